//! `[admission]`: when requests wait in the gateway instead of piling onto full workers, and
//! in what order they leave.

use serde::Deserialize;

/// `[admission]`: the gateway's admission queue. Absent: every request goes to a worker at
/// once.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// A worker is full with this many requests in flight.
    #[serde(default)]
    pub max_requests: Option<u32>,
    /// A worker is full when the KV blocks of its active requests reach this share of its
    /// `capacity_blocks` (0 < share ≤ 1; workers of unknown capacity are never full by it).
    #[serde(default)]
    pub max_kv_usage: Option<f64>,
    /// A worker is full with this many prompt tokens routed to it and not yet prefilled.
    #[serde(default)]
    pub max_prefill_tokens: Option<u64>,
    /// The batcher that orders the waiting requests: `fcfs`, `priority`, `fair-share` or a
    /// `.wasm`.
    #[serde(default = "default_batcher")]
    pub batcher: String,
    /// The batcher's own settings (e.g. `aging_ms` for `priority`).
    #[serde(default)]
    pub batcher_config: toml::Table,
    /// Requests waiting at most, over all models and tenants; one more is answered 429.
    #[serde(default = "default_max_queue")]
    pub max_queue: usize,
    /// Requests of one tenant waiting at most, for all its models together; one more is
    /// answered 429.
    #[serde(default = "default_max_queue_per_tenant")]
    pub max_queue_per_tenant: usize,
    /// Longest wait in the queue; then the request is answered 503 (`queue_timeout`).
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
}

fn default_batcher() -> String {
    "fcfs".into()
}

fn default_max_queue() -> usize {
    1024
}

fn default_max_queue_per_tenant() -> usize {
    256
}

fn default_max_wait_ms() -> u64 {
    30_000
}

impl AdmissionConfig {
    /// Checks the values; answers the offending key (under `admission.`) and why.
    pub(crate) fn check(&self) -> Result<(), (&'static str, String)> {
        if self.max_requests.is_none() && self.max_kv_usage.is_none() && self.max_prefill_tokens.is_none() {
            return Err((
                "admission",
                "needs at least one of max_requests, max_kv_usage, max_prefill_tokens (what makes a worker full)"
                    .into(),
            ));
        }
        if self.max_requests == Some(0) {
            return Err(("admission.max_requests", "must be greater than 0".into()));
        }
        if self.max_prefill_tokens == Some(0) {
            return Err(("admission.max_prefill_tokens", "must be greater than 0".into()));
        }
        if let Some(share) = self.max_kv_usage
            && !(share > 0.0 && share <= 1.0)
        {
            return Err((
                "admission.max_kv_usage",
                format!("{share}: a share of the worker's KV blocks, above 0 and at most 1"),
            ));
        }
        for (key, value) in [
            ("admission.max_queue", self.max_queue as u64),
            ("admission.max_queue_per_tenant", self.max_queue_per_tenant as u64),
            ("admission.max_wait_ms", self.max_wait_ms),
        ] {
            if value == 0 {
                return Err((key, "must be greater than 0".into()));
            }
        }
        Ok(())
    }
}
