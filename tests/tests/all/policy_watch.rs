//! A policy written into the watched directory is published; a bad one is refused (the
//! watcher counts it) and the active policy stays; two files dropped together are both loaded.

use std::time::Duration;

use switchyard_harness::{Client, Gateway, chat_body, eventually, metric_sum};

/// `switchyard_policy_watch_total` for `outcome`.
async fn watch_outcomes(client: &Client, outcome: &str) -> f64 {
    let Ok(reply) = client.send("GET", "/metrics", "").await else {
        return -1.0;
    };
    let text = String::from_utf8_lossy(&reply.body()).to_string();
    metric_sum(
        &text,
        "switchyard_policy_watch_total",
        &[&format!("outcome=\"{outcome}\"")],
    )
}

async fn deciding_policy(client: &Client) -> String {
    match client
        .post_json("/v1/chat/completions", &chat_body("mock", "watch", 1, false))
        .await
    {
        Ok(reply) if reply.status == 200 => reply
            .headers
            .get("x-switchyard-policy")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_wasm_file_publishes_it() -> anyhow::Result<()> {
    let watched = tempfile::tempdir()?;
    let staging = tempfile::tempdir()?;
    let config = format!(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nspeedup = 50.0\n\
         [policy]\nrouter = \"least-load\"\ndeadline_ms = 100\nwatch_dir = {:?}\n",
        watched.path().display().to_string()
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    assert!(deciding_policy(&client).await.starts_with("least-load@"));

    // A broken file is refused (the watcher saw it and says so): the active policy stays.
    std::fs::write(staging.path().join("broken.wasm"), b"\0asm\x01\0\0\0 truncated")?;
    std::fs::rename(staging.path().join("broken.wasm"), watched.path().join("broken.wasm"))?;
    let refused = eventually(Duration::from_secs(10), || async {
        watch_outcomes(&client, "refused").await == 1.0
    })
    .await;
    assert!(refused, "the broken file was seen and refused");
    assert!(deciding_policy(&client).await.starts_with("least-load@"));

    // A good one is published, named after the file.
    let wasm = std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/round_robin.wasm"))?;
    std::fs::write(staging.path().join("rotation.wasm"), wasm)?;
    std::fs::rename(
        staging.path().join("rotation.wasm"),
        watched.path().join("rotation.wasm"),
    )?;
    let published = eventually(Duration::from_secs(10), || async {
        deciding_policy(&client).await.starts_with("rotation@")
    })
    .await;
    assert!(published, "the dropped policy decides requests");
    assert_eq!(watch_outcomes(&client, "published").await, 1.0);

    // Two files renamed in together: both are loaded, the later one ends up active.
    let least_load = std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/least_load.wasm"))?;
    let round_robin = std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/round_robin.wasm"))?;
    std::fs::write(staging.path().join("first.wasm"), least_load)?;
    std::fs::write(staging.path().join("second.wasm"), round_robin)?;
    std::fs::rename(staging.path().join("first.wasm"), watched.path().join("first.wasm"))?;
    std::fs::rename(staging.path().join("second.wasm"), watched.path().join("second.wasm"))?;
    let both = eventually(Duration::from_secs(10), || async {
        watch_outcomes(&client, "published").await == 3.0
    })
    .await;
    assert!(both, "both files were published");
    assert!(deciding_policy(&client).await.starts_with("second@"));
    Ok(())
}
