//! Property test of the position map: random layouts of text and placeholders, each placeholder
//! given a random row count, against an independent reference that expands the merged prompt
//! row by row and reads the spans back off it.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use switchyard_workers::features::build_position_map;

const PLACEHOLDER: u32 = u32::MAX;

/// The merged prompt written out: `None` for a text row, `Some(k)` for a row of item `k`.
fn expand(prompt: &[u32], rows: &[u32]) -> Vec<Option<usize>> {
    let mut merged = Vec::new();
    let mut item = 0;
    for &token in prompt {
        if token == PLACEHOLDER {
            merged.extend(std::iter::repeat_n(Some(item), rows[item] as usize));
            item += 1;
        } else {
            merged.push(None);
        }
    }
    merged
}

#[test]
fn spans_match_the_expanded_prompt() {
    let _turn = switchyard_harness::turn();
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    for case in 0..2000 {
        let items = rng.random_range(0..6usize);
        let mut prompt = Vec::new();
        let mut rows = Vec::new();
        for _ in 0..items {
            prompt.extend((0..rng.random_range(0..5)).map(|t| t as u32));
            prompt.push(PLACEHOLDER);
            // Zero-row items are legal (a video whose every frame was dropped is not, but the
            // map must not care).
            rows.push(rng.random_range(0..3000u32));
        }
        prompt.extend((0..rng.random_range(0..5)).map(|t| t as u32));
        let (entries, len) = build_position_map(&prompt, |t| t == PLACEHOLDER, &rows).expect("one per item");
        let merged = expand(&prompt, &rows);
        assert_eq!(len, merged.len(), "case {case}: length");
        assert_eq!(
            len,
            prompt.len() - items + rows.iter().map(|&r| r as usize).sum::<usize>(),
            "case {case}: text − placeholders + Σ rows"
        );
        assert_eq!(entries.len(), items);
        let mut previous_end = 0;
        for (k, entry) in entries.iter().enumerate() {
            assert_eq!(entry.slot, k);
            assert!(entry.span.start >= previous_end, "case {case}: spans ordered");
            previous_end = entry.span.end;
            assert_eq!(entry.span.len(), rows[k] as usize);
            let expected: Vec<usize> = merged
                .iter()
                .enumerate()
                .filter(|(_, row)| **row == Some(k))
                .map(|(at, _)| at)
                .collect();
            let got: Vec<usize> = (entry.span.start as usize..entry.span.end as usize).collect();
            assert_eq!(got, expected, "case {case}: item {k}'s rows");
        }
        // A plan with a different number of items than placeholders is refused.
        let mut wrong = rows.clone();
        wrong.push(1);
        assert!(build_position_map(&prompt, |t| t == PLACEHOLDER, &wrong).is_none());
    }
}
