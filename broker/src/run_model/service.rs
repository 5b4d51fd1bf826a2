//! The gRPC adapter of the `dflash.v1.ModelSync` service: the state its
//! sessions share, and each drafter's session (hello, then snapshots of
//! begin, the model's files in chunks and commit, each answered with its
//! result). All rules
//! live in the rest of [`crate::run_model`]; the task that writes the
//! model to disk is [`writer`], the evaluator's RPCs are [`evaluation`].
//! The lighthouse is its own service (`crate::lighthouse::rpc`).
//!
//! Concurrency: one mutex around the [`ModelSyncState`]. Chunks are staged
//! per session without it, checked finite on a blocking thread without it,
//! and their handles moved in under it at the commit. Checkpoints and reads
//! clone the model's handles under the lock (never its bytes) and write or
//! stream them after it.

mod evaluation;
mod writer;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_server::{ModelSync, ModelSyncServer};
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::rpc_error::RpcError;
use crate::run_model::checkpoint::CheckpointError;
use crate::run_model::evaluation::Evaluations;
use crate::run_model::store::files::{CONFIG_FILE_NAME, MODEL_FILE_NAME};
use crate::run_model::store::{ModelSyncState, StoredModel, Upload};
use crate::run_model::RunModelSettings;

pub use dflash_proto::transport::MODEL_SYNC_CHUNK_BYTES as CHUNK_BYTES;

/// State shared by the sessions and the background task.
pub struct ModelSyncShared {
    state: Mutex<ModelSyncState>,
    /// The run model's part of the flags.
    settings: RunModelSettings,
    /// `--hello-timeout`: how long a new Session may take to send its hello.
    hello_timeout: Duration,
    /// Cancelled on broker shutdown: sessions end with UNAVAILABLE.
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// One checkpoint write at a time. The guard travels into the blocking
    /// write, so a caller that stops waiting (an aborted task) does not let
    /// a second write start while the first is still renaming files.
    save_lock: Arc<tokio::sync::Mutex<()>>,
    /// Woken when a snapshot commits or a session closes: the model
    /// writer re-checks what it waits for.
    sync_changed: Notify,
    /// Online evaluation: the τ history, the best report and the versions
    /// served to an evaluator ([`crate::run_model::evaluation`]). Its own lock, never
    /// held with the state's: an evaluator never delays a snapshot.
    evaluations: Mutex<Evaluations>,
    /// One report at a time, from its checks to its record (the best
    /// model's write included), so two reports never race for the best.
    report_lock: tokio::sync::Mutex<()>,
}

impl ModelSyncShared {
    /// The service state, with the model resumed from `--model-output`
    /// when a model was written there before.
    pub fn start(
        settings: RunModelSettings,
        hello_timeout: Duration,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>, CheckpointError> {
        let state = crate::run_model::resume(&settings)?;
        info!(output = ?settings.model_output, "model sync ready");
        let evaluations = Evaluations::new(settings.max_pending_evaluations);
        Ok(Arc::new(ModelSyncShared {
            state: Mutex::new(state),
            settings,
            hello_timeout,
            shutdown,
            tasks: TaskTracker::new(),
            save_lock: Arc::new(tokio::sync::Mutex::new(())),
            sync_changed: Notify::new(),
            evaluations: Mutex::new(evaluations),
            report_lock: tokio::sync::Mutex::new(()),
        }))
    }

    pub fn status(&self) -> proto::ModelSyncStatus {
        let mut status = self.state.lock().status(Instant::now());
        self.evaluations.lock().fill_status(&mut status);
        status
    }

    /// Online evaluation's series for `/metrics`.
    pub fn tau_gauges(&self) -> crate::run_model::evaluation::TauGauges {
        self.evaluations.lock().gauges()
    }

    /// The tonic service, with message limits sized for chunks.
    pub fn server(self: &Arc<Self>) -> ModelSyncServer<ModelSyncService> {
        ModelSyncServer::new(ModelSyncService {
            shared: self.clone(),
        })
        .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
        .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
    }

    /// Session tasks, awaited (bounded) on shutdown.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }
}

/// The `dflash.v1.ModelSync` service.
#[derive(Clone)]
pub struct ModelSyncService {
    shared: Arc<ModelSyncShared>,
}

/// Closes the drafter's session in the state when its task ends, however
/// it ends.
struct SessionGuard {
    shared: Arc<ModelSyncShared>,
    drafter_id: String,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.shared.state.lock().close_session(&self.drafter_id);
        self.shared.sync_changed.notify_one();
    }
}

type Outbox = mpsc::Sender<Result<proto::SyncResponse, Status>>;

fn response(kind: proto::sync_response::Kind) -> Result<proto::SyncResponse, Status> {
    Ok(proto::SyncResponse { kind: Some(kind) })
}

#[tonic::async_trait]
impl ModelSync for ModelSyncService {
    type SessionStream = ReceiverStream<Result<proto::SyncResponse, Status>>;
    type ReadModelStream = ReceiverStream<Result<proto::ReadModelResponse, Status>>;

    async fn read_model(
        &self,
        request: Request<proto::ReadModelRequest>,
    ) -> Result<Response<Self::ReadModelStream>, Status> {
        evaluation::read_model(&self.shared, request).await
    }

    async fn report_tau(
        &self,
        request: Request<proto::TauReport>,
    ) -> Result<Response<proto::TauReportResult>, Status> {
        evaluation::report_tau(&self.shared, request).await
    }

    async fn session(
        &self,
        request: Request<Streaming<proto::SyncRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let principal = crate::roles::Principal::of(request.extensions());
        let mut inbound = request.into_inner();
        let timeout = self.shared.hello_timeout;
        let first = match tokio::time::timeout(timeout, inbound.message()).await {
            Err(_) => return Err(RpcError::NoHello(timeout).into()),
            Ok(result) => result?,
        };
        let hello = match first.and_then(|message| message.kind) {
            Some(proto::sync_request::Kind::Hello(hello)) => hello,
            _ => {
                return Err(RpcError::FirstMessageNotHello {
                    stream: "Session",
                    id_field: "drafter_id",
                }
                .into())
            }
        };
        if hello.drafter_id.is_empty() {
            return Err(RpcError::EmptyId {
                field: "drafter_id",
            }
            .into());
        }
        crate::roles::validate_id("drafter_id", &hello.drafter_id)?;
        principal.authorize(
            crate::roles::Role::Drafter,
            &hello.drafter_id,
            "ModelSync.Session",
        )?;
        serde_json::from_str::<serde_json::Value>(&hello.model_config_json)
            .map_err(RpcError::ModelConfigNotJson)?;
        let (outbox, receiver) = mpsc::channel(16);
        let welcome = {
            let mut state = self.shared.state.lock();
            state.open_session(&hello.drafter_id);
            proto::SyncWelcome {
                has_model: state.model().is_some(),
                model_version: state.version().unwrap_or(0),
            }
        };
        let guard = SessionGuard {
            shared: self.shared.clone(),
            drafter_id: hello.drafter_id.clone(),
        };
        let _ = outbox.try_send(response(proto::sync_response::Kind::Welcome(welcome)));
        info!(drafter_id = %hello.drafter_id, "model sync session opened");
        self.shared
            .tasks
            .spawn(run_session(self.shared.clone(), guard, inbound, outbox));
        Ok(Response::new(ReceiverStream::new(receiver)))
    }
}

/// Reads one session's snapshots until it ends, the broker stops, or one
/// is refused (the error ends the session; nothing was applied).
async fn run_session(
    shared: Arc<ModelSyncShared>,
    guard: SessionGuard,
    mut inbound: Streaming<proto::SyncRequest>,
    outbox: Outbox,
) {
    let drafter_id = guard.drafter_id.clone();
    let mut upload: Option<Upload> = None;
    loop {
        let message = tokio::select! {
            _ = shared.shutdown.cancelled() => {
                let _ = outbox.try_send(Err(RpcError::ShuttingDown.into()));
                break;
            }
            message = inbound.message() => message,
        };
        let request = match message {
            Ok(Some(request)) => request,
            Ok(None) => break,
            Err(status) => {
                debug!(drafter_id, %status, "model sync session broke");
                break;
            }
        };
        let outcome = handle_request(&shared, &drafter_id, &mut upload, request, &outbox).await;
        if let Err(status) = outcome {
            warn!(drafter_id, %status, "model snapshot refused; nothing applied");
            let _ = outbox.send(Err(status)).await;
            break;
        }
    }
    if upload.is_some() {
        info!(
            drafter_id,
            "model sync session ended mid-snapshot; its partial upload is dropped"
        );
    }
    drop(guard);
}

/// Handles one message of an open session: `Begin` opens a snapshot,
/// `FileChunk` adds to it, `Commit` applies it ([`commit_snapshot`]); anything
/// else is refused.
async fn handle_request(
    shared: &ModelSyncShared,
    drafter_id: &str,
    upload: &mut Option<Upload>,
    request: proto::SyncRequest,
    outbox: &Outbox,
) -> Result<(), Status> {
    use proto::sync_request::Kind;
    match request.kind {
        Some(Kind::Begin(begin)) => {
            if upload.is_some() {
                return Err(RpcError::BeginWhileSnapshotOpen.into());
            }
            *upload = Some(Upload::new(&begin)?);
            Ok(())
        }
        Some(Kind::FileChunk(chunk)) => {
            let open = upload
                .as_mut()
                .ok_or(RpcError::OutsideSnapshot { what: "file_chunk" })?;
            open.add_file_chunk(chunk)?;
            Ok(())
        }
        Some(Kind::Commit(commit)) => {
            let open = upload
                .take()
                .ok_or(RpcError::OutsideSnapshot { what: "commit" })?;
            commit_snapshot(shared, drafter_id, open, commit.files, outbox).await
        }
        Some(Kind::Hello(_)) => Err(RpcError::UnexpectedSessionMessage.into()),
        // prost drops a field it does not know: an old drafter's tensor
        // chunk (its number reserved) arrives as a message of no kind.
        None => Err(RpcError::RetiredTensorChunk.into()),
    }
}

/// Commits a whole snapshot: checks it whole and every value finite on a
/// blocking thread (a read-only pass over the bytes, before the lock),
/// applies it to the model under the lock (its chunks moved in, nothing
/// copied), logs it, and sends the result.
async fn commit_snapshot(
    shared: &ModelSyncShared,
    drafter_id: &str,
    open: Upload,
    declared_files: u32,
    outbox: &Outbox,
) -> Result<(), Status> {
    let kind = open.kind;
    let open = tokio::task::spawn_blocking(move || open.into_finite(declared_files))
        .await
        .map_err(|join_error| RpcError::TaskFailed {
            what: "checking the snapshot",
            detail: join_error.to_string(),
        })??;
    let outcome = shared
        .state
        .lock()
        .commit(drafter_id, open, Instant::now())?;
    shared.sync_changed.notify_one();
    debug!(
        drafter_id,
        ?kind,
        version = outcome.model_version,
        applied = outcome.applied,
        "model snapshot"
    );
    if outcome.initialised {
        info!(drafter_id, "model initialised from this drafter's snapshot");
    }
    let result = proto::SyncResult {
        model_version: outcome.model_version,
        applied: outcome.applied,
        reason: outcome.reason,
        initialised: outcome.initialised,
        model_samples: outcome.model_samples,
    };
    send(outbox, proto::sync_response::Kind::Result(result)).await
}

/// The model's files as the chunks that carry them: `config.json`, then
/// `model.safetensors`, each stored chunk cut to at most [`CHUNK_BYTES`],
/// each a slice of the stored bytes (no copy of the weights, no encoding).
fn model_file_chunks(model: &StoredModel) -> Vec<proto::ModelFileChunk> {
    let config = bytes::Bytes::from(model.config_json.clone().into_bytes());
    let config = crate::run_model::store::ModelFile::whole(config);
    [
        (CONFIG_FILE_NAME, &config),
        (MODEL_FILE_NAME, &model.weights),
    ]
    .into_iter()
    .flat_map(|(name, file)| {
        let mut pieces = Vec::new();
        let mut offset = 0u64;
        for chunk in &file.chunks {
            for start in (0..chunk.len()).step_by(CHUNK_BYTES) {
                let data = chunk.slice(start..(start + CHUNK_BYTES).min(chunk.len()));
                let length = data.len() as u64;
                pieces.push(proto::ModelFileChunk {
                    file: name.to_string(),
                    offset,
                    data,
                    file_size: file.size,
                });
                offset += length;
            }
        }
        if pieces.is_empty() {
            pieces.push(proto::ModelFileChunk {
                file: name.to_string(),
                offset: 0,
                data: bytes::Bytes::new(),
                file_size: 0,
            });
        }
        pieces
    })
    .collect()
}

/// Sends one response; a gone receiver means the drafter left.
async fn send(outbox: &Outbox, kind: proto::sync_response::Kind) -> Result<(), Status> {
    outbox
        .send(response(kind))
        .await
        .map_err(|_| RpcError::SessionClosed.into())
}
