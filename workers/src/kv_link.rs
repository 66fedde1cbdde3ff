//! A worker's link to the routing layer over NATS.
//!
//! [`run`] numbers the engine's KV events with an [`EventLog`] and publishes them on the
//! worker's event subject, heartbeats its [`Registration`] (with its newest event id), answers
//! dump requests from the log, and says goodbye when it stops. The subjects and payloads are
//! documented on [`Subjects`]. For fault-injection runs, `drop_every` loses every N-th event
//! on purpose (it is still numbered), which is what a lossy transport does to a gateway.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;

use switchyard_protocol::kv_events::{EventLog, KvEvent, Registration, Subjects};

/// How long a stopping worker tries to say goodbye.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the link stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// Subscribing to the dump subject failed.
    #[error("cannot subscribe to `{subject}`: {reason}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// Why.
        reason: String,
    },
}

/// Link settings.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// The subjects.
    pub subjects: Subjects,
    /// What the worker announces (its `last_event_id` is filled in at each beat).
    pub registration: Registration,
    /// Lose every N-th event on purpose (fault injection); `None` loses nothing.
    pub drop_every: Option<u64>,
    /// Turns true when the worker's reclaim notice comes (spot capacity): the link heartbeats
    /// at once with `preempting` set, so gateways stop routing to it without waiting a beat.
    pub preempting: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Runs the link until `events` closes (the engine stopped) or `stop` fires.
///
/// # Errors
///
/// Returns [`LinkError`] if the dump subject cannot be subscribed.
pub async fn run(
    client: async_nats::Client,
    config: LinkConfig,
    mut events: mpsc::UnboundedReceiver<KvEvent>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), LinkError> {
    let worker = config.registration.worker.clone();
    let subjects = config.subjects.clone();
    let log = Arc::new(Mutex::new(EventLog::new(worker.clone())));
    let dump_subject = subjects.dump(&worker);
    let mut dumps = client
        .subscribe(dump_subject.clone())
        .await
        .map_err(|err| LinkError::Subscribe {
            subject: dump_subject,
            reason: err.to_string(),
        })?;
    let event_subject = subjects.events(&worker);
    let mut ticker = tokio::time::interval(Duration::from_millis(config.registration.heartbeat_ms.max(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut registration = config.registration.clone();
    let mut preempting = config.preempting.clone();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            event = events.recv() => {
                let Some(event) = event else { break };
                let numbered = match log.lock() {
                    Ok(mut log) => log.record(event),
                    Err(_) => break,
                };
                if config.drop_every.is_some_and(|n| n > 0 && numbered.event_id % n == 0) {
                    tracing::debug!(event_id = numbered.event_id, "dropping a KV event on purpose (fault injection)");
                    continue;
                }
                match serde_json::to_vec(&numbered) {
                    Ok(payload) => {
                        if let Err(err) = client.publish(event_subject.clone(), payload.into()).await {
                            tracing::warn!(error = %err, "cannot publish a KV event");
                        }
                    }
                    Err(err) => tracing::error!(error = %err, "cannot encode a KV event"),
                }
            }
            request = dumps.next() => {
                let Some(request) = request else { break };
                let Some(reply) = request.reply else { continue };
                let dump = match log.lock() {
                    Ok(log) => log.dump(),
                    Err(_) => break,
                };
                match serde_json::to_vec(&dump) {
                    Ok(payload) => {
                        if let Err(err) = client.publish(reply, payload.into()).await {
                            tracing::warn!(error = %err, "cannot answer a dump request");
                        }
                    }
                    Err(err) => tracing::error!(error = %err, "cannot encode a dump"),
                }
            }
            _ = ticker.tick() => heartbeat(&client, &subjects, &log, &mut registration).await,
            () = notice(&mut preempting) => {
                registration.preempting = true;
                heartbeat(&client, &subjects, &log, &mut registration).await;
            }
            _ = &mut stop => break,
        }
    }
    // A worker stopping while NATS is gone must not wait for it to come back: the gateways
    // drop it when its heartbeats stop anyway.
    let goodbye = async {
        let _ = client.publish(subjects.leave(), worker.clone().into()).await;
        let _ = client.flush().await;
    };
    if tokio::time::timeout(GOODBYE_TIMEOUT, goodbye).await.is_err() {
        tracing::warn!(%worker, "NATS unreachable: left without a goodbye");
    }
    Ok(())
}

/// Publishes the registration with the newest event id.
async fn heartbeat(
    client: &async_nats::Client,
    subjects: &Subjects,
    log: &Mutex<EventLog>,
    registration: &mut Registration,
) {
    registration.last_event_id = log.lock().map(|log| log.last_event_id()).unwrap_or(0);
    match serde_json::to_vec(&registration) {
        Ok(payload) => {
            if let Err(err) = client.publish(subjects.heartbeat(), payload.into()).await {
                tracing::warn!(error = %err, "cannot publish a heartbeat");
            }
        }
        Err(err) => tracing::error!(error = %err, "cannot encode the registration"),
    }
}

/// Resolves once, when the reclaim notice comes; never without a notice channel.
async fn notice(preempting: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    let Some(receiver) = preempting else {
        return std::future::pending().await;
    };
    if receiver.wait_for(|preempting| *preempting).await.is_err() {
        // The sender is gone without a notice: there will never be one.
        *preempting = None;
        return std::future::pending().await;
    }
    // Told once: later calls wait forever.
    *preempting = None;
}
