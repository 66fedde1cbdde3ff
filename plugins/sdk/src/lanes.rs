//! Four workers at a time: small vector types for a router's per-worker arithmetic.
//!
//! A cost loop over thousands of workers is where a router spends its call, and LLVM does not
//! vectorize such loops for Wasm reliably (conversions, selects, reductions). [`F32x4`],
//! [`U32x4`] and [`Mask4`] are four lanes, [`F64x2`] and [`Mask2`] two (for costs that need
//! `f64`'s precision), written once: in a component they are Wasm SIMD
//! values (`v128`, which wasmtime compiles to the host's vector instructions), natively (in
//! tests) plain arrays with the same lane-by-lane meaning, so a policy's tests run the very
//! code its component runs. Loads take `&[u32; 4]` (see `slice::as_chunks`), so a loop over a
//! table's columns has no bounds checks.
//!
//! Lane semantics are those of the Wasm instructions: [`F32x4::max`] and [`F32x4::min`] are
//! `pmax`/`pmin` (`a < b ? b : a`), which agree with `f32::max`/`min` whenever no lane is NaN;
//! [`U32x4::to_f32`] converts as signed integers, exact below 2²⁴ and meaningless from 2³¹
//! (a router checks its inputs' range, as `kv-aware` does).

use core::ops::{Add, BitAnd, BitOr, Div, Mul, Not, Sub};

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod imp {
    pub use core::arch::wasm32::v128 as F32;
    pub use core::arch::wasm32::v128 as F64;
    pub use core::arch::wasm32::v128 as U32;
    pub use core::arch::wasm32::v128 as Mask;
    pub use core::arch::wasm32::v128 as Mask2;
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod imp {
    pub type F32 = [f32; 4];
    pub type F64 = [f64; 2];
    pub type U32 = [u32; 4];
    pub type Mask = [bool; 4];
    pub type Mask2 = [bool; 2];
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
use core::arch::wasm32 as simd;

/// Four `f32` lanes.
#[derive(Clone, Copy, Debug)]
pub struct F32x4(imp::F32);

/// Four `u32` lanes.
#[derive(Clone, Copy, Debug)]
pub struct U32x4(imp::U32);

/// Four lane conditions, from comparisons.
#[derive(Clone, Copy, Debug)]
pub struct Mask4(imp::Mask);

/// Two `f64` lanes.
#[derive(Clone, Copy, Debug)]
pub struct F64x2(imp::F64);

/// Two lane conditions, from comparisons of [`F64x2`].
#[derive(Clone, Copy, Debug)]
pub struct Mask2(imp::Mask2);

/// Applies `op` lane by lane (the native form).
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn each<A: Copy, B: Copy, T, const N: usize>(a: [A; N], b: [B; N], op: impl Fn(A, B) -> T) -> [T; N] {
    core::array::from_fn(|lane| op(a[lane], b[lane]))
}

impl F32x4 {
    /// Every lane `value`.
    #[inline(always)]
    pub fn splat(value: f32) -> F32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F32x4(simd::f32x4_splat(value));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F32x4([value; 4]);
    }

    /// Four values.
    #[inline(always)]
    pub fn load(values: &[f32; 4]) -> F32x4 {
        // SAFETY: `values` is 16 readable bytes, and Wasm vector loads need no alignment.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F32x4(unsafe { simd::v128_load(values.as_ptr().cast()) });
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F32x4(*values);
    }

    /// Writes the lanes to `out`.
    #[inline(always)]
    pub fn store(self, out: &mut [f32; 4]) {
        // SAFETY: `out` is 16 writable bytes, and Wasm vector stores need no alignment.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        unsafe {
            simd::v128_store(out.as_mut_ptr().cast(), self.0)
        };
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        {
            *out = self.0;
        }
    }

    /// The greater of each pair of lanes (`self < other ? other : self`).
    #[inline(always)]
    pub fn max(self, other: F32x4) -> F32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F32x4(simd::f32x4_pmax(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F32x4(each(self.0, other.0, |a, b| if a < b { b } else { a }));
    }

    /// The lesser of each pair of lanes (`other < self ? other : self`).
    #[inline(always)]
    pub fn min(self, other: F32x4) -> F32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F32x4(simd::f32x4_pmin(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F32x4(each(self.0, other.0, |a, b| if b < a { b } else { a }));
    }

    /// The least of the four lanes (no lane NaN).
    #[inline(always)]
    pub fn least_lane(self) -> f32 {
        let mut lanes = [0.0; 4];
        self.store(&mut lanes);
        let low = if lanes[1] < lanes[0] { lanes[1] } else { lanes[0] };
        let high = if lanes[3] < lanes[2] { lanes[3] } else { lanes[2] };
        if high < low { high } else { low }
    }

    /// Lanes where `self > other`.
    #[inline(always)]
    pub fn gt(self, other: F32x4) -> Mask4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask4(simd::f32x4_gt(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask4(each(self.0, other.0, |a, b| a > b));
    }

    /// Lanes where `self <= other`.
    #[inline(always)]
    pub fn le(self, other: F32x4) -> Mask4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask4(simd::f32x4_le(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask4(each(self.0, other.0, |a, b| a <= b));
    }
}

impl U32x4 {
    /// Every lane `value`.
    #[inline(always)]
    pub fn splat(value: u32) -> U32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return U32x4(simd::u32x4_splat(value));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return U32x4([value; 4]);
    }

    /// Four values.
    #[inline(always)]
    pub fn load(values: &[u32; 4]) -> U32x4 {
        // SAFETY: `values` is 16 readable bytes, and Wasm vector loads need no alignment.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return U32x4(unsafe { simd::v128_load(values.as_ptr().cast()) });
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return U32x4(*values);
    }

    /// The lanes as `f32`, converted as signed integers: exact below 2²⁴, rounded to
    /// nearest up to 2³¹, negative from there (see the module's doc).
    #[inline(always)]
    pub fn to_f32(self) -> F32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F32x4(simd::f32x4_convert_i32x4(self.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F32x4(self.0.map(|value| value as i32 as f32));
    }

    /// Lanes 0 and 1 as `f64`, exactly.
    #[inline(always)]
    pub fn low_to_f64(self) -> F64x2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(simd::f64x2_convert_low_u32x4(self.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2([f64::from(self.0[0]), f64::from(self.0[1])]);
    }

    /// Lanes 2 and 3 as `f64`, exactly.
    #[inline(always)]
    pub fn high_to_f64(self) -> F64x2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(simd::f64x2_convert_low_u32x4(simd::u32x4_shuffle::<2, 3, 2, 3>(
            self.0, self.0,
        )));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2([f64::from(self.0[2]), f64::from(self.0[3])]);
    }

    /// The greater of each pair of lanes, unsigned.
    #[inline(always)]
    pub fn max(self, other: U32x4) -> U32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return U32x4(simd::u32x4_max(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return U32x4(each(self.0, other.0, u32::max));
    }

    /// Lanes equal to `other`'s.
    #[inline(always)]
    pub fn eq(self, other: U32x4) -> Mask4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask4(simd::i32x4_eq(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask4(each(self.0, other.0, |a, b| a == b));
    }

    /// The bitwise OR of the four lanes.
    #[inline(always)]
    pub fn or_lanes(self) -> u32 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return simd::u32x4_extract_lane::<0>(self.0)
            | simd::u32x4_extract_lane::<1>(self.0)
            | simd::u32x4_extract_lane::<2>(self.0)
            | simd::u32x4_extract_lane::<3>(self.0);
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return self.0[0] | self.0[1] | self.0[2] | self.0[3];
    }
}

impl BitOr for U32x4 {
    type Output = U32x4;
    #[inline(always)]
    fn bitor(self, other: U32x4) -> U32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return U32x4(simd::v128_or(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return U32x4(each(self.0, other.0, |a, b| a | b));
    }
}

impl Mask4 {
    /// `if_true` in the lanes that hold, `if_false` in the others.
    #[inline(always)]
    pub fn select(self, if_true: F32x4, if_false: F32x4) -> F32x4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F32x4(simd::v128_bitselect(if_true.0, if_false.0, self.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F32x4([0, 1, 2, 3].map(|lane| {
            if self.0[lane] {
                if_true.0[lane]
            } else {
                if_false.0[lane]
            }
        }));
    }
}

impl Mask4 {
    /// Whether any lane holds.
    #[inline(always)]
    pub fn any(self) -> bool {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return simd::v128_any_true(self.0);
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return self.0.iter().any(|lane| *lane);
    }

    /// How many lanes hold.
    #[inline(always)]
    pub fn count(self) -> u32 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return simd::i32x4_bitmask(self.0).count_ones();
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return self.0.iter().filter(|lane| **lane).count() as u32;
    }
}

impl BitAnd for Mask4 {
    type Output = Mask4;
    #[inline(always)]
    fn bitand(self, other: Mask4) -> Mask4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask4(simd::v128_and(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask4(each(self.0, other.0, |a, b| a & b));
    }
}

impl BitOr for Mask4 {
    type Output = Mask4;
    #[inline(always)]
    fn bitor(self, other: Mask4) -> Mask4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask4(simd::v128_or(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask4(each(self.0, other.0, |a, b| a | b));
    }
}

impl Not for Mask4 {
    type Output = Mask4;
    #[inline(always)]
    fn not(self) -> Mask4 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask4(simd::v128_not(self.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask4(self.0.map(|lane| !lane));
    }
}

impl F64x2 {
    /// Both lanes `value`.
    #[inline(always)]
    pub fn splat(value: f64) -> F64x2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(simd::f64x2_splat(value));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2([value; 2]);
    }

    /// Writes the lanes to `out`.
    #[inline(always)]
    pub fn store(self, out: &mut [f64; 2]) {
        // SAFETY: `out` is 16 writable bytes, and Wasm vector stores need no alignment.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        unsafe {
            simd::v128_store(out.as_mut_ptr().cast(), self.0)
        };
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        {
            *out = self.0;
        }
    }

    /// The greater of each pair of lanes (`self < other ? other : self`).
    #[inline(always)]
    pub fn max(self, other: F64x2) -> F64x2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(simd::f64x2_pmax(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2(each(self.0, other.0, |a, b| if a < b { b } else { a }));
    }

    /// The lesser of each pair of lanes (`other < self ? other : self`).
    #[inline(always)]
    pub fn min(self, other: F64x2) -> F64x2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(simd::f64x2_pmin(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2(each(self.0, other.0, |a, b| if b < a { b } else { a }));
    }

    /// Two values.
    #[inline(always)]
    pub fn load(values: &[f64; 2]) -> F64x2 {
        // SAFETY: `values` is 16 readable bytes, and Wasm vector loads need no alignment.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(unsafe { simd::v128_load(values.as_ptr().cast()) });
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2(*values);
    }

    /// Lanes equal to `other`'s.
    #[inline(always)]
    pub fn eq(self, other: F64x2) -> Mask2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask2(simd::f64x2_eq(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask2(each(self.0, other.0, |a, b| a == b));
    }

    /// Lanes where `self <= other`.
    #[inline(always)]
    pub fn le(self, other: F64x2) -> Mask2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask2(simd::f64x2_le(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask2(each(self.0, other.0, |a, b| a <= b));
    }

    /// Lanes where `self > other`.
    #[inline(always)]
    pub fn gt(self, other: F64x2) -> Mask2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask2(simd::f64x2_gt(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask2(each(self.0, other.0, |a, b| a > b));
    }
}

impl Mask2 {
    /// `if_true` in the lanes that hold, `if_false` in the others.
    #[inline(always)]
    pub fn select(self, if_true: F64x2, if_false: F64x2) -> F64x2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return F64x2(simd::v128_bitselect(if_true.0, if_false.0, self.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return F64x2([0, 1].map(|lane| {
            if self.0[lane] {
                if_true.0[lane]
            } else {
                if_false.0[lane]
            }
        }));
    }

    /// Whether any lane holds.
    #[inline(always)]
    pub fn any(self) -> bool {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return simd::v128_any_true(self.0);
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return self.0[0] | self.0[1];
    }
}

impl Not for Mask2 {
    type Output = Mask2;
    #[inline(always)]
    fn not(self) -> Mask2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask2(simd::v128_not(self.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask2(self.0.map(|lane| !lane));
    }
}

impl BitAnd for Mask2 {
    type Output = Mask2;
    #[inline(always)]
    fn bitand(self, other: Mask2) -> Mask2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask2(simd::v128_and(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask2(each(self.0, other.0, |a, b| a & b));
    }
}

impl BitOr for Mask2 {
    type Output = Mask2;
    #[inline(always)]
    fn bitor(self, other: Mask2) -> Mask2 {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Mask2(simd::v128_or(self.0, other.0));
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        return Mask2(each(self.0, other.0, |a, b| a | b));
    }
}

/// Lane-by-lane arithmetic, as the Wasm instructions do it.
macro_rules! arithmetic {
    ($lanes:ident, $trait:ident, $method:ident, $simd:ident, $op:tt) => {
        impl $trait for $lanes {
            type Output = $lanes;
            #[inline(always)]
            fn $method(self, other: $lanes) -> $lanes {
                #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                return $lanes(simd::$simd(self.0, other.0));
                #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
                return $lanes(each(self.0, other.0, |a, b| a $op b));
            }
        }
    };
}

arithmetic!(F32x4, Add, add, f32x4_add, +);
arithmetic!(F32x4, Sub, sub, f32x4_sub, -);
arithmetic!(F32x4, Mul, mul, f32x4_mul, *);
arithmetic!(F32x4, Div, div, f32x4_div, /);
arithmetic!(F64x2, Add, add, f64x2_add, +);
arithmetic!(F64x2, Sub, sub, f64x2_sub, -);
arithmetic!(F64x2, Mul, mul, f64x2_mul, *);
arithmetic!(F64x2, Div, div, f64x2_div, /);

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(value: F32x4) -> [f32; 4] {
        let mut out = [0.0; 4];
        value.store(&mut out);
        out
    }

    #[test]
    fn lanes_compute_as_scalars_do() {
        let a = U32x4::load(&[1, 2, 3, 4]).to_f32();
        let b = F32x4::load(&[4.0, 3.0, 2.0, 1.0]);
        assert_eq!(lanes(a + b), [5.0; 4]);
        assert_eq!(lanes((a - b).max(F32x4::splat(0.0))), [0.0, 0.0, 1.0, 3.0]);
        assert_eq!(lanes(a.min(b)), [1.0, 2.0, 2.0, 1.0]);
        assert_eq!(lanes(a * b / F32x4::splat(2.0)), [2.0, 3.0, 3.0, 2.0]);
        let picked = (a.gt(b) | U32x4::load(&[7, 0, 0, 0]).eq(U32x4::splat(7))).select(a, b);
        assert_eq!(lanes(picked), [1.0, 3.0, 3.0, 4.0]);
        assert_eq!(
            lanes((!a.le(b) & a.gt(F32x4::splat(3.5))).select(a, b)),
            [4.0, 3.0, 2.0, 4.0]
        );
        assert_eq!((U32x4::load(&[1, 2, 4, 0]) | U32x4::splat(8)).or_lanes(), 15);
        assert_eq!(U32x4::load(&[1, 0, 1, 1]).eq(U32x4::splat(1)).count(), 3);
        assert_eq!(
            lanes(U32x4::load(&[0, 5, 1, 9]).max(U32x4::splat(1)).to_f32()),
            [1.0, 5.0, 1.0, 9.0]
        );
        let wide = U32x4::load(&[u32::MAX, 2, 3, 1 << 31]);
        let (mut low, mut high) = ([0.0; 2], [0.0; 2]);
        (wide.low_to_f64() * F64x2::splat(2.0)).store(&mut low);
        (wide.high_to_f64() - F64x2::splat(1.0))
            .max(F64x2::splat(3.0))
            .store(&mut high);
        assert_eq!(low, [2.0 * f64::from(u32::MAX), 4.0]);
        assert_eq!(high, [3.0, f64::from(1u32 << 31) - 1.0]);
        let two = wide.low_to_f64();
        let picked = (two.gt(F64x2::splat(3.0)) & two.gt(F64x2::splat(0.0))) | two.gt(F64x2::splat(1e10));
        assert!(picked.any());
        picked
            .select(F64x2::splat(1.0), two.min(F64x2::splat(0.5) / F64x2::splat(0.25)))
            .store(&mut low);
        assert_eq!(low, [1.0, 2.0]);
    }
}
