//! Serde model configuration and its validation.

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::Model;
use crate::cifar_resnet::{CIFAR_RESNET_DEPTHS, CifarResNet, CifarShortcut};
use crate::error::ModelError;
use crate::gpt::GptConfig;
use crate::resnet::{RESNET_DEPTHS, ResNet, resnet_layout};
use crate::small::{Mlp, SmallCnn};
use crate::vit::{SimpleVit, VitDims, VitPreset};

/// Shape of one input image (NCHW without the batch dimension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputSpec {
    /// Channels (1 for MNIST/digits, 3 for CIFAR/ImageNet).
    pub channels: usize,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
}

impl InputSpec {
    /// `channels x height x width`.
    pub fn new(channels: usize, height: usize, width: usize) -> Self {
        Self { channels, height, width }
    }
}

/// Which model to build, as written in a run configuration.
///
/// Internally tagged by `kind`, e.g. (TOML) `{ kind = "resnet", depth = 50 }`,
/// `{ kind = "cifar-resnet", depth = 20 }`, `{ kind = "vit", preset = "b", patch_size = 16,
/// image_size = 224 }`, `{ kind = "cnn" }`, `{ kind = "mlp", hidden = [256, 256] }`, `{ kind = "gpt",
/// vocab_size = 65, context = 128, layers = 4, heads = 4, width = 128 }`. Unknown fields are rejected (a
/// typo must not silently fall back to a default).
///
/// The image models are built by [`init`](Self::init) into a [`Model`]; a GPT reads tokens, not
/// images, and is built by [`GptConfig::init`] into a [`crate::Gpt`] (see [`as_gpt`](Self::as_gpt)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum ModelConfig {
    /// torchvision ResNet-18/34/50/101/152.
    Resnet(ResNetConfig),
    /// CIFAR ResNet (6n + 2 layers).
    CifarResnet(CifarResNetConfig),
    /// SimpleViT.
    Vit(VitConfig),
    /// Small two-conv CNN.
    Cnn(CnnConfig),
    /// Multi-layer perceptron.
    Mlp(MlpConfig),
    /// GPT-style decoder (a language model over tokens).
    Gpt(GptConfig),
}

/// torchvision ResNet settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResNetConfig {
    /// 18, 34, 50, 101 or 152.
    pub depth: usize,
    /// Start the last BN gamma of every block at 0 (torchvision's `zero_init_residual`), default
    /// false as in torchvision.
    #[serde(default)]
    pub zero_init_residual: bool,
}

/// CIFAR ResNet settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CifarResNetConfig {
    /// 6n + 2: 20, 32, 44, 56, 110 in He et al.'s table (any 6n + 2 >= 8 is accepted).
    pub depth: usize,
    /// Shortcut where the shape changes: `a` (default, parameter-free) or `b` (1x1 conv + BN).
    #[serde(default)]
    pub shortcut: CifarShortcut,
}

/// SimpleViT settings. A `preset` gives dim/depth/heads/mlp_dim/dim_head; any of them can be
/// overridden, and without a preset all of dim, depth, heads and mlp_dim must be given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VitConfig {
    /// `ti`, `s` or `b` (aliases `tiny`, `small`, `base`).
    #[serde(default)]
    pub preset: Option<VitPreset>,
    /// Square patch side in pixels (default 16).
    #[serde(default = "default_patch")]
    pub patch_size: usize,
    /// Expected (square) image side; checked against the input when given.
    #[serde(default)]
    pub image_size: Option<usize>,
    /// Token width (multiple of 4, >= 8, for the sin-cos position embedding).
    #[serde(default)]
    pub dim: Option<usize>,
    /// Number of blocks.
    #[serde(default)]
    pub depth: Option<usize>,
    /// Attention heads.
    #[serde(default)]
    pub heads: Option<usize>,
    /// Width of one head (default 64).
    #[serde(default)]
    pub dim_head: Option<usize>,
    /// Feed-forward hidden width.
    #[serde(default)]
    pub mlp_dim: Option<usize>,
}

fn default_patch() -> usize {
    16
}

/// Small CNN settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CnnConfig {
    /// Use BN after each conv (default true).
    pub batch_norm: bool,
    /// Output channels of the two convs (default [32, 64]).
    pub channels: [usize; 2],
}

impl Default for CnnConfig {
    fn default() -> Self {
        Self { batch_norm: true, channels: [32, 64] }
    }
}

/// MLP settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlpConfig {
    /// Hidden layer widths, each followed by ReLU (default [256, 256]; empty = linear model).
    pub hidden: Vec<usize>,
}

impl Default for MlpConfig {
    fn default() -> Self {
        Self { hidden: vec![256, 256] }
    }
}

impl VitConfig {
    /// A preset with the given patch and image size.
    pub fn preset(preset: VitPreset, patch_size: usize, image_size: usize) -> Self {
        Self {
            preset: Some(preset),
            patch_size,
            image_size: Some(image_size),
            dim: None,
            depth: None,
            heads: None,
            dim_head: None,
            mlp_dim: None,
        }
    }

    /// The dimensions after applying overrides to the preset, validated.
    pub fn dims(&self) -> Result<VitDims, ModelError> {
        const K: &str = "vit";
        let base = self.preset.map(VitPreset::dims);
        let pick = |v: Option<usize>, b: Option<usize>, field: &'static str| {
            v.or(b).ok_or_else(|| {
                ModelError::config(K, field, format!("`{field}` is required when no `preset` (ti, s, b) is given"))
            })
        };
        let dims = VitDims {
            dim: pick(self.dim, base.map(|d| d.dim), "dim")?,
            depth: pick(self.depth, base.map(|d| d.depth), "depth")?,
            heads: pick(self.heads, base.map(|d| d.heads), "heads")?,
            dim_head: self.dim_head.or(base.map(|d| d.dim_head)).unwrap_or(64),
            mlp_dim: pick(self.mlp_dim, base.map(|d| d.mlp_dim), "mlp_dim")?,
        };
        if dims.dim < 8 || !dims.dim.is_multiple_of(4) {
            return Err(ModelError::config(
                K,
                "dim",
                format!("must be a multiple of 4 and at least 8 (2-D sin-cos position embedding), got {}", dims.dim),
            ));
        }
        for (v, field) in
            [(dims.depth, "depth"), (dims.heads, "heads"), (dims.dim_head, "dim_head"), (dims.mlp_dim, "mlp_dim")]
        {
            if v == 0 {
                return Err(ModelError::config(K, field, "must be at least 1"));
            }
        }
        within(K, "dim", &[dims.dim], MAX_WIDTH)?;
        within(K, "mlp_dim", &[dims.mlp_dim], MAX_WIDTH)?;
        within(K, "depth", &[dims.depth], MAX_DEPTH)?;
        within(K, "heads", &[dims.heads.saturating_mul(dims.dim_head)], MAX_WIDTH)
            .map_err(|_| ModelError::config(K, "heads", format!("heads x dim_head must be at most {MAX_WIDTH}")))?;
        Ok(dims)
    }
}

/// Largest width (hidden units, channels, embedding size) a configuration accepts: far above any model
/// this trainer can hold, and low enough that sizes computed from it cannot overflow before the memory
/// check of the trainer refuses the model.
pub const MAX_WIDTH: usize = 1 << 20;

/// Largest number of layers (MLP hidden layers, ViT blocks) a configuration accepts.
pub const MAX_DEPTH: usize = 1024;

fn within(kind: &'static str, field: &'static str, values: &[usize], max: usize) -> Result<(), ModelError> {
    match values.iter().find(|&&v| v > max) {
        Some(v) => Err(ModelError::config(kind, field, format!("{v} is above the limit of {max}"))),
        None => Ok(()),
    }
}

impl ModelConfig {
    /// The `kind` tag of this configuration.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelConfig::Resnet(_) => "resnet",
            ModelConfig::CifarResnet(_) => "cifar-resnet",
            ModelConfig::Vit(_) => "vit",
            ModelConfig::Cnn(_) => "cnn",
            ModelConfig::Mlp(_) => "mlp",
            ModelConfig::Gpt(_) => "gpt",
        }
    }

    /// The GPT settings when this is a language model (`kind = "gpt"`).
    pub fn as_gpt(&self) -> Option<&GptConfig> {
        match self {
            ModelConfig::Gpt(c) => Some(c),
            _ => None,
        }
    }

    /// Checks the settings that do not depend on the input; the error names the bad field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let kind = self.kind();
        match self {
            ModelConfig::Resnet(c) => {
                if resnet_layout(c.depth).is_none() {
                    return Err(ModelError::config(
                        kind,
                        "depth",
                        format!("must be one of {RESNET_DEPTHS:?}, got {}", c.depth),
                    ));
                }
            }
            ModelConfig::CifarResnet(c) => {
                if c.depth < 8 || (c.depth - 2) % 6 != 0 {
                    return Err(ModelError::config(
                        kind,
                        "depth",
                        format!("must be 6n + 2 with n >= 1 (He et al.: {CIFAR_RESNET_DEPTHS:?}), got {}", c.depth),
                    ));
                }
            }
            ModelConfig::Vit(c) => {
                c.dims()?;
                if c.patch_size == 0 {
                    return Err(ModelError::config(kind, "patch_size", "must be at least 1"));
                }
                if let Some(s) = c.image_size
                    && (s == 0 || !s.is_multiple_of(c.patch_size))
                {
                    return Err(ModelError::config(
                        kind,
                        "image_size",
                        format!("{s} is not a positive multiple of patch_size {}", c.patch_size),
                    ));
                }
            }
            ModelConfig::Cnn(c) => {
                if c.channels.contains(&0) {
                    return Err(ModelError::config(kind, "channels", "every conv needs at least 1 channel"));
                }
                within(kind, "channels", &c.channels, MAX_WIDTH)?;
            }
            ModelConfig::Mlp(c) => {
                if c.hidden.contains(&0) {
                    return Err(ModelError::config(kind, "hidden", "every hidden layer needs at least 1 unit"));
                }
                within(kind, "hidden", &c.hidden, MAX_WIDTH)?;
                within(kind, "hidden", &[c.hidden.len()], MAX_DEPTH).map_err(|_| {
                    ModelError::config(kind, "hidden", format!("has {} layers, more than {MAX_DEPTH}", c.hidden.len()))
                })?;
            }
            ModelConfig::Gpt(c) => c.validate()?,
        }
        Ok(())
    }

    /// Builds the image model for `input` images and `classes` outputs on `device` (use
    /// `device.autodiff()` to train). Parameters are created lazily by burn: they are allocated
    /// and drawn from the device's RNG on first use, so seed the device before the first forward.
    /// A `gpt` is refused (field `kind`): it takes tokens; build it with [`GptConfig::init`].
    pub fn init(&self, input: InputSpec, classes: usize, device: &Device) -> Result<Model, ModelError> {
        self.validate()?;
        let kind = self.kind();
        if classes == 0 {
            return Err(ModelError::input(kind, "classes", "must be at least 1"));
        }
        for (v, field) in
            [(input.channels, "input.channels"), (input.height, "input.height"), (input.width, "input.width")]
        {
            if v == 0 {
                return Err(ModelError::input(kind, field, "must be at least 1"));
            }
        }
        let model = match self {
            ModelConfig::Gpt(_) => {
                return Err(ModelError::config(
                    kind,
                    "kind",
                    "a GPT reads tokens, not images: build it with GptConfig::init (ModelConfig::as_gpt)",
                ));
            }
            ModelConfig::Resnet(c) => {
                let net = ResNet::new(c.depth, input.channels, classes, c.zero_init_residual, device)
                    .ok_or_else(|| ModelError::config(kind, "depth", format!("must be one of {RESNET_DEPTHS:?}")))?;
                Model::ResNet(net)
            }
            ModelConfig::CifarResnet(c) => {
                Model::CifarResNet(CifarResNet::new((c.depth - 2) / 6, input.channels, classes, c.shortcut, device))
            }
            ModelConfig::Vit(c) => {
                let dims = c.dims()?;
                let p = c.patch_size;
                if let Some(s) = c.image_size
                    && (input.height != s || input.width != s)
                {
                    return Err(ModelError::input(
                        kind,
                        "image_size",
                        format!("configured {s}x{s}, but the input is {}x{}", input.height, input.width),
                    ));
                }
                if !input.height.is_multiple_of(p) || !input.width.is_multiple_of(p) {
                    return Err(ModelError::input(
                        kind,
                        "patch_size",
                        format!("{p} does not divide the input size {}x{}", input.height, input.width),
                    ));
                }
                Model::Vit(SimpleVit::new(dims, p, input.channels, input.height, input.width, classes, device))
            }
            ModelConfig::Cnn(c) => {
                if input.height < 4 || input.width < 4 {
                    return Err(ModelError::input(
                        kind,
                        "input.height",
                        format!(
                            "the CNN pools twice by 2 and needs at least 4x4, got {}x{}",
                            input.height, input.width
                        ),
                    ));
                }
                Model::Cnn(SmallCnn::new(
                    c.channels,
                    c.batch_norm,
                    input.channels,
                    input.height,
                    input.width,
                    classes,
                    device,
                ))
            }
            ModelConfig::Mlp(c) => {
                Model::Mlp(Mlp::new(input.channels * input.height * input.width, &c.hidden, classes, device))
            }
        };
        Ok(model)
    }
}
