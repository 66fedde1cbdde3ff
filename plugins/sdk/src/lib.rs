//! The Switchyard policy SDK: write a routing or batching policy as plain Rust.
//!
//! This crate owns the guest side of the `switchyard:policy@0.2.0` contract: the generated
//! bindings, the [`Router`] and [`Batcher`] traits a policy implements, helpers over the flat
//! worker table, and the runtime a `no_std` component needs (an allocator and a panic handler
//! that traps, so a policy imports nothing but the host world). The bindings come from the
//! crate's own copy of the contract, `wit/policy.wit` here, byte-identical to the repository's
//! `wit/policy.wit`, so a policy crate outside the repository builds with nothing but a path or
//! git dependency on this crate. For routers over thousands of workers it also has
//! [`lanes`] (four-worker SIMD arithmetic that runs natively in tests), [`shortlist`] (scans
//! for ranking exact costs only where estimates say they can win), and for routers that keep a
//! record of their own decisions, [`prefix_index`] and [`state`]. A policy is:
//!
//! ```ignore
//! struct Mine;
//! impl switchyard_policy_sdk::Router for Mine {
//!     const COLUMNS: Columns = Columns::ROLES;
//!     fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
//!         workers.llm_indices().next().map(Decision::to).ok_or_else(|| PolicyError::new("no worker"))
//!     }
//! }
//! switchyard_policy_sdk::router!(Mine);
//! ```

#![no_std]

extern crate alloc;
#[cfg(not(target_arch = "wasm32"))]
extern crate std;

use alloc::string::String;
use alloc::vec::Vec;

/// Generated bindings of the `router` world.
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod router_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/router",
        pub_export_macro: true,
        export_macro_name: "export_router_world",
        default_bindings_module: "switchyard_policy_sdk::router_world",
    });
}

/// Generated bindings of the `batcher` world.
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod batcher_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/batcher",
        pub_export_macro: true,
        export_macro_name: "export_batcher_world",
        default_bindings_module: "switchyard_policy_sdk::batcher_world",
    });
}

/// Generated bindings of the `planner` world.
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod planner_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/planner",
        pub_export_macro: true,
        export_macro_name: "export_planner_world",
        default_bindings_module: "switchyard_policy_sdk::planner_world",
    });
}

pub use planner_world::switchyard::policy::planning::{IntervalStats, Pool, PoolRole, ScaleDecision};

pub use router_world::switchyard::policy::types::{
    Batch, Budget, Columns, Decision, PendingTable, PolicyError, RequestInfo,
};

mod table;
pub use table::WorkerTable;

pub mod lanes;
pub mod prefix_index;
pub mod shortlist;

/// Writing to the host's log.
pub mod log {
    pub use crate::router_world::switchyard::policy::log::Level;

    /// Writes one line to the gateway's log (to stderr when tested natively).
    pub fn write(level: Level, message: &str) {
        #[cfg(target_arch = "wasm32")]
        crate::router_world::switchyard::policy::log::log(level, message);
        #[cfg(not(target_arch = "wasm32"))]
        std::eprintln!("[{level:?}] {message}");
    }
}

/// What the gateway measured of its workers (its `measured` interface).
pub mod measured {
    use alloc::vec::Vec;

    pub use crate::router_world::switchyard::policy::measured::{PrefillFit, WorkerTiming};

    /// Every LLM worker the gateway has measured: match them to the table's rows by the `ids`
    /// column. Empty from a gateway that measured none yet (and in its validation call).
    pub fn timings() -> Vec<WorkerTiming> {
        // Asked for as columns: the host copies a list of numbers in one go, where it stores a
        // list of records field by field (~15 ns a record, half of a 4,096-worker call).
        #[cfg(target_arch = "wasm32")]
        return {
            let columns = crate::router_world::switchyard::policy::measured::timing_columns();
            columns
                .ids
                .iter()
                .zip(&columns.itl_us)
                .zip(&columns.samples)
                .map(|((&id, &itl_us), &samples)| WorkerTiming { id, itl_us, samples })
                .collect()
        };
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::timings();
    }

    /// Every LLM worker whose prefill the gateway has measured: a line from the prefill work a
    /// request finds on the worker to its time to first token. Match them to the table's rows
    /// by the `ids` column. Empty from a gateway that measured none yet (and in its validation
    /// call).
    pub fn prefill_fits() -> Vec<PrefillFit> {
        // As columns, as `timings` is.
        #[cfg(target_arch = "wasm32")]
        return {
            let columns = crate::router_world::switchyard::policy::measured::prefill_fit_columns();
            columns
                .ids
                .iter()
                .zip(&columns.fixed_ms)
                .zip(&columns.ms_per_ktoken)
                .zip(&columns.samples)
                .map(|(((&id, &fixed_ms), &ms_per_ktoken), &samples)| PrefillFit {
                    id,
                    fixed_ms,
                    ms_per_ktoken,
                    samples,
                })
                .collect()
        };
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::prefill_fits();
    }
}

/// The prompt of the request being routed, for routers that keep their own record of where
/// prompts went (an approximate prefix index) instead of reading the overlap columns.
pub mod prompt {
    use alloc::vec::Vec;

    /// The sequence hashes of the prompt's full KV blocks, in order: hash `i` covers the first
    /// `i + 1` blocks, so two prompts share their first `k` hashes exactly when they share
    /// their first `k` blocks. Empty outside a `route` call. Copied from the host each call:
    /// read it once.
    pub fn block_hashes() -> Vec<u64> {
        #[cfg(target_arch = "wasm32")]
        return crate::router_world::switchyard::policy::prompt::block_hashes();
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::prompt();
    }
}

/// State a policy keeps between calls of one instance (a record of its own decisions, say).
///
/// The contract promises no state: the gateway may drop an instance and make a new one at any
/// time, and each of its threads calls its own instance. What a policy keeps here is therefore
/// a cache of what that instance has seen, never something it relies on. Natively (in tests,
/// which run in parallel) each thread has its own value.
pub mod state {
    /// A value kept in a `static` for the instance's lifetime, made by `init` at first use.
    pub struct Kept<T> {
        #[cfg(target_arch = "wasm32")]
        cell: core::cell::UnsafeCell<Option<T>>,
        #[cfg(not(target_arch = "wasm32"))]
        per_thread: std::sync::Mutex<alloc::vec::Vec<(std::thread::ThreadId, T)>>,
    }

    // SAFETY: a component instance runs single-threaded, and `with` hands out the one `&mut`
    // for the length of its closure only (which cannot reach `with` again: see there).
    #[cfg(target_arch = "wasm32")]
    unsafe impl<T> Sync for Kept<T> {}

    impl<T> Kept<T> {
        /// Nothing kept yet.
        pub const fn new() -> Kept<T> {
            Kept {
                #[cfg(target_arch = "wasm32")]
                cell: core::cell::UnsafeCell::new(None),
                #[cfg(not(target_arch = "wasm32"))]
                per_thread: std::sync::Mutex::new(alloc::vec::Vec::new()),
            }
        }

        /// Runs `use_it` on the value, made by `init` the first time. `use_it` must not call
        /// `with` on the same `Kept` (it would panic natively and is undefined in a component).
        pub fn with<R>(&self, init: impl FnOnce() -> T, use_it: impl FnOnce(&mut T) -> R) -> R {
            #[cfg(target_arch = "wasm32")]
            {
                // SAFETY: single-threaded (see `Sync` above); the reference lives for this
                // block only and `use_it` does not re-enter (documented above).
                let value = unsafe { &mut *self.cell.get() };
                use_it(value.get_or_insert_with(init))
            }
            #[cfg(not(target_arch = "wasm32"))]
            {
                let mut kept = self
                    .per_thread
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let me = std::thread::current().id();
                let slot = match kept.iter().position(|(thread, _)| *thread == me) {
                    Some(slot) => slot,
                    None => {
                        kept.push((me, init()));
                        kept.len() - 1
                    }
                };
                use_it(&mut kept[slot].1)
            }
        }
    }

    impl<T> Default for Kept<T> {
        fn default() -> Kept<T> {
            Kept::new()
        }
    }
}

/// A well-mixed 64-bit hash (splitmix64's finaliser), for tie-breaks and draws: policies have
/// no random source, and hashing the request id keeps equal workers evenly used.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The policy's own configuration table.
///
/// A version's configuration never changes, so in a component each number is fetched from the
/// host once per instance and answered from memory afterwards: a policy may read its settings
/// on every call without paying a host call each time. Numbers are parsed by the host, so a
/// policy carries no number parser (about 20 KiB of code, which every publish would hash,
/// load and map).
pub mod config {
    use alloc::string::String;

    /// The value of `key`, rendered as TOML (strings unquoted); asks the host each time.
    pub fn get(key: &str) -> Option<String> {
        #[cfg(target_arch = "wasm32")]
        return crate::router_world::switchyard::policy::config::get(key).map(|value| String::from(value.as_str()));
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::config_value(key);
    }

    /// The value of `key` as a number (a TOML float or integer, or a string that parses as
    /// one), or `default`.
    pub fn get_f64(key: &str, default: f64) -> f64 {
        #[cfg(target_arch = "wasm32")]
        return cache::number(key, || crate::router_world::switchyard::policy::config::get_f64(key)).unwrap_or(default);
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::config_value(key)
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(default);
    }

    /// The value of `key` as a boolean (a TOML boolean, or a number: 0 is false), or
    /// `default`. Remembered per instance, as numbers are.
    pub fn get_bool(key: &str, default: bool) -> bool {
        let parse = |value: Option<String>| {
            value.and_then(|value| match value.trim() {
                "true" => Some(1.0),
                "false" => Some(0.0),
                number => number.parse::<f64>().ok(),
            })
        };
        #[cfg(target_arch = "wasm32")]
        let number = cache::number(key, || parse(get(key)));
        #[cfg(not(target_arch = "wasm32"))]
        let number = parse(crate::testing::config_value(key));
        number.map(|number| number != 0.0).unwrap_or(default)
    }

    /// A value a policy derives from its settings once per instance (its cost model, say),
    /// held in a `static`: reading a dozen keys on every call costs more than routing a small
    /// table. Natively (in tests, which change settings between calls) it is derived afresh
    /// on every read.
    ///
    /// ```ignore
    /// static MODEL: config::Derived<Model> = config::Derived::new();
    /// let model = MODEL.get_or_init(Model::from_config);
    /// ```
    pub struct Derived<T>(core::cell::UnsafeCell<Option<T>>);

    // SAFETY: a component instance runs single-threaded; natively the cell is never written.
    unsafe impl<T> Sync for Derived<T> {}

    impl<T: Copy> Derived<T> {
        /// Nothing derived yet.
        pub const fn new() -> Derived<T> {
            Derived(core::cell::UnsafeCell::new(None))
        }

        /// The value, derived by `derive` on the instance's first read.
        pub fn get_or_init(&self, derive: impl FnOnce() -> T) -> T {
            #[cfg(target_arch = "wasm32")]
            {
                // SAFETY: single-threaded (see `Sync` above); each access copies the value in
                // or out, so no reference outlives its statement (nor spans `derive`).
                if let Some(value) = unsafe { *self.0.get() } {
                    return value;
                }
                let value = derive();
                unsafe { *self.0.get() = Some(value) };
                value
            }
            #[cfg(not(target_arch = "wasm32"))]
            derive()
        }
    }

    impl<T: Copy> Default for Derived<T> {
        fn default() -> Derived<T> {
            Derived::new()
        }
    }

    #[cfg(target_arch = "wasm32")]
    mod cache {
        use core::cell::UnsafeCell;

        /// Keys remembered per instance; more are fetched from the host each time.
        const ENTRIES: usize = 24;
        /// Longest key remembered, in bytes.
        const MAX_KEY: usize = 48;

        /// One key and the host's answer, held inline: the cache allocates nothing, so
        /// reading a setting never grows the instance's memory.
        #[derive(Clone, Copy)]
        struct Entry {
            key: [u8; MAX_KEY],
            key_len: u8,
            value: Option<f64>,
        }

        struct Cache(UnsafeCell<([Entry; ENTRIES], usize)>);

        // SAFETY: a component instance runs single-threaded; the cache is only touched from
        // the one thread that calls into it.
        unsafe impl Sync for Cache {}

        const EMPTY: Entry = Entry {
            key: [0; MAX_KEY],
            key_len: 0,
            value: None,
        };

        static CACHE: Cache = Cache(UnsafeCell::new(([EMPTY; ENTRIES], 0)));

        /// The number under `key`, fetched from the host unless remembered.
        pub(super) fn number(key: &str, fetch: impl FnOnce() -> Option<f64>) -> Option<f64> {
            // SAFETY: single-threaded (see `Sync` above); each reference lives within one
            // block that neither re-enters this function nor calls the host.
            let (entries, used) = unsafe { &*CACHE.0.get() };
            let remembered = entries[..*used]
                .iter()
                .find(|entry| same(&entry.key[..usize::from(entry.key_len)], key.as_bytes()));
            if let Some(entry) = remembered {
                return entry.value;
            }
            let value = fetch();
            // SAFETY: as above.
            let (entries, used) = unsafe { &mut *CACHE.0.get() };
            if *used < ENTRIES && key.len() <= MAX_KEY {
                let mut entry = EMPTY;
                entry.key[..key.len()].copy_from_slice(key.as_bytes());
                entry.key_len = key.len() as u8;
                entry.value = value;
                entries[*used] = entry;
                *used += 1;
            }
            value
        }

        /// Byte equality without `memcmp`, which a component without libc does not have.
        fn same(a: &[u8], b: &[u8]) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a == b)
        }
    }
}

/// Memory for the current call only.
///
/// [`scratch`] hands out a `Vec` from the same per-call arena the host's arguments are copied
/// into: taking it costs a pointer bump, dropping it costs nothing, and the whole arena is
/// reused by the next call. A policy that needs a buffer per worker (costs, ranks) uses it to
/// avoid the general allocator; one that outgrows the arena gets ordinary heap memory.
pub mod scratch {
    use alloc::vec::Vec;

    /// An empty `Vec` with room for `capacity` values, valid until the current call returns.
    ///
    /// It must not be kept past the call (in a `static`, say): the next call reuses its memory.
    pub fn vec<T>(capacity: usize) -> Vec<T> {
        #[cfg(target_arch = "wasm32")]
        if let Ok(layout) = core::alloc::Layout::array::<T>(capacity)
            && layout.size() > 0
        {
            let block = crate::arena::bump(layout);
            if !block.is_null() {
                // SAFETY: `block` is `layout`'s size and alignment for `capacity` values of
                // `T`, and comes from the global allocator's arena, which that allocator
                // recognises on `dealloc` (a no-op) and on `realloc` (a copy out).
                return unsafe { Vec::from_raw_parts(block.cast::<T>(), 0, capacity) };
            }
        }
        Vec::with_capacity(capacity)
    }
}

/// Monotonic time (0 when tested natively).
pub fn now_ns() -> u64 {
    #[cfg(target_arch = "wasm32")]
    return router_world::switchyard::policy::clock::now_ns();
    #[cfg(not(target_arch = "wasm32"))]
    return 0;
}

/// Testing a policy natively (`cargo test`), without a gateway: the host imports are served
/// from here, and [`testing::table`] builds worker tables.
#[cfg(not(target_arch = "wasm32"))]
pub mod testing {
    use alloc::string::String;
    use alloc::vec;
    use alloc::vec::Vec;
    use std::cell::RefCell;
    use std::collections::HashMap;

    use crate::{Decision, PolicyError, RequestInfo, Router, WorkerTable};

    pub use crate::table::Table;

    std::thread_local! {
        static CONFIG: RefCell<HashMap<String, String>> = RefCell::new(HashMap::new());
        static TIMINGS: RefCell<Vec<crate::measured::WorkerTiming>> = const { RefCell::new(Vec::new()) };
        static PREFILL_FITS: RefCell<Vec<crate::measured::PrefillFit>> = const { RefCell::new(Vec::new()) };
        static PROMPT: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    }

    /// Sets what [`crate::prompt::block_hashes`] answers.
    pub fn set_prompt(hashes: Vec<u64>) {
        PROMPT.with(|current| *current.borrow_mut() = hashes);
    }

    pub(crate) fn prompt() -> Vec<u64> {
        PROMPT.with(|current| current.borrow().clone())
    }

    /// Sets what [`crate::measured::timings`] answers.
    pub fn set_timings(timings: Vec<crate::measured::WorkerTiming>) {
        TIMINGS.with(|current| *current.borrow_mut() = timings);
    }

    pub(crate) fn timings() -> Vec<crate::measured::WorkerTiming> {
        TIMINGS.with(|current| current.borrow().clone())
    }

    /// Sets what [`crate::measured::prefill_fits`] answers.
    pub fn set_prefill_fits(fits: Vec<crate::measured::PrefillFit>) {
        PREFILL_FITS.with(|current| *current.borrow_mut() = fits);
    }

    pub(crate) fn prefill_fits() -> Vec<crate::measured::PrefillFit> {
        PREFILL_FITS.with(|current| current.borrow().clone())
    }

    /// Sets a configuration value the policy will read with [`crate::config::get`].
    pub fn set_config(key: &str, value: &str) {
        CONFIG.with(|config| config.borrow_mut().insert(key.into(), value.into()));
    }

    pub(crate) fn config_value(key: &str) -> Option<String> {
        CONFIG.with(|config| config.borrow().get(key).cloned())
    }

    /// A table of `n` idle LLM workers with block size 64; set the fields you care about.
    pub fn table(n: usize) -> Table {
        Table {
            ids: (0..n as u32).collect(),
            roles: vec![0; n],
            capabilities: vec![1; n],
            overlap_device_blocks: vec![0; n],
            overlap_host_blocks: vec![0; n],
            active_blocks: vec![0; n],
            prefill_tokens: vec![0; n],
            active_requests: vec![0; n],
            capacity_blocks: vec![16_384; n],
            block_size: vec![64; n],
            cost: vec![1.0; n],
            node: vec![0; n],
            queued_us: vec![0; n],
            encode_us: vec![0; n],
            media_cached_tokens: vec![0; n],
        }
    }

    /// Routes `req` over `table` with policy `P` the way the gateway does: `init` first, then
    /// `route` over the table packed as the host sends it, holding only the columns
    /// `P::COLUMNS` names, so a policy that reads a column it did not declare fails here too
    /// (a checked read such as `workers.active_requests()?` answers an error naming the
    /// column; an unchecked one sees an empty slice and panics when indexed).
    pub fn route<P: Router>(req: &RequestInfo, table: &Table) -> Result<Decision, PolicyError> {
        P::init()?;
        let (count, data, cost) = table.pack(P::COLUMNS);
        let view = WorkerTable::from_packed(count, P::COLUMNS, &data, &cost, P::COLUMNS)?;
        P::route(req, &view)
    }

    /// A small deterministic generator for a policy's differential tests (random tables
    /// replayed the same way on every run).
    pub struct Draws(pub u64);

    impl Draws {
        /// A value below `bound` (0 when `bound` is 0).
        pub fn below(&mut self, bound: u32) -> u32 {
            self.0 = crate::mix(self.0);
            (self.0 % u64::from(bound.max(1))) as u32
        }

        /// A value from a few small ones (so that workers tie), else anything below `bound`.
        pub fn value(&mut self, bound: u32) -> u32 {
            if self.below(2) == 0 {
                self.below(3)
            } else {
                self.below(bound)
            }
        }
    }

    /// A request of `prompt_tokens` tokens.
    pub fn request(id: u64, prompt_tokens: u32) -> RequestInfo {
        RequestInfo {
            request_id: id,
            prompt_tokens,
            max_tokens: 128,
            prompt_blocks: prompt_tokens / 64,
            media_tokens: 0,
            affinity: 0,
            ttft_target_ms: 0.0,
        }
    }
}

/// Worker role values in [`WorkerTable::roles`].
pub mod role {
    /// Generates tokens.
    pub const LLM: u32 = 0;
    /// Encodes images and video frames.
    pub const VISION: u32 = 1;
    /// Encodes audio.
    pub const AUDIO: u32 = 2;
}

impl PolicyError {
    /// An error with `message`.
    pub fn new(message: &str) -> PolicyError {
        PolicyError {
            message: String::from(message),
        }
    }
}

impl Decision {
    /// Route to worker `index`, with no encoder and no fallbacks.
    pub fn to(index: usize) -> Decision {
        Decision {
            worker: index as u32,
            encoders: Vec::new(),
            fallbacks: Vec::new(),
        }
    }
}

/// Packs requests, taken in `order`, into batches: a batch closes when the next request would
/// push it past the largest token budget or past `max_items`, and at most `max_batches` are
/// formed. Each batch is labelled with the smallest budget its tokens fit, or with its own token
/// count when it fits none (a request larger than every budget forms a batch of its own).
pub fn pack(order: impl IntoIterator<Item = usize>, tokens: &[u32], budget: &Budget) -> Vec<Batch> {
    let largest = budget.token_budgets.last().copied().unwrap_or(u32::MAX);
    let label = |total: u32| {
        budget
            .token_budgets
            .iter()
            .copied()
            .find(|b| *b >= total)
            .unwrap_or(total)
    };
    let mut batches = Vec::new();
    let mut items: Vec<u32> = Vec::new();
    let mut total = 0u32;
    for index in order {
        let need = tokens[index];
        if !items.is_empty() && (total.saturating_add(need) > largest || items.len() as u32 >= budget.max_items.max(1))
        {
            batches.push(Batch {
                token_budget: label(total),
                items: core::mem::take(&mut items),
            });
            total = 0;
            if batches.len() as u32 >= budget.max_batches.max(1) {
                return batches;
            }
        }
        items.push(index as u32);
        total = total.saturating_add(need);
    }
    if !items.is_empty() {
        batches.push(Batch {
            token_budget: label(total),
            items,
        });
    }
    batches
}

/// A routing policy.
pub trait Router {
    /// The worker-table columns `route` reads. The host sends only what policies ask for, so
    /// naming fewer columns makes each call cheaper; in the [`WorkerTable`] `route` sees,
    /// columns not named here are empty slices, and their checked accessors
    /// ([`WorkerTable::column`], `workers.active_requests()`, ...) answer an error naming them.
    /// Every column by default.
    const COLUMNS: Columns = Columns::all();

    /// Called once per instance before any route; an error refuses the policy.
    fn init() -> Result<(), PolicyError> {
        Ok(())
    }

    /// Picks a worker (an index into `workers`) for `req`.
    fn route(req: &RequestInfo, workers: &WorkerTable<'_>) -> Result<Decision, PolicyError>;
}

/// Who queued each item of a pending table, index for index: what a batcher sharing a queue
/// between tenants reads beside the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tenancy {
    /// Each item's tenant as a small number (one tenant's items share it; 0 = no tenant).
    pub tenants: Vec<u32>,
    /// Each item's tenant's weight (its share; 1.0 where none is configured).
    pub weights: Vec<f32>,
}

impl Tenancy {
    /// Every one of `items` from one tenant of weight 1 (what a queue without tenants is).
    pub fn single(items: usize) -> Tenancy {
        Tenancy {
            tenants: alloc::vec![0; items],
            weights: alloc::vec![1.0; items],
        }
    }

    /// The host's answer for the current call, made as long as the table (a host that gives
    /// less leaves the rest to tenant 0, weight 1; a weight that is not a positive number
    /// counts as 1).
    fn from_host(tenants: Vec<u32>, weights: Vec<f32>, items: usize) -> Tenancy {
        let mut tenancy = Tenancy { tenants, weights };
        tenancy.tenants.resize(items, 0);
        tenancy.weights.resize(items, 1.0);
        for weight in &mut tenancy.weights {
            if !(weight.is_finite() && *weight > 0.0) {
                *weight = 1.0;
            }
        }
        tenancy
    }
}

/// A batching policy.
pub trait Batcher {
    /// Called once per instance before any call; an error refuses the policy.
    fn init() -> Result<(), PolicyError> {
        Ok(())
    }

    /// Forms batches of indices into `queue` within `budget`.
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch>;

    /// As [`Batcher::form_batches`], knowing whose each item is; what the gateway calls. The
    /// default ignores `tenancy`: a policy that shares the queue between tenants overrides it.
    fn form_batches_for(queue: &PendingTable, tenancy: &Tenancy, budget: &Budget) -> Vec<Batch> {
        let _ = tenancy;
        Self::form_batches(queue, budget)
    }
}

/// A planner: desired sizes of the worker pools, once per adjustment interval (the `planner`
/// world). Pools come with their recent history, so a planner keeps no state between calls.
pub trait Planner {
    /// Called once per instance before any call; an error refuses the policy.
    fn init() -> Result<(), PolicyError> {
        Ok(())
    }

    /// Desired sizes for `pools` (indices into it); pools left out keep their size.
    /// `max_gpus` is the fleet's GPU budget (0: none).
    fn plan(pools: &[Pool], max_gpus: u32) -> Result<Vec<ScaleDecision>, PolicyError>;
}

/// Exports a [`Planner`] implementation as the component's `planner` world.
#[macro_export]
macro_rules! planner {
    ($policy:ty) => {
        struct __SwitchyardPlannerExport;
        impl $crate::planner_world::Guest for __SwitchyardPlannerExport {
            fn init() -> Result<(), $crate::planner_world::switchyard::policy::types::PolicyError> {
                <$policy as $crate::Planner>::init().map_err(|e| {
                    $crate::planner_world::switchyard::policy::types::PolicyError { message: e.message }
                })
            }
            fn plan(
                pools: $crate::__Vec<$crate::Pool>,
                max_gpus: u32,
            ) -> Result<
                $crate::__Vec<$crate::ScaleDecision>,
                $crate::planner_world::switchyard::policy::types::PolicyError,
            > {
                let decisions = <$policy as $crate::Planner>::plan(&pools, max_gpus).map_err(|e| {
                    $crate::planner_world::switchyard::policy::types::PolicyError { message: e.message }
                });
                $crate::__end_of_call();
                decisions
            }
        }
        $crate::planner_world::export_planner_world!(__SwitchyardPlannerExport with_types_in $crate::planner_world);
    };
}

/// Exports a [`Router`] implementation as the component's `router` world.
#[macro_export]
macro_rules! router {
    ($policy:ty) => {
        struct __SwitchyardRouterExport;
        impl $crate::router_world::Guest for __SwitchyardRouterExport {
            fn init() -> Result<$crate::Columns, $crate::PolicyError> {
                <$policy as $crate::Router>::init()?;
                Ok(<$policy as $crate::Router>::COLUMNS)
            }
            fn route(
                req: $crate::RequestInfo,
                workers: $crate::router_world::switchyard::policy::types::WorkerTable,
            ) -> Result<$crate::Decision, $crate::PolicyError> {
                let columns = <$policy as $crate::Router>::COLUMNS;
                let (count, present) = (workers.count, workers.present);
                let decision = $crate::WorkerTable::from_packed(count, present, &workers.data, &workers.cost, columns)
                    .and_then(|view| <$policy as $crate::Router>::route(&req, &view));
                $crate::__end_of_call();
                decision
            }
        }
        $crate::router_world::export_router_world!(__SwitchyardRouterExport with_types_in $crate::router_world);
    };
}

/// Exports a [`Batcher`] implementation as the component's `batcher` world.
#[macro_export]
macro_rules! batcher {
    ($policy:ty) => {
        struct __SwitchyardBatcherExport;
        impl $crate::batcher_world::Guest for __SwitchyardBatcherExport {
            fn init() -> Result<(), $crate::batcher_world::switchyard::policy::types::PolicyError> {
                <$policy as $crate::Batcher>::init().map_err(|e| {
                    $crate::batcher_world::switchyard::policy::types::PolicyError { message: e.message }
                })
            }
            fn form_batches(
                queue: $crate::batcher_world::switchyard::policy::types::PendingTable,
                budget: $crate::batcher_world::switchyard::policy::types::Budget,
            ) -> $crate::__Vec<$crate::batcher_world::switchyard::policy::types::Batch> {
                let batches = $crate::__batcher_adapter::<$policy>(queue, budget);
                $crate::__end_of_call();
                batches
            }
        }
        $crate::batcher_world::export_batcher_world!(__SwitchyardBatcherExport with_types_in $crate::batcher_world);
    };
}

#[doc(hidden)]
pub type __Vec<T> = Vec<T>;

#[doc(hidden)]
pub fn __batcher_adapter<B: Batcher>(
    queue: batcher_world::switchyard::policy::types::PendingTable,
    budget: batcher_world::switchyard::policy::types::Budget,
) -> Vec<batcher_world::switchyard::policy::types::Batch> {
    let queue = PendingTable {
        ids: queue.ids,
        tokens: queue.tokens,
        waited_ms: queue.waited_ms,
        priority: queue.priority,
        kinds: queue.kinds,
        ready: queue.ready,
    };
    let budget = Budget {
        token_budgets: budget.token_budgets,
        max_items: budget.max_items,
        max_batches: budget.max_batches,
    };
    #[cfg(target_arch = "wasm32")]
    let tenancy = Tenancy::from_host(
        batcher_world::switchyard::policy::tenancy::tenants(),
        batcher_world::switchyard::policy::tenancy::weights(),
        queue.ids.len(),
    );
    #[cfg(not(target_arch = "wasm32"))]
    let tenancy = Tenancy::from_host(Vec::new(), Vec::new(), queue.ids.len());
    B::form_batches_for(&queue, &tenancy, &budget)
        .into_iter()
        .map(|b| batcher_world::switchyard::policy::types::Batch {
            items: b.items,
            token_budget: b.token_budget,
        })
        .collect()
}

#[cfg(target_arch = "wasm32")]
#[global_allocator]
static ALLOCATOR: arena::PolicyAllocator = arena::PolicyAllocator;

/// Call arguments live in a bump arena that is reset when each exported call ends.
///
/// The host copies every argument list into the guest through `cabi_realloc`; with a general
/// allocator each list costs a `malloc` and, when the call's arguments are dropped, a `free`.
/// Arguments are dead once the call returns, so they are bump-allocated instead, freeing is a
/// no-op, and the whole arena is reused by the next call ([`scratch::vec`] hands out the same
/// memory). Everything else (and any argument that outgrows the arena) comes from dlmalloc. A
/// policy that keeps an argument beyond its call must clone it (moving a `Vec` argument into a
/// `static` would see it overwritten).
///
/// The arena is a 12 KiB static (a table of ~380 workers with eight columns): with the 32 KiB
/// stack and the statics it stays in the low 64 KiB the gateway keeps resident between
/// instances, so a fresh instance's first calls neither page-fault nor grow its memory, which
/// dlmalloc's first allocation would.
///
/// # Rejected designs
///
/// - A 512 KiB arena, so that a 4,096-worker table's columns are bump-allocated too: 0–4 %
///   faster at 1,024 and 4,096 workers (`least-load` 2.94 / 2.81 → 2.82 / 2.80 µs, `kv-aware`
///   8.53 / 8.48 → 8.19 / 8.10 µs), since the copies, not the allocator, are where the columns'
///   cost goes; and a static that large would sit past the low 64 KiB the gateway resets in
///   place.
#[cfg(target_arch = "wasm32")]
mod arena {
    use core::alloc::{GlobalAlloc, Layout};
    use core::cell::UnsafeCell;
    use core::sync::atomic::{AtomicUsize, Ordering};

    const SIZE: usize = 12 * 1024;

    #[repr(C, align(16))]
    struct Region(UnsafeCell<[u8; SIZE]>);

    // SAFETY: a component instance runs single-threaded; the arena is only touched from the
    // one thread that calls into it.
    unsafe impl Sync for Region {}

    static REGION: Region = Region(UnsafeCell::new([0; SIZE]));
    static NEXT: AtomicUsize = AtomicUsize::new(0);

    fn base() -> usize {
        REGION.0.get() as usize
    }

    /// Whether `pointer` was handed out by the arena.
    pub(crate) fn contains(pointer: *mut u8) -> bool {
        let address = pointer as usize;
        address >= base() && address < base() + SIZE
    }

    /// A block from the arena, or null when it is full.
    pub(crate) fn bump(layout: Layout) -> *mut u8 {
        let base = base();
        let start = (base + NEXT.load(Ordering::Relaxed)).next_multiple_of(layout.align());
        let end = start.saturating_add(layout.size());
        if end > base + SIZE {
            return core::ptr::null_mut();
        }
        NEXT.store(end - base, Ordering::Relaxed);
        start as *mut u8
    }

    /// Forgets every arena block (at the end of an exported call).
    pub(crate) fn reset() {
        NEXT.store(0, Ordering::Relaxed);
    }

    /// dlmalloc, except that arena blocks are never freed individually.
    pub(crate) struct PolicyAllocator;

    // SAFETY: delegates to dlmalloc for every block it did not hand out from the arena, and
    // never frees arena blocks; `realloc` of an arena block copies into a dlmalloc block.
    unsafe impl GlobalAlloc for PolicyAllocator {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded contract.
            unsafe { dlmalloc::GlobalDlmalloc.alloc(layout) }
        }

        unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
            if !contains(pointer) {
                // SAFETY: forwarded contract; the block came from dlmalloc.
                unsafe { dlmalloc::GlobalDlmalloc.dealloc(pointer, layout) }
            }
        }

        unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            if !contains(pointer) {
                // SAFETY: forwarded contract; the block came from dlmalloc.
                return unsafe { dlmalloc::GlobalDlmalloc.realloc(pointer, layout, new_size) };
            }
            // SAFETY: `layout.align()` is a valid alignment and `new_size` is non-zero per the
            // `GlobalAlloc::realloc` contract.
            let moved = unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
            if !moved.is_null() {
                // SAFETY: both blocks are valid for the copied length and do not overlap.
                unsafe { core::ptr::copy_nonoverlapping(pointer, moved, layout.size().min(new_size)) };
            }
            moved
        }
    }
}

#[doc(hidden)]
pub fn __end_of_call() {
    #[cfg(target_arch = "wasm32")]
    arena::reset();
}

#[cfg(target_arch = "wasm32")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

/// The canonical ABI's allocation entry point, which the host calls to copy arguments in.
///
/// # Safety
///
/// Called by the component runtime with the canonical ABI's contract: `old_ptr`/`old_len`
/// describe a live allocation of alignment `align` (or are 0), and `new_len` is non-zero.
#[cfg(target_arch = "wasm32")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cabi_realloc(old_ptr: *mut u8, old_len: usize, align: usize, new_len: usize) -> *mut u8 {
    use alloc::alloc::{Layout, alloc, realloc};
    // SAFETY: the canonical ABI passes a power-of-two alignment and, for a reallocation, the
    // layout the block was allocated with.
    let pointer = unsafe {
        if old_len == 0 {
            if new_len == 0 {
                return align as *mut u8;
            }
            let layout = Layout::from_size_align_unchecked(new_len, align);
            let block = arena::bump(layout);
            if block.is_null() { alloc(layout) } else { block }
        } else {
            realloc(old_ptr, Layout::from_size_align_unchecked(old_len, align), new_len)
        }
    };
    if pointer.is_null() {
        core::arch::wasm32::unreachable();
    }
    pointer
}
