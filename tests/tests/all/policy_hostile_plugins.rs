//! Hostile router policies pushed into a live gateway through the admin API: each one that
//! misbehaves on live traffic costs no client request, is counted, and is rolled back
//! automatically; each one that misbehaves at load is refused with the reason while the active
//! policy stays.

use std::path::PathBuf;
use std::time::Duration;

use switchyard_harness::{Admin, Client, Gateway, chat_body, eventually};

const TOKEN: &str = "hostile-test-token-0123456789";

fn guest(name: &str) -> anyhow::Result<Vec<u8>> {
    let path = PathBuf::from(env!("SWITCHYARD_GUESTS_DIR")).join(format!("hostile_{name}.wasm"));
    std::fs::read(&path).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))
}

fn start() -> anyhow::Result<(Gateway, Client, Admin)> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n\
         [embedded_mockers]\ncount = 2\nspeedup = 50.0\n\
         [policy]\nrouter = \"least-load\"\ndeadline_ms = 5\nmax_failures = 3\n",
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    Ok((gateway, client, admin))
}

async fn metrics(client: &Client) -> anyhow::Result<String> {
    Ok(String::from_utf8(client.send("GET", "/metrics", "").await?.body())?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_policies_cost_no_request_and_are_rolled_back() -> anyhow::Result<()> {
    let (_gateway, client, admin) = start()?;
    assert_eq!(admin.active().await?, "least-load");
    let cases = [
        ("loop", "trap"),
        ("trap", "trap"),
        ("memory-bomb", "trap"),
        ("stack-overflow", "trap"),
        ("bad-answer", "invalid_answer"),
        ("huge-return", "invalid_answer"),
        ("refuse", "refused"),
    ];
    for (round, (name, kind)) in cases.iter().enumerate() {
        let (status, answer) = admin
            .call(
                "PUT",
                &format!("/admin/policies/{name}?activate=true"),
                guest(&name.replace('-', "_"))?,
            )
            .await?;
        assert_eq!(
            status, 200,
            "{name} passes validation (it only misbehaves on live traffic): {answer}"
        );
        assert_eq!(admin.active().await?, *name);
        // Traffic flows until the gateway has rolled the policy back; not one request fails.
        let mut sent = 0;
        let rolled_back = eventually(Duration::from_secs(20), || {
            sent += 1;
            let client = client.clone();
            let admin = &admin;
            async move {
                let reply = client
                    .post_json(
                        "/v1/chat/completions",
                        &chat_body("mock", "through a hostile policy", 2, sent % 2 == 0),
                    )
                    .await;
                let reply = reply.expect("transport");
                assert_eq!(
                    reply.status,
                    200,
                    "{name}: a request failed: {}",
                    String::from_utf8_lossy(&reply.body())
                );
                admin
                    .active()
                    .await
                    .map(|active| active == "least-load")
                    .unwrap_or(false)
            }
        })
        .await;
        assert!(rolled_back, "{name}: rolled back to least-load");
        let text = metrics(&client).await?;
        let failure = text.lines().find(|line| {
            line.starts_with("switchyard_policy_failures_total")
                && line.contains(&format!("version=\"{name}@"))
                && line.contains(&format!("kind=\"{kind}\""))
        });
        assert!(failure.is_some(), "{name}: failures of kind {kind} counted:\n{text}");
        assert!(
            text.lines()
                .any(|line| line.starts_with("switchyard_policy_decisions_total")
                    && line.contains(&format!("version=\"{name}@"))
                    && line.contains("outcome=\"fallback\"")),
            "{name}: fallback decisions counted"
        );
        assert!(
            text.contains(&format!("switchyard_policy_rollbacks_total {}", round + 1)),
            "{name}: rollback counted:\n{text}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_that_fail_validation_are_refused_and_the_active_one_stays() -> anyhow::Result<()> {
    let (_gateway, client, admin) = start()?;
    let (status, answer) = admin
        .call(
            "PUT",
            "/admin/policies/sneaky?activate=true",
            guest("forbidden_import")?,
        )
        .await?;
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("wasi:"), "names the forbidden imports: {message}");
    let (status, answer) = admin
        .call("PUT", "/admin/policies/slow?activate=true", guest("slow_init")?)
        .await?;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"].as_str().unwrap_or_default().contains("trap"),
        "{answer}"
    );
    let (status, _) = admin
        .call("PUT", "/admin/policies/junk", b"\0asm garbage".to_vec())
        .await?;
    assert_eq!(status, 400);
    assert_eq!(admin.active().await?, "least-load");
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "still fine", 2, false))
        .await?;
    assert_eq!(reply.status, 200);

    // Without the token: 401, and nothing changes.
    let mut connection = admin.client.connect().await?;
    let reply = connection
        .send("PUT", "/admin/policies/x?activate=true", guest("trap")?)
        .await?;
    assert_eq!(reply.status, 401);
    let reply = connection
        .send_with_auth("GET", "/admin/policies", Vec::new(), "wrong-token-wrong-token")
        .await?;
    assert_eq!(reply.status, 401);
    assert_eq!(admin.active().await?, "least-load");
    let (status, answer) = admin
        .call("POST", "/admin/policies/never-uploaded/shadow", Vec::new())
        .await?;
    assert_eq!(status, 404, "a rollout needs an uploaded candidate: {answer}");
    Ok(())
}

/// The gateway process's resident memory, in MiB.
fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS in /proc/{pid}/status"))?;
    Ok(kib / 1024.0)
}

/// Warms up the request path and the allocator, then answers the gateway's RSS in MiB.
async fn warm_baseline(client: &Client, pid: u32) -> anyhow::Result<f64> {
    for _ in 0..20 {
        client
            .post_json("/v1/chat/completions", &chat_body("mock", "warm up", 2, false))
            .await?;
    }
    rss_mib(pid)
}

/// A memory bomb's instance grows to the memory cap and traps; its slot's
/// memory must be given back when the instance is dropped, not when 64 slots have piled up
/// in wasmtime's decommit queue (five pushes left ~250 MiB resident that way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_grows_its_memory_leaves_none_behind() -> anyhow::Result<()> {
    let (gateway, client, admin) = start()?;
    let pid = gateway.process.id();
    let baseline = warm_baseline(&client, pid).await?;
    let bomb = guest("memory_bomb")?;
    for push in 0..5 {
        let (status, answer) = admin
            .call(
                "PUT",
                &format!("/admin/policies/bomb{push}?activate=true"),
                bomb.clone(),
            )
            .await?;
        assert_eq!(status, 200, "{answer}");
        // Each failing call grows an instance to the memory cap before it traps.
        let rolled_back = eventually(Duration::from_secs(20), || {
            let (client, admin) = (client.clone(), &admin);
            async move {
                let reply = client
                    .post_json("/v1/chat/completions", &chat_body("mock", "bomb", 2, false))
                    .await
                    .expect("transport");
                assert_eq!(reply.status, 200);
                admin.active().await.map(|a| a == "least-load").unwrap_or(false)
            }
        })
        .await;
        assert!(rolled_back, "push {push} rolled back");
    }
    let after = rss_mib(pid)?;
    println!("gateway RSS: {baseline:.0} MiB before, {after:.0} MiB after five rolled-back memory bombs");
    assert!(
        after - baseline <= 50.0,
        "a rolled-back policy left {:.0} MiB resident (baseline {baseline:.0}, after {after:.0})",
        after - baseline
    );
    Ok(())
}

/// A policy that leaks across calls, tried as a shadow candidate, then
/// the rollout is ended by the operator. Its instances never trapped, so they sit in the
/// runtime threads' instance caches holding what they leaked, beside the active version's
/// (still cached, so no thread misses and re-instantiates); the next call on each thread must
/// drop them (before, they stayed until a thread next instantiated something).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_leaks_across_calls_leaves_none_behind_once_retired() -> anyhow::Result<()> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n\
         [embedded_mockers]\ncount = 2\nspeedup = 50.0\n\
         [policy]\nrouter = \"least-load\"\nmemory_limit_mib = 128\ndeadline_ms = 2000\n",
        TOKEN,
    )?;
    // The long deadline: writing 24 MiB of fresh pages takes milliseconds, more on a loaded
    // machine, and a call cut by the deadline drops its instance, leaking nothing to measure.
    let client = Client::plain(gateway.addr);
    let pid = gateway.process.id();
    let baseline = warm_baseline(&client, pid).await?;
    let leak = guest("leak")?;
    let mut peak: f64 = 0.0;
    for push in 0..3 {
        let name = format!("leak{push}");
        let (status, answer) = admin
            .call("PUT", &format!("/admin/policies/{name}"), leak.clone())
            .await?;
        assert_eq!(status, 200, "{answer}");
        let (status, answer) = admin
            .call("POST", &format!("/admin/policies/{name}/shadow"), Vec::new())
            .await?;
        assert_eq!(status, 200, "{answer}");
        // 24 MiB kept per call: three calls stay under the 128 MiB cap on any thread.
        for _ in 0..3 {
            let reply = client
                .post_json("/v1/chat/completions", &chat_body("mock", "leak", 2, false))
                .await?;
            assert_eq!(reply.status, 200);
        }
        peak = peak.max(rss_mib(pid)?);
        let (status, answer) = admin.call("DELETE", "/admin/rollout", Vec::new()).await?;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(admin.active().await?, "least-load");
        for _ in 0..20 {
            let reply = client
                .post_json("/v1/chat/completions", &chat_body("mock", "after", 2, false))
                .await?;
            assert_eq!(reply.status, 200);
        }
    }
    let after = rss_mib(pid)?;
    println!(
        "gateway RSS: {baseline:.0} MiB before, {peak:.0} MiB at the most, {after:.0} MiB after three leaking \
         candidates were retired"
    );
    assert!(
        peak - baseline >= 60.0,
        "the guest leaked too little to tell ({peak:.0} MiB peak)"
    );
    assert!(
        after - baseline <= 50.0,
        "retired leaking candidates left {:.0} MiB resident (baseline {baseline:.0}, after {after:.0})",
        after - baseline
    );
    Ok(())
}
