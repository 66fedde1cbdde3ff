//! Stopping the gateway gracefully: on SIGTERM it refuses new requests (503 `shutting_down`,
//! `/readyz` 503), lets a stream in flight run to its last token, and exits 0; and a
//! connection past `server.max_connections` is answered 503 and closed.

use std::time::Duration;

use switchyard_harness::{Client, Gateway, chat_body, eventually, metric_sum};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_stream_in_flight_and_exits_cleanly() -> anyhow::Result<()> {
    // Real-time mockers: 200 tokens take a couple of seconds.
    let config = "[server]\nplaintext = true\ndrain_timeout_ms = 20000\n\
                  [embedded_mockers]\ncount = 1\nspeedup = 1.0\n";
    let mut gateway = Gateway::start(config)?;
    let addr = gateway.addr;
    let stream = tokio::spawn(async move {
        Client::plain(addr)
            .post_json("/v1/chat/completions", &chat_body("mock", "a long answer", 200, true))
            .await
    });
    let observer = Client::plain(addr);
    let running = eventually(Duration::from_secs(10), || async {
        match observer.send("GET", "/metrics", "").await {
            Ok(reply) => {
                metric_sum(
                    &String::from_utf8_lossy(&reply.body()),
                    "switchyard_worker_in_flight",
                    &[],
                ) >= 1.0
            }
            Err(_) => false,
        }
    })
    .await;
    anyhow::ensure!(running, "the stream started");
    gateway.process.terminate()?;

    // New requests are refused while the stream drains (each on a fresh connection).
    let refused = eventually(Duration::from_secs(5), || async {
        matches!(Client::plain(addr).send("GET", "/readyz", "").await, Ok(reply) if reply.status == 503)
    })
    .await;
    anyhow::ensure!(refused, "/readyz answers 503 while draining");
    let late = Client::plain(addr)
        .post_json("/v1/chat/completions", &chat_body("mock", "too late", 4, false))
        .await?;
    anyhow::ensure!(late.status == 503, "a new request is refused: {}", late.status);
    anyhow::ensure!(String::from_utf8_lossy(&late.body()).contains("shutting_down"));

    let reply = tokio::time::timeout(Duration::from_secs(30), stream).await???;
    anyhow::ensure!(reply.status == 200);
    let events = reply.events();
    let tokens = events.iter().filter(|(_, data)| data.contains("\"content\"")).count();
    anyhow::ensure!(tokens == 200, "all 200 tokens arrived, got {tokens}");
    anyhow::ensure!(
        events.iter().any(|(_, data)| data == "[DONE]"),
        "the stream ended properly"
    );

    let status = tokio::task::spawn_blocking(move || gateway.process.wait_exit(Duration::from_secs(20)))
        .await?
        .ok_or_else(|| anyhow::anyhow!("the gateway did not exit after draining"))?;
    anyhow::ensure!(status.success(), "exit status {status}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_cap_is_answered_503() -> anyhow::Result<()> {
    let config = "[server]\nplaintext = true\nmax_connections = 2\n[embedded_mockers]\ncount = 1\nspeedup = 50.0\n";
    let gateway = Gateway::start(config)?;
    // Two idle connections hold both permits.
    let _first = tokio::net::TcpStream::connect(gateway.addr).await?;
    let _second = tokio::net::TcpStream::connect(gateway.addr).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = tokio::net::TcpStream::connect(gateway.addr).await?;
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await?;
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), third.read_to_string(&mut answer)).await??;
    anyhow::ensure!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    anyhow::ensure!(answer.contains("too_many_connections"), "{answer}");
    drop((_first, _second));
    // With the permits back, connections are served again.
    let served = eventually(Duration::from_secs(5), || async {
        matches!(Client::plain(gateway.addr).send("GET", "/healthz", "").await, Ok(reply) if reply.status == 200)
    })
    .await;
    anyhow::ensure!(served, "served once connections closed");
    Ok(())
}
