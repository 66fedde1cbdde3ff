//! The last good router survives a bad streak: after a version has served without a failure,
//! more hostile versions than the gateway keeps for rollback are pushed one after another, and
//! the gateway still rolls back to the good one (kept pinned however many versions follow),
//! with no client request failing on the way.

use std::path::PathBuf;
use std::time::Duration;

use switchyard_harness::{Client, Gateway, chat_body, eventually};

const TOKEN: &str = "last-good-test-token-0123456789";

/// More than the four versions kept for rollback.
const HOSTILE_VERSIONS: usize = 5;

fn component(path: PathBuf) -> anyhow::Result<Vec<u8>> {
    std::fs::read(&path).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))
}

/// The policy that routed one request (`x-switchyard-policy`), after checking it was served.
async fn routed_by(client: &Client, stream: bool) -> anyhow::Result<String> {
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_body("mock", "who routes this?", 2, stream),
        )
        .await?;
    anyhow::ensure!(
        reply.status == 200,
        "a request failed: {}",
        String::from_utf8_lossy(&reply.body())
    );
    Ok(reply
        .headers
        .get("x-switchyard-policy")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_good_router_outlives_more_hostile_versions_than_are_kept() -> anyhow::Result<()> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n\
         [embedded_mockers]\ncount = 2\nspeedup = 50.0\n\
         [policy]\nrouter = \"least-load\"\ndeadline_ms = 5\nmax_failures = 2\n",
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    let good = component(PathBuf::from(env!("SWITCHYARD_PLUGINS_DIR")).join("round_robin.wasm"))?;
    let (status, body) = admin.call("PUT", "/admin/policies/good?activate=true", good).await?;
    assert_eq!(status, 200, "{body}");
    for _ in 0..4 {
        let by = routed_by(&client, false).await?;
        assert!(by.starts_with("good@"), "routed by {by}");
    }

    let hostile = component(PathBuf::from(env!("SWITCHYARD_GUESTS_DIR")).join("hostile_trap.wasm"))?;
    for index in 1..=HOSTILE_VERSIONS {
        let (status, body) = admin
            .call(
                "PUT",
                &format!("/admin/policies/bad{index}?activate=true"),
                hostile.clone(),
            )
            .await?;
        assert_eq!(status, 200, "bad{index} passes validation: {body}");
    }
    assert_eq!(admin.active().await?, format!("bad{HOSTILE_VERSIONS}"));

    // Each hostile version fails, is rolled back, and the next older one fails in turn, until
    // the good one routes again; every request is served meanwhile.
    let mut sent = 0;
    let last = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let restored = eventually(Duration::from_secs(30), || {
        sent += 1;
        let (client, last) = (client.clone(), last.clone());
        let stream = sent % 2 == 0;
        async move {
            let by = routed_by(&client, stream).await.unwrap_or_else(|err| panic!("{err}"));
            let good = by.starts_with("good@");
            if let Ok(mut last) = last.lock() {
                *last = by;
            }
            good
        }
    })
    .await;
    let last = last.lock().map(|last| last.clone()).unwrap_or_default();
    assert!(restored, "still routed by `{last}` after {sent} requests");
    assert_eq!(admin.active().await?, "good");
    Ok(())
}
