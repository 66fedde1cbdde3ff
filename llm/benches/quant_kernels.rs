//! The quantized block kernels alone, on every kernel set this CPU has: nanoseconds per
//! 32-value weight block against one activation row (and per row at 2, 8 and 32 rows; from 16
//! rows on, the AVX-512 VNNI set runs the panel kernels, 16 rows a vector), on one thread and
//! on all of them, for SmolLM2-135M's shapes (Q4_1 576→1,536 and 1,536→576, the
//! Q8_0 head 576→49,152), with the weight bytes read per second beside them. The baseline is
//! the portable kernel in the same run. Figures are printed, never asserted.
//!
//! `cargo bench -p switchyard-llm --bench quant_kernels`

use std::hint::black_box;
use std::time::{Duration, Instant};

use switchyard_llm::quant::{BLOCK, Isa, QuantKind, QuantMatrix};

/// A deterministic pseudo-random byte stream.
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect()
}

/// A matrix of valid blocks: small normal f16 scales (and minimums), random integers.
fn matrix(kind: QuantKind, rows: usize, cols: usize) -> QuantMatrix {
    let mut data = bytes(rows as u64 ^ cols as u64, rows * cols / BLOCK * kind.block_bytes());
    let half = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for block in data.chunks_exact_mut(kind.block_bytes()) {
        let scale = half(0.01 + f32::from(block[0]) * 1e-4);
        block[0..2].copy_from_slice(&scale);
        if kind == QuantKind::Q4_1 {
            let minimum = half(-0.05 - f32::from(block[2]) * 1e-4);
            block[2..4].copy_from_slice(&minimum);
        }
    }
    QuantMatrix::new(kind, rows, cols, data).expect("valid shape")
}

fn activations(rows: usize, cols: usize) -> Vec<f32> {
    bytes(99, rows * cols)
        .into_iter()
        .map(|b| f32::from(b) / 128.0 - 1.0)
        .collect()
}

/// Seconds per call of `f`, the best of several runs of at least `budget` each.
fn seconds_per_call(budget: Duration, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let mut calls = 0u32;
        while calls == 0 || start.elapsed() < budget {
            f();
            calls += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / f64::from(calls));
    }
    best
}

fn main() {
    let budget = Duration::from_millis(300);
    let shapes = [
        ("Q4_1 576→1536 (gate, up)", QuantKind::Q4_1, 1536, 576),
        ("Q4_1 1536→576 (down)", QuantKind::Q4_1, 576, 1536),
        ("Q8_0 576→49152 (head)", QuantKind::Q8_0, 49152, 576),
    ];
    // `QUANT_KERNELS_ROWS=512` measures that row count alone (a prefill's, or one case to
    // profile).
    let only_rows: Option<usize> = std::env::var("QUANT_KERNELS_ROWS")
        .ok()
        .and_then(|rows| rows.parse().ok());
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|isa| isa.available()).collect();
    let all_threads = rayon::current_num_threads();
    let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
    // Called from a worker of the pool, as the model's forward pass is.
    let every_thread = rayon::ThreadPoolBuilder::new().build().expect("a pool");
    println!(
        "kernel sets here: {isas:?} (default {:?}); {all_threads} threads",
        switchyard_llm::quant::isa()
    );
    println!(
        "{:<26} {:>4} {:>9} | {:>14} {:>6} {:>10} | {:>14} {:>6} {:>10}",
        "matrix",
        "rows",
        "kernels",
        "1 thread ns",
        "GB/s",
        "/portable",
        format!("{all_threads} threads ns"),
        "GB/s",
        "/portable"
    );
    for (label, kind, outputs, cols) in shapes {
        let weights = matrix(kind, outputs, cols);
        let blocks = (outputs * cols / BLOCK) as f64;
        for rows in only_rows.map_or(vec![1, 2, 8, 32], |rows| vec![rows]) {
            let x = activations(rows, cols);
            // Seconds per product on one thread and on all, per kernel set.
            let figures: Vec<(Isa, [f64; 2])> = isas
                .iter()
                .map(|&isa| {
                    let mut call = || {
                        black_box(weights.matmul_on(isa, black_box(&x), rows));
                    };
                    let alone = one_thread.install(|| seconds_per_call(budget, &mut call));
                    let together = every_thread.install(|| seconds_per_call(budget, &mut call));
                    (isa, [alone, together])
                })
                .collect();
            let portable = figures
                .iter()
                .find(|(isa, _)| *isa == Isa::Portable)
                .map_or([f64::NAN; 2], |(_, f)| *f);
            // Nanoseconds per weight block and activation row.
            let ns = |seconds: f64| seconds * 1e9 / (blocks * rows as f64);
            let gbs = |seconds: f64| weights.bytes() as f64 / seconds / 1e9;
            for (isa, [alone, all]) in figures {
                println!(
                    "{label:<26} {rows:>4} {:>9} | {:>14.2} {:>6.1} {:>9.2}× | {:>14.2} {:>6.1} {:>9.2}×",
                    format!("{isa:?}"),
                    ns(alone),
                    gbs(alone),
                    portable[0] / alone,
                    ns(all),
                    gbs(all),
                    portable[1] / all,
                );
            }
        }
    }
}
