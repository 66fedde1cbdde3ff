//! The routing core without HTTP: a pool of configured workers (never contacted), the KV
//! state with blocks stored as a worker's events would store them, and a built-in policy.

use std::sync::Arc;

use switchyard_protocol::block_hash::block_hashes;
use switchyard_protocol::kv_events::{KvEvent, StorageTier, StoredBlock};
use tokio::sync::mpsc;

use super::{Request, Router};
use crate::config::{Config, Role, WorkerConfig};
use crate::events::applier::Inbound;
use crate::kv::{KvState, PromptBlocks};
use crate::metrics::Metrics;
use crate::policy::runtime::{PolicyRuntime, RuntimeConfig};
use crate::policy::switch::{PolicySwitch, SwitchConfig};
use crate::workers::WorkerPool;

const BLOCK: usize = 16;

struct Fixture {
    router: Router,
    events: mpsc::UnboundedReceiver<Inbound>,
}

fn fixture(workers: usize, policy: &str) -> Fixture {
    let configs: Vec<WorkerConfig> = (0..workers)
        .map(|i| WorkerConfig {
            name: Some(format!("w{i}")),
            url: format!("http://127.0.0.1:{}", 9000 + i),
            model: "m".into(),
            role: Role::Llm,
            block_size: BLOCK,
            capabilities: vec!["text".into()],
            cost: 1.0,
            capacity_blocks: 1024,
            node: String::new(),
            token_budgets: Vec::new(),
            spot: false,
            engine: None,
            health_path: None,
        })
        .collect();
    let config = Config::parse(
        "[server]\nplaintext = true\n[[models]]\nname = \"m\"\nblock_size = 16\n[[workers]]\nurl = \"http://127.0.0.1:9\"\nmodel = \"m\"\nblock_size = 16\n",
        std::path::Path::new("test.toml"),
    )
    .expect("valid");
    let kv = Arc::new(KvState::new(&config).expect("kv state"));
    let pool = Arc::new(WorkerPool::new(&configs, Arc::new(Metrics::new())).expect("valid urls"));
    // A deadline generous enough that parallel tests on two busy cores do not interrupt
    // well-behaved calls (it is wall-clock time).
    let runtime = Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            deadline: std::time::Duration::from_millis(200),
            ..RuntimeConfig::default()
        })
        .expect("engine"),
    );
    let wasm = crate::built_ins::router(policy).expect("built in");
    let policy = runtime.load_router(policy, wasm, toml::Table::new()).expect("loads");
    let switch = Arc::new(PolicySwitch::new(policy, SwitchConfig::default()));
    let (sender, events) = mpsc::unbounded_channel();
    Fixture {
        router: Router::new(pool, kv, switch, sender),
        events,
    }
}

/// A prompt of `blocks` full blocks (plus a partial one), its hashes as the gateway computes
/// them.
fn prompt(blocks: usize, seed: u32) -> PromptBlocks {
    let tokens: Vec<u32> = (0..(blocks * BLOCK + 3) as u32).map(|t| t ^ seed).collect();
    PromptBlocks {
        tokens: tokens.len(),
        hashes: block_hashes(&tokens, BLOCK).iter().map(|h| h.sequence).collect(),
        block_size: BLOCK,
    }
}

/// Stores the first `blocks` blocks of the prompt made with `seed` on `worker`.
fn cache(router: &Router, worker: usize, blocks: usize, seed: u32) {
    let tokens: Vec<u32> = (0..(blocks * BLOCK) as u32).map(|t| t ^ seed).collect();
    let stored = block_hashes(&tokens, BLOCK)
        .iter()
        .map(|h| StoredBlock {
            block_hash: h.sequence,
            tokens_hash: h.local,
        })
        .collect();
    let id = router.pool().workers()[worker].kv_id;
    router.kv().index().apply(
        id,
        StorageTier::Device,
        &KvEvent::Stored {
            parent: None,
            blocks: stored,
        },
    );
}

fn request(prompt: &PromptBlocks, id: u64) -> Request<'_> {
    Request {
        id,
        model: "m",
        prompt,
        max_tokens: Some(16),
        media_tokens: 0,
        affinity: 0,
        encoders: &[],
        ttft_target_ms: 0.0,
    }
}

#[test]
fn kv_aware_leases_the_worker_that_caches_the_prompt() {
    let Fixture { router, .. } = fixture(4, "kv-aware");
    cache(&router, 2, 6, 7);
    let prompt = prompt(8, 7);
    let choice = router.choose(&request(&prompt, 1), &[]).expect("a worker");
    assert_eq!(choice.lease.worker().name, "w2");
    assert_eq!(choice.lease.overlap(), 6);
    assert!(choice.lease.routed().generation().is_some(), "decided by the policy");
}

#[test]
fn a_lease_holds_the_in_flight_count_and_the_active_sequence_until_dropped() {
    let Fixture { router, .. } = fixture(2, "least-load");
    let prompt = prompt(4, 1);
    let mut lease = router.choose(&request(&prompt, 7), &[]).expect("a worker").lease;
    let worker = lease.worker().clone();
    assert_eq!(worker.in_flight(), 1);
    let load = router.kv().loads([worker.kv_id])[0];
    assert_eq!(load.requests, 1);
    assert_eq!(
        load.prefill_tokens, prompt.tokens as u64,
        "nothing cached: all of it is prefill"
    );
    lease.first_token(false);
    assert_eq!(router.kv().loads([worker.kv_id])[0].prefill_tokens, 0);
    drop(lease);
    assert_eq!(worker.in_flight(), 0);
    assert_eq!(router.kv().loads([worker.kv_id])[0].requests, 0);
}

#[test]
fn a_streamed_first_token_tells_the_worker_the_prefill_work_it_found() {
    let Fixture { router, .. } = fixture(1, "least-load");
    let (first, second) = (prompt(4, 1), prompt(6, 2));
    let mut ahead = router.choose(&request(&first, 1), &[]).expect("a worker").lease;
    let mut behind = router.choose(&request(&second, 2), &[]).expect("a worker").lease;
    let worker = behind.worker().clone();
    assert_eq!(ahead.prefill_work(), first.tokens as u64, "nothing ahead of it");
    assert_eq!(
        behind.prefill_work(),
        (first.tokens + second.tokens) as u64,
        "the first prompt ahead of it, and its own"
    );
    assert_eq!(worker.measured_prefill(), (None, 0));
    behind.first_token(true);
    assert_eq!(worker.measured_prefill().1, 1, "one request taken in");
    ahead.first_token(false);
    assert_eq!(
        worker.measured_prefill().1,
        1,
        "an unmeasured first token (not streamed, or with media) is no sample"
    );
}

#[test]
fn tried_and_unhealthy_workers_are_not_chosen() {
    let Fixture { router, .. } = fixture(3, "least-load");
    let prompt = prompt(2, 3);
    let ids: Vec<u32> = router.pool().workers().iter().map(|w| w.kv_id).collect();
    router.pool().workers()[1].eject();
    let choice = router.choose(&request(&prompt, 1), &[ids[0]]).expect("w2 is left");
    assert_eq!(choice.lease.worker().name, "w2");
    drop(choice);
    assert!(router.choose(&request(&prompt, 2), &[ids[0], ids[2]]).is_none());
}

#[test]
fn attempts_ask_the_policy_again_without_the_workers_tried() {
    let Fixture { router, .. } = fixture(3, "least-load");
    let prompt = prompt(2, 5);
    let mut attempts = router.attempts(request(&prompt, 1));
    let mut seen = Vec::new();
    while let Some(lease) = attempts.next_lease() {
        seen.push(lease.worker().name.clone());
    }
    seen.sort();
    assert_eq!(seen, ["w0", "w1", "w2"], "each worker once, then none");
}

#[test]
fn an_unreachable_worker_leaves_the_rotation_and_its_blocks_the_index() {
    let Fixture { router, mut events } = fixture(2, "least-load");
    let worker = router.pool().workers()[0].clone();
    router.unreachable(&worker);
    assert!(!worker.is_healthy());
    match events.try_recv() {
        Ok(Inbound::Lost(name)) => assert_eq!(name, "w0"),
        other => panic!("expected the applier to hear of w0: {other:?}"),
    }
    // Ejected once: a second failure does not report it again.
    router.unreachable(&worker);
    assert!(events.try_recv().is_err());
}

#[test]
fn affinity_is_zero_without_a_rollout_key() {
    let Fixture { router, .. } = fixture(1, "least-load");
    assert_eq!(
        router.affinity(|_| Some(b"session-1".to_vec())),
        0,
        "no rollout, no key"
    );
}

#[test]
fn a_router_with_its_own_prefix_index_reads_the_prompt_through_the_host() {
    // `peer-sglang` remembers where it sent each prompt from the `prompt` import's block
    // hashes, not from KV events (there are none here): the prompt it saw goes back to the same
    // worker, another prompt to the worker with the smallest record.
    let Fixture { router, .. } = fixture(4, "peer-sglang");
    let first = prompt(8, 3);
    let other = prompt(8, 11);
    let name = |id: u64, prompt: &PromptBlocks| {
        let choice = router.choose(&request(prompt, id), &[]).expect("a worker");
        assert!(choice.lease.routed().generation().is_some(), "decided by the policy");
        choice.lease.worker().name.clone()
    };
    let went = name(1, &first);
    assert_ne!(name(2, &other), went, "a new prompt goes to an empty record");
    assert_eq!(name(3, &first), went, "a prompt seen before follows its blocks");
}
