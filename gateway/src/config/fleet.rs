//! `[fleet]`: gateway replicas that share one router policy through NATS JetStream.

use serde::Deserialize;

/// `[fleet]`: the fleet this gateway belongs to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// The NATS server (with JetStream) the fleet's state lives in.
    pub nats_url: String,
    /// This replica's name in the fleet's status (letters, digits, `-`, `_`); default: the
    /// host's name and the process id.
    #[serde(default)]
    pub replica: Option<String>,
    /// Prefix of the fleet's JetStream buckets (`PREFIX-fleet`, a KV bucket, and
    /// `PREFIX-policies`, an object store); gateways with the same prefix are one fleet.
    #[serde(default = "default_bucket")]
    pub bucket: String,
}

fn default_bucket() -> String {
    "switchyard".into()
}

fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

impl FleetConfig {
    /// This replica's name.
    pub fn replica_name(&self) -> String {
        self.replica.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| "gateway".into());
            let host: String = host
                .trim()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
                .collect();
            format!("{host}-{}", std::process::id())
        })
    }

    /// Checks the values; answers the offending key and why.
    pub(crate) fn check(&self) -> Result<(), (&'static str, String)> {
        if !self.nats_url.starts_with("nats://") && !self.nats_url.starts_with("tls://") {
            return Err((
                "fleet.nats_url",
                format!("`{}` must be a nats:// or tls:// URL", self.nats_url),
            ));
        }
        if let Some(replica) = &self.replica
            && !name_ok(replica)
        {
            return Err((
                "fleet.replica",
                format!("`{replica}`: a replica is named with letters, digits, `-` and `_`"),
            ));
        }
        if !name_ok(&self.bucket) {
            return Err((
                "fleet.bucket",
                format!("`{}`: a bucket prefix is letters, digits, `-` and `_`", self.bucket),
            ));
        }
        Ok(())
    }
}
