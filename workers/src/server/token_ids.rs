//! The token ids a worker reports beside its text when asked (`return_token_ids`, vLLM's
//! extension): the prompt's in the first chunk, each chunk's own in its choice.
//!
//! A token's id goes out with the chunk that carries the last byte of its text, never before:
//! text held back by a stop string or an unfinished character holds its ids back too. So the
//! ids a client (the gateway) has received are exactly those of the text it has received, and
//! a stream continued elsewhere from the prompt and those ids neither repeats nor skips text.

use std::collections::VecDeque;

use serde_json::{Value, json};
use switchyard_protocol::api::Endpoint;

/// One generation's token ids on their way out.
#[derive(Debug, Default)]
pub(super) struct TokenIds {
    /// The prompt's ids, until the first chunk carries them.
    prompt: Option<Vec<u32>>,
    /// Generated ids whose text the decoder has not produced yet (an unfinished character).
    undecoded: Vec<u32>,
    /// Decoded ids not sent yet, each with the end of its text (in bytes of the generation's
    /// text).
    decoded: VecDeque<(u32, usize)>,
    /// Bytes of text decoded so far.
    decoded_bytes: usize,
    /// Bytes of text released to the client so far.
    released_bytes: usize,
}

impl TokenIds {
    /// The ids of a generation whose prompt was `prompt` (`None` where the worker cannot say,
    /// as for a prompt with media).
    pub(super) fn new(prompt: Option<Vec<u32>>) -> TokenIds {
        TokenIds {
            prompt,
            ..TokenIds::default()
        }
    }

    /// `token` was generated and the decoder made `piece` of text from it (empty while a
    /// character is unfinished).
    pub(super) fn generated(&mut self, token: u32, piece: &str) {
        self.undecoded.push(token);
        self.decoded_text(piece);
    }

    /// The decoder made `piece` of text from the ids it held (at the end of the generation).
    pub(super) fn decoded_text(&mut self, piece: &str) {
        if piece.is_empty() {
            return;
        }
        self.decoded_bytes += piece.len();
        let end = self.decoded_bytes;
        self.decoded.extend(self.undecoded.drain(..).map(|token| (token, end)));
    }

    /// `text` was released to the client: the ids whose text it completes.
    pub(super) fn released(&mut self, text: &str) -> Vec<u32> {
        self.released_bytes += text.len();
        let mut ids = Vec::new();
        while let Some(&(token, end)) = self.decoded.front() {
            if end > self.released_bytes {
                break;
            }
            ids.push(token);
            self.decoded.pop_front();
        }
        ids
    }

    /// The generation ended with all of its text released: every id not sent yet.
    pub(super) fn rest(&mut self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.decoded.drain(..).map(|(token, _)| token).collect();
        ids.append(&mut self.undecoded);
        ids
    }

    /// Adds `ids` to a chunk (or a whole answer) of `endpoint`'s shape, and the prompt's ids
    /// if no chunk has carried them yet: vLLM's places, the prompt's at the top of a chat
    /// chunk and in the choice of a completion's.
    pub(super) fn attach(&mut self, chunk: &mut Value, endpoint: Endpoint, ids: Vec<u32>) {
        let prompt = self.prompt.take();
        let Some(choice) = chunk.get_mut("choices").and_then(|c| c.get_mut(0)) else {
            return;
        };
        choice["token_ids"] = json!(ids);
        if let Some(prompt) = prompt {
            match endpoint {
                Endpoint::Chat => chunk["prompt_token_ids"] = json!(prompt),
                Endpoint::Completion => choice["prompt_token_ids"] = json!(prompt),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_go_out_with_the_last_byte_of_their_text() {
        let mut ids = TokenIds::new(None);
        ids.generated(1, " a");
        // A character split over two tokens: the first makes no text yet.
        ids.generated(2, "");
        ids.generated(3, "é");
        assert_eq!(ids.released(" a"), vec![1]);
        // A stop string holds back the first byte of "é": its ids stay back with it.
        assert_eq!(ids.released(""), Vec::<u32>::new());
        assert_eq!(ids.released("é"), vec![2, 3]);
        ids.generated(4, "");
        assert_eq!(ids.rest(), vec![4]);
    }

    #[test]
    fn the_prompt_goes_with_the_first_chunk_only() {
        let mut ids = TokenIds::new(Some(vec![7, 8]));
        let mut chat = json!({"choices": [{"index": 0, "delta": {"content": "x"}}]});
        ids.attach(&mut chat, Endpoint::Chat, vec![5]);
        assert_eq!(chat["prompt_token_ids"], json!([7, 8]));
        assert_eq!(chat["choices"][0]["token_ids"], json!([5]));
        let mut next = json!({"choices": [{"index": 0, "text": "y"}]});
        ids.attach(&mut next, Endpoint::Completion, vec![6]);
        assert!(next["choices"][0].get("prompt_token_ids").is_none());
        let mut completion = json!({"choices": [{"index": 0, "text": "y"}]});
        TokenIds::new(Some(vec![1])).attach(&mut completion, Endpoint::Completion, vec![2]);
        assert_eq!(completion["choices"][0]["prompt_token_ids"], json!([1]));
    }
}
