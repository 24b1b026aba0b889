//! Models of the QSR paper (Gu et al., ICLR 2024) and small models for fast experiments, as burn
//! 0.22 modules that run on any burn `Device`.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use qsr_models::{CifarResNetConfig, CifarShortcut, InputSpec, ModelConfig, param_count};
//!
//! // A recipe's `[model]` section: { kind = "cifar-resnet", depth = 20 }.
//! let config = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A });
//! let device = Device::flex();
//! device.seed(0); // parameters are drawn lazily, on first use
//! let model = config.init(InputSpec::new(3, 32, 32), 10, &device).unwrap();
//! assert_eq!(param_count(&model), 269_722);
//! let logits = model.forward(Tensor::zeros([2, 3, 32, 32], &device));
//! assert_eq!(logits.dims(), [2, 10]);
//! ```
//!
//! `cargo run --release -p qsr-models --example count_params` prints the parameter counts of ResNet-18/50,
//! CIFAR ResNet-20 and SimpleViT-Ti.
//!
//! # Presets
//!
//! | config | model | notes |
//! |---|---|---|
//! | `{ kind = "resnet", depth = 18 \| 34 \| 50 \| 101 \| 152 }` | torchvision ResNet | 11,689,512 / 21,797,672 / 25,557,032 / 44,549,160 / 60,192,808 params with 1000 classes |
//! | `{ kind = "cifar-resnet", depth = 20 \| 32 \| 44 \| 56 \| 110 }` | He et al. CIFAR ResNet | shortcut option A by default; ResNet-20 with 10 classes: 269,722 params (option A), 272,474 (option B) |
//! | `{ kind = "vit", preset = "ti" \| "s" \| "b", patch_size = 16, image_size = 224 }` | SimpleViT (vit-pytorch 1.2.8) | ViT-B/16 at 224: 86,381,800 params with 1000 classes |
//! | `{ kind = "cnn" }` | conv32-conv64 CNN, BN by default | 1x28x28, 1x8x8, 3x32x32, ... (H, W >= 4) |
//! | `{ kind = "mlp", hidden = [256, 256] }` | MLP on flattened pixels | |
//! | [`GptConfig`] (`vocab_size`, `context`, `layers`, `heads`, `width`, `dropout`, `bias`) | GPT-2 / nanoGPT decoder, tied LM head | GPT-2 small ([`GptConfig::gpt2_small`]): 124,439,808 params |
//!
//! # Fidelity
//!
//! - [`ResNet`] reproduces `torchvision.models.resnet{18,34,50,101,152}` layer by layer (v1.5:
//!   stride on the bottleneck's 3x3 conv), with torchvision's initialisation (kaiming normal
//!   fan_out for convs, BN gamma 1 beta 0, default Linear init for fc) and its optional
//!   `zero_init_residual`. Parameter counts match torchvision exactly; field names follow
//!   torchvision (`conv1`, `bn1`, `layer1`..`layer4`, `downsample`, `fc`).
//! - [`CifarResNet`] follows He et al. 2016 and the akamaster reference code, shortcut option A
//!   (identity, stride-2 subsampling, zero channel padding) unless option B is chosen.
//! - [`SimpleVit`] follows vit-pytorch 1.2.8's `simple_vit.py` as described in the paper notes:
//!   LN -> Linear -> LN patch embedding, fixed 2-D sin-cos position embedding, pre-LN blocks with
//!   bias-free q/k/v and output projections, mean pooling, LN + Linear head, no dropout, no class
//!   token.
//! - BatchNorm is burn's [`burn::nn::BatchNorm`] (eps 1e-5, momentum 0.1 as PyTorch). One
//!   difference from PyTorch remains: burn updates `running_var` with the biased batch variance,
//!   PyTorch with the unbiased one (a factor n/(n-1), n = batch x H x W per channel).
//!
//! # BatchNorm running statistics
//!
//! The running statistics are `BatchNorm::running_mean` / `running_var`
//! (`burn::module::RunningState<Tensor<1>>`); the momentum is the plain field `BatchNorm::momentum`
//! (`f64`, not visible to `ModuleVisitor`/`ModuleMapper`). [`Model::for_each_batch_norm_mut`] gives
//! direct access; [`Model::set_bn_momentum`] and [`Model::reset_bn_running_stats`] cover BN
//! re-estimation; [`param_count`], [`trainable_param_ids`] and [`bn_running_stat_ids`] work on any
//! burn module. Note that cloning a burn module *shares* its running statistics (they live behind
//! an `Arc`): use [`Model::deep_clone`] for independent worker replicas.

#![deny(unsafe_code)] // allowed only around the fused convolution's gemm calls
#![warn(missing_docs)]

mod bn;
mod cifar_resnet;
mod config;
mod error;
pub mod fused;
mod gpt;
mod resnet;
mod small;
mod vit;

pub use bn::{bn_running_stat_ids, is_bn_running_stat, param_count, trainable_param_ids};
pub use cifar_resnet::{CIFAR_RESNET_DEPTHS, CifarBlock, CifarResNet, CifarShortcut, Projection};
pub use config::{
    CifarResNetConfig, CnnConfig, InputSpec, MAX_DEPTH, MAX_WIDTH, MlpConfig, ModelConfig, ResNetConfig, VitConfig,
};
pub use error::ModelError;
pub use gpt::{CausalSelfAttention, Gpt, GptBlock, GptConfig, GptMlp};
pub use resnet::{BasicBlock, Bottleneck, Downsample, RESNET_DEPTHS, ResNet, Stage};
pub use small::{ConvUnit, Mlp, SmallCnn};
pub use vit::{Attention, Block, FeedForward, SimpleVit, VitDims, VitPreset, posemb_sincos_2d};

use burn::module::{Module, ModuleVisitor, Param, ParamId, RunningState};
use burn::nn::BatchNorm;
use burn::tensor::Tensor;

/// Any model of this crate, as one burn module the trainer can hold (burn 0.22's `Module` derive
/// supports enums with single-field tuple variants).
// One `Model` per worker, held for the whole run: boxing the larger variants would add an indirection
// to every forward pass and save nothing worth having.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Model {
    /// torchvision ResNet.
    ResNet(ResNet),
    /// CIFAR ResNet.
    CifarResNet(CifarResNet),
    /// SimpleViT.
    Vit(SimpleVit),
    /// Small CNN.
    Cnn(SmallCnn),
    /// MLP.
    Mlp(Mlp),
}

impl Model {
    /// Logits `[N, classes]` for images `[N, C, H, W]` (f32, NCHW).
    ///
    /// BN layers use batch statistics (and update their running statistics) when the input lives
    /// on an autodiff device and the module is in training state; otherwise the running statistics
    /// (call `model.valid()` for evaluation).
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        match self {
            Model::ResNet(m) => m.forward(images),
            Model::CifarResNet(m) => m.forward(images),
            Model::Vit(m) => m.forward(images),
            Model::Cnn(m) => m.forward(images),
            Model::Mlp(m) => m.forward(images),
        }
    }

    /// Whether the model has BatchNorm layers (and therefore running statistics to handle at
    /// synchronisation and before evaluation).
    pub fn has_batch_norm(&self) -> bool {
        match self {
            Model::ResNet(_) | Model::CifarResNet(_) => true,
            Model::Cnn(m) => m.has_batch_norm(),
            Model::Vit(_) | Model::Mlp(_) => false,
        }
    }

    /// Calls `f` on every BatchNorm layer, in forward order.
    pub fn for_each_batch_norm(&self, mut f: impl FnMut(&BatchNorm)) {
        match self {
            Model::ResNet(m) => m.for_each_bn(&mut f),
            Model::CifarResNet(m) => m.for_each_bn(&mut f),
            Model::Cnn(m) => m.for_each_bn(&mut f),
            Model::Vit(_) | Model::Mlp(_) => {}
        }
    }

    /// Calls `f` on every BatchNorm layer, in forward order, mutably (to change `momentum` or
    /// replace `running_mean` / `running_var`).
    pub fn for_each_batch_norm_mut(&mut self, mut f: impl FnMut(&mut BatchNorm)) {
        match self {
            Model::ResNet(m) => m.for_each_bn_mut(&mut f),
            Model::CifarResNet(m) => m.for_each_bn_mut(&mut f),
            Model::Cnn(m) => m.for_each_bn_mut(&mut f),
            Model::Vit(_) | Model::Mlp(_) => {}
        }
    }

    /// Number of BatchNorm layers.
    pub fn batch_norm_count(&self) -> usize {
        let mut n = 0;
        self.for_each_batch_norm(|_| n += 1);
        n
    }

    /// Sets the running-statistics momentum of every BN layer (burn's convention, as PyTorch's:
    /// `running = (1 - momentum) running + momentum batch`). For the paper's re-estimation, use
    /// `1 / (1 + i)` before micro-batch `i` after [`reset_bn_running_stats`](Self::reset_bn_running_stats)
    /// to get a cumulative average. Errors (field `momentum`) outside `[0, 1]` or for NaN.
    pub fn set_bn_momentum(&mut self, momentum: f64) -> Result<(), ModelError> {
        if !(0.0..=1.0).contains(&momentum) {
            return Err(ModelError::config("batch-norm", "momentum", format!("must be in [0, 1], got {momentum}")));
        }
        self.for_each_batch_norm_mut(|bn| bn.momentum = momentum);
        Ok(())
    }

    /// Resets every BN's running mean to 0 and running variance to 1 (PyTorch's
    /// `reset_running_stats`), keeping parameter ids and devices. The new running states are not
    /// shared with any clone of this model.
    pub fn reset_bn_running_stats(&mut self) {
        self.for_each_batch_norm_mut(|bn| {
            bn.running_mean = fresh_state(&bn.running_mean, |t| t.zeros_like());
            bn.running_var = fresh_state(&bn.running_var, |t| t.ones_like());
        });
    }

    /// Makes this model's BN running statistics independent of every clone (pending per-thread
    /// updates are folded in first). burn's `Clone` of a module shares each `RunningState` behind
    /// an `Arc`, so replicas made with `clone()` would update one another's statistics.
    pub fn unshare_running_stats(&mut self) {
        self.for_each_batch_norm_mut(|bn| {
            bn.running_mean = fresh_state(&bn.running_mean, |t| t);
            bn.running_var = fresh_state(&bn.running_var, |t| t);
        });
    }

    /// A copy with its own BN running statistics (parameters are immutable tensors in burn, so
    /// sharing them is safe; running statistics are not). Use this for per-worker replicas.
    pub fn deep_clone(&self) -> Self {
        let mut m = self.clone();
        m.unshare_running_stats();
        m
    }
}

/// The id of a running state (not exposed by burn except through a visitor).
fn running_state_id(state: &RunningState<Tensor<1>>) -> Option<ParamId> {
    struct IdOf(Option<ParamId>);
    impl ModuleVisitor for IdOf {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 = Some(param.id);
        }
    }
    let mut v = IdOf(None);
    state.visit(&mut v);
    v.0
}

/// A new, unshared running state with the same id and device, holding `f(current value)`.
fn fresh_state(state: &RunningState<Tensor<1>>, f: impl FnOnce(Tensor<1>) -> Tensor<1>) -> RunningState<Tensor<1>> {
    // `valid()` folds pending per-thread updates into the value (burn's private `sync`) and returns
    // an unshared state; it also drops autodiff, which `forward` restores by moving the statistics
    // to the input's device.
    let was_autodiff = state.value().is_autodiff();
    let synced = state.valid();
    let mut value = f(synced.value());
    if was_autodiff {
        value = value.autodiff();
    }
    match running_state_id(state) {
        Some(id) => RunningState::with_id(id, value),
        None => RunningState::new(value),
    }
}
