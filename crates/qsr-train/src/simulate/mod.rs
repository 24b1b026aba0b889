//! `qsr simulate` (documented on [`simulate()`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qsr_models::ModelConfig;
use qsr_sched::{Encoding, Plan, SyncMode};
use serde::{Deserialize, Serialize};

use crate::recipe::TrainRecipe;
use crate::records::Summary;

/// A network: per-link bandwidth and one-way latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Network {
    /// Bits per second, each direction of each link.
    pub bandwidth_bits_per_second: f64,
    /// One-way latency of a message between ring neighbours, in seconds.
    pub latency_seconds: f64,
}

impl Network {
    /// A network with this bandwidth (bits per second, finite and > 0) and latency (seconds, finite and
    /// >= 0); errors name the invalid value.
    pub(crate) fn new(bandwidth_bits_per_second: f64, latency_seconds: f64) -> Result<Self> {
        if !(bandwidth_bits_per_second.is_finite() && bandwidth_bits_per_second > 0.0) {
            bail!("invalid bandwidth {bandwidth_bits_per_second}: must be a positive number of bits per second");
        }
        if !(latency_seconds.is_finite() && latency_seconds >= 0.0) {
            bail!("invalid latency {latency_seconds}: must be a non-negative number of seconds");
        }
        Ok(Network { bandwidth_bits_per_second, latency_seconds })
    }

    /// Seconds of one ring all-reduce of `bytes` across `world_size` ranks in `calls` collective calls:
    /// `calls * 2 (K-1) * latency + 2 (K-1)/K * bytes * 8 / bandwidth`; zero for one rank.
    pub(crate) fn allreduce_seconds(&self, bytes: f64, world_size: usize, calls: u64) -> f64 {
        if world_size <= 1 {
            return 0.0;
        }
        let k = world_size as f64;
        let steps = 2.0 * (k - 1.0);
        calls as f64 * steps * self.latency_seconds + steps / k * bytes * 8.0 / self.bandwidth_bits_per_second
    }
}

/// Where the workers sit: one network between all of them, or nodes of `size` workers on a faster
/// network of their own, the nodes joined by `inter`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Cluster {
    /// The network between nodes (between all workers when there are no nodes).
    pub inter: Network,
    /// Nodes of several workers, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Nodes>,
}

/// Nodes of a [`Cluster`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Nodes {
    /// Workers per node.
    pub size: usize,
    /// The network inside a node.
    pub intra: Network,
}

impl From<Network> for Cluster {
    fn from(net: Network) -> Self {
        Cluster { inter: net, nodes: None }
    }
}

impl Cluster {
    /// Seconds of a global sync over `world_size` workers: one ring over `inter`, or with nodes (as
    /// our collectives do it) a sum inside each node, a ring of one leader per node over `inter`
    /// and a broadcast inside each node, the two node phases costed as one all-reduce on `intra`.
    fn global_seconds(&self, payload: &SyncPayload, mode: SyncMode, world_size: usize) -> f64 {
        match self.nodes {
            None => payload.seconds(mode, world_size, &self.inter),
            Some(n) => {
                let hosts = world_size.div_ceil(n.size.max(1));
                payload.seconds(mode, n.size.min(world_size), &n.intra) + payload.seconds(mode, hosts, &self.inter)
            }
        }
    }

    /// Seconds of a local average inside a node (none without nodes: every worker is its own node).
    fn local_seconds(&self, payload: &SyncPayload) -> f64 {
        let local = SyncPayload { parameter_encoding: payload.local_encoding, ..*payload };
        self.nodes.map_or(0.0, |n| local.seconds(SyncMode::Parameters, n.size, &n.intra))
    }
}

/// Parses a rate as `tc` writes it: `1gbit`, `10Gbit/s`, `25gbps` (bits), `100mbit`, `512kbit`, `1e9`
/// (bits per second); `GB/s`/`MB/s` with a capital `B` are bytes.
pub(crate) fn parse_bandwidth(text: &str) -> Result<f64> {
    let s = text.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 =
        num.trim().parse().map_err(|_| anyhow!("bandwidth `{text}`: expected a number with a unit such as 1gbit"))?;
    let unit = unit.trim().trim_end_matches("/s").trim_end_matches("ps");
    let bytes = unit.ends_with('B');
    let lower = unit.to_ascii_lowercase();
    let prefix = lower.trim_end_matches("bit").trim_end_matches('b');
    let scale = match prefix {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        _ => bail!(
            "bandwidth `{text}`: unknown unit `{unit}` (expected bit, kbit, mbit, gbit, tbit or kB/s, MB/s, GB/s)"
        ),
    };
    let bits = value * scale * if bytes { 8.0 } else { 1.0 };
    if !(bits.is_finite() && bits > 0.0) {
        bail!("bandwidth `{text}`: must be positive");
    }
    Ok(bits)
}

/// Parses a duration: `0.2ms`, `200us`, `1.5s`, `50ns`, or a bare number of seconds.
pub(crate) fn parse_duration(text: &str) -> Result<f64> {
    let s = text.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 =
        num.trim().parse().map_err(|_| anyhow!("duration `{text}`: expected a number with a unit such as 0.2ms"))?;
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        other => bail!("duration `{text}`: unknown unit `{other}` (expected s, ms, us or ns)"),
    };
    let secs = value * scale;
    if !(secs.is_finite() && secs >= 0.0) {
        bail!("duration `{text}`: must be non-negative");
    }
    Ok(secs)
}

/// What one synchronization moves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct SyncPayload {
    /// Elements of a data-parallel (gradient) all-reduce.
    pub gradient_elements: u64,
    /// Elements of a local-round (parameter) all-reduce, with averaged moments and BN statistics.
    pub parameter_elements: u64,
    /// Bytes per element of a gradient all-reduce on the wire (4: f32).
    pub bytes_per_element: u64,
    /// How a parameter all-reduce's payload travels (`driver.wire`): f32, bf16, or int8 / fp8 with
    /// one scale per 64 values.
    pub parameter_encoding: Encoding,
    /// How a node's local average travels (`Wire::at(Level::Local)`): f32 under int8 / fp8, which
    /// carry only the global syncs' pseudo-gradients.
    pub local_encoding: Encoding,
    /// Largest bucket in elements (`driver.bucket_elems`), if the recipe buckets its all-reduces.
    pub bucket_elements: Option<u64>,
}

impl SyncPayload {
    /// Plain payload: `params` elements both ways, f32, one call.
    #[cfg(test)]
    pub(crate) fn params(params: u64) -> Self {
        SyncPayload {
            gradient_elements: params,
            parameter_elements: params,
            bytes_per_element: 4,
            parameter_encoding: Encoding::F32,
            local_encoding: Encoding::F32,
            bucket_elements: None,
        }
    }

    fn elements(&self, mode: SyncMode) -> u64 {
        match mode {
            SyncMode::Gradients => self.gradient_elements,
            SyncMode::Parameters => self.parameter_elements,
        }
    }

    /// Seconds of one synchronization of `mode`.
    pub(crate) fn seconds(&self, mode: SyncMode, world_size: usize, net: &Network) -> f64 {
        let n = self.elements(mode);
        let calls = self.bucket_elements.filter(|&b| b > 0).map_or(1, |b| n.div_ceil(b).max(1));
        let bytes = match mode {
            SyncMode::Gradients => n * self.bytes_per_element,
            SyncMode::Parameters => self.parameter_encoding.bytes(n),
        };
        net.allreduce_seconds(bytes as f64, world_size, calls)
    }
}

/// The predicted wall-clock of one plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Prediction {
    /// The recipe's name.
    pub name: String,
    /// The sync rule's name (`dp`, `constant`, `qsr`, ...).
    pub rule: String,
    /// K: the ranks of the ring.
    pub world_size: usize,
    /// Steps of the plan (its end step).
    pub steps: u64,
    /// Steps per epoch, if known; `epoch_seconds` is empty without it.
    pub steps_per_epoch: Option<u64>,
    /// Synchronizations: the plan's rounds.
    pub syncs: u64,
    /// Of `syncs`, the data-parallel (gradient) all-reduces.
    pub gradient_syncs: u64,
    /// `100 * syncs / steps`: data parallel is 100.
    pub comm_percent: f64,
    /// Compute seconds per optimizer step used for the prediction.
    pub step_seconds: f64,
    /// `steps * step_seconds`.
    pub compute_seconds: f64,
    /// Local averages inside the nodes (two-level plans).
    #[serde(default)]
    pub local_syncs: u64,
    /// Modelled seconds of all synchronizations, local averages included; for a streaming recipe, the
    /// time the workers waited for averages that had not arrived (the rest overlaps the steps).
    pub comm_seconds: f64,
    /// Of `comm_seconds`, the local averages'.
    #[serde(default)]
    pub local_comm_seconds: f64,
    /// `compute_seconds + comm_seconds`.
    pub total_seconds: f64,
    /// Time of each epoch (steps and syncs whose last step falls in it); the last may be partial.
    pub epoch_seconds: Vec<f64>,
}

impl Prediction {
    /// Mean time of a full epoch (total over epochs run).
    pub(crate) fn mean_epoch_seconds(&self) -> Option<f64> {
        self.steps_per_epoch.filter(|&s| s > 0).map(|s| self.total_seconds * s as f64 / self.steps as f64)
    }
}

/// Predicts the wall-clock of `plan`: `steps * step_seconds` plus the cost of every round's sync on
/// `net` (a [`Network`] between all workers, or a [`Cluster`] of nodes), and of every local average
/// of a two-level plan inside a node.
pub(crate) fn predict(
    name: &str,
    plan: &Plan,
    step_seconds: f64,
    payload: &SyncPayload,
    world_size: usize,
    net: impl Into<Cluster>,
    steps_per_epoch: Option<u64>,
) -> Prediction {
    let net: Cluster = net.into();
    let steps = plan.end_step();
    let mut syncs = 0;
    let mut gradient_syncs = 0;
    let mut comm = 0.0;
    let spe = steps_per_epoch.filter(|&s| s > 0);
    let mut epochs = vec![0.0; spe.map_or(0, |s| steps.div_ceil(s) as usize)];
    let grad_cost = net.global_seconds(payload, SyncMode::Gradients, world_size);
    let param_cost = net.global_seconds(payload, SyncMode::Parameters, world_size);
    for r in plan.rounds() {
        let c = match r.mode {
            SyncMode::Gradients => {
                gradient_syncs += 1;
                grad_cost
            }
            SyncMode::Parameters => param_cost,
        };
        syncs += 1;
        comm += c;
        if let Some(s) = spe {
            // Compute time goes to the epoch of each step; the sync to the epoch of the round's last step.
            let mut t = r.start;
            while t < r.end() {
                let e = t / s;
                let upto = ((e + 1) * s).min(r.end());
                epochs[e as usize] += (upto - t) as f64 * step_seconds;
                t = upto;
            }
            epochs[((r.end() - 1) / s) as usize] += c;
        }
    }
    let (local_syncs, local_comm) = local_averages(plan, &net, payload, spe, &mut epochs);
    let counted = Counted { syncs, gradient_syncs, local_syncs, comm: comm + local_comm, local_comm, epochs };
    Prediction::new(name, plan, (world_size, spe, step_seconds), counted)
}

/// What a prediction's walk through a plan counted.
struct Counted {
    syncs: u64,
    gradient_syncs: u64,
    local_syncs: u64,
    /// Seconds of communication the workers pay (local averages included).
    comm: f64,
    local_comm: f64,
    epochs: Vec<f64>,
}

impl Prediction {
    /// The prediction of `plan` for `world_size` workers, `spe` steps per epoch and `step_seconds`
    /// of compute per step, from what its walk `counted`.
    fn new(
        name: &str,
        plan: &Plan,
        (world_size, spe, step_seconds): (usize, Option<u64>, f64),
        counted: Counted,
    ) -> Self {
        let steps = plan.end_step();
        let compute = steps as f64 * step_seconds;
        Prediction {
            name: name.to_string(),
            rule: plan.sync().name().to_string(),
            world_size,
            steps,
            steps_per_epoch: spe,
            syncs: counted.syncs,
            gradient_syncs: counted.gradient_syncs,
            comm_percent: 100.0 * counted.syncs as f64 / steps.max(1) as f64,
            step_seconds,
            compute_seconds: compute,
            local_syncs: counted.local_syncs,
            comm_seconds: counted.comm,
            local_comm_seconds: counted.local_comm,
            total_seconds: compute + counted.comm,
            epoch_seconds: counted.epochs,
        }
    }
}

/// The local averages of a two-level plan and their modelled seconds, each added to the epoch of its
/// step.
fn local_averages(
    plan: &Plan,
    net: &Cluster,
    payload: &SyncPayload,
    spe: Option<u64>,
    epochs: &mut [f64],
) -> (u64, f64) {
    if plan.local().is_none() {
        return (0, 0.0);
    }
    let cost = net.local_seconds(payload);
    let mut n = 0;
    for s in plan.cursor().filter(|s| s.local_sync_after) {
        n += 1;
        if let Some(e) = spe.and_then(|spe| epochs.get_mut((s.step / spe) as usize)) {
            *e += cost;
        }
    }
    (n, n as f64 * cost)
}

/// Compute seconds per step implied by a measured wall time of `plan` (normally data parallel): the
/// total minus the modelled communication, over the steps. Errors if communication alone exceeds it.
pub(crate) fn step_seconds_from_wall(
    plan: &Plan,
    wall_seconds: f64,
    payload: &SyncPayload,
    world_size: usize,
    net: impl Into<Cluster>,
) -> Result<f64> {
    let net = &net.into();
    let comm = predict("calibration", plan, 0.0, payload, world_size, *net, None).comm_seconds;
    let steps = plan.end_step() as f64;
    let step = (wall_seconds - comm) / steps;
    if !(step.is_finite() && step > 0.0) {
        bail!(
            "a wall time of {wall_seconds:.1} s is less than the modelled communication alone ({comm:.1} s over {} syncs): the network is faster than assumed",
            plan.summary().rounds
        );
    }
    Ok(step)
}

/// The payload a recipe moves, given its trainable parameter count and BN running-statistic count.
pub(crate) fn recipe_payload(recipe: &TrainRecipe, params: u64, running: u64) -> SyncPayload {
    // The buffer the Worker fills, from the same rule.
    let buffer = qsr_optim::SyncBuffer::new(&recipe.driver, recipe.optimizer.moments(), running > 0);
    SyncPayload {
        gradient_elements: params,
        parameter_elements: buffer.elements(params, running),
        bytes_per_element: 4,
        parameter_encoding: recipe.driver.wire.encoding(),
        local_encoding: recipe.driver.wire.at(qsr_optim::Level::Local).encoding(),
        bucket_elements: recipe.driver.bucket_elems.map(|b| b as u64),
    }
}

/// Positions a sample passes through the weights: ViT tokens (`(image / patch)^2`), else 1.
fn tokens_per_sample(model: &ModelConfig) -> u64 {
    match model {
        ModelConfig::Vit(v) => v.image_size.map_or(1, |i| ((i / v.patch_size.max(1)) as u64).pow(2)),
        // A sample is one window: every position predicts a token.
        ModelConfig::Gpt(g) => g.context as u64,
        _ => 1,
    }
}

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

struct Item {
    recipe: TrainRecipe,
    summary: Option<Summary>,
}

fn read_summary(dir: &Path) -> Result<Summary> {
    let path = dir.join("summary.json");
    let bytes = crate::files::read_regular(&path, crate::files::SUMMARY_BYTES, "run summary")
        .context("is the run finished?")?;
    serde_json::from_slice(&bytes).with_context(|| format!("{} is not a qsr summary", path.display()))
}

/// Trainable parameters and BN running statistics of a recipe's model (built on the CPU).
fn count_params(recipe: &TrainRecipe) -> Result<(u64, u64)> {
    let device = crate::device_spec::device("cpu")?;
    let model = crate::worker::build_model(recipe, &device).with_context(|| {
        format!("cannot build the model of `{}` to count its parameters (pass --params)", recipe.name)
    })?;
    let trainable = model.trainable_params() as u64;
    let all = model.num_params() as u64;
    Ok((trainable, all.saturating_sub(trainable)))
}

fn steps_per_epoch(recipe: &TrainRecipe, world: usize) -> Option<u64> {
    if let Some(gpt) = recipe.model.as_gpt() {
        let corpus = crate::recipe::open_corpus(&recipe.data).ok()?;
        return crate::worker::task::text_steps_per_epoch(recipe, &corpus, gpt.context, world).ok().map(|s| s as u64);
    }
    let set = crate::recipe::open_dataset(&recipe.data, qsr_data::Split::Train).ok()?;
    let per = world * recipe.train.local_batch;
    (per > 0).then(|| (set.len() / per) as u64).filter(|&s| s > 0)
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

/// The one cluster every row is priced on: nodes of `--node-size` workers (or of the first recipe's
/// `sync.local.workers_per_node`) on the intra-node network, or one network between all workers.
/// A two-level recipe needs nodes: its local averages would cost nothing without them.
fn cluster_of(args: &SimulateArgs, items: &[Item], inter: Network, intra: Network, wants: bool) -> Result<Cluster> {
    let from_recipe = || items.iter().find_map(|i| i.recipe.sync.local.as_ref().and_then(|l| l.workers_per_node));
    let nodes = match args.node_size.or_else(from_recipe) {
        Some(0) => bail!("--node-size must be at least 1"),
        Some(size) => Some(Nodes { size, intra }),
        None if wants => {
            bail!("the intra-node network needs the node size (--node-size or sync.local.workers_per_node)")
        }
        None => None,
    };
    if let Some(i) = items.iter().find(|i| i.recipe.sync.local.is_some() && nodes.is_none()) {
        bail!("`{}` averages inside nodes ([sync.local]): give --node-size", i.recipe.name);
    }
    Ok(Cluster { inter, nodes })
}

/// The `--recipe` files (with `--set` and `--world-size` applied), then the `--run` directories
/// (their recipe at the world size they ran with, and their summary).
fn load_items(args: &SimulateArgs) -> Result<Vec<Item>> {
    let mut items = Vec::new();
    for path in &args.recipes {
        let mut recipe = TrainRecipe::load(path, &args.sets)?;
        if let Some(k) = args.world_size {
            if k == 0 {
                bail!("--world-size must be at least 1");
            }
            recipe.train.workers = k;
        }
        items.push(Item { recipe, summary: None });
    }
    for dir in &args.runs {
        let summary = read_summary(dir)?;
        let mut recipe = TrainRecipe::load(&dir.join("recipe.toml"), &[])?;
        recipe.train.workers = summary.world_size;
        items.push(Item { recipe, summary: Some(summary) });
    }
    Ok(items)
}

/// `--reference NAME=HOURS` as `(name, seconds)`; each name must be one of the items'.
fn references(args: &SimulateArgs, items: &[Item]) -> Result<Vec<(String, f64)>> {
    let mut references = Vec::new();
    for r in &args.references {
        let (name, hours) = r.split_once('=').ok_or_else(|| anyhow!("--reference {r}: expected NAME=HOURS"))?;
        let hours: f64 = hours
            .trim()
            .parse()
            .ok()
            .filter(|h: &f64| h.is_finite() && *h > 0.0)
            .ok_or_else(|| anyhow!("--reference {r}: `{hours}` is not a positive number of hours"))?;
        if !items.iter().any(|i| i.recipe.name == name.trim()) {
            bail!("--reference {r}: no recipe named `{}`", name.trim());
        }
        references.push((name.trim().to_string(), hours * 3600.0));
    }
    Ok(references)
}

/// `(trainable, running)` parameter counts of each item's model: `--params`, or counted once per
/// distinct model config (building a model is the slow part).
fn model_sizes(args: &SimulateArgs, items: &[Item]) -> Result<Vec<(u64, u64)>> {
    let mut counts: Vec<(String, (u64, u64))> = Vec::new();
    let mut sizes = Vec::new();
    for item in items {
        let size = match args.params {
            Some(p) => (p, 0),
            None => {
                let key =
                    serde_json::to_string(&(&item.recipe.model, &item.recipe.data.dataset, &item.recipe.data.path))?;
                match counts.iter().find(|(k, _)| *k == key) {
                    Some((_, c)) => *c,
                    None => {
                        let c = count_params(&item.recipe)?;
                        counts.push((key, c));
                        c
                    }
                }
            }
        };
        sizes.push(size);
    }
    Ok(sizes)
}

/// The world size an item is simulated at: the one its run had, else its recipe's.
fn world_of(item: &Item) -> usize {
    item.summary.as_ref().map_or(item.recipe.train.workers, |s| s.world_size)
}

/// Compute seconds per step and where they come from, from the first of `--step-seconds`,
/// `--step-seconds-from`, `--flop-rate`, `--dp-hours` given.
fn step_time(args: &SimulateArgs, items: &[Item], sizes: &[(u64, u64)], net: &Cluster) -> Result<(f64, String)> {
    if let Some(s) = args.step_seconds {
        if !(s.is_finite() && s >= 0.0) {
            bail!("--step-seconds {s}: must be a non-negative number");
        }
        Ok((s, format!("measured: {s} s per step (--step-seconds)")))
    } else if let Some(dir) = &args.step_seconds_from {
        let s = read_summary(dir)?;
        let steps = s.steps.max(1) as f64;
        // Both levels' communication: local averages are not compute either.
        let comm = s.comm_seconds + s.local.as_ref().map_or(0.0, |l| l.comm_seconds);
        let step = (s.wall_seconds - comm).max(0.0) / steps;
        Ok((
            step,
            format!("run {}: (wall {:.2} s - comm {comm:.2} s) / {} steps", dir.display(), s.wall_seconds, s.steps),
        ))
    } else if let Some(rate) = args.flop_rate {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--flop-rate {rate}: must be positive");
        }
        let item = &items[0];
        let flops =
            args.flops_per_sample.unwrap_or(6.0 * sizes[0].0 as f64 * tokens_per_sample(&item.recipe.model) as f64);
        let step = item.recipe.train.local_batch as f64 * flops / rate;
        Ok((step, format!("{} samples x {flops:.3e} FLOP / {rate:.3e} FLOP/s", item.recipe.train.local_batch)))
    } else if let Some(hours) = args.dp_hours {
        step_time_from_dp_hours(hours, items, sizes, net)
    } else {
        bail!("give one of --step-seconds, --step-seconds-from, --flop-rate, --dp-hours");
    }
}

/// `--dp-hours`: the data-parallel recipe's wall time less its modelled communication, per step.
fn step_time_from_dp_hours(hours: f64, items: &[Item], sizes: &[(u64, u64)], net: &Cluster) -> Result<(f64, String)> {
    let idx = items
        .iter()
        .position(|i| matches!(i.recipe.sync.rule, qsr_sched::SyncRule::Dp))
        .ok_or_else(|| anyhow!("--dp-hours needs a data-parallel recipe (sync.rule = \"dp\") among --recipe"))?;
    let item = &items[idx];
    let payload = recipe_payload(&item.recipe, sizes[idx].0, sizes[idx].1);
    let plan = item.recipe.plan()?;
    let step = step_seconds_from_wall(&plan, hours * 3600.0, &payload, world_of(item), *net)?;
    let comm = predict("", &plan, 0.0, &payload, world_of(item), *net, None).comm_seconds;
    Ok((
        step,
        format!(
            "from {}'s {hours} h: ({:.0} s - modelled DP communication {:.0} s) / {} steps",
            item.recipe.name,
            hours * 3600.0,
            comm,
            plan.end_step()
        ),
    ))
}

fn fmt_time(s: f64) -> String {
    if s >= 3600.0 { format!("{:.2} h", s / 3600.0) } else { format!("{s:.2} s") }
}

/// The report as a text table.
pub(crate) fn render(report: &Report) -> String {
    let mut out = String::new();
    let net = &report.network;
    let _ = writeln!(
        out,
        "network: {:.3} Gbit/s per link, {:.3} ms latency; compute {:.4} s per step ({})",
        net.bandwidth_bits_per_second / 1e9,
        net.latency_seconds * 1e3,
        report.step_seconds,
        report.step_source
    );
    if let Some(intra) = &report.intra {
        let _ = writeln!(
            out,
            "inside a node: {:.3} Gbit/s per link, {:.3} ms latency",
            intra.bandwidth_bits_per_second / 1e9,
            intra.latency_seconds * 1e3
        );
    }
    let has_local = report.rows.iter().any(|r| r.prediction.local_syncs > 0);
    let has_meas = report.rows.iter().any(|r| r.measured_seconds.is_some());
    let has_ref = report.rows.iter().any(|r| r.reference_seconds.is_some());
    let mut header =
        vec!["recipe", "rule", "params", "K", "steps", "syncs", "comm %", "compute", "comm", "per epoch", "predicted"];
    if has_local {
        header.extend(["local", "local comm"]);
    }
    if has_meas {
        header.extend(["measured", "pred/meas"]);
    }
    if has_ref {
        header.extend(["reference", "pred/ref"]);
    }
    let mut lines = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    for r in &report.rows {
        let p = &r.prediction;
        let mut l = vec![
            p.name.clone(),
            p.rule.clone(),
            r.params.to_string(),
            p.world_size.to_string(),
            p.steps.to_string(),
            p.syncs.to_string(),
            format!("{:.1}", p.comm_percent),
            fmt_time(p.compute_seconds),
            fmt_time(p.comm_seconds),
            p.mean_epoch_seconds().map_or("-".into(), fmt_time),
            fmt_time(p.total_seconds),
        ];
        if has_local {
            l.push(p.local_syncs.to_string());
            l.push(fmt_time(p.local_comm_seconds));
        }
        if has_meas {
            l.push(r.measured_seconds.map_or("-".into(), fmt_time));
            l.push(r.measured_seconds.map_or("-".into(), |m| format!("{:.3}", p.total_seconds / m)));
        }
        if has_ref {
            l.push(r.reference_seconds.map_or("-".into(), fmt_time));
            l.push(r.reference_seconds.map_or("-".into(), |m| format!("{:.3}", p.total_seconds / m)));
        }
        lines.push(l);
    }
    let widths: Vec<usize> =
        (0..lines[0].len()).map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0)).collect();
    for l in &lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
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

mod streaming;

#[cfg(test)]
mod tests;
