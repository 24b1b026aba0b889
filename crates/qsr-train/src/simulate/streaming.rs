//! The prediction of a streaming recipe (`[sync.streaming]`): fragments' all-reduces overlap the steps.

use qsr_optim::StreamingConfig;
use qsr_sched::{FragmentPlan, SyncMode, split_elements};

use super::{Cluster, Prediction, SyncPayload};

/// An average on the link: when it arrives, and the step after which the worker needs it.
struct Pending {
    fragment: u32,
    apply_after: u64,
    arrives: f64,
}

/// [`super::predict`] of a streaming recipe. Each fragment's all-reduce (its share of the parameters,
/// split evenly) queues on the link when the fragment syncs and runs while the workers step, one at a
/// time in the order sent; a worker waits only where an average is due (`delay` steps after it was
/// sent, or earlier when its fragment syncs again) and has not arrived. The run's last step settles
/// every average and, with more than one fragment or `mix < 1`, averages all parameters in f32 at
/// once, as the driver does. `comm_seconds` is the time the workers waited.
pub(super) fn predict_streaming(
    name: &str,
    (fragments, streaming): (&FragmentPlan, &StreamingConfig),
    step_seconds: f64,
    payload: &SyncPayload,
    world_size: usize,
    (net, spe): (Cluster, Option<u64>),
) -> Prediction {
    let plan = fragments.plan();
    let steps = plan.end_step();
    let spe = spe.filter(|&s| s > 0);
    let mut epochs = vec![0.0; spe.map_or(0, |s| steps.div_ceil(s) as usize)];
    let shares = split_elements(payload.gradient_elements, fragments.fragments());
    let cost = |elements: u64| {
        let part = SyncPayload { parameter_elements: elements, ..*payload };
        net.global_seconds(&part, SyncMode::Parameters, world_size)
    };
    let (mut clock, mut link_free, mut waited) = (0.0f64, 0.0f64, 0.0f64);
    let mut pending: Vec<Pending> = Vec::new();
    let mut wait = |clock: &mut f64, until: f64, step: u64, epochs: &mut [f64]| {
        let w = (until - *clock).max(0.0);
        *clock += w;
        waited += w;
        if let Some(e) = spe.and_then(|s| epochs.get_mut((step / s) as usize)) {
            *e += w;
        }
    };
    let (mut syncs, mut gradient_syncs) = (0, 0);
    for info in plan.cursor() {
        clock += step_seconds;
        if let Some(e) = spe.and_then(|s| epochs.get_mut((info.step / s) as usize)) {
            *e += step_seconds;
        }
        if info.mode == SyncMode::Gradients {
            // Data-parallel steps (a stream of one fragment only): a blocking gradient all-reduce.
            let until = clock + net.global_seconds(payload, SyncMode::Gradients, world_size);
            wait(&mut clock, until, info.step, &mut epochs);
            gradient_syncs += 1;
        }
        syncs += u64::from(info.sync_after);
        let due: Vec<u32> = fragments.syncs_after(&info).collect();
        // Averages due now, and those of fragments about to sync again, must have arrived.
        let needed = |p: &Pending| p.apply_after <= info.step || due.contains(&p.fragment);
        for p in pending.iter().filter(|p| needed(p)) {
            wait(&mut clock, p.arrives, info.step, &mut epochs);
        }
        pending.retain(|p| !needed(p));
        for f in due {
            let start = clock.max(link_free);
            link_free = start + cost(shares[f as usize].end - shares[f as usize].start);
            pending.push(Pending { fragment: f, apply_after: info.step + streaming.delay, arrives: link_free });
        }
        if info.step + 1 == steps {
            let last = pending.iter().map(|p| p.arrives).fold(clock, f64::max);
            wait(&mut clock, last, info.step, &mut epochs);
            if fragments.fragments() > 1 || streaming.mix < 1.0 {
                let full = SyncPayload { parameter_encoding: qsr_sched::Encoding::F32, ..*payload };
                let until = clock + net.global_seconds(&full, SyncMode::Parameters, world_size);
                wait(&mut clock, until, info.step, &mut epochs);
            }
        }
    }
    let compute = steps as f64 * step_seconds;
    Prediction {
        name: name.to_string(),
        rule: plan.sync().name().to_string(),
        world_size,
        steps,
        steps_per_epoch: spe,
        syncs,
        gradient_syncs,
        comm_percent: 100.0 * syncs as f64 / steps.max(1) as f64,
        step_seconds,
        compute_seconds: compute,
        local_syncs: 0,
        comm_seconds: waited,
        local_comm_seconds: 0.0,
        total_seconds: compute + waited,
        epoch_seconds: epochs,
    }
}
