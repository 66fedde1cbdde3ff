//! The vLLM and SGLang adapter: routes a fleet of real vLLM or SGLang workers KV-aware from
//! their own event streams.
//!
//! vLLM publishes KV events on a ZMQ PUB socket (`--kv-events-config`), one multipart message
//! per batch: `[topic, seq u64 BE, msgpack KVEventBatch]` ([`decode`]). SGLang
//! (`--kv-events-config`, `sglang/srt/disaggregation/kv_events.py`) publishes the same frames
//! and the same tagged events in their array form, with a two-field batch (`[ts, events]`) and
//! Python-hash block ids; one decoder reads both. Their block hashes are their own (vLLM's
//! sha256-based and seeded per process), so this adapter recomputes Switchyard's hashes from
//! each stored block's `token_ids` (local hash salted by the LoRA name) and chains them from the
//! parent, keeping a per-worker map from the engine's hash to ours for later parents and
//! removals. An engine whose blocks are smaller than the model's (SGLang's pages are often one
//! token) has its blocks regrouped: each engine block remembers the chain it ends (our last
//! whole block and the tokens since), so a child continues it, and the engine block that
//! completes one of ours stands for it when removed. Device blocks (`medium` GPU or absent)
//! and host blocks (`CPU`) go to their tiers; events of KV-cache groups other than full
//! attention are skipped. The translated events are numbered for the applier: a jump in the
//! engine's `seq` becomes a jump in `event_id`, so the applier sees the gap, and since neither
//! engine answers dumps it drops the worker's blocks and goes on from the new events; `seq`
//! going back means the engine restarted, so numbering restarts too. The SUB socket reconnects
//! by itself when the engine restarts.

pub mod decode;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use switchyard_protocol::block_hash::{chain_hash, local_hash_with_seed, lora_seed};
use switchyard_protocol::kv_events::{KvDump, KvEvent, StorageTier, StoredBlock, WorkerEvent};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv};

use crate::config::EngineEventsConfig;
use crate::events::applier::{BoxFuture, DumpSource, Inbound};
use crate::kv::KvState;

use self::decode::{VllmBatch, VllmEvent};

/// vLLM and SGLang answer no dumps: a gap drops the worker's blocks instead.
#[derive(Debug)]
pub struct NoDumps;

impl DumpSource for NoDumps {
    fn request(&self, worker: String) -> BoxFuture<Result<KvDump, String>> {
        Box::pin(async move {
            Err(format!(
                "worker `{worker}` (vLLM or SGLang) cannot answer dump requests"
            ))
        })
    }

    fn answers_dumps(&self) -> bool {
        false
    }
}

/// Turns one vLLM or SGLang worker's events into Switchyard's.
#[derive(Debug)]
pub struct Translator {
    worker: String,
    block_size: usize,
    /// Engine block → our block, where the sizes agree.
    ours: HashMap<u64, u64>,
    /// Engine block → the chain it ends, where the engine's blocks are smaller than ours.
    pages: HashMap<u64, Page>,
    last_seq: Option<u64>,
    next_event_id: u64,
}

/// Where the chain stands after an engine block smaller than ours.
#[derive(Debug, Clone, Default)]
struct Page {
    /// Our last whole block of the chain.
    last: Option<u64>,
    /// Tokens after it, fewer than a block of ours.
    pending: Vec<u32>,
    /// Our block this engine block completed, if it did.
    completes: Option<u64>,
}

/// What a batch became.
#[derive(Debug, Default, PartialEq)]
pub struct Translated {
    /// Numbered events for the applier.
    pub events: Vec<WorkerEvent>,
    /// Events left out, with the reason.
    pub skipped: Vec<&'static str>,
}

impl Translator {
    /// A translator for `worker`, whose model cuts blocks of `block_size` tokens.
    pub fn new(worker: impl Into<String>, block_size: usize) -> Translator {
        Translator {
            worker: worker.into(),
            block_size: block_size.max(1),
            ours: HashMap::new(),
            pages: HashMap::new(),
            last_seq: None,
            next_event_id: 1,
        }
    }

    /// Translates one batch.
    pub fn translate(&mut self, batch: &VllmBatch) -> Translated {
        let mut out = Translated::default();
        match self.last_seq {
            Some(last) if batch.seq <= last && batch.seq != 0 => {
                out.skipped.push("duplicate");
                return out;
            }
            Some(last) if batch.seq == last => {
                out.skipped.push("duplicate");
                return out;
            }
            Some(last) if batch.seq < last => {
                // seq 0 after more: the engine restarted with an empty cache.
                self.ours.clear();
                self.pages.clear();
                self.next_event_id = 1;
            }
            Some(last) if batch.seq > last + 1 => {
                // Batches were lost: skip an id so the applier sees the gap.
                self.next_event_id += 1;
            }
            _ => {}
        }
        self.last_seq = Some(batch.seq);
        for event in &batch.events {
            match self.event(event) {
                Ok(Some((tier, event))) => {
                    out.events.push(WorkerEvent {
                        worker: self.worker.clone(),
                        event_id: self.next_event_id,
                        tier,
                        event,
                    });
                    self.next_event_id += 1;
                }
                Ok(None) => {}
                Err(reason) => out.skipped.push(reason),
            }
        }
        out
    }

    fn event(&mut self, event: &VllmEvent) -> Result<Option<(StorageTier, KvEvent)>, &'static str> {
        match event {
            VllmEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                kv_cache_spec_kind,
                ..
            } => {
                if kv_cache_spec_kind
                    .as_deref()
                    .is_some_and(|kind| kind != "full_attention")
                {
                    return Err("not_full_attention");
                }
                let engine_block = *block_size as usize;
                if engine_block != self.block_size {
                    if engine_block == 0 || !self.block_size.is_multiple_of(engine_block) {
                        return Err("block_size_mismatch");
                    }
                    let seed = lora_seed(lora_name.as_deref());
                    return self
                        .regrouped(block_hashes, *parent_block_hash, token_ids, engine_block, seed)
                        .map(|stored| stored.map(|event| (tier(medium.as_deref()), event)));
                }
                if token_ids.len() != block_hashes.len() * self.block_size {
                    return Err("malformed");
                }
                let parent = match parent_block_hash {
                    None => None,
                    Some(theirs) => Some(*self.ours.get(theirs).ok_or("unknown_parent")?),
                };
                let seed = lora_seed(lora_name.as_deref());
                let mut previous = parent;
                let blocks = block_hashes
                    .iter()
                    .zip(token_ids.chunks_exact(self.block_size))
                    .map(|(&theirs, tokens)| {
                        let local = local_hash_with_seed(tokens, seed);
                        let sequence = chain_hash(previous, local);
                        previous = Some(sequence);
                        self.ours.insert(theirs, sequence);
                        StoredBlock {
                            block_hash: sequence,
                            tokens_hash: local,
                        }
                    })
                    .collect();
                Ok(Some((tier(medium.as_deref()), KvEvent::Stored { parent, blocks })))
            }
            VllmEvent::BlockRemoved {
                block_hashes, medium, ..
            } => {
                let ours: Vec<u64> = block_hashes
                    .iter()
                    .filter_map(|h| {
                        self.ours
                            .remove(h)
                            .or_else(|| self.pages.remove(h).and_then(|page| page.completes))
                    })
                    .collect();
                if ours.is_empty() {
                    return Ok(None);
                }
                Ok(Some((tier(medium.as_deref()), KvEvent::Removed { block_hashes: ours })))
            }
            VllmEvent::AllBlocksCleared => {
                self.ours.clear();
                self.pages.clear();
                Ok(Some((StorageTier::Device, KvEvent::Cleared)))
            }
        }
    }
}

impl Translator {
    /// Stored engine blocks of `engine_block` tokens (a divisor of ours), regrouped into our
    /// whole blocks; `None` when they complete none.
    fn regrouped(
        &mut self,
        theirs: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        engine_block: usize,
        seed: u64,
    ) -> Result<Option<KvEvent>, &'static str> {
        if tokens.len() != theirs.len() * engine_block {
            return Err("malformed");
        }
        let Page {
            mut last, mut pending, ..
        } = match parent {
            None => Page::default(),
            Some(parent) => self.pages.get(&parent).cloned().ok_or("unknown_parent")?,
        };
        let our_parent = last;
        let mut blocks = Vec::new();
        for (&hash, tokens) in theirs.iter().zip(tokens.chunks_exact(engine_block)) {
            pending.extend_from_slice(tokens);
            let mut completes = None;
            if pending.len() == self.block_size {
                let local = local_hash_with_seed(&pending, seed);
                let sequence = chain_hash(last, local);
                blocks.push(StoredBlock {
                    block_hash: sequence,
                    tokens_hash: local,
                });
                last = Some(sequence);
                completes = Some(sequence);
                pending.clear();
            }
            self.pages.insert(
                hash,
                Page {
                    last,
                    pending: pending.clone(),
                    completes,
                },
            );
        }
        Ok((!blocks.is_empty()).then_some(KvEvent::Stored {
            parent: our_parent,
            blocks,
        }))
    }
}

fn tier(medium: Option<&str>) -> StorageTier {
    match medium {
        Some(m) if m.eq_ignore_ascii_case("cpu") => StorageTier::Host,
        _ => StorageTier::Device,
    }
}

/// Subscribes to one vLLM or SGLang worker's publisher (`engine` names which, for the logs)
/// and feeds the applier until aborted.
pub fn spawn(
    engine: &'static str,
    config: EngineEventsConfig,
    block_size: usize,
    state: Arc<KvState>,
    inbound: mpsc::UnboundedSender<Inbound>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let source: Arc<dyn DumpSource> = Arc::new(NoDumps);
        let mut translator = Translator::new(config.worker.clone(), block_size);
        let ignored = |reason: &'static str| {
            state
                .metrics
                .events_ignored
                .get_or_create(&vec![("reason", reason.to_string())])
                .inc();
        };
        loop {
            let mut socket = zeromq::SubSocket::new();
            if let Err(err) = socket.subscribe(&config.topic).await {
                tracing::error!(worker = %config.worker, engine, error = %err, "cannot subscribe to KV events");
                return;
            }
            // `connect` waits for the peer; the socket reconnects by itself after that.
            if let Err(err) = socket.connect(&config.endpoint).await {
                tracing::warn!(worker = %config.worker, engine, endpoint = %config.endpoint, error = %err, "cannot reach the KV event publisher; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            tracing::info!(worker = %config.worker, engine, endpoint = %config.endpoint, "subscribed to KV events");
            loop {
                let message = match socket.recv().await {
                    Ok(message) => message,
                    Err(err) => {
                        tracing::debug!(worker = %config.worker, engine, error = %err, "KV event socket error");
                        continue;
                    }
                };
                let frames = message.into_vec();
                let batch = match decode::decode_batch(&frames) {
                    Ok(batch) => batch,
                    Err(err) => {
                        tracing::warn!(worker = %config.worker, engine, error = %err, "undecodable KV event batch dropped");
                        ignored("undecodable");
                        continue;
                    }
                };
                let translated = translator.translate(&batch);
                for reason in translated.skipped {
                    ignored(reason);
                }
                for event in translated.events {
                    if inbound.send(Inbound::Event(event, source.clone())).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_protocol::block_hash::block_hashes;

    fn stored(theirs: &[u64], parent: Option<u64>, tokens: &[u32]) -> VllmEvent {
        VllmEvent::BlockStored {
            block_hashes: theirs.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }
    }

    fn batch(seq: u64, events: Vec<VllmEvent>) -> VllmBatch {
        VllmBatch {
            topic: String::new(),
            seq,
            ts: 0.0,
            dp_rank: Some(0),
            events,
            skipped_event_tags: Vec::new(),
        }
    }

    #[test]
    fn hashes_are_recomputed_from_tokens_and_chained_through_parents() {
        let mut translator = Translator::new("v", 2);
        let tokens = [1, 2, 3, 4, 5, 6];
        let expected = block_hashes(&tokens, 2);
        let first = translator.translate(&batch(0, vec![stored(&[901, 902], None, &tokens[..4])]));
        let second = translator.translate(&batch(1, vec![stored(&[903], Some(902), &tokens[4..])]));
        let KvEvent::Stored { blocks, parent } = &second.events[0].event else {
            panic!("stored expected");
        };
        assert_eq!(*parent, Some(expected[1].sequence));
        assert_eq!(blocks[0].block_hash, expected[2].sequence);
        assert_eq!(first.events[0].event_id, 1);
        assert_eq!(second.events[0].event_id, 2);
        let removed = translator.translate(&batch(
            2,
            vec![VllmEvent::BlockRemoved {
                block_hashes: vec![903, 999],
                medium: None,
                group_idx: None,
            }],
        ));
        assert_eq!(
            removed.events[0].event,
            KvEvent::Removed {
                block_hashes: vec![expected[2].sequence]
            }
        );
    }

    #[test]
    fn lost_batches_become_a_gap_and_a_restart_renumbers() {
        let mut translator = Translator::new("v", 2);
        translator.translate(&batch(0, vec![stored(&[1], None, &[1, 2])]));
        let after_gap = translator.translate(&batch(5, vec![stored(&[2], None, &[3, 4])]));
        assert_eq!(after_gap.events[0].event_id, 3, "one id skipped");
        assert_eq!(translator.translate(&batch(5, vec![])).skipped, vec!["duplicate"]);
        let restarted = translator.translate(&batch(0, vec![stored(&[3], None, &[5, 6])]));
        assert_eq!(restarted.events[0].event_id, 1);
    }

    #[test]
    fn unusable_events_are_skipped_with_a_reason() {
        let mut translator = Translator::new("v", 2);
        let out = translator.translate(&batch(
            0,
            vec![
                stored(&[1], Some(77), &[1, 2]),
                stored(&[1, 2], None, &[1, 2, 3]),
                VllmEvent::BlockStored {
                    block_hashes: vec![1],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 4,
                    lora_id: None,
                    medium: None,
                    lora_name: None,
                    group_idx: None,
                    kv_cache_spec_kind: None,
                },
            ],
        ));
        assert_eq!(out.skipped, vec!["unknown_parent", "malformed", "block_size_mismatch"]);
        assert!(out.events.is_empty());
    }

    /// SGLang's one-token pages, as its publisher sends them (Python-hash ids, no medium).
    fn pages(theirs: &[u64], parent: Option<u64>, tokens: &[u32]) -> VllmEvent {
        VllmEvent::BlockStored {
            block_hashes: theirs.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 1,
            lora_id: None,
            medium: None,
            lora_name: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }
    }

    #[test]
    fn smaller_engine_blocks_are_regrouped_into_ours() {
        let mut translator = Translator::new("s", 2);
        let tokens = [1, 2, 3, 4, 5, 6];
        let expected = block_hashes(&tokens, 2);
        // Three pages: one whole block of ours and a token toward the next.
        let first = translator.translate(&batch(0, vec![pages(&[-11i64 as u64, 12, 13], None, &tokens[..3])]));
        let KvEvent::Stored { blocks, parent } = &first.events[0].event else {
            panic!("stored expected");
        };
        assert_eq!((*parent, blocks.len()), (None, 1));
        assert_eq!(blocks[0].block_hash, expected[0].sequence);
        // Their child continues the chain from the pending token.
        let second = translator.translate(&batch(1, vec![pages(&[14, 15, 16], Some(13), &tokens[3..])]));
        let KvEvent::Stored { blocks, parent } = &second.events[0].event else {
            panic!("stored expected");
        };
        assert_eq!(*parent, Some(expected[0].sequence));
        let ours: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        assert_eq!(ours, [expected[1].sequence, expected[2].sequence]);
        // A page that completes none of ours is stored without an event.
        assert!(
            translator
                .translate(&batch(2, vec![pages(&[17], Some(16), &[7])]))
                .events
                .is_empty()
        );
        // Removing the page that completed a block removes that block; others remove nothing.
        let removed = translator.translate(&batch(
            3,
            vec![VllmEvent::BlockRemoved {
                block_hashes: vec![17, 16, 15],
                medium: None,
                group_idx: None,
            }],
        ));
        assert_eq!(
            removed.events[0].event,
            KvEvent::Removed {
                block_hashes: vec![expected[2].sequence]
            }
        );
    }
}
