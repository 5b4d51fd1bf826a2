//! The drafter-server against a real in-process broker on 127.0.0.1:0, with
//! the tiny target model's real hidden states: training to COMPLETE with two
//! drafters, dead-lettering of unusable samples, graceful stop, redelivery
//! of a killed drafter's unacked items, ABORTED runs, resume, synthetic mode.

mod common;

use std::time::Duration;

use common::*;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::samples::encode_sample;
use dflash_drafter_server::{run, ModelMode, RunEnd};
use dflash_model::draft::step_dirs::latest_checkpoint;
use tokio_util::sync::CancellationToken;

const TEST_TIMEOUT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_drafters_train_until_the_run_completes() {
    let broker = TestBroker::start(BrokerConfig::for_targets(2)).await;
    let output = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    let drafters: Vec<_> = ["drafter-0", "drafter-1"]
        .iter()
        .map(|id| {
            let config = test_drafter_config(id, &broker.address, output.path().join(id));
            tokio::spawn(run(config, shutdown.clone()))
        })
        .collect();
    let sequences = random_token_sequences(24, 24, 1);
    let samples = target_samples(&sequences);
    let (first, second) = samples.split_at(12);
    tokio::join!(
        produce(&broker.address, "target-0", first.to_vec(), true),
        produce(&broker.address, "target-1", second.to_vec(), true),
    );
    // Stats reach the broker while training runs.
    let mut reports = Vec::new();
    for drafter in drafters {
        let report = report_within(TEST_TIMEOUT, drafter).await;
        reports.push(report);
    }
    // The commit of the run's last step acks its samples and so ends the
    // run (the broker acks a data-parallel step's samples itself): a
    // drafter's stats of that last step go after its stream ended, and the
    // drafter waits until the broker shows them.
    let status = broker.status().await;
    assert_eq!(status.acked_items, 24);
    assert_eq!(status.dead_letters, 0);
    let total_samples: u64 = reports.iter().map(|report| report.samples_trained).sum();
    assert_eq!(total_samples, 24, "every item is trained on exactly once");
    for report in &reports {
        assert_eq!(report.end, RunEnd::Complete);
        assert_eq!(report.exit(), dflash_shell::Exit::Done);
        assert!(report.steps > 0, "{} took no step", report.drafter_id);
        assert!(report.last_loss.is_some_and(f64::is_finite));
        let checkpoint = report.final_checkpoint.clone().expect("final checkpoint");
        assert!(checkpoint.join("model.safetensors").is_file());
        assert!(checkpoint.join("config.json").is_file());
        assert!(checkpoint.join("optimizer.safetensors").is_file());
        assert_eq!(
            latest_checkpoint(&output.path().join(&report.drafter_id)).unwrap(),
            Some(checkpoint)
        );
        let drafter = drafter_status(&status, &report.drafter_id).expect("drafter in status");
        let stats = drafter.stats.clone().expect("stats sent");
        assert_eq!(stats.device, "cpu");
        assert_eq!(
            stats.steps, report.steps,
            "the final stats of {} name every step taken",
            report.drafter_id
        );
        assert_eq!(drafter.acked_items, report.samples_trained);
    }
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sample_of_the_wrong_hidden_width_is_dead_lettered_and_training_goes_on() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir().unwrap();
    let config = test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
    let drafter = tokio::spawn(run(config, CancellationToken::new()));
    // The model reads 2 layers × 64 = 128 wide states; these are 96 wide.
    produce(
        &broker.address,
        "target-0",
        samples_with_width(3, 10, 96),
        true,
    )
    .await;
    let report = report_within(TEST_TIMEOUT, drafter).await;
    assert_eq!(report.end, RunEnd::Complete);
    assert_eq!(report.dead_lettered, 3);
    assert_eq!(report.samples_trained, 0);
    let status = broker.status().await;
    assert_eq!(status.dead_letters, 3);
    let reason = &status.dead_letter_items[0].reason;
    assert!(
        reason.contains("width 96, the drafter expects 128"),
        "{reason}"
    );
    broker.stop().await;
}

/// One of two targets sends one sample whose hidden states hold a NaN
/// among good ones (#22): it is dead-lettered naming its (target, seq),
/// never trained on; the run ends COMPLETE with every other (target, seq)
/// trained, every loss stays finite and the final weights load finite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sample_with_a_nan_is_dead_lettered_by_target_and_seq_and_the_model_stays_finite() {
    const POISONED_SEQ: usize = 5;
    let broker = TestBroker::start(BrokerConfig::for_targets(2)).await;
    let output = tempfile::tempdir().unwrap();
    let config = test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
    let drafter = tokio::spawn(run(config, CancellationToken::new()));
    let mut poisoned = target_samples(&random_token_sequences(8, 24, 3));
    let clean = target_samples(&random_token_sequences(8, 24, 4));
    // bf16 NaN (0x7FC0) in the middle of one sample's hidden states.
    let hidden = poisoned[POISONED_SEQ]
        .tensors
        .iter_mut()
        .find(|tensor| tensor.name == "hidden_states")
        .unwrap();
    let mut bytes = hidden.data.to_vec();
    let middle = (bytes.len() / 2) & !1;
    bytes[middle..middle + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    hidden.data = bytes.into();
    tokio::join!(
        produce(&broker.address, "target-0", clean, true),
        produce(&broker.address, "target-1", poisoned, true),
    );
    let report = report_within(TEST_TIMEOUT, drafter).await;
    assert_eq!(report.end, RunEnd::Complete);
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(report.non_finite_samples, 1);
    assert_eq!(report.samples_trained, 15);
    assert!(report.last_loss.is_some_and(f64::is_finite), "{report:?}");
    let status = broker.status().await;
    assert_eq!(status.dead_letters, 1);
    assert_eq!(status.acked_items, 15);
    let dead = &status.dead_letter_items[0];
    assert_eq!(
        (dead.target_id.as_str(), dead.seq),
        ("target-1", POISONED_SEQ as u64)
    );
    assert!(
        dead.reason.contains("target target-1 seq 5") && dead.reason.contains("non-finite"),
        "{}",
        dead.reason
    );
    let checkpoint = report.final_checkpoint.clone().expect("final checkpoint");
    let weights = tch::Tensor::read_safetensors(checkpoint.join("model.safetensors")).unwrap();
    for (name, tensor) in weights {
        let finite = tensor.isfinite().all().int64_value(&[]) == 1;
        assert!(finite, "{name} is not finite");
    }
    broker.stop().await;
}

/// Samples whose hidden states are finite but overflow the model (bf16
/// 3e38: the projection reaches infinity, the loss is NaN) make every step
/// non-finite: each is skipped (the model unchanged, the items requeued),
/// and `--max-skipped-steps` in a row stop the drafter with an error naming
/// the reason; nothing is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn steps_that_go_non_finite_are_skipped_and_too_many_in_a_row_stop_the_drafter() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir().unwrap();
    let mut config = test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
    config.max_skipped_steps = 3;
    let drafter = tokio::spawn(run(config, CancellationToken::new()));
    let huge = (((3.0e38f32).to_bits() >> 16) as u16).to_le_bytes();
    let samples: Vec<_> = (0..4)
        .map(|_| {
            let tokens: Vec<i32> = (0..12).map(|token| token + 3).collect();
            let hidden: Vec<u8> = huge.iter().copied().cycle().take(12 * 128 * 2).collect();
            encode_sample(&tokens, &[1; 12], &hidden, 128)
        })
        .collect();
    produce(&broker.address, "target-0", samples, true).await;
    let outcome = tokio::time::timeout(TEST_TIMEOUT, drafter)
        .await
        .expect("the drafter stopped in time")
        .unwrap();
    let error = outcome.expect_err("the drafter fails");
    let message = error.to_string();
    assert!(
        message.contains("3 optimizer steps in a row were skipped")
            && message.contains("not finite"),
        "{message}"
    );
    let status = broker.status().await;
    assert_eq!(status.acked_items, 0, "{status:?}");
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_finishes_the_step_checkpoints_and_hands_back_unused_items() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir().unwrap();
    let mut config = test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
    // Steps happen only at 4 held samples; the 2 extra never fill a step.
    config.linger = std::time::Duration::from_millis(600_000);
    config.batch_tokens = 1 << 20;
    let shutdown = CancellationToken::new();
    let drafter = tokio::spawn(run(config, shutdown.clone()));
    produce(
        &broker.address,
        "target-0",
        target_samples(&random_token_sequences(6, 16, 2)),
        false,
    )
    .await;
    let stepped = wait_until(TEST_TIMEOUT, || async {
        let status = broker.status().await;
        drafter_status(&status, "drafter-0")
            .is_some_and(|drafter| drafter.acked_items == 4 && drafter.leased_items == 2)
    })
    .await;
    assert!(
        stepped,
        "the drafter did not ack one step and hold two items"
    );
    shutdown.cancel();
    let report = report_within(Duration::from_secs(30), drafter).await;
    assert_eq!(report.end, RunEnd::Shutdown);
    assert_eq!(report.exit(), dflash_shell::Exit::Done);
    assert_eq!(report.steps, 1);
    assert_eq!(report.requeued, 2);
    let checkpoint = report
        .final_checkpoint
        .expect("checkpoint written on shutdown");
    assert!(checkpoint.ends_with("step-00000001"));
    assert!(checkpoint.join("model.safetensors").is_file());
    let released = wait_until(Duration::from_secs(10), || async {
        let status = broker.status().await;
        status.leased_items == 0 && status.queued_items == 2 && status.acked_items == 4
    })
    .await;
    assert!(
        released,
        "unused items were not handed back: {:?}",
        broker.status().await
    );
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn items_of_a_killed_drafter_are_redelivered_because_acks_follow_steps() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir().unwrap();
    let mut holding = test_drafter_config(
        "drafter-holding",
        &broker.address,
        output.path().join("holding"),
    );
    holding.linger = std::time::Duration::from_millis(600_000);
    holding.batch_tokens = 1 << 20;
    holding.max_step_samples = 8;
    let killed = tokio::spawn(run(holding, CancellationToken::new()));
    produce(
        &broker.address,
        "target-0",
        target_samples(&random_token_sequences(5, 16, 3)),
        true,
    )
    .await;
    let all_leased = wait_until(TEST_TIMEOUT, || async {
        let status = broker.status().await;
        drafter_status(&status, "drafter-holding").is_some_and(|drafter| drafter.leased_items == 5)
    })
    .await;
    assert!(all_leased, "the holding drafter did not lease every item");
    assert_eq!(
        broker.status().await.acked_items,
        0,
        "nothing is acked before a step"
    );
    // Kill it between delivery and step.
    killed.abort();
    let _ = killed.await;

    let config = test_drafter_config("drafter-next", &broker.address, output.path().join("next"));
    let report = tokio::time::timeout(TEST_TIMEOUT, run(config, CancellationToken::new()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.end, RunEnd::Complete);
    assert_eq!(
        report.samples_trained, 5,
        "every item was redelivered to the next drafter"
    );
    let status = broker.status().await;
    assert_eq!(status.acked_items, 5);
    assert!(status.redelivered_items >= 5);
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_aborted_run_checkpoints_and_exits_non_zero() {
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.target_grace = Duration::from_millis(300);
    let broker = TestBroker::start(broker_config).await;
    let output = tempfile::tempdir().unwrap();
    let config = test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
    let drafter = tokio::spawn(run(config, CancellationToken::new()));
    // The target streams a few items and vanishes without reporting done.
    produce(
        &broker.address,
        "target-0",
        target_samples(&random_token_sequences(4, 16, 4)),
        false,
    )
    .await;
    let report = report_within(TEST_TIMEOUT, drafter).await;
    assert!(
        matches!(&report.end, RunEnd::Aborted { reason } if reason.contains("target-0")),
        "{:?}",
        report.end
    );
    assert_eq!(report.exit(), dflash_shell::Exit::Aborted);
    let checkpoint = report.final_checkpoint.expect("checkpoint before exiting");
    assert!(checkpoint.join("model.safetensors").is_file());
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resume_continues_from_the_latest_checkpoint() {
    let output = tempfile::tempdir().unwrap();
    let samples = target_samples(&random_token_sequences(8, 16, 5));
    let mut steps_after_each_run = Vec::new();
    for (run_index, resume) in [false, true].into_iter().enumerate() {
        let mut broker_config = BrokerConfig::for_targets(1);
        broker_config.target_ids = vec![format!("target-{run_index}")];
        let broker = TestBroker::start(broker_config).await;
        let mut config =
            test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
        // An independent drafter: with data parallelism `--resume` is
        // refused (the run resumes from the broker's state dir).
        config.model_sync.model_sync = dflash_drafter_server::model_sync::ModelSyncMode::Off;
        config.resume = resume;
        let drafter = tokio::spawn(run(config, CancellationToken::new()));
        produce(
            &broker.address,
            &format!("target-{run_index}"),
            samples.clone(),
            true,
        )
        .await;
        let report = report_within(TEST_TIMEOUT, drafter).await;
        assert_eq!(report.end, RunEnd::Complete);
        steps_after_each_run.push(report.steps);
        broker.stop().await;
    }
    let (first, second) = (steps_after_each_run[0], steps_after_each_run[1]);
    assert!(first >= 2, "first run took {first} steps");
    assert!(
        second > first,
        "the resumed run restarted its step count: {first} then {second}"
    );
    let latest = latest_checkpoint(output.path())
        .unwrap()
        .expect("latest checkpoint");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(latest.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], second);
    assert_eq!(state["samples_trained"], 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synthetic_mode_consumes_and_acks_without_a_model() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir().unwrap();
    let mut config = test_drafter_config(
        "drafter-synthetic",
        &broker.address,
        output.path().to_path_buf(),
    );
    config.target_model = None;
    config.model = "synthetic:ms_per_1k_tokens=200"
        .parse::<ModelMode>()
        .unwrap();
    let drafter = tokio::spawn(run(config, CancellationToken::new()));
    // Any hidden width: the synthetic drafter has no model to match.
    produce(
        &broker.address,
        "target-0",
        samples_with_width(20, 50, 8),
        true,
    )
    .await;
    let report = report_within(TEST_TIMEOUT, drafter).await;
    assert_eq!(report.end, RunEnd::Complete);
    assert_eq!(report.samples_trained, 20);
    assert_eq!(report.tokens_trained, 1000);
    assert_eq!(report.device, "synthetic");
    // 1000 tokens at 200 ms per 1k: at least 0.2 s of modelled compute.
    assert!(
        report.tokens_per_second > 0.0 && report.tokens_per_second < 5000.0 * 1.5,
        "{}",
        report.tokens_per_second
    );
    assert!(report.busy_fraction > 0.0);
    assert_eq!(broker.status().await.acked_items, 20);
    broker.stop().await;
}

/// `--draft-architecture dflash2`: the drafter trains DFlash2 (its steps
/// finite) and its checkpoint is the reference's DFlash2DraftModel with the
/// selector's and the convolutions' tensors (`make check-dflash2` loads one
/// in the reference package).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dflash2_drafter_trains_and_writes_a_dflash2_checkpoint() {
    let output = tempfile::tempdir().unwrap();
    let samples = target_samples(&random_token_sequences(8, 16, 9));
    let broker = TestBroker::for_targets(1).await;
    let mut config = test_drafter_config("drafter-0", &broker.address, output.path().to_path_buf());
    config.draft_architecture = dflash_drafter_server::config::DraftArchitecture::Dflash2;
    let drafter = tokio::spawn(run(config, CancellationToken::new()));
    produce(&broker.address, "target-0", samples, true).await;
    let report = report_within(TEST_TIMEOUT, drafter).await;
    assert_eq!(report.end, RunEnd::Complete);
    assert!(report.steps >= 2, "{} steps", report.steps);
    let checkpoint = report.final_checkpoint.expect("a final checkpoint");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(checkpoint.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "DFlash2DraftModel", "{config}");
    let names: Vec<String> = tch::Tensor::read_safetensors(checkpoint.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(name, tensor)| {
            let finite = bool::try_from(tensor.isfinite().all()).unwrap();
            assert!(finite, "{name} is not finite");
            name
        })
        .collect();
    assert!(
        names.iter().any(|name| name.contains("codebook")),
        "no selector codebook in {names:?}"
    );
    broker.stop().await;
}
