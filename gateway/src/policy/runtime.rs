//! The wasmtime side of policies: one engine, loading and validating components, sandboxing.
//!
//! [`PolicyRuntime`] owns the `Engine` (Cranelift, pooling allocator, epoch interruption, no
//! async or concurrency support), the `Linker` with the host world's imports, the epoch ticker
//! thread, and the on-disk cache of precompiled code keyed by the artifact's sha256 and the
//! engine's compatibility hash. [`PolicyRuntime::load_router`] turns `.wasm` bytes into a
//! [`RouterPolicy`]: imports checked against the host world, compiled (or deserialized from the
//! cache), `init` called and a self-test `route` run on a synthetic table, all before anything
//! can route with it.
//!
//! # Rejected designs
//!
//! - 2 MiB of each instance slot kept resident instead of 64 KiB: the memset that resets it cost
//!   40 µs a re-instantiation (`LINEAR_MEMORY_KEEP_RESIDENT`).
//! - `PAGEMAP_SCAN`, to reset only the pages an instance wrote: no help on the kernel measured.
//! - Data segments mapped copy-on-write: copying them saves ~30 µs of a fresh module's first
//!   instantiation.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, Store, StoreLimits, StoreLimitsBuilder, UpdateDeadline};

use crate::policy::bindings::{DisaggregatingRouterPre, DisaggregatingRouterWorld, RouterPre, RouterWorld, v0_1};
use crate::policy::host::HostState;
use crate::policy::ticker::{EpochTicker, TickerState};
use crate::policy::{PolicyError, table};

/// Interfaces a policy may import (any version of our package's host world).
const ALLOWED_IMPORTS: [&str; 9] = [
    "switchyard:policy/log@",
    "switchyard:policy/config@",
    "switchyard:policy/clock@",
    "switchyard:policy/types@",
    "switchyard:policy/tenancy@",
    "switchyard:policy/measured@",
    "switchyard:policy/prompt@",
    "switchyard:policy/planning@",
    "switchyard:policy/disaggregation@",
];

/// Times a load's self-test call that ran past the deadline is tried again on a fresh
/// instance before the policy is refused. A busy machine (several gateways starting at once on
/// two cores) can preempt a call past a 1 ms deadline however fast the policy is; a policy that
/// is slow by itself is interrupted every time and still refused, at the cost of a few
/// deadlines.
pub(crate) const SELF_TEST_RETRIES: u32 = 8;

/// Runs a policy's load-time self-test, `call` (each try on a fresh instance), and answers
/// its result.
///
/// The self-test checks the answer, not the speed: every live call has the deadline. A first
/// call on a loaded machine can be preempted or page-fault past a 1 ms deadline, so a try the
/// deadline interrupted is made again, up to [`SELF_TEST_RETRIES`] times; a policy interrupted
/// on every try is refused as a runaway.
///
/// # Errors
///
/// The last try's error; an answer against the contract becomes [`PolicyError::Invalid`].
pub(crate) fn self_test<T>(name: &str, mut call: impl FnMut() -> Result<T, PolicyError>) -> Result<T, PolicyError> {
    let mut interrupted = 0;
    loop {
        match call() {
            Err(PolicyError::Trap(message)) if message.contains("interrupt") && interrupted < SELF_TEST_RETRIES => {
                interrupted += 1;
                tracing::debug!(policy = name, interrupted, "self-test interrupted; trying again");
            }
            Err(PolicyError::InvalidAnswer(why)) => {
                return Err(PolicyError::Invalid(format!(
                    "self-test answer breaks the contract: {why}"
                )));
            }
            answer => return answer,
        }
    }
}

/// Settings of the policy sandbox.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// CPU time one call may take before it is interrupted.
    pub deadline: Duration,
    /// Linear memory one instance may grow to.
    pub memory_limit_bytes: usize,
    /// Where precompiled code is cached; `None` disables the disk cache.
    pub cache_dir: Option<PathBuf>,
    /// Instances the pooling allocator keeps slots for.
    pub max_instances: u32,
}

impl Default for RuntimeConfig {
    fn default() -> RuntimeConfig {
        RuntimeConfig {
            deadline: Duration::from_millis(1),
            memory_limit_bytes: 32 << 20,
            cache_dir: None,
            max_instances: default_max_instances(),
        }
    }
}

/// Instance slots for every thread that may call a policy: four per core (each runtime worker
/// keeps the active version and a rollout candidate, for the router and a batcher) and 64 for
/// blocking threads, at least 256. Slots are address space until used.
pub fn default_max_instances() -> u32 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    u32::try_from(cores.saturating_mul(4).saturating_add(64))
        .unwrap_or(u32::MAX)
        .max(256)
}

/// The wasmtime engine and everything shared by all policies.
pub struct PolicyRuntime {
    engine: Engine,
    linker: Linker<HostState>,
    config: RuntimeConfig,
    compatibility: String,
    half_deadline_ticks: u64,
    ticker: EpochTicker,
    /// Components loaded from the compiled-code cache instead of compiled.
    cache_hits: AtomicU64,
    /// What the `measured` import answers, once the gateway's workers exist.
    timings: std::sync::OnceLock<Arc<dyn TimingSource>>,
}

/// Where the `measured` import's answers come from: the gateway's worker pool.
pub trait TimingSource: Send + Sync + std::fmt::Debug {
    /// Every measured LLM worker's timing.
    fn timings(&self) -> Vec<crate::policy::host::WorkerTiming>;
    /// Every LLM worker's fitted prefill.
    fn prefill_fits(&self) -> Vec<crate::policy::host::PrefillFit>;
}

impl std::fmt::Debug for PolicyRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyRuntime")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Half-deadline checks after which a call is interrupted even if the OS kept preempting it
/// (about 50 deadlines of wall-clock time).
const MAX_DEADLINE_CHECKS: u32 = 100;

/// Bytes of each instance's linear memory, from address 0, reset in place rather than given
/// back to the OS when the instance goes (see `PolicyRuntime::new`).
const LINEAR_MEMORY_KEEP_RESIDENT: usize = 64 << 10;

/// Bytes in a Wasm page.
const WASM_PAGE_BYTES: u64 = 64 << 10;

/// Bytes of each instance's tables reset in place.
const TABLE_KEEP_RESIDENT: usize = 4 << 10;

/// Instance slots whose memory is given back to the OS in one go: one, so that a dropped
/// instance's memory beyond the resident window goes back at once. Batched (64), five
/// rolled-back memory bombs left ~250 MiB resident, up to 64 × the memory cap in all; the
/// madvise of an instance that did not grow costs nothing measurable (`instantiate` bench).
const DECOMMIT_BATCH: usize = 1;

/// How often the epoch advances: the resolution of the per-call deadline.
const EPOCH_TICK: Duration = Duration::from_micros(500);

/// Time with no policy call after which the epoch ticker sleeps until the next call (at least
/// four deadlines).
const IDLE_BEFORE_PARKING: Duration = Duration::from_millis(100);

impl PolicyRuntime {
    /// Builds the engine and starts the epoch ticker.
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError::Engine`] if wasmtime refuses the configuration, or if the
    /// compiled-code cache folder cannot be created or can be written by others.
    pub fn new(config: RuntimeConfig) -> Result<PolicyRuntime, PolicyError> {
        if let Some(dir) = &config.cache_dir {
            check_cache_dir(dir)?;
        }
        let mut pooling = wasmtime::PoolingAllocationConfig::default();
        pooling
            .total_component_instances(config.max_instances)
            .total_core_instances(config.max_instances)
            .total_memories(config.max_instances)
            .total_tables(config.max_instances)
            .max_memory_size(config.memory_limit_bytes)
            // A fresh instance in a reused slot would otherwise page-fault on the first page it
            // writes (~3 µs per fault here) and pay an madvise with a TLB shootdown to give the
            // pages back: the low 64 KiB (the built-ins' 32 KiB shadow stack, statics and
            // argument arena) are reset with a memset instead, the tables likewise, and the
            // rest is returned as the instance is dropped. Re-instantiation: 12.6 → ~3 µs
            // (benchmarks/history/policy-calls.md).
            .linear_memory_keep_resident(LINEAR_MEMORY_KEEP_RESIDENT)
            .table_keep_resident(TABLE_KEEP_RESIDENT)
            .decommit_batch_size(DECOMMIT_BATCH);
        let mut wasm = Config::new();
        // Data segments are copied into the instance's (resident) memory rather than mapped
        // copy-on-write from the compiled image: a policy's data is a few KiB, and mapping it
        // costs an mmap, a fault per written page and a remap whenever a slot changes module,
        // which made publishing a policy 30 µs slower.
        wasm.memory_init_cow(false);
        wasm.epoch_interruption(true)
            .wasm_component_model(true)
            .allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pooling));
        let engine = Engine::new(&wasm).map_err(PolicyError::engine)?;
        let mut linker = Linker::new(&engine);
        RouterWorld::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(&mut linker, |state| state)
            .map_err(PolicyError::engine)?;
        v0_1::Router::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(&mut linker, |state| state)
            .map_err(PolicyError::engine)?;
        // Disaggregating routers import the types-only `disaggregation` interface.
        crate::policy::bindings::disaggregation::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(
            &mut linker,
            |state| state,
        )
        .map_err(PolicyError::engine)?;
        // Planners import the types-only `planning` interface on top of the host world.
        crate::policy::bindings::planning::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(
            &mut linker,
            |state| state,
        )
        .map_err(PolicyError::engine)?;
        let mut hasher = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let compatibility = format!("{:016x}", hasher.finish());
        // Deadline checks come every half deadline (see `HostState::check_deadline`: the first
        // samples the thread's CPU clock, the next judges); the next tick may come at once, so
        // one more tick than half the deadline holds guarantees a call its full deadline.
        let half_deadline_ticks = (config.deadline / 2).as_micros().div_ceil(EPOCH_TICK.as_micros()) as u64 + 1;
        // Longer than any deadline a store sets (see `ticker`), and long enough that a
        // gateway serving anything at all never parks it.
        let idle_ticks = (IDLE_BEFORE_PARKING.as_micros() / EPOCH_TICK.as_micros()) as u64;
        let ticker = EpochTicker::start(engine.clone(), EPOCH_TICK, idle_ticks.max(4 * half_deadline_ticks))
            .map_err(|err| PolicyError::Engine(format!("cannot start the epoch ticker: {err}")))?;
        Ok(PolicyRuntime {
            engine,
            linker,
            config,
            compatibility,
            half_deadline_ticks,
            ticker,
            cache_hits: AtomicU64::new(0),
            timings: std::sync::OnceLock::new(),
        })
    }

    /// The epoch ticker's shared state: how often it ticked and whether it sleeps.
    pub fn ticker(&self) -> &Arc<TickerState> {
        self.ticker.state()
    }

    /// Components taken from the compiled-code cache so far.
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.load(Ordering::Relaxed)
    }

    /// The sandbox settings.
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Compiles (or loads from the cache), validates and self-tests a router policy.
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError`] if the bytes are not a component, import anything outside the
    /// host world, fail `init`, or fail the self-test.
    pub fn load_router(
        self: &Arc<Self>,
        name: &str,
        wasm: &[u8],
        policy_config: toml::Table,
    ) -> Result<RouterPolicy, PolicyError> {
        let (sha256, component, pre) = self.prepare(wasm)?;
        // The widest world first: a disaggregating router also exports the plain `route`; a
        // router built against 0.1.0 exports its own version.
        let pre = match DisaggregatingRouterPre::new(pre.clone()) {
            Ok(pre) => RouterPreOf::Disaggregating(pre),
            Err(_) => match RouterPre::new(pre.clone()) {
                Ok(pre) => RouterPreOf::Current(pre),
                Err(current) => RouterPreOf::V0_1(
                    v0_1::RouterPre::new(pre)
                        .map_err(|_| PolicyError::Invalid(format!("does not export the router world: {current:#}")))?,
                ),
            },
        };
        let initial_memory_bytes = initial_memory_bytes(&component);
        let mut policy = RouterPolicy {
            name: name.to_string(),
            sha256,
            pre,
            config: Arc::new(policy_config),
            runtime: self.clone(),
            columns: table::Columns::empty(),
            initial_memory_bytes,
        };
        if !policy.fits_resident_memory() {
            tracing::info!(
                policy = name,
                initial_memory_bytes,
                "policy starts with more memory than is reset in place; re-instantiating it page-faults (build it with a smaller stack, see plugins/.cargo/config.toml)"
            );
        }
        let first = policy.instantiate()?;
        policy.columns = first.columns;
        let mut first = Some(first);
        // The self-test table holds what a live one would: the declared and the fallback's columns.
        let table = table::synthetic(8).select(policy.columns | table::fallback_columns());
        let request = table::synthetic_request();
        let decision = self_test(name, || {
            // The instance `init` declared the columns on, then a fresh one for each retry.
            let mut instance = match first.take() {
                Some(first) => first,
                None => policy.instantiate()?,
            };
            instance.route(&request, &[], &table)
        })?
        .worker;
        if decision as usize >= table.len() {
            return Err(PolicyError::Invalid(format!(
                "self-test answered worker {decision} of {}",
                table.len()
            )));
        }
        Ok(policy)
    }

    /// The component of `wasm` (compiled, or from the cache) with its sha256, its imports
    /// checked and linked against the host world.
    pub(crate) fn prepare(
        &self,
        wasm: &[u8],
    ) -> Result<(String, Component, wasmtime::component::InstancePre<HostState>), PolicyError> {
        let sha256 = hex(&Sha256::digest(wasm));
        let component = self.component(&sha256, wasm)?;
        self.check_imports(&component)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|err| PolicyError::Invalid(format!("cannot link: {err:#}")))?;
        Ok((sha256, component, pre))
    }

    /// A store for one call sequence into a guest, with its deadline armed for the first call.
    pub(crate) fn armed_store(&self, config: Arc<toml::Table>) -> Store<HostState> {
        let mut store = self.store(config);
        self.arm(&mut store);
        store
    }

    /// Arms the deadline for the next call into a guest of `store`.
    pub(crate) fn arm(&self, store: &mut Store<HostState>) {
        store.data_mut().begin_call();
        store.set_epoch_deadline(self.half_deadline_ticks);
    }

    fn component(&self, sha256: &str, wasm: &[u8]) -> Result<Component, PolicyError> {
        // Cached files are native code: only the owner may have written them.
        let cached = self
            .config
            .cache_dir
            .as_ref()
            .map(|dir| dir.join(format!("{sha256}-{}.cwasm", self.compatibility)));
        if let Some(path) = &cached
            && path.is_file()
            && private_to_owner(path)
        {
            // Read, not mapped: a mapped file cut short under the gateway (an operator cleaning
            // the cache) would be a SIGBUS, not an error.
            let bytes = std::fs::read(path);
            // SAFETY: the file was written by `Component::serialize` of an engine with the same
            // compatibility hash (part of its name) into the operator's private cache folder
            // (checked at start; the file itself is writable by nobody else, checked above);
            // wasmtime checks the header and the engine's settings before using it.
            let loaded = bytes
                .map_err(wasmtime::Error::from)
                .and_then(|bytes| unsafe { Component::deserialize(&self.engine, &bytes) });
            match loaded {
                Ok(component) => {
                    self.cache_hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(component);
                }
                Err(err) => {
                    tracing::warn!(path = %path.display(), error = %err, "ignoring unusable cached policy code")
                }
            }
        }
        let component = Component::new(&self.engine, wasm)
            .map_err(|err| PolicyError::Invalid(format!("not a valid component: {err:#}")))?;
        if let Some(path) = &cached {
            let written = component.serialize().map_err(|err| err.to_string()).and_then(|bytes| {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|err| err.to_string())?;
                }
                let temporary = path.with_extension("tmp");
                std::fs::write(&temporary, bytes).map_err(|err| err.to_string())?;
                std::fs::rename(&temporary, path).map_err(|err| err.to_string())
            });
            if let Err(err) = written {
                tracing::warn!(path = %path.display(), error = %err, "could not cache compiled policy code");
            }
        }
        Ok(component)
    }

    fn check_imports(&self, component: &Component) -> Result<(), PolicyError> {
        let ty = component.component_type();
        let forbidden: Vec<String> = ty
            .imports(&self.engine)
            .map(|(name, _)| name.to_string())
            .filter(|name| !ALLOWED_IMPORTS.iter().any(|allowed| name.starts_with(allowed)))
            .collect();
        if forbidden.is_empty() {
            Ok(())
        } else {
            Err(PolicyError::ForbiddenImport(forbidden.join(", ")))
        }
    }

    /// Makes `source` answer the `measured` import of every instance made from now on.
    pub fn provide_timings(&self, source: Arc<dyn TimingSource>) {
        let _ = self.timings.set(source);
    }

    fn store(&self, config: Arc<toml::Table>) -> Store<HostState> {
        let limits: StoreLimits = StoreLimitsBuilder::new()
            .memory_size(self.config.memory_limit_bytes)
            .instances(4)
            .trap_on_grow_failure(true)
            .build();
        let mut state = HostState::new(config, limits);
        state.timings = self.timings.get().cloned();
        state.ticker = Some(self.ticker.state().clone());
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.limits);
        // A check runs right as the epoch advances, so the next check comes exactly `half - 1`
        // ticks later (the initial `half` includes one tick for a first tick that may come at once).
        let half = self.half_deadline_ticks.saturating_sub(1).max(1);
        store.epoch_deadline_callback(move |mut state| {
            Ok(if state.data_mut().check_deadline(MAX_DEADLINE_CHECKS) {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::Continue(half)
            })
        });
        store
    }
}

/// Linear memory a component's instance starts with, in bytes.
pub(crate) fn initial_memory_bytes(component: &Component) -> u64 {
    component
        .resources_required()
        .and_then(|resources| resources.max_initial_memory_size)
        .map_or(0, |pages| pages.saturating_mul(WASM_PAGE_BYTES))
}

/// A router's linked code, by the contract version it was built against.
enum RouterPreOf {
    Disaggregating(DisaggregatingRouterPre<HostState>),
    Current(RouterPre<HostState>),
    V0_1(v0_1::RouterPre<HostState>),
}

/// A router instance's exports, by contract version.
enum RouterBindingsOf {
    Disaggregating(DisaggregatingRouterWorld),
    Current(RouterWorld),
    V0_1(v0_1::Router),
}

/// A validated router policy: compiled code ready to instantiate. Immutable and shared.
pub struct RouterPolicy {
    /// The policy's name.
    pub name: String,
    /// sha256 of the `.wasm` it was loaded from.
    pub sha256: String,
    pre: RouterPreOf,
    config: Arc<toml::Table>,
    runtime: Arc<PolicyRuntime>,
    columns: table::Columns,
    initial_memory_bytes: u64,
}

impl std::fmt::Debug for RouterPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterPolicy")
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .field("columns", &self.columns)
            .finish_non_exhaustive()
    }
}

impl RouterPolicy {
    /// The settings the policy was loaded with (what its `config` import reads).
    pub fn settings(&self) -> &toml::Table {
        &self.config
    }

    /// The worker-table columns the policy reads (its `init` answer at load).
    pub fn columns(&self) -> table::Columns {
        self.columns
    }

    /// Whether the policy may send prompts to prefill workers (it exports the
    /// `disaggregating-router` world): only its tables hold prefill rows.
    pub fn disaggregates(&self) -> bool {
        matches!(self.pre, RouterPreOf::Disaggregating(_))
    }

    /// The linear memory an instance starts with, in bytes.
    pub fn initial_memory_bytes(&self) -> u64 {
        self.initial_memory_bytes
    }

    /// Whether an instance's initial memory lies within what is reset in place when an instance
    /// goes, so that re-instantiating the policy does not page-fault.
    pub fn fits_resident_memory(&self) -> bool {
        self.initial_memory_bytes <= LINEAR_MEMORY_KEEP_RESIDENT as u64
    }

    /// A fresh instance with its own store, after a successful `init`.
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError`] if instantiation traps or `init` fails.
    pub fn instantiate(&self) -> Result<RouterInstance, PolicyError> {
        let mut store = self.runtime.armed_store(self.config.clone());
        // Each contract version's bindings are types of their own with the same steps:
        // instantiate, arm the deadline, `init`.
        macro_rules! instantiate_and_init {
            ($pre:expr) => {{
                let bindings = $pre.instantiate(&mut store).map_err(PolicyError::instantiation)?;
                self.runtime.arm(&mut store);
                let columns = bindings
                    .call_init(&mut store)
                    .map_err(PolicyError::trap)?
                    .map_err(|err| PolicyError::Refused(err.message))?;
                (bindings, columns)
            }};
        }
        let (bindings, columns) = match &self.pre {
            RouterPreOf::Disaggregating(pre) => {
                let (bindings, columns) = instantiate_and_init!(pre);
                (RouterBindingsOf::Disaggregating(bindings), columns)
            }
            RouterPreOf::Current(pre) => {
                let (bindings, columns) = instantiate_and_init!(pre);
                (RouterBindingsOf::Current(bindings), columns)
            }
            RouterPreOf::V0_1(pre) => {
                let (bindings, columns) = instantiate_and_init!(pre);
                let columns = V0_1_COLUMNS
                    .iter()
                    .filter(|(_, old)| columns.contains(*old))
                    .fold(table::Columns::empty(), |all, (current, _)| all | *current);
                (RouterBindingsOf::V0_1(bindings), columns)
            }
        };
        // (On the errors above the store goes, which ends its calls.)
        store.data_mut().end_call();
        Ok(RouterInstance {
            store,
            bindings,
            deadline_ticks: self.runtime.half_deadline_ticks,
            columns,
        })
    }
}

/// One live instance of a router policy, owned by one thread.
pub struct RouterInstance {
    store: Store<HostState>,
    bindings: RouterBindingsOf,
    deadline_ticks: u64,
    /// The columns this instance's `init` asked for.
    columns: table::Columns,
}

impl std::fmt::Debug for RouterInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterInstance").finish_non_exhaustive()
    }
}

impl RouterInstance {
    /// Calls `route` under the deadline, with `prompt` (the request's block hashes) as what
    /// the `prompt` import answers during the call, and returns the chosen worker and its
    /// ranked fallbacks, checked against the table's size (repeated fallbacks and the chosen
    /// worker itself are dropped from the list).
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError::Trap`] (including deadline interrupts and memory exhaustion),
    /// [`PolicyError::Refused`] for an error result, or [`PolicyError::InvalidAnswer`] (also
    /// when this instance's `init` asked for columns the table, built for what the policy
    /// declared at load, does not hold).
    pub fn route(
        &mut self,
        request: &table::RequestInfo,
        prompt: &[u64],
        workers: &table::WorkerTable,
    ) -> Result<Pick, PolicyError> {
        if !workers.present.contains(self.columns) {
            return Err(PolicyError::InvalidAnswer(format!(
                "init asked for the columns {:?}; the table holds {:?}",
                self.columns, workers.present
            )));
        }
        let host = self.store.data_mut();
        host.begin_call();
        // Copied into a buffer the store keeps, so no call after the first allocates.
        host.prompt.extend_from_slice(prompt);
        self.store.set_epoch_deadline(self.deadline_ticks);
        // Every version's answer as (worker, encoders, fallbacks, prefill) or the refusal's
        // message. Only a disaggregating router sees the prefill rows.
        let answer = match &self.bindings {
            RouterBindingsOf::Disaggregating(bindings) => bindings
                .call_route_disaggregated(&mut self.store, *request, workers)
                .map(|answer| {
                    answer
                        .map(|answer| {
                            let decision = answer.decision;
                            (decision.worker, decision.encoders, decision.fallbacks, answer.prefill)
                        })
                        .map_err(|err| err.message)
                }),
            RouterBindingsOf::Current(bindings) => {
                let without_prefill = workers.without_prefill_rows();
                let workers = without_prefill.as_ref().unwrap_or(workers);
                bindings.call_route(&mut self.store, *request, workers).map(|answer| {
                    answer
                        .map(|decision| (decision.worker, decision.encoders, decision.fallbacks, None))
                        .map_err(|err| err.message)
                })
            }
            RouterBindingsOf::V0_1(bindings) => bindings
                .call_route(
                    &mut self.store,
                    v0_1_request(request),
                    &v0_1_table(workers.without_prefill_rows().as_ref().unwrap_or(workers)),
                )
                .map(|answer| {
                    // 0.1.0's `encoder` was never used by a host; it is checked, then dropped.
                    answer
                        .map(|decision| {
                            (
                                decision.worker,
                                decision.encoder.into_iter().collect(),
                                decision.fallbacks,
                                None,
                            )
                        })
                        .map_err(|err| err.message)
                }),
        };
        let host = self.store.data_mut();
        host.prompt.clear();
        host.end_call();
        let (worker, encoders, fallbacks, prefill) =
            answer.map_err(PolicyError::trap)?.map_err(PolicyError::Refused)?;
        let mut pick = check_route_answer(workers, worker, encoders, fallbacks)?;
        pick.prefill =
            table::check_roles(workers, pick.worker, &pick.fallbacks, prefill).map_err(PolicyError::InvalidAnswer)?;
        Ok(pick)
    }
}

/// Checks a router's answer against the table it was given: the worker and every fallback in
/// range, the encoders valid ([`table::check_encoders`]); answers the [`Pick`], cleaned of
/// repeated fallbacks.
///
/// # Errors
///
/// [`PolicyError::InvalidAnswer`] saying what is out of range.
pub fn check_route_answer(
    workers: &table::WorkerTable,
    worker: u32,
    encoders: Vec<u32>,
    fallbacks: Vec<u32>,
) -> Result<Pick, PolicyError> {
    let size = workers.len();
    if worker as usize >= size {
        return Err(PolicyError::InvalidAnswer(format!(
            "worker {worker} of a {size}-worker table"
        )));
    }
    if fallbacks.len() > size || fallbacks.iter().any(|&index| index as usize >= size) {
        return Err(PolicyError::InvalidAnswer(format!(
            "{} fallbacks, or one out of range, for a {size}-worker table",
            fallbacks.len()
        )));
    }
    let encoders = table::check_encoders(workers, encoders).map_err(PolicyError::InvalidAnswer)?;
    let mut pick = Pick::new(worker, fallbacks);
    pick.encoders = encoders;
    Ok(pick)
}

type OldColumns = v0_1::switchyard::policy::types::Columns;

/// The 0.1.0 contract's columns and today's of the same name.
const V0_1_COLUMNS: [(table::Columns, OldColumns); 11] = [
    (table::Columns::IDS, OldColumns::IDS),
    (table::Columns::ROLES, OldColumns::ROLES),
    (table::Columns::CAPABILITIES, OldColumns::CAPABILITIES),
    (table::Columns::OVERLAP_DEVICE_BLOCKS, OldColumns::OVERLAP_DEVICE_BLOCKS),
    (table::Columns::OVERLAP_HOST_BLOCKS, OldColumns::OVERLAP_HOST_BLOCKS),
    (table::Columns::ACTIVE_BLOCKS, OldColumns::ACTIVE_BLOCKS),
    (table::Columns::PREFILL_TOKENS, OldColumns::PREFILL_TOKENS),
    (table::Columns::ACTIVE_REQUESTS, OldColumns::ACTIVE_REQUESTS),
    (table::Columns::CAPACITY_BLOCKS, OldColumns::CAPACITY_BLOCKS),
    (table::Columns::BLOCK_SIZE, OldColumns::BLOCK_SIZE),
    (table::Columns::COST, OldColumns::COST),
];

/// A 0.1.0 router's view of a request: the same fields.
fn v0_1_request(request: &table::RequestInfo) -> v0_1::switchyard::policy::types::RequestInfo {
    v0_1::switchyard::policy::types::RequestInfo {
        request_id: request.request_id,
        prompt_tokens: request.prompt_tokens,
        max_tokens: request.max_tokens,
        prompt_blocks: request.prompt_blocks,
        media_tokens: request.media_tokens,
        affinity: request.affinity,
        ttft_target_ms: request.ttft_target_ms,
    }
}

/// A 0.1.0 router's view of a table: its eleven columns, which lead today's packed data.
fn v0_1_table(workers: &table::WorkerTable) -> v0_1::switchyard::policy::types::WorkerTable {
    let old = workers.select(table::v0_1_columns());
    v0_1::switchyard::policy::types::WorkerTable {
        count: old.count,
        present: V0_1_COLUMNS
            .iter()
            .filter(|(current, _)| old.present.contains(*current))
            .fold(OldColumns::empty(), |all, (_, old)| all | *old),
        data: old.data,
        cost: old.cost,
    }
}

/// A router's answer: the worker to send the request to, then the ones to try, in order, if
/// it fails before its first byte (before the policy is asked again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// Index of the chosen worker in the table.
    pub worker: u32,
    /// Indices to try next, best first; never the chosen worker, never one twice.
    pub fallbacks: Vec<u32>,
    /// Indices of the encoders chosen for the request's media, at most one per role.
    pub encoders: Vec<u32>,
    /// Index of the prefill worker the prompt goes to first (a row of role
    /// [`table::ROLE_PREFILL`]); `None`: the chosen worker prefills it.
    pub prefill: Option<u32>,
}

impl Pick {
    /// `worker` with `fallbacks` (in range, checked by the caller) cleaned of repeats.
    pub fn new(worker: u32, mut fallbacks: Vec<u32>) -> Pick {
        let mut seen = std::collections::HashSet::with_capacity(fallbacks.len() + 1);
        seen.insert(worker);
        fallbacks.retain(|&index| seen.insert(index));
        Pick {
            worker,
            fallbacks,
            encoders: Vec::new(),
            prefill: None,
        }
    }

    /// `worker` alone, without fallbacks.
    pub fn only(worker: u32) -> Pick {
        Pick {
            worker,
            fallbacks: Vec::new(),
            encoders: Vec::new(),
            prefill: None,
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Whether `path` belongs to this gateway's user and can be written by its owner only (no group
/// or other write bit), so that a file in it, loaded as native code, came from this gateway's
/// user. Elsewhere than Unix, always true.
fn private_to_owner(path: &std::path::Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.uid() != effective_uid() => {
                tracing::warn!(
                    path = %path.display(),
                    owner = meta.uid(),
                    "ignoring cached policy code owned by another user; recompiling"
                );
                false
            }
            Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o022 == 0 => true,
            Ok(meta) => {
                tracing::warn!(
                    path = %path.display(),
                    mode = format!("{:o}", meta.permissions().mode() & 0o777),
                    "ignoring cached policy code that others can write (or not a plain file); recompiling"
                );
                false
            }
            Err(_) => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        true
    }
}

/// This process's effective user id.
#[cfg(unix)]
fn effective_uid() -> u32 {
    // SAFETY: `geteuid` takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// Makes sure the compiled-code cache folder exists and that no other user can write it or
/// put another folder in its place: its files are loaded as native code, so such a folder
/// would let them run code in the gateway. The folder must be this user's, not a symbolic
/// link, and writable by its owner only; each folder above it must belong to this user or
/// root, and be writable by others only with the sticky bit (as `/tmp`), which keeps them from
/// renaming what is not theirs.
fn check_cache_dir(dir: &std::path::Path) -> Result<(), PolicyError> {
    let refused = |why: String| {
        tracing::error!(path = %dir.display(), reason = %why, "policy.cache_dir refused");
        PolicyError::Engine(format!("policy.cache_dir `{}` {why}", dir.display()))
    };
    if !dir.exists() {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            builder.mode(0o700);
        }
        builder
            .create(dir)
            .map_err(|err| refused(format!("cannot be created: {err}")))?;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let meta = std::fs::symlink_metadata(dir).map_err(|err| refused(format!("cannot be read: {err}")))?;
        if meta.file_type().is_symlink() {
            return Err(refused(
                "is a symbolic link; name the folder itself, so no one can point it elsewhere".into(),
            ));
        }
        let me = effective_uid();
        if meta.uid() != me {
            return Err(refused(format!(
                "is owned by user {}, not the gateway's user {me}; its files are loaded as native \
                 code, so only the gateway's user may own it",
                meta.uid()
            )));
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o022 != 0 {
            return Err(refused(format!(
                "can be written by others (mode {mode:o}); its files are loaded as native code, so \
                 only the gateway's user may write it (chmod go-w)"
            )));
        }
        let absolute = dir
            .canonicalize()
            .map_err(|err| refused(format!("cannot be resolved: {err}")))?;
        for above in absolute.ancestors().skip(1) {
            let meta = std::fs::metadata(above)
                .map_err(|err| refused(format!("cannot be checked: `{}`: {err}", above.display())))?;
            let mode = meta.permissions().mode();
            if meta.uid() != me && meta.uid() != 0 {
                return Err(refused(format!(
                    "lies in `{}`, owned by user {}, who could replace it",
                    above.display(),
                    meta.uid()
                )));
            }
            if mode & 0o022 != 0 && mode & 0o1000 == 0 {
                return Err(refused(format!(
                    "lies in `{}`, which others can write (mode {:o}, no sticky bit), so they \
                     could replace it",
                    above.display(),
                    mode & 0o7777
                )));
            }
        }
    }
    Ok(())
}
