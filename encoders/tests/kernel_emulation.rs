//! The tiled attention kernel, checked on machines without a GPU: `attention_tiled` is cut out
//! of `src/cuda/kernels.cu` (between its `emulated:` lines), compiled as C++ with a shim that
//! runs each block's 128 threads as real threads with a barrier for `__syncthreads`
//! (`kernel_emulation/attention_tiled.cpp`), and compared with attention computed plainly, on
//! shapes that cover partial tiles, several items, one row and the widest head. NVRTC only
//! proves the kernels compile; this proves the tiling, the masking and the online softmax.
//! Needs a C++20 compiler (`$CXX`, else `c++`; `scripts/test.sh` installs `g++`); without one
//! it says so and passes, unless `SWITCHYARD_KERNEL_EMULATION=required`.

use switchyard_harness::kernel_emulation;

const KERNELS: &str = include_str!("../src/cuda/kernels.cu");
const HARNESS: &str = include_str!("kernel_emulation/attention_tiled.cpp");

/// The kernel's source, made plain C++: no `extern "C"`, its dynamic shared memory the
/// harness's per-block buffer.
fn kernel_source() -> String {
    let begin = KERNELS.find("// emulated: begin").expect("a begin line in kernels.cu");
    let end = KERNELS.find("// emulated: end").expect("an end line in kernels.cu");
    let kernel = &KERNELS[begin..end];
    let shared = "extern __shared__ float tile_memory[];";
    assert!(kernel.contains(shared), "the kernel's shared memory is not `{shared}`");
    kernel
        .replace(shared, "float* tile_memory = dynamic_shared;")
        .replace("extern \"C\" __global__", "__global__")
}

#[test]
fn attention_tiled_matches_plain_attention_on_the_cpu() {
    let Some(report) = kernel_emulation::compile_and_run("attention_tiled", &kernel_source(), HARNESS) else {
        return;
    };
    assert_eq!(report.lines().count(), 7, "every shape reported");
}
