//! Checking a router component offline, before any gateway sees it: what
//! `switchyard policy check FILE.wasm` runs.
//!
//! The check is the gateway's own upload validation — the component compiles, imports nothing
//! outside the host world, its `init` succeeds and a self-test call on a synthetic table
//! answers in range — plus what an author wants to know before pushing: the columns it
//! declared, whether its initial memory fits what the gateway resets in place (if not, every
//! re-instantiation page-faults), whether it disaggregates (its tables then hold prefill
//! workers), and what one call costs at 8, 64 and 1,024 workers under the same sandbox
//! (deadline and memory cap) the gateway would run it in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::policy::PolicyError;
use crate::policy::runtime::{PolicyRuntime, RuntimeConfig};
use crate::policy::table;

/// Table sizes a check times calls at.
const SIZES: [usize; 3] = [8, 64, 1024];

/// How long calls are timed per table size.
const TIMING_BUDGET: Duration = Duration::from_millis(200);

/// The deadline calls are timed under (see [`check_policy`]).
const TIMING_DEADLINE: Duration = Duration::from_secs(1);

/// What [`check_policy`] found out about a component that passed.
#[derive(Debug, Clone)]
pub struct PolicyCheck {
    /// The component's SHA-256.
    pub sha256: String,
    /// The worker-table columns its `init` declared.
    pub columns: String,
    /// Its linear memory at instantiation, in bytes.
    pub initial_memory_bytes: u64,
    /// Whether that memory lies within what the gateway resets in place.
    pub fits_resident_memory: bool,
    /// Whether it exports the `disaggregating-router` world (its calls are timed with a
    /// quarter of each table's rows prefill workers).
    pub disaggregates: bool,
    /// The CPU deadline each call ran under.
    pub deadline: Duration,
    /// Mean time of one `route` call, by table size: `(workers, nanoseconds)`.
    pub ns_per_call: Vec<(usize, f64)>,
}

impl std::fmt::Display for PolicyCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "ok: imports, init and the self-test call pass")?;
        writeln!(f, "sha256: {}", self.sha256)?;
        writeln!(f, "columns: {}", self.columns)?;
        writeln!(
            f,
            "initial memory: {} KiB ({})",
            self.initial_memory_bytes / 1024,
            if self.fits_resident_memory {
                "reset in place between instances"
            } else {
                "more than is reset in place: each re-instantiation page-faults; build with a smaller stack (see plugins/.cargo/config.toml)"
            }
        )?;
        if self.disaggregates {
            writeln!(
                f,
                "disaggregates: yes (may send prompts to prefill workers; timed with a quarter of the rows prefill workers)"
            )?;
        }
        for (workers, ns) in &self.ns_per_call {
            let share = ns / self.deadline.as_nanos() as f64 * 100.0;
            writeln!(
                f,
                "route at {workers:>5} workers: {ns:>10.0} ns per call ({share:.1} % of the {} µs deadline)",
                self.deadline.as_micros()
            )?;
        }
        Ok(())
    }
}

/// Validates router component `wasm` with `config` as its own settings, in a sandbox with
/// `sandbox`'s deadline and memory cap, and times its calls (the mean must fit the deadline).
///
/// # Errors
///
/// The [`PolicyError`] the gateway would refuse the upload with, or the one a timed call
/// failed with (a trap, a deadline overrun, a refusal or an out-of-range answer).
pub fn check_policy(wasm: &[u8], config: toml::Table, sandbox: RuntimeConfig) -> Result<PolicyCheck, PolicyError> {
    let deadline = sandbox.deadline;
    let sandbox = RuntimeConfig {
        cache_dir: None,
        max_instances: 4,
        ..sandbox
    };
    // Validation exactly as an upload: the same sandbox, deadline included.
    let policy = Arc::new(PolicyRuntime::new(sandbox.clone())?).load_router("check", wasm, config.clone())?;
    // Timing under a deadline far past the real one, so that a call the OS happened to
    // preempt is measured instead of interrupted; the mean is then held against the deadline.
    let timing = Arc::new(PolicyRuntime::new(RuntimeConfig {
        deadline: TIMING_DEADLINE.max(deadline),
        ..sandbox
    })?);
    let mut instance = timing.load_router("check", wasm, config)?.instantiate()?;
    let request = table::synthetic_request();
    let mut ns_per_call = Vec::with_capacity(SIZES.len());
    for workers in SIZES {
        let mut table = table::synthetic(workers).select(policy.columns() | table::fallback_columns());
        if policy.disaggregates()
            && let Some(roles) = table.column_mut(table::Columns::ROLES)
        {
            // Prefill rows come last, as the gateway orders them.
            let first_prefill = workers - workers / 4;
            roles[first_prefill..].fill(table::ROLE_PREFILL);
        }
        // One call first, so that lazily touched memory and caches do not count.
        instance.route(&request, &[], &table)?;
        let started = Instant::now();
        let mut calls = 0u32;
        while started.elapsed() < TIMING_BUDGET {
            for _ in 0..16 {
                std::hint::black_box(instance.route(&request, &[], &table)?);
            }
            calls += 16;
        }
        let ns = started.elapsed().as_nanos() as f64 / f64::from(calls);
        if ns > deadline.as_nanos() as f64 {
            return Err(PolicyError::Invalid(format!(
                "route takes {:.0} µs per call at {workers} workers, past the {} µs deadline: a gateway would interrupt it and route every such request by the fallback",
                ns / 1_000.0,
                deadline.as_micros()
            )));
        }
        ns_per_call.push((workers, ns));
    }
    Ok(PolicyCheck {
        sha256: policy.sha256.clone(),
        columns: format!("{:?}", policy.columns()),
        initial_memory_bytes: policy.initial_memory_bytes(),
        fits_resident_memory: policy.fits_resident_memory(),
        disaggregates: policy.disaggregates(),
        deadline,
        ns_per_call,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_in_passes_and_is_timed_at_every_size() {
        let wasm = crate::built_ins::router("least-load").expect("built in");
        // A deadline that parallel tests on two busy cores do not hit (it is wall-clock time).
        let sandbox = RuntimeConfig {
            deadline: Duration::from_millis(200),
            ..RuntimeConfig::default()
        };
        let check = check_policy(wasm, toml::Table::new(), sandbox).expect("passes");
        assert_eq!(check.ns_per_call.iter().map(|(n, _)| *n).collect::<Vec<_>>(), SIZES);
        assert!(check.ns_per_call.iter().all(|(_, ns)| *ns > 0.0));
        assert!(check.fits_resident_memory);
        assert!(check.to_string().contains("1024 workers"));
        assert!(!check.disaggregates);
        let wasm = crate::built_ins::router("pd-predicted").expect("built in");
        let sandbox = RuntimeConfig {
            deadline: Duration::from_millis(200),
            ..RuntimeConfig::default()
        };
        let check = check_policy(wasm, toml::Table::new(), sandbox).expect("passes");
        assert!(check.disaggregates && check.to_string().contains("disaggregates: yes"));
    }

    #[test]
    fn bytes_that_are_no_component_are_refused() {
        let err = check_policy(b"not wasm", toml::Table::new(), RuntimeConfig::default()).expect_err("refused");
        assert!(matches!(err, PolicyError::Invalid(_)), "{err}");
    }
}
