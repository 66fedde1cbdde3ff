//! Summary statistics of a trace: arrival rate, prompt and output length percentiles, and how
//! much of the prompt an infinite prefix cache would serve.
//!
//! This module owns [`TraceStats`], the one set of numbers the `synth` and `compare` commands
//! print for a source trace and a synthesized one, so the two can be checked against each other.
//! Reuse is measured the way a prefix cache sees it: requests in timestamp order, each one
//! looking up its blocks among those of every earlier request.

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::Serialize;

use crate::trace::TraceRequest;

/// Summary statistics of a trace (see [`trace_stats`]).
#[derive(Debug, Clone, Serialize)]
pub struct TraceStats {
    /// Requests in the trace.
    pub requests: usize,
    /// Last arrival minus first arrival, in milliseconds.
    pub duration_ms: u64,
    /// Requests per second over `duration_ms` (0 when every request arrives at once).
    pub request_rate: f64,
    /// Mean prompt length in tokens.
    pub isl_mean: f64,
    /// Median prompt length (nearest rank).
    pub isl_p50: u32,
    /// 90th-percentile prompt length (nearest rank).
    pub isl_p90: u32,
    /// 99th-percentile prompt length (nearest rank).
    pub isl_p99: u32,
    /// Longest prompt.
    pub isl_max: u32,
    /// Mean output length in tokens.
    pub osl_mean: f64,
    /// Median output length (nearest rank).
    pub osl_p50: u32,
    /// 90th-percentile output length (nearest rank).
    pub osl_p90: u32,
    /// 99th-percentile output length (nearest rank).
    pub osl_p99: u32,
    /// Fraction of block references whose id an earlier request already referenced: the block
    /// hit ratio of an infinite cache.
    pub block_reuse_ratio: f64,
    /// Token-weighted prefix hit ratio of an infinite cache: per request, the leading run of
    /// blocks all seen in earlier requests, in tokens (capped at the prompt length), summed over
    /// the trace and divided by all prompt tokens.
    pub prefix_hit_ratio: f64,
    /// Distinct hash ids.
    pub distinct_ids: usize,
    /// Mean hash ids per request.
    pub mean_blocks: f64,
    /// Mean shared prefix per request, in blocks: the leading run of ids that appear in more than
    /// one request of the trace (the part a synthesizer draws from its prefix tree).
    pub mean_prefix_blocks: f64,
    /// Mean blocks after the shared prefix (the request's own context).
    pub mean_tail_blocks: f64,
}

/// Computes [`TraceStats`] for `requests` with `block_tokens` tokens per hash id. The requests
/// need not be sorted: reuse is measured in timestamp order (stable, so equal timestamps keep
/// slice order). An empty trace gives all zeros.
pub fn trace_stats(requests: &[TraceRequest], block_tokens: usize) -> TraceStats {
    let mut order: Vec<&TraceRequest> = requests.iter().collect();
    order.sort_by_key(|r| r.timestamp);
    let count = order.len();
    let duration_ms = match (order.first(), order.last()) {
        (Some(first), Some(last)) => last.timestamp - first.timestamp,
        _ => 0,
    };
    let request_rate = if duration_ms == 0 {
        0.0
    } else {
        count as f64 / (duration_ms as f64 / 1000.0)
    };

    // In how many requests each id appears, to tell shared prefix blocks from own blocks.
    let mut requests_per_id: HashMap<u64, u32> = HashMap::new();
    for request in &order {
        let distinct: HashSet<u64> = request.hash_ids.iter().copied().collect();
        for id in distinct {
            *requests_per_id.entry(id).or_default() += 1;
        }
    }

    let mut seen: HashSet<u64> = HashSet::new();
    let (mut references, mut reused) = (0u64, 0u64);
    let (mut input_tokens, mut hit_tokens) = (0u64, 0u64);
    let mut prefix_blocks = 0u64;
    for request in &order {
        let ids = &request.hash_ids;
        references += ids.len() as u64;
        reused += ids.iter().filter(|id| seen.contains(id)).count() as u64;
        let leading_hits = ids.iter().take_while(|id| seen.contains(id)).count() as u64;
        let input = u64::from(request.input_length);
        input_tokens += input;
        hit_tokens += leading_hits.saturating_mul(block_tokens as u64).min(input);
        prefix_blocks += ids
            .iter()
            .take_while(|id| requests_per_id.get(id).is_some_and(|&n| n > 1))
            .count() as u64;
        // Ids enter the cache after the lookup: a request never hits its own blocks.
        seen.extend(ids.iter().copied());
    }

    let mut isl: Vec<u32> = order.iter().map(|r| r.input_length).collect();
    let mut osl: Vec<u32> = order.iter().map(|r| r.output_length).collect();
    isl.sort_unstable();
    osl.sort_unstable();
    let mean_blocks = ratio(references, count as u64);
    let mean_prefix_blocks = ratio(prefix_blocks, count as u64);
    TraceStats {
        requests: count,
        duration_ms,
        request_rate,
        isl_mean: mean(&isl),
        isl_p50: percentile(&isl, 0.50),
        isl_p90: percentile(&isl, 0.90),
        isl_p99: percentile(&isl, 0.99),
        isl_max: isl.last().copied().unwrap_or(0),
        osl_mean: mean(&osl),
        osl_p50: percentile(&osl, 0.50),
        osl_p90: percentile(&osl, 0.90),
        osl_p99: percentile(&osl, 0.99),
        block_reuse_ratio: ratio(reused, references),
        prefix_hit_ratio: ratio(hit_tokens, input_tokens),
        distinct_ids: seen.len(),
        mean_blocks,
        mean_prefix_blocks,
        mean_tail_blocks: ratio(references - prefix_blocks, count as u64),
    }
}

/// `part / whole`, or 0 for an empty whole.
fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 { 0.0 } else { part as f64 / whole as f64 }
}

fn mean(values: &[u32]) -> f64 {
    ratio(values.iter().map(|&v| u64::from(v)).sum(), values.len() as u64)
}

/// Nearest-rank percentile of sorted `values` (0 when empty).
fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl TraceStats {
    /// The statistics as `(label, value)` rows, in display order, shared by the plain summary
    /// and the side-by-side table so both always list the same numbers.
    fn rows(&self) -> Vec<(&'static str, String)> {
        vec![
            ("requests", self.requests.to_string()),
            ("duration (s)", format!("{:.1}", self.duration_ms as f64 / 1000.0)),
            ("rate (req/s)", format!("{:.3}", self.request_rate)),
            ("ISL mean", format!("{:.1}", self.isl_mean)),
            ("ISL p50", self.isl_p50.to_string()),
            ("ISL p90", self.isl_p90.to_string()),
            ("ISL p99", self.isl_p99.to_string()),
            ("ISL max", self.isl_max.to_string()),
            ("OSL mean", format!("{:.1}", self.osl_mean)),
            ("OSL p50", self.osl_p50.to_string()),
            ("OSL p90", self.osl_p90.to_string()),
            ("OSL p99", self.osl_p99.to_string()),
            ("block reuse", format!("{:.4}", self.block_reuse_ratio)),
            ("prefix hit (tokens)", format!("{:.4}", self.prefix_hit_ratio)),
            ("distinct ids", self.distinct_ids.to_string()),
            ("blocks/request", format!("{:.2}", self.mean_blocks)),
            (
                "shared prefix blocks/request",
                format!("{:.2}", self.mean_prefix_blocks),
            ),
            ("tail blocks/request", format!("{:.2}", self.mean_tail_blocks)),
        ]
    }
}

/// One `label: value` line per statistic.
impl fmt::Display for TraceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows = self.rows();
        let width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
        for (label, value) in rows {
            writeln!(f, "{label:<width$}  {value}")?;
        }
        Ok(())
    }
}

/// A Markdown table with one row per statistic and one column per `(name, stats)`, e.g. a
/// source trace beside its synthesized copy.
pub fn markdown_table(columns: &[(&str, &TraceStats)]) -> String {
    let mut out = String::from("| statistic |");
    for (name, _) in columns {
        out.push_str(&format!(" {name} |"));
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(columns.len()));
    out.push('\n');
    let tables: Vec<Vec<(&str, String)>> = columns.iter().map(|(_, stats)| stats.rows()).collect();
    // Every column has the same labels in the same order; no column means no rows.
    let labels: Vec<&str> = tables
        .first()
        .map(|rows| rows.iter().map(|(label, _)| *label).collect())
        .unwrap_or_default();
    for (index, label) in labels.iter().enumerate() {
        out.push_str(&format!("| {label} |"));
        for table in &tables {
            let value = table.get(index).map_or("", |(_, value)| value.as_str());
            out.push_str(&format!(" {value} |"));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(timestamp: u64, input_length: u32, output_length: u32, hash_ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length,
            output_length,
            hash_ids: hash_ids.to_vec(),
            media: Vec::new(),
        }
    }

    /// Four requests with 4-token blocks, given out of timestamp order. In timestamp order:
    /// t=0 [1,2,3] (10 tokens) misses all; t=1000 [1,2] (7) hits 2 blocks, 7 tokens (capped);
    /// t=2000 [1,4,5] (9) hits 1 block, 4 tokens; t=4000 [1,2,3] (12) hits 3 blocks, 12 tokens.
    #[test]
    fn a_hand_made_trace_gives_the_known_numbers() {
        let trace = [
            request(4000, 12, 20, &[1, 2, 3]),
            request(0, 10, 5, &[1, 2, 3]),
            request(2000, 9, 100, &[1, 4, 5]),
            request(1000, 7, 1, &[1, 2]),
        ];
        let stats = trace_stats(&trace, 4);
        assert_eq!(stats.requests, 4);
        assert_eq!(stats.duration_ms, 4000);
        assert_eq!(stats.request_rate, 1.0);
        assert_eq!(stats.isl_mean, 9.5);
        assert_eq!(
            (stats.isl_p50, stats.isl_p90, stats.isl_p99, stats.isl_max),
            (9, 12, 12, 12)
        );
        assert_eq!(stats.osl_mean, 31.5);
        assert_eq!((stats.osl_p50, stats.osl_p90, stats.osl_p99), (5, 100, 100));
        assert_eq!(stats.block_reuse_ratio, 6.0 / 11.0);
        assert_eq!(stats.prefix_hit_ratio, 23.0 / 38.0);
        assert_eq!(stats.distinct_ids, 5);
        assert_eq!(stats.mean_blocks, 2.75);
        // Shared ids: 1, 2, 3 (4 and 5 appear once): prefixes of 3, 2, 1 and 3 blocks.
        assert_eq!(stats.mean_prefix_blocks, 2.25);
        assert_eq!(stats.mean_tail_blocks, 0.5);
    }

    #[test]
    fn reuse_follows_timestamps_not_slice_order() {
        let early_second = [request(10, 8, 1, &[7, 8]), request(0, 8, 1, &[7, 9])];
        let stats = trace_stats(&early_second, 4);
        // At t=0 [7,9] misses; at t=10 [7,8] hits its first block only.
        assert_eq!(stats.block_reuse_ratio, 0.25);
        assert_eq!(stats.prefix_hit_ratio, 4.0 / 16.0);
    }

    #[test]
    fn an_empty_trace_gives_zeros() {
        let stats = trace_stats(&[], 512);
        assert_eq!(stats.requests, 0);
        assert_eq!(stats.block_reuse_ratio, 0.0);
        assert_eq!(stats.isl_p99, 0);
    }

    #[test]
    fn the_summary_and_the_table_list_every_statistic() {
        let stats = trace_stats(&[request(0, 10, 5, &[1, 2, 3]), request(3000, 6, 5, &[1, 2])], 4);
        let text = stats.to_string();
        assert!(text.contains("block reuse"), "{text}");
        assert!(text.contains("0.4000"), "{text}");
        let table = markdown_table(&[("source", &stats), ("synth", &stats)]);
        assert_eq!(table.lines().count(), 2 + stats.rows().len(), "{table}");
        assert!(table.contains("| block reuse | 0.4000 | 0.4000 |"), "{table}");
    }
}
