//! Simulated workers started inside the gateway process: the embedded default.
//!
//! Each mocker listens on its own loopback port and is added to the pool as an ordinary HTTP
//! worker, so requests take exactly the path they take to remote workers.

use std::net::{IpAddr, Ipv4Addr};

use switchyard_workers::mocker::{self, EngineConfig, ServerConfig, WorkerServer};

use crate::config::{EmbeddedMockers, Role, WorkerConfig};

/// Starts the configured mockers and returns them with their worker entries.
///
/// # Errors
///
/// Returns the I/O error of a loopback port that cannot be bound.
pub async fn start(config: &EmbeddedMockers) -> std::io::Result<(Vec<WorkerServer>, Vec<WorkerConfig>)> {
    let engine = EngineConfig {
        block_size: config.block_size,
        num_gpu_blocks: config.num_gpu_blocks,
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs: config.max_num_seqs,
        enable_chunked_prefill: true,
        enable_prefix_caching: true,
        speedup: config.speedup,
    };
    let server = ServerConfig {
        model: config.model.clone(),
        default_max_tokens: config.default_max_tokens,
        ..ServerConfig::default()
    };
    let fleet = mocker::spawn_fleet(config.count, IpAddr::V4(Ipv4Addr::LOCALHOST), 0, &engine, &server).await?;
    let workers = fleet
        .iter()
        .enumerate()
        .map(|(index, mocker)| WorkerConfig {
            name: Some(name(index)),
            url: format!("http://{}", mocker.addr()),
            model: config.model.clone(),
            role: Role::Llm,
            block_size: config.block_size,
            capabilities: vec!["text".into()],
            cost: 1.0,
            capacity_blocks: config.num_gpu_blocks as u64,
        })
        .collect();
    Ok((fleet, workers))
}

/// The worker name of embedded mocker `index`.
pub fn name(index: usize) -> String {
    format!("embedded-{index}")
}
