//! One process's part of a run: records, evaluations, divergence and checkpoints around the steps.

use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::Module;
use qsr_optim::{StepReport, Worker};
use qsr_sched::{Cursor, Plan, SyncMode};

use super::outcome::{Chance, Meeting, averaging_lost, untrained};
use super::spec::RunSpec;
use super::task::{Eval, Task};
use crate::checkpoint::{self, CheckpointState, Counters};
use crate::exit::CheckpointAbandoned;
use crate::records::{Fit, LocalLevel, Metrics, Record, Summary, membership_changes};

/// The plan and the length of an epoch: what records and evaluation cadence are reckoned in.
pub(crate) struct Pace {
    pub(crate) plan: Plan,
    /// Steps per epoch of this rank's data (of the recipe's world in an elastic run).
    pub(crate) spe: usize,
}

impl Pace {
    /// Epochs completed after `steps` steps (fractional).
    pub(crate) fn epoch(&self, steps: u64) -> f64 {
        steps as f64 / self.spe as f64
    }
}

/// Whether the run goes on after a sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterSync {
    Continue,
    /// `halt_after` was reached before the end of the plan.
    Halt,
    /// The evaluation saw the run diverge: it stops (every rank saw the same evaluation).
    Diverged,
    /// A signal (its number) stopped the run here, after a checkpoint ([`super::interrupt`]).
    Interrupted(i32),
}

/// Steps between two checks of a signal at the syncs (every sync of rounds this long or longer):
/// the workers of a threaded run stop within this many steps of a signal, or one round.
const SIGNAL_CHECK_STEPS: u64 = 16;

/// This process's part of the run (all of it, or what follows a resume): rank 0's metrics file and
/// progress bar, and what the next records need.
pub(crate) struct Segment {
    metrics: Option<Metrics>,
    bar: Option<indicatif::ProgressBar>,
    /// The counters of the checkpoint resumed from (zero for a fresh run).
    base: Counters,
    t0: Instant,
    first_step: u64,
    /// The training losses since the previous sync record.
    since_sync: Interval,
    last_eval: Option<Eval>,
    /// The records of the last global sync (rank 0 wrote them; every rank keeps them, for a new
    /// generation's rank 0 to restore those its predecessor died before writing).
    held: Vec<Record>,
    /// The training losses of the last sync interval.
    last_interval: Interval,
    /// Whether the last evaluation's loss was above the divergence limit.
    above_limit: bool,
    /// Why the run diverged, once it did.
    diverged: Option<crate::exit::Diverged>,
    /// Why the run did not train, when its final evaluation was no better than chance.
    not_trained: Option<crate::exit::NotTrained>,
    /// The workers' own models evaluated one step before the run's last average.
    workers_before: Option<Eval>,
    /// The step at which the workers last checked for a signal together.
    signal_checked: u64,
}

/// The training losses of the steps since a sync: a non-finite loss (an update skipped for it) is
/// counted apart, so that one does not make the interval's mean meaningless.
#[derive(Debug, Clone, Copy, Default)]
struct Interval {
    sum: f64,
    finite: u64,
    non_finite: u64,
}

impl Interval {
    fn add(&mut self, loss: f32) {
        if loss.is_finite() {
            self.sum += f64::from(loss);
            self.finite += 1;
        } else {
            self.non_finite += 1;
        }
    }

    /// The mean of the finite losses; NaN when every loss of the interval was not finite.
    fn mean(&self) -> f64 {
        if self.finite == 0 && self.non_finite > 0 { f64::NAN } else { self.sum / self.finite.max(1) as f64 }
    }
}

impl Segment {
    /// Opens rank 0's metrics (cut back to `start_records` on resume) and progress bar, then starts the clock.
    pub(crate) fn start(
        spec: &RunSpec,
        rank: usize,
        end: u64,
        first_step: u64,
        start_records: Option<u64>,
        base: Counters,
    ) -> Result<Self> {
        let metrics = if rank == 0 {
            // No other rank writes yet: what a killed commit left behind is rank 0's to clear.
            checkpoint::sweep(&spec.run_dir)?;
            Some(Metrics::open(&spec.run_dir, start_records)?)
        } else {
            None
        };
        let bar = (rank == 0 && spec.progress).then(|| progress_bar(end, first_step));
        let t0 = Instant::now();
        Ok(Segment {
            metrics,
            bar,
            base,
            t0,
            first_step,
            since_sync: Interval::default(),
            last_eval: None,
            held: Vec::new(),
            last_interval: Interval::default(),
            above_limit: false,
            diverged: None,
            not_trained: None,
            workers_before: None,
            signal_checked: first_step,
        })
    }

    /// Continues the counters from `base` (a new membership's, taken over from its source rank), with
    /// this worker's totals restarted. Rank 0 clears checkpoints its predecessor left half-written,
    /// (re)opens `metrics.jsonl` dropping records past `change.step`, restores the `handed` records of
    /// that sync the file lacks (its predecessor may have died before writing them), and appends
    /// `change`.
    pub(crate) fn rebase<M: Module>(
        &mut self,
        spec: &RunSpec,
        worker: &mut Worker<M>,
        base: Counters,
        handed: &[Record],
        change: Record,
    ) -> Result<()> {
        self.base = base;
        self.t0 = Instant::now();
        worker.take_stats();
        self.since_sync = Interval::default();
        self.metrics = None;
        if worker.rank() == 0 {
            checkpoint::sweep(&spec.run_dir)?;
            let mut m = Metrics::open(&spec.run_dir, Some(change.step))?;
            m.restore(&spec.run_dir, handed.iter().filter(|r| r.step == change.step))?;
            m.write(&change)?;
            self.metrics = Some(m);
        }
        Ok(())
    }

    /// Appends `record` to rank 0's `metrics.jsonl` (a membership change at a resume).
    pub(crate) fn append(&mut self, record: &Record) -> Result<()> {
        if let Some(m) = self.metrics.as_mut() {
            m.write(record)?;
        }
        Ok(())
    }

    /// The records of the last global sync (written by rank 0; kept by every rank).
    pub(crate) fn sync_records(&self) -> &[Record] {
        &self.held
    }

    /// The run's divergence, if this rank saw one (every rank at an evaluation; rank 0 for its
    /// training loss), as the error the run ends with.
    pub(crate) fn check_diverged(&mut self, rank: usize) -> Result<()> {
        if let Some(d) = self.diverged.take() {
            return Err(anyhow::Error::new(d).context(format!("rank {rank}")));
        }
        match self.not_trained.take() {
            Some(n) => Err(anyhow::Error::new(n).context(format!("rank {rank}"))),
            None => Ok(()),
        }
    }

    /// Before the run's last step, when it ends a round of local steps: evaluates the workers' own
    /// models (every rank its shard, as the final evaluation), to be set beside their average's.
    pub(crate) fn before_last_average<T: Task>(&mut self, task: &T, worker: &mut Worker<T::Module>) -> Result<()> {
        let round = worker.cursor().round();
        let last = worker.cursor().step() + 1 == worker.cursor().plan().end_step();
        if last && round.mode == SyncMode::Parameters && round.len > 1 && worker.world_size() > 1 {
            self.workers_before = Some(task.evaluate(worker)?);
        }
        Ok(())
    }

    /// The run's counters now.
    pub(crate) fn counters<M: Module>(&self, worker: &Worker<M>) -> Counters {
        counters(&self.base, worker.stats(), self.t0)
    }

    /// A record, given the counters now: rank 0 appends it to `metrics.jsonl`, every rank keeps it
    /// among the sync's records.
    fn write<M: Module>(&mut self, worker: &Worker<M>, record: impl FnOnce(Counters) -> Record) -> Result<()> {
        let r = record(counters(&self.base, worker.stats(), self.t0));
        if let Some(m) = self.metrics.as_mut() {
            m.write(&r)?;
        }
        self.held.push(r);
        Ok(())
    }

    /// Counts a step's loss towards the next sync record and moves the progress bar.
    pub(crate) fn stepped<M: Module>(&mut self, worker: &Worker<M>, report: &StepReport, pace: &Pace) {
        self.since_sync.add(report.loss);
        let Some(bar) = &self.bar else {
            return;
        };
        let done_steps = report.info.step + 1;
        bar.set_position(done_steps);
        // The message every 10 steps and at syncs: often enough to watch, rarely enough to cost nothing.
        if report.sync.is_some() || done_steps.is_multiple_of(10) {
            let syncs = worker.stats().syncs;
            bar.set_message(format!(
                "epoch {:.2} lr {:.2e} H {} loss {:.3} comm {:.1}%",
                pace.epoch(done_steps),
                report.info.lr,
                report.info.h,
                report.loss,
                100.0 * syncs as f64 / done_steps as f64
            ));
        }
    }

    /// After a sync: rank 0's sync record; then, when an evaluation is due, BN re-estimation, the
    /// evaluation (collectives on every rank, so every rank decides alike), its record and line, the
    /// checkpoint, and whether `halt_after` stops the run here.
    pub(crate) fn synced<T: Task>(
        &mut self,
        spec: &RunSpec,
        pace: &Pace,
        task: &T,
        worker: &mut Worker<T::Module>,
        report: &StepReport,
    ) -> Result<AfterSync> {
        let recipe = &spec.recipe;
        let done_steps = report.info.step + 1;
        crate::fault::at(worker.rank(), crate::fault::Point::Synced(done_steps));
        let loss = self.since_sync.mean();
        self.last_interval = std::mem::take(&mut self.since_sync);
        self.held.clear();
        self.write(worker, |c| record("sync", report, pace, loss, None, c))?;
        let is_end = worker.cursor().is_done();
        let due = match recipe.eval.every_steps {
            Some(period) => eval_due_every(worker.cursor(), done_steps, period),
            None => eval_due(worker.cursor(), done_steps, pace.spe, recipe.eval.every_epochs as u64),
        };
        if let Some(signal) = self.signal_agreed(worker, done_steps, due || is_end)? {
            if recipe.checkpoint.enabled {
                save_checkpoint(worker, spec, done_steps, self.counters(worker))?;
            }
            return Ok(AfterSync::Interrupted(signal));
        }
        if !due {
            return Ok(AfterSync::Continue);
        }
        task.prepare_eval(worker, done_steps)?;
        let ev = task.evaluate(worker)?;
        let train = ev.train;
        self.write(worker, |c| Record { train, ..record("eval", report, pace, ev.loss, Some(ev.accuracy), c) })?;
        if let Some(bar) = &self.bar {
            bar.println(format!("step {done_steps:>7}  epoch {:>6.2}  {}", pace.epoch(done_steps), task.describe(&ev)));
        }
        let limit = recipe.eval.divergence_factor * task.chance_loss();
        self.diverged = judge(&mut self.above_limit, ev.loss, limit, done_steps, is_end);
        if is_end && self.diverged.is_none() {
            let chance = Chance { loss: task.chance_loss(), accuracy: task.chance_accuracy() };
            self.not_trained = untrained(&ev, chance, Meeting::of(&recipe.sync.rule));
            let lost = self.workers_before.as_ref().and_then(|b| averaging_lost(b, &ev, task.chance_accuracy()));
            if let (Some(w), 0) = (lost, worker.rank()) {
                eprintln!("qsr: warning: {w}");
            }
        }
        self.last_eval = Some(ev);
        if self.diverged.is_some() {
            return Ok(AfterSync::Diverged);
        }
        // A state above the limit is not checkpointed: the kept checkpoint precedes the excursion.
        if recipe.checkpoint.enabled && !self.above_limit {
            let c = self.counters(worker);
            save_checkpoint(worker, spec, done_steps, c)?;
        }
        let halt = spec.halt_after.is_some_and(|h| done_steps >= h) && !is_end;
        Ok(if halt { AfterSync::Halt } else { AfterSync::Continue })
    }

    /// Whether a signal stops the run at the sync after `done_steps`: in a process whose handlers are
    /// armed (a threaded run), every worker asks at the same syncs (at least [`SIGNAL_CHECK_STEPS`]
    /// apart, and at every evaluation, `always`) whether any received one: a 4-byte all-reduce.
    fn signal_agreed<M: burn::module::Module>(
        &mut self,
        worker: &mut Worker<M>,
        done_steps: u64,
        always: bool,
    ) -> Result<Option<i32>> {
        if !super::interrupt::armed() || !(always || done_steps >= self.signal_checked + SIGNAL_CHECK_STEPS) {
            return Ok(None);
        }
        self.signal_checked = done_steps;
        let mut seen = super::interrupt::one_hot(super::interrupt::received());
        worker.comm_mut().all_reduce(&mut seen, qsr_comm::ReduceOp::Sum).context("while checking for a signal")?;
        // A rank the launcher's forwarded signal has not reached yet stops for the others' signal.
        Ok(super::interrupt::agreed(&seen))
    }

    /// Clears the progress bar; on rank 0 of a finished run that evaluated, writes `summary.json` and
    /// returns the summary.
    pub(crate) fn finish<T: Task>(
        &mut self,
        spec: &RunSpec,
        pace: &Pace,
        task: &T,
        worker: &Worker<T::Module>,
        finished: bool,
    ) -> Result<Option<Summary>> {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        let wall = self.t0.elapsed().as_secs_f64();
        let c = self.counters(worker);
        if worker.rank() == 0 && self.diverged.is_none() && !self.last_interval.mean().is_finite() {
            let why = format!(
                "the training loss of every step of its last synchronization interval ({}) was not finite (summary.json counts {} skipped updates)",
                self.last_interval.non_finite, c.skipped_updates
            );
            self.diverged = Some(crate::exit::Diverged { step: Some(pace.plan.end_step()), why });
        }
        if worker.rank() == 0 && c.skipped_updates > 0 {
            eprintln!(
                "qsr: warning: {} updates were skipped for non-finite gradients (skipped_updates in summary.json)",
                c.skipped_updates
            );
        }
        let (0, true, Some(ev)) = (worker.rank(), finished, &self.last_eval) else {
            return Ok(None);
        };
        let recipe = &spec.recipe;
        let planned = pace.plan.summary();
        let end = pace.plan.end_step();
        let steps_run = end - self.first_step;
        let s = Summary {
            name: recipe.name.clone(),
            rule: recipe.sync.rule.name().to_string(),
            seed: recipe.seed,
            world_size: worker.world_size(),
            steps: end,
            epochs: pace.epoch(end),
            steps_per_epoch: pace.spe,
            final_test_accuracy: ev.accuracy,
            final_test_loss: ev.loss,
            final_train: ev.train,
            syncs: c.syncs,
            planned_syncs: planned.rounds,
            local: recipe.sync.local.as_ref().zip(planned.local).map(|(l, p)| LocalLevel {
                rule: l.rule.name().to_string(),
                node_size: worker.local_comm().map_or(1, |c| c.world_size()),
                syncs: c.local_syncs,
                planned_syncs: p.rounds,
                bytes_per_rank: c.local_bytes,
                comm_seconds: c.local_comm_seconds,
            }),
            comm_percent: planned.comm_percent,
            bytes_per_rank: c.bytes,
            comm_seconds: c.comm_seconds,
            wall_seconds: c.wall_seconds,
            steps_per_second: steps_run as f64 / wall.max(1e-9),
            skipped_updates: c.skipped_updates,
            unigram_entropy: task.unigram_entropy(),
            membership: membership_changes(&spec.run_dir),
            diverged: self.diverged.as_ref().map(ToString::to_string),
            not_trained: self.not_trained.as_ref().map(|n| n.why.clone()),
            workers_before_last_average: self
                .workers_before
                .as_ref()
                .map(|e| Fit { accuracy: e.accuracy, loss: e.loss }),
        };
        crate::files::write_atomic(
            &spec.run_dir.join("summary.json"),
            serde_json::to_string_pretty(&s)?.as_bytes(),
            "run summary",
        )?;
        Ok(Some(s))
    }
}

/// Whether an evaluation's `loss` at `done_steps` says the run diverged (every rank sees the same
/// numbers): a loss that is not finite, or above `limit` at two evaluations in a row (or at the last,
/// `is_end`), so that one spike does not end a run that would recover. `above_limit` carries whether
/// the previous evaluation was above it.
fn judge(
    above_limit: &mut bool,
    loss: f64,
    limit: f64,
    done_steps: u64,
    is_end: bool,
) -> Option<crate::exit::Diverged> {
    let above = loss.is_nan() || loss > limit;
    let diverged = !loss.is_finite() || (above && (*above_limit || is_end));
    *above_limit = above;
    if !diverged {
        return None;
    }
    let seen = if loss.is_finite() { format!("{loss:.4}, above") } else { format!("{loss}, not below") };
    let twice = if loss.is_finite() && !is_end { ", at two evaluations in a row" } else { "" };
    let why = format!(
        "the evaluation's loss is {seen} {limit:.4}, the divergence limit (eval.divergence_factor x the loss at the start, of a model that predicts every class alike){twice}; the last checkpoint before it is kept (lower the learning rate, or the outer optimizer's momentum)"
    );
    Some(crate::exit::Diverged { step: Some(done_steps), why })
}

/// One record shape for syncs and evaluations, at the step `report` completed.
fn record(kind: &str, report: &StepReport, pace: &Pace, loss: f64, accuracy: Option<f64>, c: Counters) -> Record {
    let step = report.info.step + 1;
    let counted = Record::counted(kind, step, pace.epoch(step), report.info.lr, report.info.h, c);
    Record { loss: Some(loss), accuracy, ..counted }
}

/// Whether the sync that completed `done_steps` steps evaluates: the last sync before an epoch
/// boundary (the next sync would be past it), every `every_epochs` epochs, and the end. Data parallel
/// syncs every step, so it evaluates on the boundary itself.
fn eval_due(cursor: &Cursor, done_steps: u64, spe: usize, every_epochs: u64) -> bool {
    let is_end = cursor.is_done();
    let next_end = cursor.round().end();
    let boundary = done_steps.div_ceil(spe as u64) * spe as u64;
    let epoch_index = boundary / spe as u64;
    is_end || (next_end > boundary && epoch_index.is_multiple_of(every_epochs))
}

/// Whether the sync that completed `done_steps` steps evaluates under `eval.every_steps = period`: the
/// last sync before every multiple of `period` (the next sync would be past it), and the end.
fn eval_due_every(cursor: &Cursor, done_steps: u64, period: u64) -> bool {
    let boundary = done_steps.div_ceil(period) * period;
    cursor.is_done() || cursor.round().end() > boundary
}

/// The run's counters: those of the checkpoint it resumed from, then this segment's.
fn counters(base: &Counters, st: &qsr_optim::DriverStats, t0: Instant) -> Counters {
    base.then(&Counters {
        syncs: st.syncs,
        bytes: st.comm.bytes_sent,
        comm_seconds: st.comm.seconds,
        wall_seconds: t0.elapsed().as_secs_f64(),
        skipped_updates: st.skipped_updates,
        local_syncs: st.local.syncs,
        local_bytes: st.local.comm.bytes_sent,
        local_comm_seconds: st.local.comm.seconds,
    })
}

/// Writes the checkpoint of `step` (every rank its files, rank 0 the rest and the commit); a rank 0
/// that fails removes the unfinished one (a full disk leaves no `tmp-step-<N>`, N5). Other ranks may
/// still be writing into it then, so the launchers sweep once every worker has stopped.
fn save_checkpoint<M: Module>(worker: &mut Worker<M>, spec: &RunSpec, step: u64, counters: Counters) -> Result<()> {
    let saved = write_checkpoint(worker, spec, step, counters);
    let tmp = checkpoint::tmp_dir(&spec.run_dir, step);
    match saved {
        Err(e) if worker.rank() == 0 => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
        // Rank 0 removed it after a failure while this rank wrote: the failure is not this rank's.
        Err(e) if !tmp.exists() => Err(CheckpointAbandoned { step, what: format!("{e:#}") }.into()),
        saved => saved,
    }
}

fn write_checkpoint<M: Module>(worker: &mut Worker<M>, spec: &RunSpec, step: u64, counters: Counters) -> Result<()> {
    let rank = worker.rank();
    let run_dir = &spec.run_dir;
    let tmp = checkpoint::tmp_dir(run_dir, step);
    let err = || format!("checkpoint at step {step}");
    if rank == 0 {
        checkpoint::begin(run_dir, step)?;
    }
    worker.comm_mut().barrier().with_context(err)?;
    checkpoint::write_file(
        &tmp,
        &format!("optim-rank{rank}.safetensors"),
        &checkpoint::optim_bytes(&*worker.optimizer_state()?)?,
    )?;
    let sync = worker.sync_state()?;
    if !sync.is_empty() {
        // A streaming rank's own parameters: its ranks differ between a fragment's syncs.
        let params = worker.params()?;
        let own = sync.stream().is_some().then_some(&*params);
        checkpoint::write_file(&tmp, &checkpoint::sync_file(rank), &sync.to_safetensors(own)?)?;
    }
    if rank == 0 {
        let mut running = vec![0.0; worker.layout().running_len()];
        worker.layout().read_running(worker.model(), &mut running)?;
        checkpoint::write_file(
            &tmp,
            "model.safetensors",
            &checkpoint::model_bytes(worker.layout(), &worker.params()?, &running, step)?,
        )?;
        let state = CheckpointState {
            format: checkpoint::FORMAT,
            step,
            world_size: worker.world_size(),
            cursor: worker.cursor().clone(),
            resume_key: spec.recipe.resume_key()?,
            counters,
        };
        checkpoint::write_file(&tmp, "state.json", serde_json::to_string_pretty(&state)?.as_bytes())?;
    }
    worker.comm_mut().barrier().with_context(err)?;
    if rank == 0 {
        crate::fault::at(rank, crate::fault::Point::Commit(step));
        checkpoint::commit(run_dir, step, spec.recipe.checkpoint.keep)?;
    }
    Ok(())
}

fn progress_bar(end: u64, start: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(end);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} [{elapsed_precise} < {eta_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_evaluation_above_the_limit_is_a_spike_and_two_in_a_row_diverge() {
        let mut above = false;
        assert!(judge(&mut above, 1.0, 6.9, 22, false).is_none());
        assert!(judge(&mut above, 13.0, 6.9, 44, false).is_none(), "one spike");
        assert!(judge(&mut above, 2.0, 6.9, 66, false).is_none(), "recovered");
        assert!(judge(&mut above, 13.0, 6.9, 88, false).is_none());
        let d = judge(&mut above, 14.0, 6.9, 110, false).expect("twice in a row");
        assert_eq!(d.step, Some(110));
        assert!(d.why.contains("two evaluations in a row"), "{}", d.why);
        let mut above = false;
        assert!(judge(&mut above, f64::NAN, 6.9, 22, false).is_some(), "not finite: at once");
        assert!(judge(&mut false, f64::INFINITY, f64::INFINITY, 22, false).is_some());
        assert!(judge(&mut false, 13.0, 6.9, 880, true).is_some(), "above at the last evaluation");
    }

    #[test]
    fn a_step_whose_loss_is_not_finite_is_left_out_of_the_intervals_mean() {
        let mut i = Interval::default();
        for loss in [2.0, f32::NAN, 4.0, f32::INFINITY] {
            i.add(loss);
        }
        assert_eq!((i.mean(), i.non_finite), (3.0, 2));
        let mut all_bad = Interval::default();
        all_bad.add(f32::NAN);
        assert!(all_bad.mean().is_nan());
        assert_eq!(Interval::default().mean(), 0.0);
    }
}
