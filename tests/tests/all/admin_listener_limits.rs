//! The admin listener's own limits: connections that never send a request head are closed
//! after `admin.header_read_timeout_ms`, and past `admin.max_connections` a new one is closed
//! at once, so silent peers on the admin port hold neither tasks nor file descriptors the
//! client listener needs.

use std::time::Duration;

use anyhow::Context;

use switchyard_harness::{Client, Gateway, chat_body};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const TOKEN: &str = "admin-limits-token-0123456789";

/// Whether the gateway closes `stream` within `within` (a read sees the end, or an error).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buffer = [0u8; 64];
    matches!(
        tokio::time::timeout(within, stream.read(&mut buffer)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_admin_connections_are_capped_and_timed_out() -> anyhow::Result<()> {
    let (gateway, admin) = Gateway::start_with_admin_keys(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\nspeedup = 50.0\n",
        TOKEN,
        "max_connections = 8\nheader_read_timeout_ms = 2000",
    )?;
    let admin_addr = gateway.admin.context("the gateway printed no admin API line")?;
    let started = std::time::Instant::now();
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(TcpStream::connect(admin_addr).await?);
    }
    // Past the cap, more silent peers are turned away at once (well before the timeout).
    for extra in 0..32 {
        let mut stream = TcpStream::connect(admin_addr).await?;
        assert!(
            closed_within(&mut stream, Duration::from_millis(1500)).await,
            "connection {} past the cap was kept open",
            extra + 1
        );
    }
    // The client listener serves all along.
    let reply = Client::plain(gateway.addr)
        .post_json("/v1/chat/completions", &chat_body("mock", "still here?", 2, false))
        .await?;
    assert_eq!(reply.status, 200);
    // The silent ones are closed by the header read timeout, and the admin listener serves again.
    for stream in &mut silent {
        assert!(
            closed_within(stream, Duration::from_secs(10)).await,
            "a silent admin connection is still open after {:?}",
            started.elapsed()
        );
    }
    let (status, body) = admin.call("GET", "/admin/kv", Vec::new()).await?;
    assert_eq!(status, 200, "{body}");
    Ok(())
}
