//! The round driver: one worker's training loop body.
//!
//! Each [`Worker::step`] takes the next step from the `qsr-sched` cursor, runs the caller's loss closure
//! on every micro-batch, accumulates gradients, and applies the worker's own optimizer with the
//! scheduled lr. When the cursor says the step ends a round, the worker averages its parameters with
//! the other workers through its [`Collective`] in **one** flat all-reduce (optionally bucketed), with
//! the optimizer moments and BatchNorm statistics appended to the same buffer when the policies ask for
//! it. In data-parallel rounds (`SyncMode::Gradients`) the gradients are averaged before the update
//! instead. The synchronization is driven here, after the update, and never depends on the update
//! having happened: a step whose gradients are not finite skips its update but keeps its sync.
//!
//! With device residency ([`Residency`]) the flat state is burn tensors and simulated workers average
//! through a [`DeviceGroup`]: one fused launch per averaged tensor (parameters, and each moment the
//! policy names); BatchNorm statistics, when averaged, still go through the host collective.

use std::time::Instant;

use std::borrow::Cow;

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use qsr_comm::{Collective, CommStats, ReduceOp};
use qsr_sched::{Cursor, StepInfo, SyncMode};
use serde::{Deserialize, Serialize};

use crate::device::{DeviceGroup, DeviceOptimizer, all_finite, to_host};
use crate::error::{LossError, OptimError};
use crate::flat::ParamLayout;
use crate::optim::{OptimState, Optimizer, OptimizerConfig};

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

/// What happens to BatchNorm running statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BnPolicy {
    /// The paper: statistics stay local during training; before an evaluation the trainer re-estimates
    /// them on training data and calls [`Worker::average_running_stats`].
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
    /// a [`DeviceGroup`] average there, with the fused cubecl kernel on a cubecl backend.
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
        }
    }
}

/// One synchronization.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    /// Whether gradients (a data-parallel step, before the update) or parameters (a round's end,
    /// after it) were averaged.
    pub mode: SyncMode,
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
    /// parameter average after it.
    pub sync: Option<SyncReport>,
}

/// Totals over a worker's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverStats {
    /// Steps completed, skipped updates included.
    pub steps: u64,
    /// Synchronizations (gradient and parameter), i.e. rounds completed.
    pub syncs: u64,
    /// Of `syncs`, the data-parallel gradient all-reduces.
    pub gradient_syncs: u64,
    /// Steps whose gradients were not finite, so the optimizer update was skipped (the sync was not).
    pub skipped_updates: u64,
    /// Traffic of synchronizations only (the initial broadcast is not counted).
    pub comm: CommStats,
    /// Synchronizations averaged on the device by the fused cubecl kernel.
    #[serde(default)]
    pub fused_syncs: u64,
}

/// The device-resident state of a worker (see [`Residency::Device`]).
struct DeviceReplica {
    /// The training device without autodiff.
    device: Device,
    params: Tensor<1>,
    optimizer: DeviceOptimizer,
    group: Option<DeviceGroup>,
}

/// One worker: a model replica, its flat parameters, its optimizer state, its collective and cursor.
pub struct Worker<M: Module> {
    /// The replica; writes go through a clone, so a failed write leaves it intact.
    model: M,
    layout: ParamLayout,
    params: Vec<f32>,
    grads: Vec<f32>,
    grad_sum: Vec<f32>,
    sync_buf: Vec<f32>,
    optimizer: Optimizer,
    comm: Box<dyn Collective>,
    cursor: Cursor,
    config: DriverConfig,
    stats: DriverStats,
    dev: Option<DeviceReplica>,
}

impl<M: Module> Worker<M> {
    /// Wraps `model` (on an autodiff device) for training under `cursor`'s plan.
    pub fn new(
        model: M,
        optimizer: OptimizerConfig,
        comm: Box<dyn Collective>,
        cursor: Cursor,
        config: DriverConfig,
    ) -> Result<Self, OptimError> {
        if config.accumulation_steps == 0 {
            return Err(OptimError::Config {
                field: "driver.accumulation_steps".into(),
                reason: "must be at least 1".into(),
            });
        }
        if config.bucket_elems == Some(0) {
            return Err(OptimError::Config {
                field: "driver.bucket_elems".into(),
                reason: "must be at least 1".into(),
            });
        }
        // burn shares BatchNorm running state between clones of a module; `valid().train()` gives this
        // worker its own, so simulated workers keep local statistics as the paper's workers do.
        let model = model.valid().train();
        let layout = ParamLayout::of(&model);
        let n = layout.len();
        // Per-tensor ranges: clipping sums squares per tensor, as torch does.
        let tensors: Vec<_> = layout.trainable.iter().map(|e| e.range.clone()).collect();
        let optimizer = Optimizer::new(optimizer, n, &layout.no_decay_ranges())?.with_tensors(&tensors)?;
        let mut params = vec![0.0; n];
        layout.read_params(&model, &mut params)?;
        let mut w = Self {
            model,
            layout,
            params,
            grads: vec![0.0; n],
            grad_sum: Vec::new(),
            sync_buf: Vec::new(),
            optimizer,
            comm,
            cursor,
            config,
            stats: DriverStats::default(),
            dev: None,
        };
        if w.config.broadcast_initial && w.comm.world_size() > 1 {
            let step = w.cursor.step();
            w.comm.broadcast(&mut w.params, 0).map_err(|source| OptimError::Comm { step, source })?;
            if w.layout.running_len() > 0 {
                let mut running = vec![0.0; w.layout.running_len()];
                w.layout.read_running(w.model(), &mut running)?;
                w.comm.broadcast(&mut running, 0).map_err(|source| OptimError::Comm { step, source })?;
                w.replace_running(&running)?;
            }
            w.write_back()?;
        }
        if resolve_residency(w.config.residency, w.model()) == Residency::Device {
            let device = w.model_device().inner();
            let params = w.layout.params_tensor(w.model(), &device)?;
            let optimizer =
                DeviceOptimizer::new(w.optimizer.config().clone(), n, &w.layout.no_decay_ranges(), &device)?;
            // The host copies are not used from here on (the host optimizer keeps only its config).
            w.params = Vec::new();
            w.grads = Vec::new();
            w.optimizer = Optimizer::new(w.optimizer.config().clone(), 0, &[])?;
            w.dev = Some(DeviceReplica { device, params, optimizer, group: None });
        }
        Ok(w)
    }

    /// Gives a device-resident worker the in-process group of its K simulated peers on the same
    /// device, so syncs average there (rank and size must match the collective's).
    pub fn set_device_group(&mut self, group: DeviceGroup) -> Result<(), OptimError> {
        if group.rank() != self.rank() || group.world_size() != self.world_size() {
            return Err(OptimError::DeviceGroup(format!(
                "rank {}/{} does not match the collective's {}/{}",
                group.rank(),
                group.world_size(),
                self.rank(),
                self.world_size()
            )));
        }
        match &mut self.dev {
            Some(d) => {
                d.group = Some(group);
                Ok(())
            }
            None => Err(OptimError::DeviceGroup("it needs a device-resident worker (driver.residency)".into())),
        }
    }

    /// Whether parameters and optimizer state live on the device.
    pub fn is_device_resident(&self) -> bool {
        self.dev.is_some()
    }

    fn model_device(&self) -> Device {
        model_device(self.model())
    }

    /// The worker's model replica (its parameters equal the flat ones after every step).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model replica, ending the worker (after training: to evaluate or save it).
    pub fn into_model(self) -> M {
        self.model
    }

    /// Replaces the model (e.g. after the trainer re-estimated BatchNorm statistics with forward passes).
    /// Its trainable parameters must equal the worker's; they are overwritten from the flat buffer.
    pub fn set_model(&mut self, model: M) -> Result<(), OptimError> {
        let layout = ParamLayout::of(&model);
        if layout != self.layout {
            return Err(OptimError::Layout("the new model has a different parameter layout".into()));
        }
        self.model = model;
        self.write_back()
    }

    /// Where the model's parameters and running statistics lie in the flat buffers.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    /// The worker's flat trainable parameters (equal to the model's); downloaded when device-resident.
    pub fn params(&self) -> Result<Cow<'_, [f32]>, OptimError> {
        match &self.dev {
            Some(d) => Ok(Cow::Owned(to_host(&d.params)?)),
            None => Ok(Cow::Borrowed(&self.params)),
        }
    }
    /// The optimizer settings the worker was built with.
    pub fn optimizer_config(&self) -> &OptimizerConfig {
        self.optimizer.config()
    }
    /// The optimizer state (for checkpoints); downloaded when device-resident.
    pub fn optimizer_state(&self) -> Result<Cow<'_, OptimState>, OptimError> {
        match &self.dev {
            Some(d) => Ok(Cow::Owned(d.optimizer.state()?)),
            None => Ok(Cow::Borrowed(self.optimizer.state())),
        }
    }
    /// The position in the plan: [`Cursor::step`] is the next step to run.
    pub fn cursor(&self) -> &Cursor {
        &self.cursor
    }
    /// Totals so far.
    pub fn stats(&self) -> &DriverStats {
        &self.stats
    }
    /// The collective the worker synchronizes over. Its [`Collective::stats`] also count the initial
    /// broadcast, [`Worker::average_running_stats`] and the trainer's own reductions, but not
    /// averages done by a [`DeviceGroup`]; [`DriverStats::comm`] counts the syncs only.
    pub fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }
    /// The collective, for the trainer's own reductions (evaluation counts); every rank must make the
    /// same calls.
    pub fn comm_mut(&mut self) -> &mut dyn Collective {
        self.comm.as_mut()
    }
    /// This worker's rank in the collective, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// The number of workers (K) in the collective.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Restores parameters, optimizer state and position (from a checkpoint taken at a sync point).
    pub fn restore(&mut self, params: &[f32], state: crate::OptimState, cursor: Cursor) -> Result<(), OptimError> {
        if params.len() != self.layout.len() {
            return Err(OptimError::Layout(format!(
                "checkpoint has {} parameters, model {}",
                params.len(),
                self.layout.len()
            )));
        }
        match &mut self.dev {
            Some(d) => {
                d.optimizer.load_state(state, &d.device)?;
                d.params = Tensor::<1>::from_data(TensorData::new(params.to_vec(), [params.len()]), &d.device);
            }
            None => {
                self.optimizer.load_state(state)?;
                self.params.copy_from_slice(params);
            }
        }
        self.cursor = cursor;
        self.write_back()
    }

    fn write_back(&mut self) -> Result<(), OptimError> {
        // A clone of a module shares its tensors (cheap); on error the worker keeps its model.
        let model = self.model.clone();
        self.model = match &self.dev {
            Some(d) => self.layout.write_params_tensor(model, &d.params)?,
            None => self.layout.write_params(model, &self.params)?,
        };
        Ok(())
    }

    fn replace_running(&mut self, running: &[f32]) -> Result<(), OptimError> {
        self.model = self.layout.write_running(self.model.clone(), running)?;
        Ok(())
    }

    /// Runs the next step of the plan. `loss_fn(model, micro_batch)` returns the micro-batch's mean loss
    /// as a one-element tensor on the model's autodiff device.
    pub fn step<F>(&mut self, mut loss_fn: F) -> Result<StepReport, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        if self.dev.is_some() {
            return self.step_device(loss_fn);
        }
        let info = self.cursor.advance().ok_or(OptimError::Finished(self.cursor.step()))?;
        let accum = self.config.accumulation_steps;
        let mut loss_sum = 0.0f64;
        if accum > 1 {
            self.grad_sum.clear();
            self.grad_sum.resize(self.params.len(), 0.0);
        }
        for micro in 0..accum {
            let model = &self.model;
            let loss = loss_fn(model, micro).map_err(|source| OptimError::Step { step: info.step, source })?;
            loss_sum += f64::from(loss.clone().into_scalar::<f32>());
            let mut grads = loss.backward();
            self.layout.read_grads(model, &mut grads, &mut self.grads)?;
            if accum > 1 {
                self.grad_sum.iter_mut().zip(&self.grads).for_each(|(s, g)| *s += g);
            }
        }
        if accum > 1 {
            let inv = 1.0 / accum as f32;
            self.grads.iter_mut().zip(&self.grad_sum).for_each(|(g, s)| *g = s * inv);
        }
        let mut sync = None;
        if info.mode == SyncMode::Gradients {
            // Data parallel: every rank averages gradients, so every rank takes the same update.
            sync = Some(self.all_reduce_grads(info.step)?);
        }
        let updated = self.grads.iter().all(|g| g.is_finite());
        if updated {
            self.optimizer.step(&mut self.params, &mut self.grads, info.lr);
        } else {
            self.stats.skipped_updates += 1;
        }
        if info.sync_after && info.mode == SyncMode::Parameters {
            sync = Some(self.sync_parameters(info.step)?);
        }
        self.finish_step(info, loss_sum / accum as f64, updated, sync)
    }

    /// The module rewritten from the flat parameters, and the step counted.
    fn finish_step(
        &mut self,
        info: StepInfo,
        loss: f64,
        updated: bool,
        sync: Option<SyncReport>,
    ) -> Result<StepReport, OptimError> {
        self.write_back()?;
        self.stats.steps += 1;
        if let Some(s) = &sync {
            self.stats.syncs += 1;
            if s.mode == SyncMode::Gradients {
                self.stats.gradient_syncs += 1;
            }
        }
        Ok(StepReport { info, loss: loss as f32, updated, sync })
    }

    /// [`Self::step`] with device-resident parameters and state: no host transfer but one
    /// finiteness flag (and the loss) per step.
    fn step_device<F>(&mut self, mut loss_fn: F) -> Result<StepReport, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        let info = self.cursor.advance().ok_or(OptimError::Finished(self.cursor.step()))?;
        let accum = self.config.accumulation_steps;
        let device = self.dev.as_ref().expect("device-resident").device.clone();
        let mut loss_sum = 0.0f64;
        let mut grad_sum: Option<Tensor<1>> = None;
        for micro in 0..accum {
            let model = &self.model;
            let loss = loss_fn(model, micro).map_err(|source| OptimError::Step { step: info.step, source })?;
            loss_sum += f64::from(loss.clone().into_scalar::<f32>());
            let mut grads = loss.backward();
            let g = self.layout.grads_tensor(model, &mut grads, &device)?;
            grad_sum = Some(match grad_sum {
                Some(s) => s + g,
                None => g,
            });
        }
        let mut grads = grad_sum.expect("at least one micro-batch");
        if accum > 1 {
            // The host path's sum * (1 / accum).
            grads = grads.mul_scalar(1.0 / accum as f32);
        }
        let mut sync = None;
        if info.mode == SyncMode::Gradients {
            let (mut out, report) = self.average_device(info.step, vec![grads], SyncMode::Gradients)?;
            grads = out.remove(0);
            sync = Some(report);
        }
        let updated = all_finite(&grads);
        let dev = self.dev.as_mut().expect("device-resident");
        if updated {
            let params = dev.params.clone();
            dev.params = dev.optimizer.step(params, grads, info.lr);
        } else {
            self.stats.skipped_updates += 1;
        }
        if info.sync_after && info.mode == SyncMode::Parameters {
            sync = Some(self.sync_parameters_device(info.step)?);
        }
        self.finish_step(info, loss_sum / accum as f64, updated, sync)
    }

    /// Parameters (and the moments the policy names) averaged on the device; BatchNorm statistics,
    /// when averaged, go through the host collective (they are small).
    fn sync_parameters_device(&mut self, step: u64) -> Result<SyncReport, OptimError> {
        let policy = self.config.state;
        let dev = self.dev.as_mut().expect("device-resident");
        let mut tensors = vec![dev.params.clone()];
        let (m, v) = dev.optimizer.moments_mut();
        let avg_m = policy.average_first_moment && m.is_some();
        let avg_v = policy.average_second_moment && v.is_some();
        if avg_m {
            tensors.push(m.clone().expect("checked"));
        }
        if avg_v {
            tensors.push(v.clone().expect("checked"));
        }
        let (mut out, mut report) = self.average_device(step, tensors, SyncMode::Parameters)?;
        let dev = self.dev.as_mut().expect("device-resident");
        dev.params = out.remove(0);
        let (m, v) = dev.optimizer.moments_mut();
        if avg_m {
            *m = Some(out.remove(0));
        }
        if avg_v {
            *v = Some(out.remove(0));
        }
        if self.config.bn == BnPolicy::Average && self.layout.running_len() > 0 {
            let before = *self.comm.stats();
            let t = Instant::now();
            let mut running = vec![0.0; self.layout.running_len()];
            self.layout.read_running(self.model(), &mut running)?;
            let calls = all_reduce_bucketed(self.comm.as_mut(), &mut running, self.config.bucket_elems)
                .map_err(|source| OptimError::Comm { step, source })?;
            self.replace_running(&running)?;
            let extra = self.account(before, t, SyncMode::Parameters, running.len(), calls);
            report.elements += extra.elements;
            report.calls += extra.calls;
            report.bytes_sent += extra.bytes_sent;
            report.seconds += extra.seconds;
        }
        Ok(report)
    }

    /// Mean over the workers of each tensor: through the device group where there is one (one
    /// fused launch per tensor on a cubecl backend), else through the host collective.
    fn average_device(
        &mut self,
        step: u64,
        tensors: Vec<Tensor<1>>,
        mode: SyncMode,
    ) -> Result<(Vec<Tensor<1>>, SyncReport), OptimError> {
        let t = Instant::now();
        let elements: usize = tensors.iter().map(|x| x.dims()[0]).sum();
        let k = self.world_size();
        let dev = self.dev.as_ref().expect("device-resident");
        if k == 1 && dev.group.is_none() {
            // Nothing to average with: no transfer.
            return Ok((tensors, SyncReport { mode, elements, calls: 0, bytes_sent: 0, seconds: 0.0 }));
        }
        if let Some(group) = &dev.group {
            let calls = tensors.len() as u64;
            let (out, fused) = group.average(tensors)?;
            // What a ring all-reduce of the same bytes would move, as the in-process collective reports.
            let bytes = qsr_sched::ring_allreduce_bytes_per_rank(elements as u64, 4, k as u64);
            let seconds = t.elapsed().as_secs_f64();
            self.stats.comm.calls += calls;
            self.stats.comm.bytes_sent += bytes;
            self.stats.comm.bytes_received += bytes;
            self.stats.comm.seconds += seconds;
            if fused {
                self.stats.fused_syncs += 1;
            }
            return Ok((out, SyncReport { mode, elements, calls, bytes_sent: bytes, seconds }));
        }
        // Across processes: stage through the host collective in one flat buffer.
        let device = dev.device.clone();
        let lens: Vec<usize> = tensors.iter().map(|x| x.dims()[0]).collect();
        let mut buf = Vec::with_capacity(elements);
        for x in &tensors {
            buf.extend(to_host(x)?);
        }
        let before = *self.comm.stats();
        let calls = all_reduce_bucketed(self.comm.as_mut(), &mut buf, self.config.bucket_elems)
            .map_err(|source| OptimError::Comm { step, source })?;
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0;
        for n in lens {
            out.push(Tensor::<1>::from_data(TensorData::new(buf[at..at + n].to_vec(), [n]), &device));
            at += n;
        }
        let report = self.account(before, t, mode, elements, calls);
        Ok((out, report))
    }

    fn all_reduce_grads(&mut self, step: u64) -> Result<SyncReport, OptimError> {
        let before = *self.comm.stats();
        let t = Instant::now();
        let calls = all_reduce_bucketed(self.comm.as_mut(), &mut self.grads, self.config.bucket_elems)
            .map_err(|source| OptimError::Comm { step, source })?;
        Ok(self.account(before, t, SyncMode::Gradients, self.grads.len(), calls))
    }

    /// Averages parameters (and the state the policies name) across workers in one flat collective.
    fn sync_parameters(&mut self, step: u64) -> Result<SyncReport, OptimError> {
        let before = *self.comm.stats();
        let t = Instant::now();
        let policy = self.config.state;
        let avg_m = policy.average_first_moment && !self.optimizer.state().first_moment.is_empty();
        let avg_v = policy.average_second_moment && !self.optimizer.state().second_moment.is_empty();
        let avg_bn = self.config.bn == BnPolicy::Average && self.layout.running_len() > 0;
        let err = |source| OptimError::Comm { step, source };
        if !(avg_m || avg_v || avg_bn) {
            let calls =
                all_reduce_bucketed(self.comm.as_mut(), &mut self.params, self.config.bucket_elems).map_err(err)?;
            return Ok(self.account(before, t, SyncMode::Parameters, self.params.len(), calls));
        }
        // Append the extra state to one buffer: still one collective per round.
        let mut buf = std::mem::take(&mut self.sync_buf);
        buf.clear();
        buf.extend_from_slice(&self.params);
        if avg_m {
            buf.extend_from_slice(&self.optimizer.state().first_moment);
        }
        if avg_v {
            buf.extend_from_slice(&self.optimizer.state().second_moment);
        }
        let running_at = buf.len();
        if avg_bn {
            buf.resize(running_at + self.layout.running_len(), 0.0);
            self.layout.read_running(self.model(), &mut buf[running_at..])?;
        }
        let calls = all_reduce_bucketed(self.comm.as_mut(), &mut buf, self.config.bucket_elems).map_err(err)?;
        let n = self.params.len();
        self.params.copy_from_slice(&buf[..n]);
        let mut at = n;
        let state = self.optimizer.state_mut();
        if avg_m {
            state.first_moment.copy_from_slice(&buf[at..at + n]);
            at += n;
        }
        if avg_v {
            state.second_moment.copy_from_slice(&buf[at..at + n]);
        }
        if avg_bn {
            self.replace_running(&buf[running_at..])?;
        }
        let elements = buf.len();
        self.sync_buf = buf;
        Ok(self.account(before, t, SyncMode::Parameters, elements, calls))
    }

    fn account(&mut self, before: CommStats, t: Instant, mode: SyncMode, elements: usize, calls: u64) -> SyncReport {
        let mut delta = self.comm.stats().since(&before);
        delta.seconds = t.elapsed().as_secs_f64();
        self.stats.comm.calls += delta.calls;
        self.stats.comm.bytes_sent += delta.bytes_sent;
        self.stats.comm.bytes_received += delta.bytes_received;
        self.stats.comm.seconds += delta.seconds;
        SyncReport { mode, elements, calls, bytes_sent: delta.bytes_sent, seconds: delta.seconds }
    }

    /// Averages BatchNorm running statistics across workers (the last step of the paper's re-estimation,
    /// after the trainer ran its forward passes). A no-op for models without running statistics.
    pub fn average_running_stats(&mut self) -> Result<(), OptimError> {
        let n = self.layout.running_len();
        if n == 0 {
            return Ok(());
        }
        let mut running = vec![0.0; n];
        self.layout.read_running(self.model(), &mut running)?;
        let step = self.cursor.step();
        all_reduce_bucketed(self.comm.as_mut(), &mut running, self.config.bucket_elems)
            .map_err(|source| OptimError::Comm { step, source })?;
        self.replace_running(&running)
    }
}

/// Mean all-reduce of `buf`, in buckets of at most `bucket` elements; returns the calls made.
fn all_reduce_bucketed(
    comm: &mut dyn Collective,
    buf: &mut [f32],
    bucket: Option<usize>,
) -> Result<u64, qsr_comm::CommError> {
    match bucket {
        Some(b) if b < buf.len() => {
            let mut calls = 0;
            for chunk in buf.chunks_mut(b) {
                comm.all_reduce(chunk, ReduceOp::Mean)?;
                calls += 1;
            }
            Ok(calls)
        }
        _ => {
            comm.all_reduce(buf, ReduceOp::Mean)?;
            Ok(1)
        }
    }
}

/// The device of a module's first float parameter (flex when it has none).
fn model_device<M: Module>(model: &M) -> Device {
    struct First(Option<Device>);
    impl burn::module::ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().device());
            }
        }
    }
    let mut v = First(None);
    model.visit(&mut v);
    v.0.unwrap_or_else(Device::flex)
}

/// `Auto` is device residency on a cubecl (GPU) backend, host residency otherwise.
fn resolve_residency<M: Module>(r: Residency, model: &M) -> Residency {
    match r {
        Residency::Auto if is_cube_device(&model_device(model)) => Residency::Device,
        Residency::Auto => Residency::Host,
        other => other,
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn is_cube_device(device: &Device) -> bool {
    Tensor::<1>::zeros([1], &device.clone().inner()).try_into_primitive::<burn::backend::Cube>().is_ok()
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn is_cube_device(_device: &Device) -> bool {
    false
}
