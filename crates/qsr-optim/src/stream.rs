//! Streaming synchronization: the parameters in fragments, each averaged on its own step of the round
//! (qsr-sched's [`FragmentPlan`]), its average applied `delay` steps later while the worker keeps
//! stepping, and the payload optionally quantized with error feedback.
//!
//! A fragment's sync sends the worker's pseudo-gradient `global - local` of the fragment (DiLoCo's
//! outer gradient; plain averaging is the outer step with lr 1), plus, on a quantized wire, what
//! earlier payloads dropped. The mean comes back bit-identical on every rank; `delay` steps after the
//! sync the outer step turns it into the fragment's new global values (the same on every rank). The
//! average lands as a correction that keeps the local steps taken while it was in flight (the
//! overlapped schemes of Overlap Local-SGD and DiLoCo's delayed outer gradients): with `sent` the
//! fragment's local values when it was sent, `corrected = global + (local - sent)`, and the local
//! fragment becomes `mix * corrected + (1 - mix) * local`. When and how much is applied depends on
//! the schedule alone, never on when the all-reduce finished: a run is the same bits with the
//! all-reduce in the background or between steps.
//!
//! Invariants:
//! - at most one average of a fragment is in flight: a fragment due to sync again while its last
//!   average waits applies that one first (only when `delay` reaches past the next round's sync), so
//!   the copies of sent values hold at most one parameter vector;
//! - the global values and outer momentum of every fragment are bit-identical on all ranks; with
//!   `mix = 1` and no step between send and landing (delay 0) so are the fragment's parameters;
//! - the run's last step settles every average in flight and (unless one fragment lands at once,
//!   replacing: [`StreamingConfig::ends_with_average`]) ends with an f32 average of all parameters,
//!   so every rank holds the same model at the end, as plain averaging leaves it.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use qsr_comm::{Collective, CommError, CommStats, SyncTag};
use qsr_sched::{StepInfo, StreamingConfig, SyncMode, fragments_syncing_after, split_tensors};
use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::flat::ParamLayout;
use crate::outer::Outer;
use crate::sync::{Level, StepEnd, SyncReport, Transfer, Wire, all_reduce_bucketed};

/// A fragment's average that has not been applied yet, as a checkpoint holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    /// The fragment, `0..fragments`.
    pub fragment: u32,
    /// The step after which the fragment was sent.
    pub sent_after: u64,
    /// The step after which the average is applied.
    pub apply_after: u64,
    /// The mean pseudo-gradient of the fragment's parameters (a checkpoint waits for it).
    pub mean: Vec<f32>,
    /// This worker's values of the fragment when it was sent: the landing keeps what the local steps
    /// changed since. Empty in a state saved before landings kept them (such an average lands as it
    /// was sent then, replacing the local values by `mix`).
    #[serde(default)]
    pub sent: Vec<f32>,
}

/// What a streaming worker holds beyond its parameters, optimizer and outer state: the averages in
/// flight and the error-feedback residual (on a quantized wire).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamState {
    /// Averages sent and not yet applied, in the order they were sent.
    pub in_flight: Vec<InFlight>,
    /// What quantization dropped from this worker's payloads so far, one value per parameter.
    pub residual: Option<Vec<f32>>,
}

/// An average sent and not yet applied; its mean arrives with the all-reduce (at once on the inline
/// lane, later on the background one).
struct Sent {
    fragment: u32,
    sent_after: u64,
    apply_after: u64,
    /// The fragment's local values when sent (see [`InFlight::sent`]).
    sent: Vec<f32>,
    mean: Option<Vec<f32>>,
}

/// A job of the background lane: the payload, and the step it belongs to (for errors).
struct Job {
    payload: Vec<f32>,
    step: u64,
    tag: SyncTag,
}

/// A finished job: the mean.
type Done = Result<Vec<f32>, OptimError>;

/// Where the fragments' all-reduces run.
enum Lane {
    /// On the worker's collective, between steps: the mean is ready at the sync and held until it
    /// is applied.
    Inline,
    /// On a collective of its own, on a thread: the all-reduce runs while the worker steps. `stale`
    /// counts the answers still due for averages [`Stream::forget`] dropped, to be skipped.
    Background {
        jobs: Option<mpsc::Sender<Job>>,
        done: mpsc::Receiver<Done>,
        thread: Option<JoinHandle<()>>,
        stale: usize,
    },
}

/// Each fragment's range of `layout`'s flat parameters: `fragments` contiguous groups of whole
/// tensors, balanced by size.
pub(crate) fn fragment_ranges(layout: &ParamLayout, fragments: u32) -> Result<Vec<Range<usize>>, OptimError> {
    let sizes: Vec<u64> = layout.trainable.iter().map(|e| e.range.len() as u64).collect();
    let tensors = split_tensors(&sizes, fragments)?;
    Ok(tensors.iter().map(|t| layout.trainable[t.start].range.start..layout.trainable[t.end - 1].range.end).collect())
}

/// The streaming state of a host-resident worker (or an `Averager`).
pub(crate) struct Stream {
    /// Each fragment's range of the flat parameters.
    ranges: Vec<Range<usize>>,
    config: StreamingConfig,
    transfer: Transfer,
    /// What quantization dropped, one value per parameter: on a quantized wire.
    residual: Option<Vec<f32>>,
    in_flight: VecDeque<Sent>,
    lane: Lane,
    /// Averages applied so far (a caller learns from it whether a step changed the parameters).
    applied: u64,
}

impl Stream {
    /// Streaming over `ranges.len()` fragments, fragment `p` holding the parameters `ranges[p]` of `len`.
    pub(crate) fn new(ranges: Vec<Range<usize>>, config: StreamingConfig, transfer: Transfer, len: usize) -> Self {
        let residual = transfer.wire.codec().map(|_| vec![0.0; len]);
        let (in_flight, lane) = (VecDeque::new(), Lane::Inline);
        Self { ranges, config, transfer, residual, in_flight, lane, applied: 0 }
    }

    /// Runs the fragments' all-reduces on `comm`, on a thread of their own, so they overlap the steps.
    /// `comm` holds the same ranks as the worker's collective (e.g. from [`qsr_comm::split`]) and
    /// every rank must give one; no average may be on its way (restored ones, with their means, may
    /// wait to be applied).
    pub(crate) fn set_background(&mut self, mut comm: Box<dyn Collective>) -> Result<(), OptimError> {
        // Restored averages hold their means; one still owed by the current lane would be lost.
        if self.in_flight.iter().any(|s| s.mean.is_none()) {
            return Err(OptimError::Config {
                field: "sync.streaming".into(),
                reason: "a background collective must be given while no average is on its way".into(),
            });
        }
        let transfer = self.transfer;
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, done) = mpsc::channel::<Done>();
        let thread = std::thread::Builder::new()
            .name("qsr-stream".into())
            .spawn(move || {
                for mut job in inbox {
                    let res = all_reduce_bucketed(comm.as_mut(), &mut job.payload, transfer, Some(job.tag))
                        .map(|_| job.payload)
                        .map_err(|source| OptimError::sync(job.step, Some(job.tag), source));
                    let failed = res.is_err();
                    if outbox.send(res).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| OptimError::Config { field: "sync.streaming".into(), reason: format!("no thread: {e}") })?;
        // A lane replaced here is detached, not joined: its thread ends once its queue is drained or
        // its collective fails (an old membership's, when a peer was lost).
        self.lane = Lane::Background { jobs: Some(jobs), done, thread: Some(thread), stale: 0 };
        Ok(())
    }

    /// Runs the all-reduces between steps on the worker's collective again (before the worker's
    /// collective is replaced); nothing may be in flight. A background lane is detached.
    pub(crate) fn set_inline(&mut self) -> Result<(), OptimError> {
        if !self.in_flight.is_empty() {
            return Err(OptimError::Config {
                field: "sync.streaming".into(),
                reason: "averages are in flight on the streaming collective (restore a snapshot first)".into(),
            });
        }
        self.lane = Lane::Inline;
        Ok(())
    }

    /// Drops the averages in flight and zeroes the error-feedback residual: a worker going back to a
    /// snapshot, or taking another rank's state. The dropped fragments sync again at their next
    /// boundary, and their pseudo-gradient `global - local` then carries what the dropped ones did;
    /// the residual's rounding of earlier payloads is lost. Every rank must forget at the same step.
    /// The state [`Self::forget`] leaves: nothing in flight, a zero residual.
    pub(crate) fn forgotten(&self) -> StreamState {
        StreamState { in_flight: Vec::new(), residual: self.residual.as_ref().map(|r| vec![0.0; r.len()]) }
    }

    pub(crate) fn forget(&mut self) {
        let pending = self.in_flight.iter().filter(|s| s.mean.is_none()).count();
        if let Lane::Background { stale, .. } = &mut self.lane {
            *stale += pending;
        }
        self.in_flight.clear();
        if let Some(r) = &mut self.residual {
            r.fill(0.0);
        }
    }

    /// After step `end.info`'s update of `params`: applies the averages due after it, starts the
    /// fragments that sync after it, and on the run's last step (`end.last`) settles everything and
    /// averages all parameters in f32. Returns the step's report, if it sent anything; its traffic
    /// is added to `stats` (seconds: the time the worker spent here, waiting included).
    pub(crate) fn after_step(
        &mut self,
        params: &mut [f32],
        end: StepEnd<'_>,
        outer: &mut Outer,
        comm: &mut dyn Collective,
        stats: &mut CommStats,
    ) -> Result<Option<SyncReport>, OptimError> {
        let (info, last) = (end.info, end.last);
        let t = Instant::now();
        let mut sent = Vec::new();
        let mut traffic = CommStats::default();
        while self.in_flight.front().is_some_and(|f| f.apply_after <= info.step) {
            self.apply_front(params, outer)?;
        }
        if info.mode == SyncMode::Parameters {
            let due: Vec<u32> = fragments_syncing_after(self.ranges.len() as u32, info).collect();
            for fragment in due {
                if let Some(i) = self.in_flight.iter().position(|f| f.fragment == fragment) {
                    // Its previous average is still out (delay beyond the round): apply it first.
                    for _ in 0..=i {
                        self.apply_front(params, outer)?;
                    }
                }
                traffic = add(traffic, self.send(fragment, params, info, outer, comm)?);
                sent.push(self.ranges[fragment as usize].len());
            }
        }
        // A delay of 0 (a quantized wire without streaming) applies what it just sent.
        while self.in_flight.front().is_some_and(|f| f.apply_after <= info.step) {
            self.apply_front(params, outer)?;
        }
        if last {
            // One fragment replaced in the round's (and run's) last step leaves every rank the same.
            let average = self.config.ends_with_average();
            if let Some(t) = self.settle(params, info.step, average, outer, comm)? {
                traffic = add(traffic, t);
                sent.push(params.len());
            }
        }
        let seconds = t.elapsed().as_secs_f64();
        *stats = add(*stats, CommStats { seconds, ..traffic });
        Ok((!sent.is_empty()).then(|| SyncReport {
            mode: SyncMode::Parameters,
            level: Level::Global,
            elements: sent.iter().sum(),
            calls: traffic.calls,
            bytes_sent: traffic.bytes_sent,
            seconds,
        }))
    }

    /// Applies every average in flight, then (with `average`) averages all parameters in f32, which
    /// become the global values; returns the traffic of that average. Every rank at the same step.
    pub(crate) fn settle(
        &mut self,
        params: &mut [f32],
        step: u64,
        average: bool,
        outer: &mut Outer,
        comm: &mut dyn Collective,
    ) -> Result<Option<CommStats>, OptimError> {
        while !self.in_flight.is_empty() {
            self.apply_front(params, outer)?;
        }
        average.then(|| self.average_all(params, step, outer, comm)).transpose()
    }

    /// Averages applied so far.
    pub(crate) fn applied(&self) -> u64 {
        self.applied
    }

    /// Whether applying leaves every rank the same parameters: one fragment, replaced (mix 1) in the
    /// step that sent it (no local step to keep), and nothing else in flight.
    pub(crate) fn leaves_ranks_equal(&self) -> bool {
        !self.config.ends_with_average() && self.in_flight.is_empty()
    }

    /// Whether [`Self::after_step`] has anything to do after `info` (an average to apply, a fragment
    /// to send, or the run's end): a caller that keeps no flat copy reads its parameters only then.
    pub(crate) fn acts_after(&self, info: &StepInfo, last: bool) -> bool {
        let applies = self.in_flight.front().is_some_and(|f| f.apply_after <= info.step);
        last || applies || fragments_syncing_after(self.ranges.len() as u32, info).next().is_some()
    }

    /// Sends `fragment`'s pseudo-gradient after step `info` (with error feedback on a quantized wire).
    fn send(
        &mut self,
        fragment: u32,
        params: &[f32],
        info: &StepInfo,
        outer: &Outer,
        comm: &mut dyn Collective,
    ) -> Result<CommStats, OptimError> {
        let step = info.step;
        let tag = SyncTag::new(step + 1, info.h).fragment(fragment + 1);
        let range = self.ranges[fragment as usize].clone();
        let mut payload = vec![0.0; range.len()];
        outer.pseudo_gradient_of(range.start, params, &mut payload);
        if let (Some(codec), Some(residual)) = (self.transfer.wire.codec(), &mut self.residual) {
            // Error feedback: this payload carries what earlier ones dropped and keeps what it drops.
            let residual = &mut residual[range.clone()];
            residual.iter_mut().zip(&payload).for_each(|(r, p)| *r += p);
            payload.copy_from_slice(residual);
            // Blocks as the all-reduce forms them: from the start of each bucket.
            let bucket = self.transfer.bucket.filter(|&b| b > 0).unwrap_or(payload.len().max(1));
            payload.chunks_mut(bucket).for_each(|chunk| codec.round_block(chunk));
            residual.iter_mut().zip(&payload).for_each(|(r, q)| *r -= q);
        }
        let apply_after = step.saturating_add(self.config.delay);
        let sent = params[range.clone()].to_vec();
        let mut entry = Sent { fragment, sent_after: step, apply_after, sent, mean: None };
        let predicted = self.predicted(range.len(), comm.world_size());
        let traffic = match &mut self.lane {
            Lane::Inline => {
                let before = *comm.stats();
                all_reduce_bucketed(comm, &mut payload, self.transfer, Some(tag))
                    .map_err(|source| OptimError::sync(step, Some(tag), source))?;
                entry.mean = Some(payload);
                comm.stats().since(&before)
            }
            Lane::Background { jobs, .. } => {
                let sent = jobs.as_ref().is_some_and(|j| j.send(Job { payload, step, tag }).is_ok());
                if !sent {
                    return Err(lane_failed(step));
                }
                // Counted when sent, as a ring all-reduce of the payload moves it (the in-process
                // group's own count), so a checkpoint with it in flight has counted it already.
                predicted
            }
        };
        self.in_flight.push_back(entry);
        Ok(traffic)
    }

    /// The calls and bytes of a ring all-reduce of `len` values on this wire over `k` ranks.
    fn predicted(&self, len: usize, k: usize) -> CommStats {
        let bucket = self.transfer.bucket.filter(|&b| b > 0 && b < len).unwrap_or(len.max(1));
        let (full, rest) = (len / bucket, len % bucket);
        let ring =
            |n: usize| qsr_sched::ring_allreduce_bytes_per_rank(n as u64, self.transfer.wire.encoding(), k as u64);
        let bytes = full as u64 * ring(bucket) + ring(rest);
        let calls = (full + usize::from(rest > 0)).max(1) as u64;
        CommStats { calls, bytes_sent: bytes, bytes_received: bytes, seconds: 0.0 }
    }

    /// Applies the oldest average in flight (waiting for it on the background lane).
    fn apply_front(&mut self, params: &mut [f32], outer: &mut Outer) -> Result<(), OptimError> {
        self.receive(1)?;
        let Some(entry) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let Some(mut mean) = entry.mean else {
            return Err(lane_failed(entry.sent_after));
        };
        let range = self.ranges[entry.fragment as usize].clone();
        outer.step_at(range.start, &mut mean);
        self.applied += 1;
        land(&mut params[range], &mean, &entry.sent, self.config.mix as f32);
        Ok(())
    }

    /// Waits until the first `n` averages in flight have their means: the background lane answers
    /// its jobs in the order they were sent, so the ones without are the queue's last.
    fn receive(&mut self, n: usize) -> Result<(), OptimError> {
        while let Some(i) = self.in_flight.iter().take(n).position(|s| s.mean.is_none()) {
            let step = self.in_flight[i].sent_after;
            // The inline lane has every mean at once; only a background lane leaves one to wait for.
            let Lane::Background { done, stale, .. } = &mut self.lane else {
                return Err(lane_failed(step));
            };
            // Answers for forgotten averages come first, in the order their jobs were sent.
            while *stale > 0 {
                done.recv().map_err(|_| lane_failed(step))?.map_err(|_| lane_failed(step))?;
                *stale -= 1;
            }
            match done.recv() {
                Ok(Ok(mean)) => self.in_flight[i].mean = Some(mean),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(lane_failed(step)),
            }
        }
        Ok(())
    }

    /// Every rank's parameters averaged in f32, which become the global values: the run's end.
    fn average_all(
        &mut self,
        params: &mut [f32],
        step: u64,
        outer: &mut Outer,
        comm: &mut dyn Collective,
    ) -> Result<CommStats, OptimError> {
        let before = *comm.stats();
        all_reduce_bucketed(comm, params, self.transfer.on(Wire::F32), None)
            .map_err(|source| OptimError::Comm { step, source })?;
        outer.follow(params);
        Ok(comm.stats().since(&before))
    }

    /// The averages in flight (waiting for every one of them) and the residual, for a checkpoint.
    pub(crate) fn state(&mut self) -> Result<StreamState, OptimError> {
        self.receive(self.in_flight.len())?;
        let in_flight = self
            .in_flight
            .iter()
            .map(|s| InFlight {
                fragment: s.fragment,
                sent_after: s.sent_after,
                apply_after: s.apply_after,
                mean: s.mean.clone().unwrap_or_default(),
                sent: s.sent.clone(),
            })
            .collect();
        Ok(StreamState { in_flight, residual: self.residual.clone() })
    }

    /// Restores a checkpoint's state (before any step of this worker).
    pub(crate) fn restore(&mut self, state: StreamState) -> Result<(), OptimError> {
        let bad = |reason: String| OptimError::Layout(format!("streaming state: {reason}"));
        if !self.in_flight.is_empty() {
            // A background lane would still answer for the averages in flight now.
            return Err(bad("restored into a worker with averages in flight (restore before the first step)".into()));
        }
        let len = |r: &Option<Vec<f32>>| r.as_ref().map(Vec::len);
        if len(&state.residual) != len(&self.residual) {
            let said = |r| len(r).map_or("none".to_string(), |n| format!("{n} values"));
            return Err(bad(format!("residual: {}, expected {}", said(&state.residual), said(&self.residual))));
        }
        for f in &state.in_flight {
            let Some(range) = self.ranges.get(f.fragment as usize) else {
                return Err(bad(format!("fragment {} of {}", f.fragment, self.ranges.len())));
            };
            if f.mean.len() != range.len() || !(f.sent.is_empty() || f.sent.len() == range.len()) {
                return Err(bad(format!(
                    "fragment {} holds {} values ({} sent), expected {}",
                    f.fragment,
                    f.mean.len(),
                    f.sent.len(),
                    range.len()
                )));
            }
        }
        self.residual = state.residual;
        self.in_flight = state
            .in_flight
            .into_iter()
            .map(|f| Sent {
                fragment: f.fragment,
                sent_after: f.sent_after,
                apply_after: f.apply_after,
                sent: f.sent,
                mean: Some(f.mean),
            })
            .collect();
        Ok(())
    }
}

/// Lands a fragment's new global values `global` on its local values `local`, which were `sent` when
/// its average left: `corrected = global + (local - sent)` keeps the local steps taken since, and
/// `local` becomes `mix * corrected + (1 - mix) * local`. A value no step changed lands as `global`
/// exactly (a delay of 0 leaves every rank the same bits); an empty `sent` (a state saved before
/// corrections) lands `global` itself.
fn land(local: &mut [f32], global: &[f32], sent: &[f32], mix: f32) {
    let corrected = |l: f32, g: f32, s: Option<&f32>| match s {
        Some(&s) if l != s => g + (l - s),
        _ => g,
    };
    let sent = sent.iter().map(Some).chain(std::iter::repeat(None));
    for ((l, &g), s) in local.iter_mut().zip(global).zip(sent) {
        let c = corrected(*l, g, s);
        *l = if mix == 1.0 { c } else { mix * c + (1.0 - mix) * *l };
    }
}

/// The error of a background lane whose thread is gone (after its collective failed).
fn lane_failed(step: u64) -> OptimError {
    let detail = "the streaming collective's thread stopped after an earlier failure".to_string();
    OptimError::Comm { step, source: CommError::Broken(detail) }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Lane::Background { jobs, thread, .. } = &mut self.lane {
            jobs.take(); // the thread's loop ends once its queue is closed and drained
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// `a` and `b` together (calls, bytes and seconds summed).
fn add(a: CommStats, b: CommStats) -> CommStats {
    CommStats {
        calls: a.calls + b.calls,
        bytes_sent: a.bytes_sent + b.bytes_sent,
        bytes_received: a.bytes_received + b.bytes_received,
        seconds: a.seconds + b.seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::land;

    /// A landing keeps what the local steps changed since the send: `global + (local - sent)`, and
    /// a value no step changed lands as the global bits themselves.
    #[test]
    fn a_landing_keeps_the_local_steps_since_the_send() {
        let (global, sent) = ([1.0, -0.0, 0.25], [0.5, 3.0, 0.75]);
        let mut local = [0.75, 3.0, 1.0];
        land(&mut local, &global, &sent, 1.0);
        assert_eq!(local.map(f32::to_bits), [1.25f32, -0.0, 0.5].map(f32::to_bits));
        // mix blends the corrected values with the local ones.
        let mut local = [0.75, 3.0, 1.0];
        land(&mut local, &global, &sent, 0.5);
        assert_eq!(local, [1.0, 1.5, 0.75]);
        // A state saved before corrections (no sent values) lands the global values.
        let mut local = [0.75, 3.0, 1.0];
        land(&mut local, &global, &[], 1.0);
        assert_eq!(local, global);
    }
}
