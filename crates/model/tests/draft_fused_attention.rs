//! The fused-attention forward and the memory-saving backward compute the
//! same function as the split forward and the plain backward: draft hidden
//! states, loss and every parameter gradient (of the normalised loss, as the
//! optimizer gets them) within 1e-5 in f32.
//!
//! Why 1e-5: the implementations only reorder f32 sums (the flash kernel
//! accumulates its softmax in tiles, the chunked loss sums per chunk), so
//! they differ by a few ulps of the O(1) activations and of the gradients
//! (≈ 1e-7 relative, times the ~100 terms a value here sums over); a real
//! difference in the mask or the chunk bookkeeping moves values by ≥ 1e-3.

use std::collections::BTreeMap;

use dflash_model::draft::{
    compute_objective, compute_objective_backward, pack_batch, AttentionImplementation,
    DraftConfig, DraftModel, ObjectiveMemory, PackedBatch, TrainingSequence,
};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tch::{Device, Kind, Tensor};

mod common;

use common::{frozen_heads, tiny_draft_config, uniform_tensor, HIDDEN, VOCAB};

const TOLERANCE: f64 = 1e-5;

/// The tiny configuration with weights larger than the recipe's 0.02, so
/// attention is far from uniform and a wrong mask changes the result
/// visibly.
fn config() -> DraftConfig {
    tiny_draft_config(0.3)
}

fn model(attention: AttentionImplementation) -> anyhow::Result<DraftModel> {
    let mut model = DraftModel::new(config(), frozen_heads(11), Device::Cpu, Kind::Float, 5)?;
    model.set_attention(attention)?;
    Ok(model)
}

/// Two sequences of unequal length and anchor count: anchor 0 (a block
/// without any context), anchors near the end (labels past it), and
/// padding anchors in the shorter list.
fn batch() -> anyhow::Result<PackedBatch> {
    let mut generator = StdRng::seed_from_u64(3);
    let width = 2 * HIDDEN;
    let lengths = [37usize, 26];
    let anchors = vec![
        vec![0i64, 3, 4, 9, 15, 16, 22, 30, 35],
        vec![2i64, 7, 11, 24],
    ];
    let sequences: Vec<TrainingSequence> = lengths
        .iter()
        .map(|&length| TrainingSequence {
            target_last_hidden: None,
            input_ids: (0..length)
                .map(|_| generator.random_range(0..VOCAB - 1))
                .collect(),
            loss_mask: (0..length)
                .map(|position| u8::from(position != 5))
                .collect(),
            target_hidden: uniform_tensor(&[length as i64, width], 2.0, &mut generator),
        })
        .collect();
    Ok(pack_batch(&sequences, &anchors)?)
}

/// Gradients of every parameter, by name, divided by `Σ w` (the backward
/// runs on the unnormalised `Σ w·CE`; the trainer divides by `Σ w`, so these
/// are the gradients that reach the optimizer); cleared afterwards.
fn gradients(model: &DraftModel, weight_sum: f64) -> BTreeMap<String, Tensor> {
    model
        .var_store()
        .variables()
        .into_iter()
        .map(|(name, variable)| {
            let gradient = variable.grad();
            let copy = if gradient.defined() {
                gradient.copy() / weight_sum
            } else {
                variable.zeros_like()
            };
            if gradient.defined() {
                let _ = gradient.detach().zero_();
            }
            (name, copy)
        })
        .collect()
}

fn max_difference(first: &Tensor, second: &Tensor) -> f64 {
    (first - second).abs().max().double_value(&[])
}

fn assert_gradients_equal(
    expected: &BTreeMap<String, Tensor>,
    actual: &BTreeMap<String, Tensor>,
    what: &str,
) {
    assert_eq!(expected.len(), actual.len());
    let mut largest_gradient = 0.0f64;
    for (name, expected_gradient) in expected {
        let actual_gradient = &actual[name];
        largest_gradient = largest_gradient.max(expected_gradient.abs().max().double_value(&[]));
        let difference = max_difference(expected_gradient, actual_gradient);
        assert!(
            difference < TOLERANCE,
            "{what}: gradient of {name} differs by {difference}"
        );
    }
    // The comparison means something only if the gradients are not all zero.
    assert!(
        largest_gradient > 1e-3,
        "{what}: gradients vanish ({largest_gradient})"
    );
}

/// Forward, loss and gradients of the split reference path.
fn split_reference(batch: &PackedBatch) -> anyhow::Result<(Tensor, f64, BTreeMap<String, Tensor>)> {
    let model = model(AttentionImplementation::Split)?;
    let output = compute_objective(&model, batch, 2.0)?;
    (&output.loss * output.weight_sum).backward();
    assert!(output.weight_sum > 1.0, "Σ w = {}", output.weight_sum);
    let loss = output.loss.double_value(&[]);
    Ok((
        output.draft_hidden.detach(),
        loss,
        gradients(&model, output.weight_sum),
    ))
}

#[test]
fn fused_attention_matches_split_attention_forward_loss_and_gradients() -> anyhow::Result<()> {
    let batch = batch()?;
    let (expected_hidden, expected_loss, expected_gradients) = split_reference(&batch)?;
    // 9 blocks: chunks of 1, of 4 (the last one short) and all in one; the
    // first chunk of 1 is anchor 0 alone, without any context.
    for blocks_per_chunk in [1, 4, 9] {
        for attention in [
            AttentionImplementation::Fused { blocks_per_chunk },
            AttentionImplementation::FusedConcatenated { blocks_per_chunk },
        ] {
            check_against_split(
                attention,
                &batch,
                &expected_hidden,
                expected_loss,
                &expected_gradients,
            )?;
        }
    }
    Ok(())
}

fn check_against_split(
    attention: AttentionImplementation,
    batch: &PackedBatch,
    expected_hidden: &Tensor,
    expected_loss: f64,
    expected_gradients: &BTreeMap<String, Tensor>,
) -> anyhow::Result<()> {
    {
        let model = model(attention)?;
        let output = compute_objective(&model, batch, 2.0)?;
        let hidden_difference = max_difference(expected_hidden, &output.draft_hidden);
        assert!(
            hidden_difference < TOLERANCE,
            "{attention:?}: draft hidden states differ by {hidden_difference}"
        );
        let loss = output.loss.double_value(&[]);
        assert!(
            (loss - expected_loss).abs() < TOLERANCE,
            "{attention:?}: loss {loss} vs {expected_loss}"
        );
        (&output.loss * output.weight_sum).backward();
        assert_gradients_equal(
            expected_gradients,
            &gradients(&model, output.weight_sum),
            &format!("{attention:?}"),
        );
    }
    Ok(())
}

#[test]
fn a_wrong_mask_would_be_seen() -> anyhow::Result<()> {
    // Guards the test above: a model whose blocks see one more context
    // position (anchor + 1) must differ by far more than the tolerance.
    let batch = batch()?;
    let (expected_hidden, _, _) = split_reference(&batch)?;
    let model = model(AttentionImplementation::Fused {
        blocks_per_chunk: 4,
    })?;
    let shifted = PackedBatch {
        anchors: &batch.anchors + 1,
        target_hidden: batch.target_hidden.shallow_clone(),
        target_last_hidden: None,
        input_ids: batch.input_ids.shallow_clone(),
        loss_mask: batch.loss_mask.shallow_clone(),
        anchor_valid: batch.anchor_valid.shallow_clone(),
        num_tokens: batch.num_tokens,
    };
    let output = tch::no_grad(|| compute_objective(&model, &shifted, 2.0))?;
    assert!(max_difference(&expected_hidden, &output.draft_hidden) > 1e-3);
    Ok(())
}

#[test]
fn chunked_logits_and_checkpointed_layers_give_the_same_gradients() -> anyhow::Result<()> {
    let batch = batch()?;
    let (_, expected_loss, expected_gradients) = split_reference(&batch)?;
    for memory in [
        ObjectiveMemory {
            logits_chunk_blocks: None,
            checkpoint_layers: false,
        },
        ObjectiveMemory {
            logits_chunk_blocks: Some(2),
            checkpoint_layers: false,
        },
        ObjectiveMemory {
            logits_chunk_blocks: Some(4),
            checkpoint_layers: true,
        },
    ] {
        for attention in [
            AttentionImplementation::Split,
            AttentionImplementation::Fused {
                blocks_per_chunk: 4,
            },
            AttentionImplementation::FusedConcatenated {
                blocks_per_chunk: 4,
            },
        ] {
            let model = model(attention)?;
            let output = compute_objective_backward(&model, &batch, 2.0, memory)?;
            assert!(
                (output.loss - expected_loss).abs() < TOLERANCE,
                "{memory:?}, {attention:?}: loss {} vs {expected_loss}",
                output.loss
            );
            assert_gradients_equal(
                &expected_gradients,
                &gradients(&model, output.weight_sum),
                &format!("{memory:?}, {attention:?}"),
            );
        }
    }
    Ok(())
}

#[test]
fn nonsense_chunk_sizes_are_refused_with_the_value() -> anyhow::Result<()> {
    let mut model = model(AttentionImplementation::Split)?;
    let error = model
        .set_attention(AttentionImplementation::Fused {
            blocks_per_chunk: 0,
        })
        .unwrap_err();
    assert!(error.to_string().contains("0 blocks per chunk"), "{error}");
    let error = compute_objective_backward(
        &model,
        &batch()?,
        2.0,
        ObjectiveMemory {
            logits_chunk_blocks: Some(-3),
            checkpoint_layers: false,
        },
    )
    .unwrap_err();
    assert!(error.to_string().contains("-3 blocks"), "{error}");
    Ok(())
}
