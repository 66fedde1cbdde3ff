//! A workload synthesizer: learns the prefix structure, lengths and arrivals of a trace and
//! generates new traces like it, with knobs to scale each, in the spirit of NVIDIA Dynamo's
//! prefix data generator.
//!
//! This module owns [`Synthesizer`] and its [`SynthConfig`]. Learning builds the prefix tree of
//! the requests' hash-id paths, keeps only the *shared* nodes (blocks that more than one request
//! uses), compresses unary chains of them into one node with a length, and records per node how
//! many requests went on to each child or stopped there. Everything after a request's shared
//! prefix is its own context; its length (by how long the shared prefix was), the tokens in the
//! last block, the output length and the gaps between arrivals are kept as empirical samples.
//! Generating walks the tree with the learned transition counts, gives the walked nodes ids
//! (scaled and copied by the knobs), appends fresh ids for the context, and draws the rest from
//! the samples. Walks and samples are drawn without replacement, in epochs of the source's size,
//! so a trace generated with every knob at 1 has the source's reuse, length means and duration
//! exactly, with only the pairing of prefixes, contexts, outputs and gaps shuffled. Each kind of
//! draw has its own seeded random stream, so changing one knob leaves the other draws as they were.

use std::collections::HashMap;
use std::fmt;

use anyhow::{Context, ensure};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use switchyard_harness::rng::splitmix64;

use crate::trace::TraceRequest;

/// The knobs of [`Synthesizer::generate`]. The default (every multiplier 1, the source's request
/// count, seed 0, 512-token blocks) generates a trace statistically like the source.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    /// Scales every shared prefix: each compressed chain of shared blocks becomes
    /// `max(1, round(len × multiplier))` blocks.
    pub prefix_len_multiplier: f64,
    /// Copies the prefix tree this many times with disjoint ids; each request walks one copy
    /// chosen uniformly, so `k` copies split the reuse into `k` independent trees.
    pub prefix_root_multiplier: usize,
    /// Scales each request's own context (the blocks after its shared prefix) and the tokens in
    /// its last block.
    pub prompt_len_multiplier: f64,
    /// Scales output lengths (at least 1 token).
    pub osl_multiplier: f64,
    /// Divides the gaps between arrivals: 2 replays the trace twice as fast.
    pub speedup_ratio: f64,
    /// Requests to generate; `None` generates as many as the source has.
    pub num_requests: Option<usize>,
    /// Seed of every random draw: equal seeds give equal traces.
    pub seed: u64,
    /// Tokens per hash id; must be the size the synthesizer learned with.
    pub block_tokens: usize,
}

impl Default for SynthConfig {
    fn default() -> SynthConfig {
        SynthConfig {
            prefix_len_multiplier: 1.0,
            prefix_root_multiplier: 1,
            prompt_len_multiplier: 1.0,
            osl_multiplier: 1.0,
            speedup_ratio: 1.0,
            num_requests: None,
            seed: 0,
            block_tokens: 512,
        }
    }
}

impl SynthConfig {
    /// Checks every knob.
    ///
    /// # Errors
    ///
    /// Fails, naming the knob, if a multiplier or the speedup is not a finite number above 0,
    /// the root multiplier, the request count or the block size is 0.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, value) in [
            ("prefix_len_multiplier", self.prefix_len_multiplier),
            ("prompt_len_multiplier", self.prompt_len_multiplier),
            ("osl_multiplier", self.osl_multiplier),
            ("speedup_ratio", self.speedup_ratio),
        ] {
            ensure!(
                value.is_finite() && value > 0.0,
                "{name} must be a finite number above 0, not {value}"
            );
        }
        ensure!(
            self.prefix_root_multiplier >= 1,
            "prefix_root_multiplier must be at least 1, not 0"
        );
        ensure!(self.num_requests != Some(0), "num_requests must be at least 1, not 0");
        ensure!(self.block_tokens >= 1, "block_tokens must be at least 1, not 0");
        Ok(())
    }
}

/// The index of the virtual node above every root: a request that shares no block stops there.
const TOP: usize = 0;

/// One node of the compressed prefix tree: a chain of shared blocks that every request reaching
/// its first block follows to its last.
#[derive(Debug, Clone)]
struct Node {
    /// Blocks in the chain (0 for [`TOP`]).
    len: u32,
    /// Blocks from the top of the tree through the end of this chain.
    depth: u32,
    /// Requests whose shared prefix ends here.
    stops: u64,
    /// Child nodes.
    children: Vec<usize>,
    /// Requests that went on to each child.
    weights: Vec<u64>,
}

impl Node {
    fn new(len: u32, depth: u32) -> Node {
        Node {
            len,
            depth,
            stops: 0,
            children: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Requests that reached this node.
    fn visits(&self) -> u64 {
        self.stops + self.weights.iter().sum::<u64>()
    }
}

/// The transition counts not yet used in the current epoch of walks. Walks draw without
/// replacement: each takes one count from every edge it follows, so an epoch of as many walks
/// as the source had requests walks every learned path exactly once, in random order. Drawing
/// with replacement instead would visit a node learned from v requests a Poisson-like number of
/// times, and the first visit of a node is a cache miss, so reuse would come out higher than the
/// source's (by about 0.02 on the Mooncake conversation trace).
struct Urn {
    /// Per node: its stops first, then one count per child.
    counts: Vec<Vec<u64>>,
    /// Per node: the sum of its counts.
    totals: Vec<u64>,
}

impl Urn {
    fn full(nodes: &[Node]) -> Urn {
        Urn {
            counts: nodes
                .iter()
                .map(|node| {
                    std::iter::once(node.stops)
                        .chain(node.weights.iter().copied())
                        .collect()
                })
                .collect(),
            totals: nodes.iter().map(Node::visits).collect(),
        }
    }

    /// Walks from the top to a stop, pushing the nodes passed (not the top) onto `walked`, and
    /// returns the node it stopped at. Starts a new epoch when the last one is used up.
    fn walk(&mut self, nodes: &[Node], rng: &mut SmallRng, walked: &mut Vec<usize>) -> usize {
        if self.totals[TOP] == 0 {
            *self = Urn::full(nodes);
        }
        let mut at = TOP;
        loop {
            // An edge's count is the child's total, so a node reached this epoch has a count
            // left; the check only guards a trace of no requests.
            let total = self.totals[at];
            if total == 0 {
                return at;
            }
            self.totals[at] -= 1;
            let mut draw = rng.random_range(0..total);
            let counts = &mut self.counts[at];
            let choice = counts
                .iter()
                .position(|&count| {
                    if draw < count {
                        true
                    } else {
                        draw -= count;
                        false
                    }
                })
                .unwrap_or(0);
            counts[choice] -= 1;
            match choice.checked_sub(1).and_then(|child| nodes[at].children.get(child)) {
                Some(&child) => {
                    walked.push(child);
                    at = child;
                }
                None => return at,
            }
        }
    }
}

/// Samples dealt without replacement: a lazy Fisher-Yates shuffle, reshuffled when used up, so
/// that as many draws as samples reproduce the source's values exactly (in random order) and
/// sums such as the trace's duration do not drift by chance.
struct Deck<T> {
    cards: Vec<T>,
    dealt: usize,
}

impl<T: Copy> Deck<T> {
    fn new(samples: &[T]) -> Deck<T> {
        Deck {
            cards: samples.to_vec(),
            dealt: 0,
        }
    }

    /// The next card, or `None` if there are none.
    fn deal(&mut self, rng: &mut SmallRng) -> Option<T> {
        if self.cards.is_empty() {
            return None;
        }
        if self.dealt == self.cards.len() {
            self.dealt = 0;
        }
        let pick = rng.random_range(self.dealt..self.cards.len());
        self.cards.swap(self.dealt, pick);
        self.dealt += 1;
        Some(self.cards[self.dealt - 1])
    }
}

/// A trace's learned prefix tree and length and arrival samples (see the module documentation).
#[derive(Clone)]
pub struct Synthesizer {
    block_tokens: usize,
    source_requests: usize,
    /// The compressed tree; index [`TOP`] is the virtual top, parents come before children.
    nodes: Vec<Node>,
    /// Context lengths in blocks, by [`depth_bucket`] of the shared prefix they followed: a long
    /// conversation's latest turn adds little to it, a fresh request brings its whole prompt.
    context_blocks: Vec<Vec<u32>>,
    /// Tokens in each request's last block, `1..=block_tokens`.
    residuals: Vec<u32>,
    /// Output lengths.
    output_lengths: Vec<u32>,
    /// Gaps between consecutive arrivals in milliseconds; zeros keep the source's bursts.
    inter_arrivals: Vec<u64>,
}

impl fmt::Debug for Synthesizer {
    // The samples run to thousands of entries: show their sizes only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Synthesizer")
            .field("block_tokens", &self.block_tokens)
            .field("source_requests", &self.source_requests)
            .field("tree_nodes", &self.tree_nodes())
            .field("inter_arrivals", &self.inter_arrivals.len())
            .finish_non_exhaustive()
    }
}

/// The bucket of a shared prefix of `depth` blocks: 0 for none, then powers of two.
fn depth_bucket(depth: u32) -> usize {
    if depth == 0 { 0 } else { 1 + depth.ilog2() as usize }
}

/// A random stream of its own per kind of draw, so that e.g. scaling outputs does not change
/// which prefixes are walked.
fn stream(seed: u64, kind: u64) -> SmallRng {
    SmallRng::seed_from_u64(splitmix64(seed ^ splitmix64(kind)))
}

/// Scales a sample by a multiplier, rounding to the nearest integer (saturating).
fn scale(value: u64, multiplier: f64) -> u64 {
    (value as f64 * multiplier).round() as u64
}

impl Synthesizer {
    /// Learns the prefix tree and the samples of `requests`, whose hash ids cover `block_tokens`
    /// tokens each. The requests need not be sorted; they are taken in timestamp order.
    ///
    /// # Errors
    ///
    /// Fails if the trace is empty or `block_tokens` is 0.
    pub fn learn(requests: &[TraceRequest], block_tokens: usize) -> anyhow::Result<Synthesizer> {
        ensure!(!requests.is_empty(), "cannot learn from an empty trace");
        ensure!(block_tokens >= 1, "block_tokens must be at least 1, not 0");
        let mut order: Vec<&TraceRequest> = requests.iter().collect();
        order.sort_by_key(|r| r.timestamp);

        // The uncompressed prefix tree: trie node 0 is the top, every other node one block at
        // one position after one path, with the number of requests through it.
        let mut parent: Vec<usize> = vec![TOP];
        let mut visits: Vec<u64> = vec![order.len() as u64];
        let mut child_of: HashMap<(usize, u64), usize> = HashMap::new();
        let mut paths: Vec<Vec<usize>> = Vec::with_capacity(order.len());
        for request in &order {
            let mut at = TOP;
            let mut path = Vec::with_capacity(request.hash_ids.len());
            for &id in &request.hash_ids {
                let next = *child_of.entry((at, id)).or_insert_with(|| {
                    parent.push(at);
                    visits.push(0);
                    parent.len() - 1
                });
                visits[next] += 1;
                path.push(next);
                at = next;
            }
            paths.push(path);
        }

        // Split each request into its shared prefix (visits only fall along a path, so the
        // shared nodes are a leading run) and its own context.
        let mut stops_at = vec![0u64; parent.len()];
        let mut context_blocks: Vec<Vec<u32>> = Vec::new();
        for path in &paths {
            let shared = path.iter().take_while(|&&node| visits[node] > 1).count();
            let end = if shared == 0 { TOP } else { path[shared - 1] };
            stops_at[end] += 1;
            let depth = u32::try_from(shared).context("a request has more than 2^32 blocks")?;
            let bucket = depth_bucket(depth);
            if context_blocks.len() <= bucket {
                context_blocks.resize_with(bucket + 1, Vec::new);
            }
            let context = u32::try_from(path.len() - shared).context("a request has more than 2^32 blocks")?;
            context_blocks[bucket].push(context);
        }

        // Compress: a shared node whose parent sends every visit on to it (so nothing stops at
        // the parent and it has no other child) joins its parent's chain. Trie nodes are numbered
        // in creation order, so a parent is always placed before its children.
        let mut nodes = vec![Node::new(0, 0)];
        let mut edges: Vec<Vec<(usize, u64)>> = vec![Vec::new()];
        let mut compressed = vec![TOP; parent.len()];
        for trie in 1..parent.len() {
            if visits[trie] <= 1 {
                continue;
            }
            let up = parent[trie];
            let up_node = compressed[up];
            if up != TOP && visits[up] == visits[trie] {
                nodes[up_node].len += 1;
                nodes[up_node].depth += 1;
                compressed[trie] = up_node;
            } else {
                let index = nodes.len();
                let depth = nodes[up_node].depth + 1;
                nodes.push(Node::new(1, depth));
                edges.push(Vec::new());
                edges[up_node].push((index, visits[trie]));
                compressed[trie] = index;
            }
        }
        for (trie, &stops) in stops_at.iter().enumerate() {
            nodes[compressed[trie]].stops += stops;
        }
        for (node, edges) in nodes.iter_mut().zip(edges) {
            (node.children, node.weights) = edges.into_iter().unzip();
        }

        let residuals = order
            .iter()
            .filter(|r| !r.hash_ids.is_empty())
            .map(|r| {
                // Traces where the ids do not cover the prompt exactly are clamped to a block.
                let before_last = (r.hash_ids.len() as u64 - 1).saturating_mul(block_tokens as u64);
                let last = u64::from(r.input_length).saturating_sub(before_last);
                last.clamp(1, block_tokens as u64) as u32
            })
            .collect();
        Ok(Synthesizer {
            block_tokens,
            source_requests: order.len(),
            nodes,
            context_blocks,
            residuals,
            output_lengths: order.iter().map(|r| r.output_length).collect(),
            inter_arrivals: order
                .windows(2)
                .map(|pair| pair[1].timestamp - pair[0].timestamp)
                .collect(),
        })
    }

    /// Requests in the trace the synthesizer learned from.
    pub fn source_requests(&self) -> usize {
        self.source_requests
    }

    /// Nodes of the compressed prefix tree (each a chain of shared blocks).
    pub fn tree_nodes(&self) -> usize {
        self.nodes.len() - 1
    }

    /// The id layout of one copy of the tree: every node owns a contiguous range of ids,
    /// `base[n]..base[n] + scaled[n]`, its chain scaled by `prefix_len_multiplier` (at least 1
    /// block); copy r adds `r * ids_per_copy`, so a node and copy always map to the same ids and
    /// copies never share one. Returns `(base, scaled, ids_per_copy)`.
    fn layout(&self, prefix_len_multiplier: f64) -> anyhow::Result<(Vec<u64>, Vec<u64>, u64)> {
        let mut base = Vec::with_capacity(self.nodes.len());
        let mut scaled = Vec::with_capacity(self.nodes.len());
        let mut ids_per_copy = 0u64;
        for node in &self.nodes {
            let len = if node.len == 0 {
                0
            } else {
                scale(u64::from(node.len), prefix_len_multiplier).max(1)
            };
            base.push(ids_per_copy);
            scaled.push(len);
            ids_per_copy = ids_per_copy
                .checked_add(len)
                .context("prefix_len_multiplier makes more prefix ids than fit in 64 bits")?;
        }
        Ok((base, scaled, ids_per_copy))
    }

    /// Generates a trace with the knobs of `config`, sorted by timestamp, the first at 0. Every
    /// request has `ceil(input_length / block_tokens)` hash ids and at least one token in and out.
    /// Prefix ids are numbered from 0, copy by copy; context ids follow above all of them and are
    /// never reused.
    ///
    /// # Errors
    ///
    /// Fails if a knob is invalid (see [`SynthConfig::validate`]), `config.block_tokens` is not
    /// the learned block size, or the knobs make ids or prompt lengths overflow.
    pub fn generate(&self, config: &SynthConfig) -> anyhow::Result<Vec<TraceRequest>> {
        config.validate()?;
        ensure!(
            config.block_tokens == self.block_tokens,
            "block_tokens {} differs from the {} the synthesizer learned with",
            config.block_tokens,
            self.block_tokens
        );
        let count = config.num_requests.unwrap_or(self.source_requests);
        let block_tokens = self.block_tokens as u64;

        let (base, scaled, ids_per_copy) = self.layout(config.prefix_len_multiplier)?;
        let mut fresh_id = ids_per_copy
            .checked_mul(config.prefix_root_multiplier as u64)
            .context("prefix_root_multiplier makes more prefix ids than fit in 64 bits")?;
        // A prompt may have at most this many blocks for its length to fit in a u32.
        let max_blocks = u64::from(u32::MAX) / block_tokens;

        let mut copies = stream(config.seed, 1);
        let mut walks = stream(config.seed, 2);
        let mut contexts = stream(config.seed, 3);
        let mut residuals = stream(config.seed, 4);
        let mut outputs = stream(config.seed, 5);
        let mut arrivals = stream(config.seed, 6);
        let mut urn = Urn::full(&self.nodes);
        let mut context_decks: Vec<Deck<u32>> = self.context_blocks.iter().map(|s| Deck::new(s)).collect();
        let mut residual_deck = Deck::new(&self.residuals);
        let mut output_deck = Deck::new(&self.output_lengths);
        let mut arrival_deck = Deck::new(&self.inter_arrivals);

        let mut requests = Vec::with_capacity(count);
        let mut elapsed_ms = 0u64;
        let mut walked = Vec::new();
        for index in 0..count {
            let copy = copies.random_range(0..config.prefix_root_multiplier) as u64;
            walked.clear();
            let stop = urn.walk(&self.nodes, &mut walks, &mut walked);
            // Every stop node had a request stop at its depth, so its bucket has samples.
            let context = context_decks
                .get_mut(depth_bucket(self.nodes[stop].depth))
                .and_then(|deck| deck.deal(&mut contexts))
                .unwrap_or(0);
            let context = scale(u64::from(context), config.prompt_len_multiplier);
            let prefix_blocks: u64 = walked.iter().map(|&node| scaled[node]).sum();
            // A request with neither shared nor own blocks still needs one block for its tokens.
            let context = if prefix_blocks + context == 0 { 1 } else { context };
            let blocks = prefix_blocks.saturating_add(context);
            ensure!(
                blocks <= max_blocks,
                "request {index} would have {blocks} blocks of {block_tokens} tokens, more than a u32 length \
                 holds; lower prefix_len_multiplier or prompt_len_multiplier"
            );

            let mut hash_ids = Vec::with_capacity(blocks as usize);
            let copy_base = copy * ids_per_copy;
            for &node in &walked {
                let first = copy_base + base[node];
                hash_ids.extend(first..first + scaled[node]);
            }
            hash_ids.extend(fresh_id..fresh_id + context);
            fresh_id += context;

            let residual = residual_deck.deal(&mut residuals).map_or(block_tokens, u64::from);
            let residual = scale(residual, config.prompt_len_multiplier).clamp(1, block_tokens);
            // Fits: blocks <= u32::MAX / block_tokens and residual <= block_tokens.
            let input_length =
                u32::try_from((blocks - 1) * block_tokens + residual).context("prompt length overflows a u32")?;
            let output = output_deck.deal(&mut outputs).map_or(1, u64::from);
            let output_length = scale(output, config.osl_multiplier).clamp(1, u64::from(u32::MAX)) as u32;
            if index > 0 {
                elapsed_ms = elapsed_ms.saturating_add(arrival_deck.deal(&mut arrivals).unwrap_or(0));
            }
            requests.push(TraceRequest {
                timestamp: (elapsed_ms as f64 / config.speedup_ratio).round() as u64,
                input_length,
                output_length,
                hash_ids,
                media: Vec::new(),
            });
        }
        Ok(requests)
    }
}

/// Tests on a synthetic conversation fixture (no files). With every knob at 1 and as many
/// requests as the source, the synthesized trace must match the source within: block reuse
/// and token-weighted prefix hit ratio ±0.03 absolute, mean ISL ±5 %, ISL p50 and p90 ±10 %,
/// mean OSL ±5 %, duration ±15 %.
#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;
    use crate::stats::{TraceStats, trace_stats};

    const BLOCK: usize = 512;

    /// About 3000 requests of multi-turn conversations: 3 system prompts of 2, 5 and 9 blocks
    /// (and a tenth of sessions with none), a first user message of 1–8 blocks, each later turn
    /// adding 1–4 blocks to the previous turn's ids, skewed output lengths, and arrivals
    /// quantised to 3 s as in the Mooncake trace, so many requests share a timestamp.
    fn fixture(seed: u64) -> Vec<TraceRequest> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut next_id = 0u64;
        let mut fresh = |n: u64| {
            let ids: Vec<u64> = (next_id..next_id + n).collect();
            next_id += n;
            ids
        };
        let systems = [fresh(2), fresh(5), fresh(9)];
        let mut requests = Vec::new();
        while requests.len() < 3000 {
            let mut ids = match rng.random_range(0..10) {
                0..5 => systems[0].clone(),
                5..8 => systems[1].clone(),
                8 => systems[2].clone(),
                _ => Vec::new(),
            };
            ids.extend(fresh(rng.random_range(1..=8)));
            let turns = 1 + rng.random_range(0..3) * rng.random_range(0..3);
            let mut at: u64 = rng.random_range(0..600_000);
            for turn in 0..turns {
                if turn > 0 {
                    ids.extend(fresh(rng.random_range(1..=4)));
                    at += rng.random_range(5_000..60_000);
                }
                let skew: f64 = rng.random();
                requests.push(TraceRequest {
                    timestamp: at / 3000 * 3000,
                    input_length: ((ids.len() - 1) * BLOCK) as u32 + rng.random_range(1..=BLOCK as u32),
                    output_length: 10 + (1500.0 * skew * skew * skew) as u32,
                    hash_ids: ids.clone(),
                    media: Vec::new(),
                });
            }
        }
        requests.sort_by_key(|r| r.timestamp);
        requests
    }

    fn synthesize(source: &[TraceRequest], config: &SynthConfig) -> Vec<TraceRequest> {
        Synthesizer::learn(source, BLOCK)
            .expect("learn")
            .generate(config)
            .expect("generate")
    }

    fn within(name: &str, got: f64, want: f64, relative: f64) {
        assert!(
            (got - want).abs() <= relative * want.abs(),
            "{name}: got {got}, want {want} ± {}%",
            relative * 100.0
        );
    }

    #[test]
    fn the_fixture_looks_like_a_conversation_trace() {
        let source = fixture(1);
        let stats = trace_stats(&source, BLOCK);
        assert!((3000..3100).contains(&stats.requests), "{stats}");
        assert!(
            stats.block_reuse_ratio > 0.3 && stats.block_reuse_ratio < 0.8,
            "{stats}"
        );
        assert!(
            stats.mean_prefix_blocks > 2.0 && stats.mean_tail_blocks > 1.0,
            "{stats}"
        );
        let distinct_times: HashSet<u64> = source.iter().map(|r| r.timestamp).collect();
        assert!(distinct_times.len() * 5 < source.len(), "arrivals are bursty");
    }

    #[test]
    fn with_every_knob_at_one_the_statistics_match_the_source() {
        let source = fixture(1);
        let synth = synthesize(&source, &SynthConfig::default());
        let want = trace_stats(&source, BLOCK);
        let got = trace_stats(&synth, BLOCK);
        let report = crate::stats::markdown_table(&[("source", &want), ("synth", &got)]);
        assert_eq!(got.requests, want.requests);
        assert!(
            (got.block_reuse_ratio - want.block_reuse_ratio).abs() <= 0.03,
            "block reuse\n{report}"
        );
        assert!(
            (got.prefix_hit_ratio - want.prefix_hit_ratio).abs() <= 0.03,
            "prefix hit\n{report}"
        );
        within("ISL mean", got.isl_mean, want.isl_mean, 0.05);
        within("ISL p50", f64::from(got.isl_p50), f64::from(want.isl_p50), 0.10);
        within("ISL p90", f64::from(got.isl_p90), f64::from(want.isl_p90), 0.10);
        within("OSL mean", got.osl_mean, want.osl_mean, 0.05);
        within("duration", got.duration_ms as f64, want.duration_ms as f64, 0.15);
    }

    #[test]
    fn every_request_is_well_formed_and_sorted() {
        let source = fixture(2);
        for config in [
            SynthConfig::default(),
            SynthConfig {
                prefix_len_multiplier: 0.3,
                prompt_len_multiplier: 0.2,
                osl_multiplier: 0.001,
                ..SynthConfig::default()
            },
            SynthConfig {
                prefix_len_multiplier: 1.7,
                prompt_len_multiplier: 2.5,
                prefix_root_multiplier: 3,
                ..SynthConfig::default()
            },
        ] {
            let synth = synthesize(&source, &config);
            assert_eq!(synth[0].timestamp, 0);
            for pair in synth.windows(2) {
                assert!(pair[0].timestamp <= pair[1].timestamp, "{config:?}");
            }
            for request in &synth {
                assert!(request.input_length >= 1 && request.output_length >= 1, "{config:?}");
                assert_eq!(
                    request.hash_ids.len(),
                    (request.input_length as usize).div_ceil(BLOCK),
                    "{config:?}: {request:?}"
                );
            }
        }
    }

    /// Mean blocks per request walked in the prefix tree and drawn as own context, told apart by
    /// id: context ids are allocated above every prefix id (one copy of the tree here).
    fn prefix_and_context(source: &[TraceRequest], config: &SynthConfig) -> (f64, f64) {
        let learned = Synthesizer::learn(source, BLOCK).expect("learn");
        let (_, _, first_context_id) = learned.layout(config.prefix_len_multiplier).expect("layout");
        let synth = learned.generate(config).expect("generate");
        let prefix: usize = synth
            .iter()
            .map(|r| r.hash_ids.iter().filter(|&&id| id < first_context_id).count())
            .sum();
        let all: usize = synth.iter().map(|r| r.hash_ids.len()).sum();
        let count = synth.len() as f64;
        (prefix as f64 / count, (all - prefix) as f64 / count)
    }

    #[test]
    fn more_root_copies_split_the_reuse_and_share_no_id() {
        let source = fixture(3);
        let one = trace_stats(&synthesize(&source, &SynthConfig::default()), BLOCK);
        let four = synthesize(
            &source,
            &SynthConfig {
                prefix_root_multiplier: 4,
                ..SynthConfig::default()
            },
        );
        let four_stats = trace_stats(&four, BLOCK);
        assert!(
            four_stats.block_reuse_ratio < one.block_reuse_ratio - 0.05,
            "reuse {} with 4 copies, {} with 1",
            four_stats.block_reuse_ratio,
            one.block_reuse_ratio
        );
        // Two requests share an id only if they start with the same block (the same root of
        // the same copy); every system prompt now has 4 copies, so 12 first blocks start many
        // requests (a conversation without a system prompt starts a handful at most).
        let mut first_blocks_of: HashMap<u64, HashSet<u64>> = HashMap::new();
        for request in &four {
            for &id in &request.hash_ids {
                first_blocks_of.entry(id).or_default().insert(request.hash_ids[0]);
            }
        }
        assert!(first_blocks_of.values().all(|firsts| firsts.len() == 1));
        let mut starts: HashMap<u64, usize> = HashMap::new();
        for request in &four {
            *starts.entry(request.hash_ids[0]).or_default() += 1;
        }
        assert_eq!(starts.values().filter(|&&n| n >= 30).count(), 12, "{starts:?}");
    }

    #[test]
    fn the_prefix_length_multiplier_scales_shared_prefixes() {
        let source = fixture(4);
        let (prefix, context) = prefix_and_context(&source, &SynthConfig::default());
        let want = trace_stats(&source, BLOCK).mean_prefix_blocks;
        within("walked prefix vs the source's shared prefix", prefix, want, 0.10);
        let doubled = SynthConfig {
            prefix_len_multiplier: 2.0,
            ..SynthConfig::default()
        };
        let (long_prefix, same_context) = prefix_and_context(&source, &doubled);
        within("doubled prefix", long_prefix, 2.0 * prefix, 0.02);
        within("context", same_context, context, 0.02);
        // Shorter chains shrink too, but never below one block per node.
        let (short_prefix, _) = prefix_and_context(
            &source,
            &SynthConfig {
                prefix_len_multiplier: 0.5,
                ..SynthConfig::default()
            },
        );
        assert!(
            short_prefix < 0.8 * prefix && short_prefix > 0.4 * prefix,
            "{short_prefix} vs {prefix}"
        );
    }

    #[test]
    fn the_prompt_length_multiplier_scales_own_context() {
        let source = fixture(5);
        let (prefix, context) = prefix_and_context(&source, &SynthConfig::default());
        let want = trace_stats(&source, BLOCK).mean_tail_blocks;
        within("drawn context vs the source's tails", context, want, 0.10);
        let doubled = SynthConfig {
            prompt_len_multiplier: 2.0,
            ..SynthConfig::default()
        };
        let (same_prefix, long_context) = prefix_and_context(&source, &doubled);
        within("doubled context", long_context, 2.0 * context, 0.02);
        within("prefix", same_prefix, prefix, 0.02);
    }

    #[test]
    fn the_output_multiplier_and_the_speedup_scale_outputs_and_time() {
        let source = fixture(6);
        let base: TraceStats = trace_stats(&synthesize(&source, &SynthConfig::default()), BLOCK);
        let scaled = trace_stats(
            &synthesize(
                &source,
                &SynthConfig {
                    osl_multiplier: 0.5,
                    speedup_ratio: 2.0,
                    ..SynthConfig::default()
                },
            ),
            BLOCK,
        );
        within("OSL mean", scaled.osl_mean, 0.5 * base.osl_mean, 0.02);
        within(
            "duration",
            scaled.duration_ms as f64,
            0.5 * base.duration_ms as f64,
            0.01,
        );
        within("ISL mean", scaled.isl_mean, base.isl_mean, 0.0);
    }

    #[test]
    fn the_request_count_is_respected() {
        let source = fixture(7);
        let learned = Synthesizer::learn(&source, BLOCK).expect("learn");
        assert_eq!(learned.source_requests(), source.len());
        for want in [1, 500, 5000] {
            let config = SynthConfig {
                num_requests: Some(want),
                ..SynthConfig::default()
            };
            assert_eq!(learned.generate(&config).expect("generate").len(), want);
        }
        assert_eq!(
            learned.generate(&SynthConfig::default()).expect("generate").len(),
            source.len()
        );
    }

    #[test]
    fn equal_seeds_give_equal_traces_and_different_seeds_do_not() {
        let source = fixture(8);
        let learned = Synthesizer::learn(&source, BLOCK).expect("learn");
        let seeded = |seed| {
            learned
                .generate(&SynthConfig {
                    seed,
                    num_requests: Some(300),
                    ..SynthConfig::default()
                })
                .expect("generate")
        };
        assert_eq!(seeded(11), seeded(11));
        assert_ne!(seeded(11), seeded(12));
    }

    #[test]
    fn bad_knobs_are_refused_by_name() {
        let learned = Synthesizer::learn(&fixture(9), BLOCK).expect("learn");
        let cases: Vec<(&str, SynthConfig)> = vec![
            (
                "prefix_len_multiplier",
                SynthConfig {
                    prefix_len_multiplier: 0.0,
                    ..SynthConfig::default()
                },
            ),
            (
                "prefix_len_multiplier",
                SynthConfig {
                    prefix_len_multiplier: f64::NAN,
                    ..SynthConfig::default()
                },
            ),
            (
                "prefix_root_multiplier",
                SynthConfig {
                    prefix_root_multiplier: 0,
                    ..SynthConfig::default()
                },
            ),
            (
                "prompt_len_multiplier",
                SynthConfig {
                    prompt_len_multiplier: f64::INFINITY,
                    ..SynthConfig::default()
                },
            ),
            (
                "osl_multiplier",
                SynthConfig {
                    osl_multiplier: -1.0,
                    ..SynthConfig::default()
                },
            ),
            (
                "speedup_ratio",
                SynthConfig {
                    speedup_ratio: 0.0,
                    ..SynthConfig::default()
                },
            ),
            (
                "num_requests",
                SynthConfig {
                    num_requests: Some(0),
                    ..SynthConfig::default()
                },
            ),
            (
                "block_tokens",
                SynthConfig {
                    block_tokens: 16,
                    ..SynthConfig::default()
                },
            ),
            (
                "prefix_len_multiplier",
                SynthConfig {
                    prefix_len_multiplier: 1e9,
                    ..SynthConfig::default()
                },
            ),
        ];
        for (knob, config) in cases {
            let err = learned.generate(&config).expect_err(knob);
            assert!(format!("{err:#}").contains(knob), "{knob}: {err:#}");
        }
    }

    #[test]
    fn learning_refuses_an_empty_trace_or_empty_blocks() {
        let err = Synthesizer::learn(&[], BLOCK).expect_err("empty");
        assert!(format!("{err:#}").contains("empty trace"), "{err:#}");
        let err = Synthesizer::learn(&fixture(10)[..5], 0).expect_err("block 0");
        assert!(format!("{err:#}").contains("block_tokens"), "{err:#}");
    }

    /// Two requests [a,b,c,d] and [a,b,c,e] and one [a,f]: the chain a-b-c... is not one node,
    /// since one visit of `a` leaves for `f`; b-c is one chain of 2 after `a`.
    #[test]
    fn unary_chains_of_shared_blocks_become_one_node() {
        let request = |ids: &[u64]| TraceRequest {
            timestamp: 0,
            input_length: (ids.len() * BLOCK) as u32,
            output_length: 1,
            hash_ids: ids.to_vec(),
            media: Vec::new(),
        };
        let learned = Synthesizer::learn(
            &[request(&[1, 2, 3, 4]), request(&[1, 2, 3, 5]), request(&[1, 6])],
            BLOCK,
        )
        .expect("learn");
        assert_eq!(learned.tree_nodes(), 2);
        let chain = &learned.nodes[2];
        assert_eq!((chain.len, chain.depth, chain.stops), (2, 3, 2));
        let root = &learned.nodes[1];
        assert_eq!((root.len, root.stops, root.visits()), (1, 1, 3));
        assert_eq!(learned.nodes[TOP].visits(), 3);
        // Every synthesized request starts with the root, and walks are drawn without
        // replacement in epochs of 3, so exactly two thirds go on through the chain.
        let synth = learned
            .generate(&SynthConfig {
                num_requests: Some(3000),
                ..SynthConfig::default()
            })
            .expect("generate");
        assert!(synth.iter().all(|r| r.hash_ids[0] == 0));
        let through_chain = synth
            .iter()
            .filter(|r| r.hash_ids.get(1..3) == Some(&[1, 2][..]))
            .count();
        assert_eq!(through_chain, 2000);
    }
}
