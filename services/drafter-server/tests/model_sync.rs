//! Many drafters, one model: the drafter's model-sync link against a real
//! in-process broker, with real draft models of the tiny target.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::model_sync::{ModelSyncLink, ModelSyncMode, SyncConfig, SyncDtype};
use dflash_drafter_server::{run, RunEnd};
use dflash_model::draft::{
    load_draft_model, DraftConfig, DraftModel, DraftOptions, FrozenTargetHeads, TargetDimensions,
};
use tch::{Device, Kind, Tensor};
use tokio_util::sync::CancellationToken;

const TEST_TIMEOUT: Duration = Duration::from_secs(120);

fn tiny_draft_model(seed: u64) -> DraftModel {
    let (target_config, frozen) =
        FrozenTargetHeads::load(tiny_target_dir(), Device::Cpu, Kind::Float).unwrap();
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(4),
        mask_token_id: dflash_model::tokens::mask_token_id(tiny_target_dir()).unwrap(),
        target_layer_ids: Some(TEST_TARGET_LAYER_IDS.iter().map(|&id| id as i64).collect()),
    };
    let config =
        DraftConfig::for_target(&TargetDimensions::from(&target_config), &options).unwrap();
    DraftModel::new(config, frozen, Device::Cpu, Kind::Float, seed).unwrap()
}

fn parameters(model: &DraftModel) -> Vec<(String, Tensor)> {
    let mut parameters: Vec<(String, Tensor)> = model.var_store().variables().into_iter().collect();
    parameters.sort_by(|left, right| left.0.cmp(&right.0));
    parameters
}

/// Largest |a − b| over every parameter of two models.
fn max_difference(left: &DraftModel, right: &DraftModel) -> f64 {
    parameters(left)
        .iter()
        .zip(parameters(right))
        .map(|((_, a), (_, b))| (a - b).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// A local "training step": every parameter moves by `by`.
fn shift(model: &DraftModel, by: f64) {
    tch::no_grad(|| {
        for (_, mut parameter) in parameters(model) {
            let _ = parameter.f_add_scalar_(by).unwrap();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drafter_joining_mid_run_starts_from_the_center_and_deltas_reach_everyone() {
    // Plain asynchronous local SGD: the center is the sum of the deltas.
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.model_sync.outer_momentum = 0.0;
    let broker = TestBroker::start(broker_config).await;
    let address = broker.address.clone();
    let runtime = tokio::runtime::Handle::current();
    // The link runs on a training thread, as in the server.
    let drafters = tokio::task::spawn_blocking(move || {
        let every_step = SyncConfig {
            sync_every: 1,
            ..SyncConfig::default()
        };
        let first = tiny_draft_model(1);
        let late = tiny_draft_model(2);
        assert!(
            max_difference(&first, &late) > 1e-3,
            "different initialisations"
        );
        let mut first_link = ModelSyncLink::new(runtime.clone(), &address, "first", &every_step)
            .expect("sync is on");
        first_link.join(&first);
        assert_eq!(
            (first_link.totals.exchanges, first_link.totals.failures),
            (1, 0)
        );
        // The first drafter trains and syncs: the center moves.
        shift(&first, 0.25);
        first_link.after_step(&first, 4, 40);
        assert_eq!(first_link.totals.center_version, 1);

        // A drafter joining now starts from the center, not its own init.
        let mut late_link =
            ModelSyncLink::new(runtime.clone(), &address, "late", &every_step).unwrap();
        late_link.join(&late);
        assert_eq!(late_link.totals.failures, 0);
        assert_eq!(
            max_difference(&first, &late),
            0.0,
            "f32 on the wire is exact"
        );

        // Its delta reaches the center, and the first drafter's next sync
        // brings it there too (the first drafter's own delta is zero).
        shift(&late, -0.5);
        late_link.after_step(&late, 4, 40);
        first_link.after_step(&first, 4, 40);
        assert_eq!(first_link.totals.center_version, 3);
        assert_eq!(first_link.totals.last_staleness, 1);
        // Staleness measures the drafters sharing the center (their AdamW
        // β1 follows it): the late one's delta was fresh (1 drafter), the
        // first one's two were 0 then 1 behind, a running mean of 1 and 2
        // with a quarter's weight on the newest.
        assert_eq!(late_link.run_clock().state().drafters_sharing, 1.0);
        assert_eq!(first_link.run_clock().state().drafters_sharing, 1.25);
        // Both are the center now: the same weights up to f32 rounding of
        // (x + d) − x + x (a few ulps of values below 1).
        assert!(max_difference(&first, &late) < 1e-6);

        // bf16 on the wire: the joiner holds the center rounded to bf16.
        let bf16 = SyncConfig {
            sync_dtype: SyncDtype::Bf16,
            ..every_step.clone()
        };
        let third = tiny_draft_model(3);
        let mut third_link = ModelSyncLink::new(runtime, &address, "third", &bf16).unwrap();
        third_link.join(&third);
        for ((name, center), (_, rounded)) in parameters(&first).iter().zip(parameters(&third)) {
            // Round to nearest: within half a bf16 ulp, at most 2^-8 of
            // the magnitude (8 significant bits).
            let bound = (center.abs() / 256.0 + 1e-30)
                .f_sub(&(center - &rounded).abs())
                .unwrap();
            assert!(
                bound.min().double_value(&[]) >= 0.0,
                "{name}: not the center rounded to bf16"
            );
        }
        first_link.finish(&first);
        late_link.finish(&late);
        third_link.finish(&third);
        (first_link.totals.clone(), late_link.totals.clone())
    })
    .await
    .unwrap();
    assert_eq!(drafters.0.failures, 0);
    assert_eq!(drafters.1.failures, 0);
    let model_sync = broker.status().await.model_sync.unwrap();
    assert_eq!(
        model_sync.center_version, 3,
        "final syncs without steps carry no delta"
    );
    assert_eq!(model_sync.center_samples, 12);
    for drafter in &model_sync.drafters {
        assert!(
            drafter.finished,
            "{} sent its final sync",
            drafter.drafter_id
        );
    }
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drafters_train_one_center_a_killed_one_blocks_nothing_and_the_center_loads() {
    let work = tempfile::tempdir().unwrap();
    let center_dir = work.path().join("center");
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.model_sync.model_output = Some(center_dir.clone());
    broker_config.model_sync.model_final_sync_timeout = Duration::from_secs(600);
    let broker = TestBroker::start(broker_config).await;
    let config = |id: &str| {
        let mut config = test_drafter_config(id, &broker.address, work.path().join(id));
        config.model_sync.model_sync = ModelSyncMode::LocalSgd;
        config.model_sync.sync_every = 1;
        config
    };
    // The victim holds its first items unstepped for a long time, so it is
    // killed between syncs (after its join, before any delta).
    let mut victim_config = config("victim");
    victim_config.linger = std::time::Duration::from_secs(600);
    victim_config.batch_tokens = 1 << 20;
    victim_config.max_step_samples = 64;
    let victim = tokio::spawn(run(victim_config, CancellationToken::new()));
    assert!(
        wait_until(TEST_TIMEOUT, || async {
            broker.status().await.model_sync.is_some_and(|sync| {
                sync.drafters
                    .iter()
                    .any(|drafter| drafter.drafter_id == "victim" && drafter.connected)
            })
        })
        .await,
        "the victim joined the center"
    );
    let samples = target_samples(&random_token_sequences(16, 16, 7));
    let producer_address = broker.address.clone();
    let producer = tokio::spawn(async move {
        produce(&producer_address, "target-0", samples, true).await;
    });
    assert!(
        wait_until(TEST_TIMEOUT, || async {
            drafter_status(&broker.status().await, "victim")
                .is_some_and(|drafter| drafter.leased_items > 0)
        })
        .await
    );
    victim.abort();
    let _ = victim.await;
    let survivors: Vec<_> = ["drafter-0", "drafter-1"]
        .iter()
        .map(|id| tokio::spawn(run(config(id), CancellationToken::new())))
        .collect();
    producer.await.unwrap();
    let mut trained = 0;
    for survivor in survivors {
        let report = tokio::time::timeout(TEST_TIMEOUT, survivor)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(report.end, RunEnd::Complete);
        trained += report.samples_trained;
    }
    assert_eq!(trained, 16);
    // The killed drafter's session is gone, so the final center does not
    // wait the 10-minute timeout for it.
    assert!(
        wait_until(Duration::from_secs(30), || async {
            broker
                .status()
                .await
                .model_sync
                .is_some_and(|sync| sync.final_saved)
        })
        .await,
        "final center written"
    );
    let status = broker.status().await;
    let sync = status.model_sync.unwrap();
    // Every trained sample went into the center through exactly one delta.
    assert_eq!(sync.center_samples, 16);
    assert_eq!(status.acked_items, 16);
    assert_eq!(sync.saved_version, sync.center_version);
    assert!(sync.center_version >= 2);
    let victim = sync
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == "victim")
        .unwrap();
    assert!(!victim.connected);
    assert_eq!(victim.updates_applied, 0);
    // The center is a complete draft checkpoint: the strict loader (no
    // missing or unexpected tensors) accepts it.
    let (_, frozen) = FrozenTargetHeads::load(tiny_target_dir(), Device::Cpu, Kind::Float).unwrap();
    let center = load_draft_model(&center_dir, frozen, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(center.config().num_draft_layers, 2);
    broker.stop().await;
}

/// Sequences that follow a learnable rule (each token is the previous plus
/// one, from a random start), so a short run measurably learns.
fn counting_sequences(count: usize, length: usize, seed: u64) -> Vec<Vec<i64>> {
    random_token_sequences(count, 1, seed)
        .into_iter()
        .map(|start| {
            (0..length as i64)
                .map(|offset| 3 + (start[0] + offset) % 290)
                .collect()
        })
        .collect()
}

/// Mean held-out loss (the training objective, anchors drawn with a fixed
/// seed) of the checkpoint in `dir`.
fn held_out_loss(dir: &std::path::Path, held_out: &[dflash_proto::v1::Sample]) -> f64 {
    use dflash_drafter_server::samples::{decode_sample, SampleExpectations};
    use rand::SeedableRng;
    let (_, frozen) = FrozenTargetHeads::load(tiny_target_dir(), Device::Cpu, Kind::Float).unwrap();
    let model = load_draft_model(dir, frozen, Device::Cpu, Kind::Float).unwrap();
    let config = model.config();
    let expectations = SampleExpectations {
        hidden_width: config.target_hidden_width(),
        vocab_size: config.vocab_size,
    };
    let sequences: Vec<_> = held_out
        .iter()
        .map(|sample| decode_sample(sample, expectations).unwrap())
        .collect();
    let mut generator = rand::rngs::StdRng::seed_from_u64(99);
    let anchors: Vec<Vec<i64>> = sequences
        .iter()
        .map(|sequence| dflash_model::draft::sample_anchors(&sequence.loss_mask, 8, &mut generator))
        .collect();
    let batch = dflash_model::draft::pack_batch(&sequences, &anchors).unwrap();
    let gamma = dflash_model::draft::default_loss_decay_gamma(config.block_size);
    tch::no_grad(|| {
        dflash_model::draft::compute_objective(&model, &batch, gamma)
            .unwrap()
            .loss
            .double_value(&[])
    })
}

/// Trains `drafters` drafters on `samples` through a fresh broker; returns
/// each drafter's final checkpoint and the center (when written).
async fn train(
    work: &std::path::Path,
    drafters: usize,
    sync_every: u64,
    samples: &[dflash_proto::v1::Sample],
) -> (Vec<std::path::PathBuf>, std::path::PathBuf) {
    let center = work.join("center");
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.model_sync.model_output = Some(center.clone());
    let broker = TestBroker::start(broker_config).await;
    // The target announces its shard size first, so every drafter's
    // schedule is estimated from the run (as in production) from its
    // first step.
    let client = broker.client().await;
    let mut producer = client.produce("target-0").await.unwrap();
    producer
        .send_stats(dflash_proto::v1::ProducerStats {
            samples_total: samples.len() as u64,
            ..Default::default()
        })
        .await
        .unwrap();
    for (seq, sample) in samples.iter().enumerate() {
        producer
            .send(seq as u64, sample.clone(), Default::default())
            .await
            .unwrap();
    }
    producer.finish().await.unwrap();
    client
        .report_done("target-0", samples.len() as u64)
        .await
        .unwrap();
    let runs: Vec<_> = (0..drafters)
        .map(|index| {
            let id = format!("drafter-{index}");
            let mut config = test_drafter_config(&id, &broker.address, work.join(&id));
            config.model_sync.model_sync = ModelSyncMode::LocalSgd;
            config.model_sync.sync_every = sync_every;
            config.learning_rate = 3e-3;
            config.total_steps = None;
            config.seed = index as u64;
            tokio::spawn(run(config, CancellationToken::new()))
        })
        .collect();
    let mut checkpoints = Vec::new();
    for drafter in runs {
        let report = tokio::time::timeout(TEST_TIMEOUT, drafter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(report.end, RunEnd::Complete);
        checkpoints.push(report.final_checkpoint.unwrap());
    }
    if sync_every > 0 {
        assert!(
            wait_until(TEST_TIMEOUT, || async {
                broker
                    .status()
                    .await
                    .model_sync
                    .is_some_and(|sync| sync.final_saved)
            })
            .await
        );
    }
    broker.stop().await;
    (checkpoints, center)
}

/// The quality comparison at test size: three drafters with model
/// sync (sync every step: each trains about 8 steps here) against one
/// drafter trained on every sample alone and three independent drafters,
/// on the same 96 samples. Measured as held-out loss: τ needs speculative
/// decoding, too slow for CI (the note gives τ from `dflash local`).
///
/// At this size the ratio center / one drafter spread from 0.95 to 1.16 in
/// repeated runs (async scheduling decides who trains what), so the issue's
/// 10 % is not asserted here (`model_sync_quality.rs` asserts it in a fixed
/// interleaving); the bounds below still fail when the sync does nothing
/// useful (independent drafters sit near 3x on average).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_synced_drafters_learn_like_one_and_better_than_three_independent() {
    let work = tempfile::tempdir().unwrap();
    let train_samples = target_samples(&counting_sequences(96, 20, 11));
    let held_out = target_samples(&counting_sequences(16, 20, 12));

    let (alone, _) = train(&work.path().join("alone"), 1, 0, &train_samples).await;
    let (_, center) = train(&work.path().join("synced"), 3, 1, &train_samples).await;
    let (independent, _) = train(&work.path().join("independent"), 3, 0, &train_samples).await;

    let untrained = {
        let model = tiny_draft_model(0);
        let dir = work.path().join("untrained");
        dflash_model::draft::save_draft_checkpoint(&dir, &model, None).unwrap();
        held_out_loss(&dir, &held_out)
    };
    let alone = held_out_loss(&alone[0], &held_out);
    let synced = held_out_loss(&center, &held_out);
    let independent: Vec<f64> = independent
        .iter()
        .map(|dir| held_out_loss(dir, &held_out))
        .collect();
    eprintln!("held-out loss: untrained {untrained:.4}, one drafter {alone:.4}, 3 synced (center) {synced:.4}, 3 independent {independent:.4?}");
    assert!(alone < 0.8 * untrained, "the run is long enough to learn");
    assert!(
        synced <= 1.5 * alone,
        "center {synced} far from one drafter's {alone}"
    );
    // Against the independent drafters as a set: the shared queue deals
    // items to whoever asks first, so one independent drafter that started
    // early may train on most of the samples and come close to one drafter
    // alone (a CI run saw 58.4, 23.5 and 56.9 beside a center of 19.1). A
    // sync that does nothing leaves the center at the untrained loss or at
    // one drafter's share, far above 0.6 of their mean.
    let independent_mean = independent.iter().sum::<f64>() / independent.len() as f64;
    assert!(
        synced < 0.6 * independent_mean,
        "center {synced} not clearly better than the independent drafters' mean {independent_mean}"
    );
}

/// A broker restart: the center resumes from its last checkpoint, a sync
/// that meets no broker fails without stopping the drafter, and the next
/// sync point re-joins the restarted broker's center.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_broker_restart_drafters_rejoin_the_resumed_center() {
    let work = tempfile::tempdir().unwrap();
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.model_sync.model_output = Some(work.path().join("center"));
    broker_config.model_sync.outer_momentum = 0.0;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let socket = listener.local_addr().unwrap();
    let address = format!("http://{socket}");
    let shutdown = CancellationToken::new();
    let first_broker = tokio::spawn(dflash_broker::serve(
        listener,
        broker_config.clone(),
        shutdown.clone(),
    ));
    let runtime = tokio::runtime::Handle::current();
    let every_step = SyncConfig {
        sync_every: 1,
        sync_timeout: Duration::from_secs(10),
        ..SyncConfig::default()
    };
    let (model_sender, model_receiver) = std::sync::mpsc::channel::<()>();
    let (step_sender, mut step_receiver) = tokio::sync::mpsc::channel::<(u64, u64, f64)>(4);
    // The drafter's training thread: join, one synced step, then a step per
    // signal from the test, reporting (exchanges, failures, |model − saved|).
    let drafter = std::thread::spawn(move || {
        let model = tiny_draft_model(1);
        let mut link = ModelSyncLink::new(runtime, &address, "drafter-0", &every_step).unwrap();
        link.join(&model);
        shift(&model, 0.25);
        link.after_step(&model, 4, 40);
        let synced = tiny_draft_model(2);
        tch::no_grad(|| {
            for ((_, mut copy), (_, value)) in
                parameters(&synced).into_iter().zip(parameters(&model))
            {
                copy.copy_(&value);
            }
        });
        let report = |link: &ModelSyncLink, model: &DraftModel| {
            (
                link.totals.exchanges,
                link.totals.failures,
                max_difference(model, &synced),
            )
        };
        step_sender.blocking_send(report(&link, &model)).unwrap();
        while model_receiver.recv().is_ok() {
            shift(&model, 1.0);
            link.after_step(&model, 4, 40);
            step_sender.blocking_send(report(&link, &model)).unwrap();
        }
    });
    assert_eq!(step_receiver.recv().await.unwrap(), (2, 0, 0.0));

    // The broker goes away; the center (version 1) was written on the way.
    shutdown.cancel();
    first_broker.await.unwrap().unwrap();
    model_sender.send(()).unwrap();
    let (exchanges, failures, moved) = step_receiver.recv().await.unwrap();
    assert_eq!(
        (exchanges, failures),
        (2, 1),
        "the sync failed, training went on"
    );
    assert!((moved - 1.0).abs() < 1e-5, "the local step is kept");

    // The broker comes back on the same address with the same folder.
    let listener = tokio::net::TcpListener::bind(socket).await.unwrap();
    let shutdown = CancellationToken::new();
    let second_broker = tokio::spawn(dflash_broker::serve(
        listener,
        broker_config,
        shutdown.clone(),
    ));
    model_sender.send(()).unwrap();
    let (exchanges, failures, moved) = step_receiver.recv().await.unwrap();
    assert_eq!((exchanges, failures), (3, 1), "re-joined");
    // Re-joining takes the resumed center: the weights of the last good
    // sync, the steps since then are lost (at most --sync-every).
    assert_eq!(moved, 0.0);
    drop(model_sender);
    drafter.join().unwrap();
    shutdown.cancel();
    second_broker.await.unwrap().unwrap();
}
