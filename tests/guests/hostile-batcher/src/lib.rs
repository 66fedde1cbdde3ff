//! A batcher that passes the host's self-test and then misbehaves on live queues the way its
//! `mode` setting says: `loop` (never answers), `bad-index` (names an item that does not
//! exist), `drop` (leaves items out of every batch), `trap` (panics). With no mode it batches
//! first come, first served, as a well-behaved batcher.

#![no_std]

extern crate alloc;

use alloc::vec::Vec;

use hostile_common::sdk::{self, Batch, Batcher, Budget, PendingTable};

/// The host's self-test queue (`synthetic_queue` in the gateway's `policy/batching.rs`).
const SELF_TEST_TOKENS: [u32; 8] = [576, 64, 1800, 256, 5760, 100, 576, 50];

struct Hostile;

impl Batcher for Hostile {
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
        let arrival: Vec<usize> = (0..queue.ids.len()).collect();
        let honest = sdk::pack(arrival, &queue.tokens, budget);
        if queue.tokens[..] == SELF_TEST_TOKENS[..] {
            return honest;
        }
        match sdk::config::get("mode").as_deref() {
            Some("loop") => loop {
                core::hint::black_box(&queue.ids);
            },
            Some("bad-index") => alloc::vec![Batch {
                items: alloc::vec![queue.ids.len() as u32],
                token_budget: budget.token_budgets.first().copied().unwrap_or(0),
            }],
            Some("drop") => honest
                .into_iter()
                .take(1)
                .map(|mut batch| {
                    batch.items.truncate(1);
                    batch
                })
                .collect(),
            Some("trap") => panic!("hostile batcher"),
            _ => honest,
        }
    }
}

sdk::batcher!(Hostile);
