//! Media by URL (`[media] fetch = true`): a TLS gateway fetches `image_url` parts from a
//! local HTTP and HTTPS origin, under the host allowlist, the refusal of non-public addresses
//! (off, then on), the byte and time limits, with redirects refused. A fetched image is encoded
//! and merged like an inline one; every refusal is a 400 naming the part, and no worker sees
//! the request. A request with more media parts than `max_items` is refused before any
//! connection is opened, and one request's fetches run at most `fetch_concurrency` at a time.

use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use switchyard_harness::{Alpn, Client, Gateway, TestCa};
use switchyard_media::fixtures;
use switchyard_protocol::respond::{self, Body};

/// The origin's answers, by path.
async fn origin(path: &str) -> Response<Body> {
    let reply = |status: StatusCode, body: Vec<u8>| {
        Response::builder()
            .status(status)
            .header("content-type", "image/png")
            .body(respond::full(body))
            .unwrap_or_else(|_| Response::new(respond::full(Vec::new())))
    };
    match path {
        "/cat.png" => reply(StatusCode::OK, fixtures::png_tagged(336, 336, b"cat")),
        "/big.png" => reply(StatusCode::OK, fixtures::png(600, 600)),
        "/moved" => Response::builder()
            .status(StatusCode::FOUND)
            .header("location", "/cat.png")
            .body(respond::full(Vec::new()))
            .unwrap_or_else(|_| Response::new(respond::full(Vec::new()))),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            reply(StatusCode::OK, Vec::new())
        }
        _ => reply(StatusCode::NOT_FOUND, Vec::new()),
    }
}

/// Serves [`origin`] over plain HTTP and over TLS with the test CA's `localhost` certificate.
async fn start_origins(ca: &TestCa) -> anyhow::Result<(u16, u16)> {
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let plain_port = plain.local_addr()?.port();
    tokio::spawn(switchyard_protocol::serve::serve_http(
        plain,
        "origin",
        |request| async move { origin(request.uri().path()).await },
    ));
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(&ca.cert_path)?.collect::<Result<_, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&ca.key_path)?;
    let tls = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let secure = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let secure_port = secure.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = secure.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(|request: http::Request<hyper::body::Incoming>| async move {
                    Ok::<_, std::convert::Infallible>(origin(request.uri().path()).await)
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((plain_port, secure_port))
}

fn with_image_url(url: &str) -> Value {
    json!({
        "model": "mock",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
        "max_tokens": 2,
    })
}

fn gateway(ca: &TestCa, media: &str) -> anyhow::Result<Gateway> {
    Gateway::start(&format!(
        "mode = \"production\"\n{}\n[embedded_mockers]\ncount = 1\nspeedup = 100.0\n[media]\nfetch = true\n{media}",
        ca.tls_toml()
    ))
}

async fn assert_refused(client: &Client, url: &str, why: &str) -> anyhow::Result<()> {
    let reply = client.post_json("/v1/chat/completions", &with_image_url(url)).await?;
    let body: Value = serde_json::from_slice(&reply.body()).unwrap_or(Value::Null);
    assert_eq!(reply.status.as_u16(), 400, "{url}: {body}");
    assert_eq!(body["error"]["param"], "messages[0].content[1]", "{url}: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(why), "{url}: `{why}` not in {body}");
    assert!(
        reply.headers.get("x-switchyard-worker").is_none(),
        "{url} reached a worker"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_urls_are_fetched_within_the_allowlist_and_limits() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let (http_port, https_port) = start_origins(&ca).await?;

    // Loopback is not public: refused while allow_private is off.
    let strict = gateway(&ca, "allow_hosts = [\"localhost\"]\n")?;
    let client = Client::tls(strict.addr, &ca.ca_der, Alpn::H2, None)?;
    assert_refused(
        &client,
        &format!("http://localhost:{http_port}/cat.png"),
        "non-public address",
    )
    .await?;
    drop(strict);

    let open = gateway(
        &ca,
        &format!(
            "allow_hosts = [\"localhost\", \"*.example.org\"]\nallow_private = true\nmax_bytes = 500000\n\
             fetch_timeout_ms = 1500\nfetch_ca_file = {:?}\n",
            ca.ca_path.display().to_string()
        ),
    )?;
    let client = Client::tls(open.addr, &ca.ca_der, Alpn::H2, None)?;
    for url in [
        format!("http://localhost:{http_port}/cat.png"),
        format!("https://localhost:{https_port}/cat.png"),
    ] {
        let reply = client.post_json("/v1/chat/completions", &with_image_url(&url)).await?;
        assert_eq!(reply.status, 200, "{url}: {}", String::from_utf8_lossy(&reply.body()));
        let merge = reply.headers["x-switchyard-merge"].to_str()?.to_string();
        assert!(merge.contains("spans="), "{url}: {merge}");
    }
    assert_refused(&client, "https://images.example.com/cat.png", "allow_hosts").await?;
    assert_refused(&client, &format!("http://localhost:{http_port}/big.png"), "max_bytes").await?;
    assert_refused(
        &client,
        &format!("http://localhost:{http_port}/moved"),
        "redirects are not followed",
    )
    .await?;
    assert_refused(&client, &format!("http://localhost:{http_port}/nothing"), "404").await?;
    assert_refused(&client, &format!("http://localhost:{http_port}/slow"), "within 1500 ms").await?;
    assert_refused(&client, "ftp://localhost/cat.png", "not a data URL").await?;
    drop(open);

    // Without the test CA among the roots, the HTTPS origin's certificate is not trusted.
    let untrusting = gateway(&ca, "allow_hosts = [\"localhost\"]\nallow_private = true\n")?;
    let client = Client::tls(untrusting.addr, &ca.ca_der, Alpn::H2, None)?;
    assert_refused(&client, &format!("https://localhost:{https_port}/cat.png"), "TLS").await?;
    Ok(())
}

/// An origin that counts the connections it is opened, and the most held at once: each is
/// held `hold` before it is answered (the cat image, as [`origin`] answers).
struct CountingOrigin {
    port: u16,
    opened: Arc<std::sync::atomic::AtomicUsize>,
    most_open: Arc<std::sync::atomic::AtomicUsize>,
}

async fn counting_origin(hold: Duration) -> anyhow::Result<CountingOrigin> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let opened = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let most_open = Arc::new(AtomicUsize::new(0));
    let (opened_, most_open_) = (opened.clone(), most_open.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            opened_.fetch_add(1, Ordering::SeqCst);
            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
            most_open_.fetch_max(now, Ordering::SeqCst);
            let open = open.clone();
            tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                // No longer counted once it answers: the gateway's next fetch may start then.
                open.fetch_sub(1, Ordering::SeqCst);
                let service = hyper::service::service_fn(|request: http::Request<hyper::body::Incoming>| async move {
                    Ok::<_, std::convert::Infallible>(origin(request.uri().path()).await)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(CountingOrigin {
        port,
        opened,
        most_open,
    })
}

fn with_image_urls(url: &str, count: usize) -> Value {
    let mut content = vec![json!({"type": "text", "text": "what are these?"})];
    content.extend((0..count).map(|_| json!({"type": "image_url", "image_url": {"url": url}})));
    json!({
        "model": "mock",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_media_urls_are_refused_before_any_fetch_and_fetches_are_bounded() -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    let ca = TestCa::new()?;
    let origin = counting_origin(Duration::from_millis(200)).await?;
    let gateway = gateway(
        &ca,
        "allow_hosts = [\"localhost\"]\nallow_private = true\nmax_items = 16\nfetch_concurrency = 4\n",
    )?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let url = format!("http://localhost:{}/cat.png", origin.port);

    let reply = client
        .post_json("/v1/chat/completions", &with_image_urls(&url, 200))
        .await?;
    let body: Value = serde_json::from_slice(&reply.body()).unwrap_or(Value::Null);
    assert_eq!(reply.status.as_u16(), 400, "{body}");
    assert_eq!(body["error"]["code"], "too_many_media_items", "{body}");
    // The 17th media part is the first one over the limit (part 0 is the text).
    assert_eq!(body["error"]["param"], "messages[0].content[17]", "{body}");
    assert_eq!(
        origin.opened.load(Ordering::SeqCst),
        0,
        "connections opened for a refused request"
    );

    // Within the limit, every URL is fetched, a few at a time.
    let reply = client
        .post_json("/v1/chat/completions", &with_image_urls(&url, 12))
        .await?;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
    assert_eq!(origin.opened.load(Ordering::SeqCst), 12);
    let most_open = origin.most_open.load(Ordering::SeqCst);
    assert!((1..=4).contains(&most_open), "{most_open} fetches at once");
    Ok(())
}
