//! Latency targets per request: from headers, else the model's defaults; the TTFT target
//! reaches the router; each answer is judged against its targets (attainment per model and
//! worker) and its cost served is counted from the worker's `cost`.

use std::path::PathBuf;

use switchyard_harness::{Client, Gateway, chat_body, metric_sum};

const TOKEN: &str = "latency-targets-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_reach_the_router_and_answers_are_judged_against_them() -> anyhow::Result<()> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nspeedup = 20.0\n",
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    let guest = std::fs::read(PathBuf::from(env!("SWITCHYARD_GUESTS_DIR")).join("by_target.wasm"))?;
    let (status, body) = admin
        .call("PUT", "/admin/policies/by-target?activate=true", guest)
        .await?;
    assert_eq!(status, 200, "{body}");

    let whole = chat_body("mock", "how fast?", 8, false);
    let streamed = chat_body("mock", "how fast?", 8, true);
    // The router sees 0 without a target (first worker) and the header's with one (last).
    let loose = [("x-switchyard-ttft-ms", "10000"), ("x-switchyard-itl-ms", "1000")];
    let first = client.chat_with_headers(&whole, &[]).await?.worker();
    let last = client.chat_with_headers(&whole, &loose).await?.worker();
    assert!(
        !first.is_empty() && !last.is_empty() && first != last,
        "{first} / {last}"
    );
    let refused = client
        .chat_with_headers(&whole, &[("x-switchyard-ttft-ms", "soon")])
        .await?;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.json()?["error"]["code"], "invalid_latency_target");

    // Streams judged: loose targets are met, a 0.001 ms one is not.
    for _ in 0..3 {
        assert_eq!(client.chat_with_headers(&streamed, &loose).await?.status, 200);
    }
    let tight = [("x-switchyard-ttft-ms", "0.001"), ("x-switchyard-itl-ms", "0.001")];
    for _ in 0..2 {
        let reply = client.chat_with_headers(&streamed, &tight).await?;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), last);
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", Vec::new()).await?.body())?;
    let count = |target: &str, met: &str| {
        metric_sum(
            &metrics,
            "switchyard_slo_requests_total",
            &[
                "model=\"mock\"",
                &format!("target=\"{target}\""),
                &format!("met=\"{met}\""),
            ],
        )
    };
    // TTFT: the whole answer with a target and three streams met it, two tight streams did
    // not; the answer without a target is not judged.
    assert_eq!((count("ttft", "true"), count("ttft", "false")), (4.0, 2.0), "{metrics}");
    // ITL: streams only (a whole answer shows no gap between its tokens).
    assert_eq!((count("itl", "true"), count("itl", "false")), (3.0, 2.0), "{metrics}");
    let on_last = metric_sum(
        &metrics,
        "switchyard_slo_requests_total",
        &[&format!("worker=\"{last}\""), "target=\"ttft\""],
    );
    assert_eq!(on_last, 6.0, "every request with a target went to {last}");
    // Cost served: the embedded workers cost 1 a token, so it equals the tokens served.
    let cost = metric_sum(&metrics, "switchyard_cost_served_total", &["model=\"mock\""]);
    let tokens = metric_sum(&metrics, "switchyard_tokens_served_total", &["model=\"mock\""]);
    assert!(
        tokens > 7.0 * 8.0,
        "prompt and completion tokens of seven answers: {tokens}"
    );
    assert!(
        (cost - tokens).abs() < 1e-6,
        "cost {cost} for {tokens} tokens at cost 1"
    );
    Ok(())
}
