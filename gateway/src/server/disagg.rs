//! Prefill/decode disaggregation on the request path: a prompt computed on a prefill worker,
//! whose KV blocks the answering worker then pulls.
//!
//! The exchange is vLLM's (`kv_transfer_params`, as its NixlConnector and router speak it), so
//! the same path fronts Switchyard's own workers and vLLM engines run as producer and consumer.
//! The prefill worker gets the request with one token to generate, not streamed, and
//! `kv_transfer_params.do_remote_decode`; its answer carries the `kv_transfer_params` the
//! answering worker needs to pull the blocks, which go into that worker's request unchanged.
//! Nothing here fails a request: a prefill worker that cannot be reached, refuses, errs, misses
//! `[forwarding] prefill_timeout_ms` or answers without the parameters leaves the prompt to the
//! answering worker ([`Prefilled::Local`]), and so does a pull that the answering worker reports
//! failed in its `x-switchyard-kv-transfer` header. The client learns which in
//! `x-switchyard-disagg`, the operator in `switchyard_disagg_fallbacks_total{reason}`.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{Map, Value};
use switchyard_protocol::api::Endpoint;

use super::edited_body;
use crate::routing::PrefillLease;
use crate::state::AppState;

/// The response header that says how a disaggregated request's prompt was computed.
pub(super) const DISAGG_HEADER: &str = "x-switchyard-disagg";

/// The header in which the answering worker says how its pull of the blocks went
/// (`remote; blocks=N; ...` or `local; reason=...`).
pub(super) const KV_TRANSFER_HEADER: &str = "x-switchyard-kv-transfer";

/// The most of a prefill worker's answer read (one token's answer and its parameters).
const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// How a disaggregated request's prompt was computed, as far as the gateway knows before the
/// answering worker's reply.
#[derive(Debug, Clone)]
pub(super) enum Prefilled {
    /// The prefill worker named computed it; its blocks are the answering worker's to pull.
    Remote {
        /// The prefill worker's name.
        prefill: String,
    },
    /// The answering worker prefills it itself, for this reason.
    Local(&'static str),
}

impl Prefilled {
    /// The outcome after the answering worker's reply `headers`: a pull it reports failed
    /// makes a remote prefill local after all.
    pub(super) fn settled(self, headers: &http::HeaderMap) -> Prefilled {
        let pull_failed = headers
            .get(KV_TRANSFER_HEADER)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.trim_start().starts_with("local"));
        match self {
            Prefilled::Remote { .. } if pull_failed => Prefilled::Local("transfer"),
            settled => settled,
        }
    }

    /// Counts the outcome and answers the client's header value.
    pub(super) fn report(&self, state: &AppState) -> Option<HeaderValue> {
        let value = match self {
            Prefilled::Remote { prefill } => {
                state.metrics.disaggregated(None);
                format!("remote; prefill={prefill}")
            }
            Prefilled::Local(reason) => {
                state.metrics.disaggregated(Some(reason));
                format!("local; reason={reason}")
            }
        };
        HeaderValue::from_str(&value).ok()
    }
}

/// Has the prompt of `body` (the request as it goes to the answering worker) computed on the
/// prefill worker `lease` holds; answers the body for the answering worker (with the
/// prefill worker's `kv_transfer_params`) and the outcome. The lease is let go when the prefill
/// worker has answered.
pub(super) async fn prefill(
    state: &AppState,
    lease: PrefillLease,
    endpoint: Endpoint,
    body: &Bytes,
) -> (Bytes, Prefilled) {
    let worker = lease.worker().clone();
    let timeout = Duration::from_millis(state.forwarding.prefill_timeout_ms);
    let outcome = match tokio::time::timeout(timeout, ask(state, &worker, endpoint, body)).await {
        Ok(outcome) => outcome,
        Err(_) => Err("timeout"),
    };
    drop(lease);
    match outcome.and_then(|params| with_params(body, params).ok_or("request")) {
        Ok(decode_body) => (
            decode_body,
            Prefilled::Remote {
                prefill: worker.name.clone(),
            },
        ),
        Err(reason) => {
            tracing::info!(prefill = %worker.name, reason, "prefill worker did not compute the prompt; prefilling locally");
            (body.clone(), Prefilled::Local(reason))
        }
    }
}

/// Sends the prefill request and answers the `kv_transfer_params` of the prefill worker's
/// answer, or why there are none.
async fn ask(
    state: &AppState,
    worker: &crate::workers::Worker,
    endpoint: Endpoint,
    body: &Bytes,
) -> Result<Value, &'static str> {
    let prefill_body = prefill_request(body).ok_or("request")?;
    let request = Request::post(worker.endpoint_uri(endpoint.path()))
        .header(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .body(Full::new(prefill_body))
        .map_err(|_| "request")?;
    let backoffs = state.forwarding.backoffs();
    let response = match state.client.answer(request).await {
        Ok(response) => response,
        Err(err) if err.is_connect() => {
            state.router.unreachable(worker);
            return Err("unreachable");
        }
        Err(_) => {
            state.router.failed_answer(worker, &backoffs);
            return Err("error");
        }
    };
    let (parts, body) = response.into_parts();
    match parts.status {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
            state.router.busy(worker, None, &backoffs);
            return Err("busy");
        }
        status if status.is_server_error() => {
            state.router.failed_answer(worker, &backoffs);
            return Err("error");
        }
        status if !status.is_success() => return Err("refused"),
        _ => {}
    }
    let bytes = Limited::new(body, MAX_PREFILL_ANSWER)
        .collect()
        .await
        .map_err(|_| "error")?
        .to_bytes();
    worker.answered();
    let mut answer: Map<String, Value> = serde_json::from_slice(&bytes).map_err(|_| "answer")?;
    match answer.remove("kv_transfer_params") {
        Some(params @ Value::Object(_)) => Ok(params),
        _ => Err("answer"),
    }
}

/// The prefill worker's request: the client's, generating one token, not streamed, asking
/// for its blocks to be kept for a remote decode. `None` when the body is not a JSON object.
fn prefill_request(body: &[u8]) -> Option<Bytes> {
    edited_body(body, |request| {
        for key in [
            "max_completion_tokens",
            "stream_options",
            "return_token_ids",
            "n",
            "logprobs",
            "top_logprobs",
        ] {
            request.remove(key);
        }
        request.insert("max_tokens".into(), Value::from(1));
        request.insert("stream".into(), Value::Bool(false));
        request.insert(
            "kv_transfer_params".into(),
            serde_json::json!({ "do_remote_decode": true, "do_remote_prefill": false }),
        );
    })
}

/// `body` without the `kv_transfer_params` a client put in it; `None` when it is not a JSON
/// object.
pub(super) fn without_transfer_params(body: &[u8]) -> Option<Bytes> {
    edited_body(body, |request| {
        request.remove("kv_transfer_params");
    })
}

/// `body` with the prefill worker's `params` as its `kv_transfer_params`.
fn with_params(body: &[u8], params: Value) -> Option<Bytes> {
    edited_body(body, |request| {
        request.insert("kv_transfer_params".into(), params);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_request_generates_one_token_unstreamed_and_keeps_the_blocks() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
            "stream_options":{"include_usage":true},"max_completion_tokens":50,"temperature":0.5}"#;
        let sent: Value = serde_json::from_slice(&prefill_request(body).expect("a JSON object")).expect("JSON");
        assert_eq!(sent["max_tokens"], 1);
        assert_eq!(sent["stream"], false);
        assert_eq!(sent["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(sent["temperature"], 0.5);
        assert!(sent.get("stream_options").is_none() && sent.get("max_completion_tokens").is_none());
        assert!(prefill_request(b"[1, 2]").is_none());
    }

    #[test]
    fn the_answering_request_carries_the_prefill_workers_parameters_unchanged() {
        let params =
            serde_json::json!({"do_remote_prefill": true, "remote_url": "http://p:1", "remote_block_ids": [1, 2]});
        let sent = with_params(br#"{"model":"m","prompt":"x","stream":true}"#, params.clone()).expect("object");
        let sent: Value = serde_json::from_slice(&sent).expect("JSON");
        assert_eq!(sent["kv_transfer_params"], params);
        assert_eq!(sent["stream"], true);
    }

    #[test]
    fn a_clients_own_transfer_params_are_taken_out() {
        let sent = without_transfer_params(
            br#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_url":"http://10.0.0.1:1"}}"#,
        )
        .expect("object");
        let sent: Value = serde_json::from_slice(&sent).expect("JSON");
        assert!(sent.get("kv_transfer_params").is_none());
        assert_eq!(sent["prompt"], "x");
    }

    #[test]
    fn a_pull_the_answering_worker_reports_failed_makes_the_prefill_local() {
        let remote = || Prefilled::Remote { prefill: "p0".into() };
        let mut headers = http::HeaderMap::new();
        assert!(matches!(remote().settled(&headers), Prefilled::Remote { .. }));
        headers.insert(
            KV_TRANSFER_HEADER,
            HeaderValue::from_static("remote; blocks=4; bytes=10; ms=1"),
        );
        assert!(matches!(remote().settled(&headers), Prefilled::Remote { .. }));
        headers.insert(KV_TRANSFER_HEADER, HeaderValue::from_static("local; reason=connect"));
        assert!(matches!(remote().settled(&headers), Prefilled::Local("transfer")));
        assert!(matches!(
            Prefilled::Local("timeout").settled(&headers),
            Prefilled::Local("timeout")
        ));
    }
}
