//! Stage 2 of the request path: the prompt as the router reads it.
//!
//! A request's media parts are counted against `[media] max_items` first; then its media is
//! fetched (`[media] fetch`) and inspected from its headers alone; then
//! its prompt is rendered with the model's chat template, tokenized (each media item a span of
//! its estimated tokens) and hashed into KV blocks. A prompt over the model's limits is refused
//! here, before any worker is asked; one that is far too long is refused before it is
//! tokenized at all.

use std::ops::Range;

use http::StatusCode;
use switchyard_protocol::api::{self, ApiError};
use switchyard_tokenize::{MediaSlot, media_token};

use super::pipeline::Admitted;
use crate::kv::PromptBlocks;
use crate::media;
use crate::state::AppState;

/// Request bodies larger than this are tokenized on a blocking thread.
const TOKENIZE_INLINE_BYTES: usize = 64 << 10;

/// Text bytes per allowed prompt token past which a prompt is refused without tokenizing it
/// (real tokenizers average 3-5 bytes per token; 64 leaves room for any text).
const MAX_BYTES_PER_TOKEN: u64 = 64;

/// A request's prompt, ready to route.
pub(super) struct Prepared {
    /// The prompt, tokenized and hashed into blocks.
    pub(super) prompt: PromptBlocks,
    /// Where each media item sits in the prompt's tokens (empty without media).
    pub(super) spans: Vec<Range<u32>>,
    /// The request's media items, read and sized.
    pub(super) media_items: Vec<media::MediaItem>,
}

/// Stage 2: fetches and inspects the request's media, tokenizes and hashes its prompt, checks
/// the prompt's limits, and counts its tokens against the tenant's charge.
pub(super) async fn prepare_prompt(state: &AppState, admitted: &mut Admitted) -> Result<Prepared, ApiError> {
    let parsed = &admitted.parsed;
    let model = parsed.model();
    let limits = &admitted.limits;
    // Counted first: a request with too many parts opens no connection at all.
    media::check_item_count(parsed, &state.media.config)?;
    let mut fetched = match &state.fetcher {
        Some(fetcher) => fetcher
            .fetch_request(parsed)
            .await
            .map_err(|(message, part, why)| media::fetch_error(message, part, why))?,
        None => Default::default(),
    };
    let mut media_items = media::inspect(
        parsed,
        &state.media.config,
        &state.media.limits,
        &limits.media,
        &mut fetched,
    )?;
    let max_prompt_tokens = limits.max_prompt_tokens;
    if prompt_text_bytes(parsed) > u64::from(max_prompt_tokens) * MAX_BYTES_PER_TOKEN {
        // Refused before any tokenizing: no tokenizer packs this much text into so few tokens.
        return Err(prompt_too_long(model, None, max_prompt_tokens));
    }
    let (prompt, spans) = if media_items.is_empty() {
        (text_prompt(state, admitted).await?, Vec::new())
    } else {
        let fallback_block_size = || admitted.fallback_block_size(state);
        media_prompt(state, parsed, limits, &mut media_items, fallback_block_size)?
    };
    if prompt.tokens > max_prompt_tokens as usize {
        return Err(prompt_too_long(model, Some(prompt.tokens), max_prompt_tokens));
    }
    if let Some(charge) = &mut admitted.charge {
        charge.prompt(prompt.tokens);
    }
    Ok(Prepared {
        prompt,
        spans,
        media_items,
    })
}

/// The prompt of a request without media, tokenized and hashed; a large one on a blocking
/// thread, off the executor that serves every other connection.
async fn text_prompt(state: &AppState, admitted: &Admitted) -> Result<PromptBlocks, ApiError> {
    let kv = state.router.kv();
    let fallback_block_size = || admitted.fallback_block_size(state);
    let prompt = if admitted.body.len() > TOKENIZE_INLINE_BYTES {
        let (kv, request, block_size) = (kv.clone(), admitted.parsed.clone(), fallback_block_size());
        tokio::task::spawn_blocking(move || kv.prompt_blocks(request.model(), || block_size, &request))
            .await
            .map_err(|err| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "tokenizer_failed",
                    format!("the tokenizing thread failed: {err}"),
                )
            })?
    } else {
        kv.prompt_blocks(admitted.model(), fallback_block_size, &admitted.parsed)
    };
    prompt.map_err(tokenization_failed)
}

/// The prompt of a request with media: tokenized with a span per media item, videos sized to
/// the room the text leaves, then hashed.
fn media_prompt(
    state: &AppState,
    parsed: &api::GenerateRequest,
    limits: &media::ModelLimits,
    items: &mut [media::MediaItem],
    fallback_block_size: impl FnOnce() -> usize,
) -> Result<(PromptBlocks, Vec<Range<u32>>), ApiError> {
    let slots = |items: &[media::MediaItem]| -> Vec<MediaSlot> {
        items
            .iter()
            .map(|item| MediaSlot {
                token: media_token(item.id().0),
                tokens: item.tokens,
            })
            .collect()
    };
    let (layout, settings) = state
        .router
        .kv()
        .prompt_with_media(parsed.model(), fallback_block_size, parsed, &slots(items))
        .map_err(tokenization_failed)?;
    let sized: u32 = items.iter().map(|item| item.tokens).sum();
    let text_tokens = u32::try_from(layout.tokens.len())
        .unwrap_or(u32::MAX)
        .saturating_sub(sized);
    let max_tokens = parsed.token_limit().unwrap_or(0);
    media::size_videos(items, &limits.media, limits.max_model_len, text_tokens, max_tokens)?;
    let layout = layout.with_slots(&slots(items));
    let total = u64::from(text_tokens) + items.iter().map(|item| u64::from(item.tokens)).sum::<u64>();
    if total + u64::from(max_tokens) > u64::from(limits.max_model_len) {
        return Err(ApiError::invalid_request(
            "context_length_exceeded",
            format!(
                "the prompt needs {total} tokens ({text_tokens} text, {} media) and max_tokens {max_tokens}, more than the model's {} token context",
                total - u64::from(text_tokens),
                limits.max_model_len
            ),
        )
        .with_param(Some("messages".into())));
    }
    Ok((settings.blocks(&layout.tokens), layout.spans))
}

/// Bytes of prompt text in a request (message texts, or the completion prompt; four per id
/// of a token prompt).
fn prompt_text_bytes(request: &api::GenerateRequest) -> u64 {
    use switchyard_protocol::api::{GenerateRequest, MessageContent, Prompt};
    match request {
        GenerateRequest::Chat(chat) => chat
            .messages
            .iter()
            .map(|message| match &message.content {
                Some(MessageContent::Text(text)) => text.len() as u64,
                Some(MessageContent::Parts(parts)) => parts
                    .iter()
                    .map(|part| part.text.as_ref().map_or(0, |t| t.len() as u64))
                    .sum(),
                None => 0,
            })
            .sum(),
        GenerateRequest::Completion(completion) => match &completion.prompt {
            Prompt::Text(text) => text.len() as u64,
            Prompt::Tokens(ids) => ids.len() as u64 * 4,
            Prompt::TextBatch(texts) => texts.iter().map(|t| t.len() as u64).sum(),
            Prompt::TokenBatch(batches) => batches.iter().map(|ids| ids.len() as u64 * 4).sum(),
        },
    }
}

/// The client error for a prompt over the model's `max_prompt_tokens`.
fn prompt_too_long(model: &str, tokens: Option<usize>, max: u32) -> ApiError {
    let what = match tokens {
        Some(tokens) => format!("{tokens} tokens"),
        None => "far more text than that".to_string(),
    };
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "prompt_too_long",
        format!("the prompt is {what}; model `{model}` takes at most {max} prompt tokens"),
    )
    .with_param(Some("messages".into()))
}

/// The client error for a prompt the model's tokenizer or template cannot take.
fn tokenization_failed(err: switchyard_tokenize::TokenizeError) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "tokenization_failed",
        err.to_string(),
    )
}
