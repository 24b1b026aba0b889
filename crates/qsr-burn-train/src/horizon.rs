//! The trap of an lr scheduler sized for the whole training loader (documented on [`check`]).

use std::ops::RangeInclusive;

use burn::train::{Learner, LearnerModel, TrainLoader};
use qsr_optim::{AveragerConfig, OptimError};

/// Before the first step, with the replica's step count estimated from its loader (`shard`'s items
/// in batches of its first batch's size, a partial last batch counting as one; `grad_accumulation`
/// batches per step; over `epochs`, a resumed run's scheduler already `start - 1` epochs along; a
/// loader with several workers takes a few more steps, never fewer): refuses a scheduler sized for
/// another run ([`check`]) and, on rank 0 of a run from its first epoch, warns of what the averager
/// finds in the Learner's schedule ([`AveragerConfig::schedule_warnings`]: a round that keeps the
/// replicas apart while the lr is high, one lr throughout, an lr that rises again).
pub(crate) fn judge<M: LearnerModel>(
    learner: &Learner<M>,
    config: &AveragerConfig,
    shard: &TrainLoader<M>,
    (epochs, grad_accumulation): (&RangeInclusive<usize>, Option<usize>),
    (rank, k): (usize, usize),
) -> Result<(), String> {
    let mut first = shard.iter();
    first.next();
    let batch = first.progress().items_processed.max(1);
    let batches = shard.num_items().div_ceil(batch);
    let per_epoch = grad_accumulation.map_or(batches, |n| batches.div_ceil(n.max(1))) as u64;
    let (done, total) = ((*epochs.start() as u64).saturating_sub(1) * per_epoch, *epochs.end() as u64 * per_epoch);
    check(learner, done, total, k)
        .map_err(|reason| OptimError::Config { field: "lr scheduler".into(), reason }.to_string())?;
    if rank == 0 && done == 0 {
        let mut sampled = learner.clone();
        let lrs = (0..total).map(|_| {
            sampled.lr_step();
            sampled.lr_current().base()
        });
        let warnings = config.schedule_warnings(lrs.collect()).map_err(|e| e.to_string())?;
        let per = format!("the Learner's lr scheduler over each replica's {total} steps");
        warnings.iter().for_each(|w| qsr_comm::notice(true, &format!("qsr-burn-train: {per}: {w}")));
    }
    Ok(())
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
