//! Probe tests over the fixtures: what each probe reads, truncation at several cut points,
//! garbage, and a no-panic sweep over every truncation length and many corruptions of each
//! fixture.

use crate::fixtures::{self, Mp4Video, WebmVideo};
use crate::*;

fn probe_any(b: &[u8]) -> Vec<Result<MediaInfo, MediaError>> {
    let mut out = vec![probe_image(b), probe_video(b)];
    for f in ["wav", "mp3", "flac", "ogg"] {
        out.push(probe_audio(b, f));
    }
    out
}

/// Every probe on every prefix of `b` (and on `b` with bytes flipped at many places) returns
/// without panicking. With `has_end`, the container marks its end (or its length), so `probe`
/// must refuse every proper prefix; without it (MP3, WebM of unknown size) a prefix that ends
/// on a frame boundary is a valid shorter file.
fn sweep(b: &[u8], has_end: bool, probe: impl Fn(&[u8]) -> Result<MediaInfo, MediaError>) {
    assert!(probe(b).is_ok(), "{:?}", probe(b));
    for len in 0..b.len() {
        let cut = &b[..len];
        let r = probe(cut);
        assert!(
            !has_end || r.is_err(),
            "a {len}-byte prefix of {} bytes was accepted: {r:?}",
            b.len()
        );
        if len.is_multiple_of(7) {
            let _ = probe_any(cut);
        }
    }
    let mut x = b.to_vec();
    let step = (b.len() / 512).max(1);
    for i in (0..b.len()).step_by(step) {
        for v in [0x00, 0xFF, x[i] ^ 0x80, x[i].wrapping_add(1)] {
            let old = x[i];
            x[i] = v;
            let _ = probe_any(&x);
            x[i] = old;
        }
    }
}

fn assert_truncated(r: Result<MediaInfo, MediaError>, what: &str) {
    match r {
        Err(e @ MediaError::Truncated { .. }) => {
            assert!(e.to_string().starts_with("truncated "), "{e}");
        }
        other => panic!("{what}: expected a truncation error, got {other:?}"),
    }
}

/// A small deterministic generator for garbage.
fn garbage(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

// ---- images

#[test]
fn images_read_their_size() {
    for (b, c) in [
        (fixtures::png(336, 200), Container::Png),
        (fixtures::jpeg(336, 200), Container::Jpeg),
        (fixtures::gif(336, 200), Container::Gif),
        (fixtures::webp(336, 200), Container::WebP),
    ] {
        let info = probe_image(&b).unwrap_or_else(|e| panic!("{c}: {e}"));
        assert_eq!(
            (info.kind, info.container, info.width, info.height),
            (MediaKind::Image, c, 336, 200)
        );
        assert_eq!((info.bytes, info.id), (b.len(), MediaId::of(&b)));
        assert_eq!((info.duration_s, info.frame_count, info.sample_rate), (0.0, 0, 0));
    }
}

#[test]
fn truncated_images() {
    let png = fixtures::png(64, 48);
    for cut in [png.len() - 1, png.len() - 12, png.len() / 2, 40] {
        assert_truncated(probe_image(&png[..cut]), "png");
    }
    let e = probe_image(&png[..png.len() - 12]).unwrap_err();
    assert!(e.to_string().starts_with("truncated PNG: no IEND chunk"), "{e}");
    let jpeg = fixtures::jpeg(64, 48);
    for cut in [jpeg.len() - 1, jpeg.len() - 2, jpeg.len() / 2, 30] {
        assert_truncated(probe_image(&jpeg[..cut]), "jpeg");
    }
    assert!(
        probe_image(&jpeg[..jpeg.len() - 1])
            .unwrap_err()
            .to_string()
            .contains("EOI")
    );
    // Bytes after EOI are ignored.
    let mut tail = jpeg.clone();
    tail.extend_from_slice(b"trailing");
    assert!(probe_image(&tail).is_ok());
    let gif = fixtures::gif(64, 48);
    for cut in [gif.len() - 1, gif.len() - 2, gif.len() / 2, 14] {
        assert_truncated(probe_image(&gif[..cut]), "gif");
    }
    assert!(
        probe_image(&gif[..gif.len() - 1])
            .unwrap_err()
            .to_string()
            .contains("trailer")
    );
    let webp = fixtures::webp(64, 48);
    for cut in [webp.len() - 1, webp.len() / 2, 16] {
        assert_truncated(probe_image(&webp[..cut]), "webp");
    }
    let mut long = webp.clone();
    long.push(0);
    assert!(matches!(probe_image(&long), Err(MediaError::Malformed { .. })));
}

#[test]
fn other_images_are_unsupported_and_say_what_they_look_like() {
    let bmp = b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0\x28\0\0\0\x02\0\0\0\x02\0\0\0\x01\0\x18\0\0\0\0\0";
    let e = probe_image(bmp).unwrap_err();
    assert_eq!(
        e.to_string(),
        "not a PNG, JPEG, WebP or GIF image (looks like: a BMP image)"
    );
    let e = probe_image(&fixtures::wav(8000, 1, 0.01)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "not a PNG, JPEG, WebP or GIF image (looks like: WAV audio)"
    );
    let e = probe_image(&Mp4Video::default().build()).unwrap_err();
    assert!(e.to_string().contains("an MP4 video"), "{e}");
    assert!(matches!(probe_image(b""), Err(MediaError::Unsupported(_))));
}

// ---- audio

#[test]
fn audio_reads_duration_rate_and_channels() {
    let cases: Vec<(&str, Vec<u8>, f64, u32, u32)> = vec![
        ("wav", fixtures::wav(16_000, 1, 1.5), 1.5, 16_000, 1),
        ("wav", fixtures::wav(44_100, 2, 0.25), 0.25, 44_100, 2),
        (
            "mp3",
            fixtures::mp3(44_100, 2, 100),
            100.0 * 1152.0 / 44_100.0,
            44_100,
            2,
        ),
        ("mp3", fixtures::mp3(16_000, 1, 50), 50.0 * 576.0 / 16_000.0, 16_000, 1),
        ("mp3", fixtures::mp3(8_000, 1, 10), 10.0 * 576.0 / 8_000.0, 8_000, 1),
        (
            "flac",
            fixtures::flac(48_000, 2, 100_000, 4096, true),
            100_000.0 / 48_000.0,
            48_000,
            2,
        ),
        ("flac", fixtures::flac(16_000, 1, 40_000, 1152, false), 2.5, 16_000, 1),
        ("ogg", fixtures::ogg_opus(2, 3.0), 3.0, 48_000, 2),
        ("ogg", fixtures::ogg_vorbis(22_050, 1, 2.0), 2.0, 22_050, 1),
    ];
    for (format, b, duration, rate, channels) in cases {
        let info = probe_audio(&b, format).unwrap_or_else(|e| panic!("{format}: {e}"));
        assert_eq!(info.kind, MediaKind::Audio);
        assert_eq!(info.container.to_string(), format);
        assert!(
            (info.duration_s - duration).abs() < 1e-6,
            "{format}: {} vs {duration}",
            info.duration_s
        );
        assert_eq!(
            (info.sample_rate, info.channels, info.width),
            (rate, channels, 0),
            "{format}"
        );
    }
    // Case and aliases.
    assert!(probe_audio(&fixtures::wav(8000, 1, 0.1), "WAV").is_ok());
    assert!(probe_audio(&fixtures::ogg_opus(1, 0.5), "opus").is_ok());
}

#[test]
fn audio_tolerances() {
    // WAV: a streaming writer's placeholder data size (0xFFFFFFFF) means "to the end".
    let mut w = fixtures::wav(8000, 1, 0.5);
    let data = w.windows(4).position(|x| x == b"data").unwrap();
    w[data + 4..data + 8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!((probe_audio(&w, "wav").unwrap().duration_s - 0.5).abs() < 1e-9);
    // MP3: ID3v2 before, ID3v1 after; a Xing frame is not counted.
    let mut m = b"ID3\x03\0\0\0\0\0\x0a".to_vec();
    m.extend_from_slice(&[0; 10]);
    let frames = fixtures::mp3(44_100, 2, 20);
    let mut xing = frames[..417].to_vec();
    xing[4 + 32..4 + 36].copy_from_slice(b"Xing");
    m.extend_from_slice(&xing);
    m.extend_from_slice(&frames);
    m.extend_from_slice(b"TAG");
    m.extend_from_slice(&[0; 125]);
    let info = probe_audio(&m, "mp3").unwrap();
    assert!((info.duration_s - 20.0 * 1152.0 / 44_100.0).abs() < 1e-9);
}

#[test]
fn truncated_audio() {
    let wav = fixtures::wav(8000, 1, 0.5);
    for cut in [wav.len() - 1, wav.len() / 2, 30, 44] {
        assert_truncated(probe_audio(&wav[..cut], "wav"), "wav");
    }
    let e = probe_audio(&wav[..wav.len() - 1], "wav").unwrap_err();
    assert!(
        e.to_string().contains("data chunk declares 8000 bytes but only 7999"),
        "{e}"
    );
    let mp3 = fixtures::mp3(44_100, 2, 10);
    for cut in [mp3.len() - 1, mp3.len() / 2 + 3, 100, 2] {
        assert_truncated(probe_audio(&mp3[..cut], "mp3"), "mp3");
    }
    let flac = fixtures::flac(16_000, 1, 20_000, 1024, true);
    for cut in [flac.len() - 1, flac.len() - 20, flac.len() / 2, 41, 30, 6, 2] {
        assert_truncated(probe_audio(&flac[..cut], "flac"), "flac");
    }
    // Cut at a frame boundary: STREAMINFO's total tells.
    let frame = 4 + 1 + 2 + 1 + 3 + 2;
    let e = probe_audio(&flac[..flac.len() - frame], "flac").unwrap_err();
    assert!(e.to_string().contains("of the 20000 STREAMINFO declares"), "{e}");
    // Without a declared total the frame count is the duration, and a cut frame still shows.
    let open = fixtures::flac(16_000, 1, 20_000, 1024, false);
    assert_truncated(probe_audio(&open[..open.len() - 1], "flac"), "flac (no total)");
    let ogg = fixtures::ogg_opus(1, 2.0);
    for cut in [ogg.len() - 1, ogg.len() / 2, 30, 3] {
        assert_truncated(probe_audio(&ogg[..cut], "ogg"), "ogg");
    }
    // Cut at a page boundary: no end-of-stream page.
    let last_page = ogg.windows(4).rposition(|x| x == b"OggS").unwrap();
    let e = probe_audio(&ogg[..last_page], "ogg").unwrap_err();
    assert!(e.to_string().contains("end-of-stream"), "{e}");
}

#[test]
fn audio_format_must_match() {
    let mp3 = fixtures::mp3(44_100, 2, 5);
    let e = probe_audio(&mp3, "wav").unwrap_err();
    assert_eq!(
        e.to_string(),
        "input_audio.format is `wav` but the data looks like MP3 audio"
    );
    let e = probe_audio(&fixtures::png(4, 4), "mp3").unwrap_err();
    assert!(matches!(e, MediaError::FormatMismatch { .. }), "{e}");
    let e = probe_audio(&mp3, "aac").unwrap_err();
    assert!(
        matches!(e, MediaError::Unsupported(_)) && e.to_string().contains("send wav, mp3, flac or ogg"),
        "{e}"
    );
    // Not a container at all.
    let e = probe_audio(b"hello world, not audio", "wav").unwrap_err();
    assert!(
        matches!(e, MediaError::Malformed { .. }) && e.to_string().contains("looks like text"),
        "{e}"
    );
    // Corrupt Ogg CRC and capture pattern.
    let mut ogg = fixtures::ogg_opus(1, 1.0);
    let n = ogg.len();
    ogg[n - 1] ^= 1;
    assert!(probe_audio(&ogg, "ogg").unwrap_err().to_string().contains("CRC"));
    let mut ogg = fixtures::ogg_opus(1, 1.0);
    let second = ogg.windows(4).skip(1).position(|x| x == b"OggS").unwrap() + 1;
    ogg[second] = b'X';
    assert!(
        probe_audio(&ogg, "ogg")
            .unwrap_err()
            .to_string()
            .contains("capture pattern")
    );
    // MP3 frames that stop lining up.
    let mut m = fixtures::mp3(44_100, 2, 5);
    m[417 * 2] = 0;
    let e = probe_audio(&m, "mp3").unwrap_err();
    assert!(e.to_string().contains("inconsistent frames"), "{e}");
    // A compressed WAV.
    let mut w = fixtures::wav(8000, 1, 0.1);
    w[20] = 0x11; // IMA ADPCM
    assert!(matches!(probe_audio(&w, "wav"), Err(MediaError::Unsupported(_))));
}

// ---- video

#[test]
fn mp4_reads_its_index() {
    let b = Mp4Video {
        width: 640,
        height: 360,
        frames: 90,
        fps: 30.0,
        keyframe_interval: Some(30),
        ..Default::default()
    }
    .build();
    let info = probe_video(&b).unwrap();
    assert_eq!((info.kind, info.container), (MediaKind::Video, Container::Mp4));
    assert_eq!((info.width, info.height, info.frame_count), (640, 360, 90));
    assert!((info.duration_s - 3.0).abs() < 1e-6, "{}", info.duration_s);
    assert!((info.frame_rate - 30.0).abs() < 1e-6, "{}", info.frame_rate);
    assert_eq!(info.keyframes, vec![0, 30, 60]);
    assert_eq!((info.sample_rate, info.channels), (0, 0));
    // No stss: every frame is a sync frame, and the list is empty.
    let b = Mp4Video {
        keyframe_interval: None,
        fps: 29.97,
        ..Default::default()
    }
    .build();
    let info = probe_video(&b).unwrap();
    assert!(info.keyframes.is_empty());
    assert!((info.frame_rate - 29.97).abs() < 0.01, "{}", info.frame_rate);
    // moov after mdat.
    assert!(
        probe_video(
            &Mp4Video {
                moov_first: false,
                ..Default::default()
            }
            .build()
        )
        .is_ok()
    );
}

#[test]
fn mp4_refusals() {
    let e = probe_video(
        &Mp4Video {
            codec: *b"hev1",
            ..Default::default()
        }
        .build(),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "H.265 video is not supported (MP4 with hev1 track); send H.264 or WebM"
    );
    let e = probe_video(
        &Mp4Video {
            codec: *b"hvc1",
            ..Default::default()
        }
        .build(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("hvc1"), "{e}");
    let e = probe_video(
        &Mp4Video {
            codec: *b"vp09",
            ..Default::default()
        }
        .build(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("VP9"), "{e}");
    let e = probe_video(&fixtures::png(8, 8)).unwrap_err();
    assert_eq!(e.to_string(), "not an MP4 or WebM video (looks like: a PNG image)");
}

#[test]
fn truncated_mp4() {
    let b = Mp4Video::default().build();
    for cut in [b.len() - 1, b.len() - 64, b.len() / 2, 100, 20, 12] {
        assert_truncated(probe_video(&b[..cut]), "mp4");
    }
    // The mdat box of size 0 ("to the end of the file") still cannot hold fewer bytes than the
    // sample table needs.
    let mut open = b.clone();
    let mdat = open.windows(4).rposition(|x| x == b"mdat").unwrap() - 4;
    open[mdat..mdat + 4].copy_from_slice(&0u32.to_be_bytes());
    assert!(probe_video(&open).is_ok());
    let e = probe_video(&open[..open.len() - 10]).unwrap_err();
    assert!(e.to_string().contains("the sample table needs"), "{e}");
    // Cut before a trailing moov.
    let late = Mp4Video {
        moov_first: false,
        ..Default::default()
    }
    .build();
    let moov = late.windows(4).position(|x| x == b"moov").unwrap() - 4;
    let e = probe_video(&late[..moov]).unwrap_err();
    assert!(e.is_truncated() && e.to_string().contains("no moov"), "{e}");
}

#[test]
fn webm_reads_its_blocks() {
    let b = WebmVideo {
        width: 640,
        height: 360,
        frames: 60,
        fps: 30.0,
        keyframe_interval: 15,
        ..Default::default()
    }
    .build();
    let info = probe_video(&b).unwrap();
    assert_eq!((info.kind, info.container), (MediaKind::Video, Container::WebM));
    assert_eq!((info.width, info.height, info.frame_count), (640, 360, 60));
    assert!((info.duration_s - 2.0).abs() < 1e-6, "{}", info.duration_s);
    assert!((info.frame_rate - 30.0).abs() < 1e-3, "{}", info.frame_rate);
    assert_eq!(info.keyframes, vec![0, 15, 30, 45]);
    // Without Duration and DefaultDuration: from the timestamps.
    let b = WebmVideo {
        declare_duration: false,
        default_duration: false,
        fps: 25.0,
        frames: 50,
        ..Default::default()
    }
    .build();
    let info = probe_video(&b).unwrap();
    assert!((info.duration_s - 2.0).abs() < 0.01, "{}", info.duration_s);
    assert!((info.frame_rate - 25.0).abs() < 0.2, "{}", info.frame_rate);
    // Live-style unknown sizes, and other codecs.
    for codec in ["V_VP8", "V_AV1", "V_MPEG4/ISO/AVC"] {
        let b = WebmVideo {
            unknown_sizes: true,
            codec_id: codec.to_owned(),
            ..Default::default()
        }
        .build();
        assert_eq!(probe_video(&b).unwrap().frame_count, 30, "{codec}");
    }
    let e = probe_video(
        &WebmVideo {
            codec_id: "V_MPEGH/ISO/HEVC".into(),
            ..Default::default()
        }
        .build(),
    )
    .unwrap_err();
    assert!(e.to_string().starts_with("H.265 video is not supported"), "{e}");
    let e = probe_video(
        &WebmVideo {
            codec_id: "V_THEORA".into(),
            ..Default::default()
        }
        .build(),
    )
    .unwrap_err();
    assert!(matches!(e, MediaError::Unsupported(_)), "{e}");
}

#[test]
fn truncated_webm() {
    for unknown_sizes in [false, true] {
        let b = WebmVideo {
            unknown_sizes,
            ..Default::default()
        }
        .build();
        for cut in [b.len() - 1, b.len() - 40, b.len() / 2, 60, 10] {
            assert_truncated(probe_video(&b[..cut]), "webm");
        }
    }
}

// ---- hostile input

/// An EBML element with an 8-byte size.
fn ebml(id: &[u8], body: &[u8]) -> Vec<u8> {
    let mut v = id.to_vec();
    v.push(0x01);
    v.extend_from_slice(&(body.len() as u64).to_be_bytes()[1..]);
    v.extend_from_slice(body);
    v
}

#[test]
fn hostile_webm() {
    let header = ebml(&[0x1A, 0x45, 0xDF, 0xA3], &ebml(&[0x42, 0x82], b"webm"));
    // A SeekHead whose two Seeks both point at a second SeekHead (this panicked
    // matroska-demuxer 0.8.1).
    let seek = |pos: u8| {
        ebml(
            &[0x4D, 0xBB],
            &[
                ebml(&[0x53, 0xAB], &[0x11, 0x4D, 0x9B, 0x74]),
                ebml(&[0x53, 0xAC], &[pos]),
            ]
            .concat(),
        )
    };
    let a_len = ebml(&[0x11, 0x4D, 0x9B, 0x74], &[seek(0), seek(0)].concat()).len() as u8;
    let segment = [
        ebml(&[0x11, 0x4D, 0x9B, 0x74], &[seek(a_len), seek(a_len)].concat()),
        ebml(&[0x11, 0x4D, 0x9B, 0x74], &[]),
    ]
    .concat();
    let file = [header.clone(), ebml(&[0x18, 0x53, 0x80, 0x67], &segment)].concat();
    assert!(matches!(probe_video(&file), Err(MediaError::Unsupported(_))));
    // Extreme timestamps: i16::MIN relative, u64::MAX cluster.
    let tracks = ebml(
        &[0x16, 0x54, 0xAE, 0x6B],
        &ebml(
            &[0xAE],
            &[
                ebml(&[0xD7], &[1]),
                ebml(&[0x83], &[1]),
                ebml(&[0x86], b"V_VP9"),
                ebml(&[0xE0], &[ebml(&[0xB0], &[8]), ebml(&[0xBA], &[8])].concat()),
            ]
            .concat(),
        ),
    );
    let block = |ts: [u8; 2]| ebml(&[0xA3], &[0x81, ts[0], ts[1], 0x80, 0]);
    let cluster = ebml(
        &[0x1F, 0x43, 0xB6, 0x75],
        &[ebml(&[0xE7], &[0xFF; 8]), block([0x80, 0]), block([0x7F, 0xFF])].concat(),
    );
    let file = [header, ebml(&[0x18, 0x53, 0x80, 0x67], &[tracks, cluster].concat())].concat();
    let info = probe_video(&file).unwrap();
    assert_eq!((info.frame_count, info.width), (2, 8));
}

#[test]
fn garbage_is_refused() {
    for seed in 0..200u64 {
        let len = (seed as usize * 37) % 3000;
        let g = garbage(seed, len);
        for r in probe_any(&g) {
            assert!(r.is_err());
        }
        // Garbage behind each container's magic reaches the deep parsers.
        for magic in [
            &b"\x89PNG\r\n\x1a\n"[..],
            &[0xFF, 0xD8, 0xFF],
            b"GIF89a",
            b"RIFF\0\0\0\0WEBP",
            b"RIFF\0\0\0\0WAVE",
            b"OggS",
            b"fLaC",
            b"ID3\x03\0\0\0\0\0\0",
            &[0xFF, 0xFB, 0x90, 0x64],
            &[0x1A, 0x45, 0xDF, 0xA3],
            b"\0\0\0\x18ftypisom",
            b"\0\0\x10\0moov",
        ] {
            let mut x = magic.to_vec();
            x.extend_from_slice(&g);
            let _ = probe_any(&x);
        }
    }
}

#[test]
fn no_panic_on_any_truncation_or_corruption() {
    sweep(&fixtures::png(12, 9), true, probe_image);
    sweep(&fixtures::jpeg(16, 16), true, probe_image);
    sweep(&fixtures::gif(12, 9), true, probe_image);
    sweep(&fixtures::webp(12, 9), true, probe_image);
    sweep(&fixtures::wav(8000, 2, 0.02), true, |b| probe_audio(b, "wav"));
    sweep(&fixtures::mp3(8000, 1, 6), false, |b| probe_audio(b, "mp3"));
    sweep(&fixtures::flac(8000, 2, 700, 128, true), true, |b| {
        probe_audio(b, "flac")
    });
    sweep(&fixtures::ogg_opus(2, 0.3), true, |b| probe_audio(b, "ogg"));
    sweep(&fixtures::ogg_vorbis(8000, 1, 0.3), true, |b| probe_audio(b, "ogg"));
    let mp4 = Mp4Video {
        frames: 8,
        frame_bytes: 8,
        keyframe_interval: Some(4),
        ..Default::default()
    };
    sweep(&mp4.build(), true, probe_video);
    let webm = WebmVideo {
        frames: 8,
        frame_bytes: 4,
        keyframe_interval: 4,
        ..Default::default()
    };
    sweep(&webm.build(), true, probe_video);
    sweep(
        &WebmVideo {
            unknown_sizes: true,
            ..webm
        }
        .build(),
        false,
        probe_video,
    );
}

/// Random structural mutations of every fixture (overwrites, bit flips, insertions, deletions,
/// duplicated ranges) through every probe: no panic. `SWITCHYARD_MEDIA_FUZZ=<rounds>` runs longer,
/// and `SWITCHYARD_MEDIA_FUZZ_DIR=<folder>` adds the files there (real media, say) as seeds.
#[test]
fn fuzz_mutations() {
    let rounds: u64 = std::env::var("SWITCHYARD_MEDIA_FUZZ")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    let mut seeds = vec![
        fixtures::png(9, 7),
        fixtures::jpeg(16, 8),
        fixtures::gif(9, 7),
        fixtures::webp(9, 7),
        fixtures::wav(8000, 1, 0.01),
        fixtures::mp3(8000, 1, 4),
        fixtures::flac(8000, 1, 300, 100, true),
        fixtures::ogg_opus(1, 0.1),
        fixtures::ogg_vorbis(8000, 2, 0.1),
        Mp4Video {
            frames: 6,
            frame_bytes: 6,
            keyframe_interval: Some(3),
            ..Default::default()
        }
        .build(),
        WebmVideo {
            frames: 6,
            frame_bytes: 3,
            keyframe_interval: 3,
            ..Default::default()
        }
        .build(),
        WebmVideo {
            frames: 6,
            frame_bytes: 3,
            unknown_sizes: true,
            ..Default::default()
        }
        .build(),
    ];
    if let Ok(dir) = std::env::var("SWITCHYARD_MEDIA_FUZZ_DIR") {
        for entry in std::fs::read_dir(dir)
            .expect("SWITCHYARD_MEDIA_FUZZ_DIR is a folder")
            .flatten()
        {
            seeds.push(std::fs::read(entry.path()).expect("a readable file"));
        }
    }
    let mut rng = garbage(7, 0).len() as u64 ^ 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for round in 0..rounds {
        for seed in &seeds {
            let mut x = seed.clone();
            for _ in 0..1 + next() % 6 {
                let len = x.len().max(1);
                let at = (next() as usize) % len;
                match next() % 6 {
                    0 => {
                        if let Some(b) = x.get_mut(at) {
                            *b = next() as u8;
                        }
                    }
                    1 => {
                        if let Some(b) = x.get_mut(at) {
                            *b ^= 1 << (next() % 8);
                        }
                    }
                    2 => {
                        let n = (next() % 16) as usize;
                        let bytes = garbage(next(), n);
                        x.splice(at.min(x.len())..at.min(x.len()), bytes);
                    }
                    3 => {
                        let end = (at + (next() % 32) as usize).min(x.len());
                        x.drain(at.min(end)..end);
                    }
                    4 => {
                        let end = (at + (next() % 64) as usize).min(x.len());
                        let copy = x[at.min(end)..end].to_vec();
                        let to = (next() as usize) % (x.len() + 1);
                        x.splice(to..to, copy);
                    }
                    _ => {
                        // A big-endian or little-endian length field set to an extreme.
                        let v: [u8; 4] = match next() % 4 {
                            0 => [0xFF; 4],
                            1 => [0x7F, 0xFF, 0xFF, 0xFF],
                            2 => [0; 4],
                            _ => [0x80, 0, 0, 0],
                        };
                        let end = (at + 4).min(x.len());
                        let n = end - at.min(end);
                        x[at.min(end)..end].copy_from_slice(&v[..n]);
                    }
                }
            }
            let _ = (round, probe_any(&x));
        }
    }
}

// ---- ids, kinds, limits

#[test]
fn media_ids() {
    let id = MediaId::of(b"hello");
    assert_eq!(id.0, xxhash_rust::xxh3::xxh3_128(b"hello"));
    let s = id.to_string();
    assert_eq!(s.len(), 32);
    assert!(s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    assert_eq!(s.parse::<MediaId>().unwrap(), id);
    assert_eq!(MediaId(1).to_string(), "00000000000000000000000000000001");
    assert!("xyz".parse::<MediaId>().is_err());
    assert!("+0000000000000000000000000000001".parse::<MediaId>().is_err());
    assert_eq!(MediaId::of(b"hello"), MediaId::of(b"hello"));
    assert_ne!(MediaId::of(b"hello"), MediaId::of(b"hellp"));
    let info = probe_image(&fixtures::png(2, 2)).unwrap();
    let back: MediaInfo = toml::from_str(&toml::to_string(&info).unwrap()).unwrap();
    assert_eq!(back, info);
}

#[test]
fn names_and_mimes() {
    assert_eq!(Container::WebP.to_string(), "webp");
    assert_eq!(Container::WebM.to_string(), "webm");
    assert_eq!(MediaKind::Video.to_string(), "video");
    assert_eq!(Container::from_mime("image/JPG"), Some(Container::Jpeg));
    assert_eq!(Container::from_mime("audio/ogg; codecs=opus"), Some(Container::Ogg));
    assert_eq!(Container::from_mime("image/bmp"), None);
    for c in [Container::Png, Container::Mp3, Container::WebM] {
        assert_eq!(Container::from_mime(c.mime()), Some(c));
    }
}

#[test]
fn limits() {
    let l = MediaLimits::default();
    assert_eq!(
        (l.max_bytes, l.max_pixels, l.max_frames_in_file),
        (20 << 20, 8192 * 8192, 100_000)
    );
    let mut img = probe_image(&fixtures::png(4, 4)).unwrap();
    assert!(l.check(&img).is_ok());
    img.width = 10_000;
    img.height = 10_000;
    let e = l.check(&img).unwrap_err();
    assert!(e.to_string().starts_with("image size 10000x10000"), "{e}");
    let mut vid = probe_video(&Mp4Video::default().build()).unwrap();
    assert!(l.check(&vid).is_ok());
    vid.duration_s = 601.0;
    assert!(
        l.check(&vid)
            .unwrap_err()
            .to_string()
            .contains("video duration 601.0 s")
    );
    vid.duration_s = f64::NAN;
    assert!(l.check(&vid).is_err());
    vid.duration_s = 1.0;
    vid.frame_count = 100_001;
    assert!(l.check(&vid).is_err());
    vid.frame_count = 1;
    vid.bytes = (20 << 20) + 1;
    assert!(matches!(
        l.check(&vid),
        Err(MediaError::TooLarge { what: "media size", .. })
    ));
    // Encoded length: refused before decoding.
    assert!(l.check_encoded_len(fixtures::base64(&[0; 1000]).len()).is_ok());
    assert!(l.check_encoded_len((20 << 20) / 3 * 4).is_ok());
    assert!(l.check_encoded_len((21 << 20) / 3 * 4).is_err());
    let parsed: MediaLimits = toml::from_str("max_duration_s = 60.0").unwrap();
    assert_eq!((parsed.max_duration_s, parsed.max_bytes), (60.0, 20 << 20));
}

#[test]
fn data_url_to_probe() {
    let png = fixtures::png(3, 5);
    let url = decode_data_url(&fixtures::data_url("image/png", &png)).unwrap();
    assert_eq!(url.mime, "image/png");
    let info = probe_image(&url.bytes).unwrap();
    assert_eq!((info.width, info.height, info.id), (3, 5, MediaId::of(&png)));
    let wav = fixtures::wav(16_000, 1, 0.1);
    let bytes = decode_base64(&fixtures::base64(&wav)).unwrap();
    assert_eq!(probe_audio(&bytes, "wav").unwrap().id, MediaId::of(&wav));
}
