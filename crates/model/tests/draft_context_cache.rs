//! The drafter's context cache computes the function of the uncached
//! forward: along a speculative-decoding trajectory on the tiny Qwen3 target
//! (real captured hidden states, the context growing by 1 to 8 positions at
//! a time, full and short blocks, two rows), every block's draft from the
//! cached per-layer context keys and values gives the same proposals token
//! for token as `forward_blocks` over the whole context, and logits within
//! a bound derived from f32 rounding.
//!
//! The bound: both paths do the same arithmetic except the order of f32
//! sums (the context rows are projected a few at a time instead of all at
//! once, and the attention reads them from the cache). A sum of k products
//! computed in two orders differs by at most 2·γ_k·Σ|aᵢbᵢ| ≈ 2·k·u·Σ|aᵢbᵢ|
//! (u = 2⁻²⁴, the f32 unit roundoff). Summing k over every dot product a
//! logit depends on (fc, k/v projections, scores, the attention average,
//! o_proj, the MLP, the LM head) and scaling by the largest a logit can be
//! (Σₕ|lm_headᵥₕ|·max|h|) gives a first-order bound on the difference; RMS
//! norm and softmax are Lipschitz with constants of order one at these
//! activations (RMS of the residual stream ≈ 1), for which a factor 4 is
//! allowed. A real error (a position off by one, a context row missing)
//! moves logits by over ten times the bound, which the test checks too.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use anyhow::{ensure, Result};
use dflash_model::draft::{
    BlockInputs, DraftConfig, DraftModel, DraftOptions, FrozenTargetHeads, TargetDimensions,
};
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_model::tokens::mask_token_id;
use tch::{Device, Kind, Tensor};

const BLOCK_SIZE: i64 = 8;
const PROMPT_LENGTH: i64 = 6;
/// How many committed positions each verification adds to the context
/// (1 = only the anchor accepted, 8 = the whole block).
const COMMITTED_PER_STEP: [i64; 9] = [1, 3, 8, 2, 5, 1, 7, 4, 6];

struct Fixture {
    _directory: tempfile::TempDir,
    drafter: DraftModel,
    /// `[2, length, n·hidden]` target states of two token sequences.
    target_hidden: Tensor,
    /// `[2, length]` their tokens.
    token_ids: Tensor,
    length: i64,
}

fn fixture() -> Result<Fixture> {
    let directory = tempfile::tempdir()?;
    write_tiny_model(directory.path(), &TinyModelSpec::default())?;
    let target = TargetModel::load(directory.path(), Device::Cpu, Kind::Float)?;
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(BLOCK_SIZE),
        mask_token_id: mask_token_id(directory.path())?,
        target_layer_ids: None,
    };
    let mut config = DraftConfig::for_target(&TargetDimensions::from(target.config()), &options)?;
    // Larger than the recipe's 0.02 so attention is far from uniform and
    // the proposals depend on the context: a wrong context shows.
    config.initializer_range = 0.3;
    let layer_ids: Vec<usize> = config
        .target_layer_ids
        .iter()
        .map(|&layer| layer as usize)
        .collect();
    let frozen = FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let drafter = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 3)?;
    let length = PROMPT_LENGTH + COMMITTED_PER_STEP.iter().sum::<i64>() + BLOCK_SIZE;
    let rows: Vec<Vec<i64>> = (0..2)
        .map(|row| {
            (0..length)
                .map(|position| (row * 211 + position * 37 + 11) % 290 + 3)
                .collect()
        })
        .collect();
    let token_ids = Tensor::from_slice(&rows.concat()).view([2, length]);
    let target_hidden =
        target.capture_hidden_states(&token_ids, &token_ids.ones_like(), &layer_ids)?;
    Ok(Fixture {
        _directory: directory,
        drafter,
        target_hidden,
        token_ids,
        length,
    })
}

/// Block tokens `[2, block_length]`: the token at the anchor, then masks.
fn block_at(fixture: &Fixture, anchor: i64, block_length: i64) -> Tensor {
    let mask = fixture.drafter.config().mask_token_id;
    let block = Tensor::full([2, block_length], mask, (Kind::Int64, Device::Cpu));
    block
        .narrow(1, 0, 1)
        .copy_(&fixture.token_ids.narrow(1, anchor, 1));
    block
}

/// The reference: `forward_blocks` over the whole context before `anchor`,
/// `[2, block_length, hidden]`.
fn uncached_block(fixture: &Fixture, anchor: i64, block: &Tensor) -> Result<Tensor> {
    let block_length = block.size()[1];
    let anchors = Tensor::from_slice(&[anchor, anchor]).view([2, 1]);
    let hidden = tch::no_grad(|| {
        fixture.drafter.forward_blocks(&BlockInputs {
            target_hidden: &fixture.target_hidden.narrow(1, 0, anchor),
            block_token_ids: &block.view([2, 1, block_length]),
            anchor_positions: &anchors,
        })
    })?;
    Ok(hidden.view([2, block_length, -1]))
}

/// The first-order f32 bound of the module comment for these logits.
fn logit_tolerance(fixture: &Fixture, draft_hidden: &Tensor, context_length: i64) -> f64 {
    let config = fixture.drafter.config();
    let unit_roundoff = f64::from(f32::EPSILON) / 2.0;
    let hidden = config.hidden_size;
    let per_layer = hidden * 3 // k, v, q projections
        + config.head_dim // scores
        + context_length + BLOCK_SIZE // the attention average
        + config.num_attention_heads * config.head_dim // o_proj
        + hidden * 2 + config.intermediate_size; // gate, up, down
    let terms = config.target_hidden_width() // fc
        + config.num_draft_layers * per_layer
        + hidden; // the LM head
    let lm_head = fixture
        .drafter
        .logits(&Tensor::eye(hidden, (Kind::Float, Device::Cpu)));
    let largest_row_sum = lm_head.abs().sum_dim_intlist(0, false, Kind::Float).max();
    let logit_scale =
        largest_row_sum.double_value(&[]) * draft_hidden.abs().max().double_value(&[]);
    let lipschitz_allowance = 4.0;
    2.0 * terms as f64 * unit_roundoff * logit_scale * lipschitz_allowance
}

fn max_difference(first: &Tensor, second: &Tensor) -> f64 {
    (first - second).abs().max().double_value(&[])
}

#[test]
fn cached_context_drafts_equal_the_uncached_forward_token_for_token() -> Result<()> {
    // One thread: the same reduction order on every run.
    tch::set_num_threads(1);
    let fixture = fixture()?;
    let drafter = &fixture.drafter;
    let mut cache = drafter.new_context_cache(2, 4);
    drafter.extend_context(
        &mut cache,
        &fixture.target_hidden.narrow(1, 0, PROMPT_LENGTH),
    )?;
    let mut largest_difference = 0.0f64;
    let mut compared_tokens = 0;
    for (step, &committed) in COMMITTED_PER_STEP.iter().enumerate() {
        let anchor = cache.len();
        // Every third block is short, as near the end of generation.
        let block_length = if step % 3 == 2 { 3 } else { BLOCK_SIZE };
        let block = block_at(&fixture, anchor, block_length);
        let cached = drafter.forward_block_cached(&cache, &block)?;
        let uncached = uncached_block(&fixture, anchor, &block)?;
        let cached_logits = drafter.logits(&cached.narrow(1, 1, block_length - 1));
        let uncached_logits = drafter.logits(&uncached.narrow(1, 1, block_length - 1));
        let tolerance = logit_tolerance(&fixture, &uncached, anchor);
        let difference = max_difference(&cached_logits, &uncached_logits);
        ensure!(
            difference <= tolerance,
            "step {step} (anchor {anchor}): logits differ by {difference}, bound {tolerance}"
        );
        largest_difference = largest_difference.max(difference);
        let cached_tokens = Vec::<i64>::try_from(&cached_logits.argmax(-1, false).flatten(0, -1))?;
        let uncached_tokens =
            Vec::<i64>::try_from(&uncached_logits.argmax(-1, false).flatten(0, -1))?;
        ensure!(
            cached_tokens == uncached_tokens,
            "step {step} (anchor {anchor}): proposals {cached_tokens:?} != {uncached_tokens:?}"
        );
        compared_tokens += cached_tokens.len();

        // The comparison has power: the same block anchored one position
        // earlier (the context one row short) is far outside the bound.
        let shifted = uncached_block(&fixture, anchor - 1, &block)?;
        let shifted_difference = max_difference(
            &drafter.logits(&shifted.narrow(1, 1, block_length - 1)),
            &uncached_logits,
        );
        ensure!(
            shifted_difference > 10.0 * tolerance,
            "step {step}: a shifted context moves logits by only {shifted_difference} (bound {tolerance})"
        );

        drafter.extend_context(
            &mut cache,
            &fixture.target_hidden.narrow(1, anchor, committed),
        )?;
    }
    ensure!(
        cache.len() + BLOCK_SIZE == fixture.length,
        "the cache holds {} positions",
        cache.len()
    );
    ensure!(compared_tokens > 80, "{compared_tokens} proposals compared");
    eprintln!("{compared_tokens} proposals equal; largest logit difference {largest_difference:e}");
    Ok(())
}

#[test]
fn the_context_cache_refuses_inputs_of_another_shape() -> Result<()> {
    let fixture = fixture()?;
    let drafter = &fixture.drafter;
    let mut cache = drafter.new_context_cache(2, 16);
    let narrow_width = Tensor::zeros([2, 3, 5], (Kind::Float, Device::Cpu));
    let error = drafter
        .extend_context(&mut cache, &narrow_width)
        .unwrap_err()
        .to_string();
    ensure!(error.contains("target hidden width 5"), "{error}");
    let one_row = fixture.target_hidden.narrow(0, 0, 1).narrow(1, 0, 3);
    let error = drafter
        .extend_context(&mut cache, &one_row)
        .unwrap_err()
        .to_string();
    ensure!(error.contains("batch 1"), "{error}");
    ensure!(cache.is_empty(), "a refused extension changed the cache");
    let error = drafter
        .forward_block_cached(&cache, &Tensor::zeros([3, 8], (Kind::Int64, Device::Cpu)))
        .unwrap_err()
        .to_string();
    ensure!(error.contains("block batch 3"), "{error}");
    Ok(())
}
