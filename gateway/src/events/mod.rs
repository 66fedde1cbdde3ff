//! Where the KV index learns what workers cache, and the pool who the workers are.
//!
//! Transports carry workers' numbered KV events, registrations (heartbeats) and goodbyes, and
//! other gateways' active-sequence updates: the in-process bus of embedded mockers ([`bus`]),
//! NATS for workers and replicas elsewhere ([`nats`]), the admin API for workers without NATS
//! ([`http`]), and vLLM's ZMQ publisher ([`vllm`]). Each hands them to the one [`applier`]
//! task, which keeps the KV index (`crate::kv`) in step with each worker's stream and adds and
//! removes registered workers in the pool (`crate::workers`). This module sits above both, so
//! neither knows the other.

pub mod applier;
#[cfg(feature = "embedded-mockers")]
pub mod bus;
pub mod http;
pub mod nats;
pub mod vllm;
