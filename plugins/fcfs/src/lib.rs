//! `fcfs`: first come, first served. Requests are taken longest-waiting first (higher priority
//! classes before lower), and batches are filled in that order up to `max-items` and the
//! largest token budget ([`switchyard_policy_sdk::pack`]).

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
        switchyard_policy_sdk::pack(order, &queue.tokens, budget)
    }
}

switchyard_policy_sdk::batcher!(Fcfs);

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn higher_priority_then_longest_waiting_first() {
        let queue = PendingTable {
            ids: vec![1, 2, 3, 4],
            tokens: vec![100; 4],
            waited_ms: vec![5.0, 50.0, 1.0, 20.0],
            priority: vec![0, 0, 1, 0],
            kinds: vec![1; 4],
            ready: vec![false; 4],
        };
        let budget = Budget {
            token_budgets: vec![256],
            max_items: 2,
            max_batches: 4,
        };
        let batches = Fcfs::form_batches(&queue, &budget);
        assert_eq!(batches[0].items, vec![2, 1], "priority 1 first, then the 50 ms wait");
        assert_eq!(batches[1].items, vec![3, 0]);
        assert_eq!(batches[0].token_budget, 256);
    }
}
