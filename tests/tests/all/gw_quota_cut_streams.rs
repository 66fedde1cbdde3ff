//! A tenant's tokens when its clients cut their streams: a client that reads part of a
//! streamed answer and closes the connection before the usage chunk is charged its prompt and
//! every chunk the gateway relayed, so its monthly quota trips on the same schedule as if it
//! had read every answer to the end; and each cut stream is judged (its tokens served counted)
//! as one read to its end is.

use std::time::Duration;

use hyper::body::Body as _;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use switchyard_harness::{Admin, Client, Gateway, chat_body, eventually, metric_sum};

const TOKEN: &str = "quota-cut-streams-token-0123456789";
const KEY: &str = "sk-cutter-0123456789abcdef";
const PROBE_KEY: &str = "sk-probe-0123456789abcdef";
/// The cutting tenant's monthly tokens.
const MONTHLY: u64 = 1000;
/// Tokens each streamed answer asks for.
const MAX_TOKENS: u32 = 500;
/// Content chunks the client reads before it leaves.
const READ: u64 = 250;

fn entry(key: &str, tenant: &str, extra: &str) -> String {
    let sha: String = Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("[[api_keys]]\nkey_sha256 = \"{sha}\"\ntenant = \"{tenant}\"\n{extra}\n")
}

async fn month_tokens(admin: &Admin, tenant: &str) -> anyhow::Result<f64> {
    let (status, text) = admin.get_text("/metrics").await?;
    anyhow::ensure!(status == 200, "{status}: {text}");
    let label = format!("tenant=\"{tenant}\"");
    Ok(metric_sum(&text, "switchyard_tenant_month_tokens", &[&label]))
}

/// Streams `body` as `key`'s client, reads the answer until it has seen `read` content chunks,
/// then closes the connection. Answers the status and the content chunks seen.
async fn read_then_leave(
    gateway: &Gateway,
    key: &str,
    body: &serde_json::Value,
    read: u64,
) -> anyhow::Result<(u16, u64)> {
    let tcp = tokio::net::TcpStream::connect(gateway.addr).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    let connection = tokio::spawn(connection);
    let request = http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .header("host", "localhost")
        .body(serde_json::to_string(body)?)?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut seen = Vec::new();
    let mut chunks = 0;
    while chunks < read {
        let next = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx));
        let Some(frame) = tokio::time::timeout(Duration::from_secs(30), next).await? else {
            break;
        };
        if let Ok(data) = frame?.into_data() {
            seen.extend_from_slice(&data);
        }
        chunks = String::from_utf8_lossy(&seen).matches("\"content\":").count() as u64;
    }
    // Leaves: the connection closes with the answer unread.
    drop(body);
    drop(sender);
    connection.abort();
    Ok((status, chunks))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_cut_before_their_usage_are_charged_what_was_relayed() -> anyhow::Result<()> {
    let keys = [
        entry(KEY, "cutter", &format!("monthly_tokens = {MONTHLY}")),
        entry(PROBE_KEY, "probe", ""),
    ]
    .concat();
    // A token every ~1 ms: the client leaves long before the answer's end.
    let (gateway, admin) = Gateway::start_with_admin(
        &format!("[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\nspeedup = 5.0\n{keys}"),
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    let prompt = "tell me a long story";
    // The prompt's tokens, as the worker counts them (the gateway's count is the same).
    let probe = client
        .chat(Some(PROBE_KEY), &chat_body("mock", prompt, 1, false))
        .await?;
    anyhow::ensure!(probe.status == 200, "probe: {}", probe.status);
    let prompt_tokens = probe.json()?["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    anyhow::ensure!(prompt_tokens > 0);

    let body = chat_body("mock", prompt, MAX_TOKENS, true);
    let mut charged = 0.0;
    let mut cut = 0;
    loop {
        let (status, chunks) = read_then_leave(&gateway, KEY, &body, READ).await?;
        if status == 429 {
            break;
        }
        anyhow::ensure!(status == 200, "status {status}");
        anyhow::ensure!(chunks >= READ, "read {chunks} chunks");
        cut += 1;
        // Settled once the gateway notices the client left.
        let before = charged;
        anyhow::ensure!(
            eventually(Duration::from_secs(5), || async {
                month_tokens(&admin, "cutter").await.is_ok_and(|now| now > before)
            })
            .await,
            "stream {cut} was never charged"
        );
        charged = month_tokens(&admin, "cutter").await?;
        let this_one = charged - before;
        let least = (prompt_tokens + chunks) as f64;
        // Chunks relayed but still in the sockets when the client left count too: a few.
        anyhow::ensure!(
            this_one >= least && this_one <= least + 8.0,
            "stream {cut}: charged {this_one} tokens; the client read {chunks} chunks after a {prompt_tokens}-token prompt"
        );
        eprintln!("stream {cut}: charged {this_one}, read {chunks} after a {prompt_tokens}-token prompt");
        anyhow::ensure!(cut <= 10, "the monthly quota never tripped ({charged} tokens charged)");
    }
    // Refused once the month's tokens were used, as if every answer had been read.
    let expected = MONTHLY.div_ceil(prompt_tokens + READ);
    anyhow::ensure!(
        cut == expected,
        "the quota tripped after {cut} cut streams; {expected} spend {MONTHLY} tokens"
    );
    anyhow::ensure!(charged >= MONTHLY as f64, "{charged} tokens charged");
    // Served: the probe's answer, and each cut stream's prompt and chunks, as charged.
    let (_, text) = admin.get_text("/metrics").await?;
    let served = metric_sum(&text, "switchyard_tokens_served_total", &["model=\"mock\""]);
    let probed = (prompt_tokens + 1) as f64;
    anyhow::ensure!(
        served == probed + charged,
        "tokens served {served}: the probe's {probed} and the cut streams' {charged}"
    );
    Ok(())
}
