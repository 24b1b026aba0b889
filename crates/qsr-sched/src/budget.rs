//! QSR's `alpha` from a communication budget: the share of data parallel's synchronizations a run can
//! afford, turned into the rule's scale for a given schedule.

use crate::error::ConfigError;
use crate::plan::Plan;
use crate::rule::SyncRule;
use crate::schedule::LrSchedule;

/// Bisection steps: alpha to about 2^-40 of its bracket, far below what changes a round.
const STEPS: u32 = 40;

/// The smallest QSR `alpha` whose plan over `schedule` (for `run_steps`, default the horizon) syncs
/// at most `budget` times as often as data parallel (rounds over steps, as
/// [`PlanSummary::comm_percent`](crate::PlanSummary::comm_percent) / 100): the most synchronizations the
/// budget buys, so the most averaging. Refused, naming `budget`, outside (0, 1]; when `h_base`
/// alone already syncs that seldom (QSR then only lengthens rounds the budget does not need
/// lengthened: lower `h_base`); when no `alpha` gets below it (the warmup's rounds, at `h_base`,
/// already cost more); and when only rounds that keep the workers apart while the lr is high get
/// below it ([`Plan::first_apart`]). The last two offer the least budget that works, rounded up.
///
/// ```
/// use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule, alpha_for_budget};
/// let schedule = LrSchedule::new(ScheduleKind::Cosine, 10_000, 500, 0.1, 0.0);
/// let alpha = alpha_for_budget(&schedule, 2, 0.1, None).unwrap();
/// let plan = Plan::new(schedule, SyncRule::Qsr { h_base: 2, alpha }).unwrap();
/// let share = plan.summary().comm_percent / 100.0;
/// assert!(share <= 0.1 && share > 0.09, "{share}");
/// ```
pub fn alpha_for_budget(
    schedule: &LrSchedule,
    h_base: u64,
    budget: f64,
    run_steps: Option<u64>,
) -> Result<f64, ConfigError> {
    schedule.validate()?;
    let plan = |alpha: f64| Plan::from_parts(schedule.clone(), SyncRule::Qsr { h_base, alpha }, run_steps);
    let share = |alpha: f64| -> Result<f64, ConfigError> { Ok(plan(alpha)?.summary().comm_percent / 100.0) };
    let trains = |alpha: f64| -> Result<bool, ConfigError> { Ok(plan(alpha)?.first_apart().is_none()) };
    least_alpha_within(budget, h_base, (schedule.lr_min, schedule.lr_max), share, trains)
}

/// [`alpha_for_budget`] for any run: `share(alpha)` is the share of data parallel's syncs a run under
/// QSR with `h_base` and `alpha` makes (rounds over steps), `trains(alpha)` whether its workers meet
/// while the lr is high ([`Plan::first_apart`]; [`round_apart`](crate::round_apart) for rounds from
/// other lrs), `lrs` the smallest and largest lr of the run: the planner's budget and qsr-optim's
/// `AveragerConfig::qsr_for_budget` (rounds from the caller's own lrs) use it alike. Refused, naming
/// `budget`, outside (0, 1], when `h_base` alone meets it or keeps the workers apart, and when only
/// rounds that keep them apart meet it: then the least budget that trains is offered.
pub fn least_alpha_within<E: From<ConfigError>>(
    budget: f64,
    h_base: u64,
    (lr_min, lr_max): (f64, f64),
    mut share: impl FnMut(f64) -> Result<f64, E>,
    mut trains: impl FnMut(f64) -> Result<bool, E>,
) -> Result<f64, E> {
    let refuse = |reason: String| Err(E::from(ConfigError::new("budget", reason)));
    if !(budget > 0.0 && budget <= 1.0) {
        return refuse(format!("must be in (0, 1] (got {budget})"));
    }
    // Below the smallest lr of the run: H is h_base on every round.
    let floor = lr_max.min(lr_min).max(f64::MIN_POSITIVE) * 1e-6;
    let at_h_base = share(floor)?;
    if at_h_base <= budget {
        return refuse(format!(
            "h_base = {h_base} alone syncs {:.2} % of data parallel's steps, within the budget of {:.2} %: lower h_base so QSR spends it",
            100.0 * at_h_base,
            100.0 * budget
        ));
    }
    if !trains(floor)? {
        return refuse(format!("h_base = {h_base} alone keeps the workers apart while the lr is high: lower h_base"));
    }
    // Grow the bracket until the budget is met: past a point every round after warmup spans the run.
    let top = lr_max.max(f64::MIN_POSITIVE);
    let mut hi = top;
    while share(hi)? > budget && hi <= top * 1e9 {
        hi *= 4.0;
    }
    let found = if share(hi)? <= budget { Some(bisect(floor, hi, |a| share(a).map(|s| s <= budget))?.1) } else { None };
    if let Some(alpha) = found
        && trains(alpha)?
    {
        return Ok(alpha);
    }
    // No alpha meets the budget (the warmup's rounds cost more), or only rounds that keep the workers
    // apart do: offer the least budget that trains, rounded up so that it does.
    let up = |share: f64| (share * 1e4).ceil() / 1e2;
    if found.is_none() && trains(hi)? {
        return refuse(format!(
            "no alpha syncs that seldom: at least {:.2} % of data parallel's steps (the warmup's rounds at h_base = \
             {h_base}, one round after it)",
            up(share(hi)?)
        ));
    }
    let largest = bisect(floor, hi, |a| trains(a).map(|t| !t))?.0;
    refuse(format!(
        "{:.2} % of data parallel's syncs is too few: the rounds it allows keep the workers apart while the lr is \
         high, which has ended runs near chance (docs/architecture/sched.md); at least {:.2} % keeps them short enough here",
        100.0 * budget,
        up(share(largest)?)
    ))
}

/// Geometric bisection of `(lo, hi)` where `above` is false at `lo` and true at `hi`: the bracket
/// `(last false, first true)` it ends with, about 2^-40 of its width apart.
fn bisect<E>(mut lo: f64, mut hi: f64, mut above: impl FnMut(f64) -> Result<bool, E>) -> Result<(f64, f64), E> {
    for _ in 0..STEPS {
        let mid = (lo * hi).sqrt();
        if above(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;

    fn share(schedule: &LrSchedule, h_base: u64, alpha: f64) -> f64 {
        Plan::new(schedule.clone(), SyncRule::Qsr { h_base, alpha }).unwrap().summary().comm_percent / 100.0
    }

    #[test]
    fn the_alpha_found_meets_the_budget_and_a_smaller_one_does_not() {
        // ViT-B's schedule (the paper's 10.4 % at h_base 4, alpha 0.0175).
        let vit = LrSchedule::new(ScheduleKind::Cosine, 93_600, 10_000, 0.008, 1e-6);
        for (h_base, budget) in [(4, 0.104), (4, 0.2), (8, 0.069), (2, 0.3)] {
            let alpha = alpha_for_budget(&vit, h_base, budget, None).unwrap();
            assert!(share(&vit, h_base, alpha) <= budget, "{h_base} {budget}: {alpha}");
            assert!(share(&vit, h_base, alpha * 0.99) > budget, "{h_base} {budget}: {alpha} is not the least");
        }
        // The paper's own setting comes back near its alpha.
        let alpha = alpha_for_budget(&vit, 4, 0.104, None).unwrap();
        assert!((alpha - 0.0175).abs() < 0.0175 * 0.05, "{alpha}");
    }

    #[test]
    fn budgets_h_base_meets_alone_or_no_alpha_meets_are_refused_naming_the_key() {
        let s = LrSchedule::new(ScheduleKind::Cosine, 1_000, 100, 0.1, 0.0);
        for (h_base, budget, says) in [
            (4, 0.5, "lower h_base"),
            (2, 0.0, "must be in (0, 1]"),
            (2, 1.5, "must be in (0, 1]"),
            (2, 0.01, "too few"),
            // The issue's repro: the digits MLP's schedule, where 2.7 % leaves one round after warmup.
            (2, 0.027, "too few"),
        ] {
            let e = alpha_for_budget(&s, h_base, budget, None).unwrap_err();
            assert_eq!(e.field, "budget");
            assert!(e.reason.contains(says), "{h_base} {budget}: {e}");
        }
    }

    #[test]
    fn the_least_budget_offered_trains() {
        // The digits MLP recipe's schedule: 2.7 % buys alpha 5.78, one round of 836 steps after warmup.
        let digits = LrSchedule::new(ScheduleKind::Cosine, 880, 44, 0.2, 1e-6);
        let e = alpha_for_budget(&digits, 2, 0.027, None).unwrap_err();
        assert_eq!(e.field, "budget");
        let least: f64 = e.reason.split("at least ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        // The value printed, as printed (a percentage with 2 decimals, rounded up).
        let offered = least / 100.0;
        let alpha = alpha_for_budget(&digits, 2, offered, None).unwrap();
        let plan = Plan::new(digits, SyncRule::Qsr { h_base: 2, alpha }).unwrap();
        assert!(plan.check_meets().is_ok(), "{offered}: {alpha}");
    }
}
