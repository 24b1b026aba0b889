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
//! + fn train(comm: Box<dyn Collective>) -> anyhow::Result<Mlp> {  // main: qsr_comm::run_workers(4, train)
//!   let model = Mlp::new(&device);
//! + let (mut avg, mut model) = Averager::new(model, AveragerConfig::qsr(2, 0.06), comm)?;
//!   let mut optim = AdamWConfig::new().init();
//!   for step in 0..steps {                             // each rank on its own shard (ShardedDataset)
//!       let lr = sched.step();
//!       let grads = GradientsParams::from_grads(loss(&model, batch(step)).backward(), &model);
//!       model = optim.step(lr.clone(), model, grads);
//! +     model = avg.step(model, lr.base())?;           // averages when a round ends
//!   }
//! + let model = avg.finish(model)?;                    // the last round (a drop without it warns)
//! ```
//!
//! Initial weights: [`Averager::new`] gives every worker rank 0's parameters, so only rank 0's
//! initialization matters. burn draws initial weights lazily from one global RNG shared by all threads;
//! for reruns that are bit-identical, build the model with [`seeded_init`].
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
//! DiLoCo's schedule with QSR's `H`); with an int8 / fp8 [`AveragerConfig::wire`] the payloads are
//! block-scaled with error feedback. [`Averager::set_streaming_comm`] runs the fragments'
//! all-reduces on a second group, on a thread, while the caller steps (the same bits). The run's
//! last step (or [`Averager::finish`]) applies what is in flight and averages all parameters, so
//! every rank ends with one model.
//!
//! What the averager does not do: burn's optimizers keep their state private, so their moments stay
//! per worker (the paper's default; [`Worker`](crate::Worker) can average them).

use std::path::Path;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use qsr_comm::{Collective, CommStats, ReduceOp};
use qsr_sched::{RoundStart, StepInfo, StreamingConfig, SyncMode, SyncRule};
use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::flat::ParamLayout;
use crate::lr_watch::{self, LrWatch};
use crate::outer::OuterConfig;
use crate::settings::{Face, SyncSettings, check_sync};
use crate::state::SyncState;
use crate::sync::{Level, SyncReport, Transfer, Wire};
use crate::synchronizer::{At, StepEnd, Synced, Synchronizer};

/// What an [`Averager`] averages and when.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AveragerConfig {
    /// When rounds end: any rule; `dp` and `post-local` (before its switch) average gradients through
    /// [`Averager::average_grads`].
    pub rule: SyncRule,
    /// Steps of the caller's lr warmup: the power rules use `h_base` while `step < warmup_steps`.
    pub warmup_steps: u64,
    /// Average BatchNorm running statistics with the parameters (default: they stay local).
    pub average_bn: bool,
    /// Broadcast rank 0's parameters at construction, so every worker starts from the same point
    /// (default; turn off only if every rank built bit-identical weights itself).
    pub broadcast_initial: bool,
    /// Steps the run takes, if known: the last round is cut to end there (with a synchronization), as
    /// the `qsr-sched` planner does. Without it, call [`Averager::average_now`] after the last step.
    pub run_steps: Option<u64>,
    /// An outer optimizer (DiLoCo) on the mean pseudo-gradient at every parameter synchronization,
    /// instead of plain averaging (default none). BatchNorm statistics are still averaged plainly.
    pub outer: Option<OuterConfig>,
    /// How a parameter average travels: f32 (default), bf16 (half the bytes, every rank ends with
    /// the same bf16-rounded mean), or int8 / fp8 (the pseudo-gradient in blocks with a scale each,
    /// with error feedback, as [`Worker`](crate::Worker) sends them); gradient averages stay f32.
    pub wire: Wire,
    /// Streaming syncs (default none): the parameters in fragments of whole tensors, each synced
    /// once per round at its own step and applied `delay` steps later, blended by `mix`, as the
    /// trainer's `[sync.streaming]` does. An int8 / fp8 wire without it syncs one fragment at each
    /// round's end, applied at once.
    pub streaming: Option<StreamingConfig>,
    /// Compare a fingerprint of the parameters across ranks after every parameter average (default
    /// off): ranks whose parameters differ fail naming the step ([`OptimError::ParametersDiffer`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fingerprint: bool,
}

impl AveragerConfig {
    /// `rule` with `warmup_steps` of warmup, BN statistics local, rank 0's initial weights.
    pub fn new(rule: SyncRule, warmup_steps: u64) -> Self {
        Self {
            rule,
            warmup_steps,
            average_bn: false,
            broadcast_initial: true,
            run_steps: None,
            outer: None,
            wire: Wire::F32,
            streaming: None,
            fingerprint: false,
        }
    }

    /// QSR without warmup: `H = max(h_base, floor((alpha / lr)^2))` at each round's start.
    pub fn qsr(h_base: u64, alpha: f64) -> Self {
        Self::new(SyncRule::Qsr { h_base, alpha }, 0)
    }

    /// Data parallel: gradients averaged every step ([`Averager::average_grads`] before each
    /// optimizer step), the baseline a local method is compared with.
    ///
    /// ```
    /// let config = qsr_optim::AveragerConfig::dp();
    /// assert_eq!(config.rule, qsr_optim::SyncRule::Dp);
    /// assert_eq!(config.round_lengths([0.1; 5]).unwrap(), [1, 1, 1, 1, 1]);
    /// ```
    pub fn dp() -> Self {
        Self::new(SyncRule::Dp, 0)
    }

    /// QSR whose `alpha` spends at most `budget` of data parallel's synchronizations (a share in
    /// (0, 1]: 0.1 syncs a tenth as often) over a run whose steps use `lrs`, the first `warmup_steps`
    /// of them warmup: the smallest such `alpha`, so the most averaging the budget buys. `lrs` is your
    /// own schedule sampled step by step, as for [`Self::round_lengths`]. Refused, naming `budget`, for
    /// a share `h_base` alone already meets (lower `h_base`: QSR then lengthens rounds the budget does
    /// not ask for), and for one that only rounds keeping the workers apart while the lr is high meet
    /// ([`Self::first_apart`]; the refusal offers the least budget that trains).
    ///
    /// ```
    /// use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    /// let mut sched = CosineAnnealingLrSchedulerConfig::new(0.1, 1000).init().unwrap();
    /// let lrs: Vec<f64> = (0..1000).map(|_| sched.step().base()).collect();
    /// let config = qsr_optim::AveragerConfig::qsr_for_budget(2, 0.1, 0, &lrs).unwrap();
    /// let syncs = config.round_lengths(lrs.iter().copied()).unwrap().len();
    /// assert!(syncs <= 100 && syncs > 90, "{syncs} syncs for a budget of 100");
    /// ```
    pub fn qsr_for_budget(h_base: u64, budget: f64, warmup_steps: u64, lrs: &[f64]) -> Result<Self, OptimError> {
        let config = |alpha| Self::new(SyncRule::Qsr { h_base, alpha }, warmup_steps);
        let finite = lrs.iter().copied().filter(|lr| lr.is_finite() && *lr > 0.0);
        let range = finite.fold((f64::INFINITY, 0.0f64), |(lo, hi), lr| (lo.min(lr), hi.max(lr)));
        if range.1 == 0.0 {
            return Err(OptimError::Config { field: "lr".into(), reason: "no finite positive learning rate".into() });
        }
        let share = |alpha| config(alpha).round_lengths(lrs.iter().copied()).map(|r| r.len() as f64 / lrs.len() as f64);
        let trains = |alpha| config(alpha).first_apart(lrs).map(|a| a.is_none());
        Ok(config(qsr_sched::least_alpha_within(budget, h_base, range, share, trains)?))
    }

    /// The first round an [`Averager`] with this config makes over `lrs` (as [`Self::round_lengths`])
    /// that keeps the workers apart too long while the lr is high, judged as the planner judges its
    /// rounds ([`qsr_sched::round_apart`]: its drift in steps at the peak of `lrs`).
    pub fn first_apart(&self, lrs: &[f64]) -> Result<Option<qsr_sched::Apart>, OptimError> {
        let peak = lrs.iter().copied().filter(|lr| lr.is_finite()).fold(0.0, f64::max);
        let mut start = 0;
        for len in self.round_lengths(lrs.iter().copied())? {
            let steps = &lrs[start as usize..(start + len) as usize];
            let lr = steps.iter().copied().filter(|lr| lr.is_finite()).fold(0.0, f64::max);
            if let Some(apart) = qsr_sched::round_apart(start, len, lr, peak, lrs.len() as u64) {
                return Ok(Some(apart));
            }
            start += len;
        }
        Ok(None)
    }

    /// The sync settings of this config over `workers` workers, as [`check_sync`](crate::check_sync)
    /// judges them (host-resident, no plan: the rounds come from the caller's lrs).
    pub fn sync_settings(&self, workers: usize) -> SyncSettings {
        SyncSettings {
            outer: self.outer,
            streaming: self.streaming,
            wire: self.wire,
            fingerprint: self.fingerprint,
            ..SyncSettings::new(self.rule.clone(), workers)
        }
    }

    /// The length of each round an [`Averager`] with this config makes over a run whose steps use
    /// `lrs` (one per step, in order; the last round cut at the run's end): the plan of your own
    /// schedule, e.g. a clone of your burn `LrScheduler` sampled step by step. Its `len()` is the
    /// number of synchronizations such a run makes (with `run_steps` set, or `finish` at the end).
    ///
    /// ```
    /// use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    /// let mut sched = CosineAnnealingLrSchedulerConfig::new(0.1, 1000).init().unwrap();
    /// let config = qsr_optim::AveragerConfig::qsr(2, 0.02);
    /// let rounds = config.round_lengths((0..1000).map(|_| sched.step().base())).unwrap();
    /// assert_eq!(rounds.iter().sum::<u64>(), 1000);
    /// assert!(rounds.len() < 500, "{} syncs: fewer than every other step", rounds.len());
    /// ```
    pub fn round_lengths(&self, lrs: impl IntoIterator<Item = f64>) -> Result<Vec<u64>, OptimError> {
        let mut rounds_after_warmup = 0;
        let mut starts = Vec::new();
        let mut end = 0;
        let mut steps = 0;
        for (t, lr) in (0..).zip(lrs) {
            if t >= end {
                end = self.round_at(t, lr, &mut rounds_after_warmup)?.end;
                starts.push(t);
            }
            steps = t + 1;
        }
        starts.push(steps);
        Ok(starts.windows(2).map(|w| w[1] - w[0]).collect())
    }

    /// The round that starts at step `t` with learning rate `lr` (QSR: `H` from it after warmup).
    fn round_at(&self, t: u64, lr: f64, rounds_after_warmup: &mut u64) -> Result<RoundSpan, OptimError> {
        let in_warmup = t < self.warmup_steps;
        if self.rule.power().is_some() && !in_warmup && !(lr.is_finite() && lr > 0.0) {
            return Err(OptimError::Config {
                field: "lr".into(),
                reason: format!("step {t}: the power rules need a finite positive learning rate, got {lr}"),
            });
        }
        let h = self.rule.h_at(RoundStart { step: t, lr, in_warmup, rounds_after_warmup: *rounds_after_warmup });
        *rounds_after_warmup += u64::from(!in_warmup);
        let end = t.saturating_add(h).min(self.run_steps.unwrap_or(u64::MAX));
        Ok(RoundSpan { start: t, h, end })
    }
}

/// The round under way: steps `start..end`, of length `h` unless cut at the run's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct RoundSpan {
    start: u64,
    h: u64,
    end: u64,
}

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
}

/// Where an [`Averager`] stands: its step, rounds and sync state (outer, streaming), saved beside the
/// model and the optimizer so that a resumed run continues its rounds exactly ([`Averager::state`],
/// [`Averager::restore`]). It records the settings the ranks agreed on; restoring it under other
/// settings (rule, world size, model) is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AveragerState {
    /// The averager's own rounds (its fields at the top level, as the first format had them).
    #[serde(flatten)]
    rounds: Rounds,
    /// The sync engine's state (outer, streaming, inner round), its fields at the top level.
    #[serde(flatten)]
    sync: SyncState,
}

/// The averager's part of its state: the settings, its counters and rounds, the lrs' course.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Rounds {
    settings: serde_json::Value,
    steps: u64,
    syncs: u64,
    synced_at: u64,
    rounds_after_warmup: u64,
    round: Option<RoundSpan>,
    /// The lrs' course, so that the warnings of wrong plans judge the whole run.
    #[serde(default)]
    lr_watch: LrWatch,
}

impl AveragerState {
    /// Writes the state to `path` as safetensors (the sync state's tensors in its own codec, the
    /// rounds in its metadata), through a temporary file of this process and a rename, so a crash of
    /// the process never leaves half a file.
    pub fn save(&self, path: &Path) -> Result<(), OptimError> {
        let io = |e: std::io::Error| OptimError::Io { path: path.to_path_buf(), source: e };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp.{}", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        let rounds = serde_json::to_value(&self.rounds).map_err(|e| io(std::io::Error::other(e)))?;
        let bytes = self.sync.encode(None, Some(rounds))?;
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads a state [`save`](Self::save) wrote, or a JSON state of the first format.
    pub fn load(path: &Path) -> Result<Self, OptimError> {
        let invalid = |e: String| OptimError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        };
        let bytes = std::fs::read(path).map_err(|e| OptimError::Io { path: path.to_path_buf(), source: e })?;
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') {
            return serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()));
        }
        let decoded = SyncState::decode(&bytes, None).map_err(|e| invalid(e.to_string()))?;
        let rounds = decoded.owner.ok_or_else(|| invalid("not an averager's state: no rounds".into()))?;
        let rounds = serde_json::from_value(rounds).map_err(|e| invalid(format!("its rounds: {e}")))?;
        Ok(Self { rounds, sync: decoded.state })
    }

    /// Steps the averager had seen.
    pub fn steps(&self) -> u64 {
        self.rounds.steps
    }
}

/// Builds a model whose initial weights depend only on `seed`: burn draws them from one global RNG that
/// every thread shares, so a threaded run (or two tests at once) otherwise starts from other weights
/// each time. Seeds `device`'s RNG and runs `init` under a process-wide lock, initializing every
/// parameter before the lock is released (burn initializes them lazily, at first use).
///
/// ```
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::Device;
/// let device = Device::flex();
/// let a: Linear = qsr_optim::seeded_init(&device, 7, || LinearConfig::new(4, 2).init(&device));
/// let b: Linear = qsr_optim::seeded_init(&device, 7, || LinearConfig::new(4, 2).init(&device));
/// assert_eq!(a.weight.val().into_data(), b.weight.val().into_data());
/// ```
pub fn seeded_init<M: Module>(device: &Device, seed: u64, init: impl FnOnce() -> M) -> M {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    device.seed(seed);
    let model = init();
    let layout = ParamLayout::of(&model);
    let mut values = vec![0.0; layout.len()];
    // Reading every parameter draws its lazily initialized values now, under the lock.
    let _ = layout.read_params(&model, &mut values);
    model
}

impl Averager {
    /// Sets up averaging of `model` over `comm`: checks that every rank has the same configuration and
    /// model layout (an error naming the differing settings otherwise, on every rank), then hands back
    /// the model with rank 0's parameters (and BN statistics), so every worker starts from the same point.
    pub fn new<M: Module>(
        model: M,
        config: AveragerConfig,
        comm: Box<dyn Collective>,
    ) -> Result<(Self, M), OptimError> {
        check_sync(&config.sync_settings(comm.world_size()), Face::Averager).into_result()?;
        let mut sync = Synchronizer::new(comm, Transfer { wire: config.wire, bucket: None }, Face::Averager)?;
        sync.set_fingerprint(config.fingerprint);
        let layout = ParamLayout::of(&model);
        let stream = sync
            .streams_with(config.streaming.as_ref())
            .then(|| sync.prepare_streaming(config.streaming, &layout))
            .transpose()?;
        let settings = serde_json::json!({
            "config": &config,
            "world_size": sync.comm().world_size(),
            "model": { "parameters": layout.len(), "running_statistics": layout.running_len(), "tensors": layout.trainable.len() },
        });
        qsr_comm::agree(sync.comm_mut(), &settings).map_err(|source| OptimError::Setup { source })?;
        let running_len = if config.average_bn { layout.running_len() } else { 0 };
        let mut avg = Self {
            params: vec![0.0; layout.len() + running_len],
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
        };
        let model = match avg.config.broadcast_initial {
            true => avg
                .sync
                .broadcast_initial(model, &avg.layout, avg.config.average_bn, |source| OptimError::Setup { source })?,
            false => model,
        };
        let n = avg.layout.len();
        if let Some(config) = avg.config.outer {
            avg.layout.read_params(&model, &mut avg.params[..n])?;
            avg.sync.set_outer(config, &avg.params[..n])?;
        }
        if let Some(stream) = stream {
            // Streaming syncs pseudo-gradients: plain averaging is the outer step with lr 1.
            avg.layout.read_params(&model, &mut avg.params[..n])?;
            avg.sync.start_streaming(stream, &avg.params[..n]);
        }
        Ok((avg, model))
    }

    /// Runs the streaming fragments' all-reduces on `comm`, on a thread of their own, while the
    /// caller steps: `comm` holds the same ranks as the averager's (a second
    /// [`qsr_comm::InProcessGroup`], or [`qsr_comm::split`] of a ring), and every rank gives one
    /// before its first step. The results are the same bits as without it.
    pub fn set_streaming_comm(&mut self, comm: Box<dyn Collective>) -> Result<(), OptimError> {
        self.sync.set_streaming_comm(comm)
    }

    /// Call after each of the caller's optimizer steps with the learning rate that step used. At the
    /// first step of a round it decides the round's `H` from that lr (QSR: `max(h_base, floor((alpha /
    /// lr)^2))` after warmup); at a round's last step it averages the parameters over all ranks.
    ///
    /// On a step whose round syncs gradients, [`Self::average_grads`] must have averaged them before the
    /// optimizer step; the parameters then need no averaging.
    pub fn step<M: Module>(&mut self, model: M, lr: f64) -> Result<M, OptimError> {
        let t = self.stats.steps;
        let lr_driven = self.config.rule.power().is_some();
        if let Some(w) = self.lr_watch.observe(t, lr, self.config.run_steps, lr_driven) {
            self.warn(&w);
        }
        if self.config.run_steps == Some(t + 1)
            && let Some(w) = self.lr_watch.at_end()
        {
            self.warn(&w);
        }
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
        };
        Ok(AveragerState { rounds, sync: self.sync.state()? })
    }

    /// Continues from a saved [`state`](Self::state): call it right after [`Averager::new`], on every
    /// rank, with the state each rank saved at the same step (then load the model's and the optimizer's
    /// records as usual). A state saved under other settings, or ranks resuming at different steps, is
    /// an error naming the difference.
    pub fn restore(&mut self, state: AveragerState) -> Result<(), OptimError> {
        let diffs = qsr_comm::differing_keys(&self.settings, &state.rounds.settings);
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
    pub fn finish<M: Module>(&mut self, model: M) -> Result<M, OptimError> {
        if let Some(w) = self.lr_watch.at_end() {
            self.warn(&w);
        }
        if self.unsynced_steps() > 0 { self.average_now(model) } else { Ok(model) }
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
        let judged = !self.config.rule.syncs_gradients(t) && t >= self.config.warmup_steps;
        if let Some(run) = self.config.run_steps.filter(|&run| judged && t < run)
            && let Some(w) = self.lr_watch.round(t, round.end.saturating_sub(round.start), lr, run)
        {
            self.warn(&w);
        }
        self.round = Some(round);
        Ok(round)
    }

    /// A warning about this averager, naming its rank.
    fn warn(&self, message: &str) {
        let (rank, k) = (self.sync.comm().rank(), self.sync.comm().world_size());
        lr_watch::warn(&format!("qsr Averager (rank {rank} of {k}): {message}"));
    }

    fn write<M: Module>(&self, model: M) -> Result<M, OptimError> {
        let n = self.layout.len();
        let model = self.layout.write_params(model, &self.params[..n])?;
        if self.config.average_bn { self.layout.write_running(model, &self.params[n..]) } else { Ok(model) }
    }
}

/// A round left unaveraged is lost work and leaves the workers with different models: say so, once.
impl Drop for Averager {
    fn drop(&mut self) {
        let pending = self.unsynced_steps();
        if pending == 0 || self.abandoned || std::thread::panicking() {
            return;
        }
        self.warn(&format!(
            "dropped {pending} step(s) after its last synchronization: the workers' models differ; call `Averager::finish(model)` after the last step, or set `AveragerConfig::run_steps`"
        ));
    }
}
