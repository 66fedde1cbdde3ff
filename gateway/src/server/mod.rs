//! The client-facing server: listener, TLS, HTTP/1.1 and HTTP/2, OpenAI handlers, SSE relay.
//!
//! This module owns everything between a client's socket and a worker request: accepting and
//! limiting connections ([`conn`]), TLS ([`tls`]), dispatch by method and path ([`routes`]),
//! and the path of a generation request, whose stages [`pipeline`] runs in order: [`prompt`]
//! (media inspected, prompt tokenized and hashed), [`media_plan`] (encoders), [`forward`]
//! (attempts on workers, with retries, a prompt sent to a prefill worker first by `disagg`)
//! and [`relay`] (the answer streamed back). It asks
//! `routing` where a request goes (and holds the lease it gets while the answer streams),
//! reaches the worker with the `workers` client, and records `metrics`; nothing below it knows
//! about HTTP bodies.

mod coalesce;
pub(crate) mod conn;
mod disagg;
mod forward;
mod media_plan;
mod migrate;
pub(crate) mod pipeline;
mod prompt;
pub mod relay;
mod rewind;
pub(crate) mod routes;
pub mod tls;

/// A request body rewritten as a JSON object by `edit` (the fields a worker is asked for
/// besides the client's); `None` when the body is not a JSON object (the request path has
/// parsed it already, so only a bug gets here).
fn edited_body(
    body: &[u8],
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Option<bytes::Bytes> {
    let mut request: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body).ok()?;
    edit(&mut request);
    serde_json::to_vec(&request).ok().map(bytes::Bytes::from)
}
