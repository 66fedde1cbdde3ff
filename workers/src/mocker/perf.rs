//! The mocker's timing model: how long a simulated forward pass takes.
//!
//! Constants are Dynamo's published polynomial fit for its mocker (ai-dynamo/dynamo,
//! `lib/mocker`, documented in `docs/mocker/mocker.md`). Prefill time grows with the tokens computed in the
//! step; decode time grows with how full the KV cache is. A mixed step (prefill chunks plus
//! decoding sequences) is timed as a prefill of all its tokens, since decode tokens ride along
//! in the same forward pass.

use std::time::Duration;

/// Milliseconds to prefill `tokens` new tokens in one step:
/// `4.209989e-7·T² + 1.518344e-2·T + 16.50142`.
pub fn prefill_ms(tokens: usize) -> f64 {
    let t = tokens as f64;
    4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
}

/// Milliseconds for one decode step at KV usage `u` (active / total KV tokens, capped at 1):
/// `−25.74·u² + 54.01·u + 5.74`, never below 1 ms.
pub fn decode_ms(kv_usage: f64) -> f64 {
    let u = kv_usage.clamp(0.0, 1.0);
    (-25.74 * u * u + 54.01 * u + 5.74).max(1.0)
}

/// The simulated duration of one step, divided by the speed-up factor.
///
/// `prefill_tokens` counts tokens of sequences still in prefill, `decode_seqs` the sequences
/// generating one token each.
pub fn step_duration(prefill_tokens: usize, decode_seqs: usize, kv_usage: f64, speedup: f64) -> Duration {
    let ms = if prefill_tokens > 0 {
        prefill_ms(prefill_tokens + decode_seqs)
    } else if decode_seqs > 0 {
        decode_ms(kv_usage)
    } else {
        0.0
    };
    Duration::from_secs_f64(ms / 1000.0 / speedup.max(f64::MIN_POSITIVE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polynomials_match_published_constants() {
        assert!((prefill_ms(0) - 16.50142).abs() < 1e-9);
        let t = 8192.0f64;
        let expected = 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142;
        assert!((prefill_ms(8192) - expected).abs() < 1e-9);
        assert!((decode_ms(0.0) - 5.74).abs() < 1e-9);
        assert!((decode_ms(1.0) - (-25.74 + 54.01 + 5.74)).abs() < 1e-9);
        assert!((decode_ms(7.0) - decode_ms(1.0)).abs() < 1e-9, "usage is capped at 1");
    }

    #[test]
    fn speedup_divides_the_step() {
        let slow = step_duration(100, 0, 0.0, 1.0);
        let fast = step_duration(100, 0, 0.0, 10.0);
        assert!((slow.as_secs_f64() / fast.as_secs_f64() - 10.0).abs() < 1e-4);
        assert_eq!(step_duration(0, 0, 0.5, 1.0), Duration::ZERO);
    }
}
