//! The quality comparison, made deterministic: three drafters that
//! train one model through the broker's model sync against one drafter
//! trained on every sample alone and three independent drafters
//! (`--sync-every 0`), the same samples for each. Asserted: the center
//! within 10 % of the one drafter's τ, and clearly above every independent
//! drafter.
//!
//! Async timing decides, in a real run, which drafter trains which sample
//! and when each delta lands, so repeated runs spread (the asynchronous
//! test in `model_sync.rs` saw the center's held-out loss at 0.95 to 1.16 of
//! one drafter's). Here the test itself is the scheduler: the real engines
//! (`build_engine`, the drafter's own training code, on the run-wide
//! learning-rate schedule and the asynchronous β1), the real sync links
//! over gRPC to a real in-process broker (its averaging and delayed
//! Nesterov outer step), in a fixed interleaving (one step per drafter in
//! turn, samples dealt round robin as the queue deals them) with fixed
//! seeds, and libtorch on one thread. Every run of this test computes the
//! same numbers.
//!
//! τ is measured by real speculative decoding (`eval`) on held-out prompts
//! that the target continues greedily, as `dflash eval` does.
//!
//! Sweeps: `DFLASH_SYNC_QUALITY_{SEED,LR,EPOCHS,SYNC_EVERY,MOMENTUM,OUTER_LR,
//! DRAFTERS,ADAM_BETA1}` override the settings below (`-- --nocapture` prints τ and
//! the loss curves).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::*;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::engine::{build_engine, RunSchedule, TrainingEngine};
use dflash_drafter_server::model_sync::{ModelSyncLink, SyncConfig};
use dflash_drafter_server::schedule::RunClock;
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
/// A third of the tiny demo's 3e-3: stale deltas cost more the higher the
/// learning rate (seed 0, 3 epochs at 3e-3: center / one drafter 0.84 with
/// a sync every step, 0.71 every 2 steps).
const LEARNING_RATE: f64 = 1e-3;

/// The data and drafter seeds; `DFLASH_SYNC_QUALITY_SEED` overrides it to
/// measure the margins on other seeds (the note reports them).
fn base_seed() -> u64 {
    std::env::var("DFLASH_SYNC_QUALITY_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(0)
}

/// A sweep knob: `DFLASH_SYNC_QUALITY_<NAME>` when set, else `default`.
fn knob(name: &str, default: f64) -> f64 {
    std::env::var(format!("DFLASH_SYNC_QUALITY_{name}"))
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// Optimizer steps between a drafter's exchanges.
fn sync_every() -> u64 {
    knob("SYNC_EVERY", SYNC_EVERY as f64) as u64
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

fn drafter_config(id: &str, work: &Path, seed: u64) -> DrafterServerConfig {
    let mut config = test_drafter_config(id, "http://127.0.0.1:1", work.join(id));
    config.block_size = BLOCK_SIZE;
    config.num_anchors = 32;
    config.learning_rate = knob("LR", LEARNING_RATE);
    config.adam_beta1 = knob("ADAM_BETA1", config.adam_beta1);
    config.max_step_samples = BATCH;
    config.seed = seed;
    config
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

/// How a run's drafters relate.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Independent,
    Synced,
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

/// Trains `drafters` drafters on `run` (the run's samples in queue order,
/// dealt round robin), one step each in turn. Runs on a plain thread: the
/// sync links drive their gRPC exchanges on `runtime`.
fn train(
    work: &Path,
    runtime: &tokio::runtime::Handle,
    broker: &str,
    drafters: usize,
    mode: Mode,
    run: &[proto::Sample],
) -> RunResult {
    let seed = base_seed();
    let steps_per_drafter = run.len().div_ceil(BATCH * drafters) as u64;
    let sync = SyncConfig {
        sync_every: sync_every(),
        ..SyncConfig::default()
    };
    let mut trainees: Vec<Trainee> = (0..drafters)
        .map(|index| {
            let id = format!("drafter-{index}");
            let mut config = drafter_config(&id, work, seed + index as u64);
            let stream: Vec<proto::Sample> =
                run.iter().skip(index).step_by(drafters).cloned().collect();
            match mode {
                Mode::Independent => {
                    // Its own schedule over its own share (what the
                    // estimate from the broker's summary gives).
                    config.total_steps = Some(steps_per_drafter);
                    let engine = build_engine(&config, None, steps_per_drafter).unwrap();
                    Trainee {
                        engine,
                        link: None,
                        stream,
                        losses: Vec::new(),
                        learning_rates: Vec::new(),
                    }
                }
                Mode::Synced => {
                    config.total_steps = None;
                    let mut engine = build_engine(&config, None, 1).unwrap();
                    // The run's size, as the async side learns it from the
                    // broker's expected items.
                    let clock = RunClock::new();
                    clock.set_run_samples_total(run.len() as u64);
                    engine.follow_run_schedule(RunSchedule::for_config(&config, clock.clone()));
                    let mut link = ModelSyncLink::new(runtime.clone(), broker, &id, &sync)
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
    for round in 0..steps_per_drafter as usize {
        for trainee in trainees.iter_mut() {
            let batch: Vec<_> = trainee
                .stream
                .iter()
                .skip(round * BATCH)
                .take(BATCH)
                .map(|sample| trainee.engine.prepare(sample).unwrap())
                .collect();
            if batch.is_empty() {
                continue;
            }
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
    let center = (mode == Mode::Synced).then(|| {
        // A drafter joining now receives the center: that is the run's model.
        let observer_config = drafter_config("observer", work, seed + 100);
        let observer = build_engine(&observer_config, None, 1).unwrap();
        let mut link = ModelSyncLink::new(runtime.clone(), broker, "observer", &sync).unwrap();
        link.join(observer.draft_model().unwrap());
        assert_eq!(link.totals.failures, 0);
        let dir = work.join("center");
        save_draft_checkpoint(&dir, observer.draft_model().unwrap(), None).unwrap();
        dir
    });
    RunResult {
        drafters: drafter_dirs,
        center,
        losses: trainees.iter().map(|t| t.losses.clone()).collect(),
        learning_rates: trainees.iter().map(|t| t.learning_rates.clone()).collect(),
    }
}

fn tau(checkpoint: &Path, prompts: &[Vec<i64>]) -> f64 {
    let options = EvalOptions {
        max_new_tokens: MAX_NEW_TOKENS,
        stop_token_ids: Vec::new(),
        device: Device::Cpu,
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

/// Trains one drafter alone, three synced drafters and three independent
/// ones on the same run, and measures τ of each result.
async fn measure() -> Taus {
    let work = tempfile::tempdir().unwrap();
    let mut broker_config = BrokerConfig::for_targets(1);
    // The broker's defaults, spelled out: η 1, delayed Nesterov μ 0.7 over
    // N = open sessions (3 here).
    broker_config.model_sync.outer_learning_rate = knob("OUTER_LR", 1.0) as f32;
    broker_config.model_sync.outer_momentum = knob("MOMENTUM", 0.7) as f32;
    broker_config.model_sync.outer_momentum_delay = 0;
    let broker = TestBroker::start(broker_config).await;
    let address = broker.address.clone();
    let runtime = tokio::runtime::Handle::current();
    let work_path = work.path().to_path_buf();
    let taus = tokio::task::spawn_blocking(move || {
        // Tiny ops: one thread is faster, and fixes every sum's order.
        tch::set_num_threads(1);
        let seed = base_seed();
        let target = TargetModel::load(tiny_target_dir(), Device::Cpu, Kind::Float).unwrap();
        let sequences = self_generated(&target, TRAIN_SEQUENCES, 1000 + seed);
        let held_out: Vec<Vec<i64>> =
            random_token_sequences(HELD_OUT_PROMPTS, PROMPT_LENGTH, 2000 + seed);
        let samples = target_samples(&sequences);
        // The run: every sequence EPOCHS times, epochs in turn.
        let epochs = knob("EPOCHS", EPOCHS as f64) as usize;
        let run: Vec<proto::Sample> = (0..epochs).flat_map(|_| samples.clone()).collect();

        let alone = train(
            &work_path.join("alone"),
            &runtime,
            &address,
            1,
            Mode::Independent,
            &run,
        );
        let synced = train(
            &work_path.join("synced"),
            &runtime,
            &address,
            knob("DRAFTERS", 3.0) as usize,
            Mode::Synced,
            &run,
        );
        let independent = train(
            &work_path.join("independent"),
            &runtime,
            &address,
            3,
            Mode::Independent,
            &run,
        );
        let untrained_dir = work_path.join("untrained");
        build_engine(&drafter_config("untrained", &work_path, seed), None, 1)
            .unwrap()
            .save_checkpoint(&untrained_dir)
            .unwrap();

        // The run-wide schedule: a synced drafter's last step is at the
        // end of the run's cosine (as the one drafter's last steps), not a
        // third of the way in as its own step count would put it. Its
        // position lags the run's by the other drafters' steps since their
        // last sync: fewer than 3·2·SYNC_EVERY steps of one drafter alone.
        let alone_rates = &alone.learning_rates[0];
        let near_the_end = alone_rates[alone_rates.len() - 1 - 3 * 2 * sync_every() as usize];
        for rates in &synced.learning_rates {
            let last = *rates.last().unwrap();
            assert!(
                last <= near_the_end,
                "last synced lr {last}, the one drafter's near its end {near_the_end}"
            );
        }

        let taus = Taus {
            untrained: tau(&untrained_dir, &held_out),
            alone: tau(&alone.drafters[0], &held_out),
            center: tau(synced.center.as_ref().unwrap(), &held_out),
            independent: independent
                .drafters
                .iter()
                .map(|dir| tau(dir, &held_out))
                .collect(),
        };
        eprintln!(
            "seed {seed}: tau untrained {:.3}, one drafter {:.3}, center of 3 synced {:.3} \
             (center / one drafter {:.3}), 3 independent {:.3?}",
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
        eprintln!("loss: 3 synced {:.3?}", loss_curve(&synced.losses));
        eprintln!(
            "loss: 3 independent {:.3?}",
            loss_curve(&independent.losses)
        );
        taus
    })
    .await
    .unwrap();
    broker.stop().await;
    taus
}

/// Measured, τ untrained / one drafter / center / independent (η 1,
/// delayed Nesterov μ 0.7, each drafter's β1 0.9^N with N measured):
/// seed 0: 1.000 / 1.517 / 1.585 / 1.058, 1.000, 1.053 (center 1.045 of one drafter);
/// seed 1: 1.120 / 2.016 / 1.984 / 1.210, 1.117, 1.162 (0.984);
/// seed 2: 1.000 / 1.450 / 1.512 / 1.035, 1.016, 1.074 (1.043).
/// With every drafter at β1 0.9 (before the asynchronous β1) the center
/// reached 0.85, 0.76 and 0.89 of one drafter; with β1 0.9^N and no outer
/// momentum 1.035 (seed 0). Where one drafter learns faster the center does
/// not keep up (seed 0): lr 3e-3, 3 epochs: 0.84 (a sync every step), 0.71
/// (every 2 steps); `ADAM_BETA1=0.7` for every drafter: 0.76 (3e-3), 0.78
/// (1e-3). The issue stays open on that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_synced_drafters_reach_one_drafters_tau_and_beat_three_independent_ones() {
    let taus = measure().await;
    assert!(
        taus.alone > taus.untrained + 0.3,
        "the run is long enough to learn: tau {} vs untrained {}",
        taus.alone,
        taus.untrained
    );
    // The criterion: within 10 % of one drafter trained on every
    // sample alone.
    assert!(
        taus.center >= 0.9 * taus.alone,
        "center tau {} below 90 % of one drafter's {}",
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
            "independent tau {independent} not clearly below the center's {}",
            taus.center
        );
    }
}
