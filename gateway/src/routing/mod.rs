//! The routing core: which worker serves a request, and the bookkeeping that lasts as long as
//! it does.
//!
//! [`Router`] owns what a decision reads — the worker pool, the KV state (prefix index and
//! active sequences) and the live router policy — and nothing about HTTP. A request is routed
//! through [`Attempts`]: the first attempt asks the policy ([`Router::choose`]); when that
//! worker fails before its first byte, the policy's ranked fallbacks are tried in order, and
//! only when they are used up (or no longer healthy) is the policy asked again, without the
//! workers already tried. Each attempt holds a [`Lease`] that counts the request in flight on
//! the worker and keeps its entry in the active-sequence tracker; dropping the lease releases
//! both together. A policy that disaggregates may also name a prefill worker for the first
//! attempt: the lease then holds that worker too ([`PrefillLease`]), counted while the prompt
//! is computed there.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::events::applier::Inbound;
use crate::kv::{ActiveGuard, KvState, KvSummary, PromptBlocks, SummaryWorker, WorkerId};
use crate::policy::switch::{PolicySwitch, Routed};
use crate::policy::table::RequestInfo;
use crate::workers::breaker::Backoffs;
use crate::workers::{InFlight, Worker, WorkerPool};

mod measured;
pub mod table;
#[cfg(test)]
mod tests;

pub use table::{EncoderRow, LlmRows};

/// The high bit marks a prefill worker's entry in the active-sequence tracker, so that it
/// never meets the same request's entry on the answering worker.
const PREFILL_ENTRY: u64 = 1 << 63;

/// One request as the routing core sees it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The gateway's id of the request (also its key in the active-sequence tracker).
    pub id: u64,
    /// The model asked for.
    pub model: &'a str,
    /// The prompt, tokenized and hashed.
    pub prompt: &'a PromptBlocks,
    /// The most tokens it may generate, if the client said.
    pub max_tokens: Option<u32>,
    /// Estimated tokens of its media items (images, audio, video), included in `prompt`.
    pub media_tokens: u32,
    /// Hash of its affinity key (the split rollout's header), 0 when absent.
    pub affinity: u64,
    /// The encoders its media may go to, as rows of the router's table (empty without media).
    pub encoders: &'a [EncoderRow],
    /// Its time-to-first-token target in milliseconds; 0 when none.
    pub ttft_target_ms: f32,
}

/// The routing core: pool, KV state and policy, answering where each request goes.
#[derive(Debug)]
pub struct Router {
    pool: Arc<WorkerPool>,
    kv: Arc<KvState>,
    policy: Arc<PolicySwitch>,
    events: mpsc::UnboundedSender<Inbound>,
    next_request: AtomicU64,
}

impl Router {
    /// A router over `pool`, `kv` and `policy`; workers it finds unreachable are reported to
    /// the event applier through `events`, so their cached blocks leave the index.
    pub fn new(
        pool: Arc<WorkerPool>,
        kv: Arc<KvState>,
        policy: Arc<PolicySwitch>,
        events: mpsc::UnboundedSender<Inbound>,
    ) -> Router {
        Router {
            pool,
            kv,
            policy,
            events,
            next_request: AtomicU64::new(1_000),
        }
    }

    /// The worker pool.
    pub fn pool(&self) -> &Arc<WorkerPool> {
        &self.pool
    }

    /// The KV state.
    pub fn kv(&self) -> &Arc<KvState> {
        &self.kv
    }

    /// The live router policy.
    pub fn policy(&self) -> &Arc<PolicySwitch> {
        &self.policy
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// The affinity hash of a request whose rollout key header (if the current rollout has
    /// one) carries `header_value`: 0 when there is no key, as the contract says.
    pub fn affinity(&self, header_value: impl FnOnce(&str) -> Option<Vec<u8>>) -> u64 {
        self.policy
            .rollout()
            .and_then(|rollout| rollout.key_header.clone())
            .and_then(|header| header_value(&header))
            .map_or(0, |value| xxhash_rust::xxh3::xxh3_64(&value))
    }

    /// Asks the policy for a worker among the healthy workers of `request.model` not in
    /// `tried`, and leases it. `None` when no such worker is left.
    pub fn choose(&self, request: &Request<'_>, tried: &[WorkerId]) -> Option<Choice> {
        let candidates = self.pool.candidates(request.model, tried);
        if candidates.is_empty() {
            return None;
        }
        let overlaps = self.kv.lookup(&request.prompt.hashes);
        let loads = self.kv.loads(candidates.iter().map(|worker| worker.kv_id));
        // Prefill rows only for a policy that may use them, on a first try, for a prompt
        // without media (its media would have to be encoded for the prefill worker too).
        let prefill = if tried.is_empty() && request.media_tokens == 0 && self.policy.disaggregates() {
            self.pool.prefill_candidates(request.model)
        } else {
            Vec::new()
        };
        let prefill_loads = if prefill.is_empty() {
            Vec::new()
        } else {
            self.kv.loads(prefill.iter().map(|worker| worker.kv_id))
        };
        let info = RequestInfo {
            request_id: request.id,
            prompt_tokens: u32::try_from(request.prompt.tokens).unwrap_or(u32::MAX),
            max_tokens: request.max_tokens.unwrap_or(0),
            prompt_blocks: u32::try_from(request.prompt.hashes.len()).unwrap_or(u32::MAX),
            media_tokens: request.media_tokens,
            affinity: request.affinity,
            ttft_target_ms: request.ttft_target_ms,
        };
        let rows = LlmRows {
            candidates: &candidates,
            loads: &loads,
            prefill: &prefill,
            prefill_loads: &prefill_loads,
        };
        let (pick, routed) = self.policy.route(&info, &request.prompt.hashes, |columns| {
            table::build(rows, &overlaps, request.encoders, columns)
        });
        let pick = pick?;
        // Indices past the LLM workers name encoder rows (checked to be encoders by the runtime).
        let encoders = pick
            .encoders
            .iter()
            .filter_map(|&index| (index as usize).checked_sub(candidates.len()))
            .filter_map(|row| request.encoders.get(row))
            .map(|row| row.worker.clone())
            .collect();
        let overlap_of = |worker: &Worker| overlaps.get(worker.kv_id).map_or(0, |o| o.device);
        let chosen = candidates.get(pick.worker as usize)?.clone();
        let fallbacks = pick
            .fallbacks
            .iter()
            .filter_map(|&index| candidates.get(index as usize))
            .map(|worker| (worker.clone(), overlap_of(worker)))
            .collect();
        let overlap = overlap_of(&chosen);
        // Rows past the encoders name prefill workers (checked to be ones by the runtime).
        let prefill = pick
            .prefill
            .and_then(|index| (index as usize).checked_sub(candidates.len() + request.encoders.len()))
            .and_then(|row| prefill.get(row))
            .map(|worker| self.prefill_lease(request, worker.clone(), overlap_of(worker)));
        let mut lease = self.lease(request, chosen, overlap, routed);
        lease.encoders = encoders;
        lease.prefill = prefill;
        Some(Choice { lease, fallbacks })
    }

    /// Starts counting `request`'s prompt on the prefill worker `worker`, which holds
    /// `overlap` of its leading blocks.
    fn prefill_lease(&self, request: &Request<'_>, worker: Arc<Worker>, overlap: u32) -> PrefillLease {
        let prompt = request.prompt;
        let cached_tokens = (overlap as usize).saturating_mul(prompt.block_size).min(prompt.tokens);
        let active = self.kv.begin(
            request.id | PREFILL_ENTRY,
            worker.kv_id,
            &worker.name,
            prompt.hashes.clone(),
            (prompt.tokens - cached_tokens) as u64,
        );
        worker.take_turn();
        PrefillLease {
            in_flight: InFlight::new(worker),
            _active: active,
        }
    }

    /// Starts counting `request` on `worker` (in flight, and in the active-sequence tracker
    /// with the prompt tokens it must prefill beyond the `overlap` blocks it has cached).
    fn lease(&self, request: &Request<'_>, worker: Arc<Worker>, overlap: u32, routed: Routed) -> Lease {
        let prompt = request.prompt;
        let cached_tokens = (overlap as usize).saturating_mul(prompt.block_size).min(prompt.tokens);
        let active = self.kv.begin(
            request.id,
            worker.kv_id,
            &worker.name,
            prompt.hashes.clone(),
            (prompt.tokens - cached_tokens) as u64,
        );
        worker.take_turn();
        Lease {
            in_flight: InFlight::new(worker),
            active,
            routed,
            overlap,
            encoders: Vec::new(),
            prefill: None,
            leased_at: std::time::Instant::now(),
        }
    }

    /// A request could not reach `worker`: it leaves the rotation at once (the health checker
    /// brings it back) and its cached blocks leave the index.
    pub fn unreachable(&self, worker: &Worker) {
        if worker.eject() {
            self.worker_lost(worker);
        }
    }

    /// `worker` failed a request (a 5xx other than 503, a timeout, a stream broken before its
    /// first byte): counted by its circuit breaker (see [`crate::workers::breaker`]). Its
    /// cached blocks stay in the index: its cache outlives a run of failed answers.
    pub fn failed_answer(&self, worker: &Worker, backoffs: &Backoffs) {
        worker.failed_answer(backoffs);
    }

    /// `worker` answered 429 or 503 (its engine is full): it is left alone for a backoff,
    /// counted apart from failures.
    pub fn busy(&self, worker: &Worker, retry_after: Option<Duration>, backoffs: &Backoffs) {
        let backoff = worker.busy(retry_after, backoffs);
        tracing::debug!(worker = %worker.name, backoff_ms = backoff.as_millis() as u64, "worker busy");
    }

    /// `worker` left the rotation: its cached blocks leave the index until it is resynced.
    pub fn worker_lost(&self, worker: &Worker) {
        if self.events.send(Inbound::Lost(worker.name.clone())).is_err() {
            // The applier is gone (the gateway is stopping): forget the blocks here.
            self.kv.forget(worker.kv_id);
        }
    }

    /// What `GET /admin/kv` shows: the index and, per worker, its cache and load.
    pub fn kv_summary(&self) -> KvSummary {
        let workers = self.pool.workers();
        self.kv.summary(workers.iter().map(|worker| SummaryWorker {
            name: &worker.name,
            kv_id: worker.kv_id,
            model: &worker.model,
            block_size: worker.block_size,
            healthy: worker.is_healthy(),
        }))
    }

    /// The attempts at serving `request`, in order (see the module documentation).
    pub fn attempts<'r>(&'r self, request: Request<'r>) -> Attempts<'r> {
        self.attempts_excluding(request, Vec::new())
    }

    /// The attempts at serving `request` on any worker but those in `excluded`.
    pub fn attempts_excluding<'r>(&'r self, request: Request<'r>, excluded: Vec<WorkerId>) -> Attempts<'r> {
        Attempts {
            router: self,
            request,
            tried: excluded,
            fallbacks: VecDeque::new(),
            routed: None,
        }
    }
}

/// A policy's choice: the leased worker and the fallbacks it ranked after it.
#[derive(Debug)]
pub struct Choice {
    /// The chosen worker, leased.
    pub lease: Lease,
    /// The workers to try next, best first, with their cached leading blocks of the prompt.
    pub fallbacks: Vec<(Arc<Worker>, u32)>,
}

/// A request's hold on a worker: counted in flight there and tracked as an active sequence
/// until dropped.
#[derive(Debug)]
pub struct Lease {
    in_flight: InFlight,
    active: ActiveGuard,
    routed: Routed,
    overlap: u32,
    /// The encoders the policy chose with the worker (at most one per role).
    encoders: Vec<Arc<Worker>>,
    /// The prefill worker the policy chose to compute the prompt first, until it has.
    prefill: Option<PrefillLease>,
    /// When the worker was chosen: where its time to first token starts.
    leased_at: std::time::Instant,
}

/// A prompt's hold on the prefill worker computing it: counted in flight there, its uncached
/// tokens as prefill work, until dropped (when the prefill answered or failed).
#[derive(Debug)]
pub struct PrefillLease {
    in_flight: InFlight,
    _active: ActiveGuard,
}

impl PrefillLease {
    /// The prefill worker.
    pub fn worker(&self) -> &Arc<Worker> {
        self.in_flight.worker()
    }
}

impl Lease {
    /// The worker.
    pub fn worker(&self) -> &Arc<Worker> {
        self.in_flight.worker()
    }

    /// The policy version (or fallback) that chose the worker.
    pub fn routed(&self) -> &Routed {
        &self.routed
    }

    /// The prompt's leading blocks cached on the worker's device.
    pub fn overlap(&self) -> u32 {
        self.overlap
    }

    /// Whether the policy chose a prefill worker to compute the prompt first (and it has not
    /// been taken yet).
    pub fn has_prefill(&self) -> bool {
        self.prefill.is_some()
    }

    /// The prefill worker the policy chose to compute the prompt first, taken (once): the
    /// caller holds it while the prompt is computed there.
    pub fn take_prefill(&mut self) -> Option<PrefillLease> {
        self.prefill.take()
    }

    /// The encoder the policy chose for media of `role` with this worker, if it chose one.
    pub fn encoder_for(&self, role: crate::config::Role) -> Option<&Arc<Worker>> {
        self.encoders.iter().find(|encoder| encoder.role == role)
    }

    /// The prefill work the request found on its worker when it was routed (uncached prompt
    /// tokens of the requests there before their first token, its own included).
    pub fn prefill_work(&self) -> u64 {
        self.active.prefill_work()
    }

    /// The request's first token came back: its prompt no longer counts as prefill work.
    /// `measured` (a streamed request with no media, whose first data is its first token)
    /// also tells the worker how long the prefill work it found took
    /// ([`Worker::observe_prefill`]).
    pub fn first_token(&mut self, measured: bool) {
        if measured {
            let ttft_ms = self.leased_at.elapsed().as_secs_f64() * 1000.0;
            self.worker().observe_prefill(self.prefill_work(), ttft_ms);
        }
        self.active.first_token();
    }
}

/// The attempts at serving one request: the policy's choice, then its fallbacks, then the
/// policy again without the workers tried.
#[derive(Debug)]
pub struct Attempts<'r> {
    router: &'r Router,
    request: Request<'r>,
    tried: Vec<WorkerId>,
    fallbacks: VecDeque<(Arc<Worker>, u32)>,
    routed: Option<Routed>,
}

impl Attempts<'_> {
    /// The next worker to try, leased; `None` when every healthy worker has been tried.
    pub fn next_lease(&mut self) -> Option<Lease> {
        while let Some((worker, overlap)) = self.fallbacks.pop_front() {
            if !worker.is_routable() || self.tried.contains(&worker.kv_id) {
                continue;
            }
            let Some(routed) = self.routed.clone() else { break };
            self.tried.push(worker.kv_id);
            return Some(self.router.lease(&self.request, worker, overlap, routed));
        }
        let choice = self.router.choose(&self.request, &self.tried)?;
        self.tried.push(choice.lease.worker().kv_id);
        self.fallbacks = choice.fallbacks.into();
        self.routed = Some(choice.lease.routed().clone());
        Some(choice.lease)
    }
}
