//! The trap of an lr scheduler sized for the whole training loader (documented on [`check`]).

use burn::train::{Learner, LearnerModel};

/// Refuses a Learner whose lr scheduler ends long after the run does.
///
/// Each of the K replicas takes `1/K` of the loader's batches, so a scheduler sized for the whole
/// loader (`epochs x batches`, as for one device) is still near its peak lr when the run ends: QSR then
/// keeps `H` small and syncs far more often than the schedule the user planned for (40 syncs instead of
/// 17 in a user's trial). Sampled from a clone of the Learner after the run's first epoch, when the
/// replica's step count is known: `at` optimizer steps taken so far, `run_steps` in the whole run. A
/// schedule that keeps decreasing (step, exponential) has no end to compare and passes, as does one
/// that ends within 1.5x the run.
pub(crate) fn check<M: LearnerModel>(learner: &Learner<M>, at: u64, run_steps: u64, k: usize) -> Result<(), String> {
    let Some(end) = schedule_end(learner.clone(), at, run_steps, k) else {
        return Ok(());
    };
    if 2 * end < 3 * run_steps {
        return Ok(());
    }
    Err(format!(
        "the Learner's lr scheduler decays until step {end}, but each of the {k} replicas takes only {run_steps} \
         optimizer steps (its 1/{k} of the training loader, every epoch): the schedule would end far after the run, \
         and the sync rule would follow lrs it never reaches the end of. Size the scheduler for {run_steps} steps \
         (e.g. CosineAnnealingLrSchedulerConfig::new(lr, {run_steps}))"
    ))
}

/// The last step at which the lr still decreased, once it has then not decreased for a whole run's
/// length; `None` when it keeps decreasing within the steps sampled (at most `(4k + 1) x run_steps`).
fn schedule_end<M: LearnerModel>(mut learner: Learner<M>, at: u64, run_steps: u64, k: usize) -> Option<u64> {
    let window = run_steps.max(1);
    let cap = at + (4 * k as u64 + 1) * window;
    let mut lr = learner.lr_current().base();
    let mut last_decrease = at.saturating_sub(1);
    for step in at..cap {
        learner.lr_step();
        let next = learner.lr_current().base();
        if next < lr {
            last_decrease = step;
        } else if step - last_decrease >= window {
            return Some(last_decrease);
        }
        lr = next;
    }
    None
}
