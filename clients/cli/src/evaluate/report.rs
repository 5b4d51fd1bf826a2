//! What the evaluator measured: its points and the broker's best.

use dflash_proto::v1 as proto;
use serde::Serialize;

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
/// broker made it the best so far (and wrote it to `model-best/`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Point {
    #[serde(flatten)]
    pub point: proto::TauPoint,
    pub best: bool,
}
