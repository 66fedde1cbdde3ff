//! Chat-template rendering: conversations from clients through real models' templates
//! (ChatML, Llama 3, Mistral's with `raise_exception`), and templates from model files
//! (arbitrary Jinja) over arbitrary conversations. Nothing may panic or run unbounded; through
//! ChatML, every message's text must reach the prompt as sent.

#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use switchyard_protocol::api::{ChatMessage, MessageContent};
use switchyard_tokenize::{ChatTemplate, JinjaTemplate};

const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

fn models() -> &'static [ChatTemplate; 4] {
    static MODELS: OnceLock<[ChatTemplate; 4]> = OnceLock::new();
    MODELS.get_or_init(|| {
        let jinja =
            |source| ChatTemplate::Jinja(JinjaTemplate::new(source, "<s>", "</s>").expect("a real template parses"));
        [jinja(CHATML), jinja(LLAMA3), jinja(MISTRAL), ChatTemplate::default()]
    })
}

#[derive(Debug, Arbitrary)]
struct Input {
    /// A template from a model file, when present.
    template: Option<String>,
    which: u8,
    messages: Vec<(String, Option<String>)>,
}

fuzz_target!(|input: Input| {
    let messages: Vec<ChatMessage> = input
        .messages
        .iter()
        .map(|(role, content)| ChatMessage {
            role: role.clone(),
            content: content.clone().map(MessageContent::Text),
        })
        .collect();
    if let Some(source) = &input.template {
        if let Ok(template) = JinjaTemplate::new(source, "<s>", "</s>") {
            let _ = ChatTemplate::Jinja(template).render_with_media_markers(&messages);
        }
        return;
    }
    let which = usize::from(input.which) % models().len();
    let rendered = models()[which].render(&messages);
    if which == 0 {
        let prompt = rendered.expect("ChatML renders every conversation");
        for (_, content) in &input.messages {
            assert!(
                prompt.contains(content.as_deref().unwrap_or("")),
                "a message was altered"
            );
        }
    }
});
