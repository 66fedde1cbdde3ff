//! Simulated workers started inside the gateway process: the embedded default.
//!
//! Each mocker engine and each mocker encoder listens on its own loopback port and is added to
//! the pool as an ordinary HTTP worker, so requests (and media) take exactly the path they take
//! to remote workers. Their KV and feature-cache events reach the applier in process.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use switchyard_protocol::kv_events::KvEvent;
use switchyard_workers::encoder::{self, EncoderConfig, EncoderServer};
use switchyard_workers::mocker::{self, EngineConfig, ServerConfig, WorkerServer};
use tokio::sync::mpsc;

use crate::config::{EmbeddedMockers, EngineKind, Role, WorkerConfig};

/// The embedded engines and encoders; they stop when dropped.
#[derive(Debug, Default)]
pub struct EmbeddedFleet {
    engines: Vec<(String, WorkerServer)>,
    encoders: Vec<(String, EncoderServer)>,
}

impl EmbeddedFleet {
    /// Each embedded engine's name and address.
    pub fn engine_addresses(&self) -> Vec<(String, SocketAddr)> {
        self.engines
            .iter()
            .map(|(name, engine)| (name.clone(), engine.addr()))
            .collect()
    }

    /// Each embedded encoder's name and address.
    pub fn encoder_addresses(&self) -> Vec<(String, SocketAddr)> {
        self.encoders
            .iter()
            .map(|(name, server)| (name.clone(), server.addr()))
            .collect()
    }

    /// Each worker's name and a receiver of its KV (or feature-cache) events.
    pub fn event_sources(&self) -> Vec<(String, mpsc::UnboundedReceiver<KvEvent>)> {
        let mut sources = Vec::new();
        for (name, engine) in &self.engines {
            let (sink, events) = mpsc::unbounded_channel();
            engine.engine().subscribe_kv_events(sink);
            sources.push((name.clone(), events));
        }
        for (name, server) in &self.encoders {
            let (sink, events) = mpsc::unbounded_channel();
            server.subscribe_kv_events(sink);
            sources.push((name.clone(), events));
        }
        sources
    }
}

/// Starts the configured mockers and encoders and returns them with their worker entries.
///
/// # Errors
///
/// Returns the I/O error of a loopback port that cannot be bound.
pub async fn start(config: &EmbeddedMockers) -> std::io::Result<(EmbeddedFleet, Vec<WorkerConfig>)> {
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
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
        overlap_prefill: config.overlap_prefill,
        local_encode_scale: config.encoder_cost_scale,
        kv_transfer: mocker::KvTransferConfig {
            remote_gbps: config.kv_link_gbps,
            ..mocker::KvTransferConfig::default()
        },
        ..ServerConfig::default()
    };
    // The regular engines cost 1 a token; spot ones are slower and cheaper.
    let spot = EngineConfig {
        speedup: config.speedup * config.spot_speed,
        ..engine.clone()
    };
    let mut engines = Vec::new();
    let mut workers: Vec<WorkerConfig> = Vec::new();
    let answering = if config.prefill_count > 0 {
        Role::Decode
    } else {
        Role::Llm
    };
    for (count, engine, cost, spot, prefix, role) in [
        (config.count, &engine, 1.0, false, "embedded-", answering),
        (
            config.spot_count,
            &spot,
            config.spot_cost,
            true,
            "embedded-spot-",
            answering,
        ),
        (
            config.prefill_count,
            &engine,
            1.0,
            false,
            "embedded-prefill-",
            Role::Prefill,
        ),
    ] {
        for (index, mocker) in mocker::spawn_fleet(count, loopback, 0, engine, &server)
            .await?
            .into_iter()
            .enumerate()
        {
            let name = format!("{prefix}{index}");
            workers.push(WorkerConfig {
                name: Some(name.clone()),
                url: format!("http://{}", mocker.addr()),
                model: config.model.clone(),
                role,
                block_size: config.block_size,
                capabilities: vec!["text".into()],
                cost,
                capacity_blocks: config.num_gpu_blocks as u64,
                node: String::new(),
                token_budgets: Vec::new(),
                spot,
                engine: Some(EngineKind::Switchyard),
                health_path: None,
            });
            engines.push((name, mocker));
        }
    }
    let mut encoders = Vec::new();
    for (role, count, capabilities) in [
        (
            Role::Vision,
            config.vision_encoders,
            vec!["image".to_string(), "video".to_string()],
        ),
        (Role::Audio, config.audio_encoders, vec!["audio".to_string()]),
    ] {
        let encoder_config = EncoderConfig {
            role,
            model: config.model.clone(),
            speedup: config.speedup,
            cost_scale: config.encoder_cost_scale,
            ..EncoderConfig::default()
        };
        for (index, server) in encoder::spawn_encoders(count, loopback, 0, &encoder_config)
            .await?
            .into_iter()
            .enumerate()
        {
            let name = format!("embedded-{role}-{index}");
            workers.push(WorkerConfig {
                name: Some(name.clone()),
                url: format!("http://{}", server.addr()),
                model: config.model.clone(),
                role,
                block_size: 1,
                capabilities: capabilities.clone(),
                cost: 1.0,
                capacity_blocks: 0,
                node: String::new(),
                token_budgets: encoder_config.token_budgets.clone(),
                spot: false,
                engine: Some(EngineKind::Switchyard),
                health_path: None,
            });
            encoders.push((name, server));
        }
    }
    Ok((EmbeddedFleet { engines, encoders }, workers))
}
