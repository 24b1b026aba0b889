//! One optimizer step on a ResNet-18-sized parameter set (11.7 M parameters in ResNet-18's 62 tensor
//! shapes): qsr-optim's full step as the driver runs it (gradients module -> flat, fused update, flat ->
//! module) against burn's own `ModuleOptimizer` with the same rule, on the same backend (flex).

use std::cell::RefCell;

use burn::module::{Module, Param};
use burn::optim::{AdamWConfig, GradientsParams, SgdConfig, decay::WeightDecayConfig, momentum::MomentumConfig};
use burn::tensor::{Device, Gradients, Tensor};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use qsr_optim::{Optimizer, OptimizerConfig, ParamLayout};

#[derive(Module, Debug)]
struct Params {
    tensors: Vec<Param<Tensor<2>>>,
}

/// ResNet-18's parameter shapes (conv kernels flattened to 2-D), 11,689,512 elements.
fn resnet18_shapes() -> Vec<[usize; 2]> {
    let mut s = vec![[64, 3 * 49], [1, 64], [1, 64]];
    let mut cin = 64;
    for (cout, first_stride) in [(64, 1), (128, 2), (256, 2), (512, 2)] {
        for block in 0..2 {
            let input = if block == 0 { cin } else { cout };
            s.extend([[cout, input * 9], [1, cout], [1, cout], [cout, cout * 9], [1, cout], [1, cout]]);
            if block == 0 && (first_stride != 1 || cin != cout) {
                s.extend([[cout, cin], [1, cout], [1, cout]]);
            }
        }
        cin = cout;
    }
    s.extend([[1000, 512], [1, 1000]]);
    s
}

fn model(device: &Device) -> Params {
    let tensors = resnet18_shapes()
        .into_iter()
        .map(|shape| Param::from_tensor(Tensor::<2>::ones(shape, device).mul_scalar(0.01).require_grad()))
        .collect();
    Params { tensors }
}

fn grads(m: &Params) -> Gradients {
    let loss = m.tensors.iter().map(|p| p.val().mul_scalar(0.5).powf_scalar(2.0).sum()).reduce(|a, b| a + b).unwrap();
    loss.backward()
}

fn step(c: &mut Criterion) {
    let device = Device::flex().autodiff();
    let m = model(&device);
    let layout = ParamLayout::of(&m);
    assert_eq!(layout.len(), 11_689_512);
    for (name, ours, mut theirs) in [
        (
            "sgd_momentum_wd",
            OptimizerConfig::sgd(0.9, 1e-4),
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                .with_weight_decay(Some(WeightDecayConfig::new(1e-4)))
                .init(),
        ),
        ("adamw_wd", OptimizerConfig::adamw(0.05), AdamWConfig::new().with_weight_decay(0.05).init()),
    ] {
        let mut g = c.benchmark_group(format!("optimizer_step_resnet18_{name}"));
        g.sample_size(10);
        let mut opt = Optimizer::new(ours, layout.len(), &[]).unwrap();
        let mut params = vec![0.0f32; layout.len()];
        layout.read_params(&m, &mut params).unwrap();
        let mut flat_grads = vec![0.0f32; layout.len()];
        // The model is replaced by every step; a RefCell lets the (untimed) set-up take gradients of the
        // current one.
        let ours_model = RefCell::new(Some(m.clone()));
        g.bench_function("qsr", |b| {
            b.iter_batched(
                || grads(ours_model.borrow().as_ref().unwrap()),
                |mut gr| {
                    let model = ours_model.borrow_mut().take().unwrap();
                    layout.read_grads(&model, &mut gr, &mut flat_grads).unwrap();
                    opt.step(&mut params, &mut flat_grads, 1e-3);
                    *ours_model.borrow_mut() = Some(layout.write_params(model, &params).unwrap());
                },
                BatchSize::PerIteration,
            )
        });
        let burn_model = RefCell::new(Some(m.clone()));
        g.bench_function("burn_module_optimizer", |b| {
            b.iter_batched(
                || {
                    let model = burn_model.borrow();
                    let model = model.as_ref().unwrap();
                    GradientsParams::from_grads(grads(model), model)
                },
                |gp| {
                    let model = burn_model.borrow_mut().take().unwrap();
                    *burn_model.borrow_mut() = Some(theirs.step(1e-3, model, gp));
                },
                BatchSize::PerIteration,
            )
        });
        g.finish();
    }
}

criterion_group!(benches, step);
criterion_main!(benches);
