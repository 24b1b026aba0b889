//! Forward shapes for every preset. Large models run one image, at a reduced image size where the
//! architecture allows it (torchvision ResNets end in an adaptive pool, so 32x32 works for 34-152;
//! ResNet-18 also runs once at the native 224x224). ViT-S/B run at 64x64 and 32x32 with patch 16,
//! ViT-Ti at its native 224/16.

use crate::common::{all_finite, images};
use burn::module::Module;
use burn::tensor::Device;
use qsr_models::{
    CifarResNetConfig, CifarShortcut, CnnConfig, InputSpec, MlpConfig, ModelConfig, ResNetConfig, VitConfig, VitPreset,
};

fn check(cfg: &ModelConfig, input: InputSpec, classes: usize, n: usize) {
    let d = Device::flex();
    let m = cfg.init(input, classes, &d).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    let y = m.forward(images(n, input.channels, input.height, input.width, 7, &d));
    assert_eq!(y.dims(), [n, classes], "{cfg:?} at {input:?}");
    assert!(all_finite(y), "{cfg:?}: non-finite logits");
}

#[test]
fn torchvision_resnets() {
    for depth in [18, 34, 50, 101, 152] {
        let cfg = ModelConfig::Resnet(ResNetConfig { depth, zero_init_residual: depth == 50 });
        check(&cfg, InputSpec::new(3, 32, 32), 1000, 1);
    }
    let r18 = ModelConfig::Resnet(ResNetConfig { depth: 18, zero_init_residual: false });
    check(&r18, InputSpec::new(3, 224, 224), 1000, 1);
    // grayscale, few classes, tiny images
    check(&r18, InputSpec::new(1, 8, 8), 10, 2);
}

#[test]
fn cifar_resnets() {
    for depth in [20, 32, 44, 56, 110] {
        check(
            &ModelConfig::CifarResnet(CifarResNetConfig { depth, shortcut: CifarShortcut::A }),
            InputSpec::new(3, 32, 32),
            10,
            2,
        );
    }
    let b = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::B });
    check(&b, InputSpec::new(3, 32, 32), 100, 2);
    // odd sizes: the stride-2 shortcut subsamples like x[:, :, ::2, ::2] (ceil), as the 3x3/2 conv
    let a = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A });
    check(&a, InputSpec::new(1, 28, 28), 10, 2);
    check(&a, InputSpec::new(1, 7, 9), 10, 2);
}

#[test]
fn simple_vits() {
    check(&ModelConfig::Vit(VitConfig::preset(VitPreset::Ti, 16, 224)), InputSpec::new(3, 224, 224), 1000, 1);
    check(&ModelConfig::Vit(VitConfig::preset(VitPreset::S, 16, 64)), InputSpec::new(3, 64, 64), 1000, 1);
    check(&ModelConfig::Vit(VitConfig::preset(VitPreset::B, 16, 32)), InputSpec::new(3, 32, 32), 1000, 1);
    // non-square input without image_size, patch 4
    let mut c = VitConfig::preset(VitPreset::Ti, 4, 0);
    c.image_size = None;
    check(&ModelConfig::Vit(c), InputSpec::new(1, 8, 12), 10, 3);
}

#[test]
fn small_models() {
    for input in [InputSpec::new(1, 28, 28), InputSpec::new(1, 8, 8), InputSpec::new(3, 32, 32)] {
        for batch_norm in [true, false] {
            check(&ModelConfig::Cnn(CnnConfig { batch_norm, channels: [32, 64] }), input, 10, 3);
        }
        check(&ModelConfig::Mlp(MlpConfig { hidden: vec![256, 256] }), input, 10, 3);
        check(&ModelConfig::Mlp(MlpConfig { hidden: vec![] }), input, 10, 3);
    }
}

#[test]
fn train_and_eval_paths_on_autodiff_device() {
    let d = Device::flex().autodiff();
    let m = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A })
        .init(InputSpec::new(3, 16, 16), 10, &d)
        .unwrap();
    let x = images(4, 3, 16, 16, 3, &d);
    assert_eq!(m.forward(x.clone()).dims(), [4, 10]);
    let eval = m.valid();
    let y = eval.forward(x.without_autodiff());
    assert_eq!(y.dims(), [4, 10]);
    assert!(all_finite(y));
}
