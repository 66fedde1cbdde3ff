//! `mixed-modality`: the batch order of a mixed image, audio and video queue: ready items
//! first, small items filling the room a large one leaves, and no item starved.
//!
//! Items are taken ready first (an encoder that already holds an item's features serves it at
//! no cost to the rest), then by arrival, longest waiting first, higher priority classes ahead
//! within each group. A batch is filled in that order; an item that would push it past the
//! largest token budget or `max-items` is skipped, so smaller items behind it can fill the
//! room, and goes into a later batch. Skipping alone lets small items overtake a large one
//! forever; here an item that has waited `max_wait_ms` (default 50) comes before everything
//! else and is never skipped: when it does not fit, the batch closes and the next one starts
//! with it. Each batch is labelled with the smallest budget its tokens fit; an item larger than
//! every budget forms a batch of its own.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Batch, Batcher, Budget, PendingTable};

/// The policy.
pub struct MixedModality;

/// The aging bound when the configuration does not set `max_wait_ms`.
const DEFAULT_MAX_WAIT_MS: f64 = 50.0;

impl Batcher for MixedModality {
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
        let max_wait = switchyard_policy_sdk::config::get_f64("max_wait_ms", DEFAULT_MAX_WAIT_MS) as f32;
        let n = queue.ids.len();
        let aged = |i: usize| queue.waited_ms[i] >= max_wait;
        let mut order: Vec<usize> = (0..n).collect();
        // Aged first, then ready, then the rest; within each, higher priority, then longest waiting.
        order.sort_by(|&a, &b| {
            aged(b)
                .cmp(&aged(a))
                .then(queue.ready[b].cmp(&queue.ready[a]))
                .then(queue.priority[b].cmp(&queue.priority[a]))
                .then(queue.waited_ms[b].total_cmp(&queue.waited_ms[a]))
                .then(a.cmp(&b))
        });
        let largest = budget.token_budgets.iter().copied().max().unwrap_or(u32::MAX);
        let max_items = budget.max_items.max(1) as usize;
        let max_batches = budget.max_batches.max(1) as usize;
        let mut batches = Vec::new();
        while !order.is_empty() && batches.len() < max_batches {
            let mut items: Vec<u32> = Vec::new();
            let mut total = 0u32;
            let mut rest = Vec::with_capacity(order.len());
            let mut closed = false;
            for &index in &order {
                let need = queue.tokens[index];
                let fits = items.is_empty() || (items.len() < max_items && total.saturating_add(need) <= largest);
                if !closed && fits {
                    items.push(index as u32);
                    total = total.saturating_add(need);
                } else {
                    // An aged item is never overtaken: the batch closes in front of it.
                    closed |= aged(index);
                    rest.push(index);
                }
            }
            batches.push(Batch {
                token_budget: label(total, &budget.token_budgets),
                items,
            });
            order = rest;
        }
        batches
    }
}

/// The smallest budget `total` fits, or `total` itself when it fits none.
fn label(total: u32, budgets: &[u32]) -> u32 {
    budgets.iter().copied().filter(|b| *b >= total).min().unwrap_or(total)
}

switchyard_policy_sdk::batcher!(MixedModality);

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn queue(tokens: Vec<u32>, waited_ms: Vec<f32>, ready: Vec<bool>) -> PendingTable {
        let n = tokens.len();
        PendingTable {
            ids: (100..100 + n as u64).collect(),
            tokens,
            waited_ms,
            priority: vec![0; n],
            kinds: vec![1; n],
            ready,
        }
    }

    fn budget(max_items: u32, max_batches: u32) -> Budget {
        Budget {
            token_budgets: vec![512, 1024],
            max_items,
            max_batches,
        }
    }

    #[test]
    fn ready_items_go_first_then_arrival() {
        let queue = queue(
            vec![100, 100, 100, 100],
            vec![4.0, 3.0, 2.0, 1.0],
            vec![false, false, true, false],
        );
        let batches = MixedModality::form_batches(&queue, &budget(2, 8));
        assert_eq!(batches[0].items, vec![2, 0]);
        assert_eq!(batches[1].items, vec![1, 3]);
        assert!(batches.iter().all(|b| b.token_budget == 512));
    }

    #[test]
    fn a_large_item_is_skipped_while_young_so_small_ones_fill_the_batch() {
        // 900 arrives first; 200 + 900 would pass 1024, so 900 waits for the next batch.
        let queue = queue(vec![200, 900, 300, 400], vec![9.0, 8.0, 7.0, 6.0], vec![false; 4]);
        let batches = MixedModality::form_batches(&queue, &budget(8, 8));
        assert_eq!(batches[0].items, vec![0, 2, 3]);
        assert_eq!(batches[0].token_budget, 1024);
        assert_eq!(batches[1].items, vec![1]);
    }

    #[test]
    fn an_aged_item_is_never_overtaken() {
        // The same queue, but the 900 has waited past the bound: it leads, and nothing jumps it.
        let queue = queue(vec![200, 900, 300, 400], vec![9.0, 60.0, 7.0, 6.0], vec![false; 4]);
        let batches = MixedModality::form_batches(&queue, &budget(8, 8));
        assert_eq!(batches[0].items, vec![1]);
        assert_eq!(batches[0].token_budget, 1024);
        assert_eq!(batches[1].items, vec![0, 2, 3]);
    }

    #[test]
    fn every_item_is_placed_unless_max_batches_is_reached() {
        let queue = queue(vec![700; 6], vec![1.0; 6], vec![false; 6]);
        let all = MixedModality::form_batches(&queue, &budget(8, 8));
        assert_eq!(all.iter().map(|b| b.items.len()).sum::<usize>(), 6);
        assert!(all.iter().all(|b| b.items.len() == 1), "two 700s pass 1024");
        let capped = MixedModality::form_batches(&queue, &budget(8, 2));
        assert_eq!(capped.len(), 2);
    }

    #[test]
    fn an_item_over_every_budget_goes_alone() {
        let queue = queue(vec![5000, 100], vec![2.0, 1.0], vec![false; 2]);
        let batches = MixedModality::form_batches(&queue, &budget(8, 8));
        assert_eq!(batches[0].items, vec![0]);
        assert_eq!(batches[0].token_budget, 5000);
        assert_eq!(batches[1].items, vec![1]);
    }
}
