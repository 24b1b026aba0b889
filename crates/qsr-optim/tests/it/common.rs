//! What several test modules build: a two-layer MLP.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor};

/// `inputs` -> 16 (ReLU) -> `outputs`.
#[derive(Module, Debug)]
pub(crate) struct Mlp {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Mlp {
    pub(crate) fn new(device: &Device, inputs: usize, outputs: usize) -> Self {
        Self {
            fc1: LinearConfig::new(inputs, 16).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(16, outputs).init(device),
        }
    }

    pub(crate) fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

/// Two hidden layers, for Muon's split: `4 -> 16 -> 16 -> 1`.
#[derive(Module, Debug)]
pub(crate) struct Mlp3 {
    fc1: Linear,
    fc2: Linear,
    head: Linear,
}

impl Mlp3 {
    pub(crate) fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(4, 16).init(device),
            fc2: LinearConfig::new(16, 16).init(device),
            head: LinearConfig::new(16, 1).init(device),
        }
    }
}
