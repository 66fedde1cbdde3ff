//! Writing to the host's log.

pub use crate::router_world::switchyard::policy::log::Level;

/// Writes one line to the gateway's log (to stderr when tested natively).
pub fn write(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::router_world::switchyard::policy::log::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    std::eprintln!("[{level:?}] {message}");
}
