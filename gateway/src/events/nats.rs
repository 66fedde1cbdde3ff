//! KV events, registrations and replica sync over NATS.
//!
//! A gateway subscribes to every worker's event subject, the heartbeat and leave subjects,
//! and (with `replica_sync`) the active-sequence subject, and hands what arrives to the
//! applier ([`crate::events::applier`]); dumps are NATS requests to the worker's dump subject. The
//! subjects and payloads are documented on `switchyard_protocol::kv_events::Subjects`.
//! Undecodable payloads are logged, counted and dropped; they never stop the subscription.
//! Two gateways on one NATS receive the same events and so converge to the same index; their
//! active sequences meet through the active subject, where each ignores its own updates.

use std::sync::Arc;

use futures_util::StreamExt;
use switchyard_protocol::kv_events::{KvDump, Registration, Subjects, WorkerEvent};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::events::applier::{BoxFuture, DumpSource, Inbound};
use crate::kv::{ActiveUpdate, KvState};

/// Dumps requested over NATS.
#[derive(Debug)]
pub struct NatsDumps {
    client: async_nats::Client,
    subjects: Subjects,
}

impl DumpSource for NatsDumps {
    fn request(&self, worker: String) -> BoxFuture<Result<KvDump, String>> {
        let client = self.client.clone();
        let subject = self.subjects.dump(&worker);
        Box::pin(async move {
            let reply = client
                .request(subject, bytes::Bytes::new())
                .await
                .map_err(|err| format!("dump request failed: {err}"))?;
            serde_json::from_slice::<KvDump>(&reply.payload).map_err(|err| format!("undecodable dump: {err}"))
        })
    }
}

/// Connects to `url`.
///
/// # Errors
///
/// Returns the reason if the server cannot be reached.
pub async fn connect(url: &str) -> Result<async_nats::Client, String> {
    async_nats::ConnectOptions::new()
        .name("switchyard-gateway")
        .retry_on_initial_connect()
        .connect(url)
        .await
        .map_err(|err| err.to_string())
}

/// Subscribes to workers' events and heartbeats (and replicas' active sequences when
/// `replica_sync`), forwarding them to `inbound`.
///
/// # Errors
///
/// Returns the reason if a subscription fails.
pub async fn start(
    client: async_nats::Client,
    subjects: Subjects,
    replica_sync: bool,
    state: Arc<KvState>,
    inbound: mpsc::UnboundedSender<Inbound>,
) -> Result<Vec<JoinHandle<()>>, String> {
    let source: Arc<dyn DumpSource> = Arc::new(NatsDumps {
        client: client.clone(),
        subjects: subjects.clone(),
    });
    let subscribe = |subject: String| {
        let client = client.clone();
        async move {
            client
                .subscribe(subject.clone())
                .await
                .map_err(|err| format!("cannot subscribe to `{subject}`: {err}"))
        }
    };
    let mut tasks = Vec::new();
    let mut events = subscribe(subjects.all_events()).await?;
    let mut heartbeats = subscribe(subjects.heartbeat()).await?;
    let mut leaves = subscribe(subjects.leave()).await?;
    {
        let inbound = inbound.clone();
        let source = source.clone();
        let state = state.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(message) = events.next().await {
                match serde_json::from_slice::<WorkerEvent>(&message.payload) {
                    Ok(event) => {
                        if inbound.send(Inbound::Event(event, source.clone())).is_err() {
                            break;
                        }
                    }
                    Err(err) => undecodable(&state, &message.subject, &err),
                }
            }
        }));
    }
    {
        let inbound = inbound.clone();
        let state = state.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(message) = heartbeats.next().await {
                match serde_json::from_slice::<Registration>(&message.payload) {
                    Ok(registration) => {
                        if inbound.send(Inbound::Heartbeat(registration, source.clone())).is_err() {
                            break;
                        }
                    }
                    Err(err) => undecodable(&state, &message.subject, &err),
                }
            }
        }));
    }
    {
        let inbound = inbound.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(message) = leaves.next().await {
                let worker = String::from_utf8_lossy(&message.payload).into_owned();
                if inbound.send(Inbound::Leave(worker)).is_err() {
                    break;
                }
            }
        }));
    }
    if replica_sync {
        let mut updates = subscribe(subjects.active()).await?;
        let origin = state.origin();
        {
            let state = state.clone();
            tasks.push(tokio::spawn(async move {
                while let Some(message) = updates.next().await {
                    match serde_json::from_slice::<ActiveUpdate>(&message.payload) {
                        Ok(update) if update.origin == origin => {}
                        Ok(update) => {
                            if inbound.send(Inbound::Active(update)).is_err() {
                                break;
                            }
                        }
                        Err(err) => undecodable(&state, &message.subject, &err),
                    }
                }
            }));
        }
        let (out, mut outgoing) = mpsc::unbounded_channel::<ActiveUpdate>();
        state.share_active(out);
        let subject = subjects.active();
        tasks.push(tokio::spawn(async move {
            while let Some(update) = outgoing.recv().await {
                if let Ok(payload) = serde_json::to_vec(&update)
                    && let Err(err) = client.publish(subject.clone(), payload.into()).await
                {
                    tracing::warn!(error = %err, "cannot share an active-sequence update");
                }
            }
        }));
    }
    Ok(tasks)
}

fn undecodable(state: &KvState, subject: &async_nats::Subject, err: &serde_json::Error) {
    tracing::warn!(%subject, error = %err, "undecodable message on a KV subject dropped");
    state
        .metrics
        .events_ignored
        .get_or_create(&vec![("reason", "undecodable".to_string())])
        .inc();
}
