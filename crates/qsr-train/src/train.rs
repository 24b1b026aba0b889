//! The training loop (documented on [`run_worker`]).

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use qsr_comm::Collective;
use qsr_data::Split;
use qsr_models::{Gpt, GptConfig, InputSpec, Model};
use qsr_optim::{DeviceGroup, Level, OptimState, OptimizerKind, StepReport, Worker};
use qsr_sched::{Cursor, Plan};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointState, Counters};
use crate::task::{Eval, ImageTask, Task, TextTask, check_vocab, transform};
use crate::train_recipe::{TrainRecipe, open_corpus, open_dataset};

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Record {
    /// `sync`, `eval`, or `membership` (an elastic run's change of workers, at the step it continues from).
    pub kind: String,
    /// Steps completed.
    pub step: u64,
    /// Epochs completed: `step / steps_per_epoch` (fractional).
    pub epoch: f64,
    /// Learning rate of the last step completed.
    pub lr: f64,
    /// Length of the round that just ended (sync) or is under way (eval).
    pub h: u64,
    /// Rank 0's mean training loss since the previous sync record, over the steps whose loss was
    /// finite (sync; `null` when none was); test loss (eval).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Top-1 test accuracy as a fraction in `[0, 1]` (eval records only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Synchronizations so far (counted across resumes).
    pub syncs: u64,
    /// Bytes rank 0 sent for synchronizations so far.
    pub bytes: u64,
    /// Seconds rank 0 spent in synchronizations so far.
    pub comm_seconds: f64,
    /// Seconds of training so far (across resumes, excluding the time between a stop and its resume).
    pub wall_seconds: f64,
    /// Local averages inside rank 0's node so far (two-level runs; `syncs` counts the global ones).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local_syncs: u64,
    /// Bytes rank 0 sent for local averages so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local_bytes: u64,
    /// The change of a `membership` record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<MembershipChange>,
}

/// A change of an elastic run's workers (`qsr train --elastic`): a `membership` record of
/// `metrics.jsonl` and an entry of `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MembershipChange {
    /// The generation that formed (0 is the first; one more per change).
    pub generation: u64,
    /// Workers in it.
    pub world_size: usize,
    /// Workers of the previous generation left out, by their rank there, with the store's reason.
    pub lost: Vec<qsr_comm::Lost>,
    /// Ranks of the workers that joined.
    pub joined: Vec<usize>,
    /// What the survivors saw: the failure that ended the round, or the admission of new workers.
    pub reason: String,
    /// Rounds abandoned: 1 when a round was under way, 0 when the change came at a sync.
    pub rounds_lost: u64,
    /// Steps trained again because the round they belonged to was abandoned.
    pub steps_lost: u64,
}

/// JSON writes a float that is not finite as `null`; read it back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The local level of a two-level run in `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LocalLevel {
    /// The local rule's name.
    pub rule: String,
    /// Workers in rank 0's node.
    pub node_size: usize,
    /// Local averages performed (counted across resumes).
    pub syncs: u64,
    /// Local averages in the plan.
    pub planned_syncs: u64,
    /// Bytes rank 0 sent for local averages over the run.
    pub bytes_per_rank: u64,
    /// Seconds rank 0 spent in local averages over the run.
    pub comm_seconds: f64,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    /// The recipe's `name`.
    pub name: String,
    /// The sync rule's name (`dp`, `constant`, `qsr`, ...).
    pub rule: String,
    /// The recipe's `seed`.
    pub seed: u64,
    /// K: the number of workers.
    pub world_size: usize,
    /// Steps of the whole run (the plan's end step, including steps done before a resume).
    pub steps: u64,
    /// `steps / steps_per_epoch`.
    pub epochs: f64,
    /// Steps per epoch: `floor(N / (K * train.local_batch))` for N training images.
    pub steps_per_epoch: usize,
    /// Top-1 accuracy of the final evaluation, as a fraction in `[0, 1]`: of the test images' class, or
    /// of the next token of the validation windows (language models).
    pub final_test_accuracy: f64,
    /// Mean loss of the final evaluation: on the test split, or per token on the validation windows
    /// (`null` in the file when it is not finite: a diverged run's).
    #[serde(deserialize_with = "nan_if_null")]
    pub final_test_loss: f64,
    /// Global synchronizations performed (counted across resumes).
    pub syncs: u64,
    /// Global synchronizations in the plan (its rounds).
    pub planned_syncs: u64,
    /// The local level of a two-level run (`[sync.local]`), counted apart from the global one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalLevel>,
    /// The plan's `100 * rounds / steps`: data parallel is 100.
    pub comm_percent: f64,
    /// Bytes rank 0 sent for synchronizations over the run.
    pub bytes_per_rank: u64,
    /// Seconds rank 0 spent in synchronizations over the run.
    pub comm_seconds: f64,
    /// Seconds of training over the run (excluding the time between a stop and its resume).
    pub wall_seconds: f64,
    /// Steps this process ran divided by its own wall time (this segment only after a resume).
    pub steps_per_second: f64,
    /// Updates skipped for non-finite gradients.
    pub skipped_updates: u64,
    /// Language models: the unigram entropy of the training tokens in nats, the loss of a predictor that
    /// ignores the context, which `final_test_loss` (the validation loss) should fall well below.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unigram_entropy: Option<f64>,
    /// The changes of workers of an elastic run, in order (`world_size` is the last generation's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub membership: Vec<MembershipChange>,
    /// Why the run diverged, when it did (`qsr` then exits with status 4; the final evaluation is
    /// the one that saw it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diverged: Option<String>,
}

/// Everything a worker needs besides its collective and its model replica.
#[derive(Clone)]
pub struct RunSpec {
    /// The resolved recipe every worker trains.
    pub recipe: TrainRecipe,
    /// The device this worker computes on.
    pub device: Device,
    /// The run directory (rank 0 writes metrics, summary and the shared checkpoint files; every rank
    /// writes its optimizer state into the checkpoint).
    pub run_dir: PathBuf,
    /// Continue from this checkpoint.
    pub resume: Option<(PathBuf, CheckpointState)>,
    /// Show a progress bar (rank 0).
    pub progress: bool,
    /// Stop after the first checkpoint at or past this step (for tests of resumption).
    pub halt_after: Option<u64>,
}

/// What a worker returns.
pub struct Outcome {
    /// The worker's rank.
    pub rank: usize,
    /// The worker's flat parameters when it stopped.
    pub params: Vec<f32>,
    /// The run's summary: on rank 0 of a finished run that evaluated, `None` elsewhere.
    pub summary: Option<Summary>,
    /// False when the run halted early (`halt_after`).
    pub finished: bool,
}

/// A recipe's network, built once and copied to every worker.
// Built once per worker and moved into it at once: boxing would save nothing worth an indirection.
#[allow(clippy::large_enum_variant)]
pub enum TrainModel {
    /// An image classifier (`model.kind` resnet, cifar-resnet, vit, cnn, mlp).
    Image(Model),
    /// A language model (`model.kind = "gpt"`).
    Language(Gpt),
}

impl TrainModel {
    /// A copy for one more worker (image models get their own BatchNorm state).
    pub fn replica(&self) -> Self {
        match self {
            TrainModel::Image(m) => TrainModel::Image(m.deep_clone()),
            TrainModel::Language(m) => TrainModel::Language(m.clone()),
        }
    }

    /// Trainable parameters (BN running statistics excluded).
    pub fn trainable_params(&self) -> usize {
        match self {
            TrainModel::Image(m) => qsr_models::param_count(m),
            TrainModel::Language(m) => qsr_models::param_count(m),
        }
    }

    /// All float values of the module (parameters and BN running statistics).
    pub fn num_params(&self) -> usize {
        match self {
            TrainModel::Image(m) => m.num_params(),
            TrainModel::Language(m) => m.num_params(),
        }
    }
}

/// Input shape and class count an image recipe's model is built for; an error for a language model.
pub fn input_spec(recipe: &TrainRecipe) -> Result<(InputSpec, usize)> {
    crate::task::image_input(recipe)
}

/// Checks a run's inputs before anything large is built: the batch fits the training data for `k`
/// workers, the held-out split fits the model, and `replicas` copies of the model's training state fit
/// in this machine's memory (CPU runs).
pub fn preflight(recipe: &TrainRecipe, k: usize, replicas: usize, gpu: bool) -> Result<()> {
    let params = match recipe.model.as_gpt() {
        Some(gpt) => {
            let corpus = open_corpus(&recipe.data)?;
            check_vocab(gpt, &corpus)?;
            for rank in 0..k {
                qsr_data::TextWindows::new(&corpus, (gpt.context, recipe.train.local_batch), recipe.seed, rank, k)?;
            }
            crate::task::text_steps_per_epoch(recipe, &corpus, gpt.context, k)?;
            gpt_params(gpt)
        }
        None => preflight_images(recipe, k)?,
    };
    if !gpu {
        check_memory(recipe, params, replicas)?;
    }
    Ok(())
}

/// Parameters of a GPT config, counted without building it: embeddings, blocks, final LayerNorm.
fn gpt_params(c: &GptConfig) -> usize {
    let (w, b) = (c.width, usize::from(c.bias));
    let block =
        2 * (w + b * w) + (3 * w * w + b * 3 * w) + (w * w + b * w) + (4 * w * w + b * 4 * w) + (4 * w * w + b * w);
    c.vocab_size * w + c.context * w + c.layers * block + (w + b * w)
}

/// The image checks of [`preflight`]; returns the model's parameter count.
fn preflight_images(recipe: &TrainRecipe, k: usize) -> Result<usize> {
    let train = open_dataset(&recipe.data, Split::Train)?;
    let test = open_dataset(&recipe.data, Split::Test)?;
    if test.is_empty() {
        bail!(
            "`data`: the test split of {} is empty, so the run could never evaluate: give it test images (a run without an evaluation has no result)",
            test.info().name
        );
    }
    crate::task::sampler(recipe, train.len(), k, 0)?;
    let shape = transform(recipe, train.info(), true).output_shape(train.info())?;
    let test_shape = transform(recipe, test.info(), false).output_shape(test.info())?;
    if shape != test_shape {
        bail!(
            "`data`: the test images of {} become {test_shape:?} (channels, height, width) but the training images {shape:?}: the model needs one input shape",
            test.info().name
        );
    }
    if test.classes() > train.classes() {
        bail!(
            "`data`: the test split of {} has {} classes, the training split only {}",
            test.info().name,
            test.classes(),
            train.classes()
        );
    }
    let model = recipe
        .model
        .init(InputSpec::new(shape.0, shape.1, shape.2), train.classes(), &Device::flex())
        .map_err(|e| anyhow!("invalid `model.{}`: {e}", e.field()))?;
    Ok(model.num_params())
}

/// Refuses a model whose training state (`replicas` times: module, gradients, flat parameters and
/// gradients, optimizer moments, the outer optimizer's global parameters and momentum) exceeds the memory the kernel says is available.
fn check_memory(recipe: &TrainRecipe, params: usize, replicas: usize) -> Result<()> {
    let Some(available) = mem_available() else {
        return Ok(());
    };
    let o = &recipe.optimizer;
    let moments = match o.kind {
        OptimizerKind::Adamw => 2,
        OptimizerKind::Sgd => usize::from(o.momentum() != 0.0),
    };
    // The outer optimizer keeps the global parameters and a momentum buffer.
    let outer = if recipe.outer.is_some() { 2 } else { 0 };
    let copies = 4 + moments + outer;
    let need = (params as u128) * 4 * copies as u128 * replicas as u128;
    if need > available as u128 {
        let gib = |b: u128| b as f64 / f64::from(1u32 << 30);
        bail!(
            "invalid `model`: {params} parameters need about {:.1} GiB ({replicas} worker(s) x {copies} f32 copies: module, gradients, flat parameters, flat gradients, optimizer moments, outer state), but only {:.1} GiB of memory is available (MemAvailable in /proc/meminfo)",
            gib(need),
            gib(available as u128)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_evaluation_above_the_limit_is_a_spike_and_two_in_a_row_diverge() {
        let mut above = false;
        assert!(judge(&mut above, 1.0, 6.9, 22, false).is_none());
        assert!(judge(&mut above, 13.0, 6.9, 44, false).is_none(), "one spike");
        assert!(judge(&mut above, 2.0, 6.9, 66, false).is_none(), "recovered");
        assert!(judge(&mut above, 13.0, 6.9, 88, false).is_none());
        let d = judge(&mut above, 14.0, 6.9, 110, false).expect("twice in a row");
        assert_eq!(d.step, Some(110));
        assert!(d.why.contains("two evaluations in a row"), "{}", d.why);
        let mut above = false;
        assert!(judge(&mut above, f64::NAN, 6.9, 22, false).is_some(), "not finite: at once");
        assert!(judge(&mut false, f64::INFINITY, f64::INFINITY, 22, false).is_some());
        assert!(judge(&mut false, 13.0, 6.9, 880, true).is_some(), "above at the last evaluation");
    }

    #[test]
    fn a_step_whose_loss_is_not_finite_is_left_out_of_the_intervals_mean() {
        let mut i = Interval::default();
        for loss in [2.0, f32::NAN, 4.0, f32::INFINITY] {
            i.add(loss);
        }
        assert_eq!((i.mean(), i.non_finite), (3.0, 2));
        let mut all_bad = Interval::default();
        all_bad.add(f32::NAN);
        assert!(all_bad.mean().is_nan());
        assert_eq!(Interval::default().mean(), 0.0);
    }

    #[test]
    fn gpt_params_counts_what_the_built_model_has() {
        for (bias, layers) in [(true, 2), (false, 3)] {
            let c = GptConfig { bias, layers, ..GptConfig::char_small(65) };
            let device = Device::flex();
            let model = c.init(&device).unwrap();
            let _ = model.forward(Tensor::<2, burn::tensor::Int>::zeros([1, 1], &device).inner());
            assert_eq!(gpt_params(&c), qsr_models::param_count(&model), "bias {bias}");
        }
    }
}

fn mem_available() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The error to report when several workers of one process failed: a failure of a worker's own
/// (data, disk, ...) before one that only saw another worker fail, and the blamed worker's own error
/// before the error of a worker blaming it.
pub fn root_cause(errors: Vec<(usize, anyhow::Error)>) -> Option<(usize, anyhow::Error)> {
    let blamed = |e: &anyhow::Error| {
        e.chain().filter_map(|c| c.downcast_ref::<qsr_comm::CommError>()).find_map(qsr_comm::CommError::blamed_rank)
    };
    let own = errors.iter().position(|(_, e)| !crate::exit::is_peer_failure(e));
    let via_blame =
        || errors.iter().find_map(|(_, e)| blamed(e)).and_then(|r| errors.iter().position(|(rank, _)| *rank == r));
    let pick = own.or_else(via_blame).unwrap_or(0);
    errors.into_iter().nth(pick)
}

/// Builds the model of a recipe on `device` (seeded, so every process builds the same one).
pub fn build_model(recipe: &TrainRecipe, device: &Device) -> Result<TrainModel> {
    device.seed(recipe.seed);
    let bad = |e: qsr_models::ModelError| anyhow!("invalid `model.{}`: {e}", e.field());
    // Parameters are created lazily; one forward materializes them now, under this seed.
    if let Some(gpt) = recipe.model.as_gpt() {
        let model = gpt.init(device).map_err(bad)?;
        let probe = Tensor::<2, burn::tensor::Int>::zeros([1, 1], device);
        model.valid().forward(probe.inner()).map_err(bad)?;
        return Ok(TrainModel::Language(model));
    }
    let (input, classes) = input_spec(recipe)?;
    let model = recipe.model.init(input, classes, device).map_err(bad)?;
    let probe = Tensor::<4>::zeros([1, input.channels, input.height, input.width], device);
    let _ = model.valid().forward(probe.inner());
    Ok(TrainModel::Image(model))
}

/// The plan and the length of an epoch: what records and evaluation cadence are reckoned in.
pub(crate) struct Pace {
    pub(crate) plan: Plan,
    /// Steps per epoch of this rank's data (of the recipe's world in an elastic run).
    pub(crate) spe: usize,
}

impl Pace {
    /// Epochs completed after `steps` steps (fractional).
    pub(crate) fn epoch(&self, steps: u64) -> f64 {
        steps as f64 / self.spe as f64
    }
}

/// Runs one worker to the end of the plan (or to `halt_after`).
///
/// `group` is the device group of K simulated workers sharing one device; it is used when the worker
/// is device-resident (a GPU backend, or `driver.residency = "device"`).
///
/// This is the training loop: the same code for every worker, whatever carries its collective (threads in one
/// process, local processes over the TCP ring, MPI, an externally launched job), and for every task (images:
/// test accuracy; text: validation loss of next-token prediction).
pub fn run_worker(spec: &RunSpec, comms: Comms, model: TrainModel, group: Option<DeviceGroup>) -> Result<Outcome> {
    let (rank, k) = (comms.world.rank(), comms.world.world_size());
    let recipe = &spec.recipe;
    match model {
        TrainModel::Image(m) => {
            let task = ImageTask::new(recipe, &m, rank, k, &spec.device)?;
            run(spec, comms, m, group, &task)
        }
        TrainModel::Language(m) => {
            let gpt =
                recipe.model.as_gpt().ok_or_else(|| anyhow!("a GPT was built for a `model.kind` that is not gpt"))?;
            let task = TextTask::new(recipe, gpt, rank, k, &spec.device)?;
            run(spec, comms, m, group, &task)
        }
    }
}

/// A worker's collectives: every worker's, and for a two-level run (`[sync.local]`) its node's.
pub struct Comms {
    /// All workers: global syncs, the initial broadcast, evaluation and checkpoint barriers.
    pub world: Box<dyn Collective>,
    /// The worker's node, for the local averages of a two-level run.
    pub node: Option<Box<dyn Collective>>,
}

impl Comms {
    /// The collective of a flat run.
    pub fn flat(world: Box<dyn Collective>) -> Self {
        Comms { world, node: None }
    }
}

/// [`run_worker`] for one task.
fn run<T: Task>(
    spec: &RunSpec,
    comms: Comms,
    model: T::Module,
    group: Option<DeviceGroup>,
    task: &T,
) -> Result<Outcome> {
    let recipe = &spec.recipe;
    let rank = comms.world.rank();
    let pace = Pace { plan: recipe.plan()?, spe: task.steps_per_epoch() };
    let (cursor, driver) = (pace.plan.cursor(), recipe.driver_config());
    let mut worker = Worker::new(model, recipe.optimizer.clone(), comms.world, cursor, driver)?;
    if let Some(node) = comms.node {
        worker.set_local(node)?;
    }
    if let Some(g) = group
        && worker.is_device_resident()
    {
        worker.set_device_group(g)?;
    }
    if let Some(outer) = recipe.outer {
        worker.set_outer(outer)?;
    }
    let (start_records, base) = resume(spec, &pace.plan, &mut worker)?;
    let end = pace.plan.end_step();
    let first_step = worker.cursor().step();
    let mut stream = task.stream(first_step, end)?;
    let mut segment = Segment::start(spec, rank, end, first_step, start_records, base)?;
    let mut finished = true;
    while !worker.cursor().is_done() {
        crate::fault::at(rank, crate::fault::Point::Step(worker.cursor().step()));
        let report = task.train_step(&mut worker, &mut stream)?;
        segment.stepped(&worker, &report, &pace);
        let global = report.sync.is_some_and(|s| s.level == Level::Global);
        match if global { segment.synced(spec, &pace, task, &mut worker, &report)? } else { AfterSync::Continue } {
            AfterSync::Continue => {}
            AfterSync::Diverged => break,
            AfterSync::Halt => {
                finished = false;
                break;
            }
        }
    }
    let summary = segment.finish(spec, &pace, task, &worker, finished)?;
    segment.check_diverged(rank)?;
    Ok(Outcome { rank, params: worker.params()?.to_vec(), summary, finished })
}

/// Continues from `spec.resume`, if any: the checkpoint's parameters, this rank's optimizer state, its
/// position in the plan and the BatchNorm statistics go into `worker`. Returns the step past which
/// metrics records are dropped (`None` for a fresh run) and the counters the run continues from.
pub(crate) fn resume<M: Module>(
    spec: &RunSpec,
    plan: &Plan,
    worker: &mut Worker<M>,
) -> Result<(Option<u64>, Counters)> {
    let Some((dir, state)) = &spec.resume else {
        return Ok((None, Counters::default()));
    };
    let rank = worker.rank();
    let (params, running) = checkpoint::load_model(&dir.join("model.safetensors"), worker.layout())?;
    let template: OptimState = worker.optimizer_state()?.into_owned();
    // An elastic run may resume with more workers than wrote the checkpoint: those start with fresh
    // moments, as a worker joining a running job does.
    let optim = if rank < state.world_size {
        checkpoint::load_optim(&dir.join(format!("optim-rank{rank}.safetensors")), &template)?
    } else {
        template
    };
    // A longer (or shorter) plan may move the cursor; the same plan must land where the checkpoint was.
    let cursor = plan.cursor_at(state.cursor.step());
    if cursor != state.cursor && plan.end_step() == state.cursor.plan().end_step() {
        bail!("checkpoint {}: its position does not follow from this recipe's plan", dir.display());
    }
    worker.restore(&params, optim, cursor)?;
    if worker.outer_state().is_some() {
        let (global, momentum) = checkpoint::load_outer(&dir.join("outer.safetensors"), params.len())?;
        worker.restore_outer_state(&global, &momentum)?;
    }
    if !running.is_empty() {
        let m = worker.layout().write_running(worker.model().clone(), &running)?;
        worker.set_model(m)?;
    }
    Ok((Some(state.step), state.counters))
}

/// Whether the run goes on after a sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterSync {
    Continue,
    /// `halt_after` was reached before the end of the plan.
    Halt,
    /// The evaluation saw the run diverge: it stops (every rank saw the same evaluation).
    Diverged,
}

/// This process's part of the run (all of it, or what follows a resume): rank 0's metrics file and
/// progress bar, and what the next records need.
pub(crate) struct Segment {
    metrics: Option<Metrics>,
    bar: Option<indicatif::ProgressBar>,
    /// The counters of the checkpoint resumed from (zero for a fresh run).
    base: Counters,
    t0: Instant,
    first_step: u64,
    /// The training losses since the previous sync record.
    since_sync: Interval,
    last_eval: Option<Eval>,
    /// The records of the last global sync (rank 0 wrote them; every rank keeps them, for a new
    /// generation's rank 0 to restore those its predecessor died before writing).
    held: Vec<Record>,
    /// The training losses of the last sync interval.
    last_interval: Interval,
    /// Whether the last evaluation's loss was above the divergence limit.
    above_limit: bool,
    /// Why the run diverged, once it did.
    diverged: Option<crate::exit::Diverged>,
}

/// The training losses of the steps since a sync: a non-finite loss (an update skipped for it) is
/// counted apart, so that one does not make the interval's mean meaningless.
#[derive(Debug, Clone, Copy, Default)]
struct Interval {
    sum: f64,
    finite: u64,
    non_finite: u64,
}

impl Interval {
    fn add(&mut self, loss: f32) {
        if loss.is_finite() {
            self.sum += f64::from(loss);
            self.finite += 1;
        } else {
            self.non_finite += 1;
        }
    }

    /// The mean of the finite losses; NaN when every loss of the interval was not finite.
    fn mean(&self) -> f64 {
        if self.finite == 0 && self.non_finite > 0 { f64::NAN } else { self.sum / self.finite.max(1) as f64 }
    }
}

impl Segment {
    /// Opens rank 0's metrics (cut back to `start_records` on resume) and progress bar, then starts the clock.
    pub(crate) fn start(
        spec: &RunSpec,
        rank: usize,
        end: u64,
        first_step: u64,
        start_records: Option<u64>,
        base: Counters,
    ) -> Result<Self> {
        let metrics = if rank == 0 {
            // No other rank writes yet: what a killed commit left behind is rank 0's to clear.
            checkpoint::sweep(&spec.run_dir)?;
            Some(Metrics::open(&spec.run_dir, start_records)?)
        } else {
            None
        };
        let bar = (rank == 0 && spec.progress).then(|| progress_bar(end, first_step));
        let t0 = Instant::now();
        Ok(Segment {
            metrics,
            bar,
            base,
            t0,
            first_step,
            since_sync: Interval::default(),
            last_eval: None,
            held: Vec::new(),
            last_interval: Interval::default(),
            above_limit: false,
            diverged: None,
        })
    }

    /// Continues the counters from `base` (a new membership's, taken over from its source rank), with
    /// this worker's totals restarted. Rank 0 clears checkpoints its predecessor left half-written,
    /// (re)opens `metrics.jsonl` dropping records past `change.step`, restores the `handed` records of
    /// that sync the file lacks (its predecessor may have died before writing them), and appends
    /// `change`.
    pub(crate) fn rebase<M: Module>(
        &mut self,
        spec: &RunSpec,
        worker: &mut Worker<M>,
        base: Counters,
        handed: &[Record],
        change: Record,
    ) -> Result<()> {
        self.base = base;
        self.t0 = Instant::now();
        worker.take_stats();
        self.since_sync = Interval::default();
        self.metrics = None;
        if worker.rank() == 0 {
            checkpoint::sweep(&spec.run_dir)?;
            let mut m = Metrics::open(&spec.run_dir, Some(change.step))?;
            m.restore(&spec.run_dir, handed.iter().filter(|r| r.step == change.step))?;
            m.write(&change)?;
            self.metrics = Some(m);
        }
        Ok(())
    }

    /// The records of the last global sync (written by rank 0; kept by every rank).
    pub(crate) fn sync_records(&self) -> &[Record] {
        &self.held
    }

    /// The run's divergence, if this rank saw one (every rank at an evaluation; rank 0 for its
    /// training loss), as the error the run ends with.
    pub(crate) fn check_diverged(&mut self, rank: usize) -> Result<()> {
        match self.diverged.take() {
            Some(d) => Err(anyhow::Error::new(d).context(format!("rank {rank}"))),
            None => Ok(()),
        }
    }

    /// The run's counters now.
    pub(crate) fn counters<M: Module>(&self, worker: &Worker<M>) -> Counters {
        counters(&self.base, worker.stats(), self.t0)
    }

    /// A record, given the counters now: rank 0 appends it to `metrics.jsonl`, every rank keeps it
    /// among the sync's records.
    fn write<M: Module>(&mut self, worker: &Worker<M>, record: impl FnOnce(Counters) -> Record) -> Result<()> {
        let r = record(counters(&self.base, worker.stats(), self.t0));
        if let Some(m) = self.metrics.as_mut() {
            m.write(&r)?;
        }
        self.held.push(r);
        Ok(())
    }

    /// Counts a step's loss towards the next sync record and moves the progress bar.
    pub(crate) fn stepped<M: Module>(&mut self, worker: &Worker<M>, report: &StepReport, pace: &Pace) {
        self.since_sync.add(report.loss);
        let Some(bar) = &self.bar else {
            return;
        };
        let done_steps = report.info.step + 1;
        bar.set_position(done_steps);
        // The message every 10 steps and at syncs: often enough to watch, rarely enough to cost nothing.
        if report.sync.is_some() || done_steps.is_multiple_of(10) {
            let syncs = worker.stats().syncs;
            bar.set_message(format!(
                "epoch {:.2} lr {:.2e} H {} loss {:.3} comm {:.1}%",
                pace.epoch(done_steps),
                report.info.lr,
                report.info.h,
                report.loss,
                100.0 * syncs as f64 / done_steps as f64
            ));
        }
    }

    /// After a sync: rank 0's sync record; then, when an evaluation is due, BN re-estimation, the
    /// evaluation (collectives on every rank, so every rank decides alike), its record and line, the
    /// checkpoint, and whether `halt_after` stops the run here.
    pub(crate) fn synced<T: Task>(
        &mut self,
        spec: &RunSpec,
        pace: &Pace,
        task: &T,
        worker: &mut Worker<T::Module>,
        report: &StepReport,
    ) -> Result<AfterSync> {
        let recipe = &spec.recipe;
        let done_steps = report.info.step + 1;
        crate::fault::at(worker.rank(), crate::fault::Point::Synced(done_steps));
        let loss = self.since_sync.mean();
        self.last_interval = std::mem::take(&mut self.since_sync);
        self.held.clear();
        self.write(worker, |c| record("sync", report, pace, loss, None, c))?;
        let is_end = worker.cursor().is_done();
        let due = match recipe.eval.every_steps {
            Some(period) => eval_due_every(worker.cursor(), done_steps, period),
            None => eval_due(worker.cursor(), done_steps, pace.spe, recipe.eval.every_epochs as u64),
        };
        if !due {
            return Ok(AfterSync::Continue);
        }
        task.prepare_eval(worker, done_steps)?;
        let ev = task.evaluate(worker)?;
        self.write(worker, |c| record("eval", report, pace, ev.loss, Some(ev.accuracy), c))?;
        if let Some(bar) = &self.bar {
            bar.println(format!("step {done_steps:>7}  epoch {:>6.2}  {}", pace.epoch(done_steps), task.describe(&ev)));
        }
        let limit = recipe.eval.divergence_factor * task.chance_loss();
        self.diverged = judge(&mut self.above_limit, ev.loss, limit, done_steps, is_end);
        self.last_eval = Some(ev);
        if self.diverged.is_some() {
            return Ok(AfterSync::Diverged);
        }
        // A state above the limit is not checkpointed: the kept checkpoint precedes the excursion.
        if recipe.checkpoint.enabled && !self.above_limit {
            let c = self.counters(worker);
            save_checkpoint(worker, spec, done_steps, c)?;
        }
        let halt = spec.halt_after.is_some_and(|h| done_steps >= h) && !is_end;
        Ok(if halt { AfterSync::Halt } else { AfterSync::Continue })
    }

    /// Clears the progress bar; on rank 0 of a finished run that evaluated, writes `summary.json` and
    /// returns the summary.
    pub(crate) fn finish<T: Task>(
        &mut self,
        spec: &RunSpec,
        pace: &Pace,
        task: &T,
        worker: &Worker<T::Module>,
        finished: bool,
    ) -> Result<Option<Summary>> {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        let wall = self.t0.elapsed().as_secs_f64();
        let c = self.counters(worker);
        if worker.rank() == 0 && self.diverged.is_none() && !self.last_interval.mean().is_finite() {
            let why = format!(
                "the training loss of every step of its last synchronization interval ({}) was not finite (summary.json counts {} skipped updates)",
                self.last_interval.non_finite, c.skipped_updates
            );
            self.diverged = Some(crate::exit::Diverged { step: Some(pace.plan.end_step()), why });
        }
        if worker.rank() == 0 && c.skipped_updates > 0 {
            eprintln!(
                "qsr: warning: {} updates were skipped for non-finite gradients (skipped_updates in summary.json)",
                c.skipped_updates
            );
        }
        let (0, true, Some(ev)) = (worker.rank(), finished, &self.last_eval) else {
            return Ok(None);
        };
        let recipe = &spec.recipe;
        let planned = pace.plan.summary();
        let end = pace.plan.end_step();
        let steps_run = end - self.first_step;
        let s = Summary {
            name: recipe.name.clone(),
            rule: recipe.sync.rule.name().to_string(),
            seed: recipe.seed,
            world_size: worker.world_size(),
            steps: end,
            epochs: pace.epoch(end),
            steps_per_epoch: pace.spe,
            final_test_accuracy: ev.accuracy,
            final_test_loss: ev.loss,
            syncs: c.syncs,
            planned_syncs: planned.rounds,
            local: recipe.sync.local.as_ref().zip(planned.local).map(|(l, p)| LocalLevel {
                rule: l.rule.name().to_string(),
                node_size: worker.local_comm().map_or(1, |c| c.world_size()),
                syncs: c.local_syncs,
                planned_syncs: p.rounds,
                bytes_per_rank: c.local_bytes,
                comm_seconds: c.local_comm_seconds,
            }),
            comm_percent: planned.comm_percent,
            bytes_per_rank: c.bytes,
            comm_seconds: c.comm_seconds,
            wall_seconds: c.wall_seconds,
            steps_per_second: steps_run as f64 / wall.max(1e-9),
            skipped_updates: c.skipped_updates,
            unigram_entropy: task.unigram_entropy(),
            membership: membership_changes(&spec.run_dir),
            diverged: self.diverged.as_ref().map(ToString::to_string),
        };
        checkpoint::write_atomic(&spec.run_dir.join("summary.json"), serde_json::to_string_pretty(&s)?.as_bytes())?;
        Ok(Some(s))
    }
}

impl Record {
    /// A `kind` record at `step` with the run's counters `c`, and no loss, accuracy or membership.
    pub(crate) fn counted(kind: &str, step: u64, epoch: f64, lr: f64, h: u64, c: Counters) -> Record {
        Record {
            kind: kind.into(),
            step,
            epoch,
            lr,
            h,
            loss: None,
            accuracy: None,
            syncs: c.syncs,
            bytes: c.bytes,
            comm_seconds: c.comm_seconds,
            wall_seconds: c.wall_seconds,
            local_syncs: c.local_syncs,
            local_bytes: c.local_bytes,
            membership: None,
        }
    }
}

/// Whether an evaluation's `loss` at `done_steps` says the run diverged (every rank sees the same
/// numbers): a loss that is not finite, or above `limit` at two evaluations in a row (or at the last,
/// `is_end`), so that one spike does not end a run that would recover. `above_limit` carries whether
/// the previous evaluation was above it.
fn judge(
    above_limit: &mut bool,
    loss: f64,
    limit: f64,
    done_steps: u64,
    is_end: bool,
) -> Option<crate::exit::Diverged> {
    let above = loss.is_nan() || loss > limit;
    let diverged = !loss.is_finite() || (above && (*above_limit || is_end));
    *above_limit = above;
    if !diverged {
        return None;
    }
    let seen = if loss.is_finite() { format!("{loss:.4}, above") } else { format!("{loss}, not below") };
    let twice = if loss.is_finite() && !is_end { ", at two evaluations in a row" } else { "" };
    let why = format!(
        "the evaluation's loss is {seen} {limit:.4}, the divergence limit (eval.divergence_factor x the loss at the start, of a model that predicts every class alike){twice}; the last checkpoint before it is kept (lower the learning rate, or the outer optimizer's momentum)"
    );
    Some(crate::exit::Diverged { step: Some(done_steps), why })
}

/// One record shape for syncs and evaluations, at the step `report` completed.
fn record(kind: &str, report: &StepReport, pace: &Pace, loss: f64, accuracy: Option<f64>, c: Counters) -> Record {
    let step = report.info.step + 1;
    let counted = Record::counted(kind, step, pace.epoch(step), report.info.lr, report.info.h, c);
    Record { loss: Some(loss), accuracy, ..counted }
}

/// The membership records of a run's `metrics.jsonl`, in order (none outside elastic runs).
fn membership_changes(run_dir: &Path) -> Vec<MembershipChange> {
    let Ok(file) = File::open(run_dir.join("metrics.jsonl")) else {
        return Vec::new();
    };
    BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<Record>(&l).ok()?.membership)
        .collect()
}

/// Whether the sync that completed `done_steps` steps evaluates: the last sync before an epoch
/// boundary (the next sync would be past it), every `every_epochs` epochs, and the end. Data parallel
/// syncs every step, so it evaluates on the boundary itself.
fn eval_due(cursor: &Cursor, done_steps: u64, spe: usize, every_epochs: u64) -> bool {
    let is_end = cursor.is_done();
    let next_end = cursor.round().end();
    let boundary = done_steps.div_ceil(spe as u64) * spe as u64;
    let epoch_index = boundary / spe as u64;
    is_end || (next_end > boundary && epoch_index.is_multiple_of(every_epochs))
}

/// Whether the sync that completed `done_steps` steps evaluates under `eval.every_steps = period`: the
/// last sync before every multiple of `period` (the next sync would be past it), and the end.
fn eval_due_every(cursor: &Cursor, done_steps: u64, period: u64) -> bool {
    let boundary = done_steps.div_ceil(period) * period;
    cursor.is_done() || cursor.round().end() > boundary
}

/// The run's counters: those of the checkpoint it resumed from, then this segment's.
fn counters(base: &Counters, st: &qsr_optim::DriverStats, t0: Instant) -> Counters {
    base.then(&Counters {
        syncs: st.syncs,
        bytes: st.comm.bytes_sent,
        comm_seconds: st.comm.seconds,
        wall_seconds: t0.elapsed().as_secs_f64(),
        skipped_updates: st.skipped_updates,
        local_syncs: st.local.syncs,
        local_bytes: st.local.comm.bytes_sent,
        local_comm_seconds: st.local.comm.seconds,
    })
}

fn save_checkpoint<M: Module>(worker: &mut Worker<M>, spec: &RunSpec, step: u64, counters: Counters) -> Result<()> {
    let rank = worker.rank();
    let run_dir = &spec.run_dir;
    let tmp = checkpoint::tmp_dir(run_dir, step);
    let err = || format!("checkpoint at step {step}");
    if rank == 0 {
        checkpoint::begin(run_dir, step)?;
    }
    worker.comm_mut().barrier().with_context(err)?;
    checkpoint::write_file(
        &tmp,
        &format!("optim-rank{rank}.safetensors"),
        &checkpoint::optim_bytes(&*worker.optimizer_state()?)?,
    )?;
    if rank == 0 {
        let mut running = vec![0.0; worker.layout().running_len()];
        worker.layout().read_running(worker.model(), &mut running)?;
        checkpoint::write_file(
            &tmp,
            "model.safetensors",
            &checkpoint::model_bytes(worker.layout(), &worker.params()?, &running, step)?,
        )?;
        let state = CheckpointState {
            format: checkpoint::FORMAT,
            step,
            world_size: worker.world_size(),
            cursor: worker.cursor().clone(),
            resume_key: spec.recipe.resume_key()?,
            counters,
        };
        checkpoint::write_file(&tmp, "state.json", serde_json::to_string_pretty(&state)?.as_bytes())?;
        if let Some((global, momentum)) = worker.outer_state() {
            checkpoint::write_file(&tmp, "outer.safetensors", &checkpoint::outer_bytes(global, momentum, step)?)?;
        }
    }
    worker.comm_mut().barrier().with_context(err)?;
    if rank == 0 {
        crate::fault::at(rank, crate::fault::Point::Commit(step));
        checkpoint::commit(run_dir, step, spec.recipe.checkpoint.keep)?;
    }
    Ok(())
}

fn progress_bar(end: u64, start: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(end);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} [{elapsed_precise} < {eta_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    bar
}

/// `metrics.jsonl` of rank 0; on resume, records past the checkpoint are dropped first.
struct Metrics {
    file: File,
}

impl Metrics {
    fn open(run_dir: &Path, resume_at: Option<u64>) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        if let Some(step) = resume_at
            && path.exists()
        {
            let kept: Vec<String> = BufReader::new(File::open(&path)?)
                .lines()
                .map_while(Result::ok)
                .filter(|l| serde_json::from_str::<Record>(l).is_ok_and(|r| r.step <= step))
                .collect();
            let mut text = kept.join("\n");
            if !text.is_empty() {
                text.push('\n');
            }
            checkpoint::write_atomic(&path, text.as_bytes())?;
        } else if resume_at.is_none() && path.exists() {
            fs::remove_file(&path).with_context(|| format!("cannot replace {}", path.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self { file })
    }

    /// Appends a record as one write, so that a process killed while writing leaves no half line.
    fn write(&mut self, r: &Record) -> Result<()> {
        let mut line = serde_json::to_string(r)?;
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        Ok(())
    }

    /// Appends those of `records` the file lacks (by kind and step).
    fn restore<'a>(&mut self, run_dir: &Path, records: impl Iterator<Item = &'a Record>) -> Result<()> {
        let have: Vec<(String, u64)> = BufReader::new(File::open(run_dir.join("metrics.jsonl"))?)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<Record>(&l).ok())
            .map(|r| (r.kind, r.step))
            .collect();
        for r in records {
            if !have.iter().any(|(kind, step)| *kind == r.kind && *step == r.step) {
                self.write(r)?;
            }
        }
        Ok(())
    }
}
