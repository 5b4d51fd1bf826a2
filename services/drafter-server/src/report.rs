//! [`DrafterReport`]: what a drafter-server did, and [`RunEnd`], how its
//! run ended.

use std::path::PathBuf;

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// The broker sent end-of-stream COMPLETE.
    Complete,
    /// The broker sent end-of-stream ABORTED (the process should exit non-zero).
    Aborted { reason: String },
    /// The shutdown token fired (SIGTERM): step finished, checkpoint written,
    /// unused deliveries handed back.
    Shutdown,
}

/// What a drafter-server did.
#[derive(Debug, Clone)]
pub struct DrafterReport {
    pub drafter_id: String,
    pub end: RunEnd,
    pub steps: u64,
    pub samples_trained: u64,
    pub tokens_trained: u64,
    /// Deliveries nacked to the dead letters (unusable samples).
    pub dead_lettered: u64,
    /// Deliveries handed back to the queue (failed batches, shutdown).
    pub requeued: u64,
    /// Optimizer steps skipped because their loss or gradient was not
    /// finite or spiked (weights, moments and step count unchanged).
    pub skipped_steps: u64,
    /// Samples dead-lettered because their hidden states held a NaN or an
    /// infinity (also in `dead_lettered`).
    pub non_finite_samples: u64,
    pub final_checkpoint: Option<PathBuf>,
    /// Loss of the first and the last optimizer step of this process.
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub last_accuracy: Option<f64>,
    /// Trained tokens per second from the first delivery to the end.
    pub tokens_per_second: f64,
    /// Compute time over wall time from the first delivery to the end.
    pub busy_fraction: f64,
    pub device: String,
    /// The GPU's peak memory in use after a step (NVML), on CUDA only.
    pub device_memory_peak_bytes: Option<u64>,
}

impl DrafterReport {
    /// How the process exits (the table in `dflash_shell::exit`): done
    /// for COMPLETE and for a graceful stop (everything unused was handed
    /// back, nothing is owed), aborted for ABORTED.
    pub fn exit(&self) -> dflash_shell::Exit {
        match self.end {
            RunEnd::Complete | RunEnd::Shutdown => dflash_shell::Exit::Done,
            RunEnd::Aborted { .. } => dflash_shell::Exit::Aborted,
        }
    }
}
