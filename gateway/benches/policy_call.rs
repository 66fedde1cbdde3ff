//! `cargo bench -p switchyard --bench policy_call`: what a Wasm routing decision costs.
//!
//! Measured with criterion, then summarised as ratios in the same run:
//! - `route/{policy}/{n}`: one `route` call of each built-in router on a reused instance with
//!   an `n`-worker table, against `least-load` on the same table, against `least-load` sent
//!   `kv-aware`'s eight columns (what moving those bytes costs), and against `least-load` in
//!   native Rust (`native-least-load`);
//! - `route/cost-aware-measured/{n}`: `cost-aware` as the gateway runs it, the `measured`
//!   import answering a timing and a fitted prefill line for every worker (the plain rows have
//!   none, as a gateway that has not measured yet);
//! - `publish/cached` vs `publish/compile`: validating and publishing a policy whose compiled
//!   code is in the disk cache, against compiling the `.wasm` afresh;
//! - `instantiate`: a thread's re-instantiation of a published policy;
//! - `trap-to-fallback`: a request routed by a policy that traps, to the fallback's answer
//!   (re-instantiation included), and `deadline-to-fallback` for a policy that never returns
//!   (bounded by the 1 ms default deadline). These need the hostile guests built by
//!   `cargo test --workspace` and are skipped without them.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use switchyard::bench::{PolicyRuntime, RuntimeConfig};
use switchyard::bench::{PolicySwitch, SwitchConfig};
use switchyard::bench::{PrefillFit, TimingSource, WorkerTiming};
use switchyard::bench::{built_in_router, table};

const SIZES: [usize; 4] = [8, 64, 1024, 4096];

/// The built-in routers, the simplest first: every one is reported against `least-load`.
const ROUTERS: [&str; 6] = [
    "least-load",
    "round-robin",
    "kv-aware",
    "predicted-ttft",
    "cost-aware",
    "modality-aware",
];

/// A runtime with the default sandbox, or with a deadline long enough that a descheduled
/// benchmark thread is never interrupted (the deadline is wall-clock time; its length does not
/// change the cost of a call).
fn runtime(cache_dir: Option<PathBuf>, default_deadline: bool) -> Arc<PolicyRuntime> {
    let deadline = if default_deadline {
        RuntimeConfig::default().deadline
    } else {
        Duration::from_millis(100)
    };
    Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            cache_dir,
            deadline,
            ..RuntimeConfig::default()
        })
        .expect("policy engine"),
    )
}

/// Measurements of every worker of the table being routed, as a gateway that has served a
/// while has them: gaps between chunks of 20–29 ms over enough streams, and a fitted prefill
/// line.
#[derive(Debug, Default)]
struct EveryWorkerMeasured {
    workers: AtomicU32,
}

impl TimingSource for EveryWorkerMeasured {
    fn timings(&self) -> Vec<WorkerTiming> {
        (0..self.workers.load(Ordering::Relaxed))
            .map(|id| WorkerTiming {
                id,
                itl_us: 20_000 + (id * 7_919) % 10_000,
                samples: 50,
            })
            .collect()
    }

    fn prefill_fits(&self) -> Vec<PrefillFit> {
        (0..self.workers.load(Ordering::Relaxed))
            .map(|id| PrefillFit {
                id,
                fixed_ms: 15.0 + (id % 5) as f32,
                ms_per_ktoken: 30.0 + (id % 7) as f32,
                samples: 40,
            })
            .collect()
    }
}

fn bench_route(c: &mut Criterion, runtime: &Arc<PolicyRuntime>) {
    let request = table::synthetic_request();
    let mut group = c.benchmark_group("route");
    for name in ROUTERS {
        let policy = runtime
            .load_router(name, built_in_router(name).expect("built in"), toml::Table::new())
            .expect("loads");
        let mut instance = policy.instantiate().expect("instance");
        for n in SIZES {
            // What the gateway sends this policy: its columns and the fallback's.
            let workers = table::synthetic(n).select(policy.columns() | table::fallback_columns());
            group.bench_with_input(BenchmarkId::new(name, n), &workers, |b, workers| {
                b.iter(|| instance.route(&request, &[], workers).expect("answer"))
            });
        }
    }
    // `cost-aware` with every worker measured, on a runtime of its own (a runtime takes its
    // timing source once).
    let measured = self::runtime(None, false);
    let source = Arc::new(EveryWorkerMeasured::default());
    measured.provide_timings(source.clone());
    let policy = measured
        .load_router(
            "cost-aware",
            built_in_router("cost-aware").expect("built in"),
            toml::Table::new(),
        )
        .expect("loads");
    let mut instance = policy.instantiate().expect("instance");
    for n in SIZES {
        let workers = table::synthetic(n).select(policy.columns() | table::fallback_columns());
        source.workers.store(n as u32, Ordering::Relaxed);
        group.bench_with_input(BenchmarkId::new("cost-aware-measured", n), &workers, |b, workers| {
            b.iter(|| instance.route(&request, &[], workers).expect("answer"))
        });
    }
    // The floor under the routers that read more columns: `least-load` sent the eight columns
    // `kv-aware` and `predicted-ttft` read (the host copies every column sent), so the bytes
    // cost what they cost and the policy's own work is least-load's scan.
    let least = runtime
        .load_router(
            "least-load",
            built_in_router("least-load").expect("built in"),
            toml::Table::new(),
        )
        .expect("loads");
    let kv_columns = runtime
        .load_router(
            "kv-aware",
            built_in_router("kv-aware").expect("built in"),
            toml::Table::new(),
        )
        .expect("loads")
        .columns();
    let mut instance = least.instantiate().expect("instance");
    for n in SIZES {
        let workers = table::synthetic(n).select(kv_columns | least.columns() | table::fallback_columns());
        group.bench_with_input(
            BenchmarkId::new("least-load-on-8-columns", n),
            &workers,
            |b, workers| b.iter(|| instance.route(&request, &[], workers).expect("answer")),
        );
    }
    // Through the switch, as the gateway calls it: the thread's cached instance found, its
    // slot locked, the answer checked and counted.
    let policy = runtime
        .load_router(
            "least-load",
            built_in_router("least-load").expect("built in"),
            toml::Table::new(),
        )
        .expect("loads");
    let columns = policy.columns() | table::fallback_columns();
    let switch = PolicySwitch::new(policy, SwitchConfig::default());
    let workers = table::synthetic(8).select(columns);
    group.bench_with_input(BenchmarkId::new("switch-least-load", 8), &workers, |b, workers| {
        b.iter(|| switch.route(&request, &[], |_| workers).0.expect("answer"))
    });
    for n in SIZES {
        let workers = table::synthetic(n);
        group.bench_with_input(BenchmarkId::new("native-least-load", n), &workers, |b, workers| {
            b.iter(|| table::least_load(std::hint::black_box(workers)))
        });
    }
    group.finish();
}

fn bench_publish(c: &mut Criterion) {
    let wasm = built_in_router("kv-aware").expect("built in");
    let cache = tempfile::tempdir().expect("temp dir");
    let cached = runtime(Some(cache.path().to_path_buf()), false);
    cached
        .load_router("warm", wasm, toml::Table::new())
        .expect("warms the cache");
    let fresh = runtime(None, false);
    let mut group = c.benchmark_group("publish");
    group.sample_size(20);
    group.bench_function("cached", |b| {
        b.iter(|| cached.load_router("kv-aware", wasm, toml::Table::new()).expect("loads"))
    });
    group.bench_function("compile", |b| {
        b.iter(|| fresh.load_router("kv-aware", wasm, toml::Table::new()).expect("loads"))
    });
    group.finish();
    let policy = cached.load_router("kv-aware", wasm, toml::Table::new()).expect("loads");
    c.bench_function("instantiate", |b| b.iter(|| policy.instantiate().expect("instance")));
}

fn hostile(name: &str) -> Option<Vec<u8>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    std::fs::read(dir.join(format!("wasm-guests/wasm32-wasip2/release/hostile_{name}.wasm"))).ok()
}

fn bench_failures(c: &mut Criterion, runtime: &Arc<PolicyRuntime>) {
    let request = table::RequestInfo {
        prompt_tokens: 7,
        ..table::synthetic_request()
    };
    let workers = table::synthetic(64);
    for (label, guest) in [("trap-to-fallback", "trap"), ("deadline-to-fallback", "loop")] {
        let Some(wasm) = hostile(guest) else {
            eprintln!("skipping {label}: build the hostile guests first (`cargo test --workspace`)");
            continue;
        };
        let policy = runtime
            .load_router(guest, &wasm, toml::Table::new())
            .expect("passes validation");
        let switch = PolicySwitch::new(
            policy,
            SwitchConfig {
                max_failures: u32::MAX,
                backoff: Duration::ZERO,
                ..SwitchConfig::default()
            },
        );
        let mut group = c.benchmark_group("failure");
        group.sample_size(20);
        group.bench_function(label, |b| {
            b.iter(|| {
                let (index, routed) = switch.route(&request, &[], |_| &workers);
                assert!(
                    index.is_some() && routed.generation().is_none(),
                    "served by the fallback"
                );
            })
        });
        group.finish();
    }
}

fn mean_ns(id: &str) -> Option<f64> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/criterion")
        .join(id)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

fn summary() {
    println!("\n## policy_call summary (means; ratios in this run)\n");
    println!(
        "Each built-in router's Wasm call, in ns, and its ratio to `least-load`'s on the same table \
         (aim: at most 1.5× at 1,024 and 4,096 workers); `cost-aware` with a timing and a prefill \
         line for every worker; then `least-load` sent the eight columns \
         `kv-aware` reads (the floor those bytes set), and `least-load` in native Rust.\n"
    );
    let mut header = String::from("| workers |");
    let mut rule = String::from("|---:|");
    for name in ROUTERS {
        header.push_str(&format!(" {name} |"));
        rule.push_str("---:|");
    }
    println!(
        "{header} cost-aware, every worker measured | least-load sent 8 columns | native least-load | least-load Wasm/native |"
    );
    println!("{rule}---:|---:|---:|---:|");
    for n in SIZES {
        let Some(least) = mean_ns(&format!("route/least-load/{n}")) else {
            continue;
        };
        let mut row = format!("| {n} |");
        for name in ROUTERS {
            match mean_ns(&format!("route/{name}/{n}")) {
                Some(ns) if name == "least-load" => row.push_str(&format!(" {ns:.0} |")),
                Some(ns) => row.push_str(&format!(" {ns:.0} ({:.2}×) |", ns / least)),
                None => row.push_str(" n/a |"),
            }
        }
        match mean_ns(&format!("route/cost-aware-measured/{n}")) {
            Some(ns) => row.push_str(&format!(" {ns:.0} ({:.2}×) |", ns / least)),
            None => row.push_str(" n/a |"),
        }
        match mean_ns(&format!("route/least-load-on-8-columns/{n}")) {
            Some(ns) => row.push_str(&format!(" {ns:.0} ({:.2}×) |", ns / least)),
            None => row.push_str(" n/a |"),
        }
        match mean_ns(&format!("route/native-least-load/{n}")) {
            Some(native) => row.push_str(&format!(" {native:.0} | {:.1}× |", least / native)),
            None => row.push_str(" n/a | n/a |"),
        }
        println!("{row}");
    }
    let us = |id: &str| {
        mean_ns(id)
            .map(|ns| format!("{:.1} µs", ns / 1000.0))
            .unwrap_or_else(|| "n/a".into())
    };
    println!();
    println!("- publish from the compiled-code cache: {}", us("publish/cached"));
    println!("- publish compiling the .wasm: {}", us("publish/compile"));
    println!("- per-thread re-instantiate: {}", us("instantiate"));
    println!(
        "- trapping policy → fallback answer: {}",
        us("failure/trap-to-fallback")
    );
    println!(
        "- runaway policy → fallback answer (1 ms deadline): {}",
        us("failure/deadline-to-fallback")
    );
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench_route(&mut criterion, &runtime(None, false));
    bench_publish(&mut criterion);
    bench_failures(&mut criterion, &runtime(None, true));
    criterion.final_summary();
    summary();
}
