//! `fcfs`: first come, first served. Requests are taken longest-waiting first (higher priority
//! classes before lower), and batches are filled in that order up to `max-items` and the
//! largest token budget; each batch is labelled with the smallest budget its tokens fit.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Batch, Batcher, Budget, PendingTable};

/// The policy.
pub struct Fcfs;

impl Batcher for Fcfs {
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
        let mut order: Vec<usize> = (0..queue.ids.len()).collect();
        order.sort_by(|&a, &b| {
            queue.priority[b]
                .cmp(&queue.priority[a])
                .then(queue.waited_ms[b].total_cmp(&queue.waited_ms[a]))
        });
        let largest = budget.token_budgets.last().copied().unwrap_or(u32::MAX);
        let mut batches = Vec::new();
        let mut items = Vec::new();
        let mut tokens = 0u32;
        for index in order {
            let need = queue.tokens[index];
            let full = items.len() as u32 >= budget.max_items.max(1) || tokens.saturating_add(need) > largest;
            if full && !items.is_empty() {
                batches.push(Batch {
                    token_budget: smallest_fit(budget, tokens),
                    items: core::mem::take(&mut items),
                });
                tokens = 0;
                if batches.len() as u32 >= budget.max_batches.max(1) {
                    return batches;
                }
            }
            items.push(index as u32);
            tokens = tokens.saturating_add(need);
        }
        if !items.is_empty() {
            batches.push(Batch {
                token_budget: smallest_fit(budget, tokens),
                items,
            });
        }
        batches
    }
}

/// The smallest budget holding `tokens`, or the largest if none does.
pub fn smallest_fit(budget: &Budget, tokens: u32) -> u32 {
    budget
        .token_budgets
        .iter()
        .copied()
        .find(|b| *b >= tokens)
        .or(budget.token_budgets.last().copied())
        .unwrap_or(tokens)
}

switchyard_policy_sdk::batcher!(Fcfs);
