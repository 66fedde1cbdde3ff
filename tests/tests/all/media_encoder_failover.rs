//! An encoder dies mid-run: 100 mixed requests (images, audio, video, text) are in flight
//! through a TLS gateway to mocker LLM workers and mocker encoders, each in its own process,
//! when one vision encoder is killed. Every client request must still succeed: items at the
//! dead encoder are retried once on the other one (itself failing every third item, so some
//! items fail twice), and requests whose media could not be encoded are answered text-only,
//! flagged in `x-switchyard-media` and counted. Afterwards the LLM workers hold no feature
//! memory and track no request.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_harness::{Alpn, Client, Gateway, Mockers, TestCa, metric_sum};
use switchyard_media::fixtures;

fn request(kind: usize, index: usize) -> Value {
    let text = json!({"type": "text", "text": format!("request {index}: describe it")});
    let parts = match kind {
        0 => {
            json!([text, {"type": "image_url", "image_url": {"url": fixtures::data_url("image/png", &fixtures::png(64 + index as u32, 64))}}])
        }
        1 => {
            json!([text, {"type": "input_audio", "input_audio": {"data": fixtures::base64(&fixtures::wav(16_000, 1, 1.0 + index as f64 / 100.0)), "format": "wav"}}])
        }
        2 => {
            let mp4 = fixtures::Mp4Video {
                width: 336,
                height: 336,
                frames: 60 + index as u32,
                fps: 30.0,
                ..fixtures::Mp4Video::default()
            }
            .build();
            json!([text, {"type": "video_url", "video_url": {"url": fixtures::data_url("video/mp4", &mp4)}}])
        }
        _ => json!(format!("request {index}: just text")),
    };
    json!({
        "model": "mock",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 4,
        "stream": index.is_multiple_of(2),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_encoder_fails_no_client_request() -> anyhow::Result<()> {
    let llm = Mockers::start(&["--num-workers", "2", "--speedup", "50"])?;
    // Slow encoders (every encode 40 times the measured curve) so that work is queued at the
    // one that dies; the survivor also fails every third item.
    let mut doomed = Mockers::start(&["--role", "encoder", "--cost-scale", "40"])?;
    let survivor = Mockers::start(&["--role", "encoder", "--cost-scale", "40", "--fail-every", "3"])?;
    let audio = Mockers::start(&["--role", "encoder", "--encodes", "audio", "--cost-scale", "40"])?;
    let ca = TestCa::new()?;
    let mut config = format!(
        "mode = \"production\"\n{}\n[encoders]\ntimeout_ms = 5000\n[health]\ninterval_ms = 200\n",
        ca.tls_toml()
    );
    let workers = [
        (llm.addrs[0], "llm", "llm-0"),
        (llm.addrs[1], "llm", "llm-1"),
        (doomed.addrs[0], "vision", "vision-doomed"),
        (survivor.addrs[0], "vision", "vision-survivor"),
        (audio.addrs[0], "audio", "audio-0"),
    ];
    for (addr, role, name) in workers {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\nrole = \"{role}\"\n"
        ));
    }
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;

    let mut requests = Vec::new();
    for index in 0..100 {
        let client = client.clone();
        let body = request(index % 4, index);
        requests.push(tokio::spawn(async move {
            client.post_json("/v1/chat/completions", &body).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    doomed.process.kill();

    let mut flagged = 0;
    for (index, request) in requests.into_iter().enumerate() {
        let reply = request.await??;
        assert_eq!(
            reply.status,
            200,
            "request {index}: {}",
            String::from_utf8_lossy(&reply.body())
        );
        if reply.headers.contains_key("x-switchyard-media") {
            assert_eq!(reply.headers["x-switchyard-media"], "text-only; reason=encoder-failed");
            flagged += 1;
        } else if index % 4 != 3 {
            assert!(reply.headers.contains_key("x-switchyard-merge"), "request {index}");
        }
        if index.is_multiple_of(2) {
            let events = reply.events();
            assert!(events.iter().any(|(_, data)| data == "[DONE]"), "request {index}");
            assert!(
                !events.iter().any(|(_, data)| data.contains("\"error\"")),
                "request {index}"
            );
        }
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert!(
        flagged > 0,
        "the survivor's injected failures must leave some items failed twice"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "switchyard_media_text_only_total",
            &["reason=\"encoder_failed\""]
        ),
        f64::from(flagged),
        "{metrics}"
    );
    assert!(
        metric_sum(&metrics, "switchyard_encoder_retries_total", &[]) > 0.0,
        "{metrics}"
    );

    // Feature memory on the LLM workers returns to zero (a cancelled stream is released as its
    // connection closes, so allow a moment).
    for addr in &llm.addrs {
        let worker = Client::plain(*addr);
        let mut held = f64::NAN;
        for _ in 0..50 {
            let text = String::from_utf8(worker.send("GET", "/metrics", "").await?.body())?;
            held = [
                "switchyard_mocker_feature_cpu_bytes",
                "switchyard_mocker_feature_gpu_bytes",
                "switchyard_mocker_feature_requests",
            ]
            .iter()
            .map(|name| metric_sum(&text, name, &[]))
            .sum();
            if held == 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(held, 0.0, "worker {addr} still holds features");
    }
    drop(survivor);
    drop(audio);
    Ok(())
}
