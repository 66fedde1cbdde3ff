//! Multimodal workloads: media items added to a trace's requests.
//!
//! [`MediaMix`] says what share of requests carries an image, an audio clip or a video, how
//! large they are, and how often an item repeats one sent before (the same bytes, so an
//! encoder's feature cache can serve it). [`add_media`] draws that for each request from its
//! own seeded stream, so the text side of a trace (prefixes, lengths, arrivals) is untouched
//! and equal seeds give equal workloads.

use anyhow::ensure;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::trace::{TraceMedia, TraceMediaKind, TraceRequest};

/// What media a workload's requests carry.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaMix {
    /// Share of requests with one image, in `[0, 1]`.
    pub image_share: f64,
    /// Share of requests with one audio clip.
    pub audio_share: f64,
    /// Share of requests with one video.
    pub video_share: f64,
    /// Probability that an item repeats an earlier item of its kind (same bytes).
    pub repeat_rate: f64,
    /// Image sides to draw from, in pixels (uniformly).
    pub image_sides: Vec<u32>,
    /// Audio lengths, in seconds: drawn uniformly from `[min, max]`.
    pub audio_seconds: (u32, u32),
    /// Video lengths, in seconds: drawn uniformly from `[min, max]`.
    pub video_seconds: (u32, u32),
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for MediaMix {
    fn default() -> MediaMix {
        MediaMix {
            image_share: 0.0,
            audio_share: 0.0,
            video_share: 0.0,
            repeat_rate: 0.0,
            image_sides: vec![224, 336, 448],
            audio_seconds: (2, 15),
            video_seconds: (2, 8),
            seed: 0,
        }
    }
}

impl MediaMix {
    /// Whether any request gets media.
    pub fn is_empty(&self) -> bool {
        self.image_share + self.audio_share + self.video_share <= 0.0
    }

    /// Checks the shares and ranges.
    ///
    /// # Errors
    ///
    /// Names the first setting out of range.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, share) in [
            ("image share", self.image_share),
            ("audio share", self.audio_share),
            ("video share", self.video_share),
            ("repeat rate", self.repeat_rate),
        ] {
            ensure!(
                (0.0..=1.0).contains(&share),
                "the {name} must lie in [0, 1], not {share}"
            );
        }
        let total = self.image_share + self.audio_share + self.video_share;
        ensure!(total <= 1.0 + 1e-9, "the media shares add up to {total}, more than 1");
        ensure!(
            !self.image_sides.is_empty() && self.image_sides.iter().all(|side| *side > 0),
            "image sides must be positive"
        );
        for (name, (min, max)) in [("audio", self.audio_seconds), ("video", self.video_seconds)] {
            ensure!(
                0 < min && min <= max,
                "{name} seconds must be 1 <= min <= max, not {min}..{max}"
            );
        }
        Ok(())
    }
}

/// Gives each of `requests` the media `mix` draws for it (replacing any it had).
///
/// # Errors
///
/// Fails if `mix` does not [`MediaMix::validate`].
pub fn add_media(requests: &mut [TraceRequest], mix: &MediaMix) -> anyhow::Result<()> {
    mix.validate()?;
    let mut rng = SmallRng::seed_from_u64(mix.seed ^ 0x4D45_4449_4100_0000);
    let mut sent: [Vec<TraceMedia>; 3] = Default::default();
    for request in requests.iter_mut() {
        request.media.clear();
        // Every request takes the same four draws, whatever it gets, so two mixes differing
        // only in one share give the same items to every request the change does not touch.
        let (draw, repeat, pick, size): (f64, f64, f64, f64) = (rng.random(), rng.random(), rng.random(), rng.random());
        let kind = if draw < mix.image_share {
            TraceMediaKind::Image
        } else if draw < mix.image_share + mix.audio_share {
            TraceMediaKind::Audio
        } else if draw < mix.image_share + mix.audio_share + mix.video_share {
            TraceMediaKind::Video
        } else {
            continue;
        };
        let earlier = &mut sent[kind as usize];
        let within = |len: usize, at: f64| ((at * len as f64) as usize).min(len.saturating_sub(1));
        let between = |(min, max): (u32, u32)| min + within((max - min + 1) as usize, size) as u32;
        let item = if repeat < mix.repeat_rate && !earlier.is_empty() {
            earlier[within(earlier.len(), pick)]
        } else {
            let size = match kind {
                TraceMediaKind::Image => mix.image_sides[within(mix.image_sides.len(), size)],
                TraceMediaKind::Audio => between(mix.audio_seconds),
                TraceMediaKind::Video => between(mix.video_seconds),
            };
            // Ids count up per kind from a base of its own, so one kind's items never shift
            // another's ids.
            let id = (kind as u64 + 1) << 48 | (earlier.len() as u64 + 1);
            let item = TraceMedia { kind, id, size };
            earlier.push(item);
            item
        };
        request.media.push(item);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests(n: usize) -> Vec<TraceRequest> {
        (0..n)
            .map(|i| TraceRequest {
                timestamp: i as u64 * 10,
                input_length: 100,
                output_length: 10,
                hash_ids: vec![i as u64],
                media: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn shares_and_repeats_come_out_near_what_was_asked() {
        let mut trace = requests(4000);
        let mix = MediaMix {
            image_share: 0.3,
            audio_share: 0.1,
            video_share: 0.1,
            repeat_rate: 0.5,
            seed: 7,
            ..MediaMix::default()
        };
        add_media(&mut trace, &mix).expect("valid");
        let count = |kind: &str| trace.iter().filter(|r| r.modality() == kind).count() as f64 / 4000.0;
        assert!((count("image") - 0.3).abs() < 0.03, "{}", count("image"));
        assert!((count("audio") - 0.1).abs() < 0.02);
        assert!((count("video") - 0.1).abs() < 0.02);
        assert!((count("text") - 0.5).abs() < 0.03);
        let items: Vec<&TraceMedia> = trace.iter().flat_map(|r| &r.media).collect();
        let distinct: std::collections::HashSet<u64> = items.iter().map(|m| m.id).collect();
        let repeated = 1.0 - distinct.len() as f64 / items.len() as f64;
        assert!((repeated - 0.5).abs() < 0.05, "{repeated}");
        let mut again = requests(4000);
        add_media(&mut again, &mix).expect("valid");
        assert_eq!(trace, again, "equal seeds, equal workloads");
        // Without video, the requests that had one are text and every other keeps its item.
        let mut without = requests(4000);
        add_media(
            &mut without,
            &MediaMix {
                video_share: 0.0,
                ..mix
            },
        )
        .expect("valid");
        for (with, without) in trace.iter().zip(&without) {
            match with.modality() {
                "video" => assert!(without.media.is_empty()),
                _ => assert_eq!(with.media, without.media),
            }
        }
    }

    #[test]
    fn shares_over_one_are_refused() {
        let mix = MediaMix {
            image_share: 0.7,
            video_share: 0.4,
            ..MediaMix::default()
        };
        assert!(add_media(&mut requests(3), &mix).is_err());
    }
}
