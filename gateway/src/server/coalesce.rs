//! Coalescing a hot stream's events into fewer writes to the client.
//!
//! Each SSE event relayed as it arrives costs a write (and, under TLS, a record) of its own:
//! on a busy gateway most of its CPU time is in those writes (BENCHMARKS.md, "Gateway
//! overhead"). A stream whose events come faster than `server.stream_coalesce_us` apart has the
//! ones that arrive within that window of its last write held back and written together when
//! the window ends — at most one write per window, each event late by at most the window. A
//! stream slower than that (a real engine's decode step is milliseconds) is written event by
//! event, with no timer, and the stream's first bytes always go at once, so time to
//! first token never waits.
//!
//! An event that opens a write takes along the rest of what upstream read with it: the relay
//! drives its upstream connection in its own task (`workers::upstream`), so one poll brings
//! every event a read holds, and what is held is written as soon as upstream has nothing more
//! ([`Coalescer::ready`]). The upstream is still read as events arrive, so what the gateway
//! measures of the worker's pace is unchanged.
//!
//! # Rejected designs
//!
//! Measured with `switchyard-bench overhead --nginx`, TLS gateway's CPU per streamed request;
//! the runs are in `benchmarks/history/overhead.md`.
//!
//! - A body adapter gathering the events an upstream connection had ready into one write, with
//!   one scheduler turn for more to come: every turn came back empty (each event arrived in a
//!   read of its own), so it saved no system call.
//! - An opening event held until the scheduler's round ends (tokio's deferred wake): 5.9
//!   `writev` a request at 512 streams instead of 7.6–8.8, but `epoll_wait` rose from 0.4 to 1.5
//!   a request and the CPU did not move beyond the noise (158 / 164 / 168 µs against
//!   183 / 125 / 135).
//! - An opening event held until two polls in a row bring nothing: at 512 streams 142 / 142 /
//!   125 µs with it, 119 / 121 / 122 without, once the relay drove its upstream connection.
//! - Events read in the same burst as a write joining its flush: 196 µs at 512 streams against
//!   nginx's 125 (1.57×), where the window alone made 1.44×.
//! - A 4 ms window: 147–172 µs at 512 streams, within the noise of 1 ms, for more delay between
//!   tokens.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::time::{Instant, Sleep};

/// Held bytes past which they are written at once, window or not: a burst this large is
/// worth a write of its own, and the hold should not grow with a runaway upstream.
const MAX_HELD_BYTES: usize = 32 << 10;

/// One stream's write pacing: when it last wrote, and what waits for the window to end.
#[derive(Debug)]
pub(crate) struct Coalescer {
    window: Duration,
    last_write: Option<Instant>,
    held: BytesMut,
    /// Armed while `held` waits for the window to end.
    timer: Option<Pin<Box<Sleep>>>,
    /// `held` opens a write: it goes as soon as upstream has nothing more, with no window.
    opening: bool,
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
            opening: false,
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
        if self.held.is_empty() {
            self.opening = !self.last_write.is_some_and(|last| now < last + self.window);
        }
        self.held.extend_from_slice(&data);
        if self.held.len() >= MAX_HELD_BYTES {
            return Offer::Write(self.take_at(now));
        }
        Offer::Held
    }

    /// Upstream has nothing more for now: what is held, at once if it opens a write, else once
    /// its window has ended. Pending while it has not, with `cx` woken when the window ends;
    /// `None` when nothing is held.
    pub(crate) fn ready(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if self.held.is_empty() {
            return Poll::Ready(None);
        }
        if self.opening {
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
        self.opening = false;
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
    async fn a_slow_streams_events_go_alone_as_soon_as_upstream_is_quiet() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        for n in 0..5 {
            tokio::time::advance(Duration::from_millis(3)).await;
            assert_eq!(coalescer.offer(event(n)), Offer::Held);
            assert_eq!(poll_ready(&mut coalescer), Poll::Ready(Some(event(n))));
            assert_eq!(poll_ready(&mut coalescer), Poll::Ready(None));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_opening_event_takes_the_rest_of_its_read_along() {
        let mut coalescer = Coalescer::new(Duration::from_millis(2));
        coalescer.wrote();
        tokio::time::advance(Duration::from_millis(3)).await;
        // One poll of upstream brings three events, then nothing.
        for n in 1..=3 {
            assert_eq!(coalescer.offer(event(n)), Offer::Held);
        }
        assert_eq!(
            poll_ready(&mut coalescer),
            Poll::Ready(Some(Bytes::from("data: 1\n\ndata: 2\n\ndata: 3\n\n")))
        );
        // That write opened a window, which the next event waits for.
        assert_eq!(coalescer.offer(event(4)), Offer::Held);
        assert!(poll_ready(&mut coalescer).is_pending());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(poll_ready(&mut coalescer).is_pending(), "the window is 2 ms");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(poll_ready(&mut coalescer), Poll::Ready(Some(event(4))));
        // Past the window an event opens a write again.
        tokio::time::advance(Duration::from_millis(5)).await;
        assert_eq!(coalescer.offer(event(5)), Offer::Held);
        assert_eq!(poll_ready(&mut coalescer), Poll::Ready(Some(event(5))));
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
