//! Fleets of gateways on a real `nats-server` with JetStream: a policy pushed to one replica
//! runs on all of them, a replica that starts later converges, rollback and split rollouts are
//! fleet-wide, a replica that refuses the fleet's policy says so in the fleet's listing, and a
//! NATS outage leaves every replica serving the version it runs; new settings for the same
//! component reach every replica too.

use std::time::Duration;

use switchyard_harness::{Admin, Client, Gateway, NatsServer, binary, chat_body, eventually};

const TOKEN: &str = "fleet-token-0123456789abcdef";

fn replica(nats: &NatsServer, name: &str) -> anyhow::Result<(Gateway, Admin)> {
    Gateway::start_with_admin(
        &format!(
            "[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nspeedup = 50.0\n\
             [fleet]\nnats_url = \"{}\"\nreplica = \"{name}\"\n",
            nats.url
        ),
        TOKEN,
    )
}

fn component(file: &str) -> anyhow::Result<Vec<u8>> {
    Ok(std::fs::read(format!("{}/{file}", env!("SWITCHYARD_PLUGINS_DIR")))?)
}

/// The policy that routed a request on `gateway` (`x-switchyard-policy`).
async fn routed_by(gateway: &Gateway) -> String {
    let client = Client::plain(gateway.addr);
    match client
        .post_json("/v1/chat/completions", &chat_body("mock", "which policy?", 1, false))
        .await
    {
        Ok(reply) => reply
            .headers
            .get("x-switchyard-policy")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string(),
        Err(_) => String::new(),
    }
}

/// Waits until every gateway routes with a version of policy `name`.
async fn all_route_with(gateways: &[&Gateway], name: &str, within: Duration) -> anyhow::Result<()> {
    for (index, gateway) in gateways.iter().enumerate() {
        let prefix = format!("{name}@");
        anyhow::ensure!(
            eventually(within, || async { routed_by(gateway).await.starts_with(&prefix) }).await,
            "replica {index} routes with `{}`, not `{name}`",
            routed_by(gateway).await
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_pushed_to_one_replica_runs_on_all_and_rolls_back_everywhere() -> anyhow::Result<()> {
    let nats = NatsServer::start_jetstream()?;
    let (a, admin_a) = replica(&nats, "a")?;
    let (b, admin_b) = replica(&nats, "b")?;
    let (c, admin_c) = replica(&nats, "c")?;

    // Pushed to a through its admin API: all three route with it (within a second of the
    // answer on a quiet machine; the deadlines here are wide for busy ones, as elsewhere).
    let (status, body) = admin_a
        .call(
            "PUT",
            "/admin/policies/fleet-ll?activate=true",
            component("least_load.wasm")?,
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    assert!(body["fleet_revision"].as_u64().is_some_and(|r| r > 0), "{body}");
    all_route_with(&[&a, &b, &c], "fleet-ll", Duration::from_secs(10)).await?;

    // Pushed to b with the command line's --fleet.
    let rr = format!("{}/round_robin.wasm", env!("SWITCHYARD_PLUGINS_DIR"));
    let output = std::process::Command::new(binary("switchyard")?)
        .args([
            "policy",
            "push",
            "fleet-rr",
            &rr,
            "--fleet",
            "--admin",
            &admin_b.url(),
            "--token",
            TOKEN,
        ])
        .output()?;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    all_route_with(&[&a, &b, &c], "fleet-rr", Duration::from_secs(10)).await?;

    // A replica that starts later converges to the fleet's version.
    let (d, _admin_d) = replica(&nats, "d")?;
    all_route_with(&[&d], "fleet-rr", Duration::from_secs(10)).await?;

    // A split rollout started on c is tried on every replica.
    let (status, body) = admin_c
        .call("PUT", "/admin/policies/fleet-ll2", component("least_load.wasm")?)
        .await?;
    assert_eq!(status, 200, "{body}");
    let (status, body) = admin_c
        .call("POST", "/admin/policies/fleet-ll2/split?percent=100", Vec::new())
        .await?;
    assert_eq!(status, 200, "{body}");
    all_route_with(&[&a, &b, &c, &d], "fleet-ll2", Duration::from_secs(10)).await?;
    let (status, _) = admin_a.call("DELETE", "/admin/rollout", Vec::new()).await?;
    assert_eq!(status, 200);
    all_route_with(&[&a, &b, &c, &d], "fleet-rr", Duration::from_secs(10)).await?;

    // Rolled back on c: every replica goes back to the fleet's previous policy.
    let (status, body) = admin_c
        .call("POST", "/admin/policies/active/rollback", Vec::new())
        .await?;
    assert_eq!(status, 200, "{body}");
    all_route_with(&[&a, &b, &c, &d], "fleet-ll", Duration::from_secs(10)).await?;

    // The fleet's listing: every replica runs the latest revision.
    let output = std::process::Command::new(binary("switchyard")?)
        .args(["policy", "list", "--fleet", "--admin", &admin_a.url(), "--token", TOKEN])
        .output()?;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let listing: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let revision = listing["revision"].as_u64().unwrap_or(0);
    let replicas = listing["replicas"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = replicas.iter().filter_map(|r| r["replica"].as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"], "{listing}");
    for status in &replicas {
        assert_eq!(status["revision"].as_u64(), Some(revision), "{status}");
        assert_eq!(status["outcome"], "active", "{status}");
        assert!(
            status["running"].as_str().is_some_and(|r| r.starts_with("fleet-ll@")),
            "{status}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_visible_and_a_nats_outage_keeps_every_replica_serving() -> anyhow::Result<()> {
    let mut nats = NatsServer::start_jetstream()?;
    let (a, admin_a) = replica(&nats, "a")?;
    let (b, _admin_b) = replica(&nats, "b")?;
    let (status, body) = admin_a
        .call(
            "PUT",
            "/admin/policies/fleet-ll?activate=true",
            component("least_load.wasm")?,
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    all_route_with(&[&a, &b], "fleet-ll", Duration::from_secs(10)).await?;

    // The fleet's state names a component that is not in the store: each replica refuses it,
    // says why, and keeps its policy.
    let client = async_nats::connect(&nats.url).await?;
    let store = async_nats::jetstream::new(client)
        .get_key_value("switchyard-fleet")
        .await?;
    let missing = serde_json::json!({
        "active": {"name": "ghost", "sha256": "0".repeat(64), "config": ""},
    });
    store.put("router", serde_json::to_vec(&missing)?.into()).await?;
    let refused = || async {
        let (_, listing) = admin_a
            .call("GET", "/admin/fleet", Vec::new())
            .await
            .unwrap_or_default();
        listing["replicas"].as_array().is_some_and(|replicas| {
            replicas.len() == 2
                && replicas.iter().all(|r| {
                    r["outcome"] == "refused"
                        && r["error"].as_str().is_some_and(|e| e.contains("ghost"))
                        && r["running"].as_str().is_some_and(|run| run.starts_with("fleet-ll@"))
                })
        })
    };
    assert!(
        eventually(Duration::from_secs(5), refused).await,
        "both replicas report the refusal: {}",
        admin_a.call("GET", "/admin/fleet", Vec::new()).await?.1
    );
    all_route_with(&[&a, &b], "fleet-ll", Duration::from_secs(10)).await?;

    // NATS goes away: both replicas keep serving with the version they run.
    nats.kill();
    for _ in 0..3 {
        all_route_with(&[&a, &b], "fleet-ll", Duration::from_secs(10)).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Pushing needs the fleet: refused with a clear error while NATS is down.
    let (status, body) = admin_a
        .call(
            "PUT",
            "/admin/policies/fleet-rr?activate=true",
            component("round_robin.wasm")?,
        )
        .await?;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "fleet_unavailable", "{body}");
    Ok(())
}

/// The settings the active router of `admin`'s gateway runs with (`GET /admin/policies`).
async fn active_settings(admin: &Admin) -> serde_json::Value {
    match admin.call("GET", "/admin/policies", Vec::new()).await {
        Ok((200, list)) => list["active"]["config"].clone(),
        _ => serde_json::Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_settings_for_the_same_component_reach_every_replica() -> anyhow::Result<()> {
    let nats = NatsServer::start_jetstream()?;
    let (a, admin_a) = replica(&nats, "a")?;
    let (b, admin_b) = replica(&nats, "b")?;
    let wasm = component("least_load.wasm")?;
    for setting in [1, 2] {
        let (status, body) = admin_a
            .call(
                "PUT",
                "/admin/policies/tuned/config",
                format!("weight = {setting}\n").into_bytes(),
            )
            .await?;
        assert_eq!(status, 200, "{body}");
        let (status, body) = admin_a
            .call("PUT", "/admin/policies/tuned?activate=true", wasm.clone())
            .await?;
        assert_eq!(status, 200, "{body}");
        all_route_with(&[&a, &b], "tuned", Duration::from_secs(10)).await?;
        // Both replicas run the component with the settings pushed last, not only the same
        // component.
        for (replica, admin) in [("a", &admin_a), ("b", &admin_b)] {
            let expected = serde_json::json!({"weight": setting});
            assert!(
                eventually(Duration::from_secs(10), || async {
                    active_settings(admin).await == expected
                })
                .await,
                "replica {replica} runs `tuned` with {}, not {expected}",
                active_settings(admin).await
            );
        }
    }
    // A fleet rollback to the revision that differs only in its settings is no no-op either.
    let (status, body) = admin_b
        .call("POST", "/admin/policies/active/rollback", Vec::new())
        .await?;
    assert_eq!(status, 200, "{body}");
    for (replica, admin) in [("a", &admin_a), ("b", &admin_b)] {
        let expected = serde_json::json!({"weight": 1});
        assert!(
            eventually(Duration::from_secs(10), || async {
                active_settings(admin).await == expected
            })
            .await,
            "after the rollback replica {replica} runs `tuned` with {}",
            active_settings(admin).await
        );
    }
    Ok(())
}
