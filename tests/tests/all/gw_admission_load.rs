//! A load figure for the admission queue, run by hand (`#[ignore]`): 10,000 clients connect,
//! send a chat request to a gateway whose one worker takes two at a time, and leave at a random
//! moment (many while queued, some just as they are admitted, some mid-answer). Once they are
//! gone, the queue must hold no reservation and the model's room must be whole, as before;
//! the gateway's `/admin/stats` and resident memory are printed before and after.
//!
//! `cargo test -p switchyard-e2e --test all -- gw_admission_load --ignored --nocapture`

use std::time::{Duration, Instant};

use switchyard_harness::{Admin, Gateway, chat_body, eventually};
use tokio::io::AsyncWriteExt;

const CLIENTS: usize = 10_000;
/// Clients connected at once.
const AT_ONCE: usize = 400;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

async fn admission(admin: &Admin) -> anyhow::Result<serde_json::Value> {
    let (status, body) = admin.call("GET", "/admin/stats", Vec::new()).await?;
    anyhow::ensure!(status == 200, "{status}: {body}");
    Ok(body["admission"].clone())
}

/// One client: connects, sends its request, and leaves after `leave_after`.
async fn connect_and_leave(addr: std::net::SocketAddr, body: &[u8], leave_after: Duration) -> anyhow::Result<()> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await?;
    tcp.write_all(body).await?;
    tokio::time::sleep(leave_after).await;
    // Closed with the answer unread (a reset when the answer has started).
    drop(tcp);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a load figure: 10,000 clients, about a minute"]
async fn ten_thousand_clients_leaving_leave_the_admission_room_whole() -> anyhow::Result<()> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\nmax_connections = 20000\n[embedded_mockers]\ncount = 1\nspeedup = 1.0\n\
         [admission]\nmax_requests = 2\nmax_queue = 20000\nmax_queue_per_tenant = 20000\nmax_wait_ms = 60000\n",
        "admission-load-token-0123456789",
    )?;
    let pid = gateway.process.id();
    // One request through, so the model has its queue and the figures their baseline.
    let warm = switchyard_harness::Client::plain(gateway.addr)
        .post_json("/v1/chat/completions", &chat_body("mock", "warm up", 2, false))
        .await?;
    anyhow::ensure!(warm.status == 200);
    let before = admission(&admin).await?;
    let rss_before = rss_kib(pid);
    println!("before: admission {before}, gateway RSS {rss_before} KiB");

    let body = serde_json::to_vec(&chat_body("mock", "a short answer", 4, false))?;
    let addr = gateway.addr;
    let started = Instant::now();
    let semaphore = std::sync::Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let mut clients = Vec::with_capacity(CLIENTS);
    let mut failed = 0usize;
    for i in 0..CLIENTS {
        let permit = semaphore.clone().acquire_owned().await?;
        let body = body.clone();
        // 0 to 60 ms: the worker answers one request in about 30 ms, two at a time.
        let leave_after = Duration::from_micros((i as u64 * 7919) % 60_000);
        clients.push(tokio::spawn(async move {
            let failed = connect_and_leave(addr, &body, leave_after).await.is_err();
            // The client's place among those connected at once.
            drop(permit);
            failed
        }));
        if clients.len() >= 2 * AT_ONCE {
            for client in clients.drain(..AT_ONCE) {
                failed += usize::from(client.await.unwrap_or(true));
            }
        }
    }
    for client in clients {
        failed += usize::from(client.await.unwrap_or(true));
    }
    let took = started.elapsed();

    // Once every client is gone and the worker idle, the room is what it was.
    let settled = eventually(Duration::from_secs(30), || async {
        admission(&admin).await.is_ok_and(|now| now == before)
    })
    .await;
    let after = admission(&admin).await?;
    let rss_after = rss_kib(pid);
    println!(
        "{CLIENTS} clients ({AT_ONCE} at once) in {:.1} s, {failed} could not connect; after: admission {after}, gateway RSS {rss_after} KiB",
        took.as_secs_f64()
    );
    let (status, metrics) = admin.get_text("/metrics").await?;
    anyhow::ensure!(status == 200);
    for outcome in ["direct", "queued", "abandoned", "timed_out", "full"] {
        let label = format!("outcome=\"{outcome}\"");
        let count = switchyard_harness::metric_sum(&metrics, "switchyard_admission_requests_total", &[&label]);
        println!("admission outcome {outcome}: {count}");
    }
    anyhow::ensure!(
        settled,
        "the room before was {before}; after the clients left it is {after}"
    );
    anyhow::ensure!(failed < CLIENTS / 100, "{failed} clients could not connect");
    Ok(())
}
