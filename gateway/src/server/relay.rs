//! Forwarding a generation request to a worker and relaying its answer.
//!
//! The body is read under the size limit and validated before any worker is chosen, so bad
//! input never costs a worker anything. The request then goes to the chosen worker unchanged;
//! a request with media also carries its media plan, while its items go to encoders through
//! [`crate::encoders`] (the client's answer starts only once the media has settled: merged,
//! text-only, or a client error).
//! A worker that cannot be reached, answers 5xx, or breaks off before its first body byte is
//! left for another worker (up to `forwarding.retries` times: the policy's fallbacks first,
//! then the policy again; see [`crate::routing`]); an unreachable one is also taken out of
//! rotation at once. Streamed answers are relayed as they arrive (a stream whose events come
//! faster than `server.stream_coalesce_us` apart has them written a window's worth at a time:
//! see `coalesce.rs`); if the worker fails mid-stream the client gets a final SSE error event
//! and a clean end of stream. Whole answers are read to the end first, so a failure becomes a 502.

use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use memchr::memmem;
use switchyard_protocol::api::{self, ApiError, Endpoint};
use switchyard_protocol::respond::{self, Body};

use switchyard_tokenize::{MediaSlot, media_token};

use switchyard_protocol::encode::{
    LOCAL_ENCODER, MEDIA_PLAN_HEADER, MERGE_HEADER, MediaPlan, PlannedItem, abandon_path, estimate_ms,
};

use super::coalesce::{Coalescer, Offer};
use crate::admission;
use crate::encoders::{self, Verdict};
use crate::kv::PromptBlocks;
use crate::media;
use crate::metrics::Metrics;
use crate::routing::{self, Lease};
use crate::slo;
use crate::state::AppState;
use crate::tenants::usage::{self, UsageTap};
use crate::tenants::{Charge, Grant};
use crate::workers::Worker;
use crate::workers::upstream::UpstreamBody;

/// Largest whole (non-streamed) answer accepted from a worker.
const MAX_WORKER_RESPONSE_BYTES: usize = 64 << 20;

/// Header naming the worker that served a request.
pub const WORKER_HEADER: &str = "x-switchyard-worker";

/// Header naming the policy version (or fallback) that chose the worker.
pub const POLICY_HEADER: &str = "x-switchyard-policy";

/// Header saying how a request's media was served (`text-only; reason=...` when it was left
/// out of the answer).
pub const MEDIA_HEADER: &str = switchyard_protocol::encode::MEDIA_HEADER;

/// The prompt of a request with media: tokenized with a span per media item, videos sized to
/// the room the text leaves, then hashed.
fn media_prompt(
    state: &AppState,
    parsed: &api::GenerateRequest,
    limits: &media::ModelLimits,
    items: &mut [media::MediaItem],
    fallback_block_size: impl FnOnce() -> usize,
) -> Result<(PromptBlocks, Vec<std::ops::Range<u32>>), ApiError> {
    let slots = |items: &[media::MediaItem]| -> Vec<MediaSlot> {
        items
            .iter()
            .map(|item| MediaSlot {
                token: media_token(item.id().0),
                tokens: item.tokens,
            })
            .collect()
    };
    let (layout, settings) = state
        .router
        .kv()
        .prompt_with_media(parsed.model(), fallback_block_size, parsed, &slots(items))
        .map_err(tokenization_failed)?;
    let sized: u32 = items.iter().map(|item| item.tokens).sum();
    let text_tokens = u32::try_from(layout.tokens.len())
        .unwrap_or(u32::MAX)
        .saturating_sub(sized);
    let max_tokens = parsed.token_limit().unwrap_or(0);
    media::size_videos(items, &limits.media, limits.max_model_len, text_tokens, max_tokens)?;
    let layout = layout.with_slots(&slots(items));
    let total = u64::from(text_tokens) + items.iter().map(|item| u64::from(item.tokens)).sum::<u64>();
    if total + u64::from(max_tokens) > u64::from(limits.max_model_len) {
        return Err(ApiError::invalid_request(
            "context_length_exceeded",
            format!(
                "the prompt needs {total} tokens ({text_tokens} text, {} media) and max_tokens {max_tokens}, more than the model's {} token context",
                total - u64::from(text_tokens),
                limits.max_model_len
            ),
        )
        .with_param(Some("messages".into())));
    }
    Ok((settings.blocks(&layout.tokens), layout.spans))
}

/// Request bodies larger than this are tokenized on a blocking thread.
const TOKENIZE_INLINE_BYTES: usize = 64 << 10;

/// Text bytes per allowed prompt token past which a prompt is refused without tokenizing it
/// (real tokenizers average 3-5 bytes per token; 64 leaves room for any text).
const MAX_BYTES_PER_TOKEN: u64 = 64;

/// Bytes of prompt text in a request (message texts, or the completion prompt; four per id
/// of a token prompt).
fn prompt_text_bytes(request: &switchyard_protocol::api::GenerateRequest) -> u64 {
    use switchyard_protocol::api::{GenerateRequest, MessageContent, Prompt};
    match request {
        GenerateRequest::Chat(chat) => chat
            .messages
            .iter()
            .map(|message| match &message.content {
                Some(MessageContent::Text(text)) => text.len() as u64,
                Some(MessageContent::Parts(parts)) => parts
                    .iter()
                    .map(|part| part.text.as_ref().map_or(0, |t| t.len() as u64))
                    .sum(),
                None => 0,
            })
            .sum(),
        GenerateRequest::Completion(completion) => match &completion.prompt {
            Prompt::Text(text) => text.len() as u64,
            Prompt::Tokens(ids) => ids.len() as u64 * 4,
            Prompt::TextBatch(texts) => texts.iter().map(|t| t.len() as u64).sum(),
            Prompt::TokenBatch(batches) => batches.iter().map(|ids| ids.len() as u64 * 4).sum(),
        },
    }
}

/// The client error for a prompt over the model's `max_prompt_tokens`.
fn prompt_too_long(model: &str, tokens: Option<usize>, max: u32) -> ApiError {
    let what = match tokens {
        Some(tokens) => format!("{tokens} tokens"),
        None => "far more text than that".to_string(),
    };
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "prompt_too_long",
        format!("the prompt is {what}; model `{model}` takes at most {max} prompt tokens"),
    )
    .with_param(Some("messages".into()))
}

/// The client error for a prompt the model's tokenizer or template cannot take.
fn tokenization_failed(err: switchyard_tokenize::TokenizeError) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "tokenization_failed",
        err.to_string(),
    )
}

/// Validates a generation request, forwards it, and relays the answer.
pub(crate) async fn generate(
    state: &AppState,
    endpoint: Endpoint,
    request: Request<Incoming>,
    started: Instant,
    grant: Option<Arc<Grant>>,
) -> Result<Response<Body>, ApiError> {
    let (parts, body) = request.into_parts();
    let mut body = respond::read_limited(&parts.headers, body, state.server.max_body_bytes).await?;
    let parsed = api::parse_generate_request(endpoint, &body)?;
    let model = parsed.model();
    let router = &state.router;
    let pool = router.pool();
    if !pool.serves(model) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "model `{model}` does not exist; available models: {}",
                pool.models().join(", ")
            ),
        )
        .with_param(Some("model".into())));
    }
    // The tenant's limits are checked before any tokenizing, so a tenant over them costs little.
    let mut charge = grant
        .as_ref()
        .map(|grant| state.tenants.admit(grant, model))
        .transpose()?;
    let stream = parsed.is_stream();
    let fallback_block_size = || pool.candidates(model, &[]).first().map_or(64, |w| w.block_size);
    let model_limits = state.media.model(model);
    let targets = slo::Targets::of_request(&parts.headers, model_limits.targets)?;
    let mut fetched = match &state.fetcher {
        Some(fetcher) => fetcher
            .fetch_request(&parsed)
            .await
            .map_err(|(message, part, why)| media::fetch_error(message, part, why))?,
        None => Default::default(),
    };
    let mut media_items = media::inspect(
        &parsed,
        &state.media.config,
        &state.media.limits,
        &model_limits.media,
        &mut fetched,
    )?;
    let max_prompt_tokens = model_limits.max_prompt_tokens;
    if prompt_text_bytes(&parsed) > u64::from(max_prompt_tokens) * MAX_BYTES_PER_TOKEN {
        // Refused before any tokenizing: no tokenizer packs this much text into so few tokens.
        return Err(prompt_too_long(model, None, max_prompt_tokens));
    }
    let (prompt, spans) = if media_items.is_empty() {
        let prompt = if body.len() > TOKENIZE_INLINE_BYTES {
            // A large prompt is rendered and tokenized on a blocking thread, off the executor
            // that serves every other connection.
            let (kv, request, block_size) = (router.kv().clone(), parsed.clone(), fallback_block_size());
            tokio::task::spawn_blocking(move || kv.prompt_blocks(request.model(), || block_size, &request))
                .await
                .map_err(|err| {
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "tokenizer_failed",
                        format!("the tokenizing thread failed: {err}"),
                    )
                })?
        } else {
            router.kv().prompt_blocks(model, fallback_block_size, &parsed)
        };
        (prompt.map_err(tokenization_failed)?, Vec::new())
    } else {
        media_prompt(state, &parsed, &model_limits, &mut media_items, fallback_block_size)?
    };
    if prompt.tokens > max_prompt_tokens as usize {
        return Err(prompt_too_long(model, Some(prompt.tokens), max_prompt_tokens));
    }
    if let Some(charge) = &mut charge {
        charge.prompt(prompt.tokens);
    }
    // Waits here while every worker of the model is full (`[admission]`); the reservation is
    // held until the request has its worker.
    let mut admitted = Some(
        state
            .admission
            .enter(
                model,
                admission::Ticket {
                    grant: grant.as_deref(),
                    tokens: prompt.tokens,
                },
            )
            .await?,
    );
    // A tenant's streamed tokens are counted from the usage chunk, which the worker sends
    // only when asked; where the client did not ask, the chunk is asked for and taken out.
    let strip_usage = charge.is_some() && stream && !parsed.include_usage();
    if strip_usage && let Some(asked) = usage::ask_for_usage(&body) {
        body = asked;
    }
    let media_tokens = media_items.iter().map(|item| item.tokens).sum::<u32>();
    for item in &media_items {
        state.metrics.media_item(media::kind_label(item.info.kind), item.tokens);
    }
    // Every item needs an encoder of its kind; without one the answer is the text's alone.
    let chosen: Option<Vec<Arc<Worker>>> = media_items
        .iter()
        .map(|item| state.encoders.choose(model, item, &[]))
        .collect();
    // The encoders join the router's table, so a policy may choose them with the worker;
    // without an encoder pool (`[encoders] local`) each worker encodes its own media.
    let local = state.encoders.config().local;
    let encoder_rows = match &chosen {
        Some(_) if !media_items.is_empty() && !local => state.encoders.rows(model, &media_items),
        _ => Vec::new(),
    };
    let planned = |request: String, encoders: &mut dyn Iterator<Item = String>| MediaPlan {
        request,
        items: media_items
            .iter()
            .zip(&spans)
            .map(|(item, span)| PlannedItem {
                media_id: item.id(),
                kind: item.info.kind,
                tokens: item.tokens,
                start: span.start,
                encoder: encoders.next().unwrap_or_default(),
                estimate_us: (estimate_ms(item.info.kind, item.frames.len(), item.info.duration_s) * 1000.0) as u64,
            })
            .collect(),
    };
    let id = router.next_request_id();
    state.slo.arrived(model, prompt.tokens as u64);
    let affinity = router.affinity(|header| parts.headers.get(header).map(|value| value.as_bytes().to_vec()));
    let mut attempts = router.attempts(routing::Request {
        id,
        model,
        prompt: &prompt,
        max_tokens: parsed.token_limit(),
        media_tokens,
        affinity,
        encoders: &encoder_rows,
        ttft_target_ms: targets.ttft_ms.unwrap_or(0.0),
    });
    // Unique per gateway: the answer's id (the same on every attempt) and, with the attempt,
    // the key the request's media is planned under.
    let response_id = format!("{:016x}-{id}", router.kv().origin());
    let mut last_failure: Option<String> = None;
    for attempt in 0..=state.forwarding.retries {
        let Some(mut lease) = attempts.next_lease() else {
            break;
        };
        // The worker's own count holds the request now.
        admitted.take();
        if attempt > 0 {
            state.metrics.retry();
        }
        let worker = lease.worker().clone();
        // The policy's encoder for a role wins; the host's choice fills the rest.
        let chosen = chosen.as_ref().map(|host| {
            media_items
                .iter()
                .zip(host)
                .map(|(item, host)| {
                    lease
                        .encoder_for(encoders::role_for(item.info.kind))
                        .unwrap_or(host)
                        .clone()
                })
                .collect::<Vec<_>>()
        });
        let request_key = || format!("{response_id}-{attempt}");
        let (outcome, text_only) = match &chosen {
            _ if local && !media_items.is_empty() => {
                let plan = planned(request_key(), &mut std::iter::repeat(LOCAL_ENCODER.to_string()));
                let header = serde_json::to_string(&plan).unwrap_or_default();
                (
                    attempt_on(
                        state,
                        &worker,
                        endpoint,
                        body.clone(),
                        stream,
                        Some(&header),
                        &response_id,
                    )
                    .await,
                    None,
                )
            }
            Some(chosen) if !media_items.is_empty() => {
                let plan = planned(request_key(), &mut chosen.iter().map(|encoder| encoder.name.clone()));
                let media = MediaRequest {
                    model,
                    settings: &model_limits.media,
                    items: &media_items,
                    encoders: chosen,
                    response_id: &response_id,
                };
                media_attempt(state, &worker, endpoint, body.clone(), stream, plan, media).await?
            }
            Some(_) => (
                attempt_on(state, &worker, endpoint, body.clone(), stream, None, &response_id).await,
                None,
            ),
            None => (
                attempt_on(state, &worker, endpoint, body.clone(), stream, None, &response_id).await,
                Some(encoders::REASON_NO_ENCODER),
            ),
        };
        match outcome {
            Attempt::Answered(response) => {
                lease.first_token(stream && media_items.is_empty());
                if !prompt.hashes.is_empty() {
                    router
                        .kv()
                        .metrics
                        .overlap_ratio
                        .observe(f64::from(lease.overlap()) / prompt.hashes.len() as f64);
                }
                let policy_header = lease.routed().header_value();
                let accounting = charge.take().map(|charge| Accounting {
                    charge,
                    strip: strip_usage,
                });
                let judged = Judged {
                    model,
                    targets,
                    prompt_tokens: prompt.tokens as u64,
                    usage_asked: parsed.include_usage(),
                };
                let response = finish(state, endpoint, response, lease, started, stream, accounting, judged).await;
                let mut response = with_routing_headers(response, &worker, policy_header);
                if let Some(reason) = text_only {
                    // The media was left out: say so, never silently.
                    if let Ok(value) = HeaderValue::from_str(&format!("text-only; reason={reason}")) {
                        response.headers_mut().insert(MEDIA_HEADER, value);
                    }
                }
                // Counted whether the gateway or the worker (features late or evicted) fell back.
                if let Some(reason) = response
                    .headers()
                    .get(MEDIA_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.split("reason=").nth(1))
                {
                    state.metrics.media_text_only(reason);
                }
                return Ok(response);
            }
            Attempt::Failed(reason) => {
                tracing::warn!(worker = %worker.name, %reason, "worker failed before its first byte");
                last_failure = Some(format!("worker `{}`: {reason}", worker.name));
            }
        }
    }
    Err(match last_failure {
        None => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no_healthy_worker",
            format!("no healthy worker is available for model `{model}`; try again shortly"),
        ),
        Some(reason) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_unavailable",
            format!("every worker tried failed before answering; last: {reason}"),
        ),
    })
}

/// A worker's answer whose first body bytes (if any) have already arrived.
struct Answer {
    response: http::response::Parts,
    first: Option<Bytes>,
    rest: UpstreamBody,
}

enum Attempt {
    Answered(Answer),
    Failed(String),
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
) -> Result<(Attempt, Option<&'static str>), ApiError> {
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

async fn attempt_on(
    state: &AppState,
    worker: &Worker,
    endpoint: Endpoint,
    body: Bytes,
    stream: bool,
    media_plan: Option<&str>,
    response_id: &str,
) -> Attempt {
    let mut request = Request::post(worker.endpoint_uri(endpoint.path()))
        .header(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .header(api::RESPONSE_ID_HEADER, response_id);
    if let Some(plan) = media_plan {
        request = request.header(MEDIA_PLAN_HEADER, plan);
    }
    let request = request.body(Full::new(body));
    let request = match request {
        Ok(request) => request,
        Err(err) => return Attempt::Failed(format!("could not build the request: {err}")),
    };
    let response = match state.client.answer(request).await {
        Ok(response) => response,
        Err(err) => {
            if err.is_connect() {
                state.router.unreachable(worker);
            } else {
                state.router.failed_answer(worker, state.forwarding.errors_to_eject);
            }
            return Attempt::Failed(err.to_string());
        }
    };
    let (parts, mut rest) = response.into_parts();
    if parts.status.is_server_error() {
        state.router.failed_answer(worker, state.forwarding.errors_to_eject);
        let detail = read_error_message(rest).await;
        return Attempt::Failed(format!("answered {}: {detail}", parts.status));
    }
    if !stream || !parts.status.is_success() {
        worker.record_answer();
        return Attempt::Answered(Answer {
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
                    worker.record_answer();
                    return Attempt::Answered(Answer {
                        response: parts,
                        first: Some(data),
                        rest,
                    });
                }
                Err(_) => continue,
            },
            Some(Err(err)) => {
                state.router.failed_answer(worker, state.forwarding.errors_to_eject);
                return Attempt::Failed(format!("stream broke before the first byte: {err}"));
            }
            None => {
                state.router.failed_answer(worker, state.forwarding.errors_to_eject);
                return Attempt::Failed("stream ended before the first byte".into());
            }
        }
    }
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

/// A tenant's charge for a request, and whether the usage-only chunk is the gateway's own
/// (asked for to count the tenant's tokens) and so taken out of the client's stream.
struct Accounting {
    charge: Charge,
    strip: bool,
}

/// What an answer is judged by: its model, its latency targets, and the prompt's tokens as the
/// gateway counted them (the cost served when the worker reports no usage).
struct Judged<'a> {
    model: &'a str,
    targets: slo::Targets,
    prompt_tokens: u64,
    /// The client asked for the usage chunk: the stream's usage can be read without a tenant.
    usage_asked: bool,
}

#[allow(clippy::too_many_arguments, reason = "the parts of one answer, each used once")]
async fn finish(
    state: &AppState,
    endpoint: Endpoint,
    answer: Answer,
    lease: Lease,
    started: Instant,
    stream: bool,
    mut accounting: Option<Accounting>,
    judged: Judged<'_>,
) -> Response<Body> {
    let label = endpoint.label();
    let Answer {
        response: parts,
        first,
        rest,
    } = answer;
    if parts.status.is_success()
        && let Some(accounting) = &mut accounting
    {
        accounting.charge.served();
    }
    let tenant = accounting
        .as_ref()
        .map(|accounting| accounting.charge.tenant().to_string());
    let record = |seconds: f64| {
        state.metrics.time_to_first_byte(label, seconds);
        state.live.record(&lease.worker().name, tenant.as_deref(), seconds);
    };
    if stream && parts.status.is_success() {
        let ttft = started.elapsed().as_secs_f64();
        record(ttft);
        let timing = StreamTiming {
            metrics: state.slo.clone(),
            model: judged.model.to_string(),
            worker: lease.worker().clone(),
            targets: judged.targets,
            ttft_ms: ttft * 1000.0,
            prompt_tokens: judged.prompt_tokens,
            chunks: 0,
            first_at: None,
            last_at: None,
            gaps_us: Vec::new(),
        };
        let (tap, charge) = match accounting {
            Some(Accounting { charge, strip }) => (Some(UsageTap::new(strip)), Some(charge)),
            None => (judged.usage_asked.then(|| UsageTap::new(false)), None),
        };
        let mut body = RelayBody {
            first: None,
            inner: rest,
            done: false,
            lease: Some(lease),
            metrics: state.metrics.clone(),
            label,
            started,
            tap,
            charge,
            timing: Some(timing),
            coalescer: Coalescer::new(state.server.stream_coalesce()),
        };
        body.first = first.map(|first| body.tapped(first)).filter(|first| !first.is_empty());
        let mut response = respond::event_stream(Body::new(body));
        *response.status_mut() = parts.status;
        copy_headers(&parts.headers, &mut response, &[MERGE_HEADER, MEDIA_HEADER]);
        return response;
    }
    match http_body_util::Limited::new(rest, MAX_WORKER_RESPONSE_BYTES)
        .collect()
        .await
    {
        Ok(collected) => {
            let collected = collected.to_bytes();
            let reported = usage::of_answer(&collected);
            if let (Some(accounting), Some(reported)) = (&mut accounting, reported) {
                accounting.charge.report(reported);
            }
            drop(accounting);
            let elapsed = started.elapsed().as_secs_f64();
            record(elapsed);
            if parts.status.is_success() {
                let worker = lease.worker();
                let tokens = reported.map_or(judged.prompt_tokens, |usage| {
                    u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens)
                });
                let observed = slo::Observed {
                    ttft_ms: elapsed * 1000.0,
                    itl_ms: None,
                    tokens,
                    completion_tokens: reported.map_or(0, |usage| u64::from(usage.completion_tokens)),
                };
                state
                    .slo
                    .judge(judged.model, &worker.name, worker.cost, judged.targets, observed);
            }
            drop(lease);
            state.metrics.request_duration(label, elapsed);
            let mut response = Response::new(respond::full(collected));
            *response.status_mut() = parts.status;
            copy_headers(&parts.headers, &mut response, &[header::CONTENT_TYPE.as_str()]);
            copy_headers(&parts.headers, &mut response, &[MERGE_HEADER, MEDIA_HEADER]);
            response
        }
        Err(err) => {
            let worker = lease.worker().name.clone();
            let err = ApiError::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "worker_failed_mid_response",
                format!("worker `{worker}` failed while sending its answer: {err}"),
            );
            state.metrics.error(err.code());
            respond::error(&err)
        }
    }
}

/// Copies the worker's `names` headers onto the client's response.
fn copy_headers(from: &http::HeaderMap, to: &mut Response<Body>, names: &[&'static str]) {
    for &name in names {
        if let Some(value) = from.get(name) {
            to.headers_mut().insert(name, value.clone());
        }
    }
}

/// Names the worker that served the request and the policy version (or fallback) that chose it.
fn with_routing_headers(mut response: Response<Body>, worker: &Worker, policy: Option<HeaderValue>) -> Response<Body> {
    for (name, value) in [(WORKER_HEADER, worker.name_header()), (POLICY_HEADER, policy)] {
        if let Some(value) = value {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// Relays a worker's SSE stream frame by frame and holds the request's lease on the worker
/// (its in-flight count and active sequence) until the stream ends or the client goes away.
struct RelayBody {
    first: Option<Bytes>,
    inner: UpstreamBody,
    done: bool,
    lease: Option<Lease>,
    metrics: Arc<Metrics>,
    label: &'static str,
    started: Instant,
    /// Reads the tenant's usage from the stream (and takes out the chunk the client did not
    /// ask for).
    tap: Option<UsageTap>,
    /// The tenant's charge, settled when the stream ends or the client goes away.
    charge: Option<Charge>,
    /// The stream's chunk times, judged against its targets when it ends.
    timing: Option<StreamTiming>,
    /// Paces writes to the client (`server.stream_coalesce_us`).
    coalescer: Coalescer,
}

/// What a stream's latency and cost are judged by, gathered as its chunks pass.
struct StreamTiming {
    metrics: slo::SloMetrics,
    model: String,
    worker: Arc<Worker>,
    targets: slo::Targets,
    ttft_ms: f64,
    prompt_tokens: u64,
    /// SSE data events seen, `[DONE]` aside.
    chunks: u64,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    /// Gaps between its chunks (µs; a frame of k chunks after a gap g counts k gaps of g/k),
    /// the first [`MAX_GAPS`] of them.
    gaps_us: Vec<u32>,
}

/// Gaps kept per stream for the worker's typical gap: enough for a stable median, and few
/// enough that the worker hears of it within seconds, not when a long answer ends (a router
/// weighing measured speed is blind until then: the first version reported at the end, and on
/// a replay whose answers ran 30 s `cost-aware` took slow workers for fast ones for most of it).
const MAX_GAPS: usize = 16;

impl StreamTiming {
    fn saw(&mut self, data: &[u8]) {
        // Built once: a searcher built per call was ~0.5 % of a busy gateway's CPU.
        static DATA: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"data:"));
        static DONE: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"[DONE]"));
        let events = DATA.find_iter(data).count() as u64;
        let done = DONE.find_iter(data).count() as u64;
        let chunks = events.saturating_sub(done);
        if chunks == 0 {
            return;
        }
        let now = Instant::now();
        if let Some(last) = self.last_at
            && self.gaps_us.len() < MAX_GAPS
        {
            let gap_us = (now.duration_since(last).as_micros() / u128::from(chunks)).min(u128::from(u32::MAX)) as u32;
            let room = MAX_GAPS - self.gaps_us.len();
            self.gaps_us
                .extend(std::iter::repeat_n(gap_us, (chunks as usize).min(room)));
            // Reached once: gaps are kept only while there are fewer.
            if self.gaps_us.len() == MAX_GAPS {
                self.report_itl();
            }
        }
        self.first_at.get_or_insert(now);
        self.last_at = Some(now);
        self.chunks += chunks;
    }

    /// The median gap between chunks, in milliseconds: the engine's plain decode step. Unlike
    /// the mean, it is not raised by the few steps that also carried other requests' prefill,
    /// so it tells a slow engine from a busy one.
    fn median_gap_ms(&mut self) -> Option<f64> {
        if self.gaps_us.is_empty() {
            return None;
        }
        let middle = self.gaps_us.len() / 2;
        let (_, median, _) = self.gaps_us.select_nth_unstable(middle);
        Some(f64::from(*median) / 1000.0)
    }

    /// Tells the worker this stream's typical gap (the `measured` import of routers that
    /// weigh a worker's own speed).
    fn report_itl(&mut self) {
        if let Some(gap_ms) = self.median_gap_ms() {
            self.worker.observe_itl(gap_ms);
        }
    }

    /// Judges the stream, with the usage the worker reported if it did.
    fn judge(mut self, reported: Option<api::Usage>) {
        let itl_ms = match (self.first_at, self.last_at) {
            (Some(first), Some(last)) if self.chunks >= 2 => {
                Some(last.duration_since(first).as_secs_f64() * 1000.0 / (self.chunks - 1) as f64)
            }
            _ => None,
        };
        let tokens = reported.map_or(self.prompt_tokens + self.chunks, |usage| {
            u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens)
        });
        // A stream that reached MAX_GAPS gaps reported then; a shorter one reports what it has.
        if self.gaps_us.len() < MAX_GAPS {
            self.report_itl();
        }
        let observed = slo::Observed {
            ttft_ms: self.ttft_ms,
            itl_ms,
            tokens,
            completion_tokens: reported.map_or(self.chunks, |usage| u64::from(usage.completion_tokens)),
        };
        self.metrics
            .judge(&self.model, &self.worker.name, self.worker.cost, self.targets, observed);
    }
}

impl RelayBody {
    /// What of `data` goes on to the client, noting any usage in it.
    fn tapped(&mut self, data: Bytes) -> Bytes {
        if let Some(timing) = &mut self.timing {
            timing.saw(&data);
        }
        let Some(tap) = &mut self.tap else { return data };
        let data = tap.feed(data);
        if let (Some(reported), Some(charge)) = (tap.usage(), &mut self.charge) {
            charge.report(reported);
        }
        data
    }

    fn end(&mut self) {
        self.done = true;
        self.lease = None;
        self.charge = None;
        if let Some(timing) = self.timing.take() {
            timing.judge(self.tap.as_ref().and_then(UsageTap::usage));
        }
        self.metrics
            .request_duration(self.label, self.started.elapsed().as_secs_f64());
    }
}

impl http_body::Body for RelayBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            this.coalescer.wrote();
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        // Read everything upstream has ready (so its pace is measured as it comes), writing at
        // once what the coalescer lets through, then what it held once it says so (at once for
        // an opening write, else when its window ends).
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    return match this.coalescer.ready(cx) {
                        Poll::Ready(Some(held)) => Poll::Ready(Some(Ok(Frame::data(held)))),
                        Poll::Ready(None) | Poll::Pending => Poll::Pending,
                    };
                }
                Poll::Ready(Some(Ok(frame))) => {
                    // Trailers are not part of the OpenAI stream; skip them.
                    let Ok(data) = frame.into_data() else { continue };
                    let data = this.tapped(data);
                    // Empty: all of it waits in the tap for the rest of its event.
                    if data.is_empty() {
                        continue;
                    }
                    if let Offer::Write(data) = this.coalescer.offer(data) {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Poll::Ready(Some(Err(err))) => {
                    let worker = this
                        .lease
                        .as_ref()
                        .map(|lease| lease.worker().name.clone())
                        .unwrap_or_default();
                    let error = ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "server_error",
                        "worker_failed_mid_stream",
                        format!("worker `{worker}` failed mid-stream: {err}"),
                    );
                    this.metrics.error(error.code());
                    this.end();
                    let last = this.coalescer.finish(error.to_sse_event());
                    return Poll::Ready(Some(Ok(Frame::data(last))));
                }
                Poll::Ready(None) => {
                    let rest = this.tap.as_mut().map(UsageTap::finish).unwrap_or_default();
                    this.end();
                    let last = this.coalescer.finish(rest);
                    return if last.is_empty() {
                        Poll::Ready(None)
                    } else {
                        Poll::Ready(Some(Ok(Frame::data(last))))
                    };
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none()
    }
}
