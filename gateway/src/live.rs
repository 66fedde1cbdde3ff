//! Live figures for the admin dashboard: per worker and per tenant, requests answered and the
//! time to first byte of the most recent ones (p50 and p99 over a window).
//!
//! Prometheus histograms hold the same times, but by endpoint and in buckets; the dashboard
//! wants each worker's and tenant's recent percentiles without a query language, so the relay
//! records each answer here too (one short lock) and `GET /admin/stats` reads them.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;
use serde::Serialize;

/// Answers kept per worker and per tenant for the percentiles.
const WINDOW: usize = 512;

/// One worker's or tenant's figures.
#[derive(Debug, Default)]
struct Series {
    requests: u64,
    ttft_ms: VecDeque<f32>,
}

impl Series {
    fn record(&mut self, ttft_ms: f32) {
        self.requests += 1;
        if self.ttft_ms.len() == WINDOW {
            self.ttft_ms.pop_front();
        }
        self.ttft_ms.push_back(ttft_ms);
    }

    fn figures(&self, name: &str) -> Figures {
        let mut sorted: Vec<f32> = self.ttft_ms.iter().copied().collect();
        sorted.sort_by(f32::total_cmp);
        let at = |q: f64| {
            if sorted.is_empty() {
                return None;
            }
            let index = ((sorted.len() - 1) as f64 * q).round() as usize;
            sorted.get(index).copied()
        };
        Figures {
            name: name.to_string(),
            requests: self.requests,
            ttft_p50_ms: at(0.50),
            ttft_p99_ms: at(0.99),
        }
    }
}

/// What the dashboard shows of one worker or tenant.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Figures {
    /// The worker's or tenant's name.
    pub(crate) name: String,
    /// Requests answered since the gateway started.
    pub(crate) requests: u64,
    /// Median time to first byte over the recent window.
    pub(crate) ttft_p50_ms: Option<f32>,
    /// 99th percentile over the recent window.
    pub(crate) ttft_p99_ms: Option<f32>,
}

/// The figures of every worker and tenant that answered.
#[derive(Debug, Default)]
pub(crate) struct Live {
    workers: Mutex<HashMap<String, Series>>,
    tenants: Mutex<HashMap<String, Series>>,
}

impl Live {
    /// Records one answer of `worker` (for `tenant`, when the gateway has keys).
    pub(crate) fn record(&self, worker: &str, tenant: Option<&str>, ttft_seconds: f64) {
        let ttft_ms = (ttft_seconds * 1000.0) as f32;
        let add = |series: &Mutex<HashMap<String, Series>>, name: &str| {
            let mut series = series.lock();
            match series.get_mut(name) {
                Some(entry) => entry.record(ttft_ms),
                None => series.entry(name.to_string()).or_default().record(ttft_ms),
            }
        };
        add(&self.workers, worker);
        if let Some(tenant) = tenant {
            add(&self.tenants, tenant);
        }
    }

    /// Each worker's figures, by name.
    pub(crate) fn workers(&self) -> HashMap<String, Figures> {
        self.workers
            .lock()
            .iter()
            .map(|(name, series)| (name.clone(), series.figures(name)))
            .collect()
    }

    /// Each tenant's figures, sorted by name.
    pub(crate) fn tenants(&self) -> Vec<Figures> {
        let mut tenants: Vec<Figures> = self
            .tenants
            .lock()
            .iter()
            .map(|(name, series)| series.figures(name))
            .collect();
        tenants.sort_by(|a, b| a.name.cmp(&b.name));
        tenants
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_cover_the_recent_window_only() {
        let live = Live::default();
        for i in 0..WINDOW {
            live.record("w", Some("t"), 10.0 + i as f64);
        }
        for i in 1..=100 {
            live.record("w", None, f64::from(i) / 1000.0);
        }
        let w = &live.workers()["w"];
        assert_eq!(w.requests, (WINDOW + 100) as u64);
        // The window holds 100 answers of 1..100 ms and 412 of 110 s and more.
        assert!(w.ttft_p50_ms.is_some_and(|p| p > 100_000.0), "{w:?}");
        let t = &live.tenants()[0];
        assert_eq!((t.name.as_str(), t.requests), ("t", WINDOW as u64));
        assert_eq!(t.ttft_p50_ms, Some(((10 + WINDOW / 2) * 1000) as f32));
    }
}
