//! A GPT-style decoder as in GPT-2 and nanoGPT: token + learned position embeddings, pre-LayerNorm
//! blocks of causal multi-head self-attention and a 4x GELU MLP, a final LayerNorm, and an LM head
//! tied to the token embedding (`logits = x wte^T`), with dropout on the embeddings, the attention
//! weights and each residual branch.
//!
//! Initialisation follows GPT-2 / nanoGPT: Linear and Embedding weights N(0, 0.02), the two residual
//! projections (`attn.c_proj`, `mlp.c_proj`) N(0, 0.02 / sqrt(2 layers)), biases 0, LayerNorm gamma 1
//! beta 0 (eps 1e-5). Field names follow nanoGPT (`wte`, `wpe`, `h`, `ln_1`, `c_attn`, ...).

use burn::module::{Module, Param};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::ModelError;
use crate::fused;

/// Largest vocabulary, context, width, depth and head count a config may ask for: beyond them a typo
/// would allocate without bound.
const MAX_GPT_SIZE: usize = 1 << 20;

/// GPT settings: the recipe's `[model]` section with `kind = "gpt"` (keys `model.<field>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Tokens in the vocabulary (50,257 for GPT-2's BPE; a char-level corpus has its own).
    pub vocab_size: usize,
    /// Longest sequence, the number of learned positions (GPT-2: 1,024).
    pub context: usize,
    /// Transformer blocks (GPT-2 small: 12).
    pub layers: usize,
    /// Attention heads; `width` must be a multiple (GPT-2 small: 12).
    pub heads: usize,
    /// Token width (GPT-2 small: 768).
    pub width: usize,
    /// Dropout probability on embeddings, attention weights and residual branches (default 0).
    #[serde(default)]
    pub dropout: f64,
    /// Biases in the Linear layers and LayerNorms' beta (default true, as GPT-2).
    #[serde(default = "yes")]
    pub bias: bool,
}

fn yes() -> bool {
    true
}

impl GptConfig {
    /// GPT-2 small: vocabulary 50,257, context 1,024, 12 layers, 12 heads, width 768; 124,439,808
    /// parameters with the tied head (123,653,376 without the position embeddings, as nanoGPT prints).
    pub fn gpt2_small() -> Self {
        Self { vocab_size: 50_257, context: 1_024, layers: 12, heads: 12, width: 768, dropout: 0.0, bias: true }
    }

    /// A small model for a character-level corpus: 4 layers, 4 heads, width 128, context 128.
    pub fn char_small(vocab_size: usize) -> Self {
        Self { vocab_size, context: 128, layers: 4, heads: 4, width: 128, dropout: 0.0, bias: true }
    }

    /// Checks the settings, naming the key of the first bad one.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field: &'static str, reason: String| Err(ModelError::InvalidConfig { kind: "gpt", field, reason });
        for (field, value) in
            [("vocab_size", self.vocab_size), ("context", self.context), ("layers", self.layers), ("heads", self.heads)]
        {
            if value == 0 || value > MAX_GPT_SIZE {
                return bad(field, format!("must be in 1..={MAX_GPT_SIZE}, got {value}"));
            }
        }
        if self.width == 0 || self.width > MAX_GPT_SIZE || !self.width.is_multiple_of(self.heads) {
            return bad(
                "width",
                format!("must be a positive multiple of model.heads ({}), got {}", self.heads, self.width),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", format!("must be in [0, 1), got {}", self.dropout));
        }
        Ok(())
    }

    /// Builds the model on `device` (weights are drawn lazily, on first use, from the device's RNG).
    pub fn init(&self, device: &Device) -> Result<Gpt, ModelError> {
        self.validate()?;
        let normal = |std: f64| Initializer::Normal { mean: 0.0, std };
        let embedding = |n: usize| EmbeddingConfig::new(n, self.width).with_initializer(normal(0.02)).init(device);
        let h = (0..self.layers).map(|_| GptBlock::new(self, device)).collect();
        Ok(Gpt {
            wte: embedding(self.vocab_size),
            wpe: embedding(self.context),
            drop: DropoutConfig::new(self.dropout).init(),
            h,
            ln_f: layer_norm(self, device),
            context: self.context,
        })
    }
}

/// A GPT-style decoder, built by [`GptConfig::init`]: `forward(tokens [B, T]) -> logits [B, T, vocab]`.
///
/// As GPT-2 and nanoGPT: token + learned position embeddings, pre-LayerNorm blocks of causal multi-head
/// self-attention and a 4x GELU MLP, a final LayerNorm, and an LM head tied to the token embedding
/// (`logits = x wte^T`), dropout on the embeddings, the attention weights and each residual branch.
/// Weights N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 layers)), biases 0.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding, `[vocab, width]`; also the LM head's weight.
    pub wte: Embedding,
    /// Learned position embedding, `[context, width]`.
    pub wpe: Embedding,
    /// Dropout on the summed embeddings.
    pub drop: Dropout,
    /// The blocks.
    pub h: Vec<GptBlock>,
    /// Final LayerNorm.
    pub ln_f: LayerNorm,
    /// Longest sequence the model takes.
    pub context: usize,
}

impl Gpt {
    /// Next-token logits for every position of `tokens` (`[B, T]`). Refuses sequences longer than the
    /// context. Ids must be below `vocab_size`, as every token of a `qsr_data::Corpus` with this
    /// vocabulary is (checking here would cost a device read per call; burn's lookup panics otherwise).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        let [_, t] = tokens.dims();
        if t > self.context {
            return Err(ModelError::InvalidInput {
                kind: "gpt",
                field: "tokens",
                reason: format!("a sequence of {t} tokens is longer than the context {}", self.context),
            });
        }
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &device).unsqueeze::<2>();
        let mut x = self.drop.forward(self.wte.forward(tokens) + self.wpe.forward(positions));
        for block in &self.h {
            x = block.forward(x);
        }
        let [b, t, width] = x.dims();
        let x = norm(&self.ln_f, x).reshape([b * t, width]);
        // The tied head: logits = x wte^T, over all b t rows at once (see `fused::linear`).
        let head = self.wte.weight.val().transpose();
        let logits = x.matmul(head);
        let vocab = logits.dims()[1];
        Ok(logits.reshape([b, t, vocab]))
    }
}

/// One pre-LayerNorm block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Module, Debug)]
pub struct GptBlock {
    /// Norm before attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// Norm before the MLP.
    pub ln_2: LayerNorm,
    /// The 4x GELU MLP.
    pub mlp: GptMlp,
}

impl GptBlock {
    fn new(config: &GptConfig, device: &Device) -> Self {
        Self {
            ln_1: layer_norm(config, device),
            attn: CausalSelfAttention::new(config, device),
            ln_2: layer_norm(config, device),
            mlp: GptMlp::new(config, device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attn.forward(norm(&self.ln_1, x));
        x.clone() + self.mlp.forward(norm(&self.ln_2, x))
    }
}

/// Multi-head self-attention where each position sees itself and the positions before it.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    /// q, k, v projection, `width -> 3 width`.
    pub c_attn: Linear,
    /// Output (residual) projection.
    pub c_proj: Linear,
    /// Dropout on the attention weights.
    pub attn_dropout: Dropout,
    /// Dropout on the output.
    pub resid_dropout: Dropout,
    /// Number of heads.
    pub heads: usize,
}

impl CausalSelfAttention {
    fn new(config: &GptConfig, device: &Device) -> Self {
        let w = config.width;
        Self {
            c_attn: linear(config, w, 3 * w, 0.02, device),
            c_proj: linear(config, w, w, residual_std(config), device),
            attn_dropout: DropoutConfig::new(config.dropout).init(),
            resid_dropout: DropoutConfig::new(config.dropout).init(),
            heads: config.heads,
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, w] = x.dims();
        let (h, d) = (self.heads, w / self.heads);
        let qkv = fused::linear(&self.c_attn, x);
        if self.attn_dropout.prob == 0.0 {
            // Heads split, scores, causal softmax, weights x v and heads merged: one fused op.
            return self.resid_dropout.forward(fused::linear(&self.c_proj, fused::causal_attention(qkv, h)));
        }
        // 'b t (h d) -> b h t d' for each of q, k, v.
        let split = |i: usize| qkv.clone().narrow(2, i * w, w).reshape([b, t, h, d]).swap_dims(1, 2);
        let (q, k, v) = (split(0), split(1), split(2));
        // One fused op for scale, causal mask and softmax (burn's autodiff splits them into ~8).
        let weights = fused::causal_softmax(q.matmul(k.swap_dims(2, 3)), (d as f64).powf(-0.5));
        let weights = self.attn_dropout.forward(weights);
        let out = weights.matmul(v).swap_dims(1, 2).reshape([b, t, w]);
        self.resid_dropout.forward(fused::linear(&self.c_proj, out))
    }
}

/// `width -> 4 width -> GELU -> width`, then dropout.
#[derive(Module, Debug)]
pub struct GptMlp {
    /// Expansion.
    pub c_fc: Linear,
    /// Output (residual) projection.
    pub c_proj: Linear,
    /// Dropout on the output.
    pub dropout: Dropout,
}

impl GptMlp {
    fn new(config: &GptConfig, device: &Device) -> Self {
        let w = config.width;
        Self {
            c_fc: linear(config, w, 4 * w, 0.02, device),
            c_proj: linear(config, 4 * w, w, residual_std(config), device),
            dropout: DropoutConfig::new(config.dropout).init(),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.dropout.forward(fused::linear(&self.c_proj, fused::gelu(fused::linear(&self.c_fc, x))))
    }
}

/// GPT-2's scaled init of the residual projections: 0.02 / sqrt(2 layers).
fn residual_std(config: &GptConfig) -> f64 {
    0.02 / (2.0 * config.layers as f64).sqrt()
}

/// A Linear with N(0, `std`) weights and zero biases (or none).
fn linear(config: &GptConfig, d_in: usize, d_out: usize, std: f64, device: &Device) -> Linear {
    let mut layer = LinearConfig::new(d_in, d_out)
        .with_bias(config.bias)
        .with_initializer(Initializer::Normal { mean: 0.0, std })
        .init(device);
    if config.bias {
        layer.bias = Some(Param::from_tensor(Tensor::zeros([d_out], device)));
    }
    layer
}

/// The LayerNorms' epsilon (GPT-2's and burn's default).
const LN_EPSILON: f64 = 1e-5;

fn layer_norm(config: &GptConfig, device: &Device) -> LayerNorm {
    LayerNormConfig::new(config.width).with_epsilon(LN_EPSILON).with_bias(config.bias).init(device)
}

/// `ln(x)` as one fused op (`LayerNorm` keeps its epsilon private; ours are all [`LN_EPSILON`]).
fn norm(ln: &LayerNorm, x: Tensor<3>) -> Tensor<3> {
    fused::layer_norm(x, ln.gamma.val(), ln.beta.as_ref().map(|b| b.val()), LN_EPSILON)
}
