//! PIL's image resize, reproduced: the reference processors resize with Pillow, and a ViT fed
//! pixels resampled another way sees slightly different images. Resampling crates use their own
//! kernels' normalization and rounding; this follows `libImaging/Resample.c` step for step so
//! the result is Pillow's to the last bit: per output pixel, the filter's taps over the source
//! span (widened by the scale when shrinking), normalized, converted to 22-bit fixed point; a
//! horizontal pass rounding to 8 bits, then a vertical one; a pass is skipped when its side keeps
//! its size. Nearest-neighbour picks the source pixel under each output pixel's centre.

use crate::image::Resample;

const PRECISION_BITS: u32 = 32 - 8 - 2;

impl Resample {
    /// The filter's support (half-width, in source pixels at scale 1).
    fn support(self) -> f64 {
        match self {
            Resample::Nearest | Resample::Box => 0.5,
            Resample::Bilinear | Resample::Hamming => 1.0,
            Resample::Bicubic => 2.0,
            Resample::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Resample::Nearest | Resample::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Resample::Bilinear => {
                let x = x.abs();
                if x < 1.0 { 1.0 - x } else { 0.0 }
            }
            Resample::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    x.sin() / x * (0.54 + 0.46 * x.cos())
                }
            }
            Resample::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Resample::Lanczos => {
                let sinc = |x: f64| {
                    if x == 0.0 {
                        1.0
                    } else {
                        let x = x * std::f64::consts::PI;
                        x.sin() / x
                    }
                };
                if -3.0 < x && x < 3.0 {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Per output pixel: the first source pixel and the fixed-point taps from there.
struct Taps {
    starts: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

/// `precompute_coeffs` and `normalize_coeffs_8bpc` of Pillow.
fn taps(input: usize, output: usize, filter: Resample) -> Taps {
    let scale = input as f64 / output as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support() * filter_scale;
    let mut starts = Vec::with_capacity(output);
    let mut weights = Vec::with_capacity(output);
    for out in 0..output {
        let center = (out as f64 + 0.5) * scale;
        // C's `(int)` truncates toward zero; the values here are ≥ −support.
        let min = ((center - support + 0.5) as i64).max(0) as usize;
        let max = ((center + support + 0.5) as i64).min(input as i64).max(min as i64) as usize;
        let raw: Vec<f64> = (min..max)
            .map(|x| filter.weight((x as f64 - center + 0.5) / filter_scale))
            .collect();
        let total: f64 = raw.iter().sum();
        let fixed = raw
            .iter()
            .map(|&w| {
                let w = if total != 0.0 { w / total } else { w };
                let scaled = w * (1u32 << PRECISION_BITS) as f64;
                if scaled < 0.0 {
                    (scaled - 0.5) as i32
                } else {
                    (scaled + 0.5) as i32
                }
            })
            .collect();
        starts.push(min);
        weights.push(fixed);
    }
    Taps { starts, weights }
}

fn clip8(value: i64) -> u8 {
    (value >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes an 8-bit RGB image (`width × height`, interleaved) to `new_width × new_height`.
pub(crate) fn resize_rgb8(
    pixels: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
    filter: Resample,
) -> Vec<u8> {
    if filter == Resample::Nearest {
        return nearest(pixels, width, height, new_width, new_height);
    }
    let mut current = pixels.to_vec();
    let mut current_width = width;
    if new_width != width {
        let taps = taps(width, new_width, filter);
        let mut out = vec![0u8; new_width * height * 3];
        for y in 0..height {
            let row = &current[y * width * 3..(y + 1) * width * 3];
            for x in 0..new_width {
                let start = taps.starts[x];
                for c in 0..3 {
                    let mut sum: i64 = 1 << (PRECISION_BITS - 1);
                    for (k, &w) in taps.weights[x].iter().enumerate() {
                        sum += row[(start + k) * 3 + c] as i64 * w as i64;
                    }
                    out[(y * new_width + x) * 3 + c] = clip8(sum);
                }
            }
        }
        current = out;
        current_width = new_width;
    }
    if new_height != height {
        let taps = taps(height, new_height, filter);
        let stride = current_width * 3;
        let mut out = vec![0u8; current_width * new_height * 3];
        for y in 0..new_height {
            let start = taps.starts[y];
            for i in 0..stride {
                let mut sum: i64 = 1 << (PRECISION_BITS - 1);
                for (k, &w) in taps.weights[y].iter().enumerate() {
                    sum += current[(start + k) * stride + i] as i64 * w as i64;
                }
                out[y * stride + i] = clip8(sum);
            }
        }
        current = out;
    }
    current
}

fn nearest(pixels: &[u8], width: usize, height: usize, new_width: usize, new_height: usize) -> Vec<u8> {
    let mut out = vec![0u8; new_width * new_height * 3];
    let (sx, sy) = (width as f64 / new_width as f64, height as f64 / new_height as f64);
    for y in 0..new_height {
        let source_y = (((y as f64 + 0.5) * sy) as usize).min(height - 1);
        for x in 0..new_width {
            let source_x = (((x as f64 + 0.5) * sx) as usize).min(width - 1);
            let from = (source_y * width + source_x) * 3;
            out[(y * new_width + x) * 3..][..3].copy_from_slice(&pixels[from..from + 3]);
        }
    }
    out
}
