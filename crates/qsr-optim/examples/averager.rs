//! QSR added to a plain burn training loop: burn's own SGD (momentum 0.9) and cosine lr scheduler, an MLP
//! on the embedded digits, K workers each on its own shard, parameters averaged by a [`qsr_optim::Averager`]
//! whenever a QSR round ends. Prints the syncs next to the planned rounds and the test accuracy, for 4
//! workers as threads, or for the ranks of a launch (`qsr launch`, torchrun, mpirun, srun) over qsr's
//! TCP ring; fails if syncs differ from the plan.
//!
//! ```sh
//! cargo run --release -p qsr-optim --example averager                          # 4 threads
//! qsr-launch --nproc 2 -- target/release/examples/averager                  # 2 processes
//! ```

use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, SgdConfig, momentum::MomentumConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use qsr_comm::Collective;
use qsr_data::{Dataset, Split};
use qsr_optim::{Averager, AveragerConfig};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};

const STEPS: usize = 600;
const BATCH: usize = 16;
const LR: f64 = 0.2;

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(64, 64).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(64, 10).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

/// Images `idx` of a split as (pixels / 16, labels).
fn tensors(set: &qsr_data::ImageSet, idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let x: Vec<f32> =
        idx.iter().flat_map(|&i| set.images[i * 64..(i + 1) * 64].iter().map(|&p| f32::from(p) / 16.0)).collect();
    let y: Vec<i64> = idx.iter().map(|&i| i64::from(set.labels[i])).collect();
    (
        Tensor::from_data(TensorData::new(x, [idx.len(), 64]), device),
        Tensor::from_data(TensorData::new(y, [idx.len()]), device),
    )
}

/// One worker: a plain burn loop; the lines that add QSR are marked.
fn worker(comm: Box<dyn Collective>, rule: SyncRule) -> anyhow::Result<(usize, u64, f64)> {
    let device = Device::flex().autodiff();
    let (rank, k) = (comm.rank(), comm.world_size());
    let train = qsr_data::digits(Split::Train);
    device.seed(7); // rank 0 draws alone under `run_workers`' threads: the same weights on every rerun
    let mut model = Mlp::new(&device);
    let mut optim = SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9))).init();
    let mut sched = CosineAnnealingLrSchedulerConfig::new(LR, STEPS).init().map_err(anyhow::Error::msg)?;
    let config = AveragerConfig::new(rule, 0).schedule(&sched, STEPS); // QSR: the lrs that pick H
    let mut avg = Averager::new(&mut model, config, comm)?; // QSR: rank 0's weights everywhere
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let shard: Vec<usize> = (rank..train.len()).step_by(k).collect();
    for step in 0..STEPS {
        let lr = sched.step();
        let idx: Vec<usize> = (0..BATCH).map(|j| shard[(step * BATCH + j * 7919) % shard.len()]).collect();
        let (x, y) = tensors(&train, &idx, &device);
        let loss = loss_fn.forward(model.forward(x), y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        model = avg.step(model)?; // QSR: averages when a round ends, and at the last step
    }
    let test = qsr_data::digits(Split::Test);
    let all: Vec<usize> = (0..test.len()).collect();
    let (x, y) = tensors(&test, &all, &Device::flex());
    let pred = model.valid().forward(x).argmax(1).squeeze_dim::<1>(1);
    let correct: i64 = pred.equal(y).int().sum().into_scalar();
    Ok((rank, avg.stats().syncs, correct as f64 / test.len() as f64))
}

fn run() -> anyhow::Result<()> {
    let rule = SyncRule::Qsr { h_base: 2, alpha: 0.06 };
    // The rounds qsr-sched plans for burn's cosine schedule (burn's starts at step 0 with the peak lr).
    let plan = Plan::from_parts(LrSchedule::new(ScheduleKind::Cosine, STEPS as u64, 0, LR, 0.0), rule.clone(), None)?;
    // 4 threads, or this process's rank when a launcher started it.
    for result in qsr_comm::run_workers(4, |c| worker(c, rule.clone()))? {
        let (rank, syncs, acc) = result?;
        if rank == 0 {
            println!(
                "syncs {syncs} (plan: {} rounds, {:.1}% of data parallel), test accuracy {:.2}%",
                plan.summary().rounds,
                plan.summary().comm_percent,
                100.0 * acc
            );
        }
        anyhow::ensure!(
            syncs == plan.summary().rounds,
            "rank {rank}: {syncs} synchronizations, the plan has {}",
            plan.summary().rounds
        );
    }
    Ok(())
}

/// Under a launcher, a rank stopped only by another rank's failure exits with
/// `qsr_comm::EXIT_PEER_FAILED`, so that `qsr launch` names the rank that failed first.
fn main() -> std::process::ExitCode {
    qsr_comm::exit_code(run())
}
