//! The admin API: managing router policies and inspecting KV routing, on a listener of its own
//! (plain HTTP, or TLS with `[admin.tls]`, then optionally requiring client certificates).
//!
//! Every request needs `authorization: Bearer TOKEN` with the configured token (401 otherwise).
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

mod dashboard;
mod fleet;

use crate::events::applier::{DumpSource, Inbound};
use crate::events::http as kv_http;
use crate::policy::batching::BatcherPolicy;
use crate::policy::runtime::RouterPolicy;
use crate::policy::switch::{Rollout, RolloutMode};
use crate::state::AdminState;

/// Largest policy upload accepted.
const MAX_POLICY_BYTES: usize = 16 << 20;

/// Largest batch of KV events accepted in one post.
const MAX_EVENT_BATCH_BYTES: usize = 16 << 20;

/// Uploaded, validated policies not yet active, by name.
#[derive(Debug, Default)]
pub struct Candidates {
    by_name: Mutex<HashMap<String, Arc<RouterPolicy>>>,
    configs: Mutex<HashMap<String, toml::Table>>,
    /// The components and settings of uploaded routers, for pushing them to a fleet later.
    sources: Mutex<HashMap<String, (bytes::Bytes, toml::Table)>>,
    /// Uploaded batchers, by [`BatcherQueue::key`].
    batchers: Mutex<HashMap<String, Arc<BatcherPolicy>>>,
    batcher_configs: Mutex<HashMap<String, toml::Table>>,
    admission_configs: Mutex<HashMap<String, toml::Table>>,
}

/// Which queue a batcher path manages: the encoder queues (`/admin/batchers`) or the
/// admission queue (`/admin/admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatcherQueue {
    Encoders,
    Admission,
}

impl BatcherQueue {
    fn from_segment(segment: &str) -> BatcherQueue {
        if segment == "admission" {
            BatcherQueue::Admission
        } else {
            BatcherQueue::Encoders
        }
    }

    /// The queue's live switch and configured batcher settings.
    fn of(self, state: &AdminState) -> (&Arc<crate::policy::batching::BatcherSwitch>, &toml::Table) {
        match self {
            BatcherQueue::Encoders => (&state.batchers, &state.batcher_config),
            BatcherQueue::Admission => (&state.admission_batchers, &state.admission_batcher_config),
        }
    }

    /// Settings stored for uploads to this queue.
    fn configs(self, candidates: &Candidates) -> &Mutex<HashMap<String, toml::Table>> {
        match self {
            BatcherQueue::Encoders => &candidates.batcher_configs,
            BatcherQueue::Admission => &candidates.admission_configs,
        }
    }

    /// An uploaded candidate's key: each queue has its own names.
    fn key(self, name: &str) -> String {
        match self {
            BatcherQueue::Encoders => name.to_string(),
            BatcherQueue::Admission => format!("admission/{name}"),
        }
    }
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

/// Serves the admin API on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, token: String, state: Arc<AdminState>, tls: Option<TlsAcceptor>) {
    let candidates = Arc::new(Candidates::default());
    let token = Arc::new(token);
    let handler = move |request: Request<Incoming>| {
        let (state, token, candidates) = (state.clone(), token.clone(), candidates.clone());
        async move {
            // The page holds no data: it asks for the token and sends it with each call.
            if request.method() == Method::GET && matches!(request.uri().path(), "/" | "/dashboard") {
                return dashboard::page();
            }
            match authorize(&request, &token) {
                Ok(()) => handle(&state, &candidates, request)
                    .await
                    .unwrap_or_else(|err| respond::error(&err)),
                Err(err) => respond::error(&err),
            }
        }
    };
    match tls {
        None => switchyard_protocol::serve::serve_http(listener, "admin", handler).await,
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
            switchyard_protocol::serve::serve_http_over(listener, "admin", handshake, handler).await;
        }
    }
}

fn authorize(request: &Request<Incoming>, token: &str) -> Result<(), ApiError> {
    let presented = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .unwrap_or("");
    // Compare in constant time so the token cannot be guessed byte by byte.
    let matches = presented.len() == token.len()
        && presented
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if matches {
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

async fn handle(
    state: &AdminState,
    candidates: &Candidates,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (request.method().clone(), segments.as_slice()) {
        (Method::GET, ["metrics"]) => Ok(respond::text(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            state.metrics.encode(),
        )),
        (Method::GET, ["admin", "policies"]) => Ok(list(state, candidates)),
        (Method::GET, ["admin", "kv"]) => Ok(respond::json(StatusCode::OK, &state.router.kv_summary())),
        (Method::PUT, ["admin", kind @ ("policies" | "batchers" | "admission"), name, "config"]) => {
            let name = valid_name(name)?;
            let (parts, body) = request.into_parts();
            let text = respond::read_limited(&parts.headers, body, 1 << 20).await?;
            let text = std::str::from_utf8(&text)
                .map_err(|_| ApiError::invalid_request("invalid_utf8", "the policy config must be UTF-8 TOML"))?;
            let table: toml::Table = toml::from_str(text).map_err(|err| {
                ApiError::invalid_request("invalid_config", format!("policy config is not valid TOML: {err}"))
            })?;
            let keys: Vec<String> = table.keys().cloned().collect();
            let store = match *kind {
                "policies" => &candidates.configs,
                queue => BatcherQueue::from_segment(queue).configs(candidates),
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
        (Method::GET, ["admin", queue @ ("batchers" | "admission")]) => {
            Ok(list_batchers(state, candidates, BatcherQueue::from_segment(queue)))
        }
        (Method::PUT, ["admin", queue @ ("batchers" | "admission"), name]) => {
            let queue = BatcherQueue::from_segment(queue);
            let (switch, configured) = queue.of(state);
            let configs = (queue.configs(candidates), configured);
            let policy = upload(state, request, name, configs, |runtime, name, wasm, config| {
                runtime.load_batcher(&name, &wasm, config)
            })
            .await?
            .policy;
            let body = if activate_requested(&query) {
                let version = switch.publish(policy.clone());
                json!({"name": policy.name, "sha256": policy.sha256, "active": true, "generation": version.generation})
            } else {
                lock_batchers(candidates)?.insert(queue.key(&policy.name), policy.clone());
                json!({"name": policy.name, "sha256": policy.sha256, "active": false})
            };
            Ok(respond::json(StatusCode::OK, &body))
        }
        (Method::POST, ["admin", queue @ ("batchers" | "admission"), name, "activate"]) => {
            let queue = BatcherQueue::from_segment(queue);
            let policy = lock_batchers(candidates)?
                .remove(&queue.key(name))
                .ok_or_else(|| not_uploaded(name))?;
            let version = queue.of(state).0.publish(policy.clone());
            Ok(respond::json(
                StatusCode::OK,
                &json!({"name": policy.name, "sha256": policy.sha256, "generation": version.generation}),
            ))
        }
        (Method::POST, ["admin", queue @ ("batchers" | "admission"), _name, "rollback"]) => {
            match BatcherQueue::from_segment(queue).of(state).0.rollback() {
                Some(version) => Ok(respond::json(
                    StatusCode::OK,
                    &json!({"name": version.policy.name, "sha256": version.policy.sha256, "generation": version.generation}),
                )),
                None => Err(no_previous_version()),
            }
        }
        (Method::GET, ["admin", "stats"]) => Ok(respond::json(StatusCode::OK, &dashboard::stats(state))),
        (Method::GET, ["admin", "planner"]) => {
            let planner = state.planner.as_ref().ok_or_else(no_planner)?;
            Ok(respond::json(StatusCode::OK, &planner.status()))
        }
        (Method::PUT, ["admin", "planner", name]) => {
            let planner = state.planner.as_ref().ok_or_else(no_planner)?.clone();
            let stored = Mutex::new(HashMap::new());
            let policy = upload(
                state,
                request,
                name,
                (&stored, planner.policy_config()),
                |runtime, name, wasm, config| runtime.load_planner(&name, &wasm, config),
            )
            .await?
            .policy;
            let version = planner.switch().publish(policy.clone());
            Ok(respond::json(
                StatusCode::OK,
                &json!({"name": policy.name, "sha256": policy.sha256, "active": true, "generation": version.generation}),
            ))
        }
        (Method::POST, ["admin", "planner", "rollback"]) => {
            let planner = state.planner.as_ref().ok_or_else(no_planner)?;
            match planner.switch().rollback() {
                Some(version) => Ok(respond::json(
                    StatusCode::OK,
                    &json!({"name": version.policy.name, "sha256": version.policy.sha256, "generation": version.generation}),
                )),
                None => Err(no_previous_version()),
            }
        }
        (Method::GET, ["admin", "fleet"]) => {
            let fleet = state.fleet.as_ref().ok_or_else(not_in_a_fleet)?;
            Ok(respond::json(StatusCode::OK, &fleet::list(fleet).await?))
        }
        (Method::PUT, ["admin", "policies", name]) => {
            let in_fleet = fleet::of(state, &query)?;
            let configs = (&candidates.configs, &state.policy_config);
            let uploaded = upload(state, request, name, configs, |runtime, name, wasm, config| {
                runtime.load_router(&name, &wasm, config)
            })
            .await?;
            let policy = uploaded.policy.clone();
            let body = match in_fleet {
                Some(fleet) if activate_requested(&query) => {
                    fleet::activate(state, fleet, &policy.name, &uploaded.wasm, &uploaded.config).await?
                }
                None if activate_requested(&query) => {
                    let version = state.router.policy().publish(policy.clone());
                    json!({"name": policy.name, "sha256": policy.sha256, "active": true, "generation": version.generation})
                }
                _ => {
                    lock(candidates)?.insert(policy.name.clone(), policy.clone());
                    candidates
                        .sources
                        .lock()
                        .map_err(|_| internal("candidate list poisoned".into()))?
                        .insert(policy.name.clone(), (uploaded.wasm, uploaded.config));
                    json!({"name": policy.name, "sha256": policy.sha256, "active": false})
                }
            };
            Ok(respond::json(StatusCode::OK, &body))
        }
        (Method::POST, ["admin", "policies", name, "activate"]) => {
            let in_fleet = fleet::of(state, &query)?;
            let policy = lock(candidates)?.remove(*name).ok_or_else(|| not_uploaded(name))?;
            let source = candidates
                .sources
                .lock()
                .map_err(|_| internal("candidate list poisoned".into()))?
                .remove(*name);
            if let (Some(fleet), Some((wasm, config))) = (in_fleet, source) {
                let body = fleet::activate(state, fleet, &policy.name, &wasm, &config).await?;
                return Ok(respond::json(StatusCode::OK, &body));
            }
            let version = state.router.policy().publish(policy.clone());
            Ok(respond::json(
                StatusCode::OK,
                &json!({"name": policy.name, "sha256": policy.sha256, "generation": version.generation}),
            ))
        }
        (Method::POST, ["admin", "policies", _name, "rollback"]) => {
            if let Some(fleet) = fleet::of(state, &query)? {
                return Ok(respond::json(StatusCode::OK, &fleet::rollback(state, fleet).await?));
            }
            match state.router.policy().rollback() {
                Some(version) => Ok(respond::json(
                    StatusCode::OK,
                    &json!({"name": version.policy.name, "sha256": version.policy.sha256, "generation": version.generation}),
                )),
                None => Err(no_previous_version()),
            }
        }
        (Method::POST, ["admin", "policies", name, mode @ ("shadow" | "split")]) => {
            let policy = lock(candidates)?
                .get(*name)
                .cloned()
                .ok_or_else(|| not_uploaded(name))?;
            let parameter = |key: &str| {
                query
                    .split('&')
                    .find_map(|pair| pair.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
            };
            let (mode, key) = if *mode == "shadow" {
                (RolloutMode::Shadow, None)
            } else {
                let percent = parameter("percent")
                    .and_then(|p| p.parse::<u8>().ok())
                    .filter(|p| *p <= 100)
                    .ok_or_else(|| {
                        ApiError::invalid_request(
                            "invalid_percent",
                            "split needs `?percent=P` with P an integer in 0..=100",
                        )
                    })?;
                let key = parameter("key").filter(|k| !k.is_empty()).map(str::to_ascii_lowercase);
                if key
                    .as_deref()
                    .is_some_and(|k| http::HeaderName::from_bytes(k.as_bytes()).is_err())
                {
                    return Err(ApiError::invalid_request("invalid_key", "`key` must be a header name"));
                }
                (RolloutMode::Split { percent }, key)
            };
            if let Some(fleet) = fleet::of(state, &query)? {
                let source = candidates
                    .sources
                    .lock()
                    .map_err(|_| internal("candidate list poisoned".into()))?
                    .get(*name)
                    .cloned();
                if let Some((wasm, config)) = source {
                    let body = fleet::rollout(state, fleet, (&policy.name, &wasm, &config), &mode, key).await?;
                    return Ok(respond::json(StatusCode::OK, &body));
                }
            }
            let rollout = state.router.policy().start_rollout(policy.clone(), mode, key);
            Ok(respond::json(StatusCode::OK, &rollout_json(&rollout)))
        }
        (Method::POST, ["admin", "workers"]) => {
            let (parts, body) = request.into_parts();
            let body = respond::read_limited(&parts.headers, body, 1 << 20).await?;
            let registration = kv_http::registration(&body)?;
            let worker = registration.worker.clone();
            let source = Arc::new(kv_http::HttpDumps::new(state.client.clone(), &registration.url));
            send_inbound(state, Inbound::Heartbeat(registration, source))?;
            Ok(respond::json(StatusCode::OK, &json!({"registered": worker})))
        }
        (Method::POST, ["admin", "workers", name, "events"]) => {
            let name = name.to_string();
            let Some(worker) = state.router.pool().workers().iter().find(|w| w.name == name).cloned() else {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_request_error",
                    "worker_not_registered",
                    format!("worker `{name}` is not registered; POST /admin/workers first"),
                ));
            };
            let (parts, body) = request.into_parts();
            let body = respond::read_limited(&parts.headers, body, MAX_EVENT_BATCH_BYTES).await?;
            let events = kv_http::events(&name, &body)?;
            let count = events.len();
            let source: Arc<dyn DumpSource> =
                Arc::new(kv_http::HttpDumps::new(state.client.clone(), &worker.base.to_string()));
            for event in events {
                send_inbound(state, Inbound::Event(event, source.clone()))?;
            }
            Ok(respond::json(StatusCode::OK, &json!({"accepted": count})))
        }
        (Method::DELETE, ["admin", "workers", name]) => {
            send_inbound(state, Inbound::Leave(name.to_string()))?;
            Ok(respond::json(StatusCode::OK, &json!({"left": name})))
        }
        (Method::DELETE, ["admin", "rollout"]) => {
            if let Some(fleet) = fleet::of(state, &query)? {
                return Ok(respond::json(StatusCode::OK, &fleet::stop_rollout(state, fleet).await?));
            }
            state.router.policy().stop_rollout();
            Ok(respond::json(StatusCode::OK, &json!({"rollout": null})))
        }
        _ => Err(respond::not_found(&path)),
    }
}

fn send_inbound(state: &AdminState, message: Inbound) -> Result<(), ApiError> {
    state
        .events
        .send(message)
        .map_err(|_| internal("the KV event applier has stopped".into()))
}

fn list(state: &AdminState, candidates: &Candidates) -> Response<Body> {
    let active = state.router.policy().active();
    let candidates: Vec<_> = candidates
        .by_name
        .lock()
        .map(|map| {
            map.values()
                .map(|p| json!({"name": p.name, "sha256": p.sha256}))
                .collect()
        })
        .unwrap_or_default();
    respond::json(
        StatusCode::OK,
        &json!({
            "active": {
                "name": active.policy.name,
                "sha256": active.policy.sha256,
                "generation": active.generation,
                "failures": active.failures(),
                "decisions": {
                    "policy": state.router.policy().decision_counts(&active)[0],
                    "fallback": state.router.policy().decision_counts(&active)[1],
                },
            },
            "previous": state.router.policy().previous().iter().map(|v| json!({
                "name": v.policy.name, "sha256": v.policy.sha256, "generation": v.generation,
            })).collect::<Vec<_>>(),
            "candidates": candidates,
            "rollout": state.router.policy().rollout().map(|rollout| {
                let mut body = rollout_json(&rollout);
                let [agree, disagree, failed] = state.router.policy().shadow_comparisons(&rollout.candidate);
                body["comparisons"] = json!({"agree": agree, "disagree": disagree, "failed": failed});
                body["candidate"]["failures"] = json!(rollout.candidate.failures());
                body
            }),
        }),
    )
}

fn list_batchers(state: &AdminState, candidates: &Candidates, queue: BatcherQueue) -> Response<Body> {
    let switch = queue.of(state).0;
    let active = switch.active();
    let uploaded: Vec<_> = candidates
        .batchers
        .lock()
        .map(|map| {
            map.iter()
                .filter(|(key, policy)| **key == queue.key(&policy.name))
                .map(|(_, p)| json!({"name": p.name, "sha256": p.sha256}))
                .collect()
        })
        .unwrap_or_default();
    respond::json(
        StatusCode::OK,
        &json!({
            "active": {
                "name": active.policy.name,
                "sha256": active.policy.sha256,
                "generation": active.generation,
                "failures": active.failures(),
            },
            "previous": switch.previous().iter().map(|v| json!({
                "name": v.policy.name, "sha256": v.policy.sha256, "generation": v.generation,
            })).collect::<Vec<_>>(),
            "candidates": uploaded,
        }),
    )
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

fn activate_requested(query: &str) -> bool {
    query
        .split('&')
        .any(|pair| pair == "activate=true" || pair == "activate=1")
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

fn lock_batchers(
    candidates: &Candidates,
) -> Result<std::sync::MutexGuard<'_, HashMap<String, Arc<BatcherPolicy>>>, ApiError> {
    candidates
        .batchers
        .lock()
        .map_err(|_| internal("candidate list poisoned".into()))
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

fn rollout_json(rollout: &Rollout) -> serde_json::Value {
    let (mode, percent) = match rollout.mode {
        RolloutMode::Shadow => ("shadow", None),
        RolloutMode::Split { percent } => ("split", Some(percent)),
    };
    json!({
        "candidate": {"name": rollout.candidate.policy.name, "sha256": rollout.candidate.policy.sha256, "generation": rollout.candidate.generation},
        "mode": mode,
        "percent": percent,
        "key": rollout.key_header,
    })
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

fn lock(candidates: &Candidates) -> Result<std::sync::MutexGuard<'_, HashMap<String, Arc<RouterPolicy>>>, ApiError> {
    candidates
        .by_name
        .lock()
        .map_err(|_| internal("candidate list poisoned".into()))
}

fn internal(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", message)
}
