//! CIFAR-style ResNet-20/32/44/56/110 (He et al. 2016, section 4.2), for 32x32 inputs.
//!
//! conv3x3(16, no bias) -> BN -> ReLU, three stages of n = (depth - 2) / 6 basic blocks with
//! 16/32/64 channels (strides 1/2/2), global average pool, fc. The widely used reference
//! implementation (akamaster/pytorch_resnet_cifar10) is followed, including its initialisation:
//! `kaiming_normal_` (fan_in, gain sqrt 2) for conv and fc weights, PyTorch's default uniform for the
//! fc bias, BN gamma 1 beta 0.
//!
//! Shortcut option A (the paper's CIFAR choice, and the default here): where a block halves the
//! resolution and doubles the width, the shortcut is the identity subsampled with stride 2
//! (`x[:, :, ::2, ::2]`) and zero-padded in the channel dimension, (cout - cin) / 2 channels on
//! each side as the reference implementation does. It has no parameters: ResNet-20 has 269,722
//! parameters with 10 classes (He et al.'s "0.27 M"). Option B (1x1 conv + BN projection where the
//! shape changes) adds 2,752 parameters, giving the 272,474 sometimes quoted for ResNet-20.

use burn::module::{Initializer, Module};
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{BatchNorm, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::ops::PadMode;
use burn::tensor::{Device, Slice, Tensor};

use crate::fused;
use serde::{Deserialize, Serialize};

use crate::resnet::{bn, conv};

/// Shortcut used where a CIFAR ResNet block changes shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CifarShortcut {
    /// Parameter-free: stride-2 subsampling + zero channel padding (He et al. option A).
    #[default]
    A,
    /// 1x1 conv (no bias) + BN projection (option B).
    B,
}

/// Depths of He et al.'s CIFAR table (6n + 2).
pub const CIFAR_RESNET_DEPTHS: [usize; 5] = [20, 32, 44, 56, 110];

/// akamaster's `_weights_init`: `kaiming_normal_` with PyTorch's defaults (fan_in, a = 0).
fn kaiming_fan_in() -> Initializer {
    Initializer::KaimingNormal { gain: std::f64::consts::SQRT_2, fan_out_only: false }
}

/// Projection shortcut (option B).
#[derive(Module, Debug)]
pub struct Projection {
    /// 1x1 conv with stride, no bias.
    pub conv: Conv2d,
    /// BN after the projection.
    pub bn: BatchNorm,
}

/// Basic block of the CIFAR ResNet.
#[derive(Module, Debug)]
pub struct CifarBlock {
    /// 3x3 conv carrying the stride.
    pub conv1: Conv2d,
    /// BN after conv1.
    pub bn1: BatchNorm,
    /// 3x3 conv.
    pub conv2: Conv2d,
    /// BN after conv2.
    pub bn2: BatchNorm,
    /// Option B projection, when the shape changes and option B was chosen.
    pub projection: Option<Projection>,
    /// Option A: stride of the identity subsampling (1 = none).
    pub subsample: usize,
    /// Option A: zero channels padded before the input channels.
    pub pad_before: usize,
    /// Option A: zero channels padded after the input channels.
    pub pad_after: usize,
}

impl CifarBlock {
    fn new(cin: usize, cout: usize, stride: usize, shortcut: CifarShortcut, device: &Device) -> Self {
        let changes = stride != 1 || cin != cout;
        let (projection, subsample, pad_before, pad_after) = match (changes, shortcut) {
            (false, _) => (None, 1, 0, 0),
            (true, CifarShortcut::B) => (
                Some(Projection {
                    conv: conv(cin, cout, 1, stride, 0, kaiming_fan_in(), device),
                    bn: bn(cout, false, device),
                }),
                1,
                0,
                0,
            ),
            (true, CifarShortcut::A) => {
                // cout >= cin always holds in this network (16 -> 32 -> 64).
                let extra = cout.saturating_sub(cin);
                (None, stride, extra / 2, extra - extra / 2)
            }
        };
        Self {
            conv1: conv(cin, cout, 3, stride, 1, kaiming_fan_in(), device),
            bn1: bn(cout, false, device),
            conv2: conv(cout, cout, 3, 1, 1, kaiming_fan_in(), device),
            bn2: bn(cout, false, device),
            projection,
            subsample,
            pad_before,
            pad_after,
        }
    }

    fn shortcut(&self, x: Tensor<4>) -> Tensor<4> {
        if let Some(p) = &self.projection {
            return fused::batch_norm(&p.bn, fused::conv2d(&p.conv, x));
        }
        let mut x = x;
        if self.subsample > 1 {
            let s = self.subsample as isize;
            x = x.slice([
                Slice::new(0, None, 1),
                Slice::new(0, None, 1),
                Slice::new(0, None, s),
                Slice::new(0, None, s),
            ]);
        }
        if self.pad_before + self.pad_after > 0 {
            x = x.pad([(0, 0), (self.pad_before, self.pad_after), (0, 0), (0, 0)], PadMode::Constant(0.0));
        }
        x
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let identity = self.shortcut(x.clone());
        let out = relu(fused::batch_norm(&self.bn1, fused::conv2d(&self.conv1, x)));
        let out = fused::batch_norm(&self.bn2, fused::conv2d(&self.conv2, out));
        relu(out + identity)
    }

    fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        f(&mut self.bn1);
        f(&mut self.bn2);
        if let Some(p) = &mut self.projection {
            f(&mut p.bn);
        }
    }

    fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        f(&self.bn1);
        f(&self.bn2);
        if let Some(p) = &self.projection {
            f(&p.bn);
        }
    }
}

/// CIFAR ResNet (see the module docs).
#[derive(Module, Debug)]
pub struct CifarResNet {
    /// Stem conv 3x3, 16 channels.
    pub conv1: Conv2d,
    /// Stem BN.
    pub bn1: BatchNorm,
    /// Stage 1: 16 channels.
    pub layer1: Vec<CifarBlock>,
    /// Stage 2: 32 channels, first block stride 2.
    pub layer2: Vec<CifarBlock>,
    /// Stage 3: 64 channels, first block stride 2.
    pub layer3: Vec<CifarBlock>,
    /// Global average pool.
    pub avgpool: AdaptiveAvgPool2d,
    /// Classifier 64 -> classes.
    pub fc: Linear,
}

impl CifarResNet {
    /// Builds the network with `n` blocks per stage (depth = 6n + 2).
    pub(crate) fn new(n: usize, in_channels: usize, classes: usize, shortcut: CifarShortcut, device: &Device) -> Self {
        let mut cin = 16;
        let mut stage = |cout: usize, stride: usize| {
            (0..n)
                .map(|j| {
                    let b = CifarBlock::new(cin, cout, if j == 0 { stride } else { 1 }, shortcut, device);
                    cin = cout;
                    b
                })
                .collect::<Vec<_>>()
        };
        let layer1 = stage(16, 1);
        let layer2 = stage(32, 2);
        let layer3 = stage(64, 2);
        let mut fc = LinearConfig::new(64, classes).with_initializer(kaiming_fan_in()).init(device);
        // The reference re-initialises only the fc weight; the bias keeps PyTorch's U(±1/sqrt(fan_in)).
        let bound = 1.0 / 8.0; // 1 / sqrt(64)
        fc.bias = Some(Initializer::Uniform { min: -bound, max: bound }.init([classes], device));
        Self {
            conv1: conv(in_channels, 16, 3, 1, 1, kaiming_fan_in(), device),
            bn1: bn(16, false, device),
            layer1,
            layer2,
            layer3,
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc,
        }
    }

    /// Logits `[N, classes]` for images `[N, C, H, W]` (designed for 32x32; any size works).
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = relu(fused::batch_norm(&self.bn1, fused::conv2d(&self.conv1, x)));
        for block in self.layer1.iter().chain(&self.layer2).chain(&self.layer3) {
            x = block.forward(x);
        }
        let x = self.avgpool.forward(x);
        let [n, c, _, _] = x.dims();
        self.fc.forward(x.reshape([n, c]))
    }

    /// Calls `f` on every BatchNorm in forward order.
    pub fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        f(&mut self.bn1);
        for block in self.layer1.iter_mut().chain(&mut self.layer2).chain(&mut self.layer3) {
            block.for_each_bn_mut(f);
        }
    }

    /// Calls `f` on every BatchNorm in forward order.
    pub fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        f(&self.bn1);
        for block in self.layer1.iter().chain(&self.layer2).chain(&self.layer3) {
            block.for_each_bn(f);
        }
    }
}
