//! The engines behind the workers: which kind each one is, where its health is checked, and
//! what its own metrics say about its load.
//!
//! A `[[workers]]` entry names its engine (`engine = "vllm"`, …) or leaves the gateway to tell
//! at its first health check (`workers::health`): the metric names on its `/metrics` (`vllm:`,
//! `sglang:`, `llamacpp:`, `tgi_`, `switchyard_`), else the `owned_by` of its `/v1/models`,
//! else which health path answers.
//! Switchyard's own workers are checked at `/healthz`, every other engine at `/health`
//! (`health_path` overrides either).
//!
//! [`EngineLoad::read`] turns an engine's Prometheus text into what the routing table's
//! columns need. What each engine reports, and so what is measured rather than estimated by
//! the gateway from the requests it sent:
//!
//! | engine | requests (running + waiting) | KV usage | KV capacity |
//! |---|---|---|---|
//! | vLLM | `vllm:num_requests_running`, `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `num_gpu_blocks` label of `vllm:cache_config_info` |
//! | SGLang | `sglang:num_running_reqs`, `sglang:num_queue_reqs` | `sglang:token_usage` | `sglang:max_total_num_tokens` ÷ block size |
//! | llama.cpp | `llamacpp:requests_processing`, `llamacpp:requests_deferred` | `llamacpp:kv_cache_usage_ratio` (where the build reports it) | — |
//! | TGI | `tgi_batch_current_size`, `tgi_queue_size` | — | — |
//!
//! An engine's error answers are passed to the client in OpenAI's shape ([`openai_error`]).
//!
//! Prefill tokens queued at a worker are always the gateway's estimate (no engine reports
//! them), and so is every column for an engine whose metrics cannot be read. The text format
//! is read line by line for the few gauges above; a full Prometheus parser would bring a date
//! and regex stack into the gateway for no gain here.

use serde::Deserialize;

pub use crate::config::EngineKind;

impl EngineKind {
    /// Where its health is checked unless `health_path` says otherwise.
    pub fn health_path(self) -> &'static str {
        match self {
            EngineKind::Switchyard => switchyard_protocol::paths::HEALTHZ,
            _ => switchyard_protocol::paths::HEALTH,
        }
    }

    /// Whether its streams report the token ids of their text when asked (`return_token_ids`),
    /// so a broken one can be continued elsewhere.
    pub fn reports_token_ids(self) -> bool {
        matches!(self, EngineKind::Switchyard | EngineKind::Vllm)
    }

    /// Whether it takes a completion prompt as token ids, so it can continue another worker's
    /// broken stream.
    pub fn continues_from_tokens(self) -> bool {
        matches!(
            self,
            EngineKind::Switchyard | EngineKind::Vllm | EngineKind::Sglang | EngineKind::Llamacpp
        )
    }

    /// Whether the gateway reads its load from its `/metrics` (Switchyard's workers report
    /// theirs as KV events instead; a generic server has none the gateway knows).
    pub fn reports_load(self) -> bool {
        matches!(
            self,
            EngineKind::Vllm | EngineKind::Sglang | EngineKind::Llamacpp | EngineKind::Tgi
        )
    }

    /// The engine whose metric names `text` (Prometheus text) carries, if any.
    pub fn from_metrics(text: &str) -> Option<EngineKind> {
        samples(text).find_map(|(name, _, _)| {
            Some(if name.starts_with("vllm:") {
                EngineKind::Vllm
            } else if name.starts_with("sglang:") {
                EngineKind::Sglang
            } else if name.starts_with("llamacpp:") {
                EngineKind::Llamacpp
            } else if name.starts_with("tgi_") {
                EngineKind::Tgi
            } else if name.starts_with("switchyard_") {
                EngineKind::Switchyard
            } else {
                return None;
            })
        })
    }

    /// The engine a `/v1/models` answer names as its models' owner, if it is one the gateway
    /// knows.
    pub fn from_models(body: &[u8]) -> Option<EngineKind> {
        #[derive(Deserialize)]
        struct Models {
            data: Vec<Model>,
        }
        #[derive(Deserialize)]
        struct Model {
            #[serde(default)]
            owned_by: String,
        }
        let models: Models = serde_json::from_slice(body).ok()?;
        models
            .data
            .iter()
            .find_map(|model| match model.owned_by.to_ascii_lowercase().as_str() {
                "vllm" => Some(EngineKind::Vllm),
                "sglang" => Some(EngineKind::Sglang),
                "llamacpp" | "llama.cpp" => Some(EngineKind::Llamacpp),
                "tgi" | "text-generation-inference" => Some(EngineKind::Tgi),
                "switchyard" => Some(EngineKind::Switchyard),
                _ => None,
            })
    }
}

/// An engine's load as its own metrics report it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests it is running.
    pub running: u64,
    /// Requests waiting in its queue.
    pub waiting: u64,
    /// Fraction of its KV cache in use, 0 to 1, where it reports one.
    pub kv_usage: Option<f64>,
    /// Its KV cache in blocks of the worker's block size, where it reports its size.
    pub capacity_blocks: Option<u64>,
}

impl EngineLoad {
    /// Reads the load out of `kind`'s Prometheus `text`; `block_size` converts a capacity
    /// reported in tokens. `None` when `text` has none of the engine's load gauges.
    pub fn read(kind: EngineKind, text: &str, block_size: usize) -> Option<EngineLoad> {
        let mut load = EngineLoad::default();
        let mut seen = false;
        // Engines that serve several models (or ranks) report one series each: they add up.
        let mut add = |into: &mut u64, value: f64| {
            seen = true;
            *into = into.saturating_add(count(value));
        };
        for (name, labels, value) in samples(text) {
            match (kind, name) {
                (EngineKind::Vllm, "vllm:num_requests_running")
                | (EngineKind::Sglang, "sglang:num_running_reqs")
                | (EngineKind::Llamacpp, "llamacpp:requests_processing")
                | (EngineKind::Tgi, "tgi_batch_current_size") => add(&mut load.running, value),
                (EngineKind::Vllm, "vllm:num_requests_waiting")
                | (EngineKind::Sglang, "sglang:num_queue_reqs")
                | (EngineKind::Llamacpp, "llamacpp:requests_deferred")
                | (EngineKind::Tgi, "tgi_queue_size") => add(&mut load.waiting, value),
                (EngineKind::Vllm, "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc")
                | (EngineKind::Sglang, "sglang:token_usage")
                | (EngineKind::Llamacpp, "llamacpp:kv_cache_usage_ratio") => {
                    if value.is_finite() {
                        let usage = value.clamp(0.0, 1.0);
                        load.kv_usage = Some(load.kv_usage.map_or(usage, |before: f64| before.max(usage)));
                    }
                }
                (EngineKind::Vllm, "vllm:cache_config_info") => {
                    if let Some(blocks) = label(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok()) {
                        // vLLM's blocks are its own size; the table counts in the worker's.
                        let engine_block = label(labels, "block_size")
                            .and_then(|v| v.parse::<u64>().ok())
                            .filter(|size| *size > 0);
                        load.capacity_blocks = Some(match engine_block {
                            Some(size) => blocks.saturating_mul(size) / (block_size.max(1) as u64),
                            None => blocks,
                        });
                    }
                }
                (EngineKind::Sglang, "sglang:max_total_num_tokens") => {
                    load.capacity_blocks = Some(count(value) / (block_size.max(1) as u64));
                }
                _ => {}
            }
        }
        seen.then_some(load)
    }

    /// Requests at the engine: running and waiting.
    pub fn requests(&self) -> u64 {
        self.running.saturating_add(self.waiting)
    }

    /// KV blocks in use, where both the usage and a capacity (its own, else `configured`)
    /// are known.
    pub fn used_blocks(&self, configured: u64) -> Option<u64> {
        let capacity = self.capacity_blocks.filter(|c| *c > 0).unwrap_or(configured);
        let usage = self.kv_usage?;
        (capacity > 0).then(|| (usage * capacity as f64).round() as u64)
    }
}

/// An engine's error answer in OpenAI's shape (`{"error": {"message", "type", "param",
/// "code"}}`), or `None` when it already is. vLLM and SGLang answer `{"object": "error",
/// "message", "type", "code"}` at the top level, TGI `{"error": "…", "error_type": "…"}`, and
/// anything else (a proxy's HTML page, plain text) is taken as the message.
pub fn openai_error(status: http::StatusCode, body: &[u8]) -> Option<Vec<u8>> {
    use serde_json::{Value, json};
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let detail = match &parsed {
        Some(Value::Object(fields)) => match fields.get("error") {
            Some(Value::Object(error)) if error.get("message").is_some_and(Value::is_string) => return None,
            Some(Value::String(message)) => json!({
                "message": message,
                "type": kind,
                "param": null,
                "code": fields.get("error_type").cloned().unwrap_or(Value::Null),
            }),
            _ => match fields.get("message") {
                Some(Value::String(message)) => json!({
                    "message": message,
                    "type": fields.get("type").filter(|t| t.is_string()).cloned().unwrap_or_else(|| kind.into()),
                    "param": fields.get("param").cloned().unwrap_or(Value::Null),
                    "code": fields.get("code").cloned().unwrap_or(Value::Null),
                }),
                _ => json!({"message": String::from_utf8_lossy(body), "type": kind, "param": null, "code": null}),
            },
        },
        _ => {
            // Keep a non-JSON page short: it is a message, not a document.
            let text = String::from_utf8_lossy(body);
            let message: String = text.trim().chars().take(1_000).collect();
            let message = if message.is_empty() {
                status.canonical_reason().unwrap_or("error").to_string()
            } else {
                message
            };
            json!({"message": message, "type": kind, "param": null, "code": null})
        }
    };
    serde_json::to_vec(&json!({ "error": detail })).ok()
}

fn count(value: f64) -> u64 {
    if value.is_finite() && value > 0.0 {
        value.round() as u64
    } else {
        0
    }
}

/// The samples of a Prometheus text: (metric name, the text between its braces, value).
/// Comments, blank lines and lines that do not read as a sample are skipped.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
        let name = &line[..name_end];
        let (labels, rest) = if line[name_end..].starts_with('{') {
            let close = label_block_end(&line[name_end..])?;
            (&line[name_end + 1..name_end + close], &line[name_end + close + 1..])
        } else {
            ("", &line[name_end..])
        };
        let value = rest.split_whitespace().next()?;
        let value = match value {
            "+Inf" | "Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            other => other.parse().ok()?,
        };
        Some((name, labels, value))
    })
}

/// The offset of the `}` that closes the label block `block` opens, skipping quoted values
/// (which may hold `}` and escaped quotes).
fn label_block_end(block: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (offset, c) in block.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(offset),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in a label block, unescaped only as far as a number needs.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let name = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut end = None;
        let mut escaped = false;
        for (offset, c) in after.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    end = Some(offset);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        if name == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    // vLLM's /metrics as its documentation shows it (v1 engine), trimmed to the series read.
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="8192"} 1.0
"#;

    // SGLang's, as its production-metrics page shows it.
    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 262144.0
"#;

    #[test]
    fn vllm_metrics_read_as_requests_usage_and_capacity_in_the_workers_blocks() {
        assert_eq!(EngineKind::from_metrics(VLLM), Some(EngineKind::Vllm));
        let load = EngineLoad::read(EngineKind::Vllm, VLLM, 64).expect("vLLM gauges");
        assert_eq!((load.running, load.waiting, load.requests()), (7, 3, 10));
        assert_eq!(load.kv_usage, Some(0.25));
        // 8,192 blocks of 16 tokens are 2,048 blocks of 64.
        assert_eq!(load.capacity_blocks, Some(2_048));
        assert_eq!(load.used_blocks(0), Some(512));
    }

    #[test]
    fn sglang_metrics_read_as_requests_usage_and_capacity() {
        assert_eq!(EngineKind::from_metrics(SGLANG), Some(EngineKind::Sglang));
        let load = EngineLoad::read(EngineKind::Sglang, SGLANG, 64).expect("SGLang gauges");
        assert_eq!((load.running, load.waiting), (12, 4));
        assert_eq!(load.capacity_blocks, Some(4_096));
        assert_eq!(load.used_blocks(0), Some(1_147));
    }

    #[test]
    fn llamacpp_and_tgi_read_their_request_gauges() {
        let llamacpp = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n\
                        llamacpp:requests_deferred 5\n";
        assert_eq!(EngineKind::from_metrics(llamacpp), Some(EngineKind::Llamacpp));
        let load = EngineLoad::read(EngineKind::Llamacpp, llamacpp, 64).expect("llama.cpp gauges");
        assert_eq!((load.running, load.waiting, load.kv_usage), (2, 5, None));
        assert_eq!(load.used_blocks(100), None, "no usage reported: nothing to multiply");
        let tgi = "tgi_batch_current_size 3\ntgi_queue_size 1\n";
        let load = EngineLoad::read(EngineKind::Tgi, tgi, 64).expect("TGI gauges");
        assert_eq!(load.requests(), 4);
    }

    #[test]
    fn series_of_several_models_add_up_and_junk_lines_are_skipped() {
        let text = "vllm:num_requests_running{model_name=\"a\"} 1\n\
                    vllm:num_requests_running{model_name=\"b \\\"}\\\" c\"} 2\n\
                    garbage line without a value\n\
                    vllm:num_requests_waiting{model_name=\"a\"} NaN\n\
                    vllm:kv_cache_usage_perc 7\n";
        let load = EngineLoad::read(EngineKind::Vllm, text, 16).expect("gauges");
        assert_eq!(
            load.running, 3,
            "a quoted brace and escaped quotes do not end the labels"
        );
        assert_eq!(load.waiting, 0, "NaN counts nothing");
        assert_eq!(load.kv_usage, Some(1.0), "usage is clamped to 0..1");
        assert_eq!(
            load.used_blocks(10),
            Some(10),
            "the configured capacity when none is reported"
        );
    }

    #[test]
    fn text_without_the_engines_gauges_is_no_load() {
        assert_eq!(EngineLoad::read(EngineKind::Vllm, SGLANG, 64), None);
        assert_eq!(EngineLoad::read(EngineKind::Tgi, "", 64), None);
        assert_eq!(EngineKind::from_metrics("process_cpu_seconds_total 1\n"), None);
    }

    #[test]
    fn engine_errors_take_openai_shape() {
        use http::StatusCode;
        let openai = br#"{"error":{"message":"bad","type":"invalid_request_error","code":null}}"#;
        assert_eq!(openai_error(StatusCode::BAD_REQUEST, openai), None, "already OpenAI's");
        let shape = |body: &[u8], status| -> serde_json::Value {
            serde_json::from_slice(&openai_error(status, body).expect("reshaped")).expect("json")
        };
        let tgi = shape(
            br#"{"error":"Input validation error: too long","error_type":"validation"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        );
        assert_eq!(tgi["error"]["message"], "Input validation error: too long");
        assert_eq!(tgi["error"]["type"], "invalid_request_error");
        assert_eq!(tgi["error"]["code"], "validation");
        let vllm = shape(
            br#"{"object":"error","message":"max_tokens too large","type":"BadRequestError","param":null,"code":400}"#,
            StatusCode::BAD_REQUEST,
        );
        assert_eq!(vllm["error"]["message"], "max_tokens too large");
        assert_eq!(vllm["error"]["type"], "BadRequestError");
        assert_eq!(vllm["error"]["code"], 400);
        let html = shape(b"<html>Bad Gateway</html>", StatusCode::BAD_GATEWAY);
        assert_eq!(html["error"]["message"], "<html>Bad Gateway</html>");
        assert_eq!(html["error"]["type"], "server_error");
        let empty = shape(b"", StatusCode::NOT_FOUND);
        assert_eq!(empty["error"]["message"], "Not Found");
    }

    #[test]
    fn models_owner_names_the_engine() {
        let vllm = br#"{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}"#;
        assert_eq!(EngineKind::from_models(vllm), Some(EngineKind::Vllm));
        let llamacpp = br#"{"object":"list","data":[{"id":"m","owned_by":"llamacpp"}]}"#;
        assert_eq!(EngineKind::from_models(llamacpp), Some(EngineKind::Llamacpp));
        assert_eq!(
            EngineKind::from_models(br#"{"data":[{"id":"m","owned_by":"me"}]}"#),
            None
        );
        assert_eq!(EngineKind::from_models(b"not json"), None);
    }
}
