//! The gateway's Prometheus metrics.
//!
//! This module owns every metric family the gateway exports on `GET /metrics`, registered once
//! at start, and their encoding in the Prometheus text format. Other modules hold cheap clones
//! of the handles they update; nothing here decides anything.
//!
//! Families labelled by tenant sit in a registry of their own: tenant names and their usage
//! are for the operator, so they are encoded only for the admin listener
//! ([`Metrics::encode_with_tenants`]), never on the client listener's open `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Label set: name/value pairs.
pub type Labels = Vec<(&'static str, String)>;

/// The labels of a per-request counter: built without allocating, since every request counts
/// itself (string labels cost three allocations a request).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointStatus {
    endpoint: &'static str,
    status: u16,
}

/// The label of a per-request histogram (see [`EndpointStatus`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: &'static str,
}

type HistogramFamily = Family<EndpointLabel, Histogram, fn() -> Histogram>;

/// The label of the media counters: an item's kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// The label of the text-only counter: one of [`TEXT_ONLY_REASONS`] or `other`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// Why a request's media was answered text-only, as `/metrics` names it: the gateway's reasons
/// and the workers' (`workers`' media path). The reason comes back in a worker's
/// `x-switchyard-media` header, which carries whatever an encoder reported when it gave up, so
/// any other reason counts as `other`: what a worker sends cannot grow the label set.
const TEXT_ONLY_REASONS: [&str; 10] = [
    "no_encoder",
    "encoder_failed",
    "feature_timeout",
    "feature_evicted",
    "feature_dim_mismatch",
    "merge_failed",
    "staging_full",
    "tracker_poisoned",
    "not_tracked",
    "abandoned",
];

/// `reason` as a [`TEXT_ONLY_REASONS`] label (the header's `-` and spaces read as `_`), else
/// `other`.
fn text_only_label(reason: &str) -> &'static str {
    let normal = |byte: u8| if byte == b'-' || byte == b' ' { b'_' } else { byte };
    TEXT_ONLY_REASONS
        .iter()
        .find(|known| known.bytes().eq(reason.trim().bytes().map(normal)))
        .copied()
        .unwrap_or("other")
}

/// Every metric the gateway exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Families labelled by tenant: the admin listener's only.
    tenant_registry: Registry,
    requests: Family<EndpointStatus, Counter>,
    errors: Family<Labels, Counter>,
    time_to_first_byte: HistogramFamily,
    request_duration: HistogramFamily,
    worker_in_flight: Family<Labels, Gauge>,
    worker_healthy: Family<Labels, Gauge>,
    worker_busy: Family<Labels, Counter>,
    worker_breaker_state: Family<Labels, Gauge>,
    worker_breaker_transitions: Family<Labels, Counter>,
    worker_misconfigured: Family<Labels, Gauge>,
    retries: Counter,
    preemptions: Counter,
    media_items: Family<KindLabel, Counter>,
    media_tokens: Family<KindLabel, Counter>,
    media_text_only: Family<ReasonLabel, Counter>,
    stream_migrations: Family<Labels, Counter>,
    disagg_requests: Family<Labels, Counter>,
    disagg_fallbacks: Family<ReasonLabel, Counter>,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~65 s, doubling.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.0005, 2.0, 18,
    ))
}

impl Metrics {
    /// Registers every family.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("switchyard");
        let requests = Family::<EndpointStatus, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let time_to_first_byte: HistogramFamily = Family::new_with_constructor(latency_histogram);
        let request_duration: HistogramFamily = Family::new_with_constructor(latency_histogram);
        let worker_in_flight = Family::<Labels, Gauge>::default();
        let worker_healthy = Family::<Labels, Gauge>::default();
        let worker_busy = Family::<Labels, Counter>::default();
        let worker_breaker_state = Family::<Labels, Gauge>::default();
        let worker_breaker_transitions = Family::<Labels, Counter>::default();
        let worker_misconfigured = Family::<Labels, Gauge>::default();
        let retries = Counter::default();
        let preemptions = Counter::default();
        let media_items = Family::<KindLabel, Counter>::default();
        let media_tokens = Family::<KindLabel, Counter>::default();
        let media_text_only = Family::<ReasonLabel, Counter>::default();
        let stream_migrations = Family::<Labels, Counter>::default();
        let disagg_requests = Family::<Labels, Counter>::default();
        let disagg_fallbacks = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "disagg_requests",
            "Requests a policy sent to a prefill worker first, by how the prompt was computed in the end: remote or local",
            disagg_requests.clone(),
        );
        registry.register(
            "disagg_fallbacks",
            "Disaggregated requests whose answering worker prefilled the prompt itself, by why",
            disagg_fallbacks.clone(),
        );
        registry.register(
            "media_items",
            "Media items accepted in requests, by kind (image, audio, video)",
            media_items.clone(),
        );
        registry.register(
            "media_tokens",
            "Estimated model tokens of accepted media items, by kind",
            media_tokens.clone(),
        );
        registry.register(
            "media_text_only",
            "Requests with media answered text-only (media left out, flagged in x-switchyard-media), by reason",
            media_text_only.clone(),
        );
        registry.register(
            "requests",
            "Client requests answered, by endpoint and status",
            requests.clone(),
        );
        registry.register(
            "errors",
            "Client requests that ended in an error, by kind",
            errors.clone(),
        );
        registry.register(
            "time_to_first_byte_seconds",
            "Time from request arrival to the first body byte relayed from a worker",
            time_to_first_byte.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from request arrival to the end of the response",
            request_duration.clone(),
        );
        registry.register(
            "worker_in_flight",
            "Requests in flight per worker",
            worker_in_flight.clone(),
        );
        registry.register(
            "worker_healthy",
            "1 while a worker is in rotation, 0 while ejected",
            worker_healthy.clone(),
        );
        registry.register(
            "worker_busy",
            "Answers 429 or 503 (the engine is full): the request went to another worker",
            worker_busy.clone(),
        );
        registry.register(
            "worker_breaker_state",
            "A worker's circuit breaker: 0 closed, 1 open, 2 half open",
            worker_breaker_state.clone(),
        );
        registry.register(
            "worker_breaker_transitions",
            "Changes of a worker's circuit breaker, by the state entered",
            worker_breaker_transitions.clone(),
        );
        registry.register(
            "worker_misconfigured",
            "1 while a worker's health path answers 404 (health_path is wrong for its engine)",
            worker_misconfigured.clone(),
        );
        registry.register(
            "worker_retries",
            "Requests retried on another worker after a failure before the first byte",
            retries.clone(),
        );
        registry.register(
            "worker_preemptions",
            "Spot workers taken out of routing by a reclaim notice",
            preemptions.clone(),
        );
        registry.register(
            "stream_migrations",
            "Streams broken after their first byte, by why (worker_failed, stream_ended, error_event, reclaim_notice) and what became of them (continued elsewhere, finished by the gateway with all their tokens relayed, failed)",
            stream_migrations.clone(),
        );
        Metrics {
            registry,
            tenant_registry: Registry::with_prefix("switchyard"),
            requests,
            errors,
            time_to_first_byte,
            request_duration,
            worker_in_flight,
            worker_healthy,
            worker_busy,
            worker_breaker_state,
            worker_breaker_transitions,
            worker_misconfigured,
            retries,
            preemptions,
            media_items,
            media_tokens,
            media_text_only,
            stream_migrations,
            disagg_requests,
            disagg_fallbacks,
        }
    }

    /// Counts one stream broken after its first byte, why, and what became of it: `continued`
    /// on another worker, `finished` by the gateway (all of its tokens had come), or `failed`.
    pub fn stream_migration(&self, reason: &'static str, outcome: &'static str) {
        self.stream_migrations
            .get_or_create(&vec![("reason", reason.to_string()), ("outcome", outcome.to_string())])
            .inc();
    }

    /// Counts one request a policy disaggregated: computed on its prefill worker (`None`), or
    /// by its answering worker after all, and why (one of `crate::server`'s disaggregation
    /// reasons).
    pub fn disaggregated(&self, fallback: Option<&'static str>) {
        let outcome = if fallback.is_some() { "local" } else { "remote" };
        self.disagg_requests
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
        if let Some(reason) = fallback {
            self.disagg_fallbacks.get_or_create(&ReasonLabel { reason }).inc();
        }
    }

    /// Counts one accepted media item of `kind` and its estimated tokens.
    pub fn media_item(&self, kind: &'static str, tokens: u32) {
        let label = KindLabel { kind };
        self.media_items.get_or_create(&label).inc();
        self.media_tokens.get_or_create(&label).inc_by(u64::from(tokens));
    }

    /// Counts one request with media answered text-only, and why: `reason` as the
    /// `x-switchyard-media` header gives it (a reason not in [`TEXT_ONLY_REASONS`] counts as
    /// `other`).
    pub fn media_text_only(&self, reason: &str) {
        let reason = text_only_label(reason);
        self.media_text_only.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts one answered request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.requests.get_or_create(&EndpointStatus { endpoint, status }).inc();
    }

    /// Counts one error of `kind` (a stable code such as `invalid_json`).
    pub fn error(&self, kind: &str) {
        self.errors.get_or_create(&vec![("kind", kind.to_string())]).inc();
    }

    /// Records a time to first byte.
    pub fn time_to_first_byte(&self, endpoint: &'static str, seconds: f64) {
        self.time_to_first_byte
            .get_or_create(&EndpointLabel { endpoint })
            .observe(seconds);
    }

    /// Records a whole request's duration.
    pub fn request_duration(&self, endpoint: &'static str, seconds: f64) {
        self.request_duration
            .get_or_create(&EndpointLabel { endpoint })
            .observe(seconds);
    }

    /// The in-flight gauge of a worker.
    pub fn worker_in_flight(&self, worker: &str) -> Gauge {
        self.worker_in_flight
            .get_or_create(&vec![("worker", worker.to_string())])
            .clone()
    }

    /// The health gauge of a worker.
    pub fn worker_healthy(&self, worker: &str) -> Gauge {
        self.worker_healthy
            .get_or_create(&vec![("worker", worker.to_string())])
            .clone()
    }

    /// The counter of a worker's busy answers (429 or 503).
    pub fn worker_busy(&self, worker: &str) -> Counter {
        self.worker_busy
            .get_or_create(&vec![("worker", worker.to_string())])
            .clone()
    }

    /// The gauge of a worker's circuit breaker state (see [`crate::workers::breaker`]).
    pub fn worker_breaker_state(&self, worker: &str) -> Gauge {
        self.worker_breaker_state
            .get_or_create(&vec![("worker", worker.to_string())])
            .clone()
    }

    /// Counts a worker's breaker entering `state`.
    pub fn worker_breaker_transition(&self, worker: &str, state: &'static str) {
        self.worker_breaker_transitions
            .get_or_create(&vec![("worker", worker.to_string()), ("state", state.to_string())])
            .inc();
    }

    /// The gauge that says a worker's health path answers 404.
    pub fn worker_misconfigured(&self, worker: &str) -> Gauge {
        self.worker_misconfigured
            .get_or_create(&vec![("worker", worker.to_string())])
            .clone()
    }

    /// Counts one retry.
    pub fn retry(&self) {
        self.retries.inc();
    }

    /// Counts one spot worker's reclaim notice.
    pub fn preemption(&self) {
        self.preemptions.inc();
    }

    /// The registry, for other modules to register their own families at start.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The registry of the families labelled by tenant, for the tenants and the admission
    /// queue to register theirs at start.
    pub fn tenant_registry_mut(&mut self) -> &mut Registry {
        &mut self.tenant_registry
    }

    /// Every metric but those labelled by tenant, in the Prometheus text format: what the
    /// client listener serves.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut text, &self.registry);
        let _ = encode_eof(&mut text);
        text
    }

    /// Every metric, those labelled by tenant included: what the admin listener serves.
    pub fn encode_with_tenants(&self) -> String {
        let mut text = String::new();
        let _ = encode_registry(&mut text, &self.registry);
        let _ = encode_registry(&mut text, &self.tenant_registry);
        let _ = encode_eof(&mut text);
        text
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_recorded_values() {
        let metrics = Metrics::new();
        metrics.request("chat", 200);
        metrics.error("invalid_json");
        metrics.time_to_first_byte("chat", 0.01);
        metrics.worker_in_flight("w0").inc();
        let text = metrics.encode();
        assert!(
            text.contains("switchyard_requests_total{endpoint=\"chat\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("switchyard_errors_total{kind=\"invalid_json\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("switchyard_time_to_first_byte_seconds_count{endpoint=\"chat\"} 1"),
            "{text}"
        );
        assert!(text.contains("switchyard_worker_in_flight{worker=\"w0\"} 1"), "{text}");
    }

    #[test]
    fn text_only_reasons_a_worker_makes_up_count_as_other() {
        let metrics = Metrics::new();
        metrics.media_item("image", 576);
        metrics.media_text_only("no-encoder");
        metrics.media_text_only("feature-evicted");
        metrics.media_text_only("not tracked");
        for made_up in 0..100 {
            metrics.media_text_only(&format!("encoder-said-{made_up}"));
        }
        metrics.media_text_only("");
        let text = metrics.encode();
        for line in [
            "switchyard_media_items_total{kind=\"image\"} 1",
            "switchyard_media_tokens_total{kind=\"image\"} 576",
            "switchyard_media_text_only_total{reason=\"no_encoder\"} 1",
            "switchyard_media_text_only_total{reason=\"feature_evicted\"} 1",
            "switchyard_media_text_only_total{reason=\"not_tracked\"} 1",
            "switchyard_media_text_only_total{reason=\"other\"} 101",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert_eq!(text.matches("switchyard_media_text_only_total{").count(), 4, "{text}");
    }
}
