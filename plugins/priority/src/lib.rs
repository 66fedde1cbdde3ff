//! `priority`: strict priority classes, with aging so that a low class is never starved.
//!
//! Requests are taken highest class first and, within a class, longest waiting first. A
//! request rises one class for every `aging_ms` it has waited (default 10,000 ms), so under a
//! flood of high-class requests a low one still goes after a bounded wait: a class-0 request
//! that has waited 20 s ranks with class-2 requests that just arrived (and ahead of those, as it
//! has waited longer). Batches are packed in that order ([`switchyard_policy_sdk::pack`]).

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Batch, Batcher, Budget, PendingTable};

/// The policy.
pub struct Priority;

/// Milliseconds of waiting worth one class when the configuration does not set `aging_ms`.
const DEFAULT_AGING_MS: f64 = 10_000.0;

/// The class item `i` ranks in after aging: its own, plus one per whole `aging_ms` waited.
fn effective_class(queue: &PendingTable, i: usize, aging_ms: f32) -> u32 {
    // `as` truncates toward zero (and saturates): whole periods of a non-negative wait.
    u32::from(queue.priority[i]).saturating_add((queue.waited_ms[i].max(0.0) / aging_ms) as u32)
}

impl Batcher for Priority {
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
        let aging_ms = switchyard_policy_sdk::config::get_f64("aging_ms", DEFAULT_AGING_MS);
        let aging_ms = if aging_ms.is_finite() && aging_ms > 0.0 {
            aging_ms as f32
        } else {
            DEFAULT_AGING_MS as f32
        };
        let mut order: Vec<usize> = (0..queue.ids.len()).collect();
        order.sort_by(|&a, &b| {
            let class = |i: usize| effective_class(queue, i, aging_ms);
            class(b)
                .cmp(&class(a))
                .then(queue.waited_ms[b].total_cmp(&queue.waited_ms[a]))
                .then(a.cmp(&b))
        });
        switchyard_policy_sdk::pack(order, &queue.tokens, budget)
    }
}

switchyard_policy_sdk::batcher!(Priority);

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn queue(priority: Vec<u8>, waited_ms: Vec<f32>) -> PendingTable {
        let n = priority.len();
        PendingTable {
            ids: (0..n as u64).collect(),
            tokens: vec![10; n],
            waited_ms,
            priority,
            kinds: vec![0; n],
            ready: vec![false; n],
        }
    }

    fn order(queue: &PendingTable) -> Vec<u32> {
        let budget = Budget {
            token_budgets: vec![u32::MAX],
            max_items: queue.ids.len() as u32,
            max_batches: 1,
        };
        Priority::form_batches(queue, &budget).remove(0).items
    }

    #[test]
    fn higher_classes_first_then_the_longest_waiting() {
        let queue = queue(vec![0, 2, 1, 2, 0], vec![900.0, 5.0, 300.0, 50.0, 10.0]);
        assert_eq!(order(&queue), vec![3, 1, 2, 0, 4]);
    }

    #[test]
    fn a_low_class_rises_a_class_per_aging_period() {
        // 25 s at class 0 ranks as class 2 (aging 10 s), ahead of new class-2 and class-1 work.
        let queue = queue(vec![2, 0, 1], vec![100.0, 25_000.0, 9_000.0]);
        assert_eq!(order(&queue), vec![1, 0, 2]);
    }
}
