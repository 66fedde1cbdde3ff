//! Serving plain HTTP (HTTP/1.1 and cleartext HTTP/2) on a listener.
//!
//! This module owns the accept loop every plain-HTTP server of Switchyard runs: the workers'
//! OpenAI endpoints and the gateway's admin API. Accept errors (out of file descriptors and the
//! like) back off instead of spinning; each connection is served on its own task, after an
//! optional wrapping step ([`serve_http_over`]: the admin listener's TLS). The client
//! listener's TLS and connection limits live in the gateway's listener, not here.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use crate::respond::Body;

/// Accepts connections on `listener` until the task running it is aborted, answering every
/// request with `handler`. `name` labels log lines.
pub async fn serve_http<F, Fut>(listener: TcpListener, name: &'static str, handler: F)
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    serve_http_over(listener, name, |stream| std::future::ready(Some(stream)), handler).await;
}

/// [`serve_http`] over what `wrap` makes of each accepted connection (a TLS session, say);
/// a connection it answers `None` for is dropped. `wrap` runs on the connection's own task.
pub async fn serve_http_over<W, WFut, S, F, Fut>(listener: TcpListener, name: &'static str, wrap: W, handler: F)
where
    W: Fn(TcpStream) -> WFut + Send + Sync + 'static,
    WFut: Future<Output = Option<S>> + Send + 'static,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let wrap = Arc::new(wrap);
    let handler = Arc::new(handler);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(server = name, error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (wrap, handler) = (wrap.clone(), handler.clone());
        tokio::spawn(async move {
            let Some(stream) = wrap(stream).await else {
                return;
            };
            let service = service_fn(move |request| {
                let response = handler(request);
                async move { Ok::<_, Infallible>(response.await) }
            });
            if let Err(err) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(server = name, error = %err, "connection ended with an error");
            }
        });
    }
}
