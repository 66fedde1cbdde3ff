//! The epoch ticker: the thread that advances the engine's epoch, which is how a policy call's
//! deadline is measured, and that sleeps while no policy runs.
//!
//! Wasmtime interrupts a guest when the engine's epoch passes the deadline its store set, so
//! the epoch must advance while any call runs. Advancing it every tick forever would wake the
//! gateway 2,000 times a second even when it serves nothing (an edge box idles most of the
//! day). So the ticker parks after a whole idle period — no call began and no running call
//! checked its deadline — and the next call to begin wakes it. A call that runs cannot let it
//! park: it reaches a deadline check every half deadline, which counts as activity, and the
//! idle period is longer than any deadline a store sets. A call the OS preempted for longer
//! than the idle period finds the epoch already past its deadline when it resumes, so its next
//! check wakes the ticker before it can run on unchecked.
//!
//! The cost on the call path is one relaxed load of a flag that is already set, except for the
//! first call after each idle period's end, which sets it (and wakes the ticker if parked).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::Engine;

/// What the ticker thread and the stores share.
#[derive(Debug, Default)]
pub struct TickerState {
    /// A call began or checked its deadline since the ticker last looked.
    active: AtomicBool,
    /// The ticker is asleep until a call wakes it.
    parked: AtomicBool,
    /// The runtime is gone: the thread ends.
    stop: AtomicBool,
    /// Epoch advances so far.
    ticks: AtomicU64,
    /// Times the ticker parked.
    parks: AtomicU64,
    /// Held while the parked thread checks and waits, so a wake cannot slip between the two.
    lock: Mutex<()>,
    wake: Condvar,
}

impl TickerState {
    /// Records that a policy call is running (it begins, or it checks its deadline), and
    /// wakes the ticker if it sleeps.
    #[inline]
    pub fn mark_active(&self) {
        if self.active.load(Ordering::Relaxed) {
            return;
        }
        // Sequentially consistent with the ticker's `parked` store and `active` load: either
        // this load sees the ticker parked (and wakes it), or the ticker sees this call.
        self.active.store(true, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            self.unpark();
        }
    }

    fn unpark(&self) {
        if self.parked.swap(false, Ordering::SeqCst) {
            // Taken after `parked` changed: the ticker is either before its check (and sees
            // it) or waiting (and gets the notification).
            let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.wake.notify_one();
        }
    }

    /// Epoch advances so far.
    pub fn ticks(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }

    /// Whether the ticker is asleep now.
    pub fn is_parked(&self) -> bool {
        self.parked.load(Ordering::SeqCst)
    }

    /// Times the ticker has parked.
    pub fn parks(&self) -> u64 {
        self.parks.load(Ordering::Relaxed)
    }
}

/// The running ticker; dropping it ends the thread.
#[derive(Debug)]
pub struct EpochTicker {
    state: Arc<TickerState>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    /// Starts a thread that advances `engine`'s epoch every `tick`, and parks once `idle_ticks`
    /// ticks in a row pass with no call active. `idle_ticks` must exceed every deadline (in
    /// ticks) a store sets, for the reason in the module docs.
    ///
    /// # Errors
    ///
    /// The thread could not be started.
    pub fn start(engine: Engine, tick: Duration, idle_ticks: u64) -> std::io::Result<EpochTicker> {
        let state = Arc::new(TickerState::default());
        let thread = {
            let state = state.clone();
            std::thread::Builder::new()
                .name("policy-epoch".into())
                .spawn(move || run(&engine, &state, tick, idle_ticks.max(1)))?
        };
        Ok(EpochTicker {
            state,
            thread: Some(thread),
        })
    }

    /// What stores mark their calls on.
    pub fn state(&self) -> &Arc<TickerState> {
        &self.state
    }
}

fn run(engine: &Engine, state: &TickerState, tick: Duration, idle_ticks: u64) {
    let mut since_look = 0u64;
    while !state.stop.load(Ordering::Relaxed) {
        std::thread::sleep(tick);
        engine.increment_epoch();
        state.ticks.fetch_add(1, Ordering::Relaxed);
        since_look += 1;
        if since_look < idle_ticks {
            continue;
        }
        since_look = 0;
        if state.active.swap(false, Ordering::SeqCst) {
            continue;
        }
        state.parked.store(true, Ordering::SeqCst);
        if state.active.load(Ordering::SeqCst) {
            // A call began between the two looks; it may not have seen `parked`.
            state.parked.store(false, Ordering::SeqCst);
            continue;
        }
        state.parks.fetch_add(1, Ordering::Relaxed);
        tracing::trace!("no policy call for {idle_ticks} epoch ticks: the ticker sleeps");
        let mut held = state.lock.lock().unwrap_or_else(PoisonError::into_inner);
        while state.parked.load(Ordering::SeqCst) && !state.stop.load(Ordering::Relaxed) {
            held = state.wake.wait(held).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        {
            let _held = self.state.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.state.wake.notify_one();
        }
        if let Some(thread) = self.thread.take() {
            // It wakes within a tick; a panic in it has nothing left to tell.
            let _ = thread.join();
        }
    }
}
