//! `dflash evaluate`: τ of the run's shared model while the run trains.
//!
//! The evaluator reads the center with `ModelSync.ReadCenter` (read-only:
//! it opens no sync session, so it never counts as a drafter, changes
//! nothing of the center and is never waited for), builds the drafter from
//! the tensors read (in memory: nothing is written), measures τ on held-out
//! prompts with `dflash_model::eval` (the same code as `dflash eval`: greedy, the
//! target's KV cache, the bonus token counted; the target is loaded once),
//! and reports it with `ModelSync.ReportTau`; the broker keeps the history
//! and writes the best version to `center-best/`.
//!
//! With `--watch` it follows the run: it polls the broker's status and
//! reads the center every `--every-versions` center versions or every
//! `--every` (whichever comes first, and only a version not read yet), and
//! when the run is over (COMPLETE with the final center written, or
//! ABORTED) it reads the final center if it has not, measures what it has
//! read, then exits. Reading and measuring are apart: a version is read
//! when it is due and measured in turn, up to `--backlog` versions ahead
//! (at most the broker's `--max-pending-evaluations`, which keeps their
//! weights until their report). A version due is read header-only (the
//! broker keeps it) and its weights are read from the broker when its
//! measurement starts, so the versions waiting cost the evaluator no
//! memory: it holds one version's weights at a time. So on a CPU the training keeps busy, an
//! evaluator at the lowest priority still has a point per due version: it
//! measures them when the CPU has time, at the latest after the run. Each
//! point carries when its version was read. Without `--watch` it evaluates
//! the current center once.
//!
//! It must not slow the drafters: on the CPU it runs with its own libtorch
//! thread budget (`--threads`, 1 by default), on a GPU on its own
//! `--device`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context as _};
use dflash_client::{BrokerClient, ClientSecurityArgs};
use dflash_model::draft::DraftConfig;
use dflash_model::target_model::TargetModel;
use dflash_proto::chunks::TensorAssembler;
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::demo;

/// The broker's address when `--broker` and `DFLASH_BROKER` are not given.
const DEFAULT_BROKER: &str = "http://127.0.0.1:50051";

/// `dflash evaluate`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct EvaluateArgs {
    #[arg(long, env = "DFLASH_BROKER", default_value = DEFAULT_BROKER)]
    pub broker: String,
    /// Follow the run: evaluate every --every-versions versions or --every,
    /// and the final center, then exit. Without it: the current center once.
    #[arg(long)]
    pub watch: bool,
    /// The target model directory (Hugging Face layout).
    #[arg(long)]
    pub target: PathBuf,
    /// Held-out prompts (JSONL), as `dflash eval --data` reads them.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Use only the first N prompts (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_prompts: usize,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Evaluate when the center is this many versions past the last one evaluated.
    #[arg(long, default_value_t = 20)]
    pub every_versions: u64,
    /// Evaluate at least this often while the center changes (`90s`, `5m`).
    #[arg(long, default_value = "5m", value_parser = dflash_shell::parse_duration)]
    pub every: Duration,
    /// Versions read and not yet measured at most (capped by the broker's
    /// --max-pending-evaluations): a version due while the evaluator is
    /// still measuring an earlier one is read now and measured later.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub backlog: u32,
    /// How often to read the broker's status.
    #[arg(long, default_value = "1s", value_parser = dflash_shell::parse_duration)]
    pub poll: Duration,
    /// Where to evaluate: its own device, never the drafters' (`cpu`,
    /// `cuda:N`, `auto`).
    #[arg(long, default_value = "cpu")]
    pub device: dflash_shell::DeviceChoice,
    /// libtorch intra-op threads of this process (its CPU share).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value = "evaluator")]
    pub evaluator_id: String,
    /// Write the τ curve (JSON) here when done.
    #[arg(long)]
    pub report_file: Option<PathBuf>,
    #[command(flatten)]
    pub security: ClientSecurityArgs,
}

/// What the evaluator measured (its `--report-file`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct EvaluatorReport {
    pub points: Vec<Point>,
    /// The broker's best after the last report: (version, τ, path).
    pub best_version: Option<u64>,
    pub best_tau: Option<f64>,
    pub best_path: Option<String>,
    /// Seconds spent measuring τ (the evaluator's own cost).
    pub evaluating_seconds: f64,
    /// Reports the broker refused (each logged with its reason).
    pub refused_reports: u64,
}

/// One evaluation: the point as reported to the broker, and whether the
/// broker made it the best so far (and wrote it to `center-best/`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Point {
    #[serde(flatten)]
    pub point: proto::TauPoint,
    pub best: bool,
}

/// A center version read with `ReadCenter`: its header and every tensor
/// (name, shape, f32 little-endian bytes).
pub struct ReadCenter {
    pub header: proto::CenterHeader,
    pub tensors: Vec<(String, Vec<u64>, Vec<u8>)>,
}

/// Why a `ModelSync.ReadCenter` failed: whether another try can help
/// depends on it.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The broker no longer keeps the version asked for
    /// (FAILED_PRECONDITION: reported, released, or the broker restarted):
    /// another try cannot help.
    #[error(
        "ModelSync.ReadCenter: the broker no longer keeps center version {version}: {message}"
    )]
    NotKept { version: u64, message: String },
    /// The call failed or broke off (the broker down, restarting or
    /// refusing): another try may succeed.
    #[error("ModelSync.ReadCenter: {0}")]
    Call(tonic::Status),
    /// The broker's answer is not a center.
    #[error("ReadCenter: {0}")]
    Malformed(String),
}

impl ReadError {
    /// The error of a read of `version` (`None`: the current center) that
    /// ended with `status`.
    pub fn from_status(status: tonic::Status, version: Option<u64>) -> ReadError {
        match version {
            Some(version) if status.code() == tonic::Code::FailedPrecondition => {
                ReadError::NotKept {
                    version,
                    message: status.message().to_string(),
                }
            }
            _ => ReadError::Call(status),
        }
    }

    /// Whether trying the same read again may succeed.
    pub fn may_pass_again(&self) -> bool {
        matches!(self, ReadError::Call(_))
    }
}

/// The evaluator's connection: status through the broker client, the
/// center and the reports through ModelSync.
pub struct Evaluator {
    pub status: BrokerClient,
    model_sync: ModelSyncClient<dflash_client::AuthChannel>,
    pub evaluator_id: String,
}

impl Evaluator {
    pub async fn connect(
        broker: &str,
        security: &ClientSecurityArgs,
        evaluator_id: &str,
    ) -> anyhow::Result<Self> {
        let options = security.client_options()?;
        let status = BrokerClient::connect(broker.to_string(), options.clone())
            .await
            .with_context(|| format!("connecting to the broker at {broker}"))?;
        let channel = dflash_client::connect_channel(broker, &options)
            .await
            .with_context(|| format!("connecting to the broker at {broker}"))?;
        let model_sync = ModelSyncClient::new(channel)
            .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
            .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES);
        Ok(Evaluator {
            status,
            model_sync,
            evaluator_id: evaluator_id.to_string(),
        })
    }

    /// Keeps the current version at the broker until its report and
    /// returns its header only (no weights: [`Self::read_kept`] reads them
    /// when it is measured).
    pub async fn keep_center(&mut self) -> Result<proto::CenterHeader, ReadError> {
        Ok(self.read(true, None).await?.header)
    }

    /// A version the broker keeps since [`Self::keep_center`], whole:
    /// header, then every tensor's chunks in order, then `done` (whose
    /// count must match).
    pub async fn read_kept(&mut self, version: u64) -> Result<ReadCenter, ReadError> {
        let read = self.read(false, Some(version)).await?;
        if read.header.center_version != version {
            // A broker that predates kept reads answers the current center.
            return Err(ReadError::Malformed(format!(
                "asked for kept version {version}, got {} (a broker without kept reads?)",
                read.header.center_version
            )));
        }
        Ok(read)
    }

    async fn read(
        &mut self,
        header_only: bool,
        center_version: Option<u64>,
    ) -> Result<ReadCenter, ReadError> {
        use proto::read_center_response::Kind;
        let failed = |status| ReadError::from_status(status, center_version);
        let mut stream = self
            .model_sync
            .read_center(proto::ReadCenterRequest {
                evaluator_id: self.evaluator_id.clone(),
                header_only,
                center_version,
            })
            .await
            .map_err(failed)?
            .into_inner();
        let header = match stream
            .message()
            .await
            .map_err(failed)?
            .and_then(|message| message.kind)
        {
            Some(Kind::Header(header)) => header,
            other => {
                return Err(ReadError::Malformed(format!(
                    "expected the header first, got {other:?}"
                )))
            }
        };
        let mut tensors = TensorAssembler::default();
        loop {
            match stream
                .message()
                .await
                .map_err(failed)?
                .and_then(|message| message.kind)
            {
                Some(Kind::Chunk(chunk)) => tensors
                    .push(chunk)
                    .map_err(|error| ReadError::Malformed(error.to_string()))?,
                Some(Kind::Done(done)) => {
                    if done.center_version != header.center_version {
                        return Err(ReadError::Malformed(format!(
                            "the header says version {}, done says {}",
                            header.center_version, done.center_version
                        )));
                    }
                    let tensors = tensors
                        .finish(done.tensors)
                        .map_err(|error| ReadError::Malformed(error.to_string()))?;
                    return Ok(ReadCenter { header, tensors });
                }
                other => {
                    return Err(ReadError::Malformed(format!(
                        "expected chunks then done, got {other:?}"
                    )))
                }
            }
        }
    }

    pub async fn report(
        &mut self,
        point: proto::TauPoint,
    ) -> Result<proto::TauReportResult, tonic::Status> {
        self.model_sync
            .report_tau(proto::TauReport {
                evaluator_id: self.evaluator_id.clone(),
                point: Some(point),
            })
            .await
            .map(tonic::Response::into_inner)
    }
}

/// A center read as the evaluator measures it: its configuration (the
/// header's `config.json`) and its parameters as f32 tensors, in memory.
/// Each tensor's bytes are freed once copied, so the weights are held
/// once and a half at most.
pub fn center_model(
    center: ReadCenter,
) -> anyhow::Result<(DraftConfig, HashMap<String, tch::Tensor>)> {
    let config_json: serde_json::Value = serde_json::from_str(&center.header.model_config_json)
        .context("the center's model config is not JSON")?;
    let config = DraftConfig::from_hf_json(&config_json)?;
    let mut tensors = HashMap::with_capacity(center.tensors.len());
    for (name, shape, bytes) in center.tensors {
        let shape: Vec<i64> = shape.iter().map(|&dim| dim as i64).collect();
        let elements: i64 = shape.iter().product();
        if bytes.len() as i64 != 4 * elements {
            bail!(
                "tensor {name:?}: {} bytes, expected {} for f32 {shape:?}",
                bytes.len(),
                4 * elements
            );
        }
        let tensor = tch::Tensor::f_from_data_size(&bytes, &shape, tch::Kind::Float)?;
        tensors.insert(name, tensor);
    }
    Ok((config, tensors))
}

fn unix_time_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

/// What one evaluation needs that does not change between versions.
struct Bench {
    /// The target, `None` while a measurement owns it.
    target: Option<TargetModel>,
    /// Shared with each measurement's thread.
    prompts: Arc<Vec<Vec<i64>>>,
    options: dflash_model::eval::EvalOptions,
}

/// A center version read whole, to measure.
struct Read {
    center: ReadCenter,
    read_unix_time_ms: u64,
}

/// A center version the broker keeps for the evaluator (its header only),
/// waiting for its measurement: the weights are read when it is measured,
/// so versions waiting cost the evaluator no memory.
struct Kept {
    header: proto::CenterHeader,
    read_unix_time_ms: u64,
}

impl Kept {
    async fn from(evaluator: &mut Evaluator) -> anyhow::Result<Kept> {
        let header = evaluator.keep_center().await?;
        Ok(Kept {
            header,
            read_unix_time_ms: unix_time_ms(),
        })
    }

    /// Its weights, from the broker: a few tries, `poll` apart, since a
    /// broker that does not answer once may the next time; one only when
    /// the answer says another cannot help (the version no longer kept, or
    /// not a center).
    async fn read(self, evaluator: &mut Evaluator, poll: Duration) -> Result<Read, ReadError> {
        let version = self.header.center_version;
        let mut tries = 0;
        loop {
            tries += 1;
            match evaluator.read_kept(version).await {
                Ok(center) => {
                    return Ok(Read {
                        center,
                        read_unix_time_ms: self.read_unix_time_ms,
                    })
                }
                Err(error) if tries < KEPT_READ_TRIES && error.may_pass_again() => warn!(
                    version,
                    error = format!("{error:#}"),
                    "reading a kept version failed; trying again"
                ),
                Err(error) => return Err(error),
            }
            tokio::time::sleep(poll).await;
        }
    }
}

/// Tries of [`Kept::read`].
const KEPT_READ_TRIES: u32 = 3;

/// A measurement's end: the target back, what was measured and of what.
struct Measured {
    target: TargetModel,
    header: proto::CenterHeader,
    read_unix_time_ms: u64,
    result: anyhow::Result<dflash_model::eval::EvalReport>,
}

type Measuring = tokio::task::JoinHandle<Measured>;

impl Bench {
    /// Measures τ of the version read on a blocking thread, which owns
    /// the target meanwhile.
    fn start(&mut self, read: Read) -> anyhow::Result<Measuring> {
        let target = self.target.take().context("the target model is gone")?;
        let (prompts, options) = (Arc::clone(&self.prompts), self.options.clone());
        Ok(tokio::task::spawn_blocking(move || {
            let Read {
                center,
                read_unix_time_ms,
            } = read;
            let header = center.header.clone();
            let version = header.center_version;
            // Exported when OTLP is configured (`dflash_telemetry::init`).
            let span = tracing::debug_span!(
                target: dflash_telemetry::TRACE_TARGET,
                "evaluator.measure",
                center_version = version,
                center_samples = header.center_samples,
                tau = tracing::field::Empty,
            );
            let _measuring = span.enter();
            let result = center_model(center)
                .and_then(|(config, tensors)| {
                    let origin = format!("center version {version}");
                    dflash_model::eval::evaluate_tensors(
                        &target, config, tensors, &origin, &prompts, &options,
                    )
                    .map_err(anyhow::Error::from)
                })
                .with_context(|| format!("evaluating center version {version}"));
            if let Ok(measured) = &result {
                span.record("tau", measured.mean_acceptance_length);
            }
            Measured {
                target,
                header,
                read_unix_time_ms,
                result,
            }
        }))
    }

    /// Takes the target back from a measurement that ended; reports its
    /// τ. Returns the version measured, or why it could not be.
    async fn finish(
        &mut self,
        joined: Result<Measured, tokio::task::JoinError>,
        evaluator: &mut Evaluator,
        report: &mut EvaluatorReport,
    ) -> Result<u64, (Option<u64>, anyhow::Error)> {
        let measured = joined.map_err(|error| {
            (
                None,
                anyhow::Error::from(error).context("the evaluation thread"),
            )
        })?;
        self.target = Some(measured.target);
        let version = measured.header.center_version;
        let samples = measured.header.center_samples;
        let measured_report = measured.result.map_err(|error| (Some(version), error))?;
        report.evaluating_seconds += measured_report.seconds;
        let point = proto::TauPoint {
            center_version: version,
            center_samples: samples,
            tau: measured_report.mean_acceptance_length,
            prompts: u32::try_from(measured_report.prompts).unwrap_or(u32::MAX),
            generated_tokens: measured_report.generated_tokens as u64,
            verification_steps: measured_report.verification_steps as u64,
            eval_seconds: measured_report.seconds,
            unix_time_ms: unix_time_ms(),
            evaluator_id: evaluator.evaluator_id.clone(),
            read_unix_time_ms: measured.read_unix_time_ms,
        };
        let mut local = Point {
            point: point.clone(),
            best: false,
        };
        match evaluator.report(point).await {
            Ok(result) => {
                local.best = result.best;
                if let Some(best) = result.best_point {
                    report.best_version = Some(best.center_version);
                    report.best_tau = Some(best.tau);
                }
                report.best_path = Some(result.best_path).filter(|path| !path.is_empty());
            }
            Err(status) => {
                report.refused_reports += 1;
                warn!(version, code = ?status.code(), message = status.message(), "the broker refused the τ report");
            }
        }
        let waited_ms = local
            .point
            .unix_time_ms
            .saturating_sub(local.point.read_unix_time_ms);
        info!(
            version,
            samples,
            tau = local.point.tau,
            seconds = local.point.eval_seconds,
            read_seconds_ago = waited_ms as f64 / 1e3,
            best = local.best,
            "center evaluated"
        );
        println!(
            "center v{version} ({samples} samples): τ {:.3} on {} prompts in {:.1}s (read {:.1}s before){}",
            local.point.tau,
            local.point.prompts,
            local.point.eval_seconds,
            waited_ms as f64 / 1e3,
            if local.best { "  (best so far)" } else { "" }
        );
        report.points.push(local);
        Ok(version)
    }

    /// Reads the current center and measures it, now: kept at the broker
    /// until its report, as a `--watch` read is.
    async fn evaluate_now(
        &mut self,
        evaluator: &mut Evaluator,
        report: &mut EvaluatorReport,
        poll: Duration,
    ) -> anyhow::Result<u64> {
        let read = Kept::from(evaluator).await?.read(evaluator, poll).await?;
        let joined = self.start(read)?.await;
        self.finish(joined, evaluator, report)
            .await
            .map_err(|(_, error)| error)
    }
}

/// When the next evaluation is due: every `every_versions` versions or
/// every `every`, and never twice for one version.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub every_versions: u64,
    pub every: Duration,
}

impl Schedule {
    /// Whether `version` should be evaluated now, given the last one
    /// evaluated and when.
    pub fn due(&self, version: u64, last: Option<(u64, Instant)>, now: Instant) -> bool {
        match last {
            None => true,
            Some((last_version, _)) if version == last_version => false,
            Some((last_version, at)) => {
                version >= last_version.saturating_add(self.every_versions.max(1))
                    || now.saturating_duration_since(at) >= self.every
            }
        }
    }
}

/// Whether the run is over for the evaluator: COMPLETE with the final
/// center written, or ABORTED.
fn run_over(snapshot: &proto::StatusSnapshot) -> bool {
    let final_saved = snapshot
        .model_sync
        .as_ref()
        .is_some_and(|sync| sync.final_saved || !sync.has_center);
    match snapshot.state() {
        proto::BrokerState::Complete => final_saved,
        proto::BrokerState::Aborted => true,
        _ => false,
    }
}

/// Runs the evaluator to its end (see the module's doc); returns what it
/// measured (also written to `--report-file`).
pub async fn run(
    args: EvaluateArgs,
    interrupt: CancellationToken,
) -> anyhow::Result<EvaluatorReport> {
    if args.threads == 0 {
        bail!("--threads must be at least 1");
    }
    tch::set_num_threads(i32::try_from(args.threads).unwrap_or(i32::MAX));
    let device = dflash_model::device::resolve_device(args.device)?;
    let mut prompts = demo::read_prompts(&args.prompts, &args.target)?;
    if args.max_prompts > 0 {
        prompts.truncate(args.max_prompts);
    }
    let target_dir = args.target.clone();
    let target =
        tokio::task::spawn_blocking(move || dflash_model::eval::load_target(&target_dir, device))
            .await
            .context("loading the target")?
            .with_context(|| format!("loading the target model from {}", args.target.display()))?;
    let mut bench = Bench {
        target: Some(target),
        options: dflash_model::eval::EvalOptions {
            max_new_tokens: args.max_new_tokens,
            stop_token_ids: dflash_model::tokens::eos_token_ids(&args.target),
            device,
        },
        prompts: Arc::new(prompts),
    };
    let mut evaluator =
        Evaluator::connect(&args.broker, &args.security, &args.evaluator_id).await?;
    let mut report = EvaluatorReport::default();
    let outcome = if args.watch {
        watch(&args, &mut bench, &mut evaluator, &mut report, &interrupt).await
    } else {
        bench
            .evaluate_now(&mut evaluator, &mut report, args.poll)
            .await
            .map(|_| ())
    };
    if let Some(path) = &args.report_file {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    outcome?;
    Ok(report)
}

/// What the watch loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Read the current center (it is due and the backlog has room).
    Read,
    /// Poll again later (or when a measurement ends).
    Wait,
    /// The run is over and every version read is measured.
    Stop,
}

/// The watch loop's decisions and its backlog, apart from its RPCs and the
/// clock: which version to read when, the versions read (`T`: what was
/// read) waiting for their measurement, which one is being measured, and
/// when the evaluator is done.
#[derive(Debug, Clone)]
pub struct Watcher<T> {
    schedule: Schedule,
    backlog: usize,
    /// Versions read and not yet being measured, oldest first.
    waiting: std::collections::VecDeque<(u64, T)>,
    /// The version being measured.
    measuring: Option<u64>,
    last_read: Option<(u64, Instant)>,
    /// The run's last version, once the run is over.
    final_version: Option<u64>,
}

impl<T> Watcher<T> {
    /// `backlog`: versions read and not yet measured at most (at least 1).
    pub fn new(schedule: Schedule, backlog: u32) -> Self {
        Watcher {
            schedule,
            backlog: (backlog as usize).max(1),
            waiting: std::collections::VecDeque::new(),
            measuring: None,
            last_read: None,
            final_version: None,
        }
    }

    /// After a status: the center's version (`None` before the first
    /// JOIN), how many unreported versions the broker keeps (0: not
    /// said), and whether the run is over.
    pub fn on_status(&mut self, center: Option<u64>, kept: u32, over: bool, now: Instant) -> Next {
        let backlog = match kept {
            0 => self.backlog,
            kept => self.backlog.min(kept as usize),
        };
        if let Some(version) = center {
            if over {
                self.final_version = Some(version);
            }
            let due = if over {
                self.last_read.is_none_or(|(last, _)| last != version)
            } else {
                self.schedule.due(version, self.last_read, now)
            };
            if due {
                // Reading more than the broker keeps would let an
                // unreported version go; the next poll reads once one is
                // measured.
                return if self.unmeasured() < backlog {
                    Next::Read
                } else {
                    Next::Wait
                };
            }
        }
        if over && self.unmeasured() == 0 {
            Next::Stop
        } else {
            Next::Wait
        }
    }

    /// A version was read: it waits for its measurement.
    pub fn read(&mut self, version: u64, read: T, now: Instant) {
        self.last_read = Some((version, now));
        self.waiting.push_back((version, read));
    }

    /// The oldest version read, to measure now, unless one is being
    /// measured (one at a time) or none waits.
    pub fn next_to_measure(&mut self) -> Option<T> {
        if self.measuring.is_some() {
            return None;
        }
        let (version, read) = self.waiting.pop_front()?;
        self.measuring = Some(version);
        Some(read)
    }

    /// The measurement of `version` ended. A failed one is read again when
    /// due, unless it is the run's final version: that failure ends the
    /// evaluator (`Err`).
    pub fn measured(&mut self, version: u64, ok: bool) -> Result<(), u64> {
        if self.measuring == Some(version) {
            self.measuring = None;
        }
        if ok {
            return Ok(());
        }
        if self.final_version == Some(version) {
            return Err(version);
        }
        if self.last_read.is_some_and(|(last, _)| last == version) {
            self.last_read = None;
        }
        Ok(())
    }

    /// Versions read and not yet measured (the one being measured
    /// included).
    pub fn unmeasured(&self) -> usize {
        self.waiting.len() + usize::from(self.measuring.is_some())
    }
}

/// `--watch`: polls the status, reads a version when due (while fewer
/// than the backlog wait), measures what was read in order, and once the
/// run is over the final center, then returns (see [`Watcher`]).
async fn watch(
    args: &EvaluateArgs,
    bench: &mut Bench,
    evaluator: &mut Evaluator,
    report: &mut EvaluatorReport,
    interrupt: &CancellationToken,
) -> anyhow::Result<()> {
    let mut watcher: Watcher<Kept> = Watcher::new(
        Schedule {
            every_versions: args.every_versions,
            every: args.every,
        },
        args.backlog,
    );
    let mut measuring: Option<Measuring> = None;
    let mut failures = 0u32;
    loop {
        if interrupt.is_cancelled() {
            info!(unmeasured = watcher.unmeasured(), "stopped by a signal");
            return Ok(());
        }
        if let Some(next) = watcher.next_to_measure() {
            let version = next.header.center_version;
            match next.read(evaluator, args.poll).await {
                Ok(read) => measuring = Some(bench.start(read)?),
                Err(error) => {
                    if watcher.measured(version, false).is_err() {
                        return Err(anyhow::Error::from(error).context("reading the final center"));
                    }
                    warn!(
                        version,
                        error = format!("{error:#}"),
                        "reading a kept version failed; the center is read again when due"
                    );
                }
            }
        }
        match evaluator.status.status().await {
            Ok(snapshot) => {
                failures = 0;
                let sync = snapshot.model_sync.as_ref().filter(|sync| sync.has_center);
                let next = watcher.on_status(
                    sync.map(|sync| sync.center_version),
                    sync.map_or(0, |sync| sync.max_pending_evaluations),
                    run_over(&snapshot),
                    Instant::now(),
                );
                match next {
                    Next::Stop => {
                        info!(
                            evaluations = report.points.len(),
                            "the run is over; the evaluator stops"
                        );
                        return Ok(());
                    }
                    Next::Read => match Kept::from(evaluator).await {
                        Ok(kept) => {
                            let version = kept.header.center_version;
                            watcher.read(version, kept, Instant::now());
                            continue;
                        }
                        Err(error) => warn!(
                            error = format!("{error:#}"),
                            "reading the center failed; retrying at the next poll"
                        ),
                    },
                    Next::Wait => {}
                }
            }
            Err(error) => {
                failures += 1;
                // A broker restart is survived; a broker gone for good is not.
                if failures >= 30 {
                    bail!("the broker did not answer {failures} status calls in a row: {error}");
                }
                warn!(%error, "broker status failed; retrying");
            }
        }
        // Until the poll, a signal, or the measurement's end.
        let joined = match measuring.as_mut() {
            Some(handle) => tokio::select! {
                () = interrupt.cancelled() => None,
                () = tokio::time::sleep(args.poll) => None,
                joined = handle => Some(joined),
            },
            None => {
                pause(args.poll, interrupt).await;
                None
            }
        };
        if let Some(joined) = joined {
            measuring = None;
            match bench.finish(joined, evaluator, report).await {
                Ok(version) => {
                    let _ = watcher.measured(version, true);
                }
                Err((None, error)) => return Err(error),
                Err((Some(version), error)) => {
                    if watcher.measured(version, false).is_err() {
                        return Err(error.context("the final evaluation"));
                    }
                    warn!(
                        version,
                        error = format!("{error:#}"),
                        "evaluation failed; the version is read again when due"
                    );
                }
            }
        }
    }
}

async fn pause(poll: Duration, interrupt: &CancellationToken) {
    tokio::select! {
        () = interrupt.cancelled() => {}
        () = tokio::time::sleep(poll) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_evaluation_is_due_every_k_versions_or_t_and_never_twice() {
        let schedule = Schedule {
            every_versions: 5,
            every: Duration::from_secs(60),
        };
        let start = Instant::now();
        assert!(schedule.due(0, None, start), "the first center");
        let last = Some((3, start));
        assert!(
            !schedule.due(3, last, start + Duration::from_secs(600)),
            "same version"
        );
        assert!(!schedule.due(7, last, start + Duration::from_secs(59)));
        assert!(schedule.due(8, last, start), "5 versions on");
        assert!(
            schedule.due(4, last, start + Duration::from_secs(60)),
            "a minute on"
        );
    }

    /// Every 10 versions (the time rule out of the way), `backlog` ahead;
    /// what a version read holds is its number, to check the order.
    fn every_ten_versions(backlog: u32) -> Watcher<u64> {
        let schedule = Schedule {
            every_versions: 10,
            every: Duration::from_secs(3600),
        };
        Watcher::new(schedule, backlog)
    }

    /// Reads `version` as the loop does once `on_status` says `Read`.
    fn read(watcher: &mut Watcher<u64>, version: u64, now: Instant) {
        watcher.read(version, version, now);
    }

    /// Starts the next measurement, as the loop does when none runs, and
    /// returns the version it measures.
    fn start_measuring(watcher: &mut Watcher<u64>) -> u64 {
        let version = watcher.next_to_measure().unwrap();
        assert_eq!(watcher.next_to_measure(), None, "one measurement at a time");
        version
    }

    /// A measurement slower than the versions come: each due version is
    /// read at once, up to the backlog (and the broker's bound), measured
    /// in turn, oldest first; the final version is read once the run is
    /// over and the watcher stops only when all is measured.
    #[test]
    fn due_versions_are_read_while_measuring_up_to_the_backlog_then_the_final_one() {
        let start = Instant::now();
        let mut watcher = every_ten_versions(3);
        assert_eq!(
            watcher.on_status(None, 4, false, start),
            Next::Wait,
            "no center yet"
        );
        assert_eq!(watcher.next_to_measure(), None, "nothing read");
        assert_eq!(watcher.on_status(Some(0), 4, false, start), Next::Read);
        read(&mut watcher, 0, start);
        assert_eq!(start_measuring(&mut watcher), 0);
        // Version 0 is being measured; 5 is not due, 10 and 20 are.
        assert_eq!(watcher.on_status(Some(5), 4, false, start), Next::Wait);
        for version in [10, 20] {
            assert_eq!(
                watcher.on_status(Some(version), 4, false, start),
                Next::Read
            );
            read(&mut watcher, version, start);
        }
        assert_eq!(watcher.unmeasured(), 3);
        assert_eq!(
            watcher.on_status(Some(30), 4, false, start),
            Next::Wait,
            "the backlog is full"
        );
        assert_eq!(watcher.measured(0, true), Ok(()));
        assert_eq!(watcher.unmeasured(), 2);
        assert_eq!(start_measuring(&mut watcher), 10);
        // The broker keeps 2: two unmeasured are as many as it holds.
        assert_eq!(watcher.on_status(Some(30), 2, false, start), Next::Wait);
        assert_eq!(watcher.on_status(Some(30), 4, false, start), Next::Read);
        read(&mut watcher, 30, start);
        // The run ends at version 33: read at once when there is room,
        // and the watcher stops only once every version is measured.
        assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
        assert_eq!(watcher.measured(10, true), Ok(()));
        assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Read);
        read(&mut watcher, 33, start);
        assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
        for version in [20, 30] {
            assert_eq!(start_measuring(&mut watcher), version);
            assert_eq!(watcher.measured(version, true), Ok(()));
            assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
        }
        assert_eq!(start_measuring(&mut watcher), 33);
        assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
        assert_eq!(watcher.measured(33, true), Ok(()));
        assert_eq!(watcher.unmeasured(), 0);
        assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Stop);
    }

    #[test]
    fn a_failed_measurement_is_read_again_unless_it_is_the_final_one() {
        let start = Instant::now();
        let mut watcher = every_ten_versions(2);
        assert_eq!(watcher.on_status(Some(4), 0, false, start), Next::Read);
        read(&mut watcher, 4, start);
        assert_eq!(start_measuring(&mut watcher), 4);
        assert_eq!(watcher.measured(4, false), Ok(()));
        assert_eq!(
            watcher.on_status(Some(6), 0, false, start),
            Next::Read,
            "read again"
        );
        read(&mut watcher, 6, start);
        assert_eq!(watcher.on_status(Some(9), 0, true, start), Next::Read);
        read(&mut watcher, 9, start);
        assert_eq!(start_measuring(&mut watcher), 6);
        assert_eq!(watcher.measured(6, true), Ok(()));
        assert_eq!(start_measuring(&mut watcher), 9);
        assert_eq!(
            watcher.measured(9, false),
            Err(9),
            "the final version failed"
        );
    }

    #[test]
    fn a_version_no_longer_kept_is_told_apart_from_a_broker_that_did_not_answer() {
        let refusal = || {
            tonic::Status::failed_precondition(
                "center version 7 is not kept for evaluation (kept: [8]); read the current center",
            )
        };
        let refused = ReadError::from_status(refusal(), Some(7));
        assert!(!refused.may_pass_again());
        assert!(
            refused
                .to_string()
                .contains("no longer keeps center version 7")
                && refused.to_string().contains("kept: [8]"),
            "{refused}"
        );
        // Refused while reading the current center ("no center yet"): a
        // drafter may join, so a later read may pass.
        assert!(ReadError::from_status(refusal(), None).may_pass_again());
        let unanswered = tonic::Status::unavailable("connection refused");
        assert!(ReadError::from_status(unanswered, Some(7)).may_pass_again());
        assert!(!ReadError::Malformed("expected the header first".into()).may_pass_again());
    }

    #[test]
    fn a_run_over_without_a_center_stops_at_once() {
        let schedule = Schedule {
            every_versions: 1,
            every: Duration::from_secs(1),
        };
        let mut watcher: Watcher<()> = Watcher::new(schedule, 1);
        assert_eq!(watcher.on_status(None, 0, true, Instant::now()), Next::Stop);
    }

    #[test]
    fn the_run_is_over_once_complete_with_the_final_center_or_aborted() {
        let mut snapshot = proto::StatusSnapshot {
            state: proto::BrokerState::Complete as i32,
            model_sync: Some(proto::ModelSyncStatus {
                has_center: true,
                final_saved: false,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(!run_over(&snapshot), "the final center is not written yet");
        if let Some(sync) = snapshot.model_sync.as_mut() {
            sync.final_saved = true;
        }
        assert!(run_over(&snapshot));
        snapshot.state = proto::BrokerState::Running as i32;
        assert!(!run_over(&snapshot));
        snapshot.state = proto::BrokerState::Aborted as i32;
        assert!(run_over(&snapshot));
    }
}
