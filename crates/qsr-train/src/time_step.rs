//! `qsr time-step`: how long one training step of a model takes on one worker (forward, backward, the
//! optimizer and the round driver's bookkeeping, no collective), phase by phase. `cargo xtask bench
//! train` runs it beside the PyTorch peers of `benches/peers/`, and `scripts/gpu-check.sh` on a GPU.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use clap::ValueEnum;
use qsr_comm::InProcessGroup;
use qsr_data::{Corpus, TextWindows};
use qsr_models::{CifarResNetConfig, CnnConfig, GptConfig, InputSpec, ModelConfig};
use qsr_optim::{DriverConfig, OptimizerConfig, PhaseTimes, Worker};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
use serde::Serialize;

use crate::device_spec;

/// Largest `--batch`: beyond it a typo would allocate without bound.
const MAX_BATCH: usize = 1 << 16;
/// The most steps `--steps`, `--warmup` or `--profile` may ask for (the timed steps' times are kept).
const MAX_STEPS: u64 = 1_000_000;
/// The most memory a timed GPT may need, as [`gpt_bytes`] estimates it: past it a typo (`--width
/// 65536`) would ask the allocator for tens of GiB and abort.
const MAX_GPT_BYTES: f64 = 16.0 * (1u64 << 30) as f64;
/// `--threads` may oversubscribe the machine's cores at most this many times.
const MAX_THREADS_PER_CORE: usize = 8;

/// The models `qsr time-step` times, each as `cargo xtask bench train`'s PyTorch peer builds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum StepModel {
    /// The GPT of `qsr_models::Gpt` on Shakespeare's characters (AdamW, clipping at 1; sizes from the flags).
    Gpt,
    /// The small CNN with BatchNorm on 1 x 8 x 8 images, 10 classes (the digits recipes; SGD).
    Cnn,
    /// CIFAR ResNet-20 on 3 x 32 x 32 images, 10 classes (SGD).
    Resnet20,
}

/// `qsr time-step`: the median time of one training step of a model on one worker.
#[derive(Debug, clap::Args)]
pub(crate) struct TimeStepArgs {
    /// The model.
    #[arg(long, value_enum, default_value = "gpt")]
    pub model: StepModel,
    /// Examples per step (default: 16 windows for the GPT, 64 images for the CNN, 128 for ResNet-20).
    #[arg(long)]
    pub batch: Option<usize>,
    /// GPT: tokens per window.
    #[arg(long, default_value_t = 64)]
    pub context: usize,
    /// GPT: blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// GPT: attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// GPT: token width.
    #[arg(long, default_value_t = 64)]
    pub width: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Untimed steps first (allocations, kernel compilation).
    #[arg(long, default_value_t = 5)]
    pub warmup: u64,
    /// Intra-op threads of the CPU backend (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// `cpu` (burn's flex backend), `libtorch` (a build with feature `tch`; set `OMP_NUM_THREADS` for
    /// its threads), `wgpu` (a build with feature `wgpu`) or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Also write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// After the timed steps, run this many more with each kernel timed (one at a time) and print
    /// where the device time goes, kernel by kernel (cubecl devices only).
    #[arg(long, default_value_t = 0)]
    pub profile: u64,
}

/// What `qsr time-step` measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StepTiming {
    /// The model timed.
    pub model: StepModel,
    /// Examples per step.
    pub batch: usize,
    /// Tokens (GPT) or images per example step: what `per_second` counts.
    pub items_per_step: usize,
    /// `tokens` or `images`.
    pub unit: &'static str,
    /// Items per second at the median step time.
    pub per_second: f64,
    /// The median step time, milliseconds.
    pub step_ms_median: f64,
    /// Mean milliseconds per timed step in each phase of the round driver (`PhaseTimes` counts seconds;
    /// here each field is in milliseconds).
    pub phases_ms: PhaseTimes,
    /// Kernels launched per timed step on a cubecl device (wgpu, CUDA); `None` on the CPU.
    pub launches_per_step: Option<f64>,
    /// Whether burn's operation fusion (and autotune) were compiled in: features `cuda` / `wgpu`,
    /// against `cuda-plain` / `wgpu-plain`.
    pub fusion: bool,
    /// With `--profile`: the kernels of a profiled step, the longest-running first.
    pub kernels: Vec<KernelTime>,
}

/// One kernel's share of a profiled step (`qsr time-step --profile`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct KernelTime {
    /// The kernel's name as cubecl shortens it.
    pub name: String,
    /// Launches per step.
    pub launches_per_step: f64,
    /// Milliseconds per step, the kernels run one at a time.
    pub ms_per_step: f64,
}

/// Times the step `args` describe; prints one line to `out` (and writes `--json`).
pub(crate) fn time_step(args: &TimeStepArgs, out: &mut dyn Write) -> Result<StepTiming> {
    if !(1..=MAX_STEPS).contains(&args.steps) {
        return Err(crate::exit::bad_input(anyhow!("--steps must be in 1..={MAX_STEPS}, got {}", args.steps)));
    }
    for (flag, n) in [("--warmup", args.warmup), ("--profile", args.profile)] {
        if n > MAX_STEPS {
            return Err(crate::exit::bad_input(anyhow!("{flag} must be at most {MAX_STEPS}, got {n}")));
        }
    }
    if let Some(b) = args.batch.filter(|b| !(1..=MAX_BATCH).contains(b)) {
        return Err(crate::exit::bad_input(anyhow!("--batch must be in 1..={MAX_BATCH}, got {b}")));
    }
    check_sizes(args).map_err(crate::exit::bad_input)?;
    let device = device_spec::device(&args.device).map_err(crate::exit::bad_input)?;
    device.seed(0);
    // Flex computes on the rayon pool it is called from: its size is the intra-op thread count, and a
    // step that runs inside the pool hands no op to another thread to wait for.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(args.threads.unwrap_or(0)).build()?;
    let timing = pool.install(|| match args.model {
        StepModel::Gpt => time_gpt(args, &device),
        StepModel::Cnn | StepModel::Resnet20 => time_images(args, &device),
    })?;
    let p = &timing.phases_ms;
    let launches = match timing.launches_per_step {
        Some(n) => format!("; {n:.0} kernel launches per step, fusion {}", if timing.fusion { "on" } else { "off" }),
        None => String::new(),
    };
    writeln!(
        out,
        "{:?} batch {}: {:.0} {}/s ({:.2} ms per step, median of {}; forward {:.2}, backward {:.2}, gradients {:.2}, \
         optimizer {:.2}, write-back {:.2} ms{launches})",
        timing.model,
        timing.batch,
        timing.per_second,
        timing.unit,
        timing.step_ms_median,
        args.steps,
        p.forward,
        p.backward,
        p.gradients,
        p.optimizer,
        p.write_back
    )?;
    print_kernels(&timing.kernels, out)?;
    if let Some(path) = &args.json {
        crate::files::write_atomic(path, serde_json::to_string_pretty(&timing)?.as_bytes(), "timing file")?;
    }
    Ok(timing)
}

/// A worker of one rank over `model` whose plan never syncs within the run.
fn worker<M: Module>(model: M, optim: OptimizerConfig, total: u64) -> Result<Worker<M>> {
    let plan =
        Plan::new(LrSchedule::new(ScheduleKind::Constant, total, 0, 1e-3, 1e-3), SyncRule::Constant { h: total })?;
    let comm = Box::new(InProcessGroup::new(1).remove(0));
    Ok(Worker::new(model, optim, comm, plan.cursor(), DriverConfig::default())?)
}

/// The profile's table: the kernels taking 95% of the time, at most 20.
fn print_kernels(kernels: &[KernelTime], out: &mut dyn Write) -> Result<()> {
    if kernels.is_empty() {
        return Ok(());
    }
    let total: f64 = kernels.iter().map(|k| k.ms_per_step).sum();
    writeln!(out, "| kernel | launches per step | ms per step | share |")?;
    writeln!(out, "|---|---|---|---|")?;
    let mut shown = 0.0;
    for k in kernels.iter().take(20) {
        if shown >= 0.95 * total && total > 0.0 {
            break;
        }
        shown += k.ms_per_step;
        let share = if total > 0.0 { 100.0 * k.ms_per_step / total } else { 0.0 };
        writeln!(out, "| {} | {:.1} | {:.3} | {share:.1}% |", k.name, k.launches_per_step, k.ms_per_step)?;
    }
    writeln!(out, "(all {} kernels: {total:.2} ms per step, each run alone)", kernels.len())?;
    Ok(())
}

/// What [`run_timed`] measured: the median step in seconds, the mean phases, launches per step and
/// the profile.
struct Timed {
    median: f64,
    phases_ms: PhaseTimes,
    launches_per_step: Option<f64>,
    kernels: Vec<KernelTime>,
}

/// Runs `warmup + steps` steps with `step`, timing the last `steps`.
fn run_timed<M: Module>(
    args: &TimeStepArgs,
    device: &Device,
    worker: &mut Worker<M>,
    mut step: impl FnMut(&mut Worker<M>, u64) -> Result<()>,
) -> Result<Timed> {
    for s in 0..args.warmup {
        step(worker, s)?;
    }
    worker.take_stats();
    let launches = launches::Count::start(device)?;
    let mut times = Vec::with_capacity(args.steps as usize);
    for s in args.warmup..args.warmup + args.steps {
        let t = Instant::now();
        step(worker, s)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let launches_per_step = launches.finish(device)?.map(|n| n as f64 / args.steps as f64);
    let mut kernels = Vec::new();
    if args.profile > 0 {
        let profile = launches::Profile::start(device)?;
        let first = args.warmup + args.steps;
        for s in first..first + args.profile {
            step(worker, s)?;
        }
        kernels = profile.finish(device, args.profile)?;
    }
    times.sort_by(f64::total_cmp);
    let p = worker.take_stats().phases;
    let per_step = 1e3 / args.steps as f64;
    let mean = PhaseTimes {
        forward: p.forward * per_step,
        backward: p.backward * per_step,
        gradients: p.gradients * per_step,
        optimizer: p.optimizer * per_step,
        write_back: p.write_back * per_step,
    };
    Ok(Timed { median: times[times.len() / 2], phases_ms: mean, launches_per_step, kernels })
}

/// Kernel launches on a cubecl device; nothing to count on the CPU.
mod launches {
    use anyhow::Result;
    use burn::tensor::Device;

    use super::KernelTime;

    /// A count over the steps between [`Count::start`] and [`Count::finish`].
    pub(super) struct Count {
        #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
        count: Option<qsr_kernels::cube::LaunchCount>,
    }

    impl Count {
        /// Starts counting once the device's queued work has run.
        #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
        pub(crate) fn start(device: &Device) -> Result<Count> {
            if !is_cube(device) {
                return Ok(Count { count: None });
            }
            sync(device)?;
            Ok(Count { count: Some(qsr_kernels::cube::LaunchCount::start()) })
        }

        /// The launches since [`Count::start`], once the device has run them.
        #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
        pub(crate) fn finish(self, device: &Device) -> Result<Option<u64>> {
            let Some(count) = self.count else { return Ok(None) };
            sync(device)?;
            Ok(Some(count.launches()))
        }

        #[cfg(not(any(feature = "cuda-plain", feature = "wgpu-plain")))]
        pub(super) fn start(_device: &Device) -> Result<Count> {
            Ok(Count {})
        }

        #[cfg(not(any(feature = "cuda-plain", feature = "wgpu-plain")))]
        pub(super) fn finish(self, _device: &Device) -> Result<Option<u64>> {
            Ok(None)
        }
    }

    /// Each kernel timed over the steps between [`Profile::start`] and [`Profile::finish`].
    pub(super) struct Profile(Count);

    impl Profile {
        /// Starts timing kernels once the device's queued work has run (CPU: nothing to time).
        #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
        pub(crate) fn start(device: &Device) -> Result<Profile> {
            if !is_cube(device) {
                return Ok(Profile(Count { count: None }));
            }
            sync(device)?;
            Ok(Profile(Count { count: Some(qsr_kernels::cube::LaunchCount::start_timed()) }))
        }

        #[cfg(not(any(feature = "cuda-plain", feature = "wgpu-plain")))]
        pub(super) fn start(_device: &Device) -> Result<Profile> {
            Ok(Profile(Count {}))
        }

        /// The kernels of the `steps` profiled steps, per step, the longest-running first.
        #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
        pub(crate) fn finish(self, device: &Device, steps: u64) -> Result<Vec<KernelTime>> {
            let Some(count) = self.0.count else { return Ok(Vec::new()) };
            sync(device)?;
            let per_step = |x: f64| x / steps as f64;
            Ok(count
                .kernels()
                .into_iter()
                .map(|k| KernelTime {
                    name: k.name,
                    launches_per_step: per_step(k.launches as f64),
                    ms_per_step: per_step(1e3 * k.seconds),
                })
                .collect())
        }

        #[cfg(not(any(feature = "cuda-plain", feature = "wgpu-plain")))]
        pub(super) fn finish(self, _device: &Device, _steps: u64) -> Result<Vec<KernelTime>> {
            Ok(Vec::new())
        }
    }

    #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
    fn is_cube(device: &Device) -> bool {
        let probe = burn::tensor::Tensor::<1>::zeros([1], &device.clone().inner());
        probe.try_into_primitive::<burn::backend::Cube>().is_ok()
    }

    #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
    fn sync(device: &Device) -> Result<()> {
        device.sync().map_err(|e| anyhow::anyhow!("the device failed: {e:?}"))
    }
}

/// Refuses a GPT whose memory [`gpt_bytes`] puts above [`MAX_GPT_BYTES`] (naming its size flags), and
/// more threads than [`MAX_THREADS_PER_CORE`] per core.
fn check_sizes(args: &TimeStepArgs) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if let Some(t) = args.threads.filter(|&t| t == 0 || t > MAX_THREADS_PER_CORE * cores) {
        bail!(
            "--threads must be in 1..={} ({MAX_THREADS_PER_CORE} per core of this machine's {cores}), got {t}",
            MAX_THREADS_PER_CORE * cores
        );
    }
    if args.model != StepModel::Gpt {
        return Ok(());
    }
    let bytes = gpt_bytes(args, args.batch.unwrap_or(GPT_BATCH));
    if bytes > MAX_GPT_BYTES {
        bail!(
            "a GPT of --layers {} --width {} --heads {} --context {} at batch {} needs about {:.0} GiB (parameters, gradients, \
             AdamW's moments and activations), above the {:.0} GiB this command allows: lower --layers, --width or --context",
            args.layers,
            args.width,
            args.heads,
            args.context,
            args.batch.unwrap_or(GPT_BATCH),
            bytes / (1u64 << 30) as f64,
            MAX_GPT_BYTES / (1u64 << 30) as f64
        );
    }
    Ok(())
}

/// Examples per GPT step without `--batch`.
const GPT_BATCH: usize = 16;

/// About the bytes a GPT step of `args` holds at once, in f32: parameters with their gradients and two
/// AdamW moments (blocks of `12 width^2`, embeddings of a byte-sized vocabulary), and activations (per
/// block about `16 width` values and the heads' `context x context` attention per token).
fn gpt_bytes(args: &TimeStepArgs, batch: usize) -> f64 {
    let (l, w, c, h, b) = (args.layers as f64, args.width as f64, args.context as f64, args.heads as f64, batch as f64);
    let params = 12.0 * l * w * w + 2.0 * 256.0 * w + c * w;
    let activations = b * c * l * (16.0 * w + h * c);
    4.0 * (4.0 * params + activations)
}

fn time_gpt(args: &TimeStepArgs, device: &Device) -> Result<StepTiming> {
    let batch = args.batch.unwrap_or(GPT_BATCH);
    let corpus = Corpus::comedy_of_errors();
    let config = GptConfig {
        vocab_size: corpus.vocab().len(),
        context: args.context,
        layers: args.layers,
        heads: args.heads,
        width: args.width,
        dropout: 0.0,
        bias: true,
    };
    let optim = OptimizerConfig { clip_grad_norm: Some(1.0), ..OptimizerConfig::adamw(0.1) };
    let mut worker = worker(config.init(device)?, optim, args.warmup + args.steps + args.profile)?;
    let windows = TextWindows::new(&corpus, (args.context, batch), 0, 0, 1)?;
    let ids = |t: &[u32]| {
        let v: Vec<i64> = t.iter().map(|&x| i64::from(x)).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [batch, args.context]), device)
    };
    let timed = run_timed(args, device, &mut worker, |w, s| {
        let b = windows.batch(s);
        w.step(|m, _| {
            let logits = m.forward(ids(&b.inputs))?;
            let [n, t, v] = logits.dims();
            Ok(qsr_models::fused::cross_entropy(logits.reshape([n * t, v]), ids(&b.targets).reshape([n * t]), None))
        })?;
        Ok(())
    })?;
    Ok(finish(args.model, batch, batch * args.context, "tokens", timed))
}

fn time_images(args: &TimeStepArgs, device: &Device) -> Result<StepTiming> {
    let (config, input, batch) = match args.model {
        StepModel::Resnet20 => (
            ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: Default::default() }),
            InputSpec::new(3, 32, 32),
            args.batch.unwrap_or(128),
        ),
        _ => (ModelConfig::Cnn(CnnConfig::default()), InputSpec::new(1, 8, 8), args.batch.unwrap_or(64)),
    };
    let classes = 10;
    let mut worker = worker(
        config.init(input, classes, device)?,
        OptimizerConfig::sgd(0.9, 5e-4),
        args.warmup + args.steps + args.profile,
    )?;
    // Fixed, seeded inputs: the step's time does not depend on the pixel values.
    let images =
        Tensor::<4>::random([batch, input.channels, input.height, input.width], Distribution::Normal(0.0, 1.0), device);
    let labels: Vec<i64> = (0..batch as i64).map(|i| i % classes as i64).collect();
    let labels = Tensor::<1, Int>::from_data(TensorData::new(labels, [batch]), device);
    let ce = CrossEntropyLossConfig::new().init(device);
    let timed = run_timed(args, device, &mut worker, |w, _| {
        w.step(|m, _| Ok(ce.forward(m.forward(images.clone()), labels.clone())))?;
        Ok(())
    })?;
    Ok(finish(args.model, batch, batch, "images", timed))
}

fn finish(model: StepModel, batch: usize, items: usize, unit: &'static str, timed: Timed) -> StepTiming {
    StepTiming {
        model,
        batch,
        items_per_step: items,
        unit,
        per_second: items as f64 / timed.median,
        step_ms_median: 1e3 * timed.median,
        phases_ms: timed.phases_ms,
        launches_per_step: timed.launches_per_step,
        fusion: qsr_optim::FUSION,
        kernels: timed.kernels,
    }
}
