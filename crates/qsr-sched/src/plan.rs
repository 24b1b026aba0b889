//! The round planner: a [`Plan`] pairs an lr schedule with a sync rule and a run length, and yields
//! its rounds ([`Rounds`]), their summary ([`PlanSummary`]) and a step-by-step [`Cursor`].

use serde::{Deserialize, Serialize};

use crate::comm::{CommVolume, Encoding};
use crate::error::ConfigError;
use crate::local::{self, LocalPos, LocalSummary};
use crate::round::{Round, SyncMode};
use crate::rule::SyncRule;
use crate::schedule::LrSchedule;

/// The validated pairing of an lr schedule and a sync rule, plus how many steps a run performs
/// (`run_steps`, default the schedule's horizon `total_steps`) and, for a two-level run, the rule of
/// the local level ([`Plan::with_local`]). The one source of truth for "what lr at step t" and "does
/// step t end a round".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PlanSpec", into = "PlanSpec")]
pub struct Plan {
    schedule: LrSchedule,
    sync: SyncRule,
    local: Option<SyncRule>,
    run_steps: Option<u64>,
}

/// Serialized form of [`Plan`]; deserializing goes through [`Plan::from_parts`] so a plan is always valid.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanSpec {
    schedule: LrSchedule,
    sync: SyncRule,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    local: Option<SyncRule>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    run_steps: Option<u64>,
}

impl TryFrom<PlanSpec> for Plan {
    type Error = ConfigError;
    fn try_from(s: PlanSpec) -> Result<Self, Self::Error> {
        let plan = Plan::from_parts(s.schedule, s.sync, s.run_steps)?;
        match s.local {
            Some(rule) => plan.with_local(rule),
            None => Ok(plan),
        }
    }
}

impl From<Plan> for PlanSpec {
    fn from(p: Plan) -> Self {
        PlanSpec { schedule: p.schedule, sync: p.sync, local: p.local, run_steps: p.run_steps }
    }
}

impl Plan {
    /// A plan that runs the whole horizon, `schedule.total_steps` steps.
    pub fn new(schedule: LrSchedule, sync: SyncRule) -> Result<Self, ConfigError> {
        Self::from_parts(schedule, sync, None)
    }

    /// A plan for a run of `run_steps` steps (may be shorter or longer than the lr horizon; the last round
    /// is clamped to end at `run_steps`).
    pub fn from_parts(schedule: LrSchedule, sync: SyncRule, run_steps: Option<u64>) -> Result<Self, ConfigError> {
        schedule.validate()?;
        sync.validate(&schedule)?;
        if run_steps == Some(0) {
            return Err(ConfigError::new("run_steps", "must be at least 1 (got 0)"));
        }
        if let Some(n) = run_steps.filter(|&n| n > crate::MAX_STEPS) {
            return Err(ConfigError::new("run_steps", crate::schedule::too_many_steps(n)));
        }
        Ok(Self { schedule, sync, local: None, run_steps })
    }

    /// This plan with a local level: between global synchronizations, workers average inside their
    /// node after every round of `rule` (a recipe's `[sync.local]`). Local rounds tile each global
    /// round, each taking `H` from `rule` at its first step, clamped to the global round's end; the
    /// local round that ends with the global round has no local average (the global one supersedes it).
    ///
    /// ```
    /// use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
    ///
    /// let schedule = LrSchedule::new(ScheduleKind::Cosine, 100, 0, 0.1, 0.0);
    /// let plan = Plan::new(schedule, SyncRule::Constant { h: 10 }).unwrap();
    /// let plan = plan.with_local(SyncRule::Constant { h: 1 }).unwrap();
    /// let local: Vec<u64> = plan.cursor().filter(|s| s.local_sync_after).map(|s| s.step).collect();
    /// assert_eq!(&local[..10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 10]);
    /// assert_eq!(plan.summary().local.unwrap().rounds, 90);
    /// ```
    ///
    /// # Errors
    ///
    /// An invalid setting of `rule` (named `sync.local.*`), or a rule that all-reduces gradients.
    pub fn with_local(self, rule: SyncRule) -> Result<Plan, ConfigError> {
        local::validate(&rule, self.schedule())?;
        Ok(Plan { local: Some(rule), ..self })
    }

    /// The rule of the local level, for a two-level plan ([`Plan::with_local`]).
    pub fn local(&self) -> Option<&SyncRule> {
        self.local.as_ref()
    }

    /// The lr schedule (the recipe's `[schedule]` section).
    pub fn schedule(&self) -> &LrSchedule {
        &self.schedule
    }

    /// The sync rule (the recipe's `[sync]` section).
    pub fn sync(&self) -> &SyncRule {
        &self.sync
    }

    /// The number of steps the run performs; training ends with a synchronization after step
    /// `end_step() - 1`.
    pub fn end_step(&self) -> u64 {
        self.run_steps.unwrap_or(self.schedule.total_steps)
    }

    /// The scheduled learning rate of global step `t` (0-based); see [`LrSchedule::lr`].
    pub fn lr(&self, t: u64) -> f64 {
        self.schedule.lr(t)
    }

    /// Every round of the run, lazily, in O(1) per round.
    pub fn rounds(&self) -> Rounds<'_> {
        Rounds { plan: self, next_start: 0, index: 0, warm_rounds: 0 }
    }

    /// A cursor at step 0.
    pub fn cursor(&self) -> Cursor {
        let first = self.rounds().next().expect("a valid plan has at least one round");
        let local = self.local.as_ref().map(|rule| LocalPos::first_of(self.schedule(), rule, &first));
        Cursor { plan: self.clone(), step: 0, round: first, warm_rounds: 0, local }
    }

    /// A cursor positioned at global step `step` (which may lie inside a round), as if it had been advanced
    /// from step 0. O(rounds before `step`).
    pub fn cursor_at(&self, step: u64) -> Cursor {
        let mut rounds = self.rounds();
        let mut last = None;
        // The local level: the last local round of the previous global round, walked through.
        let mut local: Option<LocalPos> = None;
        while let Some(r) = rounds.next() {
            let warm = rounds.warm_rounds - u64::from(self.schedule.in_warmup(r.start));
            if let Some(rule) = &self.local {
                let first = match local {
                    Some(l) => l.next(self.schedule(), rule, r.start, r.end()),
                    None => LocalPos::first_of(self.schedule(), rule, &r),
                };
                local = Some(first.seek(self.schedule(), rule, &r, step));
            }
            last = Some((r, warm));
            if step < r.end() {
                break;
            }
        }
        let (round, warm_rounds) = last.expect("a valid plan has at least one round");
        Cursor { plan: self.clone(), step: step.min(self.end_step()), round, warm_rounds, local }
    }

    /// Round count, communication share and the shape of the H schedule, in one pass over the rounds.
    pub fn summary(&self) -> PlanSummary {
        let mut s = PlanSummary {
            rule: self.sync.name().to_string(),
            total_steps: self.schedule.total_steps,
            run_steps: self.end_step(),
            rounds: 0,
            gradient_syncs: 0,
            comm_percent: 0.0,
            first_h: 0,
            first_h_increase_step: None,
            max_h: 0,
            last_round_len: 0,
            local: self
                .local
                .as_ref()
                .map(|rule| LocalSummary::of(self.rounds(), self.schedule(), rule, self.end_step())),
        };
        for r in self.rounds() {
            if r.index == 0 {
                s.first_h = r.len;
            } else if s.first_h_increase_step.is_none() && r.len > s.first_h {
                s.first_h_increase_step = Some(r.start);
            }
            if r.mode == SyncMode::Gradients {
                s.gradient_syncs += 1;
            }
            s.rounds += 1;
            s.max_h = s.max_h.max(r.len);
            s.last_round_len = r.len;
        }
        s.comm_percent = 100.0 * s.rounds as f64 / s.run_steps as f64;
        s
    }
}

/// Iterator over the rounds of a [`Plan`].
#[derive(Debug, Clone)]
pub struct Rounds<'a> {
    plan: &'a Plan,
    next_start: u64,
    index: u64,
    warm_rounds: u64,
}

impl Iterator for Rounds<'_> {
    type Item = Round;

    fn next(&mut self) -> Option<Round> {
        let end = self.plan.end_step();
        if self.next_start >= end {
            return None;
        }
        let round = make_round(self.plan, self.next_start, self.index, self.warm_rounds);
        if self.plan.schedule.in_warmup(round.start) {
            self.warm_rounds += 1;
        }
        self.next_start = round.end();
        self.index += 1;
        Some(round)
    }
}

/// The round that starts at `start`: `H` from the rule, clamped so the run ends on a synchronization.
fn make_round(plan: &Plan, start: u64, index: u64, warm_rounds: u64) -> Round {
    let h = plan.sync.round_h(&plan.schedule, start, index, warm_rounds);
    let mode = if plan.sync.syncs_gradients(start) { SyncMode::Gradients } else { SyncMode::Parameters };
    Round { index, start, len: h.min(plan.end_step() - start), lr_start: plan.schedule.lr(start), mode }
}

/// Aggregate shape of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanSummary {
    /// Name of the sync rule ([`SyncRule::name`]), e.g. `qsr`.
    pub rule: String,
    /// The lr horizon T.
    pub total_steps: u64,
    /// Steps the run performs.
    pub run_steps: u64,
    /// Number of rounds = number of synchronizations.
    pub rounds: u64,
    /// Of `rounds`, how many all-reduce gradients (data-parallel steps).
    pub gradient_syncs: u64,
    /// `100 * rounds / run_steps`: data parallel is 100.
    pub comm_percent: f64,
    /// `H` of the first round.
    pub first_h: u64,
    /// Start of the first round longer than the first one (`None` if H never grows).
    pub first_h_increase_step: Option<u64>,
    /// Longest round, in steps (the largest `H` after clamping).
    pub max_h: u64,
    /// Length of the last round, which may be clamped short to end at `run_steps`.
    pub last_round_len: u64,
    /// The local level of a two-level plan ([`Plan::with_local`]): `rounds` above counts the global
    /// synchronizations only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSummary>,
}

impl PlanSummary {
    /// Bytes each rank sends over the whole run with a ring all-reduce of `params` values in
    /// `encoding` across `world_size` ranks.
    pub fn volume(&self, params: u64, encoding: Encoding, world_size: u64) -> CommVolume {
        CommVolume::new(self.rounds, self.run_steps, params, encoding, world_size)
    }
}

/// What one step of training needs to know, as handed out by [`Cursor`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepInfo {
    /// Global step index (0-based).
    pub step: u64,
    /// The lr of this step.
    pub lr: f64,
    /// Index of the round this step belongs to.
    pub round: u64,
    /// Global step at which that round started (QSR decided its `h` from the lr of this step).
    pub round_start: u64,
    /// Length of that round.
    pub h: u64,
    /// Whether a synchronization follows this step (it is the round's last).
    pub sync_after: bool,
    /// What the synchronization of this step's round all-reduces.
    pub mode: SyncMode,
    /// Whether a local average inside the node follows this step (two-level plans only; never on a
    /// step with `sync_after`, whose global average supersedes it).
    #[serde(default)]
    pub local_sync_after: bool,
}

/// The trainer's position in a plan, advanced one step at a time. Serializable with its plan, so a
/// checkpoint resumes mid-round exactly; a deserialized cursor is checked against its plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "CursorSpec", into = "CursorSpec")]
pub struct Cursor {
    plan: Plan,
    /// The next step to run.
    step: u64,
    /// The round containing `step` (the last round once the run is done).
    round: Round,
    warm_rounds: u64,
    /// The local round containing `step`, for a two-level plan.
    local: Option<LocalPos>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CursorSpec {
    plan: Plan,
    step: u64,
    round: Round,
    warm_rounds: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    local: Option<LocalPos>,
}

impl From<Cursor> for CursorSpec {
    fn from(c: Cursor) -> Self {
        CursorSpec { plan: c.plan, step: c.step, round: c.round, warm_rounds: c.warm_rounds, local: c.local }
    }
}

impl TryFrom<CursorSpec> for Cursor {
    type Error = ConfigError;
    fn try_from(s: CursorSpec) -> Result<Self, ConfigError> {
        let end = s.plan.end_step();
        if s.step > end || s.round.start >= end || s.warm_rounds > s.round.index {
            return Err(ConfigError::new("cursor", format!("position (step {}) lies outside its plan", s.step)));
        }
        let expected = make_round(&s.plan, s.round.start, s.round.index, s.warm_rounds);
        let inside = s.round.start <= s.step && (s.step < s.round.end() || (s.step == end && s.round.end() == end));
        // `lr_start` is derived; compare the structure only (a text format may round the float).
        let same = (expected.index, expected.start, expected.len, expected.mode)
            == (s.round.index, s.round.start, s.round.len, s.round.mode);
        if !same || !inside {
            return Err(ConfigError::new(
                "cursor.round",
                format!("round {} at step {} does not follow from its plan", s.round.index, s.round.start),
            ));
        }
        let local = check_local(&s.plan, s.step, s.local)?;
        Ok(Cursor { plan: s.plan, step: s.step, round: expected, warm_rounds: s.warm_rounds, local })
    }
}

/// The local position of a deserialized cursor: the one its plan reaches at `step`. Recomputed
/// from the plan (O(local rounds before `step`)), so no field of it is trusted.
fn check_local(plan: &Plan, step: u64, local: Option<LocalPos>) -> Result<Option<LocalPos>, ConfigError> {
    let bad = |why: String| Err(ConfigError::new("cursor.local", why));
    let expected = plan.local.as_ref().and_then(|_| plan.cursor_at(step).local);
    let shape = |l: &LocalPos| (l.round.index, l.round.start, l.round.len, l.round.mode, l.warm_rounds);
    match (expected, local) {
        (None, None) => Ok(None),
        (None, Some(_)) => bad("a local position, but its plan has no local level".into()),
        (Some(_), None) => bad("no local position, but its plan has a local level".into()),
        (Some(e), Some(l)) if shape(&e) == shape(&l) => Ok(Some(e)),
        (Some(_), Some(l)) => {
            bad(format!("local round {} at step {} does not follow from its plan", l.round.index, l.round.start))
        }
    }
}

impl Cursor {
    /// The plan the cursor walks.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The next step to run (equals `plan().end_step()` when done).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The round containing the next step.
    pub fn round(&self) -> &Round {
        &self.round
    }

    /// Whether every step of the run has been handed out (`step() == plan().end_step()`).
    pub fn is_done(&self) -> bool {
        self.step >= self.plan.end_step()
    }

    /// Whether the cursor sits at the first step of a round (right after a synchronization, or at 0):
    /// where checkpoints are taken.
    pub fn at_round_start(&self) -> bool {
        self.step == self.round.start || self.is_done()
    }

    /// Hands out the next step and advances; `None` once the run is done. When the handed-out step ends
    /// its round the cursor decides the next round's `H` right away, as the authors' code does after a sync.
    pub fn advance(&mut self) -> Option<StepInfo> {
        if self.is_done() {
            return None;
        }
        let r = self.round;
        let sync_after = self.step + 1 == r.end();
        let info = StepInfo {
            step: self.step,
            lr: self.plan.lr(self.step),
            round: r.index,
            round_start: r.start,
            h: r.len,
            sync_after,
            mode: r.mode,
            local_sync_after: !sync_after && self.local.is_some_and(|l| self.step + 1 == l.round.end()),
        };
        self.step += 1;
        if info.sync_after && !self.is_done() {
            if self.plan.schedule.in_warmup(r.start) {
                self.warm_rounds += 1;
            }
            self.round = make_round(&self.plan, r.end(), r.index + 1, self.warm_rounds);
        }
        if (info.sync_after || info.local_sync_after) && !self.is_done() {
            let (g, plan) = (self.round, &self.plan);
            self.local =
                plan.local.as_ref().zip(self.local).map(|(rule, l)| l.next(plan.schedule(), rule, self.step, g.end()));
        }
        Some(info)
    }
}

impl Iterator for Cursor {
    type Item = StepInfo;
    fn next(&mut self) -> Option<StepInfo> {
        self.advance()
    }
}
