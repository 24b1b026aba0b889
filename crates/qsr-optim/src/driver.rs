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

use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;
use qsr_comm::{Collective, CommStats, ReduceOp};
use qsr_sched::{Cursor, StepInfo, SyncMode};
use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::flat::ParamLayout;
use crate::optim::{Optimizer, OptimizerConfig};

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

/// Driver options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverConfig {
    #[serde(default)]
    pub state: StatePolicy,
    #[serde(default)]
    pub bn: BnPolicy,
    /// Micro-batches per step (gradient accumulation); the step's gradient is their mean.
    #[serde(default = "one")]
    pub accumulation_steps: usize,
    /// All-reduce in buckets of at most this many elements instead of one call per round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_elems: Option<usize>,
    /// Broadcast rank 0's initial parameters so every worker starts from the same point (as DDP).
    #[serde(default = "yes")]
    pub broadcast_initial: bool,
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self { state: StatePolicy::default(), bn: BnPolicy::default(), accumulation_steps: 1, bucket_elems: None, broadcast_initial: true }
    }
}

/// One synchronization.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    pub mode: SyncMode,
    /// Elements all-reduced (parameters or gradients, plus any appended state).
    pub elements: usize,
    /// Collective calls this sync made (1 unless bucketed).
    pub calls: u64,
    pub bytes_sent: u64,
    pub seconds: f64,
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    pub info: StepInfo,
    /// Mean loss over the step's micro-batches (this worker's).
    pub loss: f32,
    /// False when the gradients were not finite and the update was skipped.
    pub updated: bool,
    pub sync: Option<SyncReport>,
}

/// Totals over a worker's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverStats {
    pub steps: u64,
    /// Synchronizations (gradient and parameter), i.e. rounds completed.
    pub syncs: u64,
    pub gradient_syncs: u64,
    pub skipped_updates: u64,
    /// Traffic of synchronizations only (the initial broadcast is not counted).
    pub comm: CommStats,
}

/// One worker: a model replica, its flat parameters, its optimizer state, its collective and cursor.
pub struct Worker<M: Module> {
    model: Option<M>,
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
            return Err(OptimError::Config { field: "driver.accumulation_steps".into(), reason: "must be at least 1".into() });
        }
        if config.bucket_elems == Some(0) {
            return Err(OptimError::Config { field: "driver.bucket_elems".into(), reason: "must be at least 1".into() });
        }
        // burn shares BatchNorm running state between clones of a module; `valid().train()` gives this
        // worker its own, so simulated workers keep local statistics as the paper's workers do.
        let model = model.valid().train();
        let layout = ParamLayout::of(&model);
        let n = layout.len();
        let optimizer = Optimizer::new(optimizer, n, &layout.no_decay_ranges())?;
        let mut params = vec![0.0; n];
        layout.read_params(&model, &mut params)?;
        let mut w = Self {
            model: Some(model),
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
        Ok(w)
    }

    pub fn model(&self) -> &M {
        self.model.as_ref().expect("model is present between calls")
    }

    /// Replaces the model (e.g. after the trainer re-estimated BatchNorm statistics with forward passes).
    /// Its trainable parameters must equal the worker's; they are overwritten from the flat buffer.
    pub fn set_model(&mut self, model: M) -> Result<(), OptimError> {
        let layout = ParamLayout::of(&model);
        if layout != self.layout {
            return Err(OptimError::Layout("the new model has a different parameter layout".into()));
        }
        self.model = Some(model);
        self.write_back()
    }

    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    /// The worker's flat trainable parameters (equal to the model's).
    pub fn params(&self) -> &[f32] {
        &self.params
    }
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
    }
    pub fn cursor(&self) -> &Cursor {
        &self.cursor
    }
    pub fn stats(&self) -> &DriverStats {
        &self.stats
    }
    pub fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }
    /// The collective, for the trainer's own reductions (evaluation counts); every rank must make the
    /// same calls.
    pub fn comm_mut(&mut self) -> &mut dyn Collective {
        self.comm.as_mut()
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Restores parameters, optimizer state and position (from a checkpoint taken at a sync point).
    pub fn restore(&mut self, params: &[f32], state: crate::OptimState, cursor: Cursor) -> Result<(), OptimError> {
        if params.len() != self.params.len() {
            return Err(OptimError::Layout(format!("checkpoint has {} parameters, model {}", params.len(), self.params.len())));
        }
        self.optimizer.load_state(state)?;
        self.params.copy_from_slice(params);
        self.cursor = cursor;
        self.write_back()
    }

    fn write_back(&mut self) -> Result<(), OptimError> {
        let model = self.model.take().expect("model is present between calls");
        let model = self.layout.write_params(model, &self.params);
        match model {
            Ok(m) => {
                self.model = Some(m);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn replace_running(&mut self, running: &[f32]) -> Result<(), OptimError> {
        let model = self.model.take().expect("model is present between calls");
        self.model = Some(self.layout.write_running(model, running)?);
        Ok(())
    }

    /// Runs the next step of the plan. `loss_fn(model, micro_batch)` returns the micro-batch's mean loss
    /// as a one-element tensor on the model's autodiff device.
    pub fn step<F>(&mut self, mut loss_fn: F) -> Result<StepReport, OptimError>
    where
        F: FnMut(&M, usize) -> Result<Tensor<1>, String>,
    {
        let info = self.cursor.advance().ok_or(OptimError::Finished(self.cursor.step()))?;
        let accum = self.config.accumulation_steps;
        let mut loss_sum = 0.0f64;
        if accum > 1 {
            self.grad_sum.clear();
            self.grad_sum.resize(self.params.len(), 0.0);
        }
        for micro in 0..accum {
            let model = self.model.as_ref().expect("model is present between calls");
            let loss = loss_fn(model, micro).map_err(|message| OptimError::Step { step: info.step, message })?;
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
        self.write_back()?;
        self.stats.steps += 1;
        if let Some(s) = &sync {
            self.stats.syncs += 1;
            if s.mode == SyncMode::Gradients {
                self.stats.gradient_syncs += 1;
            }
        }
        Ok(StepReport { info, loss: (loss_sum / accum as f64) as f32, updated, sync })
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
            let calls = all_reduce_bucketed(self.comm.as_mut(), &mut self.params, self.config.bucket_elems).map_err(err)?;
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
            self.replace_running(&buf[running_at..].to_vec())?;
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
fn all_reduce_bucketed(comm: &mut dyn Collective, buf: &mut [f32], bucket: Option<usize>) -> Result<u64, qsr_comm::CommError> {
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
