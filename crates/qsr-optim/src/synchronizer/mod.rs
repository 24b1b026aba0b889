//! The sync engine under both faces: what a synchronization is, written once. A [`Synchronizer`] owns
//! the collective (and a node's, for a two-level plan), the wire and its buckets, the outer step,
//! the streaming state (fragments, delays, error feedback, averages in flight) and the check of what
//! its collectives can carry (the settings themselves are judged by `settings.rs`'s `check_sync`). The
//! trainer's [`Worker`](crate::Worker) and the library's
//! [`Averager`](crate::Averager) keep only what their callers need around it: the Worker its replica
//! (qsr's optimizers over flat state) and the plan's cursor, the Averager the caller's burn model and
//! the rounds it decides from the caller's lr. A sync feature added here reaches both.

mod step;

use std::time::Instant;

use burn::module::Module;
use qsr_comm::{Collective, CommStats, SyncTag};
use qsr_sched::{StepInfo, StreamingConfig, SyncMode};

use crate::error::OptimError;
use crate::flat::ParamLayout;
use crate::outer::{InnerRound, Outer, OuterConfig};
use crate::settings::Face;
use crate::state::{Fingerprint, OuterState, SyncState};
use crate::stream::{Stream, StreamState, fragment_ranges};
use crate::sync::{
    DriverConfig, DriverStats, Level, StepEnd, SyncReport, Transfer, Wire, all_reduce_bucketed, check_wire,
};

pub(crate) use step::{StepState, StepTarget};

/// The sync engine: collectives, wire, outer step and streaming, with their checks.
pub(crate) struct Synchronizer {
    comm: Box<dyn Collective>,
    /// The node's collective, for the local averages of a two-level plan.
    local: Option<Box<dyn Collective>>,
    transfer: Transfer,
    face: Face,
    /// DiLoCo's outer optimizer; plain averaging as an outer step for a streaming or quantized sync
    /// without one.
    outer: Option<Outer>,
    /// Fragments, delayed application, quantized payloads.
    stream: Option<Stream>,
    /// The steps since the last global parameter sync and their summed lr.
    inner_round: InnerRound,
    /// Compare the parameters' fingerprint across ranks after each global parameter average.
    fingerprint: bool,
    /// The fingerprint of the last global average, sent with the next one.
    pending: Option<Fingerprint>,
    /// The buffer of a sync that carries a fingerprint (kept to reuse its allocation).
    scratch: Vec<f32>,
}

impl Synchronizer {
    /// Syncs over `comm` as `transfer` says; refused when the collective cannot carry its wire.
    pub(crate) fn new(comm: Box<dyn Collective>, transfer: Transfer, face: Face) -> Result<Self, OptimError> {
        check_wire(transfer.wire, comm.as_ref(), face.wire())?;
        Ok(Self {
            comm,
            local: None,
            transfer,
            face,
            outer: None,
            stream: None,
            inner_round: InnerRound::default(),
            fingerprint: false,
            pending: None,
            scratch: Vec::new(),
        })
    }

    /// Compares a fingerprint of the parameters across ranks after every global parameter average
    /// from now on: it rides at the end of the next global average's buffer ([`Fingerprint`]).
    pub(crate) fn set_fingerprint(&mut self, on: bool) {
        self.fingerprint = on;
    }

    /// The collective over every worker.
    pub(crate) fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }

    /// The collective over every worker, for calls outside a sync.
    pub(crate) fn comm_mut(&mut self) -> &mut dyn Collective {
        self.comm.as_mut()
    }

    /// The node's collective of a two-level plan.
    pub(crate) fn local(&self) -> Option<&dyn Collective> {
        self.local.as_deref()
    }

    /// Gives the node's collective; refused when it cannot carry the wire of a node's average.
    pub(crate) fn set_local(&mut self, local: Box<dyn Collective>) -> Result<(), OptimError> {
        check_wire(self.transfer.wire.at(Level::Local), local.as_ref(), self.face.wire())?;
        self.local = Some(local);
        Ok(())
    }

    /// Replaces the collective (an elastic job's next generation); returns the old one. Refused when
    /// the new one cannot carry the wire, for a two-level synchronizer (its node group would still
    /// span the old membership) and while averages are in flight.
    pub(crate) fn replace_comm(&mut self, comm: Box<dyn Collective>) -> Result<Box<dyn Collective>, OptimError> {
        check_wire(self.transfer.wire, comm.as_ref(), self.face.wire())?;
        if self.local.is_some() {
            return Err(OptimError::Config {
                field: "sync.local".into(),
                reason: "a two-level worker's node group would still span the old membership".into(),
            });
        }
        if let Some(stream) = &mut self.stream {
            // Its collective spans the old membership: the new one's comes with set_streaming_comm.
            stream.set_inline()?;
        }
        // A joining worker has none to send: the new membership starts without.
        self.pending = None;
        Ok(std::mem::replace(&mut self.comm, comm))
    }

    /// Makes parameter syncs DiLoCo's outer step from the global parameters `params` (settings checked
    /// by [`check_sync`](crate::check_sync)). Refused once averages are in flight.
    pub(crate) fn set_outer(&mut self, config: OuterConfig, params: &[f32]) -> Result<(), OptimError> {
        if let Some(stream) = &mut self.stream {
            // The outer state of the fragments restarts from the parameters now, with nothing in flight.
            if !stream.state()?.in_flight.is_empty() {
                return Err(OptimError::Config {
                    field: "outer".into(),
                    reason: "set it before the first step".into(),
                });
            }
        }
        self.outer = Some(Outer::new(config, params));
        Ok(())
    }

    /// Whether parameter syncs stream under the streaming setting `config`: with one, and on a
    /// quantized wire (which sends pseudo-gradients with error feedback) without one.
    pub(crate) fn streams_with(&self, config: Option<&StreamingConfig>) -> bool {
        config.is_some() || self.transfer.wire.codec().is_some()
    }

    /// The streaming syncs of `config` (the face's streaming setting, checked by
    /// [`check_sync`](crate::check_sync)), or the one fragment, applied at once, that a quantized wire
    /// needs without one; refused when the model has fewer tensors than fragments.
    pub(crate) fn prepare_streaming(
        &self,
        config: Option<StreamingConfig>,
        layout: &ParamLayout,
    ) -> Result<Stream, OptimError> {
        let config = config.unwrap_or(StreamingConfig { fragments: 1, delay: 0, mix: 1.0 });
        let ranges = fragment_ranges(layout, config.fragments)?;
        Ok(Stream::new(ranges, config, self.transfer, layout.len()))
    }

    /// Syncs through `stream` from now on; without an outer optimizer plain averaging becomes one
    /// (lr 1) from the global parameters `params`.
    pub(crate) fn start_streaming(&mut self, stream: Stream, params: &[f32]) {
        self.stream = Some(stream);
        if self.outer.is_none() {
            self.outer = Some(Outer::new(OuterConfig::averaging(), params));
        }
    }

    /// Runs the streaming fragments' all-reduces on `comm`, on a thread, while the face steps.
    pub(crate) fn set_streaming_comm(&mut self, comm: Box<dyn Collective>) -> Result<(), OptimError> {
        check_wire(self.transfer.wire, comm.as_ref(), self.face.wire())?;
        let (field, owner) = (self.face.streaming(), self.face.owner());
        let refuse = |reason: String| Err(OptimError::Config { field: field.into(), reason });
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        if comm.world_size() != world || comm.rank() != rank {
            let (theirs, of) = (comm.rank(), comm.world_size());
            return refuse(format!(
                "the streaming collective is rank {theirs} of {of}, the {owner}'s rank {rank} of {world}"
            ));
        }
        match &mut self.stream {
            Some(stream) => stream.set_background(comm),
            None => {
                refuse(format!("a streaming collective needs the {owner} to stream (`{field}`, or a quantized wire)"))
            }
        }
    }

    /// A step of a round that averages parameters, taken at `lr`: the per-step outer units count
    /// the round's steps and sum their lrs until the next global parameter sync.
    pub(crate) fn observe_step(&mut self, lr: f64) {
        self.inner_round.steps += 1;
        self.inner_round.lr_sum += lr;
    }

    /// The steps since the last global parameter sync and their summed lr (for a checkpoint).
    pub(crate) fn inner_round(&self) -> InnerRound {
        self.inner_round
    }

    /// Restores [`Self::inner_round`] (a checkpoint's).
    pub(crate) fn set_inner_round(&mut self, round: InnerRound) {
        self.inner_round = round;
    }

    /// The engine's state (a streaming one waits for its averages in flight): every rank at the
    /// same step.
    pub(crate) fn state(&mut self) -> Result<SyncState, OptimError> {
        let outer = self.outer_state().map(|(g, m)| OuterState { global: g.to_vec(), momentum: m.to_vec() });
        let (inner_round, fingerprint) = (self.inner_round, self.pending);
        Ok(SyncState { outer, stream: self.stream_state()?, inner_round, fingerprint })
    }

    /// The state a snapshot holds: the outer state and the inner round, and a stream as
    /// [`Self::forget_stream`] leaves it (nothing in flight, a zero residual).
    pub(crate) fn held_state(&self) -> SyncState {
        let outer = self.outer_state().map(|(g, m)| OuterState { global: g.to_vec(), momentum: m.to_vec() });
        let stream = self.stream.as_ref().map(Stream::forgotten);
        // A snapshot starts a membership of its own: no fingerprint rides with its first average.
        SyncState { outer, stream, inner_round: self.inner_round, fingerprint: None }
    }

    /// Continues from `state`; refused naming `field` when it does not fit this engine's settings
    /// (an outer state without an outer step, a streaming state without streaming, or the reverse).
    pub(crate) fn restore(&mut self, state: SyncState, field: &str) -> Result<(), OptimError> {
        let misfit = |what: &str| OptimError::Config {
            field: field.into(),
            reason: format!("the {what} state does not fit the config"),
        };
        match (self.has_outer(), &state.outer) {
            (true, Some(outer)) => self.restore_outer(&outer.global, &outer.momentum)?,
            (false, None) => {}
            _ => return Err(misfit("outer optimizer's")),
        }
        match (self.streams(), state.stream) {
            (true, Some(saved)) => self.restore_stream(saved)?,
            (false, None) => {}
            _ => return Err(misfit("streaming")),
        }
        self.inner_round = state.inner_round;
        self.pending = state.fingerprint.filter(|_| self.fingerprint);
        Ok(())
    }

    /// Whether parameter syncs stream (a streaming setting, or a quantized wire).
    pub(crate) fn streams(&self) -> bool {
        self.stream.is_some()
    }

    /// Whether parameter syncs are outer steps (DiLoCo's, or plain averaging written as one).
    pub(crate) fn has_outer(&self) -> bool {
        self.outer.is_some()
    }

    /// The outer optimizer's global parameters and momentum buffer.
    pub(crate) fn outer_state(&self) -> Option<(&[f32], &[f32])> {
        self.outer.as_ref().map(Outer::state)
    }

    /// Restores the outer state; refused naming `outer` without an outer optimizer.
    pub(crate) fn restore_outer(&mut self, global: &[f32], momentum: &[f32]) -> Result<(), OptimError> {
        Outer::restore_into(self.outer.as_mut(), global, momentum, self.face.owner())
    }

    /// The streaming state (averages in flight, waited for; the residual), if streaming.
    pub(crate) fn stream_state(&mut self) -> Result<Option<StreamState>, OptimError> {
        self.stream.as_mut().map(Stream::state).transpose()
    }

    /// Restores a streaming state; refused naming the streaming setting when not streaming.
    pub(crate) fn restore_stream(&mut self, state: StreamState) -> Result<(), OptimError> {
        match &mut self.stream {
            Some(stream) => stream.restore(state),
            None => Err(OptimError::Config {
                field: self.face.streaming().into(),
                reason: format!("this {} does not stream, so it has no streaming state", self.face.owner()),
            }),
        }
    }

    /// Drops the averages in flight and zeroes the residual (every rank at the same step).
    pub(crate) fn forget_stream(&mut self) {
        if let Some(stream) = &mut self.stream {
            stream.forget();
        }
    }

    /// The global parameters follow `params`: every worker took the same (data-parallel) update.
    pub(crate) fn follow(&mut self, params: &[f32]) {
        self.inner_round = InnerRound::default();
        if let Some(outer) = &mut self.outer {
            outer.follow(params);
        }
    }

    /// `model` with rank 0's parameters (and with `running` its BatchNorm statistics), as DDP starts;
    /// a failed broadcast is `fail`'s error.
    pub(crate) fn broadcast_initial<M: Module>(
        &mut self,
        model: M,
        layout: &ParamLayout,
        running: bool,
        fail: impl Fn(qsr_comm::CommError) -> OptimError,
    ) -> Result<M, OptimError> {
        let mut params = vec![0.0; layout.len()];
        layout.read_params(&model, &mut params)?;
        self.comm.broadcast(&mut params, 0).map_err(&fail)?;
        let mut model = model;
        if running && layout.running_len() > 0 {
            let mut stats = vec![0.0; layout.running_len()];
            layout.read_running(&model, &mut stats)?;
            self.comm.broadcast(&mut stats, 0).map_err(&fail)?;
            model = layout.write_running(model, &stats)?;
        }
        layout.write_params(model, &params)
    }

    /// A parameter sync of `buf`, whose first `n` values are the parameters (the rest appended
    /// state): at the global level with an outer optimizer the pseudo-gradients are averaged and the
    /// outer step taken; on the wire at `level`. With the fingerprint check, the fingerprint of the
    /// last global average rides at the end of this one's buffer. Returns the collective calls made.
    pub(crate) fn average(&mut self, buf: &mut [f32], n: usize, at: At, level: Level) -> Result<u64, OptimError> {
        let outer = self.outer.as_mut().filter(|_| level == Level::Global);
        if let Some(outer) = &outer {
            outer.pseudo_gradient(&mut buf[..n]);
        }
        let comm = comm_at(&mut self.comm, &mut self.local, level)?;
        let transfer = self.transfer.on(self.transfer.wire.at(level));
        let riding = if level == Level::Global { self.pending.take() } else { None };
        let fail = |source| OptimError::sync(at.step, at.tag, source);
        let calls = match &riding {
            // The last average's fingerprint at the end of this one's buffer, in the same call.
            Some(last) => {
                let scratch = &mut self.scratch;
                scratch.clear();
                scratch.extend_from_slice(buf);
                scratch.extend_from_slice(&last.carried());
                let calls = all_reduce_bucketed(comm, scratch, transfer, at.tag).map_err(fail)?;
                buf.copy_from_slice(&scratch[..buf.len()]);
                if !last.matches(&scratch[buf.len()..]) {
                    return Err(OptimError::ParametersDiffer { step: last.step() });
                }
                calls
            }
            None => all_reduce_bucketed(comm, buf, transfer, at.tag).map_err(fail)?,
        };
        if let Some(outer) = outer {
            // The mean pseudo-gradient becomes the new global parameters, the same on every rank.
            outer.step(&mut buf[..n], self.inner_round);
        }
        if level == Level::Global {
            self.inner_round = InnerRound::default();
            self.pending = self.fingerprint.then(|| Fingerprint::of(&buf[..n], at.step));
        }
        Ok(calls)
    }

    /// Mean all-reduce of `buf` in f32 at `level` (gradients, BatchNorm statistics); returns the calls.
    pub(crate) fn all_reduce(&mut self, buf: &mut [f32], at: At, level: Level) -> Result<u64, OptimError> {
        let comm = comm_at(&mut self.comm, &mut self.local, level)?;
        all_reduce_bucketed(comm, buf, self.transfer.on(Wire::F32), at.tag)
            .map_err(|source| OptimError::sync(at.step, at.tag, source))
    }

    /// The BatchNorm running statistics of `model` averaged over the workers at `level`, in f32, on
    /// their own.
    pub(crate) fn average_running<M: Module>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        at: At,
        level: Level,
    ) -> Result<Synced, OptimError> {
        let mut running = vec![0.0; layout.running_len()];
        layout.read_running(model, &mut running)?;
        let calls = self.all_reduce(&mut running, at, level)?;
        *model = layout.write_running(model.clone(), &running)?;
        Ok(Synced { mode: SyncMode::Parameters, elements: running.len(), calls })
    }

    /// A streaming step's syncs after `end.info` over the flat parameters `params`: the fragments
    /// due, the averages that land, at the run's end all of them, and at a round's end the BatchNorm
    /// statistics of `bn`'s model (`None`: they stay local), in f32 and on their own. Traffic is added
    /// to `totals`.
    pub(crate) fn end_streaming_step<M: Module>(
        &mut self,
        params: &mut [f32],
        bn: Option<(&mut M, &ParamLayout)>,
        end: StepEnd<'_>,
        totals: &mut CommStats,
    ) -> Result<StreamStep, OptimError> {
        let (Some(stream), Some(outer)) = (&mut self.stream, &mut self.outer) else {
            return Ok(StreamStep::default());
        };
        let (info, applied) = (end.info, stream.applied());
        let mut report = stream.after_step(params, end, outer, self.comm.as_mut(), totals)?;
        let landed = stream.applied() > applied;
        let ranks_equal = end.last || (landed && stream.leaves_ranks_equal());
        let round_end = info.sync_after && info.mode == SyncMode::Parameters;
        if let Some((model, layout)) = bn.filter(|(_, layout)| round_end && layout.running_len() > 0) {
            let start = self.start(Level::Global);
            let synced = self.average_running(model, layout, At::after(info.step, Some(info.h)), Level::Global)?;
            let bn = self.account(start, synced, totals);
            match &mut report {
                Some(s) => s.add(&bn),
                None => report = Some(bn),
            }
        }
        Ok(StreamStep { report, landed, ranks_equal })
    }

    /// Whether [`Self::end_streaming_step`] has parameters to sync after `info`.
    pub(crate) fn acts_after(&self, info: &StepInfo, last: bool) -> bool {
        self.stream.as_ref().is_some_and(|s| s.acts_after(info, last))
    }

    /// Applies the averages in flight, then averages all parameters in f32 and, with `bn`, the
    /// BatchNorm statistics of its model at `at`; traffic added to `totals`.
    pub(crate) fn settle<M: Module>(
        &mut self,
        params: &mut [f32],
        bn: Option<(&mut M, &ParamLayout)>,
        at: At,
        totals: &mut CommStats,
    ) -> Result<(), OptimError> {
        let (Some(stream), Some(outer)) = (&mut self.stream, &mut self.outer) else {
            return Ok(());
        };
        let traffic = stream.settle(params, at.step, true, outer, self.comm.as_mut())?;
        *totals = add(*totals, traffic.unwrap_or_default());
        if let Some((model, layout)) = bn.filter(|(_, layout)| layout.running_len() > 0) {
            let start = self.start(Level::Global);
            let synced = self.average_running(model, layout, at, Level::Global)?;
            self.account(start, synced, totals);
        }
        Ok(())
    }

    /// The counters of `level`'s collective and the clock, at the start of a sync.
    pub(crate) fn start(&self, level: Level) -> SyncStart {
        let comm = match level {
            Level::Local => self.local.as_deref().unwrap_or(self.comm.as_ref()),
            Level::Global => self.comm.as_ref(),
        };
        SyncStart { level, counters: *comm.stats(), clock: Instant::now() }
    }

    /// The sync since `start` that did `synced`, its traffic added to `totals`.
    pub(crate) fn account(&self, start: SyncStart, synced: Synced, totals: &mut CommStats) -> SyncReport {
        let now = self.start(start.level).counters;
        let mut delta = now.since(&start.counters);
        delta.seconds = start.clock.elapsed().as_secs_f64();
        *totals = add(*totals, delta);
        let Synced { mode, elements, calls } = synced;
        SyncReport { mode, level: start.level, elements, calls, bytes_sent: delta.bytes_sent, seconds: delta.seconds }
    }

    /// What a Worker's replica borrows for one step's syncs at `level`, in a round of `h` steps
    /// (`None`: calls outside the plan's syncs, untagged).
    pub(crate) fn peers<'a>(
        &'a mut self,
        level: Level,
        h: Option<u64>,
        config: &'a DriverConfig,
        stats: &'a mut DriverStats,
    ) -> Peers<'a> {
        Peers { sync: self, config, stats, level, h }
    }
}

/// Where a sync runs: the step as its face reports errors, and the tag compared across ranks
/// (`None` for calls outside the plan's syncs, such as statistics averaged before an evaluation).
#[derive(Debug, Clone, Copy)]
pub(crate) struct At {
    pub(crate) step: u64,
    pub(crate) tag: Option<SyncTag>,
}

impl At {
    /// The sync after the 0-based step `step`, in a round of `h` (`None`: untagged); errors name `step`.
    pub(crate) fn after(step: u64, h: Option<u64>) -> Self {
        Self { step, tag: h.map(|h| SyncTag::new(step + 1, h)) }
    }

    /// The sync after `steps` steps, in a round of `h`; errors name `steps` (as an Averager counts).
    pub(crate) fn after_steps(steps: u64, h: u64) -> Self {
        Self { step: steps, tag: Some(SyncTag::new(steps, h)) }
    }
}

/// What a streaming step's syncs did.
#[derive(Debug, Default)]
pub(crate) struct StreamStep {
    /// The syncs made (fragments sent, the run's last average, BatchNorm statistics).
    pub(crate) report: Option<SyncReport>,
    /// Whether an average landed in the parameters.
    pub(crate) landed: bool,
    /// Whether every rank now holds the same parameters (as after a plain average).
    pub(crate) ranks_equal: bool,
}

/// The counters of a level's collective and the clock when a sync starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncStart {
    level: Level,
    counters: CommStats,
    clock: Instant,
}

/// What a sync did: its kind, the elements it averaged and the collective calls it made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Synced {
    pub(crate) mode: SyncMode,
    pub(crate) elements: usize,
    pub(crate) calls: u64,
}

/// The collective of `level`: every worker's, or the node's.
fn comm_at<'a>(
    comm: &'a mut Box<dyn Collective>,
    local: &'a mut Option<Box<dyn Collective>>,
    level: Level,
) -> Result<&'a mut dyn Collective, OptimError> {
    match level {
        Level::Global => Ok(comm.as_mut()),
        Level::Local => match local {
            Some(local) => Ok(local.as_mut()),
            None => Err(OptimError::Config {
                field: "sync.local".into(),
                reason: "a two-level plan needs the node's collective (Worker::set_local)".into(),
            }),
        },
    }
}

/// `a + b`, counter by counter.
pub(crate) fn add(a: CommStats, b: CommStats) -> CommStats {
    CommStats {
        calls: a.calls + b.calls,
        bytes_sent: a.bytes_sent + b.bytes_sent,
        bytes_received: a.bytes_received + b.bytes_received,
        seconds: a.seconds + b.seconds,
    }
}

/// What a replica's step borrows from its [`Worker`](crate::Worker) beside the replica: the
/// synchronizer, the driver settings and the totals that syncs add to, at one level.
pub(crate) struct Peers<'a> {
    pub(crate) sync: &'a mut Synchronizer,
    pub(crate) config: &'a DriverConfig,
    pub(crate) stats: &'a mut DriverStats,
    /// Every worker's syncs or the node's; a device group serves the global level only.
    pub(crate) level: Level,
    /// The round's `H`, for the tags of its syncs; `None` for calls outside the plan's syncs.
    h: Option<u64>,
}

impl Peers<'_> {
    /// The collective's counters and the clock at the start of a sync.
    pub(crate) fn start(&self) -> SyncStart {
        self.sync.start(self.level)
    }

    /// Mean all-reduce of `buf` in f32 after the 0-based step `step`; returns the calls made.
    pub(crate) fn all_reduce(&mut self, buf: &mut [f32], step: u64) -> Result<u64, OptimError> {
        self.sync.all_reduce(buf, At::after(step, self.h), self.level)
    }

    /// A parameter sync of `buf` (parameters first, `n` of them) after the 0-based step `step`,
    /// with the outer step at the global level.
    pub(crate) fn average(&mut self, buf: &mut [f32], n: usize, step: u64) -> Result<u64, OptimError> {
        self.sync.average(buf, n, At::after(step, self.h), self.level)
    }

    /// Workers in the collective of this level.
    pub(crate) fn world_size(&self) -> usize {
        match self.level {
            Level::Local => self.sync.local().map_or(1, |c| c.world_size()),
            Level::Global => self.sync.comm().world_size(),
        }
    }

    /// The sync since `start` that did `synced`, added to this level's totals.
    pub(crate) fn account(&mut self, start: SyncStart, synced: Synced) -> SyncReport {
        let totals = match self.level {
            Level::Global => &mut self.stats.comm,
            Level::Local => &mut self.stats.local.comm,
        };
        self.sync.account(start, synced, totals)
    }

    /// A sync through a [`DeviceGroup`](crate::DeviceGroup) since `t`, added to the totals as the
    /// bytes a ring all-reduce of the same elements would move (as the in-process collective reports).
    pub(crate) fn account_group(&mut self, t: Instant, synced: Synced, fused: bool) -> SyncReport {
        let Synced { mode, elements, calls } = synced;
        let k = self.sync.comm().world_size() as u64;
        let bytes = qsr_sched::ring_allreduce_bytes_per_rank(elements as u64, qsr_sched::Encoding::F32, k);
        let seconds = t.elapsed().as_secs_f64();
        let delta = CommStats { calls, bytes_sent: bytes, bytes_received: bytes, seconds };
        self.stats.comm = add(self.stats.comm, delta);
        self.stats.fused_syncs += u64::from(fused);
        SyncReport { mode, level: Level::Global, elements, calls, bytes_sent: bytes, seconds }
    }

    /// The model's BatchNorm running statistics averaged over this level's workers as part of the
    /// sync after step `step`, accounted.
    pub(crate) fn average_running<M: Module>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        step: u64,
    ) -> Result<SyncReport, OptimError> {
        let start = self.start();
        let synced = self.sync.average_running(model, layout, At::after(step, self.h), self.level)?;
        Ok(self.account(start, synced))
    }
}

#[cfg(test)]
mod tests;
