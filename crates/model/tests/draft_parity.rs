//! Parity of the tch draft model and loss with the reference PyTorch
//! computation (`scripts/golden/draft_golden.py`: the `dflash` package's
//! `DFlashDraftModel` with a dense [context ‖ blocks] mask).
//!
//! The fixture's `config.json` and `model.safetensors` were written by the
//! reference's `save_pretrained`, so this also checks that we read what
//! Hugging Face writes. Both sides compute in f32; sums are ordered
//! differently (two-part softmax here, one dense softmax there), so values
//! are compared with an absolute tolerance of 1e-4 on O(1) activations.

use std::collections::HashMap;
use std::path::PathBuf;

use dflash_model::draft::{
    checkpoint::read_safetensors, compute_objective, load_draft_model, pack_batch,
    FrozenTargetHeads, TrainingSequence,
};
use tch::{Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-4;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/draft/golden")
}

fn take(tensors: &mut HashMap<String, Tensor>, name: &str) -> anyhow::Result<Tensor> {
    tensors
        .remove(name)
        .ok_or_else(|| anyhow::anyhow!("golden.safetensors lacks {name:?}"))
}

#[test]
fn draft_forward_and_loss_match_the_reference() -> anyhow::Result<()> {
    let mut golden = read_safetensors(&fixture_dir().join("golden.safetensors"))?;
    let frozen = FrozenTargetHeads {
        embed_tokens: take(&mut golden, "embed_tokens")?,
        lm_head: take(&mut golden, "lm_head")?,
    };
    let model = load_draft_model(&fixture_dir(), frozen, Device::Cpu, Kind::Float)?;
    assert_eq!(model.config().target_layer_ids, vec![1, 3]);
    assert_eq!(model.config().block_size, 4);

    let mut sequences = Vec::new();
    let mut anchors = Vec::new();
    let mut expected_hidden = Vec::new();
    for index in 0..2 {
        let input_ids =
            Vec::<i64>::try_from(&take(&mut golden, &format!("seq{index}.input_ids"))?)?;
        let loss_mask = Vec::<u8>::try_from(&take(&mut golden, &format!("seq{index}.loss_mask"))?)?;
        anchors.push(Vec::<i64>::try_from(&take(
            &mut golden,
            &format!("seq{index}.anchors"),
        )?)?);
        sequences.push(TrainingSequence {
            target_last_hidden: None,
            input_ids,
            loss_mask,
            target_hidden: take(&mut golden, &format!("seq{index}.target_hidden"))?,
        });
        expected_hidden.push(take(&mut golden, &format!("seq{index}.draft_hidden"))?);
    }
    // Unequal lengths and anchor counts: padding must not change anything.
    assert_ne!(sequences[0].len(), sequences[1].len());
    assert_ne!(anchors[0].len(), anchors[1].len());
    let gamma = take(&mut golden, "gamma")?.double_value(&[0]);
    let batch = pack_batch(&sequences, &anchors)?;
    let output = tch::no_grad(|| compute_objective(&model, &batch, gamma))?;

    let hidden_size = model.config().hidden_size;
    for (index, expected) in expected_hidden.iter().enumerate() {
        let num_blocks = anchors[index].len() as i64;
        let actual = output
            .draft_hidden
            .get(index as i64)
            .narrow(0, 0, num_blocks)
            .reshape([-1, hidden_size]);
        assert_eq!(actual.size(), expected.size(), "sequence {index}");
        let difference = (&actual - expected).abs().max().double_value(&[]);
        assert!(
            difference < TOLERANCE,
            "sequence {index}: max |Δ| {difference}"
        );
    }

    let expected_loss = take(&mut golden, "loss")?.double_value(&[0]);
    let actual_loss = output.loss.double_value(&[]);
    assert!(
        (actual_loss - expected_loss).abs() < TOLERANCE,
        "loss {actual_loss}, reference {expected_loss}"
    );
    let expected_accuracy = Vec::<f64>::try_from(&take(&mut golden, "accuracy_per_position")?)?;
    assert_eq!(output.accuracy_per_position(), expected_accuracy);
    assert!(expected_accuracy.iter().any(|&accuracy| accuracy > 0.0));
    Ok(())
}
