//! The tenants keys file (`[tenants] keys_file`): TOML of `[[api_keys]]` tables, written by
//! operators and read again whenever it changes. Any text must parse or be refused with an
//! error, never panic; a file that is accepted holds only usable keys (a SHA-256 each, no key
//! twice, tenants named with the allowed characters, positive limits and weights), and stays
//! acceptable beside an empty config while the same keys twice are refused.

#![no_main]

use std::collections::HashSet;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::{KeysFile, validate_key_lists};

fuzz_target!(|text: &str| {
    let path = Path::new("keys.toml");
    let Ok(file) = KeysFile::parse(text, path) else {
        return;
    };
    let mut hashes = HashSet::new();
    for key in &file.api_keys {
        let hash = key.hash().expect("an accepted key has a SHA-256");
        assert!(hashes.insert(hash), "an accepted file holds a key twice");
        assert!(
            !key.tenant.is_empty()
                && key
                    .tenant
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')),
            "accepted tenant name {:?}",
            key.tenant
        );
        assert!(key.requests_per_minute != Some(0) && key.tokens_per_minute != Some(0));
        assert!(key.monthly_tokens != Some(0));
        assert!(key.weight.is_none_or(|weight| weight.is_finite() && weight > 0.0));
        assert!(key.models.iter().all(|model| !model.is_empty()));
    }
    assert!(validate_key_lists(&[], &file.api_keys, path).is_ok());
    if !file.api_keys.is_empty() {
        assert!(
            validate_key_lists(&file.api_keys, &file.api_keys, path).is_err(),
            "the same keys in the config and the file must be refused"
        );
    }
});
