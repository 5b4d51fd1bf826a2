//! Bad inputs give clear errors (and no ReportDone), or are handled as
//! documented: missing model files, a wrong dtype flag, malformed JSONL
//! lines, an empty data file, over-long sequences, out-of-range layer ids.

mod common;

use anyhow::{ensure, Context, Result};
use common::*;
use dflash_target_server::{run, TargetServerError};
use std::process::Command;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Nothing listens here: tests that must fail before contacting the broker
/// use it, so reaching the broker would be a different error.
const NO_BROKER: &str = "http://127.0.0.1:9";

fn error_text(result: Result<dflash_target_server::TargetReport, TargetServerError>) -> String {
    match result {
        Ok(report) => format!("unexpected success: {report:?}"),
        Err(error) => error.to_string(),
    }
}

#[tokio::test]
async fn missing_model_files_fail_before_contacting_the_broker() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let data = scratch.path().join("train.jsonl");
    write_lines(&data, &mixed_data_lines())?;
    let empty_model = scratch.path().join("no-model");
    std::fs::create_dir_all(&empty_model)?;
    let message = error_text(
        run(
            target_config(NO_BROKER, "target-0", &empty_model, &data),
            CancellationToken::new(),
        )
        .await,
    );
    ensure!(
        message.contains("config.json") && message.contains("no-model"),
        "{message}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_weights_are_named_and_the_target_is_not_done() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    std::fs::remove_file(model.join("model.safetensors"))?;
    let data = scratch.path().join("train.jsonl");
    write_lines(&data, &mixed_data_lines())?;
    let broker = TestBroker::for_targets(1).await;
    let result = run(
        target_config(&broker.address, "target-0", &model, &data),
        CancellationToken::new(),
    )
    .await;
    let message = error_text(result);
    ensure!(message.contains("no model.safetensors"), "{message}");
    ensure!(broker.client().await.status().await?.done_targets == 0);
    broker.stop().await;
    Ok(())
}

#[tokio::test]
async fn empty_or_missing_data_files_are_errors() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let empty = scratch.path().join("empty.jsonl");
    std::fs::write(&empty, "\n  \n")?;
    let result = run(
        target_config(NO_BROKER, "target-0", &model, &empty),
        CancellationToken::new(),
    )
    .await;
    ensure!(
        matches!(&result, Err(TargetServerError::Reader(_))),
        "{result:?}"
    );
    let message = error_text(result);
    ensure!(
        message.contains("empty.jsonl: the data file has no records"),
        "{message}"
    );

    let missing = scratch.path().join("missing.jsonl");
    let message = error_text(
        run(
            target_config(NO_BROKER, "target-0", &model, &missing),
            CancellationToken::new(),
        )
        .await,
    );
    ensure!(message.contains("missing.jsonl"), "{message}");
    Ok(())
}

fn lines_with_two_bad_ones() -> Vec<String> {
    let mut lines = mixed_data_lines();
    lines.insert(2, "{\"messages\": [{\"role\": \"user\"".to_string());
    lines.insert(6, "{\"input_ids\": [1, 99999]}".to_string());
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_lines_stop_the_run_at_the_limit_without_report_done() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let data = scratch.path().join("train.jsonl");
    std::fs::write(&data, lines_with_two_bad_ones().join("\n"))?;
    let broker = TestBroker::for_targets(1).await;
    let mut config = target_config(&broker.address, "target-0", &model, &data);
    config.max_bad_lines = 1;
    let message = error_text(run(config, CancellationToken::new()).await);
    ensure!(
        message.contains("2 malformed lines, more than --max-bad-lines 1"),
        "{message}"
    );
    ensure!(message.contains("line 3: not valid JSON"), "{message}");
    let status = broker.client().await.status().await?;
    ensure!(
        status.done_targets == 0,
        "a failed target must not report done"
    );
    broker.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tolerated_malformed_lines_are_reported_with_line_numbers() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let data = scratch.path().join("train.jsonl");
    let lines = lines_with_two_bad_ones();
    std::fs::write(&data, lines.join("\n"))?;
    let broker = TestBroker::for_targets(1).await;
    let drafter = spawn_drafter(broker.client().await, "drafter-0", Duration::from_secs(120));
    let mut config = target_config(&broker.address, "target-0", &model, &data);
    config.max_bad_lines = 2;
    let report = run(config, CancellationToken::new()).await?;
    let drained = drafter.await??;
    let bad: Vec<(u64, bool)> = report
        .reader
        .bad_lines
        .iter()
        .map(|bad| {
            (
                bad.line_number,
                bad.reason.contains("vocabulary") || bad.reason.contains("JSON"),
            )
        })
        .collect();
    ensure!(
        bad == vec![(3, true), (7, true)],
        "{:?}",
        report.reader.bad_lines
    );
    ensure!(report.total_accepted == lines.len() as u64 - 2);
    ensure!(drained.deliveries.len() == lines.len() - 2);
    broker.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_long_sequences_are_truncated_to_max_length() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let data = scratch.path().join("train.jsonl");
    let lines = mixed_data_lines();
    write_lines(&data, &lines)?;
    let broker = TestBroker::for_targets(1).await;
    let drafter = spawn_drafter(broker.client().await, "drafter-0", Duration::from_secs(120));
    let mut config = target_config(&broker.address, "target-0", &model, &data);
    config.max_length = 12;
    let report = run(config, CancellationToken::new()).await?;
    let drained = drafter.await??;
    let lengths: Vec<usize> = drained
        .deliveries
        .iter()
        .map(|delivery| {
            input_ids_of(delivery.sample.as_ref().context("no sample")?).map(|ids| ids.len())
        })
        .collect::<Result<_>>()?;
    ensure!(lengths.iter().all(|&length| length <= 12), "{lengths:?}");
    let truncated = lengths.iter().filter(|&&length| length == 12).count() as u64;
    // Every chat line and most pre-tokenized ones exceed 12 tokens.
    ensure!(
        report.reader.truncated >= 10 && report.reader.truncated <= truncated,
        "{:?}",
        report.reader
    );
    broker.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_layer_ids_are_rejected() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let data = scratch.path().join("train.jsonl");
    write_lines(&data, &mixed_data_lines())?;
    let broker = TestBroker::for_targets(1).await;
    let mut config = target_config(&broker.address, "target-0", &model, &data);
    config.layer_ids = Some(vec![1, 8]);
    let message = error_text(run(config, CancellationToken::new()).await);
    ensure!(
        message.contains("layer id 8 out of range") && message.contains("8 layers"),
        "{message}"
    );
    broker.stop().await;
    Ok(())
}

#[test]
fn binary_rejects_a_wrong_dtype_and_documents_every_flag() -> Result<()> {
    let binary = env!("CARGO_BIN_EXE_target-server");
    let wrong = Command::new(binary)
        .args([
            "--model",
            "/nonexistent",
            "--data",
            "x.jsonl",
            "--dtype",
            "int4",
        ])
        .output()?;
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    ensure!(
        wrong.status.code() == Some(2),
        "{:?} {stderr}",
        wrong.status
    );
    ensure!(
        stderr.contains("int4") && stderr.contains("bf16"),
        "{stderr}"
    );

    let help = Command::new(binary).arg("--help").output()?;
    ensure!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--broker",
        "--target-id",
        "--model",
        "--data",
        "--tokenizer",
        "--device",
        "--dtype",
        "--layer-ids",
        "--num-draft-layers",
        "--max-length",
        "--max-batch-tokens",
        "--sort-window",
        "--max-bad-lines",
        "--shard-index",
        "--num-shards",
        "--stats-interval",
        "--max-reconnects",
        "--finish-timeout",
    ] {
        ensure!(help.contains(flag), "--help lacks {flag}");
    }
    ensure!(
        help.contains("[env: DFLASH_BROKER="),
        "env fallbacks are documented"
    );
    Ok(())
}

#[test]
fn binary_runs_without_library_path_and_fails_cleanly_on_missing_model() -> Result<()> {
    // The rpath from build.rs must make libtorch loadable on its own.
    let output = Command::new(env!("CARGO_BIN_EXE_target-server"))
        .env_remove("LD_LIBRARY_PATH")
        .args([
            "--model",
            "/nonexistent-model",
            "--data",
            "x.jsonl",
            "--broker",
            NO_BROKER,
        ])
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.code() == Some(1),
        "{:?} {stderr}",
        output.status
    );
    ensure!(
        stderr.contains("/nonexistent-model/config.json"),
        "{stderr}"
    );
    Ok(())
}

/// ReportDone carries the samples this target numbered from its shard, not
/// the broker's own count of its items (which made the broker's check
/// vacuous): a broker that holds items this shard does not have (the data
/// changed between runs) answers FAILED_PRECONDITION, the target fails, and
/// the run does not count it done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_done_counts_the_shard_not_the_broker() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model = write_model(scratch.path())?;
    let data = scratch.path().join("train.jsonl");
    let lines = mixed_data_lines();
    write_lines(&data, &lines[..4])?;
    let broker = TestBroker::for_targets(1).await;
    // An earlier run of target-0, on other data, left 10 items at the broker.
    let client = broker.client().await;
    let mut earlier = client.produce("target-0").await?;
    for seq in 0..10 {
        earlier
            .send(seq, dflash_testkit::sample(64, seq), Default::default())
            .await?;
    }
    ensure!(earlier.finish().await?.accepted == 10);
    let result = run(
        target_config(&broker.address, "target-0", &model, &data),
        CancellationToken::new(),
    )
    .await;
    let message = error_text(result);
    ensure!(
        message.contains("ReportDone") && message.contains('4') && message.contains("10"),
        "{message}"
    );
    let status = broker.status().await;
    ensure!(status.done_targets == 0, "{status:?}");
    broker.stop().await;
    Ok(())
}

/// The exit-code table (`dflash_shell::Exit`): a target stopped by SIGTERM
/// before its shard is done exits 4 ("interrupted, a restart resumes"), not
/// 2, which is clap's code for a wrong command line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_before_the_shard_is_done_exits_interrupted() -> Result<()> {
    let broker = TestBroker::for_targets(1).await;
    // 400 tokens/s over 100 samples of 16 tokens, 2 samples a batch: about
    // 4 s of work, sent as it is computed.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_target-server"))
        .args([
            "--broker",
            &broker.address,
            "--target-id",
            "target-0",
            "--model",
            "synthetic:hidden=16,layers=2,tokens_per_s=400,samples=100,seq_len=16",
            "--max-batch-tokens",
            "32",
            "--stats-interval",
            "100ms",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    // Wait until it is producing, so the signal lands mid-shard.
    let producing = dflash_testkit::wait_until(Duration::from_secs(60), || async {
        broker.status().await.accepted_items >= 2
    })
    .await;
    ensure!(producing, "the target never produced");
    let pid = child.id().context("child pid")?;
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    ensure!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
    ensure!(
        status.code() == Some(i32::from(dflash_shell::Exit::Interrupted.code())),
        "{status:?}"
    );
    ensure!(broker.status().await.done_targets == 0);
    broker.stop().await;
    Ok(())
}
