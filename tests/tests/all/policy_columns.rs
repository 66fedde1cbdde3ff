//! A policy that declares only the roles and cost columns, pushed into a live gateway: the
//! gateway sends it those columns (the f32 cost column in its own list) and it routes every
//! request to the cheapest worker of the three.

use std::path::PathBuf;

use switchyard_harness::{Client, Gateway, Mockers, chat_body};

const TOKEN: &str = "columns-test-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_reading_the_cost_column_routes_to_the_cheapest_worker() -> anyhow::Result<()> {
    let mockers = Mockers::start(&["--num-workers", "3", "--speedup", "50"])?;
    let mut config = String::from("[server]\nplaintext = true\n[policy]\nrouter = \"least-load\"\n");
    for (name, cost, addr) in [
        ("dear", 2.5, mockers.addrs[0]),
        ("cheap", 0.5, mockers.addrs[1]),
        ("middling", 1.0, mockers.addrs[2]),
    ] {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\ncost = {cost}\n"
        ));
    }
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    let path = PathBuf::from(env!("SWITCHYARD_GUESTS_DIR")).join("cheapest.wasm");
    let wasm = std::fs::read(&path).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))?;
    let (status, answer) = admin
        .call("PUT", "/admin/policies/cheapest?activate=true", wasm)
        .await?;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(admin.active().await?, "cheapest");
    for round in 0..6 {
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat_body("mock", "who is cheapest", 2, round % 2 == 0),
            )
            .await?;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), "cheap", "round {round}");
        let policy = reply
            .headers
            .get("x-switchyard-policy")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert!(
            policy.starts_with("cheapest@"),
            "decided by the policy, not the fallback: {policy}"
        );
    }
    Ok(())
}
