//! The evaluator's two RPCs: `ReadModel` (the model's weights, read-only;
//! also how a starting drafter reads the run's model) and `ReportTau` (a
//! version's τ; the best one is written to the best model's directory). The rules are [`crate::run_model::evaluation`]'s;
//! this is the adapter: authorization, the locks, the stream, the write.
//!
//! `ReadModel` takes the state's lock once, to copy the model's pointers
//! (a clone of the [`StoredModel`](crate::run_model::store::StoredModel), its buffers shared), and touches nothing else of it: no session opens,
//! no drafter record, no counter. The weights go out as slices of the
//! stored bytes, after the lock.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dflash_proto::v1 as proto;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::{model_file_chunks, ModelSyncShared};
use crate::roles::{validate_id, Principal, Role};
use crate::rpc_error::RpcError;
use crate::run_model::checkpoint::write_model;

/// The best model's directory: `<name>-best` beside `--model-output`
/// (`model-best/` beside `model/`), so it is never the model itself.
pub fn best_model_dir(model_output: &Path) -> PathBuf {
    let name = model_output
        .file_name()
        .map_or_else(|| "model".into(), |name| name.to_string_lossy());
    model_output.with_file_name(format!("{name}-best"))
}

/// Checks the evaluator's id and credential (the evaluator role, for that
/// id), before anything else.
fn authorize(
    principal: &Principal,
    evaluator_id: &str,
    action: &'static str,
) -> Result<(), RpcError> {
    if evaluator_id.is_empty() {
        return Err(RpcError::EmptyId {
            field: "evaluator_id",
        });
    }
    validate_id("evaluator_id", evaluator_id)?;
    principal.authorize(Role::Evaluator, evaluator_id, action)
}

/// Checks a starting drafter's read: its id and credential (the drafter
/// role, for that id), and nothing of an evaluator's read in it.
fn authorize_drafter(
    principal: &Principal,
    request: &proto::ReadModelRequest,
) -> Result<(), RpcError> {
    if !request.evaluator_id.is_empty() || request.model_version.is_some() {
        return Err(RpcError::DrafterReadNamesEvaluator);
    }
    validate_id("drafter_id", &request.drafter_id)?;
    principal.authorize(Role::Drafter, &request.drafter_id, "ModelSync.ReadModel")
}

/// `ReadModel`: the header, the model's files in chunks (none with
/// `header_only`), then `done`; of the current model, kept until its
/// report, or of a version kept since an earlier read (`model_version`).
/// A drafter's read (`drafter_id`) gets the current model and keeps
/// nothing.
pub(super) async fn read_model(
    shared: &Arc<ModelSyncShared>,
    request: Request<proto::ReadModelRequest>,
) -> Result<Response<ReceiverStream<Result<proto::ReadModelResponse, Status>>>, Status> {
    let principal = Principal::of(request.extensions());
    let request = request.into_inner();
    let for_drafter = !request.drafter_id.is_empty();
    if for_drafter {
        authorize_drafter(&principal, &request)?;
    } else {
        authorize(&principal, &request.evaluator_id, "ModelSync.ReadModel")?;
    }
    let served = match request.model_version {
        Some(version) => {
            let evaluations = shared.evaluations.lock();
            evaluations
                .kept(version)
                .ok_or_else(|| RpcError::VersionNotKept {
                    version,
                    kept: evaluations.pending_versions(),
                })?
        }
        None => {
            let served = {
                let state = shared.state.lock();
                let model = state.model().ok_or(RpcError::NoModelToRead)?;
                model.clone()
            };
            if !for_drafter {
                shared.evaluations.lock().served(served.clone());
            }
            served
        }
    };
    info!(
        evaluator_id = %request.evaluator_id,
        drafter_id = %request.drafter_id,
        version = served.version,
        samples = served.samples,
        kept_version = request.model_version.is_some(),
        header_only = request.header_only,
        "model read"
    );
    let header = proto::ModelHeader {
        model_version: served.version,
        model_samples: served.samples,
        model_config_json: served.config_json.clone(),
    };
    // The chunks are slices of the stored files: made after the lock, no
    // copy of the weights.
    let chunks = if request.header_only {
        Vec::new()
    } else {
        model_file_chunks(&served)
    };
    let files = if request.header_only { 0 } else { 2 };
    let version = served.version;
    drop(served);
    let (outbox, receiver) = mpsc::channel(16);
    let shutdown = shared.shutdown.clone();
    shared.tasks.spawn(async move {
        use proto::read_model_response::Kind;
        let message = |kind| Ok(proto::ReadModelResponse { kind: Some(kind) });
        let messages = std::iter::once(Kind::Header(header))
            .chain(chunks.into_iter().map(Kind::FileChunk))
            .chain(std::iter::once(Kind::Done(proto::SyncDone {
                model_version: version,
                files,
            })));
        for kind in messages {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    let _ = outbox.try_send(Err(Status::from(RpcError::ShuttingDown)));
                    return;
                }
                sent = outbox.send(message(kind)) => if sent.is_err() {
                    // The evaluator went away; the version stays kept until
                    // a newer read lets it go.
                    return;
                }
            }
        }
    });
    Ok(Response::new(ReceiverStream::new(receiver)))
}

/// `ReportTau`: checks the report, writes the version as the best model
/// when its τ is the best so far (before answering), and records it.
pub(super) async fn report_tau(
    shared: &Arc<ModelSyncShared>,
    request: Request<proto::TauReport>,
) -> Result<Response<proto::TauReportResult>, Status> {
    let principal = Principal::of(request.extensions());
    let report = request.into_inner();
    authorize(&principal, &report.evaluator_id, "ModelSync.ReportTau")?;
    if let Some(point) = &report.point {
        if point.evaluator_id != report.evaluator_id && !point.evaluator_id.is_empty() {
            return Err(RpcError::PointOfOtherEvaluator {
                point: point.evaluator_id.clone(),
                report: report.evaluator_id.clone(),
            }
            .into());
        }
    }
    let _one_report_at_a_time = shared.report_lock.lock().await;
    let mut checked = shared.evaluations.lock().check(report.point.as_ref())?;
    checked.point.evaluator_id = report.evaluator_id.clone();
    let version = checked.point.model_version;
    let tau = checked.point.tau;
    let mut written = None;
    if checked.best {
        if let Some(model_output) = &shared.settings.model_output {
            let dir = best_model_dir(model_output);
            let model = checked.model.clone();
            let started = Instant::now();
            let target = dir.clone();
            tokio::task::spawn_blocking(move || write_model(&target, &model))
                .await
                .map_err(|join_error| RpcError::TaskFailed {
                    what: "writing the best model",
                    detail: join_error.to_string(),
                })?
                .map_err(|error| {
                    warn!(%error, version, "writing the best model failed; the report is not recorded");
                    RpcError::BestModelNotWritten(error)
                })?;
            info!(path = %dir.display(), version, tau, seconds = started.elapsed().as_secs_f64(), "best model written");
            written = Some(dir.display().to_string());
        }
    }
    let best = checked.best;
    let result = {
        let mut evaluations = shared.evaluations.lock();
        evaluations.record(checked, written);
        proto::TauReportResult {
            best,
            best_point: evaluations.best().cloned(),
            best_path: evaluations.best_path().to_string(),
        }
    };
    info!(evaluator_id = %report.evaluator_id, version, tau, best, "model τ reported");
    Ok(Response::new(result))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_model_lies_beside_the_model_never_in_it() {
        assert_eq!(
            best_model_dir(Path::new("/runs/x/model")),
            PathBuf::from("/runs/x/model-best")
        );
        assert_eq!(
            best_model_dir(Path::new("model")),
            PathBuf::from("model-best")
        );
    }
}
