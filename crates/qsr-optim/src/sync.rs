//! The settings and reports of synchronizations, below the sync engine (`synchronizer.rs`) and its
//! faces: the driver's settings and policies, the wire, the reports and totals of steps and syncs.

use std::time::Instant;

use qsr_comm::{Codec, Collective, CommStats, ReduceOp, SyncTag};
use qsr_sched::{StepInfo, SyncMode};
use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::optim::Moments;

/// Which optimizer state is averaged at a synchronization (the authors' `--avg-m` / `--avg-v`).
/// Default: none, as in the paper.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatePolicy {
    /// Average SGD momentum / AdamW `exp_avg`.
    #[serde(default)]
    pub average_first_moment: bool,
    /// Average AdamW `exp_avg_sq`.
    #[serde(default)]
    pub average_second_moment: bool,
}

/// What a parameter sync's one buffer holds after the parameters, in this order: the optimizer
/// moments the state policy averages (those the optimizer keeps), then the BatchNorm statistics
/// (`driver.bn = "average"`, a model that has them). The Worker fills it; `qsr simulate` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncBuffer {
    /// The first moments follow the parameters.
    pub first_moment: bool,
    /// The second moments follow.
    pub second_moment: bool,
    /// The running statistics end it.
    pub running: bool,
}

impl SyncBuffer {
    /// The buffer of a worker under `config` whose optimizer keeps `moments`, for a model with
    /// (`has_running`) or without BatchNorm statistics.
    pub fn new(config: &DriverConfig, moments: Moments, has_running: bool) -> Self {
        Self {
            first_moment: config.state.average_first_moment && moments.first,
            second_moment: config.state.average_second_moment && moments.second,
            running: config.bn == BnPolicy::Average && has_running,
        }
    }

    /// Whether it holds more than the parameters.
    pub fn has_state(&self) -> bool {
        self.first_moment || self.second_moment || self.running
    }

    /// Its elements for a model of `params` parameters and `running` statistics.
    pub fn elements(&self, params: u64, running: u64) -> u64 {
        let moments = u64::from(self.first_moment) + u64::from(self.second_moment);
        params + moments * params + if self.running { running } else { 0 }
    }
}

/// What happens to BatchNorm running statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BnPolicy {
    /// The paper: statistics stay local during training; before an evaluation the trainer re-estimates
    /// them on training data and calls [`Worker::average_running_stats`](crate::Worker::average_running_stats).
    #[default]
    Reestimate,
    /// Statistics stay local; evaluation uses rank 0's.
    Local,
    /// Statistics are averaged with the parameters at every synchronization.
    Average,
}

/// Driver options: a recipe's `[driver]` section (keys `driver.<field>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverConfig {
    /// Which optimizer moments are averaged at a sync (`driver.state`); default none.
    #[serde(default)]
    pub state: StatePolicy,
    /// What happens to BatchNorm running statistics (`driver.bn`); default `"reestimate"`.
    #[serde(default)]
    pub bn: BnPolicy,
    /// Micro-batches per step (gradient accumulation); the step's gradient is their mean. Default 1;
    /// `qsr train` sets it to `train.local_batch / train.micro_batch` whatever the recipe says.
    #[serde(default = "one")]
    pub accumulation_steps: usize,
    /// All-reduce in buckets of at most this many elements instead of one call per round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_elems: Option<usize>,
    /// Broadcast rank 0's initial parameters so every worker starts from the same point (as DDP).
    #[serde(default = "yes")]
    pub broadcast_initial: bool,
    /// Where the flat parameters and optimizer state live.
    #[serde(default)]
    pub residency: Residency,
    /// How the payload of a parameter sync (parameters or pseudo-gradients, with the state the
    /// policies append) travels: `f32` (default), `bf16` (f32 accumulation at every hop, half the
    /// bytes), `int8` or `fp8` (a byte per value and a scale per 64: 0.266 of the bytes), `int4`
    /// (0.141) or `int2` (0.078), the quantized ones sending pseudo-gradients with error feedback;
    /// host-resident workers. Gradient all-reduces stay f32.
    #[serde(default)]
    pub wire: Wire,
    /// Compare a fingerprint of the parameters across ranks after every global parameter average
    /// (`driver.fingerprint`; default off): ranks whose parameters differ fail naming the step. One
    /// more all-reduce of 22 values per sync.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fingerprint: bool,
}

/// The element type of a parameter sync on the wire (`driver.wire`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Wire {
    /// 4 bytes per value, exact.
    #[default]
    F32,
    /// 2 bytes per value: every rank ends with the bf16-rounded mean, bit-identical
    /// ([`qsr_comm::Collective::all_reduce_bf16`]).
    Bf16,
    /// A signed byte per value and an f32 scale per 64 values
    /// ([`qsr_comm::Collective::all_reduce_quantized`]). A sync then sends each worker's
    /// pseudo-gradient (the last global parameters minus its own) with error feedback, as DiLoCo's
    /// outer step does, because parameters themselves lose too much in 8 bits.
    Int8,
    /// An fp8 e4m3 number per value and an f32 scale per 64 values, sent as [`Wire::Int8`] is.
    Fp8,
    /// A 4-bit code per value (`-7..=7`) and an f32 scale per 64 values, sent as [`Wire::Int8`] is:
    /// 0.141 of f32's bytes.
    Int4,
    /// A 2-bit code per value (four levels, none zero) and an f32 scale per 64 values, sent as
    /// [`Wire::Int8`] is: 0.078 of f32's bytes (1/16 and the scales). MuLoCo's compression of the
    /// pseudo-gradient; the ring quantizes each hop's partial sum again, which error feedback does
    /// not see.
    Int2,
}

impl Wire {
    /// How a payload of this wire is laid out, for the accounting (`qsr plan`, `qsr simulate`).
    pub fn encoding(self) -> qsr_sched::Encoding {
        match self {
            Wire::F32 => qsr_sched::Encoding::F32,
            Wire::Bf16 => qsr_sched::Encoding::BF16,
            Wire::Int8 | Wire::Fp8 => qsr_sched::Encoding::quantized(qsr_kernels::WIRE_BLOCK as u64),
            Wire::Int4 => qsr_sched::Encoding::packed(4, qsr_kernels::WIRE_BLOCK as u64),
            Wire::Int2 => qsr_sched::Encoding::packed(2, qsr_kernels::WIRE_BLOCK as u64),
        }
    }

    /// The wire's name in a recipe: `f32`, `bf16`, `int8`, `fp8`, `int4`, `int2`.
    pub fn encoding_name(self) -> &'static str {
        match self {
            Wire::F32 => "f32",
            Wire::Bf16 => "bf16",
            Wire::Int8 => "int8",
            Wire::Fp8 => "fp8",
            Wire::Int4 => "int4",
            Wire::Int2 => "int2",
        }
    }

    /// The wire a parameter sync at `level` travels on: this one, except that a node's plain average
    /// (a two-level plan's local level) stays f32 under int8 / fp8, which carry pseudo-gradients of
    /// the global syncs and never raw parameters.
    pub fn at(self, level: Level) -> Wire {
        match (level, self.codec()) {
            (Level::Local, Some(_)) => Wire::F32,
            _ => self,
        }
    }

    /// The codec of a quantized wire (`int8`, `fp8`, `int4`, `int2`); `None` for f32 and bf16.
    pub fn codec(self) -> Option<Codec> {
        match self {
            Wire::Int8 => Some(Codec::Int8),
            Wire::Fp8 => Some(Codec::Fp8E4m3),
            Wire::Int4 => Some(Codec::Int4),
            Wire::Int2 => Some(Codec::Int2),
            Wire::F32 | Wire::Bf16 => None,
        }
    }
}

/// Where a worker's flat parameters and optimizer state live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Residency {
    /// On the device for a cubecl (GPU) backend, on the host otherwise.
    #[default]
    Auto,
    /// Host `Vec<f32>`s, updated by the fused host optimizer (fastest on the CPU backend).
    Host,
    /// burn tensors on the training device (no per-step transfers on a GPU); K simulated workers with
    /// a [`DeviceGroup`](crate::DeviceGroup) average there, with the fused cubecl kernel on a cubecl backend.
    Device,
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self {
            state: StatePolicy::default(),
            bn: BnPolicy::default(),
            accumulation_steps: 1,
            bucket_elems: None,
            broadcast_initial: true,
            residency: Residency::Auto,
            wire: Wire::F32,
            fingerprint: false,
        }
    }
}

/// Which level of a two-level plan a synchronization belongs to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Level {
    /// Over every worker, through the worker's collective (the only level of a flat plan).
    #[default]
    Global,
    /// Inside the worker's node, through the node's collective ([`Worker::set_local`](crate::Worker::set_local)).
    Local,
}

/// One synchronization.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    /// Whether gradients (a data-parallel step, before the update) or parameters (a round's end,
    /// after it) were averaged.
    pub mode: SyncMode,
    /// Over all workers, or inside the node (a local average of a two-level plan).
    #[serde(default)]
    pub level: Level,
    /// Elements all-reduced (parameters or gradients, plus any appended state).
    pub elements: usize,
    /// Collective calls this sync made (1 unless bucketed).
    pub calls: u64,
    /// Bytes this rank sent (the in-process and device groups report what a ring all-reduce of the
    /// same elements would send).
    pub bytes_sent: u64,
    /// Wall time of the sync in seconds, waiting for the other workers, staging and copies included.
    pub seconds: f64,
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// The cursor's description of the step: index, lr, round, whether a sync followed.
    pub info: StepInfo,
    /// Mean loss over the step's micro-batches (this worker's).
    pub loss: f32,
    /// False when the gradients were not finite and the update was skipped.
    pub updated: bool,
    /// The synchronization this step made, if any: a gradient all-reduce before the update or the
    /// parameter average after it, over all workers or (a local average) inside the node.
    pub sync: Option<SyncReport>,
}

/// Totals of the local level of a two-level plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LocalStats {
    /// Local averages inside the node.
    pub syncs: u64,
    /// Their traffic, through the node's collective.
    pub comm: CommStats,
}

/// Totals over a worker's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverStats {
    /// Steps completed, skipped updates included.
    pub steps: u64,
    /// Global synchronizations (gradient and parameter), i.e. rounds completed.
    pub syncs: u64,
    /// Of `syncs`, the data-parallel gradient all-reduces.
    pub gradient_syncs: u64,
    /// Steps whose gradients were not finite, so the optimizer update was skipped (the sync was not).
    pub skipped_updates: u64,
    /// Traffic of global synchronizations only (the initial broadcast is not counted).
    pub comm: CommStats,
    /// The local averages of a two-level plan, counted apart from the global ones.
    #[serde(default)]
    pub local: LocalStats,
    /// Synchronizations averaged on the device by the fused cubecl kernel.
    #[serde(default)]
    pub fused_syncs: u64,
    /// Where the steps' time went, phase by phase (collectives are in `comm.seconds`).
    #[serde(default)]
    pub phases: PhaseTimes,
}

/// Wall-clock seconds a worker spent in each phase of its steps, summed over the steps. On the CPU a
/// phase's time is its work; on an asynchronous device (CUDA) a phase's kernels may still run in a later
/// phase, so the times say where the host waited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseTimes {
    /// The loss closure (the model's forward pass and the loss), with the read of the loss value.
    pub forward: f64,
    /// burn's backward pass.
    pub backward: f64,
    /// Gathering the gradients into the worker's flat buffer (or device tensor).
    pub gradients: f64,
    /// The optimizer update over the flat parameters.
    pub optimizer: f64,
    /// Writing the flat parameters back into the model's tensors.
    pub write_back: f64,
}

impl PhaseTimes {
    /// The sum of the phases.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.gradients + self.optimizer + self.write_back
    }

    /// Adds the time since `since` to the phase `phase` picks; returns now, the next phase's start.
    pub(crate) fn add(&mut self, phase: impl FnOnce(&mut Self) -> &mut f64, since: Instant) -> Instant {
        let now = Instant::now();
        *phase(self) += now.duration_since(since).as_secs_f64();
        now
    }
}

impl SyncReport {
    /// Adds another part of the same sync (e.g. BatchNorm statistics averaged after the parameters).
    pub(crate) fn add(&mut self, other: &SyncReport) {
        self.elements += other.elements;
        self.calls += other.calls;
        self.bytes_sent += other.bytes_sent;
        self.seconds += other.seconds;
    }
}

/// Refuses bf16 syncs over a collective without a bf16 all-reduce before the first step, naming both;
/// `field` is the setting as its user writes it (`driver.wire` in a recipe, `wire` of an
/// `AveragerConfig`).
pub(crate) fn check_wire(wire: Wire, comm: &dyn Collective, field: &str) -> Result<(), OptimError> {
    let supported = match wire {
        Wire::F32 => true,
        Wire::Bf16 => comm.supports_bf16(),
        Wire::Int8 | Wire::Fp8 | Wire::Int4 | Wire::Int2 => comm.supports_quantized(),
    };
    let name = wire.encoding_name();
    if !supported {
        return Err(OptimError::Config {
            field: field.into(),
            reason: format!(
                "the {} collective has no {name} all-reduce (the TCP ring, shared memory and the in-process group do)",
                comm.backend()
            ),
        });
    }
    Ok(())
}

/// How a sync's values travel: the element type on the wire and the most elements per collective
/// call (`None`: one call per sync).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Transfer {
    pub(crate) wire: Wire,
    pub(crate) bucket: Option<usize>,
}

impl Transfer {
    /// The same buckets on `wire`.
    pub(crate) fn on(self, wire: Wire) -> Self {
        Self { wire, ..self }
    }
}

/// Mean all-reduce of `buf` as `transfer` says, every call tagged with `tag` (compared across
/// ranks); returns the calls made.
pub(crate) fn all_reduce_bucketed(
    comm: &mut dyn Collective,
    buf: &mut [f32],
    transfer: Transfer,
    tag: Option<SyncTag>,
) -> Result<u64, qsr_comm::CommError> {
    comm.set_tag(tag);
    let calls = all_reduce_untagged(comm, buf, transfer.bucket, transfer.wire);
    comm.set_tag(None);
    calls
}

fn all_reduce_untagged(
    comm: &mut dyn Collective,
    buf: &mut [f32],
    bucket: Option<usize>,
    wire: Wire,
) -> Result<u64, qsr_comm::CommError> {
    let mut reduce = |chunk: &mut [f32]| match (wire, wire.codec()) {
        (_, Some(codec)) => comm.all_reduce_quantized(chunk, ReduceOp::Mean, codec),
        (Wire::Bf16, None) => comm.all_reduce_bf16(chunk, ReduceOp::Mean),
        _ => comm.all_reduce(chunk, ReduceOp::Mean),
    };
    match bucket {
        Some(b) if b < buf.len() => {
            buf.chunks_mut(b).try_for_each(&mut reduce)?;
            Ok(buf.len().div_ceil(b) as u64)
        }
        // One call for the whole buffer, an empty one too (every rank makes it, on the same wire).
        _ => reduce(buf).map(|()| 1),
    }
}

/// What a flat state's step did, for the worker's report.
pub(crate) struct Stepped {
    /// Sum of the micro-batches' losses.
    pub(crate) loss_sum: f64,
    /// False when the gradients were not finite and the update was skipped.
    pub(crate) updated: bool,
    pub(crate) sync: Option<SyncReport>,
}

/// The end of a step, as the syncs after it see it: the step, and whether it is the run's last.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepEnd<'a> {
    pub(crate) info: &'a StepInfo,
    pub(crate) last: bool,
}
