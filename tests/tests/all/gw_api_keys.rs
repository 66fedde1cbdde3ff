//! Clients and tenants on a real gateway: keys checked by their hash, models allowed per key,
//! rate limits answered 429 with `Retry-After` at the configured rate, a tenant's tokens
//! counted from the workers' usage (streamed or not, asked for or not), and the keys file
//! reloaded while the gateway serves. A key learns of the models it may use only: an unknown
//! model's 404 lists those, and the public `/metrics` names no tenant (the admin listener's
//! does).

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use switchyard_harness::{Admin, Client, Gateway, Reply, chat_body, eventually, metric_sum};

const ADMIN_TOKEN: &str = "api-keys-admin-token-0123456789";

fn sha(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn entry(key: &str, tenant: &str, extra: &str) -> String {
    format!(
        "[[api_keys]]\nkey_sha256 = \"{}\"\ntenant = \"{tenant}\"\n{extra}\n",
        sha(key)
    )
}

/// The keys file of the tests: `beta` may use another model only, `gamma` is unlimited,
/// `delta` has 600 tokens a minute.
fn keys_file(extra: &str) -> String {
    [
        entry("sk-beta-0123456789abcdef", "beta", "models = [\"other\"]"),
        entry("sk-gamma-0123456789abcdef", "gamma", ""),
        entry("sk-delta-0123456789abcdef", "delta", "tokens_per_minute = 600"),
        extra.to_string(),
    ]
    .concat()
}

/// A gateway with the test keys and an admin listener, and the folder holding its keys file.
fn start() -> anyhow::Result<(Gateway, Admin, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, keys_file(""))?;
    let config = format!(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nspeedup = 100.0\n[tenants]\nkeys_file = \"{}\"\n{}",
        keys.display(),
        entry("sk-acme-0123456789abcdef", "acme", "requests_per_minute = 120")
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, ADMIN_TOKEN)?;
    Ok((gateway, admin, dir))
}

/// A tenant's tokens, from the admin listener's metrics (the public ones name no tenant).
async fn tenant_tokens(admin: &Admin, tenant: &str) -> anyhow::Result<f64> {
    let (status, metrics) = admin.get_text("/metrics").await?;
    anyhow::ensure!(status == 200, "{status}: {metrics}");
    let label = format!("tenant=\"{tenant}\"");
    Ok(metric_sum(&metrics, "switchyard_tenant_tokens_total", &[&label]))
}

fn usage_of(value: &serde_json::Value) -> u64 {
    value["usage"]["prompt_tokens"].as_u64().unwrap_or(0) + value["usage"]["completion_tokens"].as_u64().unwrap_or(0)
}

/// The usage in a stream's chunks (0 if none carries it), and whether the last chunk before
/// `[DONE]` is a usage-only one.
fn stream_usage(reply: &Reply) -> anyhow::Result<(u64, bool)> {
    let chunks: Vec<serde_json::Value> = reply
        .events()
        .iter()
        .filter(|(_, data)| data != "[DONE]")
        .map(|(_, data)| serde_json::from_str(data))
        .collect::<Result<_, _>>()?;
    let total = chunks.iter().map(usage_of).sum();
    let usage_only = chunks
        .last()
        .is_some_and(|c| c["choices"].as_array().is_some_and(Vec::is_empty) && c["usage"].is_object());
    Ok((total, usage_only))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_models_and_the_open_endpoints() -> anyhow::Result<()> {
    let (gateway, admin, _keys) = start()?;
    let client = Client::plain(gateway.addr);
    let body = chat_body("mock", "hello", 2, false);

    let missing = client.chat(None, &body).await?;
    assert_eq!(missing.status, 401);
    assert_eq!(
        missing.headers.get("www-authenticate").map(|v| v.as_bytes()),
        Some(&b"Bearer"[..])
    );
    assert_eq!(missing.json()?["error"]["code"], "invalid_api_key");
    let unknown = client.chat(Some("sk-nobody-0123456789abcdef"), &body).await?;
    assert_eq!(unknown.status, 401);
    let message = unknown.json()?["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        !message.contains("0123456789abcdef"),
        "the key is not echoed whole: {message}"
    );

    // Health and readiness stay open to probes.
    assert_eq!(client.send("GET", "/healthz", Vec::new()).await?.status, 200);

    let beta = client.chat(Some("sk-beta-0123456789abcdef"), &body).await?;
    assert_eq!(beta.status, 403, "{}", String::from_utf8_lossy(&beta.body()));
    assert_eq!(beta.json()?["error"]["code"], "model_not_allowed");
    let models = |key: &'static str| {
        let client = client.clone();
        async move {
            let mut connection = client.connect().await?;
            let reply = connection.send_with_auth("GET", "/v1/models", Vec::new(), key).await?;
            let ids: Vec<String> = reply.json()?["data"]
                .as_array()
                .map(|models| {
                    models
                        .iter()
                        .filter_map(|m| m["id"].as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            anyhow::Ok(ids)
        }
    };
    assert_eq!(models("sk-beta-0123456789abcdef").await?, Vec::<String>::new());
    assert_eq!(models("sk-gamma-0123456789abcdef").await?, vec!["mock".to_string()]);
    assert_eq!(client.send("GET", "/v1/models", Vec::new()).await?.status, 401);

    let gamma = client.chat(Some("sk-gamma-0123456789abcdef"), &body).await?;
    assert_eq!(gamma.status, 200, "{}", String::from_utf8_lossy(&gamma.body()));

    // An unknown model's 404 lists the models the key may use, and no other.
    let unknown_model = chat_body("no-such-model", "hello", 2, false);
    let not_found = |key: &'static str| {
        let (client, unknown_model) = (client.clone(), unknown_model.clone());
        async move {
            let reply = client.chat(Some(key), &unknown_model).await?;
            anyhow::ensure!(reply.status == 404, "{}", reply.status);
            let error = &reply.json()?["error"];
            anyhow::ensure!(error["code"] == "model_not_found", "{error}");
            anyhow::Ok(error["message"].as_str().unwrap_or_default().to_string())
        }
    };
    let beta = not_found("sk-beta-0123456789abcdef").await?;
    assert!(
        !beta.contains("mock"),
        "a key limited to `other` is told of `mock`: {beta}"
    );
    let gamma = not_found("sk-gamma-0123456789abcdef").await?;
    assert!(gamma.contains("mock"), "{gamma}");

    // The public metrics count requests but name no tenant; the admin listener's do.
    let public = String::from_utf8(client.send("GET", "/metrics", Vec::new()).await?.body())?;
    assert!(public.contains("switchyard_requests_total"), "{public}");
    assert!(!public.contains("tenant="), "tenants on the public metrics: {public}");
    assert!(!public.contains("gamma"), "{public}");
    assert!(
        tenant_tokens(&admin, "gamma").await? > 0.0,
        "the admin listener counts them"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_limit_holds_at_its_rate() -> anyhow::Result<()> {
    let (gateway, _admin, _keys) = start()?;
    let client = Client::plain(gateway.addr);
    let body = chat_body("mock", "hi", 1, false);
    // 120 a minute, a minute's worth at once: 120 at the start, then 2 a second.
    let window = Duration::from_secs(5);
    let started = Instant::now();
    let (mut admitted, mut refused) = (0u32, 0u32);
    let mut retry_after = None;
    while started.elapsed() < window {
        let reply = client.chat(Some("sk-acme-0123456789abcdef"), &body).await?;
        match reply.status.as_u16() {
            200 => admitted += 1,
            429 => {
                refused += 1;
                let error = reply.json()?;
                assert_eq!(error["error"]["code"], "rate_limit_exceeded");
                retry_after = reply
                    .headers
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                assert!(retry_after.is_some(), "a 429 says when to come back");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => anyhow::bail!("unexpected {other}: {}", String::from_utf8_lossy(&reply.body())),
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let expected = 120.0 + 2.0 * elapsed;
    eprintln!(
        "requests_per_minute = 120: {admitted} admitted and {refused} refused in {elapsed:.2} s (expected {expected:.1})"
    );
    // Tolerance: ±3 requests (the refill of the last request's round trip, and the bucket's
    // start a little before the first request).
    assert!(
        (f64::from(admitted) - expected).abs() <= 3.0,
        "{admitted} admitted in {elapsed:.2} s, expected {expected:.1} ± 3 at 120/min"
    );
    assert!(refused > 0);
    assert_eq!(retry_after, Some(1), "the next request is at most half a second away");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_tokens_are_the_usage_its_answers_report() -> anyhow::Result<()> {
    let (gateway, admin, _keys) = start()?;
    let client = Client::plain(gateway.addr);
    let key = Some("sk-gamma-0123456789abcdef");
    let mut reported = 0u64;
    for round in 0..3u32 {
        let whole = client
            .chat(
                key,
                &chat_body("mock", &format!("round {round} whole"), 5 + round, false),
            )
            .await?;
        assert_eq!(whole.status, 200);
        reported += usage_of(&whole.json()?);
        let mut asked = chat_body("mock", &format!("round {round} streamed"), 7 + round, true);
        asked["stream_options"] = serde_json::json!({"include_usage": true});
        let streamed = client.chat(key, &asked).await?;
        let (usage, usage_only) = stream_usage(&streamed)?;
        assert!(usage > 0 && usage_only, "the client asked for usage and got it last");
        reported += usage;
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            tenant_tokens(&admin, "gamma").await.ok() == Some(reported as f64)
        })
        .await,
        "tenant gamma counted {} tokens; its answers reported {reported}",
        tenant_tokens(&admin, "gamma").await?
    );

    // A stream that did not ask for usage is counted all the same, and its client sees no
    // usage chunk: the same request asked with usage says how much it was.
    let mut twin = chat_body("mock", "unasked", 9, true);
    twin["stream_options"] = serde_json::json!({"include_usage": true});
    let (twin_usage, _) = stream_usage(&client.chat(key, &twin).await?)?;
    let before = reported + twin_usage;
    let unasked = client.chat(key, &chat_body("mock", "unasked", 9, true)).await?;
    let (seen, usage_only) = stream_usage(&unasked)?;
    assert_eq!(
        (seen, usage_only),
        (0, false),
        "no usage chunk the client did not ask for"
    );
    assert!(unasked.events().last().is_some_and(|(_, data)| data == "[DONE]"));
    assert!(
        eventually(Duration::from_secs(5), || async {
            tenant_tokens(&admin, "gamma").await.ok() == Some((before + twin_usage) as f64)
        })
        .await,
        "counted {}, expected {}",
        tenant_tokens(&admin, "gamma").await?,
        before + twin_usage
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_limit_waits_out_the_debt_and_the_keys_file_reloads() -> anyhow::Result<()> {
    let (gateway, _admin, keys_dir) = start()?;
    let client = Client::plain(gateway.addr);
    let delta = Some("sk-delta-0123456789abcdef");
    let first = client
        .chat(delta, &chat_body("mock", "a long answer", 700, false))
        .await?;
    assert_eq!(first.status, 200);
    let used = usage_of(&first.json()?);
    assert!(used > 600, "{used}");
    let over = client.chat(delta, &chat_body("mock", "more", 1, false)).await?;
    assert_eq!(over.status, 429);
    assert_eq!(over.json()?["error"]["type"], "tokens");
    let retry_after: f64 = over
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    // The debt (used - 600, plus 1 to admit) at 10 tokens a second, rounded up.
    let expected = (used as f64 - 600.0 + 1.0) / 10.0;
    assert!(
        retry_after >= expected.floor() && retry_after <= expected.ceil() + 1.0,
        "Retry-After {retry_after}, expected about {expected:.1}"
    );

    // A key added to the file works without a restart; a broken file changes nothing.
    let keys = keys_dir.path().join("keys.toml");
    let staged = keys.with_extension("new");
    std::fs::write(&staged, keys_file(&entry("sk-new-0123456789abcdef", "newcomer", "")))?;
    std::fs::rename(&staged, &keys)?;
    let body = chat_body("mock", "hello", 2, false);
    assert!(
        eventually(Duration::from_secs(5), || async {
            client
                .chat(Some("sk-new-0123456789abcdef"), &body)
                .await
                .is_ok_and(|reply| reply.status == 200)
        })
        .await,
        "the new key works after the file changed"
    );
    std::fs::write(&keys, "[[api_keys]]\nkey_sha256 = \"not a hash\"\ntenant = \"x\"\n")?;
    let metrics = || async {
        let text = String::from_utf8(client.send("GET", "/metrics", Vec::new()).await?.body())?;
        anyhow::Ok(metric_sum(
            &text,
            "switchyard_api_key_reloads_total",
            &["outcome=\"refused\""],
        ))
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            metrics().await.ok().is_some_and(|n| n >= 1.0)
        })
        .await,
        "the broken file is refused"
    );
    assert_eq!(client.chat(Some("sk-new-0123456789abcdef"), &body).await?.status, 200);
    Ok(())
}
