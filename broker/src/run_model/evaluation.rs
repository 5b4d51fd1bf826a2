//! Online evaluation: the τ history of the model, as a synchronous state
//! machine (no gRPC, no tokio, no clock of its own).
//!
//! An evaluator reads the model with `ReadModel` (a read-only RPC apart
//! from the drafters' sessions: it opens no session, so the final model
//! never waits for it) and later reports that version's τ with
//! `ReportTau`. Between the two the broker keeps the version it served as a
//! [`StoredModel`] whose chunks are the model's own `Bytes` (handles cloned
//! under the lock; a newer snapshot replaces the model's chunks and
//! leaves these alone), so a best τ writes exactly the weights that were
//! evaluated, whatever the model did meanwhile. At most
//! `--max-pending-evaluations` versions are kept (default
//! [`DEFAULT_MAX_PENDING_READS`]): an evaluator on a busy CPU reads versions
//! when they are due and measures them later, in order, and each kept
//! version holds its own copy of the weights once the model moved on.
//!
//! A report is checked before anything changes ([`Evaluations::check`]):
//! a refused report leaves the history, the best and the kept versions as
//! they were.

use std::collections::VecDeque;

use dflash_proto::v1 as proto;

use super::store::StoredModel;
pub use crate::rpc_error::ReportError;

/// Reports kept in memory (and in the status): the last 1,024.
pub const TAU_HISTORY: usize = 1024;

/// Versions served and not yet reported that the broker keeps by default;
/// reading a newer one lets the oldest go.
pub const DEFAULT_MAX_PENDING_READS: u32 = 4;

/// A report that passed every check: what recording it will do.
#[derive(Debug, Clone)]
pub struct CheckedReport {
    pub point: proto::TauPoint,
    /// Its τ beats every earlier report's (strictly: a tie keeps the
    /// earlier version).
    pub best: bool,
    /// The version's weights, to write as the best model.
    pub model: StoredModel,
}

/// The τ history, the best report, and the versions served and not yet
/// reported.
#[derive(Debug)]
pub struct Evaluations {
    pending: VecDeque<StoredModel>,
    /// The most versions `pending` keeps.
    max_pending: usize,
    history: VecDeque<proto::TauPoint>,
    best: Option<proto::TauPoint>,
    /// The version written to the best model's directory, and where.
    best_saved_version: Option<u64>,
    best_path: String,
    reports: u64,
}

impl Default for Evaluations {
    fn default() -> Self {
        Evaluations::new(DEFAULT_MAX_PENDING_READS)
    }
}

impl Evaluations {
    /// An empty history that keeps at most `max_pending` (at least 1)
    /// versions served and not yet reported.
    pub fn new(max_pending: u32) -> Self {
        Evaluations {
            pending: VecDeque::new(),
            max_pending: (max_pending as usize).max(1),
            history: VecDeque::new(),
            best: None,
            best_saved_version: None,
            best_path: String::new(),
            reports: 0,
        }
    }

    /// Keeps `model` (a weights-only copy sharing the buffers, see
    /// [`StoredModel::clone`], buffers shared) as served to an evaluator.
    pub fn served(&mut self, model: StoredModel) {
        if self
            .pending
            .iter()
            .any(|pending| pending.version == model.version)
        {
            return;
        }
        self.pending.push_back(model);
        while self.pending.len() > self.max_pending {
            self.pending.pop_front();
        }
    }

    /// The version `version` as served and kept (its buffers shared), if
    /// it is still kept.
    pub fn kept(&self, version: u64) -> Option<StoredModel> {
        self.pending
            .iter()
            .find(|pending| pending.version == version)
            .cloned()
    }

    /// Checks a report against what was served and reported; changes
    /// nothing.
    pub fn check(&self, point: Option<&proto::TauPoint>) -> Result<CheckedReport, ReportError> {
        let point = point.ok_or(ReportError::MissingPoint)?;
        let tau = point.tau;
        if !tau.is_finite() {
            return Err(ReportError::NotFinite(tau));
        }
        if tau < 1.0 {
            return Err(ReportError::BelowOne(tau));
        }
        if point.prompts == 0 {
            return Err(ReportError::Empty { field: "prompts" });
        }
        if point.verification_steps == 0 {
            return Err(ReportError::Empty {
                field: "verification_steps",
            });
        }
        if !point.eval_seconds.is_finite() || point.eval_seconds < 0.0 {
            return Err(ReportError::BadSeconds(point.eval_seconds));
        }
        let version = point.model_version;
        if let Some(earlier) = self
            .history
            .iter()
            .find(|earlier| earlier.model_version == version)
        {
            return Err(ReportError::AlreadyReported {
                version,
                tau: earlier.tau,
            });
        }
        let model = self
            .pending
            .iter()
            .find(|pending| pending.version == version)
            .ok_or_else(|| ReportError::NotServed {
                version,
                pending: self.pending_versions(),
            })?;
        if let Some(block_size) = block_size(&model.config_json) {
            if tau > block_size as f64 {
                return Err(ReportError::AboveBlockSize { tau, block_size });
            }
        }
        if point.model_samples != model.samples {
            return Err(ReportError::SamplesMismatch {
                version,
                got: point.model_samples,
                served: model.samples,
            });
        }
        Ok(CheckedReport {
            point: point.clone(),
            best: self.best.as_ref().is_none_or(|best| tau > best.tau),
            model: model.clone(),
        })
    }

    /// Records a checked report: into the history (the oldest beyond
    /// [`TAU_HISTORY`] let go), as the best when it is, with where its
    /// weights were written (`best_path`, empty when not written); the
    /// version is no longer kept.
    pub fn record(&mut self, report: CheckedReport, best_path: Option<String>) {
        let version = report.point.model_version;
        self.pending.retain(|pending| pending.version != version);
        if report.best {
            self.best = Some(report.point.clone());
            if let Some(path) = best_path {
                self.best_saved_version = Some(version);
                self.best_path = path;
            }
        }
        if self.history.len() == TAU_HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(report.point);
        self.reports += 1;
    }

    pub fn pending_versions(&self) -> Vec<u64> {
        self.pending.iter().map(|pending| pending.version).collect()
    }

    pub fn best(&self) -> Option<&proto::TauPoint> {
        self.best.as_ref()
    }

    pub fn best_path(&self) -> &str {
        &self.best_path
    }

    pub fn latest(&self) -> Option<&proto::TauPoint> {
        self.history.back()
    }

    /// Reports recorded since the broker started (the history keeps the
    /// last [`TAU_HISTORY`]).
    pub fn reports(&self) -> u64 {
        self.reports
    }

    /// What `/metrics` shows of it.
    pub fn gauges(&self) -> TauGauges {
        TauGauges {
            latest: self.latest().map(|point| (point.model_version, point.tau)),
            best: self.best().map(|point| (point.model_version, point.tau)),
            reports: self.reports,
        }
    }

    /// Fills the status's evaluation fields.
    pub fn fill_status(&self, status: &mut proto::ModelSyncStatus) {
        status.tau_history = self.history.iter().cloned().collect();
        status.best_tau = self.best.clone();
        status.best_path = self.best_path.clone();
        status.best_saved_version = self.best_saved_version.unwrap_or(0);
        status.evaluations_pending = self.pending_versions();
        status.max_pending_evaluations = self.max_pending as u32;
    }
}

/// The evaluation's series in `/metrics`: (model version, τ) of the
/// latest and of the best report, and the reports recorded.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TauGauges {
    pub latest: Option<(u64, f64)>,
    pub best: Option<(u64, f64)>,
    pub reports: u64,
}

/// The draft model's block size from its `config.json` (the largest τ
/// possible), when it states one.
fn block_size(config_json: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(config_json)
        .ok()?
        .get("block_size")?
        .as_u64()
        .filter(|&size| size > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(version: u64, samples: u64, value: f32) -> StoredModel {
        let tensor = ("fc.weight".to_string(), vec![2], vec![value, -value]);
        crate::fuzzing::model_files::stored_model(
            r#"{"block_size": 4}"#,
            &[tensor],
            version,
            samples,
        )
        .unwrap()
    }

    fn point(version: u64, samples: u64, tau: f64) -> proto::TauPoint {
        proto::TauPoint {
            model_version: version,
            model_samples: samples,
            tau,
            prompts: 4,
            generated_tokens: 64,
            verification_steps: 20,
            eval_seconds: 0.5,
            unix_time_ms: 1_700_000_000_000,
            evaluator_id: "evaluator".to_string(),
            read_unix_time_ms: 0,
        }
    }

    fn report(book: &mut Evaluations, point: proto::TauPoint) -> Result<bool, ReportError> {
        let checked = book.check(Some(&point))?;
        let best = checked.best;
        book.record(checked, Some("/runs/model-best".to_string()));
        Ok(best)
    }

    #[test]
    fn only_a_strictly_better_tau_becomes_the_best() {
        let mut book = Evaluations::default();
        for (version, samples) in [(1, 10), (2, 20)] {
            book.served(model(version, samples, 1.0));
        }
        assert_eq!(report(&mut book, point(1, 10, 2.0)), Ok(true));
        assert_eq!(report(&mut book, point(2, 20, 1.5)), Ok(false));
        assert_eq!(book.best().map(|best| best.model_version), Some(1));
        book.served(model(3, 30, 1.0));
        assert_eq!(report(&mut book, point(3, 30, 2.0)), Ok(false), "a tie");
        book.served(model(4, 40, 1.0));
        assert_eq!(report(&mut book, point(4, 40, 2.5)), Ok(true));
        let mut status = proto::ModelSyncStatus::default();
        book.fill_status(&mut status);
        let versions: Vec<u64> = status
            .tau_history
            .iter()
            .map(|point| point.model_version)
            .collect();
        assert_eq!(versions, vec![1, 2, 3, 4]);
        assert_eq!(status.best_saved_version, 4);
        assert_eq!(status.best_tau.map(|best| best.tau), Some(2.5));
        assert!(status.evaluations_pending.is_empty());
    }

    #[test]
    fn bad_reports_are_refused_naming_the_value_and_change_nothing() {
        let mut book = Evaluations::default();
        book.served(model(5, 50, 1.0));
        assert_eq!(report(&mut book, point(5, 50, 2.0)), Ok(true));
        book.served(model(6, 60, 1.0));
        let mut no_prompts = point(6, 60, 3.0);
        no_prompts.prompts = 0;
        let mut bad_seconds = point(6, 60, 3.0);
        bad_seconds.eval_seconds = f64::NAN;
        let cases: Vec<(Option<proto::TauPoint>, &str)> = vec![
            (None, "no point"),
            (Some(point(6, 60, f64::NAN)), "τ NaN is not finite"),
            (Some(point(6, 60, f64::INFINITY)), "τ inf is not finite"),
            (Some(point(6, 60, 0.5)), "τ 0.5 is below 1"),
            (
                Some(point(6, 60, 4.5)),
                "τ 4.5 exceeds the drafter's block size 4",
            ),
            (Some(no_prompts), "prompts is 0"),
            (Some(bad_seconds), "eval_seconds NaN"),
            (Some(point(7, 70, 3.0)), "model version 7 was not served"),
            (
                Some(point(5, 50, 3.0)),
                "model version 5 is already reported (τ 2)",
            ),
            (
                Some(point(6, 61, 3.0)),
                "model_samples 61 is not the served version 6's 60",
            ),
        ];
        let before = format!("{book:?}");
        for (point, expected) in cases {
            let error = book.check(point.as_ref()).unwrap_err().to_string();
            assert!(error.contains(expected), "{error:?} lacks {expected:?}");
        }
        assert_eq!(format!("{book:?}"), before);
        assert_eq!(report(&mut book, point(6, 60, 3.0)), Ok(true));
    }

    #[test]
    fn history_and_kept_versions_are_bounded() {
        let mut book = Evaluations::default();
        for version in 0..(TAU_HISTORY as u64 + 10) {
            book.served(model(version, version, 1.0));
            report(
                &mut book,
                point(version, version, 1.0 + version as f64 / 1e4),
            )
            .unwrap();
        }
        let mut status = proto::ModelSyncStatus::default();
        book.fill_status(&mut status);
        assert_eq!(status.tau_history.len(), TAU_HISTORY);
        assert_eq!(status.tau_history[0].model_version, 10);
        assert_eq!(book.reports(), TAU_HISTORY as u64 + 10);
        for version in 0..6 {
            book.served(model(10_000 + version, 0, 1.0));
        }
        assert_eq!(
            book.pending_versions(),
            vec![10_002, 10_003, 10_004, 10_005],
            "the default keeps {DEFAULT_MAX_PENDING_READS}"
        );
        let mut one = Evaluations::new(1);
        for version in 0..3 {
            one.served(model(version, 0, 1.0));
        }
        assert_eq!(one.pending_versions(), vec![2]);
        let error = book.check(Some(&point(10_000, 0, 2.0))).unwrap_err();
        assert!(matches!(
            error,
            ReportError::NotServed {
                version: 10_000,
                ..
            }
        ));
    }
}
