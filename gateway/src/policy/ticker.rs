//! The epoch ticker: the thread that advances the engine's epoch, which is how a policy call's
//! deadline is measured, only while policy calls run.
//!
//! Wasmtime interrupts a guest when the engine's epoch passes the deadline its store set, so
//! the epoch must advance while any call runs. Advancing it every tick forever costs a sleep
//! and a wake every 500 µs: 20–30 ms of CPU a second on the gateway's machine, a sixth of its
//! CPU per request at a few hundred requests a second (BENCHMARKS.md). Policy calls last
//! microseconds, so almost every tick falls between calls.
//!
//! On Linux the ticker waits on a timer (`timerfd`) that is armed while calls run: the first of
//! the calls running arms it ([`TickerState::begin`]), and one that runs on gets the epoch
//! advanced every tick from its start, as before. When calls come further apart than a tick,
//! the last one running disarms it as it ends ([`TickerState::end`]): such a call costs two
//! system calls and wakes no thread. When they come closer together, arming and disarming
//! around each would cost more than the ticks (each reprograms a hardware timer, ~5 µs on a
//! virtual machine), so the timer stays armed and the ticker disarms it after a tick in which
//! no call began. Every change happens under one lock with the count of running calls, so a
//! call that begins as the last one ends cannot run unarmed. A call whose end is never told
//! (a store dropped mid-call) is ended when its store goes ([`crate::policy::host`]): until
//! then the timer ticks, which costs CPU but never safety.
//!
//! Elsewhere (and if the timer cannot be made) the ticker ticks on a clock and parks after a
//! whole idle period — no call began and no running call checked its deadline — and the next
//! call to begin wakes it. A call that runs cannot let it park: it reaches a deadline check
//! every half deadline, which counts as activity, and the idle period is longer than any
//! deadline a store sets. A call the OS preempted for longer than the idle period finds the
//! epoch already past its deadline when it resumes, so its next check wakes the ticker before
//! it can run on unchecked.

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
            let mut calls = timer.calls.lock().unwrap_or_else(PoisonError::into_inner);
            let now = std::time::Instant::now();
            calls.dense = calls
                .last_begin
                .is_some_and(|last| now.duration_since(last) < timer.tick);
            calls.last_begin = Some(now);
            calls.began = true;
            calls.running += 1;
            if !calls.armed {
                timer.arm();
                calls.armed = true;
                self.parked.store(false, Ordering::SeqCst);
            }
        }
    }

    /// A call sequence begun with [`TickerState::begin`] ends: on the call timer, the last of
    /// the calls running disarms it, unless calls come closer together than a tick (then the
    /// ticker disarms it after a tick in which none began, and the calls between pay nothing).
    pub fn end(&self) {
        #[cfg(target_os = "linux")]
        if let Some(timer) = &self.timer {
            let mut calls = timer.calls.lock().unwrap_or_else(PoisonError::into_inner);
            calls.running = calls.running.saturating_sub(1);
            if calls.running == 0 && !calls.dense {
                self.disarm(timer, &mut calls);
            }
        }
    }

    /// Disarms the call timer; `calls` is its state, locked.
    #[cfg(target_os = "linux")]
    fn disarm(&self, timer: &CallTimer, calls: &mut Calls) {
        if calls.armed {
            timer.disarm();
            calls.armed = false;
            self.parked.store(true, Ordering::SeqCst);
            self.parks.fetch_add(1, Ordering::Relaxed);
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
            let mut calls = timer.calls.lock().unwrap_or_else(PoisonError::into_inner);
            if calls.running == 0 && !calls.began {
                // A whole tick with no call: dense calls have stopped.
                state.disarm(timer, &mut calls);
                continue;
            }
            calls.began = false;
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
    calls: Mutex<Calls>,
}

/// What decides whether the call timer is armed; changed only under its lock.
#[cfg(target_os = "linux")]
#[derive(Debug, Default)]
struct Calls {
    /// Calls running: begun and not ended. The timer is armed while any does.
    running: u32,
    armed: bool,
    /// A call began since the timer last expired.
    began: bool,
    last_begin: Option<std::time::Instant>,
    /// The last call began within a tick of the one before: arming and disarming around each
    /// call would cost more than the ticks (two system calls a call, each reprogramming a
    /// hardware timer: ~5 µs on a virtual machine).
    dense: bool,
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
            calls: Mutex::new(Calls::default()),
        })
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
