//! Stage 5 of the request path: the attempts at getting an answer from a worker.
//!
//! A worker that cannot be reached, answers 5xx, or breaks off before its first body byte is
//! left for another worker (up to `forwarding.retries` times: the policy's fallbacks first,
//! then the policy again; see [`crate::routing`]); an unreachable one is also taken out of
//! rotation at once, and failed answers count toward the worker's circuit breaker. A worker
//! that answers 429 or 503 is full, not broken: the request goes on to another worker without
//! using a retry, and the busy one is left alone for a backoff ([`crate::workers::breaker`]).
//! A request with media carries its media plan to the worker, while its items go to encoders
//! through [`crate::encoders`]; the attempt settles once the media has: merged, text-only (the
//! worker is told), or a client error. With `forwarding.migration_limit` above 0, a streamed
//! request without media asks a worker whose engine can say for the token ids of its answer,
//! so that the relay can continue it elsewhere if it breaks (`migrate`). When the policy named
//! a prefill worker, the prompt is computed there first and the answering worker pulls its
//! blocks (`disagg`).

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use switchyard_protocol::api::{self, ApiError, Endpoint};
use switchyard_protocol::encode::{LOCAL_ENCODER, MEDIA_PLAN_HEADER, MediaPlan, abandon_path};

use super::disagg::{self, Prefilled};
use super::media_plan::{MediaPlanning, media_plan};
use super::migrate::{self, Seed};
use super::pipeline::Admitted;
use super::prompt::Prepared;
use crate::admission;
use crate::encoders::{self, Verdict};
use crate::media;
use crate::routing::{self, Lease};
use crate::state::AppState;
use crate::tenants::usage;
use crate::workers::Worker;
use crate::workers::upstream::UpstreamBody;

/// A worker's answer to a request, and the lease it was served under.
pub(super) struct Forwarded {
    /// The answer, its first bytes arrived.
    pub(super) answer: Answer,
    /// The request's hold on the worker that answered.
    pub(super) lease: Lease,
    /// Why the gateway left the request's media out of the answer, if it did.
    pub(super) text_only: Option<&'static str>,
    /// The usage chunk is the gateway's own (asked for to count the tenant's tokens), so it
    /// is taken out of the client's stream.
    pub(super) strip_usage: bool,
    /// The worker was asked for the stream's token ids, so a break can be continued elsewhere.
    pub(super) seed: Option<Seed>,
    /// How the prompt was computed, when the policy sent it to a prefill worker first.
    pub(super) prefilled: Option<Prefilled>,
}

/// Stage 5: leases workers in the routing core's order and tries each until one answers;
/// the admission `reservation` is let go once the first worker is leased (its own count holds
/// the request from then on).
///
/// # Errors
///
/// 503 `no_healthy_worker` when no worker could be leased, 502 `worker_unavailable` when every
/// one tried failed; a media item's client error as it is.
pub(super) async fn forward(
    state: &AppState,
    admitted: &Admitted,
    prepared: &Prepared,
    media: &MediaPlanning,
    reservation: admission::Reservation,
) -> Result<Forwarded, ApiError> {
    let model = admitted.model();
    let router = &state.router;
    // A tenant's streamed tokens are counted from the usage chunk, which the worker sends
    // only when asked; where the client did not ask, the chunk is asked for and taken out.
    let strip_usage = admitted.charge.is_some() && admitted.stream() && !admitted.parsed.include_usage();
    let body = match strip_usage.then(|| usage::ask_for_usage(&admitted.body)).flatten() {
        Some(asked) => asked,
        None => admitted.body.clone(),
    };
    // Only the gateway sets `kv_transfer_params`: a client's own would have a worker pull
    // blocks from an address of the client's choosing, or tell it the worker's own.
    let body = match admitted.parsed.kv_transfer_params() {
        Some(_) => disagg::without_transfer_params(&body).unwrap_or(body),
        None => body,
    };
    // A stream that may be continued elsewhere asks the workers that can say for its token
    // ids (one with media is not: its media would have to be encoded again).
    // Written the first time a worker that reports ids is leased.
    let migrating = state.forwarding.migration_limit > 0 && admitted.stream() && prepared.media_items.is_empty();
    let body_with_ids = std::cell::OnceCell::new();
    let id = router.next_request_id();
    let affinity = router.affinity(|header| admitted.headers.get(header).map(|value| value.as_bytes().to_vec()));
    let mut attempts = router.attempts(routing::Request {
        id,
        model,
        prompt: &prepared.prompt,
        max_tokens: admitted.parsed.token_limit(),
        media_tokens: media.media_tokens,
        affinity,
        encoders: &media.encoder_rows,
        ttft_target_ms: admitted.targets.ttft_ms.unwrap_or(0.0),
    });
    // Unique per gateway: the answer's id (the same on every attempt) and, with the attempt,
    // the key the request's media is planned under.
    let response_id = format!("{:016x}-{id}", router.kv().origin());
    let mut reservation = Some(reservation);
    let mut last_failure: Option<String> = None;
    let mut last_busy: Option<(String, Option<std::time::Duration>)> = None;
    let mut failures = 0;
    let mut prefilled: Option<Prefilled> = None;
    // Busy answers send the request on without using a retry; the attempts end when every
    // worker has been tried.
    for attempt in 0.. {
        if failures > state.forwarding.retries {
            break;
        }
        let Some(lease) = attempts.next_lease() else {
            if attempt == 0 {
                state.slo.unrouted(model, prepared.prompt.tokens as u64);
            }
            break;
        };
        if attempt == 0 {
            // For the planner: the pools the request reached (its first choice's, once).
            state.slo.routed(
                model,
                lease.worker().role,
                lease.has_prefill(),
                prepared.prompt.tokens as u64,
            );
        }
        // The worker's own count holds the request now.
        reservation.take();
        if attempt > 0 {
            state.metrics.retry();
        }
        let asked_ids = (migrating && lease.worker().engine().is_some_and(|engine| engine.reports_token_ids()))
            .then(|| body_with_ids.get_or_init(|| migrate::ask_for_token_ids(&body)).as_ref())
            .flatten();
        let sent = asked_ids.unwrap_or(&body).clone();
        let mut lease = lease;
        // Only the policy's first choice comes with a prefill worker; a worker tried after
        // it prefills the prompt itself.
        let to_worker = match lease.take_prefill() {
            Some(prefill) => {
                let (to_worker, outcome) = disagg::prefill(state, prefill, admitted.endpoint, &sent).await;
                prefilled = Some(outcome);
                to_worker
            }
            None => {
                if matches!(prefilled, Some(Prefilled::Remote { .. })) {
                    prefilled = Some(Prefilled::Local("retried"));
                }
                sent.clone()
            }
        };
        let (outcome, text_only) = Attempt {
            admitted,
            prepared,
            media,
            body: to_worker,
            response_id: &response_id,
            number: attempt,
        }
        .on(state, &lease)
        .await?;
        match outcome {
            Outcome::Answered(answer) => {
                let seed = asked_ids.map(|_| Seed {
                    body: sent,
                    response_id: response_id.clone(),
                    keep_ids: admitted.parsed.returns_token_ids(),
                });
                let prefilled = prefilled.map(|outcome| outcome.settled(&answer.response.headers));
                return Ok(Forwarded {
                    answer,
                    lease,
                    text_only,
                    strip_usage,
                    seed,
                    prefilled,
                });
            }
            Outcome::Failed(reason) => {
                let worker = lease.worker();
                tracing::warn!(worker = %worker.name, %reason, "worker failed before its first byte");
                last_failure = Some(format!("worker `{}`: {reason}", worker.name));
                failures += 1;
            }
            Outcome::Busy { status, retry_after } => {
                let worker = lease.worker();
                state.router.busy(worker, retry_after, &state.forwarding.backoffs());
                last_busy = Some((format!("worker `{}` answered {status}", worker.name), retry_after));
            }
            // Out of routing now; like a busy answer, it uses no retry.
            Outcome::Reclaimed => {
                tracing::info!(worker = %lease.worker().name, "reclaim notice before the first byte: trying elsewhere");
            }
        }
    }
    Err(match (last_failure, last_busy) {
        (Some(reason), _) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_unavailable",
            format!("every worker tried failed before answering; last: {reason}"),
        ),
        (None, Some((reason, retry_after))) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "workers_busy",
            format!("every worker of model `{model}` is at capacity ({reason}); try again shortly"),
        )
        .with_retry_after(retry_after.unwrap_or(std::time::Duration::from_secs(1))),
        (None, None) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no_healthy_worker",
            format!("no healthy worker is available for model `{model}`; try again shortly"),
        ),
    })
}

/// One attempt of a request: what it sends, and under which keys.
struct Attempt<'a> {
    admitted: &'a Admitted,
    prepared: &'a Prepared,
    media: &'a MediaPlanning,
    /// The body as it goes to the worker.
    body: Bytes,
    /// The unique part of the answer's id ([`api::RESPONSE_ID_HEADER`]).
    response_id: &'a str,
    /// Which attempt of the request this is (0 first).
    number: u32,
}

impl Attempt<'_> {
    /// The key this attempt's media is planned under: unique per gateway, request and attempt.
    fn key(&self) -> String {
        format!("{}-{}", self.response_id, self.number)
    }

    /// Tries the worker `lease` holds: with its media to the encoders chosen for this
    /// attempt, or the media planned for the worker itself (`[encoders] local`), or text only
    /// when some item has no encoder. Answers how the attempt ended and why the media was
    /// left out, if it was.
    async fn on(self, state: &AppState, lease: &Lease) -> Result<(Outcome, Option<&'static str>), ApiError> {
        let worker = lease.worker();
        let endpoint = self.admitted.endpoint;
        let stream = self.admitted.stream();
        let items = &self.prepared.media_items;
        let (plan, text_only) = match self.media.encoders_for(lease, items) {
            _ if self.media.local && !items.is_empty() => {
                let plan = media_plan(
                    self.key(),
                    self.prepared,
                    &mut std::iter::repeat(LOCAL_ENCODER.to_string()),
                );
                (Some(serde_json::to_string(&plan).unwrap_or_default()), None)
            }
            Some(chosen) if !items.is_empty() => {
                let plan = media_plan(
                    self.key(),
                    self.prepared,
                    &mut chosen.iter().map(|encoder| encoder.name.clone()),
                );
                let media = MediaRequest {
                    model: self.admitted.model(),
                    settings: &self.admitted.limits.media,
                    items,
                    encoders: &chosen,
                    response_id: self.response_id,
                };
                return media_attempt(state, worker, endpoint, self.body, stream, plan, media).await;
            }
            Some(_) => (None, None),
            None => (None, Some(encoders::REASON_NO_ENCODER)),
        };
        let attempt = attempt_on(
            state,
            worker,
            endpoint,
            self.body,
            stream,
            plan.as_deref(),
            self.response_id,
        )
        .await;
        Ok((attempt, text_only))
    }
}

/// A worker's answer whose first body bytes (if any) have already arrived.
pub(super) struct Answer {
    /// Its status and headers.
    pub(super) response: http::response::Parts,
    /// Its first body bytes, for a streamed answer.
    pub(super) first: Option<Bytes>,
    /// The rest of its body.
    pub(super) rest: UpstreamBody,
}

/// How one attempt on a worker ended.
pub(super) enum Outcome {
    Answered(Answer),
    Failed(String),
    /// The engine answered 429 or 503: it is full.
    Busy {
        status: StatusCode,
        /// Its `Retry-After` (given in seconds), if it sent one.
        retry_after: Option<std::time::Duration>,
    },
    /// The worker's reclaim notice came before its first bytes: the request goes elsewhere.
    Reclaimed,
}

/// A request's media and where each item is encoded first.
struct MediaRequest<'a> {
    model: &'a str,
    settings: &'a switchyard_media::ModelMedia,
    items: &'a [media::MediaItem],
    encoders: &'a [Arc<Worker>],
    /// The unique part of the answer's id ([`api::RESPONSE_ID_HEADER`]).
    response_id: &'a str,
}

/// One attempt of a request with media: the media goes to its encoders and the request to
/// `worker` at once (or after the media is encoded, with `[encoders] blocking`); an item that
/// cannot be encoded turns the answer text-only (the worker is told), an item that does not
/// decode is the client's error.
async fn media_attempt(
    state: &AppState,
    worker: &Worker,
    endpoint: Endpoint,
    body: Bytes,
    stream: bool,
    plan: MediaPlan,
    media: MediaRequest<'_>,
) -> Result<(Outcome, Option<&'static str>), ApiError> {
    let header = serde_json::to_string(&plan).unwrap_or_default();
    let llm_url = worker.uri("").to_string();
    let encode = encoders::encode_request(
        &state.encoders,
        media.model,
        media.settings,
        media.items,
        media.encoders,
        &llm_url,
        &plan.request,
    );
    if state.encoders.config().blocking {
        let verdict = encode.await;
        if let Verdict::TextOnly(reason) = verdict {
            abandon(state, worker, &plan.request, reason).await;
        }
        return match verdict {
            Verdict::ClientError(err) => Err(err),
            Verdict::TextOnly(reason) => Ok((
                attempt_on(state, worker, endpoint, body, stream, Some(&header), media.response_id).await,
                Some(reason),
            )),
            Verdict::Delivered { .. } => Ok((
                attempt_on(state, worker, endpoint, body, stream, Some(&header), media.response_id).await,
                None,
            )),
        };
    }
    let llm = attempt_on(state, worker, endpoint, body, stream, Some(&header), media.response_id);
    tokio::pin!(llm);
    tokio::pin!(encode);
    let verdict = tokio::select! {
        verdict = &mut encode => verdict,
        // The worker answered (an error) or failed before the media settled.
        attempt = &mut llm => return Ok((attempt, None)),
    };
    match verdict {
        // Dropping the worker's request cancels it there.
        Verdict::ClientError(err) => Err(err),
        Verdict::TextOnly(reason) => {
            abandon(state, worker, &plan.request, reason).await;
            Ok((llm.await, Some(reason)))
        }
        Verdict::Delivered { .. } => Ok((llm.await, None)),
    }
}

/// Tells `worker` that `request`'s media will not come (its own feature timeout is the
/// backstop if this is lost).
async fn abandon(state: &AppState, worker: &Worker, request: &str, reason: &str) {
    let call =
        Request::post(worker.uri(&abandon_path(request))).body(Full::new(Bytes::copy_from_slice(reason.as_bytes())));
    let Ok(call) = call else { return };
    if let Err(err) = state.client.send_within(call, std::time::Duration::from_secs(2)).await {
        tracing::warn!(worker = %worker.name, error = %err, "cannot tell the worker to go on without media");
    }
}

/// Sends the request to `worker` and waits for its first body bytes (a streamed answer) or its
/// head: a worker that cannot be reached, answers 5xx or breaks off before them has failed the
/// attempt, and is counted by its breaker; one that answers 429 or 503 is busy. With stream
/// migration on (`forwarding.migration_limit`), a spot worker whose reclaim notice comes first
/// is left at once: nothing of the answer has reached the client, so it starts elsewhere.
pub(super) async fn attempt_on(
    state: &AppState,
    worker: &Worker,
    endpoint: Endpoint,
    body: Bytes,
    stream: bool,
    media_plan: Option<&str>,
    response_id: &str,
) -> Outcome {
    let attempt = first_bytes(state, worker, endpoint, body, stream, media_plan, response_id);
    if !worker.spot || state.forwarding.migration_limit == 0 {
        return attempt.await;
    }
    tokio::select! {
        outcome = attempt => outcome,
        () = worker.reclaimed() => Outcome::Reclaimed,
    }
}

/// [`attempt_on`]'s request and wait.
async fn first_bytes(
    state: &AppState,
    worker: &Worker,
    endpoint: Endpoint,
    body: Bytes,
    stream: bool,
    media_plan: Option<&str>,
    response_id: &str,
) -> Outcome {
    let mut request = Request::post(worker.endpoint_uri(endpoint.path()))
        .header(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .header(api::RESPONSE_ID_HEADER, response_id);
    if let Some(plan) = media_plan {
        request = request.header(MEDIA_PLAN_HEADER, plan);
    }
    let request = request.body(Full::new(body));
    let request = match request {
        Ok(request) => request,
        Err(err) => return Outcome::Failed(format!("could not build the request: {err}")),
    };
    let backoffs = state.forwarding.backoffs();
    let response = match state.client.answer(request).await {
        Ok(response) => response,
        Err(err) => {
            if err.is_connect() {
                state.router.unreachable(worker);
            } else {
                state.router.failed_answer(worker, &backoffs);
            }
            return Outcome::Failed(err.to_string());
        }
    };
    let (parts, mut rest) = response.into_parts();
    if matches!(
        parts.status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        return Outcome::Busy {
            status: parts.status,
            retry_after: retry_after(&parts.headers),
        };
    }
    if parts.status.is_server_error() {
        state.router.failed_answer(worker, &backoffs);
        let detail = read_error_message(rest).await;
        return Outcome::Failed(format!("answered {}: {detail}", parts.status));
    }
    if !stream || !parts.status.is_success() {
        worker.answered();
        return Outcome::Answered(Answer {
            response: parts,
            first: None,
            rest,
        });
    }
    // Wait for the first data bytes: a worker that dies before them is retried elsewhere.
    loop {
        match rest.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if data.is_empty() => continue,
                Ok(data) => {
                    worker.answered();
                    return Outcome::Answered(Answer {
                        response: parts,
                        first: Some(data),
                        rest,
                    });
                }
                Err(_) => continue,
            },
            Some(Err(err)) => {
                state.router.failed_answer(worker, &backoffs);
                return Outcome::Failed(format!("stream broke before the first byte: {err}"));
            }
            None => {
                state.router.failed_answer(worker, &backoffs);
                return Outcome::Failed("stream ended before the first byte".into());
            }
        }
    }
}

/// A `Retry-After` given in seconds (the HTTP-date form is not used by engines, and is ignored).
fn retry_after(headers: &http::HeaderMap) -> Option<std::time::Duration> {
    let seconds: u64 = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(std::time::Duration::from_secs(seconds))
}

async fn read_error_message(body: UpstreamBody) -> String {
    match http_body_util::Limited::new(body, 64 << 10).collect().await {
        Ok(collected) => {
            let bytes = collected.to_bytes();
            serde_json::from_slice::<api::ErrorBody>(&bytes)
                .map(|body| body.error.message)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
        }
        Err(err) => format!("(error body unreadable: {err})"),
    }
}
