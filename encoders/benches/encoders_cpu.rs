//! CPU throughput of the native encoders by micro-batch size, and the cost of preprocessing.
//!
//! `cargo bench -p switchyard-encoders --bench encoders_cpu [-- --batches 1,4,8,16,32]` writes
//! two random-weight models as real safetensors to a temporary directory: a CLIP ViT-B/32 vision
//! tower at 224 px (the architecture of `openai/clip-vit-base-patch32`: 12 layers, width 768,
//! 50 tokens per image) with a LLaVA projector to 2048, and a Whisper tiny encoder (4 layers,
//! width 384, 30 s windows of 3,000 mel frames). For each micro-batch size it prints the time of
//! one batched forward (best of a few), the time per item, and per-item throughput and batch
//! latency against batch 1 in the same run. Then preprocessing: decode + resize + normalize
//! per image (a 640×480 PNG and JPEG to CLIP's 224), decode + log-mel per second of audio (a 30 s
//! WAV at 16 kHz mono, and at 44.1 kHz stereo, which adds resampling), and video: a 10 s
//! 640×480 H.264 MP4 at 30 fps (encoded here with OpenH264 at a fixed QP of 26, an IDR every 2 s), its decode per
//! frame, one picked frame's RGB conversion and preprocessing to CLIP's 224, and the whole
//! item as the encoder takes it at 2 fps (all 300 frames decoded, 20 kept) and by keyframes
//! (only the 5 IDR frames decoded). Figures are
//! printed, never asserted.

use std::hint::black_box;
use std::time::Instant;

use switchyard_encoders::audio;
use switchyard_encoders::image::{ImageProcessor, PixelValues};
use switchyard_encoders::mel::{LogMel, MelConfig};
use switchyard_encoders::video;
use switchyard_encoders::vit::VisionEncoder;
use switchyard_encoders::whisper::WhisperEncoder;

mod common;
use common::{Noise, write_clip_llava, write_whisper_tiny};

/// Best wall time of `runs` calls, in milliseconds.
fn best_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn sweep(name: &str, batches: &[usize], mut run: impl FnMut(usize)) {
    println!("\n{name}");
    println!("| micro-batch | ms per batch | ms per item | items/s | throughput vs batch 1 | latency vs batch 1 |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut base: Option<f64> = None;
    for &batch in batches {
        run(batch); // warm-up: allocations, rayon's pool
        let runs = if batch <= 4 { 3 } else { 2 };
        let ms = best_ms(runs, || run(batch));
        let per_item = ms / batch as f64;
        let base_ms = *base.get_or_insert(per_item);
        println!(
            "| {batch} | {ms:.1} | {per_item:.1} | {:.1} | {:.2}× | {:.2}× |",
            1e3 / per_item,
            base_ms / per_item,
            ms / base_ms
        );
    }
}

fn wav(rate: u32, channels: u16, seconds: f64) -> Vec<u8> {
    let frames = (rate as f64 * seconds) as usize;
    let data_len = (frames * channels as usize * 2) as u32;
    let mut out = Vec::new();
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data_len).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&channels.to_le_bytes());
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(rate * channels as u32 * 2).to_le_bytes());
    out.extend_from_slice(&(channels * 2).to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data_len.to_le_bytes());
    let mut noise = Noise(42);
    for n in 0..frames {
        let tone = (2.0 * std::f64::consts::PI * 440.0 * n as f64 / rate as f64).sin() as f32 * 0.3;
        for _ in 0..channels {
            out.extend_from_slice(&(((tone + noise.next()) * 32767.0) as i16).to_le_bytes());
        }
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let batches: Vec<usize> = args
        .iter()
        .position(|a| a == "--batches")
        .and_then(|i| args.get(i + 1))
        .map(|list| list.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 8, 16, 32]);
    println!(
        "encoders on the CPU: {} threads (rayon), f32",
        rayon::current_num_threads()
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let vision_dir = dir.path().join("clip-llava");
    let audio_dir = dir.path().join("whisper");
    std::fs::create_dir_all(&vision_dir).expect("dir");
    std::fs::create_dir_all(&audio_dir).expect("dir");
    write_clip_llava(&vision_dir);
    write_whisper_tiny(&audio_dir);
    let vision = VisionEncoder::load(&vision_dir).expect("vision model loads");
    let whisper = WhisperEncoder::load(&audio_dir).expect("whisper loads");

    let mut noise = Noise(7);
    let images: Vec<PixelValues> = (0..*batches.iter().max().unwrap_or(&1))
        .map(|_| PixelValues {
            height: 224,
            width: 224,
            data: (0..3 * 224 * 224).map(|_| noise.next() * 20.0).collect(),
        })
        .collect();
    sweep(
        "CLIP ViT-B/32 at 224 px + LLaVA projector (49 feature rows per image)",
        &batches,
        |batch| {
            let refs: Vec<&PixelValues> = images[..batch].iter().collect();
            black_box(vision.encode(&refs).expect("encodes"));
        },
    );
    let mels: Vec<Vec<f32>> = (0..*batches.iter().max().unwrap_or(&1))
        .map(|_| (0..80 * 3000).map(|_| noise.next() * 10.0).collect())
        .collect();
    sweep(
        "Whisper tiny encoder, 30 s windows (1,500 rows each)",
        &batches,
        |batch| {
            let refs: Vec<&[f32]> = mels[..batch].iter().map(Vec::as_slice).collect();
            black_box(whisper.forward(&refs).expect("encodes"));
        },
    );

    println!("\npreprocessing (one thread)");
    println!("| input | ms | per |");
    println!("|---|---:|---|");
    let processor = ImageProcessor::clip();
    let mut photo = image::RgbImage::new(640, 480);
    for (x, y, pixel) in photo.enumerate_pixels_mut() {
        pixel.0 = [(x % 256) as u8, (y % 256) as u8, ((x * y) % 251) as u8];
    }
    for (format, name) in [
        (image::ImageFormat::Png, "640x480 PNG"),
        (image::ImageFormat::Jpeg, "640x480 JPEG"),
    ] {
        let mut bytes = Vec::new();
        photo
            .write_to(&mut std::io::Cursor::new(&mut bytes), format)
            .expect("encode fixture");
        let ms = best_ms(5, || {
            black_box(processor.preprocess(&bytes).expect("preprocesses"));
        });
        println!("| {name} → CLIP 224 (decode, resize, crop, normalize) | {ms:.2} | image |");
    }
    let mel = LogMel::new(MelConfig::default());
    for (rate, channels, name) in [
        (16_000, 1, "30 s WAV, 16 kHz mono"),
        (44_100, 2, "30 s WAV, 44.1 kHz stereo"),
    ] {
        let bytes = wav(rate, channels, 30.0);
        let ms = best_ms(3, || {
            let decoded = audio::decode(&bytes, 60.0).expect("decodes");
            let at_16k = audio::resample(&decoded, 16_000).expect("resamples");
            black_box(mel.compute(&at_16k.samples));
        });
        println!(
            "| {name} → 80-bin log-mel (decode, downmix, resample, mel) | {:.3} | second of audio ({ms:.1} ms per clip) |",
            ms / 30.0
        );
    }
    let (width, height, fps, seconds) = (640usize, 480usize, 30.0f32, 10usize);
    let mp4 = h264_mp4(width, height, fps, seconds);
    let frames = (fps as usize * seconds) as u32;
    // The frame before each IDR: every frame is decoded, five are copied out.
    let before_idr: Vec<u32> = (59..frames).step_by(60).collect();
    let decode_ms = best_ms(3, || {
        black_box(video::decode_frames(&mp4, &before_idr, u64::MAX).expect("decodes"));
    });
    println!(
        "| {width}x{height} H.264 MP4, 30 fps ({} KiB for {seconds} s) → decode | {:.3} | frame decoded |",
        mp4.len() / 1024,
        decode_ms / f64::from(frames)
    );
    let frame = video::decode_frames(&mp4, &[150], u64::MAX).expect("decodes").remove(0);
    let ms = best_ms(5, || {
        black_box(processor.preprocess_rgb(&frame.to_rgb()).expect("preprocesses"));
    });
    println!(
        "| one {width}x{height} frame → RGB (BT.601) → CLIP 224 (resize, crop, normalize) | {ms:.2} | frame kept |"
    );
    let picked: Vec<u32> = (0..frames).step_by(15).collect();
    let ms = best_ms(3, || {
        for yuv in video::decode_frames(&mp4, &picked, u64::MAX).expect("decodes") {
            black_box(processor.preprocess_rgb(&yuv.to_rgb()).expect("preprocesses"));
        }
    });
    println!(
        "| the {seconds} s clip at 2 fps ({} frames kept of {frames}) → CLIP 224 | {:.2} | frame kept ({ms:.0} ms per clip) |",
        picked.len(),
        ms / picked.len() as f64
    );
    let keyframes: Vec<u32> = (0..frames).step_by(60).collect();
    let ms = best_ms(3, || {
        for yuv in video::decode_frames(&mp4, &keyframes, u64::MAX).expect("decodes") {
            black_box(processor.preprocess_rgb(&yuv.to_rgb()).expect("preprocesses"));
        }
    });
    println!(
        "| the {seconds} s clip, keyframes ({} IDR frames, only they decoded) → CLIP 224 | {:.2} | frame kept ({ms:.0} ms per clip) |",
        keyframes.len(),
        ms / keyframes.len() as f64
    );
}

/// A `seconds`-long H.264 MP4 of a moving pattern, encoded with OpenH264 (QP 26, no frame
/// skipped, an IDR every 2 s).
fn h264_mp4(width: usize, height: usize, fps: f32, seconds: usize) -> Vec<u8> {
    use openh264::OpenH264API;
    use openh264::encoder::{Encoder, EncoderConfig, FrameRate, IntraFramePeriod, QpRange, RateControlMode};
    use openh264::formats::{RgbSliceU8, YUVBuffer};
    let config = EncoderConfig::new()
        .max_frame_rate(FrameRate::from_hz(fps))
        .rate_control_mode(RateControlMode::Off)
        .qp(QpRange::new(26, 26))
        .skip_frames(false)
        .intra_frame_period(IntraFramePeriod::from_num_frames(2 * fps as u32));
    let mut encoder = Encoder::with_api_config(OpenH264API::from_source(), config).expect("encoder");
    let mut units = Vec::new();
    let mut rgb = vec![0u8; width * height * 3];
    for k in 0..(fps as usize * seconds) {
        for (i, pixel) in rgb.chunks_mut(3).enumerate() {
            let (x, y) = (i % width, i / width);
            pixel.copy_from_slice(&[
                ((x + 3 * k) % 256) as u8,
                ((y + k) % 256) as u8,
                ((x * y / 64 + k) % 251) as u8,
            ]);
        }
        let yuv = YUVBuffer::from_rgb_source(RgbSliceU8::new(&rgb, (width, height)));
        units.push(encoder.encode(&yuv).expect("encodes").to_vec());
    }
    switchyard_media::fixtures::Mp4Video {
        width: width as u16,
        height: height as u16,
        fps: f64::from(fps),
        stream: Some(switchyard_media::fixtures::H264Stream::from_annex_b(&units)),
        ..Default::default()
    }
    .build()
}
