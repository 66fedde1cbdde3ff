//! The load generator: replays a trace against a gateway on a fixed, open-loop schedule.
//!
//! Request `i` is sent at `timestamp_i / speedup` after the start whatever happened to the
//! requests before it: a slow server makes requests overlap, never arrive later (open loop, so
//! no coordinated omission). Latencies are measured from the *scheduled* arrival, so time a
//! request spent waiting for a connection counts against the server, as it would for a real
//! client; the dispatch lag (sent − scheduled) is recorded to show the client kept up. Each
//! request streams a chat completion with `max_tokens = output_length` and records its time to
//! first token, mean inter-token latency, end-to-end latency, tokens, the worker that served it
//! (`x-switchyard-worker`) and the prompt tokens the worker found cached (`usage`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::trace::{PromptBuilder, TraceRequest};
use switchyard_harness::{Client, Connection, Reply};

/// How to replay a trace.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The model named in every request.
    pub model: String,
    /// Tokens each hash id expands to.
    pub block_tokens: usize,
    /// The arrival schedule runs this many times faster than the trace's timestamps.
    pub speedup: f64,
    /// A request still unanswered after this long is recorded as failed.
    pub request_timeout: Duration,
    /// Draw a progress bar on standard error (when it is a terminal).
    pub progress: bool,
    /// Every request's TTFT target, sent as `x-switchyard-ttft-ms`; none when `None`.
    pub ttft_target_ms: Option<f64>,
    /// Keep each answer's text in its record (to compare runs word for word).
    pub keep_text: bool,
}

impl Default for ReplayOptions {
    fn default() -> ReplayOptions {
        ReplayOptions {
            model: "mock".into(),
            block_tokens: 512,
            speedup: 1.0,
            request_timeout: Duration::from_secs(600),
            progress: false,
            ttft_target_ms: None,
            keep_text: false,
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position of the request in the replayed trace.
    pub index: usize,
    /// Scheduled arrival, milliseconds after the start of the replay.
    pub scheduled_ms: f64,
    /// How late the request was sent after its scheduled arrival, in milliseconds.
    pub lag_ms: f64,
    /// Scheduled arrival to the first generated token, in milliseconds.
    pub ttft_ms: Option<f64>,
    /// Mean time between generated tokens after the first, in milliseconds.
    pub itl_ms: Option<f64>,
    /// Scheduled arrival to the end of the response, in milliseconds.
    pub e2e_ms: Option<f64>,
    /// Prompt tokens in the trace.
    pub input_tokens: u32,
    /// Tokens asked for (`max_tokens`).
    pub max_tokens: u32,
    /// Tokens received.
    pub output_tokens: u32,
    /// Prompt tokens as counted by the worker (after the chat template).
    pub prompt_tokens: Option<u32>,
    /// Prompt tokens the worker served from its prefix cache.
    pub cached_tokens: Option<u32>,
    /// The worker that served the request.
    pub worker: Option<String>,
    /// HTTP status (0 when there was no response).
    pub status: u16,
    /// `text`, or the kind of the request's media (`image`, `audio`, `video`, `mixed`).
    #[serde(default = "text_modality")]
    pub modality: String,
    /// Why the gateway answered without the request's media (`x-switchyard-media`), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_only: Option<String>,
    /// Why the request failed, if it did.
    pub error: Option<String>,
    /// The answer's text, when the replay keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

fn text_modality() -> String {
    "text".into()
}

impl RequestRecord {
    /// Whether the request was answered in full.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Scheduled arrival to the end, in seconds after the start of the replay (for load plots).
    pub fn span_s(&self) -> Option<(f64, f64)> {
        self.e2e_ms
            .map(|e2e| (self.scheduled_ms / 1000.0, (self.scheduled_ms + e2e) / 1000.0))
    }
}

/// The outcome of a replay.
#[derive(Debug, Clone)]
pub struct ReplayRun {
    /// One record per request, in trace order.
    pub records: Vec<RequestRecord>,
    /// Seconds from the first scheduled arrival to the last response.
    pub wall_s: f64,
}

/// Replays `requests` against the gateway behind `client`, sending each at its scheduled time.
///
/// # Errors
///
/// Fails only if the options are unusable; every request failure is recorded, not returned.
pub async fn replay(client: &Client, requests: &[TraceRequest], options: &ReplayOptions) -> anyhow::Result<ReplayRun> {
    anyhow::ensure!(
        options.speedup.is_finite() && options.speedup > 0.0,
        "the speed-up must be a positive number, not {}",
        options.speedup
    );
    let builder = PromptBuilder::new(options.block_tokens);
    let pool: Arc<parking_lot::Mutex<Vec<Connection>>> = Arc::default();
    let progress = progress_bar(requests.len() as u64, options.progress);
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let first_timestamp = requests.first().map_or(0, |r| r.timestamp);
    let mut tasks = tokio::task::JoinSet::new();
    let mut records = Vec::with_capacity(requests.len());
    let in_flight = Arc::new(AtomicUsize::new(0));
    for (index, request) in requests.iter().enumerate() {
        let offset = Duration::from_secs_f64((request.timestamp - first_timestamp) as f64 / 1000.0 / options.speedup);
        let scheduled = start + offset;
        tokio::time::sleep_until(scheduled).await;
        let body = request_body(&options.model, &builder, request, index as u64);
        let task = OneRequest {
            index,
            scheduled: scheduled.into_std(),
            scheduled_ms: offset.as_secs_f64() * 1000.0,
            input_tokens: request.input_length,
            max_tokens: request.output_length.max(1),
            modality: request.modality(),
            keep_text: options.keep_text,
        };
        let client = client.clone();
        let pool = pool.clone();
        let timeout = options.request_timeout;
        let target = options.ttft_target_ms.map(|ms| ms.to_string());
        let done = progress.clone();
        let in_flight = in_flight.clone();
        let now = in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        progress.set_message(format!("{now} in flight"));
        tasks.spawn(async move {
            let record = task.run(&client, &pool, body, timeout, target.as_deref()).await;
            let now = in_flight.fetch_sub(1, Ordering::Relaxed) - 1;
            done.set_message(format!("{now} in flight"));
            done.inc(1);
            record
        });
        // Finished tasks hold their record until joined; collect them as we go.
        while let Some(joined) = tasks.try_join_next() {
            records.push(joined.context("a request task panicked")?);
        }
    }
    while let Some(joined) = tasks.join_next().await {
        records.push(joined.context("a request task panicked")?);
    }
    progress.finish_and_clear();
    records.sort_by_key(|r| r.index);
    let wall_s = records
        .iter()
        .filter_map(|r| r.span_s().map(|(_, end)| end))
        .fold(0.0, f64::max);
    Ok(ReplayRun { records, wall_s })
}

fn progress_bar(len: u64, enabled: bool) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40.cyan/blue}] {pos}/{len} done, {msg} (eta {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// The streamed chat request for `request`: its prompt text, then its media parts, if any.
fn request_body(model: &str, builder: &PromptBuilder, request: &TraceRequest, unique: u64) -> bytes::Bytes {
    let text = builder.prompt(request, unique);
    let content = if request.media.is_empty() {
        serde_json::Value::String(text)
    } else {
        let mut parts = vec![serde_json::json!({"type": "text", "text": text})];
        parts.extend(request.media.iter().map(crate::trace::media_part));
        serde_json::Value::Array(parts)
    };
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": request.output_length.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
        // Real engines stop at EOS; the trace says how many tokens were generated.
        "ignore_eos": true,
    });
    bytes::Bytes::from(body.to_string())
}

struct OneRequest {
    index: usize,
    scheduled: Instant,
    scheduled_ms: f64,
    input_tokens: u32,
    max_tokens: u32,
    modality: &'static str,
    keep_text: bool,
}

impl OneRequest {
    async fn run(
        self,
        client: &Client,
        pool: &parking_lot::Mutex<Vec<Connection>>,
        body: bytes::Bytes,
        timeout: Duration,
        ttft_target_ms: Option<&str>,
    ) -> RequestRecord {
        let mut record = RequestRecord {
            index: self.index,
            scheduled_ms: self.scheduled_ms,
            lag_ms: ms(self.scheduled, Instant::now()),
            ttft_ms: None,
            itl_ms: None,
            e2e_ms: None,
            input_tokens: self.input_tokens,
            max_tokens: self.max_tokens,
            output_tokens: 0,
            prompt_tokens: None,
            cached_tokens: None,
            worker: None,
            status: 0,
            modality: self.modality.to_string(),
            text_only: None,
            error: None,
            text: None,
        };
        let exchange = async {
            let pooled = pool.lock().pop();
            let mut connection = match pooled {
                Some(connection) => connection,
                None => client.connect().await.context("cannot connect")?,
            };
            let headers: Vec<(&str, &str)> = ttft_target_ms
                .map(|target| ("x-switchyard-ttft-ms", target))
                .into_iter()
                .collect();
            let reply = connection
                .send_with_headers("POST", "/v1/chat/completions", body, &headers)
                .await?;
            anyhow::Ok((connection, reply))
        };
        match tokio::time::timeout(timeout, exchange).await {
            Err(_) => record.error = Some(format!("no complete answer within {} s", timeout.as_secs())),
            Ok(Err(err)) => record.error = Some(format!("{err:#}")),
            Ok(Ok((connection, reply))) => {
                self.read_reply(&reply, &mut record);
                if record.ok() {
                    pool.lock().push(connection);
                }
            }
        }
        record
    }

    fn read_reply(&self, reply: &Reply, record: &mut RequestRecord) {
        record.status = reply.status.as_u16();
        let worker = reply.worker();
        record.worker = (!worker.is_empty()).then_some(worker);
        record.text_only = reply
            .headers
            .get("x-switchyard-media")
            .and_then(|value| value.to_str().ok())
            .map(str::to_string);
        if let Some((end, _)) = reply.frames.last() {
            record.e2e_ms = Some(ms(self.scheduled, *end));
        }
        if !reply.status.is_success() {
            let body = String::from_utf8_lossy(&reply.body())
                .chars()
                .take(300)
                .collect::<String>();
            record.error = Some(format!("status {}: {body}", reply.status));
            return;
        }
        let mut token_times = Vec::with_capacity(self.max_tokens as usize);
        let mut text = String::new();
        for (at, data) in reply.events() {
            if data == "[DONE]" {
                continue;
            }
            let Ok(event) = serde_json::from_str::<serde_json::Value>(&data) else {
                record.error = Some(format!("an event is not JSON: {}", truncate(&data)));
                return;
            };
            if let Some(error) = event.get("error") {
                record.error = Some(format!("error event: {}", truncate(&error.to_string())));
                return;
            }
            let content = &event["choices"][0]["delta"]["content"];
            if let Some(piece) = content.as_str().filter(|piece| !piece.is_empty()) {
                token_times.push(at);
                if self.keep_text {
                    text.push_str(piece);
                }
            }
            if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
                record.prompt_tokens = usage["prompt_tokens"].as_u64().map(saturate);
                record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().map(saturate);
            }
        }
        record.output_tokens = saturate(token_times.len() as u64);
        record.text = self.keep_text.then_some(text);
        if let (Some(first), Some(last)) = (token_times.first(), token_times.last()) {
            record.ttft_ms = Some(ms(self.scheduled, *first));
            if token_times.len() > 1 {
                record.itl_ms = Some(ms(*first, *last) / (token_times.len() - 1) as f64);
            }
        }
        if record.output_tokens == 0 {
            record.error = Some("the stream carried no tokens".into());
        }
    }
}

fn ms(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1000.0
}

fn saturate(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

fn truncate(text: &str) -> String {
    text.chars().take(200).collect()
}

/// Average and percentiles of one latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    /// Samples.
    pub count: usize,
    /// Mean.
    pub avg: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Distribution {
    /// The distribution of `samples` (NaN and infinite samples are ignored; all zero when empty).
    pub fn of(samples: impl IntoIterator<Item = f64>) -> Distribution {
        let mut sorted: Vec<f64> = samples.into_iter().filter(|s| s.is_finite()).collect();
        if sorted.is_empty() {
            return Distribution::default();
        }
        sorted.sort_by(f64::total_cmp);
        let rank = |q: f64| sorted[(((sorted.len() - 1) as f64) * q).round() as usize];
        Distribution {
            count: sorted.len(),
            avg: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: sorted[sorted.len() - 1],
        }
    }
}

/// The figures of one replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests replayed.
    pub requests: usize,
    /// Requests answered in full.
    pub succeeded: usize,
    /// Seconds from the first arrival to the last response.
    pub wall_s: f64,
    /// Answered requests per second of wall time.
    pub requests_per_s: f64,
    /// Generated tokens per second of wall time.
    pub output_tokens_per_s: f64,
    /// Time to first token, ms.
    pub ttft_ms: Distribution,
    /// Mean inter-token latency per request, ms.
    pub itl_ms: Distribution,
    /// End-to-end latency, ms.
    pub e2e_ms: Distribution,
    /// Prompt tokens the workers found cached / prompt tokens, over answered requests.
    pub cache_hit_ratio: Option<f64>,
    /// Dispatch lag (sent − scheduled), ms: small values show the schedule was kept.
    pub lag_ms: Distribution,
    /// Requests served per worker.
    pub per_worker: BTreeMap<String, usize>,
    /// Time to first token by modality (`text`, `image`, `audio`, `video`, `mixed`), ms.
    #[serde(default)]
    pub ttft_by_modality: BTreeMap<String, Distribution>,
    /// Requests answered without their media (the gateway's text-only fallback).
    #[serde(default)]
    pub text_only: usize,
    /// The first few distinct failure reasons.
    pub errors: Vec<String>,
}

impl Summary {
    /// Summarises a replay.
    pub fn of(run: &ReplayRun) -> Summary {
        let ok: Vec<&RequestRecord> = run.records.iter().filter(|r| r.ok()).collect();
        let (prompt, cached) = ok.iter().fold((0u64, 0u64), |(p, c), r| {
            (
                p + u64::from(r.prompt_tokens.unwrap_or(0)),
                c + u64::from(r.cached_tokens.unwrap_or(0)),
            )
        });
        let mut per_worker = BTreeMap::new();
        for record in &ok {
            if let Some(worker) = &record.worker {
                *per_worker.entry(worker.clone()).or_insert(0) += 1;
            }
        }
        let mut errors: Vec<String> = Vec::new();
        for error in run.records.iter().filter_map(|r| r.error.as_ref()) {
            if errors.len() < 5 && !errors.contains(error) {
                errors.push(error.clone());
            }
        }
        let wall_s = run.wall_s.max(f64::MIN_POSITIVE);
        let mut by_modality: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for record in &ok {
            if let Some(ttft) = record.ttft_ms {
                by_modality.entry(record.modality.clone()).or_default().push(ttft);
            }
        }
        Summary {
            requests: run.records.len(),
            succeeded: ok.len(),
            wall_s: run.wall_s,
            requests_per_s: ok.len() as f64 / wall_s,
            output_tokens_per_s: ok.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / wall_s,
            ttft_ms: Distribution::of(ok.iter().filter_map(|r| r.ttft_ms)),
            itl_ms: Distribution::of(ok.iter().filter_map(|r| r.itl_ms)),
            e2e_ms: Distribution::of(ok.iter().filter_map(|r| r.e2e_ms)),
            cache_hit_ratio: (prompt > 0).then(|| cached as f64 / prompt as f64),
            lag_ms: Distribution::of(run.records.iter().map(|r| r.lag_ms)),
            per_worker,
            ttft_by_modality: by_modality
                .into_iter()
                .map(|(modality, samples)| (modality, Distribution::of(samples)))
                .collect(),
            text_only: ok.iter().filter(|r| r.text_only.is_some()).count(),
            errors,
        }
    }

    /// The summary as a Markdown table and a few lines of text.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        out.push_str("| latency (ms) | avg | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|---:|\n");
        for (name, d) in [
            ("TTFT", &self.ttft_ms),
            ("ITL (mean per request)", &self.itl_ms),
            ("E2E", &self.e2e_ms),
        ] {
            out.push_str(&format!(
                "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                d.avg, d.p50, d.p90, d.p99, d.max
            ));
        }
        out.push('\n');
        out.push_str(&format!(
            "requests: {} sent, {} answered in full; wall {:.1} s; {:.2} req/s; {:.0} output tokens/s\n",
            self.requests, self.succeeded, self.wall_s, self.requests_per_s, self.output_tokens_per_s
        ));
        out.push_str(&format!(
            "cache hit ratio seen by workers: {}\n",
            self.cache_hit_ratio
                .map_or("n/a".to_string(), |r| format!("{:.1} %", r * 100.0))
        ));
        out.push_str(&format!(
            "dispatch lag: p99 {:.2} ms, max {:.2} ms\n",
            self.lag_ms.p99, self.lag_ms.max
        ));
        if self.ttft_by_modality.keys().any(|modality| modality != "text") {
            out.push_str("\n| TTFT by modality (ms) | requests | avg | p50 | p99 |\n|---|---:|---:|---:|---:|\n");
            for (modality, d) in &self.ttft_by_modality {
                out.push_str(&format!(
                    "| {modality} | {} | {:.1} | {:.1} | {:.1} |\n",
                    d.count, d.avg, d.p50, d.p99
                ));
            }
            out.push_str(&format!("answered text-only (media left out): {}\n", self.text_only));
        }
        let workers: Vec<String> = self.per_worker.iter().map(|(w, n)| format!("{w} {n}")).collect();
        out.push_str(&format!("requests per worker: {}\n", workers.join(", ")));
        for error in &self.errors {
            out.push_str(&format!("error: {error}\n"));
        }
        out
    }
}

/// Writes one JSON line per record.
///
/// # Errors
///
/// Fails if the file cannot be written.
pub fn write_records(path: &std::path::Path, records: &[RequestRecord]) -> anyhow::Result<()> {
    use std::io::Write;
    let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for record in records {
        serde_json::to_writer(&mut out, record)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distribution_of_known_samples() {
        let d = Distribution::of((1..=100).map(f64::from).chain([f64::NAN]));
        assert_eq!(d.count, 100);
        assert!((d.avg - 50.5).abs() < 1e-9);
        assert_eq!(d.p50, 51.0);
        assert_eq!(d.p99, 99.0);
        assert_eq!(d.max, 100.0);
        assert_eq!(Distribution::of([]), Distribution::default());
    }

    fn record(index: usize, worker: &str, ttft: f64, error: Option<&str>) -> RequestRecord {
        RequestRecord {
            index,
            scheduled_ms: index as f64 * 10.0,
            lag_ms: 0.5,
            ttft_ms: Some(ttft),
            itl_ms: Some(2.0),
            e2e_ms: Some(ttft + 100.0),
            input_tokens: 100,
            max_tokens: 10,
            output_tokens: 10,
            prompt_tokens: Some(100),
            cached_tokens: Some(25),
            worker: Some(worker.into()),
            status: 200,
            modality: "text".into(),
            text_only: None,
            error: error.map(str::to_string),
            text: None,
        }
    }

    #[test]
    fn summary_counts_only_answered_requests() {
        let run = ReplayRun {
            records: vec![
                record(0, "a", 10.0, None),
                record(1, "b", 30.0, None),
                record(2, "b", 1000.0, Some("status 502")),
            ],
            wall_s: 2.0,
        };
        let summary = Summary::of(&run);
        assert_eq!(summary.succeeded, 2);
        assert!((summary.ttft_ms.avg - 20.0).abs() < 1e-9);
        assert_eq!(summary.cache_hit_ratio, Some(0.25));
        assert_eq!(summary.per_worker.get("b"), Some(&1));
        assert_eq!(summary.errors, vec!["status 502".to_string()]);
        assert!((summary.output_tokens_per_s - 10.0).abs() < 1e-9);
        assert!(summary.to_markdown().contains("| TTFT | 20.0 |"));
    }
}
