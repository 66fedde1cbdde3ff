//! How many tokens a model spends on a media item, and which video frames it sees.
//!
//! A model's media settings ([`ModelMedia`], from its configuration) say how its vision encoder
//! sizes images (a fixed resolution, or native resolution within a pixel range), how video frames
//! are sampled and pooled, and how fast audio turns into tokens. From them: [`image_tokens`]
//! (patches after the resize rule, divided by the spatial merge: 336x336 with 14-pixel patches
//! is 576 tokens), [`visual_budget`] (what the context leaves for media after the text and the
//! answer, capped by the model's visual token limit), [`select_frames`] (the frame samplers,
//! then the caps: at most `max_frames`, and as many as the budget holds),
//! [`video_tokens`] and [`audio_tokens`]. These are the gateway's estimates for routing and
//! admission; the encoder's own count is authoritative once it has run.
//!
//! The gateway never decodes, so [`FrameSampling::Keyframe`] takes the container's sync frames
//! (MP4 `stss`, WebM keyframe flags; an MP4 without `stss` has only sync frames), always with
//! frame 0, rather than probing decoded frames for pixel differences. A budget too small for a
//! single frame is an error (a 400 upstream), not one frame.

use serde::{Deserialize, Serialize};

use crate::error::MediaError;
use crate::info::MediaInfo;

/// How video frames are chosen before the caps apply.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameSampling {
    /// Every frame if there are at most `max_frames`, else `max_frames` evenly spaced ones.
    Uniform,
    /// About this many frames per second of video (`{ fps = 2.0 }` in configuration): every
    /// `max(1, int(native_fps / fps))`-th frame.
    Fps(f64),
    /// The container's sync frames (and frame 0).
    Keyframe,
}

impl Default for FrameSampling {
    fn default() -> Self {
        Self::Fps(2.0)
    }
}

/// A model's media settings. Deserializes from configuration with snake_case keys, every key
/// optional (the defaults are a CLIP ViT-L/14 at 336 pixels, LLaVA-1.5's vision tower).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelMedia {
    /// Side of a vision patch in pixels (14).
    pub patch_size: u32,
    /// Patches merged per side into one token (1; Qwen2-VL style models use 2).
    pub spatial_merge: u32,
    /// Fixed-resolution models resize every image to `image_size` x `image_size` (336);
    /// `None` means native resolution within `min_pixels..=max_pixels`, written
    /// `image_size = "native"` in configuration (or `null` in JSON).
    #[serde(with = "image_size_repr")]
    pub image_size: Option<u32>,
    /// Native resolution: smaller images are scaled up to at least this many pixels (3136).
    pub min_pixels: u64,
    /// Native resolution: larger images are scaled down to at most this many pixels (1003520).
    pub max_pixels: u64,
    /// How video frames are sampled (2 frames per second).
    pub video_sampling: FrameSampling,
    /// Most frames of one video the model sees (32).
    pub max_frames: u32,
    /// Most visual tokens in one request (8192).
    pub max_visual_tokens: u32,
    /// Consecutive frames pooled into one frame's worth of tokens (2).
    pub temporal_pooling: u32,
    /// Audio tokens per second of audio (25: Whisper's encoder after its 2x pooling).
    pub audio_tokens_per_second: f64,
    /// The model's hidden size, for estimating feature transfer sizes (4096).
    pub hidden_size: u32,
}

impl Default for ModelMedia {
    fn default() -> Self {
        Self {
            patch_size: 14,
            spatial_merge: 1,
            image_size: Some(336),
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            video_sampling: FrameSampling::default(),
            max_frames: 32,
            max_visual_tokens: 8192,
            temporal_pooling: 2,
            audio_tokens_per_second: 25.0,
            hidden_size: 4096,
        }
    }
}

impl ModelMedia {
    /// Checks the settings for values the estimates cannot use (zero sizes, an empty pixel range,
    /// a non-positive rate). The estimates never panic on such values, but their answers would
    /// be meaningless; a configuration loader should call this.
    pub fn validate(&self) -> Result<(), MediaError> {
        let bad = |why: String| Err(MediaError::Config(why));
        if self.patch_size == 0 || self.spatial_merge == 0 {
            return bad(format!(
                "patch_size {} and spatial_merge {} must be positive",
                self.patch_size, self.spatial_merge
            ));
        }
        if self.image_size == Some(0) {
            return bad("image_size must be positive".to_owned());
        }
        if self.image_size.is_none() && (self.min_pixels > self.max_pixels || self.max_pixels == 0) {
            return bad(format!(
                "min_pixels {} must not exceed max_pixels {}",
                self.min_pixels, self.max_pixels
            ));
        }
        if self.max_frames == 0 || self.temporal_pooling == 0 {
            return bad("max_frames and temporal_pooling must be positive".to_owned());
        }
        if let FrameSampling::Fps(fps) = self.video_sampling
            && !(fps.is_finite() && fps > 0.0)
        {
            return bad(format!("video_sampling fps {fps} must be positive"));
        }
        if !(self.audio_tokens_per_second.is_finite() && self.audio_tokens_per_second > 0.0) {
            return bad(format!(
                "audio_tokens_per_second {} must be positive",
                self.audio_tokens_per_second
            ));
        }
        Ok(())
    }

    /// Bytes of one media token's features in 16-bit precision (`hidden_size` x 2), for transfer
    /// estimates (an item moves `media_tokens x hidden x 2` bytes).
    pub fn feature_bytes_per_token(&self) -> u64 {
        u64::from(self.hidden_size) * 2
    }

    fn unit(&self) -> u64 {
        u64::from(self.patch_size.max(1)) * u64::from(self.spatial_merge.max(1))
    }
}

/// `image_size` in configuration: a number of pixels, or `"native"` (or null) for `None`.
mod image_size_repr {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u32(*n),
            None => s.serialize_str("native"),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Size(u32),
            Word(String),
        }
        match Option::<Repr>::deserialize(d)? {
            None => Ok(None),
            Some(Repr::Size(n)) => Ok(Some(n)),
            Some(Repr::Word(w)) if w == "native" => Ok(None),
            Some(Repr::Word(w)) => Err(serde::de::Error::custom(format!(
                "image_size must be a number of pixels or \"native\", not \"{w}\""
            ))),
        }
    }
}

/// The size in pixels a model's encoder resizes a `width` x `height` image to.
///
/// Fixed resolution: `image_size` x `image_size`. Native resolution (Qwen2-VL's `smart_resize`):
/// each side rounded to a multiple of `patch_size * spatial_merge` (at least one unit); if that
/// exceeds `max_pixels` the image is scaled down to fit (sides rounded down), if it falls below
/// `min_pixels` it is scaled up (sides rounded up).
pub fn resized(m: &ModelMedia, width: u32, height: u32) -> (u32, u32) {
    if let Some(side) = m.image_size {
        return (side, side);
    }
    let unit = m.unit() as f64;
    let (w, h) = (f64::from(width.max(1)), f64::from(height.max(1)));
    let round = |x: f64| ((x / unit).round() * unit).max(unit);
    let (mut rw, mut rh) = (round(w), round(h));
    if rw * rh > m.max_pixels as f64 {
        let beta = (w * h / m.max_pixels.max(1) as f64).sqrt();
        rw = ((w / beta / unit).floor() * unit).max(unit);
        rh = ((h / beta / unit).floor() * unit).max(unit);
    } else if rw * rh < m.min_pixels as f64 {
        let beta = (m.min_pixels as f64 / (w * h)).sqrt();
        rw = (w * beta / unit).ceil() * unit;
        rh = (h * beta / unit).ceil() * unit;
    }
    (rw.min(f64::from(u32::MAX)) as u32, rh.min(f64::from(u32::MAX)) as u32)
}

/// Tokens for one image (or one video frame): `(h / patch) * (w / patch) / merge²` after the
/// resize rule of [`resized`]. 336x336 with 14-pixel patches and no merge: 576.
pub fn image_tokens(m: &ModelMedia, width: u32, height: u32) -> u32 {
    let (w, h) = resized(m, width, height);
    let patch = u64::from(m.patch_size.max(1));
    let merge = u64::from(m.spatial_merge.max(1));
    let tokens = (u64::from(h) / patch) * (u64::from(w) / patch) / (merge * merge);
    u32::try_from(tokens.max(1)).unwrap_or(u32::MAX)
}

/// What a request's context leaves for media: `min(max_model_len - text_tokens - max_tokens,
/// max_visual_tokens)`. Zero or less is an error (the request cannot fit any media: a 400).
pub fn visual_budget(m: &ModelMedia, max_model_len: u32, text_tokens: u32, max_tokens: u32) -> Result<u32, MediaError> {
    let available = i64::from(max_model_len) - i64::from(text_tokens) - i64::from(max_tokens);
    if available <= 0 {
        return Err(MediaError::NoBudget(format!(
            "{text_tokens} prompt tokens plus max_tokens {max_tokens} leave no room in the model's {max_model_len}-token context"
        )));
    }
    let budget = (available as u64).min(u64::from(m.max_visual_tokens)) as u32;
    if budget == 0 {
        return Err(MediaError::NoBudget(
            "the model takes no visual tokens (max_visual_tokens is 0)".to_owned(),
        ));
    }
    Ok(budget)
}

/// Tokens for `frames` frames of a video: `ceil(frames / temporal_pooling) * image_tokens`.
pub fn video_tokens(m: &ModelMedia, info: &MediaInfo, frames: usize) -> u32 {
    let pooling = m.temporal_pooling.max(1) as usize;
    let groups = frames.div_ceil(pooling) as u64;
    let tokens = groups.saturating_mul(u64::from(image_tokens(m, info.width, info.height)));
    u32::try_from(tokens).unwrap_or(u32::MAX)
}

/// Tokens for `duration_s` seconds of audio: `ceil(duration_s * audio_tokens_per_second)`, at
/// least 1.
pub fn audio_tokens(m: &ModelMedia, duration_s: f64) -> u32 {
    let tokens = (duration_s * m.audio_tokens_per_second).ceil();
    if tokens.is_nan() { 1 } else { (tokens as u32).max(1) }
}

/// `k` of `indices`, evenly spaced: `indices[int(i * len / k)]`.
fn thin(indices: Vec<u32>, k: usize) -> Vec<u32> {
    if indices.len() <= k {
        return indices;
    }
    let step = indices.len() as f64 / k as f64;
    (0..k)
        .filter_map(|i| indices.get((i as f64 * step) as usize).copied())
        .collect()
}

/// The frames of a video the model sees, as indices into the file's frames (ascending).
///
/// First the sampler of `m.video_sampling`: uniform (all frames if at most
/// `max_frames`, else `max_frames` at `int(i * total / max_frames)`), fps (every
/// `max(1, int(native_fps / fps))`-th frame) or keyframe (the container's sync frames, with frame
/// 0; see the module doc). Then the caps: more than `max_frames` are thinned to `max_frames`
/// (`indices[int(i * len / max_frames)]`), and more than the budget holds are thinned to the most
/// whose pooled groups fit: `ceil(frames / temporal_pooling) * tokens_per_frame <= budget_tokens`.
/// An error when the video has no frames, or when not even one pooled group fits the budget.
pub fn select_frames(m: &ModelMedia, info: &MediaInfo, budget_tokens: u32) -> Result<Vec<u32>, MediaError> {
    let total = info.frame_count;
    if total == 0 {
        return Err(MediaError::NoBudget("the video has no frames".to_owned()));
    }
    let max_frames = m.max_frames.max(1) as usize;
    let indices: Vec<u32> = match m.video_sampling {
        FrameSampling::Uniform => (0..total).collect(),
        FrameSampling::Fps(fps) => {
            let fps = if fps.is_finite() && fps > 0.0 { fps } else { 2.0 };
            let step = (info.frame_rate / fps) as u32;
            (0..total).step_by(step.max(1) as usize).collect()
        }
        FrameSampling::Keyframe => {
            let mut k: Vec<u32> = info.keyframes.iter().copied().filter(|&i| i < total).collect();
            if k.is_empty() {
                k = (0..total).collect();
            }
            k.push(0);
            k.sort_unstable();
            k.dedup();
            k
        }
    };
    let indices = thin(indices, max_frames);

    let per_frame = u64::from(image_tokens(m, info.width, info.height));
    let pooling = u64::from(m.temporal_pooling.max(1));
    let groups = u64::from(budget_tokens) / per_frame;
    if groups == 0 {
        return Err(MediaError::NoBudget(format!(
            "one video frame ({per_frame} tokens{}) exceeds the {budget_tokens} tokens left for media",
            if pooling > 1 {
                format!(", {pooling} frames pooled")
            } else {
                String::new()
            }
        )));
    }
    let fit = usize::try_from(groups.saturating_mul(pooling)).unwrap_or(usize::MAX);
    Ok(thin(indices, fit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::info::{Container, MediaInfo};

    fn video(width: u32, height: u32, frames: u32, fps: f64) -> MediaInfo {
        let mut info = MediaInfo::new(Container::Mp4, b"");
        info.width = width;
        info.height = height;
        info.frame_count = frames;
        info.frame_rate = fps;
        info.duration_s = f64::from(frames) / fps;
        info
    }

    #[test]
    fn seed_000_image_tokens() {
        let m = ModelMedia::default();
        assert_eq!(image_tokens(&m, 336, 336), 576);
        // Fixed resolution: every image is resized to 336x336.
        assert_eq!(image_tokens(&m, 1920, 1080), 576);
        assert_eq!(image_tokens(&m, 1, 1), 576);
        // Four images at a fixed 336 pixels: 2,304 tokens.
        assert_eq!(4 * image_tokens(&m, 640, 480), 2304);
    }

    #[test]
    fn native_resolution() {
        let m = ModelMedia {
            image_size: None,
            spatial_merge: 2,
            ..ModelMedia::default()
        };
        // 28-pixel units: 336x336 is 12x12 merged tokens.
        assert_eq!(resized(&m, 336, 336), (336, 336));
        assert_eq!(image_tokens(&m, 336, 336), 144);
        // Rounded to the nearest unit, at least one.
        assert_eq!(resized(&m, 300, 10), (308, 28));
        // Too large: scaled down within max_pixels, aspect ratio kept.
        let (w, h) = resized(&m, 4000, 3000);
        assert!(u64::from(w) * u64::from(h) <= m.max_pixels, "{w}x{h}");
        assert_eq!((w % 28, h % 28), (0, 0));
        assert!((f64::from(w) / f64::from(h) - 4.0 / 3.0).abs() < 0.1);
        // Too small: scaled up to at least min_pixels.
        let (w, h) = resized(&m, 10, 10);
        assert!(u64::from(w) * u64::from(h) >= m.min_pixels, "{w}x{h}");
        // Degenerate settings and sizes never panic.
        let z = ModelMedia {
            image_size: None,
            patch_size: 0,
            spatial_merge: 0,
            min_pixels: 0,
            max_pixels: 0,
            ..m
        };
        let _ = image_tokens(&z, 0, 0);
        let _ = image_tokens(&z, u32::MAX, u32::MAX);
        assert!(z.validate().is_err());
    }

    #[test]
    fn seed_000_budget_and_frames() {
        let m = ModelMedia {
            temporal_pooling: 1,
            ..ModelMedia::default()
        };
        // min(32768 - 1000 - 512, 8192) = 8192.
        let budget = visual_budget(&m, 32768, 1000, 512).unwrap();
        assert_eq!(budget, 8192);
        // select_frame_count(8192, 576) = 14 frames without pooling.
        // 60 s at 30 fps, sampled at 2 fps: 120 frames, capped at 32, then at the budget.
        let info = video(336, 336, 1800, 30.0);
        let frames = select_frames(&m, &info, budget).unwrap();
        assert_eq!(frames.len(), 14);
        assert_eq!(video_tokens(&m, &info, frames.len()), 14 * 576);
        // With pooling 2: 28 frames in 14 groups.
        let m2 = ModelMedia::default();
        let frames = select_frames(&m2, &info, budget).unwrap();
        assert_eq!(frames.len(), 28);
        assert_eq!(video_tokens(&m2, &info, frames.len()), 14 * 576);
        assert!(frames.windows(2).all(|w| w[0] < w[1]));
        // Odd counts round up: 3 frames pooled by 2 are 2 groups.
        assert_eq!(video_tokens(&m2, &info, 3), 2 * 576);
    }

    #[test]
    fn seed_000_long_video_fits_a_32k_model() {
        // 60 s at 2 fps: 120 frames, 69,120 tokens unpooled, against a 32K model.
        let m = ModelMedia::default();
        let info = video(640, 480, 120, 2.0);
        let budget = visual_budget(&m, 32768, 200, 1024).unwrap();
        let frames = select_frames(&m, &info, budget).unwrap();
        let cap = (budget / image_tokens(&m, 640, 480)) as usize * m.temporal_pooling as usize;
        assert!(!frames.is_empty() && frames.len() <= cap && frames.len() <= m.max_frames as usize);
        assert!(video_tokens(&m, &info, frames.len()) <= budget);
        // The same video at 30 fps, sampled at 2 fps, gets the same treatment.
        let info = video(640, 480, 1800, 30.0);
        let frames = select_frames(&m, &info, budget).unwrap();
        assert!(frames.len() <= cap && video_tokens(&m, &info, frames.len()) <= budget);
    }

    #[test]
    fn seed_000_budget_errors() {
        let m = ModelMedia::default();
        // Text plus max_tokens past the context: a 400, not one frame.
        let e = visual_budget(&m, 32768, 30000, 4000).unwrap_err();
        assert!(matches!(e, MediaError::NoBudget(_)), "{e}");
        assert!(visual_budget(&m, 32768, 30000, 2768).is_err()); // exactly zero left
        assert_eq!(visual_budget(&m, 32768, 30000, 2000).unwrap(), 768);
        // A budget below one frame's tokens: an error, not an empty selection.
        let info = video(336, 336, 60, 30.0);
        assert!(matches!(select_frames(&m, &info, 575), Err(MediaError::NoBudget(_))));
        // One pooled group fits: two frames.
        assert_eq!(select_frames(&m, &info, 576).unwrap().len(), 2);
        assert!(select_frames(&m, &video(336, 336, 0, 30.0), 8192).is_err());
    }

    #[test]
    fn samplers() {
        let big = 1_000_000;
        let info = video(336, 336, 100, 30.0);
        // Uniform: total <= max_frames takes all; else int(i * total / max_frames).
        let m = ModelMedia {
            video_sampling: FrameSampling::Uniform,
            max_frames: 32,
            ..ModelMedia::default()
        };
        assert_eq!(
            select_frames(&m, &video(336, 336, 20, 30.0), big).unwrap(),
            (0..20).collect::<Vec<_>>()
        );
        let frames = select_frames(&m, &info, big).unwrap();
        assert_eq!(frames.len(), 32);
        assert_eq!(&frames[..4], &[0, 3, 6, 9]); // step 3.125
        assert_eq!(frames[31], 96);
        // Fps: step int(30 / 2) = 15: 0, 15, ..., 90.
        let m = ModelMedia {
            video_sampling: FrameSampling::Fps(2.0),
            ..m
        };
        assert_eq!(select_frames(&m, &info, big).unwrap(), vec![0, 15, 30, 45, 60, 75, 90]);
        // Native fps below the sampling rate: every frame.
        assert_eq!(
            select_frames(&m, &video(336, 336, 5, 1.0), big).unwrap(),
            vec![0, 1, 2, 3, 4]
        );
        // Keyframe: the container's sync frames, with frame 0.
        let m = ModelMedia {
            video_sampling: FrameSampling::Keyframe,
            ..m
        };
        let mut kf = info.clone();
        kf.keyframes = vec![10, 40, 70, 200];
        assert_eq!(select_frames(&m, &kf, big).unwrap(), vec![0, 10, 40, 70]);
        // No sync-frame table (MP4 without stss): every frame is a sync frame, capped.
        assert_eq!(select_frames(&m, &info, big).unwrap().len(), 32);
    }

    #[test]
    fn audio() {
        let m = ModelMedia::default();
        assert_eq!(audio_tokens(&m, 30.0), 750);
        assert_eq!(audio_tokens(&m, 0.01), 1);
        assert_eq!(audio_tokens(&m, 0.0), 1);
        assert_eq!(audio_tokens(&m, f64::NAN), 1);
        assert_eq!(
            audio_tokens(
                &ModelMedia {
                    audio_tokens_per_second: 50.0,
                    ..m
                },
                30.0
            ),
            1500
        );
    }

    #[test]
    fn settings_from_configuration() {
        let m: ModelMedia =
            toml::from_str("patch_size = 16\nvideo_sampling = { fps = 1.0 }\nimage_size = 448").unwrap();
        assert_eq!(
            (m.patch_size, m.image_size, m.video_sampling),
            (16, Some(448), FrameSampling::Fps(1.0))
        );
        assert_eq!(m.max_frames, 32);
        let m: ModelMedia = toml::from_str("video_sampling = \"keyframe\"").unwrap();
        assert_eq!(m.video_sampling, FrameSampling::Keyframe);
        let m: ModelMedia = toml::from_str("image_size = \"native\"\nspatial_merge = 2").unwrap();
        assert_eq!((m.image_size, m.spatial_merge), (None, 2));
        assert!(toml::from_str::<ModelMedia>("image_size = \"big\"").is_err());
        let back: ModelMedia = toml::from_str(&toml::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(toml::from_str::<ModelMedia>("patch-size = 16").is_err());
        assert!(toml::from_str::<ModelMedia>("bogus = 1").is_err());
        assert!(ModelMedia::default().validate().is_ok());
        assert!(
            ModelMedia {
                video_sampling: FrameSampling::Fps(0.0),
                ..ModelMedia::default()
            }
            .validate()
            .is_err()
        );
        assert_eq!(ModelMedia::default().feature_bytes_per_token(), 8192);
    }
}
