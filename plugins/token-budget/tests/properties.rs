//! Property tests of the `token-budget` batcher (the greedy packing of vLLM's encoder CUDA-graph
//! manager, vllm-project/vllm#35963) through [`TokenBudget::form_batches`]: thousands
//! of random queues from a seeded generator, checked against a simulation of the rule written
//! here and, for small queues, against the best packing found by trying every partition.

use std::collections::HashSet;

use switchyard_policy_sdk::{Batch, Batcher, Budget, PendingTable};
use token_budget::TokenBudget;

/// Cases per property.
const CASES: u64 = 2_000;

/// SplitMix64: a tiny seeded generator (no dependency), so every run checks the same cases.
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
}

/// A queue of `tokens` (ids 1000, 1001, ...).
fn queue(tokens: Vec<u32>) -> PendingTable {
    let n = tokens.len();
    PendingTable {
        ids: (1000..1000 + n as u64).collect(),
        tokens,
        waited_ms: vec![0.0; n],
        priority: vec![0; n],
        kinds: vec![1; n],
        ready: vec![false; n],
    }
}

/// Up to `max_requests` requests of 1..3000 tokens; 1..4 ascending budgets at a scale drawn per
/// case (so some cases have no request above every budget and others many); `max-items` and
/// `max-batches` 1..10.
fn random_case(rng: &mut Rng, max_requests: u32) -> (PendingTable, Budget) {
    let n = rng.range(0, max_requests);
    let tokens = (0..n).map(|_| rng.range(1, 3000)).collect();
    let scale = [1_500, 3_000, 8_000, 20_000][rng.range(0, 3) as usize];
    let mut budgets: Vec<u32> = (0..rng.range(1, 4)).map(|_| rng.range(1, scale)).collect();
    budgets.sort_unstable();
    budgets.dedup();
    let budget = Budget {
        token_budgets: budgets,
        max_items: rng.range(1, 10),
        max_batches: rng.range(1, 10),
    };
    (queue(tokens), budget)
}

/// The rule, simulated step by step (not calling the batcher): sort
/// by tokens ascending (ties by position, so the result is deterministic); add requests to the
/// open batch until the next one would take it past the largest budget or past `max-items`;
/// then close it and label it with the smallest budget at least its tokens, or its own tokens
/// when it is one request above every budget (run eagerly); stop at `max-batches`.
fn reference(tokens: &[u32], budget: &Budget) -> Vec<(Vec<u32>, u32)> {
    let largest = budget.token_budgets.iter().copied().max().expect("a budget");
    let label = |sum: u32| {
        let fits = budget.token_budgets.iter().copied().filter(|&b| b >= sum).min();
        fits.unwrap_or(sum)
    };
    let mut sorted: Vec<(u32, u32)> = tokens.iter().copied().zip(0u32..).collect();
    sorted.sort_unstable();
    let mut batches: Vec<(Vec<u32>, u32)> = Vec::new();
    let (mut open, mut sum) = (Vec::new(), 0u32);
    for (need, index) in sorted {
        let fits = open.len() < budget.max_items as usize && sum + need <= largest;
        if !open.is_empty() && !fits {
            batches.push((std::mem::take(&mut open), label(sum)));
            sum = 0;
            if batches.len() == budget.max_batches as usize {
                return batches;
            }
        }
        open.push(index);
        sum += need;
    }
    if !open.is_empty() {
        batches.push((open, label(sum)));
    }
    batches
}

/// How often each situation came up, so that the properties are not vacuous.
#[derive(Default, Debug)]
struct Seen {
    oversize: u32,
    closed_by_count: u32,
    closed_by_tokens: u32,
    left_over: u32,
}

/// Checks properties 1-6 of `batches`, formed for `queue` within `budget`.
fn check(case: u64, queue: &PendingTable, budget: &Budget, batches: &[Batch], seen: &mut Seen) {
    let tokens = &queue.tokens;
    let largest = *budget.token_budgets.last().expect("a budget");
    let max_items = budget.max_items as usize;
    let total = |batch: &Batch| batch.items.iter().map(|&i| tokens[i as usize]).sum::<u32>();
    let smallest_fitting = |sum: u32| budget.token_budgets.iter().copied().filter(|&b| b >= sum).min();
    let context = format!("case {case}: tokens {tokens:?}, budget {budget:?}, batches {batches:?}");

    // 2. At most `max-batches` batches, each of 1..=`max-items` requests.
    assert!(
        batches.len() <= budget.max_batches as usize,
        "too many batches; {context}"
    );
    assert!(
        batches.iter().all(|b| (1..=max_items).contains(&b.items.len())),
        "{context}"
    );

    for batch in batches {
        let sum = total(batch);
        if batch.items.len() == 1 && sum > largest {
            // 3./4. One request above every budget: alone, labelled with its own tokens.
            seen.oversize += 1;
            assert_eq!(batch.token_budget, sum, "an oversize request's label; {context}");
        } else {
            // 1. Within the largest budget and its own label; 3. the smallest budget that fits.
            assert!(
                sum <= largest && sum <= batch.token_budget,
                "a batch over budget; {context}"
            );
            assert_eq!(
                Some(batch.token_budget),
                smallest_fitting(sum),
                "not the smallest budget; {context}"
            );
        }
    }
    // 4. A request above every budget shares no batch.
    for batch in batches.iter().filter(|b| b.items.len() > 1) {
        assert!(batch.items.iter().all(|&i| tokens[i as usize] <= largest), "{context}");
    }

    // 5. No request twice, none outside the queue; those left out are exactly the largest ones,
    //    and only because `max-batches` was reached with no room in the last batch.
    let placed: Vec<usize> = batches
        .iter()
        .flat_map(|b| b.items.iter().map(|&i| i as usize))
        .collect();
    assert!(
        placed.iter().all(|&i| i < tokens.len()),
        "an index outside the queue; {context}"
    );
    let distinct: HashSet<usize> = placed.iter().copied().collect();
    assert_eq!(distinct.len(), placed.len(), "a request placed twice; {context}");
    let mut ascending: Vec<usize> = (0..tokens.len()).collect();
    ascending.sort_by_key(|&i| (tokens[i], i));
    assert_eq!(
        placed,
        ascending[..placed.len()],
        "not the smallest requests, in order; {context}"
    );
    for pair in batches.windows(2) {
        let full = pair[0].items.len() == max_items;
        assert!(
            full || total(&pair[0]) + tokens[pair[1].items[0] as usize] > largest,
            "{context}"
        );
        seen.closed_by_count += u32::from(full);
        seen.closed_by_tokens += u32::from(!full);
    }
    if placed.len() < tokens.len() {
        seen.left_over += 1;
        assert_eq!(
            batches.len(),
            budget.max_batches as usize,
            "left over with batches to spare; {context}"
        );
        let last = batches.last().expect("a batch");
        let next = tokens[ascending[placed.len()]];
        assert!(
            last.items.len() == max_items || total(last) + next > largest,
            "{context}"
        );
    }

    // 6. The reference simulation's batches, exactly.
    let got: Vec<(Vec<u32>, u32)> = batches.iter().map(|b| (b.items.clone(), b.token_budget)).collect();
    assert_eq!(got, reference(tokens, budget), "not the reference's batches; {context}");
}

#[test]
fn form_batches_keeps_the_rules_properties() {
    let mut rng = Rng(0x70CE_0003);
    let mut seen = Seen::default();
    for case in 0..CASES {
        let (queue, budget) = random_case(&mut rng, 20);
        let batches = TokenBudget::form_batches(&queue, &budget);
        check(case, &queue, &budget, &batches, &mut seen);
    }
    eprintln!("{seen:?}");
    assert!(seen.oversize > 0 && seen.closed_by_count > 0 && seen.closed_by_tokens > 0 && seen.left_over > 0);
}

/// The fewest batches that hold every request of `tokens` (at most `max_items` each, and
/// within `largest` tokens unless a batch is a single request): every partition of the
/// requests into batches is tried (each request joins one of the batches so far or opens a
/// new one, which enumerates each set partition once). For at most 7 requests (877
/// partitions).
fn optimal(tokens: &[u32], largest: u32, max_items: usize) -> usize {
    fn place(i: usize, tokens: &[u32], largest: u32, max_items: usize, batches: &mut Vec<(usize, u32)>) -> usize {
        if i == tokens.len() {
            let valid = batches
                .iter()
                .all(|&(count, sum)| count <= max_items && (count == 1 || sum <= largest));
            return if valid { batches.len() } else { usize::MAX };
        }
        let mut best = usize::MAX;
        for b in 0..batches.len() {
            batches[b].0 += 1;
            batches[b].1 += tokens[i];
            best = best.min(place(i + 1, tokens, largest, max_items, batches));
            batches[b].0 -= 1;
            batches[b].1 -= tokens[i];
        }
        batches.push((1, tokens[i]));
        best = best.min(place(i + 1, tokens, largest, max_items, batches));
        batches.pop();
        best
    }
    assert!(tokens.len() <= 7, "brute force is for small queues");
    place(0, tokens, largest, max_items, &mut Vec::new())
}

/// Greedy against the optimum over every partition, for queues of up to 7 requests, with
/// `max-batches` out of the way so that every request is placed.
///
/// Greedy is not optimal (sorting puts the small requests together, where the optimum pairs
/// each large request with small ones), and it is not within twice the optimum either:
/// [`greedy_can_take_more_than_twice_the_optimum`] shows 23 batches where 10 suffice. What the
/// rule guarantees, with G greedy's batches and OPT the optimum's, is OPT <= G <= 3 OPT - 2:
///
/// - OPT <= G: greedy's batches are themselves a valid partition (checked above).
/// - Requests above every budget (C, the largest) are alone in any partition, and sorted they
///   come last, each alone, so they add the same count to both sides; take the others.
/// - Greedy's batches are f full ones (`max-items` K requests) and r others. Every other
///   batch but the last of them was closed because the next request would have passed C; that
///   request is no larger than any request of the next non-full batch (sorted), so two
///   consecutive non-full batches together hold more than C tokens: the total is more than
///   floor(r/2) C, and since each batch of the optimum holds at most C, OPT >= floor(r/2) + 1,
///   that is r <= 2 OPT - 1.
/// - If r >= 1 there are more than f K requests, so OPT >= f + 1: f <= OPT - 1. Hence
///   G = f + r <= 3 OPT - 2 (and if r = 0, G = f <= OPT, so G = OPT).
#[test]
fn greedy_is_within_the_proven_bound_of_the_optimum() {
    let mut rng = Rng(0x70CE_0103);
    let mut gaps = [0u32; 8];
    let mut worst = (0usize, 1usize);
    for case in 0..CASES {
        let (queue, mut budget) = random_case(&mut rng, 7);
        budget.max_batches = u32::MAX;
        let batches = TokenBudget::form_batches(&queue, &budget);
        check(case, &queue, &budget, &batches, &mut Seen::default());
        let greedy = batches.len();
        let largest = *budget.token_budgets.last().expect("a budget");
        let best = optimal(&queue.tokens, largest, budget.max_items as usize);
        let context = format!(
            "case {case}: tokens {:?}, budget {budget:?}: greedy {greedy}, optimum {best}",
            queue.tokens
        );
        if queue.tokens.is_empty() {
            assert_eq!((greedy, best), (0, 0), "{context}");
            continue;
        }
        assert!(best <= greedy, "greedy beat every partition: {context}");
        assert!(greedy <= 3 * best - 2, "greedy past 3 OPT - 2: {context}");
        gaps[greedy - best] += 1;
        if greedy * worst.1 > worst.0 * best {
            worst = (greedy, best);
        }
    }
    eprintln!(
        "greedy - optimum over {CASES} queues of <= 7 requests: {gaps:?} (index = gap); worst ratio {}/{}",
        worst.0, worst.1
    );
    assert!(
        gaps[1..].iter().any(|&g| g > 0),
        "no case where greedy is worse: the cases are too easy"
    );
}

/// Why no "within twice the optimum" bound is asserted: 80 requests of 1 token, 10 of 1190 and
/// 10 of 1790, 10 per batch, 3000 tokens at most. Sorted, the small ones fill 8 batches by count,
/// the 1190s go two by two (5 batches) and every 1790 alone (10): 23 batches. Yet 10 batches of
/// one 1790, one 1190 and eight 1s (2988 tokens, 10 requests) hold them all.
#[test]
fn greedy_can_take_more_than_twice_the_optimum() {
    let mut tokens = vec![1; 80];
    tokens.extend([1190; 10]);
    tokens.extend([1790; 10]);
    let budget = Budget {
        token_budgets: vec![1000, 2000, 3000],
        max_items: 10,
        max_batches: 100,
    };
    let queue = queue(tokens);
    let batches = TokenBudget::form_batches(&queue, &budget);
    check(0, &queue, &budget, &batches, &mut Seen::default());
    assert_eq!(batches.len(), 23);
    let sizes: Vec<usize> = batches.iter().map(|b| b.items.len()).collect();
    assert_eq!(sizes, [[10; 8].as_slice(), &[2; 5], &[1; 10]].concat());
    // A valid packing in 10: batch j holds the j-th 1790, the j-th 1190 and eight 1s.
    let packing: Vec<Vec<usize>> = (0..10)
        .map(|j| [90 + j, 80 + j].into_iter().chain(8 * j..8 * j + 8).collect())
        .collect();
    let mut covered: Vec<usize> = packing.concat();
    covered.sort_unstable();
    assert_eq!(covered, (0..100).collect::<Vec<_>>());
    for batch in &packing {
        let sum: u32 = batch.iter().map(|&i| queue.tokens[i]).sum();
        assert!(batch.len() <= 10 && sum <= 3000, "{sum}");
    }
    assert!(batches.len() > 2 * packing.len());
    assert!(
        batches.len() <= 3 * packing.len() - 2,
        "the proven bound holds (10 is the optimum: each 1790 needs a batch of its own)"
    );
}
