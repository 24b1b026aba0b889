//! Learning-rate schedules ([`LrSchedule`]): linear warmup, then cosine, linear, step or constant, with
//! the authors' arithmetic operation by operation.

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, positive};

/// Shape of the learning rate after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Cosine decay from `lr_max` to `lr_min` at `total_steps`.
    Cosine,
    /// Linear decay from `lr_max` to `lr_min` at `total_steps`.
    Linear,
    /// `lr_max * decay_gamma^i`, `i` = number of `decay_points` passed.
    Step,
    /// `lr_max` after warmup.
    Constant,
}

impl ScheduleKind {
    /// Every kind, in the order `cosine`, `linear`, `step`, `constant`.
    pub const ALL: [ScheduleKind; 4] =
        [ScheduleKind::Cosine, ScheduleKind::Linear, ScheduleKind::Step, ScheduleKind::Constant];

    /// The kind's name in recipes (`schedule.kind`) and on the command line (`--schedule`): `cosine`,
    /// `linear`, `step` or `constant`; [`FromStr`](std::str::FromStr) parses it back.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Cosine => "cosine",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Step => "step",
            ScheduleKind::Constant => "constant",
        }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown schedule `{s}` (expected one of cosine, linear, step, constant)"))
    }
}

fn default_decay_gamma() -> f64 {
    0.1
}

/// A per-step learning-rate schedule: linear warmup from `lr_min` to `lr_max` over `warmup_steps`, then
/// [`ScheduleKind`]. `total_steps` is the horizon `T` of the decay; it is independent of how many steps a
/// run performs, so that a resumed or extended run keeps the same curve (past `T` the lr stays at its
/// final value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// Shape of the decay after warmup (recipe key `schedule.kind`).
    pub kind: ScheduleKind,
    /// Horizon `T` of the decay in steps (`schedule.total_steps`): the lr reaches `lr_min` (cosine, linear) at
    /// `T` and stays at its final value past it. At least 1, at most [`crate::MAX_STEPS`].
    pub total_steps: u64,
    /// Steps of linear warmup from `lr_min` to `lr_max` (`schedule.warmup_steps`, default 0); smaller than
    /// `total_steps`. The power and exponential rules use `h_base` for rounds that start in warmup.
    #[serde(default)]
    pub warmup_steps: u64,
    /// Peak learning rate, reached at the end of warmup (`schedule.lr_max`); finite and > 0.
    pub lr_max: f64,
    /// Learning rate at step 0 of warmup and at the end `T` of a cosine or linear decay
    /// (`schedule.lr_min`, default 0); finite, in `[0, lr_max]`.
    #[serde(default)]
    pub lr_min: f64,
    /// Steps at which a `step` schedule multiplies the lr by `decay_gamma`; strictly increasing, each in
    /// `(warmup_steps, total_steps)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decay_points: Vec<u64>,
    /// Factor a `step` schedule multiplies the lr by at each of `decay_points` (`schedule.decay_gamma`,
    /// default 0.1); in `(0, 1]`.
    #[serde(default = "default_decay_gamma")]
    pub decay_gamma: f64,
}

impl LrSchedule {
    /// A schedule without decay points (`decay_gamma` 0.1); check it with [`LrSchedule::validate`] or
    /// through [`crate::Plan::new`].
    pub fn new(kind: ScheduleKind, total_steps: u64, warmup_steps: u64, lr_max: f64, lr_min: f64) -> Self {
        Self {
            kind,
            total_steps,
            warmup_steps,
            lr_max,
            lr_min,
            decay_points: Vec::new(),
            decay_gamma: default_decay_gamma(),
        }
    }

    /// Checks every setting: `total_steps` in `1..=MAX_STEPS`, `warmup_steps < total_steps`, `lr_max > 0`,
    /// `0 <= lr_min <= lr_max`, `decay_gamma` in `(0, 1]`, and `decay_points` only for a `step` schedule,
    /// strictly increasing inside `(warmup_steps, total_steps)`.
    ///
    /// # Errors
    ///
    /// The first invalid setting, as a [`ConfigError`] naming it (`schedule.warmup_steps`, ...).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |name: &str| format!("schedule.{name}");
        if self.total_steps == 0 {
            return Err(ConfigError::new(f("total_steps"), "must be at least 1"));
        }
        if self.total_steps > crate::MAX_STEPS {
            return Err(ConfigError::new(f("total_steps"), too_many_steps(self.total_steps)));
        }
        if self.warmup_steps >= self.total_steps {
            return Err(ConfigError::new(
                f("warmup_steps"),
                format!("must be smaller than schedule.total_steps ({} >= {})", self.warmup_steps, self.total_steps),
            ));
        }
        positive(&f("lr_max"), self.lr_max)?;
        if !self.lr_min.is_finite() || self.lr_min < 0.0 {
            return Err(ConfigError::new(f("lr_min"), format!("must be a finite number >= 0 (got {})", self.lr_min)));
        }
        if self.lr_min > self.lr_max {
            return Err(ConfigError::new(
                f("lr_min"),
                format!("must not exceed schedule.lr_max ({} > {})", self.lr_min, self.lr_max),
            ));
        }
        if !self.decay_gamma.is_finite() || self.decay_gamma <= 0.0 || self.decay_gamma > 1.0 {
            return Err(ConfigError::new(f("decay_gamma"), format!("must be in (0, 1] (got {})", self.decay_gamma)));
        }
        if !self.decay_points.is_empty() && self.kind != ScheduleKind::Step {
            return Err(ConfigError::new(
                f("decay_points"),
                format!("only the `step` schedule uses decay points (kind is `{}`)", self.kind.name()),
            ));
        }
        let mut previous = self.warmup_steps;
        for (i, &p) in self.decay_points.iter().enumerate() {
            if p <= self.warmup_steps || p >= self.total_steps {
                return Err(ConfigError::new(
                    format!("schedule.decay_points[{i}]"),
                    format!(
                        "{p} is out of range: decay points lie after warmup and before total_steps ({}, {})",
                        self.warmup_steps, self.total_steps
                    ),
                ));
            }
            if i > 0 && p <= previous {
                return Err(ConfigError::new(
                    format!("schedule.decay_points[{i}]"),
                    format!("must be strictly increasing ({p} follows {previous})"),
                ));
            }
            previous = p;
        }
        Ok(())
    }

    /// The learning rate of global step `t` (0-based). The arithmetic follows the authors' code operation
    /// by operation, because the power rule floors a function of it and a last-bit difference can move a
    /// round boundary.
    pub fn lr(&self, t: u64) -> f64 {
        let (w, total) = (self.warmup_steps, self.total_steps);
        if t < w {
            return self.lr_min + t as f64 * (self.lr_max - self.lr_min) / w as f64;
        }
        let span = (total - w) as f64;
        let d = (t - w).min(total - w) as f64;
        match self.kind {
            ScheduleKind::Cosine => {
                self.lr_min + 0.5 * (self.lr_max - self.lr_min) * (1.0 + (std::f64::consts::PI * d / span).cos())
            }
            ScheduleKind::Linear => self.lr_min + (span - d) * (self.lr_max - self.lr_min) / span,
            ScheduleKind::Step => {
                let passed = self.decay_points.iter().take_while(|&&p| t >= p).count();
                self.lr_max * self.decay_gamma.powi(passed as i32)
            }
            ScheduleKind::Constant => self.lr_max,
        }
    }

    /// Whether step `t` lies in the warmup, `t < warmup_steps`.
    pub fn in_warmup(&self, t: u64) -> bool {
        t < self.warmup_steps
    }
}

/// The refusal of a step count above [`crate::MAX_STEPS`].
pub(crate) fn too_many_steps(steps: u64) -> String {
    format!(
        "must be at most {} (got {steps}): plans are enumerated round by round, and no training run comes near",
        crate::MAX_STEPS
    )
}
