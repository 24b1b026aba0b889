//! A worker's flat state, one type per residency: host buffers updated by the host optimizer, or burn
//! tensors on the training device. Neither holds a field the other mode needs, so nothing is ever
//! empty or unwrapped.

use std::borrow::Cow;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use qsr_sched::{StepInfo, SyncMode};

use crate::device::{DeviceGroup, DeviceOptimizer, all_finite, to_host};
use crate::error::{LossError, OptimError};
use crate::flat::ParamLayout;
use crate::optim::{Moments, OptimState, Optimizer, OptimizerConfig, OptimizerKind};
use crate::sync::{BnPolicy, Level, PhaseTimes, Stepped, SyncBuffer, SyncReport};
use crate::synchronizer::{Peers, StepState, Synced};

/// The micro-batches of a step: `accum` of them (at least 1), of the 0-based step `step`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Micro {
    accum: usize,
    step: u64,
}

/// Where a worker's flat parameters and optimizer state live.
// One per worker, built once and never moved in a loop: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum FlatState {
    Host(HostState),
    Device(DeviceState),
}

impl FlatState {
    /// The flat trainable parameters; downloaded from a device.
    pub(crate) fn params(&self) -> Result<Cow<'_, [f32]>, OptimError> {
        match self {
            FlatState::Host(h) => Ok(Cow::Borrowed(&h.params)),
            FlatState::Device(d) => Ok(Cow::Owned(to_host(&d.params)?)),
        }
    }

    /// The optimizer state; downloaded from a device.
    pub(crate) fn optimizer_state(&self) -> Result<Cow<'_, OptimState>, OptimError> {
        match self {
            FlatState::Host(h) => Ok(Cow::Borrowed(h.optimizer.state())),
            FlatState::Device(d) => Ok(Cow::Owned(d.optimizer.state()?)),
        }
    }

    /// Replaces parameters and optimizer state (`params` has the layout's length).
    pub(crate) fn restore(&mut self, params: &[f32], state: OptimState) -> Result<(), OptimError> {
        match self {
            FlatState::Host(h) => {
                h.optimizer.load_state(state)?;
                h.params.copy_from_slice(params);
            }
            FlatState::Device(d) => {
                d.optimizer.load_state(state, &d.device)?;
                d.params = Tensor::<1>::from_data(TensorData::new(params.to_vec(), [params.len()]), &d.device);
            }
        }
        Ok(())
    }

    /// `model` with the flat parameters written into it.
    pub(crate) fn write<M: Module>(&self, layout: &ParamLayout, model: M) -> Result<M, OptimError> {
        match self {
            FlatState::Host(h) => layout.write_params(model, &h.params),
            FlatState::Device(d) => layout.write_params_tensor(model, &d.params),
        }
    }
}

impl StepState for FlatState {
    fn host_params(&mut self) -> Option<&mut [f32]> {
        match self {
            FlatState::Host(h) => Some(&mut h.params),
            FlatState::Device(_) => None,
        }
    }

    fn sync_parameters<M: Module>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        peers: &mut Peers<'_>,
        step: u64,
    ) -> Result<SyncReport, OptimError> {
        match self {
            FlatState::Host(h) => h.sync_parameters(model, layout, peers, step),
            FlatState::Device(d) => d.sync_parameters(model, layout, peers, step),
        }
    }
}

/// Host-resident state: `Vec<f32>`s and the fused host optimizer.
pub(crate) struct HostState {
    params: Vec<f32>,
    grads: Vec<f32>,
    /// The micro-batches' gradient sum (empty without accumulation).
    grad_sum: Vec<f32>,
    /// Parameters plus appended state for a sync (kept to reuse its allocation).
    sync_buf: Vec<f32>,
    optimizer: Optimizer,
}

impl HostState {
    /// The model's parameters and a fresh optimizer over them.
    pub(crate) fn new<M: Module>(
        model: &M,
        layout: &ParamLayout,
        optimizer: OptimizerConfig,
    ) -> Result<Self, OptimError> {
        let n = layout.len();
        // Per-tensor ranges: clipping sums squares per tensor, as torch does.
        let tensors: Vec<_> = layout.trainable.iter().map(|e| e.range.clone()).collect();
        let matrices = if optimizer.kind == OptimizerKind::Muon { layout.muon_matrices() } else { Vec::new() };
        let optimizer = Optimizer::new(optimizer, n, &layout.no_decay_ranges())?
            .with_tensors(&tensors)?
            .with_muon_matrices(matrices)?;
        let mut params = vec![0.0; n];
        layout.read_params(model, &mut params)?;
        Ok(Self { params, grads: vec![0.0; n], grad_sum: Vec::new(), sync_buf: Vec::new(), optimizer })
    }

    /// One step: gradients of every micro-batch, their mean, the data-parallel all-reduce when the
    /// step syncs gradients, the update (skipped when not finite), the parameter sync at a round's end.
    pub(crate) fn step<M: Module, F>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        peers: &mut Peers<'_>,
        info: &StepInfo,
        loss_fn: F,
    ) -> Result<Stepped, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        let accum = peers.config.accumulation_steps;
        let loss_sum =
            self.gradients(model, layout, Micro { accum, step: info.step }, &mut peers.stats.phases, loss_fn)?;
        let mut sync = None;
        if info.mode == SyncMode::Gradients {
            // Data parallel: every rank averages gradients, so every rank takes the same update.
            let start = peers.start();
            let calls = peers.all_reduce(&mut self.grads, info.step)?;
            sync = Some(peers.account(start, Synced { mode: SyncMode::Gradients, elements: self.grads.len(), calls }));
        }
        let updated = self.grads.iter().all(|g| g.is_finite());
        if updated {
            let t = Instant::now();
            self.optimizer.step(&mut self.params, &mut self.grads, info.lr);
            peers.stats.phases.optimizer += t.elapsed().as_secs_f64();
        } else {
            peers.stats.skipped_updates += 1;
        }
        if info.mode == SyncMode::Gradients {
            // Every worker took the same update: these are the global parameters.
            peers.sync.follow(&self.params);
        }
        if info.sync_after && info.mode == SyncMode::Parameters {
            sync = Some(self.sync_parameters(model, layout, peers, info.step)?);
        }
        Ok(Stepped { loss_sum, updated, sync })
    }

    /// Fills `grads` with the mean gradient over `accum` micro-batches of step `step`; returns the
    /// losses' sum.
    fn gradients<M: Module, F>(
        &mut self,
        model: &M,
        layout: &ParamLayout,
        Micro { accum, step }: Micro,
        times: &mut PhaseTimes,
        mut loss_fn: F,
    ) -> Result<f64, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        let mut loss_sum = 0.0f64;
        if accum > 1 {
            self.grad_sum.clear();
            self.grad_sum.resize(self.params.len(), 0.0);
        }
        for micro in 0..accum {
            let t = Instant::now();
            let loss = loss_fn(model, micro).map_err(|source| OptimError::Step { step, source })?;
            loss_sum += f64::from(loss.clone().into_scalar::<f32>());
            let t = times.add(|p| &mut p.forward, t);
            let mut grads = loss.backward();
            let t = times.add(|p| &mut p.backward, t);
            layout.read_grads(model, &mut grads, &mut self.grads)?;
            times.add(|p| &mut p.gradients, t);
            if accum > 1 {
                self.grad_sum.iter_mut().zip(&self.grads).for_each(|(s, g)| *s += g);
            }
        }
        if accum > 1 {
            let inv = 1.0 / accum as f32;
            self.grads.iter_mut().zip(&self.grad_sum).for_each(|(g, s)| *g = s * inv);
        }
        Ok(loss_sum)
    }

    /// Averages parameters (and the state the policies name) across workers in one flat collective.
    fn sync_parameters<M: Module>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        peers: &mut Peers<'_>,
        step: u64,
    ) -> Result<SyncReport, OptimError> {
        let start = peers.start();
        let kept = self.optimizer.state();
        let moments = Moments { first: !kept.first_moment.is_empty(), second: !kept.second_moment.is_empty() };
        let with = SyncBuffer::new(peers.config, moments, layout.running_len() > 0);
        let (avg_m, avg_v, avg_bn) = (with.first_moment, with.second_moment, with.running);
        if !with.has_state() {
            let n = self.params.len();
            let calls = peers.average(&mut self.params, n, step)?;
            return Ok(peers.account(start, Synced { mode: SyncMode::Parameters, elements: self.params.len(), calls }));
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
            buf.resize(running_at + layout.running_len(), 0.0);
            layout.read_running(model, &mut buf[running_at..])?;
        }
        let n = self.params.len();
        let calls = peers.average(&mut buf, n, step)?;
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
            *model = layout.write_running(model.clone(), &buf[running_at..])?;
        }
        let elements = buf.len();
        self.sync_buf = buf;
        Ok(peers.account(start, Synced { mode: SyncMode::Parameters, elements, calls }))
    }
}

/// Device-resident state: burn tensors on the training device, and the in-process group of the
/// simulated workers on the same device once the trainer gives it one.
pub(crate) struct DeviceState {
    /// The training device without autodiff.
    device: Device,
    params: Tensor<1>,
    optimizer: DeviceOptimizer,
    group: Option<DeviceGroup>,
}

impl DeviceState {
    /// The model's parameters on its device and a fresh device optimizer over them.
    pub(crate) fn new<M: Module>(
        model: &M,
        layout: &ParamLayout,
        optimizer: OptimizerConfig,
        device: Device,
    ) -> Result<Self, OptimError> {
        let params = layout.params_tensor(model, &device)?;
        let optimizer = DeviceOptimizer::new(optimizer, layout.len(), &layout.no_decay_ranges(), &device)?;
        Ok(Self { device, params, optimizer, group: None })
    }

    /// Syncs go through `group` from now on.
    pub(crate) fn set_group(&mut self, group: DeviceGroup) {
        self.group = Some(group);
    }

    /// Whether syncs go through a device group.
    pub(crate) fn has_group(&self) -> bool {
        self.group.is_some()
    }

    /// [`HostState::step`] on the device: no host transfer but one finiteness flag (and the loss).
    pub(crate) fn step<M: Module, F>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        peers: &mut Peers<'_>,
        info: &StepInfo,
        loss_fn: F,
    ) -> Result<Stepped, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        let accum = peers.config.accumulation_steps;
        let (loss_sum, mut grads) =
            self.gradients(model, layout, Micro { accum, step: info.step }, &mut peers.stats.phases, loss_fn)?;
        let mut sync = None;
        if info.mode == SyncMode::Gradients {
            let (mut out, report) = self.average(peers, info.step, vec![grads], SyncMode::Gradients)?;
            grads = out.remove(0);
            sync = Some(report);
        }
        let updated = all_finite(&grads);
        if updated {
            let t = Instant::now();
            self.params = self.optimizer.step(self.params.clone(), grads, info.lr);
            peers.stats.phases.optimizer += t.elapsed().as_secs_f64();
        } else {
            peers.stats.skipped_updates += 1;
        }
        if info.sync_after && info.mode == SyncMode::Parameters {
            sync = Some(self.sync_parameters(model, layout, peers, info.step)?);
        }
        Ok(Stepped { loss_sum, updated, sync })
    }

    /// The mean gradient over `accum` (at least 1) micro-batches of step `step`, and the losses' sum.
    fn gradients<M: Module, F>(
        &self,
        model: &M,
        layout: &ParamLayout,
        Micro { accum, step }: Micro,
        times: &mut PhaseTimes,
        mut loss_fn: F,
    ) -> Result<(f64, Tensor<1>), OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        let mut micro_grads = |micro: usize| -> Result<(f64, Tensor<1>), OptimError> {
            let t = Instant::now();
            let loss = loss_fn(model, micro).map_err(|source| OptimError::Step { step, source })?;
            let value = f64::from(loss.clone().into_scalar::<f32>());
            let t = times.add(|p| &mut p.forward, t);
            let mut grads = loss.backward();
            let t = times.add(|p| &mut p.backward, t);
            let flat = layout.grads_tensor(model, &mut grads, &self.device)?;
            times.add(|p| &mut p.gradients, t);
            Ok((value, flat))
        };
        let (mut loss_sum, mut grads) = micro_grads(0)?;
        for micro in 1..accum {
            let (loss, g) = micro_grads(micro)?;
            loss_sum += loss;
            grads = grads + g;
        }
        if accum > 1 {
            // The host path's sum * (1 / accum).
            grads = grads.mul_scalar(1.0 / accum as f32);
        }
        Ok((loss_sum, grads))
    }

    /// Parameters (and the moments the policy names) averaged on the device; BatchNorm statistics,
    /// when averaged, go through the host collective (they are small).
    fn sync_parameters<M: Module>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        peers: &mut Peers<'_>,
        step: u64,
    ) -> Result<SyncReport, OptimError> {
        let policy = peers.config.state;
        let mut tensors = vec![self.params.clone()];
        let (m, v) = self.optimizer.moments_mut();
        let m = m.as_ref().filter(|_| policy.average_first_moment);
        let v = v.as_ref().filter(|_| policy.average_second_moment);
        let (avg_m, avg_v) = (m.is_some(), v.is_some());
        tensors.extend(m.into_iter().chain(v).cloned());
        let (out, mut report) = self.average(peers, step, tensors, SyncMode::Parameters)?;
        let mut out = out.into_iter();
        let (m, v) = self.optimizer.moments_mut();
        // `average` returns as many tensors as it was given, in order.
        if let Some(p) = out.next() {
            self.params = p;
        }
        if avg_m {
            *m = out.next();
        }
        if avg_v {
            *v = out.next();
        }
        if peers.config.bn == BnPolicy::Average && layout.running_len() > 0 {
            report.add(&peers.average_running(model, layout, step)?);
        }
        Ok(report)
    }

    /// Mean over the workers of each tensor: through the device group where there is one (one
    /// fused launch per tensor on a cubecl backend), else through the host collective.
    fn average(
        &self,
        peers: &mut Peers<'_>,
        step: u64,
        tensors: Vec<Tensor<1>>,
        mode: SyncMode,
    ) -> Result<(Vec<Tensor<1>>, SyncReport), OptimError> {
        let t = Instant::now();
        let elements: usize = tensors.iter().map(|x| x.dims()[0]).sum();
        let k = peers.world_size();
        let level = peers.level;
        match self.group.as_ref().filter(|_| level == Level::Global) {
            // Nothing to average with: no transfer.
            None if k == 1 => {
                Ok((tensors, SyncReport { mode, level, elements, calls: 0, bytes_sent: 0, seconds: 0.0 }))
            }
            Some(group) => {
                let calls = tensors.len() as u64;
                let (out, fused) = group.average(tensors)?;
                Ok((out, peers.account_group(t, Synced { mode, elements, calls }, fused)))
            }
            None => self.average_on_host(peers, step, tensors, mode),
        }
    }

    /// Across processes: the tensors staged through the host collective in one flat buffer.
    fn average_on_host(
        &self,
        peers: &mut Peers<'_>,
        step: u64,
        tensors: Vec<Tensor<1>>,
        mode: SyncMode,
    ) -> Result<(Vec<Tensor<1>>, SyncReport), OptimError> {
        let start = peers.start();
        let lens: Vec<usize> = tensors.iter().map(|x| x.dims()[0]).collect();
        let mut buf = Vec::with_capacity(lens.iter().sum());
        for x in &tensors {
            buf.extend(to_host(x)?);
        }
        let calls = peers.all_reduce(&mut buf, step)?;
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0;
        for n in lens {
            out.push(Tensor::<1>::from_data(TensorData::new(buf[at..at + n].to_vec(), [n]), &self.device));
            at += n;
        }
        Ok((out, peers.account(start, Synced { mode, elements: buf.len(), calls })))
    }
}
