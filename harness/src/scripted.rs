//! A server that answers as a third-party engine's documented endpoints do, with figures the
//! test sets: for the gateway's handling of engines that cannot run on a test machine (vLLM and
//! SGLang need GPUs). llama.cpp's real `llama-server` is used where the check needs a real
//! engine.
//!
//! [`ScriptedEngine`] serves `GET /metrics` (the text a test sets, e.g. vLLM's gauges in its
//! documented format), `GET /v1/models` (naming an owner), a health path that answers 200, and
//! `POST /v1/chat/completions` with a whole OpenAI answer, or a status the test sets (429 with
//! `Retry-After`, 503, …). It counts the generation requests it received.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// What a [`ScriptedEngine`] answers.
#[derive(Debug)]
struct Script {
    name: String,
    owner: String,
    health_path: String,
    metrics: Mutex<String>,
    /// 200: a whole chat answer; anything else: that status with an error body.
    generation_status: AtomicU16,
    retry_after_s: Option<u64>,
    generations: AtomicUsize,
}

/// A scripted engine listening on a local port until dropped (see the module documentation).
#[derive(Debug)]
pub struct ScriptedEngine {
    /// Where it listens.
    pub addr: SocketAddr,
    script: Arc<Script>,
    server: tokio::task::JoinHandle<()>,
}

impl ScriptedEngine {
    /// Starts an engine named `name` (it signs its answers with it) whose `/v1/models` names
    /// `owner`, whose health is at `health_path`, and whose `/metrics` answers `metrics`.
    pub async fn start(name: &str, owner: &str, health_path: &str, metrics: &str) -> anyhow::Result<ScriptedEngine> {
        let script = Arc::new(Script {
            name: name.to_string(),
            owner: owner.to_string(),
            health_path: health_path.to_string(),
            metrics: Mutex::new(metrics.to_string()),
            generation_status: AtomicU16::new(200),
            retry_after_s: None,
            generations: AtomicUsize::new(0),
        });
        ScriptedEngine::serve(script).await
    }

    /// Starts an engine that answers every generation request with `status` (and
    /// `Retry-After: retry_after_s` when given), as an engine whose queue is full does.
    pub async fn refusing(name: &str, status: u16, retry_after_s: Option<u64>) -> anyhow::Result<ScriptedEngine> {
        let script = Arc::new(Script {
            name: name.to_string(),
            owner: "openai".to_string(),
            health_path: "/health".to_string(),
            metrics: Mutex::new(String::new()),
            generation_status: AtomicU16::new(status),
            retry_after_s,
            generations: AtomicUsize::new(0),
        });
        ScriptedEngine::serve(script).await
    }

    async fn serve(script: Arc<Script>) -> anyhow::Result<ScriptedEngine> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let served = script.clone();
        let server = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let script = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                        let script = script.clone();
                        async move { Ok::<_, Infallible>(answer(&script, &request)) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(ScriptedEngine { addr, script, server })
    }

    /// Replaces what `/metrics` answers.
    pub fn set_metrics(&self, metrics: &str) {
        *self.script.metrics.lock().unwrap_or_else(PoisonError::into_inner) = metrics.to_string();
    }

    /// Generation requests received so far.
    pub fn generations(&self) -> usize {
        self.script.generations.load(Ordering::Relaxed)
    }
}

impl Drop for ScriptedEngine {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn answer(script: &Script, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, content_type: &str, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
    };
    let path = request.uri().path();
    match (request.method().as_str(), path) {
        ("GET", "/metrics") => {
            let metrics = script.metrics.lock().unwrap_or_else(PoisonError::into_inner).clone();
            reply(StatusCode::OK, "text/plain; version=0.0.4", metrics)
        }
        ("GET", "/v1/models") => reply(
            StatusCode::OK,
            "application/json",
            serde_json::json!({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": script.owner}]})
                .to_string(),
        ),
        ("GET", health) if health == script.health_path => reply(StatusCode::OK, "text/plain", String::new()),
        ("POST", "/v1/chat/completions") => {
            script.generations.fetch_add(1, Ordering::Relaxed);
            let status = StatusCode::from_u16(script.generation_status.load(Ordering::Relaxed))
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            if status != StatusCode::OK {
                let mut response = reply(
                    status,
                    "application/json",
                    serde_json::json!({"error": "Model is overloaded", "error_type": "overloaded"}).to_string(),
                );
                if let Some(seconds) = script.retry_after_s
                    && let Ok(value) = http::HeaderValue::from_str(&seconds.to_string())
                {
                    response.headers_mut().insert(http::header::RETRY_AFTER, value);
                }
                return response;
            }
            reply(
                StatusCode::OK,
                "application/json",
                serde_json::json!({
                    "id": "chatcmpl-scripted",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("from {}", script.name)}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                })
                .to_string(),
            )
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", format!("no route for {path}")),
    }
}
