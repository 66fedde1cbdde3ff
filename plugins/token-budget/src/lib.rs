//! `token-budget`: greedy bin packing into token budgets, as vLLM's encoder CUDA-graph manager
//! does. Requests are sorted by tokens ascending and packed into a batch until the next one
//! would exceed the largest budget or `max-items`; each batch is labelled with the smallest
//! budget that fits it. A request larger than every budget forms a batch of its own.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Batch, Batcher, Budget, PendingTable};

/// The policy.
pub struct TokenBudget;

impl Batcher for TokenBudget {
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
        let mut order: Vec<usize> = (0..queue.ids.len()).collect();
        order.sort_by_key(|&i| (queue.tokens[i], i));
        switchyard_policy_sdk::pack(order, &queue.tokens, budget)
    }
}

switchyard_policy_sdk::batcher!(TokenBudget);

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn packs_smallest_first_into_the_smallest_budget_that_fits() {
        let queue = PendingTable {
            ids: vec![10, 11, 12, 13, 14],
            tokens: vec![300, 100, 700, 200, 2000],
            waited_ms: vec![0.0; 5],
            priority: vec![0; 5],
            kinds: vec![1; 5],
            ready: vec![false; 5],
        };
        let budget = Budget {
            token_budgets: vec![256, 512, 1024],
            max_items: 8,
            max_batches: 8,
        };
        let batches = TokenBudget::form_batches(&queue, &budget);
        // Sorted: 100, 200, 300 (=600, next 700 would exceed 1024) | 700 | 2000 (alone).
        assert_eq!(batches[0].items, vec![1, 3, 0]);
        assert_eq!(batches[0].token_budget, 1024);
        assert_eq!(batches[1].items, vec![2]);
        assert_eq!(batches[1].token_budget, 1024);
        assert_eq!(batches[2].items, vec![4]);
        assert_eq!(
            batches[2].token_budget, 2000,
            "larger than every budget: a batch of its own"
        );
    }

    #[test]
    fn respects_max_items_and_max_batches() {
        let queue = PendingTable {
            ids: vec![1; 6],
            tokens: vec![10; 6],
            waited_ms: vec![0.0; 6],
            priority: vec![0; 6],
            kinds: vec![1; 6],
            ready: vec![false; 6],
        };
        let budget = Budget {
            token_budgets: vec![64],
            max_items: 2,
            max_batches: 2,
        };
        let batches = TokenBudget::form_batches(&queue, &budget);
        assert_eq!(batches.len(), 2);
        assert!(batches.iter().all(|b| b.items.len() == 2 && b.token_budget == 64));
    }
}
