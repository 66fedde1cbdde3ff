//! Two gateway replicas on one real `nats-server`: both index the same workers' events and
//! converge to the same index, and each sees the other's active sequences.

use std::time::Duration;

use switchyard_harness::{Admin, Client, Gateway, Mockers, NatsServer, eventually};

const TOKEN: &str = "nats-replicas-admin-token";

fn replica(nats: &NatsServer) -> anyhow::Result<(Gateway, Admin)> {
    let config = format!(
        "[server]\nplaintext = true\n[kv]\nnats_url = \"{}\"\nreplica_sync = true\n",
        nats.url
    );
    Gateway::start_with_admin(&config, TOKEN)
}

async fn summary(admin: &Admin) -> serde_json::Value {
    match admin.call("GET", "/admin/kv", Vec::new()).await {
        Ok((200, body)) => body,
        _ => serde_json::Value::Null,
    }
}

/// Per worker name: (cached blocks, active requests).
fn per_worker(summary: &serde_json::Value) -> Vec<(String, u64, u64)> {
    let mut rows: Vec<(String, u64, u64)> = summary["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            (
                w["name"].as_str().unwrap_or_default().to_string(),
                w["cached_blocks"].as_u64().unwrap_or(0),
                w["load"]["requests"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    rows.sort();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_converge_to_the_same_index_and_share_active_sequences() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let (first, first_admin) = replica(&nats)?;
    let (_second, second_admin) = replica(&nats)?;
    let _workers = Mockers::start(&[
        "--nats",
        &nats.url,
        "--name",
        "shared",
        "--num-workers",
        "3",
        "--speedup",
        "2",
        "--heartbeat-ms",
        "200",
    ])?;
    for admin in [&first_admin, &second_admin] {
        assert!(
            eventually(Duration::from_secs(15), || async {
                per_worker(&summary(admin).await).len() == 3
            })
            .await,
            "both replicas learn the three workers from their heartbeats"
        );
    }
    // Traffic through the first replica only.
    let client = Client::plain(first.addr);
    for i in 0..9 {
        let body = serde_json::json!({
            "model": "mock",
            "messages": [{"role": "user", "content": format!("conversation {i}: ").repeat(40)}],
            "max_tokens": 2,
        });
        assert_eq!(client.post_json("/v1/chat/completions", &body).await?.status, 200);
    }
    let converged = eventually(Duration::from_secs(10), || async {
        let a = summary(&first_admin).await;
        let b = summary(&second_admin).await;
        a["index"]["nodes"].as_u64().unwrap_or(0) > 0 && a["index"] == b["index"] && per_worker(&a) == per_worker(&b)
    })
    .await;
    assert!(
        converged,
        "indexes differ:\n{}\n{}",
        summary(&first_admin).await,
        summary(&second_admin).await
    );

    // A long stream through the first replica shows up as load on the second.
    let streaming = {
        let client = client.clone();
        tokio::spawn(async move {
            let body = serde_json::json!({
                "model": "mock",
                "messages": [{"role": "user", "content": "a long story please"}],
                "max_tokens": 400,
                "stream": true,
            });
            client.post_json("/v1/chat/completions", &body).await
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            summary(&second_admin).await["active_requests"].as_u64() == Some(1)
        })
        .await,
        "the second replica sees the first's active request: {}",
        summary(&second_admin).await
    );
    let reply = streaming.await??;
    assert_eq!(reply.status, 200);
    assert!(
        eventually(Duration::from_secs(5), || async {
            summary(&second_admin).await["active_requests"].as_u64() == Some(0)
        })
        .await,
        "the request's end reaches the second replica"
    );
    Ok(())
}
