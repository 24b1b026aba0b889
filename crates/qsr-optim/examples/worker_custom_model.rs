//! `Worker`, the second way in: qsr's PyTorch-exact AdamW over flat state, driven step by step by a
//! `qsr-sched` plan (warmup + cosine, QSR), with your own burn module. Two workers on threads fit
//! y = sin(x0) + x1 on their own seeded data; the syncs equal the planned rounds.
//!
//! ```sh
//! cargo run --release -p qsr-optim --example worker_custom_model
//! ```

use burn::module::Module;
use burn::nn::{Gelu, Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use qsr_optim::{DriverConfig, OptimizerConfig, ParamLayout, Worker};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};

/// Your model: any burn module.
#[derive(Module, Debug)]
struct Regressor {
    fc1: Linear,
    act: Gelu,
    fc2: Linear,
}

impl Regressor {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(2, 32).init(device),
            act: Gelu::new(),
            fc2: LinearConfig::new(32, 1).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

/// Worker `rank`'s batch of 32 at `step` (a small xorshift generator: seeded, no dependency).
fn batch(rank: usize, step: u64, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let mut s = ((rank as u64 + 1) * 0x9e37_79b9_7f4a_7c15) ^ step.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    };
    let x: Vec<f32> = (0..64).map(|_| next()).collect();
    let y: Vec<f32> = x.chunks(2).map(|p| p[0].sin() + p[1]).collect();
    (Tensor::from_data(TensorData::new(x, [32, 2]), device), Tensor::from_data(TensorData::new(y, [32, 1]), device))
}

fn main() {
    let plan = Plan::new(
        LrSchedule::new(ScheduleKind::Cosine, 400, 40, 0.01, 1e-5),
        SyncRule::Qsr { h_base: 2, alpha: 0.004 },
    )
    .unwrap();
    let device = Device::flex().autodiff();
    // Build once, then give each worker a replica (the Worker also broadcasts rank 0's weights).
    let model = Regressor::new(&device);
    ParamLayout::of(&model).read_params(&model, &mut vec![0.0; ParamLayout::of(&model).len()]).unwrap();
    let results = qsr_comm::run_threads(2, |comm| {
        let rank = qsr_comm::Collective::rank(&comm);
        let mut w = Worker::new(
            model.clone(),
            OptimizerConfig::adamw(0.01),
            Box::new(comm),
            plan.cursor(),
            DriverConfig::default(),
        )
        .unwrap();
        let mut loss = 0.0;
        while !w.cursor().is_done() {
            let t = w.cursor().step();
            let r = w
                .step(|m: &Regressor, _| {
                    let (x, y) = batch(rank, t, &device);
                    Ok((m.forward(x) - y).powi_scalar(2).mean())
                })
                .unwrap();
            loss = r.loss;
        }
        (w.stats().syncs, loss)
    });
    let planned = plan.summary();
    for (rank, (syncs, loss)) in results.iter().enumerate() {
        println!(
            "rank {rank}: {syncs} syncs (plan: {} rounds, {:.1}% of data parallel), last loss {loss:.4}",
            planned.rounds, planned.comm_percent
        );
        assert_eq!(*syncs, planned.rounds);
    }
}
