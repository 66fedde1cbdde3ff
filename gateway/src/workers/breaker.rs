//! A worker's circuit breaker and its busy backoff: what its answers say about sending it more.
//!
//! Failed answers (a 5xx other than 503, a timeout, a stream broken before its first byte)
//! count toward the breaker: after `errors_to_eject` in a row it opens, and the worker takes
//! no requests for a backoff that doubles with each opening in a row (from `breaker_open_ms`
//! up to `breaker_open_max_ms`, ±20 % jitter so that a fleet's breakers do not close in step).
//! When the backoff ends the breaker is half open: one request goes through as a probe; its
//! answer closes the breaker, its failure opens it again for longer.
//!
//! An engine that answers 429 or 503 is full, not broken: it is busy for a backoff of its own
//! (its `Retry-After` if it sent one, else from `busy_backoff_ms` doubling up to
//! `busy_backoff_max_ms` while it stays full), the request goes to another worker, and nothing
//! counts toward the breaker or toward ejection.

use std::time::{Duration, Instant};

/// Where a breaker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Requests flow.
    Closed,
    /// No requests until the backoff ends.
    Open,
    /// One probe request is let through.
    HalfOpen,
}

impl BreakerState {
    /// The state's name, as the metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// The state as a gauge value: 0 closed, 1 open, 2 half open.
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
}

/// How long the breaker stays open and a busy engine is left alone.
#[derive(Debug, Clone, Copy)]
pub struct Backoffs {
    /// Failed answers in a row that open the breaker.
    pub errors_to_open: u32,
    /// The first opening's backoff.
    pub open: Duration,
    /// The longest an opening lasts.
    pub open_max: Duration,
    /// The first busy answer's backoff.
    pub busy: Duration,
    /// The longest a busy backoff lasts.
    pub busy_max: Duration,
}

/// One worker's breaker and busy backoff.
#[derive(Debug)]
pub struct Breaker {
    state: BreakerState,
    /// Failed answers in a row while closed.
    failures: u32,
    /// Openings in a row (reset when a probe succeeds).
    openings: u32,
    /// Open: when the backoff ends. Half open: when the probe was let through.
    since: Instant,
    /// Busy answers in a row.
    busy_streak: u32,
    busy_until: Option<Instant>,
    /// Mixed into the jitter so that workers opened at the same moment differ.
    seed: u64,
}

/// A probe that has not answered within this long (its client left, say) lets another through.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

impl Breaker {
    /// A closed breaker; `seed` varies its jitter from other workers'.
    pub fn new(seed: u64) -> Breaker {
        Breaker {
            state: BreakerState::Closed,
            failures: 0,
            openings: 0,
            since: Instant::now(),
            busy_streak: 0,
            busy_until: None,
            seed,
        }
    }

    /// Where the breaker is.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether a request may be sent now: closed and not busy, or the half-open probe (the
    /// caller that gets `true` from an open breaker whose backoff has ended is the probe; the
    /// state change is returned so that it can be counted).
    pub fn admits(&mut self, now: Instant) -> (bool, Option<BreakerState>) {
        if self.busy_until.is_some_and(|until| now < until) {
            return (false, None);
        }
        match self.state {
            BreakerState::Closed => (true, None),
            BreakerState::Open if now >= self.since => {
                self.state = BreakerState::HalfOpen;
                self.since = now;
                (true, Some(BreakerState::HalfOpen))
            }
            BreakerState::Open => (false, None),
            BreakerState::HalfOpen if now.duration_since(self.since) >= PROBE_TIMEOUT => {
                self.since = now;
                (true, None)
            }
            BreakerState::HalfOpen => (false, None),
        }
    }

    /// Whether a request could be sent now, without taking the probe.
    pub fn would_admit(&self, now: Instant) -> bool {
        if self.busy_until.is_some_and(|until| now < until) {
            return false;
        }
        match self.state {
            BreakerState::Closed => true,
            BreakerState::Open => now >= self.since,
            BreakerState::HalfOpen => now.duration_since(self.since) >= PROBE_TIMEOUT,
        }
    }

    /// An answer came: the breaker closes and the busy streak ends. Returns the state change.
    pub fn succeeded(&mut self) -> Option<BreakerState> {
        self.failures = 0;
        self.busy_streak = 0;
        self.busy_until = None;
        if self.state == BreakerState::Closed {
            return None;
        }
        self.state = BreakerState::Closed;
        self.openings = 0;
        Some(BreakerState::Closed)
    }

    /// A failed answer: counts toward opening, or reopens a half-open breaker. Returns the state
    /// change and, when it opened, for how long.
    pub fn failed(&mut self, now: Instant, backoffs: &Backoffs) -> Option<(BreakerState, Duration)> {
        match self.state {
            BreakerState::Open => None,
            BreakerState::Closed => {
                self.failures += 1;
                (self.failures >= backoffs.errors_to_open.max(1)).then(|| self.open(now, backoffs))
            }
            BreakerState::HalfOpen => Some(self.open(now, backoffs)),
        }
    }

    fn open(&mut self, now: Instant, backoffs: &Backoffs) -> (BreakerState, Duration) {
        self.failures = 0;
        self.openings = self.openings.saturating_add(1);
        let backoff = self.jittered(doubled(backoffs.open, self.openings, backoffs.open_max));
        self.state = BreakerState::Open;
        self.since = now + backoff;
        (BreakerState::Open, backoff)
    }

    /// The engine answered that it is full: busy for `retry_after` (capped at the longest
    /// busy backoff) or the next doubling of the busy backoff. Returns how long.
    pub fn busy(&mut self, now: Instant, retry_after: Option<Duration>, backoffs: &Backoffs) -> Duration {
        self.busy_streak = self.busy_streak.saturating_add(1);
        let backoff = match retry_after {
            Some(asked) => asked.min(backoffs.busy_max),
            None => self.jittered(doubled(backoffs.busy, self.busy_streak, backoffs.busy_max)),
        };
        self.busy_until = Some(now + backoff);
        backoff
    }

    /// Whether the engine is in a busy backoff now.
    pub fn is_busy(&self, now: Instant) -> bool {
        self.busy_until.is_some_and(|until| now < until)
    }

    /// `backoff` within ±20 %, by a hash of the worker and its openings (deterministic per
    /// worker and streak, different across workers).
    fn jittered(&self, backoff: Duration) -> Duration {
        let mix = xxhash_rust::xxh3::xxh3_64(
            &[
                self.seed.to_le_bytes(),
                u64::from(self.openings).to_le_bytes(),
                u64::from(self.busy_streak).to_le_bytes(),
            ]
            .concat(),
        );
        // A factor in [0.8, 1.2).
        let factor = 0.8 + 0.4 * ((mix >> 11) as f64 / (1u64 << 53) as f64);
        backoff.mul_f64(factor)
    }
}

/// `base` doubled for each repetition after the first, at most `max`.
fn doubled(base: Duration, repetition: u32, max: Duration) -> Duration {
    let shift = repetition.saturating_sub(1).min(20);
    base.saturating_mul(1 << shift).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoffs() -> Backoffs {
        Backoffs {
            errors_to_open: 3,
            open: Duration::from_secs(1),
            open_max: Duration::from_secs(8),
            busy: Duration::from_millis(100),
            busy_max: Duration::from_secs(1),
        }
    }

    #[test]
    fn failures_in_a_row_open_it_and_a_probe_closes_it() {
        let b = backoffs();
        let mut breaker = Breaker::new(7);
        let now = Instant::now();
        assert_eq!(breaker.failed(now, &b), None);
        breaker.succeeded();
        assert_eq!(breaker.failed(now, &b), None);
        assert_eq!(breaker.failed(now, &b), None, "the run restarted after the answer");
        let (state, backoff) = breaker.failed(now, &b).expect("third in a row opens");
        assert_eq!(state, BreakerState::Open);
        assert!(backoff >= Duration::from_millis(800) && backoff < Duration::from_millis(1200));
        assert_eq!(breaker.admits(now), (false, None));
        let later = now + backoff;
        assert_eq!(breaker.admits(later), (true, Some(BreakerState::HalfOpen)), "the probe");
        assert_eq!(breaker.admits(later), (false, None), "one probe at a time");
        assert_eq!(breaker.succeeded(), Some(BreakerState::Closed));
        assert_eq!(breaker.admits(later), (true, None));
    }

    #[test]
    fn a_failed_probe_reopens_for_twice_as_long_up_to_the_cap() {
        let b = backoffs();
        let mut breaker = Breaker::new(1);
        let mut now = Instant::now();
        for _ in 0..3 {
            breaker.failed(now, &b);
        }
        let mut last = Duration::ZERO;
        for opening in 2..=6 {
            now += Duration::from_secs(10);
            assert!(breaker.admits(now).0, "half open after the backoff");
            let (state, backoff) = breaker.failed(now, &b).expect("the probe failed");
            assert_eq!(state, BreakerState::Open);
            let expected = Duration::from_secs(1 << (opening - 1)).min(Duration::from_secs(8));
            assert!(
                backoff >= expected.mul_f64(0.8) && backoff < expected.mul_f64(1.2),
                "opening {opening}: {backoff:?} vs {expected:?}"
            );
            assert!(backoff <= Duration::from_secs(8).mul_f64(1.2));
            last = backoff;
        }
        assert!(last >= Duration::from_millis(6400), "capped near the max: {last:?}");
    }

    #[test]
    fn busy_backs_off_without_counting_toward_opening() {
        let b = backoffs();
        let mut breaker = Breaker::new(3);
        let now = Instant::now();
        for _ in 0..10 {
            breaker.busy(now, None, &b);
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.is_busy(now));
        assert!(!breaker.admits(now).0);
        assert!(
            breaker.admits(now + Duration::from_millis(1300)).0,
            "at most the busy max"
        );
        let asked = breaker.busy(now, Some(Duration::from_secs(60)), &b);
        assert_eq!(asked, Duration::from_secs(1), "Retry-After is capped");
        breaker.succeeded();
        assert!(!breaker.is_busy(now), "an answer ends the backoff");
    }
}
