//! KV events, registrations and dumps as workers send them (JSON over NATS, or posted to the
//! admin API), parsed and checked as the gateway does, then applied to a prefix index that is
//! looked up along every chain the events named.
//!
//! The first byte picks the path: a posted event array, a posted registration, one NATS event,
//! or a dump. Nothing may panic; the index's counts must stay consistent.

#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::{KvIndex, posted_events, posted_registration};
use switchyard_protocol::kv_events::{KvDump, KvEvent, WorkerEvent};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let index = KvIndex::new();
    let mut chains: Vec<Vec<u64>> = Vec::new();
    let mut apply = |worker: u32, event: &WorkerEvent| {
        let _ = index.apply(worker, event.tier, &event.event);
        if let KvEvent::Stored { blocks, .. } = &event.event {
            chains.push(blocks.iter().map(|b| b.block_hash).collect());
        }
        if let KvEvent::Removed { block_hashes } = &event.event {
            chains.push(block_hashes.clone());
        }
    };
    match selector % 4 {
        0 => {
            if let Ok(events) = posted_events("w0", body) {
                for (n, event) in events.iter().enumerate() {
                    assert_eq!(event.worker, "w0");
                    apply((n % 3) as u32, event);
                }
            }
        }
        1 => {
            if let Ok(registration) = posted_registration(body) {
                assert!(switchyard_protocol::kv_events::valid_worker_name(&registration.worker));
            }
        }
        2 => {
            if let Ok(event) = serde_json::from_slice::<WorkerEvent>(body) {
                apply(0, &event);
                apply(1, &event);
            }
        }
        _ => {
            if let Ok(dump) = serde_json::from_slice::<KvDump>(body) {
                let _ = index.load_dump(0, &dump.blocks);
                chains.push(dump.blocks.iter().map(|b| b.block_hash).collect());
                let _ = index.load_dump(0, &dump.blocks[..dump.blocks.len() / 2]);
            }
        }
    }
    let mut out = Default::default();
    for chain in &chains {
        index.overlaps(chain, &mut out);
        assert!(out.len() <= 3);
        for overlap in out.iter() {
            assert!((overlap.device + overlap.host) as usize <= chain.len());
        }
    }
    let size = index.size();
    assert!(size.nodes <= size.blocks && size.workers <= 3, "{size:?}");
    for worker in 0..3 {
        index.remove_worker(worker);
    }
    assert_eq!(
        index.size(),
        Default::default(),
        "an emptied index still counts holdings"
    );
});
