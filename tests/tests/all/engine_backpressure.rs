//! Backpressure is not failure: an engine that answers 429 or 503 (its queue is full) sends the
//! request to another worker without using a retry and without counting toward the worker's
//! ejection, and is left alone for its `Retry-After`; a worker whose answers keep failing has
//! its circuit breaker opened, probed after the backoff, and reopened for longer; an engine's own
//! error shape reaches the client as OpenAI's.

use std::time::Duration;

use switchyard_harness::{Client, Gateway, Mockers, ScriptedEngine, chat_body, metric_sum};

async fn metrics(client: &Client) -> anyhow::Result<String> {
    Ok(String::from_utf8(client.send("GET", "/metrics", "").await?.body())?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_engines_are_routed_around_without_ejection_or_retries() -> anyhow::Result<()> {
    // `full` answers 429 with Retry-After: 2, `unavailable` 503 without one; `good` is a mocker.
    // No retries are allowed: busy answers must not need any.
    let full = ScriptedEngine::refusing("full", 429, Some(2)).await?;
    let unavailable = ScriptedEngine::refusing("unavailable", 503, None).await?;
    let good = Mockers::start(&["--num-workers", "1"])?;
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 200\nfailures_to_eject = 1\n\
         [forwarding]\nretries = 0\nerrors_to_eject = 1\nbusy_backoff_ms = 2000\nbusy_backoff_max_ms = 5000\n\
         [policy]\nrouter = \"round-robin\"\n\
         [[workers]]\nname = \"full\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"openai\"\n\
         [[workers]]\nname = \"unavailable\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"openai\"\n\
         [[workers]]\nname = \"good\"\nurl = \"http://{}\"\nmodel = \"mock\"\n",
        full.addr, unavailable.addr, good.addrs[0]
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    for _ in 0..12 {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "answered anyway", 4, false))
            .await?;
        assert_eq!(
            reply.status,
            200,
            "a busy answer goes to another worker: {:?}",
            reply.json()
        );
        assert_eq!(reply.worker(), "good");
    }
    // Each busy engine was tried once and then left alone for its backoff (2 s or more).
    assert_eq!(full.generations(), 1, "Retry-After keeps `full` out");
    assert_eq!(unavailable.generations(), 1, "the busy backoff keeps `unavailable` out");
    let text = metrics(&client).await?;
    for name in ["full", "unavailable"] {
        let worker = format!("worker=\"{name}\"");
        assert_eq!(
            metric_sum(&text, "switchyard_worker_healthy", &[&worker]),
            1.0,
            "{name} stays in rotation: busy is not broken"
        );
        assert_eq!(metric_sum(&text, "switchyard_worker_breaker_state", &[&worker]), 0.0);
        assert_eq!(metric_sum(&text, "switchyard_worker_busy_total", &[&worker]), 1.0);
    }
    assert_eq!(
        metric_sum(&text, "switchyard_worker_retries_total", &[]),
        2.0,
        "two redirects"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_engine_is_full_the_client_is_told_when_to_come_back() -> anyhow::Result<()> {
    let full = ScriptedEngine::refusing("full", 429, Some(3)).await?;
    let config = format!(
        "[server]\nplaintext = true\n\
         [[workers]]\nname = \"full\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"openai\"\n",
        full.addr
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "no room", 4, false))
        .await?;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json()?["error"]["code"], "workers_busy");
    assert_eq!(
        reply.headers.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("3"),
        "the engine's own Retry-After is passed on"
    );
    // While it is busy, nothing more is sent to it.
    let again = client
        .post_json("/v1/chat/completions", &chat_body("mock", "still no room", 4, false))
        .await?;
    assert_eq!(again.status, 503);
    assert_eq!(full.generations(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_probed_after_its_backoff_and_reopened_for_longer() -> anyhow::Result<()> {
    // `broken` answers 500 to every generation request while its health check passes.
    let broken = Mockers::start(&["--num-workers", "1", "--fail-every", "1"])?;
    let good = Mockers::start(&["--num-workers", "1"])?;
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 100\n\
         [forwarding]\nretries = 1\nerrors_to_eject = 1\nbreaker_open_ms = 1000\nbreaker_open_max_ms = 10000\n\
         [policy]\nrouter = \"round-robin\"\n\
         [[workers]]\nname = \"broken\"\nurl = \"http://{}\"\nmodel = \"mock\"\n\
         [[workers]]\nname = \"good\"\nurl = \"http://{}\"\nmodel = \"mock\"\n",
        broken.addrs[0], good.addrs[0]
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    let send = || async {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "answered", 2, false))
            .await?;
        anyhow::ensure!(
            reply.status == 200 && reply.worker() == "good",
            "status {}",
            reply.status
        );
        anyhow::Ok(())
    };
    let opened = |text: &str, state: &str| {
        metric_sum(
            text,
            "switchyard_worker_breaker_transitions_total",
            &["worker=\"broken\"", &format!("state=\"{state}\"")],
        )
    };
    // Round-robin reaches `broken` within two requests: its breaker opens (passing health
    // checks do not close it).
    send().await?;
    send().await?;
    let text = metrics(&client).await?;
    assert_eq!(opened(&text, "open"), 1.0, "{text}");
    assert_eq!(
        metric_sum(&text, "switchyard_worker_breaker_state", &["worker=\"broken\""]),
        1.0
    );
    // After the backoff (1 s ± 20 %) one request probes it, fails, and is retried; the
    // breaker reopens for about twice as long.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    for _ in 0..4 {
        send().await?;
    }
    let text = metrics(&client).await?;
    assert_eq!(opened(&text, "half_open"), 1.0, "{text}");
    assert_eq!(opened(&text, "open"), 2.0, "{text}");
    // Shortly after, the second backoff (2 s ± 20 %) is still running: no probe yet.
    tokio::time::sleep(Duration::from_millis(300)).await;
    send().await?;
    let text = metrics(&client).await?;
    assert_eq!(opened(&text, "half_open"), 1.0, "the doubled backoff holds: {text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_own_error_reaches_the_client_in_openai_shape() -> anyhow::Result<()> {
    // TGI's error shape: `{"error": "…", "error_type": "…"}`.
    let strict = ScriptedEngine::refusing("strict", 422, None).await?;
    let config = format!(
        "[server]\nplaintext = true\n\
         [[workers]]\nname = \"strict\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"tgi\"\n",
        strict.addr
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "refused", 4, false))
        .await?;
    assert_eq!(reply.status, 422, "the engine's status is kept");
    let body = reply.json()?;
    assert_eq!(body["error"]["message"], "Model is overloaded");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "overloaded");
    Ok(())
}
