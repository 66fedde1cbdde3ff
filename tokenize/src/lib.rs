//! Turning requests into token ids.
//!
//! This crate owns the prompt side of tokenization for gateways and workers alike: a model's
//! Hugging Face `tokenizer.json` (through the `tokenizers` crate) when one is configured, the
//! deterministic byte-level fallback otherwise (one token per UTF-8 byte, ids 0..=255), and the
//! chat template that renders a conversation to text first ([`ChatTemplate`]: a simple
//! per-message pattern, or the model's own Jinja template rendered by `minijinja` as
//! transformers renders it). The fallback and
//! the default template are stable across releases, so equal prompts give equal block hashes on
//! every gateway and worker; a gateway and its workers must be configured alike for their
//! hashes to agree.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

use std::path::Path;
use std::sync::Arc;

use switchyard_protocol::api::{ChatMessage, CompletionRequest, GenerateRequest, MEDIA_MARKER, MessageContent, Prompt};

/// Why a prompt could not be tokenized, or a tokenizer not loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The `tokenizer.json` could not be read or parsed.
    #[error("cannot load tokenizer `{path}`: {reason}")]
    Load {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The tokenizer failed on the text.
    #[error("cannot tokenize the prompt: {0}")]
    Encode(String),
    /// A chat template could not be loaded, or refused to render the conversation.
    #[error("chat template: {0}")]
    Template(String),
    /// The rendered prompt does not hold one media marker per media item (a template that
    /// drops or repeats message content).
    #[error("the chat template rendered {rendered} media parts where the request has {expected}")]
    MediaMismatch {
        /// Media items in the request.
        expected: usize,
        /// Markers in the rendered prompt.
        rendered: usize,
    },
}

/// One media item's place in a prompt: how many tokens it spends and the token id that
/// stands for each of them (the same for every token of the item, derived from its media id,
/// so equal media hash to equal KV blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSlot {
    /// The token id repeated over the item's span.
    pub token: u32,
    /// The item's tokens.
    pub tokens: u32,
}

/// A prompt with its media items in place: the merged token ids and each item's span.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MediaPrompt {
    /// Text tokens and media tokens in prompt order.
    pub tokens: Vec<u32>,
    /// Each media item's span `[start, end)` in `tokens`, in request order.
    pub spans: Vec<std::ops::Range<u32>>,
}

impl MediaPrompt {
    /// The same prompt with each media span refilled from `slots` (one per span, in order),
    /// so sizes found after tokenizing (a video's frames, fitted to the text's length) need no
    /// second tokenization. Spans past the end of `slots` are kept as they are.
    pub fn with_slots(&self, slots: &[MediaSlot]) -> MediaPrompt {
        let mut out = MediaPrompt::default();
        let mut at = 0usize;
        for (k, span) in self.spans.iter().enumerate() {
            let (start, end) = (span.start as usize, span.end as usize);
            out.tokens.extend_from_slice(&self.tokens[at..start]);
            let new_start = out.tokens.len() as u32;
            match slots.get(k) {
                Some(slot) => out.tokens.extend(std::iter::repeat_n(slot.token, slot.tokens as usize)),
                None => out.tokens.extend_from_slice(&self.tokens[start..end]),
            }
            out.spans.push(new_start..out.tokens.len() as u32);
            at = end;
        }
        out.tokens.extend_from_slice(&self.tokens[at..]);
        out
    }
}

/// The token id standing for every token of a media item with this 128-bit media id: the id
/// folded to 31 bits with the top bit set, above every vocabulary's ids, so a media span never
/// equals text.
pub fn media_token(media_id: u128) -> u32 {
    let folded = (media_id as u64) ^ ((media_id >> 64) as u64);
    0x8000_0000 | ((folded as u32) ^ ((folded >> 32) as u32)) & 0x7fff_ffff
}

/// A chat template: how a conversation becomes the prompt text.
///
/// `Simple` writes `message` once per message with `{role}` and `{content}` replaced (each
/// placeholder once, in one pass, so content that contains a placeholder is left as it is) and
/// appends `generation_prompt` so the model answers as the assistant. The default renders
/// `<|ROLE|>\nCONTENT\n` per message and ends with `<|assistant|>\n`. `Jinja` is a model's own
/// template ([`JinjaTemplate`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ChatTemplate {
    /// A per-message pattern.
    Simple {
        /// The per-message pattern, with `{role}` and `{content}`.
        message: String,
        /// Text after the last message.
        generation_prompt: String,
    },
    /// A Hugging Face (Jinja) chat template.
    Jinja(JinjaTemplate),
}

impl Default for ChatTemplate {
    fn default() -> ChatTemplate {
        ChatTemplate::Simple {
            message: "<|{role}|>\n{content}\n".into(),
            generation_prompt: "<|assistant|>\n".into(),
        }
    }
}

impl ChatTemplate {
    /// Renders a conversation.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Template`] when a Jinja template fails (for instance through its own
    /// `raise_exception`, refusing a conversation it does not accept); simple ones cannot fail.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        self.render_with(messages, MessageContent::text)
    }

    /// Renders a conversation with a [`MEDIA_MARKER`] where each media part is, in order.
    ///
    /// # Errors
    ///
    /// As [`render`](Self::render).
    pub fn render_with_media_markers(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        self.render_with(messages, MessageContent::text_with_media_markers)
    }

    fn render_with(&self, messages: &[ChatMessage], content: ContentText) -> Result<String, TokenizeError> {
        match self {
            ChatTemplate::Simple {
                message,
                generation_prompt,
            } => Ok(render_simple(message, generation_prompt, messages, content)),
            ChatTemplate::Jinja(template) => template.render_with(messages, content),
        }
    }
}

/// How a message's content becomes template text: text only, or with media markers.
type ContentText = fn(&MessageContent) -> String;

fn render_simple(pattern: &str, generation_prompt: &str, messages: &[ChatMessage], content: ContentText) -> String {
    let mut prompt = String::new();
    for message in messages {
        let content = message.content.as_ref().map(content).unwrap_or_default();
        let mut rest = pattern;
        while let Some(open) = rest.find('{') {
            prompt.push_str(&rest[..open]);
            let tail = &rest[open..];
            if let Some(after) = tail.strip_prefix("{role}") {
                prompt.push_str(&message.role);
                rest = after;
            } else if let Some(after) = tail.strip_prefix("{content}") {
                prompt.push_str(&content);
                rest = after;
            } else {
                prompt.push('{');
                rest = &tail[1..];
            }
        }
        prompt.push_str(rest);
    }
    prompt.push_str(generation_prompt);
    prompt
}

/// A model's Jinja chat template, rendered as transformers' `apply_chat_template` does:
/// `trim_blocks` and `lstrip_blocks` on, loop controls, Python string methods (`.strip()`,
/// `.startswith()`, ...), `raise_exception(message)`, and the variables `messages` (role and
/// text content of each), `add_generation_prompt` (true), `bos_token` and `eos_token`.
#[derive(Clone)]
pub struct JinjaTemplate {
    source: String,
    env: Arc<minijinja::Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for JinjaTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JinjaTemplate")
            .field("bytes", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl PartialEq for JinjaTemplate {
    fn eq(&self, other: &JinjaTemplate) -> bool {
        (&self.source, &self.bos_token, &self.eos_token) == (&other.source, &other.bos_token, &other.eos_token)
    }
}

const JINJA_NAME: &str = "chat_template";

/// Most template instructions one rendering may run. Real chat templates spend tens to
/// hundreds per message; this leaves room for conversations of tens of thousands of messages.
const TEMPLATE_FUEL: u64 = 5_000_000;

impl JinjaTemplate {
    /// Compiles `source` with the model's `bos_token` and `eos_token` texts.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Template`] with the line when the template does not parse.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<JinjaTemplate, TokenizeError> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|err| TokenizeError::Template(err.to_string()))?;
        env.set_syntax(syntax);
        // A template comes with a model file, from whoever published it; rendering runs per
        // request. Bound its work so that none can loop a request's thread for good.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(JINJA_NAME, source.to_string())
            .map_err(|err| TokenizeError::Template(format!("does not parse: {err:#}")))?;
        Ok(JinjaTemplate {
            source: source.to_string(),
            env: Arc::new(env),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Reads a template from a file: a model's `tokenizer_config.json` (its `chat_template`, the
    /// `default` one of a list, with its `bos_token` and `eos_token`) or a bare Jinja file.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Template`] naming the file when it cannot be read, holds no template,
    /// or the template does not parse.
    pub fn from_file(path: &Path) -> Result<JinjaTemplate, TokenizeError> {
        let named = |reason: String| TokenizeError::Template(format!("{}: {reason}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|err| named(err.to_string()))?;
        if path.extension().is_none_or(|ext| ext != "json") {
            return JinjaTemplate::new(&text, "", "").map_err(|err| named(err.to_string()));
        }
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|err| named(format!("not JSON: {err}")))?;
        let source = match &config["chat_template"] {
            serde_json::Value::String(source) => source.clone(),
            serde_json::Value::Array(templates) => templates
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .ok_or_else(|| named("`chat_template` lists no `default` template".into()))?
                .to_string(),
            _ => return Err(named("no `chat_template` key".into())),
        };
        let token = |key: &str| match &config[key] {
            serde_json::Value::String(text) => text.clone(),
            other => other["content"].as_str().unwrap_or_default().to_string(),
        };
        JinjaTemplate::new(&source, &token("bos_token"), &token("eos_token")).map_err(|err| named(err.to_string()))
    }

    /// Renders a conversation, ending with the prompt for the assistant's answer.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Template`] when the template fails on it.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        self.render_with(messages, MessageContent::text)
    }

    fn render_with(&self, messages: &[ChatMessage], content: ContentText) -> Result<String, TokenizeError> {
        let messages: minijinja::Value = messages
            .iter()
            .map(|message| {
                minijinja::Value::from_pairs([
                    ("role", minijinja::Value::from(message.role.as_str())),
                    (
                        "content",
                        minijinja::Value::from(message.content.as_ref().map(content).unwrap_or_default()),
                    ),
                ])
            })
            .collect();
        let template = self
            .env
            .get_template(JINJA_NAME)
            .map_err(|err| TokenizeError::Template(err.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|err| TokenizeError::Template(format!("{err:#}")))
    }
}

/// A tokenizer: a model's `tokenizer.json`, or the byte-level fallback.
#[derive(Debug, Clone, Default)]
pub enum Tokenizer {
    /// One token per UTF-8 byte.
    #[default]
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError::Load`] naming the file if it cannot be read or parsed.
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizeError> {
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Tokenizer::Hf(Box::new(t)))
            .map_err(|err| TokenizeError::Load {
                path: path.display().to_string(),
                reason: err.to_string(),
            })
    }

    /// Tokenizes `text`. Special tokens are not added: templates spell out what they need.
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError::Encode`] if the model tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Tokenizer::Bytes => Ok(byte_tokens(text)),
            Tokenizer::Hf(tokenizer) => tokenizer
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|err| TokenizeError::Encode(err.to_string())),
        }
    }
}

impl Tokenizer {
    /// Turns ids back into text (special tokens skipped); bytes that are not UTF-8 on their own
    /// become U+FFFD.
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError::Encode`] if the model tokenizer fails (an id it does not have).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&id| u8::try_from(id).unwrap_or(b'?')).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::Hf(tokenizer) => tokenizer
                .decode(ids, true)
                .map_err(|err| TokenizeError::Encode(err.to_string())),
        }
    }
}

/// Turns a stream of generated ids into text pieces as they arrive.
///
/// Decoding one id at a time is wrong for byte-level and SentencePiece vocabularies (a
/// character can span ids; a leading space depends on the id before). So each step decodes a
/// short window of recent ids with and without the new one and emits the difference, holding
/// it back while it ends in an incomplete character, as Hugging Face's text-generation-inference
/// does. The window restarts after every emitted piece, so each step costs a few ids.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// End of what has been emitted.
    read_offset: usize,
}

impl StreamDecoder {
    /// A decoder with no ids yet.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds `id` and returns the text it completes (possibly empty).
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError::Encode`] if the tokenizer cannot decode the ids.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizeError> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let after = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.is_char_boundary(before.len()) {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(after[before.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }

    /// The text still held back (an incomplete character at the end), as it is.
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError::Encode`] if the tokenizer cannot decode the ids.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String, TokenizeError> {
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let after = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(after.get(before.len()..).unwrap_or_default().to_string())
    }
}

/// A tokenizer with the chat template that goes with it.
#[derive(Debug, Clone, Default)]
pub struct PromptEncoder {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
}

impl PromptEncoder {
    /// The prompt token ids of a request; token-id prompts are taken as they are.
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError::Encode`] if the model tokenizer fails.
    pub fn prompt_tokens(&self, request: &GenerateRequest) -> Result<Vec<u32>, TokenizeError> {
        match request {
            GenerateRequest::Chat(chat) => self.tokenizer.encode(&self.template.render(&chat.messages)?),
            GenerateRequest::Completion(CompletionRequest { prompt, .. }) => match prompt {
                Prompt::Text(text) => self.tokenizer.encode(text),
                Prompt::Tokens(ids) => Ok(ids.clone()),
                // Batches are rejected at parse time; tokenizing the first keeps this total.
                Prompt::TextBatch(texts) => texts.first().map_or(Ok(Vec::new()), |t| self.tokenizer.encode(t)),
                Prompt::TokenBatch(batches) => Ok(batches.first().cloned().unwrap_or_default()),
            },
        }
    }
}

impl PromptEncoder {
    /// The prompt of a chat request with its media items in place: the conversation is
    /// rendered with one marker per media part, the text between markers is tokenized piece by
    /// piece, and each marker becomes `slots[k].tokens` copies of `slots[k].token`. Gateway
    /// and workers both build prompts this way, so their token ids and block hashes agree.
    ///
    /// # Errors
    ///
    /// As [`prompt_tokens`](Self::prompt_tokens), and [`TokenizeError::MediaMismatch`] when the
    /// template does not render exactly one marker per slot.
    pub fn prompt_with_media(
        &self,
        request: &GenerateRequest,
        slots: &[MediaSlot],
    ) -> Result<MediaPrompt, TokenizeError> {
        let GenerateRequest::Chat(chat) = request else {
            return Ok(MediaPrompt {
                tokens: self.prompt_tokens(request)?,
                spans: Vec::new(),
            });
        };
        let rendered = self.template.render_with_media_markers(&chat.messages)?;
        let pieces: Vec<&str> = rendered.split(MEDIA_MARKER).collect();
        if pieces.len() != slots.len() + 1 {
            return Err(TokenizeError::MediaMismatch {
                expected: slots.len(),
                rendered: pieces.len() - 1,
            });
        }
        let mut prompt = MediaPrompt::default();
        for (k, piece) in pieces.iter().enumerate() {
            if !piece.is_empty() {
                prompt.tokens.extend(self.tokenizer.encode(piece)?);
            }
            if let Some(slot) = slots.get(k) {
                let start = prompt.tokens.len() as u32;
                prompt
                    .tokens
                    .extend(std::iter::repeat_n(slot.token, slot.tokens as usize));
                prompt.spans.push(start..start + slot.tokens);
            }
        }
        Ok(prompt)
    }
}

/// Renders a conversation with the default chat template.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let (message, generation_prompt) = ("<|{role}|>\n{content}\n", "<|assistant|>\n");
    render_simple(message, generation_prompt, messages, MessageContent::text)
}

/// Tokenizes text with the byte-level fallback: each UTF-8 byte is one token.
pub fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The prompt token ids of a request under the fallback tokenizer and the default template;
/// token-id prompts are taken as they are.
pub fn prompt_tokens(request: &GenerateRequest) -> Vec<u32> {
    // The byte-level fallback cannot fail.
    PromptEncoder::default().prompt_tokens(request).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_protocol::api::MessageContent;

    #[test]
    fn chat_template_is_stable() {
        let messages = vec![
            ChatMessage {
                role: "system".into(),
                content: Some(MessageContent::Text("be brief".into())),
            },
            ChatMessage {
                role: "user".into(),
                content: Some(MessageContent::Text("hi".into())),
            },
        ];
        assert_eq!(
            render_chat(&messages),
            "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
        );
    }

    #[test]
    fn custom_templates_substitute_placeholders_once() {
        let template = ChatTemplate::Simple {
            message: "[{role}] {content} {x}|".into(),
            generation_prompt: "[assistant]".into(),
        };
        let messages = vec![ChatMessage {
            role: "user".into(),
            content: Some(MessageContent::Text("say {role}".into())),
        }];
        assert_eq!(
            template.render(&messages).expect("renders"),
            "[user] say {role} {x}|[assistant]"
        );
    }

    fn user(text: &str) -> ChatMessage {
        ChatMessage {
            role: "user".into(),
            content: Some(MessageContent::Text(text.into())),
        }
    }

    #[test]
    fn jinja_templates_render_as_transformers_does() {
        // ChatML as models ship it: trim_blocks and lstrip_blocks make the tags' lines vanish.
        let chatml = "{% for message in messages %}\n{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n{%- endfor %}\n{% if add_generation_prompt %}\n{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let jinja = ChatTemplate::Jinja(JinjaTemplate::new(chatml, "", "").expect("parses"));
        let simple = ChatTemplate::Simple {
            message: "<|im_start|>{role}\n{content}<|im_end|>\n".into(),
            generation_prompt: "<|im_start|>assistant\n".into(),
        };
        let messages = [user("hi"), user("and {content}?")];
        assert_eq!(
            jinja.render(&messages).expect("renders"),
            simple.render(&messages).expect("renders")
        );
    }

    #[test]
    fn tokenizer_configs_bring_their_tokens_python_methods_and_exceptions() {
        let dir = std::env::temp_dir().join(format!("switchyard-jinja-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("tokenizer_config.json");
        let template = "{{ bos_token }}{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('only users here') }}{% endif %}[{{ m['content'].strip() }}]{% if loop.last %}{% break %}{% endif %}{% endfor %}{{ eos_token }}";
        let config =
            serde_json::json!({"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"});
        std::fs::write(&path, config.to_string()).expect("write");
        let loaded = ChatTemplate::Jinja(JinjaTemplate::from_file(&path).expect("loads"));
        assert_eq!(loaded.render(&[user("  hello  ")]).expect("renders"), "<s>[hello]</s>");
        let refused = loaded
            .render(&[ChatMessage {
                role: "tool".into(),
                content: None,
            }])
            .expect_err("the template refuses tools");
        assert!(refused.to_string().contains("only users here"), "{refused}");
        std::fs::write(&path, r#"{"bos_token": "<s>"}"#).expect("write");
        let missing = JinjaTemplate::from_file(&path).expect_err("no template");
        assert!(missing.to_string().contains("tokenizer_config.json"), "{missing}");
        assert!(
            JinjaTemplate::new("{% for %}", "", "").is_err(),
            "a broken template is refused at load"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_template_that_would_run_for_hours_runs_out_of_fuel() {
        // 10^15 iterations; each range alone is within minijinja's limit of 100,000 items.
        let template = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}";
        let jinja = JinjaTemplate::new(template, "", "").expect("parses");
        let started = std::time::Instant::now();
        let err = jinja.render(&[user("hi")]).expect_err("runs out of fuel");
        assert!(err.to_string().contains("fuel"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(60));
    }

    /// A word-level `tokenizer.json` with a regex pre-tokenizer, written by hand.
    const WORD_LEVEL: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "!": 3, "<": 4, "|": 5, ">": 6},
                  "unk_token": "[UNK]"}
    }"#;

    #[test]
    fn hf_tokenizers_load_from_tokenizer_json() {
        let path = std::env::temp_dir().join(format!("switchyard-tokenizer-{}.json", std::process::id()));
        std::fs::write(&path, WORD_LEVEL).expect("writes");
        let tokenizer = Tokenizer::from_file(&path).expect("loads");
        assert_eq!(tokenizer.encode("Hello world !").expect("encodes"), vec![1, 2, 3]);
        assert_eq!(tokenizer.encode("hello mars").expect("encodes"), vec![1, 0]);
        std::fs::write(&path, "{not json").expect("writes");
        let err = Tokenizer::from_file(&path).expect_err("broken file");
        assert!(err.to_string().contains("switchyard-tokenizer"), "{err}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn streamed_decoding_waits_for_whole_characters() {
        let tokenizer = Tokenizer::Bytes;
        let mut decoder = StreamDecoder::new();
        let mut text = String::new();
        let mut pieces = 0;
        for id in byte_tokens("né à ✓") {
            let piece = decoder.push(&tokenizer, id).expect("decodes");
            assert!(!piece.contains('\u{FFFD}'), "half a character leaked: {piece:?}");
            pieces += usize::from(!piece.is_empty());
            text.push_str(&piece);
        }
        text.push_str(&decoder.flush(&tokenizer).expect("decodes"));
        assert_eq!(text, "né à ✓");
        assert_eq!(pieces, 6, "one piece per character");
        let mut cut = StreamDecoder::new();
        assert_eq!(cut.push(&tokenizer, 0xE2).expect("decodes"), "");
        assert_eq!(
            cut.flush(&tokenizer).expect("decodes"),
            "\u{FFFD}",
            "a dangling byte is flushed as it is"
        );
    }

    #[test]
    fn streamed_decoding_matches_whole_decoding_with_a_model_tokenizer() {
        let path = std::env::temp_dir().join(format!("switchyard-tokenizer-stream-{}.json", std::process::id()));
        std::fs::write(&path, WORD_LEVEL).expect("writes");
        let tokenizer = Tokenizer::from_file(&path).expect("loads");
        let _ = std::fs::remove_file(&path);
        let ids = [1, 2, 3, 1];
        let mut decoder = StreamDecoder::new();
        let streamed: String = ids
            .iter()
            .map(|&id| decoder.push(&tokenizer, id).expect("decodes"))
            .collect();
        assert_eq!(streamed, tokenizer.decode(&ids).expect("decodes"));
    }

    #[test]
    fn byte_tokens_are_utf8_bytes() {
        assert_eq!(byte_tokens("hé"), vec![104, 195, 169]);
    }

    #[test]
    fn media_items_take_their_spans_in_order() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look \ufffc"},{"type":"image_url","image_url":{"url":"data:,"}},{"type":"text","text":"and"},{"type":"input_audio","input_audio":{"data":"","format":"wav"}}]}]}"#;
        let request = switchyard_protocol::api::parse_generate_request(switchyard_protocol::api::Endpoint::Chat, body)
            .expect("valid request");
        let slots = [
            MediaSlot {
                token: media_token(7),
                tokens: 5,
            },
            MediaSlot {
                token: media_token(9),
                tokens: 3,
            },
        ];
        let encoder = PromptEncoder::default();
        let prompt = encoder.prompt_with_media(&request, &slots).expect("renders");
        assert_eq!(prompt.spans.len(), 2);
        // Independently: the text-only prompt is what remains once the spans are cut out, and
        // the merged length is the text length plus the media tokens.
        let GenerateRequest::Chat(chat) = &request else {
            unreachable!()
        };
        let text_only = encoder
            .template
            .render_with_media_markers(&chat.messages)
            .expect("renders")
            .replace(MEDIA_MARKER, "");
        let mut cut = prompt.tokens.clone();
        for (span, slot) in prompt.spans.iter().zip(&slots).rev() {
            assert_eq!(span.end - span.start, slot.tokens);
            assert!(
                cut[span.start as usize..span.end as usize]
                    .iter()
                    .all(|&t| t == slot.token)
            );
            cut.drain(span.start as usize..span.end as usize);
        }
        assert_eq!(cut, byte_tokens(&text_only));
        assert_eq!(prompt.tokens.len(), byte_tokens(&text_only).len() + 8);
        assert!(prompt.spans[0].end <= prompt.spans[1].start);
        assert!(media_token(7) >= 0x8000_0000 && media_token(7) != media_token(9));
        let refilled = prompt.with_slots(&[slots[0], MediaSlot { token: 1, tokens: 10 }]);
        assert_eq!(refilled.tokens.len(), prompt.tokens.len() + 7);
        assert_eq!(refilled.spans[0], prompt.spans[0]);
        assert_eq!(refilled.spans[1].end - refilled.spans[1].start, 10);
        assert_eq!(
            refilled.tokens[refilled.spans[1].end as usize..],
            prompt.tokens[prompt.spans[1].end as usize..]
        );
        let too_few = encoder.prompt_with_media(&request, &slots[..1]);
        assert!(matches!(
            too_few,
            Err(TokenizeError::MediaMismatch {
                expected: 1,
                rendered: 2
            })
        ));
    }
}
