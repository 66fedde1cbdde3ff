//! Stage 4 of the request path: where a request's media is encoded.
//!
//! Every media item needs an encoder of its kind; the host chooses one for each, and the
//! encoders join the router's table as rows so a policy may choose them with the worker (its
//! choice for a role wins at each attempt). Without an encoder pool (`[encoders] local`) each
//! worker encodes its own media; without an encoder for some item the answer is the text's
//! alone, and says so.

use std::sync::Arc;

use switchyard_protocol::encode::{MediaPlan, PlannedItem, estimate_ms};

use super::pipeline::Admitted;
use super::prompt::Prepared;
use crate::encoders;
use crate::media;
use crate::routing::{EncoderRow, Lease};
use crate::state::AppState;
use crate::workers::Worker;

/// Where a request's media goes.
pub(super) struct MediaPlanning {
    /// The host's encoder for each item, in item order; `None` when some item has no encoder
    /// of its kind.
    pub(super) chosen: Option<Vec<Arc<Worker>>>,
    /// Each worker encodes its own media (`[encoders] local`).
    pub(super) local: bool,
    /// The encoders as rows of the router's table (empty without media or with `local`).
    pub(super) encoder_rows: Vec<EncoderRow>,
    /// Estimated tokens of all the media items.
    pub(super) media_tokens: u32,
}

/// Stage 4: counts the request's media items, chooses an encoder for each, and makes the
/// encoders rows of the router's table.
pub(super) fn plan_media(state: &AppState, admitted: &Admitted, prepared: &Prepared) -> MediaPlanning {
    let items = &prepared.media_items;
    let media_tokens = items.iter().map(|item| item.tokens).sum::<u32>();
    for item in items {
        state.metrics.media_item(media::kind_label(item.info.kind), item.tokens);
    }
    let chosen: Option<Vec<Arc<Worker>>> = items
        .iter()
        .map(|item| state.encoders.choose(admitted.model(), item, &[]))
        .collect();
    let local = state.encoders.config().local;
    let encoder_rows = match &chosen {
        Some(_) if !items.is_empty() && !local => state.encoders.rows(admitted.model(), items),
        _ => Vec::new(),
    };
    MediaPlanning {
        chosen,
        local,
        encoder_rows,
        media_tokens,
    }
}

impl MediaPlanning {
    /// The encoder of each item for an attempt on `lease`'s worker: the policy's for a role
    /// wins, the host's choice fills the rest. `None` when some item has no encoder.
    pub(super) fn encoders_for(&self, lease: &Lease, items: &[media::MediaItem]) -> Option<Vec<Arc<Worker>>> {
        self.chosen.as_ref().map(|host| {
            items
                .iter()
                .zip(host)
                .map(|(item, host)| {
                    lease
                        .encoder_for(encoders::role_for(item.info.kind))
                        .unwrap_or(host)
                        .clone()
                })
                .collect()
        })
    }
}

/// The plan the worker gets for request `key`'s media: each item with its span in the prompt
/// and the encoder `encoders` names for it.
pub(super) fn media_plan(key: String, prepared: &Prepared, encoders: &mut dyn Iterator<Item = String>) -> MediaPlan {
    MediaPlan {
        request: key,
        items: prepared
            .media_items
            .iter()
            .zip(&prepared.spans)
            .map(|(item, span)| PlannedItem {
                media_id: item.id(),
                kind: item.info.kind,
                tokens: item.tokens,
                start: span.start,
                encoder: encoders.next().unwrap_or_default(),
                estimate_us: (estimate_ms(item.info.kind, item.frames.len(), item.info.duration_s) * 1000.0) as u64,
            })
            .collect(),
    }
}
