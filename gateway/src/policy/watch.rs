//! Publishing policies dropped into a watched directory.
//!
//! When a file `NAME.wasm` in the directory is created or rewritten, it is loaded (compiled or
//! taken from the cache, validated, self-tested) and published as router policy `NAME`. A file
//! that fails is logged and counted, and the active policy stays. Write files elsewhere and
//! rename them in, so the watcher never sees half a file; files present at start are not
//! loaded (the configured `router` is).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::policy::PolicyError;
use crate::policy::runtime::PolicyRuntime;
use crate::policy::switch::PolicySwitch;

/// Starts watching `dir`; the watch ends when the returned task is aborted.
///
/// # Errors
///
/// Returns [`PolicyError::Invalid`] if the directory cannot be watched.
pub fn spawn(
    dir: &Path,
    runtime: Arc<PolicyRuntime>,
    switch: Arc<PolicySwitch>,
    config: toml::Table,
) -> Result<JoinHandle<()>, PolicyError> {
    let (sender, mut changes) = mpsc::unbounded_channel::<PathBuf>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        if matches!(event.kind, EventKind::Create(_) | EventKind::Modify(_)) {
            for path in event.paths {
                if path.extension().is_some_and(|ext| ext == "wasm") {
                    let _ = sender.send(path);
                }
            }
        }
    })
    .map_err(|err| PolicyError::Invalid(format!("cannot watch `{}`: {err}", dir.display())))?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .map_err(|err| PolicyError::Invalid(format!("cannot watch `{}`: {err}", dir.display())))?;
    Ok(tokio::spawn(async move {
        // The watcher lives as long as this task.
        let _watcher = watcher;
        while let Some(path) = changes.recv().await {
            // Let a burst of events for one write settle, then load once.
            tokio::time::sleep(Duration::from_millis(50)).await;
            while changes.try_recv().is_ok() {}
            let Some(name) = path.file_stem().and_then(|stem| stem.to_str()).map(str::to_string) else {
                continue;
            };
            let (runtime, config, file) = (runtime.clone(), config.clone(), path.clone());
            let loaded = tokio::task::spawn_blocking(move || {
                let wasm = std::fs::read(&file)
                    .map_err(|err| PolicyError::Invalid(format!("cannot read `{}`: {err}", file.display())))?;
                runtime.load_router(&name, &wasm, config)
            })
            .await;
            match loaded {
                Ok(Ok(policy)) => {
                    switch.publish(Arc::new(policy));
                }
                Ok(Err(err)) => {
                    tracing::warn!(file = %path.display(), error = %err, "watched policy refused; the active one stays")
                }
                Err(err) => tracing::warn!(file = %path.display(), error = %err, "loading a watched policy failed"),
            }
        }
    }))
}
