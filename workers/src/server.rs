//! A worker's HTTP server: the OpenAI endpoints of one engine, simulated or native.
//!
//! This module owns the worker side of the worker API: `POST /v1/chat/completions` and
//! `POST /v1/completions` (text or token-id prompts, sampling fields, SSE streaming or a whole
//! answer), `GET /v1/models`, `GET /healthz` (also at `/health`), `GET /metrics` (Prometheus text),
//! `POST /kv/reset` (drop the prefix cache's unreferenced blocks, announced as KV events),
//! `POST /v1/features/...` (media features pushed by encoders, see [`media`]),
//! `POST /v1/kv/export` (the KV blocks a decode worker pulls: both sides of prefill/decode
//! disaggregation are in `kv_transfer`, set up by [`KvTransferConfig`]) and,
//! for workers linked to a gateway over HTTP, `GET /kv/dump` (the KV cache for a resync). It parses
//! requests with [`switchyard_protocol::api`], tokenizes them with the worker's [`TextCodec`] (the mocker's
//! byte-level prompts and made-up words, or a model's tokenizer), and turns the engine's
//! outputs into OpenAI responses chunk by chunk as the engine produces them (with each chunk's
//! token ids when asked, see [`token_ids`]). A server counts
//! the requests it is answering, so [`WorkerServer::shutdown`] can stop taking new connections
//! and wait for them to finish.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use hyper::body::Incoming;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

mod kv_transfer;
mod media;
mod token_ids;

pub use kv_transfer::{KvTransferConfig, LLAMA3_8B_KV_BYTES_PER_TOKEN};

use crate::engine::{EngineHandle, Output, SamplingParams, SubmitError};
use crate::features::{FeatureTracker, TrackerConfig};
use crate::mocker::engine::token_text;
use crate::stop::{MAX_STOP_BYTES, MAX_STOP_STRINGS, StopMatcher};
use media::FEATURES_PREFIX;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use switchyard_protocol::api::{self, ApiError, Endpoint, GenerateRequest, ModelList, StopStrings};
use switchyard_protocol::kv_events::EventLog;
use switchyard_protocol::paths::{HEALTH, HEALTHZ, KV_DUMP, KV_RESET, METRICS};
use switchyard_protocol::respond::{self, Body};
use switchyard_tokenize::{PromptEncoder, StreamDecoder};
use token_ids::TokenIds;

/// How a worker turns requests into token ids and generated ids into text.
#[derive(Debug, Clone, Default)]
pub enum TextCodec {
    /// The mocker's: prompts through the byte-level fallback and the default chat template,
    /// generated ids as made-up words.
    #[default]
    MockWords,
    /// A model's tokenizer and chat template, both ways.
    Model(Arc<PromptEncoder>),
}

/// Settings of one worker's HTTP front.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model name the worker serves.
    pub model: String,
    /// Tokens generated when a request sets no limit.
    pub default_max_tokens: u32,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Prompt tokenization and output detokenization.
    pub codec: TextCodec,
    /// Tokens that end every generation unless a request sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Prefix of every metric name (`switchyard_mocker`, `switchyard_worker`).
    pub metrics_prefix: String,
    /// `owned_by` in the model list, and the prefix of response ids.
    pub owner: String,
    /// The numbered KV event log a gateway resyncs from (`GET /kv/dump`), when the worker
    /// publishes its events over HTTP.
    pub kv_log: Option<Arc<Mutex<EventLog>>>,
    /// Byte budgets of the media features pushed to this worker.
    pub tracker: TrackerConfig,
    /// How long a request with media waits for its features before it is answered text-only.
    pub feature_timeout: Duration,
    /// Prefill the text before a request's first media item while it is being encoded.
    pub overlap_prefill: bool,
    /// Largest feature push accepted.
    pub max_feature_bytes: usize,
    /// Multiplies the reference encode time of items this worker encodes itself
    /// (`encoder = "local"` in the media plan).
    pub local_encode_scale: f64,
    /// Fault injection (the simulated engine's): every N-th generation request is answered
    /// 500 before any work, while `/healthz` stays 200 (a worker broken in a way its health
    /// check does not see).
    pub fail_every: Option<u64>,
    /// Prefill/decode disaggregation: who this worker is to decode workers, and how fast KV
    /// blocks move to it.
    pub kv_transfer: KvTransferConfig,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            model: "mock".into(),
            default_max_tokens: 32,
            max_body_bytes: 32 << 20,
            codec: TextCodec::MockWords,
            eos_token_ids: Vec::new(),
            metrics_prefix: "switchyard_mocker".into(),
            owner: "switchyard-mocker".into(),
            kv_log: None,
            tracker: TrackerConfig::default(),
            feature_timeout: Duration::from_secs(30),
            overlap_prefill: true,
            max_feature_bytes: 512 << 20,
            local_encode_scale: 1.0,
            fail_every: None,
            kv_transfer: KvTransferConfig::default(),
        }
    }
}

struct State {
    config: ServerConfig,
    engine: EngineHandle,
    next_request: AtomicU64,
    /// Requests being answered (until their last byte is sent or the client goes away).
    in_flight: Arc<AtomicU64>,
    draining: AtomicBool,
    /// Its reclaim notice came (spot capacity): `/healthz` answers 503 so a gateway that
    /// learns of workers only by health checks stops routing to it; requests are still served.
    preempting: AtomicBool,
    /// Generated-token count and time at the previous scrape, for the tokens/s gauge.
    last_scrape: Mutex<(Instant, u64)>,
    latency: Arc<Latency>,
    /// Media features pushed by encoders, by request.
    features: Mutex<FeatureTracker>,
    /// Requests with media answered from their text alone.
    text_only: AtomicU64,
    /// Generation requests received, for [`ServerConfig::fail_every`].
    received: AtomicU64,
    /// KV transfers to and from other workers.
    kv: kv_transfer::Transfers,
}

/// Latency histograms of the requests this server answers, in seconds.
#[derive(Debug)]
struct Latency {
    /// Arrival to the first generated token.
    time_to_first_token: Histogram,
    /// Between consecutive tokens of one request.
    inter_token: Histogram,
    /// Arrival to the last token (or to the stop string that ended it).
    request: Histogram,
}

impl Latency {
    fn new() -> Latency {
        // 1 ms to about 65 s: interactive decoding to long prompts on a busy CPU worker.
        let buckets = || Histogram::new(exponential_buckets(0.001, 2.0, 17));
        Latency {
            time_to_first_token: buckets(),
            inter_token: buckets(),
            request: buckets(),
        }
    }
}

/// A worker serving HTTP on a bound address; the server stops when this is dropped.
#[derive(Debug)]
pub struct WorkerServer {
    addr: SocketAddr,
    engine: EngineHandle,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("model", &self.config.model)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl WorkerServer {
    /// Serves `engine` on `listener` from the current tokio runtime.
    ///
    /// # Errors
    ///
    /// The I/O error if the listener's address cannot be read.
    pub fn start(listener: TcpListener, engine: EngineHandle, config: ServerConfig) -> std::io::Result<WorkerServer> {
        let addr = listener.local_addr()?;
        let generated = engine.stats().generated_tokens.load(Ordering::Relaxed);
        let config_tracker = config.tracker;
        let kv = kv_transfer::Transfers::new(&config.kv_transfer, addr);
        let state = Arc::new(State {
            config,
            engine: engine.clone(),
            next_request: AtomicU64::new(0),
            in_flight: Arc::new(AtomicU64::new(0)),
            draining: AtomicBool::new(false),
            preempting: AtomicBool::new(false),
            last_scrape: Mutex::new((Instant::now(), generated)),
            latency: Arc::new(Latency::new()),
            features: Mutex::new(FeatureTracker::new(config_tracker)),
            text_only: AtomicU64::new(0),
            received: AtomicU64::new(0),
            kv,
        });
        let task = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(WorkerServer {
            addr,
            engine,
            state,
            task,
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The engine behind the server.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    /// Requests being answered now.
    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::Relaxed)
    }

    /// Marks the worker as about to be preempted (a spot reclaim notice): `/healthz` answers
    /// 503 from now on, while requests that still arrive are served.
    pub fn mark_preempting(&self) {
        self.state.preempting.store(true, Ordering::Relaxed);
    }

    /// Stops accepting connections (requests on open connections are refused with 503) and
    /// waits until every request being answered has finished, or `timeout` has passed. Returns
    /// how many were still running then (0 when all finished).
    pub async fn shutdown(self, timeout: Duration) -> u64 {
        self.state.draining.store(true, Ordering::Relaxed);
        self.task.abort();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = self.in_flight();
            if left == 0 || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for WorkerServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Counts one request as in flight until dropped.
struct InFlight(Arc<AtomicU64>);

impl InFlight {
    fn new(counter: &Arc<AtomicU64>) -> InFlight {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    switchyard_protocol::serve::serve_http(listener, "worker", move |request| handle(state.clone(), request)).await;
}

async fn handle(state: Arc<State>, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let draining = state.draining.load(Ordering::Relaxed);
    let result = match (method.clone(), path.as_str()) {
        (Method::POST, api::CHAT_COMPLETIONS_PATH | api::COMPLETIONS_PATH) if draining => Err(shutting_down()),
        (Method::POST, api::CHAT_COMPLETIONS_PATH) => generate(&state, Endpoint::Chat, request).await,
        (Method::POST, api::COMPLETIONS_PATH) => generate(&state, Endpoint::Completion, request).await,
        (Method::POST, p) if p.starts_with(FEATURES_PREFIX) => media::features(&state, request).await,
        (Method::GET, api::MODELS_PATH) => Ok(respond::json(
            StatusCode::OK,
            &ModelList::new([state.config.model.as_str()], &state.config.owner),
        )),
        (Method::GET, HEALTHZ | HEALTH) if draining => Err(shutting_down()),
        (Method::GET, HEALTHZ | HEALTH) if state.preempting.load(Ordering::Relaxed) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "preempting",
            "this worker's capacity is being reclaimed (spot preemption); route elsewhere",
        )),
        (Method::GET, HEALTHZ | HEALTH) if !state.engine.is_running() => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine_stopped",
            "this worker's engine has stopped (its log says why); it takes no requests",
        )),
        (Method::GET, HEALTHZ | HEALTH) => Ok(respond::text(StatusCode::OK, "text/plain", "ok\n")),
        (Method::GET, METRICS) => Ok(metrics(&state)),
        (Method::GET, KV_DUMP) => dump(&state),
        (Method::POST, KV_RESET) => reset(&state).await,
        (Method::POST, api::KV_EXPORT_PATH) => kv_transfer::export(&state, request).await,
        (_, api::CHAT_COMPLETIONS_PATH | api::COMPLETIONS_PATH) => {
            Err(respond::method_not_allowed(&method, &path, "POST"))
        }
        (_, api::MODELS_PATH | HEALTHZ | HEALTH | METRICS | KV_DUMP) => {
            Err(respond::method_not_allowed(&method, &path, "GET"))
        }
        (_, KV_RESET | api::KV_EXPORT_PATH) => Err(respond::method_not_allowed(&method, &path, "POST")),
        _ => Err(respond::not_found(&path)),
    };
    result.unwrap_or_else(|err| respond::error(&err))
}

async fn reset(state: &State) -> Result<Response<Body>, ApiError> {
    let dropped = state.engine.clear_prefix_cache().await.map_err(|err| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine_stopped",
            err.to_string(),
        )
    })?;
    Ok(respond::json(StatusCode::OK, &json!({"dropped_blocks": dropped})))
}

fn dump(state: &State) -> Result<Response<Body>, ApiError> {
    let Some(log) = &state.config.kv_log else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no_kv_log",
            "this worker does not publish KV events over HTTP (it was not started with --gateway)",
        ));
    };
    let dump = log.lock().map(|log| log.dump()).map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "kv_log_poisoned",
            "the KV event log is unusable",
        )
    })?;
    Ok(respond::json(StatusCode::OK, &dump))
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "shutting_down",
        "this worker is shutting down and takes no new requests",
    )
}

async fn generate(
    state: &Arc<State>,
    endpoint: Endpoint,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let arrived = Instant::now();
    let in_flight = InFlight::new(&state.in_flight);
    let received = state.received.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(every) = state.config.fail_every
        && every > 0
        && received.is_multiple_of(every)
    {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "injected_fault",
            format!("fault injection: request {received} fails (--fail-every {every})"),
        ));
    }
    let (parts, body) = request.into_parts();
    // The gateway's id for the answer, when a gateway sent the request; else this worker's own.
    let response_id = parts
        .headers
        .get(api::RESPONSE_ID_HEADER)
        .and_then(|value| api::response_id_part(value.as_bytes()))
        .map(str::to_string);
    let body = respond::read_limited(&parts.headers, body, state.config.max_body_bytes).await?;
    let request = api::parse_generate_request(endpoint, &body)?;
    if request.model() != state.config.model {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "model `{}` is not served here; this worker serves `{}`",
                request.model(),
                state.config.model
            ),
        )
        .with_param(Some("model".into())));
    }
    let params = sampling_params(&state.config, &request)?;
    let stop_strings = stop_strings(&request)?;
    let plan = media::plan(&parts.headers)?;
    // The prompt's ids, when asked for; a prompt with media has none to report.
    let mut prompt_ids = None;
    let kv_params = request.kv_transfer_params();
    // Prefill side: the prompt's block hashes, to say which of them this worker holds once the
    // answer is ready (none named for a prompt with media).
    let mut export_hashes = None;
    // Decode side: how the prompt's KV got here.
    let mut pulled = None;
    let started = match plan {
        Some(plan) if !plan.items.is_empty() && matches!(request, GenerateRequest::Chat(_)) => {
            if kv_params.is_some_and(api::KvTransferParams::wants_remote_decode) {
                export_hashes = Some(Vec::new());
            }
            if kv_params.is_some_and(api::KvTransferParams::wants_remote_prefill) {
                // The media path builds its prompt as features arrive; it prefills itself.
                pulled = Some(kv_transfer::unsupported(state));
            }
            media::start(state, &request, plan, params).await?
        }
        _ => {
            let prompt = match &state.config.codec {
                TextCodec::MockWords => switchyard_tokenize::prompt_tokens(&request),
                TextCodec::Model(encoder) => encoder
                    .prompt_tokens(&request)
                    .map_err(|err| ApiError::invalid_request("tokenization_failed", err.to_string()))?,
            };
            if kv_params.is_some_and(api::KvTransferParams::wants_remote_decode) {
                export_hashes = Some(kv_transfer::prompt_hashes(&state.engine, &prompt));
            }
            if let Some(params) = kv_params.filter(|params| params.wants_remote_prefill()) {
                pulled = Some(kv_transfer::pull(state, params, &prompt).await);
            }
            let prompt_tokens = prompt.len() as u32;
            prompt_ids = request.returns_token_ids().then(|| prompt.clone());
            media::Started {
                outputs: state.engine.submit(prompt, params).map_err(submit_error)?,
                prompt_tokens,
                guard: None,
                header: None,
            }
        }
    };
    let media::Started {
        outputs,
        prompt_tokens,
        guard,
        header,
    } = started;
    let number = state.next_request.fetch_add(1, Ordering::Relaxed);
    let unique = response_id.unwrap_or_else(|| format!("{}-{number}", state.config.owner));
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{unique}"),
            Endpoint::Completion => format!("cmpl-{unique}"),
        },
        model: request.model().to_string(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        endpoint,
    };
    let generation = Generation {
        outputs,
        text: TextStream::new(&state.config.codec),
        stops: StopMatcher::new(stop_strings),
        prompt_tokens,
        completion_tokens: 0,
        cached_tokens: 0,
        arrived,
        last_token: None,
        latency: state.latency.clone(),
        media: guard,
        ids: request.returns_token_ids().then(|| TokenIds::new(prompt_ids)),
    };
    let mut response = if request.is_stream() {
        respond::event_stream(Body::new(SseBody {
            generation,
            meta,
            queue: VecDeque::new(),
            sent_role: false,
            include_usage: request.include_usage(),
            ended: false,
            _in_flight: in_flight,
        }))
    } else {
        let mut body = whole_answer(generation, meta, &request).await?;
        if let Some(hashes) = export_hashes {
            // After the answer: the prompt's blocks are in the prefix cache by now. (A streamed
            // answer has no place for them; routers ask prefill workers for whole answers.)
            let params = kv_transfer::answer_params(state, hashes).await;
            body["kv_transfer_params"] = serde_json::to_value(params).unwrap_or_default();
        }
        respond::json(StatusCode::OK, &body)
    };
    if let Some((name, value)) = header
        && let Ok(value) = http::HeaderValue::from_str(&value)
    {
        response.headers_mut().insert(name, value);
    }
    if let Some((name, value)) = pulled.and_then(kv_transfer::header) {
        response.headers_mut().insert(name, value);
    }
    Ok(response)
}

/// The client error (or 503) for a request the engine refused.
fn submit_error(err: SubmitError) -> ApiError {
    match err {
        SubmitError::Stopped => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine_stopped",
            err.to_string(),
        ),
        SubmitError::Sampling(_) => ApiError::invalid_request("invalid_value", err.to_string()),
        SubmitError::TokenOutOfRange { .. } | SubmitError::EmptyPrompt => {
            ApiError::invalid_request("invalid_value", err.to_string()).with_param(Some("prompt".into()))
        }
        SubmitError::TooLong { .. } | SubmitError::ContextLength { .. } | SubmitError::OverBudget { .. } => {
            ApiError::invalid_request("context_length_exceeded", err.to_string())
        }
        SubmitError::MediaUnsupported { .. } => {
            ApiError::invalid_request("media_unsupported", err.to_string()).with_param(Some("messages".into()))
        }
    }
}

/// The engine's sampling parameters for a request, with the worker's defaults and stop tokens.
fn sampling_params(config: &ServerConfig, request: &GenerateRequest) -> Result<SamplingParams, ApiError> {
    let options = request.sampling();
    let mut stop_token_ids = options.stop_token_ids.clone().unwrap_or_default();
    if !options.ignore_eos.unwrap_or(false) {
        stop_token_ids.extend_from_slice(&config.eos_token_ids);
    }
    Ok(SamplingParams {
        temperature: options.temperature.unwrap_or(1.0),
        top_k: options.top_k.map_or(0, |k| usize::try_from(k).unwrap_or(0)),
        top_p: options.top_p.unwrap_or(1.0),
        seed: options.seed,
        max_tokens: request.token_limit().unwrap_or(config.default_max_tokens).max(1) as usize,
        stop_token_ids,
    })
}

/// The request's stop strings, checked against the limits.
fn stop_strings(request: &GenerateRequest) -> Result<Vec<String>, ApiError> {
    let stops = match &request.sampling().stop {
        None => Vec::new(),
        Some(StopStrings::One(one)) => vec![one.clone()],
        Some(StopStrings::Many(many)) => many.clone(),
    };
    if stops.len() > MAX_STOP_STRINGS || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid_request(
            "invalid_value",
            format!("`stop` takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_BYTES} bytes"),
        )
        .with_param(Some("stop".into())));
    }
    Ok(stops)
}

/// Turns one request's generated ids into text pieces.
enum TextStream {
    MockWords,
    Model {
        encoder: Arc<PromptEncoder>,
        decoder: StreamDecoder,
    },
}

impl TextStream {
    fn new(codec: &TextCodec) -> TextStream {
        match codec {
            TextCodec::MockWords => TextStream::MockWords,
            TextCodec::Model(encoder) => TextStream::Model {
                encoder: encoder.clone(),
                decoder: StreamDecoder::new(),
            },
        }
    }

    /// The text `token` completes; a token the tokenizer cannot decode is logged and skipped.
    fn push(&mut self, token: u32) -> String {
        match self {
            TextStream::MockWords => token_text(token),
            TextStream::Model { encoder, decoder } => decoder.push(&encoder.tokenizer, token).unwrap_or_else(|err| {
                tracing::warn!(token, error = %err, "cannot decode a generated token");
                String::new()
            }),
        }
    }

    /// Text held back at the end of the generation.
    fn flush(&mut self) -> String {
        match self {
            TextStream::MockWords => String::new(),
            TextStream::Model { encoder, decoder } => decoder.flush(&encoder.tokenizer).unwrap_or_default(),
        }
    }
}

/// What the client sees next.
enum Event {
    /// More text, and the ids of the tokens it completes (when asked for).
    Text(String, Vec<u32>),
    /// The end: finish reason, usage, and the ids not sent with text yet.
    Finished(&'static str, serde_json::Value, Vec<u32>),
    /// The generation failed.
    Failed(ApiError),
}

/// One request's answer as it is produced: tokens to text, stop strings, usage.
struct Generation {
    outputs: mpsc::UnboundedReceiver<Output>,
    text: TextStream,
    stops: StopMatcher,
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
    arrived: Instant,
    last_token: Option<Instant>,
    latency: Arc<Latency>,
    /// The request's media features, released when the generation ends.
    media: Option<media::FeatureGuard>,
    /// The token ids reported beside the text, when the request asked for them.
    ids: Option<TokenIds>,
}

impl Generation {
    /// Waits for the engine's next output and turns it into events (none for bookkeeping
    /// outputs and for tokens that complete no character yet).
    async fn next(&mut self) -> Vec<Event> {
        let output = self.outputs.recv().await;
        self.on_output(output)
    }

    fn on_output(&mut self, output: Option<Output>) -> Vec<Event> {
        match output {
            Some(Output::Started { cached_tokens }) => {
                self.cached_tokens = cached_tokens;
                Vec::new()
            }
            Some(Output::Token(token)) => {
                let now = Instant::now();
                match self.last_token {
                    None => self
                        .latency
                        .time_to_first_token
                        .observe(now.duration_since(self.arrived).as_secs_f64()),
                    Some(last) => self.latency.inter_token.observe(now.duration_since(last).as_secs_f64()),
                }
                self.last_token = Some(now);
                if let Some(media) = &mut self.media {
                    media.prefilled();
                }
                self.completion_tokens += 1;
                let piece = self.text.push(token);
                if let Some(ids) = &mut self.ids {
                    ids.generated(token, &piece);
                }
                self.release(&piece, None)
            }
            Some(Output::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                self.prompt_tokens = prompt_tokens;
                self.completion_tokens = completion_tokens;
                self.cached_tokens = cached_tokens;
                let rest = self.text.flush();
                if let Some(ids) = &mut self.ids {
                    ids.decoded_text(&rest);
                }
                self.release(&rest, Some(reason.as_str()))
            }
            Some(Output::Failed(reason)) => vec![Event::Failed(engine_failed(reason))],
            None => vec![Event::Failed(engine_gone())],
        }
    }

    /// Passes `piece` through the stop strings; `end` is the engine's finish reason when the
    /// generation ended on its own.
    fn release(&mut self, piece: &str, end: Option<&'static str>) -> Vec<Event> {
        let released = self.stops.push(piece);
        let mut events = Vec::new();
        let mut text = released.text;
        let reason = if released.stopped {
            // Nothing more is wanted: closing the stream cancels the request in the engine.
            self.outputs.close();
            Some("stop")
        } else {
            if end.is_some() {
                text.push_str(&self.stops.finish());
            }
            end
        };
        let ids = self.ids.as_mut().map(|ids| ids.released(&text)).unwrap_or_default();
        if !text.is_empty() {
            events.push(Event::Text(text, ids));
        }
        if let Some(reason) = reason {
            self.latency.request.observe(self.arrived.elapsed().as_secs_f64());
            // Ended on its own, all its text is out: so are the ids left (after a stop string
            // they are the stop's own, which the text leaves out too).
            let rest = match (&mut self.ids, released.stopped) {
                (Some(ids), false) => ids.rest(),
                _ => Vec::new(),
            };
            events.push(Event::Finished(
                reason,
                usage_json(self.prompt_tokens, self.completion_tokens, self.cached_tokens),
                rest,
            ));
        }
        events
    }
}

struct ResponseMeta {
    id: String,
    model: String,
    created: u64,
    endpoint: Endpoint,
}

impl ResponseMeta {
    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        finish: Option<&str>,
        usage: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(text) = text {
                    delta.insert("content".into(), json!(text));
                }
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": finish})
            }
        };
        let mut chunk = json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        chunk
    }

    /// The last chunk of a stream that asked for `include_usage`: no choices, the usage.
    fn usage_chunk(&self, usage: serde_json::Value) -> Bytes {
        sse_event(&json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }))
    }

    /// The `object` of this answer's stream chunks.
    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }
}

fn sse_event(chunk: &serde_json::Value) -> Bytes {
    // Serializing a `Value` cannot fail.
    api::sse_event(&serde_json::to_vec(chunk).unwrap_or_default())
}

fn usage_json(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> serde_json::Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

fn engine_gone() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "engine_stopped",
        "the engine stopped mid-generation",
    )
}

fn engine_failed(reason: String) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "engine_failed",
        reason,
    )
}

/// Waits for the whole generation and returns the answer's JSON body.
async fn whole_answer(
    mut generation: Generation,
    meta: ResponseMeta,
    request: &GenerateRequest,
) -> Result<serde_json::Value, ApiError> {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    loop {
        for event in generation.next().await {
            match event {
                Event::Text(piece, ids) => {
                    text.push_str(&piece);
                    token_ids.extend(ids);
                }
                Event::Failed(err) => return Err(err),
                Event::Finished(reason, usage, ids) => {
                    let choice = match request {
                        GenerateRequest::Chat(_) => json!({
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": reason,
                        }),
                        GenerateRequest::Completion(_) => {
                            json!({"index": 0, "text": text, "finish_reason": reason})
                        }
                    };
                    let mut body = json!({
                        "id": meta.id,
                        "object": match meta.endpoint { Endpoint::Chat => "chat.completion", Endpoint::Completion => "text_completion" },
                        "created": meta.created,
                        "model": meta.model,
                        "choices": [choice],
                        "usage": usage,
                    });
                    if let Some(reported) = &mut generation.ids {
                        token_ids.extend(ids);
                        reported.attach(&mut body, meta.endpoint, std::mem::take(&mut token_ids));
                    }
                    return Ok(body);
                }
            }
        }
    }
}

/// Streams a generation as OpenAI SSE chunks, one event per piece of text as it is decoded.
struct SseBody {
    generation: Generation,
    meta: ResponseMeta,
    /// Frames ready to send.
    queue: VecDeque<Bytes>,
    sent_role: bool,
    /// `stream_options.include_usage`: the usage goes in a chunk of its own, after the finish
    /// chunk, with empty `choices` (as OpenAI answers); otherwise in the finish chunk.
    include_usage: bool,
    /// The finish chunk (or an error) is queued: nothing more comes from the engine.
    ended: bool,
    _in_flight: InFlight,
}

impl SseBody {
    /// Queues `chunk`, with `ids` in it when the request asked for token ids.
    fn send(&mut self, mut chunk: serde_json::Value, ids: Vec<u32>) {
        if let Some(reported) = &mut self.generation.ids {
            reported.attach(&mut chunk, self.meta.endpoint, ids);
        }
        self.queue.push_back(sse_event(&chunk));
    }

    fn enqueue(&mut self, events: Vec<Event>) {
        for event in events {
            match event {
                Event::Text(piece, ids) => {
                    let role = !self.sent_role;
                    self.sent_role = true;
                    let chunk = self.meta.chunk(Some(&piece), role, None, None);
                    self.send(chunk, ids);
                }
                Event::Finished(reason, usage, ids) => {
                    if self.include_usage {
                        self.send(self.meta.chunk(None, false, Some(reason), None), ids);
                        self.queue.push_back(self.meta.usage_chunk(usage));
                    } else {
                        self.send(self.meta.chunk(None, false, Some(reason), Some(usage)), ids);
                    }
                    self.queue.push_back(Bytes::from_static(api::SSE_DONE));
                    self.ended = true;
                }
                Event::Failed(err) => {
                    self.queue.push_back(err.to_sse_event());
                    self.ended = true;
                }
            }
            if self.ended {
                return;
            }
        }
    }
}

impl http_body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match this.generation.outputs.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(output) => {
                    let events = this.generation.on_output(output);
                    this.enqueue(events);
                }
            }
        }
    }
}

fn metrics(state: &State) -> Response<Body> {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;

    let stats = state.engine.stats();
    let mut registry = Registry::with_prefix(state.config.metrics_prefix.as_str());
    let gauges: [(&str, &str, &AtomicU64); 7] = [
        ("waiting_requests", "Requests waiting for admission", &stats.waiting),
        ("running_requests", "Requests running", &stats.running),
        (
            "kv_active_blocks",
            "KV blocks referenced by running requests",
            &stats.active_blocks,
        ),
        ("kv_total_blocks", "KV blocks in the cache", &stats.total_blocks),
        (
            "batch_sequences",
            "Sequences in the last engine step",
            &stats.last_batch_sequences,
        ),
        (
            "batch_tokens",
            "Tokens computed in the last engine step",
            &stats.last_batch_tokens,
        ),
        ("http_in_flight_requests", "Requests being answered", &state.in_flight),
    ];
    for (name, help, value) in gauges {
        let gauge = Gauge::<i64>::default();
        gauge.set(value.load(Ordering::Relaxed) as i64);
        registry.register(name, help, gauge);
    }
    let generated = stats.generated_tokens.load(Ordering::Relaxed);
    let tokens_per_second = match state.last_scrape.lock() {
        Ok(mut last) => {
            let now = Instant::now();
            let seconds = now.duration_since(last.0).as_secs_f64();
            let rate = if seconds > 0.0 {
                generated.saturating_sub(last.1) as f64 / seconds
            } else {
                0.0
            };
            *last = (now, generated);
            rate
        }
        Err(_) => 0.0,
    };
    let steps = stats.steps.load(Ordering::Relaxed);
    let mean_batch = if steps == 0 {
        0.0
    } else {
        stats.batched_sequences.load(Ordering::Relaxed) as f64 / steps as f64
    };
    let ratios: [(&str, &str, f64); 4] = [
        (
            "kv_usage_ratio",
            "Fraction of the KV cache referenced by running requests",
            stats.kv_usage(),
        ),
        (
            "prefix_cache_hit_ratio",
            "Fraction of admitted prompt tokens served from the prefix cache",
            stats.prefix_hit_rate(),
        ),
        (
            "generated_tokens_per_second",
            "Tokens generated per second since the previous scrape",
            tokens_per_second,
        ),
        (
            "mean_batch_sequences",
            "Mean sequences per engine step since start",
            mean_batch,
        ),
    ];
    for (name, help, value) in ratios {
        let gauge = Gauge::<f64, AtomicU64>::default();
        gauge.set(value);
        registry.register(name, help, gauge);
    }
    let counters: [(&str, &str, &AtomicU64); 7] = [
        ("requests", "Requests accepted", &stats.requests),
        ("prompt_tokens", "Prompt tokens admitted", &stats.prompt_tokens),
        (
            "cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            &stats.cached_prompt_tokens,
        ),
        ("generated_tokens", "Tokens generated", &stats.generated_tokens),
        (
            "computed_tokens",
            "Tokens computed, prefill and decode",
            &stats.computed_tokens,
        ),
        (
            "preemptions",
            "Sequences preempted for lack of KV blocks",
            &stats.preemptions,
        ),
        ("steps", "Engine steps run", &stats.steps),
    ];
    for (name, help, value) in counters {
        let counter = Counter::<u64>::default();
        counter.inc_by(value.load(Ordering::Relaxed));
        registry.register(name, help, counter);
    }
    let latency: [(&str, &str, &Histogram); 3] = [
        (
            "time_to_first_token_seconds",
            "Request arrival to its first generated token",
            &state.latency.time_to_first_token,
        ),
        (
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            &state.latency.inter_token,
        ),
        (
            "request_duration_seconds",
            "Request arrival to its last token",
            &state.latency.request,
        ),
    ];
    for (name, help, histogram) in latency {
        registry.register(name, help, histogram.clone());
    }
    let busy = Counter::<f64, AtomicU64>::default();
    busy.inc_by(stats.busy_nanos.load(Ordering::Relaxed) as f64 / 1e9);
    registry.register("busy_seconds", "Seconds spent computing engine steps", busy);
    let features = state.features.lock().map(|t| t.stats()).unwrap_or_default();
    let feature_gauges: [(&str, &str, u64); 4] = [
        (
            "feature_cpu_bytes",
            "Bytes of media features in host memory",
            features.cpu_used,
        ),
        (
            "feature_gpu_bytes",
            "Bytes of media features in device staging",
            features.gpu_used,
        ),
        (
            "feature_requests",
            "Requests with media features tracked",
            features.requests as u64,
        ),
        (
            "feature_orphans",
            "Features held for requests not seen yet",
            features.orphans as u64,
        ),
    ];
    for (name, help, value) in feature_gauges {
        let gauge = Gauge::<i64>::default();
        gauge.set(value as i64);
        registry.register(name, help, gauge);
    }
    let feature_counters: [(&str, &str, u64); 2] = [
        (
            "feature_evictions",
            "Features evicted for host memory",
            features.evictions,
        ),
        (
            "media_text_only",
            "Requests with media answered from their text alone",
            state.text_only.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, value) in feature_counters {
        let counter = Counter::<u64>::default();
        counter.inc_by(value);
        registry.register(name, help, counter);
    }
    state.kv.register_metrics(&mut registry, &state.engine);
    metrics_response(&registry)
}

/// The Prometheus text of `registry` as a response (a 500 if it cannot be encoded).
pub(crate) fn metrics_response(registry: &prometheus_client::registry::Registry) -> Response<Body> {
    let mut text = String::new();
    if let Err(err) = prometheus_client::encoding::text::encode(&mut text, registry) {
        return respond::error(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "metrics_failed",
            format!("could not encode metrics: {err}"),
        ));
    }
    respond::text(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", text)
}
