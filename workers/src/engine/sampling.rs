//! Choosing the next token from a step's logits: greedy, or temperature with top-k and top-p
//! (nucleus) filtering from a seeded stream, and the stop conditions of a sequence.
//!
//! The order of the filters is vLLM's and transformers': temperature scales the logits, top-k
//! keeps the k largest, top-p keeps the smallest set of the most likely tokens whose probability
//! reaches p, and the token is drawn from what is left, renormalised. A sampler owns its random
//! stream, so a request with a seed gets the same tokens on every run whatever else is batched.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// How a request wants its tokens chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy); larger values flatten the distribution.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the most likely tokens up to this total probability, in (0, 1].
    pub top_p: f32,
    /// Seed of the request's random stream; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Tokens that end the sequence (the model's end-of-sequence ids and the request's).
    pub stop_token_ids: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
        }
    }
}

/// Why sampling parameters were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `temperature` is negative or not a number.
    #[error("temperature must be a number ≥ 0, not {0}")]
    Temperature(f32),
    /// `top_p` is outside (0, 1].
    #[error("top_p must be in (0, 1], not {0}")]
    TopP(f32),
    /// The logits hold no finite value to choose from.
    #[error("the logits hold no finite value")]
    NoFiniteLogit,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced a stop token (OpenAI's `stop`).
    Stop,
    /// It reached `max_tokens` (OpenAI's `length`).
    Length,
}

impl FinishReason {
    /// The OpenAI spelling: `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One sequence's sampler.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    /// Made at the first random draw: greedy sequences and the mocker's never need one, so
    /// they cost no OS entropy per request.
    rng: Option<SmallRng>,
    /// Scratch for (token, logit) pairs, kept between calls.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params`.
    ///
    /// # Errors
    ///
    /// [`SamplingError`] for a negative temperature or a `top_p` outside (0, 1].
    pub fn new(params: SamplingParams) -> Result<Sampler, SamplingError> {
        if params.temperature.is_nan() || params.temperature < 0.0 {
            return Err(SamplingError::Temperature(params.temperature));
        }
        if params.top_p.is_nan() || params.top_p <= 0.0 || params.top_p > 1.0 {
            return Err(SamplingError::TopP(params.top_p));
        }
        Ok(Sampler {
            params,
            rng: None,
            candidates: Vec::new(),
        })
    }

    /// The parameters this sampler was made with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether this sampler always takes the most likely token (temperature 0 or top-k 1), so
    /// a backend may pick it without handing over the logits.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
    }

    /// The next token from `logits` (`[vocab]`). NaN logits are never chosen.
    ///
    /// # Errors
    ///
    /// [`SamplingError::NoFiniteLogit`] when no logit is a finite number.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        let finite = logits.iter().enumerate().filter(|(_, v)| v.is_finite());
        if self.is_greedy() {
            // The first of equal maxima, as argmax does.
            let mut best: Option<(usize, f32)> = None;
            for (i, &v) in finite {
                if best.is_none_or(|(_, b)| v > b) {
                    best = Some((i, v));
                }
            }
            return best.map(|(i, _)| i as u32).ok_or(SamplingError::NoFiniteLogit);
        }
        self.candidates.clear();
        let inverse = 1.0 / self.params.temperature;
        self.candidates.extend(finite.map(|(i, &v)| (i as u32, v * inverse)));
        if self.candidates.is_empty() {
            return Err(SamplingError::NoFiniteLogit);
        }
        // Most likely first; equal logits by token id so that a seed fixes the outcome.
        self.candidates
            .sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            self.candidates.truncate(self.params.top_k);
        }
        let max = self.candidates[0].1;
        let mut total = 0.0f64;
        for candidate in &mut self.candidates {
            candidate.1 = (candidate.1 - max).exp();
            total += f64::from(candidate.1);
        }
        if self.params.top_p < 1.0 {
            let mut kept = 0.0f64;
            let mut keep = self.candidates.len();
            for (i, candidate) in self.candidates.iter().enumerate() {
                kept += f64::from(candidate.1);
                if kept / total >= f64::from(self.params.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
            total = self.candidates.iter().map(|c| f64::from(c.1)).sum();
        }
        let seed = self.params.seed;
        let rng = self.rng.get_or_insert_with(|| match seed {
            Some(seed) => SmallRng::seed_from_u64(seed),
            None => SmallRng::from_os_rng(),
        });
        let mut target = rng.random::<f64>() * total;
        for candidate in &self.candidates {
            target -= f64::from(candidate.1);
            if target < 0.0 {
                return Ok(candidate.0);
            }
        }
        // Rounding can leave a sliver past the last one.
        Ok(self.candidates[self.candidates.len() - 1].0)
    }

    /// Whether a sequence that has just produced `token` as its `generated`-th token stops.
    pub fn finish(&self, token: u32, generated: usize) -> Option<FinishReason> {
        if self.params.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if generated >= self.params.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            ..SamplingParams::default()
        })
        .expect("valid params")
    }

    const LOGITS: [f32; 5] = [1.0, 3.0, 2.0, f32::NAN, 0.5];

    #[test]
    fn greedy_and_top_k_one_pick_the_largest_finite_logit() {
        assert_eq!(sampler(0.0, 0, 1.0, 1).sample(&LOGITS), Ok(1));
        assert_eq!(sampler(0.7, 1, 1.0, 1).sample(&LOGITS), Ok(1));
        assert_eq!(
            sampler(0.0, 0, 1.0, 1).sample(&[f32::NAN, f32::NEG_INFINITY]),
            Err(SamplingError::NoFiniteLogit)
        );
    }

    #[test]
    fn draws_follow_the_softmax_and_a_seed_repeats_them() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut counts = [0u32; 3];
        let mut s = sampler(1.0, 0, 1.0, 42);
        let draws: Vec<u32> = (0..30_000).map(|_| s.sample(&logits).expect("a token")).collect();
        for &t in &draws {
            counts[t as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (i, &count) in counts.iter().enumerate() {
            let expected = f64::from(logits[i]).exp() / z;
            let observed = f64::from(count) / 30_000.0;
            assert!(
                (observed - expected).abs() < 0.01,
                "token {i}: {observed} vs {expected}"
            );
        }
        let mut again = sampler(1.0, 0, 1.0, 42);
        let repeat: Vec<u32> = (0..30_000).map(|_| again.sample(&logits).expect("a token")).collect();
        assert_eq!(draws, repeat);
        let mut other = sampler(1.0, 0, 1.0, 43);
        let different: Vec<u32> = (0..100).map(|_| other.sample(&logits).expect("a token")).collect();
        assert_ne!(&draws[..100], &different[..]);
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        // Probabilities ∝ e^0, e^1, e^2, e^3: 0.032, 0.087, 0.237, 0.644.
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let mut top_k = sampler(1.0, 2, 1.0, 7);
        let mut top_p = sampler(1.0, 0, 0.8, 7);
        for _ in 0..2_000 {
            assert!(top_k.sample(&logits).expect("a token") >= 2);
            // 0.644 < 0.8 ≤ 0.644 + 0.237: the two most likely remain.
            assert!(top_p.sample(&logits).expect("a token") >= 2);
        }
        // A low temperature sharpens: almost always the largest.
        let mut cold = sampler(0.05, 0, 1.0, 7);
        let largest = (0..1_000).filter(|_| cold.sample(&logits) == Ok(3)).count();
        assert!(largest > 990, "{largest}");
    }

    #[test]
    fn bad_params_are_refused_and_stops_are_reported() {
        let bad = |temperature, top_p| {
            Sampler::new(SamplingParams {
                temperature,
                top_p,
                ..SamplingParams::default()
            })
        };
        assert_eq!(bad(-1.0, 1.0).err(), Some(SamplingError::Temperature(-1.0)));
        assert_eq!(bad(1.0, 0.0).err(), Some(SamplingError::TopP(0.0)));
        assert_eq!(bad(1.0, 1.5).err(), Some(SamplingError::TopP(1.5)));
        let s = Sampler::new(SamplingParams {
            max_tokens: 3,
            stop_token_ids: vec![9],
            ..SamplingParams::default()
        })
        .expect("valid");
        assert_eq!(s.finish(9, 1), Some(FinishReason::Stop));
        assert_eq!(s.finish(4, 2), None);
        assert_eq!(s.finish(4, 3), Some(FinishReason::Length));
    }
}
