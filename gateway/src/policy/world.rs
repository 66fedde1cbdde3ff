//! What the batcher and planner worlds share: a policy compiled once and checked against its
//! world ([`Compiled`]), and one live instance of it with its own store ([`Instance`]).
//!
//! Both worlds are called rarely (a flush, an adjustment interval) and answer one call each,
//! so loading, instantiating, `init` and the load-time self-test are the same code for both;
//! what differs — the world's exports, its call and the contract its answers are checked
//! against — lives in [`crate::policy::batching`] and [`crate::policy::planning`]. Routers are
//! loaded by [`PolicyRuntime::load_router`], which also speaks the 0.1.0 contract.

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::InstancePre;

use crate::policy::PolicyError;
use crate::policy::bindings::{BatcherPre, BatcherWorld, PlannerPre, PlannerWorld};
use crate::policy::host::HostState;
use crate::policy::runtime::{PolicyRuntime, initial_memory_bytes, self_test};
use crate::policy::versions::Named;

/// A world's generated bindings, as the shared loading code needs them.
pub trait World: Sized + Send + 'static {
    /// The world's name in `wit/policy.wit`, for errors.
    const NAME: &'static str;
    /// The bindings linked to a component, ready to instantiate.
    type Pre: Send + Sync;

    /// Checks that the linked component exports this world.
    ///
    /// # Errors
    ///
    /// What the component lacks.
    fn pre(pre: InstancePre<HostState>) -> wasmtime::Result<Self::Pre>;

    /// Instantiates the component in `store`.
    ///
    /// # Errors
    ///
    /// A trap, or the pool's slot limit.
    fn instantiate(pre: &Self::Pre, store: &mut Store<HostState>) -> wasmtime::Result<Self>;

    /// Calls the world's `init`: `Err` inside is the policy's own refusal.
    ///
    /// # Errors
    ///
    /// A trap.
    fn init(&self, store: &mut Store<HostState>) -> wasmtime::Result<Result<(), String>>;
}

impl World for BatcherWorld {
    const NAME: &'static str = "batcher";
    type Pre = BatcherPre<HostState>;

    fn pre(pre: InstancePre<HostState>) -> wasmtime::Result<Self::Pre> {
        BatcherPre::new(pre)
    }

    fn instantiate(pre: &Self::Pre, store: &mut Store<HostState>) -> wasmtime::Result<Self> {
        pre.instantiate(store)
    }

    fn init(&self, store: &mut Store<HostState>) -> wasmtime::Result<Result<(), String>> {
        Ok(self.call_init(store)?.map_err(|err| err.message))
    }
}

impl World for PlannerWorld {
    const NAME: &'static str = "planner";
    type Pre = PlannerPre<HostState>;

    fn pre(pre: InstancePre<HostState>) -> wasmtime::Result<Self::Pre> {
        PlannerPre::new(pre)
    }

    fn instantiate(pre: &Self::Pre, store: &mut Store<HostState>) -> wasmtime::Result<Self> {
        pre.instantiate(store)
    }

    fn init(&self, store: &mut Store<HostState>) -> wasmtime::Result<Result<(), String>> {
        Ok(self.call_init(store)?.map_err(|err| err.message))
    }
}

/// A validated policy of world `W`: compiled code ready to instantiate. Immutable and shared.
pub struct Compiled<W: World> {
    /// The policy's name.
    pub name: String,
    /// sha256 of the `.wasm` it was loaded from.
    pub sha256: String,
    /// Linear memory of a fresh instance.
    pub initial_memory_bytes: u64,
    pre: W::Pre,
    config: Arc<toml::Table>,
    runtime: Arc<PolicyRuntime>,
}

impl<W: World> std::fmt::Debug for Compiled<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(W::NAME)
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .field("initial_memory_bytes", &self.initial_memory_bytes)
            .finish_non_exhaustive()
    }
}

impl<W: World> Named for Compiled<W> {
    fn name(&self) -> &str {
        &self.name
    }

    fn sha256(&self) -> &str {
        &self.sha256
    }
}

impl<W: World> Compiled<W> {
    /// Compiles (or loads from the cache) and links `wasm`, checks that it exports `W`, and
    /// runs `self_test` on a fresh instance (again on another where the deadline interrupted
    /// it, as for routers).
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError`] if the bytes are not a component, import anything outside the
    /// host world, do not export `W`, fail `init`, or fail the self-test (an answer against
    /// the contract is [`PolicyError::Invalid`]).
    pub(crate) fn load(
        runtime: &Arc<PolicyRuntime>,
        name: &str,
        wasm: &[u8],
        policy_config: toml::Table,
        mut self_test_call: impl FnMut(&mut Instance<W>) -> Result<(), PolicyError>,
    ) -> Result<Compiled<W>, PolicyError> {
        let (sha256, component, pre) = runtime.prepare(wasm)?;
        let pre = W::pre(pre)
            .map_err(|err| PolicyError::Invalid(format!("does not export the {} world: {err:#}", W::NAME)))?;
        let policy = Compiled {
            name: name.to_string(),
            sha256,
            initial_memory_bytes: initial_memory_bytes(&component),
            pre,
            config: Arc::new(policy_config),
            runtime: runtime.clone(),
        };
        self_test(name, || self_test_call(&mut policy.instantiate()?))?;
        Ok(policy)
    }

    /// A fresh instance with its own store, after a successful `init`.
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError`] if instantiation traps or `init` fails.
    pub fn instantiate(&self) -> Result<Instance<W>, PolicyError> {
        let mut store = self.runtime.armed_store(self.config.clone());
        let bindings = W::instantiate(&self.pre, &mut store).map_err(PolicyError::instantiation)?;
        self.runtime.arm(&mut store);
        let init = bindings.init(&mut store);
        store.data_mut().end_call();
        init.map_err(PolicyError::trap)?.map_err(PolicyError::Refused)?;
        Ok(Instance {
            store,
            bindings,
            runtime: self.runtime.clone(),
        })
    }
}

/// One live instance of a policy of world `W`.
pub struct Instance<W: World> {
    store: Store<HostState>,
    bindings: W,
    runtime: Arc<PolicyRuntime>,
}

impl<W: World> std::fmt::Debug for Instance<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(W::NAME).finish_non_exhaustive()
    }
}

impl<W: World> Instance<W> {
    /// Arms the deadline for the next call and lends the store and bindings to make it.
    pub(crate) fn armed(&mut self) -> (&mut Store<HostState>, &W) {
        self.runtime.arm(&mut self.store);
        (&mut self.store, &self.bindings)
    }
}
