//! The fused ops (causal attention and softmax, layer norm, cross-entropy, GELU, convolution) against
//! burn's own: values and gradients on seeded random inputs, the untracked path, and results that do
//! not depend on the thread count.

use burn::module::Param;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::{BatchNorm, BatchNormConfig, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use qsr_models::fused;

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// Asserts `a` and `b` agree to `tol` relative to the largest magnitude in `b`.
fn assert_close(what: &str, a: Vec<f32>, b: Vec<f32>, tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}[{i}]: fused {x} vs burn {y} (scale {scale})");
    }
}

/// Normal(0, 2) values from a generator of the test's own: burn's seeded global RNG is shared by the
/// tests running beside this one, which could draw between a `seed` and its `random`.
fn random<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let mut state = seed;
    let mut uniform = move || {
        // splitmix64, to (0, 1]
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 + f64::EPSILON
    };
    let n = shape.iter().product();
    let normal = (0..n).map(|_| {
        let (u, v) = (uniform(), uniform());
        (2.0 * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    });
    Tensor::from_data(TensorData::new(normal.collect::<Vec<_>>(), shape), device)
}

/// `f(x)`'s values and the gradient of `sum(f(x) * weights)` with respect to `x`.
fn value_and_grad<const D: usize>(
    x: &Tensor<D>,
    weights: &Tensor<D>,
    f: &dyn Fn(Tensor<D>) -> Tensor<D>,
) -> (Vec<f32>, Vec<f32>) {
    let x = x.clone().require_grad();
    let y = f(x.clone());
    let grads = (y.clone() * weights.clone()).sum().backward();
    (values(y), values(x.grad(&grads).unwrap()))
}

fn autodiff() -> Device {
    Device::flex().autodiff()
}

/// Unfused: scale, mask the future, softmax (what the GPT built by hand).
fn causal_softmax_reference(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    let [.., t, _] = scores.dims();
    let future = Tensor::<2, Bool>::tril_mask([t, t], 0, &scores.device()).unsqueeze::<4>();
    softmax((scores * scale).mask_fill(future, f32::NEG_INFINITY), 3)
}

#[test]
fn causal_softmax_matches_mask_and_softmax_in_values_and_gradients() {
    let device = autodiff();
    // 2 x 3 x 37 x 37: 222 rows, more than a rayon block and not a multiple of one.
    let x = random([2, 3, 37, 37], 1, &device);
    let weights = random([2, 3, 37, 37], 2, &device);
    let run = |f: &dyn Fn(Tensor<4>) -> Tensor<4>| value_and_grad(&x, &weights, f);
    let (y, dx) = run(&|x| fused::causal_softmax(x, 0.3));
    let (y_ref, dx_ref) = run(&|x| causal_softmax_reference(x, 0.3));
    assert_close("causal softmax", y.clone(), y_ref, 1e-5);
    assert_close("its gradient", dx, dx_ref, 1e-5);
    // The future gets weight 0: row 0 of every head is [1, 0, 0, ...].
    assert_eq!(y[0], 1.0);
    assert!(y[1..37].iter().all(|&w| w == 0.0));
}

/// Unfused attention from burn's ops: split the heads, masked softmax, weights x v, merge.
fn causal_attention_reference(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    let [b, t, w3] = qkv.dims();
    let (w, d) = (w3 / 3, w3 / 3 / heads);
    let split = |i: usize| qkv.clone().narrow(2, i * w, w).reshape([b, t, heads, d]).swap_dims(1, 2);
    let weights = causal_softmax_reference(split(0).matmul(split(1).swap_dims(2, 3)), (d as f64).powf(-0.5));
    weights.matmul(split(2)).swap_dims(1, 2).reshape([b, t, w])
}

#[test]
fn causal_attention_matches_burns_ops_in_values_and_gradients() {
    let device = autodiff();
    // 3 sequences of 37 tokens, 4 heads of width 5: rows not a multiple of a rayon block.
    let qkv = random([3, 37, 60], 14, &device);
    let weights = random([3, 37, 20], 15, &device);
    let run = |f: &dyn Fn(Tensor<3>) -> Tensor<3>| value_and_grad(&qkv, &weights, f);
    let (y, dx) = run(&|x| fused::causal_attention(x, 4));
    let (y_ref, dx_ref) = run(&|x| causal_attention_reference(x, 4));
    assert_close("causal attention", y, y_ref, 1e-5);
    assert_close("its gradient", dx, dx_ref, 1e-4);
}

#[test]
fn layer_norm_matches_burns_in_values_and_all_three_gradients() {
    let device = autodiff();
    let x = random([5, 13, 24], 3, &device);
    let gamma = random([24], 4, &device);
    let beta = random([24], 5, &device);
    let weights = random([5, 13, 24], 6, &device);
    for with_beta in [true, false] {
        let run = |f: &dyn Fn(Tensor<3>, Tensor<1>, Option<Tensor<1>>) -> Tensor<3>| {
            let (x, gamma, beta) =
                (x.clone().require_grad(), gamma.clone().require_grad(), beta.clone().require_grad());
            let y = f(x.clone(), gamma.clone(), with_beta.then(|| beta.clone()));
            let grads = (y.clone() * weights.clone()).sum().backward();
            let dbeta = beta.grad(&grads).map(values);
            (values(y), values(x.grad(&grads).unwrap()), values(gamma.grad(&grads).unwrap()), dbeta)
        };
        let fused = run(&|x, g, b| fused::layer_norm(x, g, b, 1e-5));
        let reference = run(&|x, g, b| burn::tensor::module::layer_norm(x, g, b, 1e-5));
        assert_close("layer norm", fused.0, reference.0, 1e-5);
        assert_close("dx", fused.1, reference.1, 1e-4);
        assert_close("dgamma", fused.2, reference.2, 1e-5);
        assert_eq!(fused.3.is_some(), with_beta, "beta's gradient exists exactly when beta does");
        if let (Some(a), Some(b)) = (fused.3, reference.3) {
            assert_close("dbeta", a, b, 1e-5);
        }
    }
}

#[test]
fn cross_entropy_matches_burns_with_and_without_label_smoothing() {
    let device = autodiff();
    let logits = random([70, 11], 7, &device);
    let targets: Vec<i64> = (0..70).map(|i| (i * 7 % 11) as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [70]), &device);
    for smoothing in [None, Some(0.1)] {
        let run = |f: &dyn Fn(Tensor<2>) -> Tensor<1>| {
            let x = logits.clone().require_grad();
            let loss = f(x.clone()) * 3.0;
            let grads = loss.clone().backward();
            (values(loss), values(x.grad(&grads).unwrap()))
        };
        let (loss, dx) = run(&|x| fused::cross_entropy(x, targets.clone(), smoothing));
        let ce = CrossEntropyLossConfig::new().with_smoothing(smoothing).init(&device);
        let (loss_ref, dx_ref) = run(&|x| ce.forward(x, targets.clone()));
        assert_close("cross-entropy", loss, loss_ref, 1e-5);
        assert_close("its gradient", dx, dx_ref, 1e-5);
    }
}

#[test]
fn gelu_matches_burns_in_values_and_gradients() {
    let device = autodiff();
    // More elements than one rayon task takes, and not a multiple of it.
    let x = random([3, 70_001], 12, &device);
    let weights = random([3, 70_001], 13, &device);
    let run = |f: &dyn Fn(Tensor<2>) -> Tensor<2>| value_and_grad(&x, &weights, f);
    let (y, dx) = run(&|x| fused::gelu(x));
    let (y_ref, dx_ref) = run(&|x| burn::tensor::activation::gelu(x));
    assert_close("gelu", y, y_ref, 1e-6);
    assert_close("its gradient", dx, dx_ref, 1e-6);
}

/// A seeded conv layer: `[cin, cout]` channels, `kernel`, `stride`, `padding` `(top, left, bottom, right)`.
fn conv_layer(
    channels: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: PaddingConfig2d,
    bias: bool,
    device: &Device,
) -> Conv2d {
    let mut conv =
        Conv2dConfig::new(channels, kernel).with_stride(stride).with_padding(padding).with_bias(bias).init(device);
    conv.weight = Param::from_tensor(random(conv.weight.dims(), 20, device) * 0.2);
    conv.bias = conv.bias.map(|b| Param::from_tensor(random(b.dims(), 19, device)));
    conv
}

/// The output, and the gradients of the input, weight and bias (if any) of `sum(f(x) * weights)`.
fn layer_value_and_grads<const D: usize, const W: usize>(
    x: &Tensor<D>,
    (weight, bias): (&Param<Tensor<W>>, Option<&Param<Tensor<1>>>),
    f: &dyn Fn(Tensor<D>) -> Tensor<D>,
) -> Vec<Vec<f32>> {
    let x = x.clone().require_grad();
    let y = f(x.clone());
    let weights = random(y.dims(), 21, &y.device());
    let grads = (y.clone() * weights).sum().backward();
    let mut out = vec![values(y), values(x.grad(&grads).unwrap()), values(weight.val().grad(&grads).unwrap())];
    out.extend(bias.map(|b| values(b.val().grad(&grads).unwrap())));
    out
}

#[test]
fn conv2d_matches_burns_in_values_and_all_three_gradients() {
    let device = autodiff();
    let explicit = PaddingConfig2d::Explicit;
    // (input, channels, kernel, stride, padding, bias): the CNN's 3x3 pad 1 on 8x8 digits (batch 19,
    // not a multiple of a block), a strided 3x3, a 1x1 stride-2 projection, an uneven kernel with
    // asymmetric padding, an unpadded conv, ResNet's 7x7 stride 2 pad 3 stem, a stride-1 uneven kernel
    // with asymmetric padding and a 1x1 padded by 1 (both small: im2col), then ResNet's 3x3 and the
    // uneven kernel on 16 channels of 16 x 16 (the shifted products).
    let cases = [
        ([19, 1, 8, 8], [1, 32], [3, 3], [1, 1], explicit(1, 1, 1, 1), true),
        ([5, 6, 9, 11], [6, 4], [3, 3], [2, 2], explicit(1, 1, 1, 1), false),
        ([3, 4, 8, 8], [4, 8], [1, 1], [2, 2], PaddingConfig2d::Valid, false),
        ([2, 3, 7, 10], [3, 5], [2, 3], [1, 2], explicit(0, 2, 1, 1), true),
        ([4, 2, 6, 6], [2, 3], [3, 3], [1, 1], PaddingConfig2d::Valid, true),
        ([2, 3, 20, 20], [3, 8], [7, 7], [2, 2], explicit(3, 3, 3, 3), false),
        ([3, 4, 6, 7], [4, 5], [2, 3], [1, 1], explicit(1, 2, 0, 1), true),
        ([2, 3, 5, 5], [3, 4], [1, 1], [1, 1], explicit(1, 1, 1, 1), true),
        ([2, 16, 16, 16], [16, 8], [3, 3], [1, 1], explicit(1, 1, 1, 1), true),
        ([2, 16, 16, 17], [16, 5], [2, 3], [1, 1], explicit(1, 2, 0, 1), false),
    ];
    for (i, (input, channels, kernel, stride, padding, bias)) in cases.into_iter().enumerate() {
        let conv = conv_layer(channels, kernel, stride, padding, bias, &device);
        let x = random(input, 22 + i as u64, &device);
        let params = (&conv.weight, conv.bias.as_ref());
        let fused = layer_value_and_grads(&x, params, &|x| fused::conv2d(&conv, x));
        let reference = layer_value_and_grads(&x, params, &|x| conv.forward(x));
        assert_eq!(fused.len(), reference.len());
        for (what, (a, b)) in ["output", "dx", "dweight", "dbias"].iter().zip(fused.into_iter().zip(reference)) {
            assert_close(&format!("case {i}: {what}"), a, b, 1e-5);
        }
    }
}

#[test]
fn linear_with_merged_rows_matches_burns_in_values_and_all_three_gradients() {
    let device = autodiff();
    for (i, bias) in [true, false].into_iter().enumerate() {
        let mut layer = LinearConfig::new(6, 5).with_bias(bias).init(&device);
        layer.weight = Param::from_tensor(random([6, 5], 42 + i as u64, &device));
        layer.bias = layer.bias.map(|b| Param::from_tensor(random(b.dims(), 44, &device)));
        // t = 32: burn keeps the batched product there (its weight gradient summed per batch element).
        let x = random([3, 32, 6], 45, &device);
        let params = (&layer.weight, layer.bias.as_ref());
        let fused = layer_value_and_grads(&x, params, &|x| fused::linear(&layer, x));
        let reference = layer_value_and_grads(&x, params, &|x| layer.forward(x));
        assert_eq!(fused.len(), reference.len());
        for (what, (a, b)) in ["output", "dx", "dweight", "dbias"].iter().zip(fused.into_iter().zip(reference)) {
            assert_close(&format!("bias {bias}: {what}"), a, b, 1e-5);
        }
        let x = random([7, 6], 46, &device);
        let (a, b) = (fused::linear(&layer, x.clone()), layer.forward(x));
        assert_close("2-d input", values(a), values(b), 1e-6);
    }
}

/// A batch norm layer with random gamma and beta (momentum 0.3, so running statistics move visibly).
fn bn_layer(channels: usize, device: &Device) -> BatchNorm {
    let mut bn = BatchNormConfig::new(channels).with_momentum(0.3).init(device);
    bn.gamma = Param::from_tensor(random([channels], 40, device));
    bn.beta = Param::from_tensor(random([channels], 41, device));
    bn
}

/// The output, the gradients of the input, gamma and beta of `sum(bn(x) * weights)`, then the running
/// mean and variance after the step.
fn bn_value_and_grads(bn: &BatchNorm, x: &Tensor<4>, f: &dyn Fn(&BatchNorm, Tensor<4>) -> Tensor<4>) -> Vec<Vec<f32>> {
    let x = x.clone().require_grad();
    let y = f(bn, x.clone());
    let weights = random(y.dims(), 42, &y.device());
    let grads = (y.clone() * weights).sum().backward();
    let grad = |p: &Param<Tensor<1>>| values(p.val().grad(&grads).unwrap());
    vec![
        values(y),
        values(x.grad(&grads).unwrap()),
        grad(&bn.gamma),
        grad(&bn.beta),
        values(bn.running_mean.value()),
        values(bn.running_var.value()),
    ]
}

#[test]
fn batch_norm_matches_burns_in_values_gradients_and_running_statistics() {
    let device = autodiff();
    // ResNet-20's first stage at a small batch, odd planes, one channel, a 1x1 plane.
    for (i, shape) in [[6, 16, 8, 8], [3, 5, 7, 9], [4, 1, 5, 5], [9, 3, 1, 1]].into_iter().enumerate() {
        let x = random(shape, 43 + i as u64, &device) + 1.5;
        let fused = bn_value_and_grads(&bn_layer(shape[1], &device), &x, &|bn, x| fused::batch_norm(bn, x));
        let reference = bn_value_and_grads(&bn_layer(shape[1], &device), &x, &|bn, x| bn.forward(x));
        let parts = ["output", "dx", "dgamma", "dbeta", "running mean", "running var"];
        for (what, (a, b)) in parts.iter().zip(fused.into_iter().zip(reference)) {
            assert_close(&format!("case {i}: {what}"), a, b, 2e-5);
        }
    }
    // Inference (no autodiff) and a frozen layer use the running statistics, as burn's forward.
    let inner = Device::flex();
    let bn = bn_layer(4, &inner);
    let x = random([2, 4, 3, 3], 50, &inner);
    assert_eq!(values(fused::batch_norm(&bn, x.clone())), values(bn.forward(x)));
}

#[test]
fn max_pool2d_matches_burns_in_values_and_gradients() {
    let device = autodiff();
    // The CNN's 2x2 on 8x8 and on 7x7 (floor: the last row and column dropped), a 3x3 window, a 1x2.
    let cases = [([5, 3, 8, 8], [2, 2]), ([2, 4, 7, 7], [2, 2]), ([3, 2, 9, 10], [3, 3]), ([2, 2, 4, 6], [1, 2])];
    for (i, (shape, kernel)) in cases.into_iter().enumerate() {
        let pool = MaxPool2dConfig::new(kernel).init();
        let x = random(shape, 60 + i as u64, &device);
        let out_dims = pool.forward(x.clone()).dims();
        let weights = random(out_dims, 61, &device);
        let fused = value_and_grad(&x, &weights, &|x| fused::max_pool2d(&pool, x));
        let reference = value_and_grad(&x, &weights, &|x| pool.forward(x));
        assert_eq!(fused.0, reference.0, "case {i}: values");
        assert_eq!(fused.1, reference.1, "case {i}: gradients");
    }
    // Overlapping windows (stride 1) are burn's.
    let overlapping = MaxPool2dConfig::new([2, 2]).with_strides([1, 1]).init();
    let x = random([1, 1, 4, 4], 62, &device);
    assert_eq!(values(fused::max_pool2d(&overlapping, x.clone())), values(overlapping.forward(x)));
}

#[test]
fn conv2d_falls_back_to_burn_for_groups_and_dilation() {
    let device = autodiff();
    let x = random([2, 4, 9, 9], 30, &device);
    let grouped = Conv2dConfig::new([4, 4], [3, 3]).with_groups(2).init(&device);
    let dilated = Conv2dConfig::new([4, 2], [3, 3]).with_dilation([2, 2]).init(&device);
    for conv in [grouped, dilated] {
        assert_eq!(values(fused::conv2d(&conv, x.clone())), values(conv.forward(x.clone())));
    }
}

#[test]
fn fused_ops_run_without_autodiff_and_agree_with_the_tracked_path() {
    let inner = Device::flex();
    let x = random([1, 2, 9, 9], 8, &inner);
    let tracked = fused::causal_softmax(Tensor::from_data(x.to_data(), &autodiff()), 0.5);
    assert_eq!(values(fused::causal_softmax(x, 0.5)), values(tracked));
    let x = random([4, 6], 9, &inner);
    let gamma = Tensor::<1>::ones([6], &inner);
    let reference = burn::tensor::module::layer_norm(x.clone(), gamma.clone(), None, 1e-5);
    assert_close("untracked layer norm", values(fused::layer_norm(x, gamma, None, 1e-5)), values(reference), 1e-5);
    let conv = conv_layer([3, 4], [3, 3], [1, 1], PaddingConfig2d::Explicit(1, 1, 1, 1), true, &inner);
    let x = random([2, 3, 5, 5], 31, &inner);
    assert_close("untracked conv", values(fused::conv2d(&conv, x.clone())), values(conv.forward(x)), 1e-5);
    let layer = LinearConfig::new(5, 3).init(&inner);
    let x = random([2, 4, 5], 35, &inner);
    assert_close("untracked linear", values(fused::linear(&layer, x.clone())), values(layer.forward(x)), 1e-5);
}

/// Forward and gradients of all the ops in a rayon pool of `threads`.
fn all_ops_in_pool(threads: usize) -> Vec<Vec<f32>> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let device = autodiff();
        let x = random([3, 4, 29, 29], 10, &device).require_grad();
        let gamma = random([29], 11, &device).require_grad();
        let h = fused::layer_norm(fused::causal_softmax(x.clone(), 0.7), gamma.clone(), None, 1e-5);
        // [3, 4, 29, 29] as qkv [4, 29, 3 x 29] of one head; its output [4, 29, 29] as 116 rows of logits.
        let h = fused::causal_attention(fused::gelu(h).reshape([4, 29, 87]), 1);
        let rows = 4 * 29;
        let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![3i64; rows], [rows]), &device);
        let loss = fused::cross_entropy(h.reshape([rows, 29]), targets, Some(0.05));
        let grads = loss.clone().backward();
        let conv = conv_layer([4, 6], [3, 3], [1, 1], PaddingConfig2d::Explicit(1, 1, 1, 1), true, &device);
        // 40 images of 8x8: more than one block (4 images) and one group of blocks.
        let images = random([40, 4, 8, 8], 32, &device).require_grad();
        let conv_grads = fused::conv2d(&conv, images.clone()).powf_scalar(2.0).sum().backward();
        let (w, b) =
            (conv.weight.val().grad(&conv_grads).unwrap(), conv.bias.as_ref().unwrap().val().grad(&conv_grads));
        let mut conv_parts = vec![values(images.grad(&conv_grads).unwrap()), values(w), values(b.unwrap())];
        // 16 channels of 16 x 16: the shifted products.
        let wide = conv_layer([16, 8], [3, 3], [1, 1], PaddingConfig2d::Explicit(1, 1, 1, 1), true, &device);
        let planes = random([20, 16, 16, 16], 37, &device).require_grad();
        let wide_grads = fused::conv2d(&wide, planes.clone()).powf_scalar(2.0).sum().backward();
        conv_parts.push(values(planes.grad(&wide_grads).unwrap()));
        conv_parts.push(values(wide.weight.val().grad(&wide_grads).unwrap()));
        let bn = bn_layer(4, &device);
        let bn_grads = fused::batch_norm(&bn, images.clone().detach().require_grad()).powf_scalar(2.0).sum();
        let bn_grads = bn_grads.backward();
        let bn_parts = [values(bn.gamma.val().grad(&bn_grads).unwrap()), values(bn.running_var.value())];
        // The medium GPT's MLP layer (2048 rows x 256 x 1024): gemm splits it over the pool.
        let mut layer = LinearConfig::new(256, 1024).init(&device);
        layer.weight = Param::from_tensor(random([256, 1024], 33, &device));
        layer.bias = Some(Param::from_tensor(random([1024], 36, &device)));
        let rows = random([16, 128, 256], 34, &device).require_grad();
        let lin = fused::linear(&layer, rows.clone()).powf_scalar(2.0).sum().backward();
        let bias_grad = values(layer.bias.as_ref().unwrap().val().grad(&lin).unwrap());
        let linear_parts =
            [values(rows.grad(&lin).unwrap()), values(layer.weight.val().grad(&lin).unwrap()), bias_grad];
        [vec![values(loss), values(x.grad(&grads).unwrap()), values(gamma.grad(&grads).unwrap())], conv_parts]
            .concat()
            .into_iter()
            .chain(bn_parts)
            .chain(linear_parts)
            .collect()
    })
}

#[test]
fn fused_ops_give_the_same_bits_at_one_and_two_threads() {
    let (one, two) = (all_ops_in_pool(1), all_ops_in_pool(2));
    assert_eq!(one.len(), two.len());
    for (part, (a, b)) in one.iter().zip(&two).enumerate() {
        let differs = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differs, 0, "part {part}: {differs} of {} values differ between 1 and 2 threads", a.len());
    }
}
