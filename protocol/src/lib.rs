//! What Switchyard's gateway and workers both speak.
//!
//! This crate owns the contract between the two sides and nothing of either's machinery: the
//! OpenAI wire format ([`api`]), Dynamo-compatible KV block hashing ([`block_hash`]), the KV
//! event, dump and registration messages ([`kv_events`]), the binary framing of exported KV
//! blocks ([`kv_blocks`]), the encode protocol between gateways,
//! encoders and LLM workers ([`encode`]), what a worker does ([`Role`]), the
//! HTTP paths a gateway calls on workers and workers call on a gateway ([`paths`]), and the
//! HTTP plumbing every Switchyard server shares ([`respond`] bodies and errors, [`serve`]'s
//! plain-HTTP accept loop). It has no engine, tokenizer or routing code, so both sides compile
//! it cheaply and a change here is a change of the protocol.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

pub mod api;
pub mod block_hash;
pub mod encode;
pub mod kv_blocks;
pub mod kv_events;
pub mod paths;
pub mod respond;
mod role;
pub mod serve;

pub use role::Role;
