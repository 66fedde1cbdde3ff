//! Request dispatch: which handler answers which method and path.
//!
//! Generation endpoints go to [`pipeline`]; the rest (`/v1/models`,
//! `/healthz`, `/readyz`, `/metrics`) are answered here. Every answer is counted by endpoint
//! and status, and every error by its code.

use std::sync::Arc;
use std::time::Instant;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use switchyard_protocol::api::{self, ApiError, Endpoint, ModelList};
use switchyard_protocol::paths;
use switchyard_protocol::respond::{self, Body};

use crate::server::pipeline;
use crate::state::AppState;

/// Answers one client request.
pub(crate) async fn handle(state: Arc<AppState>, request: Request<Incoming>, started: Instant) -> Response<Body> {
    // The path is borrowed, not copied: a generation request moves the request on.
    let (label, result) = match (request.method(), request.uri().path()) {
        (&Method::POST, path @ (api::CHAT_COMPLETIONS_PATH | api::COMPLETIONS_PATH)) => {
            let endpoint = Endpoint::from_path(path).unwrap_or(Endpoint::Chat);
            if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
                (endpoint.label(), Err(shutting_down()))
            } else {
                match state.tenants.authenticate(request.headers()) {
                    Ok(grant) => (
                        endpoint.label(),
                        pipeline::generate(&state, endpoint, request, started, grant).await,
                    ),
                    Err(err) => (endpoint.label(), Err(err)),
                }
            }
        }
        (&Method::GET, api::MODELS_PATH) => ("models", models(&state, request.headers())),
        (&Method::GET, paths::HEALTHZ) => ("healthz", Ok(respond::text(StatusCode::OK, "text/plain", "ok\n"))),
        (&Method::GET, "/readyz") => ("readyz", ready(&state)),
        (&Method::GET, path @ paths::METRICS) if !state.server.metrics => ("other", Err(respond::not_found(path))),
        (&Method::GET, paths::METRICS) => (
            "metrics",
            Ok(respond::text(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                state.metrics.encode(),
            )),
        ),
        (method, path @ (api::CHAT_COMPLETIONS_PATH | api::COMPLETIONS_PATH)) => {
            ("other", Err(respond::method_not_allowed(method, path, "POST")))
        }
        (method, path @ (api::MODELS_PATH | paths::HEALTHZ | "/readyz" | paths::METRICS)) => {
            ("other", Err(respond::method_not_allowed(method, path, "GET")))
        }
        (_, path) => ("other", Err(respond::not_found(path))),
    };
    let response = result.unwrap_or_else(|err| {
        state.metrics.error(err.code());
        respond::error(&err)
    });
    state.metrics.request(label, response.status().as_u16());
    response
}

/// The models the caller may use: every served one, or those its key allows.
fn models(state: &AppState, headers: &http::HeaderMap) -> Result<Response<Body>, ApiError> {
    let grant = state.tenants.authenticate(headers)?;
    let served = state.router.pool().models();
    let visible: Vec<&str> = match &grant {
        Some(grant) => grant.visible(&served),
        None => served.iter().map(String::as_str).collect(),
    };
    Ok(respond::json(StatusCode::OK, &ModelList::new(visible, "switchyard")))
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "shutting_down",
        "this gateway is shutting down and takes no new requests; retry on another replica",
    )
}

fn ready(state: &AppState) -> Result<Response<Body>, ApiError> {
    if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(shutting_down());
    }
    if state.router.pool().any_healthy() {
        Ok(respond::text(StatusCode::OK, "text/plain", "ready\n"))
    } else {
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no_healthy_worker",
            format!(
                "not ready: none of the {} configured workers is healthy",
                state.router.pool().workers().len()
            ),
        ))
    }
}
