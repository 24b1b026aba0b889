//! SimpleViT as in vit-pytorch 1.2.8 (`vit_pytorch/simple_vit.py`), the paper's ViT-B.
//!
//! - patch embedding: `b c (h p1) (w p2) -> b (h w) (p1 p2 c)` -> LayerNorm(patch_dim) ->
//!   Linear(patch_dim, dim) -> LayerNorm(dim);
//! - fixed 2-D sin-cos position embedding (`posemb_sincos_2d`, temperature 10000), a constant, not
//!   a parameter;
//! - `depth` pre-LN blocks: x + Attention(LN(x)), then x + FeedForward(LN(x)); attention has
//!   `to_qkv` Linear(dim, 3 heads dim_head, no bias), softmax(q k^T dim_head^-0.5), `to_out`
//!   Linear(heads dim_head, dim, no bias); feed-forward Linear(dim, mlp) -> GELU (exact, erf) ->
//!   Linear(mlp, dim);
//! - no final norm inside the transformer, mean pooling over tokens, head LayerNorm(dim) ->
//!   Linear(dim, classes); no dropout, no class token.
//!
//! Initialisation is PyTorch's default (vit-pytorch does not override it): Linear weights and
//! biases U(±1/sqrt(fan_in)) (burn's default `Linear` init is the same), LayerNorm gamma 1 beta 0,
//! eps 1e-5.

use crate::fused;
use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Named SimpleViT sizes (DeiT naming), all with `dim_head` 64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VitPreset {
    /// ViT-Ti: dim 192, depth 12, heads 3, mlp 768 (5.7 M parameters at 224/16, 1000 classes).
    #[serde(alias = "tiny")]
    Ti,
    /// ViT-S: dim 384, depth 12, heads 6, mlp 1536.
    #[serde(alias = "small")]
    S,
    /// ViT-B: dim 768, depth 12, heads 12, mlp 3072 (the paper's model, 86,381,800 parameters).
    #[serde(alias = "base")]
    B,
}

/// Resolved SimpleViT dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VitDims {
    /// Token width.
    pub dim: usize,
    /// Number of transformer blocks.
    pub depth: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of one head.
    pub dim_head: usize,
    /// Feed-forward hidden width.
    pub mlp_dim: usize,
}

impl VitPreset {
    /// The preset's dimensions.
    pub fn dims(self) -> VitDims {
        let (dim, heads, mlp_dim) = match self {
            VitPreset::Ti => (192, 3, 768),
            VitPreset::S => (384, 6, 1536),
            VitPreset::B => (768, 12, 3072),
        };
        VitDims { dim, depth: 12, heads, dim_head: 64, mlp_dim }
    }
}

/// vit-pytorch's `posemb_sincos_2d(h, w, dim, temperature=10000)`: rows are tokens in (h w)
/// order, columns `[sin(x w), cos(x w), sin(y w), cos(y w)]` with `w_i = T^(-i / (dim/4 - 1))`.
/// Needs `dim % 4 == 0` and `dim >= 8` (checked by the config).
pub fn posemb_sincos_2d(h: usize, w: usize, dim: usize, temperature: f64) -> TensorData {
    let q = dim / 4;
    let omega: Vec<f64> =
        (0..q).map(|i| 1.0 / temperature.powf(i as f64 / (q.saturating_sub(1).max(1)) as f64)).collect();
    let mut out = Vec::with_capacity(h * w * dim);
    for y in 0..h {
        for x in 0..w {
            // computed in f32 like PyTorch (arange and omega are float32 there)
            let row = |pos: usize, f: fn(f32) -> f32| omega.iter().map(move |&o| f(pos as f32 * o as f32));
            out.extend(row(x, f32::sin));
            out.extend(row(x, f32::cos));
            out.extend(row(y, f32::sin));
            out.extend(row(y, f32::cos));
        }
    }
    TensorData::new(out, [h * w, dim])
}

/// Multi-head self-attention with its pre-norm.
#[derive(Module, Debug)]
pub struct Attention {
    /// Pre-norm.
    pub norm: LayerNorm,
    /// q, k, v projection, no bias.
    pub to_qkv: Linear,
    /// Output projection, no bias.
    pub to_out: Linear,
    /// Number of heads.
    pub heads: usize,
    /// Width of one head.
    pub dim_head: usize,
}

impl Attention {
    fn new(dim: usize, heads: usize, dim_head: usize, device: &Device) -> Self {
        let inner = heads * dim_head;
        Self {
            norm: LayerNormConfig::new(dim).init(device),
            to_qkv: LinearConfig::new(dim, inner * 3).with_bias(false).init(device),
            to_out: LinearConfig::new(inner, dim).with_bias(false).init(device),
            heads,
            dim_head,
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, n, _] = x.dims();
        let (h, d) = (self.heads, self.dim_head);
        let inner = h * d;
        let qkv = fused::linear(&self.to_qkv, self.norm.forward(x));
        // qkv.chunk(3, dim=-1), then 'b n (h d) -> b h n d'
        let split = |i: usize| qkv.clone().narrow(2, i * inner, inner).reshape([b, n, h, d]).swap_dims(1, 2);
        let (q, k, v) = (split(0), split(1), split(2));
        let dots = q.matmul(k.swap_dims(2, 3)) * (d as f64).powf(-0.5);
        let attn = softmax(dots, 3);
        let out = attn.matmul(v).swap_dims(1, 2).reshape([b, n, h * d]);
        fused::linear(&self.to_out, out)
    }
}

/// Pre-norm MLP.
#[derive(Module, Debug)]
pub struct FeedForward {
    /// Pre-norm.
    pub norm: LayerNorm,
    /// dim -> mlp.
    pub fc1: Linear,
    /// mlp -> dim.
    pub fc2: Linear,
}

impl FeedForward {
    fn new(dim: usize, hidden: usize, device: &Device) -> Self {
        Self {
            norm: LayerNormConfig::new(dim).init(device),
            fc1: LinearConfig::new(dim, hidden).init(device),
            fc2: LinearConfig::new(hidden, dim).init(device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        fused::linear(&self.fc2, gelu(fused::linear(&self.fc1, self.norm.forward(x))))
    }
}

/// One transformer block.
#[derive(Module, Debug)]
pub struct Block {
    /// Attention sub-layer.
    pub attn: Attention,
    /// Feed-forward sub-layer.
    pub ff: FeedForward,
}

/// SimpleViT (see the module docs).
#[derive(Module, Debug)]
pub struct SimpleVit {
    /// LayerNorm over the flattened patch.
    pub patch_norm1: LayerNorm,
    /// Patch projection.
    pub patch_linear: Linear,
    /// LayerNorm after the projection.
    pub patch_norm2: LayerNorm,
    /// Fixed sin-cos position embedding `[tokens, dim]`; a constant module field (burn visits no
    /// parameter in a bare tensor), so it is neither trained nor counted nor averaged.
    pub pos_embedding: Tensor<2>,
    /// Transformer blocks.
    pub blocks: Vec<Block>,
    /// Head LayerNorm.
    pub head_norm: LayerNorm,
    /// Head classifier.
    pub head: Linear,
    /// Patch height and width.
    pub patch_size: usize,
}

impl SimpleVit {
    /// Builds the network for `channels x height x width` images; the caller has checked that the
    /// patch size divides both sides and that `dims` are consistent.
    pub(crate) fn new(
        dims: VitDims,
        patch_size: usize,
        channels: usize,
        height: usize,
        width: usize,
        classes: usize,
        device: &Device,
    ) -> Self {
        let patch_dim = channels * patch_size * patch_size;
        let (gh, gw) = (height / patch_size, width / patch_size);
        let pos = Tensor::<2>::from_data(posemb_sincos_2d(gh, gw, dims.dim, 10_000.0), device);
        Self {
            patch_norm1: LayerNormConfig::new(patch_dim).init(device),
            patch_linear: LinearConfig::new(patch_dim, dims.dim).init(device),
            patch_norm2: LayerNormConfig::new(dims.dim).init(device),
            pos_embedding: pos,
            blocks: (0..dims.depth)
                .map(|_| Block {
                    attn: Attention::new(dims.dim, dims.heads, dims.dim_head, device),
                    ff: FeedForward::new(dims.dim, dims.mlp_dim, device),
                })
                .collect(),
            head_norm: LayerNormConfig::new(dims.dim).init(device),
            head: LinearConfig::new(dims.dim, classes).init(device),
            patch_size,
        }
    }

    /// `b c (h p1) (w p2) -> b (h w) (p1 p2 c)`, einops' order (channel fastest).
    fn patchify(&self, x: Tensor<4>) -> Tensor<3> {
        let [b, c, hh, ww] = x.dims();
        let p = self.patch_size;
        let (h, w) = (hh / p, ww / p);
        x.reshape([b, c, h, p, w, p]).permute([0, 2, 4, 3, 5, 1]).reshape([b, h * w, p * p * c])
    }

    /// Logits `[N, classes]` for images `[N, C, H, W]` of the size the model was built for.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = self.patchify(x);
        let x = self.patch_norm2.forward(fused::linear(&self.patch_linear, self.patch_norm1.forward(x)));
        let [b, n, dim] = x.dims();
        let pos = self.pos_embedding.clone().to_device(&x.device()).reshape([1, n, dim]);
        let mut x = x + pos;
        for block in &self.blocks {
            x = block.attn.forward(x.clone()) + x;
            x = block.ff.forward(x.clone()) + x;
        }
        let x = x.mean_dim(1).reshape([b, dim]);
        self.head.forward(self.head_norm.forward(x))
    }
}
