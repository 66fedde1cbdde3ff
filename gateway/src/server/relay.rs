//! Stage 6 of the request path: the answer relayed to the client, and what it is judged by.
//!
//! Streamed answers are relayed as they arrive (a stream whose events come faster than
//! `server.stream_coalesce_us` apart has them written a window's worth at a time: see
//! `coalesce.rs`); if the worker fails mid-stream the stream goes on on another worker where
//! it can (`forwarding.migration_limit`, see `migrate`), else the client gets a final SSE
//! error event and a clean end of stream. Whole answers are read to the end first, so a
//! failure becomes a 502.
//! The request's lease on its worker lasts until the answer ends or the client goes away;
//! then the tenant is charged (from the usage the worker reported, or, for a stream the client
//! left before its usage came, from the prompt and the chunks relayed) and the answer's
//! latency is judged against the request's targets, whichever way the stream ended.

use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::BodyExt;
use memchr::memmem;
use switchyard_protocol::api::{self, ApiError};
use switchyard_protocol::encode::MERGE_HEADER;
use switchyard_protocol::respond::{self, Body};

use super::coalesce::{Coalescer, Offer};
use super::disagg;
use super::forward::{Answer, Forwarded};
use super::migrate::{Break, Migration};
use super::pipeline::Admitted;
use super::prompt::Prepared;
use crate::metrics::Metrics;
use crate::routing::Lease;
use crate::slo;
use crate::state::AppState;
use crate::tenants::Charge;
use crate::tenants::usage::{self, UsageTap};
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

/// Stage 6: relays the answer a worker gave, names the worker and the policy that chose it
/// (and, when the media was left out, why), charges the tenant and judges the latency once
/// the answer ends.
pub(super) async fn finish(
    state: &Arc<AppState>,
    admitted: Admitted,
    prepared: &Prepared,
    forwarded: Forwarded,
    started: Instant,
) -> Response<Body> {
    let Forwarded {
        answer,
        mut lease,
        text_only,
        strip_usage,
        seed,
        prefilled,
    } = forwarded;
    let stream = admitted.stream();
    let prompt = &prepared.prompt;
    lease.first_token(stream && prepared.media_items.is_empty());
    if !prompt.hashes.is_empty() {
        state
            .router
            .kv()
            .metrics
            .overlap_ratio
            .observe(f64::from(lease.overlap()) / prompt.hashes.len() as f64);
    }
    let worker = lease.worker().clone();
    let policy_header = lease.routed().header_value();
    let Admitted {
        endpoint,
        parsed,
        charge,
        targets,
        ..
    } = admitted;
    let migration = seed
        .filter(|_| stream)
        .map(|seed| Migration::new(state.clone(), endpoint, &parsed, strip_usage, seed, &worker));
    let accounting = charge.map(|charge| Accounting {
        charge,
        strip: strip_usage,
    });
    let judged = Judged {
        model: parsed.model(),
        targets,
        prompt_tokens: prompt.tokens as u64,
        usage_asked: parsed.include_usage(),
        prefilled_remotely: matches!(prefilled, Some(disagg::Prefilled::Remote { .. })),
    };
    let relay = Relay {
        state,
        label: endpoint.label(),
        started,
        accounting,
        judged,
    };
    let kv_transfer = answer.response.headers.get(disagg::KV_TRANSFER_HEADER).cloned();
    let response = relay.answer(answer, lease, stream, migration).await;
    let mut response = with_routing_headers(response, &worker, policy_header);
    if let Some(value) = prefilled.and_then(|outcome| outcome.report(state)) {
        response.headers_mut().insert(disagg::DISAGG_HEADER, value);
        if let Some(kv_transfer) = kv_transfer {
            response.headers_mut().insert(disagg::KV_TRANSFER_HEADER, kv_transfer);
        }
    }
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
    response
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
    /// A prefill worker computed the prompt (for the planner's prefill pool).
    prefilled_remotely: bool,
}

/// What relaying one answer needs besides the answer and its lease.
struct Relay<'a> {
    state: &'a AppState,
    /// The endpoint's metric label.
    label: &'static str,
    /// When the request arrived.
    started: Instant,
    accounting: Option<Accounting>,
    judged: Judged<'a>,
}

impl Relay<'_> {
    /// Relays `answer` under `lease`: a successful stream as it comes, anything else once
    /// read whole. The time to its first byte is recorded either way.
    async fn answer(
        mut self,
        answer: Answer,
        lease: Lease,
        stream: bool,
        migration: Option<Migration>,
    ) -> Response<Body> {
        let success = answer.response.status.is_success();
        if success && let Some(accounting) = &mut self.accounting {
            accounting.charge.served();
        }
        let tenant = self
            .accounting
            .as_ref()
            .map(|accounting| accounting.charge.tenant().to_string());
        let (state, label, worker) = (self.state, self.label, lease.worker().clone());
        let record = move |seconds: f64| {
            state.metrics.time_to_first_byte(label, seconds);
            state.live.record(&worker.name, tenant.as_deref(), seconds);
        };
        if stream && success {
            let ttft = self.started.elapsed().as_secs_f64();
            record(ttft);
            return self.stream(answer, lease, ttft, migration);
        }
        self.whole(answer, lease, record).await
    }

    /// The client's event stream, relaying `answer`'s as it comes ([`RelayBody`]); the lease,
    /// the charge and the judging go with it until it ends.
    fn stream(self, answer: Answer, lease: Lease, ttft: f64, migration: Option<Migration>) -> Response<Body> {
        let Answer {
            response: parts,
            first,
            rest,
        } = answer;
        let judged = self.judged;
        let timing = StreamTiming {
            metrics: self.state.slo.clone(),
            model: judged.model.to_string(),
            worker: lease.worker().clone(),
            targets: judged.targets,
            ttft_ms: ttft * 1000.0,
            prompt_tokens: judged.prompt_tokens,
            prefilled_remotely: judged.prefilled_remotely,
            chunks: 0,
            first_at: None,
            last_at: None,
            gaps_us: Vec::new(),
        };
        let (tap, charge) = match self.accounting {
            Some(Accounting { charge, strip }) => (Some(UsageTap::new(strip)), Some(charge)),
            None => (judged.usage_asked.then(|| UsageTap::new(false)), None),
        };
        let mut body = RelayBody {
            first: None,
            inner: Some(rest),
            migration: migration.map(Box::new),
            break_next: None,
            done: false,
            lease: Some(lease),
            metrics: self.state.metrics.clone(),
            label: self.label,
            started: self.started,
            tap,
            broken: None,
            charge,
            timing: Some(timing),
            coalescer: Coalescer::new(self.state.server.stream_coalesce()),
        };
        body.first = first.map(|first| body.read(first)).filter(|first| !first.is_empty());
        let mut response = respond::event_stream(Body::new(body));
        *response.status_mut() = parts.status;
        copy_headers(&parts.headers, &mut response, &[MERGE_HEADER, MEDIA_HEADER]);
        response
    }

    /// Reads `answer` whole (up to [`MAX_WORKER_RESPONSE_BYTES`]), charges the usage it
    /// reports and judges it, then answers it; a worker that fails while sending it is a 502.
    async fn whole(mut self, answer: Answer, lease: Lease, record: impl Fn(f64)) -> Response<Body> {
        let Answer {
            response: parts, rest, ..
        } = answer;
        let state = self.state;
        let collected = match http_body_util::Limited::new(rest, MAX_WORKER_RESPONSE_BYTES)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(err) => {
                let worker = lease.worker().name.clone();
                let err = ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "worker_failed_mid_response",
                    format!("worker `{worker}` failed while sending its answer: {err}"),
                );
                state.metrics.error(err.code());
                return respond::error(&err);
            }
        };
        let reported = usage::of_answer(&collected);
        if let (Some(accounting), Some(reported)) = (&mut self.accounting, reported) {
            accounting.charge.report(reported);
        }
        drop(self.accounting);
        let elapsed = self.started.elapsed().as_secs_f64();
        record(elapsed);
        if parts.status.is_success() {
            let (judged, worker) = (&self.judged, lease.worker());
            let tokens = reported.map_or(judged.prompt_tokens, |usage| {
                u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens)
            });
            let observed = slo::Observed {
                ttft_ms: elapsed * 1000.0,
                itl_ms: None,
                tokens,
                completion_tokens: reported.map_or(0, |usage| u64::from(usage.completion_tokens)),
                answered_by: worker.role,
                prefilled_remotely: judged.prefilled_remotely,
            };
            state
                .slo
                .judge(judged.model, &worker.name, worker.cost, judged.targets, observed);
        }
        drop(lease);
        state.metrics.request_duration(self.label, elapsed);
        // An engine's own error shape reaches the client as OpenAI's.
        let reshaped = (!parts.status.is_success())
            .then(|| crate::workers::engine::openai_error(parts.status, &collected))
            .flatten();
        let mut response = match reshaped {
            Some(error) => {
                let mut response = Response::new(respond::full(error));
                response
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                response
            }
            None => {
                let mut response = Response::new(respond::full(collected));
                copy_headers(&parts.headers, &mut response, &[header::CONTENT_TYPE.as_str()]);
                response
            }
        };
        *response.status_mut() = parts.status;
        copy_headers(&parts.headers, &mut response, &[MERGE_HEADER, MEDIA_HEADER]);
        response
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

/// The error event of a stream whose worker failed mid-stream and that does not go on.
fn failed_mid_stream(message: String) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "server_error",
        "worker_failed_mid_stream",
        message,
    )
}

/// Relays a worker's SSE stream frame by frame and holds the request's lease on the worker
/// (its in-flight count and active sequence) until the stream ends or the client goes away.
struct RelayBody {
    first: Option<Bytes>,
    /// The worker's stream (`None` while a continuation is being set up).
    inner: Option<UpstreamBody>,
    /// Continues the stream on another worker when it breaks (`forwarding.migration_limit`).
    migration: Option<Box<Migration>>,
    /// A break an event announced, acted on once what came before it is written.
    break_next: Option<(Break, String)>,
    done: bool,
    lease: Option<Lease>,
    metrics: Arc<Metrics>,
    label: &'static str,
    started: Instant,
    /// Reads the tenant's usage from the stream (and takes out the chunk the client did not
    /// ask for).
    tap: Option<UsageTap>,
    /// Why the worker's stream cannot go on (an event past the tap's limit): the client gets
    /// it as a last SSE error event.
    broken: Option<ApiError>,
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
    /// A prefill worker computed the prompt (for the planner's prefill pool).
    prefilled_remotely: bool,
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
            answered_by: self.worker.role,
            prefilled_remotely: self.prefilled_remotely,
        };
        self.metrics
            .judge(&self.model, &self.worker.name, self.worker.cost, self.targets, observed);
    }
}

impl RelayBody {
    /// Takes in the worker's `data`: what to write to the client now, if anything (the last
    /// bytes, with an error event, when the data broke the stream).
    fn take_in(&mut self, data: Bytes) -> Option<Bytes> {
        let data = self.read(data);
        if let Some(error) = self.broken.take() {
            return Some(self.fail(&error, data));
        }
        // Empty: all of it waits in the tap for the rest of its event.
        if data.is_empty() {
            return None;
        }
        match self.coalescer.offer(data) {
            Offer::Write(data) => Some(data),
            Offer::Held => None,
        }
    }

    /// What of the worker's `data` goes on to the client: read by the migration's ledger
    /// (which may find the stream broken), then by the tap.
    fn read(&mut self, data: Bytes) -> Bytes {
        let data = match &mut self.migration {
            Some(migration) => {
                let (passed, broken) = migration.ledger.feed(&data);
                if let Some(message) = broken {
                    self.break_next = Some((Break::ErrorEvent, message));
                }
                passed
            }
            None => data,
        };
        self.tapped(data)
    }

    /// What of `data` goes on to the client, noting any usage in it.
    fn tapped(&mut self, data: Bytes) -> Bytes {
        if let Some(timing) = &mut self.timing {
            timing.saw(&data);
            if let Some(charge) = &mut self.charge {
                charge.relayed(timing.chunks);
            }
        }
        let Some(tap) = &mut self.tap else { return data };
        let data = match tap.feed(data) {
            Ok(data) => data,
            Err(err) => {
                let worker = self.lease.as_ref().map(|lease| lease.worker().name.clone());
                self.broken = Some(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "worker_event_too_large",
                    format!("worker `{}` broke its stream: {err}", worker.unwrap_or_default()),
                ));
                err.passed
            }
        };
        if let (Some(reported), Some(charge)) = (tap.usage(), &mut self.charge) {
            charge.report(reported);
        }
        data
    }

    /// Ends the stream with `error` as its last event, after `before`; answers the last bytes
    /// for the client.
    fn fail(&mut self, error: &ApiError, before: Bytes) -> Bytes {
        self.metrics.error(error.code());
        self.end();
        let mut last = before.to_vec();
        last.extend_from_slice(&error.to_sse_event());
        self.coalescer.finish(last.into())
    }

    /// The worker's stream broke (`why`, `detail`): it goes on on another worker if it can
    /// (`None`: the continuation is being set up), else the last bytes for the client end it
    /// with an error event.
    fn break_off(&mut self, why: Break, detail: &str) -> Option<Bytes> {
        // Dropping the worker's stream cancels what is left of it there.
        self.inner = None;
        // Every token came, only the end did not: the gateway writes it.
        if let Some(end) = self.migration.as_mut().and_then(|migration| migration.complete(why)) {
            let end = self.tapped(end);
            return Some(self.last_bytes(end));
        }
        let worker = self.lease.as_ref().map(|lease| lease.worker().clone());
        let refused = match (&mut self.migration, &worker) {
            (Some(migration), Some(worker)) => match migration.start(worker, why) {
                Ok(()) => {
                    // The broken worker's lease ends now; the continuation takes its own.
                    self.lease = None;
                    return None;
                }
                Err(reason) => format!("; not continued elsewhere: {reason}"),
            },
            _ => String::new(),
        };
        let name = worker.map(|worker| worker.name.clone()).unwrap_or_default();
        let error = failed_mid_stream(format!("worker `{name}` failed mid-stream: {detail}{refused}"));
        Some(self.fail(&error, Bytes::new()))
    }

    /// The worker's stream ended: the last of it (what the tap and the coalescer hold), then
    /// the end.
    fn ended(&mut self) -> Poll<Option<Result<Frame<Bytes>, std::convert::Infallible>>> {
        let last = self.last_bytes(Bytes::new());
        if last.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(Frame::data(last))))
        }
    }

    /// Ends the stream after `data`: the last bytes for the client (what the coalescer holds,
    /// `data`, and what the tap holds).
    fn last_bytes(&mut self, data: Bytes) -> Bytes {
        let rest = self.tap.as_mut().map(UsageTap::finish).unwrap_or_default();
        self.end();
        let last = if rest.is_empty() {
            data
        } else {
            [data, rest].concat().into()
        };
        self.coalescer.finish(last)
    }

    /// Writes what the coalescer holds if it says so; waits otherwise.
    fn held(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::convert::Infallible>>> {
        match self.coalescer.ready(cx) {
            Poll::Ready(Some(held)) => Poll::Ready(Some(Ok(Frame::data(held)))),
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
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

/// A client that leaves mid-stream drops the body: its stream is judged with what it saw, and
/// its charge (a field, dropped next) counts the chunks relayed.
impl Drop for RelayBody {
    fn drop(&mut self) {
        if let Some(timing) = self.timing.take() {
            timing.judge(self.tap.as_ref().and_then(UsageTap::usage));
        }
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
        if let Some(error) = this.broken.take() {
            let last = this.fail(&error, Bytes::new());
            return Poll::Ready(Some(Ok(Frame::data(last))));
        }
        // Read everything upstream has ready (so its pace is measured as it comes), writing at
        // once what the coalescer lets through, then what it held once it says so (at once for
        // an opening write, else when its window ends).
        loop {
            if let Some((why, detail)) = this.break_next.take() {
                match this.break_off(why, &detail) {
                    Some(last) => return Poll::Ready(Some(Ok(Frame::data(last)))),
                    None => continue,
                }
            }
            if let Some(migration) = this.migration.as_mut() {
                if migration.is_pending() {
                    match migration.poll_pending(cx) {
                        Poll::Pending => return this.held(cx),
                        Poll::Ready(Ok(continued)) => {
                            this.lease = Some(continued.lease);
                            this.inner = Some(continued.body);
                            if let Some(write) = this.take_in(continued.first) {
                                return Poll::Ready(Some(Ok(Frame::data(write))));
                            }
                            continue;
                        }
                        Poll::Ready(Err(reason)) => {
                            let error = failed_mid_stream(format!(
                                "the stream's worker failed mid-stream and no other could continue it: {reason}"
                            ));
                            let last = this.fail(&error, Bytes::new());
                            return Poll::Ready(Some(Ok(Frame::data(last))));
                        }
                    }
                }
                // A stream whose `[DONE]` has passed has nothing left to move.
                if !migration.ledger.done && migration.poll_notice(cx) {
                    this.break_next = Some((Break::ReclaimNotice, "its reclaim notice came".into()));
                    continue;
                }
            }
            let Some(inner) = this.inner.as_mut() else {
                // Only a continuation being set up leaves no stream; this is not reached.
                this.end();
                return Poll::Ready(None);
            };
            match Pin::new(inner).poll_frame(cx) {
                Poll::Pending => return this.held(cx),
                Poll::Ready(Some(Ok(frame))) => {
                    // Trailers are not part of the OpenAI stream; skip them.
                    let Ok(data) = frame.into_data() else { continue };
                    if let Some(write) = this.take_in(data) {
                        return Poll::Ready(Some(Ok(Frame::data(write))));
                    }
                }
                Poll::Ready(Some(Err(err))) => {
                    // A connection lost after `[DONE]` lost nothing of the answer.
                    if this.migration.as_ref().is_some_and(|migration| migration.ledger.done) {
                        return this.ended();
                    }
                    if let Some(last) = this.break_off(Break::WorkerFailed, &err.to_string()) {
                        return Poll::Ready(Some(Ok(Frame::data(last))));
                    }
                }
                Poll::Ready(None) => {
                    // A stream read by a ledger ends with `[DONE]`; without it, it broke off.
                    if this.migration.as_ref().is_some_and(|migration| !migration.ledger.done) {
                        match this.break_off(Break::StreamEnded, "it ended its stream without [DONE]") {
                            Some(last) => return Poll::Ready(Some(Ok(Frame::data(last)))),
                            None => continue,
                        }
                    }
                    return this.ended();
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none()
    }
}
