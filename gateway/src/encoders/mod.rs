//! Encoder pools: the gateway's queue in front of each encoder, and media sent through it.
//!
//! Encoders are ordinary workers of role `vision` (images, video) or `audio` in the pool. This
//! module owns what the gateway does with them: it picks an encoder for an item (one that
//! already holds the item's features, as its announced feature cache says, else the one with
//! the least estimated work queued), keeps a queue per encoder whose task flushes when
//! `max_items` items (or the largest of the encoder's token budgets) are waiting, or
//! `deadline_ms` after the oldest arrived, asks the live batching policy
//! ([`crate::policy::batching`]) how to split what waits into micro-batches, posts them in the
//! order it answered, and hands each item its own outcome. The work queued at an encoder is estimated in milliseconds
//! with the reference cost model and taken off again when the item ends, successfully or not,
//! so the estimate cannot drift. [`encode_request`] runs every item of a request: one retry on
//! another encoder after a failure (with half the frames or half the resolution after an
//! out-of-memory), and a verdict: delivered, text-only (and why), or the client's error.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use switchyard_media::{MediaKind, ModelMedia};
use switchyard_protocol::api::ApiError;
use switchyard_protocol::encode::{
    Delivery, ENCODE, EncodeBatch, EncodeItem, EncodeReply, ItemOutcome, ItemStatus, estimate_ms, media_block_hash,
};
use tokio::sync::{mpsc, oneshot};

use crate::config::{EncodersConfig, Role};
use crate::kv::KvState;
use crate::media::MediaItem;
use crate::policy::batching::{BatcherSwitch, Budget, PendingTable};
use crate::routing::EncoderRow;
use crate::workers::client::WorkerClient;
use crate::workers::{Worker, WorkerPool};

type Labels = Vec<(&'static str, String)>;

/// Largest encoder answer read.
const MAX_REPLY_BYTES: usize = 1 << 20;

/// Metrics of the encoder queues.
#[derive(Debug)]
pub(crate) struct EncoderMetrics {
    items: Family<Labels, Counter>,
    queued_ms: Family<Labels, Gauge<f64, AtomicU64>>,
    batch_items: Histogram,
    retries: Counter,
    cache_routed: Counter,
}

impl EncoderMetrics {
    /// Fresh counters.
    pub(crate) fn new() -> EncoderMetrics {
        EncoderMetrics {
            items: Family::default(),
            queued_ms: Family::default(),
            batch_items: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
            retries: Counter::default(),
            cache_routed: Counter::default(),
        }
    }

    /// Records the work now queued at `encoder`.
    fn set_queued(&self, encoder: &str, pending_us: u64) {
        self.queued_ms
            .get_or_create(&vec![("encoder", encoder.to_string())])
            .set(pending_us as f64 / 1000.0);
    }

    /// Registers the families in `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "encoder_items",
            "Media items sent to encoders, by encoder and outcome",
            self.items.clone(),
        );
        registry.register(
            "encoder_queued_ms",
            "Estimated encode work queued at or running on each encoder, in milliseconds (the reference cost curves)",
            self.queued_ms.clone(),
        );
        registry.register(
            "encoder_batch_items",
            "Items per micro-batch sent to an encoder",
            self.batch_items.clone(),
        );
        registry.register(
            "encoder_retries",
            "Media items tried again on another encoder after a failure",
            self.retries.clone(),
        );
        registry.register(
            "encoder_cache_routed",
            "Media items sent to an encoder that announced their features cached",
            self.cache_routed.clone(),
        );
    }
}

/// One queued item.
struct Job {
    item: EncodeItem,
    /// Its estimated encode time, added to the queue's pending work until its batch ends.
    estimate_us: u64,
    reply: oneshot::Sender<Result<ItemOutcome, String>>,
}

/// The queue in front of one encoder.
struct Queue {
    jobs: mpsc::UnboundedSender<Job>,
    /// Estimated work queued or running, in microseconds.
    pending_us: Arc<AtomicU64>,
}

/// Every encoder queue of a gateway; see the module docs.
pub(crate) struct Encoders {
    config: EncodersConfig,
    client: WorkerClient,
    pool: Arc<WorkerPool>,
    kv: Arc<KvState>,
    batchers: Arc<BatcherSwitch>,
    queues: Mutex<HashMap<u32, Queue>>,
    /// Its metrics.
    pub metrics: Arc<EncoderMetrics>,
}

impl std::fmt::Debug for Encoders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoders")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The role of the encoders that take `kind`.
pub(crate) fn role_for(kind: MediaKind) -> Role {
    match kind {
        MediaKind::Image | MediaKind::Video => Role::Vision,
        MediaKind::Audio => Role::Audio,
    }
}

impl Encoders {
    /// Queues for the encoders of `pool` (created as encoders are first used).
    pub(crate) fn new(
        config: EncodersConfig,
        client: WorkerClient,
        pool: Arc<WorkerPool>,
        kv: Arc<KvState>,
        batchers: Arc<BatcherSwitch>,
        metrics: Arc<EncoderMetrics>,
    ) -> Encoders {
        Encoders {
            config,
            client,
            pool,
            kv,
            batchers,
            queues: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The settings.
    pub(crate) fn config(&self) -> &EncodersConfig {
        &self.config
    }

    /// The healthy encoders of `model` that take `kind`, except those in `exclude`.
    pub(crate) fn candidates(&self, model: &str, kind: MediaKind, exclude: &[u32]) -> Vec<Arc<Worker>> {
        self.of_role(model, role_for(kind), exclude)
    }

    fn of_role(&self, model: &str, role: Role, exclude: &[u32]) -> Vec<Arc<Worker>> {
        self.pool
            .workers()
            .iter()
            .filter(|w| w.role == role && w.model == model && w.is_healthy() && !exclude.contains(&w.kv_id))
            .cloned()
            .collect()
    }

    /// The encoders `items` may go to, as rows of the router's table: per encoder of a role the
    /// items need, its queue, the time to encode the items of its role it does not hold (the
    /// reference cost curves), and the tokens of those it holds.
    pub(crate) fn rows(&self, model: &str, items: &[MediaItem]) -> Vec<EncoderRow> {
        let holders: Vec<Vec<u32>> = items
            .iter()
            .map(|item| {
                self.kv
                    .lookup(&[media_block_hash(item.id())])
                    .iter()
                    .filter(|o| o.device > 0)
                    .map(|o| o.worker)
                    .collect()
            })
            .collect();
        let mut roles: Vec<Role> = items.iter().map(|item| role_for(item.info.kind)).collect();
        roles.sort_by_key(|role| *role as u8);
        roles.dedup();
        let micros = |ms: f64| (ms * 1000.0).clamp(0.0, f64::from(u32::MAX)) as u32;
        let mut rows = Vec::new();
        for role in roles {
            for encoder in self.of_role(model, role, &[]) {
                let (mut encode_ms, mut cached_tokens) = (0.0, 0u32);
                for (item, holders) in items.iter().zip(&holders) {
                    if role_for(item.info.kind) != role {
                        continue;
                    }
                    if holders.contains(&encoder.kv_id) {
                        cached_tokens = cached_tokens.saturating_add(item.tokens);
                    } else {
                        encode_ms += estimate_ms(item.info.kind, item.frames.len(), item.info.duration_s);
                    }
                }
                rows.push(EncoderRow {
                    queued_us: micros(self.queued_ms(&encoder)),
                    encode_us: micros(encode_ms),
                    cached_tokens,
                    worker: encoder,
                });
            }
        }
        rows
    }

    /// Estimated work queued at `encoder`, in milliseconds.
    pub(crate) fn queued_ms(&self, encoder: &Worker) -> f64 {
        self.queues
            .lock()
            .get(&encoder.kv_id)
            .map_or(0.0, |q| q.pending_us.load(Ordering::Relaxed) as f64 / 1000.0)
    }

    /// The encoder for an item: one holding its features if any, else the least queued.
    pub(crate) fn choose(&self, model: &str, item: &MediaItem, exclude: &[u32]) -> Option<Arc<Worker>> {
        let candidates = self.candidates(model, item.info.kind, exclude);
        let holders = self.kv.lookup(&[media_block_hash(item.id())]);
        let cached = candidates
            .iter()
            .filter(|w| holders.iter().any(|o| o.worker == w.kv_id && o.device > 0))
            .min_by(|a, b| self.queued_ms(a).total_cmp(&self.queued_ms(b)));
        if let Some(encoder) = cached {
            self.metrics.cache_routed.inc();
            return Some(encoder.clone());
        }
        candidates.into_iter().min_by(|a, b| {
            self.queued_ms(a)
                .total_cmp(&self.queued_ms(b))
                .then(a.in_flight().cmp(&b.in_flight()))
        })
    }

    /// Encodes `item` at `encoder` through its queue, within the configured timeout.
    ///
    /// # Errors
    ///
    /// Why no outcome came back: the encoder could not be reached, answered an error, or took
    /// longer than `timeout_ms`.
    pub(crate) async fn encode(&self, encoder: &Arc<Worker>, item: EncodeItem) -> Result<ItemOutcome, String> {
        let estimate_us = (estimate_ms(item.kind, item.frames.len(), item.duration_s) * 1000.0) as u64;
        let (reply, answer) = oneshot::channel();
        {
            let mut queues = self.queues.lock();
            if !queues.contains_key(&encoder.kv_id) {
                // Queues of encoders that have left the pool are dropped (their tasks end).
                let live: Vec<u32> = self.pool.workers().iter().map(|w| w.kv_id).collect();
                queues.retain(|id, _| live.contains(id));
                queues.insert(encoder.kv_id, self.start_queue(encoder.clone()));
            }
            let Some(queue) = queues.get(&encoder.kv_id) else {
                return Err("the encoder queue is gone".into());
            };
            // Counted before it is queued, and taken off (and the outcome counted) by the
            // queue when its batch ends, whether or not this caller still waits for it: a
            // request answered before the encoder's reply arrives drops this future.
            let now = queue.pending_us.fetch_add(estimate_us, Ordering::Relaxed) + estimate_us;
            self.metrics.set_queued(&encoder.name, now);
            let job = Job {
                item,
                estimate_us,
                reply,
            };
            if queue.jobs.send(job).is_err() {
                let now = queue.pending_us.fetch_sub(estimate_us, Ordering::Relaxed) - estimate_us;
                self.metrics.set_queued(&encoder.name, now);
                return Err("the encoder queue stopped".into());
            }
        }
        match tokio::time::timeout(Duration::from_millis(self.config.timeout_ms), answer).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err("the encoder queue dropped the item".into()),
            Err(_) => Err(format!("no answer within {} ms", self.config.timeout_ms)),
        }
    }

    fn start_queue(&self, encoder: Arc<Worker>) -> Queue {
        let (jobs, receiver) = mpsc::unbounded_channel();
        let pending_us = Arc::new(AtomicU64::new(0));
        let queue = EncoderQueue {
            pending_us: pending_us.clone(),
            encoder,
            client: self.client.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            kv: self.kv.clone(),
            batchers: self.batchers.clone(),
            next_id: 0,
        };
        tokio::spawn(queue.run(receiver));
        Queue { jobs, pending_us }
    }
}

/// An item waiting in an encoder's queue.
struct Waiting {
    job: Job,
    id: u64,
    arrived: tokio::time::Instant,
    /// The encoder announced the item's features cached.
    ready: bool,
}

/// The task behind one encoder's queue: flushes, batches by the live policy, sends.
struct EncoderQueue {
    encoder: Arc<Worker>,
    /// The estimated work queued or running (shared with [`Queue`]).
    pending_us: Arc<AtomicU64>,
    client: WorkerClient,
    config: EncodersConfig,
    metrics: Arc<EncoderMetrics>,
    kv: Arc<KvState>,
    batchers: Arc<BatcherSwitch>,
    next_id: u64,
}

impl EncoderQueue {
    async fn run(mut self, mut jobs: mpsc::UnboundedReceiver<Job>) {
        let max_items = self.config.max_items.max(1);
        let largest_budget = self
            .encoder
            .token_budgets
            .iter()
            .copied()
            .max()
            .map_or(u64::MAX, u64::from);
        let mut waiting: Vec<Waiting> = Vec::new();
        let mut open = true;
        loop {
            if waiting.is_empty() {
                match jobs.recv().await {
                    Some(job) => waiting.push(self.arrive(job)),
                    None => return,
                }
            }
            let oldest = waiting
                .iter()
                .map(|w| w.arrived)
                .min()
                .unwrap_or_else(tokio::time::Instant::now);
            let deadline = oldest + Duration::from_millis(self.config.deadline_ms);
            let tokens = |waiting: &[Waiting]| waiting.iter().map(|w| u64::from(w.job.item.tokens)).sum::<u64>();
            while open && waiting.len() < max_items && tokens(&waiting) < largest_budget {
                match tokio::time::timeout_at(deadline, jobs.recv()).await {
                    Ok(Some(job)) => waiting.push(self.arrive(job)),
                    Ok(None) => open = false,
                    Err(_) => break,
                }
            }
            // Whatever else has arrived joins the flush: the batcher sees the whole queue.
            while let Ok(job) = jobs.try_recv() {
                waiting.push(self.arrive(job));
            }
            waiting = self.flush(waiting).await;
            if !open && waiting.is_empty() {
                return;
            }
        }
    }

    fn arrive(&mut self, job: Job) -> Waiting {
        self.next_id += 1;
        let holders = self.kv.lookup(&[media_block_hash(job.item.media_id)]);
        let ready = holders.iter().any(|o| o.worker == self.encoder.kv_id && o.device > 0);
        Waiting {
            job,
            id: self.next_id,
            arrived: tokio::time::Instant::now(),
            ready,
        }
    }

    /// What waits, as the batcher sees it.
    fn pending_table(&self, waiting: &[Waiting]) -> PendingTable {
        let now = tokio::time::Instant::now();
        PendingTable {
            ids: waiting.iter().map(|w| w.id).collect(),
            tokens: waiting.iter().map(|w| w.job.item.tokens).collect(),
            waited_ms: waiting
                .iter()
                .map(|w| now.saturating_duration_since(w.arrived).as_secs_f32() * 1000.0)
                .collect(),
            priority: vec![0; waiting.len()],
            kinds: waiting.iter().map(|w| kind_value(w.job.item.kind)).collect(),
            ready: waiting.iter().map(|w| w.ready).collect(),
        }
    }

    /// The room a batch at this encoder may fill.
    fn budget(&self) -> Budget {
        let mut budgets = self.encoder.token_budgets.clone();
        budgets.sort_unstable();
        budgets.dedup();
        Budget {
            token_budgets: budgets,
            max_items: u32::try_from(self.config.max_items).unwrap_or(u32::MAX),
            max_batches: self.config.max_batches,
        }
    }

    /// Batches `waiting` and sends the batches; answers the items left for the next flush.
    async fn flush(&self, waiting: Vec<Waiting>) -> Vec<Waiting> {
        let queue = self.pending_table(&waiting);
        let budget = self.budget();
        // The policy runs on a blocking thread: a batcher that loops holds it until its
        // deadline (longer on a machine too busy to give it the CPU), and the runtime's
        // threads must keep serving requests and health checks meanwhile.
        let batchers = self.batchers.clone();
        let formed = tokio::task::spawn_blocking(move || batchers.form_batches(&queue, &budget)).await;
        let (batches, by) = match formed {
            Ok(formed) => formed,
            Err(err) => {
                tracing::error!(encoder = %self.encoder.name, error = %err, "the batcher task failed; batching first come, first served");
                let queue = self.pending_table(&waiting);
                let budget = self.budget();
                (
                    crate::policy::batching::fallback(&queue, &budget),
                    crate::policy::batching::BatchedBy::Fallback("panic"),
                )
            }
        };
        tracing::trace!(encoder = %self.encoder.name, items = waiting.len(), batches = batches.len(), by = %by.label(), "encoder queue flushed");
        let mut slots: Vec<Option<Waiting>> = waiting.into_iter().map(Some).collect();
        for batch in batches {
            let jobs: Vec<Job> = batch
                .items
                .iter()
                .filter_map(|&index| slots.get_mut(index as usize)?.take())
                .map(|waiting| waiting.job)
                .collect();
            if jobs.is_empty() {
                continue;
            }
            self.metrics.batch_items.observe(jobs.len() as f64);
            tokio::spawn(send_batch(
                self.encoder.clone(),
                jobs,
                self.client.clone(),
                self.config.timeout_ms,
                self.metrics.clone(),
                self.pending_us.clone(),
            ));
        }
        slots.into_iter().flatten().collect()
    }
}

/// The `kinds` value of a media kind in a pending table.
fn kind_value(kind: MediaKind) -> u8 {
    match kind {
        MediaKind::Image => 1,
        MediaKind::Audio => 2,
        MediaKind::Video => 3,
    }
}

/// Posts one micro-batch, hands each item its outcome, counts it, and takes the batch's
/// estimated work off the queue's pending total.
async fn send_batch(
    encoder: Arc<Worker>,
    batch: Vec<Job>,
    client: WorkerClient,
    timeout_ms: u64,
    metrics: Arc<EncoderMetrics>,
    pending_us: Arc<AtomicU64>,
) {
    let estimate_us: u64 = batch.iter().map(|job| job.estimate_us).sum();
    let (items, replies): (Vec<EncodeItem>, Vec<_>) = batch.into_iter().map(|job| (job.item, job.reply)).unzip();
    let count = replies.len();
    let outcomes: Vec<Result<ItemOutcome, String>> =
        match post_batch(&encoder, EncodeBatch { items }, &client, timeout_ms).await {
            Ok(reply) if reply.items.len() == count => reply.items.into_iter().map(Ok).collect(),
            Ok(reply) => {
                let reason = format!(
                    "encoder `{}` answered {} outcomes for {count} items",
                    encoder.name,
                    reply.items.len()
                );
                vec![Err(reason); count]
            }
            Err(reason) => {
                tracing::warn!(encoder = %encoder.name, %reason, "encode batch failed");
                vec![Err(reason); count]
            }
        };
    let now = pending_us.fetch_sub(estimate_us, Ordering::Relaxed) - estimate_us;
    metrics.set_queued(&encoder.name, now);
    for (outcome, reply) in outcomes.into_iter().zip(replies) {
        let label = match &outcome {
            Ok(outcome) => outcome.status.as_str(),
            Err(_) => "unreachable",
        };
        metrics
            .items
            .get_or_create(&vec![("encoder", encoder.name.clone()), ("outcome", label.to_string())])
            .inc();
        let _ = reply.send(outcome);
    }
}

async fn post_batch(
    encoder: &Worker,
    batch: EncodeBatch,
    client: &WorkerClient,
    timeout_ms: u64,
) -> Result<EncodeReply, String> {
    let body = serde_json::to_vec(&batch).map_err(|err| format!("cannot encode the batch: {err}"))?;
    let request = http::Request::post(encoder.uri(ENCODE))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|err| format!("cannot build the request: {err}"))?;
    let response = client
        .send_within(request, Duration::from_millis(timeout_ms))
        .await
        .map_err(|err| {
            if err.is_connect() {
                encoder.eject();
            }
            format!("encoder `{}`: {err}", encoder.name)
        })?;
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), MAX_REPLY_BYTES)
        .collect()
        .await
        .map_err(|err| format!("encoder `{}` broke off its answer: {err}", encoder.name))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "encoder `{}` answered {status}: {}",
            encoder.name,
            String::from_utf8_lossy(&body).chars().take(200).collect::<String>()
        ));
    }
    serde_json::from_slice(&body).map_err(|err| format!("encoder `{}` answered nonsense: {err}", encoder.name))
}

/// How a request's media ended.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Every item's features reached the LLM worker; the count served from feature caches.
    Delivered {
        /// Items found in an encoder's cache.
        cache_hits: usize,
    },
    /// The request is answered from its text alone.
    TextOnly(&'static str),
    /// An item does not decode: the client's error.
    ClientError(ApiError),
}

/// Text-only reason: encoders failed the item twice (or there was no second encoder).
pub(crate) const REASON_ENCODER_FAILED: &str = "encoder-failed";

/// Text-only reason: no healthy encoder takes the item's kind.
pub(crate) const REASON_NO_ENCODER: &str = "no-encoder";

/// Encodes every item of a request for the LLM worker at `llm_url` (request `request`), each
/// first at `chosen[k]`.
pub(crate) async fn encode_request(
    encoders: &Encoders,
    model: &str,
    media: &ModelMedia,
    items: &[MediaItem],
    chosen: &[Arc<Worker>],
    llm_url: &str,
    request: &str,
) -> Verdict {
    let runs = items
        .iter()
        .zip(chosen)
        .enumerate()
        .map(|(slot, (item, first))| async move {
            encode_item(encoders, model, media, item, first.clone(), llm_url, request, slot).await
        });
    let verdicts = futures_util::future::join_all(runs).await;
    let mut cache_hits = 0;
    let mut text_only = None;
    for verdict in verdicts {
        match verdict {
            Verdict::ClientError(err) => return Verdict::ClientError(err),
            Verdict::TextOnly(reason) => text_only = Some(reason),
            Verdict::Delivered { cache_hits: hits } => cache_hits += hits,
        }
    }
    match text_only {
        Some(reason) => Verdict::TextOnly(reason),
        None => Verdict::Delivered { cache_hits },
    }
}

#[allow(clippy::too_many_arguments, reason = "one item's whole context, passed once")]
async fn encode_item(
    encoders: &Encoders,
    model: &str,
    media: &ModelMedia,
    item: &MediaItem,
    first: Arc<Worker>,
    llm_url: &str,
    request: &str,
    slot: usize,
) -> Verdict {
    let mut wire = EncodeItem {
        media_id: item.id(),
        kind: item.info.kind,
        tokens: item.tokens,
        frames: item.frames.clone(),
        duration_s: item.info.duration_s,
        format: item.info.container.to_string(),
        data: Some(base64::engine::general_purpose::STANDARD.encode(&item.data)),
        deliver: Delivery {
            url: llm_url.to_string(),
            request: request.to_string(),
            slot,
        },
    };
    let mut encoder = first;
    let mut tried = Vec::new();
    for attempt in 0..2 {
        if attempt > 0 {
            encoders.metrics.retries.inc();
        }
        tried.push(encoder.kv_id);
        match encoders.encode(&encoder, wire.clone()).await {
            Ok(outcome) if outcome.status.delivered() => {
                return Verdict::Delivered {
                    cache_hits: usize::from(outcome.status == ItemStatus::Cached),
                };
            }
            Ok(outcome) if outcome.status == ItemStatus::DecodeError => {
                return Verdict::ClientError(
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "invalid_media",
                        format!(
                            "content part {} of message {}: the encoder cannot decode it: {}",
                            item.part,
                            item.message,
                            outcome.message.unwrap_or_default()
                        ),
                    )
                    .with_param(Some(format!("messages[{}].content[{}]", item.message, item.part))),
                );
            }
            Ok(outcome) if outcome.status == ItemStatus::DeliveryFailed => {
                // The LLM worker is gone; another encoder cannot help.
                tracing::warn!(encoder = %encoder.name, reason = ?outcome.message, "features could not be delivered");
                return Verdict::TextOnly(REASON_ENCODER_FAILED);
            }
            Ok(outcome) => {
                tracing::warn!(encoder = %encoder.name, status = outcome.status.as_str(), reason = ?outcome.message, "encode failed");
                if outcome.status == ItemStatus::OutOfMemory {
                    reduce(&mut wire, item, media);
                }
            }
            Err(reason) => tracing::warn!(encoder = %encoder.name, %reason, "encode failed"),
        }
        match encoders.choose(model, item, &tried) {
            Some(next) => encoder = next,
            None => break,
        }
    }
    Verdict::TextOnly(REASON_ENCODER_FAILED)
}

/// Halves what an out-of-memory item asks for: every other frame of a video, half the width
/// and height of an image (audio is left as it is).
fn reduce(wire: &mut EncodeItem, item: &MediaItem, media: &ModelMedia) {
    match item.info.kind {
        MediaKind::Video => {
            let frames: Vec<u32> = wire.frames.iter().copied().step_by(2).collect();
            if !frames.is_empty() {
                wire.tokens = switchyard_media::video_tokens(media, &item.info, frames.len());
                wire.frames = frames;
            }
        }
        MediaKind::Image => {
            wire.tokens = switchyard_media::image_tokens(media, item.info.width / 2, item.info.height / 2).max(1);
        }
        MediaKind::Audio => {}
    }
}
