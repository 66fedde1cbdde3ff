//! Connections that hold the gateway's room without using it: HTTP/2 connections (negotiated by
//! ALPN, or by prior knowledge on a plaintext listener) that open no stream are closed after
//! `server.idle_timeout_ms`, so they cannot keep `server.max_connections` full while their
//! pings are answered; a connection with a stream open is not idle; and a request body that
//! trickles in is answered 408 once `server.body_read_timeout_ms` has passed.

use std::time::{Duration, Instant};

use hyper_util::rt::{TokioExecutor, TokioIo};
use switchyard_harness::{Alpn, Client, Gateway, TestCa, chat_body};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMITS: &str = "max_connections = 4\nidle_timeout_ms = 600\n";

/// Whether a new HTTP/1.1 client of `client`'s gateway is served (`GET /healthz` answered 200).
async fn served(client: &Client) -> bool {
    client
        .send("GET", "/healthz", Vec::new())
        .await
        .is_ok_and(|reply| reply.status == 200)
}

/// Holds the gateway's room with four silent connections from `open`, checks a fifth client is
/// refused, then that it is served once the four have sat idle past the timeout.
async fn silent_connections_are_closed<C, F>(fifth: &Client, open: impl Fn() -> F) -> anyhow::Result<()>
where
    F: std::future::Future<Output = anyhow::Result<C>>,
{
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(open().await?);
    }
    // Let the gateway take each one's permit.
    tokio::time::sleep(Duration::from_millis(100)).await;
    anyhow::ensure!(!served(fifth).await, "the room was not full");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    anyhow::ensure!(
        served(fifth).await,
        "four silent HTTP/2 connections still hold the gateway's room past idle_timeout_ms"
    );
    drop(silent);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_negotiated_by_alpn_are_closed() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&format!(
        "mode = \"production\"\n{}[server]\n{LIMITS}[embedded_mockers]\ncount = 1\nspeedup = 1.0\n",
        ca.tls_toml()
    ))?;
    let h2 = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let fifth = Client::tls(gateway.addr, &ca.ca_der, Alpn::Http1, None)?;
    silent_connections_are_closed(&fifth, || h2.connect()).await?;

    // A connection with a stream open is not idle: a stream longer than the idle timeout
    // (150 tokens at about 6 ms each) runs to its end.
    let started = Instant::now();
    let reply = h2.chat(None, &chat_body("mock", "a long answer", 150, true)).await?;
    anyhow::ensure!(reply.status == 200, "{}", reply.status);
    anyhow::ensure!(
        reply.events().last().is_some_and(|(_, data)| data == "[DONE]"),
        "the stream was cut after {:?}",
        started.elapsed()
    );
    anyhow::ensure!(
        started.elapsed() > Duration::from_millis(600),
        "the stream was too short to tell"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_by_prior_knowledge_are_closed() -> anyhow::Result<()> {
    let gateway = Gateway::start(&format!(
        "[server]\nplaintext = true\n{LIMITS}[embedded_mockers]\ncount = 1\nspeedup = 1.0\n"
    ))?;
    let addr = gateway.addr;
    let open = || async move {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake::<_, _, String>(TokioExecutor::new(), TokioIo::new(tcp)).await?;
        tokio::spawn(connection);
        anyhow::Ok(sender)
    };
    silent_connections_are_closed(&Client::plain(addr), open).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_answered_408_at_its_deadline() -> anyhow::Result<()> {
    let gateway = Gateway::start(
        "[server]\nplaintext = true\nbody_read_timeout_ms = 800\n[embedded_mockers]\ncount = 1\nspeedup = 100.0\n",
    )?;
    let mut tcp = tokio::net::TcpStream::connect(gateway.addr).await?;
    let started = Instant::now();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
          content-length: 1000\r\n\r\n{",
    )
    .await?;
    // One byte every 100 ms, until the gateway answers.
    let (mut read, mut write) = tcp.into_split();
    let trickle = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if write.write_all(b" ").await.is_err() {
                break;
            }
        }
    });
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    let reading = async {
        while !String::from_utf8_lossy(&answer).contains("}}") {
            let n = read.read(&mut buffer).await?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buffer[..n]);
        }
        anyhow::Ok(())
    };
    let finished = tokio::time::timeout(Duration::from_secs(5), reading).await;
    let took = started.elapsed();
    trickle.abort();
    anyhow::ensure!(finished.is_ok(), "no answer in 5 s to a body trickled in");
    let answer = String::from_utf8_lossy(&answer);
    anyhow::ensure!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    anyhow::ensure!(answer.contains("\"body_read_timeout\""), "{answer}");
    anyhow::ensure!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(2500),
        "answered after {took:?}"
    );
    Ok(())
}
