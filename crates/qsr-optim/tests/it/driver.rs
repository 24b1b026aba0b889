//! The round driver with real burn models and K in-process workers on threads.

use std::thread;

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use qsr_comm::InProcessGroup;
use qsr_optim::{
    BnPolicy, DeviceGroup, DeviceOptimizer, DriverConfig, Level, Optimizer, OptimizerConfig, OuterConfig, ParamLayout,
    ParamRole, Residency, StatePolicy, StepReport, Wire, Worker,
};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncMode, SyncRule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::common::Mlp;

pub(crate) const IN: usize = 6;
pub(crate) const OUT: usize = 3;
pub(crate) const BATCH: usize = 8;

#[derive(Module, Debug)]
struct BnNet {
    fc1: Linear,
    bn: BatchNorm,
    fc2: Linear,
}

impl BnNet {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(IN, 8).init(device),
            bn: BatchNormConfig::new(8).init(device),
            fc2: LinearConfig::new(8, OUT).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        // BatchNorm over features: [N, C] -> [N, C, 1] and back.
        let h = self.fc1.forward(x).unsqueeze_dim::<3>(2);
        self.fc2.forward(self.bn.forward(h).squeeze_dim::<2>(2))
    }
}

pub(crate) fn device() -> Device {
    Device::flex().autodiff()
}

/// Deterministic initial weights from our own seeded RNG. burn initializes parameters lazily from the
/// backend's one global RNG, which concurrently running tests and worker threads share, so its draws are
/// not reproducible across runs of a multi-threaded test.
pub(crate) fn init<M: Module>(model: M) -> M {
    let layout = ParamLayout::of(&model);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let values: Vec<f32> = (0..layout.len()).map(|_| rng.random_range(-0.4f32..0.4)).collect();
    layout.write_params(model, &values).unwrap()
}

/// A fixed regression task: 256 seeded inputs, targets from a fixed random teacher.
pub(crate) struct Task {
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Task {
    pub(crate) fn new() -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let n = 256;
        let x: Vec<f32> = (0..n * IN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let w: Vec<f32> = (0..IN * OUT).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut y = vec![0.0; n * OUT];
        for i in 0..n {
            for o in 0..OUT {
                y[i * OUT + o] = (0..IN).map(|j| x[i * IN + j] * w[j * OUT + o]).sum::<f32>().sin();
            }
        }
        Self { x, y }
    }

    /// Rows of `size` samples starting at sample `start` (wrapping).
    pub(crate) fn batch(&self, start: usize, size: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let n = self.x.len() / IN;
        let rows: Vec<usize> = (start..start + size).map(|i| i % n).collect();
        let x: Vec<f32> = rows.iter().flat_map(|&r| self.x[r * IN..(r + 1) * IN].iter().copied()).collect();
        let y: Vec<f32> = rows.iter().flat_map(|&r| self.y[r * OUT..(r + 1) * OUT].iter().copied()).collect();
        (
            Tensor::from_data(TensorData::new(x, [size, IN]), device),
            Tensor::from_data(TensorData::new(y, [size, OUT]), device),
        )
    }

    /// Worker `rank` of `k`, global step `t`, micro-batch `micro` of `accum`: disjoint samples per worker.
    pub(crate) fn start(rank: usize, k: usize, t: u64, micro: usize, accum: usize) -> usize {
        ((t as usize * k + rank) * accum + micro) * BATCH / accum
    }
}

pub(crate) fn mse(pred: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (pred - target).powf_scalar(2.0).mean()
}

pub(crate) fn plan(total: u64, sync: SyncRule) -> Plan {
    Plan::new(LrSchedule::new(ScheduleKind::Cosine, total, total / 10, 0.2, 0.0), sync).unwrap()
}

struct Run {
    params: Vec<Vec<f32>>,
    reports: Vec<Vec<StepReport>>,
    /// Every worker's parameters right after each synchronization (worker, sync index).
    after_sync: Vec<Vec<Vec<f32>>>,
    calls: Vec<u64>,
    first_moments: Vec<Vec<f32>>,
}

/// Trains `k` MLP workers (clones of one initial model) to the end of `plan`.
fn run_mlp(k: usize, plan: &Plan, optim: OptimizerConfig, config: DriverConfig, poison: Option<(usize, u64)>) -> Run {
    run_mlp_outer(k, plan, (optim, None), config, poison)
}

/// [`run_mlp`] with an outer optimizer when given.
fn run_mlp_outer(
    k: usize,
    plan: &Plan,
    (optim, outer): (OptimizerConfig, Option<OuterConfig>),
    config: DriverConfig,
    poison: Option<(usize, u64)>,
) -> Run {
    let device = device();
    let model = init(Mlp::new(&device, IN, OUT));
    let task = Task::new();
    let comms = InProcessGroup::new(k);
    // Device residency averages through a device group unless the test asks for the host collective.
    let groups = DeviceGroup::new(k);
    let use_group = config.residency == Residency::Device && !HOST_STAGED.with(|h| h.get());
    let nodes = node_comms(k, plan);
    let results: Vec<_> = thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(groups)
            .zip(nodes)
            .enumerate()
            .map(|(rank, ((comm, group), node))| {
                let (model, task, device, optim, config) =
                    (model.clone(), &task, device.clone(), optim.clone(), config.clone());
                s.spawn(move || {
                    let mut w = Worker::new(model, optim, Box::new(comm), plan.cursor(), config.clone()).unwrap();
                    assert_eq!(w.is_device_resident(), config.residency == Residency::Device);
                    if use_group {
                        w.set_device_group(group).unwrap();
                    }
                    if let Some(o) = outer {
                        w.set_outer(o).unwrap();
                    }
                    if let Some(node) = node {
                        w.set_local(Box::new(node)).unwrap();
                    }
                    let accum = config.accumulation_steps;
                    let (mut reports, mut after) = (Vec::new(), Vec::new());
                    while !w.cursor().is_done() {
                        let t = w.cursor().step();
                        let r = w
                            .step(|m: &Mlp, micro| {
                                let (x, y) = task.batch(Task::start(rank, k, t, micro, accum), BATCH / accum, &device);
                                let loss = mse(m.forward(x), y);
                                Ok(if poison == Some((rank, t)) { loss * f32::NAN } else { loss })
                            })
                            .unwrap();
                        if r.sync.is_some() {
                            after.push(w.params().unwrap().to_vec());
                        }
                        reports.push(r);
                    }
                    (
                        w.params().unwrap().to_vec(),
                        reports,
                        after,
                        w.comm().stats().calls,
                        w.optimizer_state().unwrap().first_moment.clone(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut run = Run { params: vec![], reports: vec![], after_sync: vec![], calls: vec![], first_moments: vec![] };
    for (p, r, a, c, m) in results {
        run.params.push(p);
        run.reports.push(r);
        run.after_sync.push(a);
        run.calls.push(c);
        run.first_moments.push(m);
    }
    run
}

thread_local! {
    /// Set by a test to run device-resident workers without a device group (the cross-process path).
    static HOST_STAGED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Workers per node of a two-level plan: ranks `0..n` form the first node, and so on.
    static NODE_SIZE: std::cell::Cell<usize> = const { std::cell::Cell::new(1) };
}

/// Each rank's handle of its node's group, for a plan with a local level (`None` for a flat one).
fn node_comms(k: usize, plan: &Plan) -> Vec<Option<qsr_comm::InProcessComm>> {
    let n = NODE_SIZE.with(|c| c.get());
    match plan.local() {
        Some(_) => (0..k / n).flat_map(|_| InProcessGroup::new(n)).map(Some).collect(),
        None => (0..k).map(|_| None).collect(),
    }
}

pub(crate) fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + x.abs().max(y.abs())), "{what}: element {i}: {x} vs {y}");
    }
}

pub(crate) fn bit_identical(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

pub(crate) fn sgd() -> OptimizerConfig {
    OptimizerConfig::sgd(0.0, 0.0)
}

#[test]
fn plain_sgd_with_h1_averaging_equals_data_parallel() {
    let k = 3;
    let local = run_mlp(k, &plan(20, SyncRule::Constant { h: 1 }), sgd(), DriverConfig::default(), None);
    let dp = run_mlp(k, &plan(20, SyncRule::Dp), sgd(), DriverConfig::default(), None);
    assert!(local.reports[0].iter().all(|r| r.sync.unwrap().mode == SyncMode::Parameters));
    assert!(dp.reports[0].iter().all(|r| r.sync.unwrap().mode == SyncMode::Gradients));
    // mean_k(p - lr g_k) = p - lr mean_k(g_k): equal up to float rounding.
    assert_close(&local.params[0], &dp.params[0], 1e-5, "H=1 vs data parallel");
    assert!(!bit_identical(
        &local.params[0],
        &run_mlp(k, &plan(20, SyncRule::Constant { h: 4 }), sgd(), DriverConfig::default(), None).params[0]
    ));
}

#[test]
fn one_worker_local_training_equals_plain_burn_training() {
    let p = plan(12, SyncRule::Qsr { h_base: 2, alpha: 0.1 });
    let run = run_mlp(1, &p, sgd(), DriverConfig::default(), None);

    // The same steps with burn's own SGD optimizer and no driver.
    let device = device();
    let mut model = init(Mlp::new(&device, IN, OUT));
    let task = Task::new();
    let mut burn_sgd = SgdConfig::new().init();
    for info in p.cursor() {
        let (x, y) = task.batch(Task::start(0, 1, info.step, 0, 1), BATCH, &device);
        let loss = mse(model.forward(x), y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = burn_sgd.step(info.lr, model, grads);
    }
    let layout = ParamLayout::of(&model);
    let mut plain = vec![0.0; layout.len()];
    layout.read_params(&model, &mut plain).unwrap();
    assert_close(&run.params[0], &plain, 1e-6, "K=1 driver vs burn SGD");
}

#[test]
fn phase_times_count_every_phase_of_each_step_and_reset_with_take_stats() {
    let device = device();
    let p = plan(4, SyncRule::Constant { h: 4 });
    let comm = InProcessGroup::new(1).remove(0);
    let mut w =
        Worker::new(init(Mlp::new(&device, IN, OUT)), sgd(), Box::new(comm), p.cursor(), DriverConfig::default())
            .unwrap();
    let task = Task::new();
    let mut after_one = None;
    for step in 0..4 {
        let t = std::time::Instant::now();
        w.step(|m, _| {
            let (x, y) = task.batch(step * BATCH, BATCH, &device);
            Ok(mse(m.forward(x), y))
        })
        .unwrap();
        let wall = t.elapsed().as_secs_f64();
        let phases = w.stats().phases;
        if step == 0 {
            // Each phase took time, and together they fit in the step's wall-clock.
            assert!(phases.forward > 0.0 && phases.backward > 0.0 && phases.gradients > 0.0, "{phases:?}");
            assert!(phases.optimizer > 0.0 && phases.write_back > 0.0, "{phases:?}");
            assert!(phases.total() <= wall, "{phases:?} in {wall} s");
            after_one = Some(phases);
        }
    }
    let one = after_one.unwrap();
    let all = w.take_stats().phases;
    assert!(all.forward > one.forward && all.backward > one.backward, "the phases add up over the steps");
    assert_eq!(w.stats().phases, qsr_optim::PhaseTimes::default(), "take_stats leaves zeros");
}

#[test]
fn qsr_workers_sync_at_the_planned_steps_and_agree_bit_for_bit() {
    let k = 3;
    let p = plan(60, SyncRule::Qsr { h_base: 2, alpha: 0.15 });
    let planned_ends: Vec<u64> = p.rounds().map(|r| r.end() - 1).collect();
    assert!(p.rounds().any(|r| r.len > 2), "the plan must grow H for this test to mean something");
    let run = run_mlp(k, &p, OptimizerConfig::sgd(0.9, 1e-4), DriverConfig::default(), None);
    for rank in 0..k {
        let synced: Vec<u64> = run.reports[rank].iter().filter(|r| r.sync.is_some()).map(|r| r.info.step).collect();
        assert_eq!(synced, planned_ends, "rank {rank} synced off plan");
        // One broadcast at start, then exactly one collective per planned round.
        assert_eq!(run.calls[rank], 1 + planned_ends.len() as u64);
    }
    for s in 0..planned_ends.len() {
        for rank in 1..k {
            assert!(bit_identical(&run.after_sync[0][s], &run.after_sync[rank][s]), "sync {s}: rank {rank} differs");
        }
    }
    // Momentum stays local by default: the workers' buffers differ.
    assert!(!bit_identical(&run.first_moments[0], &run.first_moments[1]));
    // Training works: the loss of the last steps is well below the first steps'.
    let mean_loss = |r: &[StepReport]| r.iter().map(|r| r.loss).sum::<f32>() / r.len() as f32;
    let first = mean_loss(&run.reports[0][..6]);
    let last = mean_loss(&run.reports[0][54..]);
    assert!(last < 0.6 * first, "loss {first} -> {last}");
}

#[test]
fn averaging_momentum_makes_it_identical_after_the_last_sync() {
    let config = DriverConfig {
        state: StatePolicy { average_first_moment: true, average_second_moment: false },
        ..DriverConfig::default()
    };
    let run = run_mlp(2, &plan(16, SyncRule::Constant { h: 4 }), OptimizerConfig::sgd(0.9, 0.0), config, None);
    assert!(bit_identical(&run.first_moments[0], &run.first_moments[1]));
    assert_eq!(run.calls[0], 1 + 4, "momentum rides in the same collective as the parameters");
    let sync = run.reports[0][3].sync.unwrap();
    assert_eq!(sync.elements, 2 * run.params[0].len());
}

/// `qsr simulate` predicts a sync's bytes from `SyncBuffer`, the rule the Worker fills its buffer
/// by: for every optimizer and state policy they count the same elements.
#[test]
fn the_sync_buffer_simulate_counts_is_the_one_the_worker_sends() {
    let both = StatePolicy { average_first_moment: true, average_second_moment: true };
    let optimizers = [OptimizerConfig::sgd(0.9, 0.0), OptimizerConfig::sgd(0.0, 0.0), OptimizerConfig::adamw(0.0)];
    for optimizer in optimizers {
        for state in [StatePolicy::default(), both] {
            let config = DriverConfig { state, ..DriverConfig::default() };
            let buffer = qsr_optim::SyncBuffer::new(&config, optimizer.moments(), false);
            let run = run_mlp(2, &plan(8, SyncRule::Constant { h: 4 }), optimizer.clone(), config, None);
            let sync = run.reports[0][3].sync.unwrap();
            let params = run.params[0].len() as u64;
            assert_eq!(sync.elements as u64, buffer.elements(params, 0), "{optimizer:?} {state:?}");
        }
    }
}

#[test]
fn a_non_finite_step_skips_its_update_but_never_its_sync() {
    let p = plan(12, SyncRule::Constant { h: 3 });
    // Rank 1's loss is NaN at step 5, the last step of round 1.
    let run = run_mlp(2, &p, sgd(), DriverConfig::default(), Some((1, 5)));
    let r = &run.reports[1][5];
    assert!(!r.updated && r.sync.is_some());
    assert!(run.reports[0][5].updated);
    assert_eq!(run.calls[0], 1 + 4);
    assert_eq!(run.calls[1], 1 + 4);
    assert!(bit_identical(&run.params[0], &run.params[1]));
    assert!(run.params[0].iter().all(|v| v.is_finite()));
}

#[test]
fn gradient_accumulation_equals_the_full_batch() {
    let p = plan(8, SyncRule::Constant { h: 2 });
    let full = run_mlp(2, &p, OptimizerConfig::adamw(0.01), DriverConfig::default(), None);
    let config = DriverConfig { accumulation_steps: 4, ..DriverConfig::default() };
    let micro = run_mlp(2, &p, OptimizerConfig::adamw(0.01), config, None);
    assert_close(&full.params[0], &micro.params[0], 2e-5, "4 micro-batches vs one batch");
}

#[test]
fn bucketed_all_reduce_gives_the_same_parameters() {
    let p = plan(8, SyncRule::Constant { h: 2 });
    let one = run_mlp(2, &p, sgd(), DriverConfig::default(), None);
    let config = DriverConfig { bucket_elems: Some(50), ..DriverConfig::default() };
    let bucketed = run_mlp(2, &p, sgd(), config, None);
    assert!(bit_identical(&one.params[0], &bucketed.params[0]));
    let n = one.params[0].len() as u64;
    assert_eq!(bucketed.reports[0][1].sync.unwrap().calls, n.div_ceil(50));
}

#[test]
fn layout_separates_batchnorm_statistics_and_roundtrips() {
    let device = device();
    let net = BnNet::new(&device);
    let layout = ParamLayout::of(&net);
    let paths: Vec<&str> = layout.trainable.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["fc1.weight", "fc1.bias", "bn.gamma", "bn.beta", "fc2.weight", "fc2.bias"]);
    let running: Vec<&str> = layout.running.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(running, ["bn.running_mean", "bn.running_var"]);
    assert_eq!(layout.len(), 6 * 8 + 8 + 8 + 8 + 8 * 3 + 3);
    assert_eq!(layout.running_len(), 16);
    assert_eq!(layout.trainable[2].role, ParamRole::Norm);
    assert_eq!(layout.trainable[3].role, ParamRole::Bias);
    assert_eq!(layout.no_decay_ranges().len(), 4, "fc biases, bn gamma and beta");
    assert_eq!(layout.len(), net.num_params() - 16, "burn counts running stats, we do not");

    let values: Vec<f32> = (0..layout.len()).map(|i| i as f32 * 0.5 - 3.0).collect();
    let net = layout.write_params(net, &values).unwrap();
    let mut back = vec![0.0; layout.len()];
    layout.read_params(&net, &mut back).unwrap();
    assert!(bit_identical(&values, &back));
    let stats: Vec<f32> = (0..16).map(|i| 1.0 + i as f32).collect();
    let net = layout.write_running(net, &stats).unwrap();
    let mut back = vec![0.0; 16];
    layout.read_running(&net, &mut back).unwrap();
    assert_eq!(back, stats);
    // The trainable parameters still carry gradients after a write.
    let (x, y) = Task::new().batch(0, BATCH, &device);
    let mut grads = mse(net.forward(x), y).backward();
    let mut g = vec![0.0; layout.len()];
    layout.read_grads(&net, &mut grads, &mut g).unwrap();
    assert!(g.iter().any(|v| *v != 0.0));
    assert!(layout.read_params(&net, &mut [0.0; 3]).is_err());
}

#[test]
fn batchnorm_statistics_are_averaged_only_under_the_average_policy() {
    let run = |bn: BnPolicy| run_bn(bn, None, (SyncRule::Constant { h: 3 }, Wire::F32));
    bn_policies_hold(run);
}

/// Streaming workers average BatchNorm statistics on their own at each round's end (`driver.bn =
/// "average"`), as plain ones do with their parameters.
#[test]
fn streaming_workers_average_batchnorm_statistics_at_round_ends() {
    let streaming = Some(qsr_sched::StreamingConfig { fragments: 2, delay: 1, mix: 1.0 });
    bn_policies_hold(|bn| run_bn(bn, streaming, (SyncRule::Constant { h: 3 }, Wire::F32)));
}

/// Regression: a quantized wire (a stream of one fragment) averaged BatchNorm statistics after every
/// data-parallel step, which plain workers never do. Data parallel's steps never average parameters,
/// so the wire changes nothing there: the same statistics with `driver.wire` int8 as with f32.
#[test]
fn a_quantized_wire_changes_nothing_in_data_parallel_steps() {
    let f32_wire = run_bn(BnPolicy::Average, None, (SyncRule::Dp, Wire::F32));
    let int8_wire = run_bn(BnPolicy::Average, None, (SyncRule::Dp, Wire::Int8));
    for (a, b) in f32_wire.iter().zip(&int8_wire) {
        assert!(bit_identical(&a.0, &b.0), "BatchNorm statistics differ with the int8 wire");
    }
}

fn bn_policies_hold(run: impl Fn(BnPolicy) -> Vec<(Vec<f32>, Vec<f32>)>) {
    let avg = run(BnPolicy::Average);
    assert!(bit_identical(&avg[0].0, &avg[1].0), "averaged at the last sync");
    let local = run(BnPolicy::Reestimate);
    assert!(!bit_identical(&local[0].0, &local[1].0), "local during training");
    // The explicit average (the end of re-estimation) makes them equal, to their mean.
    assert!(bit_identical(&local[0].1, &local[1].1));
    let mean: Vec<f32> = local[0].0.iter().zip(&local[1].0).map(|(a, b)| (a + b) / 2.0).collect();
    assert_close(&local[0].1, &mean, 1e-6, "mean of running stats");
}

/// Two BnNet workers under `bn` (streaming when given): each one's running statistics at the end,
/// before and after an explicit average.
fn run_bn(
    bn: BnPolicy,
    streaming: Option<qsr_sched::StreamingConfig>,
    (rule, wire): (SyncRule, Wire),
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let device = device();
    let net = init(BnNet::new(&device));
    let task = Task::new();
    let p = plan(6, rule);
    let comms = InProcessGroup::new(2);
    thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (net, task, device, p) = (net.clone(), &task, device.clone(), &p);
                s.spawn(move || {
                    let config = DriverConfig { bn, wire, ..DriverConfig::default() };
                    let mut w = Worker::new(net, sgd(), Box::new(comm), p.cursor(), config).unwrap();
                    if let Some(st) = streaming {
                        w.set_streaming(st).unwrap();
                    }
                    while !w.cursor().is_done() {
                        let t = w.cursor().step();
                        w.step(|m: &BnNet, _| {
                            let (x, y) = task.batch(Task::start(rank, 2, t, 0, 1), BATCH, &device);
                            Ok(mse(m.forward(x), y))
                        })
                        .unwrap();
                    }
                    let mut stats = vec![0.0; w.layout().running_len()];
                    w.layout().read_running(w.model(), &mut stats).unwrap();
                    let local = stats.clone();
                    w.average_running_stats().unwrap();
                    w.layout().read_running(w.model(), &mut stats).unwrap();
                    (local, stats)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    })
}

fn device_config(base: DriverConfig) -> DriverConfig {
    DriverConfig { residency: Residency::Device, ..base }
}

fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The device optimizer is the host optimizer written in burn operations: on the CPU backend the
/// same trajectories, for every option (momentum, dampening, Nesterov, decay exclusions, clipping).
#[test]
fn device_optimizer_follows_the_host_optimizer() {
    let dev = Device::flex();
    let n = 1000;
    let no_decay = [100..250, 900..1000];
    let mut sgd_all = OptimizerConfig::sgd(0.9, 1e-2);
    sgd_all.nesterov = Some(true);
    sgd_all.exclude_norm_and_bias = true;
    let mut sgd_damp = OptimizerConfig::sgd(0.8, 5e-4);
    sgd_damp.dampening = Some(0.3);
    sgd_damp.clip_grad_norm = Some(0.5);
    let mut adamw_excl = OptimizerConfig::adamw(0.05);
    adamw_excl.exclude_norm_and_bias = true;
    let mut adamw_beta = OptimizerConfig::adamw(0.1);
    adamw_beta.beta1 = Some(0.3); // the lerp's other branch
    for (case, config) in
        [OptimizerConfig::sgd(0.0, 0.0), sgd_all, sgd_damp, OptimizerConfig::adamw(0.0), adamw_excl, adamw_beta]
            .into_iter()
            .enumerate()
    {
        let mut host = Optimizer::new(config.clone(), n, &no_decay).unwrap();
        let mut device = DeviceOptimizer::new(config.clone(), n, &no_decay, &dev).unwrap();
        let mut p_host = random(n, 1, 1.0);
        let mut p_dev = Tensor::<1>::from_data(TensorData::new(p_host.clone(), [n]), &dev);
        for step in 0..6u64 {
            let g = random(n, 100 + step, 2.0);
            let lr = 0.1 / (step + 1) as f64;
            host.step(&mut p_host, &mut g.clone(), lr);
            p_dev = device.step(p_dev, Tensor::<1>::from_data(TensorData::new(g, [n]), &dev), lr);
        }
        let got = p_dev.into_data().try_to_vec::<f32>().unwrap();
        assert_close(&got, &p_host, 1e-6, &format!("case {case} ({:?}) parameters", config.kind));
        let (hs, ds) = (host.state().clone(), device.state().unwrap());
        assert_eq!(hs.step, ds.step);
        assert_close(&ds.first_moment, &hs.first_moment, 1e-6, &format!("case {case} first moment"));
        assert_close(&ds.second_moment, &hs.second_moment, 1e-6, &format!("case {case} second moment"));
    }
}

/// Device-resident workers (flat state as burn tensors, syncs through the device group) train to
/// the same parameters as host-resident ones, sync at the same steps, and agree after every sync.
#[test]
fn device_resident_workers_match_host_resident_ones() {
    let k = 3;
    let p = plan(40, SyncRule::Qsr { h_base: 2, alpha: 0.1 });
    for optim in [OptimizerConfig::sgd(0.9, 1e-3), OptimizerConfig::adamw(0.05)] {
        let host = run_mlp(k, &p, optim.clone(), DriverConfig::default(), None);
        let dev = run_mlp(k, &p, optim.clone(), device_config(DriverConfig::default()), None);
        let syncs = |r: &Run| r.reports[0].iter().filter(|x| x.sync.is_some()).count();
        assert_eq!(syncs(&host), syncs(&dev));
        assert_eq!(syncs(&dev) as u64, p.summary().rounds);
        for w in 0..k {
            assert_close(&dev.params[w], &host.params[w], 1e-5, &format!("{:?} worker {w}", optim.kind));
            for (i, after) in dev.after_sync[w].iter().enumerate() {
                assert!(bit_identical(after, &dev.after_sync[0][i]), "worker {w} differs from worker 0 after sync {i}");
            }
        }
    }
}

/// Data-parallel rounds, micro-batches, and averaged moments on the device path; and the same
/// run staged through the host collective (what a multi-process device-resident run does).
#[test]
fn device_residency_covers_gradient_syncs_accumulation_and_moment_averaging() {
    let k = 2;
    let config = DriverConfig {
        accumulation_steps: 2,
        state: StatePolicy { average_first_moment: true, average_second_moment: true },
        ..DriverConfig::default()
    };
    let p = plan(24, SyncRule::PostLocal { switch_step: 8, h: 3 });
    let host = run_mlp(k, &p, OptimizerConfig::adamw(0.01), config.clone(), None);
    let dev = run_mlp(k, &p, OptimizerConfig::adamw(0.01), device_config(config.clone()), None);
    HOST_STAGED.with(|h| h.set(true));
    let staged = run_mlp(k, &p, OptimizerConfig::adamw(0.01), device_config(config), None);
    HOST_STAGED.with(|h| h.set(false));
    assert!(dev.reports[0].iter().any(|r| r.sync.is_some_and(|s| s.mode == SyncMode::Gradients)));
    for w in 0..k {
        assert_close(&dev.params[w], &host.params[w], 1e-5, &format!("device worker {w}"));
        assert_close(&staged.params[w], &host.params[w], 1e-5, &format!("host-staged worker {w}"));
        assert_close(&dev.first_moments[w], &dev.first_moments[0], 0.0, "averaged first moments agree");
    }
    assert!(staged.calls[0] > 0, "the staged run used the host collective");
}

/// A device group refuses a rank that does not match its collective, reports a peer that never
/// arrives after its timeout, and one that left (failed or dropped its handle) at once.
#[test]
fn device_group_mismatch_missing_and_departed_peers_are_errors() {
    let device = device();
    let task = Task::new();
    let p = plan(4, SyncRule::Constant { h: 1 });
    let config = device_config(DriverConfig { broadcast_initial: false, ..DriverConfig::default() });
    let one_step = |w: &mut Worker<Mlp>| {
        w.step(|m: &Mlp, _| {
            let (x, y) = task.batch(0, BATCH, &device);
            Ok(mse(m.forward(x), y))
        })
        .unwrap_err()
        .to_string()
    };

    // Rank 1 is alive but never syncs: a timeout naming it.
    let comm = InProcessGroup::new(2).remove(0);
    let mut w =
        Worker::new(init(Mlp::new(&device, IN, OUT)), sgd(), Box::new(comm), p.cursor(), config.clone()).unwrap();
    let mut groups = DeviceGroup::with_timeout(2, std::time::Duration::from_millis(200));
    let _alive = groups.pop().unwrap();
    let mismatched = DeviceGroup::new(2).pop().unwrap();
    assert!(w.set_device_group(mismatched).unwrap_err().to_string().contains("does not match"));
    w.set_device_group(groups.pop().unwrap()).unwrap();
    let e = one_step(&mut w);
    assert!(e.contains("rank(s) [1] did not reach the synchronization"), "{e}");

    // Rank 1 dropped its handle (its worker failed): an error at once, naming it.
    let comm = InProcessGroup::new(2).remove(0);
    let mut w = Worker::new(init(Mlp::new(&device, IN, OUT)), sgd(), Box::new(comm), p.cursor(), config).unwrap();
    let mut groups = DeviceGroup::with_timeout(2, std::time::Duration::from_secs(600));
    drop(groups.pop());
    w.set_device_group(groups.pop().unwrap()).unwrap();
    // The departure message (not the timeout's "did not reach") shows it was reported at once.
    let e = one_step(&mut w);
    assert!(e.contains("rank 1 left the group"), "{e}");
}

/// The loss closure can fail with any error through `?`; the worker reports it as the source of a
/// `Step` error naming the step. `into_model` hands back the trained replica, and every step says where
/// its round started.
#[test]
fn loss_errors_are_typed_and_into_model_returns_the_trained_replica() {
    #[derive(Debug)]
    struct NoBatch(u64);
    impl std::fmt::Display for NoBatch {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "no batch for step {}", self.0)
        }
    }
    impl std::error::Error for NoBatch {}

    let device = device();
    let task = Task::new();
    let p = plan(40, SyncRule::Qsr { h_base: 2, alpha: 0.02 });
    let comm = InProcessGroup::new(1).remove(0);
    let mut w =
        Worker::new(init(Mlp::new(&device, IN, OUT)), sgd(), Box::new(comm), p.cursor(), DriverConfig::default())
            .unwrap();
    let mut starts = Vec::new();
    while w.cursor().step() < 20 {
        let t = w.cursor().step();
        let r = w
            .step(|m: &Mlp, _| {
                let (x, y) = task.batch(Task::start(0, 1, t, 0, 1), BATCH, &device);
                Ok(mse(m.forward(x), y))
            })
            .unwrap();
        starts.push((r.info.round, r.info.round_start));
    }
    for round in p.rounds().take_while(|r| r.start < 20) {
        assert!(
            starts.iter().filter(|(i, _)| *i == round.index).all(|(_, s)| *s == round.start),
            "round {}",
            round.index
        );
    }
    let t = w.cursor().step();
    let err = w.step(|_: &Mlp, _| Err(NoBatch(t))?).unwrap_err();
    assert!(matches!(&err, qsr_optim::OptimError::Step { step: 20, .. }), "{err}");
    let source = std::error::Error::source(&err).unwrap();
    assert_eq!(source.downcast_ref::<NoBatch>().map(|e| e.0), Some(20));
    let params = w.params().unwrap().to_vec();
    let model = w.into_model();
    let mut flat = vec![0.0; params.len()];
    ParamLayout::of(&model).read_params(&model, &mut flat).unwrap();
    assert_eq!(flat, params);
}

#[derive(Module, Debug)]
struct EmbNet {
    emb: burn::nn::Embedding,
    ln: burn::nn::LayerNorm,
    fc: Linear,
}

#[test]
fn exclude_norm_and_bias_also_exempts_embedding_tables() {
    let device = device();
    let net = EmbNet {
        emb: burn::nn::EmbeddingConfig::new(10, 4).init(&device),
        ln: burn::nn::LayerNormConfig::new(4).init(&device),
        fc: LinearConfig::new(4, 2).init(&device),
    };
    let layout = ParamLayout::of(&net);
    let roles: Vec<ParamRole> = layout.trainable.iter().map(|e| e.role).collect();
    assert_eq!(roles, [ParamRole::Embedding, ParamRole::Norm, ParamRole::Bias, ParamRole::Weight, ParamRole::Bias]);
    // Everything but the Linear weight (elements 48..56) is exempt.
    assert_eq!(layout.no_decay_ranges(), [0..40, 40..44, 44..48, 56..58]);
}

/// The round driver's outer step: lr 1 without momentum is plain averaging (within f32 rounding: the
/// pseudo-gradient's round trip `g - (g - local)` rounds), DiLoCo's settings move away from it, and every
/// worker holds the same parameters after every outer step; post-local's data-parallel phase keeps the
/// global parameters current, so its first outer step starts from the synchronized model.
#[test]
fn worker_outer_step_with_lr_one_is_plain_averaging_and_ranks_stay_identical() {
    let k = 3;
    for rule in [SyncRule::Constant { h: 4 }, SyncRule::PostLocal { h: 4, switch_step: 20 }] {
        let p = plan(60, rule.clone());
        let unit = OuterConfig::averaging();
        let plain = run_mlp(k, &p, sgd(), DriverConfig::default(), None);
        let outer = run_mlp_outer(k, &p, (sgd(), Some(unit)), DriverConfig::default(), None);
        for (o, q) in outer.after_sync[0].iter().zip(&plain.after_sync[0]) {
            assert_close(o, q, 1e-5, &format!("{rule:?}: outer lr 1 vs plain averaging"));
        }
        let diloco = run_mlp_outer(k, &p, (sgd(), Some(OuterConfig::diloco())), DriverConfig::default(), None);
        for r in 1..k {
            for (a, b) in diloco.after_sync[0].iter().zip(&diloco.after_sync[r]) {
                assert!(bit_identical(a, b), "{rule:?}: rank {r} differs after an outer step");
            }
        }
        assert!(!bit_identical(&diloco.params[0], &plain.params[0]), "{rule:?}: DiLoCo's step is not an average");
        assert!(diloco.params[0].iter().all(|x| x.is_finite()));
    }
}

#[test]
fn worker_outer_settings_that_cannot_run_are_refused_naming_the_key() {
    let device = device();
    let build = |sync: SyncRule, config: DriverConfig, outer: OuterConfig| {
        let mut w = Worker::new(
            init(Mlp::new(&device, IN, OUT)),
            sgd(),
            Box::new(InProcessGroup::new(1).remove(0)),
            plan(10, sync).cursor(),
            config,
        )
        .unwrap();
        w.set_outer(outer).unwrap_err().to_string()
    };
    assert!(build(SyncRule::Dp, DriverConfig::default(), OuterConfig::diloco()).contains("`outer`"));
    let bad_lr = OuterConfig { lr: -1.0, ..OuterConfig::diloco() };
    assert!(build(SyncRule::Constant { h: 2 }, DriverConfig::default(), bad_lr).contains("`outer.lr`"));
    let device_resident = DriverConfig { residency: Residency::Device, ..DriverConfig::default() };
    assert!(build(SyncRule::Constant { h: 2 }, device_resident, OuterConfig::diloco()).contains("host-resident"));
}

/// `driver.wire = "bf16"`: every worker is bit-identical after every sync, the parameters follow the
/// f32 run to bf16 rounding, and a sync sends half the bytes.
#[test]
fn bf16_parameter_syncs_keep_ranks_identical_and_halve_the_bytes() {
    let k = 3;
    let p = plan(60, SyncRule::Constant { h: 4 });
    let exact = run_mlp(k, &p, sgd(), DriverConfig::default(), None);
    let bf16 = DriverConfig { wire: Wire::Bf16, ..DriverConfig::default() };
    let half = run_mlp(k, &p, sgd(), bf16, None);
    for r in 1..k {
        for (a, b) in half.after_sync[0].iter().zip(&half.after_sync[r]) {
            assert!(bit_identical(a, b), "rank {r} differs after a bf16 sync");
        }
    }
    assert!(half.after_sync[0].iter().flatten().all(|x| x.to_bits() & 0xffff == 0), "a synced value is not a bf16");
    assert_close(&half.params[0], &exact.params[0], 3e-2, "bf16 vs f32 syncs");
    assert!(!bit_identical(&half.params[0], &exact.params[0]));
    let bytes = |run: &Run| run.reports[0].iter().filter_map(|r| r.sync).map(|s| s.bytes_sent).sum::<u64>();
    // The ring's 2 (K-1)/K share of the buffer, rounded down per sync: half, within a byte per sync.
    let syncs = half.reports[0].iter().filter(|r| r.sync.is_some()).count() as u64;
    assert!((bytes(&half) * 2).abs_diff(bytes(&exact)) <= 2 * syncs, "{} vs {}", bytes(&half), bytes(&exact));
    let device_bf16 = DriverConfig { wire: Wire::Bf16, residency: Residency::Device, ..DriverConfig::default() };
    let refused = Worker::new(
        init(Mlp::new(&device(), IN, OUT)),
        sgd(),
        Box::new(InProcessGroup::new(1).remove(0)),
        p.cursor(),
        device_bf16,
    );
    assert!(refused.err().unwrap().to_string().contains("driver.wire"));
}

/// A collective without a bf16 all-reduce (as MPI and NCCL are): the in-process group behind it. With
/// `skew`, that rank's parameter averages come back one ulp off (a reduction that is not deterministic,
/// or memory that changed under it); 22-value all-reduces (a fingerprint's) are left alone.
pub(crate) struct NoBf16(pub(crate) qsr_comm::InProcessComm, pub(crate) Option<usize>);

impl qsr_comm::Collective for NoBf16 {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: qsr_comm::ReduceOp) -> Result<(), qsr_comm::CommError> {
        self.0.all_reduce(buf, op)?;
        if self.1 == Some(self.0.rank()) && buf.len() > 22 {
            buf[0] = buf[0].next_up();
        }
        Ok(())
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), qsr_comm::CommError> {
        self.0.broadcast(buf, root)
    }
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), qsr_comm::CommError> {
        self.0.broadcast_bytes(bytes, root)
    }
    fn barrier(&mut self) -> Result<(), qsr_comm::CommError> {
        self.0.barrier()
    }
    fn stats(&self) -> &qsr_comm::CommStats {
        self.0.stats()
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
}

/// Regression: bf16 syncs over a collective without them failed only at the first sync, after a round of
/// training; now the worker refuses at construction, naming `driver.wire` and the backend.
#[test]
fn bf16_syncs_over_a_collective_without_them_are_refused_before_training() {
    let bf16 = DriverConfig { wire: Wire::Bf16, ..DriverConfig::default() };
    let comm = Box::new(NoBf16(InProcessGroup::new(1).remove(0), None));
    let p = plan(10, SyncRule::Constant { h: 2 });
    let Err(e) = Worker::new(init(Mlp::new(&device(), IN, OUT)), sgd(), comm, p.cursor(), bf16) else {
        panic!("bf16 over a collective without it was accepted")
    };
    let e = e.to_string();
    assert!(e.contains("driver.wire") && e.contains("mpi"), "{e}");
}

fn two_level(total: u64, global: SyncRule, local: SyncRule) -> Plan {
    plan(total, global).with_local(local).unwrap()
}

/// [`run_mlp`] with nodes of `node` workers.
fn run_nodes(k: usize, node: usize, plan: &Plan, optim: OptimizerConfig) -> Run {
    NODE_SIZE.with(|c| c.set(node));
    let run = run_mlp(k, plan, optim, DriverConfig::default(), None);
    NODE_SIZE.with(|c| c.set(1));
    run
}

fn same_params(a: &Run, b: &Run) -> bool {
    a.params.iter().zip(&b.params).all(|(x, y)| bit_identical(x, y))
}

#[test]
fn local_every_step_under_a_data_parallel_global_rule_equals_data_parallel() {
    let momentum = OptimizerConfig::sgd(0.9, 1e-4);
    let two = run_nodes(4, 2, &two_level(24, SyncRule::Dp, SyncRule::Constant { h: 1 }), momentum.clone());
    let dp = run_mlp(4, &plan(24, SyncRule::Dp), momentum, DriverConfig::default(), None);
    assert!(same_params(&two, &dp));
    assert!(two.reports.iter().flatten().all(|r| r.sync.is_some_and(|s| s.level == Level::Global)));
}

#[test]
fn nodes_of_one_worker_equal_the_flat_global_rule() {
    let qsr = SyncRule::Qsr { h_base: 2, alpha: 0.15 };
    let momentum = OptimizerConfig::sgd(0.9, 1e-4);
    let two = run_nodes(3, 1, &two_level(40, qsr.clone(), SyncRule::Constant { h: 1 }), momentum.clone());
    let flat = run_mlp(3, &plan(40, qsr), momentum, DriverConfig::default(), None);
    assert!(two.reports[0].iter().any(|r| r.sync.is_some_and(|s| s.level == Level::Local)));
    assert!(same_params(&two, &flat));
}

#[test]
fn one_node_equals_the_flat_rule_that_syncs_at_both_levels() {
    let momentum = OptimizerConfig::sgd(0.9, 1e-4);
    let p = two_level(32, SyncRule::Constant { h: 8 }, SyncRule::Constant { h: 2 });
    let two = run_nodes(4, 4, &p, momentum.clone());
    let flat = run_mlp(4, &plan(32, SyncRule::Constant { h: 2 }), momentum, DriverConfig::default(), None);
    assert!(same_params(&two, &flat));
}

#[test]
fn local_averages_join_a_node_and_count_apart_from_the_global_ones() {
    let p = two_level(36, SyncRule::Constant { h: 6 }, SyncRule::Constant { h: 2 });
    let run = run_nodes(4, 2, &p, OptimizerConfig::sgd(0.9, 0.0));
    let levels: Vec<Option<Level>> = run.reports[0].iter().map(|r| r.sync.map(|s| s.level)).collect();
    let (local, global) = (Some(Level::Local), Some(Level::Global));
    assert_eq!(&levels[..6], &[None, local, None, local, None, global]);
    for (i, level) in levels.iter().filter(|l| l.is_some()).enumerate() {
        let after = |rank: usize| &run.after_sync[rank][i];
        // A node agrees after its local average; the two nodes agree only after a global one.
        assert!(bit_identical(after(0), after(1)) && bit_identical(after(2), after(3)), "sync {i}");
        assert_eq!(bit_identical(after(0), after(2)), *level == global, "sync {i} ({level:?})");
    }
    // A broadcast, then one call per global sync and none for the local ones.
    assert_eq!(run.calls[0], 1 + 6);
}

#[test]
fn a_two_level_plan_without_a_node_and_a_node_without_one_are_refused() {
    let device = device();
    let model = init(Mlp::new(&device, IN, OUT));
    let comm = || Box::new(InProcessGroup::new(1).remove(0));
    let flat = plan(10, SyncRule::Constant { h: 2 });
    let mut w = Worker::new(model.clone(), sgd(), comm(), flat.cursor(), DriverConfig::default()).unwrap();
    let e = w.set_local(comm()).unwrap_err().to_string();
    assert!(e.contains("sync.local") && e.contains("no local level"), "{e}");
    let p = two_level(10, SyncRule::Constant { h: 4 }, SyncRule::Constant { h: 2 });
    let mut w = Worker::new(model, sgd(), comm(), p.cursor(), DriverConfig::default()).unwrap();
    let task = Task::new();
    let e = w
        .step(|m: &Mlp, _| {
            let (x, y) = task.batch(0, BATCH, &device);
            Ok(mse(m.forward(x), y))
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("Worker::set_local"), "{e}");
}

/// One MLP worker of `k` trained from its cursor to `until` steps (`Task::start` data).
fn train_until(w: &mut Worker<Mlp>, task: &Task, rank: usize, k: usize, until: u64) {
    let device = device();
    while w.cursor().step() < until {
        let t = w.cursor().step();
        w.step(|m: &Mlp, _| {
            let (x, y) = task.batch(Task::start(rank, k, t, 0, 1), BATCH, &device);
            Ok(mse(m.forward(x), y))
        })
        .unwrap();
    }
}

/// Two workers train to step 8 (two steps into the round after the sync at 6), abandon the round,
/// form a new group and continue from the newest sync, held by rank 1; with `lagging`, rank 0 had
/// gone back to an older sync (step 3) and takes rank 1's over. Returns each rank's final parameters.
fn abandon_and_redo(lagging: bool, p: &Plan, optim: &OptimizerConfig, outer: OuterConfig) -> Vec<Vec<f32>> {
    let k = 2;
    let model = init(Mlp::new(&device(), IN, OUT));
    let task = Task::new();
    let (first, second) = (InProcessGroup::new(k), InProcessGroup::new(k));
    thread::scope(|s| {
        let handles: Vec<_> = first
            .into_iter()
            .zip(second)
            .enumerate()
            .map(|(rank, (a, b))| {
                let (model, task, optim) = (model.clone(), &task, optim.clone());
                s.spawn(move || {
                    let mut w = Worker::new(model, optim, Box::new(a), p.cursor(), DriverConfig::default()).unwrap();
                    w.set_outer(outer).unwrap();
                    train_until(&mut w, task, rank, k, 3);
                    let older = w.snapshot().unwrap();
                    train_until(&mut w, task, rank, k, 6);
                    // Taken into the buffers of the older one, as an elastic trainer does at every sync.
                    let mut snap = older.clone();
                    w.snapshot_into(&mut snap).unwrap();
                    assert_eq!(snap.step(), 6);
                    train_until(&mut w, task, rank, k, 8);
                    w.restore_snapshot(if lagging && rank == 0 { &older } else { &snap }).unwrap();
                    w.replace_comm(Box::new(b)).unwrap();
                    w.adopt(1, p.cursor_at(6)).unwrap();
                    assert_eq!(w.cursor().step(), 6);
                    assert_eq!(&*w.params().unwrap(), snap.params(), "rank {rank} did not take rank 1's sync");
                    train_until(&mut w, task, rank, k, 12);
                    w.params().unwrap().to_vec()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_round_abandoned_to_its_snapshot_and_redone_over_a_new_group_equals_the_straight_run() {
    let p = plan(12, SyncRule::Constant { h: 3 });
    let (optim, outer) = (OptimizerConfig::adamw(0.01), OuterConfig::diloco());
    let straight = run_mlp_outer(2, &p, (optim.clone(), Some(outer)), DriverConfig::default(), None);
    let redone = abandon_and_redo(false, &p, &optim, outer);
    assert_eq!(redone, straight.params, "the redone round left the straight trajectory");
    // A rank that lagged a sync behind takes the newest one over (with its own, older moments).
    let lagged = abandon_and_redo(true, &p, &optim, outer);
    assert_eq!(lagged[0], lagged[1], "the ranks ended apart");
    assert_ne!(lagged[0], straight.params[0], "older moments should have changed the trajectory");
}

/// With `driver.fingerprint`, ranks left with different parameters by an average fail at that sync,
/// naming its step, on every rank; without it they train on apart. With equal parameters the check
/// changes no bit.
#[test]
fn a_fingerprint_fails_ranks_whose_parameters_differ_after_an_average_naming_the_step() {
    let p = plan(12, SyncRule::Constant { h: 4 });
    let fingerprinted = DriverConfig { fingerprint: true, ..DriverConfig::default() };
    let run = |config: DriverConfig| -> Vec<Result<Vec<f32>, qsr_optim::OptimError>> {
        let (device, task) = (device(), Task::new());
        let model = init(Mlp::new(&device, IN, OUT));
        thread::scope(|s| {
            let handles: Vec<_> = InProcessGroup::new(2)
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (model, task, device, config, p) = (model.clone(), &task, device.clone(), config.clone(), &p);
                    s.spawn(move || {
                        let comm = Box::new(NoBf16(comm, Some(1)));
                        let optim = OptimizerConfig::sgd(0.0, 0.0);
                        let mut w = Worker::new(model, optim, comm, p.cursor(), config).unwrap();
                        while !w.cursor().is_done() {
                            let t = w.cursor().step();
                            w.step(|m: &Mlp, micro| {
                                let (x, y) = task.batch(Task::start(rank, 2, t, micro, 1), BATCH, &device);
                                Ok(mse(m.forward(x), y))
                            })?;
                        }
                        Ok(w.params()?.to_vec())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    for result in run(fingerprinted.clone()) {
        let err = result.unwrap_err();
        assert!(matches!(err, qsr_optim::OptimError::ParametersDiffer { step: 3 }), "{err}");
    }
    let apart = run(DriverConfig::default());
    assert_ne!(apart[0].as_ref().unwrap(), apart[1].as_ref().unwrap(), "unchecked, the ranks drift apart");
    let straight = run_mlp(2, &p, OptimizerConfig::sgd(0.0, 0.0), DriverConfig::default(), None);
    let checked = run_mlp(2, &p, OptimizerConfig::sgd(0.0, 0.0), fingerprinted, None);
    assert_eq!(straight.params, checked.params, "the check changes no parameter");
}

/// The settings check's warnings reach a Worker's caller: a per-step outer momentum that amplifies
/// the average on 2-step rounds is said once the outer step is set (it was dropped before).
#[test]
fn a_workers_settings_warnings_are_kept_for_its_caller() {
    let device = device();
    let model = init(Mlp::new(&device, IN, OUT));
    let comm = InProcessGroup::new(1).remove(0);
    let p = plan(8, SyncRule::Constant { h: 2 });
    let mut w = Worker::new(model, OptimizerConfig::sgd(0.0, 0.0), Box::new(comm), p.cursor(), DriverConfig::default())
        .unwrap();
    assert!(w.warnings().is_empty(), "{:?}", w.warnings());
    let per_step = OuterConfig { lr: 0.7, momentum: 0.9, nesterov: true, unit: qsr_optim::OuterUnit::Lr };
    w.set_outer(per_step).unwrap();
    assert!(w.warnings().iter().any(|w| w.contains("outer.momentum")), "{:?}", w.warnings());
}
