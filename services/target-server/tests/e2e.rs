//! target-servers on the tiny model against a real in-process broker and a
//! test drafter: every line arrives exactly once with the right shapes and
//! values, targets report done, end-of-stream follows; resume skips exactly
//! what the broker has; synthetic mode streams correctly shaped states.

mod common;

use anyhow::{ensure, Context, Result};
use common::*;
use dflash_model::chat::{parse_line, ChatEncoder};
use dflash_model::target_model::TargetModel;
use dflash_proto::v1 as proto;
use dflash_target_server::{run, ModelSource, TargetReport, TargetServerConfig};
use dflash_testkit::Drained;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// (input_ids, loss_mask) of every line, as the encoder makes them.
fn expected_samples(model: &std::path::Path, lines: &[String]) -> Result<Vec<(Vec<i64>, Vec<u8>)>> {
    let encoder = ChatEncoder::from_directory(model, 3072, Some(512))?;
    let mut samples = Vec::new();
    for line in lines {
        let encoded = encoder.encode(&parse_line(line)?)?;
        samples.push((encoded.input_ids, encoded.loss_mask));
    }
    samples.sort();
    Ok(samples)
}

fn delivered_samples(deliveries: &[proto::Delivery]) -> Result<Vec<(Vec<i64>, Vec<u8>)>> {
    let mut samples = Vec::new();
    for delivery in deliveries {
        let sample = delivery
            .sample
            .as_ref()
            .context("delivery without sample")?;
        samples.push((
            input_ids_of(sample)?,
            tensor(sample, "loss_mask")?.data.to_vec(),
        ));
    }
    samples.sort();
    Ok(samples)
}

/// Shapes and dtypes of one delivered sample; returns its token count.
fn check_shapes(sample: &proto::Sample, width: u64) -> Result<u64> {
    sample.validate()?;
    let ids = tensor(sample, "input_ids")?;
    let tokens = ids.shape[0];
    ensure!(ids.shape == vec![tokens] && ids.checked_dtype()? == proto::Dtype::I32);
    let mask = tensor(sample, "loss_mask")?;
    ensure!(mask.shape == vec![tokens] && mask.checked_dtype()? == proto::Dtype::U8);
    let hidden = tensor(sample, "hidden_states")?;
    ensure!(
        hidden.shape == vec![tokens, width],
        "hidden shape {:?}",
        hidden.shape
    );
    ensure!(hidden.checked_dtype()? == proto::Dtype::Bf16);
    Ok(tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_targets_stream_every_line_once_then_end_of_stream() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let lines = mixed_data_lines();
    let data = scratch.path().join("train.jsonl");
    write_lines(&data, &lines)?;

    let broker = TestBroker::for_targets(2).await;
    let drafter = spawn_drafter(broker.client().await, "drafter-0", DRAIN_TIMEOUT);
    let shutdown = CancellationToken::new();
    let (first, second) = tokio::join!(
        run(
            target_config(&broker.address, "target-0", &model, &data),
            shutdown.clone()
        ),
        run(
            target_config(&broker.address, "target-1", &model, &data),
            shutdown.clone()
        ),
    );
    let (first, second) = (first?, second?);
    let drained = drafter.await??;

    for report in [&first, &second] {
        ensure!(report.completed && report.rejected.is_empty(), "{report:?}");
        ensure!(report.layer_ids == vec![1, 2, 3, 4, 5]);
        ensure!(report.device == "cpu");
        ensure!(
            report.tokens_per_second > 0.0
                && report.busy_fraction > 0.0
                && report.busy_fraction <= 1.0
        );
    }
    ensure!((first.shard.index, first.shard.count) == (0, 2));
    ensure!((second.shard.index, second.shard.count) == (1, 2));
    ensure!(first.total_accepted + second.total_accepted == lines.len() as u64);
    ensure!(
        first.total_accepted == 8 && second.total_accepted == 7,
        "round-robin split of 15 records"
    );

    ensure!(
        drained.end_of_stream.status() == proto::RunStatus::Complete,
        "{:?}",
        drained.end_of_stream
    );
    ensure!(drained.deliveries.len() == lines.len());
    let identities: BTreeSet<(String, u64)> = drained
        .deliveries
        .iter()
        .map(|delivery| (delivery.target_id.clone(), delivery.seq))
        .collect();
    ensure!(identities.len() == lines.len(), "duplicate deliveries");
    ensure!(delivered_samples(&drained.deliveries)? == expected_samples(&model, &lines)?);

    // Shapes, and values against a direct forward of the same tokens.
    let reference = TargetModel::load(&model, tch::Device::Cpu, tch::Kind::Float)?;
    for delivery in &drained.deliveries {
        let sample = delivery
            .sample
            .as_ref()
            .context("delivery without sample")?;
        let tokens = check_shapes(sample, 5 * 64)?;
        let ids = input_ids_of(sample)?;
        let input = tch::Tensor::from_slice(&ids).view([1, tokens as i64]);
        let expected =
            reference.capture_hidden_states(&input, &input.ones_like(), &[1, 2, 3, 4, 5])?;
        let expected: Vec<f32> = Vec::<f32>::try_from(expected.flatten(0, -1))?;
        let actual = bf16_values(tensor(sample, "hidden_states")?);
        let worst = expected
            .iter()
            .zip(&actual)
            .map(|(expected, actual)| (expected - actual).abs() / expected.abs().max(1.0))
            .fold(0.0f32, f32::max);
        ensure!(
            worst < 0.01,
            "seq {} of {}: relative error {worst}",
            delivery.seq,
            delivery.target_id
        );
    }

    let status = broker.client().await.status().await?;
    ensure!(status.done_targets == 2);
    let stats: BTreeMap<String, proto::ProducerStats> = status
        .targets
        .iter()
        .filter_map(|target| {
            target
                .stats
                .clone()
                .map(|stats| (target.target_id.clone(), stats))
        })
        .collect();
    ensure!(stats.len() == 2, "{stats:?}");
    for (target_id, stats) in &stats {
        ensure!(stats.device == "cpu", "{target_id}: {stats:?}");
        ensure!(
            stats.tokens_done > 0 && stats.samples_done > 0 && stats.samples_total > 0,
            "{stats:?}"
        );
    }
    broker.stop().await;
    Ok(())
}

/// A sample with the target-server's names, dtypes and width, for seeding
/// the broker with "earlier run" items.
fn placeholder_sample(tokens: u64, width: u64) -> proto::Sample {
    proto::Sample {
        tensors: vec![
            proto::Tensor::from_parts(
                "input_ids",
                proto::Dtype::I32,
                vec![tokens],
                vec![0u8; tokens as usize * 4].into(),
            ),
            proto::Tensor::from_parts(
                "loss_mask",
                proto::Dtype::U8,
                vec![tokens],
                vec![1u8; tokens as usize].into(),
            ),
            proto::Tensor::from_parts(
                "hidden_states",
                proto::Dtype::Bf16,
                vec![tokens, width],
                vec![0u8; (tokens * width * 2) as usize].into(),
            ),
        ],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_target_skips_exactly_what_the_broker_accepted() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let lines = mixed_data_lines();
    let data = scratch.path().join("train.jsonl");
    write_lines(&data, &lines)?;
    let broker = TestBroker::for_targets(1).await;

    // An "earlier run" of target-0 got seqs 0..=3 in before dying.
    let client = broker.client().await;
    let mut earlier = client.produce("target-0").await?;
    for seq in 0..4 {
        earlier
            .send(seq, placeholder_sample(3, 320), Default::default())
            .await?;
    }
    let earlier_report = earlier.finish().await?;
    ensure!(earlier_report.accepted == 4);

    let drafter = spawn_drafter(broker.client().await, "drafter-0", DRAIN_TIMEOUT);
    let report = run(
        target_config(&broker.address, "target-0", &model, &data),
        CancellationToken::new(),
    )
    .await?;
    let drained = drafter.await??;

    ensure!(report.resume_after_seq == Some(3), "{report:?}");
    ensure!(report.reader.skipped_for_resume == 4);
    ensure!(report.samples_sent == lines.len() as u64 - 4);
    ensure!(report.accepted == lines.len() as u64 - 4 && report.duplicates == 0);
    ensure!(report.total_accepted == lines.len() as u64);

    let seqs: Vec<u64> = {
        let mut seqs: Vec<u64> = drained
            .deliveries
            .iter()
            .map(|delivery| delivery.seq)
            .collect();
        seqs.sort_unstable();
        seqs
    };
    ensure!(
        seqs == (0..lines.len() as u64).collect::<Vec<u64>>(),
        "{seqs:?}"
    );
    ensure!(drained.end_of_stream.status() == proto::RunStatus::Complete);

    // The resumed run sent the samples after seq 3 of the same order a full
    // run would: a fresh full run on another broker gives them the same seqs.
    let fresh_broker = TestBroker::for_targets(1).await;
    let fresh_drafter = spawn_drafter(fresh_broker.client().await, "drafter-0", DRAIN_TIMEOUT);
    run(
        target_config(&fresh_broker.address, "target-0", &model, &data),
        CancellationToken::new(),
    )
    .await?;
    let fresh = fresh_drafter.await??;
    let by_seq = |deliveries: &[proto::Delivery]| -> Result<BTreeMap<u64, Vec<i64>>> {
        deliveries
            .iter()
            .filter(|delivery| delivery.seq > 3)
            .map(|delivery| {
                Ok((
                    delivery.seq,
                    input_ids_of(delivery.sample.as_ref().context("no sample")?)?,
                ))
            })
            .collect()
    };
    ensure!(by_seq(&drained.deliveries)? == by_seq(&fresh.deliveries)?);
    broker.stop().await;
    fresh_broker.stop().await;
    Ok(())
}

/// A synthetic target-0 (`spec` after `synthetic:`) for `broker`, in
/// batches of at most `max_batch_tokens`.
fn synthetic_target(
    broker: &TestBroker,
    spec: &str,
    max_batch_tokens: usize,
) -> Result<TargetServerConfig> {
    let model: ModelSource = format!("synthetic:{spec}")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model, None);
    config.max_batch_tokens = max_batch_tokens;
    Ok(config)
}

/// Runs that synthetic target to its end against a fresh broker and one
/// test drafter, and checks that it completed with `samples` accepted and
/// that the drafter got every one. The broker is returned still serving.
async fn synthetic_run(
    spec: &str,
    max_batch_tokens: usize,
    samples: u64,
) -> Result<(TestBroker, TargetReport, Drained)> {
    let broker = TestBroker::for_targets(1).await;
    let drafter = spawn_drafter(broker.client().await, "drafter-0", DRAIN_TIMEOUT);
    let config = synthetic_target(&broker, spec, max_batch_tokens)?;
    let report = run(config, CancellationToken::new()).await?;
    let drained = drafter.await??;
    ensure!(
        report.completed && report.total_accepted == samples,
        "{report:?}"
    );
    ensure!(drained.deliveries.len() as u64 == samples);
    Ok((broker, report, drained))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_mode_streams_shaped_states_without_a_model() -> Result<()> {
    let (broker, report, drained) = synthetic_run(
        "hidden=32,layers=3,tokens_per_s=0,samples=9,seq_len=16,vocab=1000",
        64,
        9,
    )
    .await?;
    ensure!(report.device == "synthetic", "{report:?}");
    for delivery in &drained.deliveries {
        let sample = delivery.sample.as_ref().context("no sample")?;
        ensure!(check_shapes(sample, 96)? == 16);
        ensure!(input_ids_of(sample)?
            .iter()
            .all(|&id| (0..1000).contains(&id)));
    }
    ensure!(drained.end_of_stream.status() == proto::RunStatus::Complete);
    broker.stop().await;
    Ok(())
}

/// A synthetic target held to a low token rate waits, not works: its busy
/// fraction counts the batches' making, not the holds. 20 samples of 16
/// tokens at 400 tokens/s, batches of 32 tokens: the holds before the
/// second to the tenth batch take (320 - 32) / 400 = 0.72 s, and sleeps on
/// a loaded machine only last longer. A batch's busy time is its forward
/// (copying 32 rows of 64 bytes: microseconds) plus the hand-off to the
/// collector thread, which is where a loaded machine's scheduling delays
/// land. busy / active <= busy / (busy + 0.72 s), so a correct run reaches
/// the bound 0.8 only with 4 x 0.72 = 2.9 s of such delays over ten
/// batches (0.29 s each). A run that counts the holds as device time
/// counts every interval between two batches' ends: 1.0 (it reported about
/// 1 when the hold counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synthetic_target_held_to_a_low_rate_is_mostly_idle() -> Result<()> {
    let (broker, report, _) = synthetic_run(
        "hidden=16,layers=2,tokens_per_s=400,samples=20,seq_len=16",
        32,
        20,
    )
    .await?;
    ensure!(
        report.busy_fraction > 0.0 && report.busy_fraction < 0.8,
        "busy fraction {} of a target held to 400 tokens/s",
        report.busy_fraction
    );
    broker.stop().await;
    Ok(())
}

/// The first run is interrupted while the broker holds it back: the queue
/// has room for a few of the 40 items and no drafter takes any yet, so the
/// target cannot finish however fast it runs or however late the test gets
/// to cancel it. The test waits for that state (the next item does not fit),
/// not for a share of a work window. Interrupted while held back, the
/// target waits its short grace for answers that cannot come and reports
/// none (a SIGTERM with a full queue). What it had pushed into the stream's
/// window the broker may still accept once a drafter frees room, until it
/// reads the stream's end; so the restart waits for that event (the target
/// shown disconnected) and must resume after exactly what the broker has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_target_does_not_report_done_and_its_restart_completes_the_shard() -> Result<()>
{
    let broker = TestBroker::start(dflash_broker::BrokerConfig {
        // A synthetic item here is 1.9 KiB: room for 8.
        max_queue_bytes: 16 << 10,
        max_item_bytes: 8 << 10,
        ..dflash_broker::BrokerConfig::for_targets(1)
    })
    .await;
    let mut config = synthetic_target(
        &broker,
        "hidden=16,layers=2,tokens_per_s=0,samples=40,seq_len=16",
        32,
    )?;
    config.sort_window = 8;

    let shutdown = CancellationToken::new();
    let first_run = tokio::spawn(run(config.clone(), shutdown.clone()));
    // The 60 s waits only stop a hang.
    let held_back = dflash_testkit::wait_until(Duration::from_secs(60), || async {
        let status = broker.status().await;
        let per_item = status.queued_bytes / status.accepted_items.max(1);
        status.accepted_items > 0 && status.queued_bytes + per_item > status.max_queue_bytes
    })
    .await;
    let status = broker.status().await;
    ensure!(
        held_back,
        "the broker never held the target back: {status:?}"
    );
    let held = status.accepted_items;
    ensure!(held < 40, "{held} accepted: nothing held back");
    shutdown.cancel();
    let interrupted = first_run.await??;
    ensure!(!interrupted.completed, "{interrupted:?}");
    // Nothing more fits until a drafter acks: no more accepted, and no
    // ReportDone.
    let status = broker.status().await;
    ensure!(status.accepted_items == held, "{status:?}");
    ensure!(status.done_targets == 0, "{status:?}");

    let drafter = spawn_drafter(broker.client().await, "drafter-0", DRAIN_TIMEOUT);
    let target_state = |status: &proto::StatusSnapshot| {
        status
            .targets
            .iter()
            .find(|target| target.target_id == "target-0")
            .map(|target| target.state())
    };
    let disconnected = dflash_testkit::wait_until(Duration::from_secs(60), || async {
        target_state(&broker.status().await) == Some(proto::TargetState::Disconnected)
    })
    .await;
    let status = broker.status().await;
    ensure!(
        disconnected,
        "the first run's stream never ended at the broker: {status:?}"
    );
    let accepted_before_restart = status.accepted_items;
    ensure!((held..40).contains(&accepted_before_restart), "{status:?}");
    let resumed = run(config, CancellationToken::new()).await?;
    ensure!(resumed.completed);
    ensure!(
        resumed.resume_after_seq == Some(accepted_before_restart - 1),
        "{accepted_before_restart} accepted before the restart: {resumed:?}"
    );
    ensure!(resumed.total_accepted == 40 && resumed.duplicates == 0);
    ensure!(
        resumed.samples_sent == 40 - accepted_before_restart,
        "{resumed:?}"
    );

    let drained = drafter.await??;
    let mut seqs: Vec<u64> = drained
        .deliveries
        .iter()
        .map(|delivery| delivery.seq)
        .collect();
    seqs.sort_unstable();
    ensure!(seqs == (0..40).collect::<Vec<u64>>(), "{seqs:?}");
    ensure!(drained.end_of_stream.status() == proto::RunStatus::Complete);
    broker.stop().await;
    Ok(())
}

/// The run decides (DSpark's teacher): under a broker with
/// `--target-capture last-hidden-states` every sample, the first included,
/// also carries `last_hidden_states` `[T, hidden]` bf16, the final-normed
/// last hidden state, whose LM head output is the target's own logits; under
/// a broker without it no sample carries it (DFlash runs do not pay its
/// bytes). The target itself has no flag for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_hidden_state_is_sent_only_when_the_run_asks_and_gives_the_target_logits(
) -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let lines: Vec<String> = mixed_data_lines().into_iter().take(4).collect();
    let data = scratch.path().join("train.jsonl");
    write_lines(&data, &lines)?;
    let reference = TargetModel::load(&model, tch::Device::Cpu, tch::Kind::Float)?;
    for capture in [true, false] {
        let broker = TestBroker::start(dflash_broker::BrokerConfig {
            target_capture: if capture {
                vec![dflash_broker::config::CapturedTensor::LastHiddenStates]
            } else {
                Vec::new()
            },
            ..dflash_broker::BrokerConfig::for_targets(1)
        })
        .await;
        let drafter = spawn_drafter(broker.client().await, "drafter-0", DRAIN_TIMEOUT);
        let config = target_config(&broker.address, "target-0", &model, &data);
        let report = run(config, CancellationToken::new()).await?;
        ensure!(report.completed, "{report:?}");
        let drained = drafter.await??;
        ensure!(drained.deliveries.len() == lines.len());
        for delivery in &drained.deliveries {
            let sample = delivery
                .sample
                .as_ref()
                .context("delivery without sample")?;
            let tokens = check_shapes(sample, 5 * 64)?;
            let decoded = dflash_proto::sample::decode(sample)?;
            let Some(last) = decoded.last_hidden_states else {
                ensure!(!capture, "seq {}: no last_hidden_states", delivery.seq);
                continue;
            };
            ensure!(
                capture,
                "seq {}: last_hidden_states in a run that did not ask for it",
                delivery.seq
            );
            ensure!(last.width == 64 && last.dtype == proto::Dtype::Bf16);
            let ids = input_ids_of(sample)?;
            let input = tch::Tensor::from_slice(&ids).view([1, tokens as i64]);
            let expected_logits = reference.logits(&input, &input.ones_like())?.get(0);
            let sent = tch::Tensor::from_slice(&bf16_values(last.tensor)).view([tokens as i64, 64]);
            let logits = reference.lm_head_logits(&sent);
            // bf16 keeps 8 bits of mantissa: the argmax of the logits made
            // from the sent state is the target's at nearly every token.
            let agreeing = logits
                .argmax(-1, false)
                .eq_tensor(&expected_logits.argmax(-1, false))
                .to_kind(tch::Kind::Float)
                .mean(tch::Kind::Float)
                .double_value(&[]);
            ensure!(
                agreeing > 0.95,
                "seq {}: argmax agrees at {agreeing}",
                delivery.seq
            );
        }
        broker.stop().await;
    }
    Ok(())
}
