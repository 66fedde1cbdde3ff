//! vLLM's KV-event stream as the gateway's ZMQ subscriber receives it: multipart messages of
//! topic, sequence number and a msgpack payload, decoded, translated into Switchyard's events
//! by one worker's translator (sequence numbers, restarts and gaps included) and applied to a
//! prefix index, which is then looked up along every stored chain.
//!
//! Input: frames, each a little-endian u16 length and its bytes, taken three at a time as
//! messages; the first byte picks the bytes-hash fold. Nothing may panic.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::{BytesHashFold, KvIndex, Translator, decode_batch_with};
use switchyard_protocol::kv_events::KvEvent;

fn frames(mut data: &[u8]) -> Vec<Bytes> {
    let mut frames = Vec::new();
    while let [a, b, rest @ ..] = data {
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(rest.len());
        frames.push(Bytes::copy_from_slice(&rest[..len]));
        data = &rest[len..];
    }
    frames
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let fold = if selector & 1 == 0 {
        BytesHashFold::Low64BigEndian
    } else {
        BytesHashFold::Xxh3
    };
    let mut translator = Translator::new("vllm-0", 16);
    let index = KvIndex::new();
    let mut chains = Vec::new();
    for message in frames(rest).chunks(3) {
        let Ok(batch) = decode_batch_with(message, fold) else {
            continue;
        };
        let translated = translator.translate(&batch);
        for event in &translated.events {
            let _ = index.apply(0, event.tier, &event.event);
            if let KvEvent::Stored { blocks, .. } = &event.event {
                chains.push(blocks.iter().map(|b| b.block_hash).collect::<Vec<u64>>());
            }
        }
    }
    let mut out = Default::default();
    for chain in &chains {
        index.overlaps(chain, &mut out);
        assert!(out.len() <= 1, "one worker's events, {} workers found", out.len());
    }
});
