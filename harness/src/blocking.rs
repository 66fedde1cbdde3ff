//! The [`Client`] for tests that are not async: one plain-HTTP/1.1 request on
//! a fresh connection, run on a runtime of its own, answering the status and the body as text.
//!
//! Call these from a plain `#[test]` (or a blocking thread), not from inside an async task.

use std::net::SocketAddr;

use crate::client::Client;

/// `POST path` with a JSON `body`; the status and the whole body.
///
/// # Panics
///
/// Panics if the request cannot be made or the response read (the test's failure).
pub fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    request(addr, "POST", path, body)
}

/// `GET path`; the status and the whole body.
///
/// # Panics
///
/// As [`post`].
pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    request(addr, "GET", path, "")
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for one request");
    let reply = runtime
        .block_on(Client::plain(addr).send(method, path, body.to_string()))
        .unwrap_or_else(|err| panic!("{method} http://{addr}{path}: {err:#}"));
    (
        reply.status.as_u16(),
        String::from_utf8_lossy(&reply.body()).into_owned(),
    )
}
