//! The DFlash draft model (arXiv 2602.06036) and its DFlash2 variant
//! (`dflash` 0.1.0's `DFlash2DraftModel`: grouped dynamic convolutions in
//! every layer and a candidate selector, switched on by
//! `DraftConfig::dflash2`) and DSpark variant (speculators 0.9.0's
//! `DSparkDraftModel`: a Markov logit-bias head and a confidence head,
//! trained by distillation from the target's distribution, switched on by
//! `DraftConfig::dspark`), their training objective, optimizer and
//! checkpoint format.
//!
//! # Layout
//! Each module depends only on the ones listed before it:
//! - [`error`]: `DraftError`, and `SkippedStep` (why a step was skipped).
//! - [`dspark_config`]: DSpark's keys (`DsparkConfig`, `MarkovHeadType`),
//!   as speculators 0.9.0 names them.
//! - [`config`]: `DraftConfig`, derived from the target's config, and its
//!   `config.json` forms: the reference `dflash` one for DFlash and
//!   DFlash2, speculators' (`speculators_model_type: dspark`) for DSpark.
//! - [`model`]: the network (`fc`, `hidden_norm`, `layers.{i}`, `norm`) over
//!   a `VarStore` named like the reference `state_dict`, with the target's
//!   frozen embedding and LM head. Its children: `model::parameters` (the
//!   checkpoint names and shapes, seeded initialisation, the frozen heads),
//!   `model::forward` (the training forward, plain and checkpointed),
//!   `model::attention` (the three interchangeable attention kernels),
//!   `model::attention_masks` (what each query sees, per kernel),
//!   `model::context_cache` (`DraftContextCache`, the per-layer context keys
//!   and values speculative decoding reuses block after block) and
//!   `model::markov` (DSpark's Markov and confidence heads).
//! - [`objective`]: anchor sampling, block packing, the decayed masked
//!   cross-entropy and per-position accuracy (DSpark: distillation and the
//!   confidence BCE, `objective::dspark`); `compute_objective_backward`
//!   runs forward and backward with chunked logits and optional layer
//!   checkpointing (`ObjectiveMemory`).
//! - [`optim`]: AdamW, warmup + cosine schedule, gradient clipping, with
//!   state that can be saved.
//! - [`trainer`]: micro-batch accumulation and optimizer steps over the
//!   above, plus checkpoint save and resume; no queue, no threads. Its
//!   child `trainer::data_parallel` packs one member's share of a
//!   data-parallel step and applies the reduced one.
//! - [`checkpoint`]: atomic save / load of `model.safetensors`,
//!   `config.json` (loadable by `dflash`'s `DFlashDraftModel.from_pretrained`,
//!   DSpark's by speculators' `DSparkDraftModel.from_pretrained`)
//!   and the optimizer/trainer state for resuming.
//! - [`step_dirs`]: a drafter's output folder: `step_N` directories, the
//!   `latest` pointer, pruning.
//!
//! Nothing here knows about the broker or threads: the drafter-server drives
//! it from its own training thread.

pub mod checkpoint;
pub mod config;
pub mod dspark_config;
pub mod error;
pub mod model;
pub mod objective;
pub mod optim;
pub mod step_dirs;
pub mod trainer;

pub use checkpoint::{
    draft_model_from_tensors, load_draft_model, load_training_state, model_files,
    save_draft_checkpoint, sorted_parameters, ModelFiles, TrainingProgress, CONFIG_FILE_NAME,
    MODEL_FILE_NAME, OPTIMIZER_FILE_NAME, TRAINER_STATE_FILE_NAME,
};
pub use config::{
    build_target_layer_ids, Dflash2Config, DraftConfig, DraftOptions, TargetDimensions,
    DFLASH2_ARCHITECTURE, DFLASH_ARCHITECTURE, DSPARK_ARCHITECTURE,
};
pub use dspark_config::{DsparkConfig, MarkovHeadType};
pub use error::{DraftError, SkippedStep};
pub use model::{
    AttentionImplementation, BlockInputs, DraftContextCache, DraftModel, DsparkBlockHeads,
    DsparkPositionHeads, FrozenTargetHeads, MarkovState, SelectorPath,
    DEFAULT_BLOCKS_PER_ATTENTION_CHUNK, HIDDEN_PROJECTION_NAME, PREDECESSOR_CODEBOOK_NAME,
    SUCCESSOR_CODEBOOK_NAME,
};
pub use objective::{
    accuracy_ratios, compute_objective, compute_objective_backward, default_loss_decay_gamma,
    overall_accuracy, pack_batch, sample_anchors, selector_training_candidates, BackwardOutput,
    DsparkTotals, ObjectiveMemory, ObjectiveOutput, PackedBatch, SelectorTotals, TrainingSequence,
};
pub use optim::{AdamW, AdamWSettings, LearningRateSchedule};
pub use trainer::data_parallel::{Contribution, Exclusion, ReducedStep};
pub use trainer::{
    DraftTrainer, DsparkReport, MicroBatchReport, SelectorReport, StepReport, TrainerSettings,
    DEFAULT_GRAD_NORM_SPIKE_RATIO, DEFAULT_LOGITS_CHUNK_BLOCKS, GRAD_NORM_WARMUP, GRAD_NORM_WINDOW,
};
