//! Device-resident workers on burn's wgpu backend (Mesa lavapipe without a GPU) with burn's fusion
//! and autotune on, as the GPU builds have them: the code path of a CUDA run (flat state as cubecl
//! tensors, syncs by one fused kernel launch over the K workers' buffers, resolved through the fusion
//! client) checked bit for bit against the host arithmetic and within tolerance of the CPU run.
//!
//! `cargo xtask ci` runs them: `cargo test --release -p qsr-optim --features wgpu --test it device_wgpu`.
//! The tests take [`GPU`] so that launch counts see no other test's kernels.
#![cfg(feature = "wgpu-plain")]

use std::sync::Mutex;
use std::thread;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, DeviceKind, Distribution, Int, Tensor, TensorData};
use qsr_comm::InProcessGroup;
use qsr_kernels::cube::LaunchCount;
use qsr_models::{CifarResNetConfig, GptConfig, InputSpec, ModelConfig};
use qsr_optim::{DeviceGroup, DriverConfig, OptimizerConfig, ParamLayout, Residency, Worker};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Held by every test here: cubecl counts launches per process.
static GPU: Mutex<()> = Mutex::new(());

fn wgpu() -> Device {
    Device::wgpu(DeviceKind::Cpu)
}

#[derive(Module, Debug)]
struct Net {
    fc: Linear,
}

/// Each worker's parameters after every sync, its fused syncs, and the syncs of the run.
fn run(device: &Device, k: usize, optim: OptimizerConfig) -> (Vec<Vec<Vec<f32>>>, Vec<u64>, u64) {
    let layout_model = Net { fc: LinearConfig::new(6, 3).init(device) };
    let layout = ParamLayout::of(&layout_model);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let init: Vec<f32> = (0..layout.len()).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    let model = layout.write_params(layout_model, &init).unwrap();
    let plan = Plan::new(LrSchedule::new(ScheduleKind::Cosine, 12, 2, 0.1, 0.0), SyncRule::Constant { h: 2 }).unwrap();
    let config = DriverConfig { residency: Residency::Device, ..DriverConfig::default() };
    let out: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = InProcessGroup::new(k)
            .into_iter()
            .zip(DeviceGroup::new(k))
            .enumerate()
            .map(|(rank, (comm, group))| {
                let (model, optim, config, plan, device) =
                    (model.clone(), optim.clone(), config.clone(), &plan, device.clone());
                s.spawn(move || {
                    let mut w = Worker::new(model, optim, Box::new(comm), plan.cursor(), config).unwrap();
                    assert!(w.is_device_resident());
                    w.set_device_group(group).unwrap();
                    let mut at_syncs = Vec::new();
                    while !w.cursor().is_done() {
                        let t = w.cursor().step() as usize;
                        w.step(|m: &Net, _| {
                            let x: Vec<f32> =
                                (0..8 * 6).map(|i| (((i + 7 * rank + 13 * t) % 17) as f32 - 8.0) / 8.0).collect();
                            let y: Vec<f32> =
                                (0..8 * 3).map(|i| (((i * 3 + rank + t) % 5) as f32 - 2.0) / 2.0).collect();
                            let x = Tensor::<2>::from_data(TensorData::new(x, [8, 6]), &device);
                            let y = Tensor::<2>::from_data(TensorData::new(y, [8, 3]), &device);
                            Ok((m.fc.forward(x) - y).powf_scalar(2.0).mean())
                        })
                        .unwrap();
                        if w.stats().syncs > at_syncs.len() as u64 {
                            at_syncs.push(w.params().unwrap().into_owned());
                        }
                    }
                    (at_syncs, w.stats().fused_syncs, w.stats().syncs)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let syncs = out[0].2;
    (out.iter().map(|o| o.0.clone()).collect(), out.iter().map(|o| o.1).collect(), syncs)
}

#[test]
fn fused_device_sync_on_wgpu_matches_the_cpu_run() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let flex = Device::flex().autodiff();
    for optim in [OptimizerConfig::sgd(0.9, 1e-3), OptimizerConfig::adamw(0.01)] {
        let (gpu_params, fused, syncs) = run(&wgpu().autodiff(), 3, optim.clone());
        let (cpu_params, cpu_fused, _) = run(&flex, 3, optim.clone());
        assert_eq!(syncs, 6);
        assert!(fused.iter().all(|&f| f == syncs), "every sync on wgpu must use the fused kernel: {fused:?}");
        assert!(cpu_fused.iter().all(|&f| f == 0), "the CPU backend has no cubecl kernel");
        for (j, per_sync) in gpu_params.iter().enumerate() {
            assert_eq!(per_sync.len() as u64, syncs);
            for (i, p) in per_sync.iter().enumerate() {
                let same = p.iter().zip(&gpu_params[0][i]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "worker {j} differs from worker 0 after sync {i}");
                for (a, b) in p.iter().zip(&cpu_params[j][i]) {
                    let close = (a - b).abs() <= 1e-4 * (1.0 + b.abs());
                    assert!(close, "{:?} worker {j} sync {i}: wgpu {a} vs cpu {b}", optim.kind);
                }
            }
        }
    }
}

/// Tensors whose values are still queued in fusion (element-wise chains not yet run) average to the
/// host arithmetic's bits, `((t_0 + t_1) + t_2) / 3`, in one launch per tensor.
#[test]
fn the_fused_average_of_queued_operations_is_bit_exact_against_the_host() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let (k, lens) = (3, [1usize, 7, 4096, 100_003]);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let inputs: Vec<Vec<Vec<f32>>> = (0..k)
        .map(|_| lens.iter().map(|&n| (0..n).map(|_| rng.random_range(-4f32..4.0)).collect()).collect())
        .collect();
    // Each rank deposits `x * 1.5 - 0.25`: queued, not yet computed, when it reaches the group.
    let deposited = |x: &[f32]| x.iter().map(|v| v * 1.5 - 0.25).collect::<Vec<f32>>();
    let count = LaunchCount::start();
    let out: Vec<(Vec<Vec<f32>>, bool)> = thread::scope(|s| {
        let hs: Vec<_> = DeviceGroup::new(k)
            .into_iter()
            .zip(&inputs)
            .map(|(group, mine)| {
                s.spawn(move || {
                    let device = wgpu();
                    let tensors = mine
                        .iter()
                        .map(|x| Tensor::<1>::from_data(TensorData::new(x.clone(), [x.len()]), &device) * 1.5 - 0.25)
                        .collect();
                    let (avg, fused) = group.average(tensors).unwrap();
                    (avg.into_iter().map(|t| t.into_data().try_to_vec::<f32>().unwrap()).collect(), fused)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let launches = count.launches();
    for (slot, &n) in lens.iter().enumerate() {
        let ranks: Vec<Vec<f32>> = inputs.iter().map(|r| deposited(&r[slot])).collect();
        let want: Vec<f32> = (0..n).map(|i| ((ranks[0][i] + ranks[1][i]) + ranks[2][i]) / 3.0).collect();
        for (rank, (got, fused)) in out.iter().enumerate() {
            assert!(fused, "rank {rank}: the average did not use the fused kernel");
            let same = got[slot].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {rank}, tensor {slot} ({n} values) differs from the host arithmetic");
        }
    }
    // One averaging launch per tensor; each rank's element-wise chain is at most two kernels per
    // tensor (one under fusion; plain burn launches the multiply and the subtraction).
    let most = (lens.len() + k * lens.len() * 2) as u64;
    assert!(launches >= lens.len() as u64 && launches <= most, "{launches} launches, at most {most}");
}

/// Under fusion an element-wise chain is one kernel; without it, one per operation.
#[test]
fn an_element_wise_chain_is_one_launch_under_fusion() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let device = wgpu();
    let x = Tensor::<1>::from_data(TensorData::new(vec![1f32; 4096], [4096]), &device);
    x.device().sync().unwrap();
    let count = LaunchCount::start();
    let y = ((x * 2.0 + 1.0) * 3.0 - 4.0).exp();
    let values = y.into_data().try_to_vec::<f32>().unwrap();
    let launches = count.launches();
    assert!(values.iter().all(|&v| (v / 5f32.exp() - 1.0).abs() < 1e-5), "{}", values[0]);
    let want = if cfg!(feature = "fusion") { 1 } else { 5 };
    assert_eq!(launches, want, "kernel launches for five element-wise operations");
}

/// One training step of the medium GPT (4 layers, 8 heads, width 256, context 128) and of ResNet-20
/// completes on the device-resident path, burn's fused and autotuned kernels under the model.
#[test]
fn a_medium_gpt_and_a_resnet20_step_complete_on_wgpu() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let device = wgpu().autodiff();
    device.seed(0);
    let gpt = GptConfig { vocab_size: 65, context: 128, layers: 4, heads: 8, width: 256, dropout: 0.0, bias: true };
    let (batch, context) = (2, gpt.context);
    let tokens = |offset: i64| {
        let ids: Vec<i64> = (0..(batch * context) as i64).map(|i| (i * 7 + offset) % 65).collect();
        Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, context]), &device)
    };
    let moved = one_step(gpt.init(&device).unwrap(), OptimizerConfig::adamw(0.1), |m| {
        let logits = m.forward(tokens(0)).unwrap();
        let [n, t, v] = logits.dims();
        qsr_models::fused::cross_entropy(logits.reshape([n * t, v]), tokens(1).reshape([n * t]), None)
    });
    assert!(moved, "the GPT step changed no parameter");
    let resnet = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: Default::default() });
    let model = resnet.init(InputSpec::new(3, 32, 32), 10, &device).unwrap();
    let images = Tensor::<4>::random([8, 3, 32, 32], Distribution::Normal(0.0, 1.0), &device);
    let labels = Tensor::<1, Int>::from_data(TensorData::new((0..8i64).collect::<Vec<_>>(), [8]), &device);
    let moved = one_step(model, OptimizerConfig::sgd(0.9, 5e-4), |m| {
        qsr_models::fused::cross_entropy(m.forward(images.clone()), labels.clone(), None)
    });
    assert!(moved, "the ResNet-20 step changed no parameter");
}

/// One device-resident step of `model` with `loss`; whether the parameters moved, all finite.
fn one_step<M: Module>(model: M, optim: OptimizerConfig, loss: impl Fn(&M) -> Tensor<1>) -> bool {
    let plan =
        Plan::new(LrSchedule::new(ScheduleKind::Constant, 1, 0, 1e-3, 1e-3), SyncRule::Constant { h: 1 }).unwrap();
    let comm = Box::new(InProcessGroup::new(1).remove(0));
    let config = DriverConfig { residency: Residency::Device, ..DriverConfig::default() };
    let mut w = Worker::new(model, optim, comm, plan.cursor(), config).unwrap();
    assert!(w.is_device_resident());
    let before = w.params().unwrap().into_owned();
    w.step(|m: &M, _| Ok(loss(m))).unwrap();
    let after = w.params().unwrap().into_owned();
    assert!(after.iter().all(|v| v.is_finite()), "a parameter is not finite after the step");
    before.iter().zip(&after).any(|(a, b)| a != b)
}

/// More ranks than the kernel's buffers (K = 9 > 8): the group says the kernel did not run, burn
/// operations average instead, and every rank gets the same mean.
#[test]
fn more_ranks_than_the_kernel_takes_are_averaged_by_burn_operations() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let k = qsr_kernels::cube::MAX_BUFFERS + 1;
    let out: Vec<(Vec<f32>, bool)> = thread::scope(|s| {
        let hs: Vec<_> = DeviceGroup::new(k)
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                s.spawn(move || {
                    let values: Vec<f32> = (0..33).map(|i| (i * k + rank) as f32 * 0.25).collect();
                    let tensor = Tensor::<1>::from_data(TensorData::new(values, [33]), &wgpu());
                    let (avg, fused) = group.average(vec![tensor]).unwrap();
                    (avg[0].clone().into_data().try_to_vec::<f32>().unwrap(), fused)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (mean, fused)) in out.iter().enumerate() {
        assert!(!fused, "rank {rank}: {k} ranks cannot go through the kernel");
        assert_eq!(mean, &out[0].0, "rank {rank} got another mean");
    }
    for (i, m) in out[0].0.iter().enumerate() {
        let want = (0..k).map(|r| (i * k + r) as f32 * 0.25).sum::<f32>() / k as f32;
        assert!((m - want).abs() <= 1e-5 * want.abs().max(1.0), "element {i}: {m} vs {want}");
    }
}
