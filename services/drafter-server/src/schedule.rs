//! Where a drafter is in its learning-rate schedule, and the size of its
//! steps.
//!
//! - A drafter's schedule is over its optimizer steps. When `--total-steps`
//!   is not given, its length is estimated from the broker's run summary
//!   and this drafter's own step sizes, and re-estimated as training goes
//!   ([`estimate_total_steps`]). A data-parallel member takes the run's
//!   steps (every member the same step, rank 0's learning rate), so its
//!   count is the run's.
//! - A data-parallel member trains its share of each step: 1/N of
//!   `--max-step-samples` and of the step's token budget, N the members of
//!   the last quorum ([`share_of_step`]), so the members' shares together
//!   are one step of `--max-step-samples` whatever N.

/// The facts the estimate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleInputs {
    /// Items the whole run will have (the targets' announced shard sizes);
    /// 0 when the broker does not know yet.
    pub expected_items: u64,
    /// Items already finished by every drafter (acked or dead-lettered).
    pub finished_items: u64,
    /// Drafters sharing the queue (connected ones, this one included).
    pub connected_drafters: u32,
    /// This drafter's optimizer steps so far.
    pub steps_done: u64,
    /// Samples this drafter trained on so far.
    pub samples_trained: u64,
    /// Samples per step assumed before any step was taken.
    pub assumed_samples_per_step: u64,
}

/// Steps done plus this drafter's share of the remaining items divided by
/// its samples per step; `fallback` while the run size is unknown.
pub fn estimate_total_steps(inputs: ScheduleInputs, fallback: u64) -> u64 {
    if inputs.expected_items == 0 {
        return fallback.max(inputs.steps_done + 1);
    }
    let samples_per_step = if inputs.steps_done > 0 && inputs.samples_trained > 0 {
        (inputs.samples_trained as f64 / inputs.steps_done as f64).max(1.0)
    } else {
        inputs.assumed_samples_per_step.max(1) as f64
    };
    let remaining = inputs.expected_items.saturating_sub(inputs.finished_items) as f64;
    let my_share = remaining / f64::from(inputs.connected_drafters.max(1));
    let remaining_steps = (my_share / samples_per_step).ceil() as u64;
    (inputs.steps_done + remaining_steps).max(inputs.steps_done + 1)
}

/// When a drafter takes an optimizer step: a micro-batch is formed when
/// its padded tokens reach `batch_tokens`, a step is taken after
/// `grad_accumulation` micro-batches, or once `max_step_samples` samples
/// are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    pub batch_tokens: usize,
    pub grad_accumulation: u64,
    pub max_step_samples: usize,
}

/// A data-parallel member's share of the run's step: with N = `members`
/// above 1, 1/N of `one`'s samples (rounded, at least 1) and of its token
/// budget (`batch_tokens` × `grad_accumulation`): fewer micro-batches when
/// there are at least N, else smaller ones, so a micro-batch never grows.
/// One member (or an unknown count: 0 or NaN) keeps `one`.
pub fn share_of_step(one: StepLimits, members: f64) -> StepLimits {
    // An unknown count (NaN) shares nothing.
    if members.is_nan() || members <= 1.0 {
        return one;
    }
    let members = members.min(1024.0);
    let share = |value: f64| (value / members).round().max(1.0);
    let grad_accumulation = share(one.grad_accumulation as f64);
    let step_tokens = one.batch_tokens as f64 * one.grad_accumulation as f64 / members;
    StepLimits {
        batch_tokens: (step_tokens / grad_accumulation)
            .ceil()
            .clamp(1.0, one.batch_tokens as f64) as usize,
        grad_accumulation: grad_accumulation as u64,
        max_step_samples: share(one.max_step_samples as f64) as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_members_step_is_its_share_of_the_runs_step() {
        let one = StepLimits {
            batch_tokens: 16384,
            grad_accumulation: 1,
            max_step_samples: 64,
        };
        for alone in [0.0, 1.0, f64::NAN] {
            assert_eq!(share_of_step(one, alone), one);
        }
        // One micro-batch per step: a quarter of its tokens and samples.
        assert_eq!(
            share_of_step(one, 4.0),
            StepLimits {
                batch_tokens: 4096,
                grad_accumulation: 1,
                max_step_samples: 16,
            }
        );
        // Three: 64 / 3 = 21.3 samples, rounded; 16384 / 3 tokens, up.
        assert_eq!(
            share_of_step(one, 3.0),
            StepLimits {
                batch_tokens: 5462,
                grad_accumulation: 1,
                max_step_samples: 21,
            }
        );
        // Eight micro-batches among four drafters: two whole ones each.
        let accumulating = StepLimits {
            grad_accumulation: 8,
            ..one
        };
        assert_eq!(
            share_of_step(accumulating, 4.0),
            StepLimits {
                batch_tokens: 16384,
                grad_accumulation: 2,
                max_step_samples: 16,
            }
        );
        // Among three: 8 / 3 = 2.7 micro-batches' tokens in 3 smaller ones.
        assert_eq!(
            share_of_step(accumulating, 3.0),
            StepLimits {
                batch_tokens: 14564,
                grad_accumulation: 3,
                max_step_samples: 21,
            }
        );
        // Never below one sample, one token, one micro-batch.
        let tiny = StepLimits {
            batch_tokens: 1,
            grad_accumulation: 1,
            max_step_samples: 1,
        };
        assert_eq!(share_of_step(tiny, 1e9), tiny);
    }

    fn inputs() -> ScheduleInputs {
        ScheduleInputs {
            expected_items: 1000,
            finished_items: 0,
            connected_drafters: 1,
            steps_done: 0,
            samples_trained: 0,
            assumed_samples_per_step: 10,
        }
    }

    #[test]
    fn unknown_run_size_uses_the_fallback() {
        let unknown = ScheduleInputs {
            expected_items: 0,
            ..inputs()
        };
        assert_eq!(estimate_total_steps(unknown, 500), 500);
    }

    #[test]
    fn the_share_of_the_remaining_items_is_divided_by_samples_per_step() {
        assert_eq!(estimate_total_steps(inputs(), 1), 100);
        let two_drafters = ScheduleInputs {
            connected_drafters: 2,
            ..inputs()
        };
        assert_eq!(estimate_total_steps(two_drafters, 1), 50);
        let midway = ScheduleInputs {
            finished_items: 600,
            steps_done: 30,
            samples_trained: 600,
            ..inputs()
        };
        // 400 left at 20 per step: 20 more steps.
        assert_eq!(estimate_total_steps(midway, 1), 50);
    }

    #[test]
    fn the_estimate_is_always_past_the_current_step() {
        let finished = ScheduleInputs {
            finished_items: 1000,
            steps_done: 77,
            samples_trained: 1000,
            ..inputs()
        };
        assert_eq!(estimate_total_steps(finished, 1), 78);
    }
}
