//! Moving KV blocks between engines: what an engine exports and imports for prefill/decode
//! disaggregation.
//!
//! A prefill engine computes a prompt and keeps its full blocks in its prefix cache; a decode
//! engine pulls the blocks it lacks and takes them in as cached blocks, exactly as if it had
//! prefilled them (shareable, evictable once free, announced as `stored` KV events). This
//! module owns the engine-level shapes of that exchange ([`KvExport`], [`KvImport`],
//! [`KvImported`]) and what an executor's blocks are made of ([`KvMedium`]), which decides
//! whether a block can move by name alone (the simulated engine, whose blocks hold nothing),
//! needs its keys and values copied ([`Executor::export_kv`](crate::engine::Executor::export_kv)
//! and [`Executor::import_kv`](crate::engine::Executor::import_kv)), or cannot move at all.
//! The scheduler does the bookkeeping ([`crate::engine::scheduler`]); how blocks travel between
//! workers is the server's business (`crate::server`'s `kv_transfer`). What a payload holds is
//! the executor's own format (the native LLM's is documented in `switchyard-llm`'s
//! `kv::transfer`): an executor must refuse a payload it did not make the like of, and the
//! import then stops there ([`KvImported::refused`]).

use bytes::Bytes;
use switchyard_protocol::block_hash::BlockHash;

/// What an executor's KV blocks are made of, for moving them between engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvMedium {
    /// Nothing but their names: a simulated engine's blocks hold no keys or values, so a block
    /// moves by its hash alone (the transfer's time is simulated by whoever moves it).
    Simulated,
    /// Keys and values the executor copies out and in, one payload per block.
    Payloads,
    /// Keys and values the executor cannot copy: its blocks are exported without payloads and
    /// it imports nothing (taking a block in without its contents would corrupt answers).
    #[default]
    Opaque,
}

impl KvMedium {
    /// Whether the engine can take blocks in at all.
    pub fn imports(self) -> bool {
        !matches!(self, KvMedium::Opaque)
    }
}

/// What an engine answers for an export: the leading run of the asked blocks it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvExport {
    /// Sequence hashes of the held blocks, a prefix of those asked for.
    pub block_hashes: Vec<u64>,
    /// Each held block's keys and values, in the same order, when the executor's medium is
    /// [`KvMedium::Payloads`] and it could copy them.
    pub payloads: Option<Vec<Vec<u8>>>,
}

/// Blocks to take in as cached blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvImport {
    /// The prompt's full-block hashes from its first block to the last one to import.
    pub chain: Vec<BlockHash>,
    /// Index in `chain` of the first block that came from elsewhere: the blocks before it
    /// must be cached here already (they were when the transfer was planned).
    pub first: usize,
    /// The moved blocks' keys and values (`chain[first..]`, in order), for an executor whose
    /// medium is [`KvMedium::Payloads`]; ignored by a simulated one. `Bytes`, so that payloads
    /// read from another worker's answer are views of its body, not copies.
    pub payloads: Option<Vec<Bytes>>,
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvImported {
    /// Leading blocks of the chain that were cached here already (of `chain[..first]` and of
    /// the moved ones, which another request may have computed meanwhile).
    pub already_cached: usize,
    /// Blocks taken in: newly cached and announced as `stored`.
    pub imported: usize,
    /// Whether the executor refused a moved block's payload (not of its shape or dtype), which
    /// stopped the import there; the rest of the prompt is prefilled.
    pub refused: bool,
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};

    use switchyard_protocol::block_hash::block_hashes;
    use tokio::sync::mpsc;

    use super::*;
    use crate::engine::{
        BlockId, EngineConfig, EngineHandle, Executor, KvEvent, ModelLimits, Output, PrefillGate, SamplingParams,
        StepItem, spawn_native,
    };
    use crate::mocker::spawn_engine;

    const BLOCK: usize = 4;

    fn config(blocks: usize) -> EngineConfig {
        EngineConfig {
            block_size: BLOCK,
            num_gpu_blocks: blocks,
            max_num_batched_tokens: 64,
            max_num_seqs: 8,
            speedup: 1000.0,
            ..EngineConfig::default()
        }
    }

    fn max(tokens: usize) -> SamplingParams {
        SamplingParams {
            max_tokens: tokens,
            ..SamplingParams::default()
        }
    }

    fn sequences(chain: &[BlockHash]) -> Vec<u64> {
        chain.iter().map(|hash| hash.sequence).collect()
    }

    /// Runs `prompt` to its end; the prompt tokens served from the prefix cache.
    async fn run(engine: &EngineHandle, prompt: Vec<u32>, tokens: usize) -> u32 {
        let mut outputs = engine.submit(prompt, max(tokens)).expect("accepted");
        while let Some(output) = outputs.recv().await {
            match output {
                Output::Finished { cached_tokens, .. } => return cached_tokens,
                Output::Failed(reason) => panic!("the request failed: {reason}"),
                Output::Started { .. } | Output::Token(_) => {}
            }
        }
        panic!("the stream ended without a finish");
    }

    fn import(chain: &[BlockHash], first: usize) -> KvImport {
        KvImport {
            chain: chain.to_vec(),
            first,
            payloads: None,
        }
    }

    /// The `stored` blocks among `events`, as (parent, block) pairs.
    fn stored(events: &mut mpsc::UnboundedReceiver<KvEvent>) -> Vec<(Option<u64>, u64)> {
        let mut stored = Vec::new();
        while let Ok(event) = events.try_recv() {
            if let KvEvent::Stored { parent, blocks } = event {
                let mut parent = parent;
                for block in blocks {
                    stored.push((parent, block.block_hash));
                    parent = Some(block.block_hash);
                }
            }
        }
        stored
    }

    #[tokio::test]
    async fn imported_blocks_are_cached_announced_and_reused() {
        let engine = spawn_engine(config(64));
        let (sink, mut events) = mpsc::unbounded_channel();
        engine.subscribe_kv_events(sink);
        let prompt: Vec<u32> = (0..42).collect();
        let chain = block_hashes(&prompt, BLOCK);
        assert_eq!(chain.len(), 10);
        let imported = engine.import_kv(import(&chain, 0)).await.expect("engine runs");
        assert_eq!(
            imported,
            KvImported {
                already_cached: 0,
                imported: 10,
                refused: false,
            }
        );
        assert_eq!(engine.held_blocks(sequences(&chain)).await.expect("engine runs"), 10);
        let announced = stored(&mut events);
        let expected: Vec<(Option<u64>, u64)> = chain
            .iter()
            .enumerate()
            .map(|(index, hash)| (index.checked_sub(1).map(|p| chain[p].sequence), hash.sequence))
            .collect();
        assert_eq!(announced, expected, "each block stored once, chained to its parent");
        assert_eq!(
            run(&engine, prompt.clone(), 2).await,
            40,
            "the request prefilled only the 2 tokens past the imported blocks"
        );
        assert_eq!(engine.stats().imported_blocks.load(Ordering::Relaxed), 10);
        // A second import of the same chain takes nothing in and announces nothing.
        let again = engine.import_kv(import(&chain, 0)).await.expect("engine runs");
        assert_eq!(
            again,
            KvImported {
                already_cached: 10,
                imported: 0,
                refused: false,
            }
        );
        assert!(stored(&mut events).is_empty());
    }

    #[tokio::test]
    async fn an_import_continues_the_prefix_already_here_and_stops_at_a_gap() {
        let engine = spawn_engine(config(64));
        let prompt: Vec<u32> = (0..24).collect();
        let chain = block_hashes(&prompt, BLOCK);
        run(&engine, prompt[..8].to_vec(), 1).await;
        assert_eq!(engine.held_blocks(sequences(&chain)).await.expect("engine runs"), 2);
        let imported = engine.import_kv(import(&chain, 2)).await.expect("engine runs");
        assert_eq!(
            imported,
            KvImported {
                already_cached: 2,
                imported: 4,
                refused: false,
            }
        );
        // Blocks said to be here but gone (first = 3 while block 2 is missing elsewhere).
        let other: Vec<u32> = (100..124).collect();
        let other_chain = block_hashes(&other, BLOCK);
        let imported = engine.import_kv(import(&other_chain, 3)).await.expect("engine runs");
        assert_eq!(imported, KvImported::default(), "nothing hangs off a missing parent");
        assert_eq!(
            engine.held_blocks(sequences(&other_chain)).await.expect("engine runs"),
            0
        );
    }

    #[tokio::test]
    async fn imports_respect_capacity_and_evict_a_chain_from_its_tail() {
        // 8 blocks; a gated request holds 2 of them while the imports run.
        let engine = spawn_engine(config(8));
        let (sink, mut events) = mpsc::unbounded_channel();
        engine.subscribe_kv_events(sink);
        let gate = PrefillGate::new(8);
        let mut held = engine
            .submit_gated((500..520).collect(), max(1), Some(gate))
            .expect("accepted");
        assert!(matches!(held.recv().await, Some(Output::Started { .. })));
        for _ in 0..100 {
            if engine.stats().active_blocks.load(Ordering::Relaxed) == 2 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        assert_eq!(engine.stats().active_blocks.load(Ordering::Relaxed), 2);
        let first: Vec<u32> = (0..40).collect();
        let first_chain = block_hashes(&first, BLOCK);
        let imported = engine.import_kv(import(&first_chain, 0)).await.expect("engine runs");
        assert_eq!(imported.imported, 6, "only the 6 blocks no request holds");
        assert_eq!(
            engine.held_blocks(sequences(&first_chain)).await.expect("engine runs"),
            6
        );
        stored(&mut events);
        // Three more blocks evict three of the first chain's, from its end.
        let second: Vec<u32> = (200..212).collect();
        let second_chain = block_hashes(&second, BLOCK);
        let imported = engine.import_kv(import(&second_chain, 0)).await.expect("engine runs");
        assert_eq!(imported.imported, 3);
        assert_eq!(
            engine.held_blocks(sequences(&first_chain)).await.expect("engine runs"),
            3,
            "what stays of the first chain is its prefix"
        );
        let mut removed = Vec::new();
        while let Ok(event) = events.try_recv() {
            if let KvEvent::Removed { block_hashes } = event {
                removed.extend(block_hashes);
            }
        }
        removed.sort_unstable();
        let mut tail = sequences(&first_chain[3..6]);
        tail.sort_unstable();
        assert_eq!(removed, tail);
        // The gated request's blocks were never touched.
        assert_eq!(engine.stats().active_blocks.load(Ordering::Relaxed), 2);
        drop(held);
    }

    #[tokio::test]
    async fn an_export_answers_the_leading_run_it_holds() {
        let engine = spawn_engine(config(64));
        let prompt: Vec<u32> = (0..42).collect();
        run(&engine, prompt.clone(), 1).await;
        let hashes = sequences(&block_hashes(&prompt, BLOCK));
        let export = engine.export_kv(hashes.clone()).await.expect("engine runs");
        assert_eq!(export.block_hashes, hashes);
        assert_eq!(export.payloads, None, "simulated blocks move by name");
        let gapped = vec![hashes[0], hashes[1], 7, hashes[3]];
        let export = engine.export_kv(gapped).await.expect("engine runs");
        assert_eq!(export.block_hashes, hashes[..2]);
        let export = engine.export_kv(vec![7, hashes[0]]).await.expect("engine runs");
        assert!(export.block_hashes.is_empty());
        assert_eq!(engine.stats().exported_blocks.load(Ordering::Relaxed), 12);
    }

    /// The bytes each block of a [`Recorder`] holds.
    type Contents = Arc<Mutex<HashMap<BlockId, Vec<u8>>>>;

    /// An executor whose blocks hold bytes: each computed position writes its token into its
    /// block, so a block's payload is its tokens.
    struct Recorder {
        medium: KvMedium,
        blocks: Contents,
    }

    impl Executor for Recorder {
        fn execute(&mut self, items: &mut [StepItem<'_>]) -> Result<(), String> {
            let mut blocks = self.blocks.lock().map_err(|_| "poisoned")?;
            for item in items.iter_mut() {
                for position in item.start..item.start + item.count {
                    let block = blocks.entry(item.blocks[position / BLOCK]).or_default();
                    block.resize(BLOCK, 0);
                    block[position % BLOCK] = item.tokens[position] as u8;
                }
                if item.samples() {
                    item.next_token = Some(Ok(1));
                }
            }
            Ok(())
        }

        fn kv_medium(&self) -> KvMedium {
            self.medium
        }

        fn export_kv(&mut self, blocks: &[BlockId]) -> Option<Vec<Vec<u8>>> {
            let held = self.blocks.lock().ok()?;
            blocks.iter().map(|block| held.get(block).cloned()).collect()
        }

        fn import_kv(&mut self, block: BlockId, payload: &[u8]) -> Result<(), String> {
            if payload.len() != BLOCK {
                return Err(format!("a payload of {} bytes", payload.len()));
            }
            self.blocks
                .lock()
                .map_err(|_| "poisoned")?
                .insert(block, payload.to_vec());
            Ok(())
        }
    }

    fn native(medium: KvMedium) -> (EngineHandle, Contents) {
        let blocks = Arc::new(Mutex::new(HashMap::new()));
        let executor = Recorder {
            medium,
            blocks: blocks.clone(),
        };
        let engine = spawn_native(config(16), ModelLimits::default(), executor, "transfer-test").expect("spawns");
        (engine, blocks)
    }

    #[tokio::test]
    async fn payloads_travel_with_the_blocks_of_executors_that_copy_them() {
        let (prefill, _) = native(KvMedium::Payloads);
        let (decode, decode_blocks) = native(KvMedium::Payloads);
        assert_eq!(decode.kv_medium(), KvMedium::Payloads);
        let prompt: Vec<u32> = (10..22).collect();
        let chain = block_hashes(&prompt, BLOCK);
        run(&prefill, prompt.clone(), 1).await;
        let export = prefill.export_kv(sequences(&chain)).await.expect("engine runs");
        let payloads = export.payloads.expect("payloads");
        assert_eq!(
            payloads,
            vec![vec![10, 11, 12, 13], vec![14, 15, 16, 17], vec![18, 19, 20, 21]]
        );
        // Without payloads such an engine takes nothing in; with them, every block.
        let without = decode.import_kv(import(&chain, 0)).await.expect("engine runs");
        assert_eq!(without.imported, 0);
        // A payload the executor refuses stops the import at its block.
        let mut wrong: Vec<Bytes> = payloads.iter().cloned().map(Bytes::from).collect();
        wrong[1] = Bytes::from_static(&[1, 2]);
        let refused = decode
            .import_kv(KvImport {
                payloads: Some(wrong),
                ..import(&chain, 0)
            })
            .await
            .expect("engine runs");
        assert_eq!(
            refused,
            KvImported {
                already_cached: 0,
                imported: 1,
                refused: true
            }
        );
        let with = decode
            .import_kv(KvImport {
                payloads: Some(payloads.iter().cloned().map(Bytes::from).collect()),
                ..import(&chain, 0)
            })
            .await
            .expect("engine runs");
        assert_eq!(with.imported, 2, "the block taken in before the refusal stays");
        assert_eq!(with.already_cached, 1);
        let mut held: Vec<Vec<u8>> = decode_blocks.lock().expect("lock").values().cloned().collect();
        held.sort();
        assert_eq!(
            held, payloads,
            "the decode engine's blocks hold the prefill's keys and values"
        );
    }

    #[tokio::test]
    async fn an_opaque_executor_imports_nothing() {
        let (engine, _) = native(KvMedium::Opaque);
        let chain = block_hashes(&(0..12).collect::<Vec<u32>>(), BLOCK);
        let imported = engine.import_kv(import(&chain, 0)).await.expect("engine runs");
        assert_eq!(imported, KvImported::default());
        assert_eq!(engine.held_blocks(sequences(&chain)).await.expect("engine runs"), 0);
        // Its exports name blocks without their contents.
        run(&engine, (0..12).collect(), 1).await;
        let export = engine.export_kv(sequences(&chain)).await.expect("engine runs");
        assert_eq!(export.block_hashes.len(), 3);
        assert_eq!(export.payloads, None);
    }
}
