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

use std::borrow::Cow;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use qsr_comm::Collective;
use qsr_sched::{Cursor, StreamingConfig, SyncMode};

use crate::device::DeviceGroup;
use crate::error::{LossError, OptimError};
use crate::flat::ParamLayout;
use crate::flat_state::{DeviceState, FlatState, HostState};
use crate::optim::{OptimState, OptimizerConfig};
use crate::outer::{InnerRound, OuterConfig};
use crate::settings::{Face, SyncSettings, check_sync};
use crate::state::SyncState;
use crate::stream::StreamState;
use crate::sync::{DriverConfig, DriverStats, Level, Residency, StepEnd, StepReport, Transfer};
use crate::synchronizer::{At, StepTarget, Synchronizer};

/// One worker: a model replica, its flat parameters, its optimizer state, its collective and cursor.
pub struct Worker<M: Module> {
    /// The replica; writes go through a clone, so a failed write leaves it intact.
    model: M,
    layout: ParamLayout,
    /// The flat state, host- or device-resident.
    flat: FlatState,
    optimizer: OptimizerConfig,
    /// The collectives, wire, outer step and streaming: the sync engine the Averager shares.
    sync: Synchronizer,
    cursor: Cursor,
    config: DriverConfig,
    /// The sync settings given so far (rule and plan, wire, residency, state; outer and streaming
    /// once set), each addition checked with the rest.
    settings: SyncSettings,
    /// What [`check_sync`] says the settings given so far do differently from what they say.
    warnings: Vec<String>,
    stats: DriverStats,
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
        check_config(&config)?;
        // burn shares BatchNorm running state between clones of a module; `valid().train()` gives this
        // worker its own, so simulated workers keep local statistics as the paper's workers do.
        let mut model = model.valid().train();
        let residency = resolve_residency(config.residency, &model);
        let settings = SyncSettings {
            plan: Some(cursor.plan().clone()),
            wire: config.wire,
            residency,
            state: config.state,
            fingerprint: config.fingerprint,
            ..SyncSettings::new(cursor.plan().sync().clone(), comm.world_size())
        };
        let warnings = check_sync(&settings, Face::Recipe).into_result()?;
        let layout = ParamLayout::of(&model);
        let transfer = Transfer { wire: config.wire, bucket: config.bucket_elems };
        let mut sync = Synchronizer::new(comm, transfer, Face::Recipe)?;
        sync.set_fingerprint(config.fingerprint);
        if config.broadcast_initial && sync.comm().world_size() > 1 {
            let step = cursor.step();
            model = sync.broadcast_initial(model, &layout, true, |source| OptimError::Comm { step, source })?;
        }
        let flat = match residency {
            Residency::Device => {
                let device = model_device(&model).inner();
                FlatState::Device(DeviceState::new(&model, &layout, optimizer.clone(), device)?)
            }
            _ => FlatState::Host(HostState::new(&model, &layout, optimizer.clone())?),
        };
        let stats = DriverStats::default();
        let mut worker = Self { model, layout, flat, optimizer, sync, cursor, config, settings, warnings, stats };
        if worker.sync.streams_with(None) {
            worker.start_stream(None)?;
        }
        Ok(worker)
    }

    /// Makes parameter syncs streaming (`[sync.streaming]`): the parameters in `config.fragments`
    /// contiguous groups of tensors, each averaged once per round on its own step ([`qsr_sched::FragmentPlan`]),
    /// the average applied `config.delay` steps later and blended with the local values by
    /// `config.mix`. Without [`Self::set_outer`] the average is plain (an outer step with lr 1). The
    /// all-reduces run between steps on the worker's collective unless [`Self::set_streaming_comm`]
    /// gives them their own. Under a two-level plan the fragments follow the global rounds and the
    /// nodes average in f32 at their local rounds' ends. Refused (naming the key) for device-resident
    /// workers, optimizer-state averaging, and fragments the plan or model cannot have.
    pub fn set_streaming(&mut self, config: StreamingConfig) -> Result<(), OptimError> {
        self.start_stream(Some(config))
    }

    fn start_stream(&mut self, config: Option<StreamingConfig>) -> Result<(), OptimError> {
        let settings = SyncSettings { streaming: config.or(self.settings.streaming), ..self.settings.clone() };
        let warnings = check_sync(&settings, Face::Recipe).into_result()?;
        let stream = self.sync.prepare_streaming(config, &self.layout)?;
        // Read only once the settings are known to fit: a device replica would download them.
        let params = self.flat.params()?;
        self.sync.start_streaming(stream, &params);
        (self.settings, self.warnings) = (settings, warnings);
        Ok(())
    }

    /// Runs the streaming fragments' all-reduces on `comm`, on a thread of their own, while the worker
    /// keeps stepping (overlap): `comm` must hold the same ranks as the worker's collective (e.g. from
    /// [`qsr_comm::split`], or a second [`qsr_comm::InProcessGroup`]), and every rank must give one.
    /// The results are the same bits as without it. Refused without [`Self::set_streaming`], while an
    /// average is on its way (restored ones may wait to be applied), and for a collective that cannot
    /// carry the wire.
    pub fn set_streaming_comm(&mut self, comm: Box<dyn Collective>) -> Result<(), OptimError> {
        self.sync.set_streaming_comm(comm)
    }

    /// The streaming state (averages in flight, waiting for them; the error-feedback residual) for a
    /// checkpoint, if the worker streams. Every rank must call it at the same step.
    pub fn streaming_state(&mut self) -> Result<Option<StreamState>, OptimError> {
        self.sync.stream_state()
    }

    /// Drops a streaming worker's averages in flight and its error-feedback residual (going back to a
    /// snapshot, or taking another rank's state); every rank does it at the same step.
    pub(crate) fn forget_stream(&mut self) {
        self.sync.forget_stream();
    }

    /// Restores the state saved by [`Self::streaming_state`] (after [`Self::set_streaming`] and
    /// [`Self::restore`]).
    pub fn restore_streaming_state(&mut self, state: StreamState) -> Result<(), OptimError> {
        self.sync.restore_stream(state)
    }

    /// Gives the worker its node's collective, through which the local averages of a two-level plan
    /// ([`qsr_sched::Plan::with_local`]) run: the ranks of this worker's node, in any order, each
    /// with a worker under the same plan. Refused for a plan without a local level, and for a node's
    /// collective that cannot carry the configured wire.
    pub fn set_local(&mut self, local: Box<dyn Collective>) -> Result<(), OptimError> {
        if self.cursor.plan().local().is_none() {
            return Err(OptimError::Config {
                field: "sync.local".into(),
                reason: "the plan has no local level, so a node's collective would never be used".into(),
            });
        }
        self.sync.set_local(local)
    }

    /// The node's collective of a two-level plan ([`Self::set_local`]).
    pub fn local_comm(&self) -> Option<&dyn Collective> {
        self.sync.local()
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
        match &mut self.flat {
            FlatState::Device(d) => {
                d.set_group(group);
                Ok(())
            }
            FlatState::Host(_) => {
                Err(OptimError::DeviceGroup("it needs a device-resident worker (driver.residency)".into()))
            }
        }
    }

    /// Makes every parameter synchronization DiLoCo's outer step: the worker keeps the last global
    /// parameters (from its parameters now, which the initial broadcast made equal on every rank) and a
    /// momentum buffer, all-reduces the pseudo-gradient `global - local` and continues from
    /// `global - outer_lr * step` (two more parameter-sized f32 buffers). Data-parallel steps (post-local
    /// before its switch) keep the global parameters equal to the synchronized ones. Refused for rules
    /// that never average parameters and for device-resident workers.
    pub fn set_outer(&mut self, config: OuterConfig) -> Result<(), OptimError> {
        let settings = SyncSettings { outer: Some(config), ..self.settings.clone() };
        let warnings = check_sync(&settings, Face::Recipe).into_result()?;
        let params = self.flat.params()?;
        self.sync.set_outer(config, &params)?;
        (self.settings, self.warnings) = (settings, warnings);
        Ok(())
    }

    /// The sync engine's state (outer optimizer, streaming, the inner round so far) for a checkpoint.
    /// A streaming worker waits for its averages in flight: every rank calls it at the same step.
    pub fn sync_state(&mut self) -> Result<SyncState, OptimError> {
        self.sync.state()
    }

    /// Continues from a [`Self::sync_state`] (after [`Self::restore`]); refused, naming `sync`, when
    /// it does not fit the worker's outer and streaming settings.
    pub fn restore_sync_state(&mut self, state: SyncState) -> Result<(), OptimError> {
        self.sync.restore(state, "sync")
    }

    /// The steps since the last global parameter sync and their summed lr.
    pub(crate) fn inner_round(&self) -> InnerRound {
        self.sync.inner_round()
    }

    /// The sync state a [`Snapshot`](crate::Snapshot) holds (no averages in flight).
    pub(crate) fn held_sync_state(&self) -> SyncState {
        self.sync.held_state()
    }

    /// What the sync settings given so far do differently from what they say ([`check_sync`]'s
    /// warnings, one line each): a caller shows them once its settings are complete.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The outer optimizer's global parameters and momentum buffer (for a checkpoint), if it has one.
    pub fn outer_state(&self) -> Option<(&[f32], &[f32])> {
        self.sync.outer_state()
    }

    /// Restores the outer state saved by [`Self::outer_state`] (after [`Self::set_outer`]).
    pub fn restore_outer_state(&mut self, global: &[f32], momentum: &[f32]) -> Result<(), OptimError> {
        self.sync.restore_outer(global, momentum)
    }

    /// Whether parameters and optimizer state live on the device.
    pub fn is_device_resident(&self) -> bool {
        matches!(self.flat, FlatState::Device(_))
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
        self.flat.params()
    }
    /// The optimizer settings the worker was built with.
    pub fn optimizer_config(&self) -> &OptimizerConfig {
        &self.optimizer
    }
    /// The optimizer state (for checkpoints); downloaded when device-resident.
    pub fn optimizer_state(&self) -> Result<Cow<'_, OptimState>, OptimError> {
        self.flat.optimizer_state()
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
        self.sync.comm()
    }
    /// The collective, for the trainer's own reductions (evaluation counts); every rank must make the
    /// same calls.
    pub fn comm_mut(&mut self) -> &mut dyn Collective {
        self.sync.comm_mut()
    }
    /// Replaces the collective (an elastic job's next generation: qsr-elastic's `Elastic`); returns the
    /// old one. Refused when the new one cannot carry the configured wire, and for workers of a
    /// two-level plan or a device group, whose other groups would still span the old membership. A
    /// streaming worker must have nothing in flight ([`Self::restore_snapshot`] drops it); its
    /// fragments' all-reduces then run on the new collective until [`Self::set_streaming_comm`]
    /// gives them one of their own again.
    pub fn replace_comm(&mut self, comm: Box<dyn Collective>) -> Result<Box<dyn Collective>, OptimError> {
        // A two-level worker is refused by the synchronizer first, naming `sync.local`.
        if matches!(&self.flat, FlatState::Device(d) if d.has_group()) && self.sync.local().is_none() {
            return Err(OptimError::DeviceGroup("a device group's members are fixed; it cannot change".into()));
        }
        self.sync.replace_comm(comm)
    }
    /// Takes the totals so far, leaving zeros (a trainer that carries its own counters across a
    /// membership change).
    pub fn take_stats(&mut self) -> DriverStats {
        std::mem::take(&mut self.stats)
    }
    /// This worker's rank in the collective, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.sync.comm().rank()
    }
    /// The number of workers (K) in the collective.
    pub fn world_size(&self) -> usize {
        self.sync.comm().world_size()
    }

    /// Restores parameters, optimizer state and position (from a checkpoint taken at a sync point).
    pub fn restore(&mut self, params: &[f32], state: OptimState, cursor: Cursor) -> Result<(), OptimError> {
        if params.len() != self.layout.len() {
            return Err(OptimError::Layout(format!(
                "checkpoint has {} parameters, model {}",
                params.len(),
                self.layout.len()
            )));
        }
        self.flat.restore(params, state)?;
        // A cursor inside a round: the round's steps so far, for an outer step per inner step.
        let (round, plan) = (cursor.round(), cursor.plan());
        let done = if round.mode == SyncMode::Parameters { round.start..cursor.step() } else { 0..0 };
        let lr_sum = done.clone().map(|t| plan.lr(t)).sum();
        self.sync.set_inner_round(InnerRound { steps: done.end - done.start, lr_sum });
        self.cursor = cursor;
        self.write_back()
    }

    fn write_back(&mut self) -> Result<(), OptimError> {
        let t = Instant::now();
        // A clone of a module shares its tensors (cheap); on error the worker keeps its model.
        self.model = self.flat.write(&self.layout, self.model.clone())?;
        self.stats.phases.write_back += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Runs the next step of the plan. `loss_fn(model, micro_batch)` returns the micro-batch's mean loss
    /// as a one-element tensor on the model's autodiff device.
    pub fn step<F>(&mut self, loss_fn: F) -> Result<StepReport, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, LossError>,
    {
        if self.cursor.plan().local().is_some() && self.sync.local().is_none() {
            return Err(OptimError::Config {
                field: "sync.local".into(),
                reason: "a two-level plan needs the node's collective (Worker::set_local)".into(),
            });
        }
        let info = self.cursor.advance().ok_or(OptimError::Finished(self.cursor.step()))?;
        let end = StepEnd { info: &info, last: self.cursor.is_done() };
        let mut target = StepTarget { model: &mut self.model, layout: &self.layout, flat: &mut self.flat };
        let stepped =
            self.sync.drive_step(&mut target, end, &self.config, &mut self.stats, |t, peers, info| match t.flat {
                FlatState::Host(h) => h.step(t.model, t.layout, peers, info, loss_fn),
                FlatState::Device(d) => d.step(t.model, t.layout, peers, info, loss_fn),
            })?;
        // The module rewritten from the flat parameters.
        self.write_back()?;
        let loss = stepped.loss_sum / self.config.accumulation_steps as f64;
        Ok(StepReport { info, loss: loss as f32, updated: stepped.updated, sync: stepped.sync })
    }

    /// Averages BatchNorm running statistics across workers (the last step of the paper's re-estimation,
    /// after the trainer ran its forward passes). A no-op for models without running statistics.
    pub fn average_running_stats(&mut self) -> Result<(), OptimError> {
        if self.layout.running_len() == 0 {
            return Ok(());
        }
        let at = At::after(self.cursor.step(), None);
        self.sync.average_running(&mut self.model, &self.layout, at, Level::Global)?;
        Ok(())
    }
}

/// Settings the driver cannot run with, named by their recipe key.
fn check_config(config: &DriverConfig) -> Result<(), OptimError> {
    if config.accumulation_steps == 0 {
        return Err(OptimError::Config {
            field: "driver.accumulation_steps".into(),
            reason: "must be at least 1".into(),
        });
    }
    if config.bucket_elems == Some(0) {
        return Err(OptimError::Config { field: "driver.bucket_elems".into(), reason: "must be at least 1".into() });
    }
    Ok(())
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

#[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
fn is_cube_device(device: &Device) -> bool {
    Tensor::<1>::zeros([1], &device.clone().inner()).try_into_primitive::<burn::backend::Cube>().is_ok()
}

#[cfg(not(any(feature = "cuda-plain", feature = "wgpu-plain")))]
fn is_cube_device(_device: &Device) -> bool {
    false
}
