//! Why a media item was refused.
//!
//! One error type, [`MediaError`], for every way an item can fail on the request path: it is not a
//! data URL or not base64, its container is cut short or malformed, its format or codec is one
//! the encoders do not take, the gateway's policy refuses it, it exceeds the operator's limits,
//! or the model has no room for it.
//! Every variant is the client's fault (an HTTP 400 upstream) and its message says why in plain
//! words, naming the container, so the gateway can hand it to the client as it is.

use crate::info::Container;

/// Why a media item could not be decoded from the request, probed, or fitted into the model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MediaError {
    /// The URL is not a `data:` URL (or has no comma separating the data).
    #[error("not a data URL: {0}")]
    NotDataUrl(String),
    /// The data URL is not base64-encoded; the field is its media type.
    #[error("data URL `data:{0},...` is not base64-encoded; send `data:<media type>;base64,<data>`")]
    NotBase64(String),
    /// The base64 text does not decode.
    #[error("invalid base64: {0}")]
    BadBase64(String),
    /// The container's own structure says bytes are missing at the end.
    #[error("truncated {}: {why}", .container.name())]
    Truncated {
        /// The container.
        container: Container,
        /// What is missing, in plain words.
        why: String,
    },
    /// The container's structure is inconsistent (not a matter of missing bytes).
    #[error("malformed {}: {why}", .container.name())]
    Malformed {
        /// The container.
        container: Container,
        /// What is wrong, in plain words.
        why: String,
    },
    /// The item is of a format, container or codec the encoders do not take; says which, and
    /// what to send instead where there is something.
    #[error("{0}")]
    Unsupported(String),
    /// The gateway refuses the item by policy (a remote URL while fetching is off, ...); the
    /// message says what to send instead.
    #[error("{0}")]
    Refused(String),
    /// `input_audio.format` names one format and the bytes are another.
    #[error("input_audio.format is `{declared}` but the data looks like {found}")]
    FormatMismatch {
        /// The declared format, as the client sent it.
        declared: String,
        /// What the bytes look like (for example "MP3 audio").
        found: String,
    },
    /// The item exceeds one of the operator's [`MediaLimits`](crate::MediaLimits).
    #[error("{what} {value} exceeds the limit of {limit}")]
    TooLarge {
        /// What was measured ("image size", "video duration", ...).
        what: &'static str,
        /// The item's value, with its unit.
        value: String,
        /// The limit, with its unit.
        limit: String,
    },
    /// The model's context has no room for the media (or not even for one video frame).
    #[error("no room for media: {0}")]
    NoBudget(String),
    /// A model's media settings are invalid (a zero patch size, ...).
    #[error("invalid media settings: {0}")]
    Config(String),
}

impl MediaError {
    pub(crate) fn truncated(container: Container, why: impl Into<String>) -> Self {
        Self::Truncated {
            container,
            why: why.into(),
        }
    }

    pub(crate) fn malformed(container: Container, why: impl Into<String>) -> Self {
        Self::Malformed {
            container,
            why: why.into(),
        }
    }

    /// Whether this error says the item was cut short.
    pub fn is_truncated(&self) -> bool {
        matches!(self, Self::Truncated { .. })
    }
}

/// Why a string is not a [`MediaId`](crate::MediaId): it must be exactly 32 hexadecimal digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid media id `{0}`: expected 32 hexadecimal digits")]
pub struct ParseMediaIdError(pub String);
