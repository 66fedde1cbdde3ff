//! The policy's own configuration table.
//!
//! A version's configuration never changes, so in a component each number is fetched from the
//! host once per instance and answered from memory afterwards: a policy may read its settings
//! on every call without paying a host call each time. Numbers are parsed by the host, so a
//! policy carries no number parser (about 20 KiB of code, which every publish would hash,
//! load and map).

use alloc::string::String;

/// The value of `key`, rendered as TOML (strings unquoted); asks the host each time.
pub fn get(key: &str) -> Option<String> {
    #[cfg(target_arch = "wasm32")]
    return crate::router_world::switchyard::policy::config::get(key).map(|value| String::from(value.as_str()));
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::config_value(key);
}

/// The value of `key` as a number (a TOML float or integer, or a string that parses as
/// one), or `default`.
pub fn get_f64(key: &str, default: f64) -> f64 {
    #[cfg(target_arch = "wasm32")]
    return cache::number(key, || crate::router_world::switchyard::policy::config::get_f64(key)).unwrap_or(default);
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::config_value(key)
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(default);
}

/// The value of `key` as a boolean (a TOML boolean, or a number: 0 is false), or
/// `default`. Remembered per instance, as numbers are.
pub fn get_bool(key: &str, default: bool) -> bool {
    let parse = |value: Option<String>| {
        value.and_then(|value| match value.trim() {
            "true" => Some(1.0),
            "false" => Some(0.0),
            number => number.parse::<f64>().ok(),
        })
    };
    #[cfg(target_arch = "wasm32")]
    let number = cache::number(key, || parse(get(key)));
    #[cfg(not(target_arch = "wasm32"))]
    let number = parse(crate::testing::config_value(key));
    number.map(|number| number != 0.0).unwrap_or(default)
}

/// A value a policy derives from its settings once per instance (its cost model, say),
/// held in a `static`: reading a dozen keys on every call costs more than routing a small
/// table. Natively (in tests, which change settings between calls) it is derived afresh
/// on every read.
///
/// ```ignore
/// static MODEL: config::Derived<Model> = config::Derived::new();
/// let model = MODEL.get_or_init(Model::from_config);
/// ```
pub struct Derived<T>(core::cell::UnsafeCell<Option<T>>);

// SAFETY: a component instance runs single-threaded; natively the cell is never written.
unsafe impl<T> Sync for Derived<T> {}

impl<T: Copy> Derived<T> {
    /// Nothing derived yet.
    pub const fn new() -> Derived<T> {
        Derived(core::cell::UnsafeCell::new(None))
    }

    /// The value, derived by `derive` on the instance's first read.
    pub fn get_or_init(&self, derive: impl FnOnce() -> T) -> T {
        #[cfg(target_arch = "wasm32")]
        {
            // SAFETY: single-threaded (see `Sync` above); each access copies the value in
            // or out, so no reference outlives its statement (nor spans `derive`).
            if let Some(value) = unsafe { *self.0.get() } {
                return value;
            }
            let value = derive();
            unsafe { *self.0.get() = Some(value) };
            value
        }
        #[cfg(not(target_arch = "wasm32"))]
        derive()
    }
}

impl<T: Copy> Default for Derived<T> {
    fn default() -> Derived<T> {
        Derived::new()
    }
}

#[cfg(target_arch = "wasm32")]
mod cache {
    use core::cell::UnsafeCell;

    /// Keys remembered per instance; more are fetched from the host each time.
    const ENTRIES: usize = 24;
    /// Longest key remembered, in bytes.
    const MAX_KEY: usize = 48;

    /// One key and the host's answer, held inline: the cache allocates nothing, so
    /// reading a setting never grows the instance's memory.
    #[derive(Clone, Copy)]
    struct Entry {
        key: [u8; MAX_KEY],
        key_len: u8,
        value: Option<f64>,
    }

    struct Cache(UnsafeCell<([Entry; ENTRIES], usize)>);

    // SAFETY: a component instance runs single-threaded; the cache is only touched from
    // the one thread that calls into it.
    unsafe impl Sync for Cache {}

    const EMPTY: Entry = Entry {
        key: [0; MAX_KEY],
        key_len: 0,
        value: None,
    };

    static CACHE: Cache = Cache(UnsafeCell::new(([EMPTY; ENTRIES], 0)));

    /// The number under `key`, fetched from the host unless remembered.
    pub(super) fn number(key: &str, fetch: impl FnOnce() -> Option<f64>) -> Option<f64> {
        // SAFETY: single-threaded (see `Sync` above); each reference lives within one
        // block that neither re-enters this function nor calls the host.
        let (entries, used) = unsafe { &*CACHE.0.get() };
        let remembered = entries[..*used]
            .iter()
            .find(|entry| same(&entry.key[..usize::from(entry.key_len)], key.as_bytes()));
        if let Some(entry) = remembered {
            return entry.value;
        }
        let value = fetch();
        // SAFETY: as above.
        let (entries, used) = unsafe { &mut *CACHE.0.get() };
        if *used < ENTRIES && key.len() <= MAX_KEY {
            let mut entry = EMPTY;
            entry.key[..key.len()].copy_from_slice(key.as_bytes());
            entry.key_len = key.len() as u8;
            entry.value = value;
            entries[*used] = entry;
            *used += 1;
        }
        value
    }

    /// Byte equality without `memcmp`, which a component without libc does not have.
    fn same(a: &[u8], b: &[u8]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a == b)
    }
}
