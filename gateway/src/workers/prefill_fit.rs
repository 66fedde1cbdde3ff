//! A worker's measured prefill: a line through its recent requests' time to first token
//! against the prefill work each found there, what the `measured.prefill-fits` import answers.
//!
//! Routers predict a request's time to first token from the gateway's view of a worker's
//! queue (the uncached prompt tokens of the requests routed there and not yet at their first
//! token) and a step-time model. How fast that queue really drains depends on the worker's
//! hardware, the decoders sharing its steps and its scheduler, which the model only
//! approximates; on a loaded slow worker the error compounds with the queue. So every streamed
//! request's work at routing (`x`, tokens, its own included) and time to first token (`y`, ms)
//! go into an exponentially weighted least-squares fit `y ≈ fixed + rate · x`, each new request
//! weighing [`DECAY`]-times more than the one before it, so the line follows the worker as its
//! load changes.

/// Each sample's weight relative to the next one's: about the last 32 requests count.
const DECAY: f64 = 1.0 - 1.0 / 32.0;

/// Below this spread of the work (standard deviation over mean), the requests do not tell a
/// slope apart from the fixed part, and a line through them would be extrapolated far past
/// them (small prompts' times, all fixed cost, taken per token): no line is fitted.
const MIN_RELATIVE_SPREAD: f64 = 0.25;

/// Weighted sums of the samples; see the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillFit {
    weight: f64,
    sum_x: f64,
    sum_y: f64,
    sum_xx: f64,
    sum_xy: f64,
    samples: u32,
}

/// The fitted line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillLine {
    /// Time to first token at no work, in milliseconds (≥ 0).
    pub fixed_ms: f64,
    /// Milliseconds per token of work (≥ 0).
    pub ms_per_token: f64,
    /// Requests fitted.
    pub samples: u32,
}

impl PrefillFit {
    /// Takes in one request that found `work_tokens` of prefill work (its own included) and
    /// reached its first token after `ttft_ms`. Non-finite or negative times are ignored.
    pub fn observe(&mut self, work_tokens: u64, ttft_ms: f64) {
        if !ttft_ms.is_finite() || ttft_ms < 0.0 {
            return;
        }
        let (x, y) = (work_tokens as f64, ttft_ms);
        self.weight = self.weight * DECAY + 1.0;
        self.sum_x = self.sum_x * DECAY + x;
        self.sum_y = self.sum_y * DECAY + y;
        self.sum_xx = self.sum_xx * DECAY + x * x;
        self.sum_xy = self.sum_xy * DECAY + x * y;
        self.samples = self.samples.saturating_add(1);
    }

    /// Requests taken in so far.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// The line, `None` while it is not determined: before the first sample, while the work
    /// has too little spread (see [`MIN_RELATIVE_SPREAD`]), or where the time falls as the work
    /// grows (noise, not a worker's behaviour). An intercept below zero (a steep line over a
    /// narrow range) is taken as zero, the slope then fitted through the origin
    /// (`rate = Σxy / Σx²`).
    pub fn line(&self) -> Option<PrefillLine> {
        if self.samples == 0 || self.weight <= 0.0 {
            return None;
        }
        let mean_x = self.sum_x / self.weight;
        let mean_y = self.sum_y / self.weight;
        let variance = (self.sum_xx / self.weight - mean_x * mean_x).max(0.0);
        if variance.sqrt() <= MIN_RELATIVE_SPREAD * mean_x {
            return None;
        }
        let rate = (self.sum_xy / self.weight - mean_x * mean_y) / variance;
        // Finite: the variance is positive here.
        if rate < 0.0 {
            return None;
        }
        let fixed = mean_y - rate * mean_x;
        let (fixed_ms, ms_per_token) = if fixed >= 0.0 {
            (fixed, rate)
        } else {
            (0.0, self.sum_xy / self.sum_xx)
        };
        Some(PrefillLine {
            fixed_ms,
            ms_per_token,
            samples: self.samples,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn a_worker_that_drains_its_queue_linearly_is_fitted_exactly() {
        let mut fit = PrefillFit::default();
        assert_eq!(fit.line(), None);
        for work in [100u64, 9_000, 2_500, 40_000, 700, 16_000] {
            fit.observe(work, 30.0 + 0.02 * work as f64);
        }
        let line = fit.line().expect("fitted");
        assert!(close(line.fixed_ms, 30.0), "{line:?}");
        assert!(close(line.ms_per_token, 0.02), "{line:?}");
        assert_eq!(line.samples, 6);
    }

    #[test]
    fn the_line_follows_the_worker_as_it_slows() {
        let mut fit = PrefillFit::default();
        for round in 0..200u64 {
            let work = 1_000 + (round * 7_919) % 30_000;
            fit.observe(work, 20.0 + 0.01 * work as f64);
        }
        // The worker now takes 2.5 times as long per token (a loaded spot engine).
        for round in 0..200u64 {
            let work = 1_000 + (round * 7_919) % 30_000;
            fit.observe(work, 20.0 + 0.025 * work as f64);
        }
        let line = fit.line().expect("fitted");
        assert!((line.ms_per_token - 0.025).abs() < 0.025 * 0.01, "{line:?}");
    }

    #[test]
    fn noise_never_gives_a_negative_rate_or_a_negative_fixed_part() {
        // Times falling as work grows (two measurements that happen to cross): no line.
        let mut fit = PrefillFit::default();
        fit.observe(10_000, 500.0);
        fit.observe(20_000, 300.0);
        assert_eq!(fit.line(), None);
        assert_eq!(fit.samples(), 2);
        // A steep line whose intercept would be negative: through the origin.
        let mut fit = PrefillFit::default();
        fit.observe(10_000, 100.0);
        fit.observe(20_000, 400.0);
        let line = fit.line().expect("fitted");
        assert_eq!(line.fixed_ms, 0.0);
        let expected = (DECAY * 10_000.0 * 100.0 + 20_000.0 * 400.0) / (DECAY * 1e8 + 4e8);
        assert!(close(line.ms_per_token, expected), "{line:?}");
        // Bad times are not samples.
        fit.observe(5, f64::NAN);
        fit.observe(5, -1.0);
        assert_eq!(fit.samples(), 2);
    }

    #[test]
    fn work_without_spread_fits_no_line() {
        // Short prompts on an idle worker: their times are a step's fixed cost, and a rate
        // drawn from them would make a long prompt look minutes long.
        let mut fit = PrefillFit::default();
        for (work, ttft) in [(40, 8.0), (44, 9.0), (38, 8.5), (41, 8.2)] {
            fit.observe(work, ttft);
        }
        assert_eq!(fit.line(), None);
        let mut fit = PrefillFit::default();
        fit.observe(0, 12.0);
        fit.observe(0, 18.0);
        assert_eq!(fit.line(), None, "no work at all");
    }
}
