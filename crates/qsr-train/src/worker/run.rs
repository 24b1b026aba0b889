//! The training loop (documented on [`run_worker`]).

use std::path::Path;

use anyhow::{Result, anyhow, bail};
use burn::module::Module;
use qsr_comm::Collective;
use qsr_optim::{DeviceGroup, Level, OptimState, StreamState, SyncState, Worker};
use qsr_sched::Plan;

use super::model::TrainModel;
use super::segment::{AfterSync, Pace, Segment};
use super::spec::{Comms, RunSpec};
use super::task::{DataSize, ImageTask, Task, TextTask};
use crate::checkpoint::{self, CheckpointState, Counters};
use crate::recipe::TrainRecipe;
use crate::records::Summary;

/// Runs one worker to the end of the plan (or to `halt_after`).
///
/// `group` is the device group of K simulated workers sharing one device; it is used when the worker
/// is device-resident (a GPU backend, or `driver.residency = "device"`).
///
/// This is the training loop: the same code for every worker, whatever carries its collective (threads in one
/// process, local processes over the TCP ring, MPI, an externally launched job), and for every task (images:
/// test accuracy; text: validation loss of next-token prediction).
pub(crate) fn run_worker(
    spec: &RunSpec,
    comms: Comms,
    model: TrainModel,
    group: Option<DeviceGroup>,
) -> Result<Option<Summary>> {
    let (rank, k) = (comms.world.rank(), comms.world.world_size());
    let recipe = &spec.recipe;
    match model {
        TrainModel::Image(m) => {
            let task = ImageTask::new(recipe, &m, rank, k, &spec.device)?;
            run(spec, comms, m, group, &task)
        }
        TrainModel::Language(m) => {
            let gpt =
                recipe.model.as_gpt().ok_or_else(|| anyhow!("a GPT was built for a `model.kind` that is not gpt"))?;
            let task = TextTask::new(recipe, gpt, rank, k, &spec.device)?;
            run(spec, comms, m, group, &task)
        }
    }
}

/// Fails on every rank, as bad input naming the size, unless every rank read data of the sizes rank 0
/// read: shards of data of different sizes end their epochs (and evaluations) at different steps, and
/// the ranks would fail much later blaming the schedule.
fn agree_data(comm: &mut dyn Collective, size: DataSize) -> Result<()> {
    let facts = serde_json::json!({ "data": { "train_items": size.train, "test_items": size.test } });
    match qsr_comm::agree(comm, &facts) {
        Err(e @ qsr_comm::CommError::Disagree { .. }) => Err(crate::exit::bad_input(
            anyhow!(e).context("the ranks read different data (each must read the same dataset)"),
        )),
        other => Ok(other?),
    }
}

/// [`run_worker`] for one task.
fn run<T: Task>(
    spec: &RunSpec,
    comms: Comms,
    model: T::Module,
    group: Option<DeviceGroup>,
    task: &T,
) -> Result<Option<Summary>> {
    let recipe = &spec.recipe;
    let rank = comms.world.rank();
    let mut comms = comms;
    agree_data(comms.world.as_mut(), task.data_size())?;
    let pace = Pace { plan: recipe.plan()?, spe: task.steps_per_epoch() };
    let (cursor, driver) = (pace.plan.cursor(), recipe.driver_config());
    let mut worker = Worker::new(model, recipe.optimizer.clone(), comms.world, cursor, driver)?;
    if let Some(node) = comms.node {
        worker.set_local(node)?;
    }
    if let Some(g) = group
        && worker.is_device_resident()
    {
        worker.set_device_group(g)?;
    }
    set_up_syncs(&mut worker, recipe, comms.fragments, rank == 0)?;
    let (start_records, base) = resume(spec, &pace.plan, &mut worker)?;
    let end = pace.plan.end_step();
    let first_step = worker.cursor().step();
    let mut batches = task.batches(first_step, end)?;
    let mut segment = Segment::start(spec, rank, end, first_step, start_records, base)?;
    let mut finished = true;
    while !worker.cursor().is_done() {
        crate::fault::at(rank, crate::fault::Point::Step(worker.cursor().step()));
        segment.before_last_average(task, &mut worker)?;
        let report = task.train_step(&mut worker, &mut batches)?;
        segment.stepped(&worker, &report, &pace);
        // A round's end (streaming fragments sync inside rounds; their records are the round's).
        let global = report.info.sync_after && report.sync.is_some_and(|s| s.level == Level::Global);
        match if global { segment.synced(spec, &pace, task, &mut worker, &report)? } else { AfterSync::Continue } {
            AfterSync::Continue => {}
            AfterSync::Diverged => break,
            AfterSync::Halt => {
                finished = false;
                break;
            }
            AfterSync::Interrupted(signal) => {
                segment.finish(spec, &pace, task, &worker, false)?;
                let (name, stopped, resumable) = (crate::exit::signal_name(signal), recipe.train.workers, true);
                return Err(crate::exit::Interrupted { signal, name, stopped, resumable }.into());
            }
        }
    }
    let summary = segment.finish(spec, &pace, task, &worker, finished)?;
    segment.check_diverged(rank)?;
    Ok(summary)
}

/// The recipe's `[sync.streaming]` (its fragments' all-reduces on `fragments` when given) and `[outer]`
/// on a new worker; `warn` says the fragments' syncs that fall within the delay (rank 0 does).
pub(crate) fn set_up_syncs<M: Module>(
    worker: &mut Worker<M>,
    recipe: &TrainRecipe,
    fragments: Option<Box<dyn Collective>>,
    warn: bool,
) -> Result<()> {
    if let Some(streaming) = recipe.sync.streaming {
        worker.set_streaming(streaming)?;
        if let Some(comm) = fragments {
            worker.set_streaming_comm(comm)?;
        }
    }
    if let Some(outer) = recipe.outer {
        worker.set_outer(outer)?;
    }
    // The worker checked its settings as they came; what they do differently, once.
    for w in worker.warnings().iter().filter(|_| warn) {
        eprintln!("qsr: warning: {w}");
    }
    Ok(())
}

/// Continues from `spec.resume`, if any: the checkpoint's parameters, this rank's optimizer state, its
/// position in the plan and the BatchNorm statistics go into `worker`. Returns the step past which
/// metrics records are dropped (`None` for a fresh run) and the counters the run continues from.
pub(crate) fn resume<M: Module>(
    spec: &RunSpec,
    plan: &Plan,
    worker: &mut Worker<M>,
) -> Result<(Option<u64>, Counters)> {
    let Some((dir, state)) = &spec.resume else {
        return Ok((None, Counters::default()));
    };
    let rank = worker.rank();
    let (mut params, running) = checkpoint::load_model(&dir.join("model.safetensors"), worker.layout())?;
    // A rank the checkpoint lacks (an elastic resume with more workers) takes rank 0's sync state and
    // parameters, with the averages in flight (the same on every rank) and a zero residual, as a
    // worker joining a running job does; its optimizer moments start fresh.
    let (from, joins) = if rank < state.world_size { (rank, false) } else { (0, true) };
    let saved = load_sync_state(dir, state, worker, from, joins)?;
    if let Some(own) = saved.own_params() {
        params.clone_from(own);
    }
    let template: OptimState = worker.optimizer_state()?.into_owned();
    let optim = match joins {
        false => checkpoint::load_optim(&dir.join(format!("optim-rank{rank}.safetensors")), &template)?,
        true => template,
    };
    // A longer (or shorter) plan may move the cursor; the same plan must land where the checkpoint was.
    let cursor = plan.cursor_at(state.cursor.step());
    if cursor != state.cursor && plan.end_step() == state.cursor.plan().end_step() {
        bail!("checkpoint {}: its position does not follow from this recipe's plan", dir.display());
    }
    worker.restore(&params, optim, cursor)?;
    saved.restore_into(worker)?;
    if !running.is_empty() {
        let m = worker.layout().write_running(worker.model().clone(), &running)?;
        worker.set_model(m)?;
    }
    Ok((Some(state.step), state.counters))
}

/// A checkpoint's sync state, as its format holds it.
enum SavedSync {
    /// Format 3: one `SyncState` (and a streaming rank's own parameters).
    State(SyncState, Option<Vec<f32>>),
    /// Formats 1 and 2: the outer state and a streaming state with the rank's own parameters.
    Parts(Option<(Vec<f32>, Vec<f32>)>, Option<(Vec<f32>, StreamState)>),
}

impl SavedSync {
    /// A streaming rank's own parameters, which replace the checkpoint's averaged ones.
    fn own_params(&self) -> Option<&Vec<f32>> {
        match self {
            SavedSync::State(_, own) => own.as_ref(),
            SavedSync::Parts(_, stream) => stream.as_ref().map(|(own, _)| own),
        }
    }

    /// Gives `worker` (restored to the checkpoint's position) its sync state.
    fn restore_into<M: Module>(self, worker: &mut Worker<M>) -> Result<()> {
        match self {
            SavedSync::State(state, _) => worker.restore_sync_state(state)?,
            // The inner round comes from the plan's position (Worker::restore).
            SavedSync::Parts(outer, stream) => {
                if let Some((global, momentum)) = outer {
                    worker.restore_outer_state(&global, &momentum)?;
                }
                if let Some((_, stream)) = stream {
                    worker.restore_streaming_state(stream)?;
                }
            }
        }
        Ok(())
    }
}

/// Rank `from`'s sync state in checkpoint `dir`, for `worker`'s outer and streaming settings (nothing
/// where it has neither); `joins`: a worker the checkpoint lacks, whose residual starts at zero.
fn load_sync_state<M: Module>(
    dir: &Path,
    state: &CheckpointState,
    worker: &mut Worker<M>,
    from: usize,
    joins: bool,
) -> Result<SavedSync> {
    let len = worker.layout().len();
    let (outer, streams) = (worker.outer_state().is_some(), worker.streaming_state()?.is_some());
    if state.format >= checkpoint::SYNC_STATE_FORMAT {
        // Written where the state is not empty: always with an outer step or streaming, with only
        // the fingerprint check once a global average has taken place.
        let file = dir.join(checkpoint::sync_file(from));
        if !(outer || streams || file.exists()) {
            return Ok(SavedSync::State(SyncState::default(), None));
        }
        let (mut sync, own) = checkpoint::load_sync(&file, len)?;
        if joins {
            sync.zero_residual();
        }
        return Ok(SavedSync::State(sync, own));
    }
    let outer = outer.then(|| checkpoint::load_outer(&dir.join("outer.safetensors"), len)).transpose()?;
    let stream = match streams {
        true => {
            let file = dir.join(format!("stream-rank{from}.safetensors"));
            let (own, mut stream) = checkpoint::load_stream(&file, worker.layout())?;
            if joins {
                stream.residual.iter_mut().for_each(|r| r.fill(0.0));
            }
            Some((own, stream))
        }
        false => None,
    };
    Ok(SavedSync::Parts(outer, stream))
}
