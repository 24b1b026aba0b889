//! The training loop (documented on [`run_worker`]).

use anyhow::{Result, anyhow, bail};
use burn::module::Module;
use qsr_comm::Collective;
use qsr_optim::{DeviceGroup, Level, OptimState, Worker};
use qsr_sched::Plan;

use super::model::TrainModel;
use super::segment::{AfterSync, Pace, Segment};
use super::spec::{Comms, RunSpec};
use super::task::{ImageTask, Task, TextTask};
use crate::checkpoint::{self, Counters};
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
    set_up_syncs(&mut worker, recipe, comms.stream, rank == 0)?;
    let (start_records, base) = resume(spec, &pace.plan, &mut worker)?;
    let end = pace.plan.end_step();
    let first_step = worker.cursor().step();
    let mut stream = task.stream(first_step, end)?;
    let mut segment = Segment::start(spec, rank, end, first_step, start_records, base)?;
    let mut finished = true;
    while !worker.cursor().is_done() {
        crate::fault::at(rank, crate::fault::Point::Step(worker.cursor().step()));
        segment.before_last_average(task, &mut worker)?;
        let report = task.train_step(&mut worker, &mut stream)?;
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
        }
    }
    let summary = segment.finish(spec, &pace, task, &worker, finished)?;
    segment.check_diverged(rank)?;
    Ok(summary)
}

/// The recipe's `[sync.streaming]` (its fragments' all-reduces on `stream` when given) and `[outer]`
/// on a new worker; `warn` says the fragments' syncs that fall within the delay (rank 0 does).
pub(crate) fn set_up_syncs<M: Module>(
    worker: &mut Worker<M>,
    recipe: &TrainRecipe,
    stream: Option<Box<dyn Collective>>,
    warn: bool,
) -> Result<()> {
    let verdict = qsr_optim::check_sync(&recipe.sync_settings()?, qsr_optim::Face::Recipe);
    for w in verdict.warnings.iter().filter(|_| warn) {
        eprintln!("qsr: warning: {w}");
    }
    if let Some(streaming) = recipe.sync.streaming {
        worker.set_streaming(streaming)?;
        if let Some(comm) = stream {
            worker.set_streaming_comm(comm)?;
        }
    }
    if let Some(outer) = recipe.outer {
        worker.set_outer(outer)?;
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
    // A streaming worker's own parameters and what it has in flight. A rank the checkpoint lacks (an
    // elastic resume with more workers) starts from rank 0's parameters, with the averages in flight
    // (the same on every rank) and a zero residual, as a worker joining a running job does.
    let stream = match worker.streaming_state()? {
        Some(_) => {
            let file = format!("stream-rank{}.safetensors", if rank < state.world_size { rank } else { 0 });
            let (local, mut stream) = checkpoint::load_stream(&dir.join(file), worker.layout())?;
            if rank >= state.world_size {
                stream.residual.iter_mut().for_each(|r| r.fill(0.0));
            }
            Some((local, stream))
        }
        None => None,
    };
    if let Some((local, _)) = &stream {
        params.clone_from(local);
    }
    let template: OptimState = worker.optimizer_state()?.into_owned();
    // An elastic run may resume with more workers than wrote the checkpoint: those start with fresh
    // moments, as a worker joining a running job does.
    let optim = if rank < state.world_size {
        checkpoint::load_optim(&dir.join(format!("optim-rank{rank}.safetensors")), &template)?
    } else {
        template
    };
    // A longer (or shorter) plan may move the cursor; the same plan must land where the checkpoint was.
    let cursor = plan.cursor_at(state.cursor.step());
    if cursor != state.cursor && plan.end_step() == state.cursor.plan().end_step() {
        bail!("checkpoint {}: its position does not follow from this recipe's plan", dir.display());
    }
    worker.restore(&params, optim, cursor)?;
    if worker.outer_state().is_some() {
        let (global, momentum) = checkpoint::load_outer(&dir.join("outer.safetensors"), params.len())?;
        worker.restore_outer_state(&global, &momentum)?;
    }
    if let Some((_, stream)) = stream {
        worker.restore_streaming_state(stream)?;
    }
    if !running.is_empty() {
        let m = worker.layout().write_running(worker.model().clone(), &running)?;
        worker.set_model(m)?;
    }
    Ok((Some(state.step), state.counters))
}
