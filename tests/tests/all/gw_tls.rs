//! The gateway binary over real TLS with embedded mockers: whole and streamed completions,
//! HTTP/2 and HTTP/1.1, TLS 1.3 and 1.2, models, health, readiness and metrics.

use std::time::Duration;

use switchyard_harness::{Alpn, Client, Gateway, TestCa, chat_body};

fn config(ca: &TestCa) -> String {
    format!(
        "mode = \"production\"\n[server]\nlisten = \"127.0.0.1:0\"\n{}\n[embedded_mockers]\ncount = 2\nmodel = \"mock\"\nspeedup = 1.0\n",
        ca.tls_toml()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_and_streamed_completions_over_tls() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&config(&ca))?;
    for alpn in [Alpn::H2, Alpn::Http1] {
        let client = Client::tls(gateway.addr, &ca.ca_der, alpn, None)?;

        let reply = client
            .post_json("/v1/chat/completions", &chat_body("mock", "hello there", 8, false))
            .await?;
        assert_eq!(
            reply.status,
            200,
            "{alpn:?}: {}",
            String::from_utf8_lossy(&reply.body())
        );
        let json = reply.json()?;
        assert_eq!(json["object"], "chat.completion");
        assert_eq!(json["usage"]["completion_tokens"], 8);
        let content = json["choices"][0]["message"]["content"].as_str().unwrap_or_default();
        assert_eq!(content.split_whitespace().count(), 8, "eight words: {content:?}");
        assert!(reply.headers.contains_key("x-switchyard-worker"));

        let tokens = 24;
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat_body("mock", "stream please", tokens, true),
            )
            .await?;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.headers["content-type"], "text/event-stream");
        let events = reply.events();
        assert_eq!(
            events.last().map(|(_, data)| data.as_str()),
            Some("[DONE]"),
            "{alpn:?}: ends with [DONE]"
        );
        let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
            .iter()
            .map(|(_, data)| serde_json::from_str(data))
            .collect::<Result<_, _>>()?;
        let words: Vec<&str> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(words.len(), tokens as usize, "one event per token");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let last = &chunks[chunks.len() - 1];
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"]["completion_tokens"], tokens);
        // Relayed as produced: decode steps take >= 5 ms each at speed-up 1, so the first
        // token must arrive well before the last one; a buffered relay delivers them together.
        let first_at = events[0].0;
        let last_at = events[events.len() - 2].0;
        assert!(
            last_at.duration_since(first_at) >= Duration::from_millis(50),
            "{alpn:?}: tokens arrived within {:?}, the stream was buffered",
            last_at.duration_since(first_at)
        );
        let distinct_arrivals = {
            let mut times: Vec<_> = events.iter().map(|(at, _)| *at).collect();
            times.dedup();
            times.len()
        };
        assert!(
            distinct_arrivals >= tokens as usize / 2,
            "{alpn:?}: only {distinct_arrivals} separate arrivals"
        );

        let reply = client
            .post_json(
                "/v1/completions",
                &serde_json::json!({"model": "mock", "prompt": [1, 2, 3, 4], "max_tokens": 3}),
            )
            .await?;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.json()?["usage"]["prompt_tokens"],
            4,
            "token-id prompts pass through"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls12_models_health_readiness_and_metrics() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&config(&ca))?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::Http1, Some(&[&rustls::version::TLS12]))?;
    let models = client.send("GET", "/v1/models", "").await?;
    assert_eq!(models.status, 200);
    assert_eq!(models.json()?["data"][0]["id"], "mock");
    assert_eq!(client.send("GET", "/healthz", "").await?.status, 200);
    assert_eq!(client.send("GET", "/readyz", "").await?.status, 200);
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "x", 2, true))
        .await?;
    assert_eq!(reply.status, 200);
    let metrics = client.send("GET", "/metrics", "").await?;
    let text = String::from_utf8(metrics.body())?;
    for needle in [
        "switchyard_requests_total{endpoint=\"chat\",status=\"200\"} 1",
        "switchyard_time_to_first_byte_seconds_count{endpoint=\"chat\"} 1",
        "switchyard_request_duration_seconds_count{endpoint=\"chat\"} 1",
        "switchyard_worker_in_flight{worker=\"embedded-0\"} 0",
        "switchyard_worker_healthy{worker=\"embedded-1\"} 1",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trusts_another_ca_is_refused() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let other = TestCa::new()?;
    let gateway = Gateway::start(&config(&ca))?;
    let client = Client::tls(gateway.addr, &other.ca_der, Alpn::H2, None)?;
    assert!(
        client.send("GET", "/healthz", "").await.is_err(),
        "the handshake must fail"
    );
    Ok(())
}
