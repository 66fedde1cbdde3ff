//! Helpers the LLM benches share: random-weight models written as real safetensors, and the
//! bytes a decode step must read.

#![allow(dead_code)]

use std::path::Path;

use switchyard_llm::ModelConfig;

/// A seeded xorshift stream for random weights (bench data, not a statistics source).
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    }
}

/// Writes a random-weight Llama (f32 safetensors, config.json, tokenizer.json) to `dir`.
pub fn write_random_llama(
    dir: &Path,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: usize,
) {
    let head_dim = hidden / heads;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
        ("lm_head.weight".into(), vec![vocab, hidden]),
    ];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        shapes.extend([
            (format!("{p}.input_layernorm.weight"), vec![hidden]),
            (format!("{p}.post_attention_layernorm.weight"), vec![hidden]),
            (format!("{p}.self_attn.q_proj.weight"), vec![heads * head_dim, hidden]),
            (
                format!("{p}.self_attn.k_proj.weight"),
                vec![kv_heads * head_dim, hidden],
            ),
            (
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv_heads * head_dim, hidden],
            ),
            (format!("{p}.self_attn.o_proj.weight"), vec![hidden, heads * head_dim]),
            (format!("{p}.mlp.gate_proj.weight"), vec![intermediate, hidden]),
            (format!("{p}.mlp.up_proj.weight"), vec![intermediate, hidden]),
            (format!("{p}.mlp.down_proj.weight"), vec![hidden, intermediate]),
        ]);
    }
    let mut noise = Noise(0x9E37_79B9_7F4A_7C15);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let count: usize = shape.iter().product();
            let is_norm = name.ends_with("norm.weight");
            let bytes = (0..count)
                .flat_map(|_| (if is_norm { 1.0 } else { noise.next() }).to_le_bytes())
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, shape, bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).expect("view");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write weights");
    let config = format!(
        r#"{{"model_type": "llama", "hidden_size": {hidden}, "intermediate_size": {intermediate},
            "num_hidden_layers": {layers}, "num_attention_heads": {heads}, "num_key_value_heads": {kv_heads},
            "vocab_size": {vocab}, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}}"#
    );
    std::fs::write(dir.join("config.json"), config).expect("write config");
    // `SWITCHYARD_FIXTURES_DIR` where the bench runs away from its source tree.
    let fixtures = std::env::var_os("SWITCHYARD_FIXTURES_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    let fixture = fixtures.join("tiny-llama/tokenizer.json");
    std::fs::copy(fixture, dir.join("tokenizer.json")).expect("copy tokenizer");
}

/// Bytes of f32 weights one decode step reads: every layer, the final norm and the LM head
/// (the embedding table itself when tied; only a row per token of an untied one).
pub fn decode_bytes(c: &ModelConfig) -> f64 {
    let (h, q, kv, i) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    );
    let bias = if c.attention_bias { q + 2 * kv } else { 0 };
    let layer = 2 * h + q * h + 2 * kv * h + h * q + 3 * i * h + bias;
    (4 * (c.num_layers * layer + h + c.vocab_size * h)) as f64
}
