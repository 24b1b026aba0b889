//! Fused training ops: causal attention, causal softmax, layer norm, cross-entropy, GELU, 2-D
//! convolution, batch norm and max pooling, each one graph node with its own backward on burn's flex (CPU) backend, spread over the
//! rayon pool it runs in.
//!
//! burn's autodiff builds these from 5-10 small ops, each a graph node and a new buffer; here each is
//! one node with its own backward (a `#[backend_extension]` over flex and autodiff). On any other
//! device, or a dtype other than `f32`, the functions run burn's own ops, so a model calls them
//! everywhere. Their values and gradients match burn's ops to float rounding (tests/it/fused.rs).
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use qsr_models::fused;
//!
//! let device = Device::flex().autodiff();
//! let logits = Tensor::<2>::from_floats([[2.0, 0.5, -1.0], [0.0, 1.0, 0.0]], &device).require_grad();
//! let targets = Tensor::<1, Int>::from_ints([0, 1], &device);
//! let loss = fused::cross_entropy(logits.clone(), targets, None);
//! let grads = loss.backward();
//! assert_eq!(logits.grad(&grads).unwrap().dims(), [2, 3]);
//! ```

mod batch_norm;
mod conv;
mod flex;
mod gemm;
mod kernels;
mod linear;
mod pool;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Dispatch, backend_extension};
use burn::nn::conv::Conv2d;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::MaxPool2d;
use burn::nn::{BatchNorm, Linear, PaddingConfig2d};
use burn::tensor::{Bool, DType, Device, Int, Tensor};

/// The fused ops as a backend extension: flex computes them, autodiff over flex records one node each.
#[backend_extension(Flex, Autodiff)]
pub(crate) trait FusedOps: burn::backend::Backend {
    /// See [`causal_softmax`]; `scores` is `[.., t, t]`.
    fn causal_softmax(scores: FloatTensor<Self>, scale: f32) -> FloatTensor<Self>;
    /// See [`layer_norm`]; `beta` is zeros where the layer has none.
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self>;
    /// See [`cross_entropy`]; `smoothing` is 0 without label smoothing.
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>, smoothing: f32) -> FloatTensor<Self>;
    /// See [`gelu`].
    fn gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// See [`causal_attention`]; `qkv` is `[b, t, 3 width]`.
    fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self>;
    /// See [`linear`]: `x` `[rows, d_input]`, `weight` `[d_input, d_output]`, `bias` zeros where the
    /// layer has none.
    fn linear(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
    /// See [`conv2d`]; `bias` is zeros where the layer has none, `padding` is `[top, left, bottom, right]`.
    fn conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        stride: [usize; 2],
        padding: [usize; 4],
    ) -> FloatTensor<Self>;
    /// See [`max_pool2d`]: windows of `kernel` at stride `kernel`, no padding, `x` `[n, c, h, w]`.
    fn max_pool2d(x: FloatTensor<Self>, kernel: [usize; 2]) -> FloatTensor<Self>;
    /// Per-channel mean and biased variance of `x` `[n, c, ..]`, as `[2, c]`; not differentiated
    /// (its dependence on `x` is in [`FusedOps::batch_norm`]'s backward).
    fn batch_norm_stats(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// See [`batch_norm`]: `x` normalized by the batch's own `stats` (from `batch_norm_stats`).
    fn batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self>;
}

/// Whether the fused kernels serve `tensor`: `f32` on the flex device (with or without autodiff).
fn fused<const D: usize>(tensor: &Tensor<D>) -> bool {
    tensor.dtype() == DType::F32 && tensor.device().without_autodiff() == Device::flex()
}

/// `softmax(scale * scores)` over the last axis of attention scores `[batch, heads, t, t]`, where
/// query `i` attends to keys `0..=i` only (the causal mask of a decoder; masked weights are 0).
pub fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    let [.., tq, tk] = scores.dims();
    assert_eq!(tq, tk, "causal_softmax takes square [.., t, t] scores, got {:?}", scores.dims());
    if fused(&scores) {
        let out = <Dispatch as FusedOps>::causal_softmax(scores.into_dispatch(), scale as f32);
        return Tensor::from_dispatch(out);
    }
    let future = Tensor::<2, Bool>::tril_mask([tq, tk], 0, &scores.device()).unsqueeze::<4>();
    burn::tensor::activation::softmax((scores * scale).mask_fill(future, f32::NEG_INFINITY), 3)
}

/// Layer norm over the last axis: `(x - mean) / sqrt(var + epsilon) * gamma + beta` (biased variance,
/// as `burn::nn::LayerNorm` and PyTorch).
pub fn layer_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, beta: Option<Tensor<1>>, epsilon: f64) -> Tensor<D> {
    if !fused(&x) {
        return burn::tensor::module::layer_norm(x, gamma, beta, epsilon);
    }
    let dims = x.dims();
    let beta = beta.unwrap_or_else(|| Tensor::zeros(gamma.dims(), &gamma.device()));
    let out = <Dispatch as FusedOps>::layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon as f32,
    );
    Tensor::<D>::from_dispatch(out).reshape(dims)
}

/// Mean cross-entropy of `logits` (`[rows, classes]`) against class ids `targets` (`[rows]`, each
/// below `classes`), with optional label smoothing as `burn::nn::loss::CrossEntropyLoss`. Returns `[1]`.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>, smoothing: Option<f32>) -> Tensor<1> {
    if !fused(&logits) {
        let loss = CrossEntropyLossConfig::new().with_smoothing(smoothing).init(&logits.device());
        return loss.forward(logits, targets);
    }
    let out = <Dispatch as FusedOps>::cross_entropy(
        logits.into_dispatch(),
        targets.into_dispatch(),
        smoothing.unwrap_or(0.0),
    );
    Tensor::from_dispatch(out)
}

/// GELU, exact (erf) form: `x * Phi(x)` as `burn::tensor::activation::gelu` and PyTorch's default.
/// The fused op keeps `Phi(x)` for the backward, which then needs no second erf.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !fused(&x) {
        return burn::tensor::activation::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::gelu(x.into_dispatch()))
}

/// Causal multi-head self-attention from the fused q, k, v projection (nanoGPT's `c_attn`): `qkv` is
/// `[batch, t, 3 width]` (q, k, v side by side, each `heads x head width`), the result the heads'
/// outputs merged back to `[batch, t, width]`, with scores scaled by `1 / sqrt(head width)`. No dropout
/// on the attention weights: a model with it builds attention from [`causal_softmax`].
///
/// Fused, the heads are split and merged by one parallel pass each way, and the backward writes the
/// gradient of `qkv` in one buffer (burn's autodiff zero-fills one per `narrow` and adds them).
pub fn causal_attention(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    let [b, t, w3] = qkv.dims();
    assert!(heads > 0 && w3 % (3 * heads) == 0, "causal_attention: width {w3} is not 3 x {heads} heads x a head width");
    if fused(&qkv) {
        return Tensor::from_dispatch(<Dispatch as FusedOps>::causal_attention(qkv.into_dispatch(), heads));
    }
    let (w, d) = (w3 / 3, w3 / 3 / heads);
    let split = |i: usize| qkv.clone().narrow(2, i * w, w).reshape([b, t, heads, d]).swap_dims(1, 2);
    let (q, k, v) = (split(0), split(1), split(2));
    let weights = causal_softmax(q.matmul(k.swap_dims(2, 3)), (d as f64).powf(-0.5));
    weights.matmul(v).swap_dims(1, 2).reshape([b, t, w])
}

/// `layer.forward(x)` for a burn [`Linear`] layer, with every leading axis of `x` merged into the rows
/// of one `[rows, d_input] x [d_input, d_output]` product. burn keeps a batched product where the
/// sequence length is a multiple of 32, whose weight gradient is then one product per batch element
/// (each summing over `t` rows only) and a sum over them; merged, it is one product over all rows, as
/// PyTorch's. Fused on flex (one graph node: the product onto the bias, and a backward of two products
/// and a column sum); elsewhere burn's matmul and add on the merged rows.
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    let mut dims = x.dims();
    let weight = layer.weight.val();
    let [d_input, d_output] = weight.dims();
    assert_eq!(dims[D - 1], d_input, "linear: input {dims:?} does not end in the layer's d_input {d_input}");
    let x = x.reshape([dims[..D - 1].iter().product::<usize>(), d_input]);
    let y = if fused(&x) && fused(&weight) {
        let bias = match &layer.bias {
            Some(bias) => bias.val(),
            None => Tensor::zeros([d_output], &weight.device()),
        };
        let y = <Dispatch as FusedOps>::linear(x.into_dispatch(), weight.into_dispatch(), bias.into_dispatch());
        Tensor::from_dispatch(y)
    } else {
        let y = x.matmul(weight);
        match &layer.bias {
            Some(bias) => y + bias.val().unsqueeze::<2>(),
            None => y,
        }
    };
    dims[D - 1] = d_output;
    y.reshape(dims)
}

/// `conv.forward(x)` for a burn [`Conv2d`] layer, fused where it can be: one graph node whose backward
/// computes the input, weight and bias gradients from one column matrix (and skips the input's where
/// the input needs none, as for the images). Taken for groups 1, dilation 1 and `Valid` or `Explicit`
/// padding with at least one kernel position in the padded input; otherwise, on other devices or
/// dtypes, this is `conv.forward(x)`.
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let weight = conv.weight.val();
    let [n, cin, h, w] = x.dims();
    let [cout, wcin, kh, kw] = weight.dims();
    let padding = match conv.padding {
        PaddingConfig2d::Valid => [0; 4],
        PaddingConfig2d::Explicit(top, left, bottom, right) => [top, left, bottom, right],
        PaddingConfig2d::Same => return conv.forward(x),
    };
    let fits = h + padding[0] + padding[2] >= kh && w + padding[1] + padding[3] >= kw;
    let plain = conv.groups == 1 && conv.dilation == [1, 1] && !conv.stride.contains(&0);
    if !(fused(&x) && fused(&weight) && plain && fits && cin == wcin && n * cin * cout * kh * kw > 0) {
        return conv.forward(x);
    }
    let bias = match &conv.bias {
        Some(bias) => bias.val(),
        None => Tensor::zeros([cout], &weight.device()),
    };
    let out = <Dispatch as FusedOps>::conv2d(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        conv.stride,
        padding,
    );
    Tensor::from_dispatch(out)
}

/// `bn.forward(x)` for a burn [`BatchNorm`] layer over images `[n, c, h, w]`, fused in training (an
/// autodiff device and the layer not frozen): the batch's statistics computed in place of the layout,
/// one graph node whose backward gives the input's, gamma's and beta's gradients, and the layer's
/// running statistics updated as burn does (`momentum`, biased variance). Otherwise, and on other
/// devices or dtypes, this is `bn.forward(x)`.
pub fn batch_norm(bn: &BatchNorm, x: Tensor<4>) -> Tensor<4> {
    let (gamma, beta) = (bn.gamma.val(), bn.beta.val());
    let training = x.device().is_autodiff() && bn.training.is_enabled();
    if !(training && fused(&x) && fused(&gamma) && fused(&beta) && x.dims()[1] == gamma.dims()[0]) {
        return bn.forward(x);
    }
    let c = gamma.dims()[0];
    let stats = <Dispatch as FusedOps>::batch_norm_stats(x.clone().detach().into_dispatch());
    let stats = Tensor::<2>::from_dispatch(stats);
    let out = <Dispatch as FusedOps>::batch_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        stats.clone().into_dispatch(),
        bn.epsilon as f32,
    );
    let device = stats.device();
    let [mean, var] = [0, 1].map(|i| stats.clone().narrow(0, i, 1).reshape([c]));
    let m = bn.momentum;
    let running = |state: &burn::module::RunningState<Tensor<1>>, batch: Tensor<1>| {
        let old = state.value_sync().to_device(&device);
        state.update(old.mul_scalar(1.0 - m).add(batch.detach().mul_scalar(m)).detach());
    };
    running(&bn.running_mean, mean);
    running(&bn.running_var, var);
    Tensor::from_dispatch(out)
}

/// `pool.forward(x)` for a burn [`MaxPool2d`] over images `[n, c, h, w]`, fused for non-overlapping
/// windows (stride = kernel, no padding, dilation 1, floor mode, windows that fit): one graph node that
/// keeps each window's argmax for its backward. Otherwise, and on other devices or dtypes, this is
/// `pool.forward(x)`.
pub fn max_pool2d(pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    let [_, _, h, w] = x.dims();
    let k = pool.kernel_size;
    let plain = pool.stride == k && pool.dilation == [1, 1] && !pool.ceil_mode;
    let unpadded = matches!(pool.padding, PaddingConfig2d::Valid | PaddingConfig2d::Explicit(0, 0, 0, 0));
    if !(fused(&x) && plain && unpadded && k[0] > 0 && k[1] > 0 && h >= k[0] && w >= k[1]) {
        return pool.forward(x);
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::max_pool2d(x.into_dispatch(), k))
}
