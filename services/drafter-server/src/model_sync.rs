//! The drafter's side of the broker's model sync (`dflash.v1.ModelSync`):
//! many drafters train one draft model.
//!
//! Asynchronous local SGD (DiLoCo's inner/outer split, asynchronous as in
//! Liu et al. 2024): the drafter keeps a copy of the center version it last
//! received (its base). Every `--sync-every` optimizer steps it uploads
//! `delta = weights − base` and continues from the center the broker sends
//! back (which already holds this delta and every other drafter's); its own
//! AdamW moments stay local, as DiLoCo's inner optimizer state does. No
//! barrier: the broker answers at once whatever the other drafters do.
//!
//! Everything here runs on the training thread, which owns the libtorch
//! state; the gRPC exchange is driven on the server's tokio runtime through
//! its handle, bounded by `--sync-timeout`. A failed exchange never stops
//! training: the drafter keeps its weights and re-joins at the next sync
//! point (taking the center, so its work since the last good sync is lost,
//! which bounds what a broker restart costs to `--sync-every` steps).
//!
//! Each exchange also brings back the center's sample count (every
//! drafter's applied deltas), which the link writes into the drafter's
//! [`RunClock`]: the learning-rate schedule is the run's, not this drafter's
//! (see [`crate::schedule`]). Each UPDATE's staleness goes there too: it
//! measures how many drafters share the center, and each of N drafters
//! runs AdamW with β1^N so the shared model's momentum is one drafter's
//! (asynchrony adds momentum of its own: Mitliagkas et al. 2016).

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use dflash_model::draft::DraftModel;
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use tch::{Device, Kind, Tensor};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::schedule::RunClock;

use dflash_proto::transport::MODEL_SYNC_CHUNK_BYTES as CHUNK_BYTES;

/// Element type of weights on the sync wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SyncDtype {
    /// Exact: the drafter's master weights are f32.
    F32,
    /// Half the bytes; deltas and the center are rounded to bf16 on the
    /// wire (the broker's center stays f32).
    Bf16,
}

impl SyncDtype {
    fn kind(self) -> Kind {
        match self {
            SyncDtype::F32 => Kind::Float,
            SyncDtype::Bf16 => Kind::BFloat16,
        }
    }

    fn proto(self) -> proto::Dtype {
        match self {
            SyncDtype::F32 => proto::Dtype::F32,
            SyncDtype::Bf16 => proto::Dtype::Bf16,
        }
    }
}

/// The drafter's model-sync flags.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct SyncConfig {
    /// Exchange with the broker's shared model every this many optimizer
    /// steps; 0 trains an independent drafter (no sync at all).
    #[arg(long, env = "DFLASH_SYNC_EVERY", default_value_t = 10)]
    pub sync_every: u64,

    /// Element type of weights on the sync wire.
    #[arg(long, env = "DFLASH_SYNC_DTYPE", value_enum, default_value = "f32")]
    pub sync_dtype: SyncDtype,

    /// Bound on one exchange (e.g. `90s`, `2m`); past it the drafter
    /// continues on its own weights and re-joins at the next sync point.
    #[arg(long, env = "DFLASH_SYNC_TIMEOUT", default_value = "2m", value_parser = dflash_shell::parse_duration)]
    pub sync_timeout: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            sync_every: 10,
            sync_dtype: SyncDtype::F32,
            sync_timeout: Duration::from_secs(120),
        }
    }
}

/// Why an exchange failed (training continues).
#[derive(Debug, thiserror::Error)]
pub enum SyncClientError {
    #[error("connecting to {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("broker: {0}")]
    Status(#[from] tonic::Status),
    #[error("the sync session closed mid-exchange")]
    Closed,
    #[error("unexpected reply: {0}")]
    Protocol(String),
    #[error("exchange took longer than {0:?}")]
    Timeout(Duration),
    #[error("tensor {name:?}: {detail}")]
    Tensor { name: String, detail: String },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

/// One tensor in transit: name, shape, raw little-endian bytes.
type WireTensor = (String, Vec<u64>, Vec<u8>);

/// An open `Session` stream.
struct Session {
    requests: mpsc::Sender<proto::SyncRequest>,
    responses: tonic::Streaming<proto::SyncResponse>,
    welcome: proto::SyncWelcome,
}

/// What the last exchanges cost and did, for the report and the log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncTotals {
    pub exchanges: u64,
    pub failures: u64,
    /// Wall time the training thread spent in exchanges.
    pub time_in_sync: Duration,
    pub center_version: u64,
    pub last_staleness: u64,
    /// Samples in the center at the last exchange (every drafter's).
    pub center_samples: u64,
}

/// The model-sync client of one drafter (lives on its training thread).
pub struct ModelSyncLink {
    runtime: tokio::runtime::Handle,
    broker: String,
    drafter_id: String,
    config: SyncConfig,
    session: Option<Session>,
    /// TLS and the bearer token of the sync connection (as the Consume one).
    security: dflash_client::ClientSecurityArgs,
    /// The center version the weights started from and a copy of it (f32,
    /// on the model's device, sorted by name); `None` until joined.
    base: Option<(u64, Vec<(String, Tensor)>)>,
    steps_since_sync: u64,
    samples_since_sync: u64,
    tokens_since_sync: u64,
    pub totals: SyncTotals,
    /// Where the run is, for the run-wide learning-rate schedule.
    clock: RunClock,
}

impl ModelSyncLink {
    /// A link when `config.sync_every > 0`, else `None` (independent drafter).
    pub fn new(
        runtime: tokio::runtime::Handle,
        broker: &str,
        drafter_id: &str,
        config: &SyncConfig,
    ) -> Option<Self> {
        (config.sync_every > 0).then(|| ModelSyncLink {
            runtime,
            broker: broker.to_string(),
            drafter_id: drafter_id.to_string(),
            config: config.clone(),
            session: None,
            security: dflash_client::ClientSecurityArgs::default(),
            base: None,
            steps_since_sync: 0,
            samples_since_sync: 0,
            tokens_since_sync: 0,
            totals: SyncTotals::default(),
            clock: RunClock::new(),
        })
    }

    /// Keeps `clock` current with the center's sample count and this
    /// drafter's samples since its last exchange.
    pub fn with_run_clock(mut self, clock: RunClock) -> Self {
        self.clock = clock;
        self
    }

    /// The run clock this link keeps current.
    pub fn run_clock(&self) -> &RunClock {
        &self.clock
    }

    /// Connects with this TLS and token (the broker's flags of the drafter).
    pub fn with_security(mut self, security: dflash_client::ClientSecurityArgs) -> Self {
        self.security = security;
        self
    }

    fn timeout(&self) -> Duration {
        self.config.sync_timeout.max(Duration::from_millis(1))
    }

    /// Starts from the center (or initialises it with this model's weights
    /// when there is none yet). A failure is logged; training continues and
    /// the next sync point tries again.
    pub fn join(&mut self, model: &DraftModel) {
        let started = Instant::now();
        let outcome = self.try_join(model);
        self.account(started, outcome, "join");
    }

    /// Counts a step; every `--sync-every` steps exchanges with the center.
    pub fn after_step(&mut self, model: &DraftModel, samples: usize, tokens: usize) {
        self.steps_since_sync += 1;
        self.samples_since_sync += samples as u64;
        self.tokens_since_sync += tokens as u64;
        self.clock.trained(samples as u64);
        if self.steps_since_sync < self.config.sync_every {
            return;
        }
        let started = Instant::now();
        let outcome = if self.base.is_none() {
            self.try_join(model)
        } else {
            self.try_exchange(model, proto::SyncKind::Update)
        };
        self.account(started, outcome, "sync");
    }

    /// The last delta before the drafter stops; nothing comes back, so the
    /// drafter's own checkpoint keeps its own weights.
    pub fn finish(&mut self, model: &DraftModel) {
        if self.base.is_none() {
            return;
        }
        let started = Instant::now();
        let outcome = self.try_exchange(model, proto::SyncKind::Final);
        self.account(started, outcome, "final sync");
        self.session = None;
    }

    fn account(&mut self, started: Instant, outcome: Result<(), SyncClientError>, what: &str) {
        self.totals.time_in_sync += started.elapsed();
        match outcome {
            Ok(()) => {
                self.totals.exchanges += 1;
                self.clock.synced(self.totals.center_samples);
                self.steps_since_sync = 0;
                self.samples_since_sync = 0;
                self.tokens_since_sync = 0;
            }
            Err(error) => {
                self.totals.failures += 1;
                // Re-join at the next sync point: the broker may have
                // restarted with an older center.
                self.session = None;
                self.base = None;
                // The samples since the last exchange never reach the center:
                // the re-join starts from the center's weights.
                self.steps_since_sync = 0;
                self.samples_since_sync = 0;
                self.tokens_since_sync = 0;
                warn!(%error, what, "model sync failed; training continues on this drafter's weights");
            }
        }
    }

    fn try_join(&mut self, model: &DraftModel) -> Result<(), SyncClientError> {
        let parameters = sorted_parameters(model);
        let config_json = model.config().to_hf_json("float32").to_string();
        let has_center = self.open_session(config_json)?.welcome.has_center;
        // Weights go up only when there is no center to start from.
        let upload = if has_center {
            Vec::new()
        } else {
            parameters
                .iter()
                .map(|(name, tensor)| tensor_to_wire(name, tensor, self.config.sync_dtype))
                .collect::<Result<Vec<_>, _>>()?
        };
        let begin = self.begin(proto::SyncKind::Join, 0);
        let (result, center) = self.run_exchange(begin, upload)?;
        let base = if result.initialised {
            info!(
                version = result.center_version,
                "model sync: this drafter initialised the center"
            );
            parameters
                .iter()
                .map(|(name, tensor)| (name.clone(), tensor.detach().copy()))
                .collect()
        } else {
            let center = center.ok_or_else(|| {
                SyncClientError::Protocol("a JOIN answered without the center".to_string())
            })?;
            let base = load_center(&parameters, center)?;
            info!(
                version = result.center_version,
                "model sync: started from the center"
            );
            base
        };
        self.totals.center_version = result.center_version;
        self.totals.center_samples = result.center_samples;
        self.base = Some((result.center_version, base));
        Ok(())
    }

    fn try_exchange(
        &mut self,
        model: &DraftModel,
        kind: proto::SyncKind,
    ) -> Result<(), SyncClientError> {
        let Some((base_version, base)) = self.base.take() else {
            return Err(SyncClientError::Protocol("not joined".to_string()));
        };
        if self.session.is_none() {
            return Err(SyncClientError::Closed);
        }
        let parameters = sorted_parameters(model);
        let deltas = if kind == proto::SyncKind::Final && self.steps_since_sync == 0 {
            Vec::new()
        } else {
            delta_to_wire(&parameters, &base, self.config.sync_dtype)?
        };
        let begin = self.begin(kind, base_version);
        let (result, center) = self.run_exchange(begin, deltas)?;
        self.totals.center_version = result.center_version;
        self.totals.center_samples = result.center_samples;
        self.totals.last_staleness = result.staleness;
        if kind == proto::SyncKind::Update && result.applied {
            self.clock.staleness_observed(result.staleness);
        }
        if !result.applied && !result.reason.is_empty() && kind == proto::SyncKind::Update {
            info!(reason = %result.reason, "model sync: delta not applied; continuing from the center");
        }
        let base = match center {
            Some(center) => load_center(&parameters, center)?,
            None => base,
        };
        self.base = Some((result.center_version, base));
        Ok(())
    }

    fn begin(&self, kind: proto::SyncKind, base_version: u64) -> proto::SyncBegin {
        proto::SyncBegin {
            kind: kind as i32,
            base_version,
            steps: self.steps_since_sync,
            samples: self.samples_since_sync,
            tokens: self.tokens_since_sync,
            reply_dtype: self.config.sync_dtype.proto() as i32,
        }
    }

    fn open_session(&mut self, config_json: String) -> Result<&Session, SyncClientError> {
        let broker = self.broker.clone();
        let hello = proto::SyncHello {
            drafter_id: self.drafter_id.clone(),
            model_config_json: config_json,
        };
        let timeout = self.timeout();
        let security = self.security.clone();
        let session = self.block_on(timeout, open(broker, hello, security))?;
        Ok(self.session.insert(session))
    }

    /// Sends one exchange and reads its answer, bounded by the timeout.
    fn run_exchange(
        &mut self,
        begin: proto::SyncBegin,
        tensors: Vec<WireTensor>,
    ) -> Result<(proto::SyncResult, Option<Vec<WireTensor>>), SyncClientError> {
        let timeout = self.timeout();
        let mut session = self.session.take().ok_or(SyncClientError::Closed)?;
        let outcome = self.block_on(timeout, exchange(&mut session, begin, tensors));
        if outcome.is_ok() {
            self.session = Some(session);
        }
        outcome
    }

    /// Runs `future` on the server's runtime from this (non-runtime) thread.
    fn block_on<T>(
        &self,
        timeout: Duration,
        future: impl std::future::Future<Output = Result<T, SyncClientError>>,
    ) -> Result<T, SyncClientError> {
        self.runtime.block_on(async move {
            tokio::time::timeout(timeout, future)
                .await
                .map_err(|_| SyncClientError::Timeout(timeout))?
        })
    }
}

async fn open(
    broker: String,
    hello: proto::SyncHello,
    security: dflash_client::ClientSecurityArgs,
) -> Result<Session, SyncClientError> {
    let connect_error = |detail: String| SyncClientError::Connect {
        address: broker.clone(),
        detail,
    };
    let security = security
        .load()
        .map_err(|error| connect_error(error.to_string()))?;
    // The same transport settings as every other stream of the client
    // (windows, frame size, keepalive: `dflash_proto::transport`).
    let options = dflash_client::ClientOptions {
        security,
        ..dflash_client::ClientOptions::default()
    };
    let channel = dflash_client::connect_channel(&broker, &options)
        .await
        .map_err(|error| connect_error(error.to_string()))?;
    let mut client = ModelSyncClient::new(channel)
        .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
        .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES);
    let (requests, receiver) = mpsc::channel(4);
    requests
        .send(request(proto::sync_request::Kind::Hello(hello)))
        .await
        .map_err(|_| SyncClientError::Closed)?;
    let mut responses = client
        .session(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    match responses.message().await?.and_then(|message| message.kind) {
        Some(proto::sync_response::Kind::Welcome(welcome)) => Ok(Session {
            requests,
            responses,
            welcome,
        }),
        other => Err(SyncClientError::Protocol(format!(
            "expected a welcome, got {other:?}"
        ))),
    }
}

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

/// One exchange on an open session: the upload (BEGIN, chunks, COMMIT),
/// the broker's result, then the center when it follows.
async fn exchange(
    session: &mut Session,
    begin: proto::SyncBegin,
    tensors: Vec<WireTensor>,
) -> Result<(proto::SyncResult, Option<Vec<WireTensor>>), SyncClientError> {
    upload(session, begin, tensors).await?;
    let result = match next(session).await? {
        proto::sync_response::Kind::Result(result) => result,
        other => {
            return Err(SyncClientError::Protocol(format!(
                "expected a result, got {other:?}"
            )))
        }
    };
    if !result.weights_follow {
        return Ok((result, None));
    }
    let center = receive_center(session).await?;
    Ok((result, Some(center)))
}

/// Sends BEGIN, every tensor in chunks of at most `CHUNK_BYTES`, then
/// COMMIT with the tensor count.
async fn upload(
    session: &Session,
    begin: proto::SyncBegin,
    tensors: Vec<WireTensor>,
) -> Result<(), SyncClientError> {
    let dtype = begin.reply_dtype;
    let send = |kind| {
        let requests = session.requests.clone();
        async move {
            requests
                .send(request(kind))
                .await
                .map_err(|_| SyncClientError::Closed)
        }
    };
    send(proto::sync_request::Kind::Begin(begin)).await?;
    let count = tensors.len() as u32;
    for (name, shape, bytes) in tensors {
        let bytes = bytes::Bytes::from(bytes);
        let mut offset = 0usize;
        loop {
            let end = (offset + CHUNK_BYTES).min(bytes.len());
            send(proto::sync_request::Kind::Chunk(proto::TensorChunk {
                name: name.clone(),
                dtype,
                shape: shape.clone(),
                offset: offset as u64,
                data: bytes.slice(offset..end),
            }))
            .await?;
            offset = end;
            if offset >= bytes.len() {
                break;
            }
        }
    }
    send(proto::sync_request::Kind::Commit(proto::SyncCommit {
        tensors: count,
    }))
    .await
}

/// The center's tensors, chunk by chunk in order, until DONE (whose count
/// must match).
async fn receive_center(session: &mut Session) -> Result<Vec<WireTensor>, SyncClientError> {
    let mut center: Vec<WireTensor> = Vec::new();
    loop {
        match next(session).await? {
            proto::sync_response::Kind::Chunk(chunk) => {
                let continues = center.last().is_some_and(|(name, _, bytes)| {
                    *name == chunk.name && bytes.len() as u64 == chunk.offset
                });
                if continues {
                    if let Some((_, _, bytes)) = center.last_mut() {
                        bytes.extend_from_slice(&chunk.data);
                    }
                } else if chunk.offset == 0 {
                    center.push((chunk.name, chunk.shape, chunk.data.to_vec()));
                } else {
                    return Err(SyncClientError::Protocol(format!(
                        "chunk of {:?} at offset {} out of order",
                        chunk.name, chunk.offset
                    )));
                }
            }
            proto::sync_response::Kind::Done(done) => {
                if done.tensors as usize != center.len() {
                    return Err(SyncClientError::Protocol(format!(
                        "{} tensors received, the broker sent {}",
                        center.len(),
                        done.tensors
                    )));
                }
                return Ok(center);
            }
            other => {
                return Err(SyncClientError::Protocol(format!(
                    "expected center chunks, got {other:?}"
                )))
            }
        }
    }
}

async fn next(session: &mut Session) -> Result<proto::sync_response::Kind, SyncClientError> {
    session
        .responses
        .message()
        .await?
        .and_then(|message| message.kind)
        .ok_or(SyncClientError::Closed)
}

/// The model's trainable parameters, sorted by name (the checkpoint order).
fn sorted_parameters(model: &DraftModel) -> Vec<(String, Tensor)> {
    let mut parameters: Vec<(String, Tensor)> = model.var_store().variables().into_iter().collect();
    parameters.sort_by(|left, right| left.0.cmp(&right.0));
    parameters
}

fn tensor_to_wire(
    name: &str,
    tensor: &Tensor,
    dtype: SyncDtype,
) -> Result<WireTensor, SyncClientError> {
    let host = tensor
        .detach()
        .f_to_device(Device::Cpu)?
        .f_to_kind(dtype.kind())?
        .contiguous();
    let elements = host.numel();
    let mut bytes = vec![0u8; elements * dtype.kind().elt_size_in_bytes()];
    host.f_copy_data_u8(&mut bytes, elements)?;
    let shape = host.size().iter().map(|&dim| dim as u64).collect();
    Ok((name.to_string(), shape, bytes))
}

/// `weights − base` for every parameter, as `dtype` bytes.
fn delta_to_wire(
    parameters: &[(String, Tensor)],
    base: &[(String, Tensor)],
    dtype: SyncDtype,
) -> Result<Vec<WireTensor>, SyncClientError> {
    parameters
        .iter()
        .zip(base)
        .map(|((name, weights), (base_name, base))| {
            if name != base_name {
                return Err(SyncClientError::Tensor {
                    name: name.clone(),
                    detail: format!("base holds {base_name:?} at its place"),
                });
            }
            let delta = tch::no_grad(|| weights.detach().f_sub(base))?;
            tensor_to_wire(name, &delta, dtype)
        })
        .collect()
}

/// Copies the center into the model's parameters and returns the new base
/// (a copy of the same values).
fn load_center(
    parameters: &[(String, Tensor)],
    center: Vec<WireTensor>,
) -> Result<Vec<(String, Tensor)>, SyncClientError> {
    if center.len() != parameters.len() {
        return Err(SyncClientError::Protocol(format!(
            "the center has {} tensors, the model {}",
            center.len(),
            parameters.len()
        )));
    }
    let mut base = Vec::with_capacity(parameters.len());
    for ((name, parameter), (center_name, shape, bytes)) in parameters.iter().zip(center) {
        if *name != center_name {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("the center sent {center_name:?} at its place"),
            });
        }
        let shape: Vec<i64> = shape.iter().map(|&dim| dim as i64).collect();
        if shape != parameter.size() {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("center shape {shape:?}, model shape {:?}", parameter.size()),
            });
        }
        let elements: i64 = shape.iter().product();
        let kind = if bytes.len() as i64 == elements * 4 {
            Kind::Float
        } else if bytes.len() as i64 == elements * 2 {
            Kind::BFloat16
        } else {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("{} bytes for {elements} elements", bytes.len()),
            });
        };
        let values = Tensor::f_from_data_size(&bytes, &shape, kind)?
            .f_to_kind(Kind::Float)?
            .f_to_device(parameter.device())?;
        tch::no_grad(|| parameter.shallow_clone().f_copy_(&values))?;
        base.push((name.clone(), values));
    }
    Ok(base)
}
