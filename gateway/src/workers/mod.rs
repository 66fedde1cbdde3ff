//! Workers as the gateway sees them: who they are, whether they are healthy, how busy they are.
//!
//! This module owns the worker registry ([`WorkerPool`]: configured, embedded and registered
//! workers, and the healthy candidates of a model), each worker's in-flight count
//! ([`InFlight`]) and measured prefill ([`prefill_fit`]), its engine and that engine's own
//! load metrics ([`engine`]), passive and active health ([`health`], which reports ejections
//! through a callback, and [`breaker`] for what its answers say), the pooled HTTP clients that
//! reach workers ([`client`], and [`upstream`] for the answers the relay reads), and
//! simulated workers started in-process for the embedded default (`embedded`, feature
//! `embedded-mockers`). It knows nothing about client
//! connections, OpenAI bodies, the KV index or policies: the routing core (`crate::routing`)
//! puts them together.

pub mod breaker;
pub mod client;
#[cfg(feature = "embedded-mockers")]
pub mod embedded;
pub mod engine;
pub mod health;
pub mod prefill_fit;
mod registry;
pub mod upstream;

pub use registry::{InFlight, Worker, WorkerPool};
