//! The quality comparison, made deterministic: N drafters that
//! train one model through the broker's model sync against one drafter
//! trained on every sample alone and N independent drafters
//! (`--sync-every 0`), the same samples for each. The test asserts the
//! 3-drafter case on seeds 0, 1 and 2: the center within 5 % of the one
//! drafter's τ, and clearly above every independent drafter. The ignored `study` test is the harness
//! the outer optimizer's defaults were chosen with (`make study`): 1, 2, 3,
//! 4 and 8 drafters on the same samples and several seeds, one table.
//!
//! Async timing decides, in a real run, which drafter trains which sample
//! and when each delta lands, so repeated runs spread (the asynchronous
//! test in `model_sync.rs` saw the center's held-out loss at 0.95 to 1.16 of
//! one drafter's). Here the test itself is the scheduler: the real engines
//! (`build_engine`, the drafter's own training code, on the run-wide
//! learning-rate schedule and the asynchronous β1), the real sync links
//! over gRPC to a real in-process broker (its outer step), in a fixed
//! interleaving (one step per drafter in turn, samples dealt round robin as
//! the queue deals them) with fixed seeds, and libtorch on one thread.
//! Every run of this test computes the same numbers.
//!
//! τ is measured by real speculative decoding (`eval`) on held-out prompts
//! that the target continues greedily, as `dflash eval` does.
//!
//! Knobs: `DFLASH_SYNC_QUALITY_{SEEDS,LR,EPOCHS,SEQUENCES,SYNC_EVERY,MOMENTUM,OUTER_LR,
//! MOMENTUM_DELAY,STALENESS_SCALING,INNER_LR_EXPONENT,LR_SCALING,INNER_BETA1,DRAFTERS,ADAM_BETA1,BATCH,
//! BATCH_SCALING,HELD_OUT}`
//! override the settings below; the study also reads
//! `DFLASH_STUDY_{DRAFTERS,SEEDS}` (comma-separated lists) and
//! `DFLASH_STUDY_{INITS,CEILING_LR_EXPONENT,CENTER_ONLY}`. `-- --nocapture`
//! prints τ and the loss curves.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use common::*;
use dflash_broker::model_sync::StalenessScaling;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::engine::{build_engine, RunSchedule, TrainingEngine};
use dflash_drafter_server::model_sync::{ModelSyncLink, SyncConfig};
use dflash_drafter_server::schedule::{shared_step_limits, RunClock, StepLimits};
use dflash_drafter_server::schedule::{SyncBatchScaling, SyncLrScaling};
use dflash_drafter_server::DrafterServerConfig;
use dflash_model::draft::save_draft_checkpoint;
use dflash_model::eval::{evaluate_with_options, EvalOptions};
use dflash_model::generate::{generate, GenerationOptions, GenerationRequest};
use dflash_model::target_model::TargetModel;
use dflash_proto::v1 as proto;
use tch::{Device, Kind};

const PROMPT_LENGTH: usize = 6;
const CONTINUATION: usize = 24;
const BLOCK_SIZE: i64 = 8;
/// Distinct training sequences, seen `EPOCHS` times by the run.
const TRAIN_SEQUENCES: usize = 640;
const EPOCHS: usize = 6;
/// Samples per optimizer step, the same for every drafter.
const BATCH: usize = 16;
const SYNC_EVERY: u64 = 1;
const HELD_OUT_PROMPTS: usize = 16;
const MAX_NEW_TOKENS: usize = 32;
/// A third of the tiny demo's 3e-3 (the study measures both).
const LEARNING_RATE: f64 = 1e-3;

/// A sweep knob: `DFLASH_SYNC_QUALITY_<NAME>` when set, else `default`.
fn knob(name: &str, default: f64) -> f64 {
    std::env::var(format!("DFLASH_SYNC_QUALITY_{name}"))
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// A flag's value by its name (`DFLASH_SYNC_QUALITY_<NAME>`, as the flag
/// takes it) when set, else `default`.
fn choice<T: clap::ValueEnum>(name: &str, default: T) -> T {
    std::env::var(format!("DFLASH_SYNC_QUALITY_{name}")).map_or(default, |value| {
        T::from_str(&value, true)
            .unwrap_or_else(|error| panic!("DFLASH_SYNC_QUALITY_{name}={value}: {error}"))
    })
}

/// A comma-separated list from `variable`, else `default`.
fn list(variable: &str, default: &[u64]) -> Vec<u64> {
    std::env::var(variable)
        .ok()
        .map(|value| {
            value
                .split(',')
                .map(|item| item.trim().parse().expect("a list of integers"))
                .collect()
        })
        .unwrap_or_else(|| default.to_vec())
}

/// The run's training settings, the same for every way of spending it.
#[derive(Debug, Clone, Copy)]
struct Setting {
    /// The data and drafter seeds.
    seed: u64,
    learning_rate: f64,
    epochs: usize,
    /// Optimizer steps between a synced drafter's exchanges.
    sync_every: u64,
    /// Samples per optimizer step of each drafter.
    batch: usize,
    /// Distinct training sequences, each seen `epochs` times.
    sequences: usize,
    adam_beta1: f64,
    /// Which initialisation of the drafters: drafter i's seed is
    /// `seed + 100·init + i` (the data stays the seed's).
    init: u64,
}

impl Setting {
    fn from_env(seed: u64) -> Setting {
        Setting {
            seed,
            learning_rate: knob("LR", LEARNING_RATE),
            epochs: knob("EPOCHS", EPOCHS as f64) as usize,
            sync_every: knob("SYNC_EVERY", SYNC_EVERY as f64) as u64,
            batch: knob("BATCH", BATCH as f64) as usize,
            sequences: knob("SEQUENCES", TRAIN_SEQUENCES as f64) as usize,
            adam_beta1: knob("ADAM_BETA1", 0.9),
            init: 0,
        }
    }
}

/// How N drafters train the one model: the broker's outer step and the
/// drafters' own learning rate.
#[derive(Debug, Clone, Copy)]
struct Method {
    outer_learning_rate: f32,
    momentum: f32,
    /// Deltas per delayed Nesterov step (0: the open sessions).
    momentum_delay: u32,
    staleness_scaling: StalenessScaling,
    /// Each of N drafters trains at the run's learning rate × N^this.
    inner_lr_exponent: f64,
    /// The synced drafters' `--sync-lr-scaling` (by N as measured).
    lr_scaling: SyncLrScaling,
    /// The synced drafters' `--sync-batch-scaling` (by N as measured).
    batch_scaling: SyncBatchScaling,
    /// The synced drafters' `--sync-adam-beta1` (the cap on β1^N while
    /// sharing); `None`: the drafter's default.
    inner_beta1: Option<f64>,
    /// Synchronous rounds only: every drafter starts each round from the
    /// center after the last round (a barrier), or (`DFLASH_STUDY_NO_BARRIER`)
    /// from the center it got back when it sent its own, one round older
    /// for all but the round's last drafter (as a broker that replies at
    /// once would have it).
    barrier: bool,
}

impl Method {
    /// The broker's defaults, each overridable by its knob.
    fn from_env() -> Method {
        let defaults = BrokerConfig::for_targets(1).model_sync;
        let drafter = DrafterServerConfig::with_defaults("", "", PathBuf::new());
        Method {
            outer_learning_rate: knob("OUTER_LR", defaults.outer_learning_rate.into()) as f32,
            momentum: knob("MOMENTUM", defaults.outer_momentum.into()) as f32,
            momentum_delay: knob("MOMENTUM_DELAY", defaults.outer_momentum_delay.into()) as u32,
            staleness_scaling: choice("STALENESS_SCALING", defaults.outer_staleness_scaling),
            inner_lr_exponent: knob("INNER_LR_EXPONENT", 0.0),
            lr_scaling: choice("LR_SCALING", drafter.sync_lr_scaling),
            batch_scaling: choice("BATCH_SCALING", drafter.sync_batch_scaling),
            inner_beta1: std::env::var("DFLASH_SYNC_QUALITY_INNER_BETA1")
                .ok()
                .map(|value| value.parse().expect("a number")),
            barrier: std::env::var_os("DFLASH_STUDY_NO_BARRIER").is_none(),
        }
    }

    fn describe(&self) -> String {
        format!(
            "outer lr {}, momentum {} (delay {}), staleness scaling {}, inner lr x N^{}, synced drafters' lr scaling {:?}, batch scaling {:?}, beta1 cap {}; rounds: barrier {}",
            self.outer_learning_rate,
            self.momentum,
            match self.momentum_delay {
                0 => "N".to_string(),
                delay => delay.to_string(),
            },
            self.staleness_scaling.name(),
            self.inner_lr_exponent,
            self.lr_scaling,
            self.batch_scaling,
            self.inner_beta1
                .map_or_else(|| "the default".to_string(), |beta1| beta1.to_string()),
            self.barrier
        )
    }

    /// A broker whose center follows this method.
    fn broker_config(&self) -> BrokerConfig {
        let mut config = BrokerConfig::for_targets(1);
        config.model_sync.outer_learning_rate = self.outer_learning_rate;
        config.model_sync.outer_momentum = self.momentum;
        config.model_sync.outer_momentum_delay = self.momentum_delay;
        config.model_sync.outer_staleness_scaling = self.staleness_scaling;
        config
    }
}

/// Prompts continued greedily by the tiny target: the data a drafter is
/// meant to imitate (as `dflash local`'s demo data).
fn self_generated(target: &TargetModel, count: usize, seed: u64) -> Vec<Vec<i64>> {
    let prompts = random_token_sequences(count, PROMPT_LENGTH, seed);
    let requests: Vec<GenerationRequest> = GenerationRequest::numbered(&prompts);
    let options = GenerationOptions {
        max_new_tokens: CONTINUATION,
        ..GenerationOptions::default()
    };
    let generated = generate(target, &requests, &options, 4096, |_, _| {}).unwrap();
    prompts
        .into_iter()
        .zip(generated)
        .map(|(mut prompt, generated)| {
            prompt.extend(generated.tokens);
            prompt
        })
        .collect()
}

fn drafter_config(id: &str, work: &Path, setting: &Setting, seed: u64) -> DrafterServerConfig {
    let mut config = test_drafter_config(id, "http://127.0.0.1:1", work.join(id));
    config.block_size = BLOCK_SIZE;
    config.num_anchors = 32;
    config.learning_rate = setting.learning_rate;
    config.adam_beta1 = setting.adam_beta1;
    config.max_step_samples = setting.batch;
    config.seed = seed;
    config
}

/// Drafter `index`'s id and config: its seed is `seed + 100·init + index`.
fn nth_drafter(work: &Path, setting: &Setting, index: usize) -> (String, DrafterServerConfig) {
    let id = format!("drafter-{index}");
    let config = drafter_config(
        &id,
        work,
        setting,
        setting.seed + 100 * setting.init + index as u64,
    );
    (id, config)
}

/// One drafter as the test drives it.
struct Trainee {
    engine: Box<dyn TrainingEngine>,
    link: Option<ModelSyncLink>,
    /// Its share of the run, in the order it trains on it.
    stream: Vec<proto::Sample>,
    losses: Vec<f64>,
    learning_rates: Vec<f64>,
}

/// A trainee's parameters by name (handles to its model's tensors).
fn variables(trainee: &Trainee) -> std::collections::HashMap<String, tch::Tensor> {
    trainee
        .engine
        .draft_model()
        .unwrap()
        .var_store()
        .variables()
}

/// How a run's drafters relate.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Independent,
    /// Through a broker at this address.
    Synced,
    /// Synchronous rounds, done by the test without a broker: every
    /// drafter steps from the same weights, then all move to those weights
    /// plus the outer learning rate × the mean of their deltas (DiLoCo's
    /// synchronous outer step, momentum 0), each at the run's schedule and
    /// its share of the batch by `--sync-batch-scaling`.
    Rounds,
}

/// What a run produced.
struct RunResult {
    /// Each drafter's own final weights.
    drafters: Vec<PathBuf>,
    /// The center, for synced runs.
    center: Option<PathBuf>,
    /// Loss of every step, per drafter.
    losses: Vec<Vec<f64>>,
    learning_rates: Vec<Vec<f64>>,
}

/// Samples per step of a drafter among `sharing` (as the drafter-server's
/// training loop sizes it by `--sync-batch-scaling`), one drafter's being
/// `batch`.
fn step_share(batch: usize, sharing: f64, scaling: SyncBatchScaling) -> usize {
    let one = StepLimits {
        batch_tokens: usize::MAX,
        grad_accumulation: 1,
        max_step_samples: batch,
    };
    shared_step_limits(one, sharing, scaling).max_step_samples
}

/// Trains `drafters` drafters on `run` (the run's samples in queue order,
/// dealt round robin), one step each in turn. Synced drafters exchange with
/// a fresh broker following `method`, served on `runtime` (this thread must
/// not be one of its workers).
fn train(
    work: &Path,
    runtime: &tokio::runtime::Handle,
    setting: &Setting,
    method: &Method,
    drafters: usize,
    mode: Mode,
    run: &[proto::Sample],
) -> RunResult {
    let steps_per_drafter = run.len().div_ceil(setting.batch * drafters) as u64;
    let sync = SyncConfig {
        sync_every: setting.sync_every,
        ..SyncConfig::default()
    };
    let broker =
        (mode == Mode::Synced).then(|| runtime.block_on(TestBroker::start(method.broker_config())));
    let address = broker.as_ref().map(|broker| broker.address.clone());
    let mut trainees: Vec<Trainee> = (0..drafters)
        .map(|index| {
            let (id, mut config) = nth_drafter(work, setting, index);
            let stream: Vec<proto::Sample> =
                run.iter().skip(index).step_by(drafters).cloned().collect();
            if mode == Mode::Rounds {
                let share = step_share(setting.batch, drafters as f64, method.batch_scaling);
                let steps = run.len().div_ceil(share * drafters) as u64;
                config.total_steps = Some(steps);
                config.learning_rate *= (drafters as f64).powf(method.inner_lr_exponent);
                let engine =
                    build_engine(&config.clone().validate().unwrap().engine, None, steps).unwrap();
                return Trainee {
                    engine,
                    link: None,
                    stream,
                    losses: Vec::new(),
                    learning_rates: Vec::new(),
                };
            }
            match &address {
                None => {
                    // Its own schedule over its own share (what the
                    // estimate from the broker's summary gives).
                    config.total_steps = Some(steps_per_drafter);
                    let engine = build_engine(
                        &config.clone().validate().unwrap().engine,
                        None,
                        steps_per_drafter,
                    )
                    .unwrap();
                    Trainee {
                        engine,
                        link: None,
                        stream,
                        losses: Vec::new(),
                        learning_rates: Vec::new(),
                    }
                }
                Some(address) => {
                    config.total_steps = None;
                    config.learning_rate *= (drafters as f64).powf(method.inner_lr_exponent);
                    config.sync_lr_scaling = method.lr_scaling;
                    config.sync_batch_scaling = method.batch_scaling;
                    config.sync_adam_beta1 = method.inner_beta1.unwrap_or(config.sync_adam_beta1);
                    let mut engine =
                        build_engine(&config.clone().validate().unwrap().engine, None, 1).unwrap();
                    // The run's size, as the async side learns it from the
                    // broker's expected items.
                    let clock = RunClock::new();
                    clock.set_run_samples_total(run.len() as u64);
                    engine.follow_run_schedule(RunSchedule::new(
                        &config.clone().validate().unwrap().schedule,
                        clock.clone(),
                    ));
                    let mut link = ModelSyncLink::new(runtime.clone(), address, &id, &sync)
                        .unwrap()
                        .with_run_clock(clock);
                    link.join(engine.draft_model().unwrap());
                    assert_eq!(link.totals.failures, 0);
                    Trainee {
                        engine,
                        link: Some(link),
                        stream,
                        losses: Vec::new(),
                        learning_rates: Vec::new(),
                    }
                }
            }
        })
        .collect();
    // Samples each drafter has trained on, in its stream's order.
    let mut trained = vec![0; drafters];
    // The synchronous rounds' shared weights, which every drafter starts
    // each round from (drafter 0's initialisation).
    let center: Option<Vec<(String, tch::Tensor)>> = (mode == Mode::Rounds).then(|| {
        let mut variables: Vec<(String, tch::Tensor)> =
            variables(&trainees[0]).into_iter().collect();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        variables
            .into_iter()
            .map(|(name, value)| (name, value.detach().copy()))
            .collect()
    });
    let load = |trainee: &Trainee, center: &[(String, tch::Tensor)]| {
        let variables = variables(trainee);
        tch::no_grad(|| {
            for (name, value) in center {
                variables[name].shallow_clone().copy_(value);
            }
        });
    };
    if let Some(center) = &center {
        for trainee in &trainees {
            load(trainee, center);
        }
    }
    // A round: one step of each drafter with samples left.
    while trainees
        .iter()
        .zip(&trained)
        .any(|(trainee, &done)| done < trainee.stream.len())
    {
        let mut stepped = vec![false; drafters];
        for ((trainee, done), stepped) in trainees
            .iter_mut()
            .zip(trained.iter_mut())
            .zip(stepped.iter_mut())
        {
            // The step a drafter of this run takes: the setting's batch, or
            // its share while it shares the center, as the drafter-server's
            // training loop sizes it (`--sync-batch-scaling`).
            let batch_size = match &trainee.link {
                None if mode == Mode::Rounds => {
                    step_share(setting.batch, drafters as f64, method.batch_scaling)
                }
                None => setting.batch,
                Some(link) => step_share(
                    setting.batch,
                    link.run_clock().state().drafters_sharing,
                    method.batch_scaling,
                ),
            };
            let batch: Vec<_> = trainee
                .stream
                .iter()
                .skip(*done)
                .take(batch_size)
                .map(|sample| trainee.engine.prepare(sample).unwrap())
                .collect();
            if batch.is_empty() {
                continue;
            }
            *done += batch.len();
            *stepped = true;
            trainee.engine.accumulate(batch).unwrap();
            let report = trainee.engine.step().unwrap();
            trainee.losses.push(report.loss);
            trainee.learning_rates.push(report.learning_rate);
            if let Some(link) = trainee.link.as_mut() {
                link.after_step(
                    trainee.engine.draft_model().unwrap(),
                    report.samples,
                    report.tokens,
                );
                assert_eq!(link.totals.failures, 0);
            }
        }
        if let Some(center) = &center {
            // The outer step: the mean of this round's deltas (× the outer
            // learning rate).
            let count = stepped.iter().filter(|&&stepped| stepped).count();
            let before: Vec<tch::Tensor> = center
                .iter()
                .map(|(_, value)| value.detach().copy())
                .collect();
            let means: Vec<tch::Tensor> = tch::no_grad(|| {
                center
                    .iter()
                    .map(|(name, value)| {
                        let mut sum = value.zeros_like();
                        for (trainee, _) in trainees.iter().zip(&stepped).filter(|(_, &s)| s) {
                            let variables = variables(trainee);
                            sum += &variables[name] - value;
                        }
                        sum / count as f64
                    })
                    .collect()
            });
            tch::no_grad(|| {
                for ((_, value), mean) in center.iter().zip(&means) {
                    value
                        .shallow_clone()
                        .copy_(&(value + mean * f64::from(method.outer_learning_rate)));
                }
            });
            let last = stepped.iter().rposition(|&s| s).unwrap();
            for (index, trainee) in trainees.iter().enumerate() {
                if method.barrier || index == last {
                    load(trainee, center);
                } else {
                    let older: Vec<(String, tch::Tensor)> = center
                        .iter()
                        .zip(&before)
                        .map(|((name, _), value)| (name.clone(), value.shallow_clone()))
                        .collect();
                    load(trainee, &older);
                }
            }
        }
    }
    if let Some(center) = &center {
        // The run's model is the last center.
        for trainee in &trainees {
            load(trainee, center);
        }
    }
    let mut drafter_dirs = Vec::new();
    for (index, trainee) in trainees.iter_mut().enumerate() {
        if let Some(link) = trainee.link.as_mut() {
            link.finish(trainee.engine.draft_model().unwrap());
            assert_eq!(link.totals.failures, 0);
        }
        let dir = work.join(format!("drafter-{index}-final"));
        trainee.engine.save_checkpoint(&dir).unwrap();
        drafter_dirs.push(dir);
    }
    let center = if mode == Mode::Rounds {
        // Every drafter holds the last center.
        Some(drafter_dirs[0].clone())
    } else {
        address.as_ref().map(|address| {
            // A drafter joining now receives the center: that is the run's model.
            let observer_config = drafter_config("observer", work, setting, setting.seed + 100);
            let observer =
                build_engine(&observer_config.validate().unwrap().engine, None, 1).unwrap();
            let mut link = ModelSyncLink::new(runtime.clone(), address, "observer", &sync).unwrap();
            link.join(observer.draft_model().unwrap());
            assert_eq!(link.totals.failures, 0);
            let dir = work.join("center");
            save_draft_checkpoint(&dir, observer.draft_model().unwrap(), None).unwrap();
            dir
        })
    };
    if let Some(broker) = broker {
        let status = runtime
            .block_on(broker.status())
            .model_sync
            .unwrap_or_default();
        eprintln!(
            "center: {} deltas applied, {} discarded ({} outliers)",
            status.updates_applied, status.updates_discarded, status.outlier_deltas
        );
        runtime.block_on(broker.stop());
    }
    RunResult {
        drafters: drafter_dirs,
        center,
        losses: trainees.iter().map(|t| t.losses.clone()).collect(),
        learning_rates: trainees.iter().map(|t| t.learning_rates.clone()).collect(),
    }
}

/// One seed's data: the run's samples in queue order and the held-out
/// prompts τ is measured on.
struct Data {
    run: Vec<proto::Sample>,
    held_out: Vec<Vec<i64>>,
}

fn data(setting: &Setting) -> Data {
    let target = TargetModel::load(tiny_target_dir(), Device::Cpu, Kind::Float).unwrap();
    let sequences = self_generated(&target, setting.sequences, 1000 + setting.seed);
    let held_out = random_token_sequences(
        knob("HELD_OUT", HELD_OUT_PROMPTS as f64) as usize,
        PROMPT_LENGTH,
        2000 + setting.seed,
    );
    let samples = target_samples(&sequences);
    // The run: every sequence `epochs` times, epochs in turn.
    let run = (0..setting.epochs).flat_map(|_| samples.clone()).collect();
    Data { run, held_out }
}

/// A runtime for the brokers and sync links, and this (non-worker) thread
/// on one libtorch thread: tiny ops are faster so, and every sum's order is
/// fixed.
fn runtime() -> tokio::runtime::Runtime {
    tch::set_num_threads(1);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn untrained_tau(work: &Path, setting: &Setting, held_out: &[Vec<i64>]) -> f64 {
    let dir = work.join("untrained");
    build_engine(
        &drafter_config("untrained", work, setting, setting.seed)
            .validate()
            .unwrap()
            .engine,
        None,
        1,
    )
    .unwrap()
    .save_checkpoint(&dir)
    .unwrap();
    tau(&dir, held_out)
}

fn tau(checkpoint: &Path, prompts: &[Vec<i64>]) -> f64 {
    let options = EvalOptions {
        max_new_tokens: MAX_NEW_TOKENS,
        stop_token_ids: Vec::new(),
        device: Device::Cpu,
        sampling: dflash_model::sampling::SamplingOptions::greedy(),
        confidence_threshold: None,
    };
    let report = evaluate_with_options(tiny_target_dir(), checkpoint, prompts, &options).unwrap();
    assert_eq!(report.generated_tokens, prompts.len() * MAX_NEW_TOKENS);
    report.mean_acceptance_length
}

/// Loss at a few points of a run: the mean over its drafters of each
/// round's step loss, at 0, ¼, ½, ¾ and the end.
fn loss_curve(losses: &[Vec<f64>]) -> Vec<(usize, f64)> {
    let rounds = losses.iter().map(Vec::len).max().unwrap_or(0);
    [
        0,
        rounds / 4,
        rounds / 2,
        3 * rounds / 4,
        rounds.saturating_sub(1),
    ]
    .into_iter()
    .map(|round| {
        let values: Vec<f64> = losses
            .iter()
            .filter_map(|l| l.get(round))
            .copied()
            .collect();
        (
            round,
            values.iter().sum::<f64>() / values.len().max(1) as f64,
        )
    })
    .collect()
}

/// τ of the three ways to spend the same samples, on the same prompts.
struct Taus {
    untrained: f64,
    alone: f64,
    center: f64,
    independent: Vec<f64>,
}

/// Trains one drafter alone, `drafters` synced drafters and as many
/// independent ones on the same run, and measures τ of each result.
fn measure(drafters: usize, setting: Setting, method: Method) -> Taus {
    let work = tempfile::tempdir().unwrap();
    let work = work.path();
    let runtime = runtime();
    let Data { run, held_out } = data(&setting);
    let handle = runtime.handle();
    let alone = train(
        &work.join("alone"),
        handle,
        &setting,
        &method,
        1,
        Mode::Independent,
        &run,
    );
    let synced = train(
        &work.join("synced"),
        handle,
        &setting,
        &method,
        drafters,
        Mode::Synced,
        &run,
    );
    let independent = train(
        &work.join("independent"),
        handle,
        &setting,
        &method,
        drafters,
        Mode::Independent,
        &run,
    );

    // The run-wide schedule: a synced drafter's last step is at the end of
    // the run's cosine (as the one drafter's last steps), not 1/N of the way
    // in as its own step count would put it. Its position lags the run's by
    // the other drafters' steps since their last sync: fewer than
    // N·2·sync_every steps of one drafter alone.
    let alone_rates = &alone.learning_rates[0];
    let lag = drafters * 2 * setting.sync_every as usize;
    let near_the_end = alone_rates[alone_rates.len() - 1 - lag];
    for rates in &synced.learning_rates {
        let last = *rates.last().unwrap();
        assert!(
            last <= near_the_end,
            "last synced lr {last}, the one drafter's near its end {near_the_end}"
        );
    }

    let taus = Taus {
        untrained: untrained_tau(work, &setting, &held_out),
        alone: tau(&alone.drafters[0], &held_out),
        center: tau(synced.center.as_ref().unwrap(), &held_out),
        independent: independent
            .drafters
            .iter()
            .map(|dir| tau(dir, &held_out))
            .collect(),
    };
    eprintln!("{}", method.describe());
    eprintln!(
        "seed {}: tau untrained {:.3}, one drafter {:.3}, center of {drafters} synced {:.3} \
         (center / one drafter {:.3}), {drafters} independent {:.3?}",
        setting.seed,
        taus.untrained,
        taus.alone,
        taus.center,
        taus.center / taus.alone,
        taus.independent
    );
    eprintln!(
        "loss (round, mean over drafters): one drafter {:.3?}",
        loss_curve(&alone.losses)
    );
    eprintln!("loss: {drafters} synced {:.3?}", loss_curve(&synced.losses));
    eprintln!(
        "loss: {drafters} independent {:.3?}",
        loss_curve(&independent.losses)
    );
    taus
}

/// Measured (the broker's defaults, the drafters' `--sync-adam-beta1`
/// default): see BENCHMARKS.md, "The model-sync study", for the figures
/// per seed and the study this default came from. The goal is on
/// every seed: seeds 0, 1 and 2 (`DFLASH_SYNC_QUALITY_SEEDS` overrides;
/// measured 0.994, 1.166, 1.152).
///
/// What it guards is the method at this setting, not the goal at every
/// learning rate: 1e-3 is far below the one drafter's best (τ 1.517 on
/// seed 0, against 2.82 at 16e-3), and at 4e-3 the 3-drafter center reaches
/// 0.72 of it (BENCHMARKS.md, "The reference's learning rate").
#[test]
fn three_synced_drafters_reach_one_drafters_tau_and_beat_three_independent_ones() {
    let drafters = knob("DRAFTERS", 3.0) as usize;
    for seed in list("DFLASH_SYNC_QUALITY_SEEDS", &[0, 1, 2]) {
        three_synced_drafters_on(drafters, seed);
    }
}

fn three_synced_drafters_on(drafters: usize, seed: u64) {
    let taus = measure(drafters, Setting::from_env(seed), Method::from_env());
    assert!(
        taus.alone > taus.untrained + 0.3,
        "seed {seed}: the run is long enough to learn: tau {} vs untrained {}",
        taus.alone,
        taus.untrained
    );
    // The goal at 2 to 4 drafters: at least 0.95 of one drafter
    // trained on every sample alone. The bound is the goal, not a fit to
    // a measurement. Run-to-run spread on one machine: none (the test is
    // its own scheduler, seeds fixed, libtorch on one thread: every run
    // computes the same numbers). Margin: 0.044 on seed 0 (0.994), 0.2 on
    // seeds 1 and 2 (1.166, 1.152): BENCHMARKS.md's figures, measured
    // again to the digit on a 2-core AVX-512 EPYC. Across CPUs they can move
    // (the 4-drafter test below: 0.823 against 0.752, a 0.07 shift), so
    // seed 0 may miss the goal on some CPU: a failure there says the goal
    // is not met on that machine, which is what it checks.
    assert!(
        taus.center >= 0.95 * taus.alone,
        "seed {seed}: center tau {} below 95 % of one drafter's {}",
        taus.center,
        taus.alone
    );
    // Clearly above each independent drafter: it gains more than twice as
    // much over an untrained drafter (gains are compared: τ ≥ 1 always,
    // and an untrained drafter is right now and then on prompts the target
    // continues by repeating).
    let center_gain = taus.center - taus.untrained;
    for independent in &taus.independent {
        assert!(
            independent - taus.untrained < 0.5 * center_gain,
            "seed {seed}: independent tau {independent} not clearly below the center's {}",
            taus.center
        );
    }
}

/// 4 drafters with `--sync-lr-scaling inverse` and `batch_scaling` at lr
/// 16e-3 (tuned for one drafter), seed 0, against one drafter and 4
/// independent ones.
fn four_drafters_at_one_drafters_rate(batch_scaling: SyncBatchScaling) -> Taus {
    let setting = Setting {
        learning_rate: 16e-3,
        ..Setting::from_env(0)
    };
    let method = Method {
        lr_scaling: SyncLrScaling::Inverse,
        batch_scaling,
        ..Method::from_env()
    };
    measure(4, setting, method)
}

/// `--sync-lr-scaling inverse` at a learning rate tuned for one drafter
/// (16e-3: one drafter's τ 2.80 on seed 0, near its best 2.83 at 32e-3,
/// against 1.52 at the other test's 1e-3): 4 synced drafters, each at
/// that rate over the 4 sharing, train a center above every one of 4
/// independent drafters on their quarter of the samples, as a user who
/// adds drafters expects. Without the scaling the center fell below them
/// (BENCHMARKS.md, "Scaling the learning rate by the drafters sharing":
/// 0.377 of one drafter against their mean 0.454; with it 0.548).
#[test]
fn at_one_drafters_learning_rate_inverse_scaling_keeps_the_center_above_independent_drafters() {
    let taus = four_drafters_at_one_drafters_rate(SyncBatchScaling::None);
    for independent in &taus.independent {
        assert!(
            taus.center > *independent,
            "center tau {} not above an independent drafter's {independent} ({:?})",
            taus.center,
            taus.independent
        );
    }
}

/// `--sync-batch-scaling inverse` beside `--sync-lr-scaling inverse`, at
/// the learning rate of the test above (tuned for one drafter): each of 4
/// drafters steps on a quarter of one drafter's batch at a quarter of its
/// rate, so a round of their 4 steps is one step of one drafter's size and
/// the center takes as many such steps as one drafter alone. Measured on
/// this seed: the center at 0.823 of one drafter's τ (2.307 against
/// 2.802; the independent drafters 1.088–1.438), where the learning-rate
/// scaling alone gave 0.548 (BENCHMARKS.md, "Sharing one drafter's step").
/// Deterministic on one machine, not across CPUs: on an AMD EPYC with
/// AVX-512 the same test measures 0.752 (2.120 against 2.818) while the
/// learning-rate scaling alone gives 0.545 there too (1.536, the same
/// figure on both), so the bound sits between the two, 0.1 from each.
/// About 65 s of CPU in the debug build.
#[test]
fn with_shared_steps_four_drafters_center_nears_one_drafter() {
    let taus = four_drafters_at_one_drafters_rate(SyncBatchScaling::Inverse);
    // What the bound tells apart: shared steps (0.823 on the 2-core
    // machine, 0.752 on a 2-core AVX-512 EPYC, measured again there in
    // issue 43's session) from the learning-rate scaling alone (0.548 and
    // 0.545). Deterministic on one machine (no run-to-run spread); 0.65
    // sits between the two regimes, 0.10 above the one and 0.10 below the
    // lowest figure of the other, the CPUs' 0.07 spread inside that margin.
    assert!(
        taus.center >= 0.65 * taus.alone,
        "center tau {} below 65 % of one drafter's {}",
        taus.center,
        taus.alone
    );
}

/// The study (`make study`, or `cargo test -p dflash-drafter-server --test
/// model_sync_quality -- --ignored study --nocapture`): for each seed of
/// `DFLASH_STUDY_SEEDS` (default 0,1,2), one drafter alone on every sample,
/// then for each N of `DFLASH_STUDY_DRAFTERS` (default 1,2,3,4,8), on the
/// same samples:
/// - N synced drafters, with the method and setting of the knobs (the
///   center);
/// - N independent drafters, each on its 1/N of the samples: what N
///   drafters give without sync, and what one drafter reaches in the same
///   steps (the same wall time when drafters limit the run);
/// - one drafter whose steps take N times the samples (N rounds' samples
///   per step, at the learning rate × N^`DFLASH_STUDY_CEILING_LR_EXPONENT`,
///   default 0.5, Adam's square-root rule): synchronous data parallelism
///   done perfectly, the ceiling of any method that averages N drafters'
///   work taken at one point.
///
/// Each is trained from `DFLASH_STUDY_INITS` initialisations (default 1;
/// the data stays the seed's) and its τ is the mean over them: one
/// drafter's τ on this run moves by up to a fifth with its initialisation
/// alone, so one run per cell cannot tell methods a few percent apart.
///
/// `DFLASH_STUDY_CENTER_ONLY` (set to anything) trains the centers only:
/// the independent drafters and the ceiling do not depend on the method,
/// so a sweep of the method needs them once.
///
/// Prints one line per run as it ends and the table at the end: τ of each
/// over τ of the one drafter, per N and seed, and the wall time.
#[test]
#[ignore = "the study behind the outer optimizer's defaults: minutes per seed"]
fn study() {
    let runtime = runtime();
    let method = Method::from_env();
    let counts = list("DFLASH_STUDY_DRAFTERS", &[1, 2, 3, 4, 8]);
    let seeds = list("DFLASH_STUDY_SEEDS", &[0, 1, 2]);
    let inits = list("DFLASH_STUDY_INITS", &[1])[0].max(1);
    let ceiling_lr_exponent = std::env::var("DFLASH_STUDY_CEILING_LR_EXPONENT")
        .ok()
        .map_or(0.5, |value| value.parse().expect("a number"));
    let center_only = std::env::var_os("DFLASH_STUDY_CENTER_ONLY").is_some();
    let center_mode = if std::env::var_os("DFLASH_STUDY_ROUNDS").is_some() {
        Mode::Rounds
    } else {
        Mode::Synced
    };
    let base = Setting::from_env(0);
    eprintln!(
        "study: {}; lr {}, {} epochs of {} sequences, batch {}, a sync every {} steps; ceiling at lr x N^{ceiling_lr_exponent}; {inits} initialisations",
        method.describe(),
        base.learning_rate,
        base.epochs,
        base.sequences,
        base.batch,
        base.sync_every
    );
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len() as f64;
    // rows[n][s]: (center, independent mean, ceiling) / one drafter for
    // counts[n], seeds[s].
    let mut rows = vec![vec![[0.0; 3]; seeds.len()]; counts.len()];
    let mut seconds = vec![0.0; counts.len()];
    let mut alone_taus = Vec::new();
    for (s, &seed) in seeds.iter().enumerate() {
        let work = tempfile::tempdir().unwrap();
        let work = work.path();
        let Data { run, held_out } = data(&Setting::from_env(seed));
        let settings: Vec<Setting> = (0..inits)
            .map(|init| Setting {
                init,
                ..Setting::from_env(seed)
            })
            .collect();
        let started = Instant::now();
        let mut alone_by_init = Vec::new();
        for setting in &settings {
            let alone = train(
                &work.join(format!("alone-{}", setting.init)),
                runtime.handle(),
                setting,
                &method,
                1,
                Mode::Independent,
                &run,
            );
            alone_by_init.push(tau(&alone.drafters[0], &held_out));
            eprintln!(
                "study: seed {seed}, init {}: one drafter {:.3}; loss {:.3?}",
                setting.init,
                alone_by_init.last().unwrap(),
                loss_curve(&alone.losses)
            );
        }
        let alone_tau = mean(&alone_by_init);
        let untrained = untrained_tau(work, &settings[0], &held_out);
        alone_taus.push(alone_tau);
        eprintln!(
            "study: seed {seed}: untrained {untrained:.3}, one drafter {alone_tau:.3} (by init {alone_by_init:.3?}; {:.0} s)",
            started.elapsed().as_secs_f64(),
        );
        for (n, &count) in counts.iter().enumerate() {
            let count = count as usize;
            let (mut centers, mut independents, mut ceilings) =
                (Vec::new(), Vec::new(), Vec::new());
            for setting in &settings {
                let started = Instant::now();
                let synced = train(
                    &work.join(format!("synced-{count}-{}", setting.init)),
                    runtime.handle(),
                    setting,
                    &method,
                    count,
                    center_mode,
                    &run,
                );
                centers.push(tau(synced.center.as_ref().unwrap(), &held_out));
                seconds[n] += started.elapsed().as_secs_f64();
                eprintln!(
                    "study: seed {seed}, init {}: {count} drafters: center {:.3}; loss {:.3?}",
                    setting.init,
                    centers.last().unwrap(),
                    loss_curve(&synced.losses)
                );
                if center_only {
                    continue;
                }
                let independent = train(
                    &work.join(format!("independent-{count}-{}", setting.init)),
                    runtime.handle(),
                    setting,
                    &method,
                    count,
                    Mode::Independent,
                    &run,
                );
                let taus: Vec<f64> = independent
                    .drafters
                    .iter()
                    .map(|dir| tau(dir, &held_out))
                    .collect();
                independents.push(mean(&taus));
                let large_batch = Setting {
                    batch: setting.batch * count,
                    learning_rate: setting.learning_rate * (count as f64).powf(ceiling_lr_exponent),
                    ..*setting
                };
                let ceiling = train(
                    &work.join(format!("ceiling-{count}-{}", setting.init)),
                    runtime.handle(),
                    &large_batch,
                    &method,
                    1,
                    Mode::Independent,
                    &run,
                );
                ceilings.push(tau(&ceiling.drafters[0], &held_out));
            }
            let (center, independent, ceiling) = if center_only {
                (mean(&centers), f64::NAN, f64::NAN)
            } else {
                (mean(&centers), mean(&independents), mean(&ceilings))
            };
            rows[n][s] = [center, independent, ceiling].map(|value| value / alone_tau);
            eprintln!(
                "study: seed {seed}: {count} drafters: center {center:.3} (by init {centers:.3?}), / one drafter {:.3}; independent {independent:.3} ({:.3}); ceiling {ceiling:.3} ({:.3})",
                rows[n][s][0],
                rows[n][s][1],
                rows[n][s][2],
            );
        }
    }
    let seed_columns: Vec<String> = seeds.iter().map(|seed| format!("seed {seed}")).collect();
    println!("\n{}", method.describe());
    println!(
        "one drafter's tau: {}",
        alone_taus
            .iter()
            .map(|tau| format!("{tau:.3}"))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    println!("each cell: center / independent (mean) / ceiling, over one drafter's tau");
    println!(
        "| drafters | {} | lowest center | s per synced run |",
        seed_columns.join(" | ")
    );
    println!("|---|{}---|---|", "---|".repeat(seeds.len()));
    for (n, &count) in counts.iter().enumerate() {
        let lowest = rows[n]
            .iter()
            .map(|row| row[0])
            .fold(f64::INFINITY, f64::min);
        println!(
            "| {count} | {} | {lowest:.3} | {:.0} |",
            rows[n]
                .iter()
                .map(|row| format!("{:.3} / {:.3} / {:.3}", row[0], row[1], row[2]))
                .collect::<Vec<_>>()
                .join(" | "),
            seconds[n] / (seeds.len() as u64 * inits) as f64
        );
    }
}
