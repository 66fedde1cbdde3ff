//! Building and reading HTTP bodies the way every Switchyard server does.
//!
//! This module owns the response body type shared by the gateway and the workers, JSON and
//! OpenAI-error responses, and reading a request body under a size limit with the right error
//! (413 over the limit, 400 when the client breaks off). It knows the OpenAI error shape from
//! [`crate::api`] and nothing about routing.

use std::convert::Infallible;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};

use crate::api::ApiError;

/// The body of every response Switchyard sends: bytes that never fail (errors after the
/// headers are sent become SSE error events instead).
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The `content-type` of server-sent events.
pub const EVENT_STREAM: &str = "text/event-stream";

/// A body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    UnsyncBoxBody::new(Full::new(bytes.into()))
}

/// A response with a JSON body.
pub fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    match serde_json::to_vec(value) {
        Ok(bytes) => with_type(status, "application/json", full(bytes)),
        Err(err) => error(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "serialization_failed",
            format!("could not serialize the response: {err}"),
        )),
    }
}

/// A response with a plain-text body.
pub fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    with_type(status, content_type, full(body))
}

/// The OpenAI error response for `err`.
///
/// A 401 names the scheme it wants (`WWW-Authenticate: Bearer`); an error with a wait
/// carries `Retry-After`.
pub fn error(err: &ApiError) -> Response<Body> {
    let mut response = with_type(err.status, "application/json", full(err.to_json()));
    if err.status == StatusCode::UNAUTHORIZED {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if let Some(seconds) = err.retry_after_s {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// A streaming response of server-sent events.
pub fn event_stream(body: Body) -> Response<Body> {
    let mut response = with_type(StatusCode::OK, EVENT_STREAM, body);
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn with_type(status: StatusCode, content_type: &'static str, body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// Reads a whole request body of at most `limit` bytes.
///
/// # Errors
///
/// Returns a 413 [`ApiError`] (`body_too_large`) if the declared or actual length exceeds
/// `limit`, and a 400 (`body_read_failed`) if the body cannot be read to its end.
pub async fn read_limited<B>(headers: &http::HeaderMap, body: B, limit: usize) -> Result<Bytes, ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<LengthLimitError>() => Err(too_large()),
        Err(err) => Err(ApiError::invalid_request(
            "body_read_failed",
            format!("could not read the request body: {err}"),
        )),
    }
}

/// The 404 answer for an unknown path.
pub fn not_found(path: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!("no route for path `{path}`"),
    )
}

/// The 405 answer for a known path called with the wrong method.
pub fn method_not_allowed(method: &http::Method, path: &str, allowed: &str) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("method {method} is not allowed on `{path}`; use {allowed}"),
    )
}
