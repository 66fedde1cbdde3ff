//! Shortlists: the few workers whose exact cost a router has to compute.
//!
//! A router over thousands of workers spends its time computing a cost per worker in `f64`,
//! one worker at a time. The fast way keeps that exact formula for the decision but runs it only
//! on a shortlist: first an `f32` estimate of every worker's cost, in a loop the compiler turns
//! into Wasm SIMD (four workers per instruction), with a bound on how far the estimate can be
//! from the exact cost; then the exact formula on the workers whose estimate is within twice
//! that bound of the least. Every worker the exact formula would pick (or tie) is on the list,
//! so the decision is the exact formula's, bit for bit; the rest only ever lose.
//!
//! This module holds the scans over the estimates; a router writes its own estimate loop. The
//! scans use the [`crate::lanes`] types (LLVM does not vectorize these scans for Wasm by
//! itself), so they run as Wasm SIMD in a component and as plain arrays in tests.

use alloc::vec::Vec;

/// The indices of the keys at most `limit`, ascending, in the call's scratch memory.
pub fn at_most(keys: &[f32], limit: f32) -> Vec<u32> {
    use crate::lanes::F32x4;
    let mut out = crate::scratch::vec(16);
    let (quads, tail) = keys.as_chunks::<4>();
    let bound = F32x4::splat(limit);
    for (chunk, quad) in quads.iter().enumerate() {
        // Most quads hold no candidate: one test skips them.
        if F32x4::load(quad).le(bound).any() {
            for (lane, key) in quad.iter().enumerate() {
                if *key <= limit {
                    out.push((chunk * 4 + lane) as u32);
                }
            }
        }
    }
    let start = quads.len() * 4;
    for (offset, key) in tail.iter().enumerate() {
        if *key <= limit {
            out.push((start + offset) as u32);
        }
    }
    out
}

/// The indices of the `f64` keys at most `limit`, ascending, in the call's scratch memory.
pub fn at_most_f64(keys: &[f64], limit: f64) -> Vec<u32> {
    use crate::lanes::F64x2;
    let mut out = crate::scratch::vec(16);
    let (pairs, tail) = keys.as_chunks::<2>();
    let bound = F64x2::splat(limit);
    for (chunk, pair) in pairs.iter().enumerate() {
        // Most pairs hold no candidate: one test skips them.
        if F64x2::load(pair).le(bound).any() {
            for (lane, key) in pair.iter().enumerate() {
                if *key <= limit {
                    out.push((chunk * 2 + lane) as u32);
                }
            }
        }
    }
    if let Some(key) = tail.first()
        && *key <= limit
    {
        out.push((pairs.len() * 2) as u32);
    }
    out
}

/// Three least values of each lane of `keys` so far, kept in order by a min/max network, for a
/// router's estimate loop: [`Least3::take`] each pair of estimates, then [`Least3::finish`].
#[derive(Clone, Copy, Debug)]
pub struct Least3 {
    first: crate::lanes::F64x2,
    second: crate::lanes::F64x2,
    third: crate::lanes::F64x2,
}

impl Least3 {
    /// Nothing seen: every lane `+∞`.
    pub fn new() -> Least3 {
        let infinite = crate::lanes::F64x2::splat(f64::INFINITY);
        Least3 {
            first: infinite,
            second: infinite,
            third: infinite,
        }
    }

    /// Takes two keys in (no NaN).
    #[inline(always)]
    pub fn take(&mut self, keys: crate::lanes::F64x2) {
        let carry = self.first.max(keys);
        self.first = keys.min(self.first);
        let carry2 = self.second.max(carry);
        self.second = carry.min(self.second);
        self.third = carry2.min(self.third);
    }

    /// The three least keys taken, ascending, padded with `+∞`.
    pub fn finish(&self) -> [f64; 3] {
        let mut best = [f64::INFINITY; 3];
        for lanes in [self.first, self.second, self.third] {
            let mut pair = [0.0; 2];
            lanes.store(&mut pair);
            for key in pair {
                if key < best[2] {
                    best[2] = key;
                    if key < best[1] {
                        best.swap(1, 2);
                        if key < best[0] {
                            best.swap(0, 1);
                        }
                    }
                }
            }
        }
        best
    }
}

impl Default for Least3 {
    fn default() -> Least3 {
        Least3::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_find_the_least_keys_and_those_under_a_limit() {
        let keys = [5.0, 3.0, f32::INFINITY, 9.0, 3.0, 1.0, 7.0];
        assert_eq!(at_most(&keys, 3.0), [1, 4, 5]);
        assert!(at_most(&keys, 0.5).is_empty());
        let wide = [5.0, 3.0, f64::INFINITY, 9.0, 3.0, 1.0, 7.0];
        assert_eq!(at_most_f64(&wide, 3.0), [1, 4, 5]);
        assert_eq!(at_most_f64(&wide, 7.0), [0, 1, 4, 5, 6]);
        let mut least = Least3::new();
        for pair in wide.as_chunks::<2>().0 {
            least.take(crate::lanes::F64x2::load(pair));
        }
        assert_eq!(least.finish(), [1.0, 3.0, 3.0]);
    }
}
