//! Turning one JSONL line into token ids and a loss mask.
//!
//! Three line formats are accepted:
//! - pre-tokenized `{"input_ids": [...], "loss_mask": [...]}` (`loss_mask`
//!   optional, all ones when absent);
//! - OpenAI-style `{"messages": [{"role": .., "content": ..}, ..]}`;
//! - ShareGPT-style `{"conversations": [{"from": .., "value": ..}, ..]}`.
//!
//! Text conversations are rendered with the model's own chat template (the
//! `chat_template.jinja` file, else the `chat_template` key of
//! `tokenizer_config.json`, as transformers does) and tokenized with its
//! `tokenizer.json` exactly like `apply_chat_template(tokenize=True)`: no
//! extra special tokens, since the template already writes them. The loss
//! mask covers the tokens of assistant replies and the end-of-turn token
//! that closes each, so the drafter learns to stop; everything else (system,
//! user, role headers) is context only.

use serde_json::Value;
use std::path::{Path, PathBuf};

/// One problem with one line, reported with its line number by the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("expected a JSON object with \"input_ids\", \"messages\" or \"conversations\"")]
    UnknownFormat,
    #[error("{0}")]
    Invalid(String),
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
    #[error("text conversation, but no tokenizer.json was found in {0}")]
    NoTokenizer(PathBuf),
    #[error("no tokens")]
    Empty,
}

/// Problems with the tokenizer or template files themselves (fatal).
#[derive(Debug, thiserror::Error)]
pub enum EncoderError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: invalid chat template: {message}")]
    Template { path: PathBuf, message: String },
}

/// A chat message as the template sees it. Extra keys of the original
/// message (tool calls, names) are kept in `raw` for the template.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    raw: Value,
}

/// A parsed line.
#[derive(Debug, Clone, PartialEq)]
pub enum Conversation {
    PreTokenized {
        input_ids: Vec<i64>,
        loss_mask: Vec<u8>,
    },
    Messages(Vec<ChatMessage>),
}

/// One data record tokenized: token ids and their loss mask (1 = the drafter
/// is trained on it). In the target-server it is numbered
/// (`batching::NumberedSequence`), then computed into a `compute::ReadyItem` (the `proto::Item` sent as is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedSequence {
    pub input_ids: Vec<i64>,
    pub loss_mask: Vec<u8>,
    /// Whether the sequence was cut to `--max-length`.
    pub truncated: bool,
}

/// Parses one JSONL line.
pub fn parse_line(line: &str) -> Result<Conversation, LineError> {
    let value: Value =
        serde_json::from_str(line).map_err(|error| LineError::Json(error.to_string()))?;
    let Value::Object(object) = &value else {
        return Err(LineError::UnknownFormat);
    };
    if let Some(input_ids) = object.get("input_ids") {
        return parse_pre_tokenized(input_ids, object.get("loss_mask"));
    }
    if let Some(messages) = object.get("messages") {
        return parse_messages(messages, "messages", "role", "content", |role| {
            Some(role.to_string())
        });
    }
    if let Some(conversations) = object.get("conversations") {
        return parse_messages(
            conversations,
            "conversations",
            "from",
            "value",
            sharegpt_role,
        );
    }
    Err(LineError::UnknownFormat)
}

fn parse_pre_tokenized(
    input_ids: &Value,
    loss_mask: Option<&Value>,
) -> Result<Conversation, LineError> {
    let ids = input_ids
        .as_array()
        .ok_or_else(|| LineError::Invalid("\"input_ids\" must be an array".into()))?
        .iter()
        .enumerate()
        .map(|(position, id)| {
            id.as_i64().filter(|&id| id >= 0).ok_or_else(|| {
                LineError::Invalid(format!("input_ids[{position}] = {id} is not a token id"))
            })
        })
        .collect::<Result<Vec<i64>, LineError>>()?;
    let mask = match loss_mask {
        None | Some(Value::Null) => vec![1u8; ids.len()],
        Some(mask) => mask
            .as_array()
            .ok_or_else(|| LineError::Invalid("\"loss_mask\" must be an array".into()))?
            .iter()
            .enumerate()
            .map(|(position, flag)| match flag {
                Value::Bool(flag) => Ok(u8::from(*flag)),
                Value::Number(number)
                    if number.as_u64() == Some(0) || number.as_u64() == Some(1) =>
                {
                    Ok(number.as_u64().map_or(0, |value| value as u8))
                }
                other => Err(LineError::Invalid(format!(
                    "loss_mask[{position}] = {other} is not 0 or 1"
                ))),
            })
            .collect::<Result<Vec<u8>, LineError>>()?,
    };
    if mask.len() != ids.len() {
        return Err(LineError::Invalid(format!(
            "loss_mask has {} entries, input_ids {}",
            mask.len(),
            ids.len()
        )));
    }
    Ok(Conversation::PreTokenized {
        input_ids: ids,
        loss_mask: mask,
    })
}

/// ShareGPT speaker names → chat roles.
fn sharegpt_role(speaker: &str) -> Option<String> {
    let role = match speaker {
        "human" | "user" => "user",
        "gpt" | "assistant" | "chatgpt" | "bard" | "bing" | "model" => "assistant",
        "system" => "system",
        "tool" | "function" | "observation" | "function_response" => "tool",
        _ => return None,
    };
    Some(role.to_string())
}

/// Message content as text: a string, null, or a list of `{"type": "text",
/// "text": ..}` parts (the OpenAI multi-part form).
fn content_text(content: &Value) -> Option<String> {
    match content {
        Value::String(text) => Some(text.clone()),
        Value::Null => Some(String::new()),
        Value::Array(parts) => parts
            .iter()
            .map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Option<Vec<&str>>>()
            .map(|texts| texts.concat()),
        _ => None,
    }
}

fn parse_messages(
    list: &Value,
    list_key: &str,
    role_key: &str,
    content_key: &str,
    map_role: impl Fn(&str) -> Option<String>,
) -> Result<Conversation, LineError> {
    let entries = list
        .as_array()
        .ok_or_else(|| LineError::Invalid(format!("{list_key:?} must be an array")))?;
    if entries.is_empty() {
        return Err(LineError::Invalid(format!("{list_key:?} is empty")));
    }
    let mut messages = Vec::with_capacity(entries.len());
    for (position, entry) in entries.iter().enumerate() {
        let speaker = entry.get(role_key).and_then(Value::as_str).ok_or_else(|| {
            LineError::Invalid(format!("{list_key}[{position}] has no string {role_key:?}"))
        })?;
        let role = map_role(speaker).ok_or_else(|| {
            LineError::Invalid(format!(
                "{list_key}[{position}]: unknown {role_key} {speaker:?}"
            ))
        })?;
        let content = entry
            .get(content_key)
            .and_then(content_text)
            .ok_or_else(|| {
                LineError::Invalid(format!(
                    "{list_key}[{position}] has no text {content_key:?}"
                ))
            })?;
        let mut raw = match entry {
            Value::Object(object) => object.clone(),
            _ => serde_json::Map::new(),
        };
        raw.remove(role_key);
        raw.remove(content_key);
        raw.insert("role".into(), Value::String(role.clone()));
        raw.insert("content".into(), Value::String(content.clone()));
        messages.push(ChatMessage {
            role,
            content,
            raw: Value::Object(raw),
        });
    }
    Ok(Conversation::Messages(messages))
}

/// Markers that close a turn in common templates (ChatML, Llama 3, Phi,
/// Llama 2); extended by the tokenizer's own eos token.
const END_OF_TURN_MARKERS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "</s>",
    "<|endoftext|>",
];

/// Renders and tokenizes conversations for one model.
pub struct ChatEncoder {
    /// `None` when the model directory has no tokenizer.json: pre-tokenized
    /// data still works, text lines fail with a clear reason.
    tokenizer: Option<tokenizers::Tokenizer>,
    template: Option<minijinja::Environment<'static>>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Where the tokenizer was looked for (for messages).
    directory: PathBuf,
    max_length: usize,
    /// Token ids at or above this are rejected (the model's vocabulary).
    vocab_size: Option<i64>,
}

impl std::fmt::Debug for ChatEncoder {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ChatEncoder")
            .field("directory", &self.directory)
            .field("has_tokenizer", &self.tokenizer.is_some())
            .field("has_template", &self.template.is_some())
            .field("max_length", &self.max_length)
            .finish_non_exhaustive()
    }
}

/// A special-token entry of tokenizer_config.json: a string or an
/// `{"content": ..}` object.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(text) => Some(text.clone()),
        Value::Object(object) => object
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

fn read_json_file(path: &Path) -> Result<Option<Value>, EncoderError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|error| EncoderError::File {
        path: path.to_path_buf(),
        message: error.to_string(),
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|error| EncoderError::File {
            path: path.to_path_buf(),
            message: format!("invalid JSON: {error}"),
        })
}

impl ChatEncoder {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and the chat template
    /// from `directory`; any of them may be absent (see the field docs), but
    /// a present file that is broken is an error.
    pub fn from_directory(
        directory: &Path,
        max_length: usize,
        vocab_size: Option<i64>,
    ) -> Result<Self, EncoderError> {
        let tokenizer_path = directory.join("tokenizer.json");
        let tokenizer = if tokenizer_path.is_file() {
            Some(
                tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|error| {
                    EncoderError::File {
                        path: tokenizer_path.clone(),
                        message: error.to_string(),
                    }
                })?,
            )
        } else {
            None
        };
        let config_path = directory.join("tokenizer_config.json");
        let config = read_json_file(&config_path)?;
        let template_file = directory.join("chat_template.jinja");
        let template_source = if template_file.is_file() {
            let source =
                std::fs::read_to_string(&template_file).map_err(|error| EncoderError::File {
                    path: template_file.clone(),
                    message: error.to_string(),
                })?;
            Some((source, template_file))
        } else {
            config
                .as_ref()
                .and_then(|config| config.get("chat_template"))
                .and_then(|template| match template {
                    Value::String(source) => Some(source.clone()),
                    // The list form: [{"name": "default", "template": ..}, ..]
                    Value::Array(named) => named
                        .iter()
                        .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"))
                        .and_then(|entry| entry.get("template"))
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    _ => None,
                })
                .map(|source| (source, config_path.clone()))
        };
        let template = template_source
            .map(|(source, path)| build_template_environment(source, &path))
            .transpose()?;
        Ok(ChatEncoder {
            tokenizer,
            template,
            bos_token: token_string(config.as_ref().and_then(|config| config.get("bos_token"))),
            eos_token: token_string(config.as_ref().and_then(|config| config.get("eos_token"))),
            directory: directory.to_path_buf(),
            max_length,
            vocab_size,
        })
    }

    /// An encoder for pre-tokenized data only.
    pub fn pre_tokenized_only(max_length: usize, vocab_size: Option<i64>) -> Self {
        ChatEncoder {
            tokenizer: None,
            template: None,
            bos_token: None,
            eos_token: None,
            directory: PathBuf::from("(no tokenizer)"),
            max_length,
            vocab_size,
        }
    }

    /// Renders messages with the chat template, as HF
    /// `apply_chat_template(messages, tokenize=False)` would.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, LineError> {
        self.render_with(messages, false)
    }

    /// Token ids of a generation prompt: the messages rendered with
    /// `add_generation_prompt=True` (the template opens the assistant turn),
    /// as `dflash eval` feeds them to speculative decoding.
    pub fn encode_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<i64>, LineError> {
        let tokenizer = self
            .tokenizer
            .as_ref()
            .ok_or_else(|| LineError::NoTokenizer(self.directory.clone()))?;
        let text = self.render_with(messages, true)?;
        let encoding = tokenizer
            .encode(text.as_str(), false)
            .map_err(|error| LineError::Tokenizer(error.to_string()))?;
        Ok(encoding.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, LineError> {
        let environment = self.template.as_ref().ok_or_else(|| {
            LineError::Template(format!("no chat template in {}", self.directory.display()))
        })?;
        let template = environment
            .get_template(TEMPLATE_NAME)
            .map_err(|error| LineError::Template(error.to_string()))?;
        let raw_messages: Vec<&Value> = messages.iter().map(|message| &message.raw).collect();
        let context = minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(&raw_messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        template
            .render(context)
            .map_err(|error| LineError::Template(error.to_string()))
    }

    /// Encodes one conversation, truncated to the max length.
    pub fn encode(&self, conversation: &Conversation) -> Result<TokenizedSequence, LineError> {
        let (mut input_ids, mut loss_mask) = match conversation {
            Conversation::PreTokenized {
                input_ids,
                loss_mask,
            } => (input_ids.clone(), loss_mask.clone()),
            Conversation::Messages(messages) => self.encode_messages(messages)?,
        };
        if input_ids.is_empty() {
            return Err(LineError::Empty);
        }
        if let Some(vocab_size) = self.vocab_size {
            if let Some((position, id)) = input_ids
                .iter()
                .enumerate()
                .find(|(_, &id)| id >= vocab_size)
            {
                return Err(LineError::Invalid(format!(
                    "token id {id} at position {position} is outside the model's vocabulary of {vocab_size}"
                )));
            }
        }
        let truncated = input_ids.len() > self.max_length;
        input_ids.truncate(self.max_length);
        loss_mask.truncate(self.max_length);
        Ok(TokenizedSequence {
            input_ids,
            loss_mask,
            truncated,
        })
    }

    fn encode_messages(&self, messages: &[ChatMessage]) -> Result<(Vec<i64>, Vec<u8>), LineError> {
        let tokenizer = self
            .tokenizer
            .as_ref()
            .ok_or_else(|| LineError::NoTokenizer(self.directory.clone()))?;
        let text = self.render(messages)?;
        let spans = self.assistant_spans(&text, messages)?;
        let encoding = tokenizer
            .encode(text.as_str(), false)
            .map_err(|error| LineError::Tokenizer(error.to_string()))?;
        let input_ids: Vec<i64> = encoding.get_ids().iter().map(|&id| i64::from(id)).collect();
        let loss_mask = encoding
            .get_offsets()
            .iter()
            .map(|&(start, end)| {
                u8::from(
                    spans
                        .iter()
                        .any(|&(span_start, span_end)| start < span_end && end > span_start),
                )
            })
            .collect();
        Ok((input_ids, loss_mask))
    }

    /// Byte ranges of the rendered text that hold assistant replies (plus the
    /// end-of-turn marker right after each). Messages are found in order,
    /// each after the previous one, so a user message quoting an assistant
    /// reply cannot be mistaken for it. Content is matched trimmed, because
    /// templates commonly strip surrounding whitespace.
    fn assistant_spans(
        &self,
        text: &str,
        messages: &[ChatMessage],
    ) -> Result<Vec<(usize, usize)>, LineError> {
        let mut markers: Vec<&str> = END_OF_TURN_MARKERS.to_vec();
        if let Some(eos) = self.eos_token.as_deref().filter(|eos| !eos.is_empty()) {
            markers.insert(0, eos);
        }
        let mut cursor = 0;
        let mut spans = Vec::new();
        for (position, message) in messages.iter().enumerate() {
            let needle = message.content.trim();
            if needle.is_empty() {
                continue;
            }
            let found = text[cursor..].find(needle).ok_or_else(|| {
                LineError::Template(format!(
                    "message {position} ({}) does not appear in the rendered template",
                    message.role
                ))
            })?;
            let start = cursor + found;
            let mut end = start + needle.len();
            if message.role == "assistant" {
                if let Some(marker) = markers
                    .iter()
                    .find(|marker| text[end..].starts_with(**marker))
                {
                    end += marker.len();
                }
                spans.push((start, end));
            }
            cursor = end;
        }
        Ok(spans)
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// A minijinja environment that behaves like transformers' Jinja sandbox:
/// trim_blocks / lstrip_blocks, Python string methods (`.strip()`,
/// `.startswith()` ...), `raise_exception` and `strftime_now`.
fn build_template_environment(
    source: String,
    path: &Path,
) -> Result<minijinja::Environment<'static>, EncoderError> {
    let mut environment = minijinja::Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|error| EncoderError::Template {
            path: path.to_path_buf(),
            message: error.to_string(),
        })?;
    environment.set_syntax(syntax);
    environment.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    minijinja_contrib::add_to_environment(&mut environment);
    environment.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    // A fixed date keeps rendered training data reproducible; templates only
    // use it for a "today is" line in the system prompt.
    environment.add_function("strftime_now", |_format: String| "26 Jul 2024".to_string());
    environment
        .add_template_owned(TEMPLATE_NAME, source)
        .map_err(|error| EncoderError::Template {
            path: path.to_path_buf(),
            message: error.to_string(),
        })?;
    Ok(environment)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_formats() -> Result<(), LineError> {
        let pre = parse_line(r#"{"input_ids": [1, 2, 3], "loss_mask": [0, 1, true]}"#)?;
        assert_eq!(
            pre,
            Conversation::PreTokenized {
                input_ids: vec![1, 2, 3],
                loss_mask: vec![0, 1, 1]
            }
        );
        let Conversation::Messages(openai) = parse_line(
            r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}"#,
        )?
        else {
            panic!("expected messages");
        };
        assert_eq!(openai[1].content, "yo");
        let Conversation::Messages(sharegpt) = parse_line(
            r#"{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}"#,
        )?
        else {
            panic!("expected messages");
        };
        assert_eq!(sharegpt[0].role, "user");
        assert_eq!(sharegpt[1].role, "assistant");
        Ok(())
    }

    #[test]
    fn malformed_lines_say_what_is_wrong() {
        let cases = [
            ("{not json", "not valid JSON"),
            ("[1, 2]", "expected a JSON object"),
            (r#"{"text": "hi"}"#, "expected a JSON object"),
            (r#"{"input_ids": [1, -2]}"#, "input_ids[1]"),
            (
                r#"{"input_ids": [1, 2], "loss_mask": [1]}"#,
                "loss_mask has 1 entries",
            ),
            (r#"{"input_ids": [1], "loss_mask": [2]}"#, "loss_mask[0]"),
            (r#"{"messages": []}"#, "is empty"),
            (r#"{"messages": [{"content": "x"}]}"#, "no string \"role\""),
            (
                r#"{"conversations": [{"from": "alien", "value": "x"}]}"#,
                "unknown from \"alien\"",
            ),
        ];
        for (line, expected) in cases {
            let message = parse_line(line)
                .err()
                .map(|error| error.to_string())
                .unwrap_or_default();
            assert!(message.contains(expected), "{line}: {message}");
        }
    }

    #[test]
    fn pre_tokenized_lines_are_truncated_and_range_checked() -> Result<(), LineError> {
        let encoder = ChatEncoder::pre_tokenized_only(3, Some(100));
        let long = parse_line(r#"{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}"#)?;
        let encoded = encoder.encode(&long)?;
        assert_eq!(encoded.input_ids, vec![1, 2, 3]);
        assert_eq!(encoded.loss_mask, vec![0, 0, 1]);
        assert!(encoded.truncated);
        let outside = parse_line(r#"{"input_ids": [1, 100]}"#)?;
        assert!(matches!(
            encoder.encode(&outside),
            Err(LineError::Invalid(_))
        ));
        let empty = parse_line(r#"{"input_ids": []}"#)?;
        assert_eq!(encoder.encode(&empty), Err(LineError::Empty));
        let text = parse_line(r#"{"messages": [{"role": "user", "content": "hi"}]}"#)?;
        assert!(matches!(
            encoder.encode(&text),
            Err(LineError::NoTokenizer(_))
        ));
        Ok(())
    }
}
