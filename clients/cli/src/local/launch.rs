//! What to launch and with which flags: the sibling binaries, the run's
//! and the tiny default's flags for each target and drafter, their libtorch
//! threads, and starting the broker (on port 0, reading back the port it
//! bound), then the targets and the drafters. The processes themselves,
//! once started, are `supervise`'s.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use dflash_client::{BrokerClient, ClientOptions};

use super::args::LocalArgs;
use super::inputs::Inputs;
use super::supervise::{spawn, terminate, Managed, Role};

/// Drafter settings for the embedded tiny default: a small drafter that
/// learns the tiny target's continuations in a CPU-minutes run.
const TINY_DRAFTER_FLAGS: &[&str] = &[
    "--draft-layers",
    "2",
    "--block-size",
    "8",
    "--num-anchors",
    "32",
    "--learning-rate",
    "3e-3",
    "--max-step-samples",
    "16",
];
const TINY_TARGET_FLAGS: &[&str] = &["--num-draft-layers", "2"];

fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the dflash binary")?;
    let directory = exe.parent().context("the dflash binary has no folder")?;
    let path = directory.join(name);
    if !path.exists() {
        bail!(
            "{name} not found at {} (build the workspace: `cargo build --workspace`)",
            path.display()
        );
    }
    Ok(path)
}

/// libtorch's intra-op threads for each target and drafter process: the
/// host's cores shared out among them (at least 1), unless the user set
/// `OMP_NUM_THREADS`, which the children then inherit. Without this every
/// child starts one thread per core, and 2 targets + 2 drafters on a 2-core
/// laptop run 8 busy threads on 2 cores: the τ evaluation alone took 64.8 s
/// that way against 9.2 s with one thread.
fn threads_per_child(children: u32) -> Option<String> {
    if std::env::var_os("OMP_NUM_THREADS").is_some() {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let children = usize::try_from(children.max(1)).unwrap_or(usize::MAX);
    Some((cores / children).max(1).to_string())
}

/// Waits for the broker, started with `--listen 127.0.0.1:0 --ready-file
/// FILE`, to write the address it bound; fails at once if it exits first.
async fn wait_for_ready_file(
    ready_file: &Path,
    broker: &mut Managed,
    deadline: Duration,
) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(ready_file) {
            let address = text.trim();
            if !address.is_empty() {
                return Ok(address.to_string());
            }
        }
        if let Ok(Some(status)) = broker.child.try_wait() {
            bail!(
                "the broker exited ({status}) before listening; see {}",
                broker.log.display()
            );
        }
        if started.elapsed() > deadline {
            bail!(
                "the broker did not write {} within {deadline:?}; see {}",
                ready_file.display(),
                broker.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn split_flags(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_string).collect()
}

/// Whether `flags` set `name` (`--name value` or `--name=value`).
/// The `--name value` pairs of `defaults` whose name `extra` does not set:
/// the tiny default's flags give way to the user's `--drafter-args` or
/// `--target-args` (a flag given twice is an error to the servers).
fn defaults_unless_set(defaults: &[&str], extra: &[String]) -> Vec<String> {
    defaults
        .chunks(2)
        .filter(|pair| !sets_flag(extra, pair[0]))
        .flatten()
        .map(|flag| flag.to_string())
        .collect()
}

fn sets_flag(flags: &[String], name: &str) -> bool {
    flags.iter().any(|flag| {
        flag == name
            || flag
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

async fn wait_for_broker(address: &str, deadline: Duration) -> anyhow::Result<BrokerClient> {
    let started = Instant::now();
    loop {
        if let Ok(client) =
            BrokerClient::connect(address.to_string(), ClientOptions::default()).await
        {
            if client.status().await.is_ok() {
                return Ok(client);
            }
        }
        if started.elapsed() > deadline {
            bail!("the broker at {address} did not answer within {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts the broker on port 0; it reports the port it got, so there is no
/// race with other processes for a "free" port. The broker, its address
/// and a client that got an answer from it.
pub(super) async fn start_broker(
    args: &LocalArgs,
    workdir: &Path,
    logs: &Path,
) -> anyhow::Result<(Managed, String, BrokerClient)> {
    let ready_file = workdir.join("broker.address");
    let _ = std::fs::remove_file(&ready_file);
    let mut flags = vec![
        "--listen".to_string(),
        "127.0.0.1:0".into(),
        "--ready-file".into(),
        ready_file.display().to_string(),
        "--expected-targets".into(),
        args.targets.to_string(),
        "--target-grace".into(),
        "30s".into(),
        // The drafters train one shared model; its final model lands here.
        "--model-output".into(),
        workdir.join("run-model").display().to_string(),
    ];
    // A DSpark drafter distils the target's distribution from its last
    // hidden state: the run asks every target for it (the broker's welcome
    // tells them), other runs do not pay its bytes. `--synthetic` drafters
    // train on nothing of it.
    if args.draft_architecture == "dspark" && !args.synthetic {
        flags.extend(["--target-capture".into(), "last-hidden-states".into()]);
    }
    let mut broker = spawn(
        "broker",
        Role::Broker,
        "-",
        &sibling_binary("broker")?,
        &flags,
        logs,
        None,
    )?;
    let address = match wait_for_ready_file(&ready_file, &mut broker, Duration::from_secs(30)).await
    {
        Ok(bound) => format!("http://{bound}"),
        Err(error) => {
            terminate(&broker);
            return Err(error);
        }
    };
    match wait_for_broker(&address, Duration::from_secs(30)).await {
        Ok(client) => Ok((broker, address, client)),
        Err(error) => {
            terminate(&broker);
            Err(error.context(format!("see {}", broker.log.display())))
        }
    }
}

pub(super) fn start_targets(
    args: &LocalArgs,
    inputs: &Inputs,
    address: &str,
    logs: &Path,
) -> anyhow::Result<Vec<Managed>> {
    let child_threads = threads_per_child(args.targets + args.drafters);
    let target_binary = sibling_binary("target-server")?;
    let mut targets = Vec::new();
    for index in 0..args.targets {
        let device = args.target_devices[index as usize % args.target_devices.len()].to_string();
        let name = format!("target-{index}");
        let extra_flags = split_flags(&args.target_args);
        let mut flags = vec![
            "--broker".to_string(),
            address.to_string(),
            "--target-id".into(),
            name.clone(),
            "--device".into(),
            device.clone(),
            "--shard-index".into(),
            index.to_string(),
            "--num-shards".into(),
            args.targets.to_string(),
        ];
        // `--target-args "--model ..."` replaces the run's model, e.g.
        // synthetic targets (`synthetic:hidden=64,layers=2,vocab=512`, the
        // tiny default's shape) feeding real drafters.
        match (&inputs.model_dir, args.synthetic) {
            _ if sets_flag(&extra_flags, "--model") => {}
            (Some(model), false) => {
                flags.extend(["--model".into(), model.display().to_string()]);
            }
            _ => flags.extend([
                "--model".into(),
                "synthetic:hidden=256,layers=2,tokens_per_s=20000,samples=200,seq_len=128".into(),
            ]),
        }
        if let Some(data) = &inputs.data {
            flags.extend(["--data".into(), data.display().to_string()]);
        }
        if inputs.embedded_model {
            flags.extend(defaults_unless_set(TINY_TARGET_FLAGS, &extra_flags));
        }
        flags.extend(extra_flags);
        targets.push(spawn(
            &name,
            Role::Target,
            &device,
            &target_binary,
            &flags,
            logs,
            child_threads.as_deref(),
        )?);
    }
    Ok(targets)
}

pub(super) fn start_drafters(
    args: &LocalArgs,
    inputs: &Inputs,
    address: &str,
    workdir: &Path,
    logs: &Path,
) -> anyhow::Result<Vec<Managed>> {
    let child_threads = threads_per_child(args.targets + args.drafters);
    let drafter_binary = sibling_binary("drafter-server")?;
    let mut drafters = Vec::new();
    for index in 0..args.drafters {
        let device = args.drafter_devices[index as usize % args.drafter_devices.len()].to_string();
        let name = format!("drafter-{index}");
        let output = workdir.join("checkpoints").join(&name);
        let flags = drafter_flags(args, inputs, address, &name, &device, &output);
        let mut managed = spawn(
            &name,
            Role::Drafter,
            &device,
            &drafter_binary,
            &flags,
            logs,
            child_threads.as_deref(),
        )?;
        managed.output = Some(output);
        drafters.push(managed);
    }
    Ok(drafters)
}

/// The online evaluator (`dflash evaluate --watch`, this binary): τ of
/// the run's model while the run trains, on the held-out prompts, with one
/// libtorch thread of its own (or its own `--evaluator-device`). None in
/// synthetic runs, without held-out prompts, or with `--no-evaluator`.
pub(super) fn start_evaluator(
    args: &LocalArgs,
    inputs: &Inputs,
    address: &str,
    logs: &Path,
) -> anyhow::Result<Option<Managed>> {
    let (Some(model), Some(held_out)) = (&inputs.model_dir, &inputs.held_out) else {
        return Ok(None);
    };
    if args.no_evaluator || args.synthetic {
        return Ok(None);
    }
    let exe = std::env::current_exe().context("locating the dflash binary")?;
    let device = args.evaluator_device.to_string();
    let flags = vec![
        "evaluate".to_string(),
        "--watch".into(),
        "--broker".into(),
        address.to_string(),
        "--target".into(),
        model.display().to_string(),
        "--prompts".into(),
        held_out.display().to_string(),
        // As the summary's final τ measures the trained drafters.
        "--max-new-tokens".into(),
        "40".into(),
        "--every-versions".into(),
        args.evaluate_every_versions.to_string(),
        "--every".into(),
        format!("{}ms", args.evaluate_every.as_millis()),
        "--device".into(),
        device.clone(),
        "--threads".into(),
        "1".into(),
    ];
    let nice = args.evaluator_nice;
    let (program, flags) = niced(nice, &exe, &flags);
    let started = spawn(
        "evaluator",
        Role::Evaluator,
        &device,
        &program,
        &flags,
        logs,
        Some("1"),
    );
    match started {
        Err(error) if nice > 0 => Err(error.context(format!(
            "the evaluator runs under `nice -n {nice}`; --evaluator-nice 0 runs it without"
        ))),
        started => Ok(Some(started?)),
    }
}

/// `program flags` under `nice -n <nice>` (the `nice` of PATH, as a
/// command name is found), or as is for nice 0.
fn niced(nice: u8, program: &Path, flags: &[String]) -> (PathBuf, Vec<String>) {
    if nice == 0 {
        return (program.to_path_buf(), flags.to_vec());
    }
    let mut niced_flags = vec![
        "-n".to_string(),
        nice.to_string(),
        program.display().to_string(),
    ];
    niced_flags.extend_from_slice(flags);
    (PathBuf::from("nice"), niced_flags)
}

/// One drafter's flags: the run's, the tiny default's (each unless
/// `--drafter-args` sets it, as the mask token), then `--drafter-args`.
fn drafter_flags(
    args: &LocalArgs,
    inputs: &Inputs,
    address: &str,
    name: &str,
    device: &str,
    output: &Path,
) -> Vec<String> {
    let mut flags = vec![
        "--broker".to_string(),
        address.to_string(),
        "--drafter-id".into(),
        name.to_string(),
        "--device".into(),
        device.to_string(),
        "--output".into(),
        output.display().to_string(),
    ];
    match (&inputs.model_dir, args.synthetic) {
        (Some(model), false) => {
            flags.extend(["--target-model".into(), model.display().to_string()])
        }
        _ => flags.extend(["--model".into(), "synthetic:ms_per_1k_tokens=5".into()]),
    }
    let extra_flags = split_flags(&args.drafter_args);
    if !sets_flag(&extra_flags, "--draft-architecture") {
        flags.extend([
            "--draft-architecture".to_string(),
            args.draft_architecture.clone(),
        ]);
    }
    if inputs.embedded_model {
        flags.extend(defaults_unless_set(TINY_DRAFTER_FLAGS, &extra_flags));
    }
    if let Some((id, _)) = &inputs.mask_token {
        if !sets_flag(&extra_flags, "--mask-token-id") {
            flags.extend(["--mask-token-id".to_string(), id.to_string()]);
        }
    }
    flags.extend(extra_flags);
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_is_set_by_its_exact_name_or_name_equals() {
        let flags = split_flags("--model synthetic:hidden=64 --model-output x --snapshot-every=1");
        assert!(sets_flag(&flags, "--model"));
        assert!(sets_flag(&flags, "--snapshot-every"));
        assert!(!sets_flag(&flags, "--model-out"));
        assert!(!sets_flag(&flags, "--snapshot"));
        assert!(!sets_flag(&split_flags("--model-output x"), "--model"));
    }

    #[test]
    fn the_tiny_defaults_give_way_to_the_users_flags() {
        let extra = split_flags("--learning-rate=16e-3 --collective-timeout 30s --block-size 4");
        let kept = defaults_unless_set(TINY_DRAFTER_FLAGS, &extra);
        assert_eq!(
            kept,
            [
                "--draft-layers",
                "2",
                "--num-anchors",
                "32",
                "--max-step-samples",
                "16"
            ]
            .map(String::from)
            .to_vec()
        );
        assert_eq!(
            defaults_unless_set(TINY_TARGET_FLAGS, &[]),
            ["--num-draft-layers", "2"].map(String::from).to_vec()
        );
    }

    #[test]
    fn the_evaluator_runs_under_nice_unless_its_nice_is_zero() {
        let program = PathBuf::from("/opt/dflash");
        let flags = vec!["evaluate".to_string(), "--watch".into()];
        assert_eq!(niced(0, &program, &flags), (program.clone(), flags.clone()));
        assert_eq!(
            niced(19, &program, &flags),
            (
                PathBuf::from("nice"),
                ["-n", "19", "/opt/dflash", "evaluate", "--watch"]
                    .map(String::from)
                    .to_vec()
            )
        );
    }
}
