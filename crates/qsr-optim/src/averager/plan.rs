//! The caller's own lr schedule ([`AveragerConfig::schedule`]): the plan it makes, judged whole at
//! construction, then followed beside the loop, so that an lr that is not the schedule's, and syncs
//! that run ahead of the plan, are warned at the step they happen rather than at the run's end.

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use qsr_sched::SyncRule;

use super::config::AveragerConfig;
use super::schedule::Schedule;
use crate::error::OptimError;
use crate::lr_watch::LrWatch;

impl AveragerConfig {
    /// The warnings [`Averager::new`](super::Averager::new) gives a [`schedule`](Self::schedule) whose
    /// steps use `lrs` (one per step of the run), for a caller that holds lrs rather than a scheduler
    /// of its own (burn-train's Learner strategy samples its Learner's): a scheduler sized for more
    /// steps than the run takes, one lr throughout, an lr that rises again, a round that keeps the
    /// workers apart while the lr is high. Empty when the plan is sound.
    ///
    /// ```
    /// let config = qsr_optim::AveragerConfig::qsr(2, 5.0); // alpha far too large
    /// let warnings = config.schedule_warnings(vec![0.1; 100]).unwrap();
    /// assert!(warnings.iter().any(|w| w.contains("keeps the workers apart")), "{warnings:?}");
    /// ```
    pub fn schedule_warnings(&self, lrs: Vec<f64>) -> Result<Vec<String>, OptimError> {
        let schedule = Schedule::of_lrs(lrs);
        let config = AveragerConfig { run_steps: Some(schedule.steps()), ..self.clone() };
        Ok(Plan::new(&config, &schedule)?.1)
    }
}

/// The schedule followed beside the loop: the lr each step should pass and the syncs planned so far.
pub(super) struct Plan {
    /// The schedule after `t` steps.
    sched: ModuleLrScheduler,
    t: u64,
    steps: u64,
    round_end: u64,
    rounds_after_warmup: u64,
    /// Syncs planned in the first `t` steps, and in the whole run.
    syncs: u64,
    total: u64,
    /// A step passed another lr than the schedule's (warned once): the rounds left the plan.
    off_plan: bool,
    warned_ahead: bool,
}

impl Plan {
    /// The plan `config`'s schedule makes, at its first step, and the warnings its lrs give as a
    /// whole (a schedule sized for more steps than the loop takes, one lr throughout, an lr that
    /// rises again, a round that keeps the workers apart): given before the first step.
    pub(super) fn new(config: &AveragerConfig, schedule: &Schedule) -> Result<(Self, Vec<String>), OptimError> {
        if config.run_steps != Some(schedule.steps()) {
            return Err(OptimError::Config {
                field: "run_steps".into(),
                reason: format!(
                    "{:?}, but the schedule is for {} steps: set both through `AveragerConfig::schedule`",
                    config.run_steps,
                    schedule.steps()
                ),
            });
        }
        // The lrs and the rounds judged as the averager's own watch judges them during a run.
        let steps = schedule.steps();
        let mut watch = LrWatch::default();
        let lr_driven = config.rule.power().is_some();
        let mut warnings: Vec<String> =
            (0..).zip(schedule.lrs()).filter_map(|(t, lr)| watch.observe(t, lr, None, lr_driven)).collect();
        warnings.extend(watch.at_end());
        let mut plan = Self::at_start(schedule);
        for t in 0..steps {
            let (lr, started) = plan.advance(config)?;
            if started.is_some() && !config.rule.syncs_gradients(t) && t >= config.warmup_steps {
                warnings.extend(watch.round(t, plan.round_end - t, lr, steps));
            }
        }
        warnings.extend(few_longer_rounds(config, plan.syncs, steps));
        Ok((Self { total: plan.syncs, ..Self::at_start(schedule) }, warnings))
    }

    fn at_start(schedule: &Schedule) -> Self {
        Self {
            sched: schedule.scheduler(),
            t: 0,
            steps: schedule.steps(),
            round_end: 0,
            rounds_after_warmup: 0,
            syncs: 0,
            total: 0,
            off_plan: false,
            warned_ahead: false,
        }
    }

    /// Steps the schedule once: step `t`'s lr, and the `H` of a planned round that starts at it.
    fn advance(&mut self, config: &AveragerConfig) -> Result<(f64, Option<u64>), OptimError> {
        let (t, lr) = (self.t, self.sched.step().base());
        let mut started = None;
        if t >= self.round_end {
            let round = config.round_at(t, lr, &mut self.rounds_after_warmup).map_err(schedule_error)?;
            self.round_end = round.end;
            started = Some(round.h);
        }
        self.t += 1;
        self.syncs += u64::from(self.t == self.round_end);
        Ok((lr, started))
    }

    /// Step `t`'s lr from the schedule, for a loop that passes none ([`Averager::step`](super::Averager::step));
    /// past the schedule's steps, the scheduler stepped on.
    pub(super) fn next_lr(&mut self, config: &AveragerConfig, t: u64) -> Result<f64, OptimError> {
        while self.t < t {
            self.advance(config)?;
        }
        if t < self.steps {
            return Ok(self.advance(config)?.0);
        }
        self.t += 1;
        Ok(self.sched.step().base())
    }

    /// Follows the loop's step `t`, which passed `lr`: a warning, once, at the first lr that is
    /// not the schedule's. Steps past the schedule's end are not compared.
    pub(super) fn follow(&mut self, config: &AveragerConfig, t: u64, lr: f64) -> Result<Option<String>, OptimError> {
        if t >= self.steps || t != self.t {
            return Ok(None);
        }
        let (planned, _) = self.advance(config)?;
        if self.off_plan || lr.to_bits() == planned.to_bits() {
            return Ok(None);
        }
        self.off_plan = true;
        let (lr, planned) = told_apart(lr, planned);
        Ok(Some(format!(
            "step {} passed lr {lr}, but the schedule given to `AveragerConfig::schedule` has {planned} there: the \
             rounds follow the lr passed, so they leave the plan of {} syncs; pass each step the lr your scheduler \
             gave it (`sched.step()`, not its peak), and step the scheduler once per step",
            t + 1,
            self.total
        )))
    }

    /// After `done` steps: a warning, once, when the syncs `made` so far run ahead of the plan's.
    /// Syncs off a plan the loop's lrs left (warned) follow those lrs, and past the schedule's
    /// steps every step averages (warned as a step past `run_steps`).
    pub(super) fn check_syncs(&mut self, made: u64, done: u64) -> Option<String> {
        if made <= self.syncs || self.warned_ahead || self.off_plan || done > self.steps {
            return None;
        }
        self.warned_ahead = true;
        Some(format!(
            "{made} syncs after {} steps, where the schedule plans {} (of {} in the run): the syncs run ahead of the \
             plan (an lr other than the schedule's, or `average_now` between rounds)",
            self.t, self.syncs, self.total
        ))
    }

    /// Whether the loop has passed the schedule's lrs so far: the plan was judged whole at the start.
    pub(super) fn on_plan(&self) -> bool {
        !self.off_plan
    }

    /// Whether the loop was warned that its lrs or syncs left the plan.
    pub(super) fn warned(&self) -> bool {
        self.off_plan || self.warned_ahead
    }

    /// Syncs the whole run plans.
    pub(super) fn total(&self) -> u64 {
        self.total
    }

    /// The steps the loop takes.
    pub(super) fn steps(&self) -> u64 {
        self.steps
    }

    /// Moves to step `t` of a resumed run (the schedule stepped `t` times from its start).
    pub(super) fn resume_at(&mut self, config: &AveragerConfig, t: u64) -> Result<(), OptimError> {
        while self.t < t.min(self.steps) {
            self.advance(config)?;
        }
        Ok(())
    }
}

/// A power rule whose `alpha` lengthens so few rounds over the schedule that the run makes at least 90 %
/// of the syncs of a constant `H = h_base`: QSR then saves nearly nothing, which the end-of-run count
/// (`planned` syncs, as planned) does not show.
fn few_longer_rounds(config: &AveragerConfig, planned: u64, steps: u64) -> Option<String> {
    let (h_base, alpha, power) = match config.rule {
        SyncRule::Qsr { h_base, alpha } => (h_base, alpha, 2.0),
        SyncRule::Power { h_base, alpha, power } => (h_base, alpha, power),
        _ => return None,
    };
    let constant = steps.div_ceil(h_base.max(1));
    if steps == 0 || planned * 10 < constant * 9 {
        return None;
    }
    let below = alpha / ((h_base + 1) as f64).powf(1.0 / power);
    Some(format!(
        "alpha = {alpha} lengthens few rounds: {planned} syncs, where a constant H = h_base = {h_base} makes {constant} \
         (a round outlasts h_base only below lr {}); for fewer syncs late in the run raise alpha, or pick it \
         from a share of data parallel's syncs (`AveragerConfig::qsr_for_budget`)",
        crate::lr_watch::short(below)
    ))
}

/// `a` and `b` with the fewest significant digits, at least 3, that tell them apart: the trial's
/// warning compared "lr 0.05" with "0.04999916334793503".
fn told_apart(a: f64, b: f64) -> (String, String) {
    use crate::lr_watch::significant;
    (3..=17)
        .map(|d| (significant(a, d), significant(b, d)))
        .find(|(x, y)| x != y)
        .unwrap_or_else(|| (a.to_string(), b.to_string()))
}

fn schedule_error(e: OptimError) -> OptimError {
    match e {
        OptimError::Config { reason, .. } => OptimError::Config { field: "schedule".into(), reason },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::told_apart;

    #[test]
    fn an_lr_off_the_schedule_is_printed_with_the_digits_that_tell_it_apart() {
        assert_eq!(told_apart(0.05, 0.04999916334793503), ("0.05".into(), "0.049999".into()));
        assert_eq!(told_apart(0.1, 0.2), ("0.1".into(), "0.2".into()));
        assert_eq!(told_apart(1e-3, 1.5e-3), ("0.001".into(), "0.0015".into()));
    }
}
