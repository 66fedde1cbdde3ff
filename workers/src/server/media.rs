//! Requests with media on an LLM worker: the gateway's plan, the features encoders push, the
//! gated prefill and the text-only fallback.
//!
//! A forwarded request with media carries a [`MediaPlan`] header. The worker builds the prompt
//! with each item's span in place (the same token ids and block hashes as the gateway's),
//! registers the items with its [`FeatureTracker`](crate::features::FeatureTracker), and submits the prompt gated at the first
//! span, so the text before it is prefilled while the encoders work (or at 0 with overlap off).
//! Encoders push each item's features to `POST /v1/features/{request}/{slot}`; when all have
//! arrived they are staged, merged by the position map, and the gate opens. If the features
//! arrive with other row counts than planned (an encoder retried with fewer frames) the prompt
//! is rebuilt with the real counts. Items planned with the encoder [`LOCAL_ENCODER`] (a fleet
//! without an encoder pool) are encoded here, one at a time, holding the engine's device for
//! their reference encode time. If the gateway abandons the media
//! (`POST /v1/features/{request}/abandon`), a feature is evicted, or nothing arrives within the
//! feature timeout, the request is answered from its text alone and says so in
//! [`MEDIA_HEADER`]. Whatever happens, the request's features are released when it ends.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use switchyard_media::MediaId;
use switchyard_protocol::api::{ApiError, GenerateRequest};
use switchyard_protocol::encode::{
    FEATURE_DIM_HEADER, LOCAL_ENCODER, MEDIA_HEADER, MEDIA_ID_HEADER, MEDIA_PLAN_HEADER, MERGE_HEADER, MediaPlan,
    TOKENS_HEADER, format_merge, valid_request_id,
};
use switchyard_protocol::respond::{self, Body};
use switchyard_tokenize::{MediaSlot, PromptEncoder, media_token};
use tokio::sync::mpsc;

use super::{State, TextCodec, submit_error};
use crate::engine::{MediaSpan, Output, PrefillGate, SamplingParams};
use crate::features::{Readiness, TrackerError, build_position_map};

/// Path prefix of feature pushes and abandons.
pub(super) const FEATURES_PREFIX: &str = "/v1/features/";

/// Token standing for one placeholder while the position map is built (above every media and
/// text token).
const PLACEHOLDER: u32 = u32::MAX;

/// A request submitted to the engine, with what its answer must carry.
pub(super) struct Started {
    pub(super) outputs: mpsc::UnboundedReceiver<Output>,
    pub(super) prompt_tokens: u32,
    pub(super) guard: Option<FeatureGuard>,
    /// A header for the answer: the merge report, or the text-only flag.
    pub(super) header: Option<(&'static str, String)>,
}

/// Holds a request's features until its generation ends; marks them prefilled at the first
/// generated token.
pub(super) struct FeatureGuard {
    state: Arc<State>,
    request: String,
    prefilled: bool,
}

impl FeatureGuard {
    /// The request's prompt is prefilled: its features are kept or freed per configuration.
    pub(super) fn prefilled(&mut self) {
        if self.prefilled {
            return;
        }
        self.prefilled = true;
        if let Ok(mut tracker) = self.state.features.lock()
            && let Err(err) = tracker.prefilled(&self.request)
        {
            tracing::warn!(request = %self.request, error = %err, "features were not merged at prefill");
        }
    }
}

impl Drop for FeatureGuard {
    fn drop(&mut self) {
        if let Ok(mut tracker) = self.state.features.lock() {
            tracker.release(&self.request);
        }
    }
}

/// The request's media plan, if it has one.
pub(super) fn plan(headers: &HeaderMap) -> Result<Option<MediaPlan>, ApiError> {
    let Some(value) = headers.get(MEDIA_PLAN_HEADER) else {
        return Ok(None);
    };
    let plan: MediaPlan = serde_json::from_slice(value.as_bytes()).map_err(|err| {
        ApiError::invalid_request(
            "invalid_media_plan",
            format!("the {MEDIA_PLAN_HEADER} header does not parse: {err}"),
        )
    })?;
    if !valid_request_id(&plan.request) {
        return Err(ApiError::invalid_request(
            "invalid_media_plan",
            "the media plan's request id must be 1 to 128 letters, digits, `-` or `_`",
        ));
    }
    Ok(Some(plan))
}

fn encoder(state: &State) -> Arc<PromptEncoder> {
    match &state.config.codec {
        TextCodec::MockWords => Arc::new(PromptEncoder::default()),
        TextCodec::Model(encoder) => encoder.clone(),
    }
}

fn tokenization_failed(err: switchyard_tokenize::TokenizeError) -> ApiError {
    ApiError::invalid_request("tokenization_failed", err.to_string())
}

/// Submits a request with media gated at its first span and waits until its features are
/// merged (then opens the gate) or will not come (then answers text-only).
pub(super) async fn start(
    state: &Arc<State>,
    request: &GenerateRequest,
    plan: MediaPlan,
    params: SamplingParams,
) -> Result<Started, ApiError> {
    let encoder = encoder(state);
    let slots: Vec<MediaSlot> = plan
        .items
        .iter()
        .map(|item| MediaSlot {
            token: media_token(item.media_id.0),
            tokens: item.tokens,
        })
        .collect();
    let prompt = encoder
        .prompt_with_media(request, &slots)
        .map_err(tokenization_failed)?;
    for (span, item) in prompt.spans.iter().zip(&plan.items) {
        if span.start != item.start {
            tracing::warn!(
                media = %item.media_id,
                gateway = item.start,
                worker = span.start,
                "the gateway placed a media span elsewhere: its tokenizer or template differs"
            );
        }
    }
    let items: Vec<(MediaId, u32)> = plan.items.iter().map(|i| (i.media_id, i.tokens)).collect();
    let notify = state
        .features
        .lock()
        .map_err(|_| poisoned())?
        .register(&plan.request, &items);
    let guard = FeatureGuard {
        state: state.clone(),
        request: plan.request.clone(),
        prefilled: false,
    };
    let first_span = prompt.spans.first().map_or(0, |span| span.start as usize);
    let gate = PrefillGate::new(if state.config.overlap_prefill { first_span } else { 0 });
    let outputs = state
        .engine
        .submit_gated(prompt.tokens.clone(), params.clone(), Some(gate.clone()))
        .map_err(submit_error)?;
    encode_locally(state, &plan);
    let deadline = tokio::time::Instant::now() + state.config.feature_timeout;
    let failure = loop {
        let readiness = state.features.lock().map_err(|_| poisoned())?.readiness(&plan.request);
        match readiness {
            Readiness::Waiting => {
                if tokio::time::timeout_at(deadline, notify.notified()).await.is_err() {
                    break "feature-timeout".to_string();
                }
            }
            Readiness::Failed(reason) => break reason,
            Readiness::Ready => match merge(state, &plan.request, deadline).await {
                Ok((rows, features)) => {
                    let (entries, len) = placeholder_map(&prompt.tokens, &prompt.spans, &rows)
                        .ok_or_else(|| internal("the position map does not fit the prompt"))?;
                    let spans: Vec<_> = entries.iter().map(|e| e.span.clone()).collect();
                    let header = Some((MERGE_HEADER, format_merge(len, &spans)));
                    // A backend that merges feature rows gets them with the gate.
                    let media = match media_spans(state, &entries, &features) {
                        Ok(media) => media,
                        Err(reason) => break reason,
                    };
                    let open = |gate: &PrefillGate| match media.clone() {
                        Some(media) => gate.open_with_media(media),
                        None => gate.open(),
                    };
                    if spans == prompt.spans {
                        open(&gate);
                        state.engine.wake();
                        return Ok(Started {
                            outputs,
                            prompt_tokens: len as u32,
                            guard: Some(guard),
                            header,
                        });
                    }
                    // An encoder delivered other row counts (fewer frames after running out of
                    // memory): the prompt is rebuilt with the real ones; the prefix stays cached.
                    drop(outputs);
                    let slots: Vec<MediaSlot> = slots
                        .iter()
                        .zip(&rows)
                        .map(|(slot, &tokens)| MediaSlot { tokens, ..*slot })
                        .collect();
                    let merged = prompt.with_slots(&slots);
                    let merged_gate = PrefillGate::new(0);
                    open(&merged_gate);
                    return Ok(Started {
                        prompt_tokens: merged.tokens.len() as u32,
                        outputs: state
                            .engine
                            .submit_gated(merged.tokens, params, Some(merged_gate))
                            .map_err(submit_error)?,
                        guard: Some(guard),
                        header,
                    });
                }
                Err(reason) => break reason,
            },
        }
    };
    // The media will not come: the answer is the text's alone.
    drop(outputs);
    drop(guard);
    state.text_only.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(request = %plan.request, reason = %failure, "answering text-only");
    let text = encoder.prompt_tokens(request).map_err(tokenization_failed)?;
    Ok(Started {
        prompt_tokens: text.len() as u32,
        outputs: state.engine.submit(text, params).map_err(submit_error)?,
        guard: None,
        header: Some((MEDIA_HEADER, format!("text-only; reason={failure}"))),
    })
}

/// Feature width of the items a worker encodes itself (the simulated encoders' default).
const LOCAL_FEATURE_DIM: usize = 64;

/// Encodes the plan's items marked [`LOCAL_ENCODER`] on this worker's own engine, one after
/// another: each holds the device for its reference encode time (no step runs meanwhile, as
/// when a vision tower shares the LLM's GPU), then its features are delivered as an encoder's
/// push would be.
fn encode_locally(state: &Arc<State>, plan: &MediaPlan) {
    let local: Vec<(usize, MediaId, u32, u64)> = plan
        .items
        .iter()
        .enumerate()
        .filter(|(_, item)| item.encoder == LOCAL_ENCODER)
        .map(|(slot, item)| (slot, item.media_id, item.tokens, item.estimate_us))
        .collect();
    if local.is_empty() {
        return;
    }
    let state = state.clone();
    let request = plan.request.clone();
    tokio::spawn(async move {
        for (slot, media_id, tokens, estimate_us) in local {
            let work = Duration::from_micros(estimate_us).mul_f64(state.config.local_encode_scale.max(0.0));
            state.engine.occupy(work).await;
            let rows = Bytes::from(vec![0u8; tokens as usize * LOCAL_FEATURE_DIM * 2]);
            let delivered = state
                .features
                .lock()
                .map(|mut tracker| tracker.deliver(&request, slot, media_id, tokens, rows));
            match delivered {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(%request, slot, error = %err, "locally encoded features not taken"),
                Err(_) => tracing::error!(%request, "the feature tracker is poisoned"),
            }
        }
    });
}

/// The merged features as rows at their prompt positions, for an engine whose model merges
/// feature rows (`None` for one that does not use their values). A width other than the
/// model's is a failure (`feature-dim-mismatch`): the encoder serves another model.
fn media_spans(
    state: &State,
    entries: &[crate::features::PositionEntry],
    features: &[Bytes],
) -> Result<Option<Vec<MediaSpan>>, String> {
    let Some(dim) = state.engine.limits().media_dim else {
        return Ok(None);
    };
    entries
        .iter()
        .zip(features)
        .map(|(entry, bytes)| {
            let rows = entry.span.len();
            if rows == 0 || bytes.len() != rows * dim * 2 {
                tracing::warn!(
                    slot = entry.slot,
                    bytes = bytes.len(),
                    rows,
                    model_dim = dim,
                    "media features do not have the model's width"
                );
                return Err("feature-dim-mismatch".to_string());
            }
            Ok(MediaSpan {
                start: entry.span.start as usize,
                dim,
                rows: bytes
                    .as_chunks::<2>()
                    .0
                    .iter()
                    .map(|b| f16_to_f32(u16::from_le_bytes(*b)))
                    .collect(),
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// An IEEE 754 half (binary16) widened to f32, exactly: the wire form of feature rows. (The
/// `half` crate would do it, but it must stay out of the gateway, which embeds this server.)
fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exponent = u32::from((bits >> 10) & 0x1f);
    let mantissa = u32::from(bits & 0x3ff);
    let magnitude = match (exponent, mantissa) {
        (0, 0) => 0,
        // Subnormal: mantissa × 2^−24, exact in f32.
        (0, m) => {
            let value = m as f32 * 2f32.powi(-24);
            return if sign != 0 { -value } else { value };
        }
        (0x1f, m) => 0x7f80_0000 | (m << 13),
        (e, m) => ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// Stages and merges a request's arrived features, waiting for staging room until the
/// deadline. Returns the rows each item arrived with, and the features.
async fn merge(state: &State, request: &str, deadline: tokio::time::Instant) -> Result<(Vec<u32>, Vec<Bytes>), String> {
    loop {
        // Reasons are short tokens: they end up in a response header and a metric label.
        let failed = |err: TrackerError| {
            tracing::warn!(%request, error = %err, "cannot merge the request's features");
            "merge-failed".to_string()
        };
        let staged = {
            let mut tracker = state.features.lock().map_err(|_| "tracker-poisoned".to_string())?;
            match tracker.stage(request) {
                Ok(()) => {
                    let features = tracker.merge(request).map_err(failed)?;
                    Some((tracker.arrived_tokens(request).unwrap_or_default(), features))
                }
                Err(TrackerError::StagingFull { .. }) => None,
                Err(err) => return Err(failed(err)),
            }
        };
        match staged {
            Some(rows) => return Ok(rows),
            None if tokio::time::Instant::now() >= deadline => return Err("staging-full".into()),
            None => tokio::time::sleep(std::time::Duration::from_millis(2)).await,
        }
    }
}

/// The position map of a prompt whose media spans are collapsed to one placeholder each and
/// refilled with `rows` rows.
fn placeholder_map(
    tokens: &[u32],
    spans: &[std::ops::Range<u32>],
    rows: &[u32],
) -> Option<(Vec<crate::features::PositionEntry>, usize)> {
    let mut collapsed = Vec::with_capacity(tokens.len());
    let mut at = 0usize;
    for span in spans {
        collapsed.extend_from_slice(tokens.get(at..span.start as usize)?);
        collapsed.push(PLACEHOLDER);
        at = span.end as usize;
    }
    collapsed.extend_from_slice(tokens.get(at..)?);
    build_position_map(&collapsed, |t| t == PLACEHOLDER, rows)
}

/// `POST /v1/features/{request}/{slot}` (an encoder's push) and
/// `POST /v1/features/{request}/abandon` (the gateway gave up).
pub(super) async fn features(state: &State, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = request.uri().path().to_string();
    let rest = path.strip_prefix(FEATURES_PREFIX).unwrap_or_default();
    let Some((id, slot)) = rest.split_once('/') else {
        return Err(respond::not_found(&path));
    };
    if !valid_request_id(id) {
        return Err(respond::not_found(&path));
    }
    let (parts, body) = request.into_parts();
    if slot == "abandon" {
        let body = respond::read_limited(&parts.headers, body, 4096).await?;
        let reason: String = String::from_utf8_lossy(&body)
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .take(64)
            .collect();
        let reason = if reason.is_empty() {
            "abandoned".to_string()
        } else {
            reason
        };
        state.features.lock().map_err(|_| poisoned())?.abandon(id, &reason);
        return Ok(respond::text(StatusCode::OK, "text/plain", "abandoned\n"));
    }
    let slot: usize = slot.parse().map_err(|_| respond::not_found(&path))?;
    let header = |name: &str| -> Result<String, ApiError> {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| {
                ApiError::invalid_request("missing_header", format!("a feature push needs the {name} header"))
            })
    };
    let media_id: MediaId = header(MEDIA_ID_HEADER)?
        .parse()
        .map_err(|err| ApiError::invalid_request("invalid_header", format!("{MEDIA_ID_HEADER}: {err}")))?;
    let tokens: u32 = header(TOKENS_HEADER)?
        .parse()
        .map_err(|err| ApiError::invalid_request("invalid_header", format!("{TOKENS_HEADER}: {err}")))?;
    let dim: usize = header(FEATURE_DIM_HEADER)?
        .parse()
        .map_err(|err| ApiError::invalid_request("invalid_header", format!("{FEATURE_DIM_HEADER}: {err}")))?;
    let body: Bytes = respond::read_limited(&parts.headers, body, state.config.max_feature_bytes).await?;
    let expected = (tokens as usize).checked_mul(dim).and_then(|n| n.checked_mul(2));
    if expected != Some(body.len()) {
        return Err(ApiError::invalid_request(
            "invalid_features",
            format!(
                "{tokens} rows of {dim} f16 values are {} bytes; the body has {}",
                expected.map_or("too many".to_string(), |n| n.to_string()),
                body.len()
            ),
        ));
    }
    let delivered = state
        .features
        .lock()
        .map_err(|_| poisoned())?
        .deliver(id, slot, media_id, tokens, body);
    match delivered {
        Ok(()) => Ok(respond::text(StatusCode::OK, "text/plain", "taken\n")),
        Err(err @ TrackerError::IllegalTransition { .. }) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "features_already_delivered",
            err.to_string(),
        )),
        Err(err) => Err(ApiError::invalid_request("invalid_features", err.to_string())),
    }
}

fn poisoned() -> ApiError {
    internal("the feature tracker is unusable")
}

fn internal(message: &str) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "feature_tracker",
        message.to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::f16_to_f32;

    #[test]
    fn halves_widen_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0000), 0.0);
        assert!(f16_to_f32(0x8000).is_sign_negative());
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8001), -(2f32.powi(-24)));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
    }
}
