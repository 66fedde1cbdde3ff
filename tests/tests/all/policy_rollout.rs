//! Shadow and split rollouts of a candidate router policy, checked by their metrics and by the
//! versions that actually decided each request.

use std::collections::HashMap;

use switchyard_harness::{Admin, Client, Gateway, chat_body};

const TOKEN: &str = "rollout-test-token-0123456789";

/// A gateway with 4 fast mockers, least-load, and the admin API.
fn start() -> anyhow::Result<(Gateway, Client, Admin)> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 4\nspeedup = 50.0\n\
         [policy]\nrouter = \"least-load\"\ndeadline_ms = 100\n",
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    Ok((gateway, client, admin))
}

fn counter(metrics: &str, prefix: &str, needles: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|line| line.starts_with(prefix) && needles.iter().all(|n| line.contains(n)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_compares_and_split_is_sticky_by_key() -> anyhow::Result<()> {
    let (_gateway, client, admin) = start()?;
    let round_robin = std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/round_robin.wasm"))?;
    let (status, _) = admin.call("PUT", "/admin/policies/rr", round_robin).await?;
    assert_eq!(status, 200);

    // Shadow: the candidate is asked on every request, its answers are only compared.
    let (status, answer) = admin.call("POST", "/admin/policies/rr/shadow", Vec::new()).await?;
    assert_eq!(status, 200, "{answer}");
    for _ in 0..30 {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "shadowed", 1, false))
            .await?;
        assert_eq!(reply.status, 200);
        let policy = reply.headers["x-switchyard-policy"].to_str()?;
        assert!(
            policy.starts_with("least-load@"),
            "the active version decides: {policy}"
        );
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    let compared = counter(
        &metrics,
        "switchyard_policy_shadow_comparisons_total",
        &["candidate=\"rr@"],
    );
    let disagreed = counter(
        &metrics,
        "switchyard_policy_shadow_comparisons_total",
        &["candidate=\"rr@", "result=\"disagree\""],
    );
    assert_eq!(compared, 30.0, "every request compared:\n{metrics}");
    assert!(
        disagreed > 0.0,
        "round-robin and least-load disagree on idle workers sometimes:\n{metrics}"
    );

    // Split 50 % sticky by a session header: each session always gets the same version.
    let (status, answer) = admin
        .call("POST", "/admin/policies/rr/split?percent=50&key=x-session", Vec::new())
        .await?;
    assert_eq!(status, 200, "{answer}");
    let (_, list) = admin.call("GET", "/admin/policies", Vec::new()).await?;
    assert_eq!(list["rollout"]["mode"], "split");
    let mut by_session: HashMap<u32, Vec<String>> = HashMap::new();
    for round in 0..3 {
        for session in 0..40u32 {
            let mut connection = client.connect().await?;
            let body = serde_json::to_vec(&chat_body("mock", &format!("round {round}"), 1, false))?;
            let reply = connection
                .send_with_headers(
                    "POST",
                    "/v1/chat/completions",
                    body,
                    &[("x-session", &format!("s-{session}"))],
                )
                .await?;
            assert_eq!(reply.status, 200);
            let name = reply.headers["x-switchyard-policy"]
                .to_str()?
                .split('@')
                .next()
                .unwrap_or_default()
                .to_string();
            by_session.entry(session).or_default().push(name);
        }
    }
    let mut candidate_sessions = 0;
    for (session, names) in &by_session {
        assert!(
            names.iter().all(|n| n == &names[0]),
            "session {session} is sticky: {names:?}"
        );
        if names[0] == "rr" {
            candidate_sessions += 1;
        }
    }
    assert!(
        (8..=32).contains(&candidate_sessions),
        "about half the sessions go to the candidate: {candidate_sessions}/40"
    );

    // Activating the candidate ends the rollout.
    let (status, _) = admin.call("POST", "/admin/policies/rr/activate", Vec::new()).await?;
    assert_eq!(status, 200);
    let (_, list) = admin.call("GET", "/admin/policies", Vec::new()).await?;
    assert!(list["rollout"].is_null(), "{list}");
    assert_eq!(list["active"]["name"], "rr");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_pushes_a_policy_with_its_config_in_one_command() -> anyhow::Result<()> {
    let (_gateway, client, admin) = start()?;
    let dir = tempfile::tempdir()?;
    let good = dir.path().join("good.toml");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&good, "active_request_weight = 2\n")?;
    std::fs::write(&bad, "active_request_weight = \n")?;
    // A built-in that reads its configuration; the template is built out of tree by CI instead.
    let wasm = concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/kv_aware.wasm");
    let cli = |args: &[&str]| -> anyhow::Result<std::process::Output> {
        Ok(std::process::Command::new(switchyard_harness::binary("switchyard")?)
            .arg("policy")
            .args(args)
            .env("SWITCHYARD_ADMIN", admin.url())
            .env("SWITCHYARD_ADMIN_TOKEN", admin.token())
            .output()?)
    };
    let refused = cli(&[
        "push",
        "affinity",
        wasm,
        "--activate",
        "--config",
        bad.to_str().unwrap_or_default(),
    ])?;
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not valid TOML"),
        "{refused:?}"
    );

    let pushed = cli(&[
        "push",
        "affinity",
        wasm,
        "--activate",
        "--config",
        good.to_str().unwrap_or_default(),
    ])?;
    assert!(pushed.status.success(), "{pushed:?}");
    let listed = cli(&["list"])?;
    let list: serde_json::Value = serde_json::from_slice(&listed.stdout)?;
    assert_eq!(list["active"]["name"], "affinity", "{list}");
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_body("mock", "via the pushed policy", 1, false),
        )
        .await?;
    assert_eq!(reply.status, 200);
    assert!(reply.headers["x-switchyard-policy"].to_str()?.starts_with("affinity@"));
    let rolled_back = cli(&["rollback"])?;
    assert!(rolled_back.status.success(), "{rolled_back:?}");
    let list: serde_json::Value = serde_json::from_slice(&cli(&["list"])?.stdout)?;
    assert_eq!(list["active"]["name"], "least-load");
    Ok(())
}
