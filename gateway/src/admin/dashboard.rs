//! The admin dashboard: one page, embedded in the binary (no CDN: there is no internet at the
//! edge), and the live figures it polls.
//!
//! The page (`dashboard.html`, plain HTML, CSS and script) asks for the admin token (or takes
//! it from the address's `#token=` fragment, which browsers never send), then calls the admin
//! API with it: `GET /admin/stats` every second for workers and tenants, `GET /admin/policies`
//! for versions and rollouts, and the policy endpoints for uploads, activation, rollback,
//! shadow and split. Charts are drawn on canvases by the page itself.

use http::{HeaderValue, Response, StatusCode, header};
use serde_json::{Value, json};
use switchyard_protocol::respond::{self, Body};

use crate::state::AdminState;

/// The page.
const PAGE: &str = include_str!("dashboard.html");

/// The dashboard page, with headers that keep it from loading anything from elsewhere.
pub(super) fn page() -> Response<Body> {
    let mut response = respond::text(StatusCode::OK, "text/html; charset=utf-8", PAGE);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// What the page polls: each worker (health, load, cached blocks, role, requests answered and
/// recent TTFT percentiles) and each tenant (requests, waiting in the admission queue, TTFT).
pub(super) fn stats(state: &AdminState) -> Value {
    let summary = state.router.kv_summary();
    let live = state.live.workers();
    let workers: Vec<Value> = state
        .router
        .pool()
        .workers()
        .iter()
        .map(|worker| {
            let kv = summary.workers.iter().find(|w| w.name == worker.name);
            let figures = live.get(&worker.name);
            json!({
                "name": worker.name,
                "role": worker.role.as_str(),
                "model": worker.model,
                "healthy": worker.is_healthy(),
                "engine": worker.engine().map(|kind| kind.name()),
                "misconfigured": worker.is_misconfigured(),
                "breaker": worker.breaker_state().name(),
                "busy": worker.is_busy(),
                "engine_load": worker.engine_load().map(|load| json!({
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "capacity_blocks": load.capacity_blocks,
                })),
                "cost": worker.cost,
                "spot": worker.spot,
                "preempting": worker.is_preempting(),
                "in_flight": worker.in_flight(),
                "cached_blocks": kv.map_or(0, |w| w.cached_blocks),
                "active_blocks": kv.map_or(0, |w| w.load.active_blocks),
                "prefill_tokens": kv.map_or(0, |w| w.load.prefill_tokens),
                "requests": figures.map_or(0, |f| f.requests),
                "ttft_p50_ms": figures.and_then(|f| f.ttft_p50_ms),
                "ttft_p99_ms": figures.and_then(|f| f.ttft_p99_ms),
                "measured_itl_ms": match worker.measured_itl() {
                    (0, _) => None,
                    (itl_us, _) => Some(f64::from(itl_us) / 1000.0),
                },
                "measured_prefill": match worker.measured_prefill() {
                    (_, 0) => Value::Null,
                    (line, samples) => json!({
                        "fixed_ms": line.map(|line| line.fixed_ms),
                        "ms_per_ktoken": line.map(|line| line.ms_per_token * 1000.0),
                        "samples": samples,
                    }),
                },
            })
        })
        .collect();
    let mut waiting = state.admission.waiting_by_tenant();
    let mut tenants: Vec<Value> = state
        .live
        .tenants()
        .into_iter()
        .map(|figures| {
            json!({
                "name": figures.name,
                "requests": figures.requests,
                "waiting": waiting.remove(&figures.name).unwrap_or(0),
                "ttft_p50_ms": figures.ttft_p50_ms,
                "ttft_p99_ms": figures.ttft_p99_ms,
            })
        })
        .collect();
    // Tenants waiting that have not been answered yet.
    for (name, count) in waiting {
        tenants.push(json!({"name": name, "requests": 0, "waiting": count, "ttft_p50_ms": null, "ttft_p99_ms": null}));
    }
    let requests: u64 = live.values().map(|f| f.requests).sum();
    let admission: Vec<Value> = state
        .admission
        .figures()
        .into_iter()
        .map(|(model, waiting, reserved, room)| {
            json!({"model": model, "waiting": waiting, "reserved": reserved, "room": room})
        })
        .collect();
    json!({
        "requests": requests,
        "workers": workers,
        "tenants": tenants,
        "admission": admission,
        "kv": {"nodes": summary.index.nodes, "active_requests": summary.active_requests},
    })
}
