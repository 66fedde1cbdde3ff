//! Waiting for a supervisor's stop: SIGINT or SIGTERM (ctrl-c off Unix), for the worker and
//! encoder binaries' graceful drain.

use std::future::Future;

/// Installs the signal handlers now and returns a future that resolves on the first SIGINT or
/// SIGTERM. Call it before printing a ready line, so a supervisor's SIGTERM is never the
/// default (abrupt) one.
///
/// # Errors
///
/// The I/O error if a handler cannot be installed.
pub fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
