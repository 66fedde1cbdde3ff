//! The paged-attention kernels, checked on machines without a GPU: `src/cuda_kernels.cu` up to
//! its `emulated: end` line (the reductions and both attention kernels) is compiled as C++ with
//! a shim that runs each block's 128 threads as real threads, with barriers for
//! `__syncthreads` and for a warp's shuffles (`kernel_emulation/paged_attention.cpp`), and both
//! kernels (the thread-per-key one also split over the keys and merged by `combine_splits`),
//! over f32 and f16 caches, are compared with causal attention computed plainly over
//! the same paged caches:
//! one position, contexts of several tiles, grouped-query heads, heads of 32 to 128. NVRTC
//! only proves the kernels compile; this proves the paging, the tiling, the online softmax and
//! the value groups. Needs a C++20 compiler (`$CXX`, else `c++`; `scripts/test.sh` installs
//! `g++`); without one it says so and passes, unless `SWITCHYARD_KERNEL_EMULATION=required`.

use switchyard_harness::kernel_emulation;

const KERNELS: &str = include_str!("../../src/cuda_kernels.cu");
const HARNESS: &str = include_str!("kernel_emulation/paged_attention.cpp");

/// The emulated part of the kernels, made plain C++: no `extern "C"`.
fn kernel_source() -> String {
    let end = KERNELS
        .find("// emulated: end")
        .expect("an end line in cuda_kernels.cu");
    KERNELS[..end].replace("extern \"C\" __global__", "__global__")
}

#[test]
fn both_attention_kernels_match_plain_attention_on_the_cpu() {
    let _turn = switchyard_harness::turn();
    let Some(report) = kernel_emulation::compile_and_run("paged_attention", &kernel_source(), HARNESS) else {
        return;
    };
    assert_eq!(
        report.lines().count(),
        30,
        "both kernels and the split one, f32 and f16 caches, on every case"
    );
}
