//! TOML recipes: the `[schedule]` and `[sync]` sections (documented on [`load_plan`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qsr_sched::{ConfigError, FragmentPlan, LrSchedule, Plan, SyncRule};
use serde::{Deserialize, Serialize};
use toml::{Table, Value};

/// A recipe's `[sync]` section: the sync rule (`sync.rule` and its settings) and, for a two-level
/// run, the local level `[sync.local]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncSection {
    /// The global rule: how often every worker averages.
    #[serde(flatten)]
    pub rule: SyncRule,
    /// Averaging inside each node between the global syncs (`[sync.local]`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSync>,
    /// The parameters averaged in fragments on staggered steps (`[sync.streaming]`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streaming: Option<StreamingSync>,
}

/// `[sync.streaming]`: the parameters averaged in fragments, each once per round on its own step
/// ([`FragmentPlan`]), applied `delay` steps later and blended by `mix` (the driver's settings).
pub use qsr_optim::StreamingConfig as StreamingSync;

/// Of the workers' differences, the most that may be left after a run's syncs under `mix`: less
/// than three halvings' worth (e^-3) means the final average mixes models that never came together.
const MIX_LEFT_REFUSED: f64 = 0.05;

/// The fragment schedule of `streaming` over `plan`, each refusal naming its key. A `mix` under which
/// the run's syncs leave more than 5 % of the workers' differences is refused (N8): each sync keeps
/// `1 - mix` of them.
pub fn fragment_plan(streaming: &StreamingSync, plan: Plan) -> Result<FragmentPlan> {
    streaming.validate()?;
    let fragments = FragmentPlan::new(plan, streaming.fragments)?;
    let syncs = fragments.summary().syncs_per_fragment;
    let left = (1.0 - streaming.mix).powf(syncs as f64);
    if syncs > 0 && left > MIX_LEFT_REFUSED {
        let least = 1.0 - MIX_LEFT_REFUSED.powf(1.0 / syncs as f64);
        bail!(
            "sync.streaming.mix = {} cannot bring the workers together: each of the run's {syncs} syncs per \
             fragment keeps 1 - mix of their differences, {:.0}% after them all, and the run ends averaging \
             models that never agreed; use mix >= {least:.4} (mix 0.5 is Streaming DiLoCo's)",
            streaming.mix,
            100.0 * left
        );
    }
    Ok(fragments)
}

/// What a runnable `[sync.streaming]` does differently from its settings over `fragments`, one line
/// each, as `qsr plan`, `qsr train` and `qsr simulate` warn: averages that land early, before their
/// delay, because their fragment syncs again first (rounds shorter than the delay); a `mix` that
/// takes more than a tenth of the run's syncs to halve the workers' differences.
pub fn streaming_warnings(set: &StreamingSync, fragments: &FragmentPlan) -> Vec<String> {
    let mut warnings = Vec::new();
    let early = fragments.syncs_within(set.delay);
    if early > 0 {
        let shortest = fragments.plan().rounds().map(|r| r.len).min().unwrap_or(0);
        warnings.push(format!(
            "{early} fragment syncs come fewer than sync.streaming.delay = {} steps after their fragment's \
             previous one (shortest round: {shortest} steps): those averages land early, at the next sync, a \
             round after they were sent",
            set.delay
        ));
    }
    let syncs = fragments.summary().syncs_per_fragment as f64;
    let half_life = std::f64::consts::LN_2 / -(1.0 - set.mix).ln();
    if syncs > 0.0 && set.mix < 1.0 && half_life > syncs / 10.0 {
        let least = 1.0 - 0.5f64.powf(10.0 / syncs);
        warnings.push(format!(
            "sync.streaming.mix = {} halves the workers' differences only every {half_life:.0} syncs of the \
             run's {syncs}: they drift apart for much of the run (mix >= {least:.3} halves them within a tenth)",
            set.mix
        ));
    }
    warnings
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

impl SyncSection {
    /// A flat section: `rule` alone.
    pub fn flat(rule: SyncRule) -> Self {
        SyncSection { rule, local: None, streaming: None }
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

/// Keys each sync rule accepts, so switching the rule from the command line keeps what still applies.
fn rule_keys(rule: &str) -> &'static [&'static str] {
    match rule {
        "constant" => &["h"],
        "post-local" => &["switch_step", "h"],
        "power" => &["h_base", "alpha", "power"],
        "qsr" => &["h_base", "alpha"],
        "exponential" => &["h_base", "scaler", "h_max"],
        _ => &[],
    }
}

/// Makes `rule` the `[sync]` table's rule, dropping the settings of the old rule that the new one does
/// not take (`--sync` and `--set sync.rule=...`: a qsr recipe switched to dp keeps no `alpha`).
pub(super) fn switch_rule(sync: &mut Table, rule: &str) {
    let old = sync.get("rule").and_then(Value::as_str).map(str::to_string);
    if old.as_deref() != Some(rule) {
        let keep = rule_keys(rule);
        sync.retain(|k, _| keep.contains(&k) || k == "local" || k == "streaming");
        if rule == "power" && !sync.contains_key("power") && old.as_deref() == Some("qsr") {
            sync.insert("power".into(), Value::Float(2.0));
        }
    }
    sync.insert("rule".into(), Value::String(rule.to_string()));
}

/// Where each setting can come from, for error messages.
fn flag_for(key: &str) -> Option<&'static str> {
    Some(match key {
        "kind" => "--schedule",
        "total_steps" => "--total-steps",
        "warmup_steps" => "--warmup-steps",
        "lr_max" => "--lr-max",
        "lr_min" => "--lr-min",
        "decay_points" => "--decay-points",
        "decay_gamma" => "--decay-gamma",
        "rule" => "--sync",
        "h_base" => "--h-base",
        "alpha" => "--alpha",
        "power" => "--power",
        "switch_step" => "--switch-step",
        "h" => "--h",
        "scaler" => "--scaler",
        "h_max" => "--h-max",
        _ => return None,
    })
}

/// Overrides of schedule and sync settings, one per command-line flag (`None` = keep the recipe's).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PlanOverrides {
    /// Horizon T of the lr schedule, in steps.
    #[arg(long)]
    pub total_steps: Option<u64>,
    /// Steps of linear warmup from lr_min to lr_max.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Peak learning rate, reached at the end of warmup.
    #[arg(long)]
    pub lr_max: Option<f64>,
    /// Learning rate at the start of warmup and at the end of a cosine or linear decay.
    #[arg(long)]
    pub lr_min: Option<f64>,
    /// cosine, linear, step or constant.
    #[arg(long = "schedule")]
    pub schedule_kind: Option<String>,
    /// Comma-separated steps at which a `step` schedule decays.
    #[arg(long, value_delimiter = ',')]
    pub decay_points: Option<Vec<u64>>,
    /// Factor a `step` schedule multiplies the lr by at each decay point.
    #[arg(long)]
    pub decay_gamma: Option<f64>,
    /// dp, constant, post-local, power, qsr (= power 2) or exponential.
    #[arg(long = "sync")]
    pub rule: Option<String>,
    /// Power, qsr and exponential rules: smallest H, used for rounds that start in warmup.
    #[arg(long)]
    pub h_base: Option<u64>,
    /// Power and qsr rules: scale alpha in H = max(h_base, floor((alpha / lr)^power)).
    #[arg(long)]
    pub alpha: Option<f64>,
    /// Power rule: exponent of alpha / lr (qsr is power 2).
    #[arg(long)]
    pub power: Option<f64>,
    /// Post-local rule: step at which rounds switch from data parallel to local.
    #[arg(long)]
    pub switch_step: Option<u64>,
    /// H of the constant and post-local rules.
    #[arg(long)]
    pub h: Option<u64>,
    /// Exponential rule: rounds between doublings.
    #[arg(long)]
    pub scaler: Option<u64>,
    /// Exponential rule: largest H.
    #[arg(long)]
    pub h_max: Option<u64>,
    /// Steps the run performs, if not the whole horizon.
    #[arg(long)]
    pub run_steps: Option<u64>,
}

/// A recipe's schedule and sync rule after overrides, validated.
#[derive(Debug, Clone)]
pub struct PlanRecipe {
    /// The recipe's `name`, or its file stem, or `flags`.
    pub name: String,
    /// The recipe file it was read from; `None` when the plan comes from flags only.
    pub source: Option<PathBuf>,
    /// The validated round plan: schedule, sync rule and run length.
    pub plan: Plan,
    /// `[sync.streaming]`'s settings and fragment schedule over `plan`, where the recipe has them.
    pub streaming: Option<(StreamingSync, FragmentPlan)>,
}

/// Reads a recipe file as a TOML table, naming the file in every error.
pub(crate) fn read_table(path: &Path) -> Result<Table> {
    let text = crate::files::read_text(path, crate::files::RECIPE_BYTES, "recipe")?;
    text.parse::<Table>().with_context(|| format!("recipe {} is not valid TOML", path.display()))
}

fn section<'a>(root: &'a mut Table, name: &str) -> Result<&'a mut Table> {
    let v = root.entry(name).or_insert_with(|| Value::Table(Table::new()));
    v.as_table_mut().ok_or_else(|| anyhow!("`{name}` must be a table ([{name}])"))
}

impl PlanOverrides {
    /// Applies the flags to a recipe table in place.
    pub fn apply(&self, root: &mut Table) -> Result<()> {
        let sched = section(root, "schedule")?;
        let set = |t: &mut Table, k: &str, v: Option<Value>| {
            if let Some(v) = v {
                t.insert(k.to_string(), v);
            }
        };
        let int = |v: Option<u64>| v.map(|x| Value::Integer(x.min(i64::MAX as u64) as i64));
        let float = |v: Option<f64>| v.map(Value::Float);
        if let Some(kind) = &self.schedule_kind {
            if kind != "step" && self.decay_points.is_none() {
                sched.remove("decay_points");
            }
            sched.insert("kind".into(), Value::String(kind.clone()));
        }
        set(sched, "total_steps", int(self.total_steps));
        set(sched, "warmup_steps", int(self.warmup_steps));
        set(sched, "lr_max", float(self.lr_max));
        set(sched, "lr_min", float(self.lr_min));
        set(sched, "decay_gamma", float(self.decay_gamma));
        if let Some(points) = &self.decay_points {
            let arr = points.iter().map(|&p| Value::Integer(p.min(i64::MAX as u64) as i64)).collect();
            sched.insert("decay_points".into(), Value::Array(arr));
        }

        let sync = section(root, "sync")?;
        if let Some(rule) = &self.rule {
            switch_rule(sync, rule);
        }
        set(sync, "h_base", int(self.h_base));
        set(sync, "alpha", float(self.alpha));
        set(sync, "power", float(self.power));
        set(sync, "switch_step", int(self.switch_step));
        set(sync, "h", int(self.h));
        set(sync, "scaler", int(self.scaler));
        set(sync, "h_max", int(self.h_max));
        Ok(())
    }
}

/// Deserializes one section, prefixing its errors with the section and, for a missing setting, the flag
/// that provides it.
fn parse_section<T: serde::de::DeserializeOwned>(root: &Table, name: &str, origin: &str) -> Result<T> {
    let table = root.get(name).cloned().unwrap_or_else(|| Value::Table(Table::new()));
    // The local level's and streaming's own errors name them.
    if name == "sync"
        && let Some(local) = table.get("local")
    {
        parse_section::<LocalSync>(
            &Table::from_iter([("sync.local".to_string(), local.clone())]),
            "sync.local",
            origin,
        )?;
    }
    if name == "sync"
        && let Some(streaming) = table.get("streaming")
    {
        let table = Table::from_iter([("sync.streaming".to_string(), streaming.clone())]);
        parse_section::<StreamingSync>(&table, "sync.streaming", origin)?;
    }
    table.try_into::<T>().map_err(|e| {
        let msg = e.message().trim().to_string();
        let hint = msg
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
            .and_then(flag_for)
            .map(|flag| format!(" (set it in [{name}] or with {flag})"))
            .unwrap_or_default();
        anyhow!("{origin}: [{name}] {msg}{hint}")
    })
}

/// Builds the plan of a recipe table (already overridden), with its `[sync.streaming]` schedule.
type PlanParts = (Plan, Option<(StreamingSync, FragmentPlan)>);

fn plan_from_table(root: &Table, run_steps: Option<u64>, origin: &str) -> Result<PlanParts> {
    let schedule: LrSchedule = parse_section(root, "schedule", origin)?;
    let sync: SyncSection = parse_section(root, "sync", origin)?;
    let plan = sync.plan(schedule, run_steps).map_err(|e| anyhow!("{origin}: {e}"))?;
    let streaming = match sync.streaming {
        Some(settings) => {
            let fragments = fragment_plan(&settings, plan.clone()).map_err(|e| anyhow!("{origin}: {e}"))?;
            Some((settings, fragments))
        }
        None => None,
    };
    Ok((plan, streaming))
}

/// Loads a recipe (or none: flags only), applies the overrides and validates.
///
/// TOML recipes: the `[schedule]` and `[sync]` sections, with command-line overrides applied before
/// validation so that a flag and a recipe key are checked by the same code.
pub fn load_plan(path: Option<&Path>, overrides: &PlanOverrides) -> Result<PlanRecipe> {
    let mut root = match path {
        Some(p) => read_table(p)?,
        None => Table::new(),
    };
    let origin = path.map_or_else(|| "command line".to_string(), |p| format!("recipe {}", p.display()));
    overrides.apply(&mut root).with_context(|| origin.clone())?;
    // A training recipe's run length (`train.steps`) is the plan's, unless a flag says otherwise.
    let recipe_steps = root
        .get("train")
        .and_then(|t| t.get("steps"))
        .map(|v| {
            v.as_integer()
                .filter(|n| *n > 0)
                .map(|n| n as u64)
                .ok_or_else(|| anyhow!("{origin}: `train.steps` must be a positive integer"))
        })
        .transpose()?;
    let (plan, streaming) = plan_from_table(&root, overrides.run_steps.or(recipe_steps), &origin)?;
    let name = match root.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => bail!("{origin}: `name` must be a string"),
        None => {
            path.and_then(|p| p.file_stem()).map_or_else(|| "flags".to_string(), |s| s.to_string_lossy().into_owned())
        }
    };
    Ok(PlanRecipe { name, source: path.map(Path::to_path_buf), plan, streaming })
}
