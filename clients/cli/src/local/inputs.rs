//! What the children run on, made ready before any of them starts: the
//! work directory, the model (given, or the embedded tiny one written
//! here), the drafters' mask token (resolved now, so a model without one
//! fails before the targets have worked for nothing) and the data (given,
//! or demo data the tiny target generates). Apart from `launch`, which only
//! turns these into flags.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::args::LocalArgs;
use crate::demo::{self, DemoSpec};

/// The work directory (created, made absolute) and its `logs` folder.
pub(super) fn prepare_workdir(args: &LocalArgs) -> anyhow::Result<(PathBuf, PathBuf)> {
    let workdir = match &args.workdir {
        Some(workdir) => workdir.clone(),
        None => {
            let seconds = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            PathBuf::from(format!("runs/local-{seconds}"))
        }
    };
    let logs = workdir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let workdir = workdir.canonicalize().unwrap_or(workdir);
    let logs = workdir.join("logs");
    Ok((workdir, logs))
}

/// What the children run on: the model, the drafters' mask token and the
/// data, given or made by [`prepare_inputs`].
pub(super) struct Inputs {
    pub(super) model_dir: Option<PathBuf>,
    /// The embedded tiny default is used (its own target and drafter flags).
    pub(super) embedded_model: bool,
    /// The drafters' mask token id and where it came from.
    pub(super) mask_token: Option<(i64, String)>,
    pub(super) data: Option<PathBuf>,
    pub(super) held_out: Option<PathBuf>,
}

/// The model and data: what was given, or the embedded tiny default and
/// demo data it generates. Exits the process when interrupted while
/// generating (nothing else was started yet).
pub(super) async fn prepare_inputs(
    args: &LocalArgs,
    workdir: &Path,
    interrupt: &CancellationToken,
) -> anyhow::Result<Inputs> {
    let embedded_model = args.model.is_none() && !args.synthetic;
    let model_dir = match &args.model {
        Some(model) => Some(model.clone()),
        None if args.synthetic => None,
        None => {
            let directory = workdir.join("model");
            dflash_model::tiny::write_tiny_model(
                &directory,
                &dflash_model::tiny::TinyModelSpec::default(),
            )
            .with_context(|| format!("writing the tiny model to {}", directory.display()))?;
            Some(directory)
        }
    };
    // The drafters' mask token, checked now rather than when the drafters
    // first need it (after the targets have produced everything).
    let mask_token = match (&model_dir, args.synthetic) {
        (Some(model_dir), false) => Some(resolve_mask_token(model_dir, args.mask_token_id)?),
        _ => None,
    };
    if let Some((id, source)) = &mask_token {
        println!("dflash local: mask token id {id} ({source}; override with --mask-token-id)");
    }
    let (data, held_out) = match (&args.data, &model_dir) {
        (Some(data), _) => (Some(data.clone()), args.held_out.clone()),
        (None, Some(model_dir)) => {
            let generated = generate_demo_data(args, model_dir, workdir, interrupt).await?;
            (
                Some(generated.train),
                args.held_out.clone().or(Some(generated.held_out)),
            )
        }
        (None, None) => (None, None),
    };
    Ok(Inputs {
        model_dir,
        embedded_model,
        mask_token,
        data,
        held_out,
    })
}

async fn generate_demo_data(
    args: &LocalArgs,
    model_dir: &Path,
    workdir: &Path,
    interrupt: &CancellationToken,
) -> anyhow::Result<demo::DemoData> {
    let spec = DemoSpec {
        unique_sequences: args.demo_sequences,
        epochs: args.demo_epochs,
        held_out_prompts: args.demo_held_out,
        ..DemoSpec::default()
    };
    println!(
        "dflash local: generating {} demo sequences of {} tokens with the target (batched, KV cache; {}x in train.jsonl) ...",
        spec.unique_sequences,
        spec.prompt_tokens + spec.continuation_tokens,
        spec.epochs
    );
    let (model, out) = (model_dir.to_path_buf(), workdir.join("data"));
    let generation =
        tokio::task::spawn_blocking(move || demo::write_demo_data(&model, &out, &spec));
    tokio::select! {
        generated = generation => Ok(generated.context("demo data thread")??),
        () = interrupt.cancelled() => {
            // Nothing else was started; the generation thread cannot
            // be joined early (the runtime would wait for it), so end here.
            println!("dflash local: interrupted while generating the demo data; nothing else was started");
            std::process::exit(i32::from(dflash_shell::Exit::Interrupted.code()));
        }
    }
}

/// The drafters' mask token: `--mask-token-id` when given, else the
/// model's default (see [`LocalArgs::mask_token_id`]), with where it came
/// from; an error naming the model when it has neither.
fn resolve_mask_token(model_dir: &Path, given: Option<i64>) -> anyhow::Result<(i64, String)> {
    if let Some(id) = given {
        return Ok((id, "--mask-token-id".to_string()));
    }
    let (id, source) = dflash_model::tokens::default_mask_token_id(model_dir)
        .with_context(|| format!("the mask token of {}", model_dir.display()))?;
    Ok((id, source.to_string()))
}
