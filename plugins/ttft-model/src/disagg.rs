//! What the disaggregating routers (`pd-threshold`, `pd-predicted`) share: the prompt tokens a
//! worker would have to prefill, the prefill worker with the shortest queue, and the time a
//! prompt's KV blocks take to move from a prefill worker to the answering one.
//!
//! The link's figures are the policy's config, defaulting to the simulated engines' own
//! (`switchyard-mocker --kv-block-bytes`, `--kv-link-local-gbps`, `--kv-link-remote-gbps`): a
//! block of Llama-3-8B's KV cache in f16 at 64 tokens per block (128 KiB a token), 300 GB/s
//! between GPUs of one machine (NVLink class), 25 GB/s across machines (200 Gb/s RDMA).

use switchyard_policy_sdk::{RequestInfo, WorkerTable, config};

/// How a prompt's KV blocks move between workers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes of one KV block (`kv_block_bytes`).
    pub block_bytes: f64,
    /// GB/s between workers of one machine (`link_local_gbps`).
    pub local_gbps: f64,
    /// GB/s between machines, or when either worker's machine is unknown (`link_remote_gbps`).
    pub remote_gbps: f64,
}

impl Default for Link {
    fn default() -> Link {
        Link {
            block_bytes: (128 * 1024 * 64) as f64,
            local_gbps: 300.0,
            remote_gbps: 25.0,
        }
    }
}

impl Link {
    /// The link of the policy's config, read once per instance.
    pub fn configured() -> Link {
        static LINK: config::Derived<Link> = config::Derived::new();
        LINK.get_or_init(|| {
            let defaults = Link::default();
            Link {
                block_bytes: config::get_f64("kv_block_bytes", defaults.block_bytes).max(0.0),
                local_gbps: config::get_f64("link_local_gbps", defaults.local_gbps),
                remote_gbps: config::get_f64("link_remote_gbps", defaults.remote_gbps),
            }
        })
    }

    /// Milliseconds `blocks` KV blocks take to move, within one machine or across machines;
    /// +∞ over a link of no bandwidth.
    pub fn transfer_ms(&self, blocks: f64, same_node: bool) -> f64 {
        let gbps = if same_node { self.local_gbps } else { self.remote_gbps };
        if gbps.is_nan() || gbps <= 0.0 {
            return f64::INFINITY;
        }
        blocks.max(0.0) * self.block_bytes / (gbps * 1e6)
    }
}

fn at(column: &[u32], i: usize) -> u32 {
    column.get(i).copied().unwrap_or(0)
}

/// Prompt tokens worker `i` does not hold cached on its device.
pub fn uncached_tokens(req: &RequestInfo, workers: &WorkerTable, i: usize) -> f64 {
    let block_size = f64::from(at(workers.block_size, i).max(1));
    (f64::from(req.prompt_tokens) - block_size * f64::from(at(workers.overlap_device_blocks, i))).max(0.0)
}

/// Full prompt blocks worker `i` does not hold: what moves to it from a prefill worker.
pub fn missing_blocks(req: &RequestInfo, workers: &WorkerTable, i: usize) -> f64 {
    f64::from(req.prompt_blocks.saturating_sub(at(workers.overlap_device_blocks, i)))
}

/// Whether workers `i` and `j` are known to share a machine (the `node` column: equal and not 0).
pub fn same_node(workers: &WorkerTable, i: usize, j: usize) -> bool {
    let node = at(workers.node, i);
    node != 0 && node == at(workers.node, j)
}

/// The prefill worker with the fewest requests in flight, then the fewest prompt tokens queued,
/// then the most of the prompt cached, then the lowest index; `None` when the table holds none.
pub fn least_queued_prefill(workers: &WorkerTable) -> Option<usize> {
    workers.prefill_indices().min_by_key(|&i| {
        (
            at(workers.active_requests, i),
            at(workers.prefill_tokens, i),
            u32::MAX - at(workers.overlap_device_blocks, i),
            i,
        )
    })
}

/// Requests waiting at the prefill workers beyond the one each is computing: the queue that
/// Dynamo's disaggregated router bounds (its prefill workers pull from one shared queue).
pub fn prefill_queue(workers: &WorkerTable) -> u32 {
    workers
        .prefill_indices()
        .map(|i| at(workers.active_requests, i).saturating_sub(1))
        .sum()
}
