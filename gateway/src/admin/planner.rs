//! The planner's policy in the admin API: `GET /admin/planner` shows the planner's state,
//! `PUT /admin/planner/{name}` uploads, validates and publishes a planner component, and
//! `POST /admin/planner/rollback` restores the previous version.

use std::collections::HashMap;
use std::sync::Mutex;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use switchyard_protocol::api::ApiError;
use switchyard_protocol::respond::{self, Body};

use super::{Route, no_planner, no_previous_version, upload, version_json};
use crate::state::AdminState;

/// Answers `/admin/planner/...`; `rest` is the path after `planner`.
pub(super) async fn handle(
    state: &AdminState,
    route: Route<'_>,
    rest: &[&str],
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let planner = || state.planner.as_ref().ok_or_else(no_planner);
    match (route.method, rest) {
        (&Method::GET, []) => Ok(respond::json(StatusCode::OK, &planner()?.status())),
        (&Method::PUT, [name]) => {
            let planner = planner()?.clone();
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
        (&Method::POST, ["rollback"]) => match planner()?.switch().rollback() {
            Some(version) => Ok(respond::json(StatusCode::OK, &version_json(&version))),
            None => Err(no_previous_version()),
        },
        _ => Err(route.not_found()),
    }
}
