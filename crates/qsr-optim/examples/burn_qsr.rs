//! `burn_plain.rs` with QSR added (the lines marked `QSR`): 4 workers as threads, or one rank per process
//! under `qsr launch` (or torchrun, mpirun, srun), each on its own shard of the data, saving after each epoch
//! when given a directory and resuming from its latest save.
//!
//! ```sh
//! cargo run --release -p qsr-optim --example burn_qsr                      # 4 threads
//! cargo build --release -p qsr-optim --example burn_qsr && cargo install --path crates/qsr-launch
//! qsr-launch --nproc 2 -- target/release/examples/burn_qsr                 # 2 processes
//! qsr-launch --nproc 2 -- target/release/examples/burn_qsr ckpt            # saving into ckpt/rank-R
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;

use burn::data::dataloader::{DataLoaderBuilder, batcher::Batcher};
use burn::data::dataset::{Dataset, InMemDataset};
use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
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

/// The directory the run saves into after each epoch (`DIR/epoch-E`) and resumes from: the program's
/// first argument, if any.
fn checkpoint_dir() -> Option<PathBuf> {
    std::env::args_os().nth(1).map(PathBuf::from)
}

/// The latest epoch saved whole under `dir`, and its directory.
fn latest(dir: &Path) -> anyhow::Result<Option<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        entries => entries.with_context(|| format!("cannot read {}", dir.display()))?,
    };
    let mut last = None;
    for entry in entries {
        let name = entry.with_context(|| format!("cannot read {}", dir.display()))?.file_name();
        let epoch = name.to_str().and_then(|n| n.strip_prefix("epoch-")?.parse::<u64>().ok());
        last = last.max(epoch);
    }
    Ok(last.map(|e| (e, dir.join(format!("epoch-{e}")))))
}

/// An empty directory to write epoch `epoch`'s checkpoint into; [`commit`] makes it `epoch-E`, so a run
/// stopped while saving resumes from the epoch before.
fn staging(dir: &Path, epoch: u64) -> anyhow::Result<PathBuf> {
    let to = dir.join(format!("epoch-{epoch}.partial"));
    if to.exists() {
        std::fs::remove_dir_all(&to).with_context(|| format!("cannot remove {}", to.display()))?;
    }
    std::fs::create_dir_all(&to).with_context(|| format!("cannot create {}", to.display()))?;
    Ok(to)
}

fn commit(staged: &Path) -> anyhow::Result<()> {
    let done = staged.with_extension("");
    std::fs::rename(staged, &done).with_context(|| format!("cannot rename {} to {}", staged.display(), done.display()))
}

/// Saves what decides the next step besides the data order (which depends on the epoch alone): the
/// model, the optimizer's state and the lr scheduler's.
fn save(to: &Path, model: &Mlp, optim: &ModuleOptimizer, sched: &ModuleLrScheduler) -> anyhow::Result<()> {
    let (m, o, s) = (to.join("model.bpk"), to.join("optim.bpk"), to.join("sched.bpk"));
    model.clone().save_file(&m).with_context(|| format!("cannot save {}", m.display()))?;
    optim.save(&o).with_context(|| format!("cannot save {}", o.display()))?;
    sched.to_record().save(&s).with_context(|| format!("cannot save {}", s.display()))
}

/// A model with its optimizer and lr scheduler, as [`save`] writes them.
type Saved = (Mlp, ModuleOptimizer, ModuleLrScheduler);

/// Loads what [`save`] wrote into `from`.
fn load(from: &Path, model: Mlp, optim: ModuleOptimizer, sched: ModuleLrScheduler) -> anyhow::Result<Saved> {
    let (m, o, s) = (from.join("model.bpk"), from.join("optim.bpk"), from.join("sched.bpk"));
    let model = model.try_load_file(&m).with_context(|| format!("cannot load {}", m.display()))?;
    let optim = optim.load(&o).with_context(|| format!("cannot load {}", o.display()))?;
    let record = LrSchedulerRecord::load(&s).with_context(|| format!("cannot load {}", s.display()))?;
    Ok((model, optim, sched.load_record(record)))
}

/// Trains, saving after each epoch when given a directory and resuming from its latest save, and
/// returns the test accuracy.
fn train(comm: Box<dyn qsr_optim::comm::Collective>) -> anyhow::Result<f64> {
    let device = Device::flex().autodiff();
    let train = Arc::new(qsr_optim::ShardedDataset::new(blobs(1000, SEED), comm.rank(), comm.world_size(), SEED)?);
    let steps = EPOCHS as usize * train.len().div_ceil(BATCH); // this rank's steps: its batches times the epochs
    let mut sched = CosineAnnealingLrSchedulerConfig::new(0.01, steps).init().map_err(anyhow::Error::msg)?;
    device.seed(SEED);
    let mut model = Mlp::new(&device);
    let ckpt = checkpoint_dir().map(|dir| dir.join(format!("rank-{}", comm.rank()))); // QSR (resume): each rank its own
    let config = qsr_optim::AveragerConfig::qsr(2, 0.0025).schedule(&sched, steps); // QSR: your scheduler's lrs pick H
    let mut avg = qsr_optim::Averager::new(&mut model, config, comm)?; // QSR: rank 0's weights everywhere
    let mut optim = AdamWConfig::new().init();
    let mut start = 0;
    if let Some((epoch, from)) = ckpt.as_deref().map(latest).transpose()?.flatten() {
        println!("resuming after epoch {epoch} from {}", from.display());
        (model, optim, sched) = load(&from, model, optim, sched)?;
        avg.restore(qsr_optim::AveragerState::load(&from.join("averager.safetensors"))?)?; // QSR (resume): where its rounds stood
        start = epoch;
    }
    // One loader, without `.shuffle`: its generator would restart with the process, and a resumed run see another order.
    let loader = DataLoaderBuilder::new(PointBatcher).batch_size(BATCH).build(Arc::clone(&train));
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    for epoch in train.epochs(start..EPOCHS) {
        for batch in loader.iter() {
            let (x, y) = batch?;
            let lr = sched.step();
            let loss = loss_fn.forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr, model, grads);
            model = avg.step(model)?; // QSR: averages when a round ends, and at the last step
        }
        if let Some(dir) = &ckpt {
            let to = staging(dir, epoch + 1)?;
            save(&to, &model, &optim, &sched)?;
            avg.state()?.save(&to.join("averager.safetensors"))?; // QSR (resume): where its rounds stand
            commit(&to)?;
        }
    }
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
    qsr_optim::try_run_workers(4, train)?.into_iter().try_for_each(report) // QSR: threads or ranks
}
