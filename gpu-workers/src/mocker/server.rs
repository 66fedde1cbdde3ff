//! The mocker's HTTP server: the OpenAI endpoints of one simulated engine.
//!
//! This module owns the worker side of the worker API: `POST /v1/chat/completions` and
//! `POST /v1/completions` (text or token-id prompts, SSE streaming or a whole answer),
//! `GET /v1/models`, `GET /healthz` and `GET /metrics` (Prometheus text). It parses requests with
//! [`crate::api`], tokenizes them with the fallback tokenizer, and turns the engine's outputs
//! into OpenAI responses chunk by chunk as the engine produces them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use hyper::body::Incoming;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::api::{self, ApiError, Endpoint, GenerateRequest, ModelList};
use crate::mocker::engine::{EngineHandle, Output, SubmitError, token_text};
use crate::respond::{self, Body};
use crate::tokenize;

/// Settings of one mocker's HTTP front.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model name the worker serves.
    pub model: String,
    /// Tokens generated when a request sets no limit.
    pub default_max_tokens: u32,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            model: "mock".into(),
            default_max_tokens: 32,
            max_body_bytes: 32 << 20,
        }
    }
}

struct State {
    config: ServerConfig,
    engine: EngineHandle,
    next_request: AtomicU64,
}

/// A mocker serving HTTP on a bound address; the server stops when this is dropped.
#[derive(Debug)]
pub struct MockerServer {
    addr: SocketAddr,
    engine: EngineHandle,
    task: JoinHandle<()>,
}

impl MockerServer {
    /// Serves `engine` on `listener` from the current tokio runtime.
    pub fn start(listener: TcpListener, engine: EngineHandle, config: ServerConfig) -> std::io::Result<MockerServer> {
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            config,
            engine: engine.clone(),
            next_request: AtomicU64::new(0),
        });
        let task = tokio::spawn(accept_loop(listener, state));
        Ok(MockerServer { addr, engine, task })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The engine behind the server.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }
}

impl Drop for MockerServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    crate::serve::serve_http(listener, "mocker", move |request| handle(state.clone(), request)).await;
}

async fn handle(state: Arc<State>, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let result = match (method.clone(), path.as_str()) {
        (Method::POST, api::CHAT_COMPLETIONS_PATH) => generate(&state, Endpoint::Chat, request).await,
        (Method::POST, api::COMPLETIONS_PATH) => generate(&state, Endpoint::Completion, request).await,
        (Method::GET, api::MODELS_PATH) => Ok(respond::json(
            StatusCode::OK,
            &ModelList::new([state.config.model.as_str()], "switchyard-mocker"),
        )),
        (Method::GET, "/healthz") => Ok(respond::text(StatusCode::OK, "text/plain", "ok\n")),
        (Method::GET, "/metrics") => Ok(metrics(&state)),
        (_, api::CHAT_COMPLETIONS_PATH | api::COMPLETIONS_PATH) => {
            Err(respond::method_not_allowed(&method, &path, "POST"))
        }
        (_, api::MODELS_PATH | "/healthz" | "/metrics") => Err(respond::method_not_allowed(&method, &path, "GET")),
        _ => Err(respond::not_found(&path)),
    };
    result.unwrap_or_else(|err| respond::error(&err))
}

async fn generate(state: &State, endpoint: Endpoint, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let (parts, body) = request.into_parts();
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
    let prompt = tokenize::prompt_tokens(&request);
    let max_tokens = request.token_limit().unwrap_or(state.config.default_max_tokens).max(1);
    let outputs = state
        .engine
        .submit(prompt, max_tokens as usize)
        .map_err(|err| match err {
            SubmitError::Stopped => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "engine_stopped",
                err.to_string(),
            ),
            _ => ApiError::invalid_request("context_length_exceeded", err.to_string()),
        })?;
    let number = state.next_request.fetch_add(1, Ordering::Relaxed);
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-mock-{number}"),
            Endpoint::Completion => format!("cmpl-mock-{number}"),
        },
        model: request.model().to_string(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        endpoint,
    };
    if request.is_stream() {
        Ok(respond::event_stream(Body::new(SseBody {
            outputs,
            meta,
            sent_role: false,
            phase: Phase::Tokens,
        })))
    } else {
        whole_answer(outputs, meta, &request).await
    }
}

struct ResponseMeta {
    id: String,
    model: String,
    created: u64,
    endpoint: Endpoint,
}

impl ResponseMeta {
    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&str>, usage: Option<serde_json::Value>) -> Bytes {
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
            "object": match self.endpoint { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completion => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        let mut event = b"data: ".to_vec();
        // Serializing a `Value` cannot fail.
        event.extend_from_slice(&serde_json::to_vec(&chunk).unwrap_or_default());
        event.extend_from_slice(b"\n\n");
        event.into()
    }
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

async fn whole_answer(
    mut outputs: mpsc::UnboundedReceiver<Output>,
    meta: ResponseMeta,
    request: &GenerateRequest,
) -> Result<Response<Body>, ApiError> {
    let mut text = String::new();
    loop {
        match outputs.recv().await {
            Some(Output::Token(token)) => text.push_str(&token_text(token)),
            Some(Output::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let usage = usage_json(prompt_tokens, completion_tokens, cached_tokens);
                let choice = match request {
                    GenerateRequest::Chat(_) => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": reason.as_str(),
                    }),
                    GenerateRequest::Completion(_) => {
                        json!({"index": 0, "text": text, "finish_reason": reason.as_str()})
                    }
                };
                let body = json!({
                    "id": meta.id,
                    "object": match meta.endpoint { Endpoint::Chat => "chat.completion", Endpoint::Completion => "text_completion" },
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": usage,
                });
                return Ok(respond::json(StatusCode::OK, &body));
            }
            None => return Err(engine_gone()),
        }
    }
}

enum Phase {
    Tokens,
    Done,
    Ended,
}

/// Streams engine outputs as OpenAI SSE chunks, one event per token as it is generated.
struct SseBody {
    outputs: mpsc::UnboundedReceiver<Output>,
    meta: ResponseMeta,
    sent_role: bool,
    phase: Phase,
}

impl http_body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let bytes = match this.phase {
            Phase::Ended => return Poll::Ready(None),
            Phase::Done => {
                this.phase = Phase::Ended;
                Bytes::from_static(api::SSE_DONE)
            }
            Phase::Tokens => match this.outputs.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Output::Token(token))) => {
                    let role = !this.sent_role;
                    this.sent_role = true;
                    this.meta.chunk(Some(&token_text(token)), role, None, None)
                }
                Poll::Ready(Some(Output::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                })) => {
                    this.phase = Phase::Done;
                    let usage = usage_json(prompt_tokens, completion_tokens, cached_tokens);
                    this.meta.chunk(None, false, Some(reason.as_str()), Some(usage))
                }
                Poll::Ready(None) => {
                    this.phase = Phase::Ended;
                    engine_gone().to_sse_event()
                }
            },
        };
        Poll::Ready(Some(Ok(Frame::data(bytes))))
    }
}

fn metrics(state: &State) -> Response<Body> {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;

    let stats = state.engine.stats();
    let mut registry = Registry::with_prefix("switchyard_mocker");
    let gauges: [(&str, &str, &AtomicU64); 4] = [
        ("waiting_requests", "Requests waiting for admission", &stats.waiting),
        ("running_requests", "Requests running", &stats.running),
        (
            "kv_active_blocks",
            "KV blocks referenced by running requests",
            &stats.active_blocks,
        ),
        ("kv_total_blocks", "KV blocks in the simulated GPU", &stats.total_blocks),
    ];
    for (name, help, value) in gauges {
        let gauge = Gauge::<i64>::default();
        gauge.set(value.load(Ordering::Relaxed) as i64);
        registry.register(name, help, gauge);
    }
    let counters: [(&str, &str, &AtomicU64); 6] = [
        ("requests", "Requests accepted", &stats.requests),
        ("prompt_tokens", "Prompt tokens admitted", &stats.prompt_tokens),
        (
            "cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            &stats.cached_prompt_tokens,
        ),
        ("generated_tokens", "Tokens generated", &stats.generated_tokens),
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
    let mut text = String::new();
    if let Err(err) = encode(&mut text, &registry) {
        return respond::error(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "metrics_failed",
            format!("could not encode metrics: {err}"),
        ));
    }
    respond::text(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", text)
}
