//! Builds models from `ModelConfig` (the `[model]` section of a recipe) on burn's flex (CPU) device and prints
//! their parameter counts: torchvision ResNet-18 and ResNet-50 (11,689,512 and 25,557,032 trainable parameters,
//! as `sum(p.numel() for p in model.parameters())` in PyTorch), He et al.'s CIFAR ResNet-20, and SimpleViT-Ti/16
//! and -B/16 (86,381,800), and GPT-2 small (124,439,808 with its tied LM head). burn creates parameters lazily, so
//! counting reads shapes only and allocates no weights.
//!
//! ```sh
//! cargo run --release -p qsr-models --example count_params
//! ```

use burn::module::Module;
use burn::tensor::Device;
use qsr_models::{
    CifarResNetConfig, CifarShortcut, GptConfig, InputSpec, ModelConfig, ModelError, ResNetConfig, VitConfig,
    VitPreset, param_count,
};

fn main() -> Result<(), ModelError> {
    let device = Device::flex();
    let imagenet = InputSpec::new(3, 224, 224);
    let cifar = InputSpec::new(3, 32, 32);
    let models = [
        ("ResNet-18", ModelConfig::Resnet(ResNetConfig { depth: 18, zero_init_residual: false }), imagenet, 1000),
        ("ResNet-50", ModelConfig::Resnet(ResNetConfig { depth: 50, zero_init_residual: false }), imagenet, 1000),
        (
            "CIFAR ResNet-20 (shortcut A)",
            ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A }),
            cifar,
            10,
        ),
        ("SimpleViT-Ti/16", ModelConfig::Vit(VitConfig::preset(VitPreset::Ti, 16, 224)), imagenet, 1000),
        ("SimpleViT-B/16", ModelConfig::Vit(VitConfig::preset(VitPreset::B, 16, 224)), imagenet, 1000),
    ];

    println!("{:<29} {:>7} {:>12} {:>16} {:>9}", "model", "classes", "trainable", "with BN stats", "BN layers");
    for (name, config, input, classes) in models {
        let model = config.init(input, classes, &device)?;
        // param_count: PyTorch's parameters(); burn's num_params also counts BN running mean and variance.
        println!(
            "{name:<29} {classes:>7} {:>12} {:>16} {:>9}",
            param_count(&model),
            model.num_params(),
            model.batch_norm_count()
        );
    }
    let gpt2 = GptConfig::gpt2_small().init(&device)?;
    let n = param_count(&gpt2);
    println!("{:<29} {:>7} {n:>12} {:>16} {:>9}", "GPT-2 small (tied head)", "-", n, 0);
    Ok(())
}
