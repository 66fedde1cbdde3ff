//! The mocker: a simulated LLM engine for fleet-scale tests without GPUs.
//!
//! It is a product feature, not a test stub: it runs the same scheduler and KV block pool as the
//! native engine ([`crate::engine`]: continuous batching, prefix caching, eviction, preemption),
//! takes as long as Dynamo's fitted perf model says ([`perf`]) divided by a speed-up factor
//! ([`engine`]), and serves the same OpenAI endpoints as a real worker ([`crate::server`]),
//! prefill/decode disaggregation included (its blocks move by name, in the time the link's
//! bandwidth gives: [`KvTransferConfig`]). [`spawn_fleet`] starts many engines in one process,
//! one port each.

pub mod engine;
pub mod perf;

use std::net::SocketAddr;

use tokio::net::TcpListener;

pub use crate::server::{KvTransferConfig, ServerConfig, WorkerServer};
pub use engine::{EngineConfig, EngineHandle, spawn_engine};

/// The port of server `index` of a fleet: 0 (ephemeral) when `base_port` is 0, else
/// `base_port + index`.
///
/// # Errors
///
/// `InvalidInput` if the range runs past 65535.
pub fn fleet_port(base_port: u16, index: usize) -> std::io::Result<u16> {
    if base_port == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(base_port) + index)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "port range runs past 65535"))
}

/// Starts `count` mockers on `host`, each with its own engine and port. With `base_port` 0
/// every mocker gets an ephemeral port; otherwise mocker `i` listens on `base_port + i`.
///
/// # Errors
///
/// Returns the I/O error of the first port that cannot be bound.
pub async fn spawn_fleet(
    count: usize,
    host: std::net::IpAddr,
    base_port: u16,
    engine: &EngineConfig,
    server: &ServerConfig,
) -> std::io::Result<Vec<WorkerServer>> {
    let mut fleet = Vec::with_capacity(count);
    for index in 0..count {
        let listener = TcpListener::bind(SocketAddr::new(host, fleet_port(base_port, index)?)).await?;
        fleet.push(WorkerServer::start(
            listener,
            spawn_engine(engine.clone()),
            server.clone(),
        )?);
    }
    Ok(fleet)
}
