//! Decoder for vLLM's KV-cache event stream (`vllm/distributed/kv_events.py`).
//!
//! Wire format (one ZMQ multipart message per batch, sent by vLLM's PUB socket):
//!
//! ```text
//! frame 0: topic            (utf-8, KVEventsConfig.topic, default "")
//! frame 1: seq              (u64, 8 bytes big-endian, starts at 0 per publisher)
//! frame 2: payload          (msgspec msgpack of KVEventBatch)
//! ```
//!
//! Payload = `KVEventBatch(ts: float, events: list[...], data_parallel_rank: int | None)`.
//! The batch envelope is a positional msgpack array `[ts, events, dp_rank]` (msgspec
//! `array_like=True`). `dp_rank` is absent only from vLLM older than PR #18925 (msgspec does not
//! apply `omit_defaults` to `array_like` structs, msgspec issue #720, so a `None` would be nil,
//! and `ZmqEventPublisher.publish` always fills it in anyway). For robustness a map envelope
//! `{"ts", "events", "data_parallel_rank"}` is also accepted (one recent vLLM main snapshot
//! declares `EventBatch` without `array_like`).
//!
//! Each event is a msgspec tagged struct (`tag=True`, tag value = class name). Two encodings:
//! * map (vLLM after PR #42892, e.g. 0.26.x): `{"type": "BlockStored", "block_hashes": [...], ...}`
//!   in declaration order; fields declared with a default that still hold it are omitted
//!   (`omit_defaults=True`: `extra_keys`, `group_idx`, `kv_cache_spec_*` when `None`), fields
//!   without a default (`lora_id`, `medium`, `lora_name`) are always present, possibly nil.
//! * array (older vLLM, `array_like=True`): `["BlockStored", block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
//!   kv_cache_spec_kind, kv_cache_spec_sliding_window]`. Every declared field is always present
//!   (omit_defaults is a no-op for array_like); arrays are shorter only because older vLLM
//!   versions declared fewer fields (e.g. `[tag, block_hashes, parent, token_ids, block_size,
//!   lora_id]` before `medium` was added).
//!
//! Both encodings are accepted, per event. Missing optional fields decode as `None`; unknown
//! extra fields (extra map keys, extra trailing array elements) are ignored; a field present
//! with the wrong msgpack type is an error naming the field path (e.g.
//! `events[1].block_hashes[3]`). Events with an unknown tag are skipped and their tags are
//! listed in [`VllmBatch::skipped_event_tags`].
//!
//! Block hashes (`ExternalBlockHash = bytes | int`):
//! * msgpack int: unsigned values map directly; negative values (old vLLM used Python's signed
//!   `hash()`) are bit-cast from i64 to u64.
//! * msgpack bin (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; the default is `1` = int):
//!   folded to u64 with [`BytesHashFold`]. The default, [`BytesHashFold::Low64BigEndian`], is
//!   what vLLM itself does in int mode (`int.from_bytes(h, "big") & (2**64 - 1)`, i.e. the last
//!   8 bytes read big-endian), so one block gets the same u64 whichever mode the worker runs
//!   in. [`BytesHashFold::Xxh3`] (`xxhash_rust::xxh3::xxh3_64(bytes)`) is available but does
//!   NOT agree with int-mode workers.

use bytes::Bytes;
use rmpv::Value;

/// One decoded ZMQ message from a vLLM KV-event publisher.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmBatch {
    /// The ZMQ topic frame.
    pub topic: String,
    /// The publisher's sequence number (from 0, one per batch).
    pub seq: u64,
    /// Publisher timestamp (seconds).
    pub ts: f64,
    /// Data-parallel rank of the publishing engine.
    pub dp_rank: Option<u32>,
    /// The events, in order.
    pub events: Vec<VllmEvent>,
    /// Tags of events this decoder does not know (forward compatibility); they are skipped.
    pub skipped_event_tags: Vec<String>,
}

/// One vLLM KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum VllmEvent {
    /// Full blocks became cached.
    BlockStored {
        /// Chained block hashes, one per full block, in sequence order.
        block_hashes: Vec<u64>,
        /// Hash of the block preceding `block_hashes[0]`; `None` for the first block of a prompt.
        parent_block_hash: Option<u64>,
        /// `block_hashes.len() * block_size` token ids.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Deprecated in vLLM (kept for compatibility); prefer `lora_name`.
        lora_id: Option<u64>,
        /// "GPU" for the device cache; connectors/offloading use e.g. "CPU".
        medium: Option<String>,
        /// LoRA adapter name (the value vLLM hashes into block keys).
        lora_name: Option<String>,
        /// KV-cache group (hybrid models emit one event stream per group); `None` on old vLLM.
        group_idx: Option<u32>,
        /// e.g. "full_attention", "sliding_window", "mamba"; `None` on old vLLM.
        kv_cache_spec_kind: Option<String>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// The evicted blocks' hashes.
        block_hashes: Vec<u64>,
        /// Where they were.
        medium: Option<String>,
        /// KV-cache group.
        group_idx: Option<u32>,
    },
    /// Every cached block was dropped.
    AllBlocksCleared,
}

/// How a block hash sent as msgpack `bin` is reduced to a u64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BytesHashFold {
    /// `int.from_bytes(b, "big") & (2**64 - 1)`: identical to vLLM's own int-mode conversion.
    #[default]
    Low64BigEndian,
    /// `xxhash_rust::xxh3::xxh3_64(b)`.
    #[allow(
        dead_code,
        reason = "no configuration key selects it yet; the decoder's tests cover it"
    )]
    Xxh3,
}

impl BytesHashFold {
    /// Reduces a hash given as bytes to a u64.
    pub fn fold(self, b: &[u8]) -> u64 {
        match self {
            BytesHashFold::Low64BigEndian => b.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)),
            BytesHashFold::Xxh3 => xxhash_rust::xxh3::xxh3_64(b),
        }
    }
}

/// Why a message could not be decoded.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // each variant's message says what it is
pub enum DecodeError {
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    FrameCount(usize),
    #[error("topic frame is not valid utf-8")]
    TopicNotUtf8,
    #[error("seq frame must be 8 bytes (u64 big-endian), got {0} bytes")]
    SeqLength(usize),
    #[error("payload is not valid msgpack: {0}")]
    Msgpack(#[from] rmpv::decode::Error),
    #[error("payload has {0} trailing bytes after the batch value")]
    TrailingBytes(usize),
    #[error("`{path}`: expected {expected}, got {got}")]
    WrongType {
        path: String,
        expected: &'static str,
        got: &'static str,
    },
    #[error("`{path}`: required field missing")]
    MissingField { path: String },
    #[error("`{path}`: value {value} out of range for {target}")]
    OutOfRange {
        path: String,
        value: String,
        target: &'static str,
    },
}

/// Decodes one multipart message `[topic, seq, payload]` with the default bytes-hash fold.
///
/// # Errors
///
/// Returns [`DecodeError`] naming the frame or field that is wrong.
pub fn decode_batch(frames: &[Bytes]) -> Result<VllmBatch, DecodeError> {
    decode_batch_with(frames, BytesHashFold::default())
}

/// Decodes one multipart message with the given bytes-hash fold.
///
/// # Errors
///
/// Returns [`DecodeError`] naming the frame or field that is wrong.
pub fn decode_batch_with(frames: &[Bytes], fold: BytesHashFold) -> Result<VllmBatch, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount(frames.len()));
    };
    let topic = std::str::from_utf8(topic)
        .map_err(|_| DecodeError::TopicNotUtf8)?
        .to_owned();
    let seq: [u8; 8] = seq[..].try_into().map_err(|_| DecodeError::SeqLength(seq.len()))?;
    let seq = u64::from_be_bytes(seq);
    let (ts, dp_rank, events, skipped_event_tags) = decode_payload(payload, fold)?;
    Ok(VllmBatch {
        topic,
        seq,
        ts,
        dp_rank,
        events,
        skipped_event_tags,
    })
}

/// A decoded payload: timestamp, DP rank, events, and the tags of skipped unknown events.
pub type Payload = (f64, Option<u32>, Vec<VllmEvent>, Vec<String>);

/// Decodes the msgpack payload frame alone (also what the replay socket returns).
///
/// # Errors
///
/// Returns [`DecodeError`] naming the field that is wrong.
pub fn decode_payload(payload: &[u8], fold: BytesHashFold) -> Result<Payload, DecodeError> {
    let mut cursor = payload;
    let root = rmpv::decode::read_value(&mut cursor)?;
    if !cursor.is_empty() {
        return Err(DecodeError::TrailingBytes(cursor.len()));
    }
    let batch = Fields::of(&root, "batch")?;
    let ts = match batch.get(0, "ts") {
        Some(v) => to_f64(v, "ts")?,
        None => return Err(missing("ts")),
    };
    let raw_events = match batch.get(1, "events") {
        Some(Value::Array(a)) => a,
        Some(other) => return Err(wrong("events", "array", other)),
        None => return Err(missing("events")),
    };
    let dp_rank = opt(batch.get(2, "data_parallel_rank"), |v| to_u32(v, "data_parallel_rank"))?;

    let mut events = Vec::with_capacity(raw_events.len());
    let mut skipped = Vec::new();
    for (i, raw) in raw_events.iter().enumerate() {
        let path = format!("events[{i}]");
        match decode_event(raw, &path, fold)? {
            Decoded::Known(ev) => events.push(ev),
            Decoded::Unknown(tag) => skipped.push(tag),
        }
    }
    Ok((ts, dp_rank, events, skipped))
}

enum Decoded {
    Known(VllmEvent),
    Unknown(String),
}

/// Field access that works for both msgspec encodings. For the array form, `pos` is the index
/// in the array *after* the tag has been stripped (for events) or the plain index (for the
/// batch); for the map form, `name` is the key.
enum Fields<'a> {
    Pos(&'a [Value]),
    Named(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    fn of(v: &'a Value, path: &str) -> Result<Self, DecodeError> {
        match v {
            Value::Array(a) => Ok(Fields::Pos(a)),
            Value::Map(m) => Ok(Fields::Named(m)),
            other => Err(wrong(path, "array or map", other)),
        }
    }

    /// `None` when absent. Nil is returned as `Some(Value::Nil)`; callers use [`opt`].
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Pos(a) => a.get(pos),
            Fields::Named(m) => m.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v),
        }
    }
}

fn decode_event(raw: &Value, path: &str, fold: BytesHashFold) -> Result<Decoded, DecodeError> {
    let (tag, fields) = match raw {
        Value::Array(a) => match a.split_first() {
            Some((Value::String(s), rest)) => match s.as_str() {
                Some(t) => (t, Fields::Pos(rest)),
                None => return Err(wrong(&format!("{path}[0]"), "utf-8 tag string", &a[0])),
            },
            Some((other, _)) => return Err(wrong(&format!("{path}[0]"), "tag string", other)),
            None => return Err(missing(&format!("{path}[0] (tag)"))),
        },
        Value::Map(m) => match m.iter().find(|(k, _)| k.as_str() == Some("type")) {
            Some((_, Value::String(s))) if s.as_str().is_some() => (s.as_str().unwrap_or_default(), Fields::Named(m)),
            Some((_, other)) => return Err(wrong(&format!("{path}.type"), "tag string", other)),
            None => return Err(missing(&format!("{path}.type"))),
        },
        other => return Err(wrong(path, "array or map (tagged event)", other)),
    };
    let p = |name: &str| format!("{path}.{name}");

    // Positions after the tag (array form), in vLLM declaration order.
    let ev = match tag {
        "BlockStored" => VllmEvent::BlockStored {
            block_hashes: req(fields.get(0, "block_hashes"), &p("block_hashes"), |v, n| {
                hashes(v, n, fold)
            })?,
            parent_block_hash: opt(fields.get(1, "parent_block_hash"), |v| {
                hash(v, &p("parent_block_hash"), fold)
            })?,
            token_ids: req(fields.get(2, "token_ids"), &p("token_ids"), token_ids)?,
            block_size: req(fields.get(3, "block_size"), &p("block_size"), to_u32)?,
            lora_id: opt(fields.get(4, "lora_id"), |v| to_u64(v, &p("lora_id")))?,
            medium: opt(fields.get(5, "medium"), |v| to_string(v, &p("medium")))?,
            lora_name: opt(fields.get(6, "lora_name"), |v| to_string(v, &p("lora_name")))?,
            // 7 = extra_keys (list[tuple[Any, ...] | None]); not needed for routing, ignored.
            group_idx: opt(fields.get(8, "group_idx"), |v| to_u32(v, &p("group_idx")))?,
            kv_cache_spec_kind: opt(fields.get(9, "kv_cache_spec_kind"), |v| {
                to_string(v, &p("kv_cache_spec_kind"))
            })?,
            // 10 = kv_cache_spec_sliding_window; ignored.
        },
        "BlockRemoved" => VllmEvent::BlockRemoved {
            block_hashes: req(fields.get(0, "block_hashes"), &p("block_hashes"), |v, n| {
                hashes(v, n, fold)
            })?,
            medium: opt(fields.get(1, "medium"), |v| to_string(v, &p("medium")))?,
            group_idx: opt(fields.get(2, "group_idx"), |v| to_u32(v, &p("group_idx")))?,
        },
        "AllBlocksCleared" => VllmEvent::AllBlocksCleared,
        other => return Ok(Decoded::Unknown(other.to_owned())),
    };
    Ok(Decoded::Known(ev))
}

fn req<'a, T>(
    v: Option<&'a Value>,
    path: &str,
    f: impl FnOnce(&'a Value, &str) -> Result<T, DecodeError>,
) -> Result<T, DecodeError> {
    match v {
        None | Some(Value::Nil) => Err(missing(path)),
        Some(v) => f(v, path),
    }
}

fn opt<'a, T>(
    v: Option<&'a Value>,
    f: impl FnOnce(&'a Value) -> Result<T, DecodeError>,
) -> Result<Option<T>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => f(v).map(Some),
    }
}

fn hash(v: &Value, path: &str, fold: BytesHashFold) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(u),
            (None, Some(s)) => Ok(s as u64), // negative i64 -> bit-cast
            (None, None) => Err(wrong(path, "int or bytes", v)),
        },
        Value::Binary(b) => Ok(fold.fold(b)),
        other => Err(wrong(path, "int or bytes", other)),
    }
}

fn hashes(v: &Value, path: &str, fold: BytesHashFold) -> Result<Vec<u64>, DecodeError> {
    let Value::Array(a) = v else {
        return Err(wrong(path, "array of hashes", v));
    };
    a.iter()
        .enumerate()
        .map(|(i, h)| hash(h, &format!("{path}[{i}]"), fold))
        .collect()
}

fn token_ids(v: &Value, path: &str) -> Result<Vec<u32>, DecodeError> {
    let Value::Array(a) = v else {
        return Err(wrong(path, "array of token ids", v));
    };
    a.iter()
        .enumerate()
        .map(|(i, t)| to_u32(t, &format!("{path}[{i}]")))
        .collect()
}

fn to_u64(v: &Value, path: &str) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i.as_u64().ok_or_else(|| DecodeError::OutOfRange {
            path: path.to_owned(),
            value: i.to_string(),
            target: "u64",
        }),
        other => Err(wrong(path, "unsigned int", other)),
    }
}

fn to_u32(v: &Value, path: &str) -> Result<u32, DecodeError> {
    let u = to_u64(v, path)?;
    u32::try_from(u).map_err(|_| DecodeError::OutOfRange {
        path: path.to_owned(),
        value: u.to_string(),
        target: "u32",
    })
}

fn to_f64(v: &Value, path: &str) -> Result<f64, DecodeError> {
    match v {
        Value::F64(f) => Ok(*f),
        Value::F32(f) => Ok(f64::from(*f)),
        Value::Integer(i) => i.as_f64().ok_or_else(|| wrong(path, "float", v)),
        other => Err(wrong(path, "float", other)),
    }
}

fn to_string(v: &Value, path: &str) -> Result<String, DecodeError> {
    match v {
        Value::String(s) => s.as_str().map(str::to_owned).ok_or_else(|| wrong(path, "utf-8 str", v)),
        other => Err(wrong(path, "str", other)),
    }
}

fn missing(path: &str) -> DecodeError {
    DecodeError::MissingField { path: path.to_owned() }
}

fn wrong(path: &str, expected: &'static str, got: &Value) -> DecodeError {
    DecodeError::WrongType {
        path: path.to_owned(),
        expected,
        got: kind(got),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "bool",
        Value::Integer(_) => "int",
        Value::F32(_) | Value::F64(_) => "float",
        Value::String(s) if s.as_str().is_none() => "non-utf-8 str",
        Value::String(_) => "str",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "ext",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn ints<T: Into<Value> + Copy>(xs: &[T]) -> Value {
        Value::Array(xs.iter().map(|&x| x.into()).collect())
    }

    fn pack(v: &Value) -> Bytes {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, v).unwrap();
        Bytes::from(buf)
    }

    fn frames(topic: &str, seq: u64, payload: Bytes) -> Vec<Bytes> {
        vec![
            Bytes::from(topic.to_owned()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]
    }

    fn map(kvs: Vec<(&str, Value)>) -> Value {
        Value::Map(kvs.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    /// Positional envelope `[ts, events, dp_rank]` as msgspec emits for `array_like=True`.
    fn batch(events: Vec<Value>, dp: Option<u32>) -> Value {
        let mut v = vec![Value::F64(1_700_000_000.25), Value::Array(events)];
        if let Some(d) = dp {
            v.push(d.into());
        }
        Value::Array(v)
    }

    fn decode(v: &Value) -> Result<VllmBatch, DecodeError> {
        decode_batch(&frames("kv-events", 7, pack(v)))
    }

    // ---- current vLLM (map-encoded events, PR #42892) ----

    fn stored_map_full() -> Value {
        // Exactly the key set/order of vLLM's BlockStored with omit_defaults: lora_id, medium,
        // lora_name have no default -> always present; extra_keys/group_idx/... present here.
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[15760518052499183552u64, 42])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", ints(&[1u32, 2, 3, 4])),
            ("block_size", 2.into()),
            ("lora_id", Value::Nil),
            ("medium", s("GPU")),
            ("lora_name", Value::Nil),
            ("extra_keys", Value::Array(vec![Value::Nil, Value::Nil])),
            ("group_idx", 0.into()),
            ("kv_cache_spec_kind", s("full_attention")),
        ])
    }

    #[test]
    fn map_block_stored_full() {
        let b = decode(&batch(vec![stored_map_full()], Some(0))).unwrap();
        assert_eq!(b.topic, "kv-events");
        assert_eq!(b.seq, 7);
        assert_eq!(b.ts, 1_700_000_000.25);
        assert_eq!(b.dp_rank, Some(0));
        assert_eq!(
            b.events,
            vec![VllmEvent::BlockStored {
                block_hashes: vec![15760518052499183552, 42],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
            }]
        );
    }

    #[test]
    fn map_block_stored_minimal_and_unknown_keys() {
        // Map form: keys absent (omit_defaults / producer-side schema drift) plus a future key.
        let ev = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[5u64])),
            ("token_ids", ints(&[9u32, 9])),
            ("block_size", 2.into()),
            ("some_future_field", map(vec![("x", 1.into())])),
        ]);
        let b = decode(&batch(vec![ev], None)).unwrap();
        assert_eq!(b.dp_rank, None);
        let VllmEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            medium,
            group_idx,
            ..
        } = &b.events[0]
        else {
            panic!()
        };
        assert_eq!(
            (block_hashes.as_slice(), *parent_block_hash, medium, *group_idx),
            (&[5u64][..], None, &None, None)
        );
    }

    #[test]
    fn map_removed_and_cleared() {
        let removed = map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[1u64, 2])),
            ("medium", s("GPU")),
            ("group_idx", 1.into()),
        ]);
        let cleared = map(vec![("type", s("AllBlocksCleared"))]);
        let b = decode(&batch(vec![removed, cleared], Some(3))).unwrap();
        assert_eq!(
            b.events,
            vec![
                VllmEvent::BlockRemoved {
                    block_hashes: vec![1, 2],
                    medium: Some("GPU".into()),
                    group_idx: Some(1)
                },
                VllmEvent::AllBlocksCleared
            ]
        );
    }

    // ---- legacy vLLM (array_like=True events) ----

    #[test]
    fn array_block_stored_legacy_5_fields() {
        // vLLM ~0.9: [tag, block_hashes, parent, token_ids, block_size, lora_id]; negative hash
        // from Python's signed hash().
        let ev = Value::Array(vec![
            s("BlockStored"),
            ints(&[-1i64, i64::MIN, 17]),
            Value::from(-2i64),
            ints(&[10u32, 11, 12, 13, 14, 15]),
            2.into(),
            Value::Nil,
        ]);
        let b = decode(&batch(vec![ev], None)).unwrap();
        assert_eq!(
            b.events[0],
            VllmEvent::BlockStored {
                block_hashes: vec![u64::MAX, 1u64 << 63, 17],
                parent_block_hash: Some(u64::MAX - 1),
                token_ids: vec![10, 11, 12, 13, 14, 15],
                block_size: 2,
                lora_id: None,
                medium: None,
                lora_name: None,
                group_idx: None,
                kv_cache_spec_kind: None,
            }
        );
    }

    #[test]
    fn array_block_stored_with_tail_and_extra_unknown_trailing() {
        let ev = Value::Array(vec![
            s("BlockStored"),
            ints(&[3u64]),
            Value::from(2u64),
            ints(&[1u32, 2]),
            2.into(),
            Value::from(7u64),
            s("CPU"),
            s("my-lora"),
            Value::Array(vec![Value::Array(vec![s("my-lora")])]),
            1.into(),
            s("sliding_window"),
            Value::from(4096),
            s("field-from-the-future"),
        ]);
        let b = decode(&batch(vec![ev], Some(1))).unwrap();
        assert_eq!(
            b.events[0],
            VllmEvent::BlockStored {
                block_hashes: vec![3],
                parent_block_hash: Some(2),
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: Some(7),
                medium: Some("CPU".into()),
                lora_name: Some("my-lora".into()),
                group_idx: Some(1),
                kv_cache_spec_kind: Some("sliding_window".into()),
            }
        );
    }

    #[test]
    fn array_removed_missing_medium_and_cleared() {
        let removed = Value::Array(vec![s("BlockRemoved"), ints(&[9u64])]);
        let cleared = Value::Array(vec![s("AllBlocksCleared")]);
        let b = decode(&batch(vec![removed, cleared], Some(0))).unwrap();
        assert_eq!(
            b.events,
            vec![
                VllmEvent::BlockRemoved {
                    block_hashes: vec![9],
                    medium: None,
                    group_idx: None
                },
                VllmEvent::AllBlocksCleared
            ]
        );
    }

    // ---- hashes as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) ----

    #[test]
    fn bytes_hashes_fold() {
        let digest: Vec<u8> = (0u8..32).collect();
        let ev = map(vec![
            ("type", s("BlockRemoved")),
            (
                "block_hashes",
                Value::Array(vec![Value::Binary(digest.clone()), Value::Binary(vec![1, 2])]),
            ),
            ("medium", Value::Nil),
        ]);
        let f = frames("", 0, pack(&batch(vec![ev], Some(0))));

        let b = decode_batch(&f).unwrap();
        let VllmEvent::BlockRemoved { block_hashes, .. } = &b.events[0] else {
            panic!()
        };
        // Same value vLLM would have sent as an int: last 8 bytes, big-endian.
        assert_eq!(block_hashes[0], u64::from_be_bytes(digest[24..32].try_into().unwrap()));
        assert_eq!(block_hashes[1], 0x0102);

        let b = decode_batch_with(&f, BytesHashFold::Xxh3).unwrap();
        let VllmEvent::BlockRemoved { block_hashes, .. } = &b.events[0] else {
            panic!()
        };
        assert_eq!(block_hashes[0], xxhash_rust::xxh3::xxh3_64(&digest));
    }

    #[test]
    fn bytes_parent_hash_in_array_form() {
        let ev = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::Binary(vec![0xff; 32])]),
            Value::Binary(vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5]),
            ints(&[1u32]),
            1.into(),
            Value::Nil,
            s("GPU"),
            Value::Nil,
        ]);
        let b = decode(&batch(vec![ev], Some(0))).unwrap();
        let VllmEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            ..
        } = &b.events[0]
        else {
            panic!()
        };
        assert_eq!((block_hashes[0], *parent_block_hash), (u64::MAX, Some(5)));
    }

    // ---- envelope variants and forward compatibility ----

    #[test]
    fn map_envelope_and_extra_batch_fields() {
        let v = map(vec![
            ("ts", Value::F64(2.5)),
            ("events", Value::Array(vec![map(vec![("type", s("AllBlocksCleared"))])])),
            ("data_parallel_rank", 4.into()),
            ("future", Value::Boolean(true)),
        ]);
        let b = decode(&v).unwrap();
        assert_eq!((b.ts, b.dp_rank, b.events.len()), (2.5, Some(4), 1));

        let v = Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), Value::Nil, s("extra")]);
        assert_eq!(decode(&v).unwrap().dp_rank, None);
    }

    #[test]
    fn unknown_event_tag_is_skipped() {
        let evs = vec![
            map(vec![("type", s("BlockTouched")), ("block_hashes", ints(&[1u64]))]),
            Value::Array(vec![s("SomethingNew"), Value::from(1)]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ];
        let b = decode(&batch(evs, Some(0))).unwrap();
        assert_eq!(b.events, vec![VllmEvent::AllBlocksCleared]);
        assert_eq!(
            b.skipped_event_tags,
            vec!["BlockTouched".to_owned(), "SomethingNew".to_owned()]
        );
    }

    // ---- strictness ----

    #[test]
    fn wrong_types_name_the_field() {
        let mut ev = stored_map_full();
        if let Value::Map(m) = &mut ev {
            m[1].1 = Value::Array(vec![1.into(), s("nope")]);
        }
        let err = decode(&batch(vec![map(vec![("type", s("AllBlocksCleared"))]), ev], Some(0))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`events[1].block_hashes[1]`: expected int or bytes, got str"
        );

        let ev = Value::Array(vec![
            s("BlockStored"),
            ints(&[1u64]),
            Value::Nil,
            ints(&[1u32]),
            s("16"),
        ]);
        let err = decode(&batch(vec![ev], None)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`events[0].block_size`: expected unsigned int, got str"
        );

        let ev = Value::Array(vec![s("BlockStored"), ints(&[1u64]), Value::Nil, ints(&[-1i64])]);
        let err = decode(&batch(vec![ev], None)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`events[0].token_ids[0]`: value -1 out of range for u64"
        );

        let ev = map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[1u64])),
            ("medium", 3.into()),
        ]);
        let err = decode(&batch(vec![ev], None)).unwrap_err();
        assert_eq!(err.to_string(), "`events[0].medium`: expected str, got int");

        let ev = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[1u64])),
            ("block_size", 16.into()),
        ]);
        let err = decode(&batch(vec![ev], None)).unwrap_err();
        assert_eq!(err.to_string(), "`events[0].token_ids`: required field missing");

        let err = decode(&Value::Array(vec![s("1.0"), Value::Array(vec![])])).unwrap_err();
        assert_eq!(err.to_string(), "`ts`: expected float, got str");

        let err = decode(&batch(vec![Value::from(5)], None)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`events[0]`: expected array or map (tagged event), got int"
        );
    }

    #[test]
    fn frame_errors() {
        let p = pack(&batch(vec![], None));
        assert!(matches!(
            decode_batch(std::slice::from_ref(&p)),
            Err(DecodeError::FrameCount(1))
        ));
        let f = vec![Bytes::new(), Bytes::from_static(&[0, 1]), p.clone()];
        assert!(matches!(decode_batch(&f), Err(DecodeError::SeqLength(2))));
        let mut long = p.to_vec();
        long.push(0xc0);
        assert!(matches!(
            decode_batch(&frames("", 0, Bytes::from(long))),
            Err(DecodeError::TrailingBytes(1))
        ));
        assert!(matches!(
            decode_batch(&frames("", 0, Bytes::from_static(&[0xdc]))),
            Err(DecodeError::Msgpack(_))
        ));
    }

    /// Golden payloads produced by real msgspec 0.22 (see gen_golden.py) from struct
    /// definitions mirroring vLLM: current (map events) and legacy (array events).
    #[test]
    fn msgspec_golden_payloads() {
        let cases: &[(&str, &str)] = &[
            ("map", include_str!("golden/map.hex")),
            ("array", include_str!("golden/array.hex")),
            ("map_bytes", include_str!("golden/map_bytes.hex")),
        ];
        for (name, hex) in cases {
            let payload = Bytes::from(unhex(hex.trim()));
            let b = decode_batch(&frames("kv-events", 1, payload)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(b.dp_rank, Some(0), "{name}");
            assert_eq!(b.events.len(), 3, "{name}");
            let VllmEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            } = &b.events[0]
            else {
                panic!("{name}")
            };
            assert_eq!(token_ids.len(), 2 * *block_size as usize, "{name}");
            assert_eq!(medium.as_deref(), Some("GPU"), "{name}");
            if *name == "map_bytes" {
                assert_eq!(
                    block_hashes,
                    &vec![0x1111_1111_1111_1111, 0x2222_2222_2222_2222],
                    "{name}"
                );
                assert_eq!(*parent_block_hash, Some(0x0303_0303_0303_0303), "{name}");
            } else {
                assert_eq!(block_hashes, &vec![15760518052499183552, (-5i64) as u64], "{name}");
                assert_eq!(*parent_block_hash, None, "{name}");
            }
            assert!(matches!(b.events[1], VllmEvent::BlockRemoved { .. }), "{name}");
            assert_eq!(b.events[2], VllmEvent::AllBlocksCleared, "{name}");
        }
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}
