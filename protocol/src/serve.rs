//! Serving plain HTTP (HTTP/1.1 and cleartext HTTP/2) on a listener.
//!
//! This module owns the accept loop every plain-HTTP server of Switchyard runs: the workers'
//! OpenAI endpoints and the gateway's admin API. Accept errors (out of file descriptors and the
//! like) back off instead of spinning; each connection is served on its own task, after an
//! optional wrapping step ([`serve_http_over`]: the admin listener's TLS), under optional
//! [`Limits`] (the admin listener's: a deadline for a connection's first request and each
//! later request head, and a cap on connections open at once). The client listener's TLS and
//! connection limits live in the gateway's listener, not here.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use crate::respond::Body;

/// Limits on a listener's connections; the default sets none.
#[derive(Debug, Clone, Copy, Default)]
pub struct Limits {
    /// Time a connection gets to send its first request, and each later request head (HTTP/1.1),
    /// before it is closed.
    pub header_read_timeout: Option<Duration>,
    /// Connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: Option<usize>,
}

/// Accepts connections on `listener` until the task running it is aborted, answering every
/// request with `handler`. `name` labels log lines.
pub async fn serve_http<F, Fut>(listener: TcpListener, name: &'static str, handler: F)
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    serve_http_over(
        listener,
        name,
        Limits::default(),
        |stream| std::future::ready(Some(stream)),
        handler,
    )
    .await;
}

/// [`serve_http`] over what `wrap` makes of each accepted connection (a TLS session, say),
/// under `limits`; a connection it answers `None` for is dropped. `wrap` runs on the
/// connection's own task, and the first request's deadline counts from before it.
pub async fn serve_http_over<W, WFut, S, F, Fut>(
    listener: TcpListener,
    name: &'static str,
    limits: Limits,
    wrap: W,
    handler: F,
) where
    W: Fn(TcpStream) -> WFut + Send + Sync + 'static,
    WFut: Future<Output = Option<S>> + Send + 'static,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let wrap = Arc::new(wrap);
    let handler = Arc::new(handler);
    let open = limits
        .max_connections
        .map(|cap| Arc::new(tokio::sync::Semaphore::new(cap)));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(server = name, error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Over the cap the connection is closed at once: its descriptor goes back before it
        // can hold anything.
        let permit = match &open {
            Some(open) => match open.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    tracing::debug!(server = name, %peer, "connection cap reached; closed");
                    drop(stream);
                    continue;
                }
            },
            None => None,
        };
        let _ = stream.set_nodelay(true);
        let (wrap, handler) = (wrap.clone(), handler.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let first_request = limits.header_read_timeout.map(|timeout| {
                let (seen, first) = tokio::sync::oneshot::channel::<()>();
                (
                    std::sync::Mutex::new(Some(seen)),
                    first,
                    tokio::time::Instant::now() + timeout,
                )
            });
            let (seen, deadline) = match first_request {
                Some((seen, first, deadline)) => (Some(Arc::new(seen)), Some((first, deadline))),
                None => (None, None),
            };
            let connection = async move {
                let stream = wrap(stream).await?;
                let service = service_fn(move |request| {
                    if let Some(seen) = seen.as_ref().and_then(|seen| seen.lock().ok()?.take()) {
                        let _ = seen.send(());
                    }
                    let response = handler(request);
                    async move { Ok::<_, Infallible>(response.await) }
                });
                let mut builder = auto::Builder::new(TokioExecutor::new());
                if let Some(timeout) = limits.header_read_timeout {
                    builder.http1().timer(TokioTimer::new()).header_read_timeout(timeout);
                    builder.http2().timer(TokioTimer::new());
                }
                if let Err(err) = builder.serve_connection(TokioIo::new(stream), service).await {
                    tracing::debug!(server = name, error = %err, "connection ended with an error");
                }
                Some(())
            };
            match deadline {
                None => {
                    connection.await;
                }
                // A connection that sends no request in time is dropped, closing it: hyper
                // times out a slow request head, but not a peer that never sends a first byte.
                Some((first, deadline)) => {
                    let silent = async move {
                        if tokio::time::timeout_at(deadline, first).await.is_err() {
                            return;
                        }
                        std::future::pending::<()>().await;
                    };
                    tokio::select! {
                        _ = connection => {}
                        () = silent => {
                            tracing::debug!(server = name, %peer, "no request within the header read timeout; closed");
                        }
                    }
                }
            }
        });
    }
}
