//! Small models for fast experiments and tests: a two-conv CNN and an MLP.
//!
//! Both use PyTorch's default initialisation (burn's default `Conv2d`/`Linear` init is the same
//! U(±1/sqrt(fan_in)) for weights and biases).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use crate::fused;

/// `conv3x3 -> [BN] -> ReLU`, the CNN's unit (BN optional).
#[derive(Module, Debug)]
pub struct ConvUnit {
    /// 3x3 conv, pad 1 (bias only without BN, as BN's beta makes it redundant).
    pub conv: Conv2d,
    /// Optional BN.
    pub bn: Option<BatchNorm>,
}

impl ConvUnit {
    fn new(cin: usize, cout: usize, batch_norm: bool, device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([cin, cout], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .with_bias(!batch_norm)
                .init(device),
            bn: batch_norm.then(|| BatchNormConfig::new(cout).init(device)),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let x = fused::conv2d(&self.conv, x);
        let x = match &self.bn {
            Some(bn) => fused::batch_norm(bn, x),
            None => x,
        };
        relu(x)
    }
}

/// Small CNN: `[conv3x3(c1) -> [BN] -> ReLU -> maxpool 2] -> [conv3x3(c2) -> [BN] -> ReLU -> maxpool 2] ->
/// flatten -> fc` (BN optional).
///
/// Two 2x2 pools take 28x28 to 7x7, 32x32 to 8x8 and the 8x8 sklearn digits to 2x2, so one design
/// covers MNIST, CIFAR and digits; inputs need H, W >= 4.
#[derive(Module, Debug)]
pub struct SmallCnn {
    /// First conv unit.
    pub unit1: ConvUnit,
    /// Second conv unit.
    pub unit2: ConvUnit,
    /// 2x2 max pool, stride 2.
    pub pool: MaxPool2d,
    /// Classifier over the flattened feature map.
    pub fc: Linear,
}

impl SmallCnn {
    pub(crate) fn new(
        channels: [usize; 2],
        batch_norm: bool,
        in_channels: usize,
        height: usize,
        width: usize,
        classes: usize,
        device: &Device,
    ) -> Self {
        let features = channels[1] * (height / 4) * (width / 4);
        Self {
            unit1: ConvUnit::new(in_channels, channels[0], batch_norm, device),
            unit2: ConvUnit::new(channels[0], channels[1], batch_norm, device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc: LinearConfig::new(features, classes).init(device),
        }
    }

    /// Logits `[N, classes]` for images of the size the model was built for.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = fused::max_pool2d(&self.pool, self.unit1.forward(x));
        let x = fused::max_pool2d(&self.pool, self.unit2.forward(x));
        let [n, c, h, w] = x.dims();
        self.fc.forward(x.reshape([n, c * h * w]))
    }

    /// Whether the CNN was built with BN.
    pub fn has_batch_norm(&self) -> bool {
        self.unit1.bn.is_some()
    }

    /// Calls `f` on every BatchNorm (none without BN).
    pub fn for_each_bn_mut(&mut self, f: &mut dyn FnMut(&mut BatchNorm)) {
        for u in [&mut self.unit1, &mut self.unit2] {
            if let Some(bn) = &mut u.bn {
                f(bn);
            }
        }
    }

    /// Calls `f` on every BatchNorm (none without BN).
    pub fn for_each_bn(&self, f: &mut dyn FnMut(&BatchNorm)) {
        for u in [&self.unit1, &self.unit2] {
            if let Some(bn) = &u.bn {
                f(bn);
            }
        }
    }
}

/// MLP on flattened images: Linear -> ReLU for each hidden size, then Linear to the classes.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Hidden layers (each followed by ReLU).
    pub hidden: Vec<Linear>,
    /// Output layer.
    pub out: Linear,
}

impl Mlp {
    pub(crate) fn new(inputs: usize, hidden: &[usize], classes: usize, device: &Device) -> Self {
        let mut prev = inputs;
        let layers = hidden
            .iter()
            .map(|&h| {
                let l = LinearConfig::new(prev, h).init(device);
                prev = h;
                l
            })
            .collect();
        Self { hidden: layers, out: LinearConfig::new(prev, classes).init(device) }
    }

    /// Logits `[N, classes]`; images are flattened in C, H, W order.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let [n, c, h, w] = x.dims();
        let mut x = x.reshape([n, c * h * w]);
        for l in &self.hidden {
            x = relu(l.forward(x));
        }
        self.out.forward(x)
    }
}
