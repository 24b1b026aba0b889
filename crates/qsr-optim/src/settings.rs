//! The one check of the sync settings: everything that shapes the syncs (rule and plan, outer step and
//! its unit, streaming, wire, residency, state policy, local level), checked together from the
//! settings alone, with no collective and no model, so a combination is judged once and alike by
//! `qsr plan`, `train`, `compare`, `simulate`, the [`Worker`](crate::Worker) and the
//! [`Averager`](crate::Averager). No other code refuses a sync setting; what the collective can carry
//! (a bf16 wire over MPI) is the collective's to say, when it exists.

use std::fmt;

use qsr_sched::{ConfigError, FragmentPlan, MAX_FRAGMENTS, Plan, StreamingConfig, SyncRule};

use crate::error::OptimError;
use crate::outer::{OuterConfig, OuterUnit};
use crate::sync::{Residency, StatePolicy, Wire};

/// Everything that shapes the syncs of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncSettings {
    /// When rounds end.
    pub rule: SyncRule,
    /// How many workers average: a plan whose workers never meet is refused only when there are
    /// several (one worker trains alone whatever its rounds).
    pub workers: usize,
    /// The run's plan under `rule` (with its local level), where the face has one: the trainer's
    /// Worker does, an [`Averager`](crate::Averager) decides rounds from the caller's lrs as it goes.
    pub plan: Option<Plan>,
    /// The outer optimizer at parameter syncs.
    pub outer: Option<OuterConfig>,
    /// Streaming syncs.
    pub streaming: Option<StreamingConfig>,
    /// The parameter syncs' wire.
    pub wire: Wire,
    /// Where the flat state lives; `Auto` is judged as host (a CPU backend), and a Worker judges its
    /// resolved residency again.
    pub residency: Residency,
    /// Which optimizer moments are averaged at syncs.
    pub state: StatePolicy,
    /// Compare the parameters' fingerprint across ranks after each global average.
    pub fingerprint: bool,
}

impl SyncSettings {
    /// `rule` over `workers` workers alone: plain f32 averages of host-resident state, no plan.
    pub fn new(rule: SyncRule, workers: usize) -> Self {
        Self {
            rule,
            workers,
            plan: None,
            outer: None,
            streaming: None,
            wire: Wire::F32,
            residency: Residency::Host,
            state: StatePolicy::default(),
            fingerprint: false,
        }
    }

    /// Whether parameter syncs stream: a streaming section, or a quantized wire (one fragment).
    pub fn streams(&self) -> bool {
        self.streaming.is_some() || self.wire.codec().is_some()
    }
}

/// How a face spells the settings in its refusals: a recipe's keys, or an `AveragerConfig`'s fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Face {
    /// `qsr`'s recipes and the trainer's Worker: `sync.*`, `outer.*`, `driver.*`.
    Recipe,
    /// An [`AveragerConfig`](crate::AveragerConfig): `rule.*`, `outer.*`, `streaming.*`, `wire`.
    Averager,
}

impl Face {
    /// The face, as a refusal calls its owner.
    pub(crate) fn owner(self) -> &'static str {
        match self {
            Face::Recipe => "worker",
            Face::Averager => "averager",
        }
    }

    /// The key of the wire setting.
    pub(crate) fn wire(self) -> &'static str {
        match self {
            Face::Recipe => "driver.wire",
            Face::Averager => "wire",
        }
    }

    /// The key of the fingerprint check.
    pub(crate) fn fingerprint(self) -> &'static str {
        match self {
            Face::Recipe => "driver.fingerprint",
            Face::Averager => "fingerprint",
        }
    }

    /// The key of the streaming section.
    pub(crate) fn streaming(self) -> &'static str {
        match self {
            Face::Recipe => "sync.streaming",
            Face::Averager => "streaming",
        }
    }

    /// A recipe key (`sync.alpha`, `sync.streaming.mix`) as this face spells it.
    fn key(self, recipe_key: &str) -> String {
        match self {
            Face::Recipe => recipe_key.to_string(),
            Face::Averager => match recipe_key.strip_prefix("sync.streaming") {
                Some(rest) => format!("streaming{rest}"),
                None => recipe_key.replacen("sync.", "rule.", 1),
            },
        }
    }
}

/// A setting refused: its key as the face spells it, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The key (`sync.alpha`, `outer.unit`, `driver.wire`; `wire`, `streaming.mix` for an Averager).
    pub field: String,
    /// Why, with the numbers and what would work.
    pub reason: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid `{}`: {}", self.field, self.reason)
    }
}

impl From<Refusal> for OptimError {
    fn from(r: Refusal) -> Self {
        OptimError::Config { field: r.field, reason: r.reason }
    }
}

/// What [`check_sync`] says of a set of settings: refusals (any one refuses the run) and warnings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncVerdict {
    /// Settings the run cannot train with, in the order checked.
    pub refusals: Vec<Refusal>,
    /// What the settings do differently from what they say, one line each.
    pub warnings: Vec<String>,
    /// The fragment plan of accepted streaming settings under a plan: built here once, for the
    /// callers that show or predict it.
    pub fragments: Option<FragmentPlan>,
}

impl SyncVerdict {
    /// The warnings, or the first refusal as an error.
    pub fn into_result(self) -> Result<Vec<String>, OptimError> {
        match self.refusals.into_iter().next() {
            Some(r) => Err(r.into()),
            None => Ok(self.warnings),
        }
    }
}

/// Checks `settings` as `face` spells them: every refusal and warning of the sync settings.
///
/// ```
/// use qsr_optim::{Face, OuterConfig, OuterUnit, SyncSettings, Wire, check_sync};
/// let mut settings = SyncSettings::new(qsr_optim::SyncRule::Qsr { h_base: 2, alpha: 0.06 }, 4);
/// settings.outer = Some(OuterConfig { unit: OuterUnit::Lr, ..OuterConfig::short_rounds() });
/// settings.wire = Wire::Int8;
/// let verdict = check_sync(&settings, Face::Recipe);
/// assert_eq!(verdict.refusals[0].field, "outer.unit");
/// ```
pub fn check_sync(settings: &SyncSettings, face: Face) -> SyncVerdict {
    let mut v = SyncVerdict::default();
    if let Some(plan) = settings.plan.as_ref().filter(|_| settings.workers > 1)
        && let Err(e) = plan.check_meets()
    {
        v.refusals.push(Refusal { field: face.key(&e.field), reason: e.reason });
    }
    v.refusals.extend(placement_refusals(settings, face));
    if let (Some(outer), Some(plan)) = (&settings.outer, &settings.plan) {
        v.warnings.extend(outer_gain_warning(outer, plan));
    }
    if settings.wire != Wire::F32 && settings.rule.syncs_gradients(u64::MAX) {
        // Issue 56 D12: silently ignored before.
        v.warnings.push(format!(
            "`{}` = \"{}\" carries parameter syncs, which rule `{}` never makes (its gradient all-reduces stay f32): \
             the wire changes nothing",
            face.wire(),
            settings.wire.encoding_name(),
            settings.rule.name()
        ));
    }
    if let Some(streaming) = &settings.streaming {
        match check_streaming(streaming, settings, face) {
            Ok((warnings, fragments)) => {
                v.warnings.extend(warnings);
                v.fragments = fragments;
            }
            Err(r) => v.refusals.push(r),
        }
    }
    v
}

/// What the outer step, the wire and streaming need of each other, of the rule, the residency and
/// the state policy.
fn placement_refusals(settings: &SyncSettings, face: Face) -> Vec<Refusal> {
    let mut refusals = Vec::new();
    let mut refuse = |field: &str, reason: String| refusals.push(Refusal { field: field.into(), reason });
    let host = settings.residency != Residency::Device;
    let on_host = |what: &str| format!("{what} run on host-resident {}s (driver.residency = \"host\")", face.owner());
    if let Some(outer) = &settings.outer {
        if let Err(OptimError::Config { field, reason }) = outer.validate_for(&settings.rule) {
            refuse(&field, reason);
        }
        if !host {
            refuse("outer", on_host("the outer optimizer's steps"));
        }
        if settings.streams() && outer.unit != OuterUnit::Round {
            refuse(
                "outer.unit",
                "streaming and quantized syncs take DiLoCo's outer step per sync (`outer.unit = \"round\"`): a \
                 fragment's sync ends no round"
                    .into(),
            );
        }
    }
    if settings.wire != Wire::F32 && !host {
        refuse(face.wire(), on_host(&format!("{} syncs", settings.wire.encoding_name())));
    }
    if settings.streams() {
        let field = if settings.streaming.is_some() { face.streaming() } else { face.wire() };
        if !host {
            refuse(field, on_host("streaming and quantized syncs"));
        }
        if settings.state.average_first_moment || settings.state.average_second_moment {
            refuse(field, "streaming and quantized syncs do not average optimizer moments (`driver.state`)".into());
        }
    }
    if settings.fingerprint {
        refusals.extend(fingerprint_refusal(settings, face));
    }
    refusals
}

/// The fingerprint check compares the parameters a plain global average leaves equal on every rank,
/// riding in the next average's f32 buffer on the host.
fn fingerprint_refusal(settings: &SyncSettings, face: Face) -> Option<Refusal> {
    let reason = if settings.streams() {
        "streaming and quantized syncs leave the ranks' parameters different between a fragment's syncs; it \
         checks plain averages"
    } else if settings.wire != Wire::F32 {
        "its digits ride in the average's buffer, which a bf16 wire rounds; it needs an f32 wire"
    } else if settings.residency == Residency::Device {
        "it checks host-resident parameters (driver.residency = \"host\")"
    } else if settings.rule.syncs_gradients(u64::MAX) {
        "the rule never averages parameters (its ranks take the same updates); it checks parameter averages"
    } else {
        return None;
    };
    Some(Refusal { field: face.fingerprint().into(), reason: reason.into() })
}

/// At steady state an outer step with per-step momentum `mu` moves `outer_lr / (1 - mu^n)` times the
/// workers' mean displacement over rounds of `n` steps: past this, say so.
const OUTER_GAIN_WARNED: f64 = 2.0;

/// A per-step outer unit whose momentum, taken over the plan's shortest parameter round, amplifies the
/// average's displacement more than [`OUTER_GAIN_WARNED`] times (on the digits MLP's 2-step QSR rounds
/// momentum 0.9 per step, a gain of 3.7, ended at 44-54 % where 0.5, a gain of 0.93, held 94 %).
fn outer_gain_warning(outer: &OuterConfig, plan: &Plan) -> Option<String> {
    if outer.unit == OuterUnit::Round || outer.momentum == 0.0 {
        return None;
    }
    let n = plan.rounds().filter(|r| r.mode == qsr_sched::SyncMode::Parameters).map(|r| r.len).min()?;
    let kept = outer.momentum.powf(n as f64);
    let gain = outer.lr / (1.0 - kept);
    (gain > OUTER_GAIN_WARNED).then(|| {
        format!(
            "outer.momentum = {} per inner step (`outer.unit = \"{}\"`) keeps {:.0}% of its buffer across the plan's \
             {n}-step rounds: at steady state an outer step moves {gain:.1} times the workers' mean displacement; \
             DiLoCo's momentum m per round of H steps is m^(1/H) per step (lower outer.momentum or outer.lr)",
            outer.momentum,
            outer.unit.name(),
            100.0 * kept
        )
    })
}

/// The streaming section against the rule and plan: its own settings, the fragment count, and a
/// `mix` that brings the workers together (its warnings and, under a plan, its fragment plan when it
/// passes).
fn check_streaming(
    streaming: &StreamingConfig,
    s: &SyncSettings,
    face: Face,
) -> Result<(Vec<String>, Option<FragmentPlan>), Refusal> {
    let sched = |e: ConfigError| Refusal { field: face.key(&e.field), reason: e.reason };
    streaming.validate().map_err(sched)?;
    let fragments_key = face.key("sync.streaming.fragments");
    match &s.plan {
        Some(plan) => {
            let fragments = streaming.fragment_plan(plan.clone()).map_err(sched)?;
            Ok((streaming.warnings(&fragments), Some(fragments)))
        }
        None if !(1..=MAX_FRAGMENTS).contains(&streaming.fragments) => Err(Refusal {
            field: fragments_key,
            reason: format!("must be 1..={MAX_FRAGMENTS} (got {})", streaming.fragments),
        }),
        None if streaming.fragments > 1 && s.rule.syncs_gradients(0) => Err(Refusal {
            field: fragments_key,
            reason: format!("needs a rule that averages parameters; `{}` all-reduces gradients", s.rule.name()),
        }),
        None => Ok((Vec::new(), None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 56 D12: a wire the rule never uses (data parallel all-reduces gradients in f32) is said,
    /// not silently ignored.
    #[test]
    fn a_wire_that_a_gradient_rule_never_uses_is_a_warning() {
        let dp = SyncSettings { wire: Wire::Int8, ..SyncSettings::new(SyncRule::Dp, 4) };
        let verdict = check_sync(&dp, Face::Recipe);
        assert!(verdict.refusals.is_empty(), "{:?}", verdict.refusals);
        assert!(verdict.warnings.iter().any(|w| w.contains("`driver.wire`") && w.contains("changes nothing")));
        let qsr = SyncSettings { wire: Wire::Int8, ..SyncSettings::new(SyncRule::Qsr { h_base: 2, alpha: 0.1 }, 4) };
        assert!(check_sync(&qsr, Face::Recipe).warnings.is_empty());
    }

    /// The fingerprint check compares what a plain f32 average of host-resident parameters leaves
    /// equal; elsewhere it is refused naming its key as each face spells it.
    #[test]
    fn the_fingerprint_check_is_refused_where_an_average_leaves_ranks_apart_or_rounds_it() {
        let qsr = SyncRule::Qsr { h_base: 2, alpha: 0.1 };
        let with = |s: SyncSettings| SyncSettings { fingerprint: true, ..s };
        let base = || SyncSettings::new(qsr.clone(), 4);
        assert!(check_sync(&with(base()), Face::Recipe).refusals.is_empty());
        let streaming = Some(StreamingConfig { fragments: 2, delay: 1, mix: 1.0 });
        for (settings, needle) in [
            (SyncSettings { streaming, ..base() }, "streaming"),
            (SyncSettings { wire: Wire::Int8, ..base() }, "quantized"),
            (SyncSettings { wire: Wire::Bf16, ..base() }, "bf16"),
            (SyncSettings { residency: Residency::Device, ..base() }, "host-resident"),
            (SyncSettings::new(SyncRule::Dp, 4), "never averages parameters"),
        ] {
            for (face, key) in [(Face::Recipe, "driver.fingerprint"), (Face::Averager, "fingerprint")] {
                let refusals = check_sync(&with(settings.clone()), face).refusals;
                let r = refusals.iter().find(|r| r.field == key).unwrap_or_else(|| panic!("{key}: {refusals:?}"));
                assert!(r.reason.contains(needle), "{r}");
            }
        }
    }
    use qsr_sched::{LrSchedule, ScheduleKind};

    /// Regression: `qsr time-step` runs one worker under a plan of one round spanning its 35 steps,
    /// and was refused as workers that never meet.
    #[test]
    fn one_worker_is_never_refused_for_long_rounds() {
        let schedule = LrSchedule::new(ScheduleKind::Constant, 35, 0, 1e-3, 1e-3);
        let rule = SyncRule::Constant { h: 35 };
        let plan = Plan::new(schedule, rule.clone()).unwrap();
        let alone = SyncSettings { plan: Some(plan), ..SyncSettings::new(rule, 1) };
        assert_eq!(check_sync(&alone, Face::Recipe), SyncVerdict::default());
        let two = check_sync(&SyncSettings { workers: 2, ..alone }, Face::Recipe);
        assert_eq!(two.refusals[0].field, "sync.h", "{two:?}");
    }
}
