//! `qsr plan` (documented on [`run`]).

use std::fmt::Write as _;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Result, bail};
use qsr_optim::{Level, Wire};
use qsr_sched::{Encoding, FragmentSummary, Plan, PlanSummary, ring_allreduce_bytes_per_rank, split_elements};
use serde::Serialize;

use crate::recipe::{PlanOverrides, PlanRecipe, load_plan};

/// Output format of `qsr plan` (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    /// A readable summary (a table when several recipes are given)
    Human,
    /// One JSON plan report, or an array of them for several recipes
    Json,
    /// The rounds of one recipe: index,start,len,lr_start
    Csv,
}

/// Arguments of `qsr plan`.
#[derive(Debug, clap::Args)]
pub(crate) struct PlanArgs {
    /// TOML recipe(s); flags override their `[schedule]` and `[sync]` settings. Several recipes are compared
    /// side by side.
    #[arg(long)]
    pub recipe: Vec<PathBuf>,
    /// Schedule and sync-rule flags that override the recipe's settings.
    #[command(flatten)]
    pub overrides: PlanOverrides,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: Format,
    /// Draw lr and H against step into this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Parameter count, to report bytes moved per rank.
    #[arg(long)]
    pub params: Option<u64>,
    /// World size K for the byte count (ring all-reduce moves 2(K-1)/K of the buffer per sync).
    #[arg(long, default_value_t = 4)]
    pub world_size: u64,
    /// Bytes per parameter on the wire.
    #[arg(long, default_value_t = 4)]
    pub bytes_per_param: u64,
    /// The parameter syncs' wire, as `driver.wire` says it (`f32`, `bf16`, `int8`, `fp8`: a byte per
    /// value and a scale per 64; `int4`, `int2`: 4 or 2 bits and the scale); replaces `--bytes-per-param`.
    #[arg(long, value_parser = parse_wire)]
    pub wire: Option<Wire>,
    /// Workers per node for the byte count of a two-level plan's local averages (default: the
    /// world size, one node).
    #[arg(long)]
    pub node_size: Option<u64>,
}

/// The JSON record of one plan.
#[derive(Debug, Serialize)]
pub(crate) struct PlanReport {
    /// The recipe's name (see [`PlanRecipe::name`]).
    pub name: String,
    /// The sync rule with its parameters (its name is the summary's `rule`).
    pub sync: qsr_sched::SyncRule,
    /// The learning-rate schedule.
    pub schedule: qsr_sched::LrSchedule,
    /// Counts of the plan (rounds, communication share, H), flattened into the record.
    #[serde(flatten)]
    pub summary: PlanSummary,
    /// Bytes each rank sends (per sync, over the run, and for data parallel); only with `--params`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume: Option<qsr_sched::CommVolume>,
    /// The local level of a two-level plan: its rule with its parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_sync: Option<qsr_sched::SyncRule>,
    /// Bytes each rank sends for the local averages inside its node of `--node-size` workers; only
    /// with `--params` and a local level.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_volume: Option<qsr_sched::CommVolume>,
    /// `[sync.streaming]`'s fragment schedule, where the recipe has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streaming: Option<StreamingReport>,
}

/// The fragment schedule of a recipe's `[sync.streaming]`.
#[derive(Debug, Serialize)]
pub(crate) struct StreamingReport {
    /// The section's settings (fragments, delay, mix).
    pub settings: qsr_sched::StreamingConfig,
    /// Syncs per fragment, most fragments on one step, fewest steps between syncs.
    pub summary: FragmentSummary,
    /// Fragment syncs that come fewer than `delay` steps after the fragment's previous one, so that
    /// its previous average lands early, at this sync: rounds too short for the delay.
    pub syncs_within_delay: u64,
    /// What the settings do differently than they say ([`qsr_sched::StreamingConfig::warnings`]), one line each.
    pub warnings: Vec<String>,
    /// The most bytes one rank sends after one step (ring all-reduce of the fragments syncing then,
    /// the parameters split evenly); only with `--params`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_bytes_per_step: Option<u64>,
    /// The same without fragments (the whole model at every sync); only with `--params`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plain_peak_bytes_per_step: Option<u64>,
}

/// Runs `qsr plan`: loads each recipe with the overrides, writes the plans to `out` in the chosen format,
/// and draws the PNG if `--plot` is given.
///
/// The output: the round plan of a recipe as a human summary, JSON or CSV, and an lr/H picture.
pub(crate) fn run(args: &PlanArgs, out: &mut dyn Write) -> Result<()> {
    let recipes = load(args).map_err(crate::exit::bad_input)?;
    let reports: Vec<PlanReport> = recipes.iter().map(|r| report(r, args)).collect();
    for (recipe, report) in recipes.iter().zip(&reports) {
        // Streaming's own warnings are part of its report.
        let shown = report.streaming.as_ref().map_or(&[][..], |s| &s.warnings[..]);
        for w in recipe.warnings.iter().filter(|w| !shown.contains(w)) {
            eprintln!("qsr: warning: {}: {w}", recipe.name);
        }
    }
    match args.format {
        Format::Json if reports.len() == 1 => writeln!(out, "{}", serde_json::to_string_pretty(&reports[0])?)?,
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&reports)?)?,
        Format::Csv => write_csv(&recipes[0].plan, out)?,
        Format::Human if reports.len() == 1 => out.write_all(human(&recipes[0], &reports[0]).as_bytes())?,
        Format::Human => out.write_all(table(&reports).as_bytes())?,
    }
    if let Some(path) = &args.plot {
        let plans: Vec<(&str, &Plan)> = recipes.iter().map(|r| (r.name.as_str(), &r.plan)).collect();
        crate::plot::draw::plan_png(path, &plans)?;
        if args.format == Format::Human {
            writeln!(out, "plot written to {}", path.display())?;
        }
    }
    Ok(())
}

/// The recipes of `qsr plan` with its overrides, and its flags checked.
fn load(args: &PlanArgs) -> Result<Vec<PlanRecipe>> {
    let recipes: Vec<PlanRecipe> = if args.recipe.is_empty() {
        vec![load_plan(None, &args.overrides)?]
    } else {
        args.recipe.iter().map(|p| load_plan(Some(p), &args.overrides)).collect::<Result<_>>()?
    };
    if args.params.is_some() && args.world_size == 0 {
        bail!("--world-size must be at least 1");
    }
    if args.node_size.is_some_and(|n| n == 0 || n > args.world_size) {
        bail!("--node-size must be in 1..=--world-size ({})", args.world_size);
    }
    if args.format == Format::Csv && recipes.len() != 1 {
        bail!("--format csv prints the rounds of one recipe; got {}", recipes.len());
    }
    Ok(recipes)
}

/// `--wire`'s value, as a recipe's `driver.wire` spells it.
fn parse_wire(s: &str) -> Result<Wire, String> {
    serde_json::from_value(serde_json::Value::String(s.into()))
        .map_err(|_| format!("`{s}` is not a wire: f32, bf16, int8, fp8, int4 or int2"))
}

fn report(r: &PlanRecipe, args: &PlanArgs) -> PlanReport {
    let summary = r.plan.summary();
    let encoding = args.wire.map_or(Encoding::plain(args.bytes_per_param), Wire::encoding);
    let volume = args.params.map(|n| summary.volume(n, encoding, args.world_size));
    let node = args.node_size.unwrap_or(args.world_size);
    // Node averages travel in f32 under a quantized wire (`Wire::at`).
    let local_encoding = args.wire.map_or(encoding, |w| w.at(Level::Local).encoding());
    let local_volume =
        summary.local.as_ref().zip(args.params).map(|(l, n)| l.volume(summary.run_steps, n, local_encoding, node));
    let streaming = r.streaming.as_ref().map(|(settings, fragments)| {
        let ring = |elements| ring_allreduce_bytes_per_rank(elements, encoding, args.world_size);
        let peak = |params| {
            let sizes: Vec<u64> =
                split_elements(params, fragments.fragments()).iter().map(|f| f.end - f.start).collect();
            ring(fragments.peak_elements(&sizes))
        };
        StreamingReport {
            settings: *settings,
            summary: fragments.summary(),
            syncs_within_delay: fragments.syncs_within(settings.delay),
            warnings: settings.warnings(fragments),
            peak_bytes_per_step: args.params.map(peak),
            plain_peak_bytes_per_step: args.params.map(ring),
        }
    });
    PlanReport {
        name: r.name.clone(),
        sync: r.plan.sync().clone(),
        schedule: r.plan.schedule().clone(),
        summary,
        volume,
        local_sync: r.plan.local().cloned(),
        local_volume,
        streaming,
    }
}

/// One row per round: `index,start,len,lr_start`.
pub(crate) fn write_csv(plan: &Plan, out: &mut dyn Write) -> Result<()> {
    let mut w = std::io::BufWriter::new(out);
    writeln!(w, "index,start,len,lr_start")?;
    for r in plan.rounds() {
        writeln!(w, "{},{},{},{:e}", r.index, r.start, r.len, r.lr_start)?;
    }
    w.flush()?;
    Ok(())
}

fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", units[u]) }
}

fn human(r: &PlanRecipe, rep: &PlanReport) -> String {
    let p = &r.plan;
    let s = &rep.summary;
    let sch = p.schedule();
    let mut o = String::new();
    let _ = writeln!(o, "recipe      {}", r.name);
    let _ = writeln!(o, "sync        {}", p.sync().describe());
    let _ = writeln!(
        o,
        "schedule    {}, horizon T {} (run {} steps), warmup {} steps from {} to lr_max {}",
        sch.kind.name(),
        sch.total_steps,
        s.run_steps,
        sch.warmup_steps,
        sch.lr_min,
        sch.lr_max,
    );
    let _ = writeln!(o, "rounds      {} syncs = {:.1}% of data parallel", s.rounds, s.comm_percent);
    if s.gradient_syncs > 0 && s.gradient_syncs < s.rounds {
        let _ = writeln!(o, "            of which {} data-parallel gradient syncs", s.gradient_syncs);
    }
    let _ = writeln!(
        o,
        "H           first {}, max {}, last round {}, first increase {}",
        s.first_h,
        s.max_h,
        s.last_round_len,
        s.first_h_increase_step.map_or("never".to_string(), |t| format!("at step {t}"))
    );
    if let Some(v) = &rep.volume {
        let _ = writeln!(
            o,
            "traffic     {} per rank ({} per sync); data parallel {}",
            bytes(v.bytes_per_rank),
            bytes(v.bytes_per_sync),
            bytes(v.data_parallel_bytes_per_rank)
        );
    }
    if let (Some(rule), Some(l)) = (p.local(), &s.local) {
        let _ = writeln!(o, "local       {} inside each node", rule.describe());
        let _ = writeln!(o, "            {} averages = {:.1}% of steps, max H {}", l.rounds, l.comm_percent, l.max_h);
    }
    if let Some(v) = &rep.local_volume {
        let _ = writeln!(
            o,
            "            {} per rank inside its node ({} per average)",
            bytes(v.bytes_per_rank),
            bytes(v.bytes_per_sync)
        );
    }
    if let Some(st) = &rep.streaming {
        o.push_str(&streaming_lines(st));
    }
    // The shape of H over training, in tenths of the run.
    let _ = writeln!(o, "\n  steps              lr at start   rounds   H (min..max)");
    let end = s.run_steps;
    let mut rounds = p.rounds().peekable();
    for tenth in 0..10u64 {
        let (lo, hi) = (end * tenth / 10, end * (tenth + 1) / 10);
        if lo == hi {
            continue;
        }
        let (mut n, mut hmin, mut hmax) = (0u64, u64::MAX, 0u64);
        while let Some(rd) = rounds.peek() {
            if rd.start >= hi {
                break;
            }
            n += 1;
            hmin = hmin.min(rd.len);
            hmax = hmax.max(rd.len);
            rounds.next();
        }
        let h = if n == 0 { "-".to_string() } else { format!("{hmin}..{hmax}") };
        let _ = writeln!(o, "  {:>8}..{:<8} {:<13.4e} {:>6}   {}", lo, hi, p.lr(lo), n, h);
    }
    o
}

/// The human summary's lines for `[sync.streaming]`.
fn streaming_lines(st: &StreamingReport) -> String {
    let (set, f, mut o) = (&st.settings, &st.summary, String::new());
    let _ = writeln!(
        o,
        "fragments   {}, each synced once per round ({} syncs each), delay {} steps, mix {}",
        set.fragments, f.syncs_per_fragment, set.delay, set.mix
    );
    let gap = f.min_gap.map_or("-".to_string(), |g| g.to_string());
    let _ = writeln!(o, "            at most {} per step, fewest steps between syncs {gap}", f.max_per_step);
    if let (Some(peak), Some(plain)) = (st.peak_bytes_per_step, st.plain_peak_bytes_per_step) {
        let _ = writeln!(o, "            peak per step {} per rank (whole model: {})", bytes(peak), bytes(plain));
    }
    for w in &st.warnings {
        let _ = writeln!(o, "            warning: {w}");
    }
    o
}

fn table(reports: &[PlanReport]) -> String {
    let w = reports.iter().map(|r| r.name.len()).max().unwrap_or(6).max(6);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<w$}  {:<11} {:>9} {:>9} {:>7} {:>7} {:>12} {:>9}",
        "recipe", "rule", "steps", "rounds", "comm%", "max H", "first grow", "local"
    );
    for r in reports {
        let s = &r.summary;
        let _ = writeln!(
            o,
            "{:<w$}  {:<11} {:>9} {:>9} {:>7.1} {:>7} {:>12} {:>9}",
            r.name,
            r.summary.rule,
            s.run_steps,
            s.rounds,
            s.comm_percent,
            s.max_h,
            s.first_h_increase_step.map_or("-".to_string(), |t| t.to_string()),
            s.local.as_ref().map_or("-".to_string(), |l| l.rounds.to_string())
        );
    }
    o
}
