//! The HTTP paths that gateway and workers call on each other (besides the OpenAI endpoints in
//! [`crate::api`]), defined once so that neither side can drift from the other.

/// Worker: `GET` answers the worker's [`KvDump`](crate::kv_events::KvDump) (a gateway resyncs
/// its index from it after an event gap).
pub const KV_DUMP: &str = "/kv/dump";

/// Worker: `POST` drops the prefix cache's unreferenced blocks, announced as KV events.
pub const KV_RESET: &str = "/kv/reset";

/// Worker and gateway: `GET` answers 200 while the server is serving.
pub const HEALTHZ: &str = "/healthz";
/// Worker: the same check as [`HEALTHZ`] at the path other routers, engines and Kubernetes
/// probes use.
pub const HEALTH: &str = "/health";

/// Worker and gateway: `GET` answers Prometheus text.
pub const METRICS: &str = "/metrics";

/// Gateway admin API: `POST` a [`Registration`](crate::kv_events::Registration) (repeated as
/// the heartbeat).
pub const ADMIN_WORKERS: &str = "/admin/workers";

/// Gateway admin API: `DELETE` takes worker `name` out of the pool (it is leaving).
pub fn admin_worker(name: &str) -> String {
    format!("{ADMIN_WORKERS}/{name}")
}

/// Gateway admin API: `POST` worker `name`'s numbered KV events.
pub fn admin_worker_events(name: &str) -> String {
    format!("{ADMIN_WORKERS}/{name}/events")
}
