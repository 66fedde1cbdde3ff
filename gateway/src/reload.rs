//! Noticing that files a running gateway loaded have changed.
//!
//! The TLS certificate and the API keys file are loaded at start and again whenever they
//! change, or when the process gets SIGHUP. This module owns noticing that: it watches the
//! folders holding the files (editors and `mv` replace a file rather than rewrite it, so
//! watching the file itself loses it), lets a burst of events settle, and calls the owner's
//! reload once per burst. What a reload means, and what happens when it fails, is the owner's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How long a burst of change events is given to settle before one reload.
const SETTLE: Duration = Duration::from_millis(200);

/// Why files cannot be watched.
#[derive(Debug, thiserror::Error)]
#[error("cannot watch `{path}` for changes: {source}")]
pub struct WatchError {
    /// The file or folder.
    pub path: PathBuf,
    /// The watcher's error.
    pub source: notify::Error,
}

/// Calls `reload` after any of `files` changes (and, on Unix, on SIGHUP), once per burst of
/// changes, until the returned task is aborted.
///
/// # Errors
///
/// Returns [`WatchError`] if a folder holding one of the files cannot be watched.
pub fn on_change(files: &[PathBuf], mut reload: impl FnMut() + Send + 'static) -> Result<JoinHandle<()>, WatchError> {
    let (sender, mut changes) = mpsc::unbounded_channel::<()>();
    let watched: Vec<PathBuf> = files
        .iter()
        .map(|path| std::path::absolute(path).unwrap_or_else(|_| path.clone()))
        .collect();
    let on_change = sender.clone();
    let names = watched.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        if event.kind.is_access() {
            return;
        }
        if event.paths.iter().any(|path| names.iter().any(|name| path == name)) {
            let _ = on_change.send(());
        }
    })
    .map_err(|source| WatchError {
        path: files.first().cloned().unwrap_or_default(),
        source,
    })?;
    let mut folders: Vec<PathBuf> = watched
        .iter()
        .map(|path| {
            path.parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."))
        })
        .collect();
    folders.sort();
    folders.dedup();
    for folder in &folders {
        watcher
            .watch(folder, RecursiveMode::NonRecursive)
            .map_err(|source| WatchError {
                path: folder.clone(),
                source,
            })?;
    }
    #[cfg(unix)]
    {
        let on_signal = sender;
        if let Ok(mut hangups) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            tokio::spawn(async move {
                while hangups.recv().await.is_some() {
                    if on_signal.send(()).is_err() {
                        break;
                    }
                }
            });
        }
    }
    Ok(tokio::spawn(async move {
        // The watcher lives as long as this task.
        let _watcher = watcher;
        while changes.recv().await.is_some() {
            tokio::time::sleep(SETTLE).await;
            while changes.try_recv().is_ok() {}
            reload();
        }
    }))
}
