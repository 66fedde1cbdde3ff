//! `switchyard-encoder` over HTTP with real models: the tiny LLaVA's vision tower and the tiny
//! Whisper from `tests/fixtures/encoders`. A batch goes in as the gateway sends it; the
//! features pushed to the (stand-in) LLM worker must be exactly what the library computes for
//! the same bytes, in f16 rows of the model's width and row count; bad bytes are the client's
//! error (an MP4 without real H.264 too), a video's picked frames are decoded, encoded and
//! pooled in time, a repeat is served from the feature cache, the
//! metrics count all of it, and SIGTERM ends the process cleanly.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_encoders::audio;
use switchyard_encoders::image::{ImageProcessor, PixelValues};
use switchyard_encoders::mel::{LogMel, MelConfig};
use switchyard_encoders::tensor::to_f16_le;
use switchyard_encoders::video;
use switchyard_encoders::vit::VisionEncoder;
use switchyard_encoders::whisper::WhisperEncoder;
use switchyard_harness::{NativeEncoder, blocking, fixtures};
use switchyard_media::{MediaId, MediaKind};
use switchyard_protocol::encode::{Delivery, EncodeBatch, EncodeItem, EncodeReply, ItemStatus};

/// One pushed feature body: its path, headers and bytes.
#[derive(Debug, Clone)]
struct Push {
    path: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

/// A stand-in LLM worker that takes feature pushes and records them.
fn receiver() -> (SocketAddr, Arc<Mutex<Vec<Push>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let pushes = Arc::new(Mutex::new(Vec::new()));
    let sink = pushes.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or_default().to_string();
            let mut headers = HashMap::new();
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
                    break;
                }
                if let Some((name, value)) = header.split_once(':') {
                    headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
                }
            }
            let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
            let mut body = vec![0u8; len];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            sink.lock().expect("lock").push(Push { path, headers, body });
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    (addr, pushes)
}

fn item(bytes: &[u8], kind: MediaKind, format: &str, worker: SocketAddr, slot: usize, with_data: bool) -> EncodeItem {
    EncodeItem {
        media_id: MediaId::of(bytes),
        kind,
        tokens: 16,
        frames: if kind == MediaKind::Video {
            vec![0, 1]
        } else {
            Vec::new()
        },
        duration_s: 0.0,
        format: format.into(),
        data: with_data.then(|| switchyard_media::fixtures::base64(bytes)),
        deliver: Delivery {
            url: format!("http://{worker}"),
            request: "req-1".into(),
            slot,
        },
    }
}

fn post_batch(encoder: SocketAddr, items: Vec<EncodeItem>) -> EncodeReply {
    let body = serde_json::to_string(&EncodeBatch { items }).expect("batch");
    let (status, reply) = blocking::post(encoder, "/v1/encode", &body);
    assert_eq!(status, 200, "{reply}");
    serde_json::from_str(&reply).expect("reply")
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{']))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

fn sigterm(encoder: &mut NativeEncoder) {
    encoder.process.terminate().expect("kill");
    let exit = encoder
        .process
        .wait_exit(Duration::from_secs(60))
        .expect("the encoder exits");
    assert!(exit.success(), "exit status {exit}");
}

#[test]
fn vision_encoder_pushes_the_models_features() {
    let _turn = switchyard_harness::turn();
    let (worker, pushes) = receiver();
    let model = fixtures::encoder("tiny-llava");
    let mut encoder = NativeEncoder::start(&[
        "--model",
        model.to_str().expect("utf-8"),
        "--port",
        "0",
        "--served-model-name",
        "tiny-llava",
    ])
    .expect("the encoder starts");
    let addr = encoder.addr;
    let png = std::fs::read(fixtures::encoder("images/gradient.png")).expect("png");
    let webp = std::fs::read(fixtures::encoder("images/alpha.webp")).expect("webp");
    let mut broken = png.clone();
    let middle = broken.len() / 2;
    broken[middle] ^= 0xff;
    // An MP4 whose samples are placeholders, not H.264: the client's error.
    let placeholder = switchyard_media::fixtures::Mp4Video::default().build();
    let mp4 = std::fs::read(fixtures::encoder("videos/baseline.mp4")).expect("mp4");
    let frames = [0u32, 5, 10];
    let mut movie = item(&mp4, MediaKind::Video, "mp4", worker, 4, true);
    movie.frames = frames.to_vec();
    let reply = post_batch(
        addr,
        vec![
            item(&png, MediaKind::Image, "png", worker, 0, true),
            item(&broken, MediaKind::Image, "png", worker, 1, true),
            item(&webp, MediaKind::Image, "webp", worker, 2, true),
            item(&placeholder, MediaKind::Video, "mp4", worker, 3, true),
            movie,
        ],
    );
    let statuses: Vec<ItemStatus> = reply.items.iter().map(|i| i.status).collect();
    assert_eq!(
        statuses,
        vec![
            ItemStatus::Encoded,
            ItemStatus::DecodeError,
            ItemStatus::Encoded,
            ItemStatus::DecodeError,
            ItemStatus::Encoded,
        ]
    );
    assert_eq!(reply.batch_size, 4, "the damaged PNG is refused before the device");
    assert!(
        reply.items[3]
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("the video does not decode"),
        "{reply:?}"
    );
    assert_eq!(reply.items[0].tokens, 16);
    // Three frames pooled in pairs: two frames' worth of rows.
    assert_eq!(reply.items[4].tokens, 32);

    // What the library computes for the same bytes, as f16 rows.
    let library = VisionEncoder::load(&model).expect("loads");
    let processor = ImageProcessor::from_file(&model.join("preprocessor_config.json")).expect("processor");
    let pushed = pushes.lock().expect("lock").clone();
    assert_eq!(pushed.len(), 3, "{pushed:?}");
    for (bytes, slot) in [(&png, 0), (&webp, 2)] {
        let push = pushed
            .iter()
            .find(|p| p.path == format!("/v1/features/req-1/{slot}"))
            .expect("pushed");
        assert_eq!(push.headers["x-switchyard-tokens"], "16");
        assert_eq!(push.headers["x-switchyard-feature-dim"], "48");
        assert_eq!(push.headers["x-switchyard-media-id"], MediaId::of(bytes).to_string());
        let pixels = processor.preprocess(bytes).expect("preprocess");
        let features = library.encode(&[&pixels]).expect("encode");
        assert_eq!(push.body, to_f16_le(&features.data), "slot {slot}: features differ");
    }
    let push = pushed
        .iter()
        .find(|p| p.path == "/v1/features/req-1/4")
        .expect("video pushed");
    assert_eq!(push.headers["x-switchyard-tokens"], "32");
    let pixels: Vec<PixelValues> = video::decode_frames(&mp4, &frames, u64::MAX)
        .expect("decodes")
        .iter()
        .map(|yuv| processor.preprocess_rgb(&yuv.to_rgb()).expect("preprocess"))
        .collect();
    let pooled = library
        .encode_video(&pixels.iter().collect::<Vec<_>>(), 2)
        .expect("encode");
    assert_eq!(push.body, to_f16_le(&pooled), "video features differ");

    // The same image again, without its bytes: served from the feature cache.
    let reply = post_batch(addr, vec![item(&png, MediaKind::Image, "png", worker, 4, false)]);
    assert_eq!(reply.items[0].status, ItemStatus::Cached);
    assert_eq!(reply.batch_size, 0);
    let (status, text) = blocking::get(addr, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(metric(&text, "switchyard_encoder_encoded_items_total"), 3.0);
    assert_eq!(metric(&text, "switchyard_encoder_cache_hits_total"), 1.0);
    assert_eq!(metric(&text, "switchyard_encoder_failed_items_total"), 2.0);
    // Two images and a video encoded in one pass of four items (the placeholder video failed
    // on the device), and pushes of 16 + 16 + 32 + 16 (the cached image) rows × 48 f16 values.
    for (modality, items) in [("image", 2), ("video", 1)] {
        let line = format!("switchyard_encoder_encode_seconds_count{{modality=\"{modality}\"}} {items}");
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
    assert_eq!(metric(&text, "switchyard_encoder_batch_items_count"), 1.0, "{text}");
    assert_eq!(metric(&text, "switchyard_encoder_batch_items_sum"), 4.0, "{text}");
    assert_eq!(
        metric(&text, "switchyard_encoder_feature_bytes_total"),
        80.0 * 48.0 * 2.0
    );
    assert_eq!(blocking::get(addr, "/healthz").0, 200);
    sigterm(&mut encoder);
}

#[test]
fn audio_encoder_pushes_whisper_features() {
    let _turn = switchyard_harness::turn();
    let (worker, pushes) = receiver();
    let model = fixtures::encoder("tiny-whisper");
    let mut encoder = NativeEncoder::start(&[
        "--model",
        model.to_str().expect("utf-8"),
        "--port",
        "0",
        "--served-model-name",
        "tiny",
    ])
    .expect("the encoder starts");
    let addr = encoder.addr;
    let wav = std::fs::read(fixtures::encoder("audio/tone.wav")).expect("wav");
    let mut audio_item = item(&wav, MediaKind::Audio, "wav", worker, 0, true);
    audio_item.tokens = 93;
    audio_item.duration_s = 3.7;
    let reply = post_batch(addr, vec![audio_item]);
    assert_eq!(reply.items[0].status, ItemStatus::Encoded, "{reply:?}");
    // ceil(3.7 s × 25) rows of d_model 32.
    assert_eq!(reply.items[0].tokens, 93);
    let library = WhisperEncoder::load(&model).expect("loads");
    let waveform = audio::decode(&wav, 60.0).expect("decodes");
    let mel = LogMel::new(MelConfig::default()).compute(&waveform.samples);
    let features = library.audio_features(&[&mel], &[waveform.seconds()]).expect("encodes");
    let pushed = pushes.lock().expect("lock").clone();
    assert_eq!(pushed.len(), 1);
    assert_eq!(pushed[0].headers["x-switchyard-tokens"], "93");
    assert_eq!(pushed[0].headers["x-switchyard-feature-dim"], "32");
    assert_eq!(pushed[0].body, to_f16_le(&features[0]));
    sigterm(&mut encoder);
}

#[test]
fn a_bad_model_directory_is_named_at_start() {
    let _turn = switchyard_harness::turn();
    // Real weights, a config without its vision tower.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        fixtures::encoder("tiny-llava/model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .expect("copy");
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "llava"}"#).expect("write");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard-encoder"))
        .args([
            "--model",
            dir.path().to_str().expect("utf-8"),
            "--port",
            "0",
            "--served-model-name",
            "m",
        ])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("config.json") && stderr.contains("`vision_config`"),
        "{stderr}"
    );
}
