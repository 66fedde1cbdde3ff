//! GGUF loading against the safetensors path: the tiny Llama fixture is written as a GGUF file
//! the way llama.cpp's converter writes one (reversed dimensions, query/key rows permuted for
//! its RoPE, the tokenizer as `tokenizer.ggml.*` arrays), and must give the same logits and the
//! same token ids; quantized tensors load within their rounding; broken files are named.

use std::io::Write;
use std::path::Path;

use switchyard_harness::fixtures::{self, max_difference};
use switchyard_llm::weights::Weights;
use switchyard_llm::{Model, ModelConfig};
use switchyard_tokenize::Tokenizer;

/// The fixture with plain RoPE (GGUF files carry no Llama 3 scaling parameters).
fn plain_rope_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["model.safetensors", "tokenizer.json", "config.json"] {
        std::fs::copy(fixtures::llm("tiny-llama").join(name), dir.path().join(name)).expect("copy");
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    config["rope_parameters"] = serde_json::json!({"rope_theta": 50000.0, "rope_type": "default"});
    std::fs::write(&path, config.to_string()).expect("write");
    dir
}

/// GGUF metadata values this writer needs.
enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// How a tensor is stored.
#[derive(Clone, Copy, PartialEq)]
enum Store {
    F32,
    Q8_0,
    Q4_1,
}

struct GgufWriter {
    metadata: Vec<(String, Meta)>,
    tensors: Vec<(String, Vec<usize>, Store, Vec<f32>)>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in values.chunks(32) {
        let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = max / 127.0;
        out.extend(half::f16::from_f32(d).to_le_bytes());
        let d = half::f16::from_f32(d).to_f32();
        out.extend(
            block
                .iter()
                .map(|v| if d == 0.0 { 0 } else { (v / d).round() as i8 as u8 }),
        );
    }
    out
}

/// GGML's Q4_1 quantizer: per 32 values an f16 scale and minimum, 4-bit steps between them.
fn q4_1(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in values.chunks(32) {
        let min = block.iter().copied().fold(f32::INFINITY, f32::min);
        let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(half::f16::from_f32(min).to_le_bytes());
        let q = |v: f32| (((v - min) * inverse + 0.5) as u8).min(15);
        out.extend((0..16).map(|i| q(block[i]) | (q(block[i + 16]) << 4)));
    }
    out
}

impl GgufWriter {
    fn write(&self, path: &Path) {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            string(&mut out, key);
            match value {
                Meta::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::Str(v) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, v);
                }
                Meta::Strs(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    for item in items {
                        string(&mut out, item);
                    }
                }
                Meta::I32s(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    for item in items {
                        out.extend(item.to_le_bytes());
                    }
                }
            }
        }
        let mut data = Vec::new();
        for (name, shape, store, values) in &self.tensors {
            string(&mut out, name);
            out.extend((shape.len() as u32).to_le_bytes());
            for dim in shape.iter().rev() {
                out.extend((*dim as u64).to_le_bytes());
            }
            let kind: u32 = match store {
                Store::F32 => 0,
                Store::Q4_1 => 3,
                Store::Q8_0 => 8,
            };
            out.extend(kind.to_le_bytes());
            out.extend((data.len() as u64).to_le_bytes());
            match store {
                Store::F32 => data.extend(values.iter().flat_map(|v| v.to_le_bytes())),
                Store::Q8_0 => data.extend(q8_0(values)),
                Store::Q4_1 => data.extend(q4_1(values)),
            }
            while !data.len().is_multiple_of(32) {
                data.push(0);
            }
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(data);
        std::fs::File::create(path)
            .and_then(|mut file| file.write_all(&out))
            .expect("write gguf");
    }
}

/// llama.cpp's converter permutation of a query/key projection.
fn permute(values: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let head_dim = rows / heads;
    let mut out = vec![0.0; values.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..head_dim / 2 {
                let from = h * head_dim + j * head_dim / 2 + i;
                let to = h * head_dim + 2 * i + j;
                out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// Writes `dir`'s model as a GGUF file, the linear layers stored as `linear`.
fn convert(dir: &Path, out: &Path, linear: Store) {
    let config = ModelConfig::from_file(&dir.join("config.json")).expect("config");
    let weights = Weights::open(dir).expect("weights");
    let tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).expect("read")).expect("json");
    let vocab = tokenizer["model"]["vocab"].as_object().expect("vocab");
    let mut tokens = vec![String::new(); vocab.len()];
    for (token, id) in vocab {
        tokens[id.as_u64().expect("id") as usize] = token.clone();
    }
    let merges: Vec<String> = tokenizer["model"]["merges"]
        .as_array()
        .expect("merges")
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            pair => format!("{} {}", pair[0].as_str().expect("a"), pair[1].as_str().expect("b")),
        })
        .collect();
    let c = &config;
    let mut writer = GgufWriter {
        metadata: vec![
            ("general.architecture".into(), Meta::Str("llama".into())),
            ("llama.block_count".into(), Meta::U32(c.num_layers as u32)),
            ("llama.embedding_length".into(), Meta::U32(c.hidden_size as u32)),
            (
                "llama.feed_forward_length".into(),
                Meta::U32(c.intermediate_size as u32),
            ),
            ("llama.attention.head_count".into(), Meta::U32(c.num_heads as u32)),
            ("llama.attention.head_count_kv".into(), Meta::U32(c.num_kv_heads as u32)),
            (
                "llama.context_length".into(),
                Meta::U32(c.max_position_embeddings as u32),
            ),
            ("llama.rope.freq_base".into(), Meta::F32(c.rope_theta as f32)),
            (
                "llama.attention.layer_norm_rms_epsilon".into(),
                Meta::F32(c.rms_norm_eps),
            ),
            ("tokenizer.ggml.model".into(), Meta::Str("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Meta::Str("default".into())),
            ("tokenizer.ggml.tokens".into(), Meta::Strs(tokens.clone())),
            ("tokenizer.ggml.token_type".into(), Meta::I32s(vec![1; tokens.len()])),
            ("tokenizer.ggml.merges".into(), Meta::Strs(merges)),
            ("tokenizer.ggml.eos_token_id".into(), Meta::U32(c.eos_token_ids[0])),
        ],
        tensors: Vec::new(),
    };
    let h = c.hidden_size;
    let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut add = |gguf: &str, hf: &str, shape: Vec<usize>, store: Store, permute_heads: Option<usize>| {
        let mut values = weights.f32(hf, &shape).expect("tensor");
        if let Some(heads) = permute_heads {
            values = permute(&values, heads, shape[0], shape[1]);
        }
        writer.tensors.push((gguf.to_string(), shape, store, values));
    };
    add(
        "token_embd.weight",
        "model.embed_tokens.weight",
        vec![c.vocab_size, h],
        Store::F32,
        None,
    );
    add("output_norm.weight", "model.norm.weight", vec![h], Store::F32, None);
    add("output.weight", "lm_head.weight", vec![c.vocab_size, h], linear, None);
    for layer in 0..c.num_layers {
        let hf = |part: &str| format!("model.layers.{layer}.{part}.weight");
        let gg = |part: &str| format!("blk.{layer}.{part}.weight");
        add(&gg("attn_norm"), &hf("input_layernorm"), vec![h], Store::F32, None);
        add(
            &gg("ffn_norm"),
            &hf("post_attention_layernorm"),
            vec![h],
            Store::F32,
            None,
        );
        add(
            &gg("attn_q"),
            &hf("self_attn.q_proj"),
            vec![q_dim, h],
            linear,
            Some(c.num_heads),
        );
        add(
            &gg("attn_k"),
            &hf("self_attn.k_proj"),
            vec![kv_dim, h],
            linear,
            Some(c.num_kv_heads),
        );
        add(&gg("attn_v"), &hf("self_attn.v_proj"), vec![kv_dim, h], linear, None);
        add(
            &gg("attn_output"),
            &hf("self_attn.o_proj"),
            vec![h, q_dim],
            linear,
            None,
        );
        add(
            &gg("ffn_gate"),
            &hf("mlp.gate_proj"),
            vec![c.intermediate_size, h],
            linear,
            None,
        );
        add(
            &gg("ffn_up"),
            &hf("mlp.up_proj"),
            vec![c.intermediate_size, h],
            linear,
            None,
        );
        add(
            &gg("ffn_down"),
            &hf("mlp.down_proj"),
            vec![h, c.intermediate_size],
            linear,
            None,
        );
    }
    writer.write(out);
}

const PROMPT: [u32; 12] = [5, 17, 42, 99, 7, 256, 3, 64, 200, 11, 140, 12];

#[test]
fn a_converted_gguf_gives_the_safetensors_logits_and_tokens() {
    let _turn = switchyard_harness::turn();
    let dir = plain_rope_copy();
    let gguf = dir.path().join("tiny.gguf");
    convert(dir.path(), &gguf, Store::F32);
    let (reference, hf_tokenizer) = Model::load_with_tokenizer(dir.path()).expect("safetensors loads");
    let (model, gguf_tokenizer) = Model::load_with_tokenizer(&gguf).expect("gguf loads");
    assert_eq!(model.config().num_kv_heads, 2);
    let expected = reference.forward(&PROMPT).expect("forward");
    let got = model.forward(&PROMPT).expect("forward");
    let difference = max_difference(&got, &expected);
    assert!(
        difference == 0.0,
        "f32 GGUF must be bit-identical, max |Δ| {difference}"
    );
    assert!(matches!(gguf_tokenizer, Tokenizer::Hf(_)));
    for text in [
        "hello world",
        "The switchyard routes 42 tokens!",
        "  spaces\tand\nlines",
    ] {
        assert_eq!(
            gguf_tokenizer.encode(text).expect("encodes"),
            hf_tokenizer.encode(text).expect("encodes"),
            "{text:?}"
        );
    }
}

#[test]
fn q8_0_weights_load_within_their_rounding() {
    let _turn = switchyard_harness::turn();
    let dir = plain_rope_copy();
    let gguf = dir.path().join("tiny-q8.gguf");
    convert(dir.path(), &gguf, Store::Q8_0);
    let reference = Model::load(dir.path()).expect("safetensors loads");
    let model = Model::load(&gguf).expect("gguf loads");
    let expected = reference.forward(&PROMPT).expect("forward");
    let got = model.forward(&PROMPT).expect("forward");
    let difference = max_difference(&got, &expected);
    let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(difference > 0.0, "8-bit weights cannot be exact");
    assert!(
        difference < 0.05 * scale,
        "max |Δ| {difference} against logits up to {scale}"
    );
}

#[test]
fn quantized_weights_stay_quantized_and_multiply_within_a_stated_tolerance() {
    let _turn = switchyard_harness::turn();
    // The quantized path (activations quantized per block to 16 bits, integer block dot
    // products; from 16 rows on, widened tiles and `gemm`) against the same blocks widened to
    // f32 at load. Stated tolerance: 1e-3 of the largest logit (measured ~6e-5 through the
    // block kernels, 0 through the tiles).
    for (store, name) in [(Store::Q8_0, "q8_0"), (Store::Q4_1, "q4_1")] {
        let dir = plain_rope_copy();
        let gguf = dir.path().join(format!("tiny-{name}.gguf"));
        convert(dir.path(), &gguf, store);
        let model = Model::load(&gguf).expect("gguf loads");
        let widened = model.widened();
        assert!(
            model.weight_bytes() < widened.weight_bytes(),
            "{name}: {} bytes kept, {} widened",
            model.weight_bytes(),
            widened.weight_bytes()
        );
        // 12 rows go through the block kernels, 40 through widened tiles and `gemm`.
        let long: Vec<u32> = (0..40).map(|i| PROMPT[i % PROMPT.len()] + i as u32).collect();
        for prompt in [&PROMPT[..], &long] {
            let expected = widened.forward(prompt).expect("forward");
            let got = model.forward(prompt).expect("forward");
            let difference = max_difference(&got, &expected);
            let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            eprintln!(
                "{name}, {} tokens: max |Δ| {difference} against logits up to {scale}",
                prompt.len()
            );
            assert!(
                difference <= 1e-3 * scale,
                "{name}, {} tokens: max |Δ| {difference} against logits up to {scale}",
                prompt.len()
            );
        }
    }
}

#[test]
fn broken_gguf_files_are_named() {
    let _turn = switchyard_harness::turn();
    let dir = plain_rope_copy();
    let gguf = dir.path().join("tiny.gguf");
    convert(dir.path(), &gguf, Store::F32);
    let bytes = std::fs::read(&gguf).expect("read");
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..200]).expect("write");
    let err = Model::load(&truncated).expect_err("truncated");
    assert!(err.to_string().contains("truncated.gguf"), "{err}");
    let not_gguf = dir.path().join("not.gguf");
    std::fs::write(&not_gguf, b"GGML and more bytes").expect("write");
    let err = Model::load(&not_gguf).expect_err("bad magic");
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
}
