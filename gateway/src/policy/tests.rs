//! Unit tests of the policy runtime and switch, on the built-in guests.

use std::sync::Arc;

use super::runtime::{PolicyRuntime, RuntimeConfig};
use super::switch::{PolicySwitch, SwitchConfig};
use super::table::{Columns, WorkerTable};
use super::{PolicyError, table};
use crate::built_ins::router as built_in_router;

/// Sets a column of `table`, which must hold it.
fn set(table: &mut WorkerTable, column: Columns, values: &[u32]) {
    table
        .column_mut(column)
        .expect("the table holds the column")
        .copy_from_slice(values);
}

/// A runtime with a deadline generous enough that parallel tests on two busy cores do not
/// interrupt well-behaved calls (the deadline is wall-clock time).
fn runtime() -> Arc<PolicyRuntime> {
    Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            deadline: std::time::Duration::from_millis(200),
            ..RuntimeConfig::default()
        })
        .expect("engine"),
    )
}

fn load(runtime: &Arc<PolicyRuntime>, name: &str) -> super::runtime::RouterPolicy {
    runtime
        .load_router(name, built_in_router(name).expect("built in"), toml::Table::new())
        .expect("loads")
}

#[test]
fn built_in_routers_load_and_decide() {
    let runtime = runtime();
    let mut table = table::synthetic(4);
    set(&mut table, Columns::ACTIVE_REQUESTS, &[5, 2, 9, 2]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0, 100, 0, 50]);
    let request = table::synthetic_request();
    let mut least = load(&runtime, "least-load").instantiate().expect("instance");
    assert_eq!(least.route(&request, &[], &table).expect("answer").worker, 3);

    let mut kv = load(&runtime, "kv-aware").instantiate().expect("instance");
    set(&mut table, Columns::ACTIVE_REQUESTS, &[0; 4]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0; 4]);
    set(&mut table, Columns::ACTIVE_BLOCKS, &[0; 4]);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0, 0, 16, 0]);
    assert_eq!(
        kv.route(&request, &[], &table).expect("answer").worker,
        2,
        "the worker holding the prefix"
    );

    let mut rr = load(&runtime, "round-robin").instantiate().expect("instance");
    let picks: Vec<u32> = (0..8)
        .map(|_| rr.route(&request, &[], &table).expect("answer").worker)
        .collect();
    let mut distinct = picks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct, vec![0, 1, 2, 3], "every worker in turn: {picks:?}");
}

#[test]
fn policies_declare_their_columns_and_decide_the_same_on_just_those() {
    let runtime = runtime();
    let least = load(&runtime, "least-load");
    assert_eq!(
        least.columns(),
        Columns::ROLES | Columns::ACTIVE_REQUESTS | Columns::PREFILL_TOKENS
    );
    let request = table::synthetic_request();
    for name in ["least-load", "kv-aware", "predicted-ttft", "round-robin", "cost-aware"] {
        let policy = load(&runtime, name);
        let full = table::synthetic(64);
        let just = full.select(policy.columns());
        assert!(just.data.len() < full.data.len(), "{name} reads fewer than all columns");
        let mut on_full = policy.instantiate().expect("instance");
        let mut on_just = policy.instantiate().expect("instance");
        for id in 0..16 {
            let request = table::RequestInfo {
                request_id: id,
                ..request
            };
            assert_eq!(
                on_full.route(&request, &[], &full).expect("answer").worker,
                on_just.route(&request, &[], &just).expect("answer").worker,
                "{name}, request {id}"
            );
        }
        if policy.columns() != Columns::ROLES {
            let err = on_just
                .route(&request, &[], &full.select(Columns::ROLES))
                .expect_err("a table without the declared columns");
            assert!(matches!(err, PolicyError::InvalidAnswer(_)), "{err}");
        }
    }
}

#[test]
fn least_load_in_wasm_agrees_with_the_native_fallback() {
    // The plugin scans eight workers per SIMD round and finishes with a scalar tail; small
    // values make ties on requests and on prefill common, so the tie-breaks are exercised.
    let runtime = runtime();
    let mut instance = load(&runtime, "least-load").instantiate().expect("instance");
    let request = table::synthetic_request();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound) as u32
    };
    for n in [1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 257] {
        for _ in 0..20 {
            let mut table = table::synthetic(n).select(table::fallback_columns());
            let roles: Vec<u32> = (0..n).map(|_| u32::from(next(4) == 0)).collect();
            let active: Vec<u32> = (0..n).map(|_| next(3)).collect();
            let prefill: Vec<u32> = (0..n).map(|_| next(3) * 100).collect();
            set(&mut table, Columns::ROLES, &roles);
            set(&mut table, Columns::ACTIVE_REQUESTS, &active);
            set(&mut table, Columns::PREFILL_TOKENS, &prefill);
            let native = table::least_load(&table);
            match instance.route(&request, &[], &table) {
                Ok(pick) => assert_eq!(
                    Some(pick.worker),
                    native,
                    "{n} workers: {roles:?} {active:?} {prefill:?}"
                ),
                Err(PolicyError::Refused(_)) => assert_eq!(native, None, "{n} workers: {roles:?}"),
                Err(err) => panic!("{err}"),
            }
        }
    }
}

#[test]
fn built_in_routers_fit_the_memory_reset_in_place() {
    // Their 32 KiB stack, statics and argument arena must stay in the low 64 KiB, or every
    // re-instantiation page-faults (plugins/.cargo/config.toml, the SDK's arena).
    let runtime = runtime();
    for name in [
        "round-robin",
        "least-load",
        "kv-aware",
        "predicted-ttft",
        "modality-aware",
        "cost-aware",
    ] {
        let policy = load(&runtime, name);
        assert!(
            policy.fits_resident_memory(),
            "{name} starts with {} bytes of memory",
            policy.initial_memory_bytes()
        );
    }
}

#[test]
fn non_routers_and_garbage_are_refused() {
    let runtime = runtime();
    let err = runtime
        .load_router("junk", b"not wasm at all", toml::Table::new())
        .unwrap_err();
    assert!(matches!(err, PolicyError::Invalid(_)), "{err}");
    let batcher = include_bytes!(concat!(env!("OUT_DIR"), "/fcfs.wasm"));
    let err = runtime.load_router("fcfs", batcher, toml::Table::new()).unwrap_err();
    assert!(matches!(err, PolicyError::Invalid(_)), "{err}");
    assert!(built_in_router("nope").is_err());
}

#[test]
fn kv_aware_reads_its_config_through_the_host() {
    let runtime = runtime();
    let mut config = toml::Table::new();
    config.insert("temperature".into(), toml::Value::Float(1.0));
    let policy = runtime
        .load_router("kv-aware", built_in_router("kv-aware").expect("built in"), config)
        .expect("loads");
    let mut instance = policy.instantiate().expect("instance");
    let mut table = table::synthetic(4);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0, 0, 16, 0]);
    set(&mut table, Columns::ACTIVE_BLOCKS, &[0; 4]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0; 4]);
    let mut picks = std::collections::HashSet::new();
    for id in 0..200 {
        let request = table::RequestInfo {
            request_id: id,
            ..table::synthetic_request()
        };
        picks.insert(instance.route(&request, &[], &table).expect("answer").worker);
    }
    assert!(picks.len() > 1, "with temperature 1 the draw spreads: {picks:?}");
}

#[test]
fn predicted_ttft_weighs_queues_and_decoders_through_the_host() {
    let runtime = runtime();
    let mut instance = load(&runtime, "predicted-ttft").instantiate().expect("instance");
    let mut table = table::synthetic(3);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0, 12, 0]);
    set(&mut table, Columns::ACTIVE_BLOCKS, &[0; 3]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0; 3]);
    set(&mut table, Columns::ACTIVE_REQUESTS, &[0; 3]);
    // 1024 prompt tokens: idle, worker 1 prefills 256 of them and the others all 1024.
    let request = table::synthetic_request();
    assert_eq!(
        instance.route(&request, &[], &table).expect("answer").worker,
        1,
        "the cached prefix"
    );
    // 16384 queued tokens make worker 1 wait two full steps (~340 ms) against one ~32 ms step.
    set(&mut table, Columns::PREFILL_TOKENS, &[0, 16_384, 0]);
    let pick = instance.route(&request, &[], &table).expect("answer").worker;
    assert!(pick == 0 || pick == 2, "away from the queue: {pick}");

    // 200 decoders on worker 0 against a 16384-token queue on worker 1: one mixed step wins,
    // unless the delay the prefill inflicts on the decoders is weighed in (config key).
    let mut table = table::synthetic(2);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0; 2]);
    set(&mut table, Columns::ACTIVE_REQUESTS, &[200, 4]);
    set(&mut table, Columns::ACTIVE_BLOCKS, &[4000, 64]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0, 16_384]);
    assert_eq!(instance.route(&request, &[], &table).expect("answer").worker, 0);
    let mut config = toml::Table::new();
    config.insert("interference_weight".into(), toml::Value::Float(0.1));
    let weighed = runtime
        .load_router(
            "predicted-ttft",
            built_in_router("predicted-ttft").expect("built in"),
            config,
        )
        .expect("loads");
    let mut weighed = weighed.instantiate().expect("instance");
    assert_eq!(weighed.route(&request, &[], &table).expect("answer").worker, 1);
}

#[test]
fn compiled_code_is_cached_by_sha256() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = dir.path().join("cache");
    let runtime = Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            cache_dir: Some(cache.clone()),
            deadline: std::time::Duration::from_millis(200),
            ..RuntimeConfig::default()
        })
        .expect("engine"),
    );
    let first = load(&runtime, "least-load");
    assert_eq!(runtime.cache_hits(), 0, "compiled the first time");
    let cached: Vec<_> = std::fs::read_dir(&cache)
        .expect("cache dir")
        .map(|entry| entry.expect("entry").path())
        .collect();
    assert_eq!(cached.len(), 1);
    let second = load(&runtime, "least-load");
    assert_eq!(runtime.cache_hits(), 1, "the second load read the cache");
    assert_eq!(first.sha256, second.sha256);
    assert!(second.instantiate().is_ok(), "code loaded from the cache runs");
    // A damaged cache file is not trusted: the component is compiled again, and runs.
    std::fs::write(&cached[0], b"not compiled code").expect("damage");
    let third = load(&runtime, "least-load");
    assert_eq!(runtime.cache_hits(), 1, "the damaged file was not used");
    assert!(third.instantiate().is_ok());
    // A cached file others can write is native code anyone could have put there: ignored.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cached[0], std::fs::Permissions::from_mode(0o666)).expect("chmod");
        load(&runtime, "least-load");
        assert_eq!(runtime.cache_hits(), 1, "a file others can write is not loaded");
    }
}

#[cfg(unix)]
#[test]
fn a_cache_dir_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let refused = PolicyRuntime::new(RuntimeConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..RuntimeConfig::default()
    });
    match refused {
        Err(PolicyError::Engine(why)) => assert!(why.contains("can be written by others (mode 777)"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[cfg(unix)]
#[test]
fn a_cache_dir_that_another_user_could_replace_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    // Under a parent anyone can write (and no sticky bit), another user could swap the folder.
    let dir = tempfile::tempdir().expect("temp dir");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let cache = open.join("cache");
    std::fs::create_dir(&cache).expect("mkdir");
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    match PolicyRuntime::new(RuntimeConfig {
        cache_dir: Some(cache.clone()),
        ..RuntimeConfig::default()
    }) {
        Err(PolicyError::Engine(why)) => {
            assert!(
                why.contains(&open.display().to_string()) && why.contains("others"),
                "{why}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A folder owned by another user is refused whatever its mode (where this test may hand
    // one over: as root).
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).expect("mkdir");
    std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    if std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).is_ok() {
        match PolicyRuntime::new(RuntimeConfig {
            cache_dir: Some(foreign.clone()),
            ..RuntimeConfig::default()
        }) {
            Err(PolicyError::Engine(why)) => assert!(why.contains("owned by user 65534"), "{why}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn publish_and_rollback_switch_versions() {
    let runtime = runtime();
    let switch = PolicySwitch::new(load(&runtime, "least-load"), SwitchConfig::default());
    let table = table::synthetic(4);
    let request = table::synthetic_request();
    // What decides, by its decisions: least-load answers one worker every time, round-robin
    // walks the table.
    let distinct_picks = || -> usize {
        (0..4)
            .filter_map(|_| switch.route(&request, &[], |_| &table).0.map(|pick| pick.worker))
            .collect::<std::collections::BTreeSet<u32>>()
            .len()
    };
    let (_, routed) = switch.route(&request, &[], |_| &table);
    assert_eq!(routed.generation(), Some(1));
    assert_eq!(distinct_picks(), 1, "least-load decides");
    let version = switch.publish(Arc::new(load(&runtime, "round-robin")));
    assert_eq!(
        switch.route(&request, &[], |_| &table).1.generation(),
        Some(version.generation)
    );
    assert_eq!(distinct_picks(), 4, "round-robin decides once published");
    let restored = switch.rollback().expect("a previous version");
    assert_eq!(restored.generation, 1);
    assert_eq!(switch.route(&request, &[], |_| &table).1.generation(), Some(1));
    assert_eq!(distinct_picks(), 1, "least-load decides again after the rollback");
    assert!(switch.rollback().is_none());
}

#[test]
fn the_host_parses_numbers_for_policies() {
    use super::bindings::switchyard::policy::config::Host;
    let config: toml::Table =
        toml::from_str("float = 1.5\nint = 2\ntext = ' 3.5 '\nflag = true\nword = 'x'").expect("toml");
    let limits = wasmtime::StoreLimitsBuilder::new().build();
    let mut state = super::host::HostState::new(Arc::new(config), limits);
    assert_eq!(state.get_f64("float".into()), Some(1.5));
    assert_eq!(state.get_f64("int".into()), Some(2.0));
    assert_eq!(state.get_f64("text".into()), Some(3.5));
    assert_eq!(state.get_f64("flag".into()), None);
    assert_eq!(state.get_f64("word".into()), None);
    assert_eq!(state.get_f64("missing".into()), None);
    assert_eq!(state.get("text".into()).as_deref(), Some(" 3.5 "));
}

#[test]
fn the_deadline_counts_cpu_time_not_time_spent_preempted() {
    use std::time::{Duration, Instant};
    let limits = wasmtime::StoreLimitsBuilder::new().build();
    let mut state = super::host::HostState::new(Arc::new(toml::Table::new()), limits);
    state.begin_call();
    assert!(!state.check_deadline(100), "the first check only samples");
    std::thread::sleep(Duration::from_millis(20));
    assert!(!state.check_deadline(100), "a preempted (sleeping) call is extended");
    // Spinning keeps the CPU busy; on a machine shared with other tests a round may still get
    // less than half a core, so allow a few rounds.
    let interrupted = (0..10).any(|_| {
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(10) {
            std::hint::black_box(0u64);
        }
        state.check_deadline(100)
    });
    assert!(interrupted, "a call that keeps the CPU busy is interrupted");
    state.begin_call();
    assert!(!state.check_deadline(3));
    std::thread::sleep(Duration::from_millis(5));
    assert!(!state.check_deadline(3));
    std::thread::sleep(Duration::from_millis(5));
    assert!(
        state.check_deadline(3),
        "the cap on checks holds even for a preempted call"
    );
}

#[test]
fn the_sdk_carries_the_contract_byte_for_byte() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| std::fs::read_to_string(root.join(path)).unwrap_or_else(|err| panic!("{path}: {err}"));
    assert!(
        read("wit/policy.wit") == read("plugins/sdk/wit/policy.wit"),
        "the SDK's copy of the contract differs from wit/policy.wit: cp wit/policy.wit plugins/sdk/wit/policy.wit"
    );
}

#[test]
fn a_router_built_against_0_1_0_loads_and_routes_unchanged() {
    // `wit/0.1.0/least-load.wasm` is the least-load built-in as the 0.1.0 SDK compiled it.
    let wasm = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../wit/0.1.0/least-load.wasm")).expect("fixture");
    let runtime = runtime();
    let old = runtime
        .load_router("old", &wasm, toml::Table::new())
        .expect("a 0.1.0 router loads");
    let current = load(&runtime, "least-load");
    assert_eq!(old.columns(), current.columns(), "same columns declared, bit for bit");
    let mut old = old.instantiate().expect("instance");
    let mut current = current.instantiate().expect("instance");
    let request = table::synthetic_request();
    for round in 0..6u32 {
        let mut table = table::synthetic(6);
        let active: Vec<u32> = (0..6).map(|i| (i * 7 + round * 3) % 5).collect();
        set(&mut table, Columns::ACTIVE_REQUESTS, &active);
        set(&mut table, Columns::NODE, &[9; 6]);
        let expected = table::least_load(&table).expect("an LLM worker");
        assert_eq!(old.route(&request, &[], &table).expect("answer").worker, expected);
        assert_eq!(current.route(&request, &[], &table).expect("answer").worker, expected);
    }
}

#[test]
fn built_in_batchers_load_and_keep_the_contract() {
    use super::batching::{BatchedBy, BatcherSwitch, Budget, PendingTable, validate};
    let runtime = runtime();
    let queue = PendingTable {
        ids: (1..=6).collect(),
        tokens: vec![900, 100, 300, 5000, 200, 700],
        waited_ms: vec![70.0, 4.0, 3.0, 2.0, 1.0, 0.5],
        priority: vec![0; 6],
        kinds: vec![3, 1, 1, 3, 2, 1],
        ready: vec![false, false, false, false, true, false],
    };
    let budget = Budget {
        token_budgets: vec![512, 1024],
        max_items: 3,
        max_batches: 8,
    };
    for name in ["fcfs", "token-budget", "mixed-modality", "priority", "fair-share"] {
        let policy = runtime
            .load_batcher(
                name,
                crate::built_ins::find(crate::built_ins::World::Batcher, name).expect("built in"),
                toml::Table::new(),
            )
            .unwrap_or_else(|err| panic!("{name}: {err}"));
        let switch = BatcherSwitch::new(policy, SwitchConfig::default());
        let (batches, by) = switch.form_batches(&queue, &budget);
        assert!(matches!(by, BatchedBy::Policy(_)), "{name}: {}", by.label());
        validate(&queue, &budget, &batches).unwrap_or_else(|err| panic!("{name}: {err}"));
        let placed: usize = batches.iter().map(|b| b.items.len()).sum();
        assert_eq!(placed, 6, "{name}: every item placed");
        if name == "mixed-modality" {
            // The aged 900 leads; the ready 200 would pass 1024 beside it, so the 100 fills in,
            // and the ready 200 opens the next batch.
            assert_eq!(batches[0].items, [0, 1]);
            assert_eq!(batches[1].items, [4, 2]);
        }
    }
    let router = runtime.load_batcher(
        "least-load",
        built_in_router("least-load").expect("built in"),
        toml::Table::new(),
    );
    assert!(
        matches!(router, Err(PolicyError::Invalid(ref why)) if why.contains("batcher world")),
        "{router:?}"
    );
}

#[test]
fn modality_aware_picks_worker_and_encoder_together_and_text_as_predicted_ttft() {
    let runtime = runtime();
    let mut joint = load(&runtime, "modality-aware").instantiate().expect("instance");
    let mut predicted = load(&runtime, "predicted-ttft").instantiate().expect("instance");
    // Text: the same answers as predicted-ttft, ties included.
    let mut table = table::synthetic(6);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0; 6]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0; 6]);
    set(&mut table, Columns::ACTIVE_REQUESTS, &[0; 6]);
    set(&mut table, Columns::ACTIVE_BLOCKS, &[0; 6]);
    for id in 0..20 {
        let request = table::RequestInfo {
            request_id: id,
            ..table::synthetic_request()
        };
        assert_eq!(
            joint.route(&request, &[], &table).expect("answer"),
            predicted.route(&request, &[], &table).expect("answer")
        );
    }
    // Media: two LLM workers on nodes 1 and 2, a vision encoder on each; the one on node 1
    // has a long queue, so the media goes to node 2's encoder and the request beside it.
    let mut table = table::synthetic(4);
    set(&mut table, Columns::ROLES, &[0, 0, 1, 1]);
    set(&mut table, Columns::NODE, &[1, 2, 1, 2]);
    set(&mut table, Columns::QUEUED_US, &[0, 0, 300_000, 0]);
    set(&mut table, Columns::ENCODE_US, &[0, 0, 10_000, 10_000]);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0; 4]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0; 4]);
    set(&mut table, Columns::ACTIVE_REQUESTS, &[0; 4]);
    let request = table::RequestInfo {
        media_tokens: 5760,
        prompt_tokens: 6784,
        ..table::synthetic_request()
    };
    let pick = joint.route(&request, &[], &table).expect("answer");
    assert_eq!((pick.worker, pick.encoders), (1, vec![3]));
}

#[test]
fn a_full_instance_pool_is_served_by_the_fallback_and_never_rolls_back() {
    // Two instance slots, three threads that each keep their instance: the third thread finds
    // no slot. That is the gateway's capacity, not the policy's fault.
    let runtime = Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            deadline: std::time::Duration::from_millis(200),
            max_instances: 2,
            ..RuntimeConfig::default()
        })
        .expect("engine"),
    );
    let switch = Arc::new(PolicySwitch::new(load(&runtime, "least-load"), SwitchConfig::default()));
    // A second version, so that a rollback would have somewhere to go.
    let active = switch.publish(Arc::new(load(&runtime, "round-robin"))).generation;
    let barrier = Arc::new(std::sync::Barrier::new(3));
    let outcomes: Vec<Vec<super::switch::Routed>> = (0..3)
        .map(|_| {
            let (switch, barrier) = (switch.clone(), barrier.clone());
            std::thread::spawn(move || {
                let table = table::synthetic(4);
                let request = table::synthetic_request();
                let mut routed = vec![switch.route(&request, &[], |_| &table).1];
                // Every thread holds its instance (or none) while the others route again.
                barrier.wait();
                for _ in 0..10 {
                    routed.push(switch.route(&request, &[], |_| &table).1);
                }
                // ... and until all are done, so no slot frees up early.
                barrier.wait();
                routed
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|thread| thread.join().expect("thread"))
        .collect();
    let capacity = outcomes
        .iter()
        .flatten()
        .filter(|r| matches!(r, super::switch::Routed::Fallback("capacity")))
        .count();
    let by_policy = outcomes
        .iter()
        .flatten()
        .filter(|r| r.generation() == Some(active))
        .count();
    assert_eq!(capacity, 11, "the thread without a slot fell back every time");
    assert_eq!(
        by_policy + capacity,
        33,
        "every call either decided or fell back for capacity"
    );
    // Far more than `max_failures` capacity events, and the active version stands.
    let table = table::synthetic(4);
    assert_eq!(
        switch
            .route(&table::synthetic_request(), &[], |_| &table)
            .1
            .generation(),
        Some(active)
    );
}

#[test]
fn a_new_switch_never_serves_a_dropped_switchs_instance() {
    let runtime = runtime();
    let table = table::synthetic(4);
    let request = table::synthetic_request();
    let picks = |switch: &PolicySwitch| -> std::collections::BTreeSet<u32> {
        (0..4)
            .map(|_| switch.route(&request, &[], |_| &table).0.expect("a pick").worker)
            .collect()
    };
    // A least-load switch answers the same worker every time; round-robin walks the table.
    // Both switches' versions are generation 1, and the new one lives where the dropped one
    // did (the same slot), which is what used to find the old instance.
    let mut slot = Some(PolicySwitch::new(load(&runtime, "least-load"), SwitchConfig::default()));
    let old = slot.as_ref().map(|s| s as *const PolicySwitch);
    assert_eq!(picks(slot.as_ref().expect("switch")).len(), 1);
    drop(slot.take());
    let policy = load(&runtime, "round-robin");
    slot = Some(PolicySwitch::new(policy, SwitchConfig::default()));
    let new = slot.as_ref().expect("switch");
    assert_eq!(Some(new as *const PolicySwitch), old, "the same address");
    assert_eq!(picks(new).len(), 4, "the new switch routes with its own policy");
}

#[test]
fn fair_share_reads_whose_each_item_is_through_the_host() {
    use super::batching::{BatchedBy, BatcherSwitch, Budget, PendingTable, Tenancy};
    let runtime = runtime();
    let policy = runtime
        .load_batcher(
            "fair-share",
            crate::built_ins::find(crate::built_ins::World::Batcher, "fair-share").expect("built in"),
            toml::Table::new(),
        )
        .expect("loads");
    let switch = BatcherSwitch::new(policy, SwitchConfig::default());
    // Tenant 1 queued five requests before tenant 2's one.
    let queue = PendingTable {
        ids: (1..=6).collect(),
        tokens: vec![100; 6],
        waited_ms: vec![60.0, 50.0, 40.0, 30.0, 20.0, 10.0],
        priority: vec![0; 6],
        kinds: vec![0; 6],
        ready: vec![false; 6],
    };
    let budget = Budget {
        token_budgets: vec![u32::MAX],
        max_items: 2,
        max_batches: 1,
    };
    let tenancy = Tenancy {
        tenants: vec![1, 1, 1, 1, 1, 2],
        weights: vec![1.0; 6],
    };
    let (batches, by) = switch.form_batches_for(&queue, &tenancy, &budget);
    assert!(matches!(by, BatchedBy::Policy(_)), "{}", by.label());
    assert_eq!(batches[0].items, vec![0, 5], "each tenant's first request");
    // Without tenancy it is one tenant: arrival order.
    let (batches, _) = switch.form_batches(&queue, &budget);
    assert_eq!(batches[0].items, vec![0, 1]);
}

/// A deterministic stream of table values for the differential tests: often one of a few
/// small values (so that workers tie), else anything below `bound`.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    fn below(&mut self, bound: u32) -> u32 {
        (self.next() % u64::from(bound.max(1))) as u32
    }

    fn value(&mut self, bound: u32) -> u32 {
        if self.below(2) == 0 {
            self.below(4)
        } else {
            self.below(bound)
        }
    }
}

/// A random table of `n` workers as the gateway sends them: mostly LLMs, mixed block sizes,
/// loads that tie and loads that overflow.
fn random_table(draws: &mut Draws, n: usize) -> WorkerTable {
    let mut table = table::synthetic(n);
    let mut column = |column: Columns, draw: &mut dyn FnMut(&mut Draws) -> u32| {
        let values: Vec<u32> = (0..n).map(|_| draw(draws)).collect();
        set(&mut table, column, &values);
    };
    column(Columns::ROLES, &mut |d| u32::from(d.below(10) == 0));
    column(Columns::BLOCK_SIZE, &mut |d| [16, 32, 64, 48][d.below(4) as usize]);
    column(Columns::OVERLAP_DEVICE_BLOCKS, &mut |d| d.value(20));
    column(Columns::OVERLAP_HOST_BLOCKS, &mut |d| d.value(8));
    column(Columns::PREFILL_TOKENS, &mut |d| d.value(20_000));
    column(Columns::ACTIVE_BLOCKS, &mut |d| d.value(600));
    column(Columns::CAPACITY_BLOCKS, &mut |d| [0, 400, 16_384][d.below(3) as usize]);
    column(Columns::ACTIVE_REQUESTS, &mut |d| d.value(40));
    column(Columns::NODE, &mut |d| d.below(3));
    column(Columns::QUEUED_US, &mut |d| d.value(50_000));
    column(Columns::ENCODE_US, &mut |d| d.value(20_000));
    // Prices as a mixed fleet's: reserved, spot, and in between (what `cost-aware` ranks by).
    for price in table.cost.iter_mut() {
        *price = [1.0, 0.4, 0.7][draws.below(3) as usize];
    }
    table
}

#[test]
fn shortlisted_routers_decide_as_their_exact_costs_do() {
    // The built-ins that rank a shortlist of f32 estimates (the SDK's `shortlist`), and
    // `cost-aware`, which predicts two workers per instruction, against the same component
    // told to compute every cost exactly, one worker at a time (`shortlist = false`): the
    // decision, its encoders and its fallbacks must be the same, on tables with ties and
    // overflows.
    let runtime = runtime();
    for name in ["kv-aware", "predicted-ttft", "modality-aware", "cost-aware"] {
        let wasm = built_in_router(name).expect("built in");
        let fast = runtime.load_router(name, wasm, toml::Table::new()).expect("loads");
        let mut exact_config = toml::Table::new();
        exact_config.insert("shortlist".into(), toml::Value::Boolean(false));
        let exact = runtime.load_router(name, wasm, exact_config).expect("loads");
        let columns = fast.columns() | table::fallback_columns();
        let (mut fast, mut exact) = (
            fast.instantiate().expect("instance"),
            exact.instantiate().expect("instance"),
        );
        let mut draws = Draws(11);
        for round in 0..400u64 {
            let n = 1 + draws.below(300) as usize;
            let workers = random_table(&mut draws, n).select(columns);
            let prompt_tokens = 1 + draws.below(8000);
            let request = table::RequestInfo {
                request_id: round,
                prompt_tokens,
                prompt_blocks: prompt_tokens.div_ceil(64),
                max_tokens: 1 + draws.below(512),
                ttft_target_ms: [0.0, 50.0, 500.0][draws.below(3) as usize],
                media_tokens: [0, 0, 576][draws.below(3) as usize],
                ..table::synthetic_request()
            };
            let fast = fast.route(&request, &[], &workers).map_err(|err| err.to_string());
            let exact = exact.route(&request, &[], &workers).map_err(|err| err.to_string());
            assert_eq!(fast, exact, "{name}, round {round}, {n} workers");
        }
    }
}

/// What the `measured` import answers in a test: set between calls.
#[derive(Debug, Default)]
struct SetMeasurements(std::sync::Mutex<(Vec<super::host::WorkerTiming>, Vec<super::host::PrefillFit>)>);

impl super::runtime::TimingSource for SetMeasurements {
    fn timings(&self) -> Vec<super::host::WorkerTiming> {
        self.0.lock().map(|set| set.0.clone()).unwrap_or_default()
    }

    fn prefill_fits(&self) -> Vec<super::host::PrefillFit> {
        self.0.lock().map(|set| set.1.clone()).unwrap_or_default()
    }
}

#[test]
fn measurements_reach_a_router_as_columns_as_they_did_as_records() {
    // `wit/0.2.0/cost-aware.wasm` is the cost-aware built-in compiled by an SDK that asked for
    // the `measured` lists of records; today's asks for the same data as
    // columns (`timing-columns`, `prefill-fit-columns`). Both must load and decide alike, and
    // the data must matter: the same router with nothing measured decides otherwise on many
    // tables.
    let old_wasm =
        std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../wit/0.2.0/cost-aware.wasm")).expect("fixture");
    let measured = runtime();
    let source = Arc::new(SetMeasurements::default());
    measured.provide_timings(source.clone());
    let unmeasured = runtime();
    let old = measured
        .load_router("cost-aware", &old_wasm, toml::Table::new())
        .expect("a router importing the record lists loads");
    let current = load(&measured, "cost-aware");
    let blind = load(&unmeasured, "cost-aware");
    let columns = current.columns() | table::fallback_columns();
    assert_eq!(old.columns() | table::fallback_columns(), columns);
    let (mut old, mut current, mut blind) = (
        old.instantiate().expect("instance"),
        current.instantiate().expect("instance"),
        blind.instantiate().expect("instance"),
    );
    let mut draws = Draws(23);
    let mut swayed = 0;
    let rounds = 300u64;
    for round in 0..rounds {
        let n = 1 + draws.below(64) as usize;
        let workers = random_table(&mut draws, n).select(columns);
        // Most workers measured, some not, some on too few streams; ids in no order, one
        // that is no worker's.
        let mut timings = Vec::new();
        let mut fits = Vec::new();
        for id in (0..n as u32 + 1).rev() {
            if draws.below(5) != 0 {
                timings.push(super::host::WorkerTiming {
                    id,
                    itl_us: draws.value(60_000),
                    samples: draws.value(40),
                });
            }
            if draws.below(4) != 0 {
                fits.push(super::host::PrefillFit {
                    id,
                    fixed_ms: draws.value(400) as f32 / 4.0,
                    ms_per_ktoken: draws.value(800) as f32 / 8.0,
                    samples: draws.value(40),
                });
            }
        }
        *source.0.lock().expect("not poisoned") = (timings, fits);
        let prompt_tokens = 1 + draws.below(8000);
        let request = table::RequestInfo {
            request_id: round,
            prompt_tokens,
            prompt_blocks: prompt_tokens.div_ceil(64),
            max_tokens: 1 + draws.below(512),
            ttft_target_ms: [0.0, 50.0, 500.0, 2_000.0][draws.below(4) as usize],
            ..table::synthetic_request()
        };
        let decided = current.route(&request, &[], &workers).map_err(|err| err.to_string());
        let before = old.route(&request, &[], &workers).map_err(|err| err.to_string());
        assert_eq!(decided, before, "round {round}, {n} workers");
        let without = blind.route(&request, &[], &workers).map_err(|err| err.to_string());
        swayed += u32::from(decided != without);
    }
    assert!(
        swayed >= 30,
        "the measurements swayed only {swayed} of {rounds} decisions: do they reach the guest?"
    );
}

/// A core module exporting `spin`, a function that loops forever: `(func (export "spin")
/// (loop (br 0)))`, encoded by hand (the engine is built without the text format).
const SPIN_MODULE: [u8; 39] = [
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, // magic, version 1
    0x01, 0x04, 0x01, 0x60, 0x00, 0x00, // types: () -> ()
    0x03, 0x02, 0x01, 0x00, // functions: one of type 0
    0x07, 0x08, 0x01, 0x04, b's', b'p', b'i', b'n', 0x00, 0x00, // export "spin" = function 0
    0x0a, 0x09, 0x01, 0x07, 0x00, 0x03, 0x40, 0x0c, 0x00, 0x0b, 0x0b, // loop { br 0 }
];

/// A core module exporting `nop`, a function that returns at once: `(func (export "nop"))`.
const NOP_MODULE: [u8; 33] = [
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, // magic, version 1
    0x01, 0x04, 0x01, 0x60, 0x00, 0x00, // types: () -> ()
    0x03, 0x02, 0x01, 0x00, // functions: one of type 0
    0x07, 0x07, 0x01, 0x03, b'n', b'o', b'p', 0x00, 0x00, // export "nop" = function 0
    0x0a, 0x04, 0x01, 0x02, 0x00, 0x0b, // an empty body
];

/// Waits up to 10 s for the ticker to park.
fn ticker_parks(ticker: &super::ticker::TickerState) -> bool {
    let waited = std::time::Instant::now();
    while !ticker.is_parked() {
        if waited.elapsed() > std::time::Duration::from_secs(10) {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    true
}

/// Calls `spin` on a fresh instance in `store` on another thread, armed as the gateway arms a
/// call; answers its error, or `None` if it did not end within 10 s (it never would).
fn spin_once(
    runtime: &Arc<PolicyRuntime>,
    mut store: wasmtime::Store<super::host::HostState>,
) -> Option<(wasmtime::Store<super::host::HostState>, wasmtime::Error)> {
    let (done, answer) = std::sync::mpsc::channel();
    let runtime = runtime.clone();
    std::thread::spawn(move || {
        let module = wasmtime::Module::new(store.engine(), SPIN_MODULE).expect("a valid module");
        let instance = wasmtime::Instance::new(&mut store, &module, &[]).expect("instantiates");
        let spin = instance
            .get_typed_func::<(), ()>(&mut store, "spin")
            .expect("exports spin");
        runtime.arm(&mut store);
        let error = spin.call(&mut store, ()).expect_err("spin never returns");
        store.data_mut().end_call();
        let _ = done.send((store, error));
    });
    answer.recv_timeout(std::time::Duration::from_secs(10)).ok()
}

#[test]
fn the_epoch_ticker_sleeps_while_idle_and_a_runaway_call_still_ends() {
    use std::time::Duration;
    let runtime = Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            deadline: Duration::from_millis(5),
            ..RuntimeConfig::default()
        })
        .expect("engine"),
    );
    let ticker = runtime.ticker().clone();
    assert!(ticker_parks(&ticker), "no call for its idle period: the ticker sleeps");
    let ticks = ticker.ticks();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(ticker.ticks(), ticks, "no epoch advance while parked");

    // A call that never ends, begun while the ticker sleeps: the call wakes it, and the
    // deadline interrupts it.
    let parks = ticker.parks();
    let store = runtime.armed_store(Arc::new(toml::Table::new()));
    let (store, error) = spin_once(&runtime, store).expect("the runaway call was interrupted");
    assert_eq!(
        error.downcast_ref::<wasmtime::Trap>(),
        Some(&wasmtime::Trap::Interrupt),
        "{error:#}"
    );
    assert!(ticker.ticks() > ticks, "the call woke the ticker");

    // Idle again, it sleeps again; and a call on the same store still wakes it.
    assert!(ticker_parks(&ticker), "idle again: the ticker sleeps again");
    assert!(ticker.parks() > parks);
    let (_, error) = spin_once(&runtime, store).expect("interrupted again");
    assert_eq!(error.downcast_ref::<wasmtime::Trap>(), Some(&wasmtime::Trap::Interrupt));
}

#[cfg(target_os = "linux")]
#[test]
fn the_epoch_advances_only_while_a_call_runs() {
    use std::time::Duration;
    let runtime = Arc::new(PolicyRuntime::new(RuntimeConfig::default()).expect("engine"));
    let ticker = runtime.ticker().clone();
    assert!(ticker.on_call_timer(), "Linux has the call timer");
    let mut store = runtime.armed_store(Arc::new(toml::Table::new()));
    let module = wasmtime::Module::new(store.engine(), NOP_MODULE).expect("a valid module");
    let instance = wasmtime::Instance::new(&mut store, &module, &[]).expect("instantiates");
    let nop = instance
        .get_typed_func::<(), ()>(&mut store, "nop")
        .expect("exports nop");
    store.data_mut().end_call();
    assert!(ticker.is_parked(), "no call runs: the timer is disarmed");
    let ticks = ticker.ticks();
    let started = std::time::Instant::now();
    for _ in 0..200 {
        runtime.arm(&mut store);
        nop.call(&mut store, ()).expect("nop returns");
        store.data_mut().end_call();
        std::thread::sleep(Duration::from_millis(2));
    }
    // A ticker on a clock would have advanced the epoch every 500 µs of the ~400 ms; calls that
    // end in microseconds leave the timer disarmed (the margin is for a call the OS preempted
    // past a tick on a loaded machine).
    let ticked = ticker.ticks() - ticks;
    let clock_ticks = started.elapsed().as_micros() / 500;
    assert!(
        ticked * 10 < clock_ticks as u64,
        "{ticked} ticks in {clock_ticks} clock ticks"
    );
    assert!(ticker.is_parked());
    // Calls closer together than a tick keep it armed; once they stop, the ticker disarms it.
    let parks = ticker.parks();
    for _ in 0..2_000 {
        runtime.arm(&mut store);
        nop.call(&mut store, ()).expect("nop returns");
        store.data_mut().end_call();
    }
    assert!(ticker_parks(&ticker), "the calls stopped: the timer is disarmed");
    assert!(ticker.parks() > parks);
    // A store dropped mid-call ends its call: the timer does not tick on for it.
    runtime.arm(&mut store);
    assert!(!ticker.is_parked(), "a call runs: the timer is armed");
    drop(store);
    assert!(ticker.is_parked(), "its store went: the timer is disarmed");
}

/// Calls that begin and end on several threads at once, dense and sparse in turn, never run
/// with the call timer disarmed, and leave it disarmed once they stop.
#[cfg(target_os = "linux")]
#[test]
fn concurrent_calls_never_run_with_the_timer_disarmed() {
    use std::time::Duration;
    let engine = wasmtime::Engine::new(wasmtime::Config::new().epoch_interruption(true)).expect("engine");
    let ticker = super::ticker::EpochTicker::start(engine, Duration::from_micros(200), 4).expect("ticker");
    let state = ticker.state().clone();
    assert!(state.on_call_timer());
    let unarmed = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let (state, unarmed) = (&state, &unarmed);
            scope.spawn(move || {
                for call in 0..4_000u64 {
                    state.begin();
                    if state.is_parked() {
                        unarmed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    // Some calls run past a tick, and between bursts the threads pause for
                    // longer than one, so the timer is armed and disarmed both ways.
                    if (call + thread) % 97 == 0 {
                        std::thread::sleep(Duration::from_micros(300));
                    }
                    if state.is_parked() {
                        unarmed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    state.end();
                    if call % 500 == 499 {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            });
        }
    });
    assert_eq!(unarmed.into_inner(), 0, "a call ran with the timer disarmed");
    assert!(ticker_parks(&state), "the calls stopped: the timer is disarmed");
    assert!(
        state.parks() > 1,
        "the timer was disarmed and armed again between bursts"
    );
    // An end with no call begun is ignored, and the next call still arms the timer.
    state.end();
    state.begin();
    assert!(!state.is_parked());
    state.end();
}

/// Four LLM workers busy with 64 streams each, then two prefill workers (as the gateway
/// orders rows): one idle, one with a request and 6,000 prompt tokens queued.
fn table_with_prefill_rows() -> WorkerTable {
    let mut table = table::synthetic(6);
    set(
        &mut table,
        Columns::ROLES,
        &[0, 0, 0, 0, table::ROLE_PREFILL, table::ROLE_PREFILL],
    );
    set(&mut table, Columns::ACTIVE_REQUESTS, &[64, 64, 64, 64, 0, 1]);
    set(&mut table, Columns::ACTIVE_BLOCKS, &[2000, 2000, 2000, 2000, 0, 0]);
    set(&mut table, Columns::OVERLAP_DEVICE_BLOCKS, &[0; 6]);
    set(&mut table, Columns::PREFILL_TOKENS, &[0, 0, 0, 0, 0, 6000]);
    table
}

#[test]
fn disaggregating_routers_name_a_prefill_worker_and_others_never_see_one() {
    let runtime = runtime();
    let table = table_with_prefill_rows();
    let request = table::RequestInfo {
        prompt_tokens: 8000,
        prompt_blocks: 125,
        ..table::synthetic_request()
    };
    for name in ["pd-threshold", "pd-predicted"] {
        let policy = load(&runtime, name);
        assert!(policy.disaggregates(), "{name}");
        let pick = policy
            .instantiate()
            .expect("instance")
            .route(&request, &[], &table)
            .expect("answer");
        assert_eq!(pick.prefill, Some(4), "{name}: the idle prefill worker");
        assert!(
            pick.worker < 4 && pick.fallbacks.iter().all(|&i| i < 4),
            "{name}: {pick:?}"
        );
    }
    // A short prompt stays where it is.
    let short = table::RequestInfo {
        prompt_tokens: 100,
        prompt_blocks: 1,
        ..request
    };
    let pick = load(&runtime, "pd-threshold")
        .instantiate()
        .expect("instance")
        .route(&short, &[], &table);
    assert_eq!(pick.expect("answer").prefill, None);
    // Routers that do not disaggregate get the table without its prefill rows: even the
    // least-loaded row, a prefill worker, is never picked.
    for name in ["least-load", "round-robin", "kv-aware"] {
        let policy = load(&runtime, name);
        assert!(!policy.disaggregates(), "{name}");
        let mut instance = policy.instantiate().expect("instance");
        for _ in 0..8 {
            let pick = instance.route(&request, &[], &table).expect("answer");
            assert!(pick.worker < 4 && pick.prefill.is_none(), "{name}: {pick:?}");
        }
    }
}

#[test]
fn answers_that_misuse_prefill_rows_are_refused() {
    let table = table_with_prefill_rows();
    assert_eq!(table.prefill_rows(), 2);
    let without = table.without_prefill_rows().expect("it has some");
    assert_eq!(without.len(), 4);
    assert_eq!(without.column(Columns::ACTIVE_REQUESTS), Some(&[64, 64, 64, 64][..]));
    assert_eq!(without.cost.len(), 4);
    assert!(without.without_prefill_rows().is_none());
    assert_eq!(table::check_roles(&table, 1, &[2], Some(5)), Ok(Some(5)));
    assert_eq!(table::check_roles(&table, 1, &[2], None), Ok(None));
    for (worker, fallbacks, prefill) in [
        (4, vec![], None),
        (0, vec![5], None),
        (0, vec![], Some(1)),
        (0, vec![], Some(6)),
    ] {
        assert!(
            table::check_roles(&table, worker, &fallbacks, prefill).is_err(),
            "{worker} {fallbacks:?} {prefill:?}"
        );
    }
}
