//! Fleets of gateways: one router policy for every replica, kept in NATS JetStream.
//!
//! With `[fleet]`, the router policy is the fleet's, not the replica's. A policy pushed to any
//! replica is validated there, its component stored once in a JetStream object store (named by
//! its SHA-256), and the fleet's state — the active policy, any rollout (shadow or split) with
//! its candidate, each with the settings it is loaded with — written to the key `router` of a
//! JetStream KV bucket ([`Fleet::set`]; a compare-and-set on the key's revision, so two pushes
//! at once cannot lose one). Every replica watches that key ([`Fleet::spawn`]): on each new
//! revision it fetches the components it does not run yet, checks their hashes, validates and
//! activates them as an upload would, and reports what it runs, or why it refused, under
//! `replica.NAME` in the same bucket ([`Fleet::statuses`]). Rollback writes the key's previous
//! active policy back, so it too is fleet-wide. A replica that starts later reads the key
//! first and converges; while NATS is unreachable every replica keeps the version it runs and
//! serves, and the watch resumes when NATS comes back.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, kv, object_store};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::FleetConfig;
use crate::policy::runtime::{PolicyRuntime, RouterPolicy};
use crate::policy::switch::{PolicySwitch, RolloutMode};

/// The key of the fleet's router state in the KV bucket.
const ROUTER_KEY: &str = "router";

/// Prefix of each replica's status key.
const REPLICA_PREFIX: &str = "replica.";

/// How long a watch that failed (NATS unreachable) first waits before it is tried again; the
/// wait doubles with each failure in a row, up to [`MAX_RETRY`].
const RETRY: Duration = Duration::from_secs(1);

/// The longest wait between tries.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// Revisions of each key the fleet's KV bucket keeps (how far back rollback can look).
const KV_HISTORY: i64 = 16;

/// Largest component the fleet stores.
const MAX_COMPONENT_BYTES: usize = 16 << 20;

/// Why a fleet operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FleetError {
    /// NATS or JetStream did not answer.
    #[error("the fleet's NATS JetStream is unavailable: {0}")]
    Unavailable(String),
    /// The operation needs state the fleet does not have.
    #[error("{0}")]
    Conflict(String),
}

fn unavailable(err: impl std::fmt::Display) -> FleetError {
    FleetError::Unavailable(err.to_string())
}

/// A policy as the fleet names it: the component by hash, and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PolicyRef {
    /// The policy's name.
    pub(crate) name: String,
    /// SHA-256 of the component (the object's name in the store), as hex.
    pub(crate) sha256: String,
    /// The policy's own settings, as TOML text.
    #[serde(default)]
    pub(crate) config: String,
}

/// A fleet-wide rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FleetRollout {
    /// The candidate.
    pub(crate) candidate: PolicyRef,
    /// `shadow` or `split`.
    pub(crate) mode: String,
    /// Share of requests under `split`.
    #[serde(default)]
    pub(crate) percent: u8,
    /// The header whose hash makes split decisions sticky.
    #[serde(default)]
    pub(crate) key: Option<String>,
}

/// The fleet's router state: the value of the `router` key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FleetRouter {
    /// The active policy.
    pub(crate) active: PolicyRef,
    /// A rollout in progress.
    #[serde(default)]
    pub(crate) rollout: Option<FleetRollout>,
}

/// What one replica runs of the fleet's state, as it reported it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ReplicaStatus {
    /// The replica.
    pub(crate) replica: String,
    /// The revision of the `router` key it last acted on.
    pub(crate) revision: u64,
    /// `active` (it runs that revision) or `refused`.
    pub(crate) outcome: String,
    /// Why it refused.
    #[serde(default)]
    pub(crate) error: Option<String>,
    /// The policy it runs now (`NAME@SHA-PREFIX`).
    pub(crate) running: String,
    /// When it reported, in milliseconds since the Unix epoch.
    pub(crate) at_unix_ms: u64,
}

/// A replica's handle on its fleet.
#[derive(Debug)]
pub(crate) struct Fleet {
    replica: String,
    client: async_nats::Client,
    kv_bucket: String,
    objects_bucket: String,
    runtime: Arc<PolicyRuntime>,
    switch: Arc<PolicySwitch>,
    /// The last revision of `router` this replica acted on.
    applied: watch::Sender<u64>,
}

impl Fleet {
    /// Joins the fleet of `config` (connecting in the background: a NATS that is down at start
    /// does not stop the gateway).
    ///
    /// # Errors
    ///
    /// The reason when the URL is unusable.
    pub(crate) async fn connect(
        config: &FleetConfig,
        runtime: Arc<PolicyRuntime>,
        switch: Arc<PolicySwitch>,
    ) -> Result<Fleet, String> {
        let client = async_nats::ConnectOptions::new()
            .name("switchyard-gateway-fleet")
            .retry_on_initial_connect()
            .connect(&config.nats_url)
            .await
            .map_err(|err| err.to_string())?;
        Ok(Fleet {
            replica: config.replica_name(),
            client,
            kv_bucket: format!("{}-fleet", config.bucket),
            objects_bucket: format!("{}-policies", config.bucket),
            runtime,
            switch,
            applied: watch::Sender::new(0),
        })
    }

    /// This replica's name in the fleet.
    pub(crate) fn replica(&self) -> &str {
        &self.replica
    }

    async fn buckets(&self) -> Result<(kv::Store, object_store::ObjectStore), FleetError> {
        let context = jetstream::new(self.client.clone());
        let store = match context.get_key_value(&self.kv_bucket).await {
            Ok(store) => store,
            Err(_) => {
                // The KV bucket's stream is made here, as the KV convention has it, rather than
                // with `create_key_value`, whose answer from the nats-server 2.9 that Debian
                // ships does not parse; another replica making it first is no error.
                let made = context
                    .create_stream(jetstream::stream::Config {
                        name: format!("KV_{}", self.kv_bucket),
                        description: Some("Switchyard fleet: the router policy and each replica's status".into()),
                        subjects: vec![format!("$KV.{}.>", self.kv_bucket)],
                        max_messages_per_subject: KV_HISTORY,
                        discard: jetstream::stream::DiscardPolicy::New,
                        allow_rollup: true,
                        deny_delete: true,
                        allow_direct: true,
                        ..Default::default()
                    })
                    .await;
                if let Err(err) = made {
                    tracing::debug!(error = %err, "fleet KV stream not made here (another replica may have)");
                }
                context.get_key_value(&self.kv_bucket).await.map_err(unavailable)?
            }
        };
        let objects = match context.get_object_store(&self.objects_bucket).await {
            Ok(objects) => objects,
            Err(_) => context
                .create_object_store(object_store::Config {
                    bucket: self.objects_bucket.clone(),
                    description: Some("Switchyard fleet: policy components by SHA-256".into()),
                    ..Default::default()
                })
                .await
                .map_err(unavailable)?,
        };
        Ok((store, objects))
    }

    /// The fleet's router state and its revision, if one was ever set.
    pub(crate) async fn router(&self) -> Result<Option<(FleetRouter, u64)>, FleetError> {
        let (store, _) = self.buckets().await?;
        let entry = store.entry(ROUTER_KEY).await.map_err(unavailable)?;
        Ok(entry
            .filter(|entry| entry.operation == kv::Operation::Put)
            .and_then(|entry| Some((serde_json::from_slice(&entry.value).ok()?, entry.revision))))
    }

    /// Stores `wasm` (already validated here) in the fleet under its hash.
    pub(crate) async fn store_component(&self, wasm: &[u8]) -> Result<String, FleetError> {
        let sha256 = hex(&Sha256::digest(wasm));
        let (_, objects) = self.buckets().await?;
        if objects.info(&sha256).await.is_err() {
            let mut reader = wasm;
            objects.put(sha256.as_str(), &mut reader).await.map_err(unavailable)?;
        }
        Ok(sha256)
    }

    /// Changes the fleet's router state with `change` (given the current one), atomically
    /// against other replicas' changes, and waits (up to 5 s) until this replica has acted on
    /// it. Answers the new revision.
    ///
    /// # Errors
    ///
    /// [`FleetError::Conflict`] when `change` refuses; [`FleetError::Unavailable`] when NATS is.
    pub(crate) async fn set(
        &self,
        change: impl Fn(Option<&FleetRouter>) -> Result<FleetRouter, FleetError>,
    ) -> Result<u64, FleetError> {
        let (store, _) = self.buckets().await?;
        for _ in 0..8 {
            let current = store.entry(ROUTER_KEY).await.map_err(unavailable)?;
            let state = current
                .as_ref()
                .filter(|entry| entry.operation == kv::Operation::Put)
                .and_then(|entry| serde_json::from_slice::<FleetRouter>(&entry.value).ok());
            let next = change(state.as_ref())?;
            let value = serde_json::to_vec(&next).map_err(unavailable)?;
            let written = match &current {
                Some(entry) => store
                    .update(ROUTER_KEY, value.into(), entry.revision)
                    .await
                    .map_err(|e| e.to_string()),
                None => store.create(ROUTER_KEY, value.into()).await.map_err(|e| e.to_string()),
            };
            match written {
                Ok(revision) => {
                    let mut applied = self.applied.subscribe();
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), applied.wait_for(|applied| *applied >= revision))
                            .await;
                    return Ok(revision);
                }
                // Another replica changed it first: read it again.
                Err(err) if err.contains("wrong last sequence") || err.contains("key exists") => continue,
                Err(err) => return Err(FleetError::Unavailable(err)),
            }
        }
        Err(FleetError::Conflict(
            "the fleet's router state kept changing under this write; try again".into(),
        ))
    }

    /// The newest earlier active policy in the key's history that differs from `current`.
    pub(crate) async fn previous_active(&self, current: &PolicyRef) -> Result<Option<PolicyRef>, FleetError> {
        let (store, _) = self.buckets().await?;
        let mut history = store.history(ROUTER_KEY).await.map_err(unavailable)?;
        let mut states = Vec::new();
        while let Some(entry) = history.next().await {
            let entry = entry.map_err(unavailable)?;
            if let Ok(state) = serde_json::from_slice::<FleetRouter>(&entry.value) {
                states.push(state.active);
            }
        }
        Ok(states.into_iter().rev().find(|active| active != current))
    }

    /// Every replica's last report.
    pub(crate) async fn statuses(&self) -> Result<Vec<ReplicaStatus>, FleetError> {
        let (store, _) = self.buckets().await?;
        let mut keys = store.keys().await.map_err(unavailable)?;
        let mut names = Vec::new();
        while let Some(key) = keys.next().await {
            let key = key.map_err(unavailable)?;
            if key.starts_with(REPLICA_PREFIX) {
                names.push(key);
            }
        }
        let mut statuses = Vec::new();
        for name in names {
            if let Some(value) = store.get(&name).await.map_err(unavailable)?
                && let Ok(status) = serde_json::from_slice::<ReplicaStatus>(&value)
            {
                statuses.push(status);
            }
        }
        statuses.sort_by(|a, b| a.replica.cmp(&b.replica));
        Ok(statuses)
    }

    /// Watches the fleet's router state and acts on each revision, until the task is aborted.
    pub(crate) fn spawn(self: &Arc<Self>) -> JoinHandle<()> {
        let fleet = self.clone();
        tokio::spawn(async move {
            let mut wait = RETRY;
            loop {
                let watched_from = *fleet.applied.borrow();
                if let Err(err) = fleet.follow().await {
                    tracing::warn!(error = %err, retry_in = ?wait, "fleet watch interrupted; this replica keeps its policy and retries");
                }
                // A watch that got anywhere starts the backoff again.
                if *fleet.applied.borrow() > watched_from {
                    wait = RETRY;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(MAX_RETRY);
            }
        })
    }

    async fn follow(&self) -> Result<(), FleetError> {
        let (store, objects) = self.buckets().await?;
        let mut updates = store.watch_with_history(ROUTER_KEY).await.map_err(unavailable)?;
        while let Some(entry) = updates.next().await {
            let entry = entry.map_err(unavailable)?;
            if entry.operation != kv::Operation::Put || entry.revision <= *self.applied.borrow() {
                continue;
            }
            let outcome = match serde_json::from_slice::<FleetRouter>(&entry.value) {
                Ok(state) => self.apply(&state, &objects).await,
                Err(err) => Err(format!("the fleet's router state does not parse: {err}")),
            };
            if let Err(err) = &outcome {
                tracing::error!(revision = entry.revision, error = %err, "fleet policy refused here; this replica keeps its policy");
            }
            self.report(&store, entry.revision, outcome.err()).await;
            self.applied.send_replace(entry.revision);
        }
        Err(FleetError::Unavailable("the watch ended".into()))
    }

    /// Makes this replica run `state`: a policy whose name, component or settings differ from
    /// what runs here is loaded, so new settings for the same component take effect too.
    async fn apply(&self, state: &FleetRouter, objects: &object_store::ObjectStore) -> Result<(), String> {
        let active = self.switch.active();
        if !runs(&active.policy, &state.active)? {
            let policy = self.load(&state.active, objects).await?;
            self.switch.publish(policy);
        }
        match &state.rollout {
            None => {
                if self.switch.rollout().is_some() {
                    self.switch.stop_rollout();
                }
            }
            Some(rollout) => {
                let mode = match rollout.mode.as_str() {
                    "shadow" => RolloutMode::Shadow,
                    "split" => RolloutMode::Split {
                        percent: rollout.percent.min(100),
                    },
                    other => return Err(format!("unknown rollout mode `{other}`")),
                };
                let same = match self.switch.rollout() {
                    Some(current) => {
                        runs(&current.candidate.policy, &rollout.candidate)?
                            && current.mode == mode
                            && current.key_header == rollout.key
                    }
                    None => false,
                };
                if !same {
                    let candidate = self.load(&rollout.candidate, objects).await?;
                    self.switch.start_rollout(candidate, mode, rollout.key.clone());
                }
            }
        }
        Ok(())
    }

    /// Fetches, checks and validates the component `policy` names.
    async fn load(&self, policy: &PolicyRef, objects: &object_store::ObjectStore) -> Result<Arc<RouterPolicy>, String> {
        let mut object = objects.get(&policy.sha256).await.map_err(|err| {
            format!(
                "component {} of `{}` cannot be fetched: {err}",
                policy.sha256, policy.name
            )
        })?;
        let mut wasm = Vec::new();
        (&mut object)
            .take(MAX_COMPONENT_BYTES as u64 + 1)
            .read_to_end(&mut wasm)
            .await
            .map_err(|err| format!("component {} of `{}` cannot be read: {err}", policy.sha256, policy.name))?;
        let sha256 = hex(&Sha256::digest(&wasm));
        if sha256 != policy.sha256 {
            return Err(format!(
                "component of `{}` has SHA-256 {sha256}, not the {} the fleet names",
                policy.name, policy.sha256
            ));
        }
        let config = settings(policy)?;
        let (runtime, name) = (self.runtime.clone(), policy.name.clone());
        tokio::task::spawn_blocking(move || runtime.load_router(&name, &wasm, config))
            .await
            .map_err(|err| format!("validation failed: {err}"))?
            .map(Arc::new)
            .map_err(|err| format!("`{}` refused here: {err}", policy.name))
    }

    async fn report(&self, store: &kv::Store, revision: u64, error: Option<String>) {
        let status = ReplicaStatus {
            replica: self.replica.clone(),
            revision,
            outcome: if error.is_none() { "active" } else { "refused" }.into(),
            error,
            running: self.switch.active().label(),
            at_unix_ms: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |since| since.as_millis() as u64),
        };
        let Ok(value) = serde_json::to_vec(&status) else { return };
        if let Err(err) = store
            .put(format!("{REPLICA_PREFIX}{}", self.replica), value.into())
            .await
        {
            tracing::warn!(error = %err, "cannot report this replica's policy to the fleet");
        }
    }
}

/// Lower-case hex of `bytes`.
/// Whether `policy` is what `wanted` names: the same name, component and settings.
fn runs(policy: &RouterPolicy, wanted: &PolicyRef) -> Result<bool, String> {
    Ok(policy.sha256 == wanted.sha256 && policy.name == wanted.name && *policy.settings() == settings(wanted)?)
}

/// The settings `policy` names, as a table.
fn settings(policy: &PolicyRef) -> Result<toml::Table, String> {
    toml::from_str(&policy.config).map_err(|err| format!("settings of `{}` are not TOML: {err}", policy.name))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The key of the planning lease in the fleet's KV bucket.
const PLANNER_LEASE_KEY: &str = "planner-lease";

/// Who holds the planning lease, and until when.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseHolder {
    replica: String,
    expires_unix_ms: u64,
}

/// The fleet's planning lease: exactly one replica plans. The holder renews it at every
/// adjustment; when it stops (crashed, partitioned from NATS), the lease lapses after its
/// duration and the next replica to ask takes it. Every change is a compare-and-set on the
/// key's revision, so two replicas can never both take it.
#[derive(Debug)]
pub(crate) struct PlanningLease {
    fleet: Arc<Fleet>,
    duration: Duration,
}

impl PlanningLease {
    /// The lease of `fleet`, held for `duration` from each renewal.
    pub(crate) fn new(fleet: Arc<Fleet>, duration: Duration) -> PlanningLease {
        PlanningLease { fleet, duration }
    }

    async fn try_hold(&self) -> Result<bool, FleetError> {
        let (store, _) = self.fleet.buckets().await?;
        let now = unix_ms();
        let mine = LeaseHolder {
            replica: self.fleet.replica.clone(),
            expires_unix_ms: now + self.duration.as_millis() as u64,
        };
        let value: bytes::Bytes = serde_json::to_vec(&mine).map_err(unavailable)?.into();
        let current = store.entry(PLANNER_LEASE_KEY).await.map_err(unavailable)?;
        let holder = current
            .as_ref()
            .filter(|entry| entry.operation == kv::Operation::Put)
            .and_then(|entry| serde_json::from_slice::<LeaseHolder>(&entry.value).ok());
        let free = holder
            .as_ref()
            .is_none_or(|holder| holder.replica == mine.replica || holder.expires_unix_ms <= now);
        if !free {
            return Ok(false);
        }
        let written = match &current {
            Some(entry) => store.update(PLANNER_LEASE_KEY, value, entry.revision).await.is_ok(),
            None => store.create(PLANNER_LEASE_KEY, value).await.is_ok(),
        };
        if written && holder.as_ref().is_none_or(|holder| holder.replica != mine.replica) {
            tracing::info!(replica = %mine.replica, "this replica holds the planning lease");
        }
        Ok(written)
    }
}

impl crate::planner::Lease for PlanningLease {
    fn hold(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>> {
        Box::pin(async move {
            match self.try_hold().await {
                Ok(held) => held,
                Err(err) => {
                    // Without NATS nobody can know who plans: hold every pool (plan nothing).
                    tracing::warn!(error = %err, "cannot reach the planning lease: not planning this interval");
                    false
                }
            }
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
