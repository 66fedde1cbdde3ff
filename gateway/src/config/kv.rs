//! `[kv]`: where KV events, registrations and heartbeats come from, and the `[[kv.vllm]]`
//! and `[[kv.sglang]]` adapters.

use serde::Deserialize;

use super::{Checked, Invalid, WorkerConfig, positive};

/// `[kv]`: where KV events, registrations and heartbeats come from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// A NATS server (`nats://host:4222`) for distributed workers and gateway replicas.
    pub nats_url: Option<String>,
    /// The prefix of every NATS subject.
    pub subject_prefix: String,
    /// Share active sequences with the other gateways on the same NATS.
    pub replica_sync: bool,
    /// Heartbeats a registered worker may miss before it leaves the index and the rotation.
    pub heartbeat_misses: u32,
    /// Events buffered per worker while its resync dump is awaited.
    pub resync_buffer: usize,
    /// How long a resync dump is awaited, in milliseconds.
    pub resync_timeout_ms: u64,
    /// vLLM workers whose ZMQ KV event stream is consumed.
    pub vllm: Vec<EngineEventsConfig>,
    /// SGLang workers whose ZMQ KV event stream is consumed.
    pub sglang: Vec<EngineEventsConfig>,
}

impl Default for KvConfig {
    fn default() -> KvConfig {
        KvConfig {
            nats_url: None,
            subject_prefix: "switchyard".into(),
            replica_sync: false,
            heartbeat_misses: 3,
            resync_buffer: 10_000,
            resync_timeout_ms: 2_000,
            vllm: Vec::new(),
            sglang: Vec::new(),
        }
    }
}

/// `[[kv.vllm]]` and `[[kv.sglang]]`: a vLLM or SGLang worker's KV event publisher.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineEventsConfig {
    /// The `[[workers]]` entry (by name) the events describe.
    pub worker: String,
    /// Its ZMQ PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The ZMQ topic to subscribe to (empty: all).
    #[serde(default)]
    pub topic: String,
}

impl KvConfig {
    /// Refuses a NATS URL of another scheme, a subject prefix NATS cannot take, replica sync
    /// without NATS, counts and timeouts of 0, and a vLLM or SGLang adapter for a worker `workers` does
    /// not name or on an endpoint that is not ZMQ's.
    pub(super) fn check(&self, workers: &[WorkerConfig]) -> Checked {
        if let Some(url) = &self.nats_url
            && !(url.starts_with("nats://") || url.starts_with("tls://"))
        {
            return Err(Invalid::new(
                "kv.nats_url",
                format!("`{url}` must be a `nats://host:port` (or `tls://`) URL"),
            ));
        }
        if self.subject_prefix.is_empty()
            || self
                .subject_prefix
                .split('.')
                .any(|token| !switchyard_protocol::kv_events::valid_worker_name(token))
        {
            return Err(Invalid::new(
                "kv.subject_prefix",
                format!(
                    "`{}` must be dot-separated tokens of letters, digits, `-` and `_`",
                    self.subject_prefix
                ),
            ));
        }
        if self.replica_sync && self.nats_url.is_none() {
            return Err(Invalid::new("kv.replica_sync", "needs `kv.nats_url`"));
        }
        positive(&[
            ("kv.heartbeat_misses", u64::from(self.heartbeat_misses)),
            ("kv.resync_buffer", self.resync_buffer as u64),
            ("kv.resync_timeout_ms", self.resync_timeout_ms),
        ])?;
        let adapters = self
            .vllm
            .iter()
            .map(|a| ("vllm", a))
            .chain(self.sglang.iter().map(|a| ("sglang", a)));
        let mut seen = std::collections::HashMap::<&str, usize>::new();
        for (section, adapter) in adapters {
            let index = seen.entry(section).or_default();
            let key = |field: &str| format!("kv.{section}[{index}].{field}");
            if !workers.iter().any(|w| w.display_name() == adapter.worker) {
                return Err(Invalid::new(
                    key("worker"),
                    format!("no `[[workers]]` entry is named `{}`", adapter.worker),
                ));
            }
            if !adapter.endpoint.starts_with("tcp://") && !adapter.endpoint.starts_with("ipc://") {
                return Err(Invalid::new(
                    key("endpoint"),
                    format!(
                        "`{}` must be a `tcp://host:port` or `ipc://` ZMQ endpoint",
                        adapter.endpoint
                    ),
                ));
            }
            *index += 1;
        }
        Ok(())
    }
}
