//! Workers as the gateway sees them: who they are, whether they are healthy, how busy they are.
//!
//! This module owns the worker registry built from configuration ([`WorkerPool`]), the choice
//! of a worker for a request (least requests in flight among healthy workers of the model,
//! until the policy host takes over), passive and active health ([`health`]), the pooled HTTP
//! client that reaches them ([`client`]), and simulated workers started in-process for the
//! embedded default ([`embedded`]). It knows nothing about client connections or OpenAI bodies.

pub mod client;
pub mod embedded;
pub mod health;
mod registry;

pub use registry::{InFlight, Worker, WorkerPool};
