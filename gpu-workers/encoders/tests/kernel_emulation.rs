//! The tiled attention kernel, checked on machines without a GPU: `attention_tiled` is cut out
//! of `src/cuda/kernels.cu` (between its `emulated:` lines), compiled as C++ with a shim that
//! runs each block's 128 threads as real threads with a barrier for `__syncthreads`
//! (`kernel_emulation/attention_tiled.cpp`), and compared with attention computed plainly, on
//! shapes that cover partial tiles, several items, one row and the widest head. NVRTC only
//! proves the kernels compile; this proves the tiling, the masking and the online softmax.
//! Needs a C++20 compiler (`$CXX`, else `c++`; `scripts/test.sh` installs `g++`); without one
//! it says so and passes, unless `SWITCHYARD_KERNEL_EMULATION=required`.

use std::path::Path;
use std::process::Command;

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
    let dir = tempfile::tempdir().expect("temporary folder");
    std::fs::write(dir.path().join("kernel.inc"), kernel_source()).expect("write the kernel");
    let harness = dir.path().join("attention_tiled.cpp");
    std::fs::write(&harness, HARNESS).expect("write the harness");
    let program = dir.path().join("attention_tiled");
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
    let ran = Command::new(Path::new(&program)).output().expect("run the harness");
    let report = String::from_utf8_lossy(&ran.stdout);
    println!("{report}");
    assert!(
        ran.status.success(),
        "attention_tiled differs from plain attention:\n{report}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(report.lines().count(), 7, "every shape reported");
}
