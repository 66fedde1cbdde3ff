//! The policies built from `plugins/` and embedded in this binary, by name and world.
//!
//! Their one list is `BUILT_INS` in `gateway/build.rs`, which builds each to a component and
//! writes the table this module includes. The configuration's checks, the gateway's start,
//! the error that lists the names and the test that keeps `plugins/README.md` complete all
//! read it here; nothing else names the built-ins. The module knows no wasmtime: it hands out
//! bytes, which [`crate::policy`] loads.

use std::fmt;

/// Which world of the policy contract a component exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum World {
    /// Chooses a worker for each request.
    Router,
    /// Forms batches from a queue (an encoder's, or the admission queue).
    Batcher,
    /// Sizes worker pools.
    Planner,
}

impl fmt::Display for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            World::Router => "router",
            World::Batcher => "batcher",
            World::Planner => "planner",
        })
    }
}

/// One embedded policy.
#[derive(Debug, Clone, Copy)]
pub struct BuiltIn {
    /// The name configurations use, also its package and folder in `plugins/`.
    pub name: &'static str,
    /// The world it exports.
    pub world: World,
    /// Its component.
    pub wasm: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/built_ins.rs"));

/// A name that is no built-in policy of the world asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no built-in {world} named `{name}`; the built-in {world}s are {}", names(*world).join(", "))]
pub struct UnknownBuiltIn {
    /// The world asked for.
    pub world: World,
    /// The name asked for.
    pub name: String,
}

/// The component of the built-in `world` policy `name`.
///
/// # Errors
///
/// [`UnknownBuiltIn`], which lists the names there are.
pub fn find(world: World, name: &str) -> Result<&'static [u8], UnknownBuiltIn> {
    BUILT_INS
        .iter()
        .find(|built_in| built_in.world == world && built_in.name == name)
        .map(|built_in| built_in.wasm)
        .ok_or_else(|| UnknownBuiltIn {
            world,
            name: name.to_string(),
        })
}

/// The names of the built-in policies of `world`, in the list's order.
pub fn names(world: World) -> Vec<&'static str> {
    BUILT_INS
        .iter()
        .filter(|built_in| built_in.world == world)
        .map(|built_in| built_in.name)
        .collect()
}

/// The component of built-in router `name`.
///
/// # Errors
///
/// [`UnknownBuiltIn`] when there is none of that name.
pub fn router(name: &str) -> Result<&'static [u8], UnknownBuiltIn> {
    find(World::Router, name)
}

/// The component of built-in planner `name`.
///
/// # Errors
///
/// [`UnknownBuiltIn`] when there is none of that name.
pub fn planner(name: &str) -> Result<&'static [u8], UnknownBuiltIn> {
    find(World::Planner, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_world_finds_its_own_names_only() {
        assert!(router("kv-aware").is_ok());
        assert!(find(World::Batcher, "fcfs").is_ok());
        assert!(planner("load-based").is_ok());
        let err = router("fcfs").expect_err("a batcher is no router");
        assert_eq!(err.world, World::Router);
        let message = err.to_string();
        assert!(message.contains("no built-in router named `fcfs`"), "{message}");
        assert!(message.contains("peer-aibrix"), "every router is listed: {message}");
        assert!(!message.contains("token-budget"), "batchers are not: {message}");
    }

    #[test]
    fn every_component_is_embedded_under_a_unique_name() {
        for (i, built_in) in BUILT_INS.iter().enumerate() {
            assert!(
                built_in.wasm.starts_with(b"\0asm"),
                "{} is a Wasm binary",
                built_in.name
            );
            assert!(
                BUILT_INS[..i].iter().all(|other| other.name != built_in.name),
                "{} listed twice",
                built_in.name
            );
        }
    }

    /// The plugins' README is the list users read: a row for every built-in, naming its world.
    #[test]
    fn the_plugins_readme_lists_every_built_in() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../plugins/README.md"))
            .expect("plugins/README.md");
        let missing: Vec<String> = BUILT_INS
            .iter()
            .map(|built_in| format!("| `{}` | {} |", built_in.name, built_in.world))
            .filter(|row| !readme.contains(row.as_str()))
            .collect();
        assert!(missing.is_empty(), "plugins/README.md has no rows {missing:?}");
    }
}
