//! The OpenAI wire format as Switchyard speaks it, shared by the gateway and every worker.
//!
//! This module owns the request types (chat and text completions, including token-id prompts),
//! the response and streaming-chunk types, the OpenAI error object, and the strict parsing that
//! turns a request body into a typed request or a client error naming what is wrong and where.
//! It also owns the wire types of prefill/decode disaggregation between workers: vLLM's
//! [`KvTransferParams`], the KV export call ([`KV_EXPORT_PATH`]) and the decode worker's
//! [`KvTransferReport`] header.
//! It knows nothing about HTTP transport; `server` modules wrap these types in responses.

use serde::{Deserialize, Serialize};

/// The HTTP path of the chat completions endpoint.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";
/// The HTTP path of the text completions endpoint.
pub const COMPLETIONS_PATH: &str = "/v1/completions";
/// The HTTP path of the model list endpoint.
pub const MODELS_PATH: &str = "/v1/models";

/// The SSE line that ends every OpenAI stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Header on a request a gateway forwards to a Switchyard worker: the unique part of the
/// response id the worker answers with (`chatcmpl-{it}` or `cmpl-{it}`), so that ids are unique
/// per gateway across workers and their restarts.
pub const RESPONSE_ID_HEADER: &str = "x-switchyard-response-id";

/// The response-id part in a [`RESPONSE_ID_HEADER`] value, if it is one: 1 to 64 ASCII letters,
/// digits, `-` and `_`.
pub fn response_id_part(value: &[u8]) -> Option<&str> {
    let ok = !value.is_empty()
        && value.len() <= 64
        && value
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_');
    ok.then(|| std::str::from_utf8(value).ok()).flatten()
}

/// `POST /v1/chat/completions` request body (the fields Switchyard acts on; others are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model to serve the request.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Options of a streamed answer.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Upper bound on generated tokens (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Upper bound on generated tokens (current name; wins over `max_tokens`).
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// Report the token ids of the prompt and of each chunk's text (vLLM's extension): the
    /// prompt's in the first chunk (`prompt_token_ids`), each chunk's in its choice
    /// (`token_ids`). The gateway asks for them to continue a broken stream elsewhere.
    #[serde(default)]
    pub return_token_ids: Option<bool>,
    /// Prefill/decode disaggregation (vLLM's `kv_transfer_params`): asks a prefill worker to
    /// keep the prompt's KV for a decode worker, or tells a decode worker where to pull it.
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// How tokens are chosen and when generation stops.
    #[serde(flatten)]
    pub sampling: SamplingOptions,
}

/// `stream_options` of a streamed request.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct StreamOptions {
    /// End the stream with one more chunk whose `choices` is empty and whose `usage` counts
    /// the request's tokens (as OpenAI does); the finish chunk then carries no usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling fields of a generation request (OpenAI's, plus vLLM's `top_k`,
/// `stop_token_ids` and `ignore_eos`). Absent fields take the engine's defaults.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingOptions {
    /// 0 is greedy; higher is more random (OpenAI's default is 1).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens; 0 or -1 keeps all.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Seed of the request's random stream, for repeatable sampling.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Strings that end generation (the answer stops before the first one found).
    #[serde(default)]
    pub stop: Option<StopStrings>,
    /// Token ids that end generation, besides the model's end-of-sequence tokens.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past the model's end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopStrings {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopStrings {
    /// Whether it holds no non-empty string.
    pub fn is_empty(&self) -> bool {
        match self {
            StopStrings::One(one) => one.is_empty(),
            StopStrings::Many(many) => many.iter().all(String::is_empty),
        }
    }
}

/// One message of a chat conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool` or `developer`.
    pub role: String,
    /// Text, a list of content parts, or absent (assistant tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// The content of a chat message.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Typed content parts (text, images, audio, ...).
    Parts(Vec<ContentPart>),
}

/// One typed content part: `text`, or a media part (`image_url`, `input_audio`, `video_url`)
/// whose bytes the gateway inspects (headers only) and hands to an encoder.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part type: `text`, `image_url`, `input_audio` or `video_url`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
    /// The image of an `image_url` part.
    #[serde(default)]
    pub image_url: Option<MediaUrl>,
    /// The audio of an `input_audio` part.
    #[serde(default)]
    pub input_audio: Option<InputAudio>,
    /// The video of a `video_url` part.
    #[serde(default)]
    pub video_url: Option<MediaUrl>,
}

/// Where a media part's bytes are: a `data:` URL carrying them, or an `http(s)` URL.
#[derive(Debug, Clone, Deserialize)]
pub struct MediaUrl {
    /// `data:<mime>;base64,<bytes>` or `http(s)://...`.
    pub url: String,
    /// OpenAI's `detail` hint (`auto`, `low`, `high`); carried, not acted on.
    #[serde(default)]
    pub detail: Option<String>,
}

/// The audio of an `input_audio` part.
#[derive(Debug, Clone, Deserialize)]
pub struct InputAudio {
    /// The audio file, base64-encoded.
    pub data: String,
    /// Its format: `wav`, `mp3`, `flac` or `ogg`.
    pub format: String,
}

/// Which kind of content a part holds, from its `type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartKind {
    /// `text`.
    Text,
    /// `image_url`.
    Image,
    /// `input_audio`.
    Audio,
    /// `video_url`.
    Video,
}

impl ContentPart {
    /// The part's kind, or `None` for a type Switchyard does not know.
    pub fn part_kind(&self) -> Option<PartKind> {
        match self.kind.as_str() {
            "text" => Some(PartKind::Text),
            "image_url" => Some(PartKind::Image),
            "input_audio" => Some(PartKind::Audio),
            "video_url" => Some(PartKind::Video),
            _ => None,
        }
    }
}

/// Stands for one media part in a prompt rendered with [`MessageContent::text_with_media_markers`]
/// (U+FFFC OBJECT REPLACEMENT CHARACTER); the tokenizer puts the item's media tokens there.
pub const MEDIA_MARKER: char = '\u{FFFC}';

impl MessageContent {
    /// The text of this content: the string itself, or its text parts joined by newlines.
    /// Media parts are left out (a text-only prompt).
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(text) => text.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter_map(|part| part.text.as_deref())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    /// Like [`text`](Self::text), with one [`MEDIA_MARKER`] in place of each media part, in
    /// order. Markers a client wrote into its own text are removed, so the markers in the
    /// result are exactly the media parts.
    pub fn text_with_media_markers(&self) -> String {
        let clean = |text: &str| text.replace(MEDIA_MARKER, "");
        match self {
            MessageContent::Text(text) => clean(text),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter_map(|part| match part.part_kind() {
                    Some(PartKind::Text) => part.text.as_deref().map(clean),
                    Some(PartKind::Image | PartKind::Audio | PartKind::Video) => Some(MEDIA_MARKER.to_string()),
                    None => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

impl ChatCompletionRequest {
    /// Whether the answer is streamed.
    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// The requested token limit, preferring `max_completion_tokens`.
    pub fn token_limit(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// `POST /v1/completions` request body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The model to serve the request.
    pub model: String,
    /// The prompt: text or token ids.
    pub prompt: Prompt,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Options of a streamed answer.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Upper bound on generated tokens.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// Report the token ids of the prompt and of each chunk's text (vLLM's extension): the
    /// prompt's in the first chunk (`prompt_token_ids`), each chunk's in its choice
    /// (`token_ids`). The gateway asks for them to continue a broken stream elsewhere.
    #[serde(default)]
    pub return_token_ids: Option<bool>,
    /// Prefill/decode disaggregation (vLLM's `kv_transfer_params`), as on chat requests.
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// How tokens are chosen and when generation stops.
    #[serde(flatten)]
    pub sampling: SamplingOptions,
}

impl CompletionRequest {
    /// Whether the answer is streamed.
    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }
}

/// A completions prompt, in any of the shapes OpenAI accepts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several text prompts (not supported by Switchyard yet; rejected with a clear error).
    TextBatch(Vec<String>),
    /// Several token-id prompts (not supported by Switchyard yet; rejected with a clear error).
    TokenBatch(Vec<Vec<u32>>),
}

/// Either kind of generation request, parsed and validated.
#[derive(Debug, Clone)]
pub enum GenerateRequest {
    /// A chat completion.
    Chat(ChatCompletionRequest),
    /// A text completion.
    Completion(CompletionRequest),
}

impl GenerateRequest {
    /// The requested model.
    pub fn model(&self) -> &str {
        match self {
            GenerateRequest::Chat(req) => &req.model,
            GenerateRequest::Completion(req) => &req.model,
        }
    }

    /// Whether the answer is streamed.
    pub fn is_stream(&self) -> bool {
        match self {
            GenerateRequest::Chat(req) => req.is_stream(),
            GenerateRequest::Completion(req) => req.is_stream(),
        }
    }

    /// Whether a streamed answer ends with a usage-only chunk (`stream_options.include_usage`).
    pub fn include_usage(&self) -> bool {
        let options = match self {
            GenerateRequest::Chat(req) => req.stream_options,
            GenerateRequest::Completion(req) => req.stream_options,
        };
        options.and_then(|o| o.include_usage).unwrap_or(false)
    }

    /// Whether the answer reports token ids (`return_token_ids`).
    pub fn returns_token_ids(&self) -> bool {
        match self {
            GenerateRequest::Chat(req) => req.return_token_ids,
            GenerateRequest::Completion(req) => req.return_token_ids,
        }
        .unwrap_or(false)
    }

    /// The requested token limit, if any.
    pub fn token_limit(&self) -> Option<u32> {
        match self {
            GenerateRequest::Chat(req) => req.token_limit(),
            GenerateRequest::Completion(req) => req.max_tokens,
        }
    }

    /// The sampling fields.
    pub fn sampling(&self) -> &SamplingOptions {
        match self {
            GenerateRequest::Chat(req) => &req.sampling,
            GenerateRequest::Completion(req) => &req.sampling,
        }
    }

    /// The request's `kv_transfer_params`, if it has them.
    pub fn kv_transfer_params(&self) -> Option<&KvTransferParams> {
        match self {
            GenerateRequest::Chat(req) => req.kv_transfer_params.as_ref(),
            GenerateRequest::Completion(req) => req.kv_transfer_params.as_ref(),
        }
    }
}

/// Which generation endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

impl Endpoint {
    /// The endpoint for an HTTP path, if it is a generation endpoint.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            CHAT_COMPLETIONS_PATH => Some(Endpoint::Chat),
            COMPLETIONS_PATH => Some(Endpoint::Completion),
            _ => None,
        }
    }

    /// The endpoint's HTTP path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => CHAT_COMPLETIONS_PATH,
            Endpoint::Completion => COMPLETIONS_PATH,
        }
    }

    /// A short label for metrics: `chat` or `completions`.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completions",
        }
    }
}

/// Parses and validates a generation request body sent to `endpoint`.
///
/// # Errors
///
/// Returns an [`ApiError`] with status 400 when the body is not UTF-8, not JSON, has a field of
/// the wrong type, lacks a required field, or asks for something Switchyard does not support
/// (several choices or batched prompts). The message names the offending field path.
pub fn parse_generate_request(endpoint: Endpoint, body: &[u8]) -> Result<GenerateRequest, ApiError> {
    let text = std::str::from_utf8(body).map_err(|err| {
        ApiError::invalid_request(
            "invalid_utf8",
            format!(
                "request body is not valid UTF-8 (first invalid byte at offset {})",
                err.valid_up_to()
            ),
        )
    })?;
    if text.trim().is_empty() {
        return Err(ApiError::invalid_request(
            "invalid_json",
            "request body is empty; expected a JSON object",
        ));
    }
    let request = match endpoint {
        Endpoint::Chat => GenerateRequest::Chat(parse_json(text)?),
        Endpoint::Completion => GenerateRequest::Completion(parse_json(text)?),
    };
    validate(&request)?;
    Ok(request)
}

fn parse_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ApiError> {
    // Most bodies parse: the path of an error is tracked only when building its message, as
    // tracking it costs an allocation per key on every request.
    let mut deserializer = serde_json::Deserializer::from_str(text);
    if let Ok(value) = T::deserialize(&mut deserializer)
        && deserializer.end().is_ok()
    {
        return Ok(value);
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        let code = match inner.classify() {
            serde_json::error::Category::Data => "invalid_type",
            _ => "invalid_json",
        };
        let message = if code == "invalid_json" {
            format!("request body is not valid JSON: {inner}")
        } else if path == "." {
            format!("invalid request: {inner}")
        } else {
            format!("invalid value for `{path}`: {inner}")
        };
        ApiError::invalid_request(code, message).with_param((path != ".").then_some(path))
    })?;
    deserializer
        .end()
        .map_err(|err| ApiError::invalid_request("invalid_json", format!("request body is not valid JSON: {err}")))?;
    Ok(value)
}

fn validate(request: &GenerateRequest) -> Result<(), ApiError> {
    if request.model().is_empty() {
        return Err(
            ApiError::invalid_request("missing_model", "`model` must not be empty").with_param(Some("model".into()))
        );
    }
    let n = match request {
        GenerateRequest::Chat(req) => req.n,
        GenerateRequest::Completion(req) => req.n,
    };
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_request("unsupported", "only `n = 1` is supported").with_param(Some("n".into())));
    }
    let sampling = request.sampling();
    if sampling.temperature.is_some_and(|t| !t.is_finite() || t < 0.0) {
        return Err(
            ApiError::invalid_request("invalid_value", "`temperature` must be a number ≥ 0")
                .with_param(Some("temperature".into())),
        );
    }
    if sampling.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(
            ApiError::invalid_request("invalid_value", "`top_p` must be in (0, 1]").with_param(Some("top_p".into()))
        );
    }
    if sampling.top_k.is_some_and(|k| k < -1) {
        return Err(ApiError::invalid_request(
            "invalid_value",
            "`top_k` must be -1 or 0 (no limit) or a positive count",
        )
        .with_param(Some("top_k".into())));
    }
    if let GenerateRequest::Chat(req) = request {
        validate_parts(&req.messages)?;
    }
    match request {
        GenerateRequest::Chat(req) if req.messages.is_empty() => Err(ApiError::invalid_request(
            "invalid_value",
            "`messages` must hold at least one message",
        )
        .with_param(Some("messages".into()))),
        GenerateRequest::Completion(CompletionRequest {
            prompt: Prompt::TextBatch(_) | Prompt::TokenBatch(_),
            ..
        }) => Err(ApiError::invalid_request(
            "unsupported",
            "batched prompts are not supported; send one prompt per request",
        )
        .with_param(Some("prompt".into()))),
        _ => Ok(()),
    }
}

/// Every content part must be of a known type and carry the field its type names.
fn validate_parts(messages: &[ChatMessage]) -> Result<(), ApiError> {
    for (m, message) in messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &message.content else {
            continue;
        };
        for (p, part) in parts.iter().enumerate() {
            let path = format!("messages[{m}].content[{p}]");
            let present = match part.part_kind() {
                None => {
                    return Err(ApiError::invalid_request(
                        "unsupported_content_part",
                        format!(
                            "content part {p} of message {m} has type `{}`; supported types are text, image_url, input_audio and video_url",
                            part.kind
                        ),
                    )
                    .with_param(Some(format!("{path}.type"))));
                }
                Some(PartKind::Text) => part.text.is_some(),
                Some(PartKind::Image) => part.image_url.is_some(),
                Some(PartKind::Audio) => part.input_audio.is_some(),
                Some(PartKind::Video) => part.video_url.is_some(),
            };
            if !present {
                return Err(ApiError::invalid_request(
                    "invalid_value",
                    format!(
                        "content part {p} of message {m} has type `{0}` but no `{0}` field",
                        part.kind
                    ),
                )
                .with_param(Some(format!("{path}.{}", part.kind))));
            }
        }
    }
    Ok(())
}

/// The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// The error itself.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorDetail {
    /// What went wrong, for a person.
    pub message: String,
    /// The OpenAI error type, e.g. `invalid_request_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A stable machine-readable code, e.g. `model_not_found`.
    pub code: Option<String>,
}

/// An error to answer a client with: an HTTP status and an OpenAI error object.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status} {}: {}", body.error.kind, body.error.message)]
pub struct ApiError {
    /// The HTTP status to answer with.
    pub status: http::StatusCode,
    /// The error object.
    pub body: ErrorBody,
    /// Seconds the client should wait before trying again (`Retry-After`), for a 429 or 503.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// An error with the given status, OpenAI type, code and message.
    pub fn new(status: http::StatusCode, kind: &str, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: ErrorBody {
                error: ErrorDetail {
                    message: message.into(),
                    kind: kind.to_string(),
                    param: None,
                    code: Some(code.to_string()),
                },
            },
            retry_after_s: None,
        }
    }

    /// Sets `Retry-After` to `wait`, rounded up to whole seconds (at least 1).
    pub fn with_retry_after(mut self, wait: std::time::Duration) -> ApiError {
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        self.retry_after_s = Some(seconds.max(1));
        self
    }

    /// A 400 `invalid_request_error` with the given code.
    pub fn invalid_request(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(http::StatusCode::BAD_REQUEST, "invalid_request_error", code, message)
    }

    /// Sets the `param` field.
    pub fn with_param(mut self, param: Option<String>) -> ApiError {
        self.body.error.param = param;
        self
    }

    /// The `param` field: the request field the error is about, if any.
    pub fn param(&self) -> Option<&str> {
        self.body.error.param.as_deref()
    }

    /// The stable code of this error (used as a metrics label).
    pub fn code(&self) -> &str {
        self.body.error.code.as_deref().unwrap_or("unknown")
    }

    /// The error object as JSON bytes.
    pub fn to_json(&self) -> bytes::Bytes {
        // Serializing a struct of strings cannot fail.
        serde_json::to_vec(&self.body).unwrap_or_default().into()
    }

    /// The error as one SSE event, for errors that happen after a stream has started.
    pub fn to_sse_event(&self) -> bytes::Bytes {
        sse_event(&self.to_json())
    }
}

/// One SSE event whose data is `json` (serialized JSON holds no raw line break, so it is one
/// `data:` line).
pub fn sse_event(json: &[u8]) -> bytes::Bytes {
    let mut event = Vec::with_capacity(json.len() + 8);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(json);
    event.extend_from_slice(b"\n\n");
    event.into()
}

/// Worker: `POST` a [`KvExportRequest`] to a prefill worker (at the `remote_url` of its
/// [`KvTransferParams`]); it answers a [`KvExportResponse`] naming the leading blocks it still
/// holds, or, when asked for payloads and its engine has them, those blocks with their keys
/// and values ([`crate::kv_blocks`]), which a decode worker then imports.
pub const KV_EXPORT_PATH: &str = "/v1/kv/export";

/// Response header of a decode worker's answer to a request with `do_remote_prefill`: how the
/// prompt's KV got there, a [`KvTransferReport`] (`remote; blocks=N; bytes=B; ms=T` or
/// `local; reason=R`).
pub const KV_TRANSFER_HEADER: &str = "x-switchyard-kv-transfer";

/// vLLM's `kv_transfer_params` (the NixlConnector's fields, plus Switchyard's `remote_url` and
/// `remote_node`), in requests and in a prefill worker's answer. Every field is optional and
/// unknown fields are ignored, so parameters written for other connectors still parse.
///
/// The flow: the router sends a prefill worker the request with `max_tokens: 1` and
/// `{"do_remote_decode": true}`; the prefill worker answers these parameters with
/// `do_remote_prefill: true`, its address and the block hashes it holds; the router sends them
/// unchanged to a decode worker with the original request, and the decode worker pulls the
/// blocks it lacks from `remote_url` ([`KV_EXPORT_PATH`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// To a prefill worker: keep the prompt's KV for a decode worker and say where it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_decode: Option<bool>,
    /// To a decode worker: the prompt's KV is on the prefill worker named below; pull it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_prefill: Option<bool>,
    /// The prefill worker's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// The prefill worker's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// The prefill worker's port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    /// The prefill worker's base URL (`http://host:port`), where [`KV_EXPORT_PATH`] is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_url: Option<String>,
    /// The prefill worker's machine (empty when unknown): a decode worker on the same node
    /// moves blocks over the faster local link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_node: Option<String>,
    /// Sequence hashes of the prompt's full blocks the prefill worker holds, in prefix order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u64>>,
}

impl KvTransferParams {
    /// Whether a prefill worker is asked to keep the prompt's KV for a decode worker.
    pub fn wants_remote_decode(&self) -> bool {
        self.do_remote_decode.unwrap_or(false)
    }

    /// Whether a decode worker is told to pull the prompt's KV.
    pub fn wants_remote_prefill(&self) -> bool {
        self.do_remote_prefill.unwrap_or(false)
    }

    /// The prefill worker's base URL: `remote_url`, else `http://{remote_host}:{remote_port}`
    /// (as vLLM's parameters name it), without a trailing `/`.
    pub fn remote_base_url(&self) -> Option<String> {
        if let Some(url) = self.remote_url.as_deref().filter(|url| !url.is_empty()) {
            return Some(url.trim_end_matches('/').to_string());
        }
        let host = self.remote_host.as_deref().filter(|host| !host.is_empty())?;
        let port = self.remote_port?;
        if host.contains(':') && !host.starts_with('[') {
            // An IPv6 literal.
            return Some(format!("http://[{host}]:{port}"));
        }
        Some(format!("http://{host}:{port}"))
    }
}

/// The body of `POST` [`KV_EXPORT_PATH`]: the blocks a decode worker wants.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvExportRequest {
    /// Sequence hashes of the wanted blocks, in prefix order.
    pub block_hashes: Vec<u64>,
    /// Whether the asking worker needs the blocks' keys and values (its engine's blocks hold
    /// them): a worker whose engine can copy them out then answers in the binary framing of
    /// [`crate::kv_blocks`]; any other answers the names-only [`KvExportResponse`], which such a
    /// worker does not import. Absent (false) for a worker that moves blocks by name.
    #[serde(default, skip_serializing_if = "is_false")]
    pub payloads: bool,
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// The answer of [`KV_EXPORT_PATH`] without payloads: the leading run of the wanted blocks the
/// worker still holds (it may have evicted the rest), in the same order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvExportResponse {
    /// The held blocks' sequence hashes: a prefix of the request's.
    pub block_hashes: Vec<u64>,
    /// Bytes of KV cache one block takes (what moving one costs).
    pub block_bytes: u64,
}

/// Why a decode worker prefilled a prompt itself instead of pulling its KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvTransferFailure {
    /// The prefill worker could not be reached (or no address was given).
    Connect,
    /// It answered a status other than 200.
    Status,
    /// It did not answer within the decode worker's deadline.
    Timeout,
    /// Its answer did not parse, or named blocks that were not asked for.
    Answer,
    /// It no longer holds the first wanted block.
    Missing,
    /// This worker cannot take blocks in (its engine cannot import KV, its prefix cache is
    /// off, or the request carries media).
    Unsupported,
    /// The blocks came without the keys and values this worker's engine needs (the prefill
    /// worker's blocks hold none, as a simulated engine's), or with payloads it refused (another
    /// model's shape or dtype, a malformed body).
    Payload,
}

impl KvTransferFailure {
    /// Every failure, in a fixed order (for metric labels).
    pub const ALL: [KvTransferFailure; 7] = [
        KvTransferFailure::Connect,
        KvTransferFailure::Status,
        KvTransferFailure::Timeout,
        KvTransferFailure::Answer,
        KvTransferFailure::Missing,
        KvTransferFailure::Unsupported,
        KvTransferFailure::Payload,
    ];

    /// The name in [`KV_TRANSFER_HEADER`] and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            KvTransferFailure::Connect => "connect",
            KvTransferFailure::Status => "status",
            KvTransferFailure::Timeout => "timeout",
            KvTransferFailure::Answer => "answer",
            KvTransferFailure::Missing => "missing",
            KvTransferFailure::Unsupported => "unsupported",
            KvTransferFailure::Payload => "payload",
        }
    }
}

/// What a decode worker reports in [`KV_TRANSFER_HEADER`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvTransferReport {
    /// Blocks were pulled: `remote; blocks=N; bytes=B; ms=T` (N = 0 when the prompt's blocks
    /// were all cached here already; T in milliseconds the transfer took, fractional).
    Remote {
        /// Blocks moved.
        blocks: u64,
        /// Bytes moved.
        bytes: u64,
        /// Milliseconds the transfer took.
        ms: f64,
    },
    /// Nothing was pulled, the worker prefilled the prompt itself: `local; reason=R`.
    Local(KvTransferFailure),
}

impl std::fmt::Display for KvTransferReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvTransferReport::Remote { blocks, bytes, ms } => {
                // Microsecond precision, trailing zeros dropped: `ms=0`, `ms=12.5`.
                let ms = format!("{:.3}", ms.max(0.0));
                let ms = ms.trim_end_matches('0').trim_end_matches('.');
                write!(f, "remote; blocks={blocks}; bytes={bytes}; ms={ms}")
            }
            KvTransferReport::Local(reason) => write!(f, "local; reason={}", reason.as_str()),
        }
    }
}

impl std::str::FromStr for KvTransferReport {
    type Err = String;

    fn from_str(text: &str) -> Result<KvTransferReport, String> {
        let mut parts = text.split(';').map(str::trim);
        let kind = parts.next().unwrap_or_default();
        let mut fields = std::collections::HashMap::new();
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not key=value"))?;
            fields.insert(key.trim(), value.trim());
        }
        let field = |key: &str| {
            fields
                .get(key)
                .copied()
                .ok_or_else(|| format!("`{text}` lacks `{key}`"))
        };
        match kind {
            "remote" => {
                let number =
                    |key: &str| -> Result<u64, String> { field(key)?.parse().map_err(|err| format!("`{key}`: {err}")) };
                let ms: f64 = field("ms")?.parse().map_err(|err| format!("`ms`: {err}"))?;
                Ok(KvTransferReport::Remote {
                    blocks: number("blocks")?,
                    bytes: number("bytes")?,
                    ms,
                })
            }
            "local" => {
                let reason = field("reason")?;
                KvTransferFailure::ALL
                    .into_iter()
                    .find(|failure| failure.as_str() == reason)
                    .map(KvTransferReport::Local)
                    .ok_or_else(|| format!("unknown reason `{reason}`"))
            }
            other => Err(format!("`{other}` is neither `remote` nor `local`")),
        }
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Sum of the two.
    pub total_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// Breakdown of prompt tokens.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: u32,
}

/// A model entry of `GET /v1/models`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelCard {
    /// The model name clients send as `model`.
    pub id: String,
    /// Always `model`.
    pub object: String,
    /// Unix seconds; 0 when unknown.
    pub created: u64,
    /// Who serves it.
    pub owned_by: String,
}

/// The body of `GET /v1/models`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    /// The models.
    pub data: Vec<ModelCard>,
}

impl ModelList {
    /// A list of the given model names, owned by `owner`.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>, owner: &str) -> ModelList {
        ModelList {
            object: "list".into(),
            data: names
                .into_iter()
                .map(|name| ModelCard {
                    id: name.to_string(),
                    object: "model".into(),
                    created: 0,
                    owned_by: owner.to_string(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn response_id_parts_are_short_plain_tokens() {
        assert_eq!(response_id_part(b"00ab12cd-7"), Some("00ab12cd-7"));
        assert_eq!(response_id_part(b""), None);
        assert_eq!(response_id_part(b"a b"), None);
        assert_eq!(response_id_part(b"a\"b"), None);
        assert_eq!(response_id_part(&[b'a'; 65]), None);
    }

    use super::*;

    fn parse_err(endpoint: Endpoint, body: &str) -> ApiError {
        parse_generate_request(endpoint, body.as_bytes()).expect_err("must be rejected")
    }

    #[test]
    fn parses_chat_and_completion_requests() {
        let chat = parse_generate_request(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"temperature":0.2}"#,
        )
        .expect("valid chat");
        assert_eq!(chat.model(), "m");
        assert!(chat.is_stream());
        let completion = parse_generate_request(Endpoint::Completion, br#"{"model":"m","prompt":[1,2,3]}"#)
            .expect("valid completion");
        assert!(matches!(
            completion,
            GenerateRequest::Completion(CompletionRequest { prompt: Prompt::Tokens(ref ids), .. }) if ids == &[1, 2, 3]
        ));
    }

    #[test]
    fn content_parts_join_their_text() {
        let request = parse_generate_request(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]}"#,
        )
        .expect("valid");
        let GenerateRequest::Chat(chat) = request else {
            panic!("chat expected")
        };
        assert_eq!(
            chat.messages[0].content.as_ref().map(MessageContent::text).as_deref(),
            Some("a\nb")
        );
    }

    #[test]
    fn content_parts_of_unknown_or_incomplete_types_are_refused_by_index() {
        let err = parse_err(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"file","file":{}}]}]}"#,
        );
        assert_eq!(err.code(), "unsupported_content_part");
        assert_eq!(err.param(), Some("messages[1].content[1].type"));
        let err = parse_err(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","text":"x"}]}]}"#,
        );
        assert_eq!(err.param(), Some("messages[0].content[0].input_audio"));
        let ok = parse_generate_request(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"video_url","video_url":{"url":"data:video/mp4;base64,AA=="}},{"type":"text","text":"x \ufffc"}]}]}"#,
        )
        .expect("valid");
        let GenerateRequest::Chat(chat) = ok else {
            panic!("chat expected")
        };
        let content = chat.messages[0].content.as_ref().expect("content");
        assert_eq!(content.text_with_media_markers(), format!("{MEDIA_MARKER}\nx "));
    }

    #[test]
    fn kv_transfer_params_parse_with_unknown_fields_and_fall_back_to_host_and_port() {
        let request = parse_generate_request(
            Endpoint::Completion,
            br#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.2","remote_port":8100,"remote_block_ids":[1,18446744073709551615],"tp_size":1}}"#,
        )
        .expect("valid");
        let params = request.kv_transfer_params().expect("params");
        assert!(params.wants_remote_prefill() && !params.wants_remote_decode());
        assert_eq!(params.remote_block_ids.as_deref(), Some(&[1, u64::MAX][..]));
        assert_eq!(params.remote_base_url().as_deref(), Some("http://10.0.0.2:8100"));
        let with_url = KvTransferParams {
            remote_url: Some("http://a:1/".into()),
            ..params.clone()
        };
        assert_eq!(with_url.remote_base_url().as_deref(), Some("http://a:1"));
        let chat = parse_generate_request(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_decode":true}}"#,
        )
        .expect("valid");
        assert!(
            chat.kv_transfer_params()
                .is_some_and(KvTransferParams::wants_remote_decode)
        );
        assert_eq!(
            serde_json::to_string(&KvTransferParams {
                do_remote_decode: Some(true),
                ..KvTransferParams::default()
            })
            .expect("serializes"),
            r#"{"do_remote_decode":true}"#
        );
        let err = parse_err(
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"remote_port":"x"}}"#,
        );
        assert_eq!(err.param(), Some("kv_transfer_params.remote_port"));
    }

    #[test]
    fn kv_transfer_reports_round_trip_through_their_header_text() {
        let cases = [
            (
                KvTransferReport::Remote {
                    blocks: 6,
                    bytes: 12_582_912,
                    ms: 12.5,
                },
                "remote; blocks=6; bytes=12582912; ms=12.5",
            ),
            (
                KvTransferReport::Remote {
                    blocks: 0,
                    bytes: 0,
                    ms: 0.0,
                },
                "remote; blocks=0; bytes=0; ms=0",
            ),
            (
                KvTransferReport::Local(KvTransferFailure::Connect),
                "local; reason=connect",
            ),
        ];
        for (report, text) in cases {
            assert_eq!(report.to_string(), text);
            assert_eq!(text.parse::<KvTransferReport>(), Ok(report));
        }
        for failure in KvTransferFailure::ALL {
            let report = KvTransferReport::Local(failure);
            assert_eq!(report.to_string().parse::<KvTransferReport>(), Ok(report));
        }
        assert!("remote; blocks=1".parse::<KvTransferReport>().is_err());
        assert!("local; reason=bored".parse::<KvTransferReport>().is_err());
        assert!("elsewhere".parse::<KvTransferReport>().is_err());
    }

    #[test]
    fn rejects_bad_bodies_with_named_fields() {
        let err = parse_err(Endpoint::Chat, "{not json");
        assert_eq!(err.code(), "invalid_json");
        let err = parse_err(Endpoint::Chat, r#"{"messages":[]}"#);
        assert_eq!(err.code(), "invalid_type");
        assert!(err.body.error.message.contains("model"), "{err}");
        let err = parse_err(Endpoint::Chat, r#"{"model":"m","messages":[],"stream":"yes"}"#);
        assert_eq!(err.body.error.param.as_deref(), Some("stream"));
        let err = parse_err(Endpoint::Chat, r#"{"model":"m","messages":[]}"#);
        assert_eq!(err.body.error.param.as_deref(), Some("messages"));
        let err = parse_err(Endpoint::Completion, r#"{"model":"m","prompt":["a","b"]}"#);
        assert_eq!(err.code(), "unsupported");
        let err = parse_err(Endpoint::Completion, r#"{"model":"m","prompt":"a"} trailing"#);
        assert_eq!(err.code(), "invalid_json");
        let err = parse_generate_request(Endpoint::Chat, b"{\"model\":\"\xff\"}").expect_err("bad utf-8");
        assert_eq!(err.code(), "invalid_utf8");
        assert_eq!(err.status, http::StatusCode::BAD_REQUEST);
    }
}
