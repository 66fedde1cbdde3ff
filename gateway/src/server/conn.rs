//! Accepting client connections: TCP, TLS, protocol choice, connection-level limits.
//!
//! Each accepted socket gets its own task: the TLS handshake (bounded in time), then HTTP/2
//! when ALPN chose `h2` (or a plaintext client sent the HTTP/2 preface), HTTP/1.1 otherwise.
//! For HTTP/1.1 the first request head is read here, under `header_read_timeout`, so that a
//! client too slow to send its headers gets an OpenAI-style 408 instead of a silent close;
//! later heads on a keep-alive connection are bounded by hyper's own timer (`idle_timeout`).
//! HTTP/2, whether chosen by ALPN or by prior knowledge, is served by one builder with one set
//! of settings, and a connection with no stream open for `idle_timeout` is closed: hyper's
//! HTTP/2 server has no idle timer of its own, and the pings it sends (which every client
//! answers) would keep a silent connection, and its permit, forever.
//!
//! A connection holds one of `server.max_connections` permits while it is open; past the cap a
//! new one is answered 503 (`too_many_connections`, after the TLS handshake where there is
//! one) and closed. Every served connection is watched by the drain (`Gateway::drain`), which
//! lets its response in flight finish and then closes it.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::StatusCode;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use switchyard_protocol::api::ApiError;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::server::rewind::Rewind;
use crate::server::routes;
use crate::server::tls::Tls;
use crate::state::AppState;

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Accepts connections on `listener` until the task is aborted.
pub(crate) async fn accept_loop(listener: TcpListener, tls: Option<Tls>, state: Arc<AppState>) {
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of file descriptors and similar: back off instead of spinning.
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = socket.set_nodelay(true);
        let state = state.clone();
        let tls = tls.clone();
        // Held until the connection ends.
        let permit = state.connections.clone().try_acquire_owned().ok();
        if permit.is_none() {
            state.metrics.error("too_many_connections");
            tracing::warn!(%peer, max = state.server.max_connections, "connection refused: server.max_connections reached");
        }
        tokio::spawn(async move {
            let _permit = permit;
            match tls {
                Some(tls) => {
                    let handshake =
                        tokio::time::timeout(state.server.tls_handshake_timeout(), tls.acceptor.accept(socket)).await;
                    match handshake {
                        Ok(Ok(stream)) if _permit.is_none() => refuse(stream, &state).await,
                        Ok(Ok(stream)) => {
                            let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                            serve(stream, h2, state).await;
                        }
                        Ok(Err(err)) => {
                            state.metrics.error("tls_handshake_failed");
                            tracing::debug!(%peer, error = %err, "TLS handshake failed");
                        }
                        Err(_) => {
                            state.metrics.error("tls_handshake_timeout");
                            tracing::debug!(%peer, "TLS handshake timed out");
                        }
                    }
                }
                None if _permit.is_none() => refuse(socket, &state).await,
                None => serve(socket, false, state).await,
            }
        });
    }
}

/// Answers a connection past `server.max_connections` with a 503 and closes it.
async fn refuse<S: AsyncWrite + Unpin>(mut stream: S, state: &AppState) {
    let err = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "too_many_connections",
        format!(
            "the gateway has {} connections open (server.max_connections); retry shortly",
            state.server.max_connections
        ),
    );
    let body = err.to_json();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(&body).await;
    let _ = stream.shutdown().await;
}

async fn serve<S>(mut stream: S, h2: bool, state: Arc<AppState>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // None once a drain has begun: the connection is then served without being waited for.
    let watcher = state
        .graceful
        .lock()
        .ok()
        .and_then(|graceful| graceful.as_ref().map(|g| g.watcher()));
    let server = &state.server;
    if h2 {
        serve_h2(TokioIo::new(stream), &state, watcher).await;
        return;
    }
    let service_state = state.clone();
    let service = service_fn(move |request| {
        let state = service_state.clone();
        async move { Ok::<_, Infallible>(routes::handle(state, request, Instant::now()).await) }
    });
    let head = match read_first_head(&mut stream, server.max_header_bytes, server.header_read_timeout()).await {
        FirstHead::Read(bytes) => bytes,
        FirstHead::Closed => return,
        FirstHead::TimedOut => {
            state.metrics.error("header_timeout");
            let err = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "header_timeout",
                format!(
                    "request headers not received within {} ms",
                    server.header_read_timeout_ms
                ),
            );
            let body = err.to_json();
            let response = format!(
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.write_all(&body).await;
            let _ = stream.shutdown().await;
            return;
        }
    };
    if head.starts_with(H2_PREFACE) {
        serve_h2(TokioIo::new(Rewind::new(head, stream)), &state, watcher).await;
        return;
    }
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(server.idle_timeout())
        .max_buf_size(server.max_header_bytes.max(8192));
    let connection = builder.serve_connection(TokioIo::new(Rewind::new(head, stream)), service);
    let ended = match watcher {
        Some(watcher) => watcher.watch(connection).await,
        None => connection.await,
    };
    if let Err(err) = ended {
        tracing::debug!(error = %err, "HTTP/1.1 connection ended with an error");
    }
}

/// Serves an HTTP/2 connection (by ALPN or prior knowledge: the same settings) until it ends,
/// the drain closes it, or it has had no stream open for `server.idle_timeout`.
async fn serve_h2<I>(io: I, state: &Arc<AppState>, watcher: Option<hyper_util::server::graceful::Watcher>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let server = &state.server;
    let streams = Arc::new(OpenStreams::new());
    let (service_state, service_streams) = (state.clone(), streams.clone());
    let service = service_fn(move |request| {
        let state = service_state.clone();
        let stream = OpenStreams::open(&service_streams);
        async move {
            let response = routes::handle(state, request, Instant::now()).await;
            // The stream stays open until its response body is done (a stream relayed for
            // minutes is not idle).
            Ok::<_, Infallible>(response.map(|body| Tracked { body, _stream: stream }))
        }
    });
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(server.idle_timeout() / 2))
        .keep_alive_timeout(server.idle_timeout() / 2)
        .max_header_list_size(u32::try_from(server.max_header_bytes).unwrap_or(u32::MAX));
    let connection = builder.serve_connection(io, service);
    let serving = async {
        match watcher {
            Some(watcher) => watcher.watch(connection).await,
            None => connection.await,
        }
    };
    tokio::select! {
        ended = serving => {
            if let Err(err) = ended {
                tracing::debug!(error = %err, "HTTP/2 connection ended with an error");
            }
        }
        () = streams.idle_for(server.idle_timeout()) => {
            // No stream is open, so dropping the connection cuts off no request.
            tracing::debug!("HTTP/2 connection closed: no stream open for server.idle_timeout_ms");
        }
    }
}

/// The streams open on one HTTP/2 connection, and since when none has been.
#[derive(Debug)]
struct OpenStreams {
    open: AtomicUsize,
    /// When the last stream ended (the connection's start before any).
    last_end: parking_lot::Mutex<Instant>,
}

impl OpenStreams {
    fn new() -> OpenStreams {
        OpenStreams {
            open: AtomicUsize::new(0),
            last_end: parking_lot::Mutex::new(Instant::now()),
        }
    }

    /// Counts a stream open until the guard is dropped.
    fn open(streams: &Arc<OpenStreams>) -> StreamOpen {
        streams.open.fetch_add(1, Ordering::AcqRel);
        StreamOpen(streams.clone())
    }

    /// Returns once no stream has been open for `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        loop {
            let deadline = if self.open.load(Ordering::Acquire) == 0 {
                *self.last_end.lock() + timeout
            } else {
                // Looked at again a timeout later: a stream open now ends no sooner.
                Instant::now() + timeout
            };
            if self.open.load(Ordering::Acquire) == 0 && Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.into()).await;
        }
    }
}

/// One open stream of an [`OpenStreams`].
#[derive(Debug)]
struct StreamOpen(Arc<OpenStreams>);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        *self.0.last_end.lock() = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its stream counted open until it is done or dropped.
struct Tracked<B> {
    body: B,
    _stream: StreamOpen,
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

enum FirstHead {
    /// Bytes up to (at least) the end of the first head, or as many as the limit allows.
    Read(Bytes),
    /// The client closed the connection before sending a request.
    Closed,
    /// The head did not arrive in time.
    TimedOut,
}

/// Reads until the first request head is complete (`\r\n\r\n`), the head limit is reached
/// (hyper then answers 431), the HTTP/2 preface is seen, or the time runs out.
async fn read_first_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    limit: usize,
    timeout: std::time::Duration,
) -> FirstHead {
    let mut buffer = BytesMut::with_capacity(4096);
    let reading = async {
        loop {
            let searched_from = buffer.len().saturating_sub(3);
            match stream.read_buf(&mut buffer).await {
                Ok(0) | Err(_) => return buffer.is_empty(),
                Ok(_) => {}
            }
            let complete = buffer[searched_from..].windows(4).any(|w| w == b"\r\n\r\n");
            if complete || buffer.len() >= limit || buffer.starts_with(H2_PREFACE) {
                return false;
            }
        }
    };
    match tokio::time::timeout(timeout, reading).await {
        Ok(true) => FirstHead::Closed,
        Ok(false) => FirstHead::Read(buffer.freeze()),
        Err(_) => FirstHead::TimedOut,
    }
}
