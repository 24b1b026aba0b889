//! Plans whose workers do not meet while the lr is high: refused, naming the setting and the largest
//! value of it that trains (docs/architecture/sched.md, "Plans that cannot train").
//!
//! The measure is QSR's own: in a round of `H` steps at learning rate `lr` the workers drift apart by
//! about `lr^2 H` (the paper's reason for `H ~ 1/lr^2`). A round is judged by `H (lr / lr_max)^2`,
//! its drift in steps at the peak lr, with `lr` the largest lr of its steps; one that drifts further
//! than [`APART_SHARE`] of the run at the peak lr ends with an average of models that trained apart
//! (a constant `H` of 836 on an 880-step run sits at chance). QSR's late rounds are long by design and
//! pass: their lr is small. Rounds of at most [`APART_FLOOR`] steps always pass.

use crate::error::ConfigError;
use crate::plan::Plan;
use crate::rule::SyncRule;

/// The most a round may drift, as a share of the run's steps at the peak lr (1/16). On the digits MLP
/// (880 steps, data parallel 94 %) constant rounds of 55 steps kept every evaluation of the second half
/// within 4 points of data parallel's, 110 fell 6 below, 440 to 65-70 %, 880 to chance.
pub const APART_SHARE: f64 = 0.0625;

/// Rounds of at most this many steps are never refused, whatever the run's length (Local SGD's usual
/// `H`; smoke runs of a few dozen steps).
pub const APART_FLOOR: u64 = 16;

/// A round that keeps the workers apart too long while the lr is high.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Apart {
    /// Its first step.
    pub start: u64,
    /// Its steps.
    pub len: u64,
    /// The largest lr of its steps.
    pub lr: f64,
    /// Its drift, in steps at the peak lr: `len * (lr / lr_max)^2`.
    pub drift: f64,
    /// The most a round of this run may drift: [`APART_SHARE`] of the run's steps.
    pub limit: f64,
}

/// Whether a round of `len` steps whose largest lr is `lr` keeps the workers apart too long in a run of
/// `run_steps` steps whose peak lr is `peak`; `start` only names it. The measure both faces use: the
/// planner's rounds and an `Averager`'s, from the caller's lrs.
pub fn round_apart(start: u64, len: u64, lr: f64, peak: f64, run_steps: u64) -> Option<Apart> {
    if len <= APART_FLOOR || peak.is_nan() || peak <= 0.0 {
        return None;
    }
    let drift = len as f64 * (lr / peak).powi(2);
    let limit = APART_SHARE * run_steps as f64;
    (drift > limit).then_some(Apart { start, len, lr, drift, limit })
}

impl Plan {
    /// The first round whose workers stay apart too long while the lr is high ([`round_apart`]), if any.
    pub fn first_apart(&self) -> Option<Apart> {
        let s = self.schedule();
        let peak = s.lr_max.max(s.lr_min);
        self.rounds().find_map(|r| {
            let last = r.end() - 1;
            // The lr rises in warmup and never rises after it: the largest is at either end or warmup's end.
            let lr = s.lr(r.start).max(s.lr(last)).max(s.lr(s.warmup_steps.clamp(r.start, last)));
            round_apart(r.start, r.len, lr, peak, self.end_step())
        })
    }

    /// Refuses a plan whose workers do not meet while the lr is high, naming the rule's setting that
    /// lengthens its rounds (`sync.alpha`, `sync.h`, `sync.h_max`, `sync.h_base`) and the largest
    /// value of it that trains.
    ///
    /// ```
    /// use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
    /// let schedule = LrSchedule::new(ScheduleKind::Cosine, 880, 44, 0.2, 1e-6);
    /// let apart = Plan::new(schedule.clone(), SyncRule::Constant { h: 1000 }).unwrap();
    /// let e = apart.check_meets().unwrap_err();
    /// assert_eq!(e.field, "sync.h");
    /// assert!(e.reason.contains("largest that trains here: 55"), "{e}");
    /// assert!(Plan::new(schedule, SyncRule::Qsr { h_base: 2, alpha: 0.06 }).unwrap().check_meets().is_ok());
    /// ```
    pub fn check_meets(&self) -> Result<(), ConfigError> {
        let Some(apart) = self.first_apart() else {
            return Ok(());
        };
        let (key, largest) = largest_trainable(self);
        let seen = format!(
            "the workers train apart for steps {}..{} at an lr of up to {:.4} ({:.0} steps at the peak lr, above {:.0}, \
             {:.1}% of the run's {} steps) and their average is no model",
            apart.start,
            apart.start + apart.len,
            apart.lr,
            apart.drift,
            apart.limit,
            100.0 * APART_SHARE,
            self.end_step()
        );
        Err(ConfigError::new(format!("sync.{key}"), format!("{seen}; largest that trains here: {largest}")))
    }
}

/// The setting of `plan`'s rule that lengthens its rounds, and the largest value of it under which the
/// plan passes [`Plan::first_apart`] (as text: an alpha with 4 significant digits, rounded down).
fn largest_trainable(plan: &Plan) -> (&'static str, String) {
    let passes = |rule: SyncRule| {
        Plan::from_parts(plan.schedule().clone(), rule, Some(plan.end_step())).is_ok_and(|p| p.first_apart().is_none())
    };
    let h_limit = |make: &dyn Fn(u64) -> SyncRule, from: u64| largest_u64(1, from, |h| passes(make(h)));
    match *plan.sync() {
        SyncRule::Dp => ("h", "1".into()),
        SyncRule::Constant { h } => ("h", h_limit(&|h| SyncRule::Constant { h }, h).to_string()),
        SyncRule::PostLocal { switch_step, h } => {
            ("h", h_limit(&|h| SyncRule::PostLocal { switch_step, h }, h).to_string())
        }
        SyncRule::Exponential { h_base, scaler, h_max } => {
            let rule = |h_max| SyncRule::Exponential { h_base, scaler, h_max };
            if passes(rule(h_base)) {
                ("h_max", largest_u64(h_base, h_max, |h| passes(rule(h))).to_string())
            } else {
                let rule = |h| SyncRule::Exponential { h_base: h, scaler, h_max: h };
                let h = h_limit(&rule, h_base);
                ("h_base", format!("{h} (with sync.h_max = {h})"))
            }
        }
        SyncRule::Qsr { h_base, alpha } => {
            power_limit(h_base, alpha, &|h_base, alpha| SyncRule::Qsr { h_base, alpha }, &passes)
        }
        SyncRule::Power { h_base, alpha, power } => {
            power_limit(h_base, alpha, &|h_base, alpha| SyncRule::Power { h_base, alpha, power }, &passes)
        }
    }
}

/// The largest `alpha` (or, when `h_base` alone keeps the workers apart, `h_base`) that passes.
fn power_limit(
    h_base: u64,
    alpha: f64,
    rule: &dyn Fn(u64, f64) -> SyncRule,
    passes: &dyn Fn(SyncRule) -> bool,
) -> (&'static str, String) {
    match largest_alpha(alpha, |a| passes(rule(h_base, a))) {
        Some(alpha) => ("alpha", format!("{}", round_down(alpha))),
        None => ("h_base", largest_u64(1, h_base, |h| passes(rule(h, alpha * 1e-9))).to_string()),
    }
}

/// The largest alpha up to `from` for which `passes` holds (to about 2^-60 of the bracket), or `None`
/// when even a vanishing alpha (every round at `h_base`) fails.
fn largest_alpha(from: f64, passes: impl Fn(f64) -> bool) -> Option<f64> {
    let (mut lo, mut hi) = (from * 1e-9, from);
    if !passes(lo) {
        return None;
    }
    if passes(hi) {
        return Some(hi);
    }
    for _ in 0..60 {
        let mid = (lo * hi).sqrt();
        if passes(mid) { lo = mid } else { hi = mid }
    }
    Some(lo)
}

/// `x` rounded down to 4 significant digits (so the value offered passes too).
fn round_down(x: f64) -> f64 {
    let scale = 10f64.powi(3 - x.log10().floor() as i32);
    (x * scale).floor() / scale
}

/// The largest `h` in `lo..=hi` with `passes(h)`, where `passes(lo)` holds (a round of one step always
/// meets; an exponential rule at `h_max = h_base` passed before this is asked).
fn largest_u64(lo: u64, hi: u64, passes: impl Fn(u64) -> bool) -> u64 {
    let (mut lo, mut hi) = (lo, hi.max(lo));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if passes(mid) { lo = mid } else { hi = mid - 1 }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LrSchedule, ScheduleKind};

    fn digits() -> LrSchedule {
        LrSchedule::new(ScheduleKind::Cosine, 880, 44, 0.2, 1e-6)
    }

    fn refusal(rule: SyncRule) -> ConfigError {
        Plan::new(digits(), rule).unwrap().check_meets().unwrap_err()
    }

    #[test]
    fn rules_whose_workers_never_meet_are_refused_naming_the_key_and_a_value_that_trains() {
        // The issue's repros: alpha 10, the budget's alpha 5.78, constant H = 1000 (one round after warmup).
        for (rule, key) in [
            (SyncRule::Qsr { h_base: 2, alpha: 10.0 }, "sync.alpha"),
            (SyncRule::Qsr { h_base: 2, alpha: 5.78 }, "sync.alpha"),
            (SyncRule::Constant { h: 1000 }, "sync.h"),
            (SyncRule::PostLocal { switch_step: 100, h: 800 }, "sync.h"),
            (SyncRule::Exponential { h_base: 2, scaler: 1, h_max: 1000 }, "sync.h_max"),
            (SyncRule::Qsr { h_base: 500, alpha: 0.06 }, "sync.h_base"),
        ] {
            let e = refusal(rule.clone());
            assert_eq!(e.field, key, "{rule:?}: {e}");
            // The value offered passes.
            let largest = e.reason.rsplit(": ").next().unwrap();
            let fixed = match rule {
                SyncRule::Qsr { h_base, .. } if key == "sync.alpha" => {
                    SyncRule::Qsr { h_base, alpha: largest.parse().unwrap() }
                }
                SyncRule::Qsr { alpha, .. } => SyncRule::Qsr { h_base: largest.parse().unwrap(), alpha },
                SyncRule::Constant { .. } => SyncRule::Constant { h: largest.parse().unwrap() },
                SyncRule::PostLocal { switch_step, .. } => {
                    SyncRule::PostLocal { switch_step, h: largest.parse().unwrap() }
                }
                SyncRule::Exponential { h_base, scaler, .. } => {
                    SyncRule::Exponential { h_base, scaler, h_max: largest.parse().unwrap() }
                }
                _ => unreachable!(),
            };
            assert!(Plan::new(digits(), fixed.clone()).unwrap().check_meets().is_ok(), "{fixed:?} from {e}");
        }
    }

    #[test]
    fn the_papers_plans_and_qsrs_long_late_rounds_pass() {
        // recipes/imagenet-*: ViT-B (h_base 4 and 8), ResNet-152; and QSR's last round on digits
        // spanning the run's tail at a small lr.
        let vit = LrSchedule::new(ScheduleKind::Cosine, 93_600, 10_000, 0.008, 1e-6);
        let resnet = LrSchedule::new(ScheduleKind::Cosine, 62_400, 1_560, 0.8, 1e-6);
        for (schedule, rule) in [
            (vit.clone(), SyncRule::Qsr { h_base: 4, alpha: 0.0175 }),
            (vit, SyncRule::Qsr { h_base: 8, alpha: 0.0175 }),
            (resnet.clone(), SyncRule::Qsr { h_base: 2, alpha: 0.2 }),
            (resnet, SyncRule::Constant { h: 2 }),
            (digits(), SyncRule::Qsr { h_base: 2, alpha: 0.06 }),
            (digits(), SyncRule::Constant { h: 55 }),
        ] {
            let plan = Plan::new(schedule, rule).unwrap();
            assert_eq!(plan.first_apart(), None, "{:?}", plan.sync());
        }
        let vit = Plan::new(
            LrSchedule::new(ScheduleKind::Cosine, 93_600, 10_000, 0.008, 1e-6),
            SyncRule::Qsr { h_base: 4, alpha: 0.0175 },
        );
        let longest = vit.unwrap().summary().max_h;
        assert!(longest > 100 * APART_FLOOR, "QSR's long late round ({longest} steps) passes");
    }

    #[test]
    fn the_h_max_offered_to_an_exponential_rule_is_at_least_its_h_base() {
        let e = refusal(SyncRule::Exponential { h_base: 40, scaler: 1, h_max: 1000 });
        assert_eq!(e.field, "sync.h_max", "{e}");
        let offered: u64 = e.reason.rsplit(": ").next().unwrap().parse().unwrap();
        assert!(offered >= 40, "{e}");
        let fixed = SyncRule::Exponential { h_base: 40, scaler: 1, h_max: offered };
        assert!(Plan::new(digits(), fixed).unwrap().check_meets().is_ok());
    }

    #[test]
    fn a_round_that_starts_in_warmup_is_judged_by_the_peak_it_reaches() {
        // H = 1000 from step 0: its first step's lr is lr_min, its steps reach lr_max.
        let apart = Plan::new(digits(), SyncRule::Constant { h: 1000 }).unwrap().first_apart().unwrap();
        assert_eq!((apart.start, apart.len), (0, 880));
        assert_eq!(apart.lr, 0.2);
    }

    #[test]
    fn short_rounds_of_toy_runs_pass() {
        let toy = LrSchedule::new(ScheduleKind::Constant, 40, 0, 0.1, 0.1);
        assert!(Plan::new(toy.clone(), SyncRule::Constant { h: APART_FLOOR }).unwrap().check_meets().is_ok());
        assert!(Plan::new(toy, SyncRule::Constant { h: APART_FLOOR + 1 }).unwrap().check_meets().is_err());
    }
}
