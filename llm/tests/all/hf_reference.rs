//! The CPU forward pass against logits computed by Hugging Face `transformers` itself.
//!
//! The fixtures under `tests/fixtures/` were written once by `make_hf_reference.py` (transformers
//! 5.23.0, torch 2.15.0): two tiny random-weight models (a Llama with GQA, untied embeddings
//! and llama3 RoPE scaling in f32; a Qwen2 with q/k/v biases, tied embeddings and bf16 weights)
//! and transformers' f32 logits at every position of three prompts. The tolerance is 1e-5
//! absolute on logits of magnitude ~1 (f32 sums in a different order; the measured differences,
//! printed by the test, were at most 2.4e-6).

use std::path::Path;

use serde::Deserialize;
use switchyard_harness::fixtures;
use switchyard_llm::{ForwardError, LoadError, Model};

const TOLERANCE: f32 = 1e-5;

#[derive(Deserialize)]
struct Reference {
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
}

fn check(name: &str) {
    let dir = fixtures::llm(name);
    let model = Model::load(&dir).unwrap_or_else(|err| panic!("loading {name}: {err}"));
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let reference: Reference = serde_json::from_str(&text).expect("reference.json parses");
    let vocab = model.config().vocab_size;
    for (prompt, expected) in reference.prompts.iter().zip(&reference.logits) {
        let logits = model.forward(prompt).expect("forward");
        assert_eq!(logits.len(), prompt.len() * vocab);
        let mut worst = 0.0f32;
        for (position, row) in expected.iter().enumerate() {
            for (token, want) in row.iter().enumerate() {
                let got = logits[position * vocab + token];
                worst = worst.max((got - want).abs());
            }
        }
        println!("{name}: {} tokens, max |Δlogit| = {worst:e}", prompt.len());
        assert!(worst <= TOLERANCE, "{name}: max |Δlogit| {worst} > {TOLERANCE}");
        // The test could fail: the logits are far from constant.
        let spread = expected[0].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(spread > 0.1, "{name}: degenerate reference");
    }
}

#[test]
fn tiny_llama_matches_transformers() {
    let _turn = switchyard_harness::turn();
    check("tiny-llama");
}

#[test]
fn tiny_qwen2_in_bf16_matches_transformers() {
    let _turn = switchyard_harness::turn();
    check("tiny-qwen2");
}

#[test]
fn bad_prompts_are_refused() {
    let _turn = switchyard_harness::turn();
    let model = Model::load(&fixtures::llm("tiny-llama")).expect("load");
    assert_eq!(model.forward(&[]), Err(ForwardError::Empty));
    assert!(matches!(
        model.forward(&[1, 2, 288]),
        Err(ForwardError::TokenOutOfRange {
            id: 288,
            position: 2,
            ..
        })
    ));
    assert!(matches!(
        model.forward(&[1; 257]),
        Err(ForwardError::TooLong { tokens: 257, .. })
    ));
}

/// Copies a fixture into a temporary directory so that one file can be broken.
fn broken_copy(name: &str, change: impl FnOnce(&Path)) -> (tempfile::TempDir, Result<Model, LoadError>) {
    let dir = tempfile::tempdir().expect("tempdir");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixtures::llm(name).join(file), dir.path().join(file)).expect("copy");
    }
    change(dir.path());
    let result = Model::load(dir.path());
    (dir, result)
}

/// Replaces `from` by `to` in the `config.json` in `dir` (which must contain it).
fn edit_config(dir: &Path, from: &str, to: &str) {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).expect("read");
    assert!(text.contains(from), "config.json lacks {from}");
    std::fs::write(&path, text.replace(from, to)).expect("write");
}

#[test]
fn missing_and_inconsistent_files_are_named() {
    let _turn = switchyard_harness::turn();
    let (_dir, result) = broken_copy("tiny-llama", |dir| {
        std::fs::remove_file(dir.join("tokenizer.json")).expect("rm");
    });
    let err = result.expect_err("no tokenizer");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let (_dir, result) = broken_copy("tiny-llama", |dir| {
        std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
    });
    let err = result.expect_err("no weights");
    assert!(err.to_string().contains("safetensors"), "{err}");

    // A config that promises a wider MLP than the weights hold.
    let (_dir, result) = broken_copy("tiny-llama", |dir| {
        edit_config(dir, "\"intermediate_size\": 160", "\"intermediate_size\": 161");
    });
    let err = result.expect_err("shape mismatch");
    let message = err.to_string();
    assert!(matches!(err, LoadError::Weights { .. }), "{message}");
    assert!(
        message.contains("model.layers.0.mlp.gate_proj.weight") && message.contains("model.safetensors"),
        "{message}"
    );

    let (_dir, result) = broken_copy("tiny-llama", |dir| {
        edit_config(dir, "\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
    });
    let err = result.expect_err("bad heads");
    assert!(
        err.to_string().contains("config.json") && err.to_string().contains("num_key_value_heads"),
        "{err}"
    );
}
