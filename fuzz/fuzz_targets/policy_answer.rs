//! Policy answers as a guest may return them. The component model lifts whatever bytes a
//! guest leaves in its memory into well-typed values or traps, so "arbitrary bytes" reach the
//! host as arbitrary values of the answer types: a router's worker, encoders and fallbacks
//! against a table of any size and roles, a batcher's batches against a queue and budget of
//! any shape. The host must accept only answers it can act on: every index in range, no
//! fallback twice or equal to the pick, encoders that are encoders (one per role), batches
//! within their limits and budgets with no item twice. The native batching fallback's own
//! answer must always pass the same check.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::{
    Batch, Budget, Columns, PendingTable, WorkerTable, check_batches, check_route_answer, fallback_batches,
};

#[derive(Debug, Arbitrary)]
struct Route {
    roles: Vec<u8>,
    worker: u32,
    encoders: Vec<u32>,
    fallbacks: Vec<u32>,
}

#[derive(Debug, Arbitrary)]
struct Batching {
    tokens: Vec<u32>,
    priority: Vec<u8>,
    budgets: Vec<u32>,
    max_items: u32,
    max_batches: u32,
    batches: Vec<(Vec<u32>, u32)>,
}

#[derive(Debug, Arbitrary)]
enum Answer {
    Route(Route),
    Batching(Batching),
}

fn route(answer: Route) {
    let count = answer.roles.len();
    let mut table = WorkerTable::zeroed(count, Columns::IDS | Columns::ROLES);
    let roles = table.column_mut(Columns::ROLES).expect("roles column");
    for (slot, &role) in roles.iter_mut().zip(&answer.roles) {
        *slot = u32::from(role % 4);
    }
    let Ok(pick) = check_route_answer(&table, answer.worker, answer.encoders, answer.fallbacks) else {
        return;
    };
    assert!((pick.worker as usize) < count);
    let mut seen = std::collections::HashSet::from([pick.worker]);
    for &fallback in &pick.fallbacks {
        assert!(
            (fallback as usize) < count && seen.insert(fallback),
            "fallback {fallback}"
        );
    }
    let mut encoder_roles = std::collections::HashSet::new();
    for &encoder in &pick.encoders {
        let role = answer.roles[encoder as usize] % 4;
        assert!(
            role != 0 && encoder_roles.insert(role),
            "encoder {encoder} of role {role}"
        );
    }
}

fn batching(answer: Batching) {
    let n = answer.tokens.len();
    let mut budgets = answer.budgets;
    budgets.sort_unstable();
    budgets.dedup();
    let queue = PendingTable {
        ids: (0..n as u64).collect(),
        tokens: answer.tokens.clone(),
        waited_ms: vec![0.0; n],
        priority: (0..n).map(|i| answer.priority.get(i).copied().unwrap_or(0)).collect(),
        kinds: vec![1; n],
        ready: vec![false; n],
    };
    let budget = Budget {
        token_budgets: budgets,
        max_items: answer.max_items % 64,
        max_batches: answer.max_batches % 16,
    };
    let native = fallback_batches(&queue, &budget);
    if let Err(why) = check_batches(&queue, &budget, &native) {
        panic!("the native fallback's batches are refused: {why}");
    }
    let batches: Vec<Batch> = answer
        .batches
        .into_iter()
        .map(|(items, token_budget)| Batch { items, token_budget })
        .collect();
    if check_batches(&queue, &budget, &batches).is_err() {
        return;
    }
    assert!(batches.len() <= budget.max_batches.max(1) as usize);
    let mut seen = std::collections::HashSet::new();
    for batch in &batches {
        assert!(!batch.items.is_empty() && batch.items.len() <= budget.max_items.max(1) as usize);
        for &item in &batch.items {
            assert!((item as usize) < n && seen.insert(item), "item {item}");
        }
    }
}

fuzz_target!(|answer: Answer| match answer {
    Answer::Route(answer) => route(answer),
    Answer::Batching(answer) => batching(answer),
});
