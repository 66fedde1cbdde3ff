//! Batcher policies in the admin API: the encoder queues' under `/admin/batchers`, the
//! admission queue's under `/admin/admission`. `GET` lists the active one, the kept versions
//! and uploaded candidates; `PUT .../{name}` uploads and validates one (`?activate=true`
//! publishes it); `POST .../{name}/activate` and `.../rollback` as for routers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use switchyard_protocol::api::ApiError;
use switchyard_protocol::respond::{self, Body};

use super::{Candidates, Route, internal, no_previous_version, not_uploaded, upload, version_json};
use crate::policy::batching::{BatcherPolicy, BatcherSwitch};
use crate::state::AdminState;

/// Answers `/admin/batchers/...` and `/admin/admission/...`; `rest` is the path after the
/// queue's segment.
pub(super) async fn handle(
    state: &AdminState,
    candidates: &Candidates,
    queue: BatcherQueue,
    route: Route<'_>,
    rest: &[&str],
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    match (route.method, rest) {
        (&Method::GET, []) => Ok(list_batchers(state, candidates, queue)),
        (&Method::PUT, [name]) => put(state, candidates, queue, route, name, request).await,
        (&Method::POST, [name, "activate"]) => {
            let policy = lock_batchers(candidates)?
                .remove(&queue.key(name))
                .ok_or_else(|| not_uploaded(name))?;
            let version = queue.of(state).0.publish(policy.clone());
            Ok(respond::json(StatusCode::OK, &version_json(&version)))
        }
        (&Method::POST, [_name, "rollback"]) => match queue.of(state).0.rollback() {
            Some(version) => Ok(respond::json(StatusCode::OK, &version_json(&version))),
            None => Err(no_previous_version()),
        },
        _ => Err(route.not_found()),
    }
}

/// `PUT .../{name}`: validates the upload; publishes it with `?activate=true`, else keeps it
/// as a candidate of `queue`.
async fn put(
    state: &AdminState,
    candidates: &Candidates,
    queue: BatcherQueue,
    route: Route<'_>,
    name: &str,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let (switch, configured) = queue.of(state);
    let configs = (queue.configs(candidates), configured);
    let policy = upload(state, request, name, configs, |runtime, name, wasm, config| {
        runtime.load_batcher(&name, &wasm, config)
    })
    .await?
    .policy;
    let body = if route.activate_requested() {
        let version = switch.publish(policy.clone());
        json!({"name": policy.name, "sha256": policy.sha256, "active": true, "generation": version.generation})
    } else {
        lock_batchers(candidates)?.insert(queue.key(&policy.name), policy.clone());
        json!({"name": policy.name, "sha256": policy.sha256, "active": false})
    };
    Ok(respond::json(StatusCode::OK, &body))
}

/// Which queue a batcher path manages: the encoder queues (`/admin/batchers`) or the
/// admission queue (`/admin/admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BatcherQueue {
    Encoders,
    Admission,
}

impl BatcherQueue {
    pub(super) fn from_segment(segment: &str) -> BatcherQueue {
        if segment == "admission" {
            BatcherQueue::Admission
        } else {
            BatcherQueue::Encoders
        }
    }

    /// The queue's live switch and configured batcher settings.
    fn of(self, state: &AdminState) -> (&Arc<BatcherSwitch>, &toml::Table) {
        match self {
            BatcherQueue::Encoders => (&state.batchers, &state.batcher_config),
            BatcherQueue::Admission => (&state.admission_batchers, &state.admission_batcher_config),
        }
    }

    /// Settings stored for uploads to this queue.
    pub(super) fn configs(self, candidates: &Candidates) -> &Mutex<HashMap<String, toml::Table>> {
        match self {
            BatcherQueue::Encoders => &candidates.batcher_configs,
            BatcherQueue::Admission => &candidates.admission_configs,
        }
    }

    /// An uploaded candidate's key: each queue has its own names.
    pub(super) fn key(self, name: &str) -> String {
        match self {
            BatcherQueue::Encoders => name.to_string(),
            BatcherQueue::Admission => format!("admission/{name}"),
        }
    }
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

fn lock_batchers(candidates: &Candidates) -> Result<MutexGuard<'_, HashMap<String, Arc<BatcherPolicy>>>, ApiError> {
    candidates
        .batchers
        .lock()
        .map_err(|_| internal("candidate list poisoned".into()))
}
