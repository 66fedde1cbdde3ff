//! The admin API's router operations when the gateway is in a fleet: each writes the fleet's
//! state (see [`crate::fleet`]) instead of this replica's switch, and answers once this replica
//! runs the result. `GET /admin/fleet` shows the fleet's state and every replica's report.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Value, json};
use switchyard_protocol::api::ApiError;

use crate::fleet::{Fleet, FleetError, FleetRollout, FleetRouter, PolicyRef};
use crate::policy::switch::RolloutMode;
use crate::state::AdminState;

/// The fleet a router operation goes through: the gateway's, when it has one. `fleet=true` in
/// the query on a gateway in no fleet is refused rather than done locally.
pub(super) fn of<'a>(state: &'a AdminState, query: &str) -> Result<Option<&'a Arc<Fleet>>, ApiError> {
    let asked = query.split('&').any(|pair| pair == "fleet=true" || pair == "fleet=1");
    match (&state.fleet, asked) {
        (None, true) => Err(super::not_in_a_fleet()),
        (fleet, _) => Ok(fleet.as_ref()),
    }
}

fn api_error(err: FleetError) -> ApiError {
    match err {
        FleetError::Unavailable(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "fleet_unavailable",
            err.to_string(),
        ),
        FleetError::Conflict(_) => ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "fleet_conflict",
            err.to_string(),
        ),
    }
}

/// Stores a validated component in the fleet and names it with its settings.
async fn reference(fleet: &Fleet, name: &str, wasm: &Bytes, config: &toml::Table) -> Result<PolicyRef, ApiError> {
    let sha256 = fleet.store_component(wasm).await.map_err(api_error)?;
    Ok(PolicyRef {
        name: name.to_string(),
        sha256,
        config: toml::to_string(config).unwrap_or_default(),
    })
}

/// What the answers say: the fleet's revision and what this replica runs now.
fn answer(state: &AdminState, revision: u64, extra: Value) -> Value {
    let active = state.router.policy().active();
    let mut body = json!({
        "fleet_revision": revision,
        "name": active.policy.name,
        "sha256": active.policy.sha256,
        "generation": active.generation,
        "active": true,
    });
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    body
}

/// Makes `name` the fleet's active policy.
pub(super) async fn activate(
    state: &AdminState,
    fleet: &Fleet,
    name: &str,
    wasm: &Bytes,
    config: &toml::Table,
) -> Result<Value, ApiError> {
    let active = reference(fleet, name, wasm, config).await?;
    let revision = fleet
        .set(|_| {
            Ok(FleetRouter {
                active: active.clone(),
                rollout: None,
            })
        })
        .await
        .map_err(api_error)?;
    Ok(answer(state, revision, json!({})))
}

/// Restores the fleet's previous active policy.
pub(super) async fn rollback(state: &AdminState, fleet: &Fleet) -> Result<Value, ApiError> {
    let Some((current, _)) = fleet.router().await.map_err(api_error)? else {
        return Err(api_error(FleetError::Conflict(
            "the fleet has no policy yet to roll back from".into(),
        )));
    };
    let Some(previous) = fleet.previous_active(&current.active).await.map_err(api_error)? else {
        return Err(api_error(FleetError::Conflict(
            "the fleet's history holds no earlier policy to roll back to".into(),
        )));
    };
    let revision = fleet
        .set(|_| {
            Ok(FleetRouter {
                active: previous.clone(),
                rollout: None,
            })
        })
        .await
        .map_err(api_error)?;
    Ok(answer(state, revision, json!({})))
}

/// Starts trying `name` as a candidate on every replica.
pub(super) async fn rollout(
    state: &AdminState,
    fleet: &Fleet,
    (name, wasm, config): (&str, &Bytes, &toml::Table),
    mode: &RolloutMode,
    key: Option<String>,
) -> Result<Value, ApiError> {
    let candidate = reference(fleet, name, wasm, config).await?;
    let (mode, percent) = match mode {
        RolloutMode::Shadow => ("shadow", 0),
        RolloutMode::Split { percent } => ("split", *percent),
    };
    let revision = fleet
        .set(|current| {
            let current = current.ok_or_else(|| {
                FleetError::Conflict("activate a policy fleet-wide before trying a candidate beside it".into())
            })?;
            Ok(FleetRouter {
                active: current.active.clone(),
                rollout: Some(FleetRollout {
                    candidate: candidate.clone(),
                    mode: mode.into(),
                    percent,
                    key: key.clone(),
                }),
            })
        })
        .await
        .map_err(api_error)?;
    Ok(answer(
        state,
        revision,
        json!({"rollout": {"candidate": candidate.name, "sha256": candidate.sha256, "mode": mode, "percent": percent}}),
    ))
}

/// Ends the fleet's rollout.
pub(super) async fn stop_rollout(state: &AdminState, fleet: &Fleet) -> Result<Value, ApiError> {
    let revision = fleet
        .set(|current| {
            let current = current.ok_or_else(|| FleetError::Conflict("the fleet has no policy yet".into()))?;
            Ok(FleetRouter {
                active: current.active.clone(),
                rollout: None,
            })
        })
        .await
        .map_err(api_error)?;
    Ok(answer(state, revision, json!({"rollout": null})))
}

/// The fleet's state and every replica's report.
pub(super) async fn list(fleet: &Fleet) -> Result<Value, ApiError> {
    let router = fleet.router().await.map_err(api_error)?;
    let replicas = fleet.statuses().await.map_err(api_error)?;
    let (router, revision) = match router {
        Some((router, revision)) => (Some(router), revision),
        None => (None, 0),
    };
    Ok(json!({
        "replica": fleet.replica(),
        "revision": revision,
        "router": router,
        "replicas": replicas,
    }))
}
