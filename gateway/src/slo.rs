//! Latency targets per request, whether they were met, and what serving cost.
//!
//! A request's time-to-first-token and inter-token-latency targets come from its headers
//! (`x-switchyard-ttft-ms`, `x-switchyard-itl-ms`), else from its model's `[[models]]`
//! defaults ([`Targets::of_request`]). The TTFT target reaches the router as
//! `request-info.ttft-target-ms`. When the answer ends, each target it had is judged
//! ([`SloMetrics::judge`]) against what the client saw: TTFT is the time to the first body byte
//! (for a whole answer, the whole answer's time: its first token is not visible apart), ITL
//! the mean gap between a stream's chunks after the first (streams of one chunk and whole
//! answers have no ITL to judge). Counted in `switchyard_slo_requests_total{model,worker,
//! target,met}`, so attainment per model and worker is `met="true"` over all. The cost served
//! is the worker's `cost` times the request's tokens (prompt and completion, as the worker
//! reported them, else the prompt as the gateway counted it and one completion token per
//! streamed chunk), in `switchyard_cost_served_total{model}`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use http::{HeaderMap, StatusCode};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use switchyard_protocol::api::ApiError;

/// Header with a request's TTFT target in milliseconds.
pub const TTFT_HEADER: &str = "x-switchyard-ttft-ms";

/// Header with a request's inter-token latency target in milliseconds.
pub const ITL_HEADER: &str = "x-switchyard-itl-ms";

/// A request's latency targets, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Targets {
    /// Time to first token.
    pub(crate) ttft_ms: Option<f32>,
    /// Inter-token latency.
    pub(crate) itl_ms: Option<f32>,
}

impl Targets {
    /// The targets of a request with `headers`, falling back to its model's `defaults`.
    ///
    /// # Errors
    ///
    /// A 400 naming the header when one is not a positive number.
    pub(crate) fn of_request(headers: &HeaderMap, defaults: Targets) -> Result<Targets, ApiError> {
        let read = |name: &str, default: Option<f32>| -> Result<Option<f32>, ApiError> {
            let Some(value) = headers.get(name) else {
                return Ok(default);
            };
            value
                .to_str()
                .ok()
                .and_then(|text| text.trim().parse::<f32>().ok())
                .filter(|ms| ms.is_finite() && *ms > 0.0)
                .map(Some)
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "invalid_latency_target",
                        format!("header `{name}` must be a positive number of milliseconds"),
                    )
                })
        };
        Ok(Targets {
            ttft_ms: read(TTFT_HEADER, defaults.ttft_ms)?,
            itl_ms: read(ITL_HEADER, defaults.itl_ms)?,
        })
    }
}

/// What the client saw of one answer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Observed {
    /// Milliseconds to the first body byte.
    pub(crate) ttft_ms: f64,
    /// Mean milliseconds between chunks after the first, when there were two or more.
    pub(crate) itl_ms: Option<f64>,
    /// Tokens served (prompt and completion).
    pub(crate) tokens: u64,
    /// Tokens generated.
    pub(crate) completion_tokens: u64,
    /// The role of the worker that answered, and whether a prefill worker computed the
    /// prompt: which of the model's planner pools the answer counts for (see
    /// [`crate::planner::window::Window::answered`]).
    pub(crate) answered_by: crate::config::Role,
    /// See `answered_by`.
    pub(crate) prefilled_remotely: bool,
}

type Labels = Vec<(&'static str, String)>;

/// The cost counter's type: cost units are fractional.
type CostCounter = Counter<f64, AtomicU64>;

/// The SLO and cost metric families.
#[derive(Debug, Clone, Default)]
pub(crate) struct SloMetrics {
    requests: Family<Labels, Counter>,
    cost: Family<Labels, CostCounter>,
    tokens: Family<Labels, Counter>,
    /// Each (model, worker)'s counters, looked up once: every answer is judged, and building
    /// the label strings of a lookup cost more allocations than the rest of a request's
    /// bookkeeping.
    handles: Arc<parking_lot::RwLock<HandlesByModel>>,
    /// The planner's window, when there is a planner: it sees every judged answer.
    planner: Option<Arc<crate::planner::window::Window>>,
}

/// [`Handles`] by model, then by worker.
type HandlesByModel = HashMap<String, HashMap<String, Arc<Handles>>>;

/// One (model, worker)'s counters.
#[derive(Debug)]
struct Handles {
    /// `slo_requests` by target (ttft, itl) and whether it was met (false, true): each made
    /// on first use, so a series appears only once counted.
    judged: [[OnceLock<Counter>; 2]; 2],
    cost: CostCounter,
    tokens: Counter,
}

/// The `target` label of [`Handles::judged`]'s rows.
const JUDGED_TARGETS: [&str; 2] = ["ttft", "itl"];

impl SloMetrics {
    /// Reports every judged answer (and, through [`SloMetrics::routed`], every request) to
    /// the planner's window from now on.
    pub(crate) fn observe_into(&mut self, window: Arc<crate::planner::window::Window>) {
        self.planner = Some(window);
    }

    /// A request for `model` with `prompt_tokens` was routed to a worker of role `answering`,
    /// with its prompt sent to a prefill worker first or not (for the planner, if any).
    pub(crate) fn routed(&self, model: &str, answering: crate::config::Role, prefill: bool, prompt_tokens: u64) {
        if let Some(window) = &self.planner {
            window.routed(model, answering, prefill, prompt_tokens);
        }
    }

    /// A request for `model` with `prompt_tokens` found no worker (for the planner, if any).
    pub(crate) fn unrouted(&self, model: &str, prompt_tokens: u64) {
        if let Some(window) = &self.planner {
            window.unrouted(model, prompt_tokens);
        }
    }

    /// Registers the families.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "slo_requests",
            "Answers judged against their latency targets, by model, worker, target (ttft, itl) and whether it was met",
            self.requests.clone(),
        );
        registry.register(
            "cost_served",
            "Cost units served per model: each worker's cost per token times the tokens it served",
            self.cost.clone(),
        );
        registry.register(
            "tokens_served",
            "Tokens served (prompt and completion) per model and worker",
            self.tokens.clone(),
        );
    }

    /// The counters of `model` served by `worker`.
    fn handles(&self, model: &str, worker: &str) -> Arc<Handles> {
        if let Some(handles) = self
            .handles
            .read()
            .get(model)
            .and_then(|by_worker| by_worker.get(worker))
        {
            return handles.clone();
        }
        let handles = Handles {
            judged: Default::default(),
            cost: self.cost.get_or_create_owned(&vec![("model", model.to_string())]),
            tokens: self
                .tokens
                .get_or_create_owned(&vec![("model", model.to_string()), ("worker", worker.to_string())]),
        };
        self.handles
            .write()
            .entry(model.to_string())
            .or_default()
            .entry(worker.to_string())
            .or_insert_with(|| Arc::new(handles))
            .clone()
    }

    /// Judges one answer of `worker` (of `cost` per token) for `model` against `targets`.
    pub(crate) fn judge(&self, model: &str, worker: &str, cost: f64, targets: Targets, observed: Observed) {
        let handles = self.handles(model, worker);
        let judged = [
            targets.ttft_ms.map(|target| observed.ttft_ms <= f64::from(target)),
            targets
                .itl_ms
                .zip(observed.itl_ms)
                .map(|(target, itl)| itl <= f64::from(target)),
        ];
        for (row, met) in judged.into_iter().enumerate() {
            let Some(met) = met else { continue };
            handles.judged[row][usize::from(met)]
                .get_or_init(|| {
                    self.requests.get_or_create_owned(&vec![
                        ("model", model.to_string()),
                        ("worker", worker.to_string()),
                        ("target", JUDGED_TARGETS[row].to_string()),
                        ("met", met.to_string()),
                    ])
                })
                .inc();
        }
        handles.cost.inc_by(cost * observed.tokens as f64);
        handles.tokens.inc_by(observed.tokens);
        if let Some(window) = &self.planner {
            window.answered(
                model,
                observed.answered_by,
                observed.prefilled_remotely,
                observed.ttft_ms,
                observed.itl_ms,
                observed.completion_tokens,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_win_over_the_models_defaults_and_bad_ones_are_refused() {
        let defaults = Targets {
            ttft_ms: Some(500.0),
            itl_ms: Some(50.0),
        };
        let mut headers = HeaderMap::new();
        assert_eq!(Targets::of_request(&headers, defaults).expect("defaults"), defaults);
        headers.insert(TTFT_HEADER, "120.5".parse().expect("value"));
        let targets = Targets::of_request(&headers, defaults).expect("valid");
        assert_eq!((targets.ttft_ms, targets.itl_ms), (Some(120.5), Some(50.0)));
        headers.insert(ITL_HEADER, "-3".parse().expect("value"));
        let err = Targets::of_request(&headers, defaults).unwrap_err();
        assert_eq!(err.status, 400);
        assert!(err.body.error.message.contains(ITL_HEADER), "{err}");
    }

    #[test]
    fn attainment_and_cost_are_counted_per_model_and_worker() {
        let metrics = SloMetrics::default();
        let targets = Targets {
            ttft_ms: Some(100.0),
            itl_ms: Some(10.0),
        };
        let seen = |ttft_ms, itl_ms| Observed {
            ttft_ms,
            itl_ms,
            tokens: 10,
            completion_tokens: 5,
            ..Observed::default()
        };
        metrics.judge("m", "w", 0.4, targets, seen(50.0, Some(5.0)));
        metrics.judge("m", "w", 0.4, targets, seen(150.0, Some(20.0)));
        metrics.judge("m", "w", 0.4, targets, seen(50.0, None));
        let count = |target: &str, met: bool| {
            metrics
                .requests
                .get_or_create(&vec![
                    ("model", "m".to_string()),
                    ("worker", "w".to_string()),
                    ("target", target.to_string()),
                    ("met", met.to_string()),
                ])
                .get()
        };
        assert_eq!((count("ttft", true), count("ttft", false)), (2, 1));
        assert_eq!((count("itl", true), count("itl", false)), (1, 1), "no ITL, not judged");
        let cost = metrics.cost.get_or_create(&vec![("model", "m".to_string())]).get();
        assert!((cost - 12.0).abs() < 1e-9, "{cost}");
    }
}
