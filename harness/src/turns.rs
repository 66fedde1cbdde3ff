//! Whose turn it is: the tests of one file run together, and no other file's tests beside them.
//!
//! A package's integration tests are one test binary with a module per file, and libtest runs
//! its tests on parallel threads in name order. Many of them load both cores of a small machine
//! (real processes, traffic, forward passes) and judge timing, memory or what a cache kept, so
//! a test running beside another file's test can miss its marks. A test takes its file's
//! [`turn`] and holds it while it runs: tests of the same file share the turn and run side by
//! side, as they did in their own test binary; a test of another file waits until the turn is
//! free. [`Gateway::start`](crate::Gateway::start) takes the turn itself, so an end-to-end test
//! need not; an in-process test calls [`turn`] first. A program that is not a test (the bench
//! tool) never waits: all its gateways share one turn.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// The file whose tests hold the turn, and how many gateways they hold it with.
#[derive(Debug, Default)]
struct Holder {
    file: Option<&'static str>,
    gateways: usize,
}

static HOLDER: Mutex<Holder> = Mutex::new(Holder {
    file: None,
    gateways: 0,
});
static FREED: Condvar = Condvar::new();

fn holder() -> MutexGuard<'static, Holder> {
    // A test that panicked while holding the lock left the counts consistent (they change
    // only after the wait), so the poison is ignored.
    HOLDER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A share of the turn of one file's tests, given back when dropped.
#[derive(Debug)]
#[must_use = "the turn is given back when this is dropped"]
pub struct Turn(());

/// Waits until no other file's tests hold the turn, then shares it with the other tests of the
/// file this is called from; hold it for the whole test: `let _turn = turn();`.
#[track_caller]
pub fn turn() -> Turn {
    take(std::panic::Location::caller().file())
}

/// Waits until no other file's tests hold the turn, then shares it with the tests of `file`.
pub(crate) fn take(file: &'static str) -> Turn {
    let mut holder = FREED
        .wait_while(holder(), |holder| holder.file.is_some_and(|current| current != file))
        .unwrap_or_else(PoisonError::into_inner);
    holder.file = Some(file);
    holder.gateways += 1;
    Turn(())
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut holder = holder();
        holder.gateways -= 1;
        if holder.gateways == 0 {
            holder.file = None;
            FREED.notify_all();
        }
    }
}
