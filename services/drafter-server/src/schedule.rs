//! Where a drafter is in its learning-rate schedule.
//!
//! - Independent drafters (`--sync-every 0`): each runs its own schedule
//!   over its share of the run. When `--total-steps` is not given, its
//!   length is estimated from the broker's run summary and this drafter's
//!   own step sizes, and re-estimated as training goes
//!   ([`estimate_total_steps`]).
//! - Drafters that train one model through the broker's model sync: the
//!   schedule is the run's, not each drafter's. The run is one schedule of
//!   `run samples / samples per step` steps, and a drafter's position in it
//!   is the run's samples so far (the center's count at this drafter's last
//!   exchange, every drafter's applied deltas, plus this drafter's own
//!   samples since) over the same samples per step
//!   ([`run_schedule_position`]). A drafter joining late starts at the run's
//!   current learning rate, not at warmup. [`RunClock`] carries those counts
//!   between the sync link (which learns the center's count), the async side
//!   (which learns the run's size from the broker's status) and the engine
//!   (which sets the learning rate of each step).
//! - The same drafters' AdamW β1 is the run's too: with N drafters applying
//!   their steps to one center in turn, each drafter's first moment is
//!   updated once per N center updates, and asynchrony itself adds momentum
//!   (Mitliagkas, Zhang, Hadjis, Ré 2016, "Asynchrony begets momentum"). A
//!   drafter therefore decays its first moment by β1^N per own step, which
//!   is β1 per center update, the decay one drafter alone has
//!   ([`asynchronous_beta1`]). N is measured, not configured: a delta's
//!   staleness S counts the other drafters' exchanges since this drafter's
//!   base, so the center takes about S + 1 drafters' steps per step of this
//!   one (every drafter syncing every `--sync-every` steps); N is the
//!   running mean of S + 1 over the last exchanges
//!   ([`RunClock::staleness_observed`]), so it follows drafters that join,
//!   leave or run at other speeds.
//! - With `--sync-lr-scaling inverse` (or `inverse-sqrt`) the same N also
//!   divides the drafter's learning rate (by N or √N,
//!   [`sync_learning_rate_scale`]): a learning rate tuned for one drafter
//!   is too large for N drafters whose steps land on weights N updates
//!   old. Off by default (see the flag).
//! - With `--sync-batch-scaling inverse` the same N divides the drafter's
//!   optimizer step ([`shared_step_limits`]): N drafters each take 1/N of
//!   one drafter's step, so a round of their N deltas trains on one
//!   drafter's step of samples and the center takes as many steps over
//!   the run as one drafter would. The run-wide schedule needs nothing
//!   more: its position is a fraction of the run's samples.

use std::sync::{Arc, Mutex, PoisonError};

/// `--sync-lr-scaling`: a sharing drafter's learning rate over N, the
/// drafters sharing the center ([`sync_learning_rate_scale`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncLrScaling {
    /// The schedule's learning rate, whatever N.
    None,
    /// Divided by N.
    Inverse,
    /// Divided by √N.
    InverseSqrt,
}

/// `--sync-batch-scaling`: a sharing drafter's step size over N, the
/// drafters sharing the center ([`shared_step_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncBatchScaling {
    /// Every drafter's step is one drafter's (`--max-step-samples`,
    /// `--batch-tokens` × `--grad-accumulation`), whatever N.
    None,
    /// Each of N drafters takes 1/N of one drafter's step: a round of N
    /// steps trains on one drafter's step of samples.
    Inverse,
}

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

/// What the run-wide schedule position is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RunClockState {
    /// Samples the whole run will train on (the broker's `expected_items`,
    /// the targets' announced shard sizes); 0 while unknown.
    pub run_samples_total: u64,
    /// Samples in the center (every drafter's applied deltas) at this
    /// drafter's last successful exchange.
    pub center_samples: u64,
    /// Samples this drafter trained on since that exchange (not yet in the
    /// center's count).
    pub samples_since_sync: u64,
    /// Drafters' steps the center takes per step of this drafter: the
    /// running mean of (staleness + 1) of its exchanges; 0 while unknown.
    pub drafters_sharing: f64,
}

/// The run-wide schedule clock of one drafter, shared by its sync link, its
/// engine and its async side (a mutex held for a few loads and stores).
#[derive(Debug, Clone, Default)]
pub struct RunClock {
    state: Arc<Mutex<RunClockState>>,
}

impl RunClock {
    pub fn new() -> Self {
        RunClock::default()
    }

    fn update(&self, change: impl FnOnce(&mut RunClockState)) {
        change(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
    }

    pub fn state(&self) -> RunClockState {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The run's size learned from the broker (0: still unknown).
    pub fn set_run_samples_total(&self, samples: u64) {
        self.update(|state| state.run_samples_total = samples);
    }

    /// An exchange succeeded: the center holds `center_samples`, and this
    /// drafter's earlier samples are in it (or were discarded with its delta).
    pub fn synced(&self, center_samples: u64) {
        self.update(|state| {
            state.center_samples = center_samples;
            state.samples_since_sync = 0;
        });
    }

    /// An UPDATE of this drafter was `staleness` center versions behind:
    /// the center took `staleness + 1` drafters' steps per step of this one.
    /// Kept as a running mean (weight [`SHARING_MEAN_WEIGHT`] on the newest),
    /// since the order in which asynchronous drafters land varies.
    pub fn staleness_observed(&self, staleness: u64) {
        let sharing = staleness.saturating_add(1).min(1 << 20) as f64;
        self.update(|state| {
            state.drafters_sharing = if state.drafters_sharing > 0.0 {
                state.drafters_sharing + SHARING_MEAN_WEIGHT * (sharing - state.drafters_sharing)
            } else {
                sharing
            };
        });
    }

    /// This drafter took a step on `samples` samples.
    pub fn trained(&self, samples: u64) {
        self.update(|state| state.samples_since_sync += samples);
    }
}

/// Weight of the newest exchange in [`RunClockState::drafters_sharing`].
pub const SHARING_MEAN_WEIGHT: f64 = 0.25;

/// AdamW's β1 for a drafter whose center takes `drafters_sharing` drafters'
/// steps per step of its own: `beta1^N`, so its first moment decays by
/// `beta1` per step of the center, as one drafter's does per own step (see
/// the module doc), and at most `sharing_cap` (`--sync-adam-beta1`: 0, the
/// default, drops the first moment while sharing, since asynchrony is
/// itself momentum; 1 keeps `beta1^N`). One drafter (or an unknown count:
/// 0 or NaN) keeps `beta1`, uncapped. At β1 0.9 with three drafters
/// `beta1^N` is 0.729.
pub fn asynchronous_beta1(beta1: f64, drafters_sharing: f64, sharing_cap: f64) -> f64 {
    if drafters_sharing > 1.0 {
        beta1.powf(drafters_sharing.min(1024.0)).min(sharing_cap)
    } else {
        beta1
    }
}

/// The factor on a sharing drafter's learning rate (`--sync-lr-scaling`):
/// 1/N or 1/√N of `drafters_sharing` once N > 1; 1 for one drafter or an
/// unknown count (0 or NaN). N drafters applying their steps to one center
/// each take steps from a base about N center updates old; the delay
/// shrinks the learning rate that stays stable about as 1/N (Zhang, Gupta,
/// Lian, Liu 2016 scale by the staleness), which is what the model-sync
/// study measured: the center's best learning rate falls as drafters are
/// added.
pub fn sync_learning_rate_scale(drafters_sharing: f64, scaling: SyncLrScaling) -> f64 {
    // NaN is not above 1: an unknown count scales nothing.
    let drafters = if drafters_sharing > 1.0 {
        drafters_sharing.min(1024.0)
    } else {
        return 1.0;
    };
    match scaling {
        SyncLrScaling::None => 1.0,
        SyncLrScaling::Inverse => 1.0 / drafters,
        SyncLrScaling::InverseSqrt => 1.0 / drafters.sqrt(),
    }
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

/// A sharing drafter's step limits (`--sync-batch-scaling`): with
/// `inverse` and N = `drafters_sharing` > 1, 1/N of `one`'s samples
/// (rounded, at least 1) and of its token budget (`batch_tokens` ×
/// `grad_accumulation`): fewer micro-batches when there are at least N,
/// else smaller ones, so a micro-batch never grows. One drafter or an
/// unknown count (0 or NaN) keeps `one`.
pub fn shared_step_limits(
    one: StepLimits,
    drafters_sharing: f64,
    scaling: SyncBatchScaling,
) -> StepLimits {
    // NaN is not above 1: an unknown count shares nothing.
    let drafters = match scaling {
        SyncBatchScaling::Inverse if drafters_sharing > 1.0 => drafters_sharing.min(1024.0),
        _ => return one,
    };
    let share = |value: f64| (value / drafters).round().max(1.0);
    let grad_accumulation = share(one.grad_accumulation as f64);
    let step_tokens = one.batch_tokens as f64 * one.grad_accumulation as f64 / drafters;
    StepLimits {
        batch_tokens: (step_tokens / grad_accumulation)
            .ceil()
            .clamp(1.0, one.batch_tokens as f64) as usize,
        grad_accumulation: grad_accumulation as u64,
        max_step_samples: share(one.max_step_samples as f64) as usize,
    }
}

/// A step's place in a schedule: the 0-based step and the schedule length,
/// as `LearningRateSchedule::learning_rate(step, total_steps)` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulePosition {
    pub step: u64,
    pub total_steps: u64,
}

/// The run-wide schedule position of a drafter's next step: the run's
/// samples so far over `samples_per_step` (this drafter's batch), within a
/// schedule of the run's samples over the same batch. `fixed_total_steps`
/// (`--total-steps`, meaning the run's steps) wins over the run's size;
/// `fallback_total_steps` is used while neither is known. The position
/// lags the run's true one by the samples other drafters trained since
/// their last exchange (at most `--sync-every` steps each).
pub fn run_schedule_position(
    clock: RunClockState,
    samples_per_step: f64,
    fixed_total_steps: Option<u64>,
    fallback_total_steps: u64,
) -> SchedulePosition {
    let samples_per_step = if samples_per_step.is_finite() {
        samples_per_step.max(1.0)
    } else {
        1.0
    };
    let samples_done = clock.center_samples + clock.samples_since_sync;
    let step = (samples_done as f64 / samples_per_step).floor() as u64;
    let total_steps = match fixed_total_steps {
        Some(total) => total,
        None if clock.run_samples_total > 0 => {
            (clock.run_samples_total as f64 / samples_per_step).ceil() as u64
        }
        None => fallback_total_steps,
    };
    SchedulePosition {
        step,
        total_steps: total_steps.max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_model::draft::LearningRateSchedule;

    #[test]
    fn a_sharing_drafters_learning_rate_is_scaled_by_the_drafters_sharing() {
        for scaling in [
            SyncLrScaling::None,
            SyncLrScaling::Inverse,
            SyncLrScaling::InverseSqrt,
        ] {
            for alone in [0.0, 1.0, f64::NAN] {
                assert_eq!(sync_learning_rate_scale(alone, scaling), 1.0, "{scaling:?}");
            }
        }
        assert_eq!(sync_learning_rate_scale(4.0, SyncLrScaling::None), 1.0);
        assert_eq!(sync_learning_rate_scale(4.0, SyncLrScaling::Inverse), 0.25);
        assert_eq!(
            sync_learning_rate_scale(4.0, SyncLrScaling::InverseSqrt),
            0.5
        );
        // A running mean between counts scales between them.
        assert_eq!(sync_learning_rate_scale(2.5, SyncLrScaling::Inverse), 0.4);
        // A runaway count stops at 1024 drafters.
        assert_eq!(
            sync_learning_rate_scale(1e9, SyncLrScaling::Inverse),
            1.0 / 1024.0
        );
    }

    #[test]
    fn a_sharing_drafters_step_is_its_share_of_one_drafters() {
        let one = StepLimits {
            batch_tokens: 16384,
            grad_accumulation: 1,
            max_step_samples: 64,
        };
        for alone in [0.0, 1.0, f64::NAN] {
            assert_eq!(
                shared_step_limits(one, alone, SyncBatchScaling::Inverse),
                one
            );
        }
        assert_eq!(shared_step_limits(one, 4.0, SyncBatchScaling::None), one);
        // One micro-batch per step: a quarter of its tokens and samples.
        assert_eq!(
            shared_step_limits(one, 4.0, SyncBatchScaling::Inverse),
            StepLimits {
                batch_tokens: 4096,
                grad_accumulation: 1,
                max_step_samples: 16,
            }
        );
        // Three: 64 / 3 = 21.3 samples, rounded; 16384 / 3 tokens, up.
        assert_eq!(
            shared_step_limits(one, 3.0, SyncBatchScaling::Inverse),
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
            shared_step_limits(accumulating, 4.0, SyncBatchScaling::Inverse),
            StepLimits {
                batch_tokens: 16384,
                grad_accumulation: 2,
                max_step_samples: 16,
            }
        );
        // Among three: 8 / 3 = 2.7 micro-batches' tokens in 3 smaller ones.
        assert_eq!(
            shared_step_limits(accumulating, 3.0, SyncBatchScaling::Inverse),
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
        assert_eq!(
            shared_step_limits(tiny, 1e9, SyncBatchScaling::Inverse),
            tiny
        );
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

    fn clock(total: u64, center: u64, since: u64) -> RunClockState {
        RunClockState {
            run_samples_total: total,
            center_samples: center,
            samples_since_sync: since,
            drafters_sharing: 0.0,
        }
    }

    #[test]
    fn each_of_n_drafters_decays_its_moment_by_beta1_per_center_step() {
        // Unknown or one drafter: the configured β1, bit for bit, uncapped.
        assert_eq!(asynchronous_beta1(0.9, 0.0, 0.0), 0.9);
        assert_eq!(asynchronous_beta1(0.9, 1.0, 0.0), 0.9);
        assert_eq!(asynchronous_beta1(0.9, f64::NAN, 0.0), 0.9);
        // N drafters: β1^N per own step. Over the N center steps between two
        // steps of one drafter its moment decays as much as one drafter's
        // over N steps (0.9³ = 0.729; 0.9⁸ = 0.43046721).
        assert!((asynchronous_beta1(0.9, 3.0, 1.0) - 0.729).abs() < 1e-15);
        assert!((asynchronous_beta1(0.9, 8.0, 1.0) - 0.430_467_21).abs() < 1e-15);
        // ... at most the cap while sharing: 0 (the default) drops it.
        assert_eq!(asynchronous_beta1(0.9, 3.0, 0.5), 0.5);
        assert_eq!(asynchronous_beta1(0.9, 1.5, 0.0), 0.0);
        assert!((asynchronous_beta1(0.9, 3.0, 0.8) - 0.729).abs() < 1e-15);
        // β1 0 (no momentum) stays 0; a huge count stays a valid β1.
        assert_eq!(asynchronous_beta1(0.0, 5.0, 1.0), 0.0);
        let many = asynchronous_beta1(0.999, f64::INFINITY, 1.0);
        assert!((0.0..1.0).contains(&many), "{many}");
        let many = asynchronous_beta1(0.999, 1e300, 1.0);
        assert!((0.0..1.0).contains(&many), "{many}");
    }

    #[test]
    fn drafters_sharing_is_a_running_mean_of_staleness_plus_one() {
        let shared = RunClock::new();
        assert_eq!(shared.state().drafters_sharing, 0.0);
        // The first UPDATE sets it: two other drafters' exchanges landed.
        shared.staleness_observed(2);
        assert_eq!(shared.state().drafters_sharing, 3.0);
        // Syncs and steps leave it alone.
        shared.synced(40);
        shared.trained(5);
        assert_eq!(shared.state().drafters_sharing, 3.0);
        // One drafter left: staleness 1 from now on moves it toward 2 by a
        // quarter of the gap per exchange: 3 - 0.25 = 2.75, then 2.5625.
        shared.staleness_observed(1);
        assert_eq!(shared.state().drafters_sharing, 2.75);
        shared.staleness_observed(1);
        assert_eq!(shared.state().drafters_sharing, 2.5625);
        for _ in 0..200 {
            shared.staleness_observed(1);
        }
        assert!((shared.state().drafters_sharing - 2.0).abs() < 1e-12);
        // A wild staleness is bounded, never infinite.
        shared.staleness_observed(u64::MAX);
        assert!(shared.state().drafters_sharing.is_finite());
    }

    #[test]
    fn the_run_is_one_schedule_of_its_samples_over_the_batch() {
        // 1000 samples at 10 per step: 100 steps; 437 samples done: step 43.
        assert_eq!(
            run_schedule_position(clock(1000, 400, 37), 10.0, None, 5),
            SchedulePosition {
                step: 43,
                total_steps: 100
            }
        );
        // A batch that does not divide the run: the last partial step counts.
        assert_eq!(
            run_schedule_position(clock(1001, 0, 0), 10.0, None, 5).total_steps,
            101
        );
        // --total-steps is the run's length; the fallback only while the
        // run's size is unknown.
        assert_eq!(
            run_schedule_position(clock(1000, 0, 20), 10.0, Some(40), 5),
            SchedulePosition {
                step: 2,
                total_steps: 40
            }
        );
        assert_eq!(
            run_schedule_position(clock(0, 0, 0), 10.0, None, 5).total_steps,
            5
        );
        // A nonsensical batch is treated as one sample per step.
        assert_eq!(
            run_schedule_position(clock(50, 7, 0), f64::NAN, None, 5),
            SchedulePosition {
                step: 7,
                total_steps: 50
            }
        );
    }

    #[test]
    fn drafters_at_the_same_run_position_share_one_learning_rate() {
        let schedule = LearningRateSchedule::default();
        // One drafter alone on the run and one of three at the same point of
        // the run (its own samples are a third of the center's) are at the
        // same step of the same 100-step schedule.
        let alone = run_schedule_position(clock(1000, 600, 0), 10.0, None, 5);
        let one_of_three = run_schedule_position(clock(1000, 590, 10), 10.0, None, 5);
        assert_eq!(alone, one_of_three);
        assert_eq!(
            schedule.learning_rate(alone.step, alone.total_steps),
            schedule.learning_rate(60, 100)
        );
    }

    #[test]
    fn a_late_joiner_starts_at_the_runs_learning_rate_not_at_warmup() {
        let schedule = LearningRateSchedule::default();
        // Joined when the center already held half of a 1000-sample run.
        let shared = RunClock::new();
        shared.set_run_samples_total(1000);
        shared.synced(500);
        let first = run_schedule_position(shared.state(), 10.0, None, 5);
        assert_eq!(
            first,
            SchedulePosition {
                step: 50,
                total_steps: 100
            }
        );
        let learning_rate = schedule.learning_rate(first.step, first.total_steps);
        // Past the 4 warmup steps, halfway down the cosine:
        // 6e-4 · ½(1 + cos(π · 46/96)).
        let expected = 6e-4 * 0.5 * (1.0 + (std::f64::consts::PI * 46.0 / 96.0).cos());
        assert!((learning_rate - expected).abs() < 1e-15, "{learning_rate}");
        // Its own step counter (0) would have put it at warmup's first step.
        let own_first_step = schedule.learning_rate(0, 100);
        assert!((own_first_step - 1.5e-4).abs() < 1e-15);
        assert!(learning_rate > 1.8 * own_first_step);
        // Its own steps move it on between syncs; a sync takes the center's
        // count (every drafter's applied samples) instead.
        shared.trained(10);
        assert_eq!(
            run_schedule_position(shared.state(), 10.0, None, 5).step,
            51
        );
        shared.synced(540);
        assert_eq!(
            run_schedule_position(shared.state(), 10.0, None, 5).step,
            54
        );
    }
}
