//! Cost-aware routing on a mixed fleet: a reserved worker (cost 1, fast) and a spot worker
//! (cost 0.4, ten times slower), each its own mocker process. The gateway measures each
//! worker's speed from its streams; `cost-aware` sends requests whose TTFT target the spot
//! worker is predicted to meet to it, and the rest to the reserved one.

use std::collections::HashMap;
use std::time::Duration;

use switchyard_e2e::{Client, Gateway, Mockers, chat_body, eventually};

const TOKEN: &str = "cost-routing-token-0123456789abcd";

async fn stream(client: &Client, ttft_ms: Option<&str>) -> anyhow::Result<String> {
    let mut connection = client.connect().await?;
    let body = serde_json::to_vec(&chat_body("mock", "a question of cost", 16, true))?;
    let headers: Vec<(&str, &str)> = ttft_ms.map(|t| ("x-switchyard-ttft-ms", t)).into_iter().collect();
    let reply = connection
        .send_with_headers("POST", "/v1/chat/completions", body, &headers)
        .await?;
    anyhow::ensure!(reply.status == 200, "{}", String::from_utf8_lossy(&reply.body()));
    Ok(reply.worker())
}

async fn placements(client: &Client, ttft_ms: Option<&str>, count: usize) -> anyhow::Result<HashMap<String, usize>> {
    let mut placed = HashMap::new();
    for _ in 0..count {
        *placed.entry(stream(client, ttft_ms).await?).or_insert(0) += 1;
    }
    Ok(placed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheap_workers_take_what_they_can_meet_and_fast_ones_the_rest() -> anyhow::Result<()> {
    let reserved = Mockers::start(&["--num-workers", "1", "--speedup", "20"])?;
    let spot = Mockers::start(&["--num-workers", "1", "--speedup", "2"])?;
    let workers = format!(
        "[[workers]]\nname = \"reserved\"\nurl = \"http://{}\"\nmodel = \"mock\"\ncost = 1.0\n\
         [[workers]]\nname = \"spot\"\nurl = \"http://{}\"\nmodel = \"mock\"\ncost = 0.4\n",
        reserved.addrs[0], spot.addrs[0]
    );
    let (gateway, admin) = Gateway::start_with_admin(
        &format!("[server]\nplaintext = true\n[policy]\nrouter = \"round-robin\"\n{workers}"),
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    // Round-robin streams measure both workers' speed.
    let warm = placements(&client, None, 6).await?;
    assert_eq!(warm.len(), 2, "both workers streamed: {warm:?}");
    let measured = || async {
        let (_, stats) = admin.call("GET", "/admin/stats", Vec::new()).await.unwrap_or_default();
        stats["workers"].as_array().is_some_and(|workers| {
            workers
                .iter()
                .all(|w| w["measured_itl_ms"].as_f64().is_some_and(|ms| ms > 0.0))
        })
    };
    assert!(
        eventually(Duration::from_secs(2), measured).await,
        "both workers' speed measured"
    );

    let component = std::fs::read(format!("{}/cost_aware.wasm", env!("SWITCHYARD_PLUGINS_DIR")))?;
    let (status, body) = admin
        .call("PUT", "/admin/policies/cost-aware?activate=true", component)
        .await?;
    assert_eq!(status, 200, "{body}");

    // A loose target (and none at all): both are predicted to meet it, so the cheap one.
    let loose = placements(&client, Some("5000"), 8).await?;
    assert_eq!(loose.get("spot"), Some(&8), "loose targets: {loose:?}");
    let untargeted = placements(&client, None, 4).await?;
    assert_eq!(untargeted.get("spot"), Some(&4), "no target: {untargeted:?}");
    // A tight one: only the reserved worker (measured ten times faster) is predicted to meet it.
    let tight = placements(&client, Some("3"), 8).await?;
    assert_eq!(tight.get("reserved"), Some(&8), "tight targets: {tight:?}");
    Ok(())
}
