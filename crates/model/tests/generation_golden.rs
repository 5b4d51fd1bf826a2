//! Cached generation against transformers' own `generate` with its KV cache
//! (`scripts/golden/generate_golden.py`, fixtures committed in
//! `tests/fixtures/target/golden_generate_*.safetensors`) on the committed
//! tiny Qwen3 and Llama: a left-padded batch, greedy, the same new tokens,
//! and every step's logits within 1e-4 (f32; the only differences are
//! summation order inside the kernels, on logits of O(1)).

use anyhow::{ensure, Context, Result};
use dflash_model::generate::{generate_batch, GenerationOptions, GenerationRequest, Padding};
use dflash_model::target_model::TargetModel;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-4;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/target")
}

fn check(name: &str) -> Result<()> {
    let path = fixture_dir().join(format!("golden_generate_{name}.safetensors"));
    let golden: HashMap<String, Tensor> = Tensor::read_safetensors(&path)
        .with_context(|| format!("reading {}", path.display()))?
        .into_iter()
        .collect();
    let get = |key: &str| {
        golden
            .get(key)
            .with_context(|| format!("no {key:?} in the fixture"))
    };
    let input_ids = get("input_ids")?;
    let attention_mask = get("attention_mask")?;
    let new_tokens = get("new_tokens")?;
    let logits = get("logits")?;
    let (batch, prompt_length) = (input_ids.size()[0], input_ids.size()[1]);
    let steps = new_tokens.size()[1];
    let model = TargetModel::load(
        &fixture_dir().join(format!("tiny_{name}")),
        Device::Cpu,
        Kind::Float,
    )?;

    // The tokens, through the public generation path.
    let requests: Vec<GenerationRequest> = (0..batch)
        .map(|row| {
            let ids = Vec::<i64>::try_from(&input_ids.get(row))?;
            let mask = Vec::<i64>::try_from(&attention_mask.get(row))?;
            Ok(GenerationRequest {
                prompt: ids
                    .into_iter()
                    .zip(mask)
                    .filter(|(_, mask)| *mask == 1)
                    .map(|(id, _)| id)
                    .collect(),
                sequence_id: row as u64,
            })
        })
        .collect::<Result<_>>()?;
    let options = GenerationOptions {
        max_new_tokens: steps as usize,
        padding: Padding::Left,
        ..GenerationOptions::default()
    };
    let generated = generate_batch(&model, &requests, &options)?;
    for (row, output) in generated.iter().enumerate() {
        let expected = Vec::<i64>::try_from(&new_tokens.get(row as i64))?;
        ensure!(
            output.tokens == expected,
            "{name} row {row}: {:?} != transformers {expected:?}",
            output.tokens
        );
    }

    // Every step's logits, through the cache with transformers' tokens.
    let mut cache = model.new_cache(batch, prompt_length + steps);
    let prefill = model.forward_cached(input_ids, attention_mask, &mut cache, &[])?;
    let mut hidden = prefill.hidden.narrow(1, prompt_length - 1, 1);
    let mut worst = 0.0f64;
    for step in 0..steps {
        let actual = model.lm_head_logits(&hidden).squeeze_dim(1);
        let expected = logits.get(step);
        worst = worst.max((&actual - &expected).abs().max().double_value(&[]));
        let next = new_tokens.narrow(1, step, 1);
        hidden = model
            .forward_cached(&next, &next.ones_like(), &mut cache, &[])?
            .hidden;
    }
    eprintln!("{name}: max abs logit difference to transformers' generate {worst:e}");
    ensure!(worst < TOLERANCE, "{name}: logits differ by {worst}");
    ensure!(
        logits.abs().max().double_value(&[]) > 0.1,
        "{name}: vacuous logits"
    );
    Ok(())
}

#[test]
fn cached_generation_matches_transformers_generate_qwen3() -> Result<()> {
    check("qwen3")
}

#[test]
fn cached_generation_matches_transformers_generate_llama() -> Result<()> {
    check("llama")
}
