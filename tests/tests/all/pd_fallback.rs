//! Disaggregation's failures lose nothing: a prefill worker killed under load, one that errs and
//! one too slow for `[forwarding] prefill_timeout_ms` leave the prompt to the answering worker,
//! which answers every request as it would have whole; each fallback is counted and said.

use std::time::Duration;

use switchyard_harness::{Client, Gateway, Mockers, Reply, metric_sum};

/// A gateway in front of one decode and one prefill mocker, `pd-threshold` disaggregating every
/// prompt over 64 tokens, with `extra` TOML appended.
fn config(decode: &Mockers, prefill: &Mockers, extra: &str) -> String {
    format!(
        "[server]\nplaintext = true\n\
         [health]\ninterval_ms = 100\ntimeout_ms = 200\nfailures_to_eject = 1\n\
         [policy]\nrouter = \"pd-threshold\"\ndeadline_ms = 50\n\
         [policy.config]\nmax_local_prefill_tokens = 64\nmax_prefill_queue = 1000\n\
         [[workers]]\nname = \"decode\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"switchyard\"\nrole = \"decode\"\n\
         [[workers]]\nname = \"prefill\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"switchyard\"\nrole = \"prefill\"\n\
         {extra}",
        decode.addrs[0], prefill.addrs[0]
    )
}

fn chat(tag: &str, words: usize) -> serde_json::Value {
    let content: Vec<String> = (0..words).map(|i| format!("{tag}{i}")).collect();
    serde_json::json!({
        "model": "mock",
        "messages": [{"role": "user", "content": content.join(" ")}],
        "max_tokens": 16,
    })
}

fn text_of(reply: &Reply) -> String {
    let json: serde_json::Value = serde_json::from_slice(&reply.body()).unwrap_or_default();
    json["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn disagg(reply: &Reply) -> String {
    reply
        .headers
        .get("x-switchyard-disagg")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

async fn scrape(client: &Client) -> anyhow::Result<String> {
    Ok(String::from_utf8(client.send("GET", "/metrics", "").await?.body())?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_under_load_fails_no_request() -> anyhow::Result<()> {
    let decode = Mockers::start(&["--num-workers", "1", "--speedup", "4", "--role", "decode"])?;
    let mut prefill = Mockers::start(&["--num-workers", "1", "--speedup", "1", "--role", "prefill"])?;
    let whole = Mockers::start(&["--num-workers", "1", "--speedup", "20"])?;
    let gateway = Gateway::start(&config(&decode, &prefill, ""))?;
    let client = Client::plain(gateway.addr);

    // 24 long prompts at once: about a second of prefill at the prefill worker's speed, which
    // is killed a third of the way in, some prompts computed (their blocks still to pull),
    // some in its queue.
    let requests: Vec<_> = (0..24)
        .map(|i| {
            let client = client.clone();
            let body = chat(&format!("load{i}w"), 2000);
            tokio::spawn(async move { (client.post_json("/v1/chat/completions", &body).await, body) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(350)).await;
    prefill.process.kill();
    let direct = Client::plain(whole.addrs[0]);
    let mut local = 0;
    for request in requests {
        let (reply, body) = tokio::time::timeout(Duration::from_secs(60), request).await??;
        let reply = reply?;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        assert_eq!(reply.worker(), "decode");
        let said = disagg(&reply);
        assert!(
            said.starts_with("remote; ") || said.starts_with("local; reason="),
            "{said}"
        );
        local += usize::from(said.starts_with("local"));
        let expected = direct.post_json("/v1/chat/completions", &body).await?;
        assert_eq!(
            text_of(&reply),
            text_of(&expected),
            "the answer is the one served whole"
        );
    }
    assert!(local > 0, "the kill left some prompts to the decode worker");
    let metrics = scrape(&client).await?;
    assert_eq!(metric_sum(&metrics, "switchyard_disagg_requests_total", &[]), 24.0);
    assert_eq!(
        metric_sum(&metrics, "switchyard_disagg_fallbacks_total", &[]),
        local as f64,
        "every fallback counted"
    );
    assert_eq!(metric_sum(&metrics, "switchyard_errors_total", &[]), 0.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_errs_or_is_too_slow_leaves_the_prompt_local() -> anyhow::Result<()> {
    let decode = Mockers::start(&["--num-workers", "1", "--speedup", "20", "--role", "decode"])?;
    // Every generation request answered 500 while its health stays good.
    let failing = Mockers::start(&[
        "--num-workers",
        "1",
        "--speedup",
        "20",
        "--role",
        "prefill",
        "--fail-every",
        "1",
    ])?;
    let gateway = Gateway::start(&config(&decode, &failing, "[forwarding]\nerrors_to_eject = 1000\n"))?;
    let client = Client::plain(gateway.addr);
    for i in 0..3 {
        let reply = client
            .post_json("/v1/chat/completions", &chat(&format!("err{i}w"), 400))
            .await?;
        assert_eq!(reply.status, 200);
        assert_eq!(disagg(&reply), "local; reason=error");
    }
    let metrics = scrape(&client).await?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_disagg_fallbacks_total", &["reason=\"error\""]),
        3.0
    );
    drop(gateway);

    // A prefill worker at a twentieth of real speed: a 2,000-token prompt takes it about a
    // second, ten times the deadline.
    let slow = Mockers::start(&["--num-workers", "1", "--speedup", "0.05", "--role", "prefill"])?;
    let gateway = Gateway::start(&config(&decode, &slow, "[forwarding]\nprefill_timeout_ms = 100\n"))?;
    let client = Client::plain(gateway.addr);
    let reply = client.post_json("/v1/chat/completions", &chat("slow", 2000)).await?;
    assert_eq!(reply.status, 200);
    assert_eq!(disagg(&reply), "local; reason=timeout");
    let metrics = scrape(&client).await?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_disagg_fallbacks_total", &["reason=\"timeout\""]),
        1.0
    );
    Ok(())
}
