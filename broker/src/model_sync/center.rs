//! The center and the drafters' sync records, as a synchronous state machine:
//! no gRPC, no tokio, no clock of its own (time comes in as an argument).
//!
//! An exchange is staged chunk by chunk in an [`Upload`] that belongs to the
//! session, not to the center; only [`ModelSyncState::commit`] touches the
//! center, all at once and after every check passed. A drafter that dies
//! mid-upload therefore leaves the center exactly as it was, and a slow one
//! never holds anything another drafter needs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_proto::v1 as proto;

use super::arith::{self, WireDtype};

/// The outer optimizer: asynchronous local SGD with a delayed Nesterov step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterSettings {
    /// Outer learning rate η: each delta moves the center by η·delta.
    pub learning_rate: f32,
    /// Nesterov momentum μ of the outer step (0: plain asynchronous local SGD).
    pub momentum: f32,
    /// Deltas averaged per momentum step (N in Liu et al. 2024); 0 means the
    /// number of drafters with an open session at the time.
    pub momentum_delay: u32,
    /// A delta whose base is more than this many center updates old is
    /// discarded and the drafter restarts from the center (0: no bound).
    pub max_staleness: u64,
    /// A delta whose L2 norm is over this many times the largest norm of
    /// the last [`DELTA_NORM_WINDOW`] applied deltas is discarded, once
    /// [`DELTA_NORM_WARMUP`] were applied (0: no bound). A delta with a NaN
    /// or an infinity is always discarded.
    ///
    /// The largest, not the median: while the learning rate warms up each
    /// delta may be a few times the previous one, and over a window that
    /// adds up to far more than any fixed multiple of the median (a rule
    /// that discarded every delta of a legitimately faster drafter, which
    /// then never caught up). Growth past the window's largest by this
    /// factor in one exchange is not training, it is a fault.
    pub max_delta_norm_ratio: f32,
}

/// Default of [`OuterSettings::max_delta_norm_ratio`]: consecutive deltas
/// of the same number of local steps differ by small factors; one ten times
/// the largest recent one is broken.
pub const DEFAULT_MAX_DELTA_NORM_RATIO: f32 = 10.0;
/// Applied deltas whose norms the bound is over (their largest).
pub const DELTA_NORM_WINDOW: usize = 32;
/// Applied deltas before the norm bound applies.
pub const DELTA_NORM_WARMUP: usize = 4;
/// A delta whose norm is at most this fraction of the weights' norm (when
/// the center was made or resumed) is never an outlier.
pub const DELTA_NORM_FLOOR: f64 = 0.05;

impl Default for OuterSettings {
    fn default() -> Self {
        OuterSettings {
            learning_rate: 1.0,
            momentum: 0.7,
            momentum_delay: 0,
            max_staleness: 0,
            max_delta_norm_ratio: DEFAULT_MAX_DELTA_NORM_RATIO,
        }
    }
}

impl OuterSettings {
    /// The method with its parameters, as shown in status and logs.
    pub fn describe(&self) -> String {
        let delay = match self.momentum_delay {
            0 => "N = open sessions".to_string(),
            delay => format!("N = {delay}"),
        };
        let staleness = match self.max_staleness {
            0 => "unbounded".to_string(),
            bound => bound.to_string(),
        };
        format!(
            "async local SGD (DiLoCo outer step, Liu et al. 2024 delayed Nesterov): outer lr {}, momentum {}, {delay}, max staleness {staleness}",
            self.learning_rate, self.momentum
        )
    }
}

/// Why an exchange or a chunk was refused. Messages name the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    #[error("no center yet: the first JOIN must carry the drafter's weights")]
    NoCenter,
    #[error("tensor {name:?}: {detail}")]
    BadTensor { name: String, detail: String },
    #[error("the center has no tensor {0:?}")]
    UnknownTensor(String),
    #[error("tensor {name:?} has shape {got:?}, the center has {center:?}")]
    ShapeMismatch {
        name: String,
        got: Vec<u64>,
        center: Vec<u64>,
    },
    #[error("the exchange sent {sent} tensors, the commit says {declared}")]
    CountMismatch { sent: usize, declared: u32 },
    #[error("the exchange lacks tensor {0:?}")]
    MissingTensor(String),
    #[error("tensor {0:?} was sent twice in one exchange")]
    DuplicateTensor(String),
    #[error("base version {base} is newer than the center's version {center}")]
    FutureBase { base: u64, center: u64 },
    #[error("unsupported dtype {0} (expected DTYPE_BF16 or DTYPE_F32)")]
    Dtype(i32),
    #[error("sync kind {0} is not JOIN, UPDATE or FINAL")]
    Kind(i32),
    #[error("model config is not valid JSON: {0}")]
    Config(String),
    #[error("model config {got} is not the run's {expected} (--model-config)")]
    ConfigMismatch { expected: String, got: String },
}

/// One tensor of the center, in f32, with its outer optimizer state.
///
/// Each buffer is shared (`Arc`): a snapshot for a save or a reply clones
/// the pointers under the lock, not the values (12 bytes per parameter:
/// 12.6 GB for a 1B-parameter drafter), and an update copies a buffer only
/// while such a snapshot still holds it ([`Arc::make_mut`]).
#[derive(Debug, Clone)]
pub struct CenterTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Arc<Vec<f32>>,
    /// Nesterov velocity (empty when the momentum is 0).
    pub velocity: Arc<Vec<f32>>,
    /// Sum of the deltas since the last momentum step (empty likewise).
    pub delta_sum: Arc<Vec<f32>>,
}

/// The run's shared weights.
#[derive(Debug, Clone)]
pub struct Center {
    /// Sorted by name (the checkpoint order).
    pub tensors: Vec<CenterTensor>,
    pub by_name: HashMap<String, usize>,
    /// The draft model's `config.json`, as the first drafter sent it.
    pub config_json: String,
    /// Bumped by every applied delta.
    pub version: u64,
    /// Deltas in `delta_sum` not yet folded into the velocity.
    pub pending_deltas: u32,
    pub samples: u64,
    pub updates_applied: u64,
    pub updates_discarded: u64,
}

impl Center {
    pub fn new(
        config_json: String,
        mut tensors: Vec<CenterTensor>,
        version: u64,
    ) -> Result<Self, SyncError> {
        serde_json::from_str::<serde_json::Value>(&config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        tensors.sort_by(|left, right| left.name.cmp(&right.name));
        // The run's one model is finite by construction: no JOIN and no
        // checkpoint may make it otherwise.
        for tensor in &tensors {
            let buffers = [
                ("weights", &tensor.values),
                ("outer velocity", &tensor.velocity),
                ("outer delta sum", &tensor.delta_sum),
            ];
            for (what, values) in buffers {
                if let Some(index) = values.iter().position(|value| !value.is_finite()) {
                    return Err(SyncError::BadTensor {
                        name: tensor.name.clone(),
                        detail: format!(
                            "{what} are not finite ({} at element {index}): refused as the run's model",
                            values[index]
                        ),
                    });
                }
            }
        }
        let mut by_name = HashMap::new();
        for (index, tensor) in tensors.iter().enumerate() {
            if by_name.insert(tensor.name.clone(), index).is_some() {
                return Err(SyncError::DuplicateTensor(tensor.name.clone()));
            }
        }
        Ok(Center {
            tensors,
            by_name,
            config_json,
            version,
            pending_deltas: 0,
            samples: 0,
            updates_applied: 0,
            updates_discarded: 0,
        })
    }

    /// The L2 norm of every weight together (one pass; taken when the
    /// center is made or resumed, not per exchange).
    pub fn weights_norm(&self) -> f64 {
        self.tensors
            .iter()
            .flat_map(|tensor| tensor.values.iter())
            .map(|&value| f64::from(value).powi(2))
            .sum::<f64>()
            .sqrt()
    }

    pub fn parameters(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| tensor.values.len() as u64)
            .sum()
    }

    /// Bytes held: weights plus the outer optimizer's buffers.
    pub fn memory_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| {
                4 * (tensor.values.len() + tensor.velocity.len() + tensor.delta_sum.len()) as u64
            })
            .sum()
    }
}

/// One center tensor encoded for the wire: name, shape, bytes.
pub type EncodedTensor = (String, Vec<u64>, Bytes);

/// One version of the center's weights (name, shape, shared values), in
/// checkpoint order; see [`ModelSyncState::center_snapshot`].
pub struct CenterSnapshot {
    pub version: u64,
    pub tensors: Vec<(String, Vec<u64>, Arc<Vec<f32>>)>,
}

impl CenterSnapshot {
    /// The weights encoded as `dtype`, one buffer per tensor.
    pub fn encode(self, dtype: WireDtype) -> (u64, Vec<EncodedTensor>) {
        let tensors = self
            .tensors
            .into_iter()
            .map(|(name, shape, values)| (name, shape, Bytes::from(arith::encode(&values, dtype))))
            .collect();
        (self.version, tensors)
    }
}

/// What kind of exchange a drafter began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    Join,
    Update,
    Final,
}

impl ExchangeKind {
    pub fn from_proto(value: i32) -> Result<Self, SyncError> {
        match proto::SyncKind::try_from(value) {
            Ok(proto::SyncKind::Join) => Ok(ExchangeKind::Join),
            Ok(proto::SyncKind::Update) => Ok(ExchangeKind::Update),
            Ok(proto::SyncKind::Final) => Ok(ExchangeKind::Final),
            _ => Err(SyncError::Kind(value)),
        }
    }
}

pub fn dtype_from_proto(value: i32) -> Result<WireDtype, SyncError> {
    match proto::Dtype::try_from(value) {
        Ok(proto::Dtype::F32) => Ok(WireDtype::F32),
        Ok(proto::Dtype::Bf16) => Ok(WireDtype::Bf16),
        _ => Err(SyncError::Dtype(value)),
    }
}

pub fn dtype_to_proto(dtype: WireDtype) -> proto::Dtype {
    match dtype {
        WireDtype::F32 => proto::Dtype::F32,
        WireDtype::Bf16 => proto::Dtype::Bf16,
    }
}

/// One tensor of an exchange being received: its chunks, unchanged.
#[derive(Debug)]
pub struct UploadedTensor {
    pub name: String,
    pub dtype: WireDtype,
    pub shape: Vec<u64>,
    /// Chunks in offset order; together exactly the tensor's bytes at commit.
    pub chunks: Vec<Bytes>,
    pub received_bytes: u64,
}

impl UploadedTensor {
    fn expected_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.element_bytes() as u64
    }

    /// Calls `apply` on each chunk, in order, with the range of the
    /// tensor's elements it holds; an error `apply` returns names this
    /// tensor.
    fn for_each_chunk(
        &self,
        mut apply: impl FnMut(std::ops::Range<usize>, &Bytes) -> Result<(), arith::LengthMismatch>,
    ) -> Result<(), SyncError> {
        let mut element_offset = 0usize;
        for chunk in &self.chunks {
            let elements = chunk.len() / self.dtype.element_bytes();
            apply(element_offset..element_offset + elements, chunk).map_err(|error| {
                SyncError::BadTensor {
                    name: self.name.clone(),
                    detail: error.to_string(),
                }
            })?;
            element_offset += elements;
        }
        Ok(())
    }

    /// Checks that `chunk` continues this tensor exactly: the same dtype and
    /// shape as its first chunk, at the next offset, whole elements, and not
    /// past the tensor's end.
    fn check_continued_by(
        &self,
        chunk: &proto::TensorChunk,
        dtype: WireDtype,
    ) -> Result<(), SyncError> {
        if self.dtype != dtype || self.shape != chunk.shape {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk says {} {:?}, the tensor's first chunk said {} {:?}",
                    dtype.name(),
                    chunk.shape,
                    self.dtype.name(),
                    self.shape
                ),
            ));
        }
        if chunk.offset != self.received_bytes {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk at offset {}, expected {}",
                    chunk.offset, self.received_bytes
                ),
            ));
        }
        let element_bytes = dtype.element_bytes() as u64;
        let length = chunk.data.len() as u64;
        if !length.is_multiple_of(element_bytes) {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk of {length} bytes is not a whole number of {} elements",
                    dtype.name()
                ),
            ));
        }
        if self.received_bytes + length > self.expected_bytes() {
            return Err(bad_chunk(
                chunk,
                format!(
                    "{} bytes received, more than the {} of {} {:?}",
                    self.received_bytes + length,
                    self.expected_bytes(),
                    dtype.name(),
                    self.shape
                ),
            ));
        }
        Ok(())
    }
}

/// A [`SyncError::BadTensor`] naming `chunk`'s tensor.
fn bad_chunk(chunk: &proto::TensorChunk, detail: String) -> SyncError {
    SyncError::BadTensor {
        name: chunk.name.clone(),
        detail,
    }
}

/// An exchange being received on one session.
#[derive(Debug)]
pub struct Upload {
    pub kind: ExchangeKind,
    pub base_version: u64,
    pub steps: u64,
    pub samples: u64,
    pub reply_dtype: WireDtype,
    pub tensors: Vec<UploadedTensor>,
    /// [`Upload::norm`], when taken before the commit (outside the lock).
    pub measured_norm: Option<f64>,
    /// Items the broker has seen this drafter ack or lease (its in-flight
    /// acks), when known: the samples it may be credited with in all (a
    /// claim beyond is cut to it).
    pub acked_by_drafter: Option<u64>,
}

impl Upload {
    /// Takes [`Upload::norm`] now, so the commit under the lock need not.
    pub fn measure_norm(&mut self) {
        self.measured_norm = Some(self.norm());
    }

    /// The L2 norm of every tensor's values together (NaN or infinity when
    /// any value is not finite); computed outside the center's lock.
    pub fn norm(&self) -> f64 {
        self.tensors
            .iter()
            .flat_map(|tensor| {
                tensor
                    .chunks
                    .iter()
                    .map(|chunk| arith::squared_sum(chunk, tensor.dtype))
            })
            .sum::<f64>()
            .sqrt()
    }
}

impl Upload {
    pub fn new(begin: &proto::SyncBegin) -> Result<Self, SyncError> {
        let reply_dtype = match begin.reply_dtype {
            0 => WireDtype::F32,
            other => dtype_from_proto(other)?,
        };
        Ok(Upload {
            kind: ExchangeKind::from_proto(begin.kind)?,
            base_version: begin.base_version,
            steps: begin.steps,
            samples: begin.samples,
            reply_dtype,
            tensors: Vec::new(),
            measured_norm: None,
            acked_by_drafter: None,
        })
    }

    /// Adds one chunk after checking it continues its tensor exactly.
    pub fn add_chunk(&mut self, chunk: proto::TensorChunk) -> Result<(), SyncError> {
        let dtype = dtype_from_proto(chunk.dtype)?;
        let continues_last = self
            .tensors
            .last()
            .is_some_and(|last| last.name == chunk.name);
        if !continues_last {
            self.begin_tensor(&chunk, dtype)?;
        }
        let Some(tensor) = self.tensors.last_mut() else {
            return Err(bad_chunk(&chunk, "no tensor".to_string()));
        };
        tensor.check_continued_by(&chunk, dtype)?;
        tensor.received_bytes += chunk.data.len() as u64;
        tensor.chunks.push(chunk.data);
        Ok(())
    }

    /// Starts a new tensor with `chunk`, its first: the chunk is at offset 0,
    /// the name is new, the tensor before it is complete, and the shape is
    /// valid.
    fn begin_tensor(
        &mut self,
        chunk: &proto::TensorChunk,
        dtype: WireDtype,
    ) -> Result<(), SyncError> {
        if chunk.offset != 0 {
            return Err(bad_chunk(
                chunk,
                format!("first chunk at offset {}, expected 0", chunk.offset),
            ));
        }
        if self.tensors.iter().any(|tensor| tensor.name == chunk.name) {
            return Err(SyncError::DuplicateTensor(chunk.name.clone()));
        }
        if let Some(last) = self.tensors.last() {
            if last.received_bytes != last.expected_bytes() {
                return Err(SyncError::BadTensor {
                    name: last.name.clone(),
                    detail: format!(
                        "{} of {} bytes before the next tensor began",
                        last.received_bytes,
                        last.expected_bytes()
                    ),
                });
            }
        }
        let elements = chunk
            .shape
            .iter()
            .try_fold(1u64, |product, &dim| product.checked_mul(dim));
        if elements.is_none() || chunk.shape.is_empty() {
            return Err(bad_chunk(chunk, format!("invalid shape {:?}", chunk.shape)));
        }
        self.tensors.push(UploadedTensor {
            name: chunk.name.clone(),
            dtype,
            shape: chunk.shape.clone(),
            chunks: Vec::new(),
            received_bytes: 0,
        });
        Ok(())
    }

    /// Every tensor is complete and their number is the declared one.
    fn check_complete(&self, declared: u32) -> Result<(), SyncError> {
        if self.tensors.len() != declared as usize {
            return Err(SyncError::CountMismatch {
                sent: self.tensors.len(),
                declared,
            });
        }
        for tensor in &self.tensors {
            if tensor.received_bytes != tensor.expected_bytes() {
                return Err(SyncError::BadTensor {
                    name: tensor.name.clone(),
                    detail: format!(
                        "{} of {} bytes received",
                        tensor.received_bytes,
                        tensor.expected_bytes()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// What a committed exchange did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOutcome {
    pub center_version: u64,
    pub staleness: u64,
    pub applied: bool,
    /// Why a delta was not applied ("" when it was or for a JOIN).
    pub reason: String,
    pub initialised: bool,
    /// The drafter gets the center back (JOIN and UPDATE).
    pub send_center: bool,
    pub center_samples: u64,
}

/// One drafter as the center knows it (by drafter id, across sessions).
#[derive(Debug, Clone, Default)]
pub struct DrafterRecord {
    pub open_sessions: u32,
    pub last_sync: Option<Instant>,
    pub base_version: u64,
    pub last_update_staleness: u64,
    pub updates_applied: u64,
    pub updates_discarded: u64,
    /// Its FINAL exchange arrived (cleared by a later JOIN).
    pub finished: bool,
    pub samples: u64,
}

/// The center (once initialised), the outer optimizer and the drafters.
#[derive(Debug)]
pub struct ModelSyncState {
    settings: OuterSettings,
    center: Option<Center>,
    /// Norms of the last applied deltas (the norm bound's reference); starts
    /// empty after a restart, so the bound waits for its warm-up again.
    recent_delta_norms: std::collections::VecDeque<f64>,
    /// The L2 norm of the center's weights when it was made or resumed:
    /// the scale below which no delta is an outlier (see [`refuse_delta`]).
    weights_norm_at_start: Option<f64>,
    /// `--model-config`: the one `config.json` every JOIN must carry.
    pinned_config: Option<serde_json::Value>,
    /// Deltas refused as not finite, and as over the norm bound.
    pub non_finite_deltas: u64,
    pub outlier_deltas: u64,
    drafters: BTreeMap<String, DrafterRecord>,
    /// The newest version written to disk, where, and whether as final.
    pub saved_version: Option<u64>,
    pub saved_path: String,
    pub final_saved: bool,
}

impl ModelSyncState {
    pub fn new(settings: OuterSettings, center: Option<Center>) -> Self {
        ModelSyncState {
            settings,
            weights_norm_at_start: center.as_ref().map(Center::weights_norm),
            center,
            recent_delta_norms: std::collections::VecDeque::with_capacity(DELTA_NORM_WINDOW),
            pinned_config: None,
            non_finite_deltas: 0,
            outlier_deltas: 0,
            drafters: BTreeMap::new(),
            saved_version: None,
            saved_path: String::new(),
            final_saved: false,
        }
    }

    pub fn settings(&self) -> OuterSettings {
        self.settings
    }

    /// Fixes the run's model: every JOIN (the first one, which defines an
    /// empty center, included) must carry this `config.json` (compared as
    /// JSON values), so no drafter can make the center another model.
    pub fn pin_config(&mut self, config_json: &str) -> Result<(), SyncError> {
        let value = serde_json::from_str::<serde_json::Value>(config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        self.pinned_config = Some(value);
        // A center resumed from --model-output must be that model too.
        match &self.center {
            Some(center) => {
                let resumed = center.config_json.clone();
                self.check_pinned_config(&resumed)
            }
            None => Ok(()),
        }
    }

    fn check_pinned_config(&self, model_config_json: &str) -> Result<(), SyncError> {
        let Some(expected) = &self.pinned_config else {
            return Ok(());
        };
        let got = serde_json::from_str::<serde_json::Value>(model_config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        if &got == expected {
            return Ok(());
        }
        let short = |value: &serde_json::Value| {
            let text = value.to_string();
            match text.char_indices().nth(300) {
                Some((end, _)) => format!("{}...", &text[..end]),
                None => text,
            }
        };
        Err(SyncError::ConfigMismatch {
            expected: short(expected),
            got: short(&got),
        })
    }

    pub fn center(&self) -> Option<&Center> {
        self.center.as_ref()
    }

    pub fn version(&self) -> Option<u64> {
        self.center.as_ref().map(|center| center.version)
    }

    pub fn drafter(&self, drafter_id: &str) -> Option<&DrafterRecord> {
        self.drafters.get(drafter_id)
    }

    pub fn open_session(&mut self, drafter_id: &str) {
        self.drafters
            .entry(drafter_id.to_string())
            .or_default()
            .open_sessions += 1;
    }

    pub fn close_session(&mut self, drafter_id: &str) {
        if let Some(record) = self.drafters.get_mut(drafter_id) {
            record.open_sessions = record.open_sessions.saturating_sub(1);
        }
    }

    /// Drafters with an open session that have not sent their FINAL
    /// exchange: the final center waits for them (bounded).
    pub fn awaiting_final(&self) -> Vec<String> {
        self.drafters
            .iter()
            .filter(|(_, record)| record.open_sessions > 0 && !record.finished)
            .map(|(drafter_id, _)| drafter_id.clone())
            .collect()
    }

    /// Applies a complete exchange. Nothing changes when it is refused.
    pub fn commit(
        &mut self,
        drafter_id: &str,
        upload: Upload,
        declared_tensors: u32,
        model_config_json: &str,
        now: Instant,
    ) -> Result<CommitOutcome, SyncError> {
        upload.check_complete(declared_tensors)?;
        let kind = upload.kind;
        let carried_delta = !upload.tensors.is_empty();
        let mut upload = upload;
        // The samples a drafter claims never exceed what the broker saw it
        // ack (in all its exchanges): a claim cannot advance the run's
        // schedule. Acks that have not landed yet are credited at the next
        // exchange, when they have.
        if let Some(acked) = upload.acked_by_drafter {
            let credited = self
                .drafters
                .get(drafter_id)
                .map_or(0, |record| record.samples);
            let allowed = acked.saturating_sub(credited);
            if upload.samples > allowed {
                tracing::debug!(
                    drafter_id,
                    claimed = upload.samples,
                    allowed,
                    "samples claimed beyond the drafter's acks; credited up to them"
                );
                upload.samples = allowed;
            }
        }
        let samples = upload.samples;
        let outcome = match upload.kind {
            ExchangeKind::Join => self.join(upload, model_config_json)?,
            // A drafter that stops without a step since its last sync has
            // no delta: it only says it is finished.
            ExchangeKind::Final if upload.tensors.is_empty() => {
                let center = self.center.as_ref().ok_or(SyncError::NoCenter)?;
                CommitOutcome {
                    center_version: center.version,
                    staleness: center.version.saturating_sub(upload.base_version),
                    applied: false,
                    reason: "no delta".to_string(),
                    initialised: false,
                    send_center: false,
                    center_samples: center.samples,
                }
            }
            ExchangeKind::Update | ExchangeKind::Final => {
                let norm = upload.measured_norm.unwrap_or_else(|| upload.norm());
                self.update(drafter_id, &upload, norm)?
            }
        };
        let record = self.drafters.entry(drafter_id.to_string()).or_default();
        record.last_sync = Some(now);
        match kind {
            ExchangeKind::Join => {
                record.finished = false;
                record.base_version = outcome.center_version;
            }
            ExchangeKind::Update => {
                record.base_version = outcome.center_version;
            }
            ExchangeKind::Final => record.finished = true,
        }
        if kind != ExchangeKind::Join && carried_delta {
            record.last_update_staleness = outcome.staleness;
            if outcome.applied {
                record.updates_applied += 1;
                record.samples += samples;
            } else {
                record.updates_discarded += 1;
            }
        }
        Ok(outcome)
    }

    fn join(
        &mut self,
        upload: Upload,
        model_config_json: &str,
    ) -> Result<CommitOutcome, SyncError> {
        self.check_pinned_config(model_config_json)?;
        if let Some(center) = &self.center {
            // The drafter's own weights are not needed: it starts from the
            // center. They must still be the same model when sent.
            for tensor in &upload.tensors {
                check_against_center(center, &tensor.name, &tensor.shape)?;
            }
            return Ok(CommitOutcome {
                center_version: center.version,
                staleness: 0,
                applied: false,
                reason: String::new(),
                initialised: false,
                send_center: true,
                center_samples: center.samples,
            });
        }
        if upload.tensors.is_empty() {
            return Err(SyncError::NoCenter);
        }
        let momentum = self.settings.momentum > 0.0;
        let mut tensors = Vec::with_capacity(upload.tensors.len());
        for uploaded in upload.tensors {
            let elements = uploaded.shape.iter().product::<u64>() as usize;
            let mut values = vec![0.0f32; elements];
            decode_chunks(&mut values, &uploaded)?;
            let optimizer_buffer = || {
                Arc::new(if momentum {
                    vec![0.0; elements]
                } else {
                    Vec::new()
                })
            };
            tensors.push(CenterTensor {
                velocity: optimizer_buffer(),
                delta_sum: optimizer_buffer(),
                name: uploaded.name,
                shape: uploaded.shape,
                values: Arc::new(values),
            });
        }
        let center = Center::new(model_config_json.to_string(), tensors, 0)?;
        let outcome = CommitOutcome {
            center_version: 0,
            staleness: 0,
            applied: false,
            reason: String::new(),
            initialised: true,
            send_center: false,
            center_samples: 0,
        };
        self.weights_norm_at_start = Some(center.weights_norm());
        self.center = Some(center);
        Ok(outcome)
    }

    /// Applies one drafter's delta to the center: checks the upload against
    /// the center, discards it when it is too stale, else adds it (scaled by
    /// the outer learning rate) and takes a momentum step when enough deltas
    /// have come in.
    fn update(
        &mut self,
        drafter_id: &str,
        upload: &Upload,
        norm: f64,
    ) -> Result<CommitOutcome, SyncError> {
        let open_sessions = self
            .drafters
            .values()
            .filter(|record| record.open_sessions > 0)
            .count() as u32;
        let settings = self.settings;
        let center = self.center.as_mut().ok_or(SyncError::NoCenter)?;
        check_upload_against_center(center, upload)?;
        let send_center = upload.kind == ExchangeKind::Update;
        let staleness = center.version - upload.base_version;
        if settings.max_staleness > 0 && staleness > settings.max_staleness {
            center.updates_discarded += 1;
            tracing::info!(
                drafter_id,
                staleness,
                max_staleness = settings.max_staleness,
                "delta discarded as too stale; the drafter restarts from the center"
            );
            return Ok(CommitOutcome {
                center_version: center.version,
                staleness,
                applied: false,
                reason: format!(
                    "staleness {staleness} exceeds the bound {}",
                    settings.max_staleness
                ),
                initialised: false,
                send_center,
                center_samples: center.samples,
            });
        }
        let floor = DELTA_NORM_FLOOR * self.weights_norm_at_start.unwrap_or(0.0);
        if let Some(reason) = refuse_delta(&settings, &self.recent_delta_norms, norm, floor) {
            center.updates_discarded += 1;
            if norm.is_finite() {
                self.outlier_deltas += 1;
            } else {
                self.non_finite_deltas += 1;
            }
            tracing::warn!(drafter_id, norm, %reason, "delta discarded; the drafter restarts from the center");
            return Ok(CommitOutcome {
                center_version: center.version,
                staleness,
                applied: false,
                reason,
                initialised: false,
                send_center,
                center_samples: center.samples,
            });
        }
        if self.recent_delta_norms.len() == DELTA_NORM_WINDOW {
            self.recent_delta_norms.pop_front();
        }
        self.recent_delta_norms.push_back(norm);
        let momentum = settings.momentum > 0.0;
        add_delta(center, upload, settings.learning_rate, momentum)?;
        center.version += 1;
        center.updates_applied += 1;
        center.samples += upload.samples;
        if momentum {
            count_delta_for_momentum(center, &settings, open_sessions);
        }
        Ok(CommitOutcome {
            center_version: center.version,
            staleness,
            applied: true,
            reason: String::new(),
            initialised: false,
            send_center,
            center_samples: center.samples,
        })
    }

    /// The center encoded as `dtype`, one buffer per tensor (name, shape,
    /// bytes), in checkpoint order. Taken under the lock so a reply is one
    /// version, never torn between two.
    pub fn encode_center(&self, dtype: WireDtype) -> Option<(u64, Vec<EncodedTensor>)> {
        self.center_snapshot()
            .map(|snapshot| snapshot.encode(dtype))
    }

    /// The center's weights at this version, sharing their buffers: taken
    /// under the lock (cheap), encoded after it ([`CenterSnapshot::encode`]).
    pub fn center_snapshot(&self) -> Option<CenterSnapshot> {
        let center = self.center.as_ref()?;
        Some(CenterSnapshot {
            version: center.version,
            tensors: center
                .tensors
                .iter()
                .map(|tensor| {
                    (
                        tensor.name.clone(),
                        tensor.shape.clone(),
                        tensor.values.clone(),
                    )
                })
                .collect(),
        })
    }

    /// The status for `GetStatus`.
    pub fn status(&self, now: Instant) -> proto::ModelSyncStatus {
        let version = self.version().unwrap_or(0);
        let drafters = self
            .drafters
            .iter()
            .map(|(drafter_id, record)| proto::DrafterSyncStatus {
                drafter_id: drafter_id.clone(),
                connected: record.open_sessions > 0,
                last_sync_ms_ago: record
                    .last_sync
                    .map_or(0, |at| millis(now.saturating_duration_since(at))),
                base_version: record.base_version,
                staleness: version.saturating_sub(record.base_version),
                last_update_staleness: record.last_update_staleness,
                updates_applied: record.updates_applied,
                updates_discarded: record.updates_discarded,
                finished: record.finished,
                samples: record.samples,
            })
            .collect();
        proto::ModelSyncStatus {
            has_center: self.center.is_some(),
            center_version: version,
            method: self.settings.describe(),
            center_bytes: self.center.as_ref().map_or(0, Center::memory_bytes),
            parameters: self.center.as_ref().map_or(0, Center::parameters),
            updates_applied: self
                .center
                .as_ref()
                .map_or(0, |center| center.updates_applied),
            updates_discarded: self
                .center
                .as_ref()
                .map_or(0, |center| center.updates_discarded),
            center_samples: self.center.as_ref().map_or(0, |center| center.samples),
            saved_version: self.saved_version.unwrap_or(0),
            saved_path: self.saved_path.clone(),
            final_saved: self.final_saved,
            drafters,
            non_finite_deltas: self.non_finite_deltas,
            outlier_deltas: self.outlier_deltas,
        }
    }
}

/// Why a delta of this `norm` must not reach the center, if it must not:
/// a NaN or an infinity in it, or a norm over `max_delta_norm_ratio` times
/// the largest of the recent applied deltas' norms and over `floor` (a
/// small fraction of the weights' own norm, under which a delta is never
/// an outlier: the first deltas of a run, at a warming-up learning rate,
/// can be a hundred times smaller than the next ones).
fn refuse_delta(
    settings: &OuterSettings,
    recent_norms: &std::collections::VecDeque<f64>,
    norm: f64,
    floor: f64,
) -> Option<String> {
    if !norm.is_finite() {
        return Some("the delta holds a NaN or an infinity".to_string());
    }
    let ratio = f64::from(settings.max_delta_norm_ratio);
    if ratio <= 0.0 || recent_norms.len() < DELTA_NORM_WARMUP || norm <= floor {
        return None;
    }
    let largest = recent_norms.iter().copied().fold(0.0, f64::max);
    (norm > ratio * largest).then(|| {
        format!(
            "delta norm {norm:.4e} is over {ratio} x the largest {largest:.4e} of the last {} applied deltas (--max-delta-norm-ratio)",
            recent_norms.len()
        )
    })
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Checks an upload against the center before anything is applied: its base
/// is not from the future, and it holds every tensor of the center exactly
/// once, each with the center's shape.
fn check_upload_against_center(center: &Center, upload: &Upload) -> Result<(), SyncError> {
    if upload.base_version > center.version {
        return Err(SyncError::FutureBase {
            base: upload.base_version,
            center: center.version,
        });
    }
    // Every tensor of the center exactly once, with its shape.
    if upload.tensors.len() != center.tensors.len() {
        let sent: std::collections::HashSet<&str> = upload
            .tensors
            .iter()
            .map(|tensor| tensor.name.as_str())
            .collect();
        for tensor in &center.tensors {
            if !sent.contains(tensor.name.as_str()) {
                return Err(SyncError::MissingTensor(tensor.name.clone()));
            }
        }
    }
    for tensor in &upload.tensors {
        check_against_center(center, &tensor.name, &tensor.shape)?;
    }
    Ok(())
}

/// Adds `learning_rate` times the uploaded delta to the center's values,
/// chunk by chunk, and (with momentum) to each tensor's running delta sum.
fn add_delta(
    center: &mut Center,
    upload: &Upload,
    learning_rate: f32,
    momentum: bool,
) -> Result<(), SyncError> {
    for uploaded in &upload.tensors {
        let index = center.by_name[&uploaded.name];
        let tensor = &mut center.tensors[index];
        // Copies a buffer only while a snapshot (a save in progress) holds it.
        let values = Arc::make_mut(&mut tensor.values);
        let mut delta_sum = momentum.then(|| Arc::make_mut(&mut tensor.delta_sum));
        uploaded.for_each_chunk(|range, chunk| {
            let sum = delta_sum.as_deref_mut().map(|sum| &mut sum[range.clone()]);
            arith::add_scaled(
                &mut values[range],
                sum,
                chunk,
                uploaded.dtype,
                learning_rate,
            )
        })?;
    }
    Ok(())
}

/// Counts one more applied delta towards the delayed Nesterov step, and
/// takes the step once the delay (the setting, or else the number of open
/// sessions) is reached.
fn count_delta_for_momentum(center: &mut Center, settings: &OuterSettings, open_sessions: u32) {
    center.pending_deltas += 1;
    let delay = match settings.momentum_delay {
        0 => open_sessions.max(1),
        delay => delay,
    };
    if center.pending_deltas >= delay {
        let count = center.pending_deltas;
        for tensor in &mut center.tensors {
            arith::delayed_nesterov_step(
                Arc::<Vec<f32>>::make_mut(&mut tensor.values).as_mut_slice(),
                Arc::<Vec<f32>>::make_mut(&mut tensor.velocity).as_mut_slice(),
                Arc::<Vec<f32>>::make_mut(&mut tensor.delta_sum).as_mut_slice(),
                count,
                settings.learning_rate,
                settings.momentum,
            );
        }
        center.pending_deltas = 0;
    }
}

fn check_against_center(center: &Center, name: &str, shape: &[u64]) -> Result<(), SyncError> {
    let index = center
        .by_name
        .get(name)
        .ok_or_else(|| SyncError::UnknownTensor(name.to_string()))?;
    let center_shape = &center.tensors[*index].shape;
    if center_shape.as_slice() != shape {
        return Err(SyncError::ShapeMismatch {
            name: name.to_string(),
            got: shape.to_vec(),
            center: center_shape.clone(),
        });
    }
    Ok(())
}

fn decode_chunks(values: &mut [f32], uploaded: &UploadedTensor) -> Result<(), SyncError> {
    uploaded.for_each_chunk(|range, chunk| {
        arith::decode_into(&mut values[range], chunk, uploaded.dtype)
    })
}
