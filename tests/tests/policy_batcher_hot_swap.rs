//! Swapping the encoder queues' batching policy live: media requests (images, audio, video;
//! at least 150) stream through a TLS gateway to mocker encoders and LLM workers, each in its own
//! process, while the batcher is replaced again and again through the admin API — by the
//! built-ins and by hostile batchers that loop, name items that do not exist, leave items out
//! or trap. No client request may fail or lose its media: a hostile answer is replaced by the
//! host's fallback batching, counted, and the hostile version rolled back.
//!
//! A test binary of its own, outside `all`: its traffic runs for as long as the swaps take, so
//! on two cores a test running beside it in the same process slows the swaps, the traffic piles
//! up and the gateway's health checks time out (beside `planner_process` it failed that way).
//! Cargo runs test binaries one after another, so here it has the machine to itself.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_harness::{Alpn, Client, Gateway, Mockers, TestCa, metric_sum};
use switchyard_media::fixtures;

const TOKEN: &str = "batcher-hot-swap-token-0123456789";

fn request(index: usize) -> Value {
    let text = json!({"type": "text", "text": format!("request {index}: describe it")});
    let media = match index % 3 {
        0 => {
            json!({"type": "image_url", "image_url": {"url": fixtures::data_url("image/png", &fixtures::png(64 + index as u32, 48))}})
        }
        1 => {
            json!({"type": "input_audio", "input_audio": {"data": fixtures::base64(&fixtures::wav(16_000, 1, 1.0 + index as f64 / 100.0)), "format": "wav"}})
        }
        _ => {
            let mp4 = fixtures::Mp4Video {
                width: 336,
                height: 336,
                frames: 30 + (index % 60) as u32,
                fps: 30.0,
                ..fixtures::Mp4Video::default()
            }
            .build();
            json!({"type": "video_url", "video_url": {"url": fixtures::data_url("video/mp4", &mp4)}})
        }
    };
    json!({
        "model": "mock",
        "messages": [{"role": "user", "content": [text, media]}],
        "max_tokens": 4,
        "stream": index.is_multiple_of(2),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapping_batchers_under_load_loses_no_request_and_hostile_ones_fall_back() -> anyhow::Result<()> {
    let llm = Mockers::start(&["--num-workers", "2", "--speedup", "50"])?;
    // Encoders at the measured curves, about two-thirds busy under this traffic: bursts queue
    // several items at each flush, and the queues drain between bursts.
    let vision = Mockers::start(&["--role", "encoder"])?;
    let audio = Mockers::start(&["--role", "encoder", "--encodes", "audio"])?;
    let ca = TestCa::new()?;
    // A deadline generous for two busy cores (it is wall-clock time); a looping batcher still
    // hits it. Five failures roll a version back.
    // Compiled code is cached, so the hostile guest uploaded under four names compiles once.
    let cache = tempfile::tempdir()?;
    let mut config = format!(
        "mode = \"production\"\n{}\n[policy]\ndeadline_ms = 20\nmax_failures = 5\ncache_dir = \"{}\"\n\
         [encoders]\nbatcher = \"fcfs\"\nmax_items = 4\ndeadline_ms = 5\n",
        ca.tls_toml(),
        cache.path().display()
    );
    let budgets = "token_budgets = [576, 2304, 4608, 9216, 18432]\n";
    let workers = [
        (llm.addrs[0], "llm", "llm-0", ""),
        (llm.addrs[1], "llm", "llm-1", ""),
        (vision.addrs[0], "vision", "vision-0", budgets),
        (audio.addrs[0], "audio", "audio-0", budgets),
    ];
    for (addr, role, name, extra) in workers {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\nrole = \"{role}\"\n{extra}"
        ));
    }
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;

    // A router is not a batcher: refused at upload, the active batcher stays.
    let router = std::fs::read(concat!(env!("SWITCHYARD_PLUGINS_DIR"), "/least_load.wasm"))?;
    let (status, body) = admin.call("PUT", "/admin/batchers/not-a-batcher", router).await?;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("batcher world"), "{body}");

    let hostile = std::fs::read(concat!(env!("SWITCHYARD_GUESTS_DIR"), "/hostile_batcher.wasm"))?;
    let built_in = |name: &str| std::fs::read(format!("{}/{name}.wasm", env!("SWITCHYARD_PLUGINS_DIR")));
    let mut swaps: Vec<(String, Vec<u8>, Option<&str>)> = Vec::new();
    for round in 0..2 {
        swaps.push((format!("token-budget-{round}"), built_in("token_budget")?, None));
        swaps.push((format!("loop-{round}"), hostile.clone(), Some("loop")));
        swaps.push((format!("mixed-{round}"), built_in("mixed_modality")?, None));
        swaps.push((format!("bad-index-{round}"), hostile.clone(), Some("bad-index")));
        swaps.push((format!("drop-{round}"), hostile.clone(), Some("drop")));
        swaps.push((format!("trap-{round}"), hostile.clone(), Some("trap")));
        swaps.push((format!("fcfs-{round}"), built_in("fcfs")?, None));
    }

    // Bursts of six requests every 40 ms (so queues hold several items at each flush) for as
    // long as the swaps take, and at least 150 requests.
    let swapping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let traffic = {
        let (client, swapping) = (client.clone(), swapping.clone());
        tokio::spawn(async move {
            let mut requests = tokio::task::JoinSet::new();
            let mut index = 0usize;
            while index < 150 || swapping.load(std::sync::atomic::Ordering::Relaxed) {
                for _ in 0..6 {
                    let client = client.clone();
                    requests
                        .spawn(async move { (index, client.post_json("/v1/chat/completions", &request(index)).await) });
                    index += 1;
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            requests
        })
    };
    for (name, wasm, mode) in swaps {
        tokio::time::sleep(Duration::from_millis(40)).await;
        if let Some(mode) = mode {
            let (status, body) = admin
                .call(
                    "PUT",
                    &format!("/admin/batchers/{name}/config"),
                    format!("mode = \"{mode}\"").into_bytes(),
                )
                .await?;
            assert_eq!(status, 200, "{body}");
        }
        let (status, body) = admin
            .call("PUT", &format!("/admin/batchers/{name}?activate=true"), wasm)
            .await?;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(body["active"], true, "{name}: {body}");
    }
    swapping.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut requests = traffic.await?;

    let mut answered = 0;
    while let Some(joined) = requests.join_next().await {
        let (index, reply) = joined?;
        let reply = reply?;
        assert_eq!(
            reply.status,
            200,
            "request {index}: {}",
            String::from_utf8_lossy(&reply.body())
        );
        assert!(
            !reply.headers.contains_key("x-switchyard-media"),
            "request {index} lost its media: {:?}",
            reply.headers.get("x-switchyard-media")
        );
        assert!(reply.headers.contains_key("x-switchyard-merge"), "request {index}");
        if index.is_multiple_of(2) {
            let events = reply.events();
            assert!(events.iter().any(|(_, data)| data == "[DONE]"), "request {index}");
        }
        answered += 1;
    }
    assert!(answered >= 150, "{answered}");

    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    let decided = |outcome: &str| {
        metric_sum(
            &metrics,
            "switchyard_batcher_decisions_total",
            &[&format!("outcome=\"{outcome}\"")],
        )
    };
    assert!(decided("policy") > 0.0, "{metrics}");
    assert!(
        decided("fallback") > 0.0,
        "hostile batchers must have been replaced: {metrics}"
    );
    for kind in ["trap", "invalid_answer"] {
        assert!(
            metric_sum(
                &metrics,
                "switchyard_batcher_failures_total",
                &[&format!("kind=\"{kind}\"")]
            ) > 0.0,
            "no {kind} failure counted: {metrics}"
        );
    }
    // The last version published is a well-behaved one; it is active and answering.
    let (_, list) = admin.call("GET", "/admin/batchers", Vec::new()).await?;
    assert_eq!(list["active"]["name"], "fcfs-1", "{list}");
    assert!(metric_sum(&metrics, "switchyard_encoder_items_total", &["outcome=\"encoded\""]) > 0.0);
    assert_eq!(
        metric_sum(&metrics, "switchyard_encoder_items_total", &["outcome=\"unreachable\""]),
        0.0,
        "{metrics}"
    );
    drop((llm, vision, audio));
    Ok(())
}
