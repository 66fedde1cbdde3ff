//! Keep-alive connections to workers that the task reading an answer drives itself.
//!
//! hyper's pooled client runs each connection in a task of its own and hands a response body
//! over through a channel that holds one frame: every event a worker streams costs a task
//! switch each way, and the events of one read reach the relay one scheduler turn at a time,
//! so they leave to the client in several writes. Here a connection
//! (`hyper::client::conn::http1`) travels with its answer: [`UpstreamBody`] polls the
//! connection before the body, so one poll decodes everything a read brought and the relay
//! sees the whole read at once, with no second task. When the answer ends cleanly the
//! connection goes back to an idle list per worker (at most `pool_max_idle_per_worker`,
//! closed after [`IDLE_TIMEOUT`], a departed worker's too); an answer dropped midway closes
//! it, which is how a worker hears that its client went away. A request that finds a reused
//! connection closed before it was sent is sent again on another one, as hyper's pooled client
//! does; one whose reused connection ends with no answer at all (the worker closed it as the
//! request arrived) is sent again once, on a new connection.
//!
//! # Rejected designs
//!
//! - hyper's pooled client for answers (kept for the gateway's own calls): at 512 streams the TLS
//!   gateway took 1.30–1.97× nginx's CPU per streamed request with it, 1.07–1.32× with this
//!   module, the two builds alternating (`benchmarks/history/overhead.md`).

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::client::ForwardError;

/// How long a connection may wait unused before it is closed rather than reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// How often the idle lists of every worker are swept of connections past [`IDLE_TIMEOUT`]:
/// a worker that left the fleet would otherwise keep its sockets open for good.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// One HTTP/1.1 connection to a worker: the handle requests go through and the connection
/// itself, which does the I/O whenever it is polled.
struct Link {
    sender: http1::SendRequest<Full<Bytes>>,
    connection: Connection,
    /// The worker it goes to: its key in the pool.
    authority: Authority,
}

/// A connection's I/O half, polled by whoever reads its current answer.
struct Connection {
    io: http1::Connection<TokioIo<TcpStream>, Full<Bytes>>,
    /// It has ended (closed, broken or told to close) and must not be polled again.
    ended: bool,
}

impl Connection {
    /// Polls the connection once, unless it has ended; `false` once it has.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.ended {
            self.ended = Pin::new(&mut self.io).poll(cx).is_ready();
        }
        !self.ended
    }
}

/// A connection waiting for its next request.
struct Idle {
    link: Box<Link>,
    since: Instant,
}

/// The idle connections, per worker address.
struct Pool {
    idle: Mutex<Idling>,
    max_idle_per_worker: usize,
}

/// What the pool's lock guards.
struct Idling {
    links: HashMap<Authority, Vec<Idle>>,
    last_sweep: Instant,
}

impl Pool {
    /// The most recently used live connection to `authority`, if one waits.
    fn checkout(&self, authority: &Authority) -> Option<Box<Link>> {
        let mut idle = self.idle.lock();
        let links = idle.links.get_mut(authority)?;
        while let Some(Idle { link, since }) = links.pop() {
            if since.elapsed() < IDLE_TIMEOUT && !link.sender.is_closed() {
                return Some(link);
            }
        }
        None
    }

    /// Keeps `link` for the next request to its worker, if there is room.
    fn release(&self, link: Box<Link>) {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        if now.duration_since(idle.last_sweep) >= SWEEP_EVERY {
            idle.last_sweep = now;
            idle.links.retain(|_, links| {
                drop_expired(links, now);
                !links.is_empty()
            });
        }
        let links = idle.links.entry(link.authority.clone()).or_default();
        drop_expired(links, now);
        if links.len() < self.max_idle_per_worker {
            links.push(Idle { link, since: now });
        }
    }

    /// Idle connections kept, per worker (for tests).
    #[cfg(test)]
    fn idle_counts(&self) -> HashMap<String, usize> {
        let idle = self.idle.lock();
        idle.links
            .iter()
            .map(|(authority, links)| (authority.to_string(), links.len()))
            .collect()
    }
}

/// Closes the connections of `links` idle for [`IDLE_TIMEOUT`] or more at `now`. A list is kept
/// oldest first (connections are pushed as they go idle and taken from the back), so they are
/// a prefix of it, found by bisection: releasing a connection does not scan the whole list.
fn drop_expired(links: &mut Vec<Idle>, now: Instant) {
    let expired = links.partition_point(|idle| now.duration_since(idle.since) >= IDLE_TIMEOUT);
    links.drain(..expired);
}

/// Sends requests to workers over connections their answers drive (see the module docs).
#[derive(Clone)]
pub struct UpstreamClient {
    pool: Arc<Pool>,
    connect_timeout: Duration,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("max_idle_per_worker", &self.pool.max_idle_per_worker)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl UpstreamClient {
    /// A client keeping at most `max_idle_per_worker` idle connections to each worker.
    pub fn new(max_idle_per_worker: usize, connect_timeout: Duration) -> UpstreamClient {
        UpstreamClient {
            pool: Arc::new(Pool {
                idle: Mutex::new(Idling {
                    links: HashMap::new(),
                    last_sweep: Instant::now(),
                }),
                max_idle_per_worker,
            }),
            connect_timeout,
        }
    }

    /// Sends `request` (an absolute `http://` URI) and waits up to `timeout` for the answer's
    /// headers; its body drives the connection from then on.
    ///
    /// # Errors
    ///
    /// [`ForwardError::Connect`] when the worker cannot be reached, [`ForwardError::Upstream`]
    /// when the connection breaks or the answer is malformed, [`ForwardError::Timeout`] when
    /// the headers do not come in time.
    pub async fn send(
        &self,
        request: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response<UpstreamBody>, ForwardError> {
        let (authority, request) = origin_form(request)?;
        match tokio::time::timeout(timeout, self.send_on_some_link(&authority, request)).await {
            Ok(Ok((response, link))) => Ok(response.map(|body| UpstreamBody {
                body,
                link: Some(link),
                pool: Arc::clone(&self.pool),
            })),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(ForwardError::Timeout(timeout)),
        }
    }

    /// Sends `request` on an idle connection, or a new one when none is left or a reused one
    /// turns out closed before the request went out.
    async fn send_on_some_link(
        &self,
        authority: &Authority,
        mut request: Request<Full<Bytes>>,
    ) -> Result<(Response<Incoming>, Box<Link>), ForwardError> {
        // Whether the request was already sent again after a reused connection ended.
        let mut sent_again = false;
        loop {
            let pooled = if sent_again {
                None
            } else {
                self.pool.checkout(authority)
            };
            let (mut link, reused) = match pooled {
                Some(link) => (link, true),
                None => (self.connect(authority).await?, false),
            };
            // A reused connection the worker closes as the request arrives (its keep-alive ran
            // out: llama.cpp's server does this) ends with no answer at all; the request goes
            // again, once, on a new connection.
            let copy = (reused && !sent_again).then(|| copy_of(&request));
            match send_on(&mut link, request).await {
                Ok(response) => return Ok((response, link)),
                Err(Unsent::Again(again)) if reused => request = *again,
                Err(Unsent::Again(_)) => {
                    return Err(ForwardError::Upstream(
                        "a new connection closed before the request went out".into(),
                    ));
                }
                Err(Unsent::Ended) => match copy {
                    Some(copy) => {
                        sent_again = true;
                        request = copy;
                    }
                    None => return Err(ForwardError::Upstream("the connection ended without an answer".into())),
                },
                Err(Unsent::Failed(err)) => return Err(ForwardError::Upstream(err)),
            }
        }
    }

    /// A new connection to `authority`.
    async fn connect(&self, authority: &Authority) -> Result<Box<Link>, ForwardError> {
        let address = (authority.host(), authority.port_u16().unwrap_or(80));
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => return Err(ForwardError::Connect(format!("cannot connect to {authority}: {err}"))),
            Err(_) => {
                return Err(ForwardError::Connect(format!(
                    "cannot connect to {authority} within {:?}",
                    self.connect_timeout
                )));
            }
        };
        // Each event is one small write; Nagle's algorithm would hold it back.
        stream
            .set_nodelay(true)
            .map_err(|err| ForwardError::Connect(format!("cannot set TCP_NODELAY to {authority}: {err}")))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| ForwardError::Connect(format!("cannot open HTTP/1.1 to {authority}: {err}")))?;
        // Boxed: a connection is large, and it moves between the pool and answers.
        Ok(Box::new(Link {
            sender,
            connection: Connection {
                io: connection,
                ended: false,
            },
            authority: authority.clone(),
        }))
    }
}

/// Why a request got no answer on a connection.
enum Unsent {
    /// The connection was closed before the request went out: it may be sent elsewhere.
    Again(Box<Request<Full<Bytes>>>),
    /// The connection ended after it went out, with no answer at all.
    Ended,
    /// It failed after going out (or could not go out for a reason another connection
    /// would share).
    Failed(String),
}

/// A copy of `request` (its extensions aside, which requests to workers do not carry).
fn copy_of(request: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let mut copy = Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy
}

/// Sends `request` on `link`, driving the connection until the answer's headers arrive.
async fn send_on(link: &mut Link, request: Request<Full<Bytes>>) -> Result<Response<Incoming>, Unsent> {
    let Link { sender, connection, .. } = link;
    // The connection takes a request only once it has said it wants one.
    let ready = poll_fn(|cx| {
        let live = connection.drive(cx);
        match sender.poll_ready(cx) {
            Poll::Ready(result) => Poll::Ready(result.is_ok()),
            Poll::Pending if !live => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    })
    .await;
    if !ready {
        return Err(Unsent::Again(Box::new(request)));
    }
    let mut answer = pin!(sender.try_send_request(request));
    poll_fn(|cx| {
        let live = connection.drive(cx);
        match answer.as_mut().poll(cx) {
            Poll::Ready(Ok(response)) => Poll::Ready(Ok(response)),
            Poll::Ready(Err(mut err)) => Poll::Ready(Err(match err.take_message() {
                Some(request) => Unsent::Again(Box::new(request)),
                None => {
                    let err = err.into_error();
                    if err.is_incomplete_message() {
                        Unsent::Ended
                    } else {
                        Unsent::Failed(err.to_string())
                    }
                }
            })),
            // The connection ended and hyper will say why through the answer; it has
            // resolved it by now, so this is only reached if it did not.
            Poll::Pending if !live => Poll::Ready(Err(Unsent::Ended)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// `request` with its URI in origin form and a `Host` header, as HTTP/1.1 sends it to an
/// origin server, and the authority it goes to.
fn origin_form(request: Request<Full<Bytes>>) -> Result<(Authority, Request<Full<Bytes>>), ForwardError> {
    let (mut parts, body) = request.into_parts();
    let uri = std::mem::take(&mut parts.uri).into_parts();
    if uri
        .scheme
        .as_ref()
        .is_some_and(|scheme| scheme != &http::uri::Scheme::HTTP)
    {
        return Err(ForwardError::Connect("workers are reached over plain http://".into()));
    }
    let Some(authority) = uri.authority else {
        return Err(ForwardError::Connect("a worker's URL has no host".into()));
    };
    let path = uri.path_and_query.unwrap_or_else(|| PathAndQuery::from_static("/"));
    parts.uri = Uri::from(path);
    if !parts.headers.contains_key(header::HOST)
        && let Ok(host) = HeaderValue::from_str(authority.as_str())
    {
        parts.headers.insert(header::HOST, host);
    }
    Ok((authority, Request::from_parts(parts, body)))
}

/// A worker's answer body, which drives its connection as it is read (see the module docs).
pub struct UpstreamBody {
    body: Incoming,
    /// `None` once the connection has ended or gone back to the pool.
    link: Option<Box<Link>>,
    pool: Arc<Pool>,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("worker", &self.link.as_ref().map(|link| &link.authority))
            .finish_non_exhaustive()
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        // The connection first: it decodes what the socket holds into the body.
        if let Some(link) = &mut this.link
            && !link.connection.drive(cx)
        {
            // Ended: what it decoded (or why it failed) is in the body.
            this.link = None;
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(None) = frame
            && let Some(mut link) = this.link.take()
        {
            // One more poll lets the connection take in the answer's end and ask for the next
            // request; a connection that ends on it is not kept.
            if link.connection.drive(cx) && !link.sender.is_closed() {
                this.pool.release(link);
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, StreamBody};
    use hyper::service::service_fn;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A worker that answers `GET /n` with `n` chunks and counts the connections it accepted;
    /// each answer names the request's `Host` and URI, so the tests see what was sent.
    async fn worker() -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let service = service_fn(|request: Request<Incoming>| async move {
                        let host = request.headers().get(header::HOST).cloned();
                        let seen = format!("{host:?} {}", request.uri());
                        let chunks: usize = request.uri().path().trim_start_matches('/').parse().unwrap_or(1);
                        let frames = (0..chunks).map(move |n| {
                            let text = if n == 0 { seen.clone() } else { format!("|{n}") };
                            Ok::<_, Infallible>(Frame::data(Bytes::from(text)))
                        });
                        let stream = futures_util::stream::iter(frames).then(|frame| async move {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            frame
                        });
                        Ok::<_, Infallible>(Response::new(StreamBody::new(stream)))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (format!("http://{address}"), accepted)
    }

    fn get(url: &str) -> Request<Full<Bytes>> {
        Request::get(url).body(Full::new(Bytes::new())).expect("request")
    }

    fn client() -> UpstreamClient {
        UpstreamClient::new(8, Duration::from_secs(2))
    }

    async fn read_all(response: Response<UpstreamBody>) -> String {
        let body = response.into_body().collect().await.expect("body").to_bytes();
        String::from_utf8(body.to_vec()).expect("utf-8")
    }

    use futures_util::StreamExt;

    #[tokio::test]
    async fn answers_stream_and_reuse_one_connection() {
        let (base, accepted) = worker().await;
        let client = client();
        for _ in 0..3 {
            let response = client.send(get(&format!("{base}/3?x=1")), Duration::from_secs(5)).await;
            let text = read_all(response.expect("answer")).await;
            let authority = base.trim_start_matches("http://");
            assert_eq!(
                text,
                format!("Some({authority:?}) /3?x=1|1|2"),
                "origin form, with Host"
            );
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one keep-alive connection for all three"
        );
    }

    #[tokio::test]
    async fn a_body_dropped_midway_closes_its_connection() {
        let (base, accepted) = worker().await;
        let client = client();
        let mut body = client
            .send(get(&format!("{base}/50")), Duration::from_secs(5))
            .await
            .expect("answer")
            .into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert!(first.is_data());
        drop(body);
        let text = read_all(
            client
                .send(get(&format!("{base}/2")), Duration::from_secs(5))
                .await
                .expect("answer"),
        )
        .await;
        assert!(text.ends_with("/2|1"), "{text}");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "the half-read connection was not reused"
        );
    }

    /// A worker that answers one request per connection with `answer`, then closes it; the
    /// address and the connections it accepted.
    async fn one_shot_worker(answer: &'static [u8]) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let mut request = vec![0; 4096];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(answer).await;
            }
        });
        (address, accepted)
    }

    #[tokio::test]
    async fn a_connection_the_worker_closed_while_idle_is_replaced() {
        // It says nothing of closing.
        let (address, accepted) = one_shot_worker(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
        let client = client();
        for round in 0..3 {
            let response = client
                .send(get(&format!("http://{address}/")), Duration::from_secs(5))
                .await;
            assert_eq!(read_all(response.expect("answer")).await, "ok", "round {round}");
            // Let the worker's close reach the idle connection.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_reused_connection_closed_as_the_request_arrives_is_replaced_once() {
        // Each connection answers its first request, then reads the next and closes without
        // answering, as a server whose keep-alive ran out does.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut request = vec![0; 4096];
                    let _ = stream.read(&mut request).await;
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                    let _ = stream.read(&mut request).await;
                });
            }
        });
        let client = client();
        for round in 0..3 {
            let response = client
                .send(get(&format!("http://{address}/")), Duration::from_secs(5))
                .await;
            assert_eq!(read_all(response.expect("answer")).await, "ok", "round {round}");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            3,
            "each later request on a new connection"
        );
    }

    #[tokio::test]
    async fn an_answer_on_a_connection_told_to_close_is_read_whole_and_not_kept() {
        let (address, accepted) =
            one_shot_worker(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 5\r\n\r\nclose").await;
        let client = client();
        for _ in 0..3 {
            let response = client
                .send(get(&format!("http://{address}/")), Duration::from_secs(5))
                .await;
            assert_eq!(read_all(response.expect("answer")).await, "close");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!(client.pool.idle_counts().values().sum::<usize>(), 0);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_after_the_idle_timeout_even_to_departed_workers() {
        let ((first, _), (second, _)) = (worker().await, worker().await);
        let client = client();
        for base in [&first, &second] {
            let response = client.send(get(&format!("{base}/1")), Duration::from_secs(5)).await;
            read_all(response.expect("answer")).await;
        }
        let key = |base: &str| base.trim_start_matches("http://").to_string();
        assert_eq!(
            client.pool.idle_counts(),
            HashMap::from([(key(&first), 1), (key(&second), 1)])
        );
        // The second worker gets no more requests; past the idle timeout a request to the
        // first sweeps its connection out.
        tokio::time::pause();
        tokio::time::advance(IDLE_TIMEOUT + SWEEP_EVERY).await;
        tokio::time::resume();
        let response = client.send(get(&format!("{first}/1")), Duration::from_secs(5)).await;
        read_all(response.expect("answer")).await;
        assert_eq!(client.pool.idle_counts(), HashMap::from([(key(&first), 1)]));
    }

    #[tokio::test]
    async fn an_unreachable_worker_is_a_connect_error() {
        // Bound but never listening: connecting is refused at once, and no one else can take
        // the port meanwhile.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
        let address = socket.local_addr().expect("address");
        let err = client()
            .send(get(&format!("http://{address}/")), Duration::from_secs(5))
            .await
            .expect_err("nothing listens");
        assert!(err.is_connect(), "{err}");
    }

    #[tokio::test]
    async fn headers_that_do_not_come_in_time_are_a_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        // Accepts and reads, never answers.
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let err = client()
            .send(get(&format!("http://{address}/")), Duration::from_millis(100))
            .await
            .expect_err("no answer");
        assert!(matches!(err, ForwardError::Timeout(_)), "{err}");
        assert!(!err.is_connect());
    }

    #[tokio::test]
    async fn only_plain_http_workers_are_reached() {
        let err = client()
            .send(get("https://127.0.0.1:1/"), Duration::from_secs(1))
            .await
            .expect_err("https");
        assert!(err.to_string().contains("plain http"), "{err}");
    }
}
