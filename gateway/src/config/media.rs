//! `[media]` and `[encoders]`: what media a request may carry, and how the gateway queues it
//! for encoder workers.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Checked, Invalid, built_in_or_file, positive};
use crate::built_ins::World;

/// `[encoders]`: the gateway's queue in front of each encoder worker (role `vision` or
/// `audio`), and how long an encode may take.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EncodersConfig {
    /// Most items in one micro-batch.
    pub max_items: usize,
    /// A batch is sent at the latest this long after its first item arrived.
    pub deadline_ms: u64,
    /// How long one encode (queue, forward pass, delivery) may take before it is retried
    /// elsewhere.
    pub timeout_ms: u64,
    /// Send the LLM request only once the media is encoded, instead of at once (the
    /// baseline that encode/prefill overlap is measured against).
    pub blocking: bool,
    /// No encoder pool: each LLM worker encodes its requests' media itself, on its own
    /// device, one item at a time (the deployment encoder pools are measured against).
    pub local: bool,
    /// The batching policy at every encoder queue: a built-in batcher (listed in
    /// `plugins/README.md`) or a path to a `.wasm` exporting the `batcher` world.
    pub batcher: String,
    /// Most batches one flush of a queue forms (the rest wait for the next flush).
    pub max_batches: u32,
    /// The batcher's own settings, readable through the host world's `config.get`.
    pub batcher_config: toml::Table,
}

impl Default for EncodersConfig {
    fn default() -> EncodersConfig {
        EncodersConfig {
            max_items: 8,
            deadline_ms: 5,
            timeout_ms: 10_000,
            blocking: false,
            local: false,
            batcher: "mixed-modality".into(),
            max_batches: 4,
            batcher_config: toml::Table::new(),
        }
    }
}

/// `[media]`: limits on the media parts of chat requests (images, audio, video), checked from
/// their headers before any worker is involved.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MediaConfig {
    /// Fetch `http(s)` media URLs. Off by default: only `data:` URLs are accepted.
    pub fetch: bool,
    /// Hosts media may be fetched from when `fetch` is on (empty: none).
    pub allow_hosts: Vec<String>,
    /// Fetch from private, loopback and link-local addresses too.
    pub allow_private: bool,
    /// Largest media item, in bytes (after base64 decoding).
    pub max_bytes: usize,
    /// Largest image or video frame, in pixels.
    pub max_pixels: u64,
    /// Longest audio or video, in seconds.
    pub max_duration_s: f64,
    /// Most media items in one request.
    pub max_items: usize,
    /// How long one URL fetch may take.
    pub fetch_timeout_ms: u64,
    /// Most URLs of one request fetched at once (the rest wait their turn).
    pub fetch_concurrency: usize,
    /// Extra CA certificates (PEM) trusted for `https` media URLs, beside the Mozilla roots.
    pub fetch_ca_file: Option<PathBuf>,
}

impl Default for MediaConfig {
    fn default() -> MediaConfig {
        let limits = switchyard_media::MediaLimits::default();
        MediaConfig {
            fetch: false,
            allow_hosts: Vec::new(),
            allow_private: false,
            max_bytes: limits.max_bytes,
            max_pixels: limits.max_pixels,
            max_duration_s: limits.max_duration_s,
            max_items: 16,
            fetch_timeout_ms: 5_000,
            fetch_concurrency: 4,
            fetch_ca_file: None,
        }
    }
}

impl MediaConfig {
    /// The header limits these settings give.
    pub fn limits(&self) -> switchyard_media::MediaLimits {
        switchyard_media::MediaLimits {
            max_bytes: self.max_bytes,
            max_pixels: self.max_pixels,
            max_duration_s: self.max_duration_s,
            ..switchyard_media::MediaLimits::default()
        }
    }
}

impl EncodersConfig {
    /// Refuses sizes and timeouts of 0, and a batcher that is neither a built-in nor a `.wasm`
    /// file.
    pub(super) fn check(&self) -> Checked {
        positive(&[
            ("encoders.max_items", self.max_items as u64),
            ("encoders.timeout_ms", self.timeout_ms),
            ("encoders.max_batches", u64::from(self.max_batches)),
        ])?;
        built_in_or_file("encoders.batcher", &self.batcher, World::Batcher)
    }
}

impl MediaConfig {
    /// Refuses fetching without the hosts it may reach or with a CA file that is not one, and
    /// limits of 0.
    pub(super) fn check(&self) -> Checked {
        if let Some(path) = self.fetch_ca_file.as_ref().filter(|_| self.fetch)
            && !path.is_file()
        {
            return Err(Invalid::new(
                "media.fetch_ca_file",
                format!("`{}` is not a readable file", path.display()),
            ));
        }
        if self.fetch && self.allow_hosts.is_empty() {
            return Err(Invalid::new(
                "media.allow_hosts",
                "`fetch = true` needs the hosts media may be fetched from (e.g. [\"images.example.com\", \"*.cdn.example.net\"])",
            ));
        }
        positive(&[
            ("media.max_bytes", self.max_bytes as u64),
            ("media.max_pixels", self.max_pixels),
            ("media.max_items", self.max_items as u64),
            ("media.fetch_timeout_ms", self.fetch_timeout_ms),
            ("media.fetch_concurrency", self.fetch_concurrency as u64),
        ])?;
        if !self.max_duration_s.is_finite() || self.max_duration_s <= 0.0 {
            return Err(Invalid::new("media.max_duration_s", "must be greater than 0"));
        }
        Ok(())
    }
}
