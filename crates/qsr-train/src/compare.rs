//! `qsr compare` (documented on [`run`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qsr_optim::{OuterConfig, OuterUnit};
use qsr_sched::SyncRule;
use serde::Serialize;

use crate::device_spec::device;
use crate::files::write_atomic;
use crate::recipe::{Beside, TrainRecipe, budget_alpha};
use crate::records::Summary;
use crate::worker::RunSpec;

/// Arguments of `qsr compare`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct CompareArgs {
    /// TOML recipe to train under every rule and seed.
    #[arg(long)]
    pub recipe: PathBuf,
    /// Comma-separated rules: dp, constant, qsr, post-local, power, exponential; parameters after a
    /// colon, e.g. `constant:h=4,qsr:h_base=2;alpha=0.06,power:power=3` (`qsr:budget=0.3` chooses
    /// alpha from a share of data parallel's syncs); a `+outer` suffix on the name
    /// (`qsr+outer`) adds the recipe's `[outer]` section, or when it has none DiLoCo's outer SGD
    /// with the momentum for short rounds (lr 0.7, Nesterov momentum 0.5: `OuterConfig::short_rounds`),
    /// whose keys `outer.KEY=VALUE` parameters set (`qsr+outer:outer.unit=lr`)
    /// (default: dp,constant,qsr). `dp` runs without the recipe's `[sync.streaming]`: it
    /// all-reduces gradients, so it is the baseline a streaming rule is compared with.
    #[arg(long, default_value = "dp,constant,qsr")]
    pub rules: String,
    /// Seeds 0..N for every rule.
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// Override a recipe key, e.g. `--set train.steps=200` (repeatable); `--set KEY=` drops it.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Simulated workers (default: the recipe's train.workers).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Output directory (default `runs/compare-<recipe name>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Compute device: `cpu`, `cuda:N` or `cuda` (GPU 0; needs a binary built with CUDA support).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// The rule as given in `--rules`, also the run directories' prefix (`power-power=3-h_base=2`).
    pub rule: String,
    /// The rule with its parameters.
    pub sync: SyncRule,
    /// The outer optimizer of these runs, if any.
    pub outer: Option<OuterConfig>,
    /// Number of seeds run.
    pub seeds: usize,
    /// Mean final test accuracy over the seeds, as a fraction in `[0, 1]`.
    pub accuracy_mean: f64,
    /// Half-width of the 95% confidence interval of the mean (Student's t).
    pub accuracy_ci95: f64,
    /// Final test accuracy of each seed, in seed order.
    pub accuracies: Vec<f64>,
    /// Mean final held-out loss (test loss; a language model's validation loss) over the seeds.
    pub loss_mean: f64,
    /// Half-width of its 95% confidence interval (Student's t).
    pub loss_ci95: f64,
    /// Final held-out loss of each seed, in seed order.
    pub losses: Vec<f64>,
    /// Final train accuracy (`eval.train_items`) over the seeds, with its 95% half-width: the
    /// generalization gap beside the test accuracy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_accuracy: Option<MeanCi>,
    /// Synchronizations of seed 0's run.
    pub syncs: u64,
    /// The plan's communication share of seed 0's run (`100 * rounds / steps`; data parallel is 100).
    pub comm_percent: f64,
    /// Bytes rank 0 sent in seed 0's run.
    pub bytes_per_rank: u64,
    /// Mean seconds rank 0 spent in synchronizations over the seeds.
    pub comm_seconds_mean: f64,
    /// Mean training wall time over the seeds, in seconds.
    pub wall_seconds_mean: f64,
    /// Run directories, in seed order.
    pub runs: Vec<PathBuf>,
    /// Seeds whose run diverged (stopped at the evaluation that saw it; its numbers are that one's).
    #[serde(default)]
    pub diverged: usize,
    /// Seeds whose run did not train (a final evaluation no better than chance).
    #[serde(default)]
    pub not_trained: usize,
}

/// A mean over seeds and the half-width of its 95% confidence interval (Student's t).
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct MeanCi {
    pub mean: f64,
    pub ci95: f64,
}

/// Student's t quantile for a two-sided 95% interval with `df` degrees of freedom.
pub(crate) fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    if df == 0 { f64::NAN } else { T.get(df - 1).copied().unwrap_or(1.960) }
}

/// Mean and 95% half-width of `xs` (half-width 0 for a single value).
pub(crate) fn mean_ci(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t95(n - 1) * (var / n as f64).sqrt())
}

/// One `--rules` entry: its label, the rule, and the outer optimizer it adds, if any.
struct RuleSpec {
    label: String,
    rule: SyncRule,
    /// The budget its alpha was chosen from (`qsr:budget=0.3`), recorded in its runs' recipes.
    budget: Option<f64>,
    outer: Option<OuterConfig>,
}

impl RuleSpec {
    /// Parses `spec` against the recipe `base` (the source of the rule's and the outer step's defaults).
    fn parse(spec: &str, base: &TrainRecipe) -> Result<Self> {
        let spec = spec.trim();
        let (name, params) = spec.split_once(':').unwrap_or((spec, ""));
        let (name, outer) = match name.strip_suffix("+outer") {
            Some(n) => (n, true),
            None => (name, false),
        };
        let (outer_keys, rule_keys): (Vec<&str>, Vec<&str>) =
            params.split(';').filter(|kv| !kv.trim().is_empty()).partition(|kv| kv.trim().starts_with("outer."));
        if let (false, Some(kv)) = (outer, outer_keys.first()) {
            bail!("--rules {spec}: `{kv}` sets the outer optimizer: add `+outer` to the rule's name");
        }
        let (budget, mut rule_keys): (Vec<&str>, Vec<&str>) =
            rule_keys.into_iter().partition(|kv| kv.trim().starts_with("budget"));
        let alpha_given = rule_keys.iter().find(|kv| kv.trim().starts_with("alpha")).map(|kv| kv.trim().to_string());
        if !budget.is_empty() && alpha_given.is_none() && name == "qsr" {
            // The budget chooses it below; a recipe of another rule has none to default to.
            rule_keys.push("alpha=1");
        }
        let mut rule = rule_from_spec(&format!("{name}:{}", rule_keys.join(";")), &base.sync.rule)
            .map_err(|e| anyhow!("--rules {spec}: {e:#}"))?;
        let mut budget_share = None;
        if let Some(kv) = budget.first() {
            let alpha = alpha_given.as_deref().and_then(|kv| kv.split_once('=')).map(|(_, v)| v.trim());
            let (r, b) = with_budget(rule, kv, alpha, base).map_err(|e| anyhow!("--rules {spec}: {e:#}"))?;
            (rule, budget_share) = (r, Some(b));
        }
        let outer = outer
            .then(|| outer_from_spec(base.outer.unwrap_or_else(OuterConfig::short_rounds), &outer_keys))
            .transpose()
            .map_err(|e| anyhow!("--rules {spec}: {e:#}"))?;
        let label = spec.replace(['+'], "-").replace([':', ';', ','], "-");
        Ok(Self { label, rule, budget: budget_share, outer })
    }
}

/// A `qsr` rule whose alpha a `budget=SHARE` parameter chooses over the recipe's schedule (as
/// `sync.budget` does); refused beside `alpha=` (one knob) and for other rules.
fn with_budget(rule: SyncRule, kv: &str, alpha: Option<&str>, base: &TrainRecipe) -> Result<(SyncRule, f64)> {
    let value = kv.split_once('=').map_or("", |(_, v)| v.trim());
    if kv.split_once('=').is_none_or(|(k, _)| k.trim() != "budget") {
        bail!("`{kv}` is not budget=SHARE");
    }
    let budget: f64 = value.parse().map_err(|_| anyhow!("invalid `budget`: `{value}` is not a number in (0, 1]"))?;
    let h_base = match rule {
        SyncRule::Qsr { h_base, .. } => Some(h_base),
        _ => None,
    };
    let beside = Beside { rule: rule.name(), alpha, h_base };
    let alpha = budget_alpha(budget, beside, &base.schedule, base.train.steps)?;
    Ok((SyncRule::Qsr { h_base: h_base.unwrap_or(1), alpha }, budget))
}

/// `start` with the `outer.KEY=VALUE` settings of a `--rules` entry, checked.
fn outer_from_spec(start: OuterConfig, settings: &[&str]) -> Result<OuterConfig> {
    let mut table = toml::Table::try_from(start)?;
    for kv in settings {
        let (k, v) = kv.split_once('=').ok_or_else(|| anyhow!("`{kv}` is not key=value"))?;
        let key = k.trim().trim_start_matches("outer.");
        table.insert(key.to_string(), toml_value(v).ok_or_else(|| anyhow!("bad value in `{kv}`"))?);
    }
    // Its values are checked with the rest of the sync settings, in the row's recipe.
    toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| anyhow!("outer: {}", e.message().trim()))
}

/// The value of a `--rules` `key=value`, as TOML (a bare word as a string: `outer.unit=lr`).
fn toml_value(v: &str) -> Option<toml::Value> {
    let v = v.trim();
    let word = !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    let parsed = format!("v = {v}").parse::<toml::Table>().ok().and_then(|mut t| t.remove("v"));
    parsed.or_else(|| word.then(|| toml::Value::String(v.to_string())))
}

/// Parses one rule spec against the recipe's own rule (the source of defaults).
pub(crate) fn rule_from_spec(spec: &str, base: &SyncRule) -> Result<SyncRule> {
    let (name, params) = spec.split_once(':').unwrap_or((spec, ""));
    let mut table = toml::Table::new();
    table.insert("rule".into(), toml::Value::String(name.trim().to_string()));
    // Defaults from the recipe: its QSR settings, and constant H = its h_base (the paper's baseline).
    let (h_base, alpha) = match *base {
        SyncRule::Qsr { h_base, alpha } | SyncRule::Power { h_base, alpha, .. } => (Some(h_base), Some(alpha)),
        SyncRule::Exponential { h_base, .. } => (Some(h_base), None),
        SyncRule::Constant { h } | SyncRule::PostLocal { h, .. } => (Some(h), None),
        SyncRule::Dp => (None, None),
    };
    let int = |v: u64| toml::Value::Integer(v as i64);
    match name.trim() {
        "constant" => {
            if let Some(h) = h_base {
                table.insert("h".into(), int(h));
            }
        }
        "qsr" | "power" => {
            if let Some(h) = h_base {
                table.insert("h_base".into(), int(h));
            }
            if let Some(a) = alpha {
                table.insert("alpha".into(), toml::Value::Float(a));
            }
            if name.trim() == "power" {
                table.insert("power".into(), toml::Value::Float(base.power().unwrap_or(2.0)));
            }
        }
        _ => {}
    }
    for kv in params.split(';').filter(|s| !s.trim().is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| anyhow!("--rules {spec}: `{kv}` is not key=value"))?;
        let value = toml_value(v).ok_or_else(|| anyhow!("--rules {spec}: bad value in `{kv}`"))?;
        table.insert(k.trim().to_string(), value);
    }
    toml::Value::Table(table).try_into::<SyncRule>().map_err(|e| anyhow!("--rules {spec}: {}", e.message().trim()))
}

/// Runs `qsr compare`: trains every rule x seed with K simulated workers, prints the table and writes
/// `compare.md`, `compare.json` and the plots (seed 0 of every rule) into the output directory.
///
/// One recipe under several sync rules and seeds, K simulated workers each, with a table
/// of test accuracy (mean and 95% interval over seeds), synchronizations, communication and wall time.
pub(crate) fn run(args: &CompareArgs) -> Result<Vec<Row>> {
    let (base, rules) = parse_args(args).map_err(crate::exit::bad_input)?;
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(format!("compare-{}", base.name)));
    if out.exists() && !out.is_dir() {
        return Err(crate::exit::bad_input(anyhow!("--out {}: exists and is not a directory", out.display())));
    }
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let cmp = Compare { args, dev: device(&args.device).map_err(crate::exit::bad_input)?, base, out };
    let rows = rules.iter().map(|r| cmp.rule_row(r)).collect::<Result<Vec<_>>>()?;
    cmp.write_outputs(&rows)?;
    let failed = |count: fn(&Row) -> usize| -> Vec<String> {
        let rows = rows.iter().filter(|r| count(r) > 0);
        rows.map(|r| format!("{} ({} of {} seeds)", r.rule, count(r), r.seeds)).collect()
    };
    let diverged = failed(|r| r.diverged);
    if !diverged.is_empty() {
        let why = format!("runs of {} diverged; the table shows them as they stopped", diverged.join(", "));
        return Err(crate::exit::Diverged { step: None, why }.into());
    }
    let not_trained = failed(|r| r.not_trained);
    if !not_trained.is_empty() {
        let why = format!("runs of {} ended no better than chance; the table marks them", not_trained.join(", "));
        return Err(crate::exit::NotTrained { why }.into());
    }
    Ok(rows)
}

/// The recipe and the `--rules`, checked: at least one rule, each once (each trains into its own
/// `<rule>-seed<N>` directories).
fn parse_args(args: &CompareArgs) -> Result<(TrainRecipe, Vec<RuleSpec>)> {
    let base = TrainRecipe::load(&args.recipe, &args.sets)?;
    if !(1..=MAX_SEEDS).contains(&args.seeds) {
        bail!("--seeds {}: must be 1..={MAX_SEEDS} (each seed trains every rule once)", args.seeds);
    }
    if args.workers == Some(0) {
        bail!("--workers must be at least 1");
    }
    let rules: Vec<RuleSpec> = args
        .rules
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| RuleSpec::parse(s, &base))
        .collect::<Result<_>>()?;
    if rules.is_empty() {
        bail!("--rules `{}` names no rule: give at least one, e.g. --rules dp,qsr", args.rules);
    }
    for (i, r) in rules.iter().enumerate() {
        if rules[..i].iter().any(|o| o.label == r.label) {
            bail!("--rules names `{}` twice: its runs would share the directories {}-seed<N>", r.label, r.label);
        }
        let recipe = variant(&base, r, args.workers, 0).map_err(|e| anyhow!("--rules {}: {e:#}", r.label))?;
        let spec = crate::device_spec::DeviceSpec::parse(&args.device)?;
        crate::topology::check_residency(&recipe, &spec)
            .map_err(|e| anyhow!("--rules {} on --device {}: {e:#}", r.label, args.device))?;
    }
    Ok((base, rules))
}

/// The most `--seeds`: each one trains every rule once.
const MAX_SEEDS: u64 = 1000;

/// The recipe that `rule` trains with `seed`: the base with the rule, its outer optimizer and
/// `--workers`, checked. `dp` leaves out `[sync.streaming]`: it all-reduces gradients every step,
/// so there is no average to stream, and it stays the baseline a streaming rule is compared with.
fn variant(base: &TrainRecipe, rule: &RuleSpec, workers: Option<usize>, seed: u64) -> Result<TrainRecipe> {
    let mut recipe = base.clone();
    recipe.sync.rule = rule.rule.clone();
    // The row's rule replaces the recipe's, and with it the budget the recipe's alpha came from.
    recipe.sync.budget = rule.budget;
    if recipe.sync.rule == SyncRule::Dp {
        recipe.sync.streaming = None;
    }
    recipe.outer = rule.outer;
    recipe.seed = seed;
    recipe.name = format!("{}-{}-seed{seed}", base.name, rule.label);
    if let Some(k) = workers {
        recipe.train.workers = k;
    }
    recipe.validate()?;
    Ok(recipe)
}

/// One `qsr compare`: its arguments, the recipe every run starts from, the device and output directory.
struct Compare<'a> {
    args: &'a CompareArgs,
    dev: burn::tensor::Device,
    base: TrainRecipe,
    out: PathBuf,
}

impl Compare<'_> {
    /// Trains `rule` under every seed and sums the runs up in one row.
    fn rule_row(&self, spec: &RuleSpec) -> Result<Row> {
        let outer = spec.outer;
        let mut summaries: Vec<Summary> = Vec::new();
        let mut runs = Vec::new();
        for seed in 0..self.args.seeds {
            let (s, run_dir) = self.run_seed(spec, seed)?;
            summaries.push(s);
            runs.push(run_dir);
        }
        let accs: Vec<f64> = summaries.iter().map(|s| s.final_test_accuracy).collect();
        let losses: Vec<f64> = summaries.iter().map(|s| s.final_test_loss).collect();
        let ((mean, ci), (loss_mean, loss_ci95)) = (mean_ci(&accs), mean_ci(&losses));
        let train: Option<Vec<f64>> = summaries.iter().map(|s| s.final_train.map(|t| t.accuracy)).collect();
        let train_accuracy = train.map(|t| mean_ci(&t)).map(|(mean, ci95)| MeanCi { mean, ci95 });
        let s0 = &summaries[0];
        let avg = |f: fn(&Summary) -> f64| summaries.iter().map(f).sum::<f64>() / summaries.len() as f64;
        Ok(Row {
            rule: spec.label.clone(),
            sync: spec.rule.clone(),
            outer,
            seeds: summaries.len(),
            accuracy_mean: mean,
            accuracy_ci95: ci,
            accuracies: accs,
            loss_mean,
            loss_ci95,
            losses,
            train_accuracy,
            syncs: s0.syncs,
            comm_percent: s0.comm_percent,
            bytes_per_rank: s0.bytes_per_rank,
            comm_seconds_mean: avg(|s| s.comm_seconds),
            wall_seconds_mean: avg(|s| s.wall_seconds),
            runs,
            diverged: summaries.iter().filter(|s| s.diverged.is_some()).count(),
            not_trained: summaries.iter().filter(|s| s.not_trained.is_some()).count(),
        })
    }

    /// Trains one rule and seed in its own run directory (recipe written first); returns rank 0's
    /// summary and the directory.
    fn run_seed(&self, spec: &RuleSpec, seed: u64) -> Result<(Summary, PathBuf)> {
        let (label, rule) = (&spec.label, &spec.rule);
        let recipe = variant(&self.base, spec, self.args.workers, seed)?;
        let run_dir = self.out.join(format!("{label}-seed{seed}"));
        replace_earlier_run(&run_dir)?;
        std::fs::create_dir_all(&run_dir)?;
        write_atomic(&run_dir.join("recipe.toml"), recipe.to_toml()?.as_bytes(), "run recipe")?;
        eprintln!("compare: {label} ({}) seed {seed}, K = {}", rule.describe(), recipe.train.workers);
        let spec = RunSpec {
            recipe,
            device: self.dev.clone(),
            run_dir: run_dir.clone(),
            resume: None,
            progress: false,
            halt_after: None,
        };
        let s = match crate::topology::threads::run(&spec) {
            Ok(summary) => summary,
            // A run that diverged or did not train is a result of the comparison: its summary says so.
            Err(e) if e.chain().any(|c| c.is::<crate::exit::Diverged>() || c.is::<crate::exit::NotTrained>()) => {
                eprintln!("compare: {label} seed {seed}: {e:#}");
                crate::files::read_regular(&run_dir.join("summary.json"), crate::files::SUMMARY_BYTES, "run summary")
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
            }
            Err(e) => return Err(e),
        };
        let s = s.ok_or_else(|| anyhow!("{label} seed {seed}: no summary"))?;
        Ok((s, run_dir))
    }

    /// Prints the table and writes `compare.md`, `compare.json` and the plots.
    fn write_outputs(&self, rows: &[Row]) -> Result<()> {
        let out = &self.out;
        let workers = self.args.workers.unwrap_or(self.base.train.workers);
        let table = markdown(&self.base, workers, rows, self.args.seeds)?;
        print!("{table}");
        write_atomic(&out.join("compare.md"), table.as_bytes(), "comparison table")?;
        write_atomic(&out.join("compare.json"), serde_json::to_string_pretty(rows)?.as_bytes(), "comparison table")?;
        // One picture per metric, overlaying seed 0 of every rule.
        let series: Vec<crate::plot::draw::RunSeries> = rows
            .iter()
            .map(|r| {
                crate::plot::draw::RunSeries::load(&r.runs[0]).map(|mut s| {
                    s.name = r.rule.clone();
                    s
                })
            })
            .collect::<Result<_>>()?;
        let pngs = crate::plot::draw::runs_png(&series, out)?;
        eprintln!(
            "compare: wrote {} and {}",
            out.join("compare.md").display(),
            pngs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
        Ok(())
    }
}

/// The table of `rows`, trained from `recipe` with `workers` workers.
fn markdown(recipe: &TrainRecipe, workers: usize, rows: &[Row], seeds: u64) -> Result<String> {
    let text = recipe.model.as_gpt().is_some();
    let (loss, acc) =
        if text { ("validation loss (nats)", "next-token accuracy (%)") } else { ("test loss", "test accuracy (%)") };
    let mut o = String::new();
    writeln!(
        o,
        "\n{}: K = {} workers, {} steps, {} seeds (mean ± 95% CI over seeds)\n",
        recipe.name,
        workers,
        recipe.plan().map_or(0, |p| p.end_step()),
        seeds
    )?;
    let with_train = rows.iter().any(|r| r.train_accuracy.is_some());
    let (train_head, train_rule) = if with_train { (" train accuracy (%) |", "---|") } else { ("", "") };
    writeln!(o, "| rule | {loss} | {acc} |{train_head} syncs | comm % | MiB sent / rank | comm s | wall s |")?;
    writeln!(o, "|---|---|---|{train_rule}---|---|---|---|---|")?;
    for r in rows {
        let outer = r.outer.map_or(String::new(), |c| {
            let per = match c.unit {
                OuterUnit::Round => "",
                OuterUnit::Step => " per step",
                OuterUnit::Lr => " per lr-weighted step",
            };
            format!(" + outer (lr {}, momentum {}{per})", c.lr, c.momentum)
        });
        let mut diverged = String::new();
        for (n, what) in [(r.diverged, "diverged"), (r.not_trained, "did not train")] {
            if n > 0 {
                write!(diverged, " **{what} in {n} of {} seeds**", r.seeds)?;
            }
        }
        let train = match (with_train, r.train_accuracy) {
            (true, Some(t)) => format!(" {:.2} ± {:.2} |", 100.0 * t.mean, 100.0 * t.ci95),
            (true, None) => " - |".to_string(),
            (false, _) => String::new(),
        };
        writeln!(
            o,
            "| {}{outer}{diverged} | {:.4} ± {:.4} | {:.2} ± {:.2} |{train} {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.sync.describe(),
            r.loss_mean,
            r.loss_ci95,
            100.0 * r.accuracy_mean,
            100.0 * r.accuracy_ci95,
            r.syncs,
            r.comm_percent,
            r.bytes_per_rank as f64 / (1024.0 * 1024.0),
            r.comm_seconds_mean,
            r.wall_seconds_mean
        )?;
    }
    Ok(o)
}

/// A compare reruns its seeds from scratch: an earlier compare's checkpoints in `run_dir` go first,
/// or the new run would train among them (pruning keeps the newest steps, whichever run wrote them).
fn replace_earlier_run(run_dir: &Path) -> Result<()> {
    let ckpt = crate::checkpoint::ckpt_root(run_dir);
    if ckpt.exists() {
        eprintln!("compare: replacing the earlier run in {}", run_dir.display());
        std::fs::remove_dir_all(&ckpt).with_context(|| format!("cannot remove {}", ckpt.display()))?;
    }
    Ok(())
}
