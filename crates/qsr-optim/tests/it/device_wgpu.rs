//! Device-resident workers on burn's wgpu backend (Mesa lavapipe without a GPU): the code path of a
//! CUDA run — flat state as cubecl tensors, syncs by one fused kernel launch over the K workers'
//! buffers — checked against the same run on the CPU backend.
//!
//! Not part of `cargo xtask ci` (burn's wgpu build costs CI ~15 minutes); run it with
//! `cargo test --release -p qsr-optim --features wgpu --test device_wgpu`.
#![cfg(feature = "wgpu")]

use std::thread;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, DeviceKind, Tensor, TensorData};
use qsr_comm::InProcessGroup;
use qsr_optim::{DeviceGroup, DriverConfig, OptimizerConfig, ParamLayout, Residency, Worker};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Module, Debug)]
struct Net {
    fc: Linear,
}

fn run(device: &Device, k: usize, optim: OptimizerConfig) -> (Vec<Vec<f32>>, Vec<u64>, u64) {
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
                    }
                    (w.params().unwrap().into_owned(), w.stats().fused_syncs, w.stats().syncs)
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
    let wgpu = Device::wgpu(DeviceKind::Cpu).autodiff();
    let flex = Device::flex().autodiff();
    for optim in [OptimizerConfig::sgd(0.9, 1e-3), OptimizerConfig::adamw(0.01)] {
        let (gpu_params, fused, syncs) = run(&wgpu, 3, optim.clone());
        let (cpu_params, cpu_fused, _) = run(&flex, 3, optim.clone());
        assert_eq!(syncs, 6);
        assert!(fused.iter().all(|&f| f == syncs), "every sync on wgpu must use the fused kernel: {fused:?}");
        assert!(cpu_fused.iter().all(|&f| f == 0), "the CPU backend has no cubecl kernel");
        for (j, p) in gpu_params.iter().enumerate() {
            assert!(
                p.iter().zip(&gpu_params[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "worker {j} differs after the last sync"
            );
            for (a, b) in p.iter().zip(&cpu_params[j]) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{:?} worker {j}: wgpu {a} vs cpu {b}", optim.kind);
            }
        }
    }
}
