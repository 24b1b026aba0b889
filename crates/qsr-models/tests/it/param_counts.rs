//! Trainable parameter counts against PyTorch (`sum(p.numel() for p in model.parameters())`).
//! Counting reads lazy shapes only, so even ViT-B and ResNet-152 allocate no weights here.

use burn::module::Module;
use burn::tensor::Device;
use qsr_models::{
    CifarResNetConfig, CifarShortcut, InputSpec, Model, ModelConfig, ResNetConfig, VitConfig, VitPreset,
    bn_running_stat_ids, param_count, trainable_param_ids,
};

fn imagenet() -> InputSpec {
    InputSpec::new(3, 224, 224)
}

fn resnet(depth: usize) -> Model {
    ModelConfig::Resnet(ResNetConfig { depth, zero_init_residual: false })
        .init(imagenet(), 1000, &Device::flex())
        .expect("valid resnet")
}

/// Sum of BN features, i.e. half the number of running-statistic elements.
fn bn_features(m: &Model) -> usize {
    let mut n = 0;
    m.for_each_batch_norm(|bn| n += bn.gamma.lazy_shape().num_elements());
    n
}

#[test]
fn torchvision_resnet_counts() {
    for (depth, expected) in
        [(18, 11_689_512), (34, 21_797_672), (50, 25_557_032), (101, 44_549_160), (152, 60_192_808)]
    {
        let m = resnet(depth);
        assert_eq!(param_count(&m), expected, "resnet{depth}");
        // burn's num_params also counts running_mean and running_var
        assert_eq!(m.num_params(), expected + 2 * bn_features(&m), "resnet{depth} num_params");
        assert_eq!(bn_running_stat_ids(&m).len(), 2 * m.batch_norm_count());
    }
}

#[test]
fn simple_vit_b16_count() {
    let m = ModelConfig::Vit(VitConfig::preset(VitPreset::B, 16, 224)).init(imagenet(), 1000, &Device::flex()).unwrap();
    assert_eq!(param_count(&m), 86_381_800);
    // no BN, and the position embedding is not a parameter
    assert_eq!(m.num_params(), 86_381_800);
    assert!(!m.has_batch_norm());
}

/// Closed form of the SimpleViT count, to check the other presets against.
fn vit_formula(
    dim: usize,
    depth: usize,
    heads: usize,
    dim_head: usize,
    mlp: usize,
    patch_dim: usize,
    classes: usize,
) -> usize {
    let inner = heads * dim_head;
    let embed = 2 * patch_dim + patch_dim * dim + dim + 2 * dim;
    let block = 2 * dim + dim * 3 * inner + inner * dim + 2 * dim + dim * mlp + mlp + mlp * dim + dim;
    let head = 2 * dim + dim * classes + classes;
    embed + depth * block + head
}

#[test]
fn simple_vit_presets_match_formula() {
    for (preset, dim, heads, mlp) in
        [(VitPreset::Ti, 192, 3, 768), (VitPreset::S, 384, 6, 1536), (VitPreset::B, 768, 12, 3072)]
    {
        let m = ModelConfig::Vit(VitConfig::preset(preset, 16, 224)).init(imagenet(), 1000, &Device::flex()).unwrap();
        assert_eq!(param_count(&m), vit_formula(dim, 12, heads, 64, mlp, 768, 1000), "{preset:?}");
    }
    assert_eq!(vit_formula(768, 12, 12, 64, 3072, 768, 1000), 86_381_800);
}

/// He et al.'s ResNet-20 with option A has 269,722 parameters (0.27 M); 272,474 is the count with
/// option B projections (two 1x1 conv + BN shortcuts: 16*32 + 2*32 + 32*64 + 2*64 = 2,752 more).
#[test]
fn cifar_resnet_counts() {
    let build = |depth, shortcut| {
        ModelConfig::CifarResnet(CifarResNetConfig { depth, shortcut })
            .init(InputSpec::new(3, 32, 32), 10, &Device::flex())
            .unwrap()
    };
    let a = build(20, CifarShortcut::A);
    assert_eq!(param_count(&a), 269_722);
    let b = build(20, CifarShortcut::B);
    assert_eq!(param_count(&b), 272_474);
    // every float the visitor reaches is either trainable or a BN running statistic
    let mut all = 0;
    struct Count<'a>(&'a mut usize);
    impl burn::module::ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, _p: &burn::module::Param<burn::tensor::Tensor<D>>) {
            *self.0 += 1;
        }
    }
    b.visit(&mut Count(&mut all));
    assert_eq!(trainable_param_ids(&b).len() + bn_running_stat_ids(&b).len(), all);
    assert_eq!(bn_running_stat_ids(&b).len(), 2 * b.batch_norm_count());
    assert_eq!(b.num_params(), 272_474 + 2 * bn_features(&b));
    for (depth, expected) in [(32, 464_154), (44, 658_586), (56, 853_018), (110, 1_727_962)] {
        assert_eq!(param_count(&build(depth, CifarShortcut::A)), expected, "cifar resnet{depth} option A");
        assert_eq!(param_count(&build(depth, CifarShortcut::B)), expected + 2_752, "cifar resnet{depth} option B");
    }
}

#[test]
fn small_models_counts() {
    let d = Device::flex();
    let mlp = ModelConfig::Mlp(qsr_models::MlpConfig { hidden: vec![256, 256] })
        .init(InputSpec::new(1, 28, 28), 10, &d)
        .unwrap();
    assert_eq!(param_count(&mlp), 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
    let cnn = ModelConfig::Cnn(Default::default()).init(InputSpec::new(3, 32, 32), 10, &d).unwrap();
    // convs without bias (BN follows), BN gamma+beta, fc over 64 x 8 x 8
    assert_eq!(param_count(&cnn), 3 * 9 * 32 + 2 * 32 + 32 * 9 * 64 + 2 * 64 + 64 * 64 * 10 + 10);
    let cnn = ModelConfig::Cnn(qsr_models::CnnConfig { batch_norm: false, channels: [32, 64] })
        .init(InputSpec::new(1, 8, 8), 10, &d)
        .unwrap();
    assert_eq!(param_count(&cnn), 9 * 32 + 32 + 32 * 9 * 64 + 64 + 64 * 2 * 2 * 10 + 10);
    assert!(!cnn.has_batch_norm());
}
