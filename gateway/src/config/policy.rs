//! `[policy]`: the router policy and the sandbox every policy runs in.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Checked, Invalid, built_in_or_file, positive};
use crate::built_ins::World;

/// `[policy]`: the router policy (a Wasm component) and its sandbox.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// A built-in router (listed in `plugins/README.md`; an unknown name is refused with the
    /// list) or a path to a `.wasm`.
    pub router: String,
    /// CPU time one policy call may take, in milliseconds.
    pub deadline_ms: u64,
    /// Linear memory one policy instance may use, in MiB.
    pub memory_limit_mib: usize,
    /// Failures of one version after which the previous version is restored.
    pub max_failures: u32,
    /// Where compiled policy code is cached (keyed by sha256 and engine); none disables it.
    /// Refused unless the folder belongs to the gateway's user, only its owner can write it,
    /// and no other user can replace it (every folder above is this user's or root's, and
    /// writable by others only with the sticky bit).
    pub cache_dir: Option<PathBuf>,
    /// Instance slots of the policy sandbox (every thread that calls a policy keeps up to four
    /// instances); absent, sized from the machine's threads (at least 256). A call that finds
    /// no slot is served by the fallback and never counts against the policy.
    pub max_instances: Option<u32>,
    /// A directory whose `NAME.wasm` files are published as they are written.
    pub watch_dir: Option<PathBuf>,
    /// The policy's own settings, readable through the host world's `config.get`.
    pub config: toml::Table,
}

impl Default for PolicyConfig {
    fn default() -> PolicyConfig {
        PolicyConfig {
            router: "kv-aware".into(),
            deadline_ms: 1,
            memory_limit_mib: 32,
            max_failures: 5,
            cache_dir: None,
            max_instances: None,
            watch_dir: None,
            config: toml::Table::new(),
        }
    }
}

impl PolicyConfig {
    /// Refuses a router that is neither a built-in nor a `.wasm` file, sandbox limits of 0,
    /// and a watched directory that is not one.
    pub(super) fn check(&self) -> Checked {
        built_in_or_file("policy.router", &self.router, World::Router)?;
        positive(&[
            ("policy.deadline_ms", self.deadline_ms),
            ("policy.memory_limit_mib", self.memory_limit_mib as u64),
            ("policy.max_failures", u64::from(self.max_failures)),
        ])?;
        if self.max_instances == Some(0) {
            return Err(Invalid::new("policy.max_instances", "must be greater than 0"));
        }
        if let Some(dir) = &self.watch_dir
            && !dir.is_dir()
        {
            return Err(Invalid::new(
                "policy.watch_dir",
                format!("`{}` is not a directory", dir.display()),
            ));
        }
        Ok(())
    }
}
