//! Coalescing a hot stream's events into fewer writes to the client.
//!
//! Each SSE event relayed as it arrives costs a write (and, under TLS, a record) of its own:
//! on a busy gateway most of its CPU time is in those writes (BENCHMARKS.md, "Gateway against
//! nginx"). A stream whose events come faster than `server.stream_coalesce_us` apart has the
//! ones that arrive within that window of its last write held back and written together when
//! the window ends — at most one write per window, each event late by at most the window. A
//! stream slower than that (a real engine's decode step is milliseconds) is written event by
//! event as before, with no timer, and the stream's first bytes always go at once, so time to
//! first token never waits.
//!
//! An event that opens a write first waits for the rest of what upstream read with it. The
//! upstream connection's task hands its events over one at a time, each one a scheduler turn
//! after the last (hyper's body channel holds one), so a busy worker's burst of events, read in
//! one piece, would otherwise leave in two writes: the first event alone, the rest when the
//! window ends. The opening event is held while polls keep bringing more, and written after
//! [`QUIET_POLLS`] polls in a row that bring nothing (at most [`MAX_GATHER_POLLS`] polls and the
//! window): a few microseconds for a lone event. The upstream is still read as events arrive,
//! so what the gateway measures of the worker's pace is unchanged.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::time::{Instant, Sleep};

/// Held bytes past which they are written at once, window or not: a burst this large is
/// worth a write of its own, and the hold should not grow with a runaway upstream.
const MAX_HELD_BYTES: usize = 32 << 10;

/// Polls in a row that bring nothing before an opening event is written. One is not enough:
/// hyper polls a response body a second time within the same connection poll when the first
/// came back pending, before any other task (the upstream connection's among them) has run.
const QUIET_POLLS: u8 = 2;

/// Polls an opening event waits at most: enough for the few events a busy worker's read holds,
/// few enough that back-to-back events cannot hold the first one for long.
const MAX_GATHER_POLLS: u8 = 16;

/// One stream's write pacing: when it last wrote, and what waits for the window to end.
#[derive(Debug)]
pub(crate) struct Coalescer {
    window: Duration,
    last_write: Option<Instant>,
    held: BytesMut,
    /// Armed while `held` waits for the window to end.
    timer: Option<Pin<Box<Sleep>>>,
    /// Set while `held` opens a write and waits for the rest of its upstream read.
    gathering: Option<Gathering>,
}

/// An opening write's wait for the rest of its upstream read.
#[derive(Debug)]
struct Gathering {
    /// When the opening event came: it waits no longer than the window.
    since: Instant,
    /// Polls waited so far.
    polls: u8,
    /// Polls in a row that brought nothing.
    quiet: u8,
}

/// What to do with an event just read from upstream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Offer {
    /// Write this now (the event alone, or everything held with it).
    Write(Bytes),
    /// It is held; read on, then ask [`Coalescer::ready`].
    Held,
}

impl Coalescer {
    /// Pacing for a stream; a zero `window` writes every event as it comes.
    pub(crate) fn new(window: Duration) -> Coalescer {
        Coalescer {
            window,
            last_write: None,
            held: BytesMut::new(),
            timer: None,
            gathering: None,
        }
    }

    /// Notes a write made without the coalescer (the stream's first bytes).
    pub(crate) fn wrote(&mut self) {
        self.last_write = Some(Instant::now());
    }

    /// Takes an event read from upstream.
    pub(crate) fn offer(&mut self, data: Bytes) -> Offer {
        let now = Instant::now();
        if self.window.is_zero() {
            self.last_write = Some(now);
            return Offer::Write(data);
        }
        let in_window = self.last_write.is_some_and(|last| now < last + self.window);
        match &mut self.gathering {
            Some(gathering) => gathering.quiet = 0,
            None if self.held.is_empty() && !in_window => {
                self.gathering = Some(Gathering {
                    since: now,
                    polls: 0,
                    quiet: 0,
                });
            }
            None => {}
        }
        self.held.extend_from_slice(&data);
        if self.held.len() >= MAX_HELD_BYTES {
            return Offer::Write(self.take_at(now));
        }
        Offer::Held
    }

    /// Upstream has nothing more for now: what is held, once its window has ended (an opening
    /// event: once polls stop bringing more). Pending while it has not, with `cx` woken when
    /// the window ends (an opening event: at once, for another poll); `None` when nothing is
    /// held.
    pub(crate) fn ready(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if self.held.is_empty() {
            return Poll::Ready(None);
        }
        if let Some(gathering) = &mut self.gathering {
            if gathering.quiet < QUIET_POLLS
                && gathering.polls < MAX_GATHER_POLLS
                && gathering.since.elapsed() < self.window
            {
                gathering.quiet += 1;
                gathering.polls += 1;
                // To the back of the run queue: the upstream connection's task, woken when
                // its last event was taken, runs first and hands over the next if it has one.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            return Poll::Ready(Some(self.take_at(Instant::now())));
        }
        let deadline = self.last_write.map_or_else(Instant::now, |last| last + self.window);
        let timer = match &mut self.timer {
            Some(timer) => {
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                timer
            }
            None => self.timer.insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        Poll::Ready(Some(self.take_at(Instant::now())))
    }

    /// Everything held, with `last` after it: for the end of the stream, which waits for no
    /// window.
    pub(crate) fn finish(&mut self, last: Bytes) -> Bytes {
        if self.held.is_empty() {
            return last;
        }
        self.held.extend_from_slice(&last);
        self.take_at(Instant::now())
    }

    fn take_at(&mut self, now: Instant) -> Bytes {
        self.last_write = Some(now);
        self.gathering = None;
        self.held.split().freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u32) -> Bytes {
        Bytes::from(format!("data: {n}\n\n"))
    }

    fn poll_ready(coalescer: &mut Coalescer) -> Poll<Option<Bytes>> {
        let waker = std::task::Waker::noop();
        coalescer.ready(&mut Context::from_waker(waker))
    }

    /// Polls until the coalescer writes, as the relay does while upstream has nothing: the
    /// polls it waited, and what it wrote.
    fn poll_until_written(coalescer: &mut Coalescer) -> (u8, Bytes) {
        let mut pending = 0;
        loop {
            match poll_ready(coalescer) {
                Poll::Pending => pending += 1,
                Poll::Ready(Some(written)) => return (pending, written),
                Poll::Ready(None) => panic!("nothing was held"),
            }
            assert!(pending <= MAX_GATHER_POLLS, "waited past its bound");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn events_within_the_window_wait_for_its_end_and_leave_together() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        assert_eq!(coalescer.offer(event(2)), Offer::Held);
        tokio::time::advance(Duration::from_micros(500)).await;
        assert_eq!(coalescer.offer(event(3)), Offer::Held);
        assert!(
            poll_ready(&mut coalescer).is_pending(),
            "held until 2 ms after the last write"
        );
        tokio::time::advance(Duration::from_micros(1500)).await;
        assert_eq!(
            poll_ready(&mut coalescer),
            Poll::Ready(Some(Bytes::from("data: 2\n\ndata: 3\n\n")))
        );
        assert_eq!(poll_ready(&mut coalescer), Poll::Ready(None), "nothing left");
        // The held write opened a new window.
        assert_eq!(coalescer.offer(event(4)), Offer::Held);
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(poll_ready(&mut coalescer), Poll::Ready(Some(event(4))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_streams_events_go_alone_after_two_quiet_polls() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        for n in 0..5 {
            tokio::time::advance(Duration::from_millis(3)).await;
            assert_eq!(coalescer.offer(event(n)), Offer::Held);
            assert_eq!(poll_until_written(&mut coalescer), (QUIET_POLLS, event(n)));
            assert_eq!(poll_ready(&mut coalescer), Poll::Ready(None));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_opening_event_takes_what_each_poll_brings_along() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        tokio::time::advance(Duration::from_millis(3)).await;
        assert_eq!(coalescer.offer(event(1)), Offer::Held);
        // The connection's second poll comes before upstream's task has run...
        assert!(poll_ready(&mut coalescer).is_pending());
        assert!(poll_ready(&mut coalescer).is_pending());
        // ... and the next, after it has, brings another event, which restarts the count.
        assert_eq!(coalescer.offer(event(2)), Offer::Held);
        assert!(poll_ready(&mut coalescer).is_pending());
        assert_eq!(coalescer.offer(event(3)), Offer::Held);
        assert_eq!(
            poll_until_written(&mut coalescer),
            (QUIET_POLLS, Bytes::from("data: 1\n\ndata: 2\n\ndata: 3\n\n"))
        );
        // That write opened a window, which the next event waits for.
        assert_eq!(coalescer.offer(event(4)), Offer::Held);
        assert!(poll_ready(&mut coalescer).is_pending());
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(poll_ready(&mut coalescer), Poll::Ready(Some(event(4))));
    }

    #[tokio::test(start_paused = true)]
    async fn an_opening_event_waits_at_most_its_polls_and_the_window() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        tokio::time::advance(Duration::from_millis(3)).await;
        assert_eq!(coalescer.offer(event(0)), Offer::Held);
        for n in 1..=u32::from(MAX_GATHER_POLLS) {
            assert!(poll_ready(&mut coalescer).is_pending(), "poll {n}");
            assert_eq!(coalescer.offer(event(n)), Offer::Held);
        }
        match poll_ready(&mut coalescer) {
            Poll::Ready(Some(all)) => assert_eq!(
                memchr::memmem::find_iter(&all, b"data:").count(),
                usize::from(MAX_GATHER_POLLS) + 1,
                "every poll's event, and no more polls"
            ),
            other => panic!("the polls are spent, yet {other:?}"),
        }

        tokio::time::advance(Duration::from_millis(3)).await;
        assert_eq!(coalescer.offer(event(0)), Offer::Held);
        assert!(poll_ready(&mut coalescer).is_pending());
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(coalescer.offer(event(1)), Offer::Held);
        assert_eq!(
            poll_ready(&mut coalescer),
            Poll::Ready(Some(Bytes::from("data: 0\n\ndata: 1\n\n"))),
            "the window has passed since the opening event"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_window_never_holds() {
        let mut coalescer = Coalescer::new(Duration::ZERO);
        for n in 0..5 {
            assert_eq!(coalescer.offer(event(n)), Offer::Write(event(n)));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_and_a_large_burst_wait_for_no_window() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        assert_eq!(coalescer.offer(event(1)), Offer::Held);
        assert_eq!(coalescer.finish(event(2)), Bytes::from("data: 1\n\ndata: 2\n\n"));
        assert_eq!(poll_ready(&mut coalescer), Poll::Ready(None), "nothing left");

        let big = Bytes::from(vec![b'x'; MAX_HELD_BYTES / 2]);
        assert_eq!(coalescer.offer(big.clone()), Offer::Held);
        match coalescer.offer(big) {
            Offer::Write(all) => assert_eq!(all.len(), MAX_HELD_BYTES),
            Offer::Held => panic!("{MAX_HELD_BYTES} bytes held are written at once"),
        }
    }
}
