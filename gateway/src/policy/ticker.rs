//! The epoch ticker: the thread that advances the engine's epoch, which is how a policy call's
//! deadline is measured, only while policy calls run.
//!
//! Wasmtime interrupts a guest when the engine's epoch passes the deadline its store set, so
//! the epoch must advance while any call runs. Advancing it every tick forever costs a sleep
//! and a wake every 500 µs: 20–30 ms of CPU a second on the gateway's machine, a sixth of its
//! CPU per request at a few hundred requests a second (`benchmarks/history/overhead.md`).
//! Policy calls last microseconds, so almost every tick falls between calls.
//!
//! On Linux the ticker waits on a timer (`timerfd`) that is armed while calls run: the first of
//! the calls running arms it ([`TickerState::begin`]), and one that runs on gets the epoch
//! advanced every tick from its start. When calls come further apart than a tick,
//! the last one running disarms it as it ends ([`TickerState::end`]): such a call costs two
//! system calls and wakes no thread. When they come closer together, arming and disarming
//! around each would cost more than the ticks (each reprograms a hardware timer, ~5 µs on a
//! virtual machine), so the timer stays armed and the ticker disarms it after a tick in which
//! no call began. The count of running calls and whether the timer is armed share one atomic
//! word: while it is armed a call begins and ends with one atomic update and no lock (a lock
//! and a clock read per call cost ~60 ns, a fifth of the cheapest call); arming and disarming
//! take a lock, and the word says "armed" only once the timer is and stops saying so before it
//! is disarmed, so a call that begins as the last one ends cannot run unarmed. A call whose
//! end is never told (a store dropped mid-call) is ended when its store goes
//! ([`crate::policy::host`]): until then the timer ticks, which costs CPU but never safety.
//!
//! Elsewhere (and if the timer cannot be made) the ticker ticks on a clock and parks after a
//! whole idle period — no call began and no running call checked its deadline — and the next
//! call to begin wakes it. A call that runs cannot let it park: it reaches a deadline check
//! every half deadline, which counts as activity, and the idle period is longer than any
//! deadline a store sets. A call the OS preempted for longer than the idle period finds the
//! epoch already past its deadline when it resumes, so its next check wakes the ticker before
//! it can run on unchecked.
//!
//! # Rejected designs
//!
//! Measured with `switchyard-bench overhead --nginx` and the `policy_call` bench; the runs are in
//! `benchmarks/history/overhead.md`.
//!
//! - Arming and disarming around every entry into the guest, found through Wasmtime's call hook
//!   (`Store::call_hook`): two system calls an entry (a pair costs 3.7 µs in a tight loop), and a
//!   `route` call enters the guest several times, its allocator included.
//! - A lock and a clock read at the start and end of every call while the timer is armed: 58 ns
//!   a call (`route/least-load/8` 260 → 318 ns); the atomic word took back ~25 ns of it.
//! - A 5 ms tick instead of 500 µs: one stream at a time, 204 / 210 / 233 µs of CPU a streamed
//!   request against 239 / 240 / 240, but every deadline ten times coarser.

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
    /// The timer armed while calls run, where there is one (see the module docs).
    #[cfg(target_os = "linux")]
    timer: Option<CallTimer>,
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

    /// A call sequence into a guest begins: on the call timer, the first of the calls running
    /// arms it if it is not armed. (The clock ticker learns of calls from
    /// [`TickerState::mark_active`].)
    pub fn begin(&self) {
        #[cfg(target_os = "linux")]
        if let Some(timer) = &self.timer {
            // While the timer is armed, one atomic update counts the call in.
            if timer.count_in_if_armed() {
                return;
            }
            let calls = timer.calls.lock().unwrap_or_else(PoisonError::into_inner);
            // Armed by another call meanwhile? (It cannot be disarmed while the lock is held.)
            if timer.count_in_if_armed() {
                return;
            }
            // Unarmed, and only the lock's holder changes the word now: every call running was
            // counted in while it was armed, and it is disarmed only with none running.
            let word = timer.word.load(Ordering::Acquire);
            let dense = calls.last_end.is_some_and(|last| last.elapsed() < timer.tick);
            // Armed before the word says so: a call counted in on the fast path never runs
            // unarmed.
            timer.arm();
            self.parked.store(false, Ordering::SeqCst);
            let dense = if dense { DENSE } else { 0 };
            timer
                .word
                .store(((word & RUNNING) + 1) | ARMED | BEGAN | dense, Ordering::Release);
        }
    }

    /// A call sequence begun with [`TickerState::begin`] ends: on the call timer, the last of
    /// the calls running disarms it, unless calls come closer together than a tick (then the
    /// ticker disarms it after a tick in which none began, and the calls between pay nothing).
    pub fn end(&self) {
        #[cfg(target_os = "linux")]
        if let Some(timer) = &self.timer {
            let mut word = timer.word.load(Ordering::Acquire);
            loop {
                if word & RUNNING == 0 {
                    // Never begun: nothing to count out.
                    return;
                }
                match timer
                    .word
                    .compare_exchange_weak(word, word - 1, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => break,
                    Err(now) => word = now,
                }
            }
            if word & RUNNING == 1 && word & ARMED != 0 && word & DENSE == 0 {
                let mut calls = timer.calls.lock().unwrap_or_else(PoisonError::into_inner);
                // Unless a call began meanwhile (then the last of those ends it).
                if self.disarm_if_idle(timer, &calls, DENSE) {
                    calls.last_end = Some(std::time::Instant::now());
                }
            }
        }
    }

    /// Disarms the call timer if no call runs and none of the word's `busy` bits is set;
    /// answers whether it did. Only under the timer's lock (`_locked`), which every change of
    /// whether it is armed takes.
    #[cfg(target_os = "linux")]
    fn disarm_if_idle(&self, timer: &CallTimer, _locked: &std::sync::MutexGuard<'_, Calls>, busy: u64) -> bool {
        let word = timer.word.load(Ordering::Acquire);
        if word & ARMED == 0 || word & (RUNNING | busy) != 0 {
            return false;
        }
        // Cleared before the timer is disarmed: a call that begins from here on takes the lock
        // (held) and arms the timer again after this.
        if timer
            .word
            .compare_exchange(word, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        timer.disarm();
        self.parked.store(true, Ordering::SeqCst);
        self.parks.fetch_add(1, Ordering::Relaxed);
        true
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

    /// Whether the ticker runs on the call timer (else on a clock).
    pub fn on_call_timer(&self) -> bool {
        #[cfg(target_os = "linux")]
        return self.timer.is_some();
        #[cfg(not(target_os = "linux"))]
        false
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
        #[cfg(target_os = "linux")]
        let state = match CallTimer::new(tick) {
            Ok(timer) => TickerState {
                parked: AtomicBool::new(true),
                timer: Some(timer),
                ..TickerState::default()
            },
            Err(err) => {
                tracing::warn!(error = %err, "no call timer: the epoch ticker ticks on a clock");
                TickerState::default()
            }
        };
        #[cfg(not(target_os = "linux"))]
        let state = TickerState::default();
        let state = Arc::new(state);
        let thread = {
            let state = state.clone();
            std::thread::Builder::new().name("policy-epoch".into()).spawn(move || {
                #[cfg(target_os = "linux")]
                if let Some(timer) = &state.timer {
                    return run_on_timer(&engine, &state, timer, tick);
                }
                run(&engine, &state, tick, idle_ticks.max(1))
            })?
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

/// Advances the epoch at each expiry of the call timer, which ticks only while calls run.
#[cfg(target_os = "linux")]
fn run_on_timer(engine: &Engine, state: &TickerState, timer: &CallTimer, tick: Duration) {
    while !state.stop.load(Ordering::Relaxed) {
        if let Err(err) = timer.wait() {
            // Never expected (the descriptor is ours and valid); ticking on a clock from here
            // on keeps every deadline.
            tracing::error!(error = %err, "the call timer failed: the epoch ticks on a clock");
            std::thread::sleep(tick);
        }
        if state.stop.load(Ordering::Relaxed) {
            break;
        }
        {
            let calls = timer.calls.lock().unwrap_or_else(PoisonError::into_inner);
            // A whole tick with no call: dense calls have stopped.
            if state.disarm_if_idle(timer, &calls, BEGAN) {
                continue;
            }
            timer.word.fetch_and(!BEGAN, Ordering::AcqRel);
        }
        engine.increment_epoch();
        state.ticks.fetch_add(1, Ordering::Relaxed);
    }
}

/// A `timerfd` on the monotonic clock, armed to expire every tick while calls run.
#[cfg(target_os = "linux")]
#[derive(Debug)]
struct CallTimer {
    fd: std::os::fd::OwnedFd,
    tick: Duration,
    /// The calls running (the low 32 bits) and the [`ARMED`], [`BEGAN`] and [`DENSE`] bits:
    /// while the timer is armed a call begins and ends with one atomic update of this word, and
    /// every change of whether it is armed happens under `calls`' lock.
    word: AtomicU64,
    calls: Mutex<Calls>,
}

/// Bits of [`CallTimer::word`]: the count of calls running (begun and not ended).
#[cfg(target_os = "linux")]
const RUNNING: u64 = u32::MAX as u64;
/// The timer is armed; set only after it is, cleared before it is disarmed.
#[cfg(target_os = "linux")]
const ARMED: u64 = 1 << 32;
/// A call began since the timer last expired.
#[cfg(target_os = "linux")]
const BEGAN: u64 = 1 << 33;
/// When the timer was armed, the last call had ended less than a tick before: arming and
/// disarming around each call would cost more than the ticks (two system calls a call, each
/// reprogramming a hardware timer: ~5 µs on a virtual machine), so the last call to end leaves
/// it armed and the ticker disarms it after a tick in which no call began.
#[cfg(target_os = "linux")]
const DENSE: u64 = 1 << 34;

/// What the arming decisions remember; behind the lock that serializes them.
#[cfg(target_os = "linux")]
#[derive(Debug, Default)]
struct Calls {
    /// When the last call that disarmed the timer ended.
    last_end: Option<std::time::Instant>,
}

#[cfg(target_os = "linux")]
impl CallTimer {
    fn new(tick: Duration) -> std::io::Result<CallTimer> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain system call; the descriptor it answers is owned from here on.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(CallTimer {
            // SAFETY: `fd` is a new descriptor no one else owns.
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
            tick,
            word: AtomicU64::new(0),
            calls: Mutex::new(Calls::default()),
        })
    }

    /// Counts a call in if the timer is armed; answers whether it was.
    #[inline]
    fn count_in_if_armed(&self) -> bool {
        let mut word = self.word.load(Ordering::Acquire);
        while word & ARMED != 0 {
            match self
                .word
                .compare_exchange_weak(word, (word + 1) | BEGAN, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => word = now,
            }
        }
        false
    }

    /// Expires after `first`, then every `every` (zero: once); a zero `first` disarms.
    fn set(&self, first: Duration, every: Duration) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let timespec = |duration: Duration| libc::timespec {
            tv_sec: duration.as_secs() as libc::time_t,
            tv_nsec: duration.subsec_nanos() as libc::c_long,
        };
        let value = libc::itimerspec {
            it_interval: timespec(every),
            it_value: timespec(first),
        };
        // SAFETY: `value` lives across the call; the old value is not asked for.
        let result = unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &value, std::ptr::null_mut()) };
        if result < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn arm(&self) {
        if let Err(err) = self.set(self.tick, self.tick) {
            // Only a bad descriptor or value fails, neither of which this code makes.
            tracing::error!(error = %err, "cannot arm the call timer");
        }
    }

    fn disarm(&self) {
        if let Err(err) = self.set(Duration::ZERO, Duration::ZERO) {
            tracing::error!(error = %err, "cannot disarm the call timer");
        }
    }

    /// Waits for the next expiry.
    fn wait(&self) -> std::io::Result<u64> {
        use std::os::fd::AsRawFd;
        let mut expirations = 0u64;
        loop {
            // SAFETY: reads 8 bytes into a u64 that lives across the call.
            let read = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    (&raw mut expirations).cast::<libc::c_void>(),
                    std::mem::size_of::<u64>(),
                )
            };
            if read == std::mem::size_of::<u64>() as isize {
                return Ok(expirations);
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        #[cfg(target_os = "linux")]
        if let Some(timer) = &self.state.timer {
            // Wakes the thread at once to see `stop`.
            let _ = timer.set(Duration::from_nanos(1), Duration::ZERO);
        }
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
