//! The planner's rules, through the real host: the built-in `load-based` and `sla-based`
//! planners compiled to Wasm, loaded by the gateway's policy runtime and called through its
//! planner switch (sandbox, answer checks, fallback, rollback) with scripted observations.
//! Each rule of their crate docs (`plugins/load-based`, `plugins/sla-based`) is checked, and hostile planners (a loop, absurd counts, an unknown
//! pool, a trap, a refusal) change nothing: every pool holds its size.

use std::sync::Arc;
use std::time::Duration;

use switchyard::planning::{
    IntervalStats, PlannedBy, PlannerSwitch, PolicyRuntime, Pool, PoolRole, RuntimeConfig, SwitchConfig,
    built_in_planner,
};

fn runtime() -> Arc<PolicyRuntime> {
    Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            deadline: Duration::from_millis(50),
            memory_limit_bytes: 64 << 20,
            cache_dir: None,
            max_instances: 16,
        })
        .expect("a policy runtime"),
    )
}

fn switch(name: &str, wasm: &[u8], config: &str) -> PlannerSwitch {
    let config: toml::Table = toml::from_str(config).expect("settings");
    let policy = runtime().load_planner(name, wasm, config).expect("the planner loads");
    PlannerSwitch::new(
        policy,
        SwitchConfig {
            max_failures: 3,
            ..Default::default()
        },
    )
}

fn built_in(name: &str) -> PlannerSwitch {
    switch(name, built_in_planner(name).expect("a built-in"), "")
}

fn interval(kv_usage: f32, queue: f32, rate: f32) -> IntervalStats {
    IntervalStats {
        request_rate: rate,
        mean_isl: 2000.0,
        mean_osl: 200.0,
        ttft_p50_ms: 200.0,
        ttft_p90_ms: 400.0,
        itl_p50_ms: 20.0,
        itl_p90_ms: 30.0,
        kv_usage,
        prefill_queue_tokens: queue,
    }
}

fn pool(role: PoolRole, desired: u32, recent: Vec<IntervalStats>) -> Pool {
    Pool {
        model: "m".into(),
        role,
        ready: desired,
        starting: 0,
        draining: 0,
        desired,
        min_workers: 1,
        max_workers: 6,
        gpus_per_worker: 1,
        ttft_target_ms: 1000.0,
        itl_target_ms: 50.0,
        prefill_capacity_tokens: 10_000.0,
        profiled_rate: 2.0,
        intervals_since_scale_up: u32::MAX,
        recent,
    }
}

/// The decisions as (pool, replicas), and that the policy (not the fallback) made them.
fn plan(switch: &PlannerSwitch, pools: &[Pool], max_gpus: u32) -> Vec<(u32, u32)> {
    let (decisions, by) = switch.plan(pools, max_gpus);
    assert!(matches!(by, PlannedBy::Policy(_)), "decided by {}", by.label());
    decisions.iter().map(|d| (d.pool, d.replicas)).collect()
}

#[test]
fn load_based_keeps_every_seed_rule() {
    let planner = built_in("load-based");
    // ±1 per interval, whatever the pressure: KV usage 0.99 adds one decode worker; 0.1 on a
    // pool of 5 removes one.
    let hot = pool(PoolRole::Decode, 2, vec![interval(0.99, 0.0, 9.0)]);
    let cold = pool(PoolRole::Aggregated, 5, vec![interval(0.1, 0.0, 0.1)]);
    assert_eq!(plan(&planner, &[hot.clone(), cold.clone()], 0), [(1, 4), (0, 3)]);

    // Grace period: no scale-down in the 3 intervals after an add.
    for since in 0..3 {
        let mut recent = cold.clone();
        recent.intervals_since_scale_up = since;
        assert!(
            plan(&planner, &[recent], 0).is_empty(),
            "{since} intervals after an add"
        );
    }
    let mut settled = cold.clone();
    settled.intervals_since_scale_up = 3;
    assert_eq!(plan(&planner, &[settled], 0), [(0, 4)]);

    // Trend buffer: queue utilization 0.8 (8000 of 10000 tokens per worker-interval)...
    let draining = pool(
        PoolRole::Prefill,
        1,
        vec![interval(0.0, 10_000.0, 5.0), interval(0.0, 8_000.0, 5.0)],
    );
    assert!(
        plan(&planner, &[draining], 0).is_empty(),
        "falling 0.2 an interval, it is under 0.5 within 3: no scale-up"
    );
    let rising = pool(
        PoolRole::Prefill,
        1,
        vec![interval(0.0, 6_000.0, 5.0), interval(0.0, 8_000.0, 5.0)],
    );
    assert_eq!(plan(&planner, &[rising], 0), [(0, 2)]);

    // Budgets: max-workers, and the fleet's GPUs (a pool at 6 of 6; 3 × 2 GPUs of 7).
    let mut full = hot.clone();
    full.desired = 6;
    assert!(plan(&planner, &[full], 0).is_empty(), "at max-workers");
    let mut wide = hot.clone();
    wide.desired = 3;
    wide.gpus_per_worker = 2;
    assert!(plan(&planner, &[wide.clone()], 7).is_empty(), "6 + 2 GPUs would pass 7");
    assert_eq!(plan(&planner, &[wide], 8), [(0, 4)]);
    // min-workers.
    let mut floor = cold;
    floor.desired = 1;
    assert!(plan(&planner, &[floor], 0).is_empty(), "at min-workers");
}

#[test]
fn sla_based_sizes_pools_for_the_predicted_load() {
    let planner = built_in("sla-based");
    // 2, 3, 4 req/s: 5 predicted, ×1.1 at 2 req/s per worker → 3 workers.
    let rising = pool(
        PoolRole::Aggregated,
        1,
        vec![
            interval(0.5, 0.0, 2.0),
            interval(0.5, 0.0, 3.0),
            interval(0.5, 0.0, 4.0),
        ],
    );
    assert_eq!(plan(&planner, std::slice::from_ref(&rising), 0), [(0, 3)]);
    // Measured p90 TTFT 1.5× its target: workers are worth less than their profile.
    let mut late = rising.clone();
    if let Some(last) = late.recent.last_mut() {
        last.ttft_p90_ms = 1500.0;
    }
    assert_eq!(plan(&planner, &[late], 0), [(0, 5)]);
    // Budget: 2 GPUs in all.
    assert_eq!(plan(&planner, std::slice::from_ref(&rising), 2), [(0, 2)]);
    // No profile: hold.
    let mut blind = rising;
    blind.profiled_rate = 0.0;
    assert!(plan(&planner, &[blind], 0).is_empty());
}

#[test]
fn hostile_planners_change_nothing() {
    let wasm = std::fs::read(format!("{}/hostile_planner.wasm", env!("SWITCHYARD_GUESTS_DIR")))
        .expect("the hostile planner is built");
    let pools = [pool(PoolRole::Decode, 2, vec![interval(0.5, 0.0, 1.0)])];
    // Well-behaved, it asks for one more worker; the host takes it.
    let eager = switch("hostile-planner", &wasm, "");
    assert_eq!(plan(&eager, &pools, 0), [(0, 3)]);
    for mode in ["loop", "absurd", "unknown-pool", "twice", "trap", "refuse"] {
        let hostile = switch("hostile-planner", &wasm, &format!("mode = \"{mode}\""));
        let (decisions, by) = hostile.plan(&pools, 0);
        assert!(decisions.is_empty(), "{mode}: {decisions:?}");
        assert!(
            matches!(by, PlannedBy::Fallback(_)),
            "{mode}: decided by {}",
            by.label()
        );
        println!("hostile planner `{mode}`: every pool holds ({})", by.label());
    }
    // Failures count against the version: three in a row with nowhere to roll back leave it
    // active, and every call still holds.
    let looping = switch("hostile-planner", &wasm, "mode = \"loop\"");
    for _ in 0..4 {
        let (decisions, _) = looping.plan(&pools, 0);
        assert!(decisions.is_empty());
    }
}
