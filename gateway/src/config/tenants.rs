//! `[tenants]` and `[[api_keys]]`: who may call the gateway, and within what limits.
//!
//! This module owns the schema of API keys, wherever they are written (the gateway's config
//! or the keys file `[tenants] keys_file`, which has the same `[[api_keys]]` tables), and the
//! checks a parser cannot make: a key is stored only as the SHA-256 of its text, a hash
//! appears once, and the keys of one tenant agree on the tenant's limits (rate limits, quota
//! and weight belong to the tenant: its keys share them).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ConfigError;

/// `[tenants]`: where keys and usage live outside the config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsConfig {
    /// A TOML file of `[[api_keys]]` tables, read at start and again when it changes (or on
    /// SIGHUP); a file that does not load is refused and the keys before it stay.
    #[serde(default)]
    pub keys_file: Option<PathBuf>,
    /// A JSON file where each tenant's tokens this month are kept across restarts (written
    /// every few seconds while they change, durably); absent, monthly quotas count from the
    /// last start. A damaged one is renamed aside and the month counts from zero.
    #[serde(default)]
    pub usage_file: Option<PathBuf>,
}

/// `[[api_keys]]`: one client key, the tenant it belongs to, and what it may do.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// The SHA-256 of the key's text, as 64 hex digits (`switchyard keys new` prints a key and
    /// its hash); the key itself is never stored.
    pub key_sha256: String,
    /// The tenant the key belongs to (a metrics label: letters, digits, `-`, `_`, `.`).
    pub tenant: String,
    /// Models the key may use; empty: every model.
    #[serde(default)]
    pub models: Vec<String>,
    /// Priority class of the key's requests in the admission queue, higher first.
    #[serde(default)]
    pub priority: u8,
    /// The tenant's request rate limit (requests a minute, refilled continuously; a full
    /// minute's worth may come at once).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// The tenant's token rate limit (prompt + completion tokens a minute).
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// The tenant's tokens per calendar month (UTC).
    #[serde(default)]
    pub monthly_tokens: Option<u64>,
    /// The tenant's share of the admission queue under `fair-share`, relative to other
    /// tenants' (default 1).
    #[serde(default)]
    pub weight: Option<f64>,
}

impl ApiKeyConfig {
    /// The limits that belong to the tenant, which all its keys must state alike.
    fn tenant_limits(&self) -> (Option<u32>, Option<u64>, Option<u64>, Option<u64>) {
        (
            self.requests_per_minute,
            self.tokens_per_minute,
            self.monthly_tokens,
            self.weight.map(f64::to_bits),
        )
    }

    /// The key's hash as bytes, once [`validate_keys`] has accepted it.
    pub fn hash(&self) -> Option<[u8; 32]> {
        parse_hash(&self.key_sha256)
    }
}

/// The keys file: `[[api_keys]]` tables and nothing else.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    /// The keys.
    #[serde(default)]
    pub api_keys: Vec<ApiKeyConfig>,
}

impl KeysFile {
    /// Reads and checks a keys file.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the file (and the key) when it cannot be read, parsed or used.
    pub fn load(path: &Path) -> Result<KeysFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: path.to_path_buf(),
            source,
        })?;
        KeysFile::parse(&text, path)
    }

    /// Parses and checks the text of a keys file; `path` names it in errors.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the file (and the key) when it cannot be parsed or used.
    pub fn parse(text: &str, path: &Path) -> Result<KeysFile, ConfigError> {
        let keys: KeysFile = toml::from_str(text).map_err(|err| ConfigError::Parse {
            file: path.to_path_buf(),
            message: err.to_string(),
        })?;
        validate_keys(&keys.api_keys).map_err(|(key, reason)| ConfigError::Invalid {
            file: path.to_path_buf(),
            key,
            reason,
        })?;
        Ok(keys)
    }
}

/// 64 hex digits as 32 bytes.
fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let text = text.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    let (pairs, _) = text.as_chunks::<2>();
    for (byte, &[high, low]) in hash.iter_mut().zip(pairs) {
        let digit = |c: u8| (c as char).to_digit(16);
        *byte = u8::try_from(digit(high)? * 16 + digit(low)?).ok()?;
    }
    Some(hash)
}

/// Checks a list of keys; answers the offending key path (`api_keys[N].FIELD`) and why.
///
/// # Errors
///
/// The first unusable entry.
pub fn validate_keys(keys: &[ApiKeyConfig]) -> Result<(), (String, String)> {
    check_keys(&keys.iter().collect::<Vec<_>>(), &|index| format!("api_keys[{index}]"))
}

/// Checks the config's keys and a keys file's together (each list already checked alone):
/// no key in both, and a tenant's limits alike in both.
///
/// # Errors
///
/// Why not, naming each entry by its list.
pub fn validate_key_lists(config: &[ApiKeyConfig], file: &[ApiKeyConfig], file_name: &Path) -> Result<(), String> {
    let keys: Vec<&ApiKeyConfig> = config.iter().chain(file).collect();
    let name = |index: usize| match index.checked_sub(config.len()) {
        None => format!("api_keys[{index}] of the config file"),
        Some(index) => format!("api_keys[{index}] of `{}`", file_name.display()),
    };
    check_keys(&keys, &name).map_err(|(key, reason)| format!("{key}: {reason}"))
}

/// Checks `keys`; `name` says how entry `i` is named in errors.
fn check_keys(keys: &[&ApiKeyConfig], name: &dyn Fn(usize) -> String) -> Result<(), (String, String)> {
    let mut hashes: HashMap<[u8; 32], usize> = HashMap::new();
    let mut tenants: HashMap<&str, usize> = HashMap::new();
    for (index, key) in keys.iter().enumerate() {
        let field = |field: &str| format!("{}.{field}", name(index));
        let Some(hash) = key.hash() else {
            return Err((
                field("key_sha256"),
                "must be the key's SHA-256 as 64 hex digits (`switchyard keys hash` prints it)".into(),
            ));
        };
        if let Some(first) = hashes.insert(hash, index) {
            return Err((field("key_sha256"), format!("the same key as {}", name(first))));
        }
        if key.tenant.is_empty()
            || !key
                .tenant
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err((
                field("tenant"),
                format!(
                    "`{}`: a tenant is named with letters, digits, `-`, `_` and `.`",
                    key.tenant
                ),
            ));
        }
        if key.models.iter().any(String::is_empty) {
            return Err((field("models"), "a model name is empty".into()));
        }
        for (name, value) in [
            ("requests_per_minute", key.requests_per_minute.map(u64::from)),
            ("tokens_per_minute", key.tokens_per_minute),
            ("monthly_tokens", key.monthly_tokens),
        ] {
            if value == Some(0) {
                return Err((field(name), "must be greater than 0 (leave it out for no limit)".into()));
            }
        }
        if let Some(weight) = key.weight
            && !(weight.is_finite() && weight > 0.0)
        {
            return Err((field("weight"), format!("{weight}: must be a positive number")));
        }
        match tenants.get(key.tenant.as_str()) {
            Some(&first) if keys[first].tenant_limits() != key.tenant_limits() => {
                return Err((
                    field("tenant"),
                    format!(
                        "tenant `{}` has other limits in {}; a tenant's keys share its requests_per_minute, tokens_per_minute, monthly_tokens and weight, so state them alike",
                        key.tenant,
                        name(first)
                    ),
                ));
            }
            Some(_) => {}
            None => {
                tenants.insert(&key.tenant, index);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(hash_digit: char, tenant: &str) -> ApiKeyConfig {
        ApiKeyConfig {
            key_sha256: hash_digit.to_string().repeat(64),
            tenant: tenant.into(),
            models: Vec::new(),
            priority: 0,
            requests_per_minute: None,
            tokens_per_minute: None,
            monthly_tokens: None,
            weight: None,
        }
    }

    #[test]
    fn refuses_what_cannot_be_used_and_names_the_entry() {
        assert!(validate_keys(&[key('a', "acme"), key('b', "acme")]).is_ok());
        let short = ApiKeyConfig {
            key_sha256: "abc".into(),
            ..key('a', "acme")
        };
        assert_eq!(validate_keys(&[short]).unwrap_err().0, "api_keys[0].key_sha256");
        let (path, reason) = validate_keys(&[key('a', "acme"), key('A', "beta")]).unwrap_err();
        assert_eq!(path, "api_keys[1].key_sha256");
        assert!(reason.contains("api_keys[0]"), "{reason}");
        assert_eq!(validate_keys(&[key('a', "ac me")]).unwrap_err().0, "api_keys[0].tenant");
        let zero = ApiKeyConfig {
            tokens_per_minute: Some(0),
            ..key('a', "acme")
        };
        assert_eq!(validate_keys(&[zero]).unwrap_err().0, "api_keys[0].tokens_per_minute");
        let limited = ApiKeyConfig {
            requests_per_minute: Some(60),
            ..key('b', "acme")
        };
        let (path, reason) = validate_keys(&[key('a', "acme"), limited]).unwrap_err();
        assert_eq!(path, "api_keys[1].tenant");
        assert!(reason.contains("api_keys[0]"), "{reason}");
    }

    #[test]
    fn a_hash_reads_in_either_case() {
        let lower = parse_hash(&"ab".repeat(32)).expect("hex");
        assert_eq!(parse_hash(&"AB".repeat(32)), Some(lower));
        assert_eq!(lower[0], 0xab);
        assert_eq!(parse_hash(&"zz".repeat(32)), None);
    }
}
