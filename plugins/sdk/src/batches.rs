//! Packing a batcher's queue into batches within token budgets.

use alloc::vec::Vec;

use crate::{Batch, Budget};

/// Packs requests, taken in `order`, into batches: a batch closes when the next request would
/// push it past the largest token budget or past `max_items`, and at most `max_batches` are
/// formed. Each batch is labelled with the smallest budget its tokens fit, or with its own token
/// count when it fits none (a request larger than every budget forms a batch of its own).
pub fn pack(order: impl IntoIterator<Item = usize>, tokens: &[u32], budget: &Budget) -> Vec<Batch> {
    let largest = budget.token_budgets.last().copied().unwrap_or(u32::MAX);
    let label = |total: u32| {
        budget
            .token_budgets
            .iter()
            .copied()
            .find(|b| *b >= total)
            .unwrap_or(total)
    };
    let mut batches = Vec::new();
    let mut items: Vec<u32> = Vec::new();
    let mut total = 0u32;
    for index in order {
        let need = tokens[index];
        if !items.is_empty() && (total.saturating_add(need) > largest || items.len() as u32 >= budget.max_items.max(1))
        {
            batches.push(Batch {
                token_budget: label(total),
                items: core::mem::take(&mut items),
            });
            total = 0;
            if batches.len() as u32 >= budget.max_batches.max(1) {
                return batches;
            }
        }
        items.push(index as u32);
        total = total.saturating_add(need);
    }
    if !items.is_empty() {
        batches.push(Batch {
            token_budget: label(total),
            items,
        });
    }
    batches
}
