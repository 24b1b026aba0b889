//! torchvision ResNet-18/34/50/101/152 (`torchvision.models.resnet`, v1.5).
//!
//! Structure, parameter shapes and initialisation follow torchvision exactly:
//! - stem: conv 7x7/2 pad 3 (no bias) -> BN -> ReLU -> max pool 3x3/2 pad 1;
//! - four stages of 64/128/256/512 planes with strides 1/2/2/2;
//! - basic block (18/34): conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN, + shortcut, ReLU;
//! - bottleneck (50/101/152, expansion 4): conv1x1 -> BN -> ReLU -> conv3x3(stride) -> BN -> ReLU ->
//!   conv1x1 -> BN, + shortcut, ReLU. The stride sits on the 3x3 conv ("ResNet v1.5").
//! - downsample (when the stride is not 1 or the width changes): conv1x1(stride, no bias) -> BN;
//! - adaptive average pool to 1x1 -> fc.
//!
//! Initialisation: convs `kaiming_normal_(mode="fan_out", nonlinearity="relu")`, BN weight 1 bias 0,
//! fc PyTorch's default `Linear` init (burn's default `Linear` init is the same U(±1/sqrt(fan_in))).
//! With `zero_init_residual` the last BN gamma of each block starts at 0 (torchvision's option,
//! off by default there and here).

use burn::module::{Initializer, Module};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use crate::fused;

/// torchvision's conv init: kaiming normal, fan_out mode, ReLU gain sqrt(2).
pub(crate) fn kaiming_fan_out() -> Initializer {
    Initializer::KaimingNormal { gain: std::f64::consts::SQRT_2, fan_out_only: true }
}

/// Conv without bias (every conv in torchvision's ResNet is followed by BN).
pub(crate) fn conv(
    cin: usize,
    cout: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    init: Initializer,
    device: &Device,
) -> Conv2d {
    Conv2dConfig::new([cin, cout], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_bias(false)
        .with_initializer(init)
        .init(device)
}

/// BN with PyTorch's defaults (eps 1e-5, momentum 0.1, gamma 1, beta 0); `zero_gamma` for the
/// zero-init-residual option.
pub(crate) fn bn(features: usize, zero_gamma: bool, device: &Device) -> BatchNorm {
    let mut bn = BatchNormConfig::new(features).init(device);
    if zero_gamma {
        bn.gamma = Initializer::Zeros.init([features], device);
    }
    bn
}

/// 1x1 conv + BN projection shortcut.
#[derive(Module, Debug)]
pub struct Downsample {
    /// 1x1 conv with the block's stride, no bias.
    pub conv: Conv2d,
    /// BN after the projection.
    pub bn: BatchNorm,
}

impl Downsample {
    fn new(cin: usize, cout: usize, stride: usize, device: &Device) -> Self {
        Self { conv: conv(cin, cout, 1, stride, 0, kaiming_fan_out(), device), bn: bn(cout, false, device) }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        fused::batch_norm(&self.bn, fused::conv2d(&self.conv, x))
    }
}

/// torchvision `BasicBlock` (expansion 1).
#[derive(Module, Debug)]
pub struct BasicBlock {
    /// 3x3 conv carrying the stride.
    pub conv1: Conv2d,
    /// BN after conv1.
    pub bn1: BatchNorm,
    /// 3x3 conv, stride 1.
    pub conv2: Conv2d,
    /// BN after conv2 (zero gamma under `zero_init_residual`).
    pub bn2: BatchNorm,
    /// Projection shortcut, present when shape changes.
    pub downsample: Option<Downsample>,
}

impl BasicBlock {
    fn new(cin: usize, planes: usize, stride: usize, zero_init: bool, device: &Device) -> Self {
        let downsample = (stride != 1 || cin != planes).then(|| Downsample::new(cin, planes, stride, device));
        Self {
            conv1: conv(cin, planes, 3, stride, 1, kaiming_fan_out(), device),
            bn1: bn(planes, false, device),
            conv2: conv(planes, planes, 3, 1, 1, kaiming_fan_out(), device),
            bn2: bn(planes, zero_init, device),
            downsample,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let identity = match &self.downsample {
            Some(d) => d.forward(x.clone()),
            None => x.clone(),
        };
        let out = relu(fused::batch_norm(&self.bn1, fused::conv2d(&self.conv1, x)));
        let out = fused::batch_norm(&self.bn2, fused::conv2d(&self.conv2, out));
        relu(out + identity)
    }

    fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        f(&mut self.bn1);
        f(&mut self.bn2);
        if let Some(d) = &mut self.downsample {
            f(&mut d.bn);
        }
    }

    fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        f(&self.bn1);
        f(&self.bn2);
        if let Some(d) = &self.downsample {
            f(&d.bn);
        }
    }
}

/// torchvision `Bottleneck` (expansion 4, stride on the 3x3 conv).
#[derive(Module, Debug)]
pub struct Bottleneck {
    /// 1x1 reduce.
    pub conv1: Conv2d,
    /// BN after conv1.
    pub bn1: BatchNorm,
    /// 3x3 conv carrying the stride (v1.5).
    pub conv2: Conv2d,
    /// BN after conv2.
    pub bn2: BatchNorm,
    /// 1x1 expand to 4x planes.
    pub conv3: Conv2d,
    /// BN after conv3 (zero gamma under `zero_init_residual`).
    pub bn3: BatchNorm,
    /// Projection shortcut, present when shape changes.
    pub downsample: Option<Downsample>,
}

impl Bottleneck {
    const EXPANSION: usize = 4;

    fn new(cin: usize, planes: usize, stride: usize, zero_init: bool, device: &Device) -> Self {
        let width = planes; // groups 1, base width 64
        let cout = planes * Self::EXPANSION;
        let downsample = (stride != 1 || cin != cout).then(|| Downsample::new(cin, cout, stride, device));
        Self {
            conv1: conv(cin, width, 1, 1, 0, kaiming_fan_out(), device),
            bn1: bn(width, false, device),
            conv2: conv(width, width, 3, stride, 1, kaiming_fan_out(), device),
            bn2: bn(width, false, device),
            conv3: conv(width, cout, 1, 1, 0, kaiming_fan_out(), device),
            bn3: bn(cout, zero_init, device),
            downsample,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let identity = match &self.downsample {
            Some(d) => d.forward(x.clone()),
            None => x.clone(),
        };
        let out = relu(fused::batch_norm(&self.bn1, fused::conv2d(&self.conv1, x)));
        let out = relu(fused::batch_norm(&self.bn2, fused::conv2d(&self.conv2, out)));
        let out = fused::batch_norm(&self.bn3, fused::conv2d(&self.conv3, out));
        relu(out + identity)
    }

    fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        f(&mut self.bn1);
        f(&mut self.bn2);
        f(&mut self.bn3);
        if let Some(d) = &mut self.downsample {
            f(&mut d.bn);
        }
    }

    fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        f(&self.bn1);
        f(&self.bn2);
        f(&self.bn3);
        if let Some(d) = &self.downsample {
            f(&d.bn);
        }
    }
}

/// Blocks of one stage: basic (18/34) or bottleneck (50/101/152).
///
/// An enum module (burn 0.22's derive supports single-field tuple variants), so that `ResNet` is
/// one type for every depth.
#[derive(Module, Debug)]
pub enum Stage {
    /// Basic blocks.
    Basic(Vec<BasicBlock>),
    /// Bottleneck blocks.
    Bottleneck(Vec<Bottleneck>),
}

impl Stage {
    fn forward(&self, mut x: Tensor<4>) -> Tensor<4> {
        match self {
            Stage::Basic(blocks) => {
                for b in blocks {
                    x = b.forward(x);
                }
            }
            Stage::Bottleneck(blocks) => {
                for b in blocks {
                    x = b.forward(x);
                }
            }
        }
        x
    }

    fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        match self {
            Stage::Basic(blocks) => blocks.iter_mut().for_each(|b| b.for_each_bn_mut(f)),
            Stage::Bottleneck(blocks) => blocks.iter_mut().for_each(|b| b.for_each_bn_mut(f)),
        }
    }

    fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        match self {
            Stage::Basic(blocks) => blocks.iter().for_each(|b| b.for_each_bn(f)),
            Stage::Bottleneck(blocks) => blocks.iter().for_each(|b| b.for_each_bn(f)),
        }
    }
}

/// Depths torchvision defines, with their block type and blocks per stage.
pub const RESNET_DEPTHS: [usize; 5] = [18, 34, 50, 101, 152];

/// (bottleneck?, blocks per stage) for a torchvision depth.
pub(crate) fn resnet_layout(depth: usize) -> Option<(bool, [usize; 4])> {
    match depth {
        18 => Some((false, [2, 2, 2, 2])),
        34 => Some((false, [3, 4, 6, 3])),
        50 => Some((true, [3, 4, 6, 3])),
        101 => Some((true, [3, 4, 23, 3])),
        152 => Some((true, [3, 8, 36, 3])),
        _ => None,
    }
}

/// torchvision ResNet (see the module docs).
#[derive(Module, Debug)]
pub struct ResNet {
    /// Stem conv 7x7/2.
    pub conv1: Conv2d,
    /// Stem BN.
    pub bn1: BatchNorm,
    /// Stem max pool 3x3/2 pad 1.
    pub maxpool: MaxPool2d,
    /// Stage 1 (64 planes, stride 1); field names follow torchvision.
    pub layer1: Stage,
    /// Stage 2 (128 planes, stride 2).
    pub layer2: Stage,
    /// Stage 3 (256 planes, stride 2).
    pub layer3: Stage,
    /// Stage 4 (512 planes, stride 2).
    pub layer4: Stage,
    /// Global average pool.
    pub avgpool: AdaptiveAvgPool2d,
    /// Classifier.
    pub fc: Linear,
}

impl ResNet {
    /// Builds a torchvision ResNet; `depth` must be one of [`RESNET_DEPTHS`] (checked by the config
    /// layer, which returns an error instead; here an unknown depth falls back to nothing built —
    /// callers go through [`crate::ModelConfig`]).
    pub(crate) fn new(
        depth: usize,
        in_channels: usize,
        classes: usize,
        zero_init_residual: bool,
        device: &Device,
    ) -> Option<Self> {
        let (bottleneck, counts) = resnet_layout(depth)?;
        let expansion = if bottleneck { Bottleneck::EXPANSION } else { 1 };
        let mut inplanes = 64;
        let mut layers = Vec::with_capacity(4);
        for (i, (&planes, &n)) in [64usize, 128, 256, 512].iter().zip(counts.iter()).enumerate() {
            let stride = if i == 0 { 1 } else { 2 };
            if bottleneck {
                let mut blocks = Vec::with_capacity(n);
                for j in 0..n {
                    let s = if j == 0 { stride } else { 1 };
                    blocks.push(Bottleneck::new(inplanes, planes, s, zero_init_residual, device));
                    inplanes = planes * expansion;
                }
                layers.push(Stage::Bottleneck(blocks));
            } else {
                let mut blocks = Vec::with_capacity(n);
                for j in 0..n {
                    let s = if j == 0 { stride } else { 1 };
                    blocks.push(BasicBlock::new(inplanes, planes, s, zero_init_residual, device));
                    inplanes = planes * expansion;
                }
                layers.push(Stage::Basic(blocks));
            }
        }
        let mut layers = layers.into_iter();
        let (layer1, layer2, layer3, layer4) = (layers.next()?, layers.next()?, layers.next()?, layers.next()?);
        Some(Self {
            conv1: conv(in_channels, 64, 7, 2, 3, kaiming_fan_out(), device),
            bn1: bn(64, false, device),
            maxpool: MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
            layer1,
            layer2,
            layer3,
            layer4,
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(512 * expansion, classes).init(device),
        })
    }

    /// Logits `[N, classes]` for images `[N, C, H, W]` (any H, W >= 1: the pool is adaptive).
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = relu(fused::batch_norm(&self.bn1, fused::conv2d(&self.conv1, x)));
        let mut x = self.maxpool.forward(x);
        for stage in [&self.layer1, &self.layer2, &self.layer3, &self.layer4] {
            x = stage.forward(x);
        }
        let x = self.avgpool.forward(x);
        let [n, c, _, _] = x.dims();
        self.fc.forward(x.reshape([n, c]))
    }

    /// Calls `f` on every BatchNorm (stem first, then blocks in order).
    pub fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        f(&mut self.bn1);
        for stage in [&mut self.layer1, &mut self.layer2, &mut self.layer3, &mut self.layer4] {
            stage.for_each_bn_mut(f);
        }
    }

    /// Calls `f` on every BatchNorm (stem first, then blocks in order).
    pub fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        f(&self.bn1);
        for stage in [&self.layer1, &self.layer2, &self.layer3, &self.layer4] {
            stage.for_each_bn(f);
        }
    }
}
