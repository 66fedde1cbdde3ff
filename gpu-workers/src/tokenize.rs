//! Turning requests into token ids when no model tokenizer is configured.
//!
//! This module owns the deterministic byte-level fallback tokenizer (one token per UTF-8 byte,
//! ids 0..=255) and the plain chat template that renders a conversation to text before
//! tokenizing. Both are stable across releases so that equal prompts give equal block hashes on
//! every gateway and worker. Model tokenizers (`tokenizer.json`) are a separate concern.

use crate::api::{ChatMessage, CompletionRequest, GenerateRequest, Prompt};

/// Renders a conversation with the fallback chat template.
///
/// Each message becomes `<|ROLE|>\nCONTENT\n`, and the prompt ends with `<|assistant|>\n` so
/// the model answers as the assistant.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut prompt = String::new();
    for message in messages {
        prompt.push_str("<|");
        prompt.push_str(&message.role);
        prompt.push_str("|>\n");
        if let Some(content) = &message.content {
            prompt.push_str(&content.text());
        }
        prompt.push('\n');
    }
    prompt.push_str("<|assistant|>\n");
    prompt
}

/// Tokenizes text with the byte-level fallback: each UTF-8 byte is one token.
pub fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The prompt token ids of a request under the fallback tokenizer; token-id prompts are taken
/// as they are.
pub fn prompt_tokens(request: &GenerateRequest) -> Vec<u32> {
    match request {
        GenerateRequest::Chat(chat) => byte_tokens(&render_chat(&chat.messages)),
        GenerateRequest::Completion(CompletionRequest { prompt, .. }) => match prompt {
            Prompt::Text(text) => byte_tokens(text),
            Prompt::Tokens(ids) => ids.clone(),
            // Batches are rejected at parse time; tokenizing the first keeps this total.
            Prompt::TextBatch(texts) => texts.first().map(|t| byte_tokens(t)).unwrap_or_default(),
            Prompt::TokenBatch(batches) => batches.first().cloned().unwrap_or_default(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::MessageContent;

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
    fn byte_tokens_are_utf8_bytes() {
        assert_eq!(byte_tokens("hé"), vec![104, 195, 169]);
    }
}
