//! Workers failing under the gateway: a worker killed mid-stream, retries before the first
//! byte, and a restarted worker returning to rotation.

use std::time::Duration;

use switchyard_harness::{Client, DeadAddress, Gateway, Mockers, chat_body, eventually, metric_sum};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_fails_its_streams_cleanly_and_returns_after_restart() -> anyhow::Result<()> {
    let mut doomed = Mockers::start(&["--num-workers", "1", "--speedup", "1"])?;
    let survivor = Mockers::start(&["--num-workers", "1", "--speedup", "1"])?;
    let doomed_addr = doomed.addrs[0];
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 200\ntimeout_ms = 200\nfailures_to_eject = 1\nsuccesses_to_restore = 1\n\
         [[workers]]\nname = \"doomed\"\nurl = \"http://{doomed_addr}\"\nmodel = \"mock\"\n\
         [[workers]]\nname = \"survivor\"\nurl = \"http://{}\"\nmodel = \"mock\"\n",
        survivor.addrs[0]
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);

    // Long streams, spread over both workers by least-in-flight routing.
    let mut streams = Vec::new();
    for _ in 0..6 {
        let client = client.clone();
        streams.push(tokio::spawn(async move {
            client
                .post_json("/v1/chat/completions", &chat_body("mock", "a long answer", 400, true))
                .await
        }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    doomed.process.kill();

    let mut failed_cleanly = 0;
    let mut completed = 0;
    for stream in streams {
        let reply = tokio::time::timeout(Duration::from_secs(30), stream).await???;
        assert_eq!(reply.status, 200, "streams had started before the kill");
        let events = reply.events();
        let last = events.last().map(|(_, d)| d.clone()).unwrap_or_default();
        match reply.worker().as_str() {
            "doomed" => {
                let error: serde_json::Value = serde_json::from_str(&last)?;
                assert_eq!(
                    error["error"]["code"], "worker_failed_mid_stream",
                    "ends with an error event: {last}"
                );
                failed_cleanly += 1;
            }
            "survivor" => {
                assert_eq!(last, "[DONE]");
                assert_eq!(events.len(), 402, "400 tokens, finish chunk, [DONE]");
                completed += 1;
            }
            other => panic!("unexpected worker {other:?}"),
        }
    }
    assert!(
        failed_cleanly > 0 && completed > 0,
        "both workers had streams: {failed_cleanly} failed, {completed} completed"
    );

    // New requests succeed, all on the survivor.
    for _ in 0..6 {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "after", 2, false))
            .await?;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        assert_eq!(reply.worker(), "survivor");
    }

    // Restart on the same port: the health checker brings it back into rotation.
    let _restarted = Mockers::start(&[
        "--num-workers",
        "1",
        "--speedup",
        "1",
        "--port",
        &doomed_addr.port().to_string(),
    ])?;
    let back = eventually(Duration::from_secs(10), || async {
        let metrics = client
            .send("GET", "/metrics", "")
            .await
            .map(|r| r.body())
            .unwrap_or_default();
        String::from_utf8_lossy(&metrics).contains("switchyard_worker_healthy{worker=\"doomed\"} 1")
    })
    .await;
    assert!(back, "the restarted worker returns to rotation");
    let mut served_by_doomed = 0;
    for _ in 0..6 {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "again", 2, false))
            .await?;
        assert_eq!(reply.status, 200);
        if reply.worker() == "doomed" {
            served_by_doomed += 1;
        }
    }
    assert!(served_by_doomed > 0, "the restarted worker receives traffic again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_be_reached_is_retried_elsewhere() -> anyhow::Result<()> {
    let live = Mockers::start(&["--num-workers", "1", "--speedup", "10"])?;
    let dead_address = DeadAddress::new()?;
    let dead = dead_address.addr;
    // Health checks are slow here, so only forwarding can discover the dead worker.
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 600000\n\
         [[workers]]\nname = \"dead\"\nurl = \"http://{dead}\"\nmodel = \"mock\"\n\
         [[workers]]\nname = \"live\"\nurl = \"http://{}\"\nmodel = \"mock\"\n",
        live.addrs[0]
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    for stream in [false, true, false, true] {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "retry me", 3, stream))
            .await?;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        assert_eq!(reply.worker(), "live");
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert!(
        metrics.contains("switchyard_worker_retries_total 1"),
        "exactly one retry, then the dead worker was out:\n{metrics}"
    );
    assert!(metrics.contains("switchyard_worker_healthy{worker=\"dead\"} 0"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_5xx_is_ejected_and_fails_no_request() -> anyhow::Result<()> {
    // `broken` answers 500 to every generation request while its `/healthz` says 200: only its
    // answers show that it is broken. Health checks are far apart, so only those answers can
    // take it out of rotation.
    let broken = Mockers::start(&["--num-workers", "1", "--fail-every", "1"])?;
    let good = Mockers::start(&["--num-workers", "1"])?;
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 600000\n\
         [forwarding]\nretries = 1\nerrors_to_eject = 2\n[policy]\nrouter = \"round-robin\"\n\
         [[workers]]\nname = \"broken\"\nurl = \"http://{}\"\nmodel = \"mock\"\n\
         [[workers]]\nname = \"good\"\nurl = \"http://{}\"\nmodel = \"mock\"\n",
        broken.addrs[0], good.addrs[0]
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    let healthy = |text: &str| metric_sum(text, "switchyard_worker_healthy", &["worker=\"broken\""]);
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(healthy(&metrics), 1.0, "in rotation at start");
    // Round-robin sends every other request to `broken`; each is retried on `good`.
    for _ in 0..10 {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "still answered", 4, false))
            .await?;
        assert_eq!(reply.status, 200, "a failed answer is retried elsewhere");
        assert_eq!(
            reply.headers.get("x-switchyard-worker").and_then(|v| v.to_str().ok()),
            Some("good")
        );
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(healthy(&metrics), 0.0, "two failed answers in a row eject it");
    Ok(())
}
