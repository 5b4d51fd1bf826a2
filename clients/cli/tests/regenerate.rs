//! `dflash regenerate` on the tiny model: assistant turns become the
//! target's own greedy continuations (user and system turns and other fields
//! kept), shards split the records round-robin, and a rerun after an
//! interrupted write resumes to the same output.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use dflash_cli::regenerate::{run, RegenerateArgs};
use dflash_model::generate::greedy_generate_uncached;
use dflash_model::target_model::TargetModel;
use serde_json::{json, Value};

const MAX_NEW_TOKENS: usize = 6;

fn input_lines() -> Vec<Value> {
    vec![
        json!({"id": "a", "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "OLD ANSWER"}]}),
        json!({"id": "b", "messages": [
            {"role": "user", "content": "Hello, how are you today?"},
            {"role": "assistant", "content": "OLD 1"},
            {"role": "user", "content": "Count from one to ten"},
            {"role": "assistant", "content": "OLD 2"}]}),
        json!({"conversations": [
            {"from": "human", "value": "Write a short poem about the sea."},
            {"from": "gpt", "value": "OLD POEM"}]}),
        json!({"input_ids": [20, 30, 40, 50, 60], "loss_mask": [0, 0, 0, 1, 1]}),
        json!({"messages": [
            {"role": "user", "content": "Thank you!"},
            {"role": "assistant", "content": "OLD"}]}),
    ]
}

fn args(model: &Path, input: &Path, output: PathBuf, shard: (u64, u64)) -> RegenerateArgs {
    RegenerateArgs {
        model: model.to_path_buf(),
        input: input.to_path_buf(),
        output,
        max_new_tokens: MAX_NEW_TOKENS,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        shard,
        token_budget: 64,
        chunk_lines: 2,
        device: dflash_shell::DeviceChoice::Cpu,
    }
}

fn read_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[test]
fn regenerates_assistant_turns_sharded_and_resumable() {
    let directory = tempfile::tempdir().unwrap();
    let model = directory.path().join("model");
    dflash_model::tiny::write_tiny_model(&model, &dflash_model::tiny::TinyModelSpec::default())
        .unwrap();
    let input = directory.path().join("chat.jsonl");
    let text: String = input_lines()
        .iter()
        .map(|line| format!("{line}\n\n"))
        .collect();
    std::fs::write(&input, text).unwrap();

    let full = directory.path().join("out/full.jsonl");
    let report = run(&args(&model, &input, full.clone(), (0, 1))).unwrap();
    assert_eq!(
        (report.shard_records, report.skipped, report.written),
        (5, 0, 5)
    );
    assert!(report.generated_tokens > 0);
    let output = read_lines(&full);
    assert_eq!(output.len(), 5);

    // Line "a": system and user kept, the assistant turn is the target's
    // greedy continuation of the rendered prompt, decoded.
    let original = input_lines();
    assert_eq!(output[0]["id"], "a");
    assert_eq!(output[0]["messages"][0], original[0]["messages"][0]);
    assert_eq!(output[0]["messages"][1], original[0]["messages"][1]);
    let encoder =
        dflash_model::chat::ChatEncoder::from_directory(&model, usize::MAX, None).unwrap();
    let dflash_model::chat::Conversation::Messages(messages) = dflash_model::chat::parse_line(
        &json!({"messages": original[0]["messages"].as_array().unwrap()[..2]}).to_string(),
    )
    .unwrap() else {
        panic!("not a chat line");
    };
    let prompt = encoder.encode_prompt(&messages).unwrap();
    let target = TargetModel::load(&model, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).unwrap();
    let eos = i64::from(tokenizer.token_to_id("<|im_end|>").unwrap());
    let mut expected = greedy_generate_uncached(&target, &prompt, MAX_NEW_TOKENS, &[eos]).unwrap();
    if expected.last() == Some(&eos) {
        expected.pop();
    }
    let ids: Vec<u32> = expected.iter().map(|&id| id as u32).collect();
    assert_eq!(
        output[0]["messages"][2]["content"],
        tokenizer.decode(&ids, true).unwrap()
    );
    // Two assistant turns regenerated, the user turn between them kept.
    let second = &output[1]["messages"];
    assert_ne!(second[1]["content"], "OLD 1");
    assert_ne!(second[3]["content"], "OLD 2");
    assert_eq!(second[2], original[1]["messages"][2]);
    // ShareGPT keeps its keys.
    assert_eq!(
        output[2]["conversations"][0],
        original[2]["conversations"][0]
    );
    assert_ne!(output[2]["conversations"][1]["value"], "OLD POEM");
    // Pre-tokenized: the 3-token prompt continued, loss on the continuation.
    let ids = output[3]["input_ids"].as_array().unwrap();
    let mask = output[3]["loss_mask"].as_array().unwrap();
    assert_eq!(ids[..3], [json!(20), json!(30), json!(40)]);
    assert_eq!(ids.len(), mask.len());
    assert!(ids.len() > 3 && ids.len() <= 3 + MAX_NEW_TOKENS);
    assert_eq!(mask[2], json!(0));
    assert_eq!(mask[3], json!(1));

    // Resume: two whole lines and a torn third, then a rerun.
    let resumed = directory.path().join("out/resumed.jsonl");
    let mut partial = std::fs::read_to_string(&full)
        .unwrap()
        .lines()
        .take(2)
        .map(|line| format!("{line}\n"))
        .collect::<String>();
    partial.push_str("{\"id\": \"tor");
    std::fs::write(&resumed, partial).unwrap();
    let report = run(&args(&model, &input, resumed.clone(), (0, 1))).unwrap();
    assert_eq!((report.skipped, report.written), (2, 3));
    assert_eq!(read_lines(&resumed), output);
    // A second rerun has nothing left to do.
    let report = run(&args(&model, &input, resumed.clone(), (0, 1))).unwrap();
    assert_eq!((report.skipped, report.written), (5, 0));

    // Shards: records 0, 2, 4 and 1, 3, each as in the unsharded run.
    for (index, rows) in [(0u64, vec![0usize, 2, 4]), (1, vec![1, 3])] {
        let path = directory.path().join(format!("out/shard-{index}.jsonl"));
        run(&args(&model, &input, path.clone(), (index, 2))).unwrap();
        let expected: Vec<Value> = rows.iter().map(|&row| output[row].clone()).collect();
        assert_eq!(read_lines(&path), expected, "shard {index}/2");
    }
}
