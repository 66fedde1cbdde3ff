//! The simulated encoder: a vision or audio encoder worker without a GPU.
//!
//! It serves the encoder side of `switchyard_protocol::encode`: `POST /v1/encode` takes a
//! micro-batch, checks each item's bytes (base64, the media id, the container's headers: what
//! fails here is the client's error, [`ItemStatus::DecodeError`]), serves what its
//! [`cache::FeatureCache`] holds, and runs the rest through one simulated device
//! that encodes a batch at a time, taking as long as the reference cost curves say
//! ([`batch_cost_ms`]: SigLIP-L images 4.8/7.2/10.1/16.3/29.7 ms at batch 1/4/8/16/32, video
//! 1.6 ms per frame, audio 2.8 ms per second), times a cost scale, divided by a speed-up. The
//! features it makes up (rows × `feature_dim` little-endian f16, deterministic per media id) are
//! cached, announced as KV events, and pushed to the LLM worker each item names; the answer
//! lists each item's outcome in batch order. Fault injection (every n-th encode fails; videos
//! over a frame count run out of memory) lets tests exercise the gateway's retries.
//!
//! The same server runs real encoders: given an [`EncodeDevice`] (`switchyard-encoder`'s
//! native models), each pass runs the device on a blocking thread instead of the simulated
//! clock, and the features pushed are the model's, with its own row counts.

pub mod cache;
#[cfg(feature = "native-encoders")]
pub mod native;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use switchyard_media::{MediaId, MediaKind};
use switchyard_protocol::Role;
use switchyard_protocol::api::ApiError;
use switchyard_protocol::encode::{
    AUDIO_MS_PER_SECOND, ENCODE, EncodeBatch, EncodeItem, EncodeReply, FEATURE_DIM_HEADER, ItemOutcome, ItemStatus,
    MEDIA_ID_HEADER, TOKENS_HEADER, VIDEO_MS_PER_FRAME, features_path, image_batch_ms,
};
use switchyard_protocol::kv_events::{EventLog, KvEvent};
use switchyard_protocol::paths::{HEALTH, HEALTHZ, KV_DUMP, METRICS};
use switchyard_protocol::respond::{self, Body};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use cache::{Cached, FeatureCache};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// How long pushing one item's features to an LLM worker may take.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// What runs a micro-batch when the encoder is not simulated: a native model.
pub trait EncodeDevice: std::fmt::Debug + Send + Sync + 'static {
    /// Encodes `items` (every one with its bytes, every one of this encoder's role) in one
    /// pass, on the calling (blocking) thread. One result per item, in order: its features
    /// (`rows × feature_dim` little-endian f16 values), the row count and the item's share of
    /// the pass in milliseconds, or why it failed (a decode failure is
    /// [`ItemStatus::DecodeError`]: the client's error).
    fn encode(&self, items: &[EncodeItem]) -> Vec<Encoded>;

    /// Width of a feature row.
    fn feature_dim(&self) -> usize;

    /// Counters of the device's own, exported on `/metrics` under the encoder's prefix: `(name,
    /// help, value)` (a GPU device's CUDA graph replays and eager runs). None by default.
    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        Vec::new()
    }
}

/// Settings of one encoder (simulated unless `device` is set).
#[derive(Debug, Clone)]
pub struct EncoderConfig {
    /// `vision` (images and video) or `audio`.
    pub role: Role,
    /// The model whose requests it encodes for.
    pub model: String,
    /// Width of a feature row (f16 values) in the features it pushes.
    pub feature_dim: usize,
    /// Bytes of features its cache holds.
    pub cache_bytes: u64,
    /// Multiplies every encode time (a slower or faster device than the measured one).
    pub cost_scale: f64,
    /// Simulated time runs this many times faster.
    pub speedup: f64,
    /// Largest accepted batch body.
    pub max_body_bytes: usize,
    /// Token budgets it batches to (advertised to gateways; its CUDA-graph sizes on a GPU).
    pub token_budgets: Vec<u32>,
    /// Fault injection: every n-th encoded item fails.
    pub fail_every: Option<u64>,
    /// Fault injection: a video with more frames than this runs out of memory.
    pub oom_above_frames: Option<u32>,
    /// The numbered event log a gateway resyncs from (`GET /kv/dump`), when the encoder
    /// publishes its events over HTTP.
    pub kv_log: Option<Arc<Mutex<EventLog>>>,
    /// A native device to run the passes on; `None` simulates one.
    pub device: Option<Arc<dyn EncodeDevice>>,
}

impl Default for EncoderConfig {
    fn default() -> EncoderConfig {
        EncoderConfig {
            role: Role::Vision,
            model: "mock".into(),
            feature_dim: 64,
            cache_bytes: 1 << 30,
            cost_scale: 1.0,
            speedup: 1.0,
            max_body_bytes: 64 << 20,
            token_budgets: vec![576, 2304, 4608, 9216, 18432],
            fail_every: None,
            oom_above_frames: None,
            kv_log: None,
            device: None,
        }
    }
}

/// The simulated cost of encoding `items` in one pass: the total and each item's share, in
/// milliseconds, before scaling. Images share the batch curve equally; a video costs its
/// frames; audio its seconds.
pub fn batch_cost_ms(items: &[&EncodeItem]) -> (f64, Vec<f64>) {
    let images = items.iter().filter(|i| i.kind == MediaKind::Image).count();
    let image_share = if images == 0 {
        0.0
    } else {
        image_batch_ms(images) / images as f64
    };
    let shares: Vec<f64> = items
        .iter()
        .map(|item| match item.kind {
            MediaKind::Image => image_share,
            MediaKind::Video => item.frames.len().max(1) as f64 * VIDEO_MS_PER_FRAME,
            MediaKind::Audio => item.duration_s.max(0.0) * AUDIO_MS_PER_SECOND,
        })
        .collect();
    (shares.iter().sum(), shares)
}

/// The features a simulated encoder makes up for an item: `tokens` rows of `dim` f16 values,
/// the same for the same media id.
pub fn mock_features(id: MediaId, tokens: u32, dim: usize) -> Bytes {
    let mut out = Vec::with_capacity(tokens as usize * dim * 2);
    let seed = (id.0 as u64) ^ ((id.0 >> 64) as u64);
    for row in 0..tokens as u64 {
        let mut state = xxhash_rust::xxh3::xxh3_64_with_seed(&row.to_le_bytes(), seed);
        for _ in 0..dim {
            // Small positive halves: exponent of 0.5..1, a random mantissa.
            let value: u16 = 0x3800 | (state as u16 & 0x03ff);
            out.extend_from_slice(&value.to_le_bytes());
            state = state.rotate_left(10) ^ 0x9e37_79b9_7f4a_7c15;
        }
    }
    Bytes::from(out)
}

/// A histogram per label set, built by a plain constructor.
pub type HistogramFamily = Family<Vec<(String, String)>, Histogram, fn() -> Histogram>;

/// Distributions of an encoder's work, exported as Prometheus histograms.
#[derive(Debug)]
pub struct EncoderHistograms {
    /// Seconds of device time per encoded item, by modality (`image`, `video`, `audio`).
    pub encode_seconds: HistogramFamily,
    /// Items per forward pass (batch fill).
    pub batch_items: Histogram,
}

fn encode_seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

impl Default for EncoderHistograms {
    fn default() -> EncoderHistograms {
        EncoderHistograms {
            encode_seconds: Family::new_with_constructor(encode_seconds_histogram),
            batch_items: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
        }
    }
}

/// Live counters of an encoder.
#[derive(Debug, Default)]
pub struct EncoderStats {
    /// Batches received.
    pub batches: AtomicU64,
    /// Items received.
    pub items: AtomicU64,
    /// Items encoded (cache misses run on the device).
    pub encoded: AtomicU64,
    /// Items served from the feature cache.
    pub cache_hits: AtomicU64,
    /// Items that failed (any reason).
    pub failures: AtomicU64,
    /// Forward passes run.
    pub passes: AtomicU64,
    /// Nanoseconds the device was busy.
    pub busy_nanos: AtomicU64,
    /// Items waiting for or in a forward pass.
    pub queued: AtomicU64,
    /// Bytes of features pushed to LLM workers.
    pub feature_bytes: AtomicU64,
    /// Encode times per modality and batch fill.
    pub histograms: EncoderHistograms,
}

/// An item's features, their rows and its encode milliseconds, or its failure and why.
pub type Encoded = Result<(Bytes, u32, f64), (ItemStatus, String)>;

/// As [`Encoded`], and whether the features came from the cache.
type Served = Result<(Bytes, u32, f64, bool), (ItemStatus, String)>;

struct Pass {
    items: Vec<EncodeItem>,
    reply: oneshot::Sender<Vec<Encoded>>,
}

struct Shared {
    config: EncoderConfig,
    cache: Mutex<FeatureCache>,
    events: Mutex<Option<mpsc::UnboundedSender<KvEvent>>>,
    stats: EncoderStats,
    client: Client<HttpConnector, Full<Bytes>>,
    device: mpsc::UnboundedSender<Pass>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("role", &self.config.role)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn feature_dim(&self) -> usize {
        self.config
            .device
            .as_ref()
            .map_or(self.config.feature_dim, |device| device.feature_dim())
    }

    fn announce(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        if let Ok(sink) = self.events.lock()
            && let Some(sink) = sink.as_ref()
        {
            for event in events {
                let _ = sink.send(event);
            }
        }
    }
}

/// A simulated encoder serving HTTP; it stops when dropped.
#[derive(Debug)]
pub struct EncoderServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl EncoderServer {
    /// Serves an encoder on `listener` from the current tokio runtime.
    ///
    /// # Errors
    ///
    /// The I/O error if the listener's address cannot be read.
    pub fn start(listener: TcpListener, config: EncoderConfig) -> std::io::Result<EncoderServer> {
        let addr = listener.local_addr()?;
        let (device, passes) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            cache: Mutex::new(FeatureCache::new(config.cache_bytes)),
            config,
            events: Mutex::new(None),
            stats: EncoderStats::default(),
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            device,
        });
        let device = tokio::spawn(run_device(shared.clone(), passes));
        let serving = shared.clone();
        let accept = tokio::spawn(async move {
            switchyard_protocol::serve::serve_http(listener, "encoder", move |request| {
                handle(serving.clone(), request)
            })
            .await;
        });
        Ok(EncoderServer {
            addr,
            shared,
            tasks: vec![device, accept],
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its settings.
    pub fn config(&self) -> &EncoderConfig {
        &self.shared.config
    }

    /// Its counters.
    pub fn stats(&self) -> &EncoderStats {
        &self.shared.stats
    }

    /// Sends every future feature-cache event to `sink` (replacing an earlier sink).
    pub fn subscribe_kv_events(&self, sink: mpsc::UnboundedSender<KvEvent>) {
        if let Ok(mut slot) = self.shared.events.lock() {
            *slot = Some(sink);
        }
    }
}

impl Drop for EncoderServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts `count` encoders on `host`, one port each (`base_port` 0: ephemeral ports).
///
/// # Errors
///
/// The I/O error of the first port that cannot be bound.
pub async fn spawn_encoders(
    count: usize,
    host: std::net::IpAddr,
    base_port: u16,
    config: &EncoderConfig,
) -> std::io::Result<Vec<EncoderServer>> {
    let mut servers = Vec::with_capacity(count);
    for index in 0..count {
        let port = crate::mocker::fleet_port(base_port, index)?;
        let listener = TcpListener::bind(SocketAddr::new(host, port)).await?;
        servers.push(EncoderServer::start(listener, config.clone())?);
    }
    Ok(servers)
}

/// The device: one forward pass at a time, as long as the cost curves say.
async fn run_device(shared: Arc<Shared>, mut passes: mpsc::UnboundedReceiver<Pass>) {
    let config = &shared.config;
    let mut encoded: u64 = 0;
    while let Some(pass) = passes.recv().await {
        let started = Instant::now();
        if let Some(device) = &config.device {
            let device = device.clone();
            let items = pass.items.clone();
            let results = tokio::task::spawn_blocking(move || device.encode(&items))
                .await
                .unwrap_or_else(|err| {
                    vec![Err((ItemStatus::Failed, format!("the encoder device panicked: {err}"))); pass.items.len()]
                });
            let mut events = Vec::new();
            if let Ok(mut cache) = shared.cache.lock() {
                for (item, result) in pass.items.iter().zip(&results) {
                    if let Ok((data, tokens, _)) = result {
                        let cached = Cached {
                            tokens: *tokens,
                            data: data.clone(),
                        };
                        cache.insert(item.media_id, cached, &mut events);
                    }
                }
            }
            shared.announce(events);
            shared.stats.passes.fetch_add(1, Ordering::Relaxed);
            shared
                .stats
                .busy_nanos
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let _ = pass.reply.send(results);
            continue;
        }
        let items: Vec<&EncodeItem> = pass.items.iter().collect();
        let (total_ms, shares) = batch_cost_ms(&items);
        let scale = config.cost_scale / config.speedup;
        tokio::time::sleep(Duration::from_secs_f64((total_ms * scale / 1000.0).max(0.0))).await;
        let mut results = Vec::with_capacity(items.len());
        let mut events = Vec::new();
        for (item, share) in items.iter().zip(shares) {
            encoded += 1;
            if let Some(frames) = config.oom_above_frames
                && item.kind == MediaKind::Video
                && item.frames.len() > frames as usize
            {
                results.push(Err((
                    ItemStatus::OutOfMemory,
                    format!("out of memory encoding {} frames (limit {frames})", item.frames.len()),
                )));
                continue;
            }
            if config.fail_every.is_some_and(|n| n > 0 && encoded.is_multiple_of(n)) {
                results.push(Err((ItemStatus::Failed, "injected encoder failure".to_string())));
                continue;
            }
            let features = mock_features(item.media_id, item.tokens, config.feature_dim);
            if let Ok(mut cache) = shared.cache.lock() {
                cache.insert(
                    item.media_id,
                    Cached {
                        tokens: item.tokens,
                        data: features.clone(),
                    },
                    &mut events,
                );
            }
            results.push(Ok((features, item.tokens, share * config.cost_scale)));
        }
        shared.announce(events);
        shared.stats.passes.fetch_add(1, Ordering::Relaxed);
        shared
            .stats
            .busy_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let _ = pass.reply.send(results);
    }
}

async fn handle(shared: Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let result = match (method.clone(), path.as_str()) {
        (Method::POST, ENCODE) => encode(&shared, request).await,
        (Method::GET, HEALTHZ | HEALTH) => Ok(respond::text(StatusCode::OK, "text/plain", "ok\n")),
        (Method::GET, METRICS) => Ok(metrics(&shared)),
        (Method::GET, KV_DUMP) => dump(&shared),
        (_, ENCODE) => Err(respond::method_not_allowed(&method, &path, "POST")),
        (_, HEALTHZ | HEALTH | METRICS | KV_DUMP) => Err(respond::method_not_allowed(&method, &path, "GET")),
        _ => Err(respond::not_found(&path)),
    };
    result.unwrap_or_else(|err| respond::error(&err))
}

/// Checks an item's bytes as far as an encoder would decode them.
fn check_item(item: &EncodeItem) -> Result<(), String> {
    let Some(data) = &item.data else {
        return Ok(());
    };
    let bytes = switchyard_media::decode_base64(data).map_err(|err| err.to_string())?;
    let id = MediaId::of(&bytes);
    if id != item.media_id {
        return Err(format!("the bytes hash to {id}, not {}", item.media_id));
    }
    let probed = match item.kind {
        MediaKind::Image => switchyard_media::probe_image(&bytes),
        MediaKind::Audio => switchyard_media::probe_audio(&bytes, &item.format),
        MediaKind::Video => switchyard_media::probe_video(&bytes),
    };
    let info = probed.map_err(|err| err.to_string())?;
    // Decoding checks what the gateway's header probe does not; of that, the simulation checks
    // what it can without pixels: a PNG's chunk CRCs.
    if info.container == switchyard_media::Container::Png {
        switchyard_media::verify_png_crcs(&bytes).map_err(|err| err.to_string())?;
    }
    Ok(())
}

async fn encode(shared: &Arc<Shared>, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let (parts, body) = request.into_parts();
    let body = respond::read_limited(&parts.headers, body, shared.config.max_body_bytes).await?;
    let batch: EncodeBatch = serde_json::from_slice(&body)
        .map_err(|err| ApiError::invalid_request("invalid_batch", format!("the encode batch does not parse: {err}")))?;
    let stats = &shared.stats;
    stats.batches.fetch_add(1, Ordering::Relaxed);
    stats.items.fetch_add(batch.items.len() as u64, Ordering::Relaxed);
    let accepts = |kind: MediaKind| match shared.config.role {
        Role::Vision => matches!(kind, MediaKind::Image | MediaKind::Video),
        Role::Audio => kind == MediaKind::Audio,
        Role::Llm | Role::Prefill | Role::Decode => false,
    };
    // Per item: its features and encode time, or why not.
    let mut results: Vec<Option<Served>> = vec![None; batch.items.len()];
    let mut misses = Vec::new();
    for (index, item) in batch.items.iter().enumerate() {
        if !accepts(item.kind) {
            results[index] = Some(Err((
                ItemStatus::Failed,
                format!("a {} encoder does not encode {}", shared.config.role, item.kind),
            )));
            continue;
        }
        if let Err(reason) = check_item(item) {
            results[index] = Some(Err((ItemStatus::DecodeError, reason)));
            continue;
        }
        let native = shared.config.device.is_some();
        let hit = shared.cache.lock().ok().and_then(|mut cache| {
            if native {
                cache.get_any(item.media_id)
            } else {
                cache.get(item.media_id, item.tokens)
            }
        });
        match (hit, &item.data) {
            (Some(cached), _) => results[index] = Some(Ok((cached.data, cached.tokens, 0.0, true))),
            (None, None) => {
                results[index] = Some(Err((
                    ItemStatus::NotCached,
                    format!(
                        "media {} is not cached here and the batch has no data for it",
                        item.media_id
                    ),
                )));
            }
            (None, Some(_)) => misses.push(index),
        }
    }
    if !misses.is_empty() {
        let (reply, answer) = oneshot::channel();
        let items: Vec<EncodeItem> = misses.iter().map(|&i| batch.items[i].clone()).collect();
        stats.queued.fetch_add(items.len() as u64, Ordering::Relaxed);
        stats.histograms.batch_items.observe(items.len() as f64);
        let sent = shared.device.send(Pass { items, reply }).is_ok();
        let outcomes = if sent { answer.await.ok() } else { None };
        stats.queued.fetch_sub(misses.len() as u64, Ordering::Relaxed);
        match outcomes {
            Some(outcomes) => {
                for (&index, outcome) in misses.iter().zip(outcomes) {
                    results[index] = Some(outcome.map(|(data, tokens, ms)| (data, tokens, ms, false)));
                }
            }
            None => {
                for &index in &misses {
                    results[index] = Some(Err((ItemStatus::Failed, "the encoder device stopped".into())));
                }
            }
        }
    }
    let deliveries = batch.items.iter().zip(results).map(|(item, result)| async move {
        match result {
            Some(Ok((data, tokens, ms, cached))) => {
                let status = if cached {
                    ItemStatus::Cached
                } else {
                    ItemStatus::Encoded
                };
                let bytes = data.len() as u64;
                match deliver(shared, item, data, tokens).await {
                    Ok(()) => {
                        shared.stats.feature_bytes.fetch_add(bytes, Ordering::Relaxed);
                        if !cached {
                            shared
                                .stats
                                .histograms
                                .encode_seconds
                                .get_or_create(&vec![("modality".to_string(), item.kind.to_string())])
                                .observe(ms / 1e3);
                        }
                        outcome(item, status, tokens, ms, None)
                    }
                    Err(reason) => outcome(item, ItemStatus::DeliveryFailed, 0, ms, Some(reason)),
                }
            }
            Some(Err((status, reason))) => outcome(item, status, 0, 0.0, Some(reason)),
            None => outcome(item, ItemStatus::Failed, 0, 0.0, Some("not processed".into())),
        }
    });
    let items = futures_util::future::join_all(deliveries).await;
    for item in &items {
        match item.status {
            ItemStatus::Encoded => stats.encoded.fetch_add(1, Ordering::Relaxed),
            ItemStatus::Cached => stats.cache_hits.fetch_add(1, Ordering::Relaxed),
            _ => stats.failures.fetch_add(1, Ordering::Relaxed),
        };
    }
    let reply = EncodeReply {
        batch_size: misses.len(),
        items,
    };
    Ok(respond::json(StatusCode::OK, &reply))
}

fn outcome(item: &EncodeItem, status: ItemStatus, tokens: u32, encode_ms: f64, message: Option<String>) -> ItemOutcome {
    if let Some(message) = &message {
        tracing::warn!(media = %item.media_id, status = status.as_str(), %message, "encode item failed");
    }
    ItemOutcome {
        media_id: item.media_id,
        status,
        tokens,
        encode_ms,
        message,
    }
}

/// Pushes an item's features to the LLM worker it names.
async fn deliver(shared: &Shared, item: &EncodeItem, data: Bytes, tokens: u32) -> Result<(), String> {
    let target = &item.deliver;
    let url = format!(
        "{}{}",
        target.url.trim_end_matches('/'),
        features_path(&target.request, target.slot)
    );
    let request = Request::post(&url)
        .header(http::header::CONTENT_TYPE, "application/octet-stream")
        .header(MEDIA_ID_HEADER, item.media_id.to_string())
        .header(TOKENS_HEADER, tokens.to_string())
        .header(FEATURE_DIM_HEADER, shared.feature_dim().to_string())
        .body(Full::new(data))
        .map_err(|err| format!("bad delivery URL `{url}`: {err}"))?;
    let response = tokio::time::timeout(DELIVERY_TIMEOUT, shared.client.request(request))
        .await
        .map_err(|_| format!("`{url}` did not take the features within {DELIVERY_TIMEOUT:?}"))?
        .map_err(|err| format!("`{url}`: {err}"))?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("`{url}` refused the features: {}", response.status()))
    }
}

fn dump(shared: &Shared) -> Result<Response<Body>, ApiError> {
    let Some(log) = &shared.config.kv_log else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no_kv_log",
            "this encoder does not publish its cache events over HTTP",
        ));
    };
    let dump = log.lock().map(|log| log.dump()).map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "kv_log_poisoned",
            "the event log is unusable",
        )
    })?;
    Ok(respond::json(StatusCode::OK, &dump))
}

fn metrics(shared: &Shared) -> Response<Body> {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;

    let stats = &shared.stats;
    let mut registry = Registry::with_prefix("switchyard_encoder");
    let counters: [(&str, &str, &AtomicU64); 7] = [
        (
            "feature_bytes",
            "Bytes of features pushed to LLM workers",
            &stats.feature_bytes,
        ),
        ("batches", "Encode batches received", &stats.batches),
        ("items", "Media items received", &stats.items),
        ("encoded_items", "Items encoded on the device", &stats.encoded),
        ("cache_hits", "Items served from the feature cache", &stats.cache_hits),
        ("failed_items", "Items that failed", &stats.failures),
        ("passes", "Forward passes run", &stats.passes),
    ];
    for (name, help, value) in counters {
        let counter = Counter::<u64>::default();
        counter.inc_by(value.load(Ordering::Relaxed));
        registry.register(name, help, counter);
    }
    if let Some(device) = &shared.config.device {
        for (name, help, value) in device.counters() {
            let counter = Counter::<u64>::default();
            counter.inc_by(value);
            registry.register(name, help, counter);
        }
    }
    let busy = Counter::<f64, AtomicU64>::default();
    busy.inc_by(stats.busy_nanos.load(Ordering::Relaxed) as f64 / 1e9);
    registry.register("busy_seconds", "Seconds the device spent encoding", busy);
    let (cached_bytes, cached_items) = shared
        .cache
        .lock()
        .map(|cache| (cache.used(), cache.len()))
        .unwrap_or((0, 0));
    let gauges: [(&str, &str, i64); 3] = [
        (
            "queued_items",
            "Items waiting for or in a forward pass",
            stats.queued.load(Ordering::Relaxed) as i64,
        ),
        ("cache_bytes", "Bytes of features cached", cached_bytes as i64),
        ("cache_items", "Media items cached", cached_items as i64),
    ];
    for (name, help, value) in gauges {
        let gauge = Gauge::<i64>::default();
        gauge.set(value);
        registry.register(name, help, gauge);
    }
    registry.register(
        "encode_seconds",
        "Device seconds per encoded item (its share of the forward pass), by modality",
        stats.histograms.encode_seconds.clone(),
    );
    registry.register(
        "batch_items",
        "Items per forward pass (batch fill)",
        stats.histograms.batch_items.clone(),
    );
    crate::server::metrics_response(&registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_costs_follow_the_seed_table() {
        let item = |kind, frames: usize, duration_s| EncodeItem {
            media_id: MediaId(1),
            kind,
            tokens: 1,
            frames: (0..frames as u32).collect(),
            duration_s,
            format: String::new(),
            data: None,
            deliver: switchyard_protocol::encode::Delivery {
                url: String::new(),
                request: "r".into(),
                slot: 0,
            },
        };
        let video = item(MediaKind::Video, 30, 10.0);
        let audio = item(MediaKind::Audio, 0, 30.0);
        let image = item(MediaKind::Image, 0, 0.0);
        let (total, shares) = batch_cost_ms(&[&video, &audio, &image, &image]);
        assert!((shares[0] - 48.0).abs() < 1e-9, "30 frames → 48 ms");
        assert!((shares[1] - 84.0).abs() < 1e-9, "30 s → 84 ms");
        assert!((shares[2] - 2.8).abs() < 1e-9, "two images share 5.6 ms");
        assert!((total - (48.0 + 84.0 + 5.6)).abs() < 1e-9);
    }

    #[test]
    fn mock_features_are_deterministic_rows_of_halves() {
        let a = mock_features(MediaId(5), 3, 4);
        assert_eq!(a.len(), 3 * 4 * 2);
        assert_eq!(a, mock_features(MediaId(5), 3, 4));
        assert_ne!(a, mock_features(MediaId(6), 3, 4));
    }
}
