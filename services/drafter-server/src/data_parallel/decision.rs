//! What a member does with its step once the broker answered its vote (or
//! did not): a pure function of the vote and the answer, apart from the
//! training thread's I/O.

use dflash_proto::v1 as proto;

/// A member's fate for one step.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// COMMIT: apply the reduced step; the model then holds `record`.
    Apply { record: proto::CommitRecord },
    /// Not applied. The step's own samples were settled by the broker
    /// (acked with a commit, or returned to the queue): the member acks or
    /// nacks none of them. `unknown`: the outcome is not known to this
    /// member, so it contributes nothing more until a quorum has healed it
    /// to the run's committed step.
    Discard { reason: String, unknown: bool },
}

/// The verdict for a vote whose reduced step was ready (`reduced_ready`:
/// it can be applied) given the broker's answer (`Err`: none came within
/// the member's patience).
pub fn verdict<E: std::fmt::Display>(
    reduced_ready: bool,
    answer: Result<&proto::CommitDecision, E>,
) -> Verdict {
    let decision = match answer {
        Ok(decision) => decision,
        Err(error) => {
            return Verdict::Discard {
                reason: format!("the decision never arrived: {error}"),
                unknown: true,
            }
        }
    };
    let outcome =
        proto::StepOutcome::try_from(decision.outcome).unwrap_or(proto::StepOutcome::Unspecified);
    match outcome {
        proto::StepOutcome::Commit => match (&decision.record, reduced_ready) {
            (Some(record), true) => Verdict::Apply { record: *record },
            (None, _) => Verdict::Discard {
                reason: "the broker said COMMIT without the step's record".to_string(),
                unknown: true,
            },
            (Some(_), false) => Verdict::Discard {
                // Cannot happen: a member without a reduced step votes no.
                reason: "COMMIT of a step this member could not apply".to_string(),
                unknown: true,
            },
        },
        proto::StepOutcome::Abort => Verdict::Discard {
            reason: decision.reason.clone(),
            unknown: false,
        },
        proto::StepOutcome::Unknown | proto::StepOutcome::Unspecified => Verdict::Discard {
            reason: if decision.reason.is_empty() {
                "the broker does not know the step".to_string()
            } else {
                decision.reason.clone()
            },
            unknown: true,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(
        outcome: proto::StepOutcome,
        record: Option<proto::CommitRecord>,
    ) -> proto::CommitDecision {
        proto::CommitDecision {
            commit: outcome == proto::StepOutcome::Commit,
            reason: "why".to_string(),
            outcome: outcome as i32,
            record,
        }
    }

    const RECORD: proto::CommitRecord = proto::CommitRecord {
        step: 5,
        instance: 1,
        quorum_id: 2,
    };

    #[test]
    fn only_a_commit_with_its_record_is_applied() {
        let commit = decision(proto::StepOutcome::Commit, Some(RECORD));
        assert_eq!(
            verdict::<String>(true, Ok(&commit)),
            Verdict::Apply { record: RECORD }
        );
        let bare = decision(proto::StepOutcome::Commit, None);
        assert!(matches!(
            verdict::<String>(true, Ok(&bare)),
            Verdict::Discard { unknown: true, .. }
        ));
    }

    #[test]
    fn unknown_and_silence_are_never_read_as_no() {
        let unknown = decision(proto::StepOutcome::Unknown, None);
        assert!(matches!(
            verdict::<String>(true, Ok(&unknown)),
            Verdict::Discard { unknown: true, .. }
        ));
        let unspecified = decision(proto::StepOutcome::Unspecified, None);
        assert!(matches!(
            verdict::<String>(true, Ok(&unspecified)),
            Verdict::Discard { unknown: true, .. }
        ));
        assert!(matches!(
            verdict(true, Err::<&proto::CommitDecision, _>("connection reset")),
            Verdict::Discard { unknown: true, .. }
        ));
        let abort = decision(proto::StepOutcome::Abort, None);
        assert_eq!(
            verdict::<String>(true, Ok(&abort)),
            Verdict::Discard {
                reason: "why".to_string(),
                unknown: false
            }
        );
    }
}
