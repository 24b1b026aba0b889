//! The cost model of `qsr simulate`: a ring all-reduce over a network (and nodes), the payload of a
//! sync, and a plan's syncs priced step by step.

use anyhow::{Result, anyhow, bail};
use qsr_sched::{Encoding, Plan, SyncMode};
use serde::{Deserialize, Serialize};

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
    pub(super) fn global_seconds(&self, payload: &SyncPayload, mode: SyncMode, world_size: usize) -> f64 {
        match self.nodes {
            None => payload.seconds(mode, world_size, &self.inter),
            Some(n) => {
                let hosts = world_size.div_ceil(n.size.max(1));
                payload.seconds(mode, n.size.min(world_size), &n.intra) + payload.seconds(mode, hosts, &self.inter)
            }
        }
    }

    /// Seconds of a local average inside a node (none without nodes: every worker is its own node).
    pub(super) fn local_seconds(&self, payload: &SyncPayload) -> f64 {
        let local = SyncPayload { parameter_encoding: payload.local_encoding, ..*payload };
        self.nodes.map_or(0.0, |n| local.seconds(SyncMode::Parameters, n.size, &n.intra))
    }
}

/// Parses a rate as `tc` writes it: `1gbit`, `10Gbit/s`, `25gbps` (bits), `100mbit`, `512kbit`, `1e9`
/// (bits per second); `GB/s`/`MB/s` with a capital `B` are bytes.
pub(crate) fn parse_bandwidth(text: &str) -> Result<f64> {
    let (value, unit) = number_and_unit(text, "bandwidth", "1gbit")?;
    let unit = unit.trim_end_matches("/s").trim_end_matches("ps");
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
    let (value, unit) = number_and_unit(text, "duration", "0.2ms")?;
    let scale = match unit {
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

/// `text` as its number and the unit after it (`1.5e9bit`: 1.5e9 and `bit`); the unit starts at the
/// first letter that is no exponent (`µ` included). `what` and `example` name it in the error.
fn number_and_unit<'a>(text: &'a str, what: &str, example: &str) -> Result<(f64, &'a str)> {
    let s = text.trim();
    let split = s.find(|c: char| c.is_alphabetic() && c != 'e' && c != 'E').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value =
        num.trim().parse().map_err(|_| anyhow!("{what} `{text}`: expected a number with a unit such as {example}"))?;
    Ok((value, unit.trim()))
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

    pub(super) fn elements(&self, mode: SyncMode) -> u64 {
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
pub(super) struct Counted {
    pub(super) syncs: u64,
    pub(super) gradient_syncs: u64,
    pub(super) local_syncs: u64,
    /// Seconds of communication the workers pay (local averages included).
    pub(super) comm: f64,
    pub(super) local_comm: f64,
    pub(super) epochs: Vec<f64>,
}

impl Prediction {
    /// The prediction of `plan` for `world_size` workers, `spe` steps per epoch and `step_seconds`
    /// of compute per step, from what its walk `counted`.
    pub(super) fn new(
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
pub(super) fn local_averages(
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
