//! The applier's state machine, driven message by message with tokio's clock paused: in-order
//! events, duplicates, a gap and its resync (events buffered meanwhile, the buffer's overflow),
//! a restarted worker, a lost tail noticed from heartbeats, and heartbeat expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use switchyard_protocol::Role;
use switchyard_protocol::block_hash::{BlockHash, block_hashes};
use switchyard_protocol::kv_events::{DumpBlock, KvDump, KvEvent, Registration, StorageTier, StoredBlock, WorkerEvent};
use tokio::sync::{mpsc, watch};

use super::{BoxFuture, DumpSource, Inbound, SyncConfig, spawn};
use crate::config::{Config, WorkerConfig};
use crate::kv::KvState;
use crate::metrics::Metrics;
use crate::workers::WorkerPool;

const BLOCK: usize = 4;

/// Dumps answered when the test says so (each answer serves one request), counting the
/// requests.
#[derive(Debug)]
struct Dumps {
    requests: AtomicUsize,
    answer: Arc<watch::Sender<Option<KvDump>>>,
    answers_dumps: bool,
}

impl Dumps {
    fn new(answers_dumps: bool) -> Arc<Dumps> {
        Arc::new(Dumps {
            requests: AtomicUsize::new(0),
            answer: Arc::new(watch::channel(None).0),
            answers_dumps,
        })
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl DumpSource for Dumps {
    fn request(&self, _worker: String) -> BoxFuture<Result<KvDump, String>> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let answer = self.answer.clone();
        let mut ready = answer.subscribe();
        Box::pin(async move {
            ready.wait_for(Option::is_some).await.map_err(|_| "gone".to_string())?;
            answer.send_replace(None).ok_or_else(|| "no dump".to_string())
        })
    }

    fn answers_dumps(&self) -> bool {
        self.answers_dumps
    }
}

struct Fixture {
    kv: Arc<KvState>,
    pool: Arc<WorkerPool>,
    inbound: mpsc::UnboundedSender<Inbound>,
    chain: Vec<BlockHash>,
}

/// An applier over a pool with worker `w` configured (block size 4), and a chain of 16
/// blocks to announce.
fn fixture(config: SyncConfig) -> Fixture {
    let gateway = Config::parse(
        "[server]\nplaintext = true\n[[models]]\nname = \"m\"\nblock_size = 4\n[[workers]]\nurl = \"http://127.0.0.1:9\"\nmodel = \"m\"\nblock_size = 4\n",
        std::path::Path::new("test.toml"),
    )
    .expect("valid");
    let kv = Arc::new(KvState::new(&gateway).expect("kv state"));
    let worker = WorkerConfig {
        name: Some("w".into()),
        url: "http://127.0.0.1:9".into(),
        model: "m".into(),
        role: Role::Llm,
        block_size: BLOCK,
        capabilities: vec!["text".into()],
        cost: 1.0,
        capacity_blocks: 0,
        node: String::new(),
        token_budgets: Vec::new(),
        spot: false,
        engine: None,
        health_path: None,
    };
    let pool = Arc::new(WorkerPool::new(&[worker], Arc::new(Metrics::new())).expect("valid url"));
    let (inbound, _task) = spawn(kv.clone(), pool.clone(), config);
    let tokens: Vec<u32> = (0..(16 * BLOCK) as u32).collect();
    Fixture {
        kv,
        pool,
        inbound,
        chain: block_hashes(&tokens, BLOCK),
    }
}

fn config() -> SyncConfig {
    SyncConfig {
        heartbeat_misses: 3,
        resync_buffer: 100,
        resync_timeout: Duration::from_secs(5),
    }
}

impl Fixture {
    /// Event `id` of worker `name`: it stores block `id - 1` of the chain.
    fn stored(&self, name: &str, id: u64) -> WorkerEvent {
        let index = (id - 1) as usize;
        WorkerEvent {
            worker: name.into(),
            event_id: id,
            tier: StorageTier::Device,
            event: KvEvent::Stored {
                parent: index.checked_sub(1).map(|parent| self.chain[parent].sequence),
                blocks: vec![StoredBlock {
                    block_hash: self.chain[index].sequence,
                    tokens_hash: self.chain[index].local,
                }],
            },
        }
    }

    /// A dump holding the first `blocks` blocks of the chain, as of event `last_event_id`.
    fn dump(&self, name: &str, blocks: usize, last_event_id: u64) -> KvDump {
        KvDump {
            worker: name.into(),
            last_event_id,
            blocks: (0..blocks)
                .map(|index| DumpBlock {
                    block_hash: self.chain[index].sequence,
                    parent: index.checked_sub(1).map(|parent| self.chain[parent].sequence),
                    tokens_hash: self.chain[index].local,
                    tier: StorageTier::Device,
                })
                .collect(),
        }
    }

    fn send(&self, message: Inbound) {
        self.inbound.send(message).expect("applier running");
    }

    fn event(&self, event: WorkerEvent, source: &Arc<Dumps>) {
        self.send(Inbound::Event(event, source.clone()));
    }

    /// Blocks the index holds for worker `name`.
    fn cached(&self, name: &str) -> usize {
        let Some(worker) = self.pool.by_name(name) else {
            return 0;
        };
        self.kv.index().worker_blocks(worker.kv_id)
    }

    fn gaps(&self, name: &str) -> u64 {
        self.kv
            .metrics
            .gaps
            .get_or_create(&vec![("worker", name.to_string())])
            .get()
    }
}

/// Lets the applier (and the dump tasks it spawned) run until they wait again.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(5)).await;
}

fn registration(name: &str, heartbeat_ms: u64, last_event_id: u64) -> Registration {
    Registration {
        worker: name.into(),
        url: "http://127.0.0.1:10".into(),
        model: "m".into(),
        role: Role::Llm,
        block_size: BLOCK,
        capacity_blocks: 64,
        capabilities: vec!["text".into()],
        cost: 1.0,
        node: String::new(),
        token_budgets: Vec::new(),
        spot: false,
        preempting: false,
        heartbeat_ms,
        last_event_id,
    }
}

#[tokio::test(start_paused = true)]
async fn events_in_order_are_applied_and_duplicates_ignored() {
    let f = fixture(config());
    let source = Dumps::new(true);
    for id in 1..=3 {
        f.event(f.stored("w", id), &source);
    }
    f.event(f.stored("w", 2), &source);
    settle().await;
    assert_eq!(f.cached("w"), 3);
    assert_eq!(source.requests(), 0, "no gap, no dump");
    let duplicates =
        f.kv.metrics
            .events_ignored
            .get_or_create(&vec![("reason", "duplicate".to_string())])
            .get();
    assert_eq!(duplicates, 1);
}

#[tokio::test(start_paused = true)]
async fn a_gap_buffers_events_until_the_dump_and_then_applies_the_newer_ones() {
    let f = fixture(config());
    let source = Dumps::new(true);
    f.event(f.stored("w", 1), &source);
    // Events 2 and 3 are lost; 4 and 5 arrive while the dump is awaited.
    f.event(f.stored("w", 4), &source);
    f.event(f.stored("w", 5), &source);
    settle().await;
    assert_eq!(f.gaps("w"), 1);
    assert_eq!(source.requests(), 1);
    assert_eq!(f.cached("w"), 1, "buffered, not applied, while the dump is awaited");
    // The dump is as of event 4: it holds blocks 0..4; only event 5 is newer.
    source.answer.send_replace(Some(f.dump("w", 4, 4)));
    settle().await;
    assert_eq!(f.cached("w"), 5);
    // The stream goes on from 6 without another gap.
    f.event(f.stored("w", 6), &source);
    settle().await;
    assert_eq!(f.cached("w"), 6);
    assert_eq!(f.gaps("w"), 1);
}

#[tokio::test(start_paused = true)]
async fn an_event_its_workers_dump_does_not_reach_is_dropped_instead_of_resyncing_forever() {
    let f = fixture(config());
    let source = Dumps::new(true);
    for id in 1..=4 {
        f.event(f.stored("w", id), &source);
    }
    // An event far ahead of the stream (forged, or from an earlier run) opens a gap ...
    f.event(f.stored("w", 16), &source);
    settle().await;
    assert_eq!(source.requests(), 1);
    // ... and the worker's dump, taken after it arrived, ends at event 4.
    source.answer.send_replace(Some(f.dump("w", 4, 4)));
    settle().await;
    settle().await;
    assert_eq!(
        source.requests(),
        1,
        "the same event must not ask for the same dump again"
    );
    assert_eq!(f.gaps("w"), 1);
    assert_eq!(f.cached("w"), 4);
    let dropped =
        f.kv.metrics
            .events_ignored
            .get_or_create(&vec![("reason", "ahead_of_dump".to_string())])
            .get();
    assert_eq!(dropped, 1);
    // The stream goes on from the dump.
    f.event(f.stored("w", 5), &source);
    settle().await;
    assert_eq!(f.cached("w"), 5);
    assert_eq!(f.gaps("w"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_full_resync_buffer_asks_for_another_dump() {
    let f = fixture(SyncConfig {
        resync_buffer: 2,
        ..config()
    });
    let source = Dumps::new(true);
    f.event(f.stored("w", 1), &source);
    for id in 3..=7 {
        f.event(f.stored("w", id), &source);
    }
    settle().await;
    assert_eq!(source.requests(), 1);
    // The buffer overflowed: the first dump cannot be followed by what was dropped.
    source.answer.send_replace(Some(f.dump("w", 3, 3)));
    settle().await;
    assert_eq!(source.requests(), 2, "a second round");
    source.answer.send_replace(Some(f.dump("w", 7, 7)));
    settle().await;
    assert_eq!(f.cached("w"), 7);
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_restarts_at_event_one_loses_its_old_blocks() {
    let f = fixture(config());
    let source = Dumps::new(true);
    for id in 1..=4 {
        f.event(f.stored("w", id), &source);
    }
    settle().await;
    assert_eq!(f.cached("w"), 4);
    f.event(f.stored("w", 1), &source);
    settle().await;
    assert_eq!(f.cached("w"), 1, "the old cache is gone; only the new first block");
    assert_eq!(source.requests(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_source_without_dumps_clears_the_worker_on_a_gap() {
    let f = fixture(config());
    let source = Dumps::new(false);
    for id in 1..=3 {
        f.event(f.stored("w", id), &source);
    }
    f.event(f.stored("w", 6), &source);
    settle().await;
    assert_eq!(source.requests(), 0);
    assert_eq!(f.cached("w"), 1, "cleared, then the new event");
}

#[tokio::test(start_paused = true)]
async fn a_tail_lost_twice_in_a_row_is_resynced() {
    let f = fixture(config());
    let source = Dumps::new(true);
    f.send(Inbound::Heartbeat(registration("r", 100, 0), source.clone()));
    f.event(f.stored("r", 1), &source);
    settle().await;
    assert_eq!(f.cached("r"), 1);
    // The worker says it sent up to event 3; events 2 and 3 never came.
    f.send(Inbound::Heartbeat(registration("r", 100, 3), source.clone()));
    settle().await;
    assert_eq!(source.requests(), 0, "once may be a race with the events in flight");
    f.send(Inbound::Heartbeat(registration("r", 100, 3), source.clone()));
    settle().await;
    assert_eq!(source.requests(), 1);
    assert_eq!(f.gaps("r"), 1);
    source.answer.send_replace(Some(f.dump("r", 3, 3)));
    settle().await;
    assert_eq!(f.cached("r"), 3);
}

#[tokio::test(start_paused = true)]
async fn a_registered_worker_that_stops_heartbeating_leaves_the_pool_and_the_index() {
    let f = fixture(config());
    let source = Dumps::new(true);
    f.send(Inbound::Heartbeat(registration("r", 100, 0), source.clone()));
    f.event(f.stored("r", 1), &source);
    settle().await;
    assert!(f.pool.by_name("r").is_some());
    let kv_id = f.pool.by_name("r").map(|w| w.kv_id).expect("registered");
    // Beats for a while keep it.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        f.send(Inbound::Heartbeat(registration("r", 100, 1), source.clone()));
    }
    settle().await;
    assert!(f.pool.by_name("r").is_some());
    // Then three intervals and a tick without one.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(f.pool.by_name("r").is_none(), "out of the pool");
    assert_eq!(f.kv.index().worker_blocks(kv_id), 0, "and out of the index");
    assert_eq!(f.kv.metrics.workers_expired.get(), 1);
    // A configured worker never expires.
    assert!(f.pool.by_name("w").is_some());
}
