//! Random-weight models of real shapes, written as real safetensors, for the encoder benches.

use std::path::Path;

/// A seeded xorshift stream for random weights and inputs (bench data only).
pub struct Noise(pub u64);

impl Noise {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    }
}

fn write_safetensors(dir: &Path, shapes: Vec<(String, Vec<usize>)>) {
    let mut noise = Noise(0x9E37_79B9_7F4A_7C15);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let count: usize = shape.iter().product();
            let bytes = (0..count).flat_map(|_| noise.next().to_le_bytes()).collect();
            (name, shape, bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .expect("tensor view");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write safetensors");
}

fn block_shapes(prefix: &str, width: usize, ffn: usize, k_bias: bool, names: [&str; 4]) -> Vec<(String, Vec<usize>)> {
    let [norm1, norm2, fc1, fc2] = names;
    let mut shapes = Vec::new();
    for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
        shapes.push((format!("{prefix}.self_attn.{proj}.weight"), vec![width, width]));
        if proj != "k_proj" || k_bias {
            shapes.push((format!("{prefix}.self_attn.{proj}.bias"), vec![width]));
        }
    }
    for norm in [norm1, norm2] {
        shapes.push((format!("{prefix}.{norm}.weight"), vec![width]));
        shapes.push((format!("{prefix}.{norm}.bias"), vec![width]));
    }
    shapes.push((format!("{prefix}.{fc1}.weight"), vec![ffn, width]));
    shapes.push((format!("{prefix}.{fc1}.bias"), vec![ffn]));
    shapes.push((format!("{prefix}.{fc2}.weight"), vec![width, ffn]));
    shapes.push((format!("{prefix}.{fc2}.bias"), vec![width]));
    shapes
}

/// A LLaVA-style CLIP ViT-B/32 at 224 px (12 layers, width 768, 50 tokens per image) with a
/// projector to 2048, random weights.
pub fn write_clip_llava(dir: &Path) {
    let (width, layers, ffn, patch, text) = (768, 12, 3072, 32, 2048);
    let config = serde_json::json!({
        "model_type": "llava",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": width, "intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": 12, "image_size": 224, "patch_size": patch,
            "hidden_act": "quick_gelu"},
        "text_config": {"model_type": "llama", "hidden_size": text},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let tower = "vision_tower.vision_model";
    let mut shapes = vec![
        (
            format!("{tower}.embeddings.patch_embedding.weight"),
            vec![width, 3, patch, patch],
        ),
        (format!("{tower}.embeddings.class_embedding"), vec![width]),
        (format!("{tower}.embeddings.position_embedding.weight"), vec![50, width]),
    ];
    for norm in ["pre_layrnorm", "post_layernorm"] {
        shapes.push((format!("{tower}.{norm}.weight"), vec![width]));
        shapes.push((format!("{tower}.{norm}.bias"), vec![width]));
    }
    for i in 0..layers {
        shapes.extend(block_shapes(
            &format!("{tower}.encoder.layers.{i}"),
            width,
            ffn,
            true,
            ["layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"],
        ));
    }
    shapes.push(("multi_modal_projector.linear_1.weight".into(), vec![text, width]));
    shapes.push(("multi_modal_projector.linear_1.bias".into(), vec![text]));
    shapes.push(("multi_modal_projector.linear_2.weight".into(), vec![text, text]));
    shapes.push(("multi_modal_projector.linear_2.bias".into(), vec![text]));
    write_safetensors(dir, shapes);
}

/// A Whisper tiny encoder (4 layers, width 384, 30 s windows), random weights.
pub fn write_whisper_tiny(dir: &Path) {
    let (width, layers, ffn, mels) = (384, 4, 1536, 80);
    let config = serde_json::json!({
        "model_type": "whisper", "d_model": width, "encoder_layers": layers, "encoder_attention_heads": 6,
        "encoder_ffn_dim": ffn, "num_mel_bins": mels, "max_source_positions": 1500,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let mut shapes = vec![
        ("model.encoder.conv1.weight".into(), vec![width, mels, 3]),
        ("model.encoder.conv1.bias".into(), vec![width]),
        ("model.encoder.conv2.weight".into(), vec![width, width, 3]),
        ("model.encoder.conv2.bias".into(), vec![width]),
        ("model.encoder.embed_positions.weight".into(), vec![1500, width]),
        ("model.encoder.layer_norm.weight".into(), vec![width]),
        ("model.encoder.layer_norm.bias".into(), vec![width]),
    ];
    for i in 0..layers {
        shapes.extend(block_shapes(
            &format!("model.encoder.layers.{i}"),
            width,
            ffn,
            false,
            ["self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"],
        ));
    }
    write_safetensors(dir, shapes);
}
