//! The whole multimodal path on native models, on this machine: the gateway (TLS) in front of
//! two `switchyard-encoder`s (vision: the tiny LLaVA's CLIP tower and projector; audio: a tiny
//! Whisper of the LLM's width) and a `switchyard-llm` serving the tiny LLaVA's language
//! model. An image, a video (H.264 MP4) and an audio question are answered, streamed: the gateway sizes
//! the media from their headers, the encoders decode, preprocess and encode them and push f16
//! feature rows to the worker, which merges them at the placeholders and prefills. The lifecycle
//! shows in the metrics (items encoded, a feature-cache hit on a repeat), no answer is
//! text-only, and a repeated image gives the same greedy answer.

use anyhow::Context;
use serde_json::{Value, json};
use switchyard_harness::fixtures::encoder as encoder_fixture;
use switchyard_harness::{Alpn, Client, Gateway, NativeEncoder, NativeWorker, TestCa, metric_sum};
use switchyard_media::fixtures;
use switchyard_protocol::encode::parse_merge;

fn chat(parts: Value) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    })
}

/// Streams `request`; returns the answer text and the merge report.
async fn ask(client: &Client, request: &Value) -> anyhow::Result<(String, String)> {
    let reply = client.post_json("/v1/chat/completions", request).await?;
    anyhow::ensure!(reply.status == 200, "{}", String::from_utf8_lossy(&reply.body()));
    anyhow::ensure!(
        reply.headers.get("x-switchyard-media").is_none(),
        "answered text-only: {:?}",
        reply.headers
    );
    let merge = reply
        .headers
        .get("x-switchyard-merge")
        .context("no merge report")?
        .to_str()?
        .to_string();
    let events = reply.events();
    anyhow::ensure!(events.iter().any(|(_, data)| data == "[DONE]"), "no [DONE]");
    let text: String = events
        .iter()
        .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    Ok((text, merge))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_video_and_audio_questions_are_answered_by_native_models() -> anyhow::Result<()> {
    let llava = encoder_fixture("tiny-llava");
    let llava = llava.to_str().context("fixture path is not UTF-8")?;
    let whisper = encoder_fixture("tiny-whisper-48");
    let whisper = whisper.to_str().context("fixture path is not UTF-8")?;
    // `SWITCHYARD_E2E_DEVICE=cuda:0` runs the encoders and the worker on a GPU (binaries built
    // with `--features cuda`; `scripts/gpu-check.sh` does so); the CPU by default.
    let device = std::env::var("SWITCHYARD_E2E_DEVICE").unwrap_or_else(|_| "cpu".to_string());
    let common = [
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--threads",
        "1",
        "--device",
        device.as_str(),
    ];
    let vision = NativeEncoder::start(&[&["--model", llava][..], &common[..]].concat())?;
    let audio = NativeEncoder::start(&[&["--model", whisper][..], &common[..]].concat())?;
    let worker = NativeWorker::start(
        &[
            &["--model", llava, "--block-size", "4", "--kv-cache-mib", "8"][..],
            &common[..],
        ]
        .concat(),
    )?;
    let ca = TestCa::new()?;
    let mut config = format!(
        "mode = \"production\"\n{}\n\
         [[models]]\nname = \"tiny\"\nblock_size = 4\nmax_model_len = 256\ntokenizer = \"{llava}/tokenizer.json\"\n\
         [models.media]\nimage_size = 32\npatch_size = 8\nhidden_size = 48\nmax_visual_tokens = 128\n",
        ca.tls_toml()
    );
    for (addr, role, name) in [
        (worker.addr, "llm", "llava-llm"),
        (vision.addr, "vision", "llava-vision"),
        (audio.addr, "audio", "whisper-audio"),
    ] {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"tiny\"\nrole = \"{role}\"\nblock_size = 4\n"
        ));
    }
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;

    let png = std::fs::read(encoder_fixture("images/gradient.png"))?;
    let image = json!({"type": "image_url", "image_url": {"url": fixtures::data_url("image/png", &png)}});
    let question = json!({"type": "text", "text": "what is in the picture?"});
    let (first, merge) = ask(&client, &chat(json!([question.clone(), image.clone()]))).await?;
    let (len, spans) = parse_merge(&merge).context("a merge report")?;
    // A 32-pixel CLIP tower with 8-pixel patches: 16 rows, merged inside the prompt.
    anyhow::ensure!(spans.len() == 1 && spans[0].end - spans[0].start == 16, "{merge}");
    anyhow::ensure!((spans[0].end as usize) < len, "{merge}");
    anyhow::ensure!(!first.is_empty(), "an answer");
    // The same image again: its features come from the encoder's cache, and the greedy answer
    // is the same.
    let (again, _) = ask(&client, &chat(json!([question, image]))).await?;
    anyhow::ensure!(again == first, "{again:?} != {first:?}");

    // A video: 20 frames at 10 fps, sampled at 2 fps (frames 0, 5, 10, 15), decoded from H.264
    // at the encoder, pooled in pairs: two frames' worth of rows.
    let mp4 = std::fs::read(encoder_fixture("videos/baseline.mp4"))?;
    let movie = json!({"type": "video_url", "video_url": {"url": fixtures::data_url("video/mp4", &mp4)}});
    let (watched, merge) = ask(
        &client,
        &chat(json!([{"type": "text", "text": "what happens?"}, movie])),
    )
    .await?;
    let (_, spans) = parse_merge(&merge).context("a merge report")?;
    anyhow::ensure!(spans.len() == 1 && spans[0].end - spans[0].start == 32, "{merge}");
    anyhow::ensure!(!watched.is_empty(), "an answer");

    let wav = std::fs::read(encoder_fixture("audio/tone.wav"))?;
    let clip = json!({"type": "input_audio", "input_audio": {"data": fixtures::base64(&wav), "format": "wav"}});
    let (heard, merge) = ask(
        &client,
        &chat(json!([clip, {"type": "text", "text": "what do you hear?"}])),
    )
    .await?;
    let (_, spans) = parse_merge(&merge).context("a merge report")?;
    // 3.7 s at 25 rows a second.
    anyhow::ensure!(spans.len() == 1 && spans[0].end - spans[0].start == 93, "{merge}");
    anyhow::ensure!(!heard.is_empty(), "an answer");

    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    anyhow::ensure!(
        metric_sum(&metrics, "switchyard_media_text_only_total", &[]) == 0.0,
        "{metrics}"
    );
    let encoder_metrics = |addr| async move {
        let body = Client::plain(addr).send("GET", "/metrics", "").await?.body();
        anyhow::Ok(String::from_utf8(body)?)
    };
    let vision_metrics = encoder_metrics(vision.addr).await?;
    anyhow::ensure!(
        metric_sum(&vision_metrics, "switchyard_encoder_encoded_items_total", &[]) == 2.0
            && metric_sum(&vision_metrics, "switchyard_encoder_cache_hits_total", &[]) == 1.0,
        "{vision_metrics}"
    );
    let audio_metrics = encoder_metrics(audio.addr).await?;
    anyhow::ensure!(
        metric_sum(&audio_metrics, "switchyard_encoder_encoded_items_total", &[]) == 1.0,
        "{audio_metrics}"
    );
    if device != "cpu" {
        // The forward passes ran on the GPU: the graph cache saw them.
        for metrics in [&vision_metrics, &audio_metrics] {
            let passes = metric_sum(metrics, "switchyard_encoder_cuda_graph_replays_total", &[])
                + metric_sum(metrics, "switchyard_encoder_cuda_eager_passes_total", &[]);
            anyhow::ensure!(passes >= 1.0, "no GPU forward pass on {device}: {metrics}");
        }
    }
    Ok(())
}
