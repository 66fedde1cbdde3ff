//! Worker role values in [`crate::WorkerTable::roles`].

/// Generates tokens.
pub const LLM: u32 = 0;
/// Encodes images and video frames.
pub const VISION: u32 = 1;
/// Encodes audio.
pub const AUDIO: u32 = 2;
