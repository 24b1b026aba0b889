//! The sync rules ([`SyncRule`]): data parallel, constant `H`, post-local SGD, the power rules (QSR
//! among them) and the exponential rule, each deciding a round's `H` when it starts.

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, positive};
use crate::schedule::LrSchedule;

/// How many local steps `H` the round starting at a given step takes.
///
/// All rules share the semantics of the authors' code: `H` is decided once, when a round starts, from the
/// lr of the round's **first** step; the power rules use `h_base` during warmup and **floor**; the planner
/// clamps the last round so that training ends on a synchronization.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "kebab-case", deny_unknown_fields, from = "RuleRepr")]
pub enum SyncRule {
    /// Data parallel: all-reduce gradients every step.
    #[serde(alias = "data-parallel")]
    Dp,
    /// Local method with a constant number of local steps `h` per round.
    Constant {
        /// Local steps per round, `H` (recipe key `sync.h`); at least 1.
        h: u64,
    },
    /// Post-local SGD (Lin et al.): data parallel before `switch_step`, then constant `h`.
    PostLocal {
        /// Global step at which rounds switch from data parallel to local (`sync.switch_step`); at most
        /// `schedule.total_steps`.
        switch_step: u64,
        /// Local steps per round after the switch, `H` (`sync.h`); at least 1.
        h: u64,
    },
    /// `H = max(h_base, floor((alpha / lr)^power))`: `power` 1 is the H ~ 1/lr rule, 2 is QSR, 3 the
    /// cubic ablation; any positive real is accepted.
    Power {
        /// Smallest `H`, used as is for rounds that start in warmup (`sync.h_base`); at least 1.
        h_base: u64,
        /// Scale `alpha` of the rule (`sync.alpha`): `H` exceeds `h_base` once the lr falls below
        /// about `alpha / h_base^(1/power)`; finite and > 0.
        alpha: f64,
        /// Exponent of `alpha / lr` (`sync.power`); finite and > 0.
        power: f64,
    },
    /// The Quadratic Synchronization Rule: the power rule with `power = 2`.
    Qsr {
        /// Smallest `H`, used as is for rounds that start in warmup (`sync.h_base`); at least 1.
        h_base: u64,
        /// Scale `alpha` in `H = max(h_base, floor((alpha / lr)^2))` (`sync.alpha`); finite and > 0.
        alpha: f64,
    },
    /// Exponentially growing interval in the style of DeepSpeed's 0/1 Adam: `h_base` doubles every
    /// `scaler` rounds after warmup, clipped at `h_max`.
    Exponential {
        /// `H` during warmup and the first `scaler` rounds after it (`sync.h_base`); at least 1.
        h_base: u64,
        /// Rounds after warmup between two doublings of `H` (`sync.scaler`); at least 1.
        scaler: u64,
        /// Largest `H` (`sync.h_max`); at least `h_base`.
        h_max: u64,
    },
}

/// What `SyncRule` deserializes from: the same rules, with `dp` as an empty struct variant, because
/// serde's `deny_unknown_fields` does not reach a unit variant of an internally tagged enum (`rule = "dp"`
/// with `h = 4` would otherwise be accepted silently).
#[derive(Deserialize)]
#[serde(tag = "rule", rename_all = "kebab-case", deny_unknown_fields)]
enum RuleRepr {
    #[serde(alias = "data-parallel")]
    Dp {},
    Constant {
        h: u64,
    },
    PostLocal {
        switch_step: u64,
        h: u64,
    },
    Power {
        h_base: u64,
        alpha: f64,
        power: f64,
    },
    Qsr {
        h_base: u64,
        alpha: f64,
    },
    Exponential {
        h_base: u64,
        scaler: u64,
        h_max: u64,
    },
}

impl From<RuleRepr> for SyncRule {
    fn from(r: RuleRepr) -> Self {
        match r {
            RuleRepr::Dp {} => SyncRule::Dp,
            RuleRepr::Constant { h } => SyncRule::Constant { h },
            RuleRepr::PostLocal { switch_step, h } => SyncRule::PostLocal { switch_step, h },
            RuleRepr::Power { h_base, alpha, power } => SyncRule::Power { h_base, alpha, power },
            RuleRepr::Qsr { h_base, alpha } => SyncRule::Qsr { h_base, alpha },
            RuleRepr::Exponential { h_base, scaler, h_max } => SyncRule::Exponential { h_base, scaler, h_max },
        }
    }
}

impl SyncRule {
    /// The rule's name as written in a recipe's `sync.rule` and on the command line (`--sync`): `dp`,
    /// `constant`, `post-local`, `power`, `qsr` or `exponential`.
    pub fn name(&self) -> &'static str {
        match self {
            SyncRule::Dp => "dp",
            SyncRule::Constant { .. } => "constant",
            SyncRule::PostLocal { .. } => "post-local",
            SyncRule::Power { .. } => "power",
            SyncRule::Qsr { .. } => "qsr",
            SyncRule::Exponential { .. } => "exponential",
        }
    }

    /// A short human description with the rule's parameters, e.g. `qsr (h_base 4, alpha 0.0175)`.
    pub fn describe(&self) -> String {
        match self {
            SyncRule::Dp => "data parallel (gradient all-reduce every step)".into(),
            SyncRule::Constant { h } => format!("constant (h {h})"),
            SyncRule::PostLocal { switch_step, h } => format!("post-local (switch_step {switch_step}, h {h})"),
            SyncRule::Power { h_base, alpha, power } => {
                format!("power (h_base {h_base}, alpha {alpha}, power {power})")
            }
            SyncRule::Qsr { h_base, alpha } => format!("qsr (h_base {h_base}, alpha {alpha})"),
            SyncRule::Exponential { h_base, scaler, h_max } => {
                format!("exponential (h_base {h_base}, scaler {scaler}, h_max {h_max})")
            }
        }
    }

    /// The exponent of a power rule (`Some(2.0)` for QSR), `None` for the other rules.
    pub fn power(&self) -> Option<f64> {
        match self {
            SyncRule::Power { power, .. } => Some(*power),
            SyncRule::Qsr { .. } => Some(2.0),
            _ => None,
        }
    }

    /// Checks the rule's settings against `schedule`: `h`, `h_base` and `scaler` at least 1; `alpha` and
    /// `power` finite and > 0; `switch_step` at most `schedule.total_steps`; `h_max >= h_base`.
    ///
    /// # Errors
    ///
    /// The first invalid setting, as a [`ConfigError`] naming it (`sync.h_base`, `sync.alpha`, ...).
    pub fn validate(&self, schedule: &LrSchedule) -> Result<(), ConfigError> {
        self.validate_at(schedule, "sync")
    }

    /// [`Self::validate`] for a rule found at recipe key `at` (`sync`, or `sync.local`).
    pub(crate) fn validate_at(&self, schedule: &LrSchedule, at: &str) -> Result<(), ConfigError> {
        let at_least_one = |field: &str, v: u64| {
            if v == 0 { Err(ConfigError::new(format!("{at}.{field}"), "must be at least 1 (got 0)")) } else { Ok(()) }
        };
        let positive = |field: &str, v: f64| positive(&format!("{at}.{field}"), v);
        match *self {
            SyncRule::Dp => Ok(()),
            SyncRule::Constant { h } => at_least_one("h", h),
            SyncRule::PostLocal { switch_step, h } => {
                at_least_one("h", h)?;
                if switch_step > schedule.total_steps {
                    return Err(ConfigError::new(
                        format!("{at}.switch_step"),
                        format!("{switch_step} is beyond schedule.total_steps ({})", schedule.total_steps),
                    ));
                }
                Ok(())
            }
            SyncRule::Power { h_base, alpha, power } => {
                at_least_one("h_base", h_base)?;
                positive("alpha", alpha)?;
                positive("power", power)
            }
            SyncRule::Qsr { h_base, alpha } => {
                at_least_one("h_base", h_base)?;
                positive("alpha", alpha)
            }
            SyncRule::Exponential { h_base, scaler, h_max } => {
                at_least_one("h_base", h_base)?;
                at_least_one("scaler", scaler)?;
                if h_max < h_base {
                    return Err(ConfigError::new(
                        format!("{at}.h_max"),
                        format!("must be at least {at}.h_base ({h_max} < {h_base})"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// Whether the round starting at `start` all-reduces gradients (data parallel) rather than parameters.
    pub fn syncs_gradients(&self, start: u64) -> bool {
        match *self {
            SyncRule::Dp => true,
            SyncRule::PostLocal { switch_step, .. } => start < switch_step,
            _ => false,
        }
    }

    /// The unclamped `H` of a round that starts at global step `start`, the `index`-th round of the run,
    /// `warm_rounds` of the earlier rounds having started inside warmup. Saturates at `u64::MAX`; the
    /// planner clamps it to the end of training. Always >= 1 for a validated rule.
    pub(crate) fn round_h(&self, schedule: &LrSchedule, start: u64, index: u64, warm_rounds: u64) -> u64 {
        let in_warmup = schedule.in_warmup(start);
        // Only the power rules read the lr (and only after warmup): skip computing it otherwise.
        let lr = if self.power().is_some() && !in_warmup { schedule.lr(start) } else { f64::NAN };
        self.h_at(RoundStart { step: start, lr, in_warmup, rounds_after_warmup: index.saturating_sub(warm_rounds) })
    }

    /// `H` of the round that starts at `start`, unclamped (saturates at `u64::MAX`), always >= 1 for a
    /// validated rule. This is the rule alone, for callers whose learning rate comes from their own
    /// scheduler (the [`Plan`](crate::Plan) uses it with its [`LrSchedule`]).
    pub fn h_at(&self, start: RoundStart) -> u64 {
        let h = match *self {
            SyncRule::Dp => 1,
            SyncRule::Constant { h } => h,
            SyncRule::PostLocal { switch_step, h } => {
                if start.step < switch_step {
                    1
                } else {
                    h
                }
            }
            SyncRule::Power { h_base, alpha, power } => power_h(start, h_base, alpha, power),
            SyncRule::Qsr { h_base, alpha } => power_h(start, h_base, alpha, 2.0),
            SyncRule::Exponential { h_base, scaler, h_max } => {
                if start.in_warmup {
                    h_base
                } else {
                    let doublings = start.rounds_after_warmup / scaler;
                    let grown = if doublings >= 64 { u64::MAX } else { h_base.saturating_mul(1u64 << doublings) };
                    grown.min(h_max)
                }
            }
        };
        h.max(1)
    }
}

/// Where a round starts, as [`SyncRule::h_at`] needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundStart {
    /// Global step of the round's first step.
    pub step: u64,
    /// Learning rate of the round's first step (read by the power rules, QSR among them, after warmup).
    pub lr: f64,
    /// Whether `step` lies in the lr warmup (the power and exponential rules then use `h_base`).
    pub in_warmup: bool,
    /// Rounds that started after warmup, before this one (the exponential rule doubles `h_base` every
    /// `scaler` of them).
    pub rounds_after_warmup: u64,
}

fn power_h(start: RoundStart, h_base: u64, alpha: f64, power: f64) -> u64 {
    if start.in_warmup {
        return h_base;
    }
    // `powf` is libm's pow, as Python's `**` in the authors' code.
    let h = (alpha / start.lr).powf(power).floor();
    // NaN only for an lr that is NaN or 0/0-like (a validated plan has lr > 0); `as` saturates huge values.
    let h = if h.is_nan() { h_base } else { h as u64 };
    h.max(h_base)
}
