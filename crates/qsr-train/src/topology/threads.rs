//! `qsr train` with K workers as threads of this process (no `--nproc`, `--comm` or `--elastic`).

use anyhow::{Result, anyhow};
use qsr_comm::{Collective, InProcessGroup};
use qsr_optim::DeviceGroup;

use crate::exit::root_cause;
use crate::recipe::TrainRecipe;
use crate::records::Summary;
use crate::worker::{Comms, RunSpec, build_model, in_pool, intra_op_threads, run_worker};

/// Runs K workers as threads of this process, joined by the in-process collective; returns rank 0's
/// summary.
pub(crate) fn run(spec: &RunSpec) -> Result<Option<Summary>> {
    let k = spec.recipe.train.workers;
    // A signal stops the workers together at a sync, with a checkpoint, instead of killing them.
    crate::worker::interrupt::arm()?;
    let model = build_model(&spec.recipe, &spec.device)?;
    let comms = InProcessGroup::new(k);
    // Used by device-resident workers (GPU): their syncs average on the device.
    let groups = DeviceGroup::new(k);
    let nodes = simulated_nodes(&spec.recipe)?;
    // Streaming fragments all-reduce on a group of their own, on a thread beside each worker.
    let fragment_comms: Vec<Option<Box<dyn Collective>>> = match spec.recipe.sync.streaming {
        Some(_) => InProcessGroup::new(k).into_iter().map(|c| Some(Box::new(c) as Box<dyn Collective>)).collect(),
        None => (0..k).map(|_| None).collect(),
    };
    // The cores split between the workers: each computes in a pool of its own.
    let threads = intra_op_threads(k);
    let results: Vec<Result<Option<Summary>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(groups)
            .zip(nodes)
            .zip(fragment_comms)
            .map(|(((comm, group), node), fragments)| {
                // Each replica gets its own BatchNorm state (a plain clone would share it).
                let replica = model.replica();
                let spec = spec.clone();
                s.spawn(move || {
                    let rank = comm.rank();
                    let spec = RunSpec { progress: spec.progress && rank == 0, ..spec };
                    let comms = Comms { world: Box::new(comm), node, fragments };
                    in_pool(rank, threads, || run_worker(&spec, comms, replica, Some(group)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a worker thread panicked")))).collect()
    });
    let mut summary = None;
    let mut errors = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) => summary = summary.or(s),
            Err(e) => errors.push((rank, e)),
        }
    }
    if !errors.is_empty() {
        // Every worker has stopped: a checkpoint left unfinished (a full disk) is garbage (N5), and
        // rank 0's own removal may have raced another rank still writing into it.
        let _ = crate::checkpoint::sweep(&spec.run_dir);
    }
    // Report the failure that came first, not a rank that saw it happen.
    if let Some((rank, e)) = root_cause(errors) {
        return Err(e.context(format!("worker {rank} failed")));
    }
    Ok(summary)
}

/// Each simulated worker's node group, in rank order, for a two-level recipe: nodes of
/// `sync.local.workers_per_node` consecutive ranks, or one node (all simulated workers share a host).
fn simulated_nodes(recipe: &TrainRecipe) -> Result<Vec<Option<Box<dyn Collective>>>> {
    let k = recipe.train.workers;
    recipe.check_nodes(k)?;
    Ok(match &recipe.sync.local {
        Some(l) => {
            let n = l.workers_per_node.unwrap_or(k);
            (0..k / n).flat_map(|_| InProcessGroup::new(n)).map(|c| Some(Box::new(c) as Box<dyn Collective>)).collect()
        }
        None => (0..k).map(|_| None).collect(),
    })
}
