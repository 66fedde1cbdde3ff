//! Streams that survive a worker: a stream broken after its first byte goes on on another
//! worker, from its prompt and the tokens already streamed.
//!
//! With `forwarding.migration_limit` above 0, a streamed request to a worker whose engine
//! reports token ids ([`EngineKind::reports_token_ids`]) asks for them (`return_token_ids`),
//! and the relay reads every event through a [`Ledger`]. The ledger keeps the prompt's ids and
//! the ids of the text relayed (a worker sends an id only with the last byte of its text, so
//! they are exactly the text the client has), and takes the id fields out of what the client
//! sees unless it asked for them. When the stream breaks — the connection fails, the worker
//! ends it without `[DONE]`, sends an error event, or its reclaim notice comes — the policy
//! chooses a worker for the prompt and the generated ids, hashed into blocks like any prompt
//! (so a worker that holds the prefix wins), among the engines that take token-id prompts
//! ([`EngineKind::continues_from_tokens`]) and not the worker it broke on. The
//! continuation is a `/v1/completions` request with the ids as its prompt and the tokens left
//! as its limit, and its chunks are rewritten into the client's stream: the same id, creation
//! time and model, chat deltas for a chat stream, and the usage of one answer (the original
//! prompt, every token generated). Up to `migration_limit` continuations after breaks per
//! stream (moves at a reclaim notice are not counted: they are planned, not caused); a stream
//! whose ids are incomplete (an engine that does not report them) or whose continuations are
//! used up ends with the error event it would have had anyway.
//!
//! [`EngineKind::reports_token_ids`]: crate::workers::engine::EngineKind::reports_token_ids
//! [`EngineKind::continues_from_tokens`]: crate::workers::engine::EngineKind::continues_from_tokens

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use serde_json::{Map, Value, json};
use switchyard_protocol::api::{self, Endpoint};

use super::forward::{Outcome, attempt_on};
use crate::kv::WorkerId;
use crate::routing::{self, Lease};
use crate::state::AppState;
use crate::workers::Worker;
use crate::workers::upstream::UpstreamBody;

mod ledger;

pub(super) use ledger::Ledger;

/// The field a worker is asked to report token ids with (vLLM's name).
const TOKEN_IDS_FIELD: &str = "return_token_ids";

/// The body of a streamed request, asking the worker for token ids; `None` if the body is not
/// a JSON object (validation has already passed it, so this does not happen).
pub(super) fn ask_for_token_ids(body: &[u8]) -> Option<Bytes> {
    super::edited_body(body, |request| {
        request.insert(TOKEN_IDS_FIELD.into(), Value::Bool(true));
    })
}

/// Why a stream broke, as the `reason` label of `switchyard_stream_migrations_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Break {
    /// The worker's connection failed mid-stream.
    WorkerFailed,
    /// The worker ended its stream without `[DONE]`.
    StreamEnded,
    /// The worker sent an error event.
    ErrorEvent,
    /// The worker's reclaim notice came (spot capacity): moved before it is killed.
    ReclaimNotice,
}

impl Break {
    fn label(self) -> &'static str {
        match self {
            Break::WorkerFailed => "worker_failed",
            Break::StreamEnded => "stream_ended",
            Break::ErrorEvent => "error_event",
            Break::ReclaimNotice => "reclaim_notice",
        }
    }
}

/// A stream continued on another worker: its lease there, and its answer.
pub(super) struct Continued {
    /// The request's hold on the new worker.
    pub(super) lease: Lease,
    /// The continuation's first bytes.
    pub(super) first: Bytes,
    /// The rest of it.
    pub(super) body: UpstreamBody,
}

type Pending = Pin<Box<dyn Future<Output = Result<Continued, String>> + Send>>;
type Notice = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What continuing one stream needs, kept by its relay.
pub(super) struct Migration {
    state: Arc<AppState>,
    model: String,
    /// The body as forwarded (its sampling fields go with every continuation); read only when
    /// the stream breaks.
    request: Bytes,
    /// Whether the usage comes in a chunk of its own (`stream_options.include_usage`).
    usage_chunk: bool,
    /// The client's token limit, if it gave one.
    max_tokens: Option<u32>,
    /// Continuations left.
    left: u32,
    /// The worker the stream broke on last.
    broke_on: Option<WorkerId>,
    /// The unique part of the answer's id ([`api::RESPONSE_ID_HEADER`]).
    response_id: String,
    /// The stream's events as they pass.
    pub(super) ledger: Ledger,
    /// A continuation being set up.
    pending: Option<Pending>,
    /// Resolves when the current worker's reclaim notice comes (spot workers only).
    notice: Option<Notice>,
    /// The current worker's reclaim notice came, and the stream moves at the next event
    /// boundary at which it can be continued.
    noticed: bool,
}

/// What forwarding tells the relay about a stream that may be continued: the worker was asked
/// for token ids.
pub(super) struct Seed {
    /// The body as forwarded.
    pub(super) body: Bytes,
    /// The unique part of the answer's id ([`api::RESPONSE_ID_HEADER`]).
    pub(super) response_id: String,
    /// The client asked for token ids itself.
    pub(super) keep_ids: bool,
}

impl Migration {
    /// The continuation of the stream of `request` (to `endpoint`) that `seed` tells of, now
    /// on `worker`; `strip_usage` says the gateway asked for the usage chunk the client did not.
    pub(super) fn new(
        state: Arc<AppState>,
        endpoint: Endpoint,
        request: &api::GenerateRequest,
        strip_usage: bool,
        seed: Seed,
        worker: &Arc<Worker>,
    ) -> Migration {
        let mut migration = Migration {
            model: request.model().to_string(),
            max_tokens: request.token_limit(),
            left: state.forwarding.migration_limit,
            state,
            request: seed.body,
            usage_chunk: request.include_usage() || strip_usage,
            broke_on: None,
            response_id: seed.response_id,
            ledger: Ledger::new(endpoint, seed.keep_ids),
            pending: None,
            notice: None,
            noticed: false,
        };
        migration.watch(worker);
        migration
    }

    /// Watches `worker` for its reclaim notice, if it is spot capacity.
    fn watch(&mut self, worker: &Arc<Worker>) {
        self.notice = worker.spot.then(|| {
            let worker = worker.clone();
            Box::pin(async move { worker.reclaimed().await }) as Notice
        });
    }

    /// Whether the stream should move now for the current worker's reclaim notice: it came
    /// (registered for otherwise), and the stream can be continued from what it has read — a
    /// notice that comes mid-event (the first, with the prompt's ids, can be long) waits for
    /// the event's end, as the worker goes on until it is killed.
    pub(super) fn poll_notice(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(notice) = &mut self.notice
            && notice.as_mut().poll(cx).is_ready()
        {
            self.notice = None;
            self.noticed = true;
        }
        self.noticed && self.ledger.at_boundary()
    }

    /// Whether a continuation is being set up.
    pub(super) fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The end of a stream that broke (`why`) after all of its tokens: every token the client
    /// asked for has been relayed, only the finish (and the usage) had not come, so the gateway
    /// writes them (the finish reason is `length`). `None` when tokens are left, or unknown.
    pub(super) fn complete(&mut self, why: Break) -> Option<Bytes> {
        let limit = self.max_tokens?;
        if self.ledger.done
            || !self.ledger.at_boundary()
            || !self.ledger.complete
            || self.ledger.generated.len() < limit as usize
        {
            return None;
        }
        self.state.metrics.stream_migration(why.label(), "finished");
        Some(self.ledger.finish(self.usage_chunk))
    }

    /// Starts continuing the stream broken on `worker` for `why`; why not, when it cannot be
    /// (the break is then final).
    pub(super) fn start(&mut self, worker: &Worker, why: Break) -> Result<(), &'static str> {
        self.broke_on = Some(worker.kv_id);
        if why != Break::ReclaimNotice {
            self.state
                .router
                .failed_answer(worker, &self.state.forwarding.backoffs());
        }
        let generated = self.ledger.generated.len();
        // The tokens left of the client's limit (without one, the new worker's default).
        let remaining = self
            .max_tokens
            .map(|limit| limit.saturating_sub(u32::try_from(generated).unwrap_or(u32::MAX)));
        let ids = match self.ledger.continuable() {
            None => Err("the worker did not report the token ids of all of its text"),
            Some(_) if self.left == 0 => Err("it was continued forwarding.migration_limit times already"),
            Some(_) if remaining == Some(0) => Err("its token limit was reached"),
            Some(ids) => serde_json::from_slice::<Map<String, Value>>(&self.request)
                .map(|request| (ids, request))
                .map_err(|_| "its request could not be read again"),
        };
        let (ids, request) = match ids {
            Ok(found) => found,
            Err(reason) => {
                self.state.metrics.stream_migration(why.label(), "failed");
                return Err(reason);
            }
        };
        // A move at a reclaim notice is planned, and the request had no part in it: only
        // breaks count toward the limit, which is there for a request that breaks every worker
        // it meets.
        if why != Break::ReclaimNotice {
            self.left -= 1;
        }
        tracing::warn!(
            worker = %worker.name,
            reason = why.label(),
            generated,
            "stream broke mid-answer: continuing it on another worker"
        );
        self.state.metrics.stream_migration(why.label(), "continued");
        self.ledger.continued_after = Some(generated);
        let body = continuation_body(&request, &ids, remaining);
        let job = Job {
            model: self.model.clone(),
            ids,
            block_size: worker.block_size,
            max_tokens: remaining,
            body,
            excluded: self.excluded(),
            response_id: self.response_id.clone(),
        };
        self.pending = Some(Box::pin(continue_stream(self.state.clone(), job)));
        Ok(())
    }

    /// The workers a continuation may not go to: the one it just broke on (where it broke
    /// earlier is left to the health checks and breakers: a worker killed and started again is
    /// a fine place to go on), and those whose engines cannot take a token-id prompt (or are
    /// not known yet).
    fn excluded(&self) -> Vec<WorkerId> {
        let mut excluded: Vec<WorkerId> = self.broke_on.into_iter().collect();
        excluded.extend(
            self.state
                .router
                .pool()
                .candidates(&self.model, &excluded)
                .iter()
                .filter(|worker| !worker.engine().is_some_and(|engine| engine.continues_from_tokens()))
                .map(|worker| worker.kv_id),
        );
        excluded
    }

    /// Polls the continuation being set up: its answer, or why none could be had.
    pub(super) fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<Result<Continued, String>> {
        let Some(pending) = &mut self.pending else {
            return Poll::Ready(Err("no continuation was started".into()));
        };
        let result = std::task::ready!(pending.as_mut().poll(cx));
        self.pending = None;
        if let Ok(continued) = &result {
            self.noticed = false;
            self.watch(continued.lease.worker());
        }
        Poll::Ready(result)
    }
}

/// One continuation to set up.
struct Job {
    model: String,
    /// The prompt's ids, then the generated ones.
    ids: Vec<u32>,
    /// The block size the broken worker hashed with.
    block_size: usize,
    max_tokens: Option<u32>,
    body: Bytes,
    excluded: Vec<WorkerId>,
    response_id: String,
}

/// Asks the policy for a worker for `job`'s tokens and sends it the continuation, trying the
/// next worker when one fails before its first byte (as a request's first attempts do).
async fn continue_stream(state: Arc<AppState>, job: Job) -> Result<Continued, String> {
    let router = &state.router;
    let prompt = router.kv().token_blocks(&job.model, job.block_size, &job.ids);
    let request = routing::Request {
        id: router.next_request_id(),
        model: &job.model,
        prompt: &prompt,
        max_tokens: job.max_tokens,
        media_tokens: 0,
        affinity: 0,
        encoders: &[],
        ttft_target_ms: 0.0,
    };
    let mut attempts = router.attempts_excluding(request, job.excluded);
    let mut failures = 0;
    let mut last = "no other worker can continue it from its tokens".to_string();
    while failures <= state.forwarding.retries {
        let Some(lease) = attempts.next_lease() else { break };
        let worker = lease.worker().clone();
        let outcome = attempt_on(
            &state,
            &worker,
            Endpoint::Completion,
            job.body.clone(),
            true,
            None,
            &job.response_id,
        )
        .await;
        match outcome {
            Outcome::Answered(answer) if answer.response.status.is_success() => {
                let mut lease = lease;
                // Its prefill (the cached prefix found, the rest computed) is measured as any.
                lease.first_token(true);
                return Ok(Continued {
                    lease,
                    first: answer.first.unwrap_or_default(),
                    body: answer.rest,
                });
            }
            Outcome::Answered(answer) => {
                last = format!("worker `{}` answered {}", worker.name, answer.response.status);
                failures += 1;
            }
            Outcome::Failed(reason) => {
                last = format!("worker `{}`: {reason}", worker.name);
                failures += 1;
            }
            Outcome::Busy { status, retry_after } => {
                router.busy(&worker, retry_after, &state.forwarding.backoffs());
                last = format!("worker `{}` answered {status}", worker.name);
            }
            Outcome::Reclaimed => last = format!("worker `{}` had its reclaim notice", worker.name),
        }
    }
    Err(last)
}

/// Fields of a chat or completions request that a continuation (a completion from token ids)
/// does not take.
const NOT_CONTINUED: [&str; 16] = [
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "best_of",
];

/// The continuation's body: the request's sampling fields, `ids` as the prompt, `max_tokens`
/// left, streamed, with token ids.
fn continuation_body(request: &Map<String, Value>, ids: &[u32], max_tokens: Option<u32>) -> Bytes {
    let mut body = request.clone();
    for field in NOT_CONTINUED {
        body.remove(field);
    }
    body.insert("prompt".into(), json!(ids));
    if let Some(max_tokens) = max_tokens {
        body.insert("max_tokens".into(), json!(max_tokens));
    }
    body.insert("stream".into(), Value::Bool(true));
    body.insert(TOKEN_IDS_FIELD.into(), Value::Bool(true));
    // Serializing a map of JSON values cannot fail.
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continuation_takes_the_sampling_fields_and_the_tokens_left() {
        let request: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
            "temperature": 0, "stop": ["x"], "stream": true, "stream_options": {"include_usage": true},
        }))
        .expect("object");
        let body: Value = serde_json::from_slice(&continuation_body(&request, &[1, 2], Some(4))).expect("json");
        assert_eq!(
            body,
            json!({"model": "m", "prompt": [1, 2], "max_tokens": 4, "temperature": 0, "stop": ["x"], "stream": true,
                   "stream_options": {"include_usage": true}, "return_token_ids": true})
        );
    }
}
