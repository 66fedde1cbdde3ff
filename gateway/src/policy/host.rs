//! What the host world gives a policy: logging, its own configuration, a monotonic clock.
//!
//! Log lines are truncated and rate-limited per instance so a chatty or hostile policy cannot
//! flood the gateway's log.

use std::sync::Arc;
use std::time::Instant;

use wasmtime::StoreLimits;

use crate::policy::bindings::switchyard::policy::{clock, config, log, measured, prompt, tenancy, types};

pub use crate::policy::bindings::switchyard::policy::measured::{PrefillFit, WorkerTiming};

/// Longest log line kept from a policy, in bytes.
const MAX_LOG_LINE: usize = 1000;
/// Log lines one instance may write per second.
const LOG_LINES_PER_SECOND: u32 = 20;

/// The state of one policy store.
#[derive(Debug)]
pub struct HostState {
    config: Arc<toml::Table>,
    /// Memory and instance limits enforced on the store.
    pub limits: StoreLimits,
    started: Instant,
    log_window: Instant,
    log_lines: u32,
    /// This thread's CPU time and the wall clock at the current call's last deadline check.
    sample: Option<(std::time::Duration, Instant)>,
    /// Deadline checks of the current call.
    checks: u32,
    /// Whose each item of the current `form-batches` call's table is.
    pub tenancy: Tenancy,
    /// What answers the `measured` import (none before the gateway's workers exist, as in
    /// a policy's validation).
    pub timings: Option<Arc<dyn crate::policy::runtime::TimingSource>>,
    /// The block hashes of the prompt being routed, which the `prompt` import answers: set
    /// by [`RouterInstance::route`](crate::policy::runtime::RouterInstance::route) for the
    /// length of its call, empty outside one.
    pub prompt: Vec<u64>,
    /// The epoch ticker this store's calls keep awake (none in tests without a runtime).
    pub ticker: Option<Arc<crate::policy::ticker::TickerState>>,
    /// A call sequence begun on the ticker ([`HostState::begin_call`]) has not ended.
    open: bool,
}

/// Who queued each item of a batcher's table: tenant numbers and weights, index for index
/// (empty: one tenant of weight 1).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tenancy {
    /// Each item's tenant, as a small number (0 = no tenant).
    pub tenants: Vec<u32>,
    /// Each item's tenant's weight.
    pub weights: Vec<f32>,
}

impl HostState {
    /// State for a store of a policy with `config`.
    pub fn new(config: Arc<toml::Table>, limits: StoreLimits) -> HostState {
        let now = Instant::now();
        HostState {
            config,
            limits,
            started: now,
            log_window: now,
            log_lines: 0,
            sample: None,
            checks: 0,
            tenancy: Tenancy::default(),
            timings: None,
            prompt: Vec::new(),
            ticker: None,
            open: false,
        }
    }
}

impl HostState {
    /// Marks the start of a call into the guest, for [`HostState::check_deadline`].
    pub fn begin_call(&mut self) {
        self.sample = None;
        self.checks = 0;
        if let Some(ticker) = &self.ticker {
            if !self.open {
                ticker.begin();
                self.open = true;
            }
            ticker.mark_active();
        }
    }

    /// Marks the end of the calls begun since [`HostState::begin_call`]: the epoch need not
    /// advance for this store until the next. A call sequence never ended is ended when the
    /// store goes.
    pub fn end_call(&mut self) {
        if self.open {
            if let Some(ticker) = &self.ticker {
                ticker.end();
            }
            self.open = false;
        }
    }

    /// Called each time the call reaches its (half-)deadline in wall-clock time; answers
    /// whether to interrupt it.
    ///
    /// The epoch ticker measures wall-clock time, so a thread the OS preempted mid-call reaches
    /// its deadline without having run. The first check samples this thread's CPU time; each
    /// later check interrupts the call only if the thread ran for most of the time since the
    /// previous check (a busy guest), and otherwise extends it, at most `max_checks` times.
    /// Reading the thread's CPU clock is a system call, so it happens here, not on every call.
    pub fn check_deadline(&mut self, max_checks: u32) -> bool {
        // A call still running keeps the ticker awake (and wakes it, if the call was preempted
        // for longer than the ticker's idle period).
        if let Some(ticker) = &self.ticker {
            ticker.mark_active();
        }
        self.checks += 1;
        let now = (cpu_time::ThreadTime::now().as_duration(), Instant::now());
        let busy = match self.sample {
            None => false,
            Some((cpu, wall)) => {
                let ran = now.0.saturating_sub(cpu);
                ran * 2 >= now.1.saturating_duration_since(wall)
            }
        };
        self.sample = Some(now);
        busy || self.checks >= max_checks
    }
}

impl Drop for HostState {
    fn drop(&mut self) {
        self.end_call();
    }
}

impl types::Host for HostState {}

impl prompt::Host for HostState {
    fn block_hashes(&mut self) -> Vec<u64> {
        self.prompt.clone()
    }
}

impl crate::policy::bindings::planning::Host for HostState {}

impl crate::policy::bindings::disaggregation::Host for HostState {}

impl log::Host for HostState {
    fn log(&mut self, level: log::Level, message: String) {
        if self.log_window.elapsed().as_secs() >= 1 {
            self.log_window = Instant::now();
            self.log_lines = 0;
        }
        self.log_lines += 1;
        if self.log_lines > LOG_LINES_PER_SECOND {
            return;
        }
        let mut end = message.len().min(MAX_LOG_LINE);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let message = &message[..end];
        match level {
            log::Level::Trace => tracing::trace!(target: "switchyard::policy::guest", "{message}"),
            log::Level::Debug => tracing::debug!(target: "switchyard::policy::guest", "{message}"),
            log::Level::Info => tracing::info!(target: "switchyard::policy::guest", "{message}"),
            log::Level::Warn => tracing::warn!(target: "switchyard::policy::guest", "{message}"),
            log::Level::Error => tracing::error!(target: "switchyard::policy::guest", "{message}"),
        }
    }
}

impl config::Host for HostState {
    fn get(&mut self, key: String) -> Option<String> {
        self.config.get(&key).map(|value| match value {
            toml::Value::String(text) => text.clone(),
            other => other.to_string(),
        })
    }

    fn get_f64(&mut self, key: String) -> Option<f64> {
        match self.config.get(&key)? {
            toml::Value::Float(value) => Some(*value),
            toml::Value::Integer(value) => Some(*value as f64),
            toml::Value::String(text) => text.trim().parse().ok(),
            _ => None,
        }
    }
}

impl tenancy::Host for HostState {
    fn tenants(&mut self) -> Vec<u32> {
        self.tenancy.tenants.clone()
    }

    fn weights(&mut self) -> Vec<f32> {
        self.tenancy.weights.clone()
    }
}

impl measured::Host for HostState {
    fn timings(&mut self) -> Vec<WorkerTiming> {
        self.timings.as_ref().map(|source| source.timings()).unwrap_or_default()
    }

    fn prefill_fits(&mut self) -> Vec<PrefillFit> {
        self.timings
            .as_ref()
            .map(|source| source.prefill_fits())
            .unwrap_or_default()
    }

    fn timing_columns(&mut self) -> measured::TimingTable {
        let timings = measured::Host::timings(self);
        measured::TimingTable {
            ids: timings.iter().map(|timing| timing.id).collect(),
            itl_us: timings.iter().map(|timing| timing.itl_us).collect(),
            samples: timings.iter().map(|timing| timing.samples).collect(),
        }
    }

    fn prefill_fit_columns(&mut self) -> measured::PrefillFitTable {
        let fits = measured::Host::prefill_fits(self);
        measured::PrefillFitTable {
            ids: fits.iter().map(|fit| fit.id).collect(),
            fixed_ms: fits.iter().map(|fit| fit.fixed_ms).collect(),
            ms_per_ktoken: fits.iter().map(|fit| fit.ms_per_ktoken).collect(),
            samples: fits.iter().map(|fit| fit.samples).collect(),
        }
    }
}

impl clock::Host for HostState {
    fn now_ns(&mut self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The 0.1.0 host world, for routers built against it: the same services.
mod v0_1_host {
    use super::HostState;
    use crate::policy::bindings::v0_1::switchyard::policy::{clock, config, log, types};

    impl types::Host for HostState {}

    impl log::Host for HostState {
        fn log(&mut self, level: log::Level, message: String) {
            use crate::policy::bindings::switchyard::policy::log::{Host, Level};
            let level = match level {
                log::Level::Trace => Level::Trace,
                log::Level::Debug => Level::Debug,
                log::Level::Info => Level::Info,
                log::Level::Warn => Level::Warn,
                log::Level::Error => Level::Error,
            };
            Host::log(self, level, message);
        }
    }

    impl config::Host for HostState {
        fn get(&mut self, key: String) -> Option<String> {
            crate::policy::bindings::switchyard::policy::config::Host::get(self, key)
        }

        fn get_f64(&mut self, key: String) -> Option<f64> {
            crate::policy::bindings::switchyard::policy::config::Host::get_f64(self, key)
        }
    }

    impl clock::Host for HostState {
        fn now_ns(&mut self) -> u64 {
            crate::policy::bindings::switchyard::policy::clock::Host::now_ns(self)
        }
    }
}
