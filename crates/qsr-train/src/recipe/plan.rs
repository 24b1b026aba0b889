//! TOML recipes: the `[schedule]` and `[sync]` sections (documented on [`load_plan`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qsr_optim::{DriverConfig, Face, OuterConfig, SyncSettings, check_sync};
use qsr_sched::{FragmentPlan, LocalSync, LrSchedule, Plan, StreamingConfig, SyncSection};
use toml::{Table, Value};

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
    /// QSR's alpha from a budget: the share of data parallel's syncs the run may make, in (0, 1]
    /// (e.g. 0.1); sets `sync.alpha` of a `qsr` rule to the smallest alpha within it. Budget and alpha
    /// are one knob: with a recipe that sets `alpha`, drop it (`--set sync.alpha=`).
    #[arg(long)]
    pub budget: Option<f64>,
    /// Override a recipe key, e.g. `--set sync.streaming.fragments=4` (repeatable; applied before
    /// the flags above); `--set KEY=` drops the key.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
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
    pub streaming: Option<(StreamingConfig, FragmentPlan)>,
    /// What the sync settings do differently from what they say ([`check_sync`]'s warnings).
    pub warnings: Vec<String>,
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
        super::sets::apply_sets(root, &self.sets)?;
        let sched = section(root, "schedule")?;
        let set = |t: &mut Table, k: &str, v: Option<Value>| {
            if let Some(v) = v {
                t.insert(k.to_string(), v);
            }
        };
        // Issue 56 D12: a u64 past TOML's integers used to be echoed back as i64::MAX.
        let one = |flag: &str, x: u64| match i64::try_from(x) {
            Ok(x) => Ok(Value::Integer(x)),
            Err(_) => Err(crate::exit::bad_input(anyhow!("{flag} {x}: larger than any plan (at most {})", i64::MAX))),
        };
        let int = |flag: &str, v: Option<u64>| v.map(|x| one(flag, x)).transpose();
        let float = |v: Option<f64>| v.map(Value::Float);
        if let Some(kind) = &self.schedule_kind {
            if kind != "step" && self.decay_points.is_none() {
                sched.remove("decay_points");
            }
            sched.insert("kind".into(), Value::String(kind.clone()));
        }
        set(sched, "total_steps", int("--total-steps", self.total_steps)?);
        set(sched, "warmup_steps", int("--warmup-steps", self.warmup_steps)?);
        set(sched, "lr_max", float(self.lr_max));
        set(sched, "lr_min", float(self.lr_min));
        set(sched, "decay_gamma", float(self.decay_gamma));
        if let Some(points) = &self.decay_points {
            let arr = points.iter().map(|&p| one("--decay-points", p)).collect::<Result<_>>()?;
            sched.insert("decay_points".into(), Value::Array(arr));
        }

        let sync = section(root, "sync")?;
        if let Some(rule) = &self.rule {
            super::sets::switch_rule(sync, rule);
        }
        set(sync, "h_base", int("--h-base", self.h_base)?);
        if self.alpha.is_some() {
            // A new alpha was not chosen from the budget a resolved recipe records.
            sync.remove("from_budget");
        }
        set(sync, "alpha", float(self.alpha));
        set(sync, "budget", float(self.budget));
        set(sync, "power", float(self.power));
        set(sync, "switch_step", int("--switch-step", self.switch_step)?);
        set(sync, "h", int("--h", self.h)?);
        set(sync, "scaler", int("--scaler", self.scaler)?);
        set(sync, "h_max", int("--h-max", self.h_max)?);
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
        parse_section::<StreamingConfig>(&table, "sync.streaming", origin)?;
    }
    table.clone().try_into::<T>().map_err(|e| {
        // A name given as a number: the key and the names it takes, as `qsr train` says them.
        if e.message().contains("unit variant")
            && let Some(named) = super::errors::check::<T>(&table)
        {
            return anyhow!("{origin}: {}", super::errors::name_error(name, named));
        }
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

/// QSR's alpha from `[sync] budget` (the recipe's, `--set sync.budget=` or `--budget`): the alpha of
/// the table's QSR rule that meets the budget over its schedule (the smallest: the most syncs the
/// budget buys), written into `[sync]` before the plan is built, with the budget as
/// `sync.from_budget`, so the resolved recipe records both and a resumed run keeps the alpha. Budget
/// and alpha are one knob: a budget beside an alpha (from any source), or under a rule other than QSR,
/// is refused naming both keys.
pub(crate) fn apply_budget(root: &mut Table, run_steps: Option<u64>, origin: &str) -> Result<()> {
    let Some(value) = root.get("sync").and_then(|s| s.get("budget")).cloned() else {
        return Ok(());
    };
    let number = value.as_float().or_else(|| value.as_integer().map(|i| i as f64));
    let budget =
        number.ok_or_else(|| anyhow!("{origin}: invalid `sync.budget`: must be a number in (0, 1] (got {value})"))?;
    let schedule: LrSchedule = parse_section(root, "schedule", origin)?;
    let sync = section(root, "sync")?;
    let rule = sync.get("rule").and_then(Value::as_str).unwrap_or("(none)").to_string();
    let alpha = sync.get("alpha").map(ToString::to_string);
    let h_base = sync.get("h_base").and_then(Value::as_integer).and_then(|h| u64::try_from(h).ok());
    let beside = Beside { rule: &rule, alpha: alpha.as_deref(), h_base };
    let alpha = budget_alpha(budget, beside, &schedule, run_steps).map_err(|e| anyhow!("{origin}: {e:#}"))?;
    sync.remove("budget");
    sync.insert("alpha".into(), Value::Float(alpha));
    sync.insert("from_budget".into(), Value::Float(budget));
    Ok(())
}

/// What a budget stands beside: the rule's name, an alpha given too (as written), the rule's `h_base`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Beside<'a> {
    pub(crate) rule: &'a str,
    pub(crate) alpha: Option<&'a str>,
    pub(crate) h_base: Option<u64>,
}

/// The alpha `budget` chooses for a `qsr` rule over `schedule` (for `run_steps`): the one rule of the
/// budget knob, for recipes ([`apply_budget`]) and `qsr compare --rules qsr:budget=`. Budget and
/// alpha are one knob: beside an alpha, or under a rule other than QSR, it is refused naming both keys.
pub(crate) fn budget_alpha(
    budget: f64,
    beside: Beside<'_>,
    schedule: &LrSchedule,
    run_steps: Option<u64>,
) -> Result<f64> {
    let Beside { rule, alpha, h_base } = beside;
    if rule != "qsr" {
        bail!(
            "invalid `sync.budget`: it chooses the alpha of `sync.rule = \"qsr\"`, and `sync.rule = \"{rule}\"` has none: set `sync.budget` or `sync.rule`, not both"
        );
    }
    if let Some(given) = alpha {
        bail!(
            "invalid `sync.alpha`: `sync.budget` = {budget} and `sync.alpha` = {given} are one knob (the budget chooses alpha): set `sync.budget` or `sync.alpha`, not both (`--set sync.alpha=` drops a recipe's alpha)"
        );
    }
    let h_base = h_base
        .filter(|h| *h > 0)
        .ok_or_else(|| anyhow!("`sync.budget` needs `sync.h_base` (set it in [sync] or with --h-base)"))?;
    qsr_sched::alpha_for_budget(schedule, h_base, budget, run_steps)
        .map_err(|e| anyhow!("invalid `sync.budget`: {}", e.reason))
}

/// Builds the plan of a recipe table (already overridden), with its `[sync.streaming]` schedule.
type PlanParts = (Plan, Option<(StreamingConfig, FragmentPlan)>, Vec<String>);

fn plan_from_table(root: &Table, run_steps: Option<u64>, origin: &str) -> Result<PlanParts> {
    let schedule: LrSchedule = parse_section(root, "schedule", origin)?;
    let sync: SyncSection = parse_section(root, "sync", origin)?;
    let plan = sync.plan(schedule, run_steps).map_err(|e| anyhow!("{origin}: {e}"))?;
    // The settings `qsr train` checks with the plan: the same check, the same verdict.
    let driver: DriverConfig = parse_section(root, "driver", origin)?;
    let outer: Option<OuterConfig> = root.get("outer").map(|_| parse_section(root, "outer", origin)).transpose()?;
    // The recipe's workers, as `qsr train` judges them; a plan from flags alone is for several.
    let workers = root.get("train").and_then(|t| t.get("workers")).and_then(Value::as_integer);
    let workers = workers.map_or(2, |k| usize::try_from(k).unwrap_or(0));
    let settings = SyncSettings {
        plan: Some(plan.clone()),
        outer,
        streaming: sync.streaming,
        wire: driver.wire,
        residency: driver.residency,
        state: driver.state,
        fingerprint: driver.fingerprint,
        ..SyncSettings::new(sync.rule.clone(), workers)
    };
    let verdict = check_sync(&settings, Face::Recipe);
    if let Some(refusal) = verdict.refusals.first() {
        bail!("{origin}: {refusal}");
    }
    let streaming = sync.streaming.zip(verdict.fragments);
    Ok((plan, streaming, verdict.warnings))
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
    let run_steps = overrides.run_steps.or(recipe_steps);
    apply_budget(&mut root, run_steps, &origin)?;
    let (plan, streaming, warnings) = plan_from_table(&root, run_steps, &origin)?;
    let name = match root.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => bail!("{origin}: `name` must be a string"),
        None => {
            path.and_then(|p| p.file_stem()).map_or_else(|| "flags".to_string(), |s| s.to_string_lossy().into_owned())
        }
    };
    Ok(PlanRecipe { name, source: path.map(Path::to_path_buf), plan, streaming, warnings })
}
