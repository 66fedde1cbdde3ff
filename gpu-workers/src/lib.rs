//! Switchyard's workers.
//!
//! The crate owns everything that runs behind the gateway: the OpenAI wire format both sides
//! speak ([`api`], [`respond`]), tokenizers and chat templates ([`tokenize`]), Dynamo-compatible
//! KV block hashing ([`blocks`]), the KV event protocol ([`kv_events`]) and its links to the
//! routing layer (NATS: [`kv_link`]; one gateway over HTTP: [`gateway_link`]), the engine core
//! every LLM worker shares ([`engine`]: scheduler, KV block pool, sampling), the worker HTTP
//! server ([`server`], with [`stop`] strings, on [`serve`]'s accept loop), the simulated engine
//! ([`mocker`]) and the native transformer ([`llm`]).

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

pub mod api;
pub mod blocks;
pub mod engine;
pub mod gateway_link;
pub mod kv_events;
pub mod kv_link;
pub mod llm;
pub mod mocker;
pub mod respond;
pub mod serve;
pub mod server;
pub mod stop;
pub mod tokenize;

#[cfg(test)]
mod tests {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_handles_are_send_and_sync() {
        assert_send_sync::<crate::mocker::EngineHandle>();
        assert_send_sync::<crate::server::WorkerServer>();
    }
}
