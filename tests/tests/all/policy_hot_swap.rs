//! Swapping the router policy under live streaming traffic: no request fails, each is routed
//! by exactly one version, and a published version decides the very next request.

use std::time::Duration;

use switchyard_harness::{Client, Gateway, Reply, chat_body};

const TOKEN: &str = "hot-swap-test-token-0123456789";

fn policy_of(reply: &Reply) -> Vec<String> {
    reply
        .headers
        .get_all("x-switchyard-policy")
        .iter()
        .map(|value| value.to_str().unwrap_or_default().to_string())
        .collect()
}

fn generation(label: &str) -> u64 {
    label.rsplit('#').next().and_then(|g| g.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapping_twenty_times_under_two_hundred_streams_loses_nothing() -> anyhow::Result<()> {
    // A generous deadline: this test is about swaps, and the deadline is wall-clock time on
    // two cores shared with the load.
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 4\nspeedup = 4.0\n\
         [policy]\nrouter = \"least-load\"\ndeadline_ms = 100\n",
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    let guests = [
        (
            "least-load",
            std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/least_load.wasm"))?,
        ),
        (
            "round-robin",
            std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/round_robin.wasm"))?,
        ),
    ];

    let mut streams = tokio::task::JoinSet::new();
    for i in 0..240u64 {
        let client = client.clone();
        streams.spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 8)).await;
            client
                .post_json(
                    "/v1/chat/completions",
                    &chat_body("mock", &format!("stream {i}"), 40, true),
                )
                .await
        });
    }

    let mut published = Vec::new();
    for swap in 0..20 {
        let (name, wasm) = &guests[(swap + 1) % 2];
        let (status, answer) = admin
            .call("PUT", &format!("/admin/policies/{name}?activate=true"), wasm.clone())
            .await?;
        assert_eq!(status, 200, "swap {swap}: {answer}");
        let generation_published = answer["generation"].as_u64().unwrap_or(0);
        published.push(generation_published);
        // The very next request is decided by the new version.
        let probe = client
            .post_json("/v1/chat/completions", &chat_body("mock", "probe", 1, false))
            .await?;
        assert_eq!(probe.status, 200);
        let labels = policy_of(&probe);
        assert_eq!(labels.len(), 1);
        assert_eq!(generation(&labels[0]), generation_published, "swap {swap}: {labels:?}");
        assert!(labels[0].starts_with(name), "{labels:?}");
        tokio::time::sleep(Duration::from_millis(90)).await;
    }

    let mut generations_seen = std::collections::HashSet::new();
    let mut count = 0;
    while let Some(result) = streams.join_next().await {
        let reply = result??;
        count += 1;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        let events = reply.events();
        assert_eq!(
            events.last().map(|(_, d)| d.as_str()),
            Some("[DONE]"),
            "every stream completes"
        );
        assert_eq!(events.len(), 42, "40 tokens, the finish chunk, [DONE]");
        let labels = policy_of(&reply);
        assert_eq!(labels.len(), 1, "routed by exactly one version: {labels:?}");
        assert!(!labels[0].starts_with("fallback"), "{labels:?}");
        generations_seen.insert(generation(&labels[0]));
    }
    assert_eq!(count, 240);
    assert!(
        generations_seen.len() >= 5,
        "streams spread over many versions: {generations_seen:?}"
    );
    Ok(())
}
