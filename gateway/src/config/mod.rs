//! The gateway's configuration: the TOML schema, its defaults, and validation.
//!
//! This module owns turning a TOML file into a [`Config`] and refusing a bad one with an error
//! that names the file, the key and why ([`ConfigError`]). Unknown keys are errors (a typo must
//! not silently fall back to a default). It does not start anything; `server` and `workers`
//! read the validated values.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::built_ins::{self, World};

mod admission;
mod fleet;
mod kv;
mod media;
mod models;
mod planner;
mod policy;
mod server;
mod tenants;
mod workers;

pub use admission::AdmissionConfig;
pub use fleet::FleetConfig;
pub use kv::{EngineEventsConfig, KvConfig};
pub use media::{EncodersConfig, MediaConfig};
pub use models::{ChatTemplateConfig, ModelConfig};
pub use planner::{PlannerConfig, PoolConfig, profiled_rate};
pub use policy::PolicyConfig;
pub use server::{AdminConfig, AdminTlsConfig, ServerConfig, TlsConfig};
pub use switchyard_protocol::Role;
pub use workers::{EmbeddedMockers, EngineKind, ForwardingConfig, HealthConfig, WorkerConfig};

pub use tenants::{ApiKeyConfig, KeysFile, TenantsConfig, validate_key_lists, validate_keys};

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read the config file: {source}")]
    Read {
        /// The config file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the wrong type.
    #[error("{file}: {message}")]
    Parse {
        /// The config file.
        file: PathBuf,
        /// The parser's message, which quotes the offending line and key.
        message: String,
    },
    /// A value is well-typed but unusable.
    #[error("{file}: key `{key}`: {reason}")]
    Invalid {
        /// The config file.
        file: PathBuf,
        /// The dotted key path, e.g. `workers[2].url`.
        key: String,
        /// Why the value is refused.
        reason: String,
    },
}

/// Whether the gateway runs for development or production.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Development: a self-signed certificate is generated when none is configured.
    #[default]
    Dev,
    /// Production: a certificate (or an explicit `plaintext = true`) is required.
    Production,
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `dev` or `production`.
    #[serde(default)]
    pub mode: Mode,
    /// The client-facing listener.
    #[serde(default)]
    pub server: ServerConfig,
    /// Active health checks of workers.
    #[serde(default)]
    pub health: HealthConfig,
    /// How requests are forwarded to workers.
    #[serde(default)]
    pub forwarding: ForwardingConfig,
    /// Simulated workers started inside the gateway process.
    #[serde(default)]
    pub embedded_mockers: Option<EmbeddedMockers>,
    /// Workers reachable over HTTP.
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// The routing policy and its sandbox.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// The admin API (policy management).
    #[serde(default)]
    pub admin: Option<AdminConfig>,
    /// Per-model tokenization and KV block settings.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// KV-aware routing: event transports, replicas, adapters.
    #[serde(default)]
    pub kv: KvConfig,
    /// Media in requests: where it may come from and how large it may be.
    #[serde(default)]
    pub media: MediaConfig,
    /// How the gateway batches media for encoders and what it does when they fail.
    #[serde(default)]
    pub encoders: EncodersConfig,
    /// The fleet of gateway replicas this one shares its router policy with.
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
    /// The admission queue in front of full workers.
    #[serde(default)]
    pub admission: Option<AdmissionConfig>,
    /// The planner that sizes worker pools.
    #[serde(default)]
    pub planner: Option<PlannerConfig>,
    /// Where API keys and tenants' usage live outside this file.
    #[serde(default)]
    pub tenants: TenantsConfig,
    /// Client keys; with none here and no `tenants.keys_file`, the gateway is open to any
    /// client that reaches it.
    #[serde(default)]
    pub api_keys: Vec<ApiKeyConfig>,
}

fn default_block_size() -> usize {
    64
}

impl Config {
    /// Reads and validates a configuration file.
    ///
    /// # Errors
    ///
    /// Returns [`ConfigError`] naming the file (and the key, where there is one) if the file
    /// cannot be read, is not valid TOML for this schema, or holds an unusable value.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses and validates configuration text; `file` is only used in error messages.
    ///
    /// # Errors
    ///
    /// As for [`Config::load`].
    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|err| ConfigError::Parse {
            file: file.to_path_buf(),
            message: err.to_string(),
        })?;
        config.validate(file)?;
        Ok(config)
    }

    /// Checks every value a parser cannot: ranges, URLs, files, uniqueness.
    ///
    /// # Errors
    ///
    /// Returns [`ConfigError::Invalid`] for the first unusable value.
    pub fn validate(&self, file: &Path) -> Result<(), ConfigError> {
        self.check().map_err(|Invalid { key, reason }| ConfigError::Invalid {
            file: file.to_path_buf(),
            key,
            reason,
        })
    }

    /// Each section's checks, in the order the sections are documented; the first unusable
    /// value ends them.
    fn check(&self) -> Checked {
        self.server.check(self.mode, self.admin.is_some())?;
        if let Some(admin) = &self.admin {
            admin.check(self.mode)?;
        }
        self.health.check()?;
        self.forwarding.check()?;
        if let Some(mockers) = &self.embedded_mockers {
            mockers.check()?;
        }
        workers::check_workers(&self.workers)?;
        self.check_some_worker()?;
        self.policy.check()?;
        self.encoders.check()?;
        self.media.check()?;
        models::check_models(&self.models)?;
        self.kv.check(&self.workers)?;
        validate_keys(&self.api_keys).map_err(|(key, reason)| Invalid::new(key, reason))?;
        if let Some(path) = &self.tenants.keys_file
            && !path.is_file()
        {
            return Err(Invalid::new(
                "tenants.keys_file",
                format!("file `{}` does not exist", path.display()),
            ));
        }
        if let Some(admission) = &self.admission {
            admission.check().map_err(|(key, reason)| Invalid::new(key, reason))?;
        }
        if let Some(fleet) = &self.fleet {
            fleet.check().map_err(|(key, reason)| Invalid::new(key, reason))?;
        }
        if let Some(planner) = &self.planner {
            planner.check().map_err(|(key, reason)| Invalid::new(key, reason))?;
        }
        Ok(())
    }

    /// Refuses a gateway with no way to get a worker: none configured, none embedded, and no
    /// NATS or admin listener for workers to register through.
    fn check_some_worker(&self) -> Checked {
        if self.workers.is_empty()
            && self.embedded_mockers.as_ref().is_none_or(|m| m.count == 0)
            && self.kv.nats_url.is_none()
            && self.admin.is_none()
        {
            return Err(Invalid::new(
                "workers",
                "no workers configured: add `[[workers]]` entries, `[embedded_mockers] count = N`, or, for workers that register themselves, `[kv] nats_url` or `[admin]`",
            ));
        }
        Ok(())
    }
}

/// An unusable value: its dotted key and why ([`Config::validate`] adds the file).
#[derive(Debug)]
struct Invalid {
    key: String,
    reason: String,
}

impl Invalid {
    fn new(key: impl Into<String>, reason: impl Into<String>) -> Invalid {
        Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// What a section's checks answer: nothing, or its first unusable value.
type Checked = Result<(), Invalid>;

/// Refuses the first of `values` that is 0, naming its key.
fn positive(values: &[(&str, u64)]) -> Checked {
    match values.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(Invalid::new(*key, "must be greater than 0")),
        None => Ok(()),
    }
}

/// Refuses a policy `name` at `key` that is neither a `.wasm` file nor a built-in of `world`.
fn built_in_or_file(key: &str, name: &str, world: World) -> Checked {
    if name.ends_with(".wasm") {
        return Ok(());
    }
    built_ins::find(world, name)
        .map(drop)
        .map_err(|err| Invalid::new(key, format!("must name a built-in policy or a .wasm file: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("test.toml"))
    }

    #[test]
    fn the_embedded_default_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/dev.toml");
        let config = Config::load(&path).expect("config/dev.toml is valid");
        assert_eq!(config.embedded_mockers.map(|m| m.count), Some(4));
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = parse("[server]\nlisten = \"127.0.0.1:1\"\nmax_body = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("test.toml:"), "{err}");
        assert!(err.contains("max_body"), "{err}");
    }

    #[test]
    fn chat_templates_are_a_pattern_or_a_jinja_file() {
        let base = "[embedded_mockers]\ncount = 1\n[[models]]\nname = \"m\"\n[models.chat_template]\n";
        let both = format!("{base}message = \"{{content}}\"\nfile = \"t.jinja\"\n");
        let err = parse(&both).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "models[0].chat_template"),
            "{err}"
        );
        let missing = format!("{base}file = \"/nonexistent/tokenizer_config.json\"\n");
        let err = parse(&missing).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "models[0].chat_template.file"),
            "{err}"
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("chat.jinja");
        std::fs::write(&path, "{% for m in messages %}{{ m['content'] }}{% endfor %}").expect("write");
        let good = format!("{base}file = \"{}\"\n", path.display());
        assert!(parse(&good).is_ok());
        assert!(parse(&format!("{base}generation_prompt = \"x\"\n")).is_err(), "neither");
    }

    #[test]
    fn a_coalescing_window_past_100_ms_is_refused() {
        let base = "[embedded_mockers]\ncount = 1\n[server]\n";
        let err = parse(&format!("{base}stream_coalesce_us = 100001\n")).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "server.stream_coalesce_us"),
            "{err}"
        );
        let config = parse(&format!("{base}stream_coalesce_us = 0\n")).expect("0 turns it off");
        assert!(config.server.stream_coalesce().is_zero());
    }

    #[test]
    fn admin_credentials_and_limits_name_the_key() {
        let base =
            "[embedded_mockers]\ncount = 1\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"admin-token-0123456789\"\n";
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("worker-token");
        std::fs::write(&file, "worker-token-from-a-file\n").expect("write");
        let cases = [
            ("worker_token = \"short\"\n", "admin.worker_token"),
            ("worker_token = \"admin-token-0123456789\"\n", "admin.worker_token"),
            (
                "worker_token_file = \"/nonexistent/worker-token\"\n",
                "admin.worker_token_file",
            ),
            (
                &*format!(
                    "worker_token = \"worker-token-0123456789\"\nworker_token_file = \"{}\"\n",
                    file.display()
                ),
                "admin.worker_token_file",
            ),
            ("max_connections = 0\n", "admin.max_connections"),
            ("header_read_timeout_ms = 0\n", "admin.header_read_timeout_ms"),
        ];
        for (extra, expected) in cases {
            let err = parse(&format!("{base}{extra}")).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key, .. } if key == expected),
                "{extra}: {err}"
            );
        }
        let config = parse(&format!("{base}worker_token_file = \"{}\"\n", file.display())).expect("a token file");
        let admin = config.admin.expect("[admin]");
        assert_eq!(admin.worker_token(), Ok(Some("worker-token-from-a-file".to_string())));
        assert_eq!(admin.max_connections, 1024);
    }

    #[test]
    fn wrong_types_are_named() {
        let err = parse("[server]\nlisten = 42\n").unwrap_err().to_string();
        assert!(err.contains("listen"), "{err}");
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = parse("[[workers]]\nurl = \"ftp://x\"\nmodel = \"m\"\n").unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "workers[0].url"),
            "{err}"
        );
        let err = parse("[embedded_mockers]\ncount = 1\nspeedup = -1.0\n").unwrap_err();
        assert!(err.to_string().contains("embedded_mockers.speedup"), "{err}");
        let err = parse("[embedded_mockers]\nspot_count = 2\nspot_speed = 0\n").unwrap_err();
        assert!(err.to_string().contains("embedded_mockers.spot_speed"), "{err}");
        let err = parse("[embedded_mockers]\ncount = 1\n[[models]]\nname = \"m\"\nttft_target_ms = -5\n").unwrap_err();
        assert!(err.to_string().contains("models[0].ttft_target_ms"), "{err}");
        let err = parse("[embedded_mockers]\ncount = 1\n[admission]\nbatcher = \"fcfs\"\n").unwrap_err();
        assert!(err.to_string().contains("key `admission`"), "{err}");
        let err = parse("[embedded_mockers]\ncount = 1\n[fleet]\nnats_url = \"http://x\"\n").unwrap_err();
        assert!(err.to_string().contains("fleet.nats_url"), "{err}");
        let err = parse("mode = \"production\"\n[embedded_mockers]\n").unwrap_err();
        assert!(err.to_string().contains("server.tls"), "{err}");
        let err = parse("").unwrap_err();
        assert!(err.to_string().contains("no workers configured"), "{err}");
        let err = parse("[server]\nmax_body_bytes = 0\n[embedded_mockers]\n").unwrap_err();
        assert!(err.to_string().contains("server.max_body_bytes"), "{err}");
    }

    #[test]
    fn duplicate_worker_names_are_refused() {
        let err = parse(
            "[[workers]]\nurl = \"http://a:1\"\nmodel = \"m\"\n[[workers]]\nurl = \"http://a:1\"\nmodel = \"m\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("workers[1].name"), "{err}");
    }
}
