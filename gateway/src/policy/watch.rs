//! Publishing policies dropped into a watched directory.
//!
//! When a file `NAME.wasm` in the directory is created or rewritten, it is loaded (compiled or
//! taken from the cache, validated, self-tested) and published as router policy `NAME`. A file
//! that fails is logged and counted, and the active policy stays. Files changed together (within
//! the 50 ms a burst of events is given to settle) are each loaded once, in the order they
//! changed, so the last one published is the active one. Outcomes are counted in
//! `switchyard_policy_watch_total{outcome}` (`published`, `refused`, `failed`). Write files
//! elsewhere and rename them in, so the watcher never sees half a file; files present at start
//! are not loaded (the configured `router` is).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::policy::PolicyError;
use crate::policy::runtime::PolicyRuntime;
use crate::policy::switch::PolicySwitch;

/// Outcomes of watched files, labelled `outcome`.
pub type WatchOutcomes = Family<Vec<(&'static str, String)>, Counter>;

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
    outcomes: WatchOutcomes,
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
        while let Some(first) = changes.recv().await {
            // Let a burst of events settle, then load each file that changed once.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut paths = vec![first];
            while let Ok(path) = changes.try_recv() {
                if !paths.contains(&path) {
                    paths.push(path);
                }
            }
            for path in paths {
                let outcome = load_and_publish(&path, &runtime, &switch, &config).await;
                outcomes.get_or_create(&vec![("outcome", outcome.to_string())]).inc();
            }
        }
    }))
}

/// Loads `path` and publishes it; answers the outcome's label.
async fn load_and_publish(
    path: &Path,
    runtime: &Arc<PolicyRuntime>,
    switch: &PolicySwitch,
    config: &toml::Table,
) -> &'static str {
    let Some(name) = path.file_stem().and_then(|stem| stem.to_str()).map(str::to_string) else {
        tracing::warn!(file = %path.display(), "watched policy file name is not UTF-8; skipped");
        return "refused";
    };
    let (runtime, config, file) = (runtime.clone(), config.clone(), path.to_path_buf());
    let loaded = tokio::task::spawn_blocking(move || {
        let wasm = std::fs::read(&file)
            .map_err(|err| PolicyError::Invalid(format!("cannot read `{}`: {err}", file.display())))?;
        runtime.load_router(&name, &wasm, config)
    })
    .await;
    match loaded {
        Ok(Ok(policy)) => {
            switch.publish(Arc::new(policy));
            "published"
        }
        Ok(Err(err)) => {
            tracing::warn!(file = %path.display(), error = %err, "watched policy refused; the active one stays");
            "refused"
        }
        Err(err) => {
            tracing::warn!(file = %path.display(), error = %err, "loading a watched policy failed");
            "failed"
        }
    }
}
