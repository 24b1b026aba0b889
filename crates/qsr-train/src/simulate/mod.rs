//! `qsr simulate` (documented on [`simulate()`]).

use std::path::PathBuf;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

mod inputs;
mod model;
mod render;
mod streaming;

pub(crate) use inputs::recipe_payload;
use inputs::{cluster_of, load_items, model_sizes, references, step_time, steps_per_epoch, world_of};
use model::Counted;
pub(crate) use model::{Cluster, Network, Prediction, SyncPayload, parse_bandwidth, parse_duration, predict};
pub(crate) use render::render;

/// `qsr simulate` arguments.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("compute").required(true).args(["step_seconds", "step_seconds_from", "flop_rate", "dp_hours"])))]
pub(crate) struct SimulateArgs {
    /// Recipe to predict (repeatable).
    #[arg(long = "recipe")]
    pub recipes: Vec<PathBuf>,
    /// Finished run directory (its recipe.toml and summary.json): predicted next to measured (repeatable).
    #[arg(long = "run", value_name = "RUN_DIR")]
    pub runs: Vec<PathBuf>,
    /// Override a recipe key of every --recipe, e.g. `--set train.local_batch=64` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// World size K (default: the recipe's train.workers, or the run's). Keeps train.local_batch.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Link bandwidth, each direction: 1gbit, 25gbit, 100mbit, 3GB/s ...
    #[arg(long)]
    pub bandwidth: String,
    /// One-way latency between ring neighbours: 0.2ms, 50us ...
    #[arg(long, default_value = "0")]
    pub latency: String,
    /// Workers per node (default: the recipe's `sync.local.workers_per_node`): `--bandwidth` and
    /// `--latency` are then the links between nodes, and a global sync sums inside each node first.
    #[arg(long)]
    pub node_size: Option<usize>,
    /// Bandwidth of the links inside a node (default: `--bandwidth`).
    #[arg(long)]
    pub intra_bandwidth: Option<String>,
    /// Latency inside a node (default: `--latency`).
    #[arg(long)]
    pub intra_latency: Option<String>,
    /// Measured compute seconds per optimizer step (forward, backward, update), per worker.
    #[arg(long)]
    pub step_seconds: Option<f64>,
    /// Take the compute time per step from a finished run: (wall_seconds - comm_seconds) / steps.
    #[arg(long, value_name = "RUN_DIR")]
    pub step_seconds_from: Option<PathBuf>,
    /// Sustained FLOP/s per worker; compute per step = local_batch * flops_per_sample / rate.
    #[arg(long)]
    pub flop_rate: Option<f64>,
    /// FLOPs of forward + backward per sample (default 6 * params * tokens; tokens = patches for ViT, the context for a GPT, else 1).
    #[arg(long, requires = "flop_rate")]
    pub flops_per_sample: Option<f64>,
    /// Derive compute per step from this wall time (hours) of the data-parallel recipe among --recipe:
    /// (hours - modelled data-parallel communication) / steps.
    #[arg(long)]
    pub dp_hours: Option<f64>,
    /// Trainable parameters (default: built from the recipe's model and dataset).
    #[arg(long)]
    pub params: Option<u64>,
    /// Steps per epoch (default: from the dataset, when it can be opened).
    #[arg(long)]
    pub steps_per_epoch: Option<u64>,
    /// A reference wall time to compare with, `RECIPE_NAME=HOURS` (repeatable).
    #[arg(long = "reference", value_name = "NAME=HOURS")]
    pub references: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One line of the output: a prediction, with a measurement or reference where there is one.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Row {
    /// The predicted wall-clock of the recipe's plan.
    pub prediction: Prediction,
    /// Trainable parameters of the model.
    pub params: u64,
    /// What each synchronization moves (elements, bytes per element, buckets).
    pub payload: SyncPayload,
    /// The run's measured `wall_seconds` from its `summary.json` (`--run` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_seconds: Option<f64>,
    /// The wall time given with `--reference NAME=HOURS`, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_seconds: Option<f64>,
}

/// The full report of `qsr simulate`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Report {
    /// The network the predictions assume (`--bandwidth`, `--latency`), between nodes when there
    /// are nodes.
    pub network: Network,
    /// The network inside a node (`--intra-bandwidth`, `--intra-latency`), when nodes are given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra: Option<Network>,
    /// Compute seconds per optimizer step, the same for every row.
    pub step_seconds: f64,
    /// Where `step_seconds` came from, in words (the flag and its arithmetic).
    pub step_source: String,
    /// One row per `--recipe`, then per `--run`.
    pub rows: Vec<Row>,
}

/// Runs `qsr simulate` and returns its report (printed by [`run`]).
///
/// Predicted wall-clock of a recipe under each sync rule, from the exact round plan
/// (`recipe.plan()`, the same rounds the trainer runs) and a ring all-reduce cost model.
///
/// Model (no overlap of compute and communication, as in the round driver):
/// - every optimizer step costs `step_seconds` of compute (forward, backward, update; per worker,
///   workers in lockstep);
/// - every synchronization is a ring all-reduce of `n` bytes across K ranks, split into `c` calls
///   (1 unless the recipe buckets it), costing
///   `c * 2 (K-1) * latency + 2 (K-1)/K * n / bandwidth`;
/// - a data-parallel round (`SyncMode::Gradients`) all-reduces the gradients (the trainable
///   parameters); a local round (`SyncMode::Parameters`) all-reduces the parameters plus the
///   optimizer moments the recipe's `driver.state` averages.
///
/// The compute time per step comes from one of: a measured value (`--step-seconds`), a run directory
/// (`--step-seconds-from`: `(wall_seconds - comm_seconds) / steps` of its summary), a FLOP rate
/// (`--flop-rate`: `local_batch * flops_per_sample / rate`, with `6 * params * tokens` FLOPs per sample
/// by default), or a data-parallel wall time (`--dp-hours`: the total minus the modelled
/// data-parallel communication, divided by its steps), as done for the paper's 26.7 h.
pub(crate) fn simulate(args: &SimulateArgs) -> Result<Report> {
    if args.recipes.is_empty() && args.runs.is_empty() {
        bail!("give at least one --recipe or --run");
    }
    let net = Network::new(parse_bandwidth(&args.bandwidth)?, parse_duration(&args.latency)?)?;
    let intra = Network::new(
        args.intra_bandwidth.as_deref().map_or(Ok(net.bandwidth_bits_per_second), parse_bandwidth)?,
        args.intra_latency.as_deref().map_or(Ok(net.latency_seconds), parse_duration)?,
    )?;
    let wants_nodes = args.intra_bandwidth.is_some() || args.intra_latency.is_some() || args.node_size.is_some();
    let items = load_items(args)?;
    let cluster = cluster_of(args, &items, net, intra, wants_nodes)?;
    let references = references(args, &items)?;
    let sizes = model_sizes(args, &items)?;
    let (step_seconds, step_source) = step_time(args, &items, &sizes, &cluster)?;
    let mut rows = Vec::new();
    for (item, (params, running)) in items.iter().zip(&sizes) {
        let world = world_of(item);
        let payload = recipe_payload(&item.recipe, *params, *running);
        let plan = item.recipe.plan()?;
        let spe = args
            .steps_per_epoch
            .or_else(|| item.summary.as_ref().map(|s| s.steps_per_epoch as u64))
            .or_else(|| steps_per_epoch(&item.recipe, world));
        if let Some(n) = cluster.nodes.filter(|n| n.size > world || !world.is_multiple_of(n.size)) {
            bail!(
                "`{}`: nodes of {} workers (--node-size) do not divide its {world} workers into whole nodes",
                item.recipe.name,
                n.size
            );
        }
        // The fragment plan and warnings `qsr train` gets from the same check.
        let verdict = qsr_optim::check_sync(&item.recipe.sync_settings()?, qsr_optim::Face::Recipe);
        let name = &item.recipe.name;
        for w in &verdict.warnings {
            eprintln!("qsr: warning: `{name}`: {w}");
        }
        let prediction = match (&item.recipe.sync.streaming, &verdict.fragments) {
            (Some(st), Some(fragments)) => {
                streaming::predict_streaming(name, (fragments, st), step_seconds, &payload, world, (cluster, spe))
            }
            _ => predict(name, &plan, step_seconds, &payload, world, cluster, spe),
        };
        let reference_seconds = references.iter().find(|(n, _)| *n == item.recipe.name).map(|(_, s)| *s);
        rows.push(Row {
            prediction,
            params: *params,
            payload,
            measured_seconds: item.summary.as_ref().map(|s| s.wall_seconds),
            reference_seconds,
        });
    }
    Ok(Report { network: net, intra: wants_nodes.then_some(intra), step_seconds, step_source, rows })
}

/// `qsr simulate`: prints the table (or JSON).
pub(crate) fn run(args: &SimulateArgs, out: &mut dyn std::io::Write) -> Result<()> {
    // A prediction is arithmetic on its inputs: whatever fails is what it was given.
    let report = simulate(args).map_err(crate::exit::bad_input)?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(out, "{}", render(&report))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
