//! `fair-share`: weighted fair queuing across tenants, by tokens, so that one tenant's burst
//! cannot starve another.
//!
//! Each tenant's requests keep their arrival order (longest waiting first). A request's finish
//! tag is the tokens of its tenant's requests up to and including it, divided by the tenant's
//! weight; requests go in order of finish tag (earlier arrival on ties). With every tenant
//! backlogged, each is served tokens in proportion to its weight; a tenant with one request
//! waiting behind another tenant's hundred has the smallest tag and goes first. Tags start
//! from the queue as it is at each call (start-time fair queuing over the backlog), so the
//! policy keeps no state between calls and a tenant that was idle does not build up credit.
//! Within a tenant, higher priority classes go first. Batches are packed in that order
//! ([`switchyard_policy_sdk::pack`]).

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use switchyard_policy_sdk::{Batch, Batcher, Budget, PendingTable, Tenancy};

/// The policy.
pub struct FairShare;

/// The order fair sharing serves `queue` in.
pub fn fair_order(queue: &PendingTable, tenancy: &Tenancy) -> Vec<usize> {
    let n = queue.ids.len();
    let mut by_tenant: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for i in 0..n {
        by_tenant.entry(tenancy.tenants[i]).or_default().push(i);
    }
    // (finish tag, -waited, index) for every request.
    let mut tagged: Vec<(f64, f32, usize)> = Vec::with_capacity(n);
    for items in by_tenant.values_mut() {
        items.sort_by(|&a, &b| {
            queue.priority[b]
                .cmp(&queue.priority[a])
                .then(queue.waited_ms[b].total_cmp(&queue.waited_ms[a]))
                .then(a.cmp(&b))
        });
        let mut tokens = 0f64;
        for &i in items.iter() {
            // A request of 0 tokens still takes a turn.
            tokens += f64::from(queue.tokens[i].max(1));
            tagged.push((tokens / f64::from(tenancy.weights[i]), -queue.waited_ms[i], i));
        }
    }
    tagged.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    tagged.into_iter().map(|(_, _, i)| i).collect()
}

impl Batcher for FairShare {
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
        Self::form_batches_for(queue, &Tenancy::single(queue.ids.len()), budget)
    }

    fn form_batches_for(queue: &PendingTable, tenancy: &Tenancy, budget: &Budget) -> Vec<Batch> {
        switchyard_policy_sdk::pack(fair_order(queue, tenancy), &queue.tokens, budget)
    }
}

switchyard_policy_sdk::batcher!(FairShare);

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn queue(tokens: Vec<u32>) -> PendingTable {
        let n = tokens.len();
        PendingTable {
            ids: (0..n as u64).collect(),
            tokens,
            // Earlier items have waited longer.
            waited_ms: (0..n).map(|i| (n - i) as f32 * 10.0).collect(),
            priority: vec![0; n],
            kinds: vec![0; n],
            ready: vec![false; n],
        }
    }

    #[test]
    fn a_quiet_tenant_goes_ahead_of_a_flood() {
        // Tenant 1 queued eight requests before tenant 2's one arrived.
        let queue = queue(vec![100; 9]);
        let tenancy = Tenancy {
            tenants: vec![1, 1, 1, 1, 1, 1, 1, 1, 2],
            weights: vec![1.0; 9],
        };
        let order = fair_order(&queue, &tenancy);
        assert_eq!(&order[..2], &[0, 8], "the flood's first, then the quiet tenant's");
    }

    #[test]
    fn backlogged_tenants_share_tokens_by_weight() {
        // Two tenants with ten 100-token requests each; tenant 2 weighs twice as much.
        let queue = queue(vec![100; 20]);
        let tenancy = Tenancy {
            tenants: (0..20).map(|i| if i % 2 == 0 { 1 } else { 2 }).collect(),
            weights: (0..20).map(|i| if i % 2 == 0 { 1.0 } else { 2.0 }).collect(),
        };
        let first_nine: Vec<u32> = fair_order(&queue, &tenancy)[..9]
            .iter()
            .map(|&i| tenancy.tenants[i])
            .collect();
        let heavy = first_nine.iter().filter(|&&t| t == 2).count();
        assert_eq!(
            heavy, 6,
            "two thirds of the first nine go to the tenant of weight 2: {first_nine:?}"
        );
    }

    #[test]
    fn large_requests_count_as_more_turns() {
        // Tenant 1 sends one 1000-token request, tenant 2 five of 100: tenant 2's go first.
        let queue = queue(vec![1000, 100, 100, 100, 100, 100]);
        let tenancy = Tenancy {
            tenants: vec![1, 2, 2, 2, 2, 2],
            weights: vec![1.0; 6],
        };
        assert_eq!(fair_order(&queue, &tenancy), vec![1, 2, 3, 4, 5, 0]);
    }
}
