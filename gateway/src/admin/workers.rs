//! Workers that register over HTTP (without NATS): `POST /admin/workers` registers and
//! heartbeats, `POST /admin/workers/{name}/events` posts a batch of KV events, and
//! `DELETE /admin/workers/{name}` leaves (see [`crate::events::http`]).

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use switchyard_protocol::api::ApiError;
use switchyard_protocol::respond::{self, Body};

use super::{Route, internal};
use crate::events::applier::{DumpSource, Inbound};
use crate::events::http as kv_http;
use crate::state::AdminState;

/// Largest batch of KV events accepted in one post.
const MAX_EVENT_BATCH_BYTES: usize = 16 << 20;

/// Answers `/admin/workers/...`; `rest` is the path after `workers`.
pub(super) async fn handle(
    state: &AdminState,
    route: Route<'_>,
    rest: &[&str],
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    match (route.method, rest) {
        (&Method::POST, []) => register(state, request).await,
        (&Method::POST, [name, "events"]) => events(state, name, request).await,
        (&Method::DELETE, [name]) => {
            send_inbound(state, Inbound::Leave(name.to_string()))?;
            Ok(respond::json(StatusCode::OK, &json!({"left": name})))
        }
        _ => Err(route.not_found()),
    }
}

/// `POST /admin/workers`: a registration or heartbeat.
async fn register(state: &AdminState, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let (parts, body) = request.into_parts();
    let body = respond::read_limited(&parts.headers, body, 1 << 20).await?;
    let registration = kv_http::registration(&body)?;
    let worker = registration.worker.clone();
    let source = Arc::new(kv_http::HttpDumps::new(state.client.clone(), &registration.url));
    send_inbound(state, Inbound::Heartbeat(registration, source))?;
    Ok(respond::json(StatusCode::OK, &json!({"registered": worker})))
}

/// `POST /admin/workers/{name}/events`: a registered worker's KV events.
async fn events(state: &AdminState, name: &str, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
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
    let events = kv_http::events(name, &body)?;
    let count = events.len();
    let source: Arc<dyn DumpSource> = Arc::new(kv_http::HttpDumps::new(state.client.clone(), &worker.base.to_string()));
    for event in events {
        send_inbound(state, Inbound::Event(event, source.clone()))?;
    }
    Ok(respond::json(StatusCode::OK, &json!({"accepted": count})))
}

fn send_inbound(state: &AdminState, message: Inbound) -> Result<(), ApiError> {
    state
        .events
        .send(message)
        .map_err(|_| internal("the KV event applier has stopped".into()))
}
