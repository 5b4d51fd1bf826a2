//! Writes a trained tiny DFlash2 checkpoint plus `forward_check.safetensors`
//! (the frozen heads, one block's inputs and this crate's draft hidden
//! states and greedy selector path for it), for `scripts/check-dflash2.sh`
//! to load with `dflash`'s `DFlash2DraftModel.from_pretrained` and compare.
//!
//!     cargo run -p dflash-model --example dflash2_checkpoint -- OUTPUT_DIR

use std::path::PathBuf;

use anyhow::Context;
use dflash_model::draft::checkpoint::write_safetensors;
use dflash_model::draft::{
    pack_batch, BlockInputs, Dflash2Config, DraftConfig, DraftModel, DraftOptions, DraftTrainer,
    FrozenTargetHeads, TargetDimensions, TrainerSettings, TrainingSequence,
};
use dflash_model::layers::RopeParams;
use tch::{Device, Kind, Tensor};

const VOCAB: i64 = 64;
const HIDDEN: i64 = 32;
const LENGTH: i64 = 24;

fn main() -> anyhow::Result<()> {
    let output = PathBuf::from(
        std::env::args()
            .nth(1)
            .context("usage: dflash2_checkpoint OUTPUT_DIR")?,
    );
    tch::manual_seed(7);
    let target = TargetDimensions {
        hidden_size: HIDDEN,
        intermediate_size: 64,
        num_hidden_layers: 6,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope: RopeParams::plain(10_000.0),
        vocab_size: VOCAB,
        max_position_embeddings: 256,
    };
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(4),
        mask_token_id: VOCAB - 1,
        target_layer_ids: None,
    };
    let config = DraftConfig::for_target(&target, &options)?.with_dflash2(Dflash2Config {
        conv_group_size: 8,
        selector_rank: 16,
        selector_top_k: 8,
        ..Dflash2Config::default()
    })?;
    let heads = || FrozenTargetHeads {
        embed_tokens: Tensor::randn([VOCAB, HIDDEN], (Kind::Float, Device::Cpu)),
        lm_head: Tensor::randn([VOCAB, HIDDEN], (Kind::Float, Device::Cpu)) * 0.5,
    };
    let frozen = heads();
    let frozen_copy = FrozenTargetHeads {
        embed_tokens: frozen.embed_tokens.copy(),
        lm_head: frozen.lm_head.copy(),
    };
    let width = config.target_hidden_width();
    let model = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 5)?;
    let mut settings = TrainerSettings::recipe_defaults(4, 5);
    settings.num_anchors = 8;
    settings.schedule.peak_learning_rate = 1e-2;
    let mut trainer = DraftTrainer::new(model, settings);
    let input_ids: Vec<i64> = (0..LENGTH).map(|position| (position * 7) % 11).collect();
    let sequence = || TrainingSequence {
        target_last_hidden: None,
        input_ids: input_ids.clone(),
        loss_mask: vec![1; LENGTH as usize],
        target_hidden: Tensor::randn([LENGTH, width], (Kind::Float, Device::Cpu)),
    };
    for _ in 0..5 {
        trainer.accumulate(&[sequence(), sequence()])?;
        let report = trainer.step()?;
        println!(
            "step {}: loss {:.4} selector {:?}",
            report.step, report.loss, report.selector
        );
    }
    trainer.save_checkpoint(&output)?;

    // One block at anchor 9 over the context before it.
    let model = trainer.model();
    let anchor = 9i64;
    let checked = sequence();
    let batch = pack_batch(std::slice::from_ref(&checked), &[vec![anchor]])?;
    let mut block_ids = vec![VOCAB - 1; 4];
    block_ids[0] = input_ids[anchor as usize];
    let block = Tensor::from_slice(&block_ids).view([1, 1, 4]);
    let hidden = tch::no_grad(|| {
        model.forward_blocks(&BlockInputs {
            target_hidden: &batch.target_hidden,
            block_token_ids: &block,
            anchor_positions: &Tensor::from_slice(&[anchor]).view([1, 1]),
        })
    })?
    .view([1, 4, HIDDEN]);
    let path = tch::no_grad(|| {
        model.select_greedy(
            &hidden.narrow(1, 1, 3),
            &Tensor::from_slice(&block_ids[..1]),
        )
    })?;
    write_safetensors(
        &output.join("forward_check.safetensors"),
        &[
            ("embed_tokens".to_string(), frozen_copy.embed_tokens),
            ("lm_head".to_string(), frozen_copy.lm_head),
            ("target_hidden".to_string(), checked.target_hidden),
            ("anchor".to_string(), Tensor::from_slice(&[anchor])),
            ("block_ids".to_string(), Tensor::from_slice(&block_ids)),
            ("draft_hidden".to_string(), hidden.get(0)),
            ("selector_path".to_string(), path.tokens.get(0)),
        ],
    )?;
    println!("wrote {}", output.display());
    Ok(())
}
