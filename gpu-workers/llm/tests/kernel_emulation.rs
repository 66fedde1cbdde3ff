//! The paged-attention kernels, checked on machines without a GPU: `src/cuda_kernels.cu` up to
//! its `emulated: end` line (the reductions and both attention kernels) is compiled as C++ with
//! a shim that runs each block's 128 threads as real threads, with barriers for
//! `__syncthreads` and for a warp's shuffles (`kernel_emulation/paged_attention.cpp`), and both
//! kernels are compared with causal attention computed plainly over the same paged caches:
//! one position, contexts of several tiles, grouped-query heads, heads of 32 to 128. NVRTC
//! only proves the kernels compile; this proves the paging, the tiling, the online softmax and
//! the value groups. Needs a C++20 compiler (`$CXX`, else `c++`; `scripts/test.sh` installs
//! `g++`); without one it says so and passes, unless `SWITCHYARD_KERNEL_EMULATION=required`.

use std::process::Command;

const KERNELS: &str = include_str!("../src/cuda_kernels.cu");
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
    let dir = tempfile::tempdir().expect("temporary folder");
    std::fs::write(dir.path().join("kernel.inc"), kernel_source()).expect("write the kernels");
    let harness = dir.path().join("paged_attention.cpp");
    std::fs::write(&harness, HARNESS).expect("write the harness");
    let program = dir.path().join("paged_attention");
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-o"])
        .arg(&program)
        .arg(&harness)
        .output();
    let built = match built {
        Ok(output) => output,
        Err(err) if std::env::var("SWITCHYARD_KERNEL_EMULATION").as_deref() != Ok("required") => {
            eprintln!(
                "skipped: no C++ compiler `{compiler}` ({err}); SWITCHYARD_KERNEL_EMULATION=required makes this a failure"
            );
            return;
        }
        Err(err) => panic!("no C++ compiler `{compiler}`: {err}"),
    };
    assert!(
        built.status.success(),
        "the harness does not compile:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&program).output().expect("run the harness");
    let report = String::from_utf8_lossy(&ran.stdout);
    println!("{report}");
    assert!(
        ran.status.success(),
        "an attention kernel differs from plain attention:\n{report}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(report.lines().count(), 10, "both kernels on every case");
}
