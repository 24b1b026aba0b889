//! A few steps of burn's SGD on one fixed batch must drive the cross-entropy loss down for the
//! small models. Everything is seeded: the data by a local generator, the weights by
//! `Device::seed` (flex keeps one global RNG, hence the lock: weights are drawn lazily at the
//! first forward, so the whole test runs under it).

use std::sync::Mutex;

use crate::common::class_batch;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Device;
use qsr_models::{CifarResNetConfig, CifarShortcut, CnnConfig, InputSpec, MlpConfig, Model, ModelConfig, VitConfig};

static RNG_LOCK: Mutex<()> = Mutex::new(());

/// Trains `steps` SGD steps (momentum 0.9) and returns (initial loss, final loss).
// Without BN the default (PyTorch) init starts with small logits, so those models get lr 0.2.
fn train(cfg: ModelConfig, input: InputSpec, classes: usize, batch: usize, lr: f64, steps: usize) -> (f32, f32) {
    let _guard = RNG_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex().autodiff();
    device.seed(42);
    let mut model: Model = cfg.init(input, classes, &device).unwrap();
    let (x, y) = class_batch(batch, input.channels, input.height, input.width, classes, 1234, &device);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut optim =
        SgdConfig::new().with_momentum(Some(MomentumConfig { momentum: 0.9, dampening: 0.0, nesterov: false })).init();
    let mut losses = Vec::new();
    for _ in 0..steps {
        let loss = loss_fn.forward(model.forward(x.clone()), y.clone());
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    let last = loss_fn.forward(model.forward(x), y).into_scalar::<f32>();
    eprintln!("{losses:?} -> {last}");
    assert!(losses.iter().chain([&last]).all(|l| l.is_finite()));
    (losses[0], last)
}

fn assert_learns((first, last): (f32, f32)) {
    assert!(last < 0.7 * first, "loss did not fall enough: {first} -> {last}");
}

#[test]
fn mlp_learns() {
    assert_learns(train(
        ModelConfig::Mlp(MlpConfig { hidden: vec![64, 64] }),
        InputSpec::new(1, 8, 8),
        10,
        20,
        0.2,
        10,
    ));
}

#[test]
fn cnn_learns() {
    assert_learns(train(ModelConfig::Cnn(CnnConfig::default()), InputSpec::new(1, 8, 8), 10, 20, 0.05, 10));
    assert_learns(train(
        ModelConfig::Cnn(CnnConfig { batch_norm: false, channels: [32, 64] }),
        InputSpec::new(1, 8, 8),
        10,
        20,
        0.2,
        10,
    ));
}

#[test]
fn cifar_resnet20_learns() {
    let cfg = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A });
    assert_learns(train(cfg, InputSpec::new(3, 32, 32), 10, 10, 0.05, 10));
}

#[test]
fn vit_ti_learns() {
    // ViT-Ti (dim 192, depth 12, heads 3) on 3x8x8 images with patch 4: four tokens.
    let cfg = ModelConfig::Vit(VitConfig::preset(qsr_models::VitPreset::Ti, 4, 8));
    assert_learns(train(cfg, InputSpec::new(3, 8, 8), 10, 20, 0.02, 10));
}
