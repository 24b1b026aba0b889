//! `burn_plain.rs` with QSR added (the lines marked `QSR`): 4 workers as threads, or one rank per process
//! under `qsr launch` (or torchrun, mpirun, srun), each on its own shard of the data.
//!
//! ```sh
//! cargo run --release -p qsr-optim --example burn_qsr                      # 4 threads
//! cargo build --release -p qsr-optim --example burn_qsr && cargo build --release --bin qsr
//! target/release/qsr launch --nproc 2 -- target/release/examples/burn_qsr  # 2 processes
//! ```

use std::sync::Arc;

use burn::data::dataloader::{DataLoaderBuilder, batcher::Batcher};
use burn::data::dataset::{Dataset, InMemDataset};
use burn::lr_scheduler::step::StepLrSchedulerConfig;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};

const SEED: u64 = 42;
const EPOCHS: u64 = 4;
const BATCH: usize = 32;

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(8, 64).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(64, 4).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

#[derive(Clone, Debug)]
struct Point {
    x: [f32; 8],
    label: i64,
}

/// Four overlapping Gaussian blobs in 8-D, stored class by class (as many datasets on disk are).
fn blobs(per_class: usize, seed: u64) -> InMemDataset<Point> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let points = (0..4i64)
        .flat_map(|label| std::iter::repeat_n(label, per_class))
        .map(|label| Point {
            x: std::array::from_fn(|i| rng.random_range(-1.0..1.0) + if i as i64 == label { 1.5 } else { 0.0 }),
            label,
        })
        .collect();
    InMemDataset::new(points)
}

#[derive(Clone, Debug)]
struct PointBatcher;

impl Batcher<Point, (Tensor<2>, Tensor<1, Int>)> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let x: Vec<f32> = items.iter().flat_map(|p| p.x).collect();
        let y: Vec<i64> = items.iter().map(|p| p.label).collect();
        let n = items.len();
        (Tensor::from_data(TensorData::new(x, [n, 8]), device), Tensor::from_data(TensorData::new(y, [n]), device))
    }
}

/// Trains and returns the test accuracy.
fn train(comm: Box<dyn qsr_comm::Collective>) -> anyhow::Result<f64> {
    let device = Device::flex().autodiff();
    let model = qsr_optim::seeded_init(&device, SEED, || Mlp::new(&device)); // QSR: threads share burn's RNG
    let train = Arc::new(qsr_data::ShardedDataset::new(blobs(1000, SEED), comm.rank(), comm.world_size(), SEED)?);
    let (mut avg, mut model) = qsr_optim::Averager::new(model, qsr_optim::AveragerConfig::qsr(2, 0.0025), comm)?;
    let loader = DataLoaderBuilder::new(PointBatcher).batch_size(BATCH).shuffle(SEED).build(Arc::clone(&train));
    let mut optim = AdamWConfig::new().init();
    let mut sched = StepLrSchedulerConfig::new(0.01, 60).init().map_err(anyhow::Error::msg)?;
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    for epoch in 0..EPOCHS {
        train.set_epoch(epoch); // QSR: this epoch's shard
        for batch in loader.iter() {
            let (x, y) = batch?;
            let lr = sched.step();
            let loss = loss_fn.forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr.clone(), model, grads);
            model = avg.step(model, lr.base())?; // QSR: averages when a round ends
        }
    }
    let model = avg.finish(model)?; // QSR: the last round
    let test = blobs(250, SEED + 1);
    let (x, y) = PointBatcher.batch(test.iter().collect::<Result<_, _>>()?, &Device::flex());
    let correct: i64 = model.valid().forward(x).argmax(1).squeeze_dim::<1>(1).equal(y).int().sum().into_scalar();
    Ok(correct as f64 / test.len() as f64)
}

fn report(accuracy: f64) -> anyhow::Result<()> {
    println!("test accuracy {:.2}%", 100.0 * accuracy);
    anyhow::ensure!(accuracy > 0.8, "the model did not learn");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    qsr_comm::run_workers(4, train)?.into_iter().try_for_each(|accuracy| report(accuracy?)) // QSR: threads or ranks
}
