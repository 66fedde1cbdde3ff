//! A token bucket refilled continuously: the rate limiter of a tenant's requests and tokens.
//!
//! The bucket holds up to one minute's worth of its limit and refills at the limit's rate
//! every instant, not once a minute, so a tenant that waits a second gets a second's worth
//! back. A charge may take the level below zero (a request's tokens are known only after it
//! is answered); the tenant then waits until the debt is refilled.

use std::time::{Duration, Instant};

/// One limit's bucket.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    /// The limit per minute, which is also the bucket's size.
    per_minute: f64,
    /// What is in the bucket as of `at`.
    level: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket for `per_minute`.
    pub(crate) fn full(per_minute: f64, now: Instant) -> Bucket {
        Bucket {
            per_minute,
            level: per_minute,
            at: now,
        }
    }

    /// Takes in a new limit; the level stays, cut to the new size.
    pub(crate) fn set_limit(&mut self, per_minute: f64, now: Instant) {
        self.refill(now);
        self.per_minute = per_minute;
        self.level = self.level.min(per_minute);
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * self.per_minute / 60.0).min(self.per_minute);
        self.at = now;
    }

    /// How long until `need` is in the bucket; zero when it is there now.
    pub(crate) fn wait_for(&mut self, need: f64, now: Instant) -> Duration {
        self.refill(now);
        if self.level >= need {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((need - self.level) * 60.0 / self.per_minute)
    }

    /// Takes `amount` out (a negative amount gives it back), going into debt if it must.
    pub(crate) fn take(&mut self, amount: f64, now: Instant) {
        self.refill(now);
        self.level = (self.level - amount).min(self.per_minute);
    }

    /// What is in the bucket now (negative: debt).
    #[cfg(test)]
    pub(crate) fn level(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refills_at_the_rate_and_holds_a_minute_at_most() {
        let start = Instant::now();
        let mut bucket = Bucket::full(120.0, start);
        for _ in 0..120 {
            assert_eq!(bucket.wait_for(1.0, start), Duration::ZERO);
            bucket.take(1.0, start);
        }
        // 2 a second: the next one is half a second away.
        let wait = bucket.wait_for(1.0, start);
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        let later = start + Duration::from_secs(5);
        assert!((bucket.level(later) - 10.0).abs() < 1e-9);
        let much_later = start + Duration::from_secs(3600);
        assert!((bucket.level(much_later) - 120.0).abs() < 1e-9);
    }

    #[test]
    fn debt_is_paid_back_before_the_next_take() {
        let start = Instant::now();
        let mut bucket = Bucket::full(600.0, start);
        bucket.take(900.0, start);
        assert!((bucket.level(start) + 300.0).abs() < 1e-9);
        // 10 a second: 301 tokens (to reach 1) take 30.1 s.
        let wait = bucket.wait_for(1.0, start).as_secs_f64();
        assert!((wait - 30.1).abs() < 1e-9, "{wait}");
        bucket.take(-1000.0, start);
        assert!((bucket.level(start) - 600.0).abs() < 1e-9, "a refund never overfills");
        bucket.set_limit(60.0, start);
        assert!((bucket.level(start) - 60.0).abs() < 1e-9);
    }
}
