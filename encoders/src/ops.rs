//! The numeric building blocks the encoders share: linear layers and strided matrix products
//! through the `gemm` crate, LayerNorm, the GELU variants the configs name, and bidirectional
//! multi-head attention over a batch of equal-length sequences. All f32.

use rayon::prelude::*;

use crate::LoadError;
use crate::tensor::TensorSource;

/// A row-major view with explicit strides, for products without transposing copies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Strided<'a> {
    data: &'a [f32],
    row_stride: isize,
    col_stride: isize,
}

impl<'a> Strided<'a> {
    pub(crate) fn new(data: &'a [f32], row_stride: usize, col_stride: usize) -> Strided<'a> {
        Strided {
            data,
            row_stride: row_stride as isize,
            col_stride: col_stride as isize,
        }
    }

    fn fits(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows as isize - 1) * self.row_stride + (cols as isize - 1) * self.col_stride;
        (last as usize) < self.data.len()
    }
}

/// `c[m, n] = a[m, k] · b[k, n]`, `c` row-major with row stride `c_row_stride`.
pub(crate) fn gemm(m: usize, k: usize, n: usize, a: Strided<'_>, b: Strided<'_>, c: &mut [f32], c_row_stride: usize) {
    assert!(a.fits(m, k) && b.fits(k, n), "gemm operand out of bounds");
    assert!(
        m == 0 || n == 0 || (m - 1) * c_row_stride + n <= c.len(),
        "gemm output out of bounds"
    );
    let parallelism = if m * n * k < 1 << 18 {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(0)
    };
    // SAFETY: the asserts keep every element the product touches inside the three slices, and
    // `c` is borrowed mutably, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_row_stride as isize,
            false,
            a.data.as_ptr(),
            a.col_stride,
            a.row_stride,
            b.data.as_ptr(),
            b.col_stride,
            b.row_stride,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `y = x·Wᵀ + b`, `W` stored `[out, in]` as transformers stores it.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub(crate) weight: Vec<f32>,
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) input: usize,
    pub(crate) output: usize,
}

impl Linear {
    pub(crate) fn load(
        weights: &dyn TensorSource,
        prefix: &str,
        output: usize,
        input: usize,
        bias: bool,
    ) -> Result<Linear, LoadError> {
        Ok(Linear {
            weight: weights.f32(&format!("{prefix}.weight"), &[output, input])?,
            bias: if bias {
                Some(weights.f32(&format!("{prefix}.bias"), &[output])?)
            } else {
                None
            },
            input,
            output,
        })
    }

    /// A linear layer from parts already loaded (e.g. one slice of a fused QKV matrix).
    pub(crate) fn from_parts(weight: Vec<f32>, bias: Option<Vec<f32>>, output: usize, input: usize) -> Linear {
        debug_assert_eq!(weight.len(), output * input);
        Linear {
            weight,
            bias,
            input,
            output,
        }
    }

    pub(crate) fn output(&self) -> usize {
        self.output
    }

    /// `x` is `[rows, input]`; returns `[rows, output]`.
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = vec![0.0; rows * self.output];
        gemm(
            rows,
            self.input,
            self.output,
            Strided::new(x, self.input, 1),
            Strided::new(&self.weight, 1, self.input),
            &mut y,
            self.output,
        );
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.output) {
                for (value, b) in row.iter_mut().zip(bias) {
                    *value += b;
                }
            }
        }
        y
    }
}

/// LayerNorm with weight and bias over rows of `width`.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    pub(crate) weight: Vec<f32>,
    pub(crate) bias: Vec<f32>,
    pub(crate) eps: f32,
}

impl LayerNorm {
    pub(crate) fn load(
        weights: &dyn TensorSource,
        prefix: &str,
        width: usize,
        eps: f32,
    ) -> Result<LayerNorm, LoadError> {
        Ok(LayerNorm {
            weight: weights.f32(&format!("{prefix}.weight"), &[width])?,
            bias: weights.f32(&format!("{prefix}.bias"), &[width])?,
            eps,
        })
    }

    pub(crate) fn from_parts(weight: Vec<f32>, bias: Vec<f32>, eps: f32) -> LayerNorm {
        LayerNorm { weight, bias, eps }
    }

    pub(crate) fn forward(&self, x: &[f32]) -> Vec<f32> {
        let width = self.weight.len();
        let mut out = vec![0.0; x.len()];
        out.par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .for_each(|(out, row)| {
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                let scale = 1.0 / (var + self.eps as f64).sqrt();
                for (i, o) in out.iter_mut().enumerate() {
                    *o = ((row[i] as f64 - mean) * scale) as f32 * self.weight[i] + self.bias[i];
                }
            });
        out
    }
}

/// The activation functions encoder configs name (`hidden_act`, `projector_hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `gelu`: the exact, erf-based GELU.
    Gelu,
    /// `gelu_pytorch_tanh` / `gelu_new`: the tanh approximation.
    GeluTanh,
    /// `quick_gelu`: `x·σ(1.702x)` (OpenAI CLIP).
    QuickGelu,
    /// `relu`.
    Relu,
}

impl Activation {
    /// The activation a config names, or `None` for one not implemented.
    pub fn parse(name: &str) -> Option<Activation> {
        match name {
            "gelu" => Some(Activation::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Activation::GeluTanh),
            "quick_gelu" => Some(Activation::QuickGelu),
            "relu" => Some(Activation::Relu),
            _ => None,
        }
    }

    pub(crate) fn apply(self, x: &mut [f32]) {
        x.par_chunks_mut(4096).for_each(|chunk| {
            for v in chunk {
                *v = self.scalar(*v);
            }
        });
    }

    fn scalar(self, x: f32) -> f32 {
        match self {
            Activation::Gelu => 0.5 * x * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2) as f32),
            Activation::GeluTanh => {
                let x64 = x as f64;
                let inner = (2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3));
                (0.5 * x64 * (1.0 + inner.tanh())) as f32
            }
            Activation::QuickGelu => x / (1.0 + (-1.702 * x).exp()),
            Activation::Relu => x.max(0.0),
        }
    }
}

/// Bidirectional multi-head self-attention with separate Q, K, V and output projections.
#[derive(Debug, Clone)]
pub(crate) struct SelfAttention {
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) out: Linear,
    pub(crate) heads: usize,
}

impl SelfAttention {
    /// `x` holds `batch` sequences of `len` rows each, `[batch·len, width]`.
    pub(crate) fn forward(&self, x: &[f32], batch: usize, len: usize) -> Vec<f32> {
        let rows = batch * len;
        let q = self.q.forward(x, rows);
        let k = self.k.forward(x, rows);
        let v = self.v.forward(x, rows);
        let width = self.q.output();
        let head_dim = width / self.heads;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut context = vec![0.0f32; rows * width];
        // One task per (sequence, head): scores = q·kᵀ, softmax, then the weighted sum of v.
        let pieces: Vec<(usize, usize, Vec<f32>)> = (0..batch * self.heads)
            .into_par_iter()
            .map(|task| {
                let (item, head) = (task / self.heads, task % self.heads);
                let base = item * len * width + head * head_dim;
                let mut scores = vec![0.0f32; len * len];
                gemm(
                    len,
                    head_dim,
                    len,
                    Strided::new(&q[base..], width, 1),
                    Strided::new(&k[base..], 1, width),
                    &mut scores,
                    len,
                );
                for row in scores.chunks_exact_mut(len) {
                    let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
                    let mut sum = 0.0f32;
                    for s in row.iter_mut() {
                        *s = (*s * scale - max).exp();
                        sum += *s;
                    }
                    for s in row.iter_mut() {
                        *s /= sum;
                    }
                }
                let mut out = vec![0.0f32; len * head_dim];
                gemm(
                    len,
                    len,
                    head_dim,
                    Strided::new(&scores, len, 1),
                    Strided::new(&v[base..], width, 1),
                    &mut out,
                    head_dim,
                );
                (item, head, out)
            })
            .collect();
        for (item, head, out) in pieces {
            for (position, row) in out.chunks_exact(head_dim).enumerate() {
                let start = (item * len + position) * width + head * head_dim;
                context[start..start + head_dim].copy_from_slice(row);
            }
        }
        self.out.forward(&context, rows)
    }
}

/// A two-layer MLP `fc2(act(fc1(x)))`.
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
    pub(crate) act: Activation,
}

impl Mlp {
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut hidden = self.fc1.forward(x, rows);
        self.act.apply(&mut hidden);
        self.fc2.forward(&hidden, rows)
    }
}

/// A pre-LN transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))` (CLIP, SigLIP and
/// Whisper's encoder layers alike).
#[derive(Debug, Clone)]
pub(crate) struct PreNormBlock {
    pub(crate) norm1: LayerNorm,
    pub(crate) attention: SelfAttention,
    pub(crate) norm2: LayerNorm,
    pub(crate) mlp: Mlp,
}

impl PreNormBlock {
    pub(crate) fn forward(&self, x: &mut [f32], batch: usize, len: usize) {
        let attended = self.attention.forward(&self.norm1.forward(x), batch, len);
        add(x, &attended);
        let mlp = self.mlp.forward(&self.norm2.forward(x), batch * len);
        add(x, &mlp);
    }
}

pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
