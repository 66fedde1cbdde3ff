//! Runs a CUDA kernel on the CPU for tests on machines without a GPU: the kernel's source,
//! made plain C++, is compiled beside a C++20 harness that runs each block's threads as real
//! threads (`llm/tests/all/kernel_emulation/` and
//! `encoders/tests/kernel_emulation/` hold the LLM's and the encoders' harnesses).
//! NVRTC only proves a kernel compiles; this runs it.

use std::process::Command;

/// Writes `kernel` as `kernel.inc` beside `harness` (C++20 source that includes it), compiles
/// them with `$CXX` (else `c++`), runs the program and returns what it printed.
///
/// Returns `None`, with a note, where there is no compiler, unless
/// `SWITCHYARD_KERNEL_EMULATION=required`.
///
/// # Panics
///
/// Fails the test if the harness does not compile or the program exits non-zero (a kernel
/// that differs from its reference), or where a compiler is required and missing.
pub fn compile_and_run(name: &str, kernel: &str, harness: &str) -> Option<String> {
    let dir = tempfile::tempdir().expect("temporary folder");
    std::fs::write(dir.path().join("kernel.inc"), kernel).expect("write the kernel");
    let source = dir.path().join(format!("{name}.cpp"));
    std::fs::write(&source, harness).expect("write the harness");
    let program = dir.path().join(name);
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-o"])
        .arg(&program)
        .arg(&source)
        .output();
    let built = match built {
        Ok(output) => output,
        Err(err) if std::env::var("SWITCHYARD_KERNEL_EMULATION").as_deref() != Ok("required") => {
            eprintln!(
                "skipped: no C++ compiler `{compiler}` ({err}); SWITCHYARD_KERNEL_EMULATION=required makes this a failure"
            );
            return None;
        }
        Err(err) => panic!("no C++ compiler `{compiler}`: {err}"),
    };
    assert!(
        built.status.success(),
        "the {name} harness does not compile:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&program).output().expect("run the harness");
    let report = String::from_utf8_lossy(&ran.stdout).into_owned();
    println!("{report}");
    assert!(
        ran.status.success(),
        "{name}: a kernel differs from its reference:\n{report}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    Some(report)
}
