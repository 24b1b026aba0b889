//! A worker's state at a synchronization, kept to abandon a round, and the hand-over of the newest
//! one to a new membership: what an elastic job (qsr-elastic's `Elastic`) needs from the driver.

use burn::module::Module;
use qsr_sched::Cursor;

use crate::{InFlight, OptimError, OptimState, StreamState, SyncState, Worker};

/// Everything a [`Worker`] continues from: flat parameters, BatchNorm running statistics, its own
/// optimizer state, its position in the plan and the sync engine's state. Taken after a completed
/// synchronization, it is the point a failed round goes back to. A streaming worker's averages in
/// flight and residual are not in it: they belong to the membership that sent them.
#[derive(Debug, Clone)]
pub struct Snapshot {
    params: Vec<f32>,
    running: Vec<f32>,
    optim: OptimState,
    cursor: Cursor,
    sync: SyncState,
}

impl Snapshot {
    /// Steps completed when it was taken.
    pub fn step(&self) -> u64 {
        self.cursor.step()
    }

    /// The flat parameters it holds.
    pub fn params(&self) -> &[f32] {
        &self.params
    }
}

impl<M: Module> Worker<M> {
    /// The worker's state now (downloaded when device-resident): one more copy of the parameters,
    /// the optimizer moments and the outer state.
    pub fn snapshot(&self) -> Result<Snapshot, OptimError> {
        let mut running = vec![0.0; self.layout().running_len()];
        self.layout().read_running(self.model(), &mut running)?;
        Ok(Snapshot {
            params: self.params()?.into_owned(),
            running,
            optim: self.optimizer_state()?.into_owned(),
            cursor: self.cursor().clone(),
            sync: self.held_sync_state(),
        })
    }

    /// [`Self::snapshot`] into `snap`'s buffers, which it reuses: no allocation and no page faults
    /// when a sync's snapshot replaces the previous one (a data-parallel run takes one every step).
    pub fn snapshot_into(&self, snap: &mut Snapshot) -> Result<(), OptimError> {
        refill(&mut snap.params, &self.params()?);
        snap.running.resize(self.layout().running_len(), 0.0);
        self.layout().read_running(self.model(), &mut snap.running)?;
        let optim = self.optimizer_state()?;
        snap.optim.step = optim.step;
        refill(&mut snap.optim.first_moment, &optim.first_moment);
        refill(&mut snap.optim.second_moment, &optim.second_moment);
        snap.cursor.clone_from(self.cursor());
        match (self.outer_state(), &mut snap.sync.outer) {
            // The outer buffers reused: a data-parallel step with an outer step snapshots every step.
            (Some((g, m)), Some(outer)) => {
                refill(&mut outer.global, g);
                refill(&mut outer.momentum, m);
                snap.sync.inner_round = self.inner_round();
            }
            _ => snap.sync = self.held_sync_state(),
        }
        Ok(())
    }

    /// Goes back to `snap` (its parameters, statistics, optimizer state, position and outer state).
    /// A streaming worker drops its averages in flight and its error-feedback residual: the global
    /// values stay those of `snap`, and each dropped fragment's next sync sends what it carried
    /// (its pseudo-gradient `global - local` holds the local steps since). Every rank restores alike.
    pub fn restore_snapshot(&mut self, snap: &Snapshot) -> Result<(), OptimError> {
        self.forget_stream();
        self.restore(&snap.params, snap.optim.clone(), snap.cursor.clone())?;
        self.restore_sync_state(snap.sync.clone())?;
        self.set_running(&snap.running)
    }

    /// Takes rank `source`'s parameters, BatchNorm statistics and outer state (broadcast over the
    /// collective; every rank calls it) and moves to `cursor`; the optimizer state stays this
    /// worker's own. This is how the ranks of a new membership continue from the newest
    /// synchronization one of them holds, and how a new worker gets the job's state (its optimizer
    /// state is then the fresh one it was built with). A streaming worker starts with nothing in
    /// flight and a zero residual, as [`Self::restore_snapshot`] leaves it.
    pub fn adopt(&mut self, source: usize, cursor: Cursor) -> Result<(), OptimError> {
        self.forget_stream();
        let step = cursor.step();
        let err = |source| OptimError::Comm { step, source };
        let mut params = self.params()?.into_owned();
        self.comm_mut().broadcast(&mut params, source).map_err(err)?;
        let mut running = vec![0.0; self.layout().running_len()];
        self.layout().read_running(self.model(), &mut running)?;
        if !running.is_empty() {
            self.comm_mut().broadcast(&mut running, source).map_err(err)?;
        }
        let outer = match self.outer_state().map(|(g, m)| (g.to_vec(), m.to_vec())) {
            Some((mut global, mut momentum)) => {
                self.comm_mut().broadcast(&mut global, source).map_err(err)?;
                self.comm_mut().broadcast(&mut momentum, source).map_err(err)?;
                Some((global, momentum))
            }
            None => None,
        };
        let optim = self.optimizer_state()?.into_owned();
        self.restore(&params, optim, cursor)?;
        if let Some((global, momentum)) = outer {
            self.restore_outer_state(&global, &momentum)?;
        }
        self.set_running(&running)
    }

    /// Gives every rank the averages in flight that rank `source` holds (`held`, its
    /// [`Self::streaming_state`], which waited for their means; what other ranks pass is ignored): an
    /// elastic generation that admits workers without a failure keeps the averages the old membership
    /// completed. Every rank of a streaming job calls it after [`Self::adopt`] (nothing in flight); a
    /// source holding none shares none.
    pub fn share_in_flight(&mut self, source: usize, held: Option<StreamState>) -> Result<(), OptimError> {
        let step = self.cursor().step();
        let err = |source| OptimError::Comm { step, source };
        let held = held.filter(|_| self.rank() == source).map(|s| s.in_flight).unwrap_or_default();
        let mut count = [held.len() as f32];
        self.comm_mut().broadcast(&mut count, source).map_err(err)?;
        // Checked on every rank, the source's too, so that all refuse together: at most one average
        // per fragment is ever in flight.
        let count = count[0];
        if !(count >= 0.0 && count <= qsr_sched::MAX_FRAGMENTS as f32 && count.fract() == 0.0) {
            return Err(OptimError::Layout(format!(
                "rank {source} shares {count} averages in flight; at most {} (one per fragment)",
                qsr_sched::MAX_FRAGMENTS
            )));
        }
        let mut in_flight = Vec::new();
        for i in 0..count as usize {
            let mine = held.get(i);
            let mut head = mine.map_or([0.0; 7], head_of);
            self.comm_mut().broadcast(&mut head, source).map_err(err)?;
            let [fragment, len, sent_len, sent_hi, sent_lo, apply_hi, apply_lo] = head.map(f32::to_bits);
            // Bounded by the model: a mean longer than all parameters is refused by the restore below.
            let most = self.layout().len();
            let bounded = |n: u32| (n as usize).min(most);
            let mut mean = mine.map_or_else(|| vec![0.0; bounded(len)], |f| f.mean.clone());
            self.comm_mut().broadcast(&mut mean, source).map_err(err)?;
            // Every rank now holds the source's parameters, so its sent values are everyone's.
            let mut sent = mine.map_or_else(|| vec![0.0; bounded(sent_len)], |f| f.sent.clone());
            self.comm_mut().broadcast(&mut sent, source).map_err(err)?;
            let (sent_after, apply_after) = (join(sent_hi, sent_lo), join(apply_hi, apply_lo));
            in_flight.push(InFlight { fragment, sent_after, apply_after, mean, sent });
        }
        if in_flight.is_empty() {
            return Ok(());
        }
        // After `adopt` the residual is zero on every rank, as a joining worker's is.
        let residual = self.streaming_state()?.and_then(|s| s.residual);
        self.restore_streaming_state(StreamState { in_flight, residual })
    }

    fn set_running(&mut self, running: &[f32]) -> Result<(), OptimError> {
        if running.is_empty() {
            return Ok(());
        }
        let model = self.layout().write_running(self.model().clone(), running)?;
        self.set_model(model)
    }
}

/// An average in flight's fragment, mean and sent lengths and steps as the bit patterns of 7 f32s (a
/// broadcast copies bits; steps need all 64 of theirs).
fn head_of(f: &InFlight) -> [f32; 7] {
    let hi = |x: u64| (x >> 32) as u32;
    let (sent, apply) = (f.sent_after, f.apply_after);
    let lens = [f.mean.len() as u32, f.sent.len() as u32];
    [f.fragment, lens[0], lens[1], hi(sent), sent as u32, hi(apply), apply as u32].map(f32::from_bits)
}

/// A step from the two halves [`head_of`] sent.
fn join(hi: u32, lo: u32) -> u64 {
    (u64::from(hi) << 32) | u64::from(lo)
}

/// `dst` made equal to `src`, in its own allocation when that is large enough.
fn refill(dst: &mut Vec<f32>, src: &[f32]) {
    dst.clear();
    dst.extend_from_slice(src);
}
