//! The OpenAI request parser on arbitrary bodies, then what the request path reads from an
//! accepted request: its text, token limit, sampling options, and its media (data URLs
//! decoded, images, audio and video probed) under the default `[media]` limits.
//!
//! The first byte picks the endpoint; the rest is the body. Nothing may panic, and a refusal
//! is a 400 with a message.

#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::inspect_media;
use switchyard_protocol::api::{Endpoint, GenerateRequest, parse_generate_request};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = if selector & 1 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Completion
    };
    let request = match parse_generate_request(endpoint, body) {
        Ok(request) => request,
        Err(err) => {
            assert_eq!(err.status, http::StatusCode::BAD_REQUEST, "{err}");
            assert!(!err.body.error.message.is_empty());
            return;
        }
    };
    let _ = request.model();
    let _ = request.is_stream();
    let _ = request.token_limit();
    let _ = request.sampling();
    if let GenerateRequest::Chat(chat) = &request {
        for message in &chat.messages {
            if let Some(content) = &message.content {
                let _ = content.text();
                let _ = content.text_with_media_markers();
            }
        }
    }
    if let Err(err) = inspect_media(&request) {
        assert!(err.status.is_client_error(), "media refused with {}: {err}", err.status);
    }
});
