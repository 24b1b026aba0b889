//! Local SGD around the caller's own burn optimizer and lr scheduler.
//!
//! [`Worker`](crate::Worker) owns the optimizer (PyTorch-exact SGD / AdamW over flat state). Most burn
//! users already have an optimizer (`SgdConfig`, `AdamWConfig`), a scheduler and a loop; an
//! [`Averager`] adds the local method to that loop without replacing any of it. It needs only what QSR
//! needs: the learning rate each step used, so that at the start of every round it can pick `H` from
//! the lr of the round's first step, and a [`Collective`] to average parameters over.
//!
//! A plain burn loop, and the same loop with K-worker QSR (the lines marked `+`; complete programs:
//! `examples/burn_plain.rs` and `examples/burn_qsr.rs`, 4 threads or ranks under `qsr launch`):
//!
//! ```text
//! + fn train(comm: Box<dyn Collective>) -> anyhow::Result<Mlp> {  // main: qsr_optim::run_workers(4, train)
//!   device.seed(SEED);
//!   let mut model = Mlp::new(&device);
//!   let mut sched = CosineAnnealingLrSchedulerConfig::new(0.01, steps).init()?;
//! + let config = AveragerConfig::qsr(2, 0.06).schedule(&sched, steps); // its lrs pick each round's H
//! + let mut avg = Averager::new(&mut model, config, comm)?;             // rank 0's weights everywhere
//!   let mut optim = AdamWConfig::new().init();
//!   for step in 0..steps {                             // each rank on its own shard (ShardedDataset)
//!       let lr = sched.step();
//!       let grads = GradientsParams::from_grads(loss(&model, batch(step)).backward(), &model);
//!       model = optim.step(lr, model, grads);
//! +     model = avg.step(model)?;                      // averages when a round ends, and at the last step
//!   }
//! ```
//!
//! Initial weights: [`Averager::new`] gives every worker rank 0's parameters, so only rank 0's
//! initialization matters. burn draws initial weights lazily from one global RNG shared by all
//! threads; under [`run_workers`](crate::run_workers)' threads rank 0 runs alone until its
//! `Averager::new` has drawn them, so a seeded rank 0 starts every run from the same weights. With
//! threads of your own, build the model with [`seeded_init`](crate::seeded_init).
//!
//! Resume: [`Averager::state`] (an [`AveragerState`], saved beside the model's and the optimizer's
//! records) and [`Averager::restore`] right after [`Averager::new`] continue the rounds exactly.
//! [`AveragerConfig::round_lengths`] gives the rounds a run makes for the lrs of your own schedule.
//!
//! Rules that all-reduce gradients (`dp`, `post-local` before its switch) need the gradients before the
//! optimizer step: call [`Averager::average_grads`] between the backward pass and the optimizer step
//! (a no-op on the steps of other rules, so a loop may always call it); [`Averager::step`] fails
//! naming it if such a step's gradients were not averaged.
//!
//! With [`AveragerConfig::outer`] a synchronization is DiLoCo's outer step instead of a plain average:
//! the mean pseudo-gradient (last global parameters minus the worker's) drives an outer SGD with
//! (Nesterov) momentum, whatever rule decides when, QSR included.
//!
//! With [`AveragerConfig::streaming`] the parameters sync in fragments of whole tensors, each once per
//! round at its own step, its average applied `delay` steps later and blended by `mix` (Streaming
//! DiLoCo's schedule with QSR's `H`); with a quantized (int8, fp8, int4, int2) [`AveragerConfig::wire`] the payloads are
//! block-scaled with error feedback. [`Averager::set_streaming_comm`] runs the fragments'
//! all-reduces on a second group, on a thread, while the caller steps (the same bits). The run's
//! last step (or [`Averager::finish`]) applies what is in flight and averages all parameters, so
//! every rank ends with one model.
//!
//! What the averager does not do: burn's optimizers keep their state private, so their moments stay
//! per worker (the paper's default; [`Worker`](crate::Worker) can average them).

use burn::module::Module;
use burn::optim::GradientsParams;
use qsr_comm::{Collective, CommStats, ReduceOp};
use qsr_sched::{StepInfo, SyncMode};

use crate::error::OptimError;
use crate::flat::ParamLayout;
use crate::lr_watch::{self, LrWatch};
use crate::settings::{Face, check_sync};
use crate::sync::{Level, StepEnd, SyncReport, Transfer};
use crate::synchronizer::{At, Synced, Synchronizer};

mod config;
mod epochs;
mod plan;
mod saved;
mod schedule;

pub use config::AveragerConfig;
use config::RoundSpan;
use plan::Plan;
pub use saved::AveragerState;
use saved::Rounds;
pub use schedule::Schedule;

/// Totals of an [`Averager`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AveragerStats {
    /// Steps seen.
    pub steps: u64,
    /// Synchronizations (rounds completed).
    pub syncs: u64,
    /// Traffic and time of the synchronizations.
    pub comm: CommStats,
    /// Calls that wrote averaged values into the model they returned: every parameter average, and
    /// with streaming every step where an average landed (mid-round too), so a caller that keeps its
    /// own copy of the model knows when to take the returned one.
    pub updates: u64,
}

/// Averages a model's parameters over a [`Collective`] at the end of every round of a sync rule,
/// deciding each round's length `H` from the learning rate the caller's own scheduler produced.
///
/// Two workers as threads, each with burn's own SGD and a step scheduler (lr 0.05 for 6 steps, then
/// 0.005), under QSR with `H_base = 2` and `alpha = 0.1`: the first two rounds, at lr 0.05, last
/// `(0.1 / 0.05)^2 = 4` steps; the third, at lr 0.005, would last 400 and ends at the run's 12th
/// step, which averages:
///
/// ```
/// use burn::lr_scheduler::step::StepLrSchedulerConfig;
/// use burn::nn::LinearConfig;
/// use burn::optim::{GradientsParams, SgdConfig};
/// use burn::tensor::{Device, Tensor};
/// use qsr_optim::{Averager, AveragerConfig};
///
/// let syncs = qsr_optim::run_workers(2, |comm| -> Result<u64, qsr_optim::OptimError> {
///     let device = Device::flex().autodiff();
///     device.seed(7);
///     let mut model = LinearConfig::new(4, 1).init(&device);
///     let mut sched = StepLrSchedulerConfig::new(0.05, 6).init().unwrap();
///     let config = AveragerConfig::qsr(2, 0.1).schedule(&sched, 12);
///     let mut avg = Averager::new(&mut model, config, comm)?;
///     let mut optim = SgdConfig::new().init();
///     for _ in 0..12 {
///         let loss = model.forward(Tensor::<2>::ones([8, 4], &device)).powi_scalar(2).mean();
///         let grads = GradientsParams::from_grads(loss.backward(), &model);
///         model = optim.step(sched.step(), model, grads);
///         model = avg.step(model)?; // averages when a round ends, and at the last step
///     }
///     Ok(avg.stats().syncs)
/// });
/// assert!(syncs.unwrap().into_iter().all(|s| s.unwrap() == 3));
/// ```
pub struct Averager {
    config: AveragerConfig,
    /// The collective, wire, outer step and streaming: the sync engine the Worker shares.
    sync: Synchronizer,
    layout: ParamLayout,
    round: Option<RoundSpan>,
    rounds_after_warmup: u64,
    /// Parameters, then (with `average_bn`) running statistics: one buffer, one all-reduce per round.
    params: Vec<f32>,
    /// The step count at the last synchronization (0 after the initial broadcast).
    synced_at: u64,
    /// Gradients of a step that syncs them (empty for rules that never do).
    grads: Vec<f32>,
    /// The step whose gradients [`Averager::average_grads`] averaged last.
    grads_averaged: Option<u64>,
    stats: AveragerStats,
    /// What the ranks agreed on at construction; a saved state must carry the same.
    settings: serde_json::Value,
    /// A collective failed, or the caller gave up ([`Averager::abandon`]): no warning at drop.
    abandoned: bool,
    /// The lrs so far, for the warnings of plans that go wrong silently.
    lr_watch: LrWatch,
    /// The caller's schedule, followed beside the loop ([`AveragerConfig::schedule`]).
    plan: Option<Plan>,
    /// The step count when the syncs made were last reported (the run's last step, or `finish`).
    reported: Option<u64>,
    /// The loop's epochs, as its `ShardedDataset::set_epoch` calls mark them.
    epochs: epochs::Epochs,
}
impl Averager {
    /// Sets up averaging of `model` over `comm`: checks that every rank has the same configuration and
    /// model layout (an error naming the differing settings otherwise, on every rank), then gives
    /// `model` rank 0's parameters (and BN statistics), so every worker starts from the same point.
    /// Rank 0's parameters are drawn (burn initializes them lazily) before it first communicates.
    pub fn new<M: Module>(
        model: &mut M,
        config: AveragerConfig,
        comm: Box<dyn Collective>,
    ) -> Result<Self, OptimError> {
        let layout = ParamLayout::of(model);
        let mut params = vec![0.0; layout.len() + if config.average_bn { layout.running_len() } else { 0 }];
        // Drawn now, before any call of `comm`: under `run_workers`' threads rank 0 runs alone until then.
        layout.read_params(model, &mut params[..layout.len()])?;
        check_sync(&config.sync_settings(comm.world_size()), Face::Averager).into_result()?;
        let mut sync = Synchronizer::new(comm, Transfer { wire: config.wire, bucket: None }, Face::Averager)?;
        sync.set_fingerprint(config.fingerprint);
        let stream = sync
            .streams_with(config.streaming.as_ref())
            .then(|| sync.prepare_streaming(config.streaming, &layout))
            .transpose()?;
        let settings = serde_json::json!({
            "config": &config,
            "world_size": sync.comm().world_size(),
            "model": { "parameters": layout.len(), "running_statistics": layout.running_len(), "tensors": layout.trainable.len() },
        });
        qsr_comm::agree(sync.comm_mut(), &settings).map_err(setup_error)?;
        let planned = config.schedule.as_ref().map(|schedule| Plan::new(&config, schedule)).transpose()?;
        let mut avg = Self {
            params,
            config,
            sync,
            layout,
            round: None,
            rounds_after_warmup: 0,
            synced_at: 0,
            grads: Vec::new(),
            grads_averaged: None,
            stats: AveragerStats::default(),
            settings,
            abandoned: false,
            lr_watch: LrWatch::default(),
            plan: None,
            reported: None,
            epochs: epochs::Epochs::new(),
        };
        if let Some((plan, warnings)) = planned {
            // The ranks agreed on the schedule: rank 0 says what is wrong with it, once.
            let steps = plan.steps();
            warnings.iter().for_each(|w| avg.warn(&format!("the schedule over its {steps} steps: {w}")));
            avg.plan = Some(plan);
        }
        if avg.config.broadcast_initial {
            let (layout, bn) = (&avg.layout, avg.config.average_bn);
            *model = avg.sync.broadcast_initial(model.clone(), layout, bn, |source| OptimError::Setup { source })?;
        }
        let n = avg.layout.len();
        if let Some(config) = avg.config.outer {
            avg.layout.read_params(model, &mut avg.params[..n])?;
            avg.sync.set_outer(config, &avg.params[..n])?;
        }
        if let Some(stream) = stream {
            // Streaming syncs pseudo-gradients: plain averaging is the outer step with lr 1.
            avg.layout.read_params(model, &mut avg.params[..n])?;
            avg.sync.start_streaming(stream, &avg.params[..n]);
        }
        Ok(avg)
    }

    /// Runs the streaming fragments' all-reduces on `comm`, on a thread of their own, while the
    /// caller steps: `comm` holds the same ranks as the averager's (a second
    /// [`qsr_comm::InProcessGroup`], or [`qsr_comm::split`] of a ring), and every rank gives one
    /// before its first step. The results are the same bits as without it.
    pub fn set_streaming_comm(&mut self, comm: Box<dyn Collective>) -> Result<(), OptimError> {
        self.sync.set_streaming_comm(comm)
    }

    /// Call after each of the caller's optimizer steps: the step's lr is the schedule's
    /// ([`AveragerConfig::schedule`], the scheduler your loop steps, so the two cannot drift). At the
    /// first step of a round it decides the round's `H` from that lr (QSR: `max(h_base, floor((alpha /
    /// lr)^2))` after warmup); at a round's last step, and at the run's last, it averages the
    /// parameters over all ranks. A loop without a burn scheduler passes its lrs to
    /// [`Self::step_with_lr`] instead.
    ///
    /// On a step whose round syncs gradients, [`Self::average_grads`] must have averaged them before the
    /// optimizer step; the parameters then need no averaging.
    pub fn step<M: Module>(&mut self, model: M) -> Result<M, OptimError> {
        let t = self.stats.steps;
        let Some(lr) = self.plan.as_mut().map(|plan| plan.next_lr(&self.config, t)).transpose()? else {
            return Err(OptimError::Config {
                field: "schedule".into(),
                reason: "`Averager::step` takes each step's lr from the schedule: give the config your scheduler \
                         (`AveragerConfig::schedule(&sched, steps)`), or pass each lr to `Averager::step_with_lr`"
                    .into(),
            });
        };
        self.step_with_lr(model, lr)
    }

    /// [`Self::step`] with the learning rate the optimizer step used, for loops whose lrs come from
    /// elsewhere than a burn scheduler given to [`AveragerConfig::schedule`]. With a schedule given
    /// too, a step whose lr is not the schedule's is warned (the rounds follow the lr passed).
    pub fn step_with_lr<M: Module>(&mut self, model: M, lr: f64) -> Result<M, OptimError> {
        let t = self.stats.steps;
        if let (Some(per_epoch), Some(run)) = (self.epochs.at_step(t), self.config.run_steps)
            && let Some(w) = epochs::judge(per_epoch, run, self.world_size(), self.epochs.of_loop())
        {
            self.warn(&w);
            // The loop was told its steps differ: a step past them is not warned again.
            self.lr_watch.past_told();
        }
        self.watch_lr(t, lr)?;
        let model = self.step_rounds(model, t, lr)?;
        if let Some(w) = self.plan.as_mut().and_then(|plan| plan.check_syncs(self.stats.syncs, self.stats.steps)) {
            self.warn(&w);
        }
        // A loop known to run past the schedule's steps is reported at its real end instead.
        if self.config.run_steps == Some(self.stats.steps) && !self.epochs.runs_past(self.stats.steps) {
            self.report_syncs();
        }
        Ok(model)
    }

    /// Step `t`'s lr against the caller's schedule, if given, and the lrs' course so far (judged
    /// here only once the loop left the schedule, which was judged whole at the start).
    fn watch_lr(&mut self, t: u64, lr: f64) -> Result<(), OptimError> {
        if let Some(w) = self.plan.as_mut().map(|plan| plan.follow(&self.config, t, lr)).transpose()?.flatten() {
            self.warn(&w);
        }
        let lr_driven = self.config.rule.power().is_some() && self.plan.as_ref().is_none_or(|p| !p.on_plan());
        if let Some(w) = self.lr_watch.observe(t, lr, self.config.run_steps, lr_driven) {
            self.warn(&w);
        }
        // A loop told that its lrs left the schedule is not told again what follows from them.
        if self.config.run_steps == Some(t + 1)
            && self.plan.as_ref().is_none_or(Plan::on_plan)
            && let Some(w) = self.lr_watch.at_end()
        {
            self.warn(&w);
        }
        Ok(())
    }

    /// Step `t` in its round: a new round's `H` from `lr`, and the sync at a round's end.
    fn step_rounds<M: Module>(&mut self, model: M, t: u64, lr: f64) -> Result<M, OptimError> {
        let round = match self.round {
            Some(r) if t < r.end => r,
            _ => self.start_round(t, lr)?,
        };
        if self.config.rule.syncs_gradients(round.start) {
            if self.grads_averaged != Some(t) {
                return Err(OptimError::Config {
                    field: "average_grads".into(),
                    reason: format!(
                        "step {t} of rule `{}` all-reduces gradients: call Averager::average_grads between the backward pass and the optimizer step",
                        self.config.rule.name()
                    ),
                });
            }
            self.stats.steps += 1;
            if self.sync.has_outer() {
                // Every rank took the same update: the outer step's global parameters follow it.
                let n = self.layout.len();
                self.layout.read_params(&model, &mut self.params[..n])?;
                self.sync.follow(&self.params[..n]);
            }
            return Ok(model);
        }
        self.sync.observe_step(lr);
        self.stats.steps += 1;
        if self.sync.streams() {
            return self.stream_step(model, t, lr, round);
        }
        if self.stats.steps < round.end { Ok(model) } else { self.average_now(model) }
    }

    /// A streaming step's syncs, after step `t` of `round`: the fragments due, the averages that
    /// land, at the round's end the BatchNorm statistics (`average_bn`), at the run's end all.
    fn stream_step<M: Module>(&mut self, model: M, t: u64, lr: f64, round: RoundSpan) -> Result<M, OptimError> {
        let sync_after = t + 1 == round.end;
        let info = StepInfo {
            step: t,
            lr,
            round: self.stats.syncs,
            round_start: round.start,
            // A step past `run_steps` is a round of its own, cut to nothing: no fragment syncs in it.
            h: round.end.saturating_sub(round.start),
            sync_after,
            mode: SyncMode::Parameters,
            local_sync_after: false,
        };
        let last = self.config.run_steps == Some(t + 1);
        self.stats.syncs += u64::from(sync_after);
        let bn_due = sync_after && self.config.average_bn && self.layout.running_len() > 0;
        if !self.sync.acts_after(&info, last) && !bn_due {
            return Ok(model);
        }
        let n = self.layout.len();
        let mut model = model;
        self.layout.read_params(&model, &mut self.params[..n])?;
        let bn = self.config.average_bn.then_some((&mut model, &self.layout));
        let end = StepEnd { info: &info, last };
        let stepped = self.sync.end_streaming_step(&mut self.params[..n], bn, end, &mut self.stats.comm);
        let stepped = self.abandon_on_error(stepped)?;
        if stepped.ranks_equal {
            self.synced_at = t + 1;
        }
        self.stats.updates += u64::from(stepped.landed || last || bn_due);
        self.layout.write_params(model, &self.params[..n])
    }

    /// Call between the backward pass and the optimizer step. On a step of a round that syncs gradients
    /// (`dp`, `post-local` before its switch) it returns the mean of every rank's gradients (one
    /// all-reduce, counted as a synchronization; parameters without a gradient contribute zeros and stay
    /// without one); on every other step it returns `grads` as they are. Every rank must call it at the
    /// same steps.
    pub fn average_grads<M: Module>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, OptimError> {
        let step = self.stats.steps;
        if !self.config.rule.syncs_gradients(step) {
            return Ok(grads);
        }
        let mut buf = std::mem::take(&mut self.grads);
        buf.resize(self.layout.len(), 0.0);
        self.layout.read_grads_params(model, &grads, &mut buf)?;
        let elements = buf.len();
        let synced = |sync: &mut Synchronizer| sync.all_reduce(&mut buf, At::after(step, Some(1)), Level::Global);
        self.synchronize(SyncMode::Gradients, elements, synced)?;
        self.layout.write_grads_params(model, &mut grads, &buf)?;
        self.grads = buf;
        self.grads_averaged = Some(step);
        self.synced_at = step + 1;
        Ok(grads)
    }

    /// Averages now, whatever the round: at the end of training (a last round cut short) or before an
    /// evaluation. Every rank must call it at the same point.
    pub fn average_now<M: Module>(&mut self, model: M) -> Result<M, OptimError> {
        if self.sync.streams() {
            return self.settle(model);
        }
        let step = self.stats.steps;
        let n = self.layout.len();
        self.layout.read_params(&model, &mut self.params[..n])?;
        if self.config.average_bn {
            self.layout.read_running(&model, &mut self.params[n..])?;
        }
        let mut params = std::mem::take(&mut self.params);
        let (at, elements) = (self.at(step), params.len());
        let reduced =
            self.synchronize(SyncMode::Parameters, elements, |sync| sync.average(&mut params, n, at, Level::Global));
        self.params = params;
        reduced?;
        self.synced_at = step;
        self.stats.updates += 1;
        self.write(model)
    }

    /// The mean of every rank's current parameters (and with `average_bn` its BatchNorm statistics)
    /// in f32, as a copy of `model`: what an evaluation of the average in the middle of a round sees.
    /// Unlike [`Self::average_now`] the round goes on: the ranks keep their own parameters, and no
    /// sync is counted (its all-reduce is left out of [`Self::stats`]). Every rank must call it at the
    /// same point.
    pub fn mean<M: Module>(&mut self, model: &M) -> Result<M, OptimError> {
        let n = self.layout.len();
        let mut buf = vec![0.0; self.params.len()];
        self.layout.read_params(model, &mut buf[..n])?;
        if self.config.average_bn {
            self.layout.read_running(model, &mut buf[n..])?;
        }
        let at = self.at(self.stats.steps);
        let reduced = self.sync.all_reduce(&mut buf, at, Level::Global);
        self.abandon_on_error(reduced)?;
        let mean = self.layout.write_params(model.clone(), &buf[..n])?;
        if self.config.average_bn { self.layout.write_running(mean, &buf[n..]) } else { Ok(mean) }
    }

    /// A streaming averager's [`Self::average_now`]: applies the averages in flight, then averages
    /// every parameter (and with `average_bn` the statistics) in f32; a round cut short counts a sync.
    fn settle<M: Module>(&mut self, model: M) -> Result<M, OptimError> {
        let (step, n) = (self.stats.steps, self.layout.len());
        let mut model = model;
        self.layout.read_params(&model, &mut self.params[..n])?;
        let bn = self.config.average_bn.then_some((&mut model, &self.layout));
        let at = self.at(step);
        let settled = self.sync.settle(&mut self.params[..n], bn, at, &mut self.stats.comm);
        self.abandon_on_error(settled)?;
        self.stats.syncs += u64::from(self.round.is_some_and(|r| step < r.end));
        self.stats.updates += 1;
        self.synced_at = step;
        self.layout.write_params(model, &self.params[..n])
    }

    /// The outer optimizer's global parameters and momentum buffer (for a checkpoint), if it has one.
    pub fn outer_state(&self) -> Option<(&[f32], &[f32])> {
        self.sync.outer_state()
    }

    /// Where this averager stands, to save beside the model and the optimizer record. A streaming
    /// averager's state holds its averages in flight, waited for, and its residual: every rank
    /// calls it at the same step.
    pub fn state(&mut self) -> Result<AveragerState, OptimError> {
        let rounds = Rounds {
            settings: self.settings.clone(),
            steps: self.stats.steps,
            syncs: self.stats.syncs,
            synced_at: self.synced_at,
            rounds_after_warmup: self.rounds_after_warmup,
            round: self.round,
            lr_watch: self.lr_watch.clone(),
            traffic: CommStats { seconds: 0.0, ..self.stats.comm },
        };
        Ok(AveragerState { rounds, sync: self.sync.state()? })
    }

    /// Continues from a saved [`state`](Self::state): call it right after [`Averager::new`], on every
    /// rank, with the state each rank saved at the same step (then load the model's and the optimizer's
    /// records as usual). A state saved under other settings, or ranks resuming at different steps, is
    /// an error naming the difference.
    pub fn restore(&mut self, state: AveragerState) -> Result<(), OptimError> {
        // Through the same text and parser as the saved settings: a float reads back alike.
        let now = serde_json::to_string(&self.settings).ok().and_then(|t| serde_json::from_str(&t).ok());
        let diffs = qsr_comm::differing_keys(&now.unwrap_or_default(), &state.rounds.settings);
        // Every rank takes part in the agreement, a rank whose state does not fit included, so that
        // no rank is left waiting for one that failed alone.
        let position = serde_json::json!({
            "resumed_at_step": state.rounds.steps,
            "synced_at": state.rounds.synced_at,
            "saved_settings_fit": diffs.is_empty(),
        });
        qsr_comm::agree(self.sync.comm_mut(), &position).map_err(|source| OptimError::Setup { source })?;
        if !diffs.is_empty() {
            let list: Vec<String> =
                diffs.iter().map(|d| format!("`{}`: now {}, saved {}", d.key, d.left, d.right)).collect();
            return Err(OptimError::Config {
                field: "state".into(),
                reason: format!("saved under other settings: {}", list.join("; ")),
            });
        }
        self.sync.restore(state.sync, "state")?;
        self.stats.steps = state.rounds.steps;
        self.stats.syncs = state.rounds.syncs;
        self.synced_at = state.rounds.synced_at;
        self.rounds_after_warmup = state.rounds.rounds_after_warmup;
        self.round = state.rounds.round;
        self.lr_watch = state.rounds.lr_watch;
        self.stats.comm = state.rounds.traffic;
        if let Some(plan) = &mut self.plan {
            plan.resume_at(&self.config, self.stats.steps)?;
        }
        Ok(())
    }

    /// Steps taken since the last synchronization: what [`finish`](Self::finish) would average. Non-zero
    /// when the averager is dropped means the workers end with different models (it warns then).
    pub fn unsynced_steps(&self) -> u64 {
        // `average_grads` counts its step as synced before `step` counts the step itself.
        self.stats.steps.saturating_sub(self.synced_at)
    }

    /// Ends the run here on purpose, the models left as they are (after an error elsewhere, say): the
    /// averager then does not warn about unaveraged steps when dropped.
    pub fn abandon(&mut self) {
        self.abandoned = true;
    }

    /// Restores the outer optimizer's state saved by [`Self::outer_state`].
    pub fn restore_outer_state(&mut self, global: &[f32], momentum: &[f32]) -> Result<(), OptimError> {
        self.sync.restore_outer(global, momentum)
    }

    /// A synchronization of `elements` through the synchronizer (`run`, which returns the calls
    /// made), counted in the totals; a failure abandons the averager.
    fn synchronize(
        &mut self,
        mode: SyncMode,
        elements: usize,
        run: impl FnOnce(&mut Synchronizer) -> Result<u64, OptimError>,
    ) -> Result<SyncReport, OptimError> {
        let start = self.sync.start(Level::Global);
        let calls = run(&mut self.sync);
        let calls = self.abandon_on_error(calls)?;
        self.stats.syncs += 1;
        Ok(self.sync.account(start, Synced { mode, elements, calls }, &mut self.stats.comm))
    }

    /// `result`, abandoning the averager when it is an error (a collective failed: no warning at drop).
    fn abandon_on_error<T>(&mut self, result: Result<T, OptimError>) -> Result<T, OptimError> {
        self.abandoned |= result.is_err();
        result
    }

    /// The sync after `steps` steps, in the current round (`H` 0 before the first).
    fn at(&self, steps: u64) -> At {
        At::after_steps(steps, self.round.map_or(0, |r| r.end.saturating_sub(r.start)))
    }

    /// Averages if some step since the last synchronization is not averaged yet: the end of a run whose
    /// length [`AveragerConfig::run_steps`] did not give (the last round cut short, as the planner cuts
    /// it). Every rank must call it at the same point.
    /// On rank 0 it reports the syncs made (and those the schedule planned, if given), and warns
    /// when the loop ended before [`AveragerConfig::run_steps`]. A run that took its `run_steps`
    /// needs no call (its last step averaged and reported); there it returns `model` as it is.
    pub fn finish<M: Module>(&mut self, model: M) -> Result<M, OptimError> {
        if self.config.run_steps == Some(self.stats.steps) {
            // The run's last step averaged and reported.
            return Ok(model);
        }
        // A loop that stopped before `run_steps` did not take the schedule to its end: its last lr says
        // nothing of the schedule.
        if let Some(w) = self.lr_watch.at_end().filter(|_| self.config.run_steps.is_none()) {
            self.warn(&w);
        }
        let model = if self.unsynced_steps() > 0 { self.average_now(model)? } else { model };
        self.report_syncs();
        Ok(model)
    }

    /// Rank 0's line at the end of the run: syncs made against those planned.
    fn report_syncs(&mut self) {
        let steps = self.stats.steps;
        if let Some(run) = self.config.run_steps.filter(|&run| steps < run) {
            let cause = epochs::times_the_shard(run, steps, self.world_size() as u64);
            self.warn(&format!(
                "the loop ended after {steps} of the {run} steps the schedule was given (`AveragerConfig::schedule`, \
                 or `run_steps`){cause}: if it did not stop early on purpose, give the scheduler and the schedule the \
                 steps this rank's loop takes (its shard's batches times the epochs)"
            ));
        }
        self.note_syncs();
    }

    /// Rank 0's line of the syncs made (against those planned), at the run's end as it stands.
    fn note_syncs(&mut self) {
        self.reported = Some(self.stats.steps);
        let (steps, syncs) = (self.stats.steps, self.stats.syncs);
        if self.rank() != 0 {
            return;
        }
        let planned = match &self.plan {
            Some(plan) => format!(", the schedule planned {}", plan.total()),
            None => String::new(),
        };
        let noun = if syncs == 1 { "sync" } else { "syncs" };
        let epochs = self.epochs.of(steps);
        lr_watch::note(&format!("Averager: {syncs} {noun} in {steps} steps{epochs}{planned}"));
        if let Some(plan) = self.plan.as_ref().filter(|p| p.total() != syncs && steps == p.steps() && !p.warned()) {
            self.warn(&format!(
                "{syncs} syncs made, where the schedule planned {}: the lrs passed were not the schedule's",
                plan.total()
            ));
        }
    }

    /// `true` on every rank when any rank passes `true`: how ranks agree to stop at the same step. One
    /// 4-byte all-reduce, not counted as a synchronization. Every rank must call it at the same point.
    pub fn any(&mut self, flag: bool) -> Result<bool, OptimError> {
        let mut buf = [f32::from(u8::from(flag))];
        let step = self.stats.steps;
        self.sync.comm_mut().all_reduce(&mut buf, ReduceOp::Sum).map_err(|source| OptimError::Comm { step, source })?;
        Ok(buf[0] > 0.0)
    }

    /// Totals so far.
    pub fn stats(&self) -> &AveragerStats {
        &self.stats
    }

    /// `H` of the round under way (`None` before the first step).
    pub fn current_h(&self) -> Option<u64> {
        self.round.map(|r| r.h)
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.sync.comm().rank()
    }

    /// Number of workers.
    pub fn world_size(&self) -> usize {
        self.sync.comm().world_size()
    }

    fn start_round(&mut self, t: u64, lr: f64) -> Result<RoundSpan, OptimError> {
        let round = self.config.round_at(t, lr, &mut self.rounds_after_warmup)?;
        // Judged after warmup (the peak is not known before it) and within the run.
        // A plan the loop follows was judged whole at the start.
        let judged = !self.config.rule.syncs_gradients(t)
            && t >= self.config.warmup_steps
            && self.plan.as_ref().is_none_or(|p| !p.on_plan());
        if let Some(run) = self.config.run_steps.filter(|&run| judged && t < run)
            && let Some(w) = self.lr_watch.round(t, round.end.saturating_sub(round.start), lr, run)
        {
            self.warn(&w);
        }
        self.round = Some(round);
        Ok(round)
    }

    /// A warning about this averager, on rank 0: every rank runs the same loop (ranks whose
    /// settings or lrs differ fail at construction or at their first sync, each naming its own).
    fn warn(&self, message: &str) {
        let (rank, k) = (self.sync.comm().rank(), self.sync.comm().world_size());
        if rank == 0 {
            lr_watch::warn(&format!("Averager (rank {rank} of {k}): {message}"));
        }
    }

    fn write<M: Module>(&self, model: M) -> Result<M, OptimError> {
        let n = self.layout.len();
        let model = self.layout.write_params(model, &self.params[..n])?;
        if self.config.average_bn { self.layout.write_running(model, &self.params[n..]) } else { Ok(model) }
    }
}

/// The error of ranks that could not agree at construction. An `alpha` that differs comes from
/// different lrs, when it was derived from them ([`AveragerConfig::qsr_for_budget`]): named as such.
fn setup_error(source: qsr_comm::CommError) -> OptimError {
    match &source {
        qsr_comm::CommError::Disagree { detail, .. } if detail.contains("`config.rule.alpha`") => OptimError::Config {
            field: "lr".into(),
            reason: format!(
                "the ranks' alphas differ ({detail}): an alpha from `AveragerConfig::qsr_for_budget` follows the \
                 lrs it was given, so the ranks' lr schedules differ; give every rank the same schedule (the same \
                 steps per epoch and epochs)"
            ),
        },
        qsr_comm::CommError::Disagree { detail, .. } if detail.contains("`config.schedule") => OptimError::Config {
            field: "schedule".into(),
            reason: format!(
                "the ranks' lr schedules differ ({detail}): give every rank the same scheduler and steps (this \
                 rank's shard's batches times the epochs, the same on every rank)"
            ),
        },
        _ => OptimError::Setup { source },
    }
}

/// A round left unaveraged is lost work and leaves the workers with different models: say so, once.
impl Drop for Averager {
    fn drop(&mut self) {
        if self.abandoned || std::thread::panicking() {
            return;
        }
        let (pending, steps) = (self.unsynced_steps(), self.stats.steps);
        match self.config.run_steps {
            Some(run) if steps > 0 && steps < run && (pending > 0 || self.reported.is_none()) => {
                let warning = self.dropped_early(run, pending);
                self.warn(&warning);
                self.note_syncs();
            }
            _ if pending > 0 => self.warn(&format!(
                "dropped {pending} step(s) after its last synchronization: the workers' models differ; call \
                 `Averager::finish(model)` after the last step, or give the config the run's steps \
                 (`AveragerConfig::schedule`); a run stopped on purpose (after a save, to resume) calls \
                 `Averager::abandon()`"
            )),
            // A loop that ran past its steps, every later step averaged: the count at its real end.
            Some(run) if steps > run && self.reported != Some(steps) => self.report_syncs(),
            // A run whose end nobody marked: what `finish` would have said of it.
            None if self.reported.is_none() && steps > 0 => {
                if let Some(w) = self.lr_watch.at_end() {
                    self.warn(&w);
                }
                self.report_syncs();
            }
            _ => {}
        }
    }
}

impl Averager {
    /// The warning of an averager dropped before the `run` steps its schedule was given, `pending`
    /// of them unaveraged: with the cause when the steps are about K times the loop's.
    fn dropped_early(&self, run: u64, pending: u64) -> String {
        let steps = self.stats.steps;
        let cause = epochs::times_the_shard(run, steps, self.world_size() as u64);
        let given = format!(
            "dropped after step {steps} of the {run} given to `AveragerConfig::schedule` (or `run_steps`){cause}"
        );
        if pending == 0 {
            return format!(
                "{given}: the loop ended before the schedule did, so its lrs (and QSR's rounds) never reached their \
                 end; give the schedule the steps this rank's loop takes (its shard's batches times the epochs), or \
                 call `Averager::finish(model)` (or `abandon()`) after a loop that ends early on purpose"
            );
        }
        format!(
            "{given}, with {pending} step(s) since its last synchronization: the workers' models differ; give the \
             schedule the steps this rank's loop takes (its shard's batches times the epochs), call \
             `Averager::finish(model)` after a loop that ends early, or `Averager::abandon()` for a run stopped on \
             purpose (to resume)"
        )
    }
}
