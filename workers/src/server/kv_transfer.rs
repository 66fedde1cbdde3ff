//! Prefill/decode disaggregation on a worker: both sides of vLLM's `kv_transfer_params` flow.
//!
//! Every LLM worker speaks both sides; its role only says which one a router uses it for.
//! *Prefill side*: a request with `do_remote_decode` is served as usual (the router asks for one
//! token), its prompt's blocks stay in the prefix cache, and the answer carries
//! [`KvTransferParams`] naming this worker ([`answer_params`]); `POST /v1/kv/export` then hands
//! out the leading run of the blocks a decode worker asks for that are still held ([`export`]).
//! *Decode side*: a request with `do_remote_prefill` has its prompt's block hashes computed
//! here, and the leading blocks not cached here already are pulled from the prefill worker
//! ([`pull`]): the export call (under a real-time deadline), then the import into the engine as
//! cached blocks, so the request's prefill computes only the uncovered tail. A transfer that
//! fails costs nothing but time: the worker imports what it got and prefills the rest. What
//! happened is reported in the [`KV_TRANSFER_HEADER`] of the answer and counted in the
//! worker's metrics.
//!
//! How a block moves depends on the engine's [`KvMedium`]. A simulated engine's blocks hold
//! nothing: they move by name (the names-only JSON answer), and the transfer's time is
//! simulated (bytes over the link's bandwidth: faster within a node than across nodes, divided
//! by the engine's speed-up). An engine whose blocks hold keys and values
//! ([`KvMedium::Payloads`], the native LLM) asks for them (`"payloads": true`) and takes the
//! blocks in only with them: a prefill worker whose engine can copy its blocks out answers them
//! in the binary framing of [`switchyard_protocol::kv_blocks`], read here under a bound of the
//! blocks asked for times this engine's block size (with room for another dtype, to be refused
//! by the engine, not cut off here), and the transfer takes the real time it takes. A
//! names-only answer to such a worker (a simulated prefill worker) is never imported: the
//! prompt is prefilled here, `local; reason=payload`. An engine that cannot take blocks in
//! ([`KvMedium::Opaque`]) prefills every prompt itself.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use switchyard_protocol::api::{
    ApiError, KV_EXPORT_PATH, KV_TRANSFER_HEADER, KvExportRequest, KvExportResponse, KvTransferFailure,
    KvTransferParams, KvTransferReport,
};
use switchyard_protocol::block_hash::{BlockHash, block_hashes};
use switchyard_protocol::kv_blocks::{self, KV_BLOCKS_CONTENT_TYPE, KvBlocks};
use switchyard_protocol::respond::{self, Body};

use super::State;
use crate::engine::{EngineHandle, KvImport, KvMedium};

/// Bytes of KV cache one token takes in Llama-3-8B at f16: keys and values × 32 layers × 8 KV
/// heads × 128 dimensions × 2 bytes (128 KiB). The simulated engine's default.
pub const LLAMA3_8B_KV_BYTES_PER_TOKEN: u64 = 2 * 32 * 8 * 128 * 2;

/// Largest names-only export answer read (a few hundred thousand block hashes), and the room
/// for the header of one with payloads.
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// Room per block of an answer with payloads beyond its keys and values: the engine's own
/// payload header and the block's share of the framing's JSON header.
const PAYLOAD_SLACK_BYTES: u64 = 4096;

/// How this worker moves KV blocks to and from other workers.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransferConfig {
    /// The worker's name in the answers it gives as a prefill worker (`remote_engine_id`);
    /// `None`: `worker-PORT`.
    pub engine_id: Option<String>,
    /// The machine the worker runs on (`remote_node`; empty when unknown): blocks between two
    /// workers of one named node move over the local link.
    pub node: String,
    /// The base URL decode workers reach this worker at (`remote_url`, and `remote_host` and
    /// `remote_port` from it); `None`: `http://` and the listening address.
    pub advertise_url: Option<String>,
    /// Bytes of KV cache one block takes; `None`: Llama-3-8B at f16
    /// ([`LLAMA3_8B_KV_BYTES_PER_TOKEN`] × the engine's block size). An engine whose blocks
    /// hold keys and values sets its own: it bounds the answers with payloads read.
    pub block_bytes: Option<u64>,
    /// Gigabytes (10⁹ bytes) per second between workers of the same node (NVLink-class); a
    /// simulated engine's transfers only.
    pub local_gbps: f64,
    /// Gigabytes per second between nodes (200 Gb/s RDMA is 25); a simulated engine's
    /// transfers only.
    pub remote_gbps: f64,
    /// How long (real time) a decode worker waits for a prefill worker's export answer before
    /// prefilling the prompt itself.
    pub timeout: Duration,
}

impl Default for KvTransferConfig {
    fn default() -> KvTransferConfig {
        KvTransferConfig {
            engine_id: None,
            node: String::new(),
            advertise_url: None,
            block_bytes: None,
            local_gbps: 300.0,
            remote_gbps: 25.0,
            timeout: Duration::from_millis(2000),
        }
    }
}

impl KvTransferConfig {
    /// Bytes of one KV block of `block_size` tokens: the configured size, else Llama-3-8B's.
    pub fn block_bytes(&self, block_size: usize) -> u64 {
        self.block_bytes
            .unwrap_or(LLAMA3_8B_KV_BYTES_PER_TOKEN.saturating_mul(block_size as u64))
    }

    /// The simulated time to move `bytes` to a worker on node `to_node` from one on
    /// `from_node` (within a node when both are named and equal), before the speed-up. Zero
    /// when the bandwidth is not a positive number.
    pub fn link_time(&self, bytes: u64, from_node: &str, to_node: &str) -> Duration {
        let same_node = !from_node.is_empty() && from_node == to_node;
        let gbps = if same_node { self.local_gbps } else { self.remote_gbps };
        if !(gbps.is_finite() && gbps > 0.0) {
            return Duration::ZERO;
        }
        Duration::try_from_secs_f64(bytes as f64 / (gbps * 1e9)).unwrap_or(Duration::MAX)
    }
}

/// Who this worker is to decode workers.
#[derive(Debug)]
struct Identity {
    engine_id: String,
    url: String,
    host: String,
    port: u16,
}

impl Identity {
    fn new(config: &KvTransferConfig, addr: SocketAddr) -> Identity {
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| format!("worker-{}", addr.port()));
        let advertised = config.advertise_url.as_deref().and_then(|url| {
            let uri: http::Uri = url.parse().ok()?;
            let host = uri.host()?.trim_matches(['[', ']']).to_string();
            let port = uri.port_u16().unwrap_or(80);
            Some((url.trim_end_matches('/').to_string(), host, port))
        });
        let (url, host, port) =
            advertised.unwrap_or_else(|| (format!("http://{addr}"), addr.ip().to_string(), addr.port()));
        Identity {
            engine_id,
            url,
            host,
            port,
        }
    }
}

/// One worker's transfer state: its identity, the HTTP client it pulls with, and counters.
pub(super) struct Transfers {
    identity: Identity,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Pulls by outcome: `remote`, then [`KvTransferFailure::ALL`] in order.
    outcomes: [AtomicU64; 1 + KvTransferFailure::ALL.len()],
    blocks: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl std::fmt::Debug for Transfers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfers")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Transfers {
    /// The transfer state of a worker listening on `addr`.
    pub(super) fn new(config: &KvTransferConfig, addr: SocketAddr) -> Transfers {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Transfers {
            identity: Identity::new(config, addr),
            client: Client::builder(TokioExecutor::new()).build(connector),
            outcomes: Default::default(),
            blocks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }

    fn record(&self, report: KvTransferReport) -> KvTransferReport {
        let slot = match report {
            KvTransferReport::Remote { blocks, bytes, ms } => {
                self.blocks.fetch_add(blocks, Ordering::Relaxed);
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
                self.nanos.fetch_add((ms * 1e6) as u64, Ordering::Relaxed);
                0
            }
            KvTransferReport::Local(failure) => {
                1 + KvTransferFailure::ALL
                    .iter()
                    .position(|known| *known == failure)
                    .unwrap_or_default()
            }
        };
        self.outcomes[slot].fetch_add(1, Ordering::Relaxed);
        report
    }

    /// Registers the transfer metrics (`kv_transfers_total{outcome}` and the amounts moved).
    pub(super) fn register_metrics(&self, registry: &mut Registry, engine: &EngineHandle) {
        let outcomes = Family::<Vec<(String, String)>, Counter>::default();
        let names = std::iter::once("remote").chain(KvTransferFailure::ALL.iter().map(|failure| failure.as_str()));
        for (name, count) in names.zip(&self.outcomes) {
            outcomes
                .get_or_create(&vec![("outcome".to_string(), name.to_string())])
                .inc_by(count.load(Ordering::Relaxed));
        }
        registry.register(
            "kv_transfers",
            "Requests that asked to pull their prompt's KV from a prefill worker, by outcome (remote: pulled; else why the worker prefilled itself)",
            outcomes,
        );
        let stats = engine.stats();
        let counters: [(&str, &str, u64); 4] = [
            (
                "kv_transfer_blocks",
                "KV blocks pulled from prefill workers",
                self.blocks.load(Ordering::Relaxed),
            ),
            (
                "kv_transfer_bytes",
                "Bytes of KV blocks pulled from prefill workers",
                self.bytes.load(Ordering::Relaxed),
            ),
            (
                "kv_imported_blocks",
                "KV blocks taken into the cache from other workers",
                stats.imported_blocks.load(Ordering::Relaxed),
            ),
            (
                "kv_exported_blocks",
                "KV blocks handed out to decode workers",
                stats.exported_blocks.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            let counter = Counter::<u64>::default();
            counter.inc_by(value);
            registry.register(name, help, counter);
        }
        let seconds = Counter::<f64, AtomicU64>::default();
        seconds.inc_by(self.nanos.load(Ordering::Relaxed) as f64 / 1e9);
        registry.register(
            "kv_transfer_seconds",
            "Seconds spent moving KV blocks from prefill workers",
            seconds,
        );
    }
}

/// Sequence hashes of `prompt`'s full blocks as `engine` keys them.
pub(super) fn prompt_hashes(engine: &EngineHandle, prompt: &[u32]) -> Vec<u64> {
    block_hashes(prompt, engine.config().block_size)
        .into_iter()
        .map(|hash| hash.sequence)
        .collect()
}

/// The `kv_transfer_params` a prefill worker answers: this worker, and the leading blocks of
/// `hashes` (the prompt's) it still holds.
pub(super) async fn answer_params(state: &State, hashes: Vec<u64>) -> KvTransferParams {
    let held = state.engine.held_blocks(hashes.clone()).await.unwrap_or(0);
    let identity = &state.kv.identity;
    KvTransferParams {
        do_remote_decode: Some(false),
        do_remote_prefill: Some(true),
        remote_engine_id: Some(identity.engine_id.clone()),
        remote_host: Some(identity.host.clone()),
        remote_port: Some(identity.port),
        remote_url: Some(identity.url.clone()),
        remote_node: Some(state.config.kv_transfer.node.clone()),
        remote_block_ids: Some(hashes[..held.min(hashes.len())].to_vec()),
    }
}

/// `POST /v1/kv/export`: the leading run of the asked blocks this worker holds, with their
/// keys and values when they are asked for and the engine has them.
pub(super) async fn export(state: &State, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let (parts, body) = request.into_parts();
    let body = respond::read_limited(&parts.headers, body, state.config.max_body_bytes).await?;
    let wanted: KvExportRequest = serde_json::from_slice(&body).map_err(|err| {
        ApiError::invalid_request("invalid_export", format!("the export request does not parse: {err}"))
    })?;
    let export = state.engine.export_kv(wanted.block_hashes).await.map_err(|err| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine_stopped",
            err.to_string(),
        )
    })?;
    match export.payloads {
        // Payloads only to a worker that asked: one that moves blocks by name has no use for
        // megabytes it would throw away.
        Some(payloads) if wanted.payloads => {
            let body = kv_blocks::encode(&export.block_hashes, &payloads).map_err(|err| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "export_failed",
                    err.to_string(),
                )
            })?;
            Ok(respond::text(StatusCode::OK, KV_BLOCKS_CONTENT_TYPE, body))
        }
        // Without payloads (a simulated engine, or one that could not copy its blocks): the
        // names, which an asker that needs payloads does not import.
        _ => Ok(respond::json(
            StatusCode::OK,
            &KvExportResponse {
                block_hashes: export.block_hashes,
                block_bytes: state.config.kv_transfer.block_bytes(state.engine.config().block_size),
            },
        )),
    }
}

/// A decode worker's pull of `prompt`'s blocks per `params`; never fails the request.
pub(super) async fn pull(state: &State, params: &KvTransferParams, prompt: &[u32]) -> KvTransferReport {
    let report = pull_blocks(state, params, prompt).await;
    if let KvTransferReport::Local(reason) = report {
        tracing::info!(
            reason = reason.as_str(),
            remote = params.remote_base_url().as_deref().unwrap_or(""),
            "KV pull failed; prefilling the prompt here"
        );
    }
    state.kv.record(report)
}

/// The header reporting `report`.
pub(super) fn header(report: KvTransferReport) -> Option<(&'static str, http::HeaderValue)> {
    http::HeaderValue::from_str(&report.to_string())
        .ok()
        .map(|value| (KV_TRANSFER_HEADER, value))
}

/// Records that a request asked for a pull this worker cannot do (e.g. it carries media).
pub(super) fn unsupported(state: &State) -> KvTransferReport {
    state.kv.record(KvTransferReport::Local(KvTransferFailure::Unsupported))
}

async fn pull_blocks(state: &State, params: &KvTransferParams, prompt: &[u32]) -> KvTransferReport {
    let engine = &state.engine;
    let medium = engine.kv_medium();
    if !medium.imports() || !engine.config().enable_prefix_caching {
        // Blocks that could not be taken in, or could never be found again, are not pulled.
        return KvTransferReport::Local(KvTransferFailure::Unsupported);
    }
    let chain = block_hashes(prompt, engine.config().block_size);
    let hashes: Vec<u64> = chain.iter().map(|hash| hash.sequence).collect();
    // Only the blocks missing here move; a prefix cached here already stays.
    let cached = engine.held_blocks(hashes.clone()).await.unwrap_or(0).min(hashes.len());
    if cached == hashes.len() {
        return KvTransferReport::Remote {
            blocks: 0,
            bytes: 0,
            ms: 0.0,
        };
    }
    let Some(base) = params.remote_base_url() else {
        return KvTransferReport::Local(KvTransferFailure::Connect);
    };
    let wanted = &hashes[cached..];
    let config = &state.config.kv_transfer;
    let block_bytes = config.block_bytes(engine.config().block_size);
    let payloads = medium == KvMedium::Payloads;
    let limit = answer_limit(wanted.len(), payloads.then_some(block_bytes));
    let started = Instant::now();
    let answer = match tokio::time::timeout(config.timeout, ask(&state.kv.client, &base, wanted, payloads, limit)).await
    {
        Ok(Ok(answer)) => answer,
        Ok(Err(failure)) => return KvTransferReport::Local(failure),
        Err(_) => return KvTransferReport::Local(KvTransferFailure::Timeout),
    };
    let moved = answer.block_hashes().len();
    if moved > wanted.len() || answer.block_hashes()[..] != wanted[..moved] {
        return KvTransferReport::Local(KvTransferFailure::Answer);
    }
    if moved == 0 {
        return KvTransferReport::Local(KvTransferFailure::Missing);
    }
    let chain = &chain[..cached + moved];
    match (medium, answer) {
        (KvMedium::Payloads, Answer::Blocks(blocks)) => import_payloads(state, chain, cached, blocks, started).await,
        // Blocks without their contents would make this engine attend to whatever its cache
        // held before: never imported.
        (KvMedium::Payloads, Answer::Names(_)) => KvTransferReport::Local(KvTransferFailure::Payload),
        (_, Answer::Names(answer)) => import_names(state, params, chain, cached, answer.block_bytes).await,
        // Payloads this worker did not ask for: the answer is not one to its question.
        (_, Answer::Blocks(_)) => KvTransferReport::Local(KvTransferFailure::Answer),
    }
}

/// The most bytes of an export answer read for `blocks` blocks: names only (`None`), or with
/// payloads of this engine's `block_bytes`. Twice that, so that a prefill worker caching the
/// same model in f32 for an f16 one here is refused by the engine with a reason that says so,
/// not cut off; still bounded by what was asked, so a peer cannot make this worker buffer more.
fn answer_limit(blocks: usize, block_bytes: Option<u64>) -> usize {
    let Some(block_bytes) = block_bytes else {
        return MAX_ANSWER_BYTES;
    };
    let payloads = block_bytes
        .saturating_mul(2)
        .saturating_add(PAYLOAD_SLACK_BYTES)
        .saturating_mul(blocks as u64);
    usize::try_from(payloads)
        .unwrap_or(usize::MAX)
        .saturating_add(MAX_ANSWER_BYTES)
}

/// Takes the moved blocks (`chain[cached..]`, whose keys and values are `blocks`) into the
/// engine; what moved, or why nothing did.
async fn import_payloads(
    state: &State,
    chain: &[BlockHash],
    cached: usize,
    blocks: KvBlocks,
    started: Instant,
) -> KvTransferReport {
    let bytes = blocks.payload_bytes();
    let import = KvImport {
        chain: chain.to_vec(),
        first: cached,
        payloads: Some(blocks.payloads),
    };
    let imported = match state.engine.import_kv(import).await {
        Ok(imported) => imported,
        Err(err) => {
            tracing::warn!(error = %err, "could not import KV blocks");
            return KvTransferReport::Local(KvTransferFailure::Payload);
        }
    };
    // The moved blocks cached here now: taken in, or computed meanwhile by another request.
    let landed = (imported.already_cached + imported.imported).saturating_sub(cached);
    if imported.refused && landed == 0 {
        return KvTransferReport::Local(KvTransferFailure::Payload);
    }
    if landed < chain.len() - cached {
        // A refused payload, or a pool full of running requests' blocks: the rest is
        // prefilled.
        tracing::debug!(
            ?imported,
            moved = chain.len() - cached,
            "imported fewer KV blocks than moved"
        );
    }
    let ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(
        blocks = landed,
        bytes,
        ms,
        "pulled KV blocks with their keys and values"
    );
    KvTransferReport::Remote {
        blocks: landed as u64,
        bytes,
        ms,
    }
}

/// Takes the moved blocks (`chain[cached..]`) into a simulated engine by name, after the
/// simulated time their `block_bytes` each take over the link.
async fn import_names(
    state: &State,
    params: &KvTransferParams,
    chain: &[BlockHash],
    cached: usize,
    block_bytes: u64,
) -> KvTransferReport {
    let engine = &state.engine;
    let moved = chain.len() - cached;
    // What moves is the prefill worker's blocks, at its size (the same model's, normally).
    let block_bytes = match block_bytes {
        0 => state.config.kv_transfer.block_bytes(engine.config().block_size),
        size => size,
    };
    let bytes = block_bytes.saturating_mul(moved as u64);
    let config = &state.config.kv_transfer;
    let link = config.link_time(bytes, params.remote_node.as_deref().unwrap_or(""), &config.node);
    let wait = link.div_f64(engine.config().speedup.max(f64::MIN_POSITIVE));
    let started = Instant::now();
    // Only this request waits: the engine goes on serving others while its blocks arrive,
    // as with an RDMA transfer.
    tokio::time::sleep(wait).await;
    let import = KvImport {
        chain: chain.to_vec(),
        first: cached,
        payloads: None,
    };
    match engine.import_kv(import).await {
        Ok(imported) if imported.imported + imported.already_cached < chain.len() => {
            // The pool was full of running requests' blocks: the rest is prefilled.
            tracing::debug!(?imported, moved, "imported fewer KV blocks than moved");
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "could not import KV blocks"),
    }
    tracing::debug!(
        blocks = moved,
        bytes,
        simulated_ms = wait.as_secs_f64() * 1e3,
        waited_ms = started.elapsed().as_secs_f64() * 1e3,
        "pulled KV blocks"
    );
    KvTransferReport::Remote {
        blocks: moved as u64,
        bytes,
        ms: wait.as_secs_f64() * 1e3,
    }
}

/// A prefill worker's export answer.
#[derive(Debug)]
enum Answer {
    /// The blocks by name (a simulated engine's, or without the payloads asked for).
    Names(KvExportResponse),
    /// The blocks with their keys and values.
    Blocks(KvBlocks),
}

impl Answer {
    fn block_hashes(&self) -> &[u64] {
        match self {
            Answer::Names(answer) => &answer.block_hashes,
            Answer::Blocks(blocks) => &blocks.block_hashes,
        }
    }
}

/// Asks the prefill worker at `base` for `wanted` (with their `payloads`, if asked), reading at
/// most `limit` bytes of answer; its answer, or why there is none.
async fn ask(
    client: &Client<HttpConnector, Full<Bytes>>,
    base: &str,
    wanted: &[u64],
    payloads: bool,
    limit: usize,
) -> Result<Answer, KvTransferFailure> {
    let body = serde_json::to_vec(&KvExportRequest {
        block_hashes: wanted.to_vec(),
        payloads,
    })
    .map_err(|_| KvTransferFailure::Answer)?;
    let request = Request::post(format!("{base}{KV_EXPORT_PATH}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        // An address that does not make a URL is nowhere to connect to.
        .map_err(|_| KvTransferFailure::Connect)?;
    let response = client.request(request).await.map_err(|_| KvTransferFailure::Connect)?;
    if response.status() != StatusCode::OK {
        return Err(KvTransferFailure::Status);
    }
    let framed = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim().eq_ignore_ascii_case(KV_BLOCKS_CONTENT_TYPE));
    let body = Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map_err(|_| KvTransferFailure::Answer)?
        .to_bytes();
    if framed {
        return kv_blocks::decode(body).map(Answer::Blocks).map_err(|err| {
            tracing::debug!(error = %err, "a KV blocks answer that does not read");
            KvTransferFailure::Payload
        });
    }
    serde_json::from_slice(&body)
        .map(Answer::Names)
        .map_err(|_| KvTransferFailure::Answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_time_is_bytes_over_the_bandwidth_of_the_link_taken() {
        let config = KvTransferConfig {
            local_gbps: 100.0,
            remote_gbps: 10.0,
            ..KvTransferConfig::default()
        };
        let gigabyte = 1_000_000_000;
        assert_eq!(config.link_time(gigabyte, "a", "a"), Duration::from_millis(10));
        assert_eq!(config.link_time(gigabyte, "a", "b"), Duration::from_millis(100));
        assert_eq!(
            config.link_time(gigabyte, "", ""),
            Duration::from_millis(100),
            "unnamed nodes are not the same node"
        );
        let broken = KvTransferConfig {
            remote_gbps: 0.0,
            ..config
        };
        assert_eq!(broken.link_time(gigabyte, "a", "b"), Duration::ZERO);
    }

    #[test]
    fn an_answer_with_payloads_is_bounded_by_the_blocks_asked_for() {
        assert_eq!(answer_limit(1000, None), MAX_ANSWER_BYTES);
        assert_eq!(
            answer_limit(3, Some(1000)),
            MAX_ANSWER_BYTES + 3 * (2000 + PAYLOAD_SLACK_BYTES as usize)
        );
        assert_eq!(answer_limit(usize::MAX, Some(u64::MAX)), usize::MAX);
    }

    #[test]
    fn the_default_block_is_llama_3_8b_at_f16() {
        let config = KvTransferConfig::default();
        assert_eq!(config.block_bytes(16), 16 * 131_072);
        let set = KvTransferConfig {
            block_bytes: Some(7),
            ..config
        };
        assert_eq!(set.block_bytes(16), 7);
    }

    #[test]
    fn the_identity_comes_from_the_advertised_url_or_the_listening_address() {
        let addr: SocketAddr = "127.0.0.1:8100".parse().expect("an address");
        let own = Identity::new(&KvTransferConfig::default(), addr);
        assert_eq!(own.engine_id, "worker-8100");
        assert_eq!(own.url, "http://127.0.0.1:8100");
        assert_eq!((own.host.as_str(), own.port), ("127.0.0.1", 8100));
        let advertised = Identity::new(
            &KvTransferConfig {
                engine_id: Some("prefill-0".into()),
                advertise_url: Some("http://[fd00::2]:9000/".into()),
                ..KvTransferConfig::default()
            },
            addr,
        );
        assert_eq!(advertised.engine_id, "prefill-0");
        assert_eq!(advertised.url, "http://[fd00::2]:9000");
        assert_eq!((advertised.host.as_str(), advertised.port), ("fd00::2", 9000));
    }
}
