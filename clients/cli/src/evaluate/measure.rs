//! Measuring τ of model versions: the target and prompts kept between
//! versions, a version's weights read when its measurement starts, and
//! each measurement on its own blocking thread.

use std::sync::Arc;
use std::time::Duration;

use super::broker::{draft_of_read, unix_time_ms, Evaluator, ReadError, ReadModel};
use super::report::{EvaluatorReport, Point};
use anyhow::Context as _;
use dflash_model::target_model::TargetModel;
use dflash_proto::v1 as proto;
use tracing::{info, warn};

/// What one evaluation needs that does not change between versions.
pub(super) struct Bench {
    /// The target, `None` while a measurement owns it.
    pub(super) target: Option<TargetModel>,
    /// Shared with each measurement's thread.
    pub(super) prompts: Arc<Vec<Vec<i64>>>,
    pub(super) options: dflash_model::eval::EvalOptions,
}

/// A model version read whole, to measure.
pub(super) struct Read {
    pub(super) model: ReadModel,
    pub(super) read_unix_time_ms: u64,
}

/// A model version the broker keeps for the evaluator (its header only),
/// waiting for its measurement: the weights are read when it is measured,
/// so versions waiting cost the evaluator no memory.
pub(super) struct Kept {
    pub(super) header: proto::ModelHeader,
    pub(super) read_unix_time_ms: u64,
}

impl Kept {
    pub(super) async fn from(evaluator: &mut Evaluator) -> anyhow::Result<Kept> {
        let header = evaluator.keep_model().await?;
        Ok(Kept {
            header,
            read_unix_time_ms: unix_time_ms(),
        })
    }

    /// Its weights, from the broker: a few tries, `poll` apart, since a
    /// broker that does not answer once may the next time; one only when
    /// the answer says another cannot help (the version no longer kept, or
    /// not a model).
    pub(super) async fn read(
        self,
        evaluator: &mut Evaluator,
        poll: Duration,
    ) -> Result<Read, ReadError> {
        let version = self.header.model_version;
        let mut tries = 0;
        loop {
            tries += 1;
            match evaluator.read_kept(version).await {
                Ok(model) => {
                    return Ok(Read {
                        model,
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
pub(super) const KEPT_READ_TRIES: u32 = 3;

/// A measurement's end: the target back, what was measured and of what.
pub(super) struct Measured {
    pub(super) target: TargetModel,
    pub(super) header: proto::ModelHeader,
    pub(super) read_unix_time_ms: u64,
    pub(super) result: anyhow::Result<dflash_model::eval::EvalReport>,
}

pub(super) type Measuring = tokio::task::JoinHandle<Measured>;

impl Bench {
    /// Measures τ of the version read on a blocking thread, which owns
    /// the target meanwhile.
    pub(super) fn start(&mut self, read: Read) -> anyhow::Result<Measuring> {
        let target = self.target.take().context("the target model is gone")?;
        let (prompts, options) = (Arc::clone(&self.prompts), self.options.clone());
        Ok(tokio::task::spawn_blocking(move || {
            let Read {
                model,
                read_unix_time_ms,
            } = read;
            let header = model.header.clone();
            let version = header.model_version;
            // Exported when OTLP is configured (`dflash_telemetry::init`).
            let span = tracing::debug_span!(
                target: dflash_telemetry::TRACE_TARGET,
                "evaluator.measure",
                model_version = version,
                model_samples = header.model_samples,
                tau = tracing::field::Empty,
            );
            let _measuring = span.enter();
            let result = draft_of_read(model)
                .and_then(|(config, tensors)| {
                    let origin = format!("model version {version}");
                    dflash_model::eval::evaluate_tensors(
                        &target, config, tensors, &origin, &prompts, &options,
                    )
                    .map_err(anyhow::Error::from)
                })
                .with_context(|| format!("evaluating model version {version}"));
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
    pub(super) async fn finish(
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
        let version = measured.header.model_version;
        let samples = measured.header.model_samples;
        let measured_report = measured.result.map_err(|error| (Some(version), error))?;
        report.evaluating_seconds += measured_report.seconds;
        let point = proto::TauPoint {
            model_version: version,
            model_samples: samples,
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
                    report.best_version = Some(best.model_version);
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
            "model evaluated"
        );
        println!(
            "model v{version} ({samples} samples): τ {:.3} on {} prompts in {:.1}s (read {:.1}s before){}",
            local.point.tau,
            local.point.prompts,
            local.point.eval_seconds,
            waited_ms as f64 / 1e3,
            if local.best { "  (best so far)" } else { "" }
        );
        report.points.push(local);
        Ok(version)
    }

    /// Reads the current model and measures it, now: kept at the broker
    /// until its report, as a `--watch` read is.
    pub(super) async fn evaluate_now(
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
