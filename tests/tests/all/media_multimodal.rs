//! Media in the OpenAI API through a TLS gateway: image, audio and video parts are read from
//! their headers, sized in tokens under the model's `[models.media]` settings, encoded by the
//! embedded mocker encoders (vision and audio), pushed to the LLM worker and merged at the
//! position map's spans, which the worker reports (`x-switchyard-merge`). A repeated item is
//! served from an encoder's feature cache. Bad media is a 400 naming the content part, and
//! never reaches a worker. Without an encoder of the item's kind the answer is text-only and
//! says so.

use serde_json::{Value, json};
use switchyard_harness::{Alpn, Client, Gateway, TestCa, metric_sum};
use switchyard_media::fixtures;
use switchyard_protocol::encode::parse_merge;

fn chat_with_parts(parts: Value, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "mock",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

fn image_part(url: String) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn video_part(url: String) -> Value {
    json!({"type": "video_url", "video_url": {"url": url}})
}

fn audio_part(data: String, format: &str) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": data, "format": format}})
}

fn text_part(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

fn mp4(seconds: u32, fps: f64) -> Vec<u8> {
    fixtures::Mp4Video {
        width: 336,
        height: 336,
        frames: (f64::from(seconds) * fps) as u32,
        fps,
        ..fixtures::Mp4Video::default()
    }
    .build()
}

/// Asserts a 400 whose `param` names the part and whose message says `why`.
fn assert_part_error(reply: &switchyard_harness::Reply, param: &str, why: &str) {
    let body: Value = serde_json::from_slice(&reply.body()).unwrap_or(Value::Null);
    assert_eq!(reply.status.as_u16(), 400, "{body}");
    assert_eq!(body["error"]["param"], param, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(why), "`{why}` not in: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_is_sized_from_headers_and_bad_media_is_refused_by_part() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let config = format!(
        "mode = \"production\"\n{}\n[embedded_mockers]\ncount = 2\nspeedup = 1000.0\n\
         [[models]]\nname = \"mock\"\nmax_model_len = 16384\n[models.media]\nmax_visual_tokens = 8192\n",
        ca.tls_toml()
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let png = fixtures::data_url("image/png", &fixtures::png(640, 480));

    // An image, an audio clip and a video, whole and streamed: encoded, merged, answered. The
    // worker's report must show each item's span as long as its estimate (576 tokens for a
    // 336-pixel image, 2 s × 25 tokens of audio, 10 pooled frame pairs × 576 of video) and a
    // merged length equal to the prompt tokens it answered with.
    let expected_spans = [576u32, 50, 5760];
    let requests = [
        json!([text_part("what is this?"), image_part(png.clone())]),
        json!([
            audio_part(fixtures::base64(&fixtures::wav(16_000, 1, 2.0)), "wav"),
            text_part("transcribe")
        ]),
        json!([
            text_part("describe"),
            video_part(fixtures::data_url("video/mp4", &mp4(10, 30.0)))
        ]),
    ];
    for (parts, span) in requests.iter().zip(expected_spans) {
        for stream in [false, true] {
            let reply = client
                .post_json("/v1/chat/completions", &chat_with_parts(parts.clone(), 4, stream))
                .await?;
            assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
            assert!(reply.headers.get("x-switchyard-media").is_none(), "{:?}", reply.headers);
            let merge = reply.headers["x-switchyard-merge"].to_str()?;
            let (len, spans) = parse_merge(merge).expect("a merge report");
            assert_eq!(spans.len(), 1, "{merge}");
            assert_eq!(spans[0].end - spans[0].start, span, "{merge}");
            assert!(spans[0].end as usize <= len);
            if stream {
                let events = reply.events();
                assert!(events.iter().any(|(_, data)| data == "[DONE]"));
                let usage = events
                    .iter()
                    .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
                    .find(|chunk| chunk["usage"].is_object())
                    .expect("a usage chunk");
                assert_eq!(usage["usage"]["prompt_tokens"], len, "{merge}");
            } else {
                let body = reply.json()?;
                assert!(body["choices"][0]["message"]["content"].is_string());
                assert_eq!(body["usage"]["prompt_tokens"], len, "{merge}");
            }
        }
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    let tokens = |kind: &str| {
        metric_sum(
            &metrics,
            "switchyard_media_tokens_total",
            &[&format!("kind=\"{kind}\"")],
        )
    };
    // Fixed 336-pixel resolution, 14-pixel patches: 576 tokens an image, twice.
    assert_eq!(tokens("image"), 2.0 * 576.0, "{metrics}");
    // 2 s at 25 tokens a second, twice.
    assert_eq!(tokens("audio"), 2.0 * 50.0, "{metrics}");
    // 10 s at 30 fps sampled at 2 fps: 20 frames, pooled in pairs: 10 × 576, twice.
    assert_eq!(tokens("video"), 2.0 * 10.0 * 576.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "switchyard_media_text_only_total", &[]), 0.0);
    // Each item was encoded once; its repeat (the streamed request) was a feature-cache hit.
    assert_eq!(
        metric_sum(&metrics, "switchyard_encoder_items_total", &["outcome=\"encoded\""]),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "switchyard_encoder_items_total", &["outcome=\"cached\""]),
        3.0,
        "{metrics}"
    );
    assert_eq!(metric_sum(&metrics, "switchyard_encoder_cache_routed_total", &[]), 3.0);

    // Bad media: a 400 naming the part, before any worker is asked.
    let png_bytes = fixtures::png(64, 64);
    let truncated = fixtures::data_url("image/png", &png_bytes[..png_bytes.len() - 20]);
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_with_parts(json!([text_part("a"), image_part(truncated)]), 4, false),
        )
        .await?;
    assert_part_error(&reply, "messages[0].content[1]", "truncated PNG");

    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_with_parts(
                json!([image_part("data:image/png;base64,@@not base64@@".into())]),
                4,
                false,
            ),
        )
        .await?;
    assert_part_error(&reply, "messages[0].content[0]", "base64");

    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_with_parts(json!([image_part("https://example.com/cat.png".into())]), 4, false),
        )
        .await?;
    assert_part_error(&reply, "messages[0].content[0]", "fetch");

    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_with_parts(
                json!([
                    text_part("x"),
                    text_part("y"),
                    audio_part(fixtures::base64(&fixtures::wav(16_000, 1, 1.0)), "mp3")
                ]),
                4,
                false,
            ),
        )
        .await?;
    assert_part_error(&reply, "messages[0].content[2]", "mp3");

    // A video when text and answer already fill the context: no room, a 400.
    let video = fixtures::data_url("video/mp4", &mp4(4, 30.0));
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_with_parts(json!([video_part(video.clone())]), 16_384, false),
        )
        .await?;
    assert_part_error(&reply, "messages", "no room");
    // The same video with room for its frames is served.
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat_with_parts(json!([video_part(video)]), 4, false),
        )
        .await?;
    assert_eq!(reply.status, 200);

    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_encoder_items_total", &[]),
        7.0,
        "refused media never reached an encoder: {metrics}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_encoder_the_answer_is_text_only_and_flagged() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let config = format!(
        "mode = \"production\"\n{}\n[embedded_mockers]\ncount = 1\nspeedup = 1000.0\naudio_encoders = 0\n",
        ca.tls_toml()
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let audio = audio_part(fixtures::base64(&fixtures::wav(16_000, 1, 1.0)), "wav");
    let reply = client
        .post_json("/v1/chat/completions", &chat_with_parts(json!([audio]), 4, false))
        .await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers["x-switchyard-media"], "text-only; reason=no-encoder");
    assert!(reply.headers.get("x-switchyard-merge").is_none());
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_media_text_only_total", &["reason=\"no_encoder\""]),
        1.0
    );
    Ok(())
}

/// `modality-aware` chooses the encoder with the worker: two machines, each with an LLM worker
/// and a vision encoder (separate processes, told apart by `node`). With idle queues the
/// features never cross machines, so every image is encoded beside the worker that answers;
/// and with the router's encoders named in the decision, the host's cache-first placement is
/// not what put it there (the first sight of each image is a miss everywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modality_aware_encodes_on_the_answering_workers_machine() -> anyhow::Result<()> {
    let llm = switchyard_harness::Mockers::start(&["--num-workers", "2", "--speedup", "100"])?;
    let vision = switchyard_harness::Mockers::start(&["--role", "encoder", "--num-workers", "2"])?;
    let ca = TestCa::new()?;
    let mut config = format!(
        "mode = \"production\"\n{}\n[policy]\nrouter = \"modality-aware\"\ndeadline_ms = 50\n",
        ca.tls_toml()
    );
    let workers = [
        (llm.addrs[0], "llm", "llm-a", "machine-a"),
        (llm.addrs[1], "llm", "llm-b", "machine-b"),
        (vision.addrs[0], "vision", "vision-a", "machine-a"),
        (vision.addrs[1], "vision", "vision-b", "machine-b"),
    ];
    for (addr, role, name, node) in workers {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\nrole = \"{role}\"\nnode = \"{node}\"\n"
        ));
    }
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let encoded = |metrics: &str, encoder: &str| {
        metric_sum(
            metrics,
            "switchyard_encoder_items_total",
            &[&format!("encoder=\"{encoder}\"")],
        )
    };
    let mut answered_by = std::collections::HashSet::new();
    let mut before = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    for index in 0..16u32 {
        let image = image_part(fixtures::data_url("image/png", &fixtures::png(40 + index, 40)));
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat_with_parts(json!([text_part(&format!("picture {index}")), image]), 2, false),
            )
            .await?;
        assert_eq!(reply.status, 200);
        assert!(reply.headers.contains_key("x-switchyard-merge"), "request {index}");
        let policy = reply.headers["x-switchyard-policy"].to_str()?;
        assert!(policy.starts_with("modality-aware@"), "{policy}");
        let worker = reply.headers["x-switchyard-worker"].to_str()?.to_string();
        let beside = worker.replace("llm-", "vision-");
        let across = if beside == "vision-a" { "vision-b" } else { "vision-a" };
        // The gateway counts an item when the encoder's answer reaches it, which may be just
        // after the worker's (the features went to the worker first).
        let mut after = String::new();
        for _ in 0..100 {
            after = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
            let counted = encoded(&after, "vision-a") + encoded(&after, "vision-b");
            if counted > encoded(&before, "vision-a") + encoded(&before, "vision-b") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(
            (
                encoded(&after, &beside) - encoded(&before, &beside),
                encoded(&after, across) - encoded(&before, across)
            ),
            (1.0, 0.0),
            "request {index} answered by {worker}: its image must be encoded by {beside}"
        );
        answered_by.insert(worker);
        before = after;
    }
    assert_eq!(
        answered_by.len(),
        2,
        "idle, equal workers share the requests: {answered_by:?}"
    );
    Ok(())
}

/// An image whose headers are sound but whose data is damaged passes the gateway's header
/// probe and fails to decode at the encoder: that is the client's error, a 400 naming the part
/// (streamed or not: no response has begun, since the worker waits for the features), not an
/// encoder failure: no retry elsewhere and no text-only answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_that_fails_to_decode_at_the_encoder_is_the_clients_error() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let config = format!(
        "mode = \"production\"\n{}\n[embedded_mockers]\ncount = 1\nspeedup = 100.0\nvision_encoders = 2\n",
        ca.tls_toml()
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let mut damaged = fixtures::png(64, 64);
    // A byte inside the IDAT chunk's data (signature 8, IHDR 25, IDAT header 8).
    damaged[8 + 25 + 8 + 100] ^= 0xA5;
    for stream in [false, true] {
        let parts = json!([
            text_part("what is it?"),
            image_part(fixtures::data_url("image/png", &damaged))
        ]);
        let reply = client
            .post_json("/v1/chat/completions", &chat_with_parts(parts, 4, stream))
            .await?;
        assert_part_error(&reply, "messages[0].content[1]", "cannot decode");
        assert!(reply.headers.get("x-switchyard-media").is_none());
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(
        metric_sum(
            &metrics,
            "switchyard_encoder_items_total",
            &["outcome=\"decode_error\""]
        ),
        2.0,
        "{metrics}"
    );
    assert_eq!(metric_sum(&metrics, "switchyard_encoder_retries_total", &[]), 0.0);
    assert_eq!(metric_sum(&metrics, "switchyard_media_text_only_total", &[]), 0.0);
    // The same image undamaged goes through.
    let parts = json!([
        text_part("what is it?"),
        image_part(fixtures::data_url("image/png", &fixtures::png(64, 64)))
    ]);
    let reply = client
        .post_json("/v1/chat/completions", &chat_with_parts(parts, 4, false))
        .await?;
    assert_eq!(reply.status, 200);
    assert!(reply.headers.contains_key("x-switchyard-merge"));
    Ok(())
}

/// Without an encoder pool (`[encoders] local = true`) each LLM worker encodes its requests'
/// media itself: the request is answered with its media merged although no encoder exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_encoder_pool_the_worker_encodes_locally() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let config = format!(
        "mode = \"production\"\n{}\n[embedded_mockers]\ncount = 1\nspeedup = 100.0\nvision_encoders = 0\naudio_encoders = 0\n[encoders]\nlocal = true\n",
        ca.tls_toml()
    );
    let gateway = Gateway::start(&config)?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::H2, None)?;
    let audio = audio_part(fixtures::base64(&fixtures::wav(16_000, 1, 2.0)), "wav");
    let image = image_part(fixtures::data_url("image/png", &fixtures::png(336, 336)));
    for stream in [false, true] {
        let parts = json!([text_part("describe both"), image.clone(), audio.clone()]);
        let reply = client
            .post_json("/v1/chat/completions", &chat_with_parts(parts, 4, stream))
            .await?;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        assert!(reply.headers.get("x-switchyard-media").is_none(), "{:?}", reply.headers);
        let merge = parse_merge(reply.headers["x-switchyard-merge"].to_str()?).expect("a merge report");
        let lengths: Vec<u32> = merge.1.iter().map(|span| span.end - span.start).collect();
        assert_eq!(lengths, [576, 50], "the image's and the audio's spans");
    }
    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(metric_sum(&metrics, "switchyard_encoder_items_total", &[]), 0.0);
    Ok(())
}
