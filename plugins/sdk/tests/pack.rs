//! Property tests of [`switchyard_policy_sdk::pack`], the greedy token-budget packing (that of
//! vLLM's encoder CUDA-graph manager, vllm-project/vllm#35963), called directly with arbitrary
//! orders: a batcher may hand it any order, not only the ascending one `token-budget` sorts into.
//!
//! Thousands of random cases come from a seeded generator, so every run checks the same ones and
//! a failure names its case. Expectations come from [`reference`], written here from the rule,
//! never from `pack` itself.

use std::collections::HashSet;

use switchyard_policy_sdk::{Batch, Budget, PendingTable, pack};

/// Cases per property.
const CASES: u64 = 2_000;

/// SplitMix64: a tiny seeded generator (no dependency), good enough to spread test cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the modulo bias is irrelevant for tests).
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next() % u64::from(hi - lo + 1)) as u32
    }

    /// `values` in a random order (Fisher–Yates).
    fn shuffle<T>(&mut self, values: &mut [T]) {
        for i in (1..values.len()).rev() {
            values.swap(i, self.range(0, i as u32) as usize);
        }
    }
}

/// 0..20 requests of 1..3000 tokens; 1..4 ascending budgets; `max-items` and `max-batches`
/// 1..10. The budgets' scale is drawn per case, so that some cases have no request larger than
/// every budget and others have many.
fn random_case(rng: &mut Rng) -> (Vec<u32>, Budget) {
    let n = rng.range(0, 20);
    let tokens: Vec<u32> = (0..n).map(|_| rng.range(1, 3000)).collect();
    let scale = [1_500, 3_000, 8_000, 20_000][rng.range(0, 3) as usize];
    let mut budgets: Vec<u32> = (0..rng.range(1, 4)).map(|_| rng.range(1, scale)).collect();
    budgets.sort_unstable();
    budgets.dedup();
    let budget = Budget {
        token_budgets: budgets,
        max_items: rng.range(1, 10),
        max_batches: rng.range(1, 10),
    };
    (tokens, budget)
}

/// The smallest budget at least `total`, or `total` itself when none is (the label of a batch
/// of one request larger than every budget: it runs eagerly, and a label above the largest
/// budget says so). Found by a minimum over all budgets, not relying on their order.
fn expected_label(total: u32, budgets: &[u32]) -> u32 {
    budgets.iter().copied().filter(|&b| b >= total).min().unwrap_or(total)
}

/// The rule, written from its statement and not from `pack`: starting where the previous batch
/// ended, a batch is the longest run of `order` with at most `max_items` requests whose tokens
/// fit the largest budget; a run of one request always counts (that is how a request larger
/// than every budget ends up alone); at most `max_batches` batches; the rest is left over.
fn reference(order: &[usize], tokens: &[u32], budget: &Budget) -> Vec<(Vec<u32>, u32)> {
    let largest = budget.token_budgets.iter().copied().max().expect("a budget");
    let max_items = budget.max_items as usize;
    let run_total = |run: &[usize]| run.iter().map(|&i| tokens[i]).sum::<u32>();
    let mut batches = Vec::new();
    let mut start = 0;
    while start < order.len() && batches.len() < budget.max_batches as usize {
        let mut end = start + 1;
        while end < order.len() && end - start < max_items && run_total(&order[start..=end]) <= largest {
            end += 1;
        }
        let run = &order[start..end];
        let items = run.iter().map(|&i| i as u32).collect();
        batches.push((items, expected_label(run_total(run), &budget.token_budgets)));
        start = end;
    }
    batches
}

/// How often each interesting situation came up, so that the properties are not vacuous.
#[derive(Default, Debug)]
struct Seen {
    oversize: u32,
    closed_by_count: u32,
    closed_by_tokens: u32,
    left_over: u32,
    labelled_below_largest: u32,
}

/// Checks properties 1-6 of `batches`, formed by `pack(order, tokens, budget)`.
fn check(case: u64, order: &[usize], tokens: &[u32], budget: &Budget, batches: &[Batch], seen: &mut Seen) {
    let largest = *budget.token_budgets.last().expect("a budget");
    let max_items = budget.max_items as usize;
    let total = |batch: &Batch| batch.items.iter().map(|&i| tokens[i as usize]).sum::<u32>();
    let context = format!("case {case}: tokens {tokens:?}, order {order:?}, budget {budget:?}, batches {batches:?}");

    // 2. At most `max-batches` batches, none empty, none over `max-items`.
    assert!(
        batches.len() <= budget.max_batches as usize,
        "too many batches; {context}"
    );
    for batch in batches {
        assert!(!batch.items.is_empty(), "an empty batch; {context}");
        assert!(batch.items.len() <= max_items, "a batch over max-items; {context}");
    }

    for batch in batches {
        let sum = total(batch);
        let oversize = batch.items.len() == 1 && sum > largest;
        if oversize {
            // 3. A request larger than every budget is labelled with its own tokens (above
            //    every budget, so the host knows it runs eagerly).
            seen.oversize += 1;
            assert_eq!(batch.token_budget, sum, "an oversize request's label; {context}");
        } else {
            // 1. Within the largest budget and within its own label; 3. the label is the
            //    smallest budget that fits.
            assert!(sum <= largest, "a batch over the largest budget; {context}");
            assert!(sum <= batch.token_budget, "a batch over its own label; {context}");
            assert_eq!(
                batch.token_budget,
                expected_label(sum, &budget.token_budgets),
                "not the smallest budget that fits; {context}"
            );
            assert!(budget.token_budgets.contains(&batch.token_budget), "{context}");
            seen.labelled_below_largest += u32::from(batch.token_budget < largest);
        }
        // 4. A request larger than every budget is alone.
        for &item in &batch.items {
            if tokens[item as usize] > largest {
                assert_eq!(batch.items.len(), 1, "an oversize request shares a batch; {context}");
            }
        }
    }

    // 5. No request twice; the placed ones are `order`'s first ones, in order.
    let placed: Vec<usize> = batches
        .iter()
        .flat_map(|b| b.items.iter().map(|&i| i as usize))
        .collect();
    let distinct: HashSet<usize> = placed.iter().copied().collect();
    assert_eq!(distinct.len(), placed.len(), "a request placed twice; {context}");
    assert!(placed.len() <= order.len(), "{context}");
    assert_eq!(placed, order[..placed.len()], "not a prefix of the order; {context}");

    // 5. Every batch but the last closed for a reason: it was full, or the next request would
    //    have pushed it past the largest budget (no room left that the next request fitted).
    for pair in batches.windows(2) {
        let next = tokens[pair[1].items[0] as usize];
        let full = pair[0].items.len() == max_items;
        let no_room = total(&pair[0]) + next > largest;
        assert!(
            full || no_room,
            "a batch closed with room for the next request; {context}"
        );
        seen.closed_by_count += u32::from(full);
        seen.closed_by_tokens += u32::from(!full);
    }
    // ... and requests are left over only once `max-batches` is reached, and only when the
    // next one would not have fitted the last batch either.
    if placed.len() < order.len() {
        seen.left_over += 1;
        assert_eq!(
            batches.len(),
            budget.max_batches as usize,
            "left over with batches to spare; {context}"
        );
        let last = batches.last().expect("a batch");
        let next = tokens[order[placed.len()]];
        assert!(
            last.items.len() == max_items || total(last) + next > largest,
            "left over though the last batch had room; {context}"
        );
    }

    // 6. Exactly the reference's batches.
    let got: Vec<(Vec<u32>, u32)> = batches.iter().map(|b| (b.items.clone(), b.token_budget)).collect();
    assert_eq!(
        got,
        reference(order, tokens, budget),
        "not the reference's batches; {context}"
    );
}

/// Properties 1-6 over random orders: a random subset of the requests in a random order.
#[test]
fn pack_keeps_its_properties_in_any_order() {
    let mut rng = Rng(0x5EED_0003);
    let mut seen = Seen::default();
    for case in 0..CASES {
        let (tokens, budget) = random_case(&mut rng);
        let mut order: Vec<usize> = (0..tokens.len()).filter(|_| rng.range(0, 5) > 0).collect();
        rng.shuffle(&mut order);
        let batches = pack(order.iter().copied(), &tokens, &budget);
        check(case, &order, &tokens, &budget, &batches, &mut seen);
    }
    eprintln!("{seen:?}");
    assert!(
        seen.oversize > 0
            && seen.closed_by_count > 0
            && seen.closed_by_tokens > 0
            && seen.left_over > 0
            && seen.labelled_below_largest > 0,
        "the cases missed a situation: {seen:?}"
    );
}

/// Properties 1-6 in ascending order of tokens (ties by index), the order `token-budget` uses.
#[test]
fn pack_keeps_its_properties_in_ascending_order() {
    let mut rng = Rng(0x5EED_0103);
    let mut seen = Seen::default();
    for case in 0..CASES {
        let (tokens, budget) = random_case(&mut rng);
        let mut order: Vec<usize> = (0..tokens.len()).collect();
        order.sort_by_key(|&i| (tokens[i], i));
        let batches = pack(order.iter().copied(), &tokens, &budget);
        check(case, &order, &tokens, &budget, &batches, &mut seen);
        // Sorted ascending, an oversize request can only be followed by another: they come last.
        let oversize_from = batches
            .iter()
            .position(|b| b.token_budget > *budget.token_budgets.last().unwrap());
        if let Some(first) = oversize_from {
            assert!(batches[first..].iter().all(|b| b.items.len() == 1), "case {case}");
        }
    }
    eprintln!("{seen:?}");
    assert!(seen.oversize > 0 && seen.closed_by_count > 0 && seen.closed_by_tokens > 0 && seen.left_over > 0);
}

/// Property 7, original order restored: a batch names requests by their index in the pending table as
/// the host sent it, not by their place in the sorted order, so the host maps each item back
/// to its request id, and scatters results back into request order, with no bookkeeping of
/// the sort.
#[test]
fn batch_items_are_indices_into_the_pending_table_as_sent() {
    let mut rng = Rng(0x5EED_0203);
    let mut permuted = 0;
    for case in 0..CASES {
        let (tokens, budget) = random_case(&mut rng);
        let n = tokens.len();
        // Distinct, unordered ids, so an index that meant "sorted position" would map to the
        // wrong id.
        let ids: Vec<u64> = (0..n as u64)
            .map(|i| (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ case)
            .collect();
        let queue = PendingTable {
            ids,
            tokens,
            waited_ms: vec![0.0; n],
            priority: vec![0; n],
            kinds: vec![1; n],
            ready: vec![false; n],
        };
        // The sort a batcher does (as `token-budget`), then `pack`.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (queue.tokens[i], i));
        permuted += u32::from(order.iter().enumerate().any(|(place, &i)| place != i));
        let batches = pack(order.iter().copied(), &queue.tokens, &budget);

        // What the host does with a batch: item index -> request id; here each request's
        // "result" is its id, scattered back to the request's place in the table.
        let mut results: Vec<Option<u64>> = vec![None; n];
        let mut served_tokens = Vec::new();
        for batch in &batches {
            for &item in &batch.items {
                let item = item as usize;
                assert!(item < n, "case {case}: index {item} outside the table");
                assert!(results[item].is_none(), "case {case}: request {item} twice");
                results[item] = Some(queue.ids[item]);
                served_tokens.push(queue.tokens[item]);
            }
        }
        // The items index the table as sent: read through them, tokens come out ascending
        // (they were sorted), and the round trip lands every id in its own place.
        assert!(served_tokens.is_sorted(), "case {case}: items are not table indices");
        for (i, result) in results.iter().enumerate() {
            if let Some(id) = result {
                assert_eq!(*id, queue.ids[i], "case {case}: request {i} got another's result");
            }
        }
        // And the requests served are exactly the first ones of the sorted order.
        let served = results.iter().filter(|r| r.is_some()).count();
        assert!(order[..served].iter().all(|&i| results[i].is_some()), "case {case}");
    }
    assert!(
        permuted > CASES as u32 / 2,
        "the sort rarely moved anything: {permuted}"
    );
}

/// Property 7 by hand: requests 7, 8, 9 of 300, 100, 200 tokens are packed 100, 200, 300 and their
/// results land back in request order.
#[test]
fn results_scatter_back_to_request_order() {
    let queue = PendingTable {
        ids: vec![7, 8, 9],
        tokens: vec![300, 100, 200],
        waited_ms: vec![0.0; 3],
        priority: vec![0; 3],
        kinds: vec![1; 3],
        ready: vec![false; 3],
    };
    let budget = Budget {
        token_budgets: vec![256, 1024],
        max_items: 8,
        max_batches: 8,
    };
    let mut order: Vec<usize> = (0..3).collect();
    order.sort_by_key(|&i| (queue.tokens[i], i));
    let batches = pack(order, &queue.tokens, &budget);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].items, [1, 2, 0]);
    assert_eq!(batches[0].token_budget, 1024);
    let ids: Vec<u64> = batches[0].items.iter().map(|&i| queue.ids[i as usize]).collect();
    assert_eq!(ids, [8, 9, 7], "in batch (sorted) order");
    let mut results = [0u64; 3];
    for &item in &batches[0].items {
        results[item as usize] = queue.ids[item as usize] * 10;
    }
    assert_eq!(results, [70, 80, 90], "back in request order");
}
