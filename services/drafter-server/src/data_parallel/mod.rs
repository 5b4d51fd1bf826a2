//! Data parallelism, the default way N drafters train one model: each
//! drafter trains its share of every optimizer step, the members all-reduce
//! their gradients over PyTorch's c10d (Gloo on CPUs; `dflash-collective`),
//! and every member takes the same AdamW step, so weights and optimizer
//! state are identical on every member. The broker is the lighthouse
//! (`Lighthouse.Quorum`, `Lighthouse.Commit`): it decides which drafters take
//! each step, at the run's committed step H only, which member a new or
//! behind one heals from, and whether the step commits. No gradient passes
//! through it.
//!
//! One step, as [`DataParallel::step`] runs it on the training thread:
//! 1. Ask for the quorum (samples ready, the commit the model last applied,
//!    its state checksum, where this drafter's c10d store listens, its
//!    collective timeout). An idle drafter asks too, with no samples
//!    ([`DataParallel::idle`]), so that nobody waits for it.
//! 2. The quorum's process group (kept while its store, prefix, rank and
//!    world size are the same). `heal`: every member takes rank 0's
//!    weights, moments and counts by broadcast, and its commit record; a
//!    member whose state changed by it gives zeros this step (its gradient
//!    was computed on another model).
//! 3. The own share's guard (non-finite, spiking: zeros and the reason);
//!    then the all-reduce of the flat gradient and the step's sums.
//! 4. The reduced step's guard, the same on every member; the vote, which
//!    names the deliveries of the samples in this member's share: the
//!    broker pins them to the step and settles them with the decision
//!    (acked in the record of a commit, returned to the queue by an abort),
//!    so the member acks or nacks none of them itself.
//! 5. The decision, fetched again until the broker answers
//!    ([`decision::verdict`]): COMMIT, every member applies the step and
//!    holds its record; ABORT, nobody applies it; UNKNOWN, this member does
//!    not apply it and is healed to H by its next quorum.
//!
//! A failed collective (a member died or hangs: c10d's timeout) is a no
//! vote; the next quorum forms without a member whose stream is gone, on a
//! new group.
//!
//! # Layout
//! `settings` (the flags), `error`, `link` (the broker calls, bounded, the decision
//! fetched again), `group` (the process group, heal and all-reduce),
//! `decision` (the vote's answer as a pure verdict), and here the step.

mod decision;
mod error;
mod group;
mod link;
mod settings;

use std::time::{Duration, Instant};

use dflash_collective::Store;
use dflash_model::draft::{Contribution, DraftTrainer, Exclusion, SkippedStep, StepReport};
use dflash_proto::v1 as proto;
use tracing::{info, warn};

pub use decision::{verdict, Verdict};
pub use error::DataParallelError;
use group::Membership;
use link::{LighthouseLink, CALL_MARGIN};
pub use settings::DataParallelConfig;

/// What one step came to. In every case but [`StepOutcome::NoQuorum`] the
/// samples the member voted with (its share, unless `excluded`) were
/// settled by the broker: the member neither acks nor nacks them.
pub enum StepOutcome {
    /// Every member applied the step. With `excluded`, this member's own
    /// samples were not in it (they go back to the queue: the member nacks
    /// them) and why.
    Committed {
        report: StepReport,
        excluded: Option<Exclusion>,
    },
    /// Not applied here; `skipped` when the reduced step failed a guard;
    /// `excluded` as for a commit.
    NotCommitted {
        reason: String,
        skipped: Option<SkippedStep>,
        excluded: Option<Exclusion>,
    },
    /// No quorum formed (too few members, or no holder of the run's
    /// committed step asked yet); nothing changed, nothing was settled.
    NoQuorum,
}

/// What data parallelism did, for the report and the log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DataParallelTotals {
    pub steps_committed: u64,
    pub steps_not_committed: u64,
    /// Steps whose outcome this member never learned (it healed after).
    pub steps_unknown: u64,
    pub heals: u64,
    /// Steps this member took part in with zeros (nothing held, a bad
    /// share, or a model healed just before).
    pub zero_contributions: u64,
    pub time_in_quorum: Duration,
    pub time_in_collectives: Duration,
    pub last_world_size: usize,
}

/// One drafter's membership in the run's data-parallel trainer; lives on
/// the training thread.
pub struct DataParallel {
    drafter_id: String,
    config: DataParallelConfig,
    link: LighthouseLink,
    store: Store,
    store_address: String,
    membership: Membership,
    /// The commit this member's model last applied (or healed to).
    committed: proto::CommitRecord,
    rank: usize,
    world_size: usize,
    pub totals: DataParallelTotals,
}

impl DataParallel {
    /// Hosts this drafter's c10d store; `link` is the member's one broker
    /// connection (shared with its run-model link).
    pub fn start(
        runtime: tokio::runtime::Handle,
        link: std::sync::Arc<crate::broker_link::BrokerLink>,
        drafter_id: &str,
        config: &DataParallelConfig,
    ) -> Result<Self, DataParallelError> {
        let store = Store::host(
            &config.collective_host,
            config.collective_port,
            config.collective_timeout,
        )
        .map_err(|source| DataParallelError::Store {
            host: config.collective_host.clone(),
            port: config.collective_port,
            source,
        })?;
        let store_address = format!("{}:{}", config.collective_host, store.port());
        info!(store = %store_address, "data parallelism: c10d store hosted");
        Ok(DataParallel {
            drafter_id: drafter_id.to_string(),
            config: config.clone(),
            link: LighthouseLink::new(runtime, link, config),
            store,
            store_address,
            membership: Membership::default(),
            committed: proto::CommitRecord::default(),
            rank: 0,
            world_size: 1,
            totals: DataParallelTotals::default(),
        })
    }

    /// Members of the last quorum (1 before the first).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether this member was rank 0 of the last quorum.
    pub fn is_rank_zero(&self) -> bool {
        self.rank == 0
    }

    pub fn snapshot_every(&self) -> u64 {
        self.config.snapshot_every
    }

    /// The commit this member's model last applied.
    pub fn committed(&self) -> proto::CommitRecord {
        self.committed
    }

    /// One step with what `trainer` accumulated from `samples` (see the
    /// module doc).
    pub fn step(
        &mut self,
        trainer: &mut DraftTrainer,
        samples: &[proto::StepSample],
    ) -> StepOutcome {
        let ready = trainer.accumulated_samples() as u64;
        let quorum = match self.ask(trainer, ready.max(1), false) {
            Ok(Some(quorum)) => quorum,
            Ok(None) => return StepOutcome::NoQuorum,
            Err(error) => {
                warn!(%error, "data parallelism: quorum call failed; the step's samples stay held");
                // Do not spin against a broker that is away.
                std::thread::sleep(Duration::from_millis(200));
                return StepOutcome::NoQuorum;
            }
        };
        self.take_part(trainer, &quorum, samples)
    }

    /// Nothing held: asks with no samples (the broker holds the call a
    /// moment) and takes part, with zeros, in a step that forms meanwhile.
    pub fn idle(&mut self, trainer: &mut DraftTrainer) -> Option<StepOutcome> {
        match self.ask(trainer, 0, false) {
            Ok(Some(quorum)) => Some(self.take_part(trainer, &quorum, &[])),
            Ok(None) => None,
            Err(error) => {
                warn!(%error, "data parallelism: idle quorum call failed");
                std::thread::sleep(Duration::from_millis(200));
                None
            }
        }
    }

    /// Leaves the membership (the drafter stops): the others stop waiting
    /// for it at once.
    pub fn leave(&mut self, trainer: &DraftTrainer) {
        if let Err(error) = self.ask(trainer, 0, true) {
            warn!(%error, "data parallelism: leaving failed; the broker drops this drafter when its stream ends");
        }
        self.membership.drop_group();
    }

    fn take_part(
        &mut self,
        trainer: &mut DraftTrainer,
        quorum: &proto::QuorumResponse,
        samples: &[proto::StepSample],
    ) -> StepOutcome {
        self.rank = quorum.rank as usize;
        self.world_size = quorum.world_size.max(1) as usize;
        self.totals.last_world_size = self.world_size;
        let started = Instant::now();
        let outcome = self.collective_step(trainer, quorum);
        self.totals.time_in_collectives += started.elapsed();
        let (vote_ok, vote_reason, reduced, excluded) = match outcome {
            Ok((reduced, excluded)) => match reduced {
                Ok(step) => (true, String::new(), Some(Ok(step)), excluded),
                Err(skipped) => (
                    false,
                    format!("reduced step: {skipped}"),
                    Some(Err(skipped)),
                    excluded,
                ),
            },
            Err((reason, excluded)) => {
                // The group may be broken: the next quorum builds one.
                self.membership.drop_group();
                (false, reason, None, excluded)
            }
        };
        // The samples in this member's share of the step: none when it gave
        // zeros (it hands them back itself).
        let voted: Vec<proto::StepSample> = if excluded.is_none() {
            samples.to_vec()
        } else {
            Vec::new()
        };
        // A guard that failed on the reduced step blames the step's
        // samples (a poison batch reaches the dead letters); a failed
        // collective blames nobody's.
        let charge_on_abort = matches!(reduced, Some(Err(_)));
        let vote = proto::CommitVote {
            drafter_id: self.drafter_id.clone(),
            quorum_id: quorum.quorum_id,
            step: quorum.step,
            ok: vote_ok,
            reason: vote_reason.clone(),
            instance: quorum.instance,
            nonce: quorum.nonce,
            samples: voted,
            charge_on_abort,
        };
        let patience = self.config.collective_timeout + CALL_MARGIN * 10;
        let answer = self.link.decide(vote, patience);
        let reduced_ready = matches!(reduced, Some(Ok(_)));
        let skipped = match &reduced {
            Some(Err(skipped)) => Some(skipped.clone()),
            _ => None,
        };
        match (verdict(reduced_ready, answer.as_ref()), reduced) {
            (Verdict::Apply { record }, Some(Ok(step))) => match trainer.apply_reduced(step) {
                Ok(report) => {
                    self.committed = record;
                    self.totals.steps_committed += 1;
                    StepOutcome::Committed { report, excluded }
                }
                Err(error) => {
                    // Cannot happen with the sizes checked at the reduce;
                    // the model now differs: the next quorum heals it.
                    self.totals.steps_not_committed += 1;
                    trainer.discard_accumulation();
                    StepOutcome::NotCommitted {
                        reason: format!("applying the committed step: {error}"),
                        skipped: None,
                        excluded,
                    }
                }
            },
            (verdict, _) => {
                let reason = match verdict {
                    Verdict::Discard { reason, unknown } => {
                        if unknown {
                            self.totals.steps_unknown += 1;
                            warn!(%reason, quorum_id = quorum.quorum_id, step = quorum.step, "data parallelism: this member does not know the step's outcome; it does not apply it and heals to the run's step next");
                        }
                        reason
                    }
                    Verdict::Apply { .. } => {
                        "COMMIT of a step this member could not apply".to_string()
                    }
                };
                self.totals.steps_not_committed += 1;
                trainer.discard_accumulation();
                let reason = if reason.is_empty() {
                    vote_reason
                } else {
                    reason
                };
                StepOutcome::NotCommitted {
                    reason,
                    skipped,
                    excluded,
                }
            }
        }
    }

    /// Steps 2 to 4 of the module doc: the reduced step as checked here (or
    /// its guard's refusal), and why this member gave zeros, if it did; Err
    /// when a collective failed (with the exclusion decided before it).
    #[allow(clippy::type_complexity)]
    fn collective_step(
        &mut self,
        trainer: &mut DraftTrainer,
        quorum: &proto::QuorumResponse,
    ) -> Result<
        (
            Result<dflash_model::draft::ReducedStep, SkippedStep>,
            Option<Exclusion>,
        ),
        (String, Option<Exclusion>),
    > {
        let single = self.world_size == 1;
        let mut excluded = None;
        if !single {
            self.membership
                .ensure(
                    quorum,
                    &self.config.collective_host,
                    self.config.collective_timeout,
                    (&self.store, &self.store_address),
                )
                .map_err(|reason| (reason, None))?;
        }
        if quorum.heal {
            let before = trainer.state_checksum();
            if !single {
                self.membership
                    .heal(trainer, self.rank)
                    .map_err(|reason| (reason, None))?;
            }
            self.totals.heals += 1;
            if let Some(record) = quorum.record {
                // Rank 0 holds the run's committed step: so does every
                // member now.
                self.committed = record;
            }
            if trainer.state_checksum() != before {
                info!(reason = %quorum.heal_reason, step = quorum.step, "data parallelism: took rank 0's state");
                excluded = Some(Exclusion::StaleModel);
            }
        }
        if excluded.is_none() {
            if let Some(skipped) = trainer.own_share_guard() {
                warn!(reason = %skipped, "data parallelism: this member's share failed its guard; it gives zeros");
                excluded = Some(Exclusion::BadShare(skipped));
            }
        }
        if excluded.is_some() || trainer.accumulated_samples() == 0 {
            self.totals.zero_contributions += 1;
        }
        let Contribution { gradient, sums } =
            trainer.contribution(self.rank == 0, excluded.as_ref());
        let reduced = if single {
            Contribution { gradient, sums }
        } else {
            match self.membership.all_reduce(gradient, sums) {
                Ok(reduced) => reduced,
                Err(reason) => return Err((reason, excluded)),
            }
        };
        Ok((trainer.check_reduced(reduced), excluded))
    }

    fn ask(
        &mut self,
        trainer: &DraftTrainer,
        samples_ready: u64,
        leaving: bool,
    ) -> Result<Option<proto::QuorumResponse>, DataParallelError> {
        let step = trainer.progress().step;
        if self.committed.step != step
            && self.committed.instance == 0
            && self.committed.quorum_id == 0
        {
            // A model that never took a step of this run (resumed from a
            // checkpoint): its own history, which the broker heals unless
            // the run has none yet.
            self.committed.step = step;
        }
        let request = proto::QuorumRequest {
            drafter_id: self.drafter_id.clone(),
            store_address: self.store_address.clone(),
            step,
            state_checksum: checksum_with_history(trainer.state_checksum(), &self.committed),
            samples_ready,
            leaving,
            committed: Some(self.committed),
            collective_timeout_ms: u64::try_from(self.config.collective_timeout.as_millis())
                .unwrap_or(u64::MAX),
        };
        let started = Instant::now();
        let response = self.link.quorum(request);
        self.totals.time_in_quorum += started.elapsed();
        let response = response?;
        Ok((response.quorum_id != 0).then_some(response))
    }
}

/// The checksum a member asks with: its state's (weights, moments, step,
/// in order) mixed with the commit that made that state, so two members at
/// one step with equal weights but different histories differ too.
fn checksum_with_history(state: u64, committed: &proto::CommitRecord) -> u64 {
    [committed.instance, committed.quorum_id, committed.step]
        .into_iter()
        .fold(state, |checksum, part| {
            (checksum ^ part)
                .wrapping_mul(0x0000_0100_0000_01B3)
                .rotate_left(29)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_covers_the_history() {
        let record = |instance, quorum_id, step| proto::CommitRecord {
            step,
            instance,
            quorum_id,
        };
        let base = checksum_with_history(42, &record(1, 2, 3));
        assert_eq!(base, checksum_with_history(42, &record(1, 2, 3)));
        for other in [
            record(2, 2, 3),
            record(1, 3, 3),
            record(1, 2, 4),
            record(2, 1, 3),
        ] {
            assert_ne!(base, checksum_with_history(42, &other), "{other:?}");
        }
        assert_ne!(base, checksum_with_history(43, &record(1, 2, 3)));
    }
}
