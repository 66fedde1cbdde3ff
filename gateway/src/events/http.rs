//! KV events, registrations and dumps over HTTP, for workers that reach a gateway without NATS.
//!
//! Such a worker (`switchyard-llm --gateway URL --gateway-token-file FILE`, with the gateway's
//! `[admin] worker_token`) posts to the admin API:
//! `POST /admin/workers` with its [`Registration`] (first as registration, then as its
//! heartbeat), `POST /admin/workers/{name}/events` with a JSON array of its numbered
//! [`WorkerEvent`]s, and `DELETE /admin/workers/{name}` when it leaves. The admin handlers
//! ([`crate::admin`]) parse and check those bodies with [`registration`] and [`events`] and hand
//! them to the applier like any transport's; a gap in the event ids makes the applier fetch a
//! dump from the worker itself, `GET {worker url}/kv/dump`, through [`HttpDumps`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use switchyard_protocol::api::ApiError;
use switchyard_protocol::kv_events::{KvDump, Registration, WorkerEvent, valid_worker_name};

use crate::events::applier::{BoxFuture, DumpSource};
use crate::workers::client::WorkerClient;

/// Largest dump accepted from a worker.
const MAX_DUMP_BYTES: usize = 256 << 20;

/// How long a dump may take.
const DUMP_TIMEOUT: Duration = Duration::from_secs(10);

/// Dumps fetched from the worker's own HTTP API.
#[derive(Debug)]
pub struct HttpDumps {
    client: WorkerClient,
    url: String,
}

impl HttpDumps {
    /// Dumps from the worker whose API is at `url` (scheme and authority).
    pub fn new(client: WorkerClient, url: &str) -> HttpDumps {
        HttpDumps {
            client,
            url: url.trim_end_matches('/').to_string(),
        }
    }
}

impl DumpSource for HttpDumps {
    fn request(&self, worker: String) -> BoxFuture<Result<KvDump, String>> {
        let client = self.client.clone();
        let url = format!("{}{}", self.url, switchyard_protocol::paths::KV_DUMP);
        Box::pin(async move {
            let request = http::Request::get(&url)
                .body(Full::new(Bytes::new()))
                .map_err(|err| format!("bad dump URL `{url}`: {err}"))?;
            let response = client
                .send_within(request, DUMP_TIMEOUT)
                .await
                .map_err(|err| format!("dump request to `{url}` failed: {err}"))?;
            if !response.status().is_success() {
                return Err(format!("`{url}` answered {}", response.status()));
            }
            let body = http_body_util::Limited::new(response.into_body(), MAX_DUMP_BYTES)
                .collect()
                .await
                .map_err(|err| format!("reading the dump from `{url}`: {err}"))?
                .to_bytes();
            let dump: KvDump = serde_json::from_slice(&body).map_err(|err| format!("undecodable dump: {err}"))?;
            if dump.worker != worker {
                return Err(format!("`{url}` sent the dump of `{}`, not `{worker}`", dump.worker));
            }
            Ok(dump)
        })
    }
}

/// Parses and checks a registration body.
///
/// # Errors
///
/// A 400 [`ApiError`] naming what is wrong: not JSON, a bad name, a URL without scheme.
pub fn registration(body: &[u8]) -> Result<Registration, ApiError> {
    let registration: Registration = serde_json::from_slice(body)
        .map_err(|err| ApiError::invalid_request("invalid_registration", format!("not a registration: {err}")))?;
    if !valid_worker_name(&registration.worker) {
        return Err(ApiError::invalid_request(
            "invalid_registration",
            format!(
                "worker name `{}` must be letters, digits, `-` and `_`",
                registration.worker
            ),
        )
        .with_param(Some("worker".into())));
    }
    if registration
        .url
        .parse::<http::Uri>()
        .ok()
        .and_then(|uri| uri.scheme().cloned())
        .is_none()
    {
        return Err(ApiError::invalid_request(
            "invalid_registration",
            format!("`url` must be an absolute URL, not `{}`", registration.url),
        )
        .with_param(Some("url".into())));
    }
    Ok(registration)
}

/// Parses an event batch posted for `worker` and checks every event is that worker's.
///
/// # Errors
///
/// A 400 [`ApiError`] when the body is not a JSON array of events or names another worker.
pub fn events(worker: &str, body: &[u8]) -> Result<Vec<WorkerEvent>, ApiError> {
    let events: Vec<WorkerEvent> = serde_json::from_slice(body)
        .map_err(|err| ApiError::invalid_request("invalid_events", format!("not a JSON array of KV events: {err}")))?;
    if let Some(other) = events.iter().find(|event| event.worker != worker) {
        return Err(ApiError::invalid_request(
            "invalid_events",
            format!(
                "event {} is `{}`'s, posted for `{worker}`",
                other.event_id, other.worker
            ),
        ));
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_and_events_are_checked() {
        let good = br#"{"worker":"w-1","url":"http://127.0.0.1:9","model":"m","role":"llm","block_size":16,
            "capacity_blocks":8,"capabilities":["text"],"cost":1.0,"heartbeat_ms":500,"last_event_id":0}"#;
        assert_eq!(registration(good).expect("valid").worker, "w-1");
        let bad_name = String::from_utf8_lossy(good).replace("w-1", "w.1");
        assert!(registration(bad_name.as_bytes()).is_err());
        let bad_url = String::from_utf8_lossy(good).replace("http://127.0.0.1:9", "127.0.0.1:9");
        assert!(registration(bad_url.as_bytes()).is_err());
        assert!(registration(b"{").is_err());
        let batch = br#"[{"worker":"w-1","event_id":1,"event":{"type":"cleared"}}]"#;
        assert_eq!(events("w-1", batch).expect("valid").len(), 1);
        assert!(events("w-2", batch).is_err(), "another worker's events are refused");
    }
}
