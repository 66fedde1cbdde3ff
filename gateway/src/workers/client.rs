//! The pooled HTTP clients that carry requests to workers.
//!
//! One client for all workers: keep-alive connections pooled per worker, TCP_NODELAY, a
//! connect timeout, and a response-header timeout applied per request. Requests for answers
//! ([`WorkerClient::answer`]) go over connections their answer's reader drives
//! ([`super::upstream`]); the gateway's own calls (health, encoders, KV dumps) go through
//! hyper's pooled client.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::upstream::{UpstreamBody, UpstreamClient};
use crate::config::ForwardingConfig;

/// Why a request to a worker produced no response.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Connecting or sending one of the gateway's own calls failed.
    #[error("{0}")]
    Transport(#[from] hyper_util::client::legacy::Error),
    /// The worker could not be reached.
    #[error("{0}")]
    Connect(String),
    /// The connection broke, or the answer was not HTTP.
    #[error("{0}")]
    Upstream(String),
    /// The response headers did not arrive in time.
    #[error("no response within {0:?}")]
    Timeout(Duration),
}

impl ForwardError {
    /// Whether the worker could not be reached at all (as opposed to answering slowly).
    pub fn is_connect(&self) -> bool {
        match self {
            ForwardError::Transport(err) => err.is_connect(),
            ForwardError::Connect(_) => true,
            ForwardError::Upstream(_) | ForwardError::Timeout(_) => false,
        }
    }
}

/// A pooled client to workers.
#[derive(Debug, Clone)]
pub struct WorkerClient {
    client: Client<HttpConnector, Full<Bytes>>,
    answers: UpstreamClient,
    response_timeout: Duration,
}

impl WorkerClient {
    /// A client with the given forwarding settings.
    pub fn new(config: &ForwardingConfig) -> WorkerClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(config.pool_max_idle_per_worker)
            .build(connector);
        WorkerClient {
            client,
            answers: UpstreamClient::new(
                config.pool_max_idle_per_worker,
                Duration::from_millis(config.connect_timeout_ms),
            ),
            response_timeout: Duration::from_millis(config.response_timeout_ms),
        }
    }

    /// Sends a request for an answer (a completion, streamed or not) and waits for the
    /// answer's headers; reading the answer's body drives its connection.
    ///
    /// # Errors
    ///
    /// Returns [`ForwardError`] if the worker cannot be reached, breaks the connection, or
    /// does not answer within the response timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future, or the answer's body before its end, closes the connection: the
    /// worker sees its client go away.
    pub async fn answer(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<UpstreamBody>, ForwardError> {
        self.answers.send(request, self.response_timeout).await
    }

    /// Sends one of the gateway's own calls (health, encoders, KV dumps) and waits up to
    /// `timeout` for the response headers.
    ///
    /// # Errors
    ///
    /// Returns [`ForwardError`] if the worker cannot be reached, breaks the connection, or
    /// does not answer in time.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the request; the pooled connection is closed.
    pub async fn send_within(
        &self,
        request: http::Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<http::Response<Incoming>, ForwardError> {
        match tokio::time::timeout(timeout, self.client.request(request)).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(ForwardError::Timeout(timeout)),
        }
    }
}
