//! The device side of the pipeline: a compute thread that owns the model
//! (or the synthetic generator) and a host-copy thread that turns device
//! tensors into wire samples.
//!
//! ```text
//! reader thread ──PlannedBatch──▶ compute thread ──ComputedBatch──▶ host-copy thread ──ReadyBatch──▶ async sender
//!   (tokenize)       (bounded)     (forward)          (bounded)     (D2H, slice)        (bounded)   (gRPC)
//! ```
//!
//! The compute thread hands each finished batch over and starts the next
//! forward at once; the copy to host memory, the slicing into per-sample
//! payloads and the network send happen on other threads meanwhile. Every
//! channel is bounded, so a slow broker holds the device back instead of
//! growing memory.

use crate::batching::PlannedBatch;
use crate::capture::{Capture, CaptureError};
use crate::metrics::TargetMetrics;
use crate::settings::{NonFiniteAction, SyntheticSpec};
use bytes::Bytes;
use dflash_model::target_model::TargetModel;
use dflash_proto::v1::{Dtype, Item};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};
use tokio_util::sync::CancellationToken;

/// Errors of the compute and host-copy threads.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    #[error(transparent)]
    Model(#[from] dflash_model::ModelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Invalid(String),
    #[error("seq {seq}: the captured hidden states hold {count} non-finite values (NaN or infinity); not sent (--on-non-finite fail)")]
    NonFinite { seq: u64, count: u64 },
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// What produces hidden states.
pub enum Backend {
    Target {
        model: Box<TargetModel>,
        layer_ids: Vec<usize>,
    },
    Synthetic(SyntheticBackend),
}

/// Shape facts of the backend, known once it is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// Width of one token's hidden_states row: captured layers × hidden.
    pub hidden_width: usize,
    pub layer_ids: Vec<usize>,
    pub vocab_size: i64,
    /// Shown in stats: `cpu`, `cuda:0`, `synthetic`.
    pub device_label: String,
}

impl Backend {
    pub fn info(&self) -> BackendInfo {
        match self {
            Backend::Target {
                model, layer_ids, ..
            } => BackendInfo {
                hidden_width: layer_ids.len() * model.config().hidden_size as usize,
                layer_ids: layer_ids.clone(),
                vocab_size: model.config().vocab_size,
                device_label: dflash_model::device::device_label(model.device()),
            },
            Backend::Synthetic(synthetic) => BackendInfo {
                hidden_width: synthetic.row_width,
                layer_ids: (0..synthetic.spec.layers).collect(),
                vocab_size: synthetic.spec.vocab,
                device_label: "synthetic".to_string(),
            },
        }
    }
}

/// Random bf16 rows of the right width at a set token rate, without a model.
///
/// Rows are copied out of a small pool of random rows generated once at
/// start-up (about as much copying per token as a real target's copy to
/// host), so a load test measures the pipeline rather than a random number
/// generator. The generator is self-contained and leaves libtorch's global
/// seed alone, since a drafter may share the process.
pub struct SyntheticBackend {
    spec: SyntheticSpec,
    row_width: usize,
    /// `pool_rows` random bf16 rows, little endian.
    pool: Vec<u8>,
    pool_rows: usize,
    /// When production started, for the rate limit.
    started: Option<Instant>,
    tokens_produced: u64,
    /// Xorshift state for pool offsets.
    state: u64,
}

/// Upper bound of the synthetic row pool.
const SYNTHETIC_POOL_BYTES: usize = 64 << 20;

impl SyntheticBackend {
    pub fn new(spec: SyntheticSpec) -> Self {
        let row_width = spec.hidden * spec.layers;
        let row_bytes = row_width * 2;
        let pool_rows = (SYNTHETIC_POOL_BYTES / row_bytes.max(1)).clamp(1, 1024);
        let mut state = spec.seed ^ 0x9E37_79B9_7F4A_7C15;
        let mut pool = Vec::with_capacity(pool_rows * row_bytes);
        for _ in 0..pool_rows * row_width {
            state = xorshift(state);
            // Sum of four uniform bytes: roughly normal, mean 0, std ~1.
            let bytes = state.to_le_bytes();
            let sum: f32 = bytes[..4].iter().map(|&byte| f32::from(byte)).sum();
            let value = (sum - 510.0) / 147.0;
            // bf16 is the upper half of the f32 bit pattern.
            pool.extend_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes());
        }
        SyntheticBackend {
            row_width,
            pool,
            pool_rows,
            started: None,
            tokens_produced: 0,
            state,
            spec,
        }
    }

    /// One sample's payload: `rows` consecutive pool rows from a random
    /// offset, wrapping around.
    fn payload(&mut self, rows: usize) -> Bytes {
        self.state = xorshift(self.state);
        let row_bytes = self.row_width * 2;
        let mut row = (self.state % self.pool_rows as u64) as usize;
        let mut payload = Vec::with_capacity(rows * row_bytes);
        let mut remaining = rows;
        while remaining > 0 {
            let take = remaining.min(self.pool_rows - row);
            payload.extend_from_slice(&self.pool[row * row_bytes..(row + take) * row_bytes]);
            remaining -= take;
            row = 0;
        }
        Bytes::from(payload)
    }

    /// Holds the set rate before the next batch: waits until the tokens
    /// produced so far are due (at `tokens_per_second` since the first
    /// batch), or `stop`. The compute thread calls it before it starts the
    /// batch's clock: holding is idle time, not device time, so a target
    /// held to a low rate reports a low busy fraction.
    pub fn hold_rate(&mut self, stop: &CancellationToken) {
        let started = *self.started.get_or_insert_with(Instant::now);
        if self.spec.tokens_per_second <= 0.0 {
            return;
        }
        let due = started
            + Duration::from_secs_f64(self.tokens_produced as f64 / self.spec.tokens_per_second);
        while !stop.is_cancelled() {
            let now = Instant::now();
            if now >= due {
                break;
            }
            std::thread::sleep((due - now).min(Duration::from_millis(50)));
        }
    }

    fn produce(&mut self, batch: &PlannedBatch) -> Vec<Bytes> {
        let payloads = batch
            .samples
            .iter()
            .map(|sample| {
                let payload = self.payload(sample.sequence.input_ids.len());
                if self.spec.nan_at_seq != Some(sample.seq) {
                    return payload;
                }
                // A bf16 NaN (0x7FC0) in the middle of the sample.
                let mut poisoned = payload.to_vec();
                let middle = (poisoned.len() / 2) & !1;
                if poisoned.len() >= 2 {
                    poisoned[middle..middle + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
                }
                Bytes::from(poisoned)
            })
            .collect();
        self.tokens_produced += batch.real_tokens() as u64;
        payloads
    }
}

fn xorshift(mut state: u64) -> u64 {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    state
}

/// Hidden states of a finished batch.
pub enum HiddenStates {
    /// `[B, T, width]` bf16, possibly still on the device.
    Batched(Tensor),
    /// One payload per sample, already on the host.
    PerSample(Vec<Bytes>),
}

/// A batch whose forward has been issued.
pub struct ComputedBatch {
    pub batch: PlannedBatch,
    pub hidden: HiddenStates,
    /// `[B, T, hidden]` bf16 last hidden states after the final norm, when
    /// the run asks for them ([`Capture::last_hidden_states`]).
    pub last_hidden: Option<Tensor>,
    /// When the forward started (for the busy-time estimate).
    pub forward_started: Instant,
    /// The batch's trace span: it ends when the batch reaches host memory.
    pub span: tracing::Span,
    /// W3C context of `span`, carried in every item of the batch.
    pub trace_context: HashMap<String, String>,
}

/// One item ready to send: the `proto::Item` the Produce stream carries,
/// built here once (on the host-copy thread), and its token count for the
/// stats.
#[derive(Debug, Clone)]
pub struct ReadyItem {
    /// seq, sample (the `dflash_proto::sample` schema) and the W3C trace
    /// context of the batch that made it (empty without tracing).
    pub item: Item,
    pub tokens: u64,
}

/// Counters shared by the threads and read by the stats reporter.
#[derive(Debug, Default)]
pub struct PipelineCounters {
    /// Real (non-padding) tokens whose hidden states reached host memory.
    pub tokens_computed: AtomicU64,
    pub samples_computed: AtomicU64,
    /// Estimated nanoseconds the device was busy.
    pub busy_nanos: AtomicU64,
    /// Nanoseconds from the pipeline's epoch to the first forward start.
    pub first_forward_nanos: AtomicU64,
    /// Captures with a NaN or an infinity, never sent (`--on-non-finite skip`).
    pub non_finite_samples: AtomicU64,
}

/// Runs forwards until the input channel closes, the output channel closes
/// or `stop` is cancelled, each capturing what the run asks for (`capture`,
/// from the broker's welcome: known before the first batch).
/// `hang_after_batches` is a test hook: after that many batches the thread
/// stops computing (until `stop`), as a stuck device call would; always
/// `None` in a build without the cargo feature `test-hooks`
/// ([`crate::test_hooks`]).
pub fn run_compute_thread(
    mut backend: Backend,
    capture: Capture,
    mut batches: tokio::sync::mpsc::Receiver<PlannedBatch>,
    computed: tokio::sync::mpsc::Sender<ComputedBatch>,
    stop: CancellationToken,
    hang_after_batches: Option<u64>,
) -> Result<(), ComputeError> {
    let _no_grad = tch::no_grad_guard();
    let mut batches_done = 0u64;
    while let Some(batch) = batches.blocking_recv() {
        if stop.is_cancelled() {
            break;
        }
        if hang_after_batches.is_some_and(|limit| batches_done >= limit) {
            tracing::warn!(batches_done, "test hook: the compute thread hangs");
            while !stop.is_cancelled() {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            break;
        }
        batches_done += 1;
        let span = tracing::debug_span!(
            target: dflash_telemetry::TRACE_TARGET,
            "target.batch",
            samples = batch.samples.len(),
            tokens = batch.real_tokens(),
            padded_length = batch.padded_length(),
            first_seq = batch.samples.first().map(|sample| sample.seq),
        );
        let trace_context = dflash_telemetry::inject_context_of(&span);
        if let Backend::Synthetic(synthetic) = &mut backend {
            synthetic.hold_rate(&stop);
        }
        let forward_started = Instant::now();
        let (hidden, last_hidden) = {
            let _entered = span.enter();
            match &mut backend {
                Backend::Target { model, layer_ids } => {
                    let (hidden, last_hidden) =
                        forward(model, layer_ids, capture.last_hidden_states, &batch)?;
                    (HiddenStates::Batched(hidden), last_hidden)
                }
                Backend::Synthetic(_) if capture.last_hidden_states => {
                    return Err(CaptureError::SyntheticLastHiddenStates.into());
                }
                Backend::Synthetic(synthetic) => {
                    (HiddenStates::PerSample(synthetic.produce(&batch)), None)
                }
            }
        };
        let item = ComputedBatch {
            batch,
            hidden,
            last_hidden,
            forward_started,
            span,
            trace_context,
        };
        if computed.blocking_send(item).is_err() {
            break;
        }
    }
    Ok(())
}

/// Pads a batch, runs the capture and returns bf16 `[B, T, width]` on the
/// device, and with `capture_last` the last hidden states `[B, T, hidden]`.
/// Padding uses token id 0 with mask 0.
fn forward(
    model: &TargetModel,
    layer_ids: &[usize],
    capture_last: bool,
    batch: &PlannedBatch,
) -> Result<(Tensor, Option<Tensor>), ComputeError> {
    let rows = batch.samples.len();
    let length = batch.padded_length();
    let mut ids = vec![0i64; rows * length];
    let mut mask = vec![0i64; rows * length];
    for (row, sample) in batch.samples.iter().enumerate() {
        let tokens = &sample.sequence.input_ids;
        ids[row * length..row * length + tokens.len()].copy_from_slice(tokens);
        mask[row * length..row * length + tokens.len()].fill(1);
    }
    let shape = [rows as i64, length as i64];
    let input_ids = Tensor::from_slice(&ids)
        .view(shape)
        .to_device(model.device());
    let attention_mask = Tensor::from_slice(&mask)
        .view(shape)
        .to_device(model.device());
    if capture_last {
        let (hidden, last) =
            model.capture_hidden_states_and_last(&input_ids, &attention_mask, layer_ids)?;
        return Ok((
            hidden.f_to_kind(Kind::BFloat16)?,
            Some(last.f_to_kind(Kind::BFloat16)?),
        ));
    }
    let hidden = model.capture_hidden_states(&input_ids, &attention_mask, layer_ids)?;
    Ok((hidden.f_to_kind(Kind::BFloat16)?, None))
}

/// Copies finished batches to host memory, cuts them into samples and hands
/// them to the async sender. Also keeps the device busy-time estimate: a
/// batch's device work ends when its copy to host completes, and starts at
/// its forward start or the end of the previous batch, whichever is later;
/// that time is also `metrics.batch_seconds`. On CUDA it reads the GPU's
/// memory after each batch (`gpu_memory`) into the memory gauges.
pub fn run_host_copy_thread(
    mut computed: tokio::sync::mpsc::Receiver<ComputedBatch>,
    ready: tokio::sync::mpsc::Sender<Vec<ReadyItem>>,
    counters: Arc<PipelineCounters>,
    metrics: TargetMetrics,
    gpu_memory: Option<Arc<dflash_device::GpuMemoryMonitor>>,
    epoch: Instant,
    on_non_finite: NonFiniteAction,
) -> Result<(), ComputeError> {
    let mut previous_done: Option<Instant> = None;
    while let Some(item) = computed.blocking_recv() {
        let ComputedBatch {
            batch,
            hidden,
            last_hidden,
            forward_started,
            span,
            trace_context,
        } = item;
        let payloads = match hidden {
            HiddenStates::PerSample(payloads) => payloads,
            HiddenStates::Batched(tensor) => split_batch(&tensor, &batch)?,
        };
        let mut last_payloads = match &last_hidden {
            Some(tensor) => Some(split_batch(tensor, &batch)?.into_iter()),
            None => None,
        };
        let done = Instant::now();
        let busy_from =
            previous_done.map_or(forward_started, |previous| previous.max(forward_started));
        previous_done = Some(done);
        if counters.samples_computed.load(Ordering::Relaxed) == 0 {
            let nanos = forward_started.saturating_duration_since(epoch).as_nanos() as u64;
            counters.first_forward_nanos.store(nanos, Ordering::Relaxed);
        }
        let device_time = done.saturating_duration_since(busy_from);
        counters
            .busy_nanos
            .fetch_add(device_time.as_nanos() as u64, Ordering::Relaxed);
        metrics.batch_seconds.set(device_time.as_secs_f64());
        metrics.batches.increment();
        if let Some(reading) = gpu_memory.as_ref().and_then(|monitor| monitor.sample()) {
            metrics
                .device_memory
                .set(reading.used_bytes, reading.peak_bytes);
        }
        let mut samples = Vec::with_capacity(batch.samples.len());
        for (sequenced, hidden_payload) in batch.samples.into_iter().zip(payloads) {
            let last_payload = last_payloads.as_mut().and_then(Iterator::next);
            // The fault shows at its source: a NaN or an infinity (a bf16
            // overflow, a faulty device) is never sent to the drafters.
            let non_finite = dflash_proto::sample::non_finite_values(&hidden_payload, Dtype::Bf16)
                .or_else(|| {
                    last_payload.as_ref().and_then(|payload| {
                        dflash_proto::sample::non_finite_values(payload, Dtype::Bf16)
                    })
                });
            let Some(non_finite) = non_finite else {
                samples.push((sequenced, hidden_payload, last_payload));
                continue;
            };
            metrics.non_finite_samples.increment();
            tracing::error!(
                seq = sequenced.seq,
                non_finite_values = non_finite.count,
                action = ?on_non_finite,
                "captured hidden states are not finite; the sample is not sent"
            );
            if on_non_finite == NonFiniteAction::Fail {
                return Err(ComputeError::NonFinite {
                    seq: sequenced.seq,
                    count: non_finite.count,
                });
            }
            counters.non_finite_samples.fetch_add(1, Ordering::Relaxed);
        }
        let items: Vec<ReadyItem> = samples
            .into_iter()
            .map(|(sequenced, hidden_payload, last_payload)| {
                let tokens = sequenced.sequence.input_ids.len();
                let width = (hidden_payload.len() / 2).checked_div(tokens).unwrap_or(0);
                let mut sample = dflash_proto::sample::encode(
                    &sequenced.sequence.input_ids,
                    &sequenced.sequence.loss_mask,
                    hidden_payload,
                    Dtype::Bf16,
                    width as u64,
                );
                if let Some(last_payload) = last_payload {
                    let last_width = (last_payload.len() / 2).checked_div(tokens).unwrap_or(0);
                    dflash_proto::sample::push_last_hidden_states(
                        &mut sample,
                        last_payload,
                        Dtype::Bf16,
                        last_width as u64,
                    );
                }
                ReadyItem {
                    item: Item {
                        seq: sequenced.seq,
                        sample: Some(sample),
                        trace_context: trace_context.clone(),
                    },
                    tokens: tokens as u64,
                }
            })
            .collect();
        drop(span);
        counters.tokens_computed.fetch_add(
            items.iter().map(|ready| ready.tokens).sum(),
            Ordering::Relaxed,
        );
        counters
            .samples_computed
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        if ready.blocking_send(items).is_err() {
            break;
        }
    }
    Ok(())
}

/// One host copy of the whole padded batch, then zero-copy slices: row `b`'s
/// first `len_b` tokens are contiguous in `[B, T, width]`.
fn split_batch(tensor: &Tensor, batch: &PlannedBatch) -> Result<Vec<Bytes>, ComputeError> {
    let host = tensor.f_to_device(Device::Cpu)?.f_contiguous()?;
    let size = host.size();
    let [rows, length, width] = size[..] else {
        return Err(ComputeError::Invalid(format!(
            "hidden states have shape {size:?}, expected [B, T, width]"
        )));
    };
    if rows as usize != batch.samples.len() {
        return Err(ComputeError::Invalid(format!(
            "hidden states have {rows} rows for {} samples",
            batch.samples.len()
        )));
    }
    let element_count = (rows * length * width) as usize;
    let mut buffer = vec![0u8; element_count * 2];
    host.f_copy_data_u8(&mut buffer, element_count)?;
    let buffer = Bytes::from(buffer);
    let row_bytes = (length * width * 2) as usize;
    let token_bytes = (width * 2) as usize;
    Ok(batch
        .samples
        .iter()
        .enumerate()
        .map(|(row, sample)| {
            let start = row * row_bytes;
            buffer.slice(start..start + sample.sequence.input_ids.len() * token_bytes)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::NumberedSequence;
    use dflash_model::chat::TokenizedSequence;

    fn batch_of(lengths: &[usize]) -> PlannedBatch {
        PlannedBatch {
            samples: lengths
                .iter()
                .enumerate()
                .map(|(seq, &length)| NumberedSequence {
                    seq: seq as u64,
                    line_number: seq as u64 + 1,
                    sequence: TokenizedSequence {
                        input_ids: vec![3; length],
                        loss_mask: vec![1; length],
                        truncated: false,
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn split_batch_drops_padding_rows() -> Result<(), ComputeError> {
        // Row r, token t, channel c holds r*100 + t*10 + c.
        let values: Vec<f32> = (0..2)
            .flat_map(|row| {
                (0..3).flat_map(move |token| {
                    (0..2).map(move |channel| (row * 100 + token * 10 + channel) as f32)
                })
            })
            .collect();
        let tensor = Tensor::from_slice(&values)
            .view([2, 3, 2])
            .to_kind(Kind::BFloat16);
        let payloads = split_batch(&tensor, &batch_of(&[3, 1]))?;
        let decode = |bytes: &Bytes| -> Vec<f32> {
            bytes
                .chunks_exact(2)
                .map(|pair| {
                    f32::from_bits((u32::from(u16::from_le_bytes([pair[0], pair[1]]))) << 16)
                })
                .collect()
        };
        assert_eq!(decode(&payloads[0]), vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
        assert_eq!(decode(&payloads[1]), vec![100.0, 101.0]);
        Ok(())
    }

    #[test]
    fn synthetic_rows_have_the_right_size_and_honour_the_rate() {
        let spec = SyntheticSpec {
            hidden: 8,
            layers: 3,
            tokens_per_second: 2000.0,
            ..SyntheticSpec::default()
        };
        let mut backend = SyntheticBackend::new(spec);
        let batch = batch_of(&[50, 20]);
        let started = Instant::now();
        let stop = CancellationToken::new();
        backend.hold_rate(&stop);
        let first = backend.produce(&batch);
        backend.hold_rate(&stop);
        let second = backend.produce(&batch);
        // The 70 tokens made before the second batch are due 35 ms in;
        // before the third, 140 tokens: 70 ms.
        assert!(started.elapsed() >= Duration::from_millis(35));
        backend.hold_rate(&stop);
        assert!(started.elapsed() >= Duration::from_millis(70));
        assert_eq!(first[0].len(), 50 * 24 * 2);
        assert_eq!(second[1].len(), 20 * 24 * 2);
        assert_eq!(backend.row_width, 24);
    }
}
