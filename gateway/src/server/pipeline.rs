//! The path of a generation request, as named stages in the one order they run.
//!
//! [`generate`] is that order, and the only place it is written:
//!
//! 1. [`admit`]: the body is read under the size limit and the read deadline, and parsed, the model must be served,
//!    the tenant's limits allow it, its latency targets are read — bad input costs no worker
//!    anything, and a tenant over its limits costs little.
//! 2. [`prepare_prompt`]: media fetched and inspected, the prompt
//!    tokenized (media items as spans) and hashed into blocks, its limits checked.
//! 3. [`enter_admission`]: waits while every worker of the model is full (`[admission]`); the
//!    reservation it returns is held until the request has its worker.
//! 4. [`plan_media`]: an encoder for each media item, and the
//!    encoders as rows of the policy's table.
//! 5. [`forward`]: the attempts — the policy's choice, its fallbacks,
//!    the policy again — until a worker answers.
//! 6. [`finish`]: the answer relayed to the client (streamed as it
//!    comes), the tenant charged, the latency judged against the targets.
//!
//! Each stage takes what the earlier ones returned and returns a value of its own, so what a
//! request carries from one stage to the next is in those values' types.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use switchyard_protocol::api::{self, ApiError, Endpoint};
use switchyard_protocol::respond::{self, Body};

use super::forward::forward;
use super::media_plan::plan_media;
use super::prompt::{Prepared, prepare_prompt};
use super::relay::finish;
use crate::admission;
use crate::media::ModelLimits;
use crate::slo;
use crate::state::AppState;
use crate::tenants::{Charge, Grant};

/// Serves one generation request, stage by stage (see the module documentation).
pub(crate) async fn generate(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    request: Request<Incoming>,
    started: Instant,
    grant: Option<Arc<Grant>>,
) -> Result<Response<Body>, ApiError> {
    let mut admitted = admit(state, endpoint, request, grant).await?;
    let prepared = prepare_prompt(state, &mut admitted).await?;
    let reservation = enter_admission(state, &admitted, &prepared).await?;
    let media = plan_media(state, &admitted, &prepared);
    let forwarded = forward(state, &admitted, &prepared, &media, reservation).await?;
    Ok(finish(state, admitted, &prepared, forwarded, started).await)
}

/// A request let in: read, parsed, for a served model, within its tenant's limits.
pub(super) struct Admitted {
    /// Which endpoint it came to.
    pub(super) endpoint: Endpoint,
    /// Its headers (the split rollout's affinity key is read from them).
    pub(super) headers: http::HeaderMap,
    /// Its body, as it goes to the worker.
    pub(super) body: Bytes,
    /// Its body, parsed.
    pub(super) parsed: api::GenerateRequest,
    /// The caller's key, when the gateway has keys.
    pub(super) grant: Option<Arc<Grant>>,
    /// The tenant's charge, settled once the answer ends.
    pub(super) charge: Option<Charge>,
    /// The model's limits (context, prompt, media) and default targets.
    pub(super) limits: ModelLimits,
    /// Its latency targets: the request's headers over the model's defaults.
    pub(super) targets: slo::Targets,
}

impl Admitted {
    /// The model asked for.
    pub(super) fn model(&self) -> &str {
        self.parsed.model()
    }

    /// Whether the answer streams.
    pub(super) fn stream(&self) -> bool {
        self.parsed.is_stream()
    }

    /// The block size prompts are hashed with when the model states none: the first worker's.
    pub(super) fn fallback_block_size(&self, state: &AppState) -> usize {
        state
            .router
            .pool()
            .candidates(self.model(), &[])
            .first()
            .map_or(64, |worker| worker.block_size)
    }
}

/// Stage 1: reads and parses the body, checks the model is served and the tenant's limits
/// (before any tokenizing, so a tenant over them costs little), and reads the targets.
async fn admit(
    state: &AppState,
    endpoint: Endpoint,
    request: Request<Incoming>,
    grant: Option<Arc<Grant>>,
) -> Result<Admitted, ApiError> {
    let (parts, body) = request.into_parts();
    // A body trickled in would hold the connection and the request's task for as long as the
    // client likes: the whole body has a deadline.
    let reading = respond::read_limited(&parts.headers, body, state.server.max_body_bytes);
    let body = tokio::time::timeout(state.server.body_read_timeout(), reading)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "body_read_timeout",
                format!(
                    "the request body did not arrive within {} ms (server.body_read_timeout_ms)",
                    state.server.body_read_timeout_ms
                ),
            )
        })??;
    let parsed = api::parse_generate_request(endpoint, &body)?;
    let model = parsed.model();
    let pool = state.router.pool();
    if !pool.serves(model) {
        // Only the models the key may use, as `/v1/models` lists them for it.
        let served = pool.models();
        let available = match &grant {
            Some(grant) => grant.visible(&served),
            None => served.iter().map(String::as_str).collect(),
        };
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "model `{model}` does not exist; available models: {}",
                available.join(", ")
            ),
        )
        .with_param(Some("model".into())));
    }
    let charge = grant
        .as_ref()
        .map(|grant| state.tenants.admit(grant, model))
        .transpose()?;
    let limits = state.media.model(model);
    let targets = slo::Targets::of_request(&parts.headers, limits.targets)?;
    Ok(Admitted {
        endpoint,
        headers: parts.headers,
        body,
        parsed,
        grant,
        charge,
        limits,
        targets,
    })
}

/// Stage 3: waits in the model's admission queue while every worker of it is full; the
/// reservation is held until the request has its worker.
async fn enter_admission(
    state: &AppState,
    admitted: &Admitted,
    prepared: &Prepared,
) -> Result<admission::Reservation, ApiError> {
    let ticket = admission::Ticket {
        grant: admitted.grant.as_deref(),
        tokens: prepared.prompt.tokens,
    };
    state.admission.enter(admitted.model(), ticket).await
}
