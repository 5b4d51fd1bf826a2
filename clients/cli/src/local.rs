//! `dflash local`: the whole pipeline on one machine, as separate processes
//! of the real binaries talking real gRPC on loopback: one broker, T
//! target-servers and D drafter-servers. Shows the live status while it
//! runs, stops every child on Ctrl-C, and ends with a summary (also written
//! as `summary.json` in the work directory) and the trained drafter's τ.

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use dflash_client::{BrokerClient, ClientOptions};
use dflash_proto::v1 as proto;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::demo::{self, DemoSpec};
use dflash_ops::top::{self, RenderOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum View {
    /// Redraw the `dflash top` view in place (when stdout is a terminal).
    Top,
    /// One progress line every few seconds.
    Lines,
    /// Only the final summary.
    None,
}

#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// Number of target-server processes.
    #[arg(long, default_value_t = 2)]
    pub targets: u32,

    /// Number of drafter-server processes.
    #[arg(long, default_value_t = 2)]
    pub drafters: u32,

    /// Target model directory (Hugging Face layout). Default: the tiny model
    /// written by `dflash init-tiny` into the work directory.
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// Training data (JSONL). Default: data the tiny target generates itself.
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Held-out prompts for the final τ measurement (pre-tokenized JSONL).
    /// Default: generated with the demo data; skipped when --data is given without it.
    #[arg(long)]
    pub held_out: Option<PathBuf>,

    /// Devices of the targets, assigned in turn (e.g. `cuda:0,cuda:1`;
    /// `auto`, `cpu`, `cuda`, `cuda:N` as the services take them). The CPU
    /// by default: the demo is for a laptop.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub target_devices: Vec<dflash_shell::DeviceChoice>,

    /// Devices of the drafters, assigned in turn.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub drafter_devices: Vec<dflash_shell::DeviceChoice>,

    /// Run without a model: synthetic hidden states and synthetic training,
    /// to load-test the plumbing.
    #[arg(long)]
    pub synthetic: bool,

    /// Where models, data, logs, checkpoints and summary.json go.
    /// Default: runs/local-<unix time>.
    #[arg(long)]
    pub workdir: Option<PathBuf>,

    /// Live view while running.
    #[arg(long, value_enum, default_value = "top")]
    pub view: View,

    /// Give up (and fail) after this long (`30m`, `90s`).
    #[arg(long, default_value = "30m", value_parser = dflash_shell::parse_duration)]
    pub timeout: Duration,

    /// Extra flags for every target-server (one string, split on spaces).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub target_args: String,

    /// Extra flags for every drafter-server (one string, split on spaces).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub drafter_args: String,

    /// Unique sequences in the generated demo data.
    #[arg(long, default_value_t = DemoSpec::default().unique_sequences)]
    pub demo_sequences: usize,

    /// How many times the demo data repeats (more optimizer steps).
    #[arg(long, default_value_t = DemoSpec::default().epochs)]
    pub demo_epochs: usize,

    /// Held-out prompts generated with the demo data (the final τ).
    #[arg(long, default_value_t = DemoSpec::default().held_out_prompts)]
    pub demo_held_out: usize,

    /// Mask token id of the drafters. Default: the `mask_token` of the
    /// model's tokenizer_config.json, else (Qwen3 and Llama tokenizers have
    /// none) the reserved id just past the tokenizer's vocabulary, the
    /// convention of the published DFlash drafters (151669 for Qwen3-8B).
    /// Resolved and checked before anything starts.
    #[arg(long)]
    pub mask_token_id: Option<i64>,
}

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
/// Model sync of the tiny default unless --drafter-args sets its own: a demo
/// run is a few dozen steps per drafter, and syncing every 10 left the
/// center far below one drafter's τ; every 2 is what the README's quality
/// figures measure (the center stays below one drafter trained alone).
const TINY_SYNC_FLAGS: [&str; 2] = ["--sync-every", "2"];
const TINY_TARGET_FLAGS: &[&str] = &["--num-draft-layers", "2"];

#[derive(Debug, Clone, Serialize)]
pub struct ProcessSummary {
    pub name: String,
    pub role: String,
    pub device: String,
    pub exit_code: Option<i32>,
    /// Over the whole run, from the process's own final report (the last
    /// stats window's when it wrote none).
    pub busy_fraction: Option<f64>,
    /// The broker's last stats window of this process (the drain, often).
    pub last_window_busy_fraction: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub samples: u64,
    pub loss: Option<f64>,
    pub checkpoint: Option<PathBuf>,
    pub log: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct LocalSummary {
    pub end_of_stream: String,
    pub abort_reason: String,
    /// Whole wall time of `dflash local`.
    pub seconds: f64,
    /// Writing the tiny model and generating the demo data with the target
    /// (before the pipeline starts).
    pub generation_seconds: f64,
    /// From the broker's start until every target and drafter exited: the
    /// time the throughput figures are computed over.
    pub pipeline_seconds: f64,
    /// The τ measurements after the pipeline.
    pub eval_seconds: f64,
    pub accepted_samples: u64,
    pub trained_samples: u64,
    pub dead_letters: u64,
    pub expected_samples: Option<u64>,
    pub tokens: u64,
    pub samples_per_second: f64,
    pub tokens_per_second: f64,
    pub final_loss: Option<f64>,
    pub processes: Vec<ProcessSummary>,
    pub acceptance_length: Option<f64>,
    /// τ of a freshly initialised drafter of the same configuration: the
    /// baseline that shows what training bought.
    pub untrained_acceptance_length: Option<f64>,
    pub acceptance_length_drafter: Option<String>,
    /// τ of the run's shared model (the broker's center checkpoint), when
    /// the drafters synced.
    pub center_acceptance_length: Option<f64>,
    pub held_out_prompts: usize,
    /// Generated tokens per target forward of the trained drafter's
    /// speculative decoding (prefills included).
    pub tokens_per_target_forward: Option<f64>,
    /// The drafters' mask token id and where it came from.
    pub mask_token_id: Option<i64>,
    pub mask_token_source: Option<String>,
    pub workdir: PathBuf,
    pub ok: bool,
    /// Why the run is not a success (empty when `ok`).
    pub failures: Vec<String>,
}

struct Managed {
    name: String,
    role: &'static str,
    device: String,
    child: Child,
    log: PathBuf,
    exit_code: Option<i32>,
    output: Option<PathBuf>,
    /// The process's `--report-file` (targets and drafters).
    report: Option<PathBuf>,
}

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

fn spawn(
    name: &str,
    role: &'static str,
    device: &str,
    program: &Path,
    args: &[String],
    logs: &Path,
    threads: Option<&str>,
) -> anyhow::Result<Managed> {
    let log = logs.join(format!("{name}.log"));
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    // Targets and drafters write their whole-run report for the summary.
    let report = (role != "broker").then(|| logs.join(format!("{name}.report.json")));
    let mut command = Command::new(program);
    if let Some(report) = &report {
        command.arg("--report-file").arg(report);
    }
    if let Some(threads) = threads {
        command.env("OMP_NUM_THREADS", threads);
    }
    let child = command
        .args(args)
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    Ok(Managed {
        name: name.to_string(),
        role,
        device: device.to_string(),
        child,
        log,
        exit_code: None,
        output: None,
        report,
    })
}

fn terminate(process: &Managed) {
    if let Some(id) = process.child.id() {
        if let Ok(raw) = i32::try_from(id) {
            let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
        }
    }
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

/// Runs the pipeline; returns the summary (also printed and written):
/// inputs, broker, targets and drafters, watch until they exit, τ,
/// summary.
pub async fn run(args: LocalArgs, interrupt: CancellationToken) -> anyhow::Result<LocalSummary> {
    check_args(&args)?;
    let started = Instant::now();
    let (workdir, logs) = prepare_workdir(&args)?;
    let inputs = prepare_inputs(&args, &workdir, &interrupt).await?;
    let generation_seconds = started.elapsed().as_secs_f64();

    let pipeline_started = Instant::now();
    let (mut broker, address, client) = start_broker(&args, &workdir, &logs).await?;
    println!("dflash local: broker at {address} (watch it with `dflash top --broker {address}`); logs in {}", logs.display());
    let mut children = start_targets(&args, &inputs, &address, &logs)?;
    children.extend(start_drafters(&args, &inputs, &address, &workdir, &logs)?);

    let view = if args.view == View::Top && !std::io::stdout().is_terminal() {
        View::Lines
    } else {
        args.view
    };
    let deadline = started + args.timeout;
    let watch = Watch {
        client: &client,
        address: &address,
        view,
        started,
    };
    let stop = watch.until_exit(&mut children, deadline, &interrupt).await;
    let snapshot = client.status().await.context("final broker status")?;
    if view == View::Top {
        print!(
            "\x1b[H\x1b[2J{}",
            top::render(&snapshot, &address, RenderOptions { color: true })
        );
    }
    stop_broker(&mut broker).await;
    let pipeline_seconds = pipeline_started.elapsed().as_secs_f64();

    let eval_started = Instant::now();
    let processes: Vec<ProcessSummary> = children
        .iter()
        .map(|child| process_summary(child, &snapshot))
        .collect();
    let taus = if stop.interrupted {
        Taus::default()
    } else {
        measure_taus(&inputs, &processes, &workdir).await?
    };
    let eval_seconds = eval_started.elapsed().as_secs_f64();
    let timings = Timings {
        seconds: started.elapsed().as_secs_f64(),
        generation_seconds,
        pipeline_seconds,
        eval_seconds,
    };
    let summary = summarize(&snapshot, processes, taus, timings, &inputs, &workdir, stop);
    std::fs::write(
        workdir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    print_summary(&summary, stop.interrupted, stop.timed_out);
    Ok(summary)
}

fn check_args(args: &LocalArgs) -> anyhow::Result<()> {
    if args.targets == 0 || args.drafters == 0 {
        bail!(
            "--targets and --drafters must be at least 1 (got {} and {})",
            args.targets,
            args.drafters
        );
    }
    if args.target_devices.is_empty() || args.drafter_devices.is_empty() {
        bail!("--target-devices and --drafter-devices must name at least one device");
    }
    Ok(())
}

/// The work directory (created, made absolute) and its `logs` folder.
fn prepare_workdir(args: &LocalArgs) -> anyhow::Result<(PathBuf, PathBuf)> {
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
struct Inputs {
    model_dir: Option<PathBuf>,
    /// The embedded tiny default is used (its own target and drafter flags).
    embedded_model: bool,
    /// The drafters' mask token id and where it came from.
    mask_token: Option<(i64, String)>,
    data: Option<PathBuf>,
    held_out: Option<PathBuf>,
}

/// The model and data: what was given, or the embedded tiny default and
/// demo data it generates. Exits the process when interrupted while
/// generating (nothing else was started yet).
async fn prepare_inputs(
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

/// Starts the broker on port 0; it reports the port it got, so there is no
/// race with other processes for a "free" port. The broker, its address
/// and a client that got an answer from it.
async fn start_broker(
    args: &LocalArgs,
    workdir: &Path,
    logs: &Path,
) -> anyhow::Result<(Managed, String, BrokerClient)> {
    let ready_file = workdir.join("broker.address");
    let _ = std::fs::remove_file(&ready_file);
    let mut broker = spawn(
        "broker",
        "broker",
        "-",
        &sibling_binary("broker")?,
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--ready-file".into(),
            ready_file.display().to_string(),
            "--expected-targets".into(),
            args.targets.to_string(),
            "--target-grace".into(),
            "30s".into(),
            // The drafters train one shared model; its final center lands here.
            "--model-output".into(),
            workdir.join("center").display().to_string(),
        ],
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

fn start_targets(
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
        match (&inputs.model_dir, args.synthetic) {
            (Some(model), false) => flags.extend(["--model".into(), model.display().to_string()]),
            _ => flags.extend([
                "--model".into(),
                "synthetic:hidden=256,layers=2,tokens_per_s=20000,samples=200,seq_len=128".into(),
            ]),
        }
        if let Some(data) = &inputs.data {
            flags.extend(["--data".into(), data.display().to_string()]);
        }
        if inputs.embedded_model {
            flags.extend(TINY_TARGET_FLAGS.iter().map(|flag| flag.to_string()));
        }
        flags.extend(split_flags(&args.target_args));
        targets.push(spawn(
            &name,
            "target",
            &device,
            &target_binary,
            &flags,
            logs,
            child_threads.as_deref(),
        )?);
    }
    Ok(targets)
}

fn start_drafters(
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
            "drafter",
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

/// One drafter's flags: the run's, the tiny default's (unless
/// `--drafter-args` sets its own mask token or sync period), then
/// `--drafter-args`.
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
    if inputs.embedded_model {
        flags.extend(TINY_DRAFTER_FLAGS.iter().map(|flag| flag.to_string()));
    }
    let extra_flags = split_flags(&args.drafter_args);
    let sets = |name: &str| extra_flags.iter().any(|flag| flag.starts_with(name));
    if let Some((id, _)) = &inputs.mask_token {
        if !sets("--mask-token-id") {
            flags.extend(["--mask-token-id".to_string(), id.to_string()]);
        }
    }
    if inputs.embedded_model && !sets("--sync-every") {
        flags.extend(TINY_SYNC_FLAGS.iter().map(|flag| flag.to_string()));
    }
    flags.extend(extra_flags);
    flags
}

/// How the children ended: on their own, or stopped.
#[derive(Debug, Clone, Copy, Default)]
struct StopReason {
    /// Ctrl-C (or SIGTERM) stopped them.
    interrupted: bool,
    /// `--timeout` stopped them.
    timed_out: bool,
}

/// The live view while the children run.
struct Watch<'a> {
    client: &'a BrokerClient,
    address: &'a str,
    view: View,
    started: Instant,
}

impl Watch<'_> {
    /// Watches until every child has exited, Ctrl-C, or `deadline`; stops
    /// the children still running in the last two cases.
    async fn until_exit(
        &self,
        children: &mut [Managed],
        deadline: Instant,
        interrupt: &CancellationToken,
    ) -> StopReason {
        let mut last_line = Instant::now();
        loop {
            for child in children
                .iter_mut()
                .filter(|child| child.exit_code.is_none())
            {
                if let Ok(Some(status)) = child.child.try_wait() {
                    child.exit_code = Some(status.code().unwrap_or(-1));
                }
            }
            if children.iter().all(|child| child.exit_code.is_some()) {
                return StopReason::default();
            }
            if interrupt.is_cancelled() || Instant::now() > deadline {
                let interrupted = interrupt.is_cancelled();
                stop_children(children).await;
                return StopReason {
                    interrupted,
                    timed_out: !interrupted,
                };
            }
            if let Ok(snapshot) = self.client.status().await {
                self.show(&snapshot, &mut last_line);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn show(&self, snapshot: &proto::StatusSnapshot, last_line: &mut Instant) {
        match self.view {
            View::Top => {
                print!(
                    "\x1b[H\x1b[2J{}",
                    top::render(snapshot, self.address, RenderOptions { color: true })
                );
            }
            View::Lines if last_line.elapsed() >= Duration::from_secs(5) => {
                *last_line = Instant::now();
                println!(
                    "[{:>5.0}s] {:?} targets done {}/{} accepted {} trained {} queued {} leased {}",
                    self.started.elapsed().as_secs_f64(),
                    snapshot.state(),
                    snapshot.done_targets,
                    snapshot.expected_targets,
                    snapshot.accepted_items,
                    snapshot.acked_items,
                    snapshot.queued_items,
                    snapshot.leased_items
                );
            }
            _ => {}
        }
    }
}

/// SIGTERM to every child still running, one bounded wait for all of them,
/// then SIGKILL.
async fn stop_children(children: &mut [Managed]) {
    for child in children.iter().filter(|child| child.exit_code.is_none()) {
        terminate(child);
    }
    let stop_deadline = Instant::now() + Duration::from_secs(30);
    for child in children
        .iter_mut()
        .filter(|child| child.exit_code.is_none())
    {
        let left = stop_deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, child.child.wait()).await {
            Ok(Ok(status)) => child.exit_code = Some(status.code().unwrap_or(-1)),
            _ => {
                let _ = child.child.kill().await;
                child.exit_code = Some(-9);
            }
        }
    }
}

async fn stop_broker(broker: &mut Managed) {
    terminate(broker);
    if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(15), broker.child.wait()).await
    {
        broker.exit_code = status.code();
    } else {
        let _ = broker.child.kill().await;
    }
}

/// The τ measurements after the pipeline.
#[derive(Debug, Default)]
struct Taus {
    acceptance_length: Option<f64>,
    untrained_acceptance_length: Option<f64>,
    acceptance_length_drafter: Option<String>,
    center_acceptance_length: Option<f64>,
    tokens_per_target_forward: Option<f64>,
    held_out_prompts: usize,
}

/// τ of the first drafter's final checkpoint (and of an untrained drafter
/// of the same configuration) on the held-out prompts, and of the shared
/// model when the drafters synced.
async fn measure_taus(
    inputs: &Inputs,
    processes: &[ProcessSummary],
    workdir: &Path,
) -> anyhow::Result<Taus> {
    let mut taus = Taus::default();
    let (Some(model_dir), Some(held_out)) = (&inputs.model_dir, &inputs.held_out) else {
        return Ok(taus);
    };
    // Speculative decoding of one prompt runs tiny ops, for which libtorch's
    // intra-op threads cost more than they save: the same 16-prompt eval on
    // the loaded 2-core machine took 64.8 s with 2 threads, 9.2 s with 1.
    tch::set_num_threads(1);
    let checkpoint = processes
        .iter()
        .find_map(|process| process.checkpoint.clone());
    if let Some(checkpoint) = checkpoint {
        let prompts = demo::read_prompts(held_out, model_dir)?;
        taus.held_out_prompts = prompts.len();
        let model_dir = model_dir.clone();
        let checkpoint_for_eval = checkpoint.clone();
        let baseline_dir = workdir.join("untrained-drafter");
        let (trained, untrained) = tokio::task::spawn_blocking(move || {
            let trained = dflash_drafter_server::eval::evaluate(
                &model_dir,
                &checkpoint_for_eval,
                &prompts,
                40,
                tch::Device::Cpu,
            )
            .context("evaluating the trained drafter")?;
            let baseline = dflash_drafter_server::eval::write_untrained_baseline(
                &model_dir,
                &checkpoint_for_eval,
                &baseline_dir,
            )?;
            let untrained = dflash_drafter_server::eval::evaluate(
                &model_dir,
                &baseline,
                &prompts,
                40,
                tch::Device::Cpu,
            )
            .context("evaluating the untrained baseline")?;
            anyhow::Ok((trained, untrained))
        })
        .await
        .context("evaluation thread")??;
        taus.acceptance_length = Some(trained.mean_acceptance_length);
        taus.tokens_per_target_forward = Some(trained.tokens_per_target_forward());
        taus.untrained_acceptance_length = Some(untrained.mean_acceptance_length);
        taus.acceptance_length_drafter = Some(checkpoint.display().to_string());
    }
    // τ of the one model the drafters trained together (model sync).
    taus.center_acceptance_length =
        center_tau(model_dir, held_out, &workdir.join("center")).await?;
    Ok(taus)
}

/// Where the wall time went.
#[derive(Debug, Clone, Copy)]
struct Timings {
    seconds: f64,
    generation_seconds: f64,
    pipeline_seconds: f64,
    eval_seconds: f64,
}

fn summarize(
    snapshot: &proto::StatusSnapshot,
    processes: Vec<ProcessSummary>,
    taus: Taus,
    timings: Timings,
    inputs: &Inputs,
    workdir: &Path,
    stop: StopReason,
) -> LocalSummary {
    let tokens: u64 = snapshot
        .targets
        .iter()
        .filter_map(|target| target.stats.as_ref())
        .map(|stats| stats.tokens_done)
        .sum();
    // The mean of the drafters' last reported losses.
    let losses: Vec<f64> = processes
        .iter()
        .filter(|process| process.role == "drafter")
        .filter_map(|process| process.loss)
        .collect();
    let final_loss = (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64);
    let end_of_stream = match snapshot.state() {
        proto::BrokerState::Complete => "COMPLETE",
        proto::BrokerState::Aborted => "ABORTED",
        proto::BrokerState::Draining => "DRAINING (not finished)",
        _ => "RUNNING (not finished)",
    };
    let trained = snapshot.acked_items;
    let failures = failures(
        snapshot,
        &processes,
        final_loss,
        &stop,
        &workdir.join("center"),
    );
    let ok = failures.is_empty();
    let pipeline_seconds = timings.pipeline_seconds;
    LocalSummary {
        end_of_stream: end_of_stream.to_string(),
        abort_reason: snapshot.abort_reason.clone(),
        seconds: timings.seconds,
        generation_seconds: timings.generation_seconds,
        pipeline_seconds,
        eval_seconds: timings.eval_seconds,
        accepted_samples: snapshot.accepted_items,
        trained_samples: trained,
        dead_letters: snapshot.dead_letters,
        expected_samples: snapshot
            .summary
            .as_ref()
            .map(|summary| summary.expected_items)
            .filter(|&items| items > 0),
        tokens,
        samples_per_second: trained as f64 / pipeline_seconds.max(1e-9),
        tokens_per_second: tokens as f64 / pipeline_seconds.max(1e-9),
        final_loss,
        processes,
        acceptance_length: taus.acceptance_length,
        untrained_acceptance_length: taus.untrained_acceptance_length,
        acceptance_length_drafter: taus.acceptance_length_drafter,
        center_acceptance_length: taus.center_acceptance_length,
        held_out_prompts: taus.held_out_prompts,
        tokens_per_target_forward: taus.tokens_per_target_forward,
        mask_token_id: inputs.mask_token.as_ref().map(|(id, _)| *id),
        mask_token_source: inputs.mask_token.as_ref().map(|(_, source)| source.clone()),
        workdir: workdir.to_path_buf(),
        ok,
        failures,
    }
}

/// Everything that makes the run not a success, each in words: a run that
/// lost data, whose drafters failed, or whose one model is not finite never
/// reports OK.
fn failures(
    snapshot: &proto::StatusSnapshot,
    processes: &[ProcessSummary],
    final_loss: Option<f64>,
    stop: &StopReason,
    center: &Path,
) -> Vec<String> {
    let mut failures = Vec::new();
    if stop.interrupted {
        failures.push("interrupted by a signal".to_string());
    }
    if stop.timed_out {
        failures.push("gave up at --timeout".to_string());
    }
    if snapshot.state() != proto::BrokerState::Complete {
        failures.push(format!(
            "the run did not end COMPLETE ({:?}{})",
            snapshot.state(),
            if snapshot.abort_reason.is_empty() {
                String::new()
            } else {
                format!(": {}", snapshot.abort_reason)
            }
        ));
    }
    for process in processes {
        if process.exit_code != Some(0) {
            failures.push(format!(
                "{} exited {} (log: {})",
                process.name,
                process
                    .exit_code
                    .map_or("by a signal".to_string(), |code| code.to_string()),
                process.log.display()
            ));
        }
    }
    if snapshot.dead_letters > 0 {
        failures.push(format!(
            "{} samples were dead-lettered (never trained on)",
            snapshot.dead_letters
        ));
    }
    if final_loss.is_some_and(|loss| !loss.is_finite()) {
        failures.push("the drafters' final loss is not finite".to_string());
    }
    match center_is_finite(center) {
        Ok(None | Some(true)) => {}
        Ok(Some(false)) => {
            failures.push(format!("the center at {} is not finite", center.display()))
        }
        Err(error) => failures.push(format!(
            "the center at {} cannot be read: {error}",
            center.display()
        )),
    }
    failures
}

/// Whether every weight of the center checkpoint is finite; `None` when no
/// center was written (independent drafters).
fn center_is_finite(center: &Path) -> anyhow::Result<Option<bool>> {
    let weights = center.join("model.safetensors");
    if !weights.is_file() {
        return Ok(None);
    }
    let tensors = tch::Tensor::read_safetensors(&weights)
        .with_context(|| format!("reading {}", weights.display()))?;
    Ok(Some(tensors.iter().all(|(_, tensor)| {
        tensor.isfinite().all().int64_value(&[]) == 1
    })))
}

/// τ of the broker's center checkpoint on the held-out prompts; `None` when
/// the drafters did not sync (no center written).
async fn center_tau(
    model_dir: &Path,
    held_out: &Path,
    center: &Path,
) -> anyhow::Result<Option<f64>> {
    if !center.join("model.safetensors").is_file() {
        return Ok(None);
    }
    let prompts = demo::read_prompts(held_out, model_dir)?;
    let (model_dir, center) = (model_dir.to_path_buf(), center.to_path_buf());
    let report = tokio::task::spawn_blocking(move || {
        dflash_drafter_server::eval::evaluate(&model_dir, &center, &prompts, 40, tch::Device::Cpu)
    })
    .await
    .context("evaluation thread")?
    .context("evaluating the shared model (center)")?;
    Ok(Some(report.mean_acceptance_length))
}

/// The drafters' mask token: `--mask-token-id` when given, else the
/// model's default (see [`LocalArgs::mask_token_id`]), with where it came
/// from; an error naming the model when it has neither.
fn resolve_mask_token(model_dir: &Path, given: Option<i64>) -> anyhow::Result<(i64, String)> {
    if let Some(id) = given {
        return Ok((id, "--mask-token-id".to_string()));
    }
    let (id, source) = dflash_model::tiny::default_mask_token_id(model_dir)
        .with_context(|| format!("the mask token of {}", model_dir.display()))?;
    Ok((id, source.to_string()))
}

fn process_summary(child: &Managed, snapshot: &proto::StatusSnapshot) -> ProcessSummary {
    let mut summary = ProcessSummary {
        name: child.name.clone(),
        role: child.role.to_string(),
        device: child.device.clone(),
        exit_code: child.exit_code,
        busy_fraction: None,
        last_window_busy_fraction: None,
        tokens_per_second: None,
        samples: 0,
        loss: None,
        checkpoint: None,
        log: child.log.clone(),
    };
    if child.role == "target" {
        if let Some(target) = snapshot
            .targets
            .iter()
            .find(|target| target.target_id == child.name)
        {
            summary.samples = target.accepted_items;
            if let Some(stats) = &target.stats {
                summary.busy_fraction = Some(stats.busy_fraction);
                summary.tokens_per_second = Some(stats.tokens_per_second);
            }
        }
    } else if let Some(drafter) = snapshot
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == child.name)
    {
        summary.samples = drafter.acked_items;
        if let Some(stats) = &drafter.stats {
            summary.busy_fraction = Some(stats.busy_fraction);
            summary.tokens_per_second = Some(stats.tokens_per_second);
            summary.loss = Some(stats.loss);
        }
    }
    if let Some(output) = &child.output {
        summary.checkpoint = dflash_drafter_server::checkpoints::latest_checkpoint(output)
            .ok()
            .flatten();
    }
    summary.last_window_busy_fraction = summary.busy_fraction;
    if let Some(report) = child.report.as_deref().and_then(read_process_report) {
        apply_process_report(&mut summary, &report);
    }
    summary
}

/// A target's or drafter's `--report-file`, if it wrote one.
fn read_process_report(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// The whole run's figures from the process's own report, over the
/// broker's last stats window (which is often the drain, when a busy
/// drafter waits for the last items).
fn apply_process_report(summary: &mut ProcessSummary, report: &serde_json::Value) {
    if let Some(busy) = report["busy_fraction"].as_f64() {
        summary.busy_fraction = Some(busy);
    }
    if let Some(rate) = report["tokens_per_second"].as_f64() {
        summary.tokens_per_second = Some(rate);
    }
    if let Some(loss) = report["loss"].as_f64() {
        summary.loss = Some(loss);
    }
}

fn percent(value: Option<f64>) -> String {
    value.map_or("-".to_string(), |value| format!("{:.0}%", value * 100.0))
}

fn print_summary(summary: &LocalSummary, interrupted: bool, timed_out: bool) {
    println!();
    println!("dflash local summary ({})", summary.workdir.display());
    if interrupted {
        println!("  interrupted (SIGINT/SIGTERM): children were stopped with SIGTERM");
    }
    if timed_out {
        println!("  timed out: children were stopped with SIGTERM");
    }
    println!(
        "  end-of-stream: {}{}",
        summary.end_of_stream,
        if summary.abort_reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", summary.abort_reason)
        }
    );
    println!(
        "  samples: {} accepted, {} trained, {} dead letters{}; tokens: {}",
        summary.accepted_samples,
        summary.trained_samples,
        summary.dead_letters,
        summary
            .expected_samples
            .map_or(String::new(), |expected| format!(
                " (of {expected} expected)"
            )),
        summary.tokens
    );
    println!(
        "  wall time {:.1}s: data generation {:.1}s, pipeline {:.1}s, evaluation {:.1}s",
        summary.seconds, summary.generation_seconds, summary.pipeline_seconds, summary.eval_seconds
    );
    println!(
        "  pipeline throughput {:.2} samples/s, {:.0} tokens/s (over the pipeline's {:.1}s only)",
        summary.samples_per_second, summary.tokens_per_second, summary.pipeline_seconds
    );
    for process in &summary.processes {
        println!(
            "  {:<10} {:<7} device {:<7} busy {:>4} (last window {:>4})  tok/s {:>8}  samples {:>5}  loss {:>7}  exit {}{}",
            process.name,
            process.role,
            process.device,
            percent(process.busy_fraction),
            percent(process.last_window_busy_fraction),
            process.tokens_per_second.map_or("-".to_string(), |value| format!("{value:.0}")),
            process.samples,
            process.loss.map_or("-".to_string(), |loss| format!("{loss:.3}")),
            process.exit_code.map_or("?".to_string(), |code| code.to_string()),
            process.checkpoint.as_ref().map_or(String::new(), |path| format!("  checkpoint {}", path.display())),
        );
    }
    if let Some(loss) = summary.final_loss {
        println!("  final loss (mean over drafters): {loss:.4}");
    }
    match (summary.acceptance_length, &summary.acceptance_length_drafter) {
        (Some(tau), Some(drafter)) => println!(
            "  τ (mean acceptance length) on {} held-out prompts: {tau:.2} trained, {} untrained  [{drafter}]",
            summary.held_out_prompts,
            summary
                .untrained_acceptance_length
                .map_or("-".to_string(), |baseline| format!("{baseline:.2}")),
        ),
        _ => println!("  τ: not measured (no checkpoint or no held-out prompts)"),
    }
    if let Some(tokens) = summary.tokens_per_target_forward {
        println!("  accepted tokens per target forward (trained, prefills included): {tokens:.2}");
    }
    if let Some(tau) = summary.center_acceptance_length {
        println!(
            "  τ of the shared model (the broker's center, one model for all drafters): {tau:.2}"
        );
    }
    println!("  logs: {}", summary.workdir.join("logs").display());
    println!("  result: {}", if summary.ok { "OK" } else { "FAILED" });
    for failure in &summary.failures {
        println!("    because {failure}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter(exit_code: Option<i32>) -> ProcessSummary {
        ProcessSummary {
            name: "drafter-0".to_string(),
            role: "drafter".to_string(),
            device: "cpu".to_string(),
            exit_code,
            busy_fraction: None,
            last_window_busy_fraction: None,
            tokens_per_second: None,
            samples: 0,
            loss: Some(1.0),
            checkpoint: None,
            log: PathBuf::from("logs/drafter-0.log"),
        }
    }

    fn complete() -> proto::StatusSnapshot {
        proto::StatusSnapshot {
            state: proto::BrokerState::Complete as i32,
            ..Default::default()
        }
    }

    const CLEAN: StopReason = StopReason {
        interrupted: false,
        timed_out: false,
    };

    /// #23: the summary's busy fraction is the run's, from the process's own
    /// report, not the broker's last window (the drain); the window is kept
    /// apart.
    #[test]
    fn a_drafter_busy_for_the_whole_run_is_reported_so() {
        let mut summary = drafter(Some(0));
        summary.busy_fraction = Some(0.05);
        summary.last_window_busy_fraction = Some(0.05);
        apply_process_report(
            &mut summary,
            &serde_json::json!({"busy_fraction": 0.95, "tokens_per_second": 812.0, "loss": 2.5}),
        );
        assert_eq!(summary.busy_fraction, Some(0.95));
        assert_eq!(summary.last_window_busy_fraction, Some(0.05));
        assert_eq!(summary.tokens_per_second, Some(812.0));
        assert_eq!(summary.loss, Some(2.5));
    }

    /// #22: a run is OK only when nothing failed, and each failure is said:
    /// a drafter's non-zero exit, dead letters, a non-finite center.
    #[test]
    fn a_run_reports_success_only_when_nothing_failed_and_says_why_otherwise() {
        let folder = tempfile::tempdir().unwrap();
        let center = folder.path().join("center");
        let ok = failures(&complete(), &[drafter(Some(0))], Some(1.0), &CLEAN, &center);
        assert!(ok.is_empty(), "{ok:?}");

        let mut lossy = complete();
        lossy.dead_letters = 2;
        let failed = failures(&lossy, &[drafter(Some(1))], Some(1.0), &CLEAN, &center);
        assert!(
            failed
                .iter()
                .any(|failure| failure.contains("drafter-0 exited 1")),
            "{failed:?}"
        );
        assert!(
            failed
                .iter()
                .any(|failure| failure.contains("2 samples were dead-lettered")),
            "{failed:?}"
        );

        std::fs::create_dir_all(&center).unwrap();
        let poisoned = tch::Tensor::from_slice(&[1.0f32, f32::NAN]);
        tch::Tensor::write_safetensors(
            &[("fc.weight", &poisoned)],
            center.join("model.safetensors"),
        )
        .unwrap();
        let failed = failures(&complete(), &[drafter(Some(0))], Some(1.0), &CLEAN, &center);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].contains("is not finite"), "{}", failed[0]);
    }
}
