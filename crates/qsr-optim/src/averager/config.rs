//! What an [`Averager`](super::Averager) averages and when: its config, and the rounds it decides
//! from the caller's lrs (the same logic for [`AveragerConfig::round_lengths`] and the averager).

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use qsr_sched::{RoundStart, StreamingConfig, SyncRule};
use serde::{Deserialize, Serialize};

use super::schedule::Schedule;
use crate::error::OptimError;
use crate::outer::OuterConfig;
use crate::settings::SyncSettings;
use crate::sync::Wire;

/// What an [`Averager`](super::Averager) averages and when.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AveragerConfig {
    /// When rounds end: any rule; `dp` and `post-local` (before its switch) average gradients through
    /// [`Averager::average_grads`](super::Averager::average_grads).
    pub rule: SyncRule,
    /// Steps of the caller's lr warmup: the power rules use `h_base` while `step < warmup_steps`.
    pub warmup_steps: u64,
    /// Average BatchNorm running statistics with the parameters (default: they stay local).
    pub average_bn: bool,
    /// Broadcast rank 0's parameters at construction, so every worker starts from the same point
    /// (default; turn off only if every rank built bit-identical weights itself).
    pub broadcast_initial: bool,
    /// Steps the run takes, if known: the last round is cut to end there (with a synchronization), as
    /// the `qsr-sched` planner does. Without it, call [`Averager::finish`](super::Averager::finish) after the last step.
    pub run_steps: Option<u64>,
    /// An outer optimizer (DiLoCo) on the mean pseudo-gradient at every parameter synchronization,
    /// instead of plain averaging (default none). BatchNorm statistics are still averaged plainly.
    pub outer: Option<OuterConfig>,
    /// How a parameter average travels: f32 (default), bf16 (half the bytes, every rank ends with
    /// the same bf16-rounded mean), or int8 / fp8 / int4 / int2 (the pseudo-gradient in blocks with
    /// a scale each, with error feedback, as [`Worker`](crate::Worker) sends them; int2 is MuLoCo's
    /// 2 bits); gradient averages stay f32.
    pub wire: Wire,
    /// Streaming syncs (default none): the parameters in fragments of whole tensors, each synced
    /// once per round at its own step and applied `delay` steps later, blended by `mix`, as the
    /// trainer's `[sync.streaming]` does. A quantized wire without it syncs one fragment at each
    /// round's end, applied at once.
    pub streaming: Option<StreamingConfig>,
    /// Compare a fingerprint of the parameters across ranks after every parameter average (default
    /// off): ranks whose parameters differ fail naming the step ([`OptimError::ParametersDiffer`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fingerprint: bool,
    /// The lr schedule the loop follows, if given ([`Self::schedule`]): the averager judges its plan
    /// before the first step and warns at the first step that leaves it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<Schedule>,
}

impl AveragerConfig {
    /// `rule` with `warmup_steps` of warmup, BN statistics local, rank 0's initial weights.
    pub fn new(rule: SyncRule, warmup_steps: u64) -> Self {
        Self {
            rule,
            warmup_steps,
            average_bn: false,
            broadcast_initial: true,
            run_steps: None,
            outer: None,
            wire: Wire::F32,
            streaming: None,
            fingerprint: false,
            schedule: None,
        }
    }

    /// The lr schedule your loop follows: your burn scheduler `sched` before its first step (a
    /// clone is kept; yours is not stepped), stepped once per step over the `steps` this rank's loop
    /// takes (its shard's batches times the epochs). Sets [`Self::run_steps`] to `steps`. The
    /// averager then judges the whole plan before the first step (a scheduler sized for more steps
    /// than the loop takes, one lr throughout, an lr that rises again, a round that keeps the workers
    /// apart), warns at the first step whose lr is not the schedule's (the peak passed instead, a
    /// scheduler stepped twice) and when the syncs run ahead of the plan, and
    /// [`Averager::finish`](super::Averager::finish) reports the syncs made against those planned.
    /// The ranks compare their schedules at construction.
    ///
    /// ```
    /// use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    /// let sched = CosineAnnealingLrSchedulerConfig::new(0.1, 1000).init().unwrap();
    /// let config = qsr_optim::AveragerConfig::qsr(2, 0.02).schedule(&sched, 1000);
    /// assert_eq!(config.run_steps, Some(1000));
    /// ```
    pub fn schedule<S: Clone + Into<ModuleLrScheduler>>(mut self, sched: &S, steps: usize) -> Self {
        let steps = steps as u64;
        self.run_steps = Some(steps);
        self.schedule = Some(Schedule::new(sched.clone().into(), steps));
        self
    }

    /// QSR without warmup: `H = max(h_base, floor((alpha / lr)^2))` at each round's start.
    pub fn qsr(h_base: u64, alpha: f64) -> Self {
        Self::new(SyncRule::Qsr { h_base, alpha }, 0)
    }

    /// Data parallel: gradients averaged every step ([`Averager::average_grads`](super::Averager::average_grads) before each
    /// optimizer step), the baseline a local method is compared with.
    ///
    /// ```
    /// let config = qsr_optim::AveragerConfig::dp();
    /// assert_eq!(config.rule, qsr_optim::SyncRule::Dp);
    /// assert_eq!(config.round_lengths([0.1; 5]).unwrap(), [1, 1, 1, 1, 1]);
    /// ```
    pub fn dp() -> Self {
        Self::new(SyncRule::Dp, 0)
    }

    /// QSR whose `alpha` spends at most `budget` of data parallel's synchronizations (a share in
    /// (0, 1]: 0.1 syncs a tenth as often) over a run whose steps use `lrs`, the first `warmup_steps`
    /// of them warmup: the smallest such `alpha`, so the most averaging the budget buys. `lrs` is your
    /// own schedule sampled step by step, as for [`Self::round_lengths`]. Refused, naming `budget`, for
    /// a share `h_base` alone already meets (lower `h_base`: QSR then lengthens rounds the budget does
    /// not ask for), and for one that only rounds keeping the workers apart while the lr is high meet
    /// ([`Self::first_apart`]; the refusal offers the least budget that trains).
    ///
    /// ```
    /// use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    /// let mut sched = CosineAnnealingLrSchedulerConfig::new(0.1, 1000).init().unwrap();
    /// let lrs: Vec<f64> = (0..1000).map(|_| sched.step().base()).collect();
    /// let config = qsr_optim::AveragerConfig::qsr_for_budget(2, 0.1, 0, &lrs).unwrap();
    /// let syncs = config.round_lengths(lrs.iter().copied()).unwrap().len();
    /// assert!(syncs <= 100 && syncs > 90, "{syncs} syncs for a budget of 100");
    /// ```
    pub fn qsr_for_budget(h_base: u64, budget: f64, warmup_steps: u64, lrs: &[f64]) -> Result<Self, OptimError> {
        let config = |alpha| Self::new(SyncRule::Qsr { h_base, alpha }, warmup_steps);
        let finite = lrs.iter().copied().filter(|lr| lr.is_finite() && *lr > 0.0);
        let range = finite.fold((f64::INFINITY, 0.0f64), |(lo, hi), lr| (lo.min(lr), hi.max(lr)));
        if range.1 == 0.0 {
            return Err(OptimError::Config { field: "lr".into(), reason: "no finite positive learning rate".into() });
        }
        let share = |alpha| config(alpha).round_lengths(lrs.iter().copied()).map(|r| r.len() as f64 / lrs.len() as f64);
        let trains = |alpha| config(alpha).first_apart(lrs).map(|a| a.is_none());
        Ok(config(qsr_sched::least_alpha_within(budget, h_base, range, share, trains)?))
    }

    /// The first round an [`Averager`](super::Averager) with this config makes over `lrs` (as [`Self::round_lengths`])
    /// that keeps the workers apart too long while the lr is high, judged as the planner judges its
    /// rounds ([`qsr_sched::round_apart`]: its drift in steps at the peak of `lrs`).
    pub fn first_apart(&self, lrs: &[f64]) -> Result<Option<qsr_sched::Apart>, OptimError> {
        let peak = lrs.iter().copied().filter(|lr| lr.is_finite()).fold(0.0, f64::max);
        let mut start = 0;
        for len in self.round_lengths(lrs.iter().copied())? {
            let steps = &lrs[start as usize..(start + len) as usize];
            let lr = steps.iter().copied().filter(|lr| lr.is_finite()).fold(0.0, f64::max);
            if let Some(apart) = qsr_sched::round_apart(start, len, lr, peak, lrs.len() as u64) {
                return Ok(Some(apart));
            }
            start += len;
        }
        Ok(None)
    }

    /// The sync settings of this config over `workers` workers, as [`check_sync`](crate::check_sync)
    /// judges them (host-resident, no plan: the rounds come from the caller's lrs).
    pub fn sync_settings(&self, workers: usize) -> SyncSettings {
        SyncSettings {
            outer: self.outer,
            streaming: self.streaming,
            wire: self.wire,
            fingerprint: self.fingerprint,
            ..SyncSettings::new(self.rule.clone(), workers)
        }
    }

    /// The length of each round an [`Averager`](super::Averager) with this config makes over a run whose steps use
    /// `lrs` (one per step, in order; the last round cut at the run's end): the plan of your own
    /// schedule, e.g. a clone of your burn `LrScheduler` sampled step by step. Its `len()` is the
    /// number of synchronizations such a run makes (with `run_steps` set, or `finish` at the end).
    ///
    /// ```
    /// use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    /// let mut sched = CosineAnnealingLrSchedulerConfig::new(0.1, 1000).init().unwrap();
    /// let config = qsr_optim::AveragerConfig::qsr(2, 0.02);
    /// let rounds = config.round_lengths((0..1000).map(|_| sched.step().base())).unwrap();
    /// assert_eq!(rounds.iter().sum::<u64>(), 1000);
    /// assert!(rounds.len() < 500, "{} syncs: fewer than every other step", rounds.len());
    /// ```
    pub fn round_lengths(&self, lrs: impl IntoIterator<Item = f64>) -> Result<Vec<u64>, OptimError> {
        let mut rounds_after_warmup = 0;
        let mut starts = Vec::new();
        let mut end = 0;
        let mut steps = 0;
        for (t, lr) in (0..).zip(lrs) {
            if t >= end {
                end = self.round_at(t, lr, &mut rounds_after_warmup)?.end;
                starts.push(t);
            }
            steps = t + 1;
        }
        starts.push(steps);
        Ok(starts.windows(2).map(|w| w[1] - w[0]).collect())
    }

    /// The round that starts at step `t` with learning rate `lr` (QSR: `H` from it after warmup). An
    /// lr of 0 (a scheduler that ends at 0) makes the round last to the run's end: QSR's `H` for
    /// lr 0, whose steps move nothing apart (issue 57: it was refused).
    pub(super) fn round_at(&self, t: u64, lr: f64, rounds_after_warmup: &mut u64) -> Result<RoundSpan, OptimError> {
        let in_warmup = t < self.warmup_steps;
        if self.rule.power().is_some() && !in_warmup && !(lr.is_finite() && lr >= 0.0) {
            return Err(OptimError::Config {
                field: "lr".into(),
                reason: format!("step {t}: the power rules need a finite, non-negative learning rate, got {lr}"),
            });
        }
        let h = self.rule.h_at(RoundStart { step: t, lr, in_warmup, rounds_after_warmup: *rounds_after_warmup });
        *rounds_after_warmup += u64::from(!in_warmup);
        let end = t.saturating_add(h).min(self.run_steps.unwrap_or(u64::MAX));
        Ok(RoundSpan { start: t, h, end })
    }
}

/// The round under way: steps `start..end`, of length `h` unless cut at the run's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct RoundSpan {
    pub(super) start: u64,
    pub(super) h: u64,
    pub(super) end: u64,
}
