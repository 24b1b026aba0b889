//! The `[sync]` schema: the rule, the local level of a two-level run (`[sync.local]`) and streaming
//! (`[sync.streaming]`), with their checks. Every crate takes these types; recipes are read in
//! qsr-train.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::fragment::FragmentPlan;
use crate::plan::Plan;
use crate::rule::SyncRule;
use crate::schedule::LrSchedule;

/// A recipe's `[sync]` section: the sync rule (`sync.rule` and its settings) and, for a two-level
/// run, the local level `[sync.local]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncSection {
    /// The global rule: how often every worker averages.
    #[serde(flatten)]
    pub rule: SyncRule,
    /// The communication budget QSR's `alpha` was chosen from (a recipe's `sync.budget`, a share of
    /// data parallel's syncs: [`alpha_for_budget`](crate::alpha_for_budget)), recorded in the resolved
    /// recipe as `sync.from_budget` beside the alpha it chose, which a resumed run keeps; none when
    /// `alpha` was given. A record, not a setting: the budget itself is read as `sync.budget`.
    #[serde(rename = "from_budget", default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<f64>,
    /// Averaging inside each node between the global syncs (`[sync.local]`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSync>,
    /// The parameters averaged in fragments on staggered steps (`[sync.streaming]`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streaming: Option<StreamingConfig>,
}

impl SyncSection {
    /// A flat section: `rule` alone.
    pub fn flat(rule: SyncRule) -> Self {
        SyncSection { rule, budget: None, local: None, streaming: None }
    }

    /// The plan of this section under `schedule` for a run of `run_steps` (default the horizon).
    pub fn plan(&self, schedule: LrSchedule, run_steps: Option<u64>) -> Result<Plan, ConfigError> {
        let plan = Plan::from_parts(schedule, self.rule.clone(), run_steps)?;
        match &self.local {
            Some(l) => plan.with_local(l.rule.clone()),
            None => Ok(plan),
        }
    }
}

/// `[sync.local]`: the local level of a two-level run (see [`Plan::with_local`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalSync {
    /// The local rule (`sync.local.rule` and its settings, e.g. `rule = "constant"`, `h = 1`); it
    /// averages parameters, so `dp` is refused.
    #[serde(flatten)]
    pub rule: SyncRule,
    /// Workers per node (`sync.local.workers_per_node`): ranks `0..n` form the first node, `n..2n`
    /// the next. Default: the ranks of one host form a node (all simulated workers are one host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers_per_node: Option<usize>,
}

/// `[sync.streaming]`: the parameters averaged in fragments, each once per round on its own step
/// ([`FragmentPlan`]), applied `delay` steps later and blended by `mix` (keys
/// `sync.streaming.<field>`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamingConfig {
    /// Fragments the parameters are averaged in (`sync.streaming.fragments`).
    pub fragments: u32,
    /// Steps a fragment's average runs behind the inner steps before it is applied
    /// (`sync.streaming.delay`, at least 1).
    #[serde(default = "one_step")]
    pub delay: u64,
    /// Weight of the landed average (corrected by the local steps taken since it was sent) against
    /// the local fragment (`sync.streaming.mix`, in (0, 1]; 1 takes the corrected average).
    #[serde(default = "full_mix")]
    pub mix: f64,
}

fn one_step() -> u64 {
    1
}

fn full_mix() -> f64 {
    1.0
}

/// The longest half-life of the workers' differences under `mix`, as a share of the run's syncs per
/// fragment (1/50): each sync keeps `1 - mix` of them, and a mix that takes longer to halve them
/// leaves the workers apart for much of the run. On the digits MLP (220 syncs per fragment, data
/// parallel 94 %) mix 0.014 (a half-life of 49 syncs) ended at 64-68 %, 0.06 at 90 %, 0.146 (the
/// bound) held every evaluation of the second half within 5 points of data parallel's, 0.5 within 1.
const HALF_LIFE_SHARE: f64 = 0.02;

/// The longest half-life of the workers' differences accepted over `syncs` syncs per fragment: a
/// fiftieth of them, and never less than one sync (mix 0.5, Streaming DiLoCo's, always passes).
fn half_life_limit(syncs: f64) -> f64 {
    (HALF_LIFE_SHARE * syncs).max(1.0)
}

impl StreamingConfig {
    /// `fragments` fragments, each average landing one step after its sync, with mix 1.
    pub fn new(fragments: u32) -> Self {
        Self { fragments, delay: 1, mix: 1.0 }
    }

    /// Whether a run under these settings ends with an f32 average of all parameters: the ranks differ
    /// at its end unless one fragment lands in the step that sent it (delay 0: an int8 / fp8 wire
    /// without streaming), replacing the local values.
    pub fn ends_with_average(&self) -> bool {
        self.fragments > 1 || self.mix < 1.0 || self.delay > 0
    }

    /// Checks `delay` and `mix`, naming the key (the fragment count is checked by [`FragmentPlan::new`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.delay == 0 {
            return Err(ConfigError::new("sync.streaming.delay", "must be at least 1 (got 0)"));
        }
        if !(self.mix > 0.0 && self.mix <= 1.0) {
            return Err(ConfigError::new("sync.streaming.mix", format!("must be in (0, 1] (got {})", self.mix)));
        }
        Ok(())
    }

    /// The fragment schedule over `plan`, each refusal naming its key. A `mix` under which the
    /// workers' differences take more than a fiftieth of the run's syncs (per fragment), and more than
    /// one sync, to halve is
    /// refused: each sync keeps `1 - mix` of them, and the workers would stay apart for much of the run.
    pub fn fragment_plan(&self, plan: Plan) -> Result<FragmentPlan, ConfigError> {
        self.validate()?;
        let fragments = FragmentPlan::new(plan, self.fragments)?;
        let syncs = fragments.summary().syncs_per_fragment as f64;
        let half_life = std::f64::consts::LN_2 / -(1.0 - self.mix).ln();
        if syncs > 0.0 && self.mix < 1.0 && half_life > half_life_limit(syncs) {
            let least = self.least_mix(syncs);
            let reason = format!(
                "sync.streaming.mix = {} halves the workers' differences only every {half_life:.0} syncs of the run's \
                 {syncs} per fragment (each sync keeps 1 - mix of them): they stay apart for much of the run; use mix \
                 >= {least:.4}, which halves them within a fiftieth of the syncs or one sync (mix 0.5 is Streaming \
                 DiLoCo's)",
                self.mix
            );
            return Err(ConfigError::new("sync.streaming.mix", reason));
        }
        Ok(fragments)
    }

    /// The least `mix` [`Self::fragment_plan`] accepts over `syncs` syncs per fragment (rounded up to
    /// 4 decimals, so that the value offered passes).
    pub fn least_mix(&self, syncs: f64) -> f64 {
        let least = 1.0 - 0.5f64.powf(1.0 / half_life_limit(syncs));
        (least * 1e4).ceil() / 1e4
    }

    /// What these settings do differently from what they say over `fragments`, one line each (`qsr
    /// plan`, `qsr train` and `qsr simulate` warn): averages that land early, before their delay,
    /// because their fragment syncs again first (rounds shorter than the delay).
    pub fn warnings(&self, fragments: &FragmentPlan) -> Vec<String> {
        let mut warnings = Vec::new();
        let early = fragments.syncs_within(self.delay);
        if early > 0 {
            let shortest = fragments.plan().rounds().map(|r| r.len).min().unwrap_or(0);
            warnings.push(format!(
                "{early} fragment syncs come fewer than sync.streaming.delay = {} steps after their fragment's \
                 previous one (shortest round: {shortest} steps): those averages land early, at the next sync, a \
                 round after they were sent",
                self.delay
            ));
        }
        warnings
    }
}
