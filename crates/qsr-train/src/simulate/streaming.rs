//! The prediction of a streaming recipe (`[sync.streaming]`): fragments' all-reduces overlap the steps.

use qsr_sched::StreamingConfig;
use qsr_sched::{FragmentPlan, StepInfo, SyncMode, split_elements};

use super::{Cluster, Counted, Prediction, SyncPayload};

/// An average on the link: when it arrives, and the step after which the worker needs it.
struct Pending {
    fragment: u32,
    apply_after: u64,
    arrives: f64,
}

/// The workers' clock, the link's, and the time the workers waited, per epoch too.
struct Timeline {
    clock: f64,
    link_free: f64,
    waited: f64,
    spe: Option<u64>,
    epochs: Vec<f64>,
}

impl Timeline {
    /// `seconds` of the workers' time at `step`: computing, or waiting.
    fn spend(&mut self, step: u64, seconds: f64) {
        self.clock += seconds;
        if let Some(e) = self.spe.and_then(|s| self.epochs.get_mut((step / s) as usize)) {
            *e += seconds;
        }
    }

    /// The workers wait at `step` until `until`.
    fn wait(&mut self, step: u64, until: f64) {
        let w = (until - self.clock).max(0.0);
        self.waited += w;
        self.spend(step, w);
    }

    /// An all-reduce of `seconds` queued on the link now (one at a time, in the order sent); returns
    /// when it arrives.
    fn send(&mut self, seconds: f64) -> f64 {
        self.link_free = self.clock.max(self.link_free) + seconds;
        self.link_free
    }
}

/// [`super::predict`] of a streaming recipe. Each fragment's all-reduce (its share of the parameters,
/// split evenly) queues on the link when the fragment syncs and runs while the workers step; a worker
/// waits only where an average is due (`delay` steps after it was sent, or earlier when its fragment
/// syncs again) and has not arrived. The run's last step settles every average and (where
/// [`StreamingConfig::ends_with_average`]) averages all parameters in f32 at once, as the driver does. `comm_seconds`
/// is the time the workers waited.
pub(super) fn predict_streaming(
    name: &str,
    (fragments, streaming): (&FragmentPlan, &StreamingConfig),
    step_seconds: f64,
    payload: &SyncPayload,
    world_size: usize,
    (net, spe): (Cluster, Option<u64>),
) -> Prediction {
    let plan = fragments.plan();
    let spe = spe.filter(|&s| s > 0);
    let epochs = vec![0.0; spe.map_or(0, |s| plan.end_step().div_ceil(s) as usize)];
    let mut t = Timeline { clock: 0.0, link_free: 0.0, waited: 0.0, spe, epochs };
    let shares = split_elements(payload.gradient_elements, fragments.fragments());
    let fragment_seconds = |elements: u64| {
        let part = SyncPayload { parameter_elements: elements, ..*payload };
        net.global_seconds(&part, SyncMode::Parameters, world_size)
    };
    let (mut pending, mut syncs, mut gradient_syncs) = (Vec::<Pending>::new(), 0, 0);
    // A node's plain average at every local round's end (in f32 under int8 / fp8).
    let node_average = net.local_seconds(payload);
    let (mut local_syncs, mut local_comm) = (0, 0.0);
    for info in plan.cursor() {
        t.spend(info.step, step_seconds);
        if info.mode == SyncMode::Gradients {
            // Data-parallel steps (a stream of one fragment only): a blocking gradient all-reduce.
            let until = t.clock + net.global_seconds(payload, SyncMode::Gradients, world_size);
            t.wait(info.step, until);
            gradient_syncs += 1;
        }
        syncs += u64::from(info.sync_after);
        for f in apply_then_send(&mut t, &mut pending, fragments, &info) {
            let share = &shares[f as usize];
            let arrives = t.send(fragment_seconds(share.end - share.start));
            pending.push(Pending { fragment: f, apply_after: info.step + streaming.delay, arrives });
        }
        if info.local_sync_after {
            t.wait(info.step, t.clock + node_average);
            (local_syncs, local_comm) = (local_syncs + 1, local_comm + node_average);
        }
        if info.step + 1 == plan.end_step() {
            let last = pending.iter().map(|p| p.arrives).fold(t.clock, f64::max);
            t.wait(info.step, last);
            if streaming.ends_with_average() {
                let full = SyncPayload { parameter_encoding: qsr_sched::Encoding::F32, ..*payload };
                let until = t.clock + net.global_seconds(&full, SyncMode::Parameters, world_size);
                t.wait(info.step, until);
            }
        }
    }
    let counted = Counted { syncs, gradient_syncs, local_syncs, comm: t.waited, local_comm, epochs: t.epochs };
    Prediction::new(name, plan, (world_size, spe, step_seconds), counted)
}

/// Waits for the averages due after `info`'s step and for those of the fragments about to sync again
/// (the driver applies them first); returns the fragments that sync now.
fn apply_then_send(
    t: &mut Timeline,
    pending: &mut Vec<Pending>,
    fragments: &FragmentPlan,
    info: &StepInfo,
) -> Vec<u32> {
    let due: Vec<u32> = fragments.syncs_after(info).collect();
    let needed = |p: &Pending| p.apply_after <= info.step || due.contains(&p.fragment);
    for p in pending.iter().filter(|p| needed(p)) {
        t.wait(info.step, p.arrives);
    }
    pending.retain(|p| !needed(p));
    due
}
