//! The pipeline's threads, started and joined as one: the compute thread
//! (a `dflash_device::DeviceWorker`, the model loaded behind its start
//! handshake), the reader thread and the host-copy thread. Their work is
//! in [`crate::compute`] and [`crate::reader`]; this module owns their
//! channels and their lifetimes, so every thread is joined within a bound
//! however the run ends.

use crate::batching::PlannedBatch;
use crate::capture::Capture;
use crate::compute::{
    run_compute_thread, Backend, BackendInfo, ComputeError, ComputedBatch, SyntheticBackend,
};
use crate::error::TargetServerError;
use crate::reader::{
    generated_records, BatchReader, ReaderError, ReaderSettings, ReaderSummary, Record, ShardLines,
};
use crate::settings::{ComputeSettings, InputSettings, ModelSource};
use crate::shard::ShardSpec;
use dflash_device::{join_within, DeviceWorker, WorkerChannels, WorkerError};
use dflash_model::chat::ChatEncoder;
use dflash_model::target_model::{build_target_layer_ids, TargetModel};
use std::path::PathBuf;
use std::time::Duration;
use tch::Device;
use tokio_util::sync::CancellationToken;

/// Samples of data kept in flight between threads (batches per channel).
pub(crate) const BATCH_CHANNEL_DEPTH: usize = 2;

/// Loads the backend on the compute thread (CUDA state stays on the thread
/// that uses it) and works out the layer ids.
fn load_backend(config: &ComputeSettings, device: Device) -> Result<Backend, TargetServerError> {
    match &config.model {
        ModelSource::Synthetic(spec) => {
            if config
                .layer_ids
                .as_ref()
                .is_some_and(|ids| ids.len() != spec.layers)
            {
                return Err(TargetServerError::Config(
                    "--layer-ids has a different count than synthetic layers=".to_string(),
                ));
            }
            Ok(Backend::Synthetic(SyntheticBackend::new(spec.clone())))
        }
        ModelSource::Directory(directory) => {
            let kind = dflash_model::device::kind_for(config.dtype, device);
            let model = TargetModel::load(directory, device, kind)?;
            let num_layers = model.config().num_hidden_layers;
            let layer_ids = match &config.layer_ids {
                Some(ids) => ids.clone(),
                None => build_target_layer_ids(num_layers, config.num_draft_layers),
            };
            if layer_ids.is_empty() {
                return Err(TargetServerError::Config(
                    "no layer ids (--layer-ids or --num-draft-layers)".into(),
                ));
            }
            if let Some(bad) = layer_ids.iter().find(|&&id| id >= num_layers) {
                return Err(TargetServerError::Config(format!(
                    "layer id {bad} out of range: {} has {num_layers} layers",
                    directory.display()
                )));
            }
            Ok(Backend::Target {
                model: Box::new(model),
                layer_ids,
            })
        }
    }
}

/// The compute thread as a device worker: its commands are planned batches
/// (sent by the reader thread), its events computed batches (read by the
/// host-copy thread), its handshake what loaded.
pub(crate) type ComputeWorker = DeviceWorker<
    PlannedBatch,
    ComputedBatch,
    Result<BackendInfo, TargetServerError>,
    Result<(), ComputeError>,
>;

/// The threads of one pipeline, owned so they are always joined.
pub(crate) struct PipelineThreads {
    /// Cancelled before the threads are joined: they stop at their next
    /// batch.
    pub(crate) stop: CancellationToken,
    pub(crate) compute: ComputeWorker,
    /// Tells the compute thread what the run captures (the broker's
    /// welcome) once it is known; the thread waits for it after loading the
    /// model and before its first batch. Dropped unsent, the thread ends.
    capture: Option<tokio::sync::oneshot::Sender<Capture>>,
    pub(crate) reader: Option<std::thread::JoinHandle<Result<ReaderSummary, ReaderError>>>,
    pub(crate) host_copy: Option<std::thread::JoinHandle<Result<(), ComputeError>>>,
}

/// How each thread of a pipeline ended.
pub(crate) struct JoinedThreads {
    reader: Option<Result<Result<ReaderSummary, ReaderError>, WorkerError>>,
    host_copy: Option<Result<Result<(), ComputeError>, WorkerError>>,
    compute: Result<Result<(), ComputeError>, WorkerError>,
}

impl PipelineThreads {
    /// Starts the compute thread, which loads the model (CUDA state stays
    /// on the thread that uses it) while the caller talks to the broker.
    pub(crate) fn start(
        config: &ComputeSettings,
        device: Device,
        shutdown: &CancellationToken,
    ) -> Result<Self, TargetServerError> {
        let stop = shutdown.child_token();
        let config = config.clone();
        let compute_stop = stop.clone();
        let (capture_sender, capture_receiver) = tokio::sync::oneshot::channel();
        let channels = WorkerChannels {
            commands: BATCH_CHANNEL_DEPTH,
            events: 1,
        };
        let compute = DeviceWorker::spawn("dflash-compute", channels, move |mut side| {
            let backend = match load_backend(&config, device) {
                Ok(backend) => backend,
                Err(error) => {
                    side.ready(Err(error));
                    return Ok(());
                }
            };
            if !side.ready(Ok(backend.info())) {
                return Ok(());
            }
            // The model loads while the target connects; no batch comes
            // before the welcome has said what the run captures.
            let Ok(capture) = capture_receiver.blocking_recv() else {
                return Ok(());
            };
            let (batches, computed) = side.into_channels();
            run_compute_thread(
                backend,
                capture,
                batches,
                computed,
                compute_stop,
                config.hang_compute_after_batches,
            )
        })?;
        Ok(Self {
            stop,
            compute,
            capture: Some(capture_sender),
            reader: None,
            host_copy: None,
        })
    }

    /// Tells the compute thread what the run captures (the broker's first
    /// welcome): before the reader starts, once. A compute thread that has
    /// already ended reports why when it is joined.
    pub(crate) fn set_capture(&mut self, capture: Capture) {
        if let Some(sender) = self.capture.take() {
            let _ended = sender.send(capture);
        }
    }

    /// Stops and joins every thread, each within `bound`: the reader, the
    /// host copy, then the compute thread.
    pub(crate) async fn join(mut self, bound: Duration) -> JoinedThreads {
        self.stop.cancel();
        // A compute thread still waiting for the run's capture ends.
        drop(self.capture.take());
        let reader = match self.reader {
            Some(reader) => Some(join_within("reader", reader, bound).await),
            None => None,
        };
        let host_copy = match self.host_copy {
            Some(host_copy) => Some(join_within("host-copy", host_copy, bound).await),
            None => None,
        };
        let compute = self.compute.finish(bound).await;
        JoinedThreads {
            reader,
            host_copy,
            compute,
        }
    }
}

impl JoinedThreads {
    /// The first failure among the threads (reader, compute, host copy),
    /// else what the reader read.
    pub(crate) fn into_result(self) -> Result<Option<ReaderSummary>, TargetServerError> {
        let reader = match self.reader {
            Some(result) => Some(result??),
            None => None,
        };
        self.compute??;
        if let Some(result) = self.host_copy {
            result??;
        }
        Ok(reader)
    }
}

pub(crate) fn spawn_named<T: Send + 'static>(
    name: &'static str,
    body: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<T>, WorkerError> {
    std::thread::Builder::new()
        .name(format!("dflash-{name}"))
        .spawn(body)
        .map_err(|source| WorkerError::Spawn {
            name: name.to_string(),
            source,
        })
}

/// Runs `work` on the blocking pool (file reading, tokenizer loading).
pub(crate) async fn blocking<T: Send + 'static>(
    name: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, WorkerError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|_| WorkerError::Panicked {
            name: name.to_string(),
        })
}

/// Starts the reader thread on the shard, past `resume_after_seq`, feeding
/// the compute thread; the tokenizer loads first, on the blocking pool (it
/// can take a second).
pub(crate) async fn spawn_reader(
    input: &InputSettings,
    shard: ShardSpec,
    resume_after_seq: Option<u64>,
    info: &BackendInfo,
    threads: &mut PipelineThreads,
) -> Result<std::thread::JoinHandle<Result<ReaderSummary, ReaderError>>, TargetServerError> {
    let tokenizer_directory = input.tokenizer.clone();
    let max_length = input.max_length;
    let vocab_size = Some(info.vocab_size);
    let encoder = match tokenizer_directory {
        Some(directory) => {
            blocking("tokenizer", move || {
                ChatEncoder::from_directory(&directory, max_length, vocab_size)
            })
            .await??
        }
        None => ChatEncoder::pre_tokenized_only(max_length, vocab_size),
    };
    let settings = ReaderSettings {
        window_size: input.sort_window,
        max_batch_tokens: input.max_batch_tokens,
        resume_after_seq,
        max_bad_lines: input.max_bad_lines,
        data_path: input
            .data
            .clone()
            .unwrap_or_else(|| PathBuf::from("(generated)")),
    };
    let batch_sender = threads.compute.take_command_sender()?;
    let reader_stop = threads.stop.clone();
    let data_path = input.data.clone();
    let synthetic_spec = input.synthetic.clone();
    Ok(spawn_named("reader", move || {
        let records: Box<dyn Iterator<Item = Result<Record, ReaderError>>> =
            match (&data_path, &synthetic_spec) {
                (Some(path), _) => Box::new(ShardLines::open(path, shard)?),
                (None, Some(spec)) => Box::new(generated_records(spec, shard)),
                (None, None) => Box::new(std::iter::empty()),
            };
        let mut reader = BatchReader::new(records, encoder, settings);
        for batch in reader.by_ref() {
            if reader_stop.is_cancelled() || batch_sender.blocking_send(batch?).is_err() {
                break;
            }
        }
        Ok(reader.summary().clone())
    })?)
}
