//! Switchyard's worker core.
//!
//! The crate owns what every LLM worker behind the gateway shares: the engine core ([`engine`]:
//! scheduler, KV block pool, sampling, and the KV block exports and imports of prefill/decode
//! disaggregation), the worker HTTP server ([`server`], with [`stop`] strings, serving both
//! sides of disaggregation), the links that tell the routing layer about a worker's cache (NATS: [`kv_link`];
//! one gateway over HTTP: [`gateway_link`]), waiting for a stop signal ([`shutdown`]) and the
//! simulated engine ([`mocker`]). What it
//! speaks to gateways is `switchyard-protocol`; how it tokenizes is `switchyard-tokenize`; the
//! native transformer is `switchyard-llm`, which builds on this crate's engine.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

pub mod binary;
pub mod encoder;
pub mod engine;
pub mod features;
pub mod gateway_link;
pub mod kv_link;
pub mod mocker;
pub mod server;
pub mod shutdown;
pub mod stop;

#[cfg(test)]
mod tests {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_handles_are_send_and_sync() {
        assert_send_sync::<crate::mocker::EngineHandle>();
        assert_send_sync::<crate::server::WorkerServer>();
    }
}
