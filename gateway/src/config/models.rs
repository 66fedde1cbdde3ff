//! `[[models]]`: how each model's prompts are tokenized and cut into KV blocks, its limits
//! and its latency targets.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Checked, Invalid};

/// `[[models]]`: how a model's prompts are tokenized and cut into KV blocks.
///
/// A model without an entry uses the byte-level fallback tokenizer, the default chat template,
/// and the block size of its embedded mockers (or of its first configured worker).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name requests use.
    pub name: String,
    /// Tokens per KV block; workers registering another size are reported and not indexed.
    #[serde(default = "super::default_block_size")]
    pub block_size: usize,
    /// A Hugging Face `tokenizer.json`; the byte-level fallback when absent.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// The chat template (see `switchyard_tokenize::ChatTemplate`).
    #[serde(default)]
    pub chat_template: Option<ChatTemplateConfig>,
    /// A LoRA adapter name that salts the model's block hashes.
    #[serde(default)]
    pub lora: Option<String>,
    /// The model's context length: prompt, media and answer together.
    #[serde(default = "default_max_model_len")]
    pub max_model_len: u32,
    /// Longest prompt accepted, in tokens (default: `max_model_len`; a model without a
    /// `[[models]]` entry has no limit but the body size). A longer one is answered 400; one
    /// whose text is over 64 bytes per allowed token is refused before it is even tokenized.
    #[serde(default)]
    pub max_prompt_tokens: Option<u32>,
    /// The model's time-to-first-token target in milliseconds, for requests that do not send
    /// `x-switchyard-ttft-ms`: what routers see and attainment is measured against.
    #[serde(default)]
    pub ttft_target_ms: Option<f32>,
    /// The model's inter-token latency target in milliseconds, for requests that do not send
    /// `x-switchyard-itl-ms`.
    #[serde(default)]
    pub itl_target_ms: Option<f32>,
    /// How the model turns media into tokens (`[models.media]`: patch size, merge factor,
    /// frame sampling, budgets; see `switchyard_media::ModelMedia`).
    #[serde(default)]
    pub media: switchyard_media::ModelMedia,
}

/// `[models.chat_template]`: `message` with `{role}` and `{content}`, then `generation_prompt`;
/// or `file`, the model's own Jinja template (its `tokenizer_config.json` or a `.jinja` file).
/// Workers must render prompts alike for block hashes to agree.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTemplateConfig {
    /// Written once per message.
    #[serde(default)]
    pub message: Option<String>,
    /// Written after the last message.
    #[serde(default)]
    pub generation_prompt: String,
    /// A Jinja chat template file (instead of `message`).
    #[serde(default)]
    pub file: Option<PathBuf>,
}

fn default_max_model_len() -> u32 {
    ModelConfig::DEFAULT_MAX_MODEL_LEN
}

impl ModelConfig {
    /// The context length of a model without `max_model_len`.
    pub const DEFAULT_MAX_MODEL_LEN: u32 = 32_768;
}

/// Checks every `[[models]]` entry: a name no other entry has, a block size and context, its
/// media settings, its tokenizer and chat template files, and its latency targets.
pub(super) fn check_models(models: &[ModelConfig]) -> Checked {
    let mut names = std::collections::HashSet::new();
    for (index, model) in models.iter().enumerate() {
        let key = |field: &str| format!("models[{index}].{field}");
        if model.name.is_empty() {
            return Err(Invalid::new(key("name"), "must not be empty"));
        }
        if !names.insert(model.name.as_str()) {
            return Err(Invalid::new(
                key("name"),
                format!("model `{}` is listed twice", model.name),
            ));
        }
        if model.block_size == 0 {
            return Err(Invalid::new(key("block_size"), "must be greater than 0"));
        }
        if model.max_model_len == 0 {
            return Err(Invalid::new(key("max_model_len"), "must be greater than 0"));
        }
        if let Err(err) = model.media.validate() {
            return Err(Invalid::new(key("media"), err.to_string()));
        }
        if let Some(path) = &model.tokenizer
            && !path.is_file()
        {
            return Err(Invalid::new(
                key("tokenizer"),
                format!("file `{}` does not exist", path.display()),
            ));
        }
        if let Some(template) = &model.chat_template {
            template
                .check()
                .map_err(|(field, reason)| Invalid::new(key(field), reason))?;
        }
        for (field, value) in [
            ("ttft_target_ms", model.ttft_target_ms),
            ("itl_target_ms", model.itl_target_ms),
        ] {
            if let Some(value) = value
                && !(value.is_finite() && value > 0.0)
            {
                return Err(Invalid::new(
                    key(field),
                    format!("{value}: a target is a positive number of milliseconds"),
                ));
            }
        }
    }
    Ok(())
}

impl ChatTemplateConfig {
    /// Refuses a template with both or neither of `message` and `file`, or a file that is no
    /// Jinja template; the error's key is relative to the model.
    fn check(&self) -> Result<(), (&'static str, String)> {
        match (&self.message, &self.file) {
            (Some(_), Some(_)) => Err(("chat_template", "give `message` or `file`, not both".into())),
            (None, None) => Err((
                "chat_template",
                "needs `message` (a pattern) or `file` (a Jinja template)".into(),
            )),
            (None, Some(path)) => switchyard_tokenize::JinjaTemplate::from_file(path)
                .map(drop)
                .map_err(|err| ("chat_template.file", err.to_string())),
            (Some(_), None) => Ok(()),
        }
    }
}
