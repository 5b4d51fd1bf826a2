//! How long the learning-rate schedule should be when `--total-steps` is
//! not given: estimated from the broker's run summary and this drafter's own
//! step sizes, and re-estimated as training goes.

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

#[cfg(test)]
mod tests {
    use super::*;

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
