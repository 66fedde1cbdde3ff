//! The in-process event bus of the embedded default.
//!
//! Embedded mockers and encoders run in the gateway's process, so their KV (and feature-cache)
//! events need no broker: each worker's events are numbered by an [`EventLog`] and handed to the applier as they are, and a
//! dump is read from the same log under the same lock, so it is always consistent with the
//! event ids already sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use switchyard_protocol::kv_events::{EventLog, KvDump, KvEvent};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::events::applier::{BoxFuture, DumpSource, Inbound};

/// Dumps of in-process engines, read from their event logs.
#[derive(Debug, Default)]
pub struct InProcessDumps {
    logs: HashMap<String, Arc<Mutex<EventLog>>>,
}

impl DumpSource for InProcessDumps {
    fn request(&self, worker: String) -> BoxFuture<Result<KvDump, String>> {
        let dump = match self.logs.get(&worker) {
            Some(log) => log
                .lock()
                .map(|log| log.dump())
                .map_err(|_| "event log poisoned".to_string()),
            None => Err(format!("no in-process worker `{worker}`")),
        };
        Box::pin(async move { dump })
    }
}

/// Connects in-process event sources (worker name, its events) to the applier; returns the
/// forwarding tasks.
pub fn connect(
    sources: Vec<(String, mpsc::UnboundedReceiver<KvEvent>)>,
    inbound: mpsc::UnboundedSender<Inbound>,
) -> Vec<JoinHandle<()>> {
    let mut dumps = InProcessDumps::default();
    let mut wiring = Vec::new();
    for (name, events) in sources {
        let log = Arc::new(Mutex::new(EventLog::new(name.clone())));
        dumps.logs.insert(name, log.clone());
        wiring.push((log, events));
    }
    let source: Arc<dyn DumpSource> = Arc::new(dumps);
    wiring
        .into_iter()
        .map(|(log, mut events)| {
            let inbound = inbound.clone();
            let source = source.clone();
            tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    let numbered = match log.lock() {
                        Ok(mut log) => log.record(event),
                        Err(_) => break,
                    };
                    if inbound.send(Inbound::Event(numbered, source.clone())).is_err() {
                        break;
                    }
                }
            })
        })
        .collect()
}
