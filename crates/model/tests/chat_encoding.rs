//! Chat template rendering, tokenization and the assistant-only loss mask on
//! the tiny model's real tokenizer files.
//!
//! The expected ids were produced by Hugging Face transformers 5.15
//! (`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
//! tokenize=True)`) on the same tiny model directory, so this also checks
//! that minijinja + the `tokenizers` crate reproduce the Python reference.

use anyhow::{ensure, Result};
use dflash_model::chat::{parse_line, ChatEncoder, Conversation, LineError};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};

const CONVERSATION: &str = r#"{"messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You are welcome."}]}"#;

const SHAREGPT: &str = r#"{"conversations": [
    {"from": "system", "value": "You are a helpful assistant."},
    {"from": "human", "value": "What is the capital of France?"},
    {"from": "gpt", "value": "The capital of France is Paris."},
    {"from": "human", "value": "Thank you!"},
    {"from": "gpt", "value": "You are welcome."}]}"#;

/// From transformers (see the module comment).
const EXPECTED_IDS: [i64; 73] = [
    457, 115, 121, 115, 306, 109, 10, 382, 282, 257, 32, 260, 108, 112, 102, 117, 108, 362, 115,
    441, 46, 458, 10, 457, 117, 115, 258, 10, 87, 300, 274, 267, 357, 283, 353, 63, 458, 10, 457,
    394, 441, 10, 284, 357, 283, 353, 274, 355, 390, 46, 458, 10, 457, 117, 115, 258, 10, 381, 315,
    33, 458, 10, 457, 394, 441, 10, 382, 282, 271, 420, 46, 458, 10,
];

/// Assistant replies and their `<|im_end|>`: positions 42..=50 ("The
/// capital of France is Paris.<|im_end|>") and 66..=71 ("You are
/// welcome.<|im_end|>"). Role headers and the newline after each turn are
/// context.
fn expected_mask() -> Vec<u8> {
    (0..EXPECTED_IDS.len())
        .map(|position| u8::from((42..=50).contains(&position) || (66..=71).contains(&position)))
        .collect()
}

fn tiny_model_dir() -> Result<tempfile::TempDir> {
    let directory = tempfile::tempdir()?;
    write_tiny_model(directory.path(), &TinyModelSpec::default())?;
    Ok(directory)
}

#[test]
fn chatml_conversation_gives_the_reference_ids_and_assistant_mask() -> Result<()> {
    let directory = tiny_model_dir()?;
    let encoder = ChatEncoder::from_directory(directory.path(), 4096, Some(512))?;
    let Conversation::Messages(messages) = parse_line(CONVERSATION)? else {
        anyhow::bail!("not parsed as messages");
    };
    let rendered = encoder.render(&messages)?;
    ensure!(
        rendered.starts_with(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        ),
        "{rendered:?}"
    );
    let encoded = encoder.encode(&Conversation::Messages(messages))?;
    ensure!(
        encoded.input_ids == EXPECTED_IDS,
        "ids {:?}",
        encoded.input_ids
    );
    ensure!(
        encoded.loss_mask == expected_mask(),
        "mask {:?}",
        encoded.loss_mask
    );
    ensure!(!encoded.truncated);

    // ShareGPT spelling of the same conversation: identical.
    let sharegpt = encoder.encode(&parse_line(SHAREGPT)?)?;
    ensure!(sharegpt == encoded);
    Ok(())
}

#[test]
fn template_from_tokenizer_config_when_no_jinja_file() -> Result<()> {
    let directory = tiny_model_dir()?;
    std::fs::remove_file(directory.path().join("chat_template.jinja"))?;
    let encoder = ChatEncoder::from_directory(directory.path(), 4096, Some(512))?;
    let encoded = encoder.encode(&parse_line(CONVERSATION)?)?;
    ensure!(encoded.input_ids == EXPECTED_IDS);
    Ok(())
}

#[test]
fn over_long_conversations_are_truncated_with_their_mask() -> Result<()> {
    let directory = tiny_model_dir()?;
    let encoder = ChatEncoder::from_directory(directory.path(), 45, Some(512))?;
    let encoded = encoder.encode(&parse_line(CONVERSATION)?)?;
    ensure!(encoded.truncated);
    ensure!(encoded.input_ids == EXPECTED_IDS[..45]);
    ensure!(encoded.loss_mask == expected_mask()[..45]);
    Ok(())
}

#[test]
fn a_model_directory_without_tokenizer_rejects_text_lines_only() -> Result<()> {
    let directory = tiny_model_dir()?;
    std::fs::remove_file(directory.path().join("tokenizer.json"))?;
    let encoder = ChatEncoder::from_directory(directory.path(), 4096, Some(512))?;
    let text = encoder.encode(&parse_line(CONVERSATION)?);
    ensure!(matches!(text, Err(LineError::NoTokenizer(_))), "{text:?}");
    let ids = encoder.encode(&parse_line(
        r#"{"input_ids": [1, 2], "loss_mask": [0, 1]}"#,
    )?)?;
    ensure!(ids.input_ids == vec![1, 2]);
    Ok(())
}

#[test]
fn broken_template_is_a_clear_error() -> Result<()> {
    let directory = tiny_model_dir()?;
    std::fs::write(
        directory.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )?;
    let message = ChatEncoder::from_directory(directory.path(), 4096, Some(512))
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    ensure!(
        message.contains("chat_template.jinja") && message.contains("invalid chat template"),
        "{message}"
    );
    Ok(())
}
