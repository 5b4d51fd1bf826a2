//! The trained model's quality after the pipeline: τ (mean acceptance
//! length) of the first drafter's final checkpoint and of an untrained
//! drafter of the same configuration on the held-out prompts, τ of the
//! broker's model when the drafters synced, and whether the model's
//! weights are finite. Apart from `summary`, which only reports these
//! figures: the evaluation runs libtorch, on blocking threads.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::inputs::Inputs;
use crate::demo;

/// The τ measurements after the pipeline.
#[derive(Debug, Default)]
pub(super) struct Taus {
    pub(super) acceptance_length: Option<f64>,
    pub(super) untrained_acceptance_length: Option<f64>,
    pub(super) acceptance_length_drafter: Option<String>,
    pub(super) model_acceptance_length: Option<f64>,
    pub(super) tokens_per_target_forward: Option<f64>,
    pub(super) held_out_prompts: usize,
}

/// τ of the first drafter's final checkpoint (and of an untrained drafter
/// of the same configuration) on the held-out prompts, and of the shared
/// model when the drafters synced.
pub(super) async fn measure_taus(
    inputs: &Inputs,
    checkpoint: Option<PathBuf>,
    workdir: &Path,
) -> anyhow::Result<Taus> {
    let mut taus = Taus::default();
    let (Some(model_dir), Some(held_out)) = (&inputs.model_dir, &inputs.held_out) else {
        return Ok(taus);
    };
    // Speculative decoding of one prompt runs tiny ops, for which libtorch's
    // intra-op threads cost more than they save: the same 16-prompt eval on
    // the loaded 2-core machine took 64.8 s with 2 threads, 9.2 s with 1.
    tch::set_num_threads(1);
    if let Some(checkpoint) = checkpoint {
        let prompts = demo::read_prompts(held_out, model_dir)?;
        taus.held_out_prompts = prompts.len();
        let model_dir = model_dir.clone();
        let checkpoint_for_eval = checkpoint.clone();
        let baseline_dir = workdir.join("untrained-drafter");
        let (trained, untrained) = tokio::task::spawn_blocking(move || {
            let trained = dflash_model::eval::evaluate(
                &model_dir,
                &checkpoint_for_eval,
                &prompts,
                40,
                tch::Device::Cpu,
            )
            .context("evaluating the trained drafter")?;
            let baseline = dflash_model::eval::write_untrained_baseline(
                &model_dir,
                &checkpoint_for_eval,
                &baseline_dir,
            )?;
            let untrained =
                dflash_model::eval::evaluate(&model_dir, &baseline, &prompts, 40, tch::Device::Cpu)
                    .context("evaluating the untrained baseline")?;
            anyhow::Ok((trained, untrained))
        })
        .await
        .context("evaluation thread")??;
        taus.acceptance_length = Some(trained.mean_acceptance_length);
        taus.tokens_per_target_forward = Some(trained.tokens_per_target_forward());
        taus.untrained_acceptance_length = Some(untrained.mean_acceptance_length);
        taus.acceptance_length_drafter = Some(checkpoint.display().to_string());
    }
    // τ of the one model the drafters trained together (model sync).
    taus.model_acceptance_length =
        model_tau(model_dir, held_out, &workdir.join("run-model")).await?;
    Ok(taus)
}

/// Whether every weight of the run's model checkpoint is finite; `None` when no
/// model was written (independent drafters).
pub(super) fn model_is_finite(model: &Path) -> anyhow::Result<Option<bool>> {
    let weights = model.join("model.safetensors");
    if !weights.is_file() {
        return Ok(None);
    }
    let tensors = tch::Tensor::read_safetensors(&weights)
        .with_context(|| format!("reading {}", weights.display()))?;
    Ok(Some(tensors.iter().all(|(_, tensor)| {
        tensor.isfinite().all().int64_value(&[]) == 1
    })))
}

/// τ of the broker's checkpoint of the run's model on the held-out prompts; `None` when
/// the drafters did not sync (no model written).
async fn model_tau(model_dir: &Path, held_out: &Path, model: &Path) -> anyhow::Result<Option<f64>> {
    if !model.join("model.safetensors").is_file() {
        return Ok(None);
    }
    let prompts = demo::read_prompts(held_out, model_dir)?;
    let (model_dir, model) = (model_dir.to_path_buf(), model.to_path_buf());
    let report = tokio::task::spawn_blocking(move || {
        dflash_model::eval::evaluate(&model_dir, &model, &prompts, 40, tch::Device::Cpu)
    })
    .await
    .context("evaluation thread")?
    .context("evaluating the run's model")?;
    Ok(Some(report.mean_acceptance_length))
}
