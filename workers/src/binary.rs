//! How every worker binary starts: a tokio runtime, logs to stderr, and an error that ends the
//! process with a message naming the binary.

use std::future::Future;
use std::process::ExitCode;

/// Runs `run` to its end on a multi-thread runtime (`worker_threads` of them when given, else
/// one per core) with logs on stderr filtered by `RUST_LOG` (default `info`). An error is
/// printed as `NAME: error: …` with its causes, and the process exits with 1.
pub fn main<F>(name: &str, worker_threads: Option<usize>, run: impl FnOnce() -> F) -> ExitCode
where
    F: Future<Output = anyhow::Result<()>>,
{
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("{name}: error: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
            .with_writer(std::io::stderr)
            .init();
        run().await
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{name}: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
