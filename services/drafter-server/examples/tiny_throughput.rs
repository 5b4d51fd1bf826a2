//! Training throughput of the DFlash drafter on the CPU for the tiny target
//! (hidden 64, 8 layers, vocab 512) with the default draft recipe (5 draft
//! layers, block 16, up to 512 anchors per sequence).
//!
//! `cargo run --release -p dflash-drafter-server --example tiny_throughput [SEQ_LEN] [SEQS_PER_STEP] [STEPS] [NUM_ANCHORS]`

use std::time::Instant;

use dflash_model::draft::{
    DraftConfig, DraftModel, DraftOptions, DraftTrainer, FrozenTargetHeads, TargetDimensions,
    TrainerSettings, TrainingSequence,
};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_model::tokens::mask_token_id;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

fn main() -> anyhow::Result<()> {
    let arguments: Vec<usize> = std::env::args()
        .skip(1)
        .map(|value| value.parse())
        .collect::<Result<_, _>>()?;
    let sequence_length = arguments.first().copied().unwrap_or(512);
    let sequences_per_step = arguments.get(1).copied().unwrap_or(8);
    let steps = arguments.get(2).copied().unwrap_or(20);
    let num_anchors = arguments.get(3).copied().unwrap_or(512);

    let target_dir = tempfile::tempdir()?;
    write_tiny_model(target_dir.path(), &TinyModelSpec::default())?;
    let (target_config, frozen) =
        FrozenTargetHeads::load(target_dir.path(), Device::Cpu, Kind::Float)?;
    let options = DraftOptions {
        mask_token_id: mask_token_id(target_dir.path())?,
        ..DraftOptions::default()
    };
    let config = DraftConfig::for_target(&TargetDimensions::from(&target_config), &options)?;
    let width = config.target_hidden_width();
    let model = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 0)?;
    let mut settings = TrainerSettings::recipe_defaults(16, steps as u64);
    settings.num_anchors = num_anchors;
    let mut trainer = DraftTrainer::new(model, settings);

    let mut generator = StdRng::seed_from_u64(0);
    let batches: Vec<Vec<TrainingSequence>> = (0..2)
        .map(|_| {
            (0..sequences_per_step)
                .map(|_| TrainingSequence {
                    target_last_hidden: None,
                    input_ids: (0..sequence_length)
                        .map(|_| generator.random_range(3..500))
                        .collect(),
                    loss_mask: (0..sequence_length)
                        .map(|position| u8::from(position >= sequence_length / 4))
                        .collect(),
                    target_hidden: Tensor::randn(
                        [sequence_length as i64, width],
                        (Kind::BFloat16, Device::Cpu),
                    ),
                })
                .collect()
        })
        .collect();
    // One warm-up step, then the timed ones.
    trainer.accumulate(&batches[0])?;
    let first = trainer.step()?;
    let started = Instant::now();
    let mut last = first.clone();
    for step in 0..steps {
        trainer.accumulate(&batches[step % 2])?;
        last = trainer.step()?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let tokens = (steps * sequences_per_step * sequence_length) as f64;
    println!(
        "tiny target, 5 draft layers, block 16, {num_anchors} anchors, {sequences_per_step} × {sequence_length} tokens per step, \
         {} threads: {:.0} tokens/s ({:.1} ms per step); loss {:.3} -> {:.3}",
        tch::get_num_threads(),
        tokens / seconds,
        seconds * 1000.0 / steps as f64,
        first.loss,
        last.loss
    );
    Ok(())
}
