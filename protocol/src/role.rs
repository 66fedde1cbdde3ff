//! What a worker does, as configuration files and registrations name it.

use serde::{Deserialize, Serialize};

/// What a worker does: `llm`, `vision` or `audio` on the wire and in configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Generates tokens (prefill and decode).
    #[default]
    Llm,
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
            Role::Vision => "vision",
            Role::Audio => "audio",
        }
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
        for role in [Role::Llm, Role::Vision, Role::Audio] {
            let json = serde_json::to_string(&role).expect("serializes");
            assert_eq!(json, format!("\"{}\"", role.as_str()));
            assert_eq!(serde_json::from_str::<Role>(&json).expect("parses"), role);
        }
        assert!(serde_json::from_str::<Role>("\"gpu\"").is_err());
    }
}
