//! Router policies in the admin API: `GET /admin/policies` lists the active version, the kept
//! versions and uploaded candidates; `PUT /admin/policies/{name}` uploads a `.wasm`
//! (`?activate=true` publishes it); `POST .../activate`, `.../rollback`, `.../shadow` and
//! `.../split?percent=P&key=H` publish, roll back and roll out; `DELETE /admin/rollout` ends a
//! rollout. With `[fleet]` these act on the fleet (see [`super::fleet`]).

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use switchyard_protocol::api::ApiError;
use switchyard_protocol::respond::{self, Body};

use super::{Candidates, Route, fleet, internal, no_previous_version, not_uploaded, upload, version_json};
use crate::policy::runtime::RouterPolicy;
use crate::policy::switch::{Rollout, RolloutMode};
use crate::state::AdminState;

/// Answers `/admin/policies/...`; `rest` is the path after `policies`.
pub(super) async fn handle(
    state: &AdminState,
    candidates: &Candidates,
    route: Route<'_>,
    rest: &[&str],
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    match (route.method, rest) {
        (&Method::GET, []) => Ok(list(state, candidates)),
        (&Method::PUT, [name]) => put(state, candidates, route, name, request).await,
        (&Method::POST, [name, "activate"]) => activate(state, candidates, route, name).await,
        (&Method::POST, [_name, "rollback"]) => rollback(state, route).await,
        (&Method::POST, [name, mode @ ("shadow" | "split")]) => roll_out(state, candidates, route, name, mode).await,
        _ => Err(route.not_found()),
    }
}

/// `PUT /admin/policies/{name}`: validates the upload; publishes it with `?activate=true`
/// (through the fleet when there is one), else keeps it as a candidate.
async fn put(
    state: &AdminState,
    candidates: &Candidates,
    route: Route<'_>,
    name: &str,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let in_fleet = fleet::of(state, route.query)?;
    let configs = (&candidates.configs, &state.policy_config);
    let uploaded = upload(state, request, name, configs, |runtime, name, wasm, config| {
        runtime.load_router(&name, &wasm, config)
    })
    .await?;
    let policy = uploaded.policy.clone();
    let body = match in_fleet {
        Some(fleet) if route.activate_requested() => {
            fleet::activate(state, fleet, &policy.name, &uploaded.wasm, &uploaded.config).await?
        }
        None if route.activate_requested() => {
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

/// `POST /admin/policies/{name}/activate`: publishes an uploaded candidate.
async fn activate(
    state: &AdminState,
    candidates: &Candidates,
    route: Route<'_>,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    let in_fleet = fleet::of(state, route.query)?;
    let policy = lock(candidates)?.remove(name).ok_or_else(|| not_uploaded(name))?;
    let source = candidates
        .sources
        .lock()
        .map_err(|_| internal("candidate list poisoned".into()))?
        .remove(name);
    if let (Some(fleet), Some((wasm, config))) = (in_fleet, source) {
        let body = fleet::activate(state, fleet, &policy.name, &wasm, &config).await?;
        return Ok(respond::json(StatusCode::OK, &body));
    }
    let version = state.router.policy().publish(policy.clone());
    Ok(respond::json(StatusCode::OK, &version_json(&version)))
}

/// `POST /admin/policies/{name}/rollback`: restores the previous version.
async fn rollback(state: &AdminState, route: Route<'_>) -> Result<Response<Body>, ApiError> {
    if let Some(fleet) = fleet::of(state, route.query)? {
        return Ok(respond::json(StatusCode::OK, &fleet::rollback(state, fleet).await?));
    }
    match state.router.policy().rollback() {
        Some(version) => Ok(respond::json(StatusCode::OK, &version_json(&version))),
        None => Err(no_previous_version()),
    }
}

/// `POST /admin/policies/{name}/shadow` and `.../split?percent=P&key=H`: rolls an uploaded
/// candidate out beside the active version.
async fn roll_out(
    state: &AdminState,
    candidates: &Candidates,
    route: Route<'_>,
    name: &str,
    mode: &str,
) -> Result<Response<Body>, ApiError> {
    let policy = lock(candidates)?.get(name).cloned().ok_or_else(|| not_uploaded(name))?;
    let parameter = |key: &str| {
        route
            .query
            .split('&')
            .find_map(|pair| pair.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
    };
    let (mode, key) = if mode == "shadow" {
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
    if let Some(fleet) = fleet::of(state, route.query)? {
        let source = candidates
            .sources
            .lock()
            .map_err(|_| internal("candidate list poisoned".into()))?
            .get(name)
            .cloned();
        if let Some((wasm, config)) = source {
            let body = fleet::rollout(state, fleet, (&policy.name, &wasm, &config), &mode, key).await?;
            return Ok(respond::json(StatusCode::OK, &body));
        }
    }
    let rollout = state.router.policy().start_rollout(policy.clone(), mode, key);
    Ok(respond::json(StatusCode::OK, &rollout_json(&rollout)))
}

/// `DELETE /admin/rollout`: ends a rollout.
pub(super) async fn stop_rollout(state: &AdminState, query: &str) -> Result<Response<Body>, ApiError> {
    if let Some(fleet) = fleet::of(state, query)? {
        return Ok(respond::json(StatusCode::OK, &fleet::stop_rollout(state, fleet).await?));
    }
    state.router.policy().stop_rollout();
    Ok(respond::json(StatusCode::OK, &json!({"rollout": null})))
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
                "config": active.policy.settings(),
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

fn lock(candidates: &Candidates) -> Result<MutexGuard<'_, HashMap<String, Arc<RouterPolicy>>>, ApiError> {
    candidates
        .by_name
        .lock()
        .map_err(|_| internal("candidate list poisoned".into()))
}
