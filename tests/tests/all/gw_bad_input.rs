//! Bad input at the gateway: every case gets an OpenAI error object with the right status,
//! and none of them disturbs a good request running at the same time.

use std::time::Duration;

use switchyard_harness::{Alpn, Client, DeadAddress, Gateway, TestCa, chat_body};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn assert_error(reply: &switchyard_harness::Reply, status: u16, code: &str) {
    let body = String::from_utf8_lossy(&reply.body()).into_owned();
    assert_eq!(reply.status.as_u16(), status, "{code}: {body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{code}: not JSON: {body}"));
    assert_eq!(json["error"]["code"], code, "{body}");
    assert!(
        json["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(json["error"]["type"].is_string(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bad_input_gets_its_error_and_good_requests_continue() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let config = format!(
        "mode = \"production\"\n[server]\nmax_body_bytes = 4096\nheader_read_timeout_ms = 500\n{}\n[embedded_mockers]\ncount = 2\nspeedup = 1.0\n",
        ca.tls_toml()
    );
    let gateway = Gateway::start(&config)?;
    let h1 = Client::tls(gateway.addr, &ca.ca_der, Alpn::Http1, None)?;
    let h2 = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;

    // A long good stream runs through all the bad input.
    let good = {
        let h2 = h2.clone();
        tokio::spawn(async move {
            h2.post_json("/v1/chat/completions", &chat_body("mock", "steady", 150, true))
                .await
        })
    };

    for client in [&h1, &h2] {
        assert_error(
            &client.send("POST", "/v1/chat/completions", "{\"model\": ").await?,
            400,
            "invalid_json",
        );
        assert_error(
            &client.send("POST", "/v1/chat/completions", "").await?,
            400,
            "invalid_json",
        );
        assert_error(
            &client
                .send("POST", "/v1/chat/completions", r#"{"model":"mock","messages":"hi"}"#)
                .await?,
            400,
            "invalid_type",
        );
        assert_error(
            &client
                .send(
                    "POST",
                    "/v1/chat/completions",
                    r#"{"model":"mock","messages":[],"stream":"yes"}"#,
                )
                .await?,
            400,
            "invalid_type",
        );
        let missing = client
            .send(
                "POST",
                "/v1/chat/completions",
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
            )
            .await?;
        assert_error(&missing, 400, "invalid_type");
        assert!(String::from_utf8_lossy(&missing.body()).contains("model"));
        assert_error(
            &client
                .post_json("/v1/chat/completions", &chat_body("gpt-9", "x", 1, false))
                .await?,
            404,
            "model_not_found",
        );
        assert_error(
            &client
                .send(
                    "POST",
                    "/v1/completions",
                    b"{\"model\":\"mock\",\"prompt\":\"\xc3\x28\"}".to_vec(),
                )
                .await?,
            400,
            "invalid_utf8",
        );
        let big = serde_json::to_vec(&chat_body("mock", &"x".repeat(5000), 1, false))?;
        assert_error(
            &client.send("POST", "/v1/chat/completions", big).await?,
            413,
            "body_too_large",
        );
        assert_error(
            &client.send("GET", "/v1/chat/completions", "").await?,
            405,
            "method_not_allowed",
        );
        assert_error(&client.send("POST", "/v1/models", "").await?, 405, "method_not_allowed");
        assert_error(&client.send("GET", "/v2/anything", "").await?, 404, "not_found");
    }

    // Slow headers: half a request line, then silence.
    let mut slow = h1.raw_tls().await?;
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: loc")
        .await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut answer)).await??;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"header_timeout\""), "{answer}");

    // A body larger than the limit and sent without a length is cut off at the limit.
    let mut connection = h1.connect().await?;
    let unsized_big = serde_json::to_vec(&chat_body("mock", &"y".repeat(8000), 1, false))?;
    let reply = connection.send("POST", "/v1/chat/completions", unsized_big).await?;
    assert_error(&reply, 413, "body_too_large");

    let good = good.await??;
    assert_eq!(good.status, 200);
    let events = good.events();
    assert_eq!(
        events.last().map(|(_, d)| d.as_str()),
        Some("[DONE]"),
        "the good stream finished"
    );
    assert_eq!(events.len(), 152, "150 tokens, the finish chunk and [DONE]");

    let metrics = String::from_utf8(h1.send("GET", "/metrics", "").await?.body())?;
    for kind in [
        "invalid_json",
        "invalid_type",
        "model_not_found",
        "invalid_utf8",
        "body_too_large",
        "header_timeout",
        "not_found",
    ] {
        assert!(
            metrics.contains(&format!("switchyard_errors_total{{kind=\"{kind}\"}}")),
            "no error count for {kind}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_worker_is_a_clear_503() -> anyhow::Result<()> {
    // A port nothing listens on, held by this test.
    let dead_address = DeadAddress::new()?;
    let dead = dead_address.addr;
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 100\nfailures_to_eject = 1\n[[workers]]\nname = \"gone\"\nurl = \"http://{dead}\"\nmodel = \"mock\"\n"
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    // The first request may find the worker still presumed healthy; it fails to connect and
    // the answer is a 502 naming it. Once ejected, the answer is 503.
    let ready = switchyard_harness::eventually(Duration::from_secs(5), || async {
        client
            .send("GET", "/readyz", "")
            .await
            .map(|r| r.status == 503)
            .unwrap_or(false)
    })
    .await;
    assert!(ready, "readyz must turn 503");
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "x", 1, false))
        .await?;
    assert_error(&reply, 503, "no_healthy_worker");
    assert!(String::from_utf8_lossy(&reply.body()).contains("no healthy worker"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_max_prompt_tokens_is_refused() -> anyhow::Result<()> {
    let config = "[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\nspeedup = 50.0\n\
                  [[models]]\nname = \"mock\"\nmax_prompt_tokens = 100\n";
    let gateway = Gateway::start(config)?;
    let client = Client::plain(gateway.addr);
    let words = |n: usize| (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    // Within the limit: served.
    let fits = client
        .post_json("/v1/chat/completions", &chat_body("mock", &words(20), 2, false))
        .await?;
    assert_eq!(fits.status, 200);
    // Over it once tokenized: the count is in the message.
    let long = client
        .post_json("/v1/chat/completions", &chat_body("mock", &words(150), 2, false))
        .await?;
    assert_error(&long, 400, "prompt_too_long");
    let body = String::from_utf8_lossy(&long.body()).into_owned();
    assert!(body.contains("takes at most 100 prompt tokens"), "{body}");
    // Far over it (more than 64 bytes per allowed token): refused without tokenizing.
    let huge = client
        .post_json(
            "/v1/chat/completions",
            &chat_body("mock", &"x".repeat(100 * 64 + 1), 2, false),
        )
        .await?;
    assert_error(&huge, 400, "prompt_too_long");
    assert!(String::from_utf8_lossy(&huge.body()).contains("far more text"));
    // A large prompt (over 64 KiB: tokenized on a blocking thread) within the limit (the
    // context length here; one token per byte with the byte-level tokenizer) is served.
    let roomy = Gateway::start(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\nspeedup = 50.0\n\
         [[models]]\nname = \"mock\"\nmax_model_len = 131072\n",
    )?;
    let large = Client::plain(roomy.addr)
        .post_json("/v1/chat/completions", &chat_body("mock", &words(12_000), 2, false))
        .await?;
    assert_eq!(large.status, 200, "{}", String::from_utf8_lossy(&large.body()));
    Ok(())
}
