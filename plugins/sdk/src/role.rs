//! Worker role values in [`crate::WorkerTable::roles`].

/// Generates tokens.
pub const LLM: u32 = 0;
/// Encodes images and video frames.
pub const VISION: u32 = 1;
/// Encodes audio.
pub const AUDIO: u32 = 2;
/// Computes prompts whose KV blocks the answering worker pulls (only in the tables of routers
/// exported with [`disaggregating_router!`](crate::disaggregating_router)).
pub const PREFILL: u32 = 3;
