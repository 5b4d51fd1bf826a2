//! The outer optimizer's settings ([`OuterSettings`]), the bounds a delta
//! is held to, and [`MagnitudeBounds`], the center's finite-by-construction
//! guard.

/// The outer optimizer: asynchronous local SGD with a delayed Nesterov step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterSettings {
    /// Outer learning rate η: each delta moves the center by η·delta.
    pub learning_rate: f32,
    /// Nesterov momentum μ of the outer step (0: plain asynchronous local SGD).
    pub momentum: f32,
    /// Deltas averaged per momentum step (N in Liu et al. 2024); 0 means the
    /// number of drafters with an open session at the time.
    pub momentum_delay: u32,
    /// A delta whose base is more than this many center updates old is
    /// discarded and the drafter restarts from the center (0: no bound).
    pub max_staleness: u64,
    /// A delta whose L2 norm is over this many times the largest norm of
    /// the last [`DELTA_NORM_WINDOW`] applied deltas is discarded, once
    /// [`DELTA_NORM_WARMUP`] were applied (0: no bound). A delta with a NaN
    /// or an infinity is always discarded.
    ///
    /// The largest, not the median: while the learning rate warms up each
    /// delta may be a few times the previous one, and over a window that
    /// adds up to far more than any fixed multiple of the median (a rule
    /// that discarded every delta of a legitimately faster drafter, which
    /// then never caught up). Growth past the window's largest by this
    /// factor in one exchange is not training, it is a fault.
    pub max_delta_norm_ratio: f32,
    /// How a delta's weight follows its staleness.
    pub staleness_scaling: StalenessScaling,
}

/// How much of a delta reaches the center, by its staleness (the center
/// updates applied since the drafter's base).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum StalenessScaling {
    /// Every delta counts fully (asynchronous local SGD as is).
    #[default]
    None,
    /// A delta `s` updates stale counts `1 / max(1, s)` (Zhang, Gupta,
    /// Lian, Liu 2016, "Staleness-aware async-SGD").
    Inverse,
}

impl StalenessScaling {
    /// The weight of a delta `staleness` center updates old, in (0, 1].
    pub fn weight(self, staleness: u64) -> f32 {
        match self {
            StalenessScaling::None => 1.0,
            StalenessScaling::Inverse => 1.0 / staleness.max(1) as f32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StalenessScaling::None => "none",
            StalenessScaling::Inverse => "inverse",
        }
    }
}

/// Default of [`OuterSettings::max_delta_norm_ratio`]: consecutive deltas
/// of the same number of local steps differ by small factors; one ten times
/// the largest recent one is broken.
pub const DEFAULT_MAX_DELTA_NORM_RATIO: f32 = 10.0;
/// Applied deltas whose norms the bound is over (their largest).
pub const DELTA_NORM_WINDOW: usize = 32;
/// Applied deltas before the norm bound applies.
pub const DELTA_NORM_WARMUP: usize = 4;
/// A delta whose norm is at most this fraction of the weights' norm (when
/// the center was made or resumed) is never an outlier.
pub const DELTA_NORM_FLOOR: f64 = 0.05;
/// Before [`DELTA_NORM_WARMUP`] deltas were applied (no recent norm to
/// compare with), a delta whose norm is over this many times the weights'
/// norm is refused: a run's first deltas move weights by a few learning
/// rates each, not by ten times the whole model (a first delta of 1e20 per
/// value from a drafter credential was applied before this bound).
pub const EARLY_DELTA_NORM_BOUND: f64 = 10.0;

impl Default for OuterSettings {
    fn default() -> Self {
        OuterSettings {
            learning_rate: 1.0,
            momentum: 0.0,
            momentum_delay: 0,
            max_staleness: 0,
            max_delta_norm_ratio: DEFAULT_MAX_DELTA_NORM_RATIO,
            staleness_scaling: StalenessScaling::None,
        }
    }
}

impl OuterSettings {
    /// The method with its parameters, as shown in status and logs.
    pub fn describe(&self) -> String {
        let delay = match self.momentum_delay {
            0 => "N = open sessions".to_string(),
            delay => format!("N = {delay}"),
        };
        let staleness = match self.max_staleness {
            0 => "unbounded".to_string(),
            bound => bound.to_string(),
        };
        format!(
            "async local SGD (DiLoCo outer step, Liu et al. 2024 delayed Nesterov): outer lr {}, momentum {}, {delay}, max staleness {staleness}, staleness scaling {}",
            self.learning_rate,
            self.momentum,
            self.staleness_scaling.name()
        )
    }
}

/// The largest magnitude any buffer of the center may reach: half of
/// f32's largest finite value, so that the rounding of an f32 result whose
/// exact value is under it cannot reach infinity.
pub const MAGNITUDE_LIMIT: f64 = f32::MAX as f64 / 2.0;

/// Upper bounds on the largest magnitude (absolute value) in each of the
/// center's buffers, carried through each step in f64 by the triangle
/// inequality: no element of a delta is larger than its L2 norm, so
/// `|w + η·d| ≤ |w| + |η|·‖d‖`, and likewise for the delta sums and the
/// momentum step. A delta whose bounds after its step pass
/// [`MAGNITUDE_LIMIT`] is refused before it touches the center: the center
/// stays finite by construction (the fuzz target `model_sync` drove it to
/// infinity with two finite deltas near f32's range before).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MagnitudeBounds {
    pub values: f64,
    pub velocity: f64,
    pub delta_sum: f64,
}

impl MagnitudeBounds {
    /// The bounds once a delta of L2 norm `norm` is applied with
    /// `settings` (added to the delta sums with `momentum`), and then the
    /// momentum step averaging `momentum_step` deltas when one is taken.
    pub fn after_delta(
        self,
        settings: &OuterSettings,
        norm: f64,
        momentum: bool,
        momentum_step: Option<u32>,
    ) -> MagnitudeBounds {
        let learning_rate = f64::from(settings.learning_rate).abs();
        let mut next = MagnitudeBounds {
            values: self.values + learning_rate * norm,
            velocity: self.velocity,
            delta_sum: if momentum {
                self.delta_sum + norm
            } else {
                self.delta_sum
            },
        };
        if let Some(count) = momentum_step {
            let mu = f64::from(settings.momentum).abs();
            next.velocity = mu * next.velocity + next.delta_sum / f64::from(count.max(1));
            next.values += learning_rate * mu * next.velocity;
            next.delta_sum = 0.0;
        }
        next
    }

    /// Every bound is within [`MAGNITUDE_LIMIT`] (a NaN bound is not).
    pub fn within_limit(&self) -> bool {
        [self.values, self.velocity, self.delta_sum]
            .iter()
            .all(|&bound| bound <= MAGNITUDE_LIMIT)
    }

    /// The largest of the bounds.
    pub fn largest(&self) -> f64 {
        self.values.max(self.velocity).max(self.delta_sum)
    }
}
