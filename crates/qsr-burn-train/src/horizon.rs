//! The trap of an lr scheduler sized for the whole training loader (documented on [`check`]).

use std::ops::RangeInclusive;

use burn::train::{Learner, LearnerModel};

/// [`check`] before the run's first optimizer step, with the replica's step count estimated from its
/// loader: `items` per epoch in batches of `batch` items (the first batch's size; a partial last batch
/// counts as one), `grad_accumulation` batches per step, over `epochs` (a resumed run's scheduler is
/// already `start - 1` epochs along). A loader with several workers takes a few more steps than the
/// estimate, never fewer, so a scheduler sized for the replica's steps always passes.
pub(crate) fn check_before_first_step<M: LearnerModel>(
    learner: &Learner<M>,
    epochs: &RangeInclusive<usize>,
    (items, batch): (usize, usize),
    grad_accumulation: Option<usize>,
    k: usize,
) -> Result<(), String> {
    let batches = items.div_ceil(batch.max(1));
    let per_epoch = grad_accumulation.map_or(batches, |n| batches.div_ceil(n.max(1))) as u64;
    let (done, total) = ((*epochs.start() as u64).saturating_sub(1), *epochs.end() as u64);
    check(learner, per_epoch * done, per_epoch * total, k)
}

/// Refuses a Learner whose lr scheduler is far from its end when the run ends.
///
/// Each of the K replicas takes `1/K` of the loader's batches, so a scheduler sized for the whole
/// loader (`epochs x batches`, as for one device) is still near its peak lr when the run ends: QSR then
/// keeps `H` small and syncs far more often than the schedule the user planned for (40 syncs instead of
/// 17 in a user's trial). Sampled from a clone of the Learner: `at` optimizer steps taken so far,
/// `run_steps` in the whole run.
/// Refused: a schedule that reaches its lowest lr past 1.5x the run while the run's last lr is still
/// more than a tenth of the way from that lowest lr to the peak. Schedules that keep decaying (step,
/// exponential) pass: their lr at any step is close to where it ends, or they never end.
fn check<M: LearnerModel>(learner: &Learner<M>, at: u64, run_steps: u64, k: usize) -> Result<(), String> {
    let Some(shape) = sample(learner.clone(), at, run_steps, k) else {
        return Ok(());
    };
    let far = shape.last_lr - shape.floor > 0.1 * (shape.peak - shape.floor);
    if 2 * shape.end < 3 * run_steps || !far {
        return Ok(());
    }
    Err(format!(
        "the Learner's lr scheduler decays until step {}, but each of the {k} replicas takes only {run_steps} \
         optimizer steps (its 1/{k} of the training loader, every epoch): the run would end at lr {:.3e}, far \
         from the schedule's {:.3e}, and the sync rule would follow lrs that never decay as planned. Size the \
         scheduler for {run_steps} steps (e.g. CosineAnnealingLrSchedulerConfig::new(lr, {run_steps}))",
        shape.end, shape.last_lr, shape.floor
    ))
}

/// What sampling found: where the lr stopped decreasing, its value there, the highest lr seen, and the
/// lr of the run's last step.
struct Shape {
    end: u64,
    floor: f64,
    peak: f64,
    last_lr: f64,
}

/// Samples the schedule from step `at` until its lr has not decreased for a whole run's length (the
/// end: the last step at which it decreased); `None` when it keeps decreasing through
/// `(k + 2) x run_steps` steps.
fn sample<M: LearnerModel>(mut learner: Learner<M>, at: u64, run_steps: u64, k: usize) -> Option<Shape> {
    let window = run_steps.max(1);
    let cap = at.max(run_steps) + (k as u64 + 1) * window;
    let mut lr = learner.lr_current().base();
    let (mut peak, mut last_lr) = (lr, lr);
    let mut end = (at.saturating_sub(1), lr);
    for step in at..cap {
        learner.lr_step();
        let next = learner.lr_current().base();
        peak = peak.max(next);
        if step + 1 == run_steps {
            last_lr = next;
        }
        if next < lr {
            end = (step, next);
        } else if step - end.0 >= window && step + 1 >= run_steps {
            return Some(Shape { end: end.0, floor: end.1, peak, last_lr });
        }
        lr = next;
    }
    None
}
