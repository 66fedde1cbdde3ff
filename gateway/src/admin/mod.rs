//! The admin API: managing router policies and inspecting KV routing, on a listener of its own
//! (plain HTTP, or TLS with `[admin.tls]`, then optionally requiring client certificates).
//!
//! Every request needs `authorization: Bearer TOKEN` with the configured token (401 otherwise).
//! The worker token (`admin.worker_token`), the credential of workers that register over HTTP,
//! opens the worker routes (`/admin/workers*`) and nothing else (401 elsewhere).
//! `GET /metrics` serves the gateway's metrics here too (the only place, with `server.metrics =
//! false`).
//! `GET /admin/policies` lists the active version, the kept versions and uploaded candidates;
//! `PUT /admin/policies/{name}/config` sets the TOML table later uploads of `name` are loaded
//! with (otherwise they get the gateway's `[policy.config]`);
//! `PUT /admin/policies/{name}` uploads a `.wasm` (validated: imports, `init`, a self-test call;
//! a policy that fails is refused with the reason and the active one stays), optionally with
//! `?activate=true`; `POST /admin/policies/{name}/activate` publishes an uploaded candidate;
//! `POST /admin/policies/{name}/rollback` restores the previous version;
//! `POST /admin/policies/{name}/shadow` runs an uploaded candidate beside the active version
//! (answers compared and counted, not used); `POST /admin/policies/{name}/split?percent=P&key=H`
//! lets the candidate decide P % of requests, sticky by the hash of header H;
//! `DELETE /admin/rollout` ends a rollout. Activating or rolling back also ends it.
//! The encoder queues' batching policy has the same life under `/admin/batchers`: `GET` lists
//! it, `PUT /admin/batchers/{name}/config` sets the settings uploads of `name` get (otherwise
//! `[encoders.batcher_config]`), `PUT /admin/batchers/{name}` uploads and validates one
//! (`?activate=true` publishes it), `POST .../activate` and `POST .../rollback` as for routers;
//! the admission queue's batcher the same under `/admin/admission` (settings default to
//! `[admission.batcher_config]`).
//! `GET /dashboard` (and `/`) serves the dashboard page, the one path that needs no token (the
//! page asks for it); `GET /admin/stats` gives the page its live figures.
//! With `[fleet]`, activating, rolling back and rollouts of routers are the fleet's (written to
//! NATS JetStream and run by every replica; `?fleet=true` insists on it and is refused by a
//! gateway in no fleet), and `GET /admin/fleet` shows the fleet's policy and each replica's
//! report (see [`crate::fleet`]).
//! `GET /admin/kv` summarises the KV index (nodes, holdings, estimated heap) and, per worker,
//! its cached blocks, block-size agreement and live load. Workers without NATS register and
//! heartbeat with `POST /admin/workers`, post their KV events to
//! `POST /admin/workers/{name}/events` and leave with `DELETE /admin/workers/{name}` (see
//! [`crate::events::http`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use switchyard_protocol::api::ApiError;
use switchyard_protocol::respond::{self, Body};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

mod batchers;
mod dashboard;
mod fleet;
mod planner;
mod routers;
mod workers;

use crate::policy::batching::BatcherPolicy;
use crate::policy::runtime::RouterPolicy;
use crate::policy::versions::{Named, Version};
use crate::state::AdminState;

/// Largest policy upload accepted.
const MAX_POLICY_BYTES: usize = 16 << 20;

/// Uploaded, validated policies not yet active, by name.
#[derive(Debug, Default)]
pub struct Candidates {
    by_name: Mutex<HashMap<String, Arc<RouterPolicy>>>,
    configs: Mutex<HashMap<String, toml::Table>>,
    /// The components and settings of uploaded routers, for pushing them to a fleet later.
    sources: Mutex<HashMap<String, (bytes::Bytes, toml::Table)>>,
    /// Uploaded batchers, by [`batchers::BatcherQueue::key`].
    batchers: Mutex<HashMap<String, Arc<BatcherPolicy>>>,
    batcher_configs: Mutex<HashMap<String, toml::Table>>,
    admission_configs: Mutex<HashMap<String, toml::Table>>,
}

/// A fresh admin token: 128 random bits from the TLS stack's secure random source, as 32 hex
/// digits (what `[admin]` without a `token` gets in dev mode); `None` without OS randomness.
pub fn generate_token() -> Option<String> {
    let mut bytes = [0u8; 16];
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .ok()?;
    Some(bytes.iter().map(|byte| format!("{byte:02x}")).collect())
}

/// The bearer tokens the admin API accepts.
#[derive(Clone)]
pub struct Credentials {
    /// Opens every route.
    pub admin: String,
    /// Opens only the worker routes (`/admin/workers*`), when configured.
    pub worker: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Tokens are secrets: a debug print must not show them.
        f.debug_struct("Credentials")
            .field("worker", &self.worker.is_some())
            .finish_non_exhaustive()
    }
}

/// Serves the admin API on `listener` until the task is aborted, under `limits` (the admin
/// listener's own header read timeout and connection cap).
pub async fn serve(
    listener: TcpListener,
    credentials: Credentials,
    limits: switchyard_protocol::serve::Limits,
    state: Arc<AdminState>,
    tls: Option<TlsAcceptor>,
) {
    let candidates = Arc::new(Candidates::default());
    let credentials = Arc::new(credentials);
    let handler = move |request: Request<Incoming>| {
        let (state, credentials, candidates) = (state.clone(), credentials.clone(), candidates.clone());
        async move {
            // The page holds no data: it asks for the token and sends it with each call.
            if request.method() == Method::GET && matches!(request.uri().path(), "/" | "/dashboard") {
                return dashboard::page();
            }
            match authorize(&request, &credentials) {
                Ok(()) => handle(&state, &candidates, request)
                    .await
                    .unwrap_or_else(|err| respond::error(&err)),
                Err(err) => respond::error(&err),
            }
        }
    };
    match tls {
        None => {
            switchyard_protocol::serve::serve_http_over(
                listener,
                "admin",
                limits,
                |stream| std::future::ready(Some(stream)),
                handler,
            )
            .await;
        }
        // A handshake that fails (no or a wrong client certificate when one is required) or
        // takes over 10 s ends that connection only.
        Some(acceptor) => {
            let handshake = move |stream: tokio::net::TcpStream| {
                let acceptor = acceptor.clone();
                async move {
                    let peer = stream.peer_addr().ok();
                    match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => Some(stream),
                        Ok(Err(err)) => {
                            tracing::info!(server = "admin", ?peer, error = %err, "admin TLS handshake refused");
                            None
                        }
                        Err(_) => None,
                    }
                }
            };
            switchyard_protocol::serve::serve_http_over(listener, "admin", limits, handshake, handler).await;
        }
    }
}

/// Whether `path` is one of the worker routes, the only ones the worker token opens: split as
/// [`handle`] splits it, so what this lets through is what `handle` sends to `workers`.
fn is_worker_route(path: &str) -> bool {
    let mut segments = path.trim_matches('/').split('/');
    segments.next() == Some("admin") && segments.next() == Some("workers")
}

/// Compares in constant time, so a token cannot be guessed byte by byte.
fn same_token(presented: &str, token: &str) -> bool {
    presented.len() == token.len()
        && presented
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn authorize(request: &Request<Incoming>, credentials: &Credentials) -> Result<(), ApiError> {
    let presented = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .unwrap_or("");
    let admin = same_token(presented, &credentials.admin);
    let worker = credentials
        .worker
        .as_deref()
        .is_some_and(|token| same_token(presented, token));
    if admin || (worker && is_worker_route(request.uri().path())) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "unauthorized",
            "the admin API needs `authorization: Bearer TOKEN` with the configured token",
        ))
    }
}

/// Answers one authorized request: a few read-only routes here, the rest by route family.
async fn handle(
    state: &AdminState,
    candidates: &Candidates,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let method = request.method().clone();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let route = Route {
        method: &method,
        query: &query,
        path: &path,
    };
    match (&method, segments.as_slice()) {
        (&Method::GET, ["metrics"]) => Ok(respond::text(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            state.metrics.encode_with_tenants(),
        )),
        (&Method::GET, ["admin", "stats"]) => Ok(respond::json(StatusCode::OK, &dashboard::stats(state))),
        (&Method::GET, ["admin", "kv"]) => Ok(respond::json(StatusCode::OK, &state.router.kv_summary())),
        (&Method::GET, ["admin", "fleet"]) => {
            let fleet = state.fleet.as_ref().ok_or_else(not_in_a_fleet)?;
            Ok(respond::json(StatusCode::OK, &fleet::list(fleet).await?))
        }
        (&Method::PUT, ["admin", kind @ ("policies" | "batchers" | "admission"), name, "config"]) => {
            put_settings(candidates, kind, name, request).await
        }
        (_, ["admin", "policies", rest @ ..]) => routers::handle(state, candidates, route, rest, request).await,
        (&Method::DELETE, ["admin", "rollout"]) => routers::stop_rollout(state, &query).await,
        (_, ["admin", queue @ ("batchers" | "admission"), rest @ ..]) => {
            let queue = batchers::BatcherQueue::from_segment(queue);
            batchers::handle(state, candidates, queue, route, rest, request).await
        }
        (_, ["admin", "planner", rest @ ..]) => planner::handle(state, route, rest, request).await,
        (_, ["admin", "workers", rest @ ..]) => workers::handle(state, route, rest, request).await,
        _ => Err(respond::not_found(&path)),
    }
}

/// What a route family needs of the request besides its body: the method, the query, and the
/// path (for the 404 of a path it does not serve).
#[derive(Debug, Clone, Copy)]
struct Route<'a> {
    method: &'a Method,
    query: &'a str,
    path: &'a str,
}

impl Route<'_> {
    /// The 404 for a path no route of the family serves (with this method).
    fn not_found(&self) -> ApiError {
        respond::not_found(self.path)
    }

    /// Whether the query asks to activate an upload at once (`activate=true`).
    fn activate_requested(&self) -> bool {
        self.query
            .split('&')
            .any(|pair| pair == "activate=true" || pair == "activate=1")
    }
}

/// `PUT /admin/{policies,batchers,admission}/{name}/config`: the TOML table later uploads of
/// `name` are loaded with.
async fn put_settings(
    candidates: &Candidates,
    kind: &str,
    name: &str,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let name = valid_name(name)?;
    let (parts, body) = request.into_parts();
    let text = respond::read_limited(&parts.headers, body, 1 << 20).await?;
    let text = std::str::from_utf8(&text)
        .map_err(|_| ApiError::invalid_request("invalid_utf8", "the policy config must be UTF-8 TOML"))?;
    let table: toml::Table = toml::from_str(text).map_err(|err| {
        ApiError::invalid_request("invalid_config", format!("policy config is not valid TOML: {err}"))
    })?;
    let keys: Vec<String> = table.keys().cloned().collect();
    let store = match kind {
        "policies" => &candidates.configs,
        queue => batchers::BatcherQueue::from_segment(queue).configs(candidates),
    };
    store
        .lock()
        .map_err(|_| internal("config store poisoned".into()))?
        .insert(name.clone(), table);
    Ok(respond::json(
        StatusCode::OK,
        &json!({"name": name, "config_keys": keys}),
    ))
}

/// The answer to activating or rolling back to `version`.
fn version_json<P: Named>(version: &Version<P>) -> serde_json::Value {
    json!({"name": version.policy.name(), "sha256": version.policy.sha256(), "generation": version.generation})
}

/// A validated upload: the policy, its component and the settings it was loaded with.
struct Uploaded<P> {
    policy: Arc<P>,
    wasm: bytes::Bytes,
    config: toml::Table,
}

/// Reads an uploaded `.wasm` named `name` and validates it with `load` on a blocking thread,
/// with the settings stored for `name` (or the configured ones): `configs` is that store and
/// the configured default.
async fn upload<P: Send + 'static>(
    state: &AdminState,
    request: Request<Incoming>,
    name: &str,
    configs: (&Mutex<HashMap<String, toml::Table>>, &toml::Table),
    load: impl FnOnce(
        Arc<crate::policy::runtime::PolicyRuntime>,
        String,
        Vec<u8>,
        toml::Table,
    ) -> Result<P, crate::policy::PolicyError>
    + Send
    + 'static,
) -> Result<Uploaded<P>, ApiError> {
    let name = valid_name(name)?;
    let (parts, body) = request.into_parts();
    let wasm = respond::read_limited(&parts.headers, body, MAX_POLICY_BYTES).await?;
    let config = configs
        .0
        .lock()
        .ok()
        .and_then(|stored| stored.get(&name).cloned())
        .unwrap_or_else(|| configs.1.clone());
    let runtime = state.runtime.clone();
    let (bytes, settings) = (wasm.clone(), config.clone());
    let loaded = tokio::task::spawn_blocking(move || load(runtime, name, wasm.to_vec(), config))
        .await
        .map_err(|err| internal(format!("validation task failed: {err}")))?
        .map_err(rejected)?;
    Ok(Uploaded {
        policy: Arc::new(loaded),
        wasm: bytes,
        config: settings,
    })
}

fn rejected(err: crate::policy::PolicyError) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "policy_rejected",
        err.to_string(),
    )
}

fn no_previous_version() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        "no_previous_version",
        "there is no previous policy version to roll back to",
    )
}

fn no_planner() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        "no_planner",
        "this gateway has no planner (no `[planner]` in its config)",
    )
}

fn not_in_a_fleet() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        "not_in_a_fleet",
        "this gateway is in no fleet (no `[fleet]` in its config)",
    )
}

fn not_uploaded(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "policy_not_found",
        format!("no uploaded policy named `{name}`; PUT it first"),
    )
}

fn valid_name(name: &str) -> Result<String, ApiError> {
    if !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        Ok(name.to_string())
    } else {
        Err(ApiError::invalid_request(
            "invalid_name",
            "policy names are 1-64 characters of [A-Za-z0-9_-]",
        ))
    }
}

fn internal(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", message)
}
