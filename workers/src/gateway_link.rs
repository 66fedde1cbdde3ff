//! A worker's link to one gateway over HTTP, for deployments without NATS.
//!
//! [`run`] posts the worker's [`Registration`] to the gateway's admin API
//! (`POST /admin/workers`, repeated as the heartbeat with the newest event id), numbers the
//! engine's KV events with the shared [`EventLog`] and posts them in batches
//! (`POST /admin/workers/{name}/events`), and leaves (`DELETE /admin/workers/{name}`) when it
//! stops. Every call carries the gateway's worker token (`[admin] worker_token`), which
//! [`token`] reads from a file or the environment, never the command line. A batch that cannot be delivered is
//! dropped (and logged): the gateway sees the gap in the ids and fetches a dump from the
//! worker's `GET /kv/dump`, which the worker's server answers from the same log.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::mpsc;

use switchyard_protocol::kv_events::{EventLog, KvEvent, Registration};

/// Most events posted in one batch.
const MAX_BATCH: usize = 1024;

/// How long one call to the gateway may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The environment variable [`token`] reads the worker token from when no file is named.
pub const TOKEN_ENV: &str = "SWITCHYARD_GATEWAY_TOKEN";

/// Why a worker has no usable gateway token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The token file cannot be read.
    #[error("cannot read the gateway token file `{path}`: {source}")]
    Unreadable {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Neither a file nor the environment variable gives one.
    #[error("registering with a gateway needs its worker token: --gateway-token-file FILE or {TOKEN_ENV}")]
    Missing,
    /// The file or the variable holds nothing.
    #[error("the gateway token is empty")]
    Empty,
    /// A token was given on the command line, which every local user can read.
    #[error(
        "--gateway-token is no longer accepted: a token on the command line is readable by every local user (/proc/PID/cmdline); put the gateway's worker token (`[admin] worker_token`) in a file for --gateway-token-file FILE, or in {TOKEN_ENV}"
    )]
    OnCommandLine,
}

/// The worker token: read from `file` when one is named, else from [`TOKEN_ENV`]; surrounding
/// whitespace is dropped. Both keep it off the command line, which every local user can read
/// in `/proc/PID/cmdline`.
///
/// # Errors
///
/// When the file cannot be read, or neither source gives a non-empty token.
pub fn token(file: Option<&std::path::Path>) -> Result<String, TokenError> {
    let token = match file {
        Some(path) => std::fs::read_to_string(path).map_err(|source| TokenError::Unreadable {
            path: path.to_path_buf(),
            source,
        })?,
        None => std::env::var(TOKEN_ENV).map_err(|_| TokenError::Missing)?,
    };
    let token = token.trim();
    if token.is_empty() {
        return Err(TokenError::Empty);
    }
    Ok(token.to_string())
}

/// The flags of a worker binary that registers with one gateway's admin API (flattened into
/// its own `clap` arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Register with one gateway directly: its admin API (`http://host:port`), with the
    /// gateway's worker token from --gateway-token-file or SWITCHYARD_GATEWAY_TOKEN.
    #[arg(long)]
    pub gateway: Option<String>,
    /// A file holding the gateway's worker token (`[admin] worker_token`).
    #[arg(long, value_name = "FILE")]
    pub gateway_token_file: Option<std::path::PathBuf>,
    /// Refused: a token on the command line is readable by every local user.
    #[arg(long, hide = true)]
    pub gateway_token: Option<String>,
}

impl GatewayArgs {
    /// The worker token when `--gateway` is given (see [`token`]); read at start, so a missing
    /// one fails before anything loads.
    ///
    /// # Errors
    ///
    /// [`TokenError::OnCommandLine`] for `--gateway-token`, and [`token`]'s errors.
    pub fn token(&self) -> Result<Option<String>, TokenError> {
        if self.gateway_token.is_some() {
            return Err(TokenError::OnCommandLine);
        }
        self.gateway
            .as_ref()
            .map(|_| token(self.gateway_token_file.as_deref()))
            .transpose()
    }
}

/// Link settings.
#[derive(Debug, Clone)]
pub struct GatewayLinkConfig {
    /// The gateway's admin API, e.g. `http://10.0.0.1:9000`.
    pub admin_url: String,
    /// The gateway's worker token (see [`token`]).
    pub token: String,
    /// What the worker announces (its `last_event_id` is filled in at each beat).
    pub registration: Registration,
}

struct Caller {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    authorization: String,
}

impl Caller {
    async fn call(&self, method: http::Method, path: &str, body: Vec<u8>) -> Result<(), String> {
        let url = format!("{}{path}", self.base);
        let request = http::Request::builder()
            .method(method)
            .uri(&url)
            .header(http::header::AUTHORIZATION, &self.authorization)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|err| format!("bad gateway URL `{url}`: {err}"))?;
        let response = tokio::time::timeout(CALL_TIMEOUT, self.client.request(request))
            .await
            .map_err(|_| format!("`{url}` did not answer within {CALL_TIMEOUT:?}"))?
            .map_err(|err| format!("`{url}`: {err}"))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("`{url}` answered {}", response.status()))
        }
    }
}

/// Runs the link until `events` closes (the engine stopped) or `stop` fires, then leaves.
pub async fn run(
    config: GatewayLinkConfig,
    log: Arc<Mutex<EventLog>>,
    mut events: mpsc::UnboundedReceiver<KvEvent>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let caller = Caller {
        client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        base: config.admin_url.trim_end_matches('/').to_string(),
        authorization: format!("Bearer {}", config.token),
    };
    let worker = config.registration.worker.clone();
    let events_path = switchyard_protocol::paths::admin_worker_events(&worker);
    let mut registration = config.registration.clone();
    let mut ticker = tokio::time::interval(Duration::from_millis(registration.heartbeat_ms.max(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Register before the first event, so the gateway knows whose events they are.
    beat(&caller, &log, &mut registration).await;
    ticker.reset();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            event = events.recv() => {
                let Some(event) = event else { break };
                let Some(batch) = number(&log, event, &mut events) else { break };
                match serde_json::to_vec(&batch) {
                    Ok(body) => {
                        if let Err(err) = caller.call(http::Method::POST, &events_path, body).await {
                            tracing::warn!(error = %err, events = batch.len(), "cannot post KV events; the gateway will resync");
                        }
                    }
                    Err(err) => tracing::error!(error = %err, "cannot encode KV events"),
                }
            }
            _ = ticker.tick() => beat(&caller, &log, &mut registration).await,
            _ = &mut stop => break,
        }
    }
    if let Err(err) = caller
        .call(
            http::Method::DELETE,
            &switchyard_protocol::paths::admin_worker(&worker),
            Vec::new(),
        )
        .await
    {
        tracing::warn!(error = %err, "cannot leave the gateway");
    }
}

/// Numbers `first` and the events already waiting behind it (up to a batch).
fn number(
    log: &Mutex<EventLog>,
    first: KvEvent,
    events: &mut mpsc::UnboundedReceiver<KvEvent>,
) -> Option<Vec<switchyard_protocol::kv_events::WorkerEvent>> {
    let mut log = log.lock().ok()?;
    let mut batch = vec![log.record(first)];
    while batch.len() < MAX_BATCH {
        match events.try_recv() {
            Ok(event) => batch.push(log.record(event)),
            Err(_) => break,
        }
    }
    Some(batch)
}

async fn beat(caller: &Caller, log: &Mutex<EventLog>, registration: &mut Registration) {
    registration.last_event_id = log.lock().map(|log| log.last_event_id()).unwrap_or(0);
    match serde_json::to_vec(&registration) {
        Ok(body) => {
            if let Err(err) = caller
                .call(http::Method::POST, switchyard_protocol::paths::ADMIN_WORKERS, body)
                .await
            {
                tracing::warn!(error = %err, "cannot register with the gateway");
            }
        }
        Err(err) => tracing::error!(error = %err, "cannot encode the registration"),
    }
}
