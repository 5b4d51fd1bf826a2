//! DFlash2's training objective against speculators 0.9.0's (issue 42): the
//! loss and every parameter's gradient on the golden DFlash2 fixture's
//! batch and labels. `scripts/golden/draft2_gradient_golden.py` computed
//! them with speculators' own `compute_metrics` (unary hard-label CE and
//! the selector loss, decayed weights) over `dflash` 0.1.0's network.
//!
//! speculators divides each loss by the supervised positions N, this
//! project by Σw of the decayed weights (DFlash's paper, SpecForge): the
//! two objectives are the same up to the batch's factor Σw / N, which this
//! test applies before comparing.

use dflash_model::draft::{
    checkpoint::read_safetensors, compute_objective, load_draft_model, pack_batch,
    FrozenTargetHeads, TrainingSequence,
};
use tch::{Device, Kind};

mod common;

use common::{dflash2_fixture_dir as fixture_dir, gamma, take};

#[test]
fn dflash2_loss_and_gradients_match_speculators_objective() -> anyhow::Result<()> {
    let mut golden = read_safetensors(&fixture_dir().join("golden.safetensors"))?;
    let mut reference = read_safetensors(&fixture_dir().join("gradient_golden.safetensors"))?;
    let frozen = FrozenTargetHeads {
        embed_tokens: take(&mut golden, "embed_tokens")?,
        lm_head: take(&mut golden, "lm_head")?,
    };
    let model = load_draft_model(&fixture_dir(), frozen, Device::Cpu, Kind::Float)?;
    let mut sequences = Vec::new();
    let mut anchors = Vec::new();
    for index in 0..2 {
        anchors.push(Vec::<i64>::try_from(&take(
            &mut golden,
            &format!("seq{index}.anchors"),
        )?)?);
        sequences.push(TrainingSequence {
            target_last_hidden: None,
            input_ids: Vec::<i64>::try_from(&take(&mut golden, &format!("seq{index}.input_ids"))?)?,
            loss_mask: Vec::<u8>::try_from(&take(&mut golden, &format!("seq{index}.loss_mask"))?)?,
            target_hidden: take(&mut golden, &format!("seq{index}.target_hidden"))?,
        });
    }
    let gamma_decay = take(&mut golden, "gamma")?.double_value(&[0]);
    let batch = pack_batch(&sequences, &anchors)?;
    let output = compute_objective(&model, &batch, gamma_decay)?;

    // The normalisations: speculators' N (+ its 1e-8) against our Σw.
    let supervised: f64 = output.supervised_per_position.iter().sum();
    assert_eq!(
        supervised,
        take(&mut reference, "supervised")?.double_value(&[0])
    );
    let reference_weight_sum = take(&mut reference, "weight_sum")?.double_value(&[0]);
    // Σw of at most 17 terms in [0, 1]: within γ_17·17 of each other.
    assert!((output.weight_sum - reference_weight_sum).abs() < gamma(17) * 17.0);
    let scale = output.weight_sum / (supervised + 1e-8);

    // Loss: a few dozen O(1..10) cross-entropies, each within the logit
    // error of the reference's (draft2.rs bounds the logits by 7.6e-3 over
    // the same chain of f32 reductions, a log-sum-exp moving by at most its
    // largest input's error), weighted and averaged: at most 7.6e-3 apart
    // relatively, and measured far below that.
    let loss = output.loss.double_value(&[]) * scale;
    let reference_loss = take(&mut reference, "loss")?.double_value(&[0]);
    let relative_loss_bound = 31.0 * gamma(64) * 8.0 * 8.0;
    let loss_bound = relative_loss_bound * reference_loss.abs();
    assert!(
        (loss - reference_loss).abs() < loss_bound,
        "loss {loss} (ours × Σw/N), speculators {reference_loss}, bound {loss_bound}"
    );
    let selector = output
        .selector
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no selector terms for a DFlash2 model"))?;
    for (name, ours) in [
        (
            "unary_loss",
            selector.unary_weighted_cross_entropy / supervised,
        ),
        (
            "selector_loss",
            selector.selector_weighted_cross_entropy / supervised,
        ),
    ] {
        let theirs = take(&mut reference, name)?.double_value(&[0]);
        assert!(
            (ours - theirs).abs() < relative_loss_bound * theirs.abs(),
            "{name}: {ours}, speculators {theirs}"
        );
    }

    // Gradients: the backward runs the forward's chain of reductions in
    // reverse, each op's backward being a reduction of the same length
    // (n ≤ 64) as its forward: twice the forward's 31 reductions, each off
    // by γ_64 relative to the magnitudes it sums, amplified by at most 8
    // through a normalisation on either side as in the forward's bound:
    // 62 × γ_64 × 8 × 8 ≈ 1.5e-2, taken relative to the tensor's largest
    // gradient (gradient entries cancel; their scale is the largest).
    output.loss.multiply_scalar(scale).backward();
    let gradient_bound = 62.0 * gamma(64) * 8.0 * 8.0;
    let variables = model.var_store().variables();
    let mut worst: (f64, String) = (0.0, String::new());
    let mut compared = 0;
    for (name, expected) in reference
        .iter()
        .filter_map(|(name, tensor)| Some((name.strip_prefix("grad.")?, tensor)))
    {
        let variable = variables.get(name).ok_or_else(|| {
            anyhow::anyhow!("speculators has a gradient for {name}, we have no such parameter")
        })?;
        let gradient = variable.grad();
        assert!(gradient.defined(), "{name} got no gradient");
        let largest = expected.abs().max().double_value(&[]);
        let difference = (&gradient - expected).abs().max().double_value(&[]);
        let relative = difference / largest.max(f64::MIN_POSITIVE);
        assert!(
            relative < gradient_bound,
            "gradient of {name}: max |Δ| {difference} over its largest {largest} ({relative:.2e} > {gradient_bound:.2e})"
        );
        if relative > worst.0 {
            worst = (relative, name.to_string());
        }
        compared += 1;
    }
    // Every trained parameter, none left out.
    assert_eq!(
        compared,
        variables.len(),
        "parameters without a reference gradient"
    );
    println!(
        "loss {loss:.7} vs {reference_loss:.7}; {compared} gradients, worst relative max |Δ| {:.2e} ({}), bound {gradient_bound:.2e}",
        worst.0, worst.1
    );
    Ok(())
}
