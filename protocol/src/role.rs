//! What a worker does, as configuration files and registrations name it.
//!
//! LLM workers come in three roles: `llm` does both phases of a request, `decode` does too
//! (it prefills locally whenever the router does not send the prompt to a prefill worker) but
//! is sized as the decode pool, and `prefill` only computes prompts whose KV blocks a decode
//! worker then pulls (prefill/decode disaggregation).

use serde::{Deserialize, Serialize};

/// What a worker does: `llm`, `prefill`, `decode`, `vision` or `audio` on the wire and in
/// configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Generates tokens (prefill and decode).
    #[default]
    Llm,
    /// Computes prompts for decode workers, which pull the KV blocks it made; never serves a
    /// request's answer itself.
    Prefill,
    /// Generates tokens, from KV blocks a prefill worker computed or prefilling itself.
    Decode,
    /// Encodes images or video frames.
    Vision,
    /// Encodes audio.
    Audio,
}

impl Role {
    /// The name used on the wire, in configuration and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Llm => "llm",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Vision => "vision",
            Role::Audio => "audio",
        }
    }

    /// Whether the worker answers requests: an `llm` or `decode` worker.
    pub fn generates(self) -> bool {
        matches!(self, Role::Llm | Role::Decode)
    }

    /// Whether the worker runs a language model and holds KV blocks: every role but the
    /// encoders'.
    pub fn is_llm(self) -> bool {
        matches!(self, Role::Llm | Role::Prefill | Role::Decode)
    }

    /// Whether the worker encodes media.
    pub fn is_encoder(self) -> bool {
        matches!(self, Role::Vision | Role::Audio)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Role;

    #[test]
    fn roles_travel_as_lowercase_names() {
        for role in [Role::Llm, Role::Prefill, Role::Decode, Role::Vision, Role::Audio] {
            let json = serde_json::to_string(&role).expect("serializes");
            assert_eq!(json, format!("\"{}\"", role.as_str()));
            assert_eq!(serde_json::from_str::<Role>(&json).expect("parses"), role);
        }
        assert!(serde_json::from_str::<Role>("\"gpu\"").is_err());
    }
}
