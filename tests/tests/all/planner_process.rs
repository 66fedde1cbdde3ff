//! The planner acting on a live fleet through the `process` connector: the gateway starts
//! `switchyard-mocker` processes that register over NATS and take traffic when a load step
//! comes, and stops them one at a time (SIGTERM: each leaves routing at once and drains) when
//! the load drops, with no failed or truncated stream. Then a hostile planner pushed through
//! the admin API changes nothing. In a fleet, one replica plans, and another takes the
//! planning lease over when it stops.

use std::time::{Duration, Instant};

use switchyard_harness::{Admin, Client, Gateway, NatsServer, binary, chat_body, eventually, metric_sum};

const TOKEN: &str = "planner-process-token-0123456789";

/// The pool as `GET /admin/planner` shows it.
async fn pool(admin: &Admin) -> serde_json::Value {
    let (_, status) = admin
        .call("GET", "/admin/planner", Vec::new())
        .await
        .unwrap_or_default();
    status["pools"][0].clone()
}

async fn ready(admin: &Admin) -> usize {
    pool(admin).await["ready"].as_array().map_or(0, Vec::len)
}

/// One streamed answer: the worker that served it, and whether it came whole (every token it
/// asked for, then `[DONE]`).
async fn stream(client: Client, max_tokens: u32) -> anyhow::Result<(String, bool)> {
    let mut connection = client.connect().await?;
    let body = serde_json::to_vec(&chat_body("mock", "how many workers are there", max_tokens, true))?;
    let reply = connection.send("POST", "/v1/chat/completions", body).await?;
    anyhow::ensure!(reply.status == 200, "{}", String::from_utf8_lossy(&reply.body()));
    let text = String::from_utf8_lossy(&reply.body()).to_string();
    let whole = text.contains("data: [DONE]") && text.contains("\"finish_reason\":\"length\"");
    Ok((reply.worker(), whole))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_grows_and_shrinks_a_pool_of_processes_without_losing_a_stream() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let mocker = binary("switchyard-mocker")?;
    let config = format!(
        r#"[server]
plaintext = true
[kv]
nats_url = "{nats}"
[planner]
policy = "sla-based"
metric_interval_ms = 200
adjustment_interval_s = 1.0
connector = "process"
[planner.policy_config]
window = 2
# Read by the hostile planner pushed at the end; the built-ins ignore it.
mode = "absurd"
[[planner.pools]]
model = "mock"
min_workers = 1
max_workers = 3
name_prefix = "planned"
profile = [{{ isl = 10, osl = 40, rate = 2.0 }}, {{ isl = 1000, osl = 40, rate = 2.0 }}]
command = ["{mocker}", "--nats", "{nats}", "--name", "{{name}}", "--heartbeat-ms", "200"]
"#,
        nats = nats.url,
        mocker = mocker.display(),
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::plain(gateway.addr);

    // The minimum comes up on its own.
    assert!(
        eventually(Duration::from_secs(20), || async { ready(&admin).await == 1 }).await,
        "the planner started its first worker: {}",
        pool(&admin).await
    );

    // A load step: ~8 requests a second for 6 s, four times a worker's profiled 2.
    let started = Instant::now();
    let mut load = Vec::new();
    let mut grown_at = None;
    while started.elapsed() < Duration::from_secs(12) {
        load.push(tokio::spawn(stream(client.clone(), 40)));
        tokio::time::sleep(Duration::from_millis(125)).await;
        if grown_at.is_none() && ready(&admin).await == 3 {
            grown_at = Some(started.elapsed());
        }
        if grown_at.is_some_and(|at| started.elapsed() > at + Duration::from_secs(2)) {
            break;
        }
    }
    let Some(grown_at) = grown_at else {
        anyhow::bail!("the pool never reached 3: {}", pool(&admin).await);
    };
    println!(
        "load step: 3 workers ready {:.1} s after it began",
        grown_at.as_secs_f64()
    );
    let mut served_by = std::collections::HashSet::new();
    for request in load {
        let (worker, whole) = request.await??;
        assert!(whole, "a stream of the load step came cut");
        served_by.insert(worker);
    }
    assert!(
        served_by.len() >= 2,
        "the started workers took traffic: served by {served_by:?}"
    );

    // The load drops to a trickle of long streams: the pool shrinks one worker an interval,
    // and the streams on a stopping worker finish there.
    let dropped = Instant::now();
    let mut trickle = Vec::new();
    while dropped.elapsed() < Duration::from_secs(40) {
        trickle.push(tokio::spawn(stream(client.clone(), 400)));
        tokio::time::sleep(Duration::from_millis(700)).await;
        let now = pool(&admin).await;
        if now["ready"].as_array().map_or(0, Vec::len) == 1 && now["draining"] == 0 {
            break;
        }
    }
    let now = pool(&admin).await;
    assert_eq!(
        now["ready"].as_array().map_or(0, Vec::len),
        1,
        "shrunk to the minimum: {now}"
    );
    assert_eq!(now["draining"], 0, "the stopped workers exited: {now}");
    println!(
        "load drop: back to 1 worker {:.1} s after it",
        dropped.elapsed().as_secs_f64()
    );
    let streams = trickle.len();
    for request in trickle {
        let (_, whole) = request.await??;
        assert!(whole, "a stream was cut while the pool shrank");
    }
    println!("{streams} streams during the shrink, none failed or cut");
    let (_, status) = admin.call("GET", "/admin/planner", Vec::new()).await?;
    let plans = status["plans"].as_array().cloned().unwrap_or_default();
    let ups = plans
        .iter()
        .flat_map(|plan| plan["decisions"].as_array().cloned().unwrap_or_default())
        .filter(|decision| decision["to"].as_u64() > decision["from"].as_u64())
        .count();
    assert!(ups >= 1, "the scale-up is on record: {status}");

    // A hostile planner (it asks for 4 billion workers) changes nothing.
    let hostile = std::fs::read(format!("{}/hostile_planner.wasm", env!("SWITCHYARD_GUESTS_DIR")))?;
    let (code, body) = admin.call("PUT", "/admin/planner/hostile-planner", hostile).await?;
    assert_eq!(code, 200, "{body}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = pool(&admin).await;
    assert_eq!(now["desired"], 1, "{now}");
    assert_eq!(now["ready"].as_array().map_or(0, Vec::len), 1, "{now}");
    let (_, metrics) = admin.get_text("/metrics").await?;
    let fallbacks = metric_sum(&metrics, "switchyard_planner_calls_total", &["fallback"]);
    assert!(fallbacks >= 1.0, "the hostile planner's answers were refused");
    Ok(())
}

/// Whether the replica behind `admin` holds the planning lease (`switchyard_planner_leader`).
async fn leads(admin: &Admin) -> Option<bool> {
    let (_, metrics) = admin.get_text("/metrics").await.ok()?;
    metrics
        .lines()
        .find(|line| line.starts_with("switchyard_planner_leader "))
        .map(|line| line.ends_with(" 1"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_of_a_fleet_plans_and_another_takes_over_when_it_stops() -> anyhow::Result<()> {
    let nats = NatsServer::start_jetstream()?;
    let replica = |name: &str| {
        Gateway::start_with_admin(
            &format!(
                "[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\nspeedup = 50.0\n\
                 [fleet]\nnats_url = \"{}\"\nreplica = \"{name}\"\n\
                 [planner]\nconnector = \"none\"\nmetric_interval_ms = 100\nadjustment_interval_s = 0.3\n\
                 lease_ms = 1500\n[[planner.pools]]\nmodel = \"mock\"\nmax_workers = 2\n",
                nats.url
            ),
            TOKEN,
        )
    };
    let (mut a, admin_a) = replica("a")?;
    let (mut b, admin_b) = replica("b")?;
    // Every replica reports after its first adjustments: exactly one of them plans.
    assert!(
        eventually(Duration::from_secs(10), || async {
            matches!(
                (leads(&admin_a).await, leads(&admin_b).await),
                (Some(true), Some(false)) | (Some(false), Some(true))
            )
        })
        .await,
        "one leader: a {:?}, b {:?}",
        leads(&admin_a).await,
        leads(&admin_b).await
    );
    // Both stay that way over several intervals (no flapping while the holder renews).
    let leader_is_a = leads(&admin_a).await == Some(true);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(leads(&admin_a).await, Some(leader_is_a));
        assert_eq!(leads(&admin_b).await, Some(!leader_is_a));
    }
    // The leader stops without a word; the other takes over once its lease lapses.
    let (follower, name) = if leader_is_a {
        a.process.kill();
        (&admin_b, "b")
    } else {
        b.process.kill();
        (&admin_a, "a")
    };
    let stopped = std::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || async {
            leads(follower).await == Some(true)
        })
        .await,
        "replica {name} took the lease over"
    );
    println!(
        "planning lease: replica {name} took over {:.1} s after the leader stopped (lease 1.5 s)",
        stopped.elapsed().as_secs_f64()
    );
    Ok(())
}
