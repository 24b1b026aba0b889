//! [`FusedOps`] on flex (the kernels on the tensors' buffers) and on autodiff over flex (one graph
//! node per op, with the backward in `kernels`).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Shape, TensorData};

use super::FusedOps;
use super::batch_norm::{self, BnShape};
use super::conv::{self, ConvShape};
use super::kernels::{self, Heads};
use super::linear::{self, LinearShape};
use super::pool::{self, PoolShape};

/// `tensor` as one contiguous `f32` buffer covering exactly its elements.
fn contiguous(tensor: &FlexTensor) -> FlexTensor {
    assert_eq!(tensor.dtype(), DType::F32, "the fused ops take f32 tensors");
    tensor.to_contiguous()
}

fn shape(tensor: &FlexTensor) -> Shape {
    tensor.layout().shape().clone()
}

fn last_dim(tensor: &FlexTensor) -> usize {
    let shape = shape(tensor);
    shape[shape.num_dims() - 1]
}

fn from_vec(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Class ids as indices, each checked against the `classes` of the logits.
fn class_ids(targets: IntTensor<Flex>, classes: usize) -> Vec<usize> {
    let data = targets.into_data();
    data.iter::<i64>()
        .enumerate()
        .map(|(row, t)| match usize::try_from(t) {
            Ok(t) if t < classes => t,
            _ => panic!("cross_entropy: target {t} of row {row} is not a class id below {classes}"),
        })
        .collect()
}

fn layer_norm_with_stats(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    epsilon: f32,
) -> (FlexTensor, Vec<f32>) {
    let (xs, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let (out, stats) = kernels::layer_norm(xs.storage(), gamma.storage(), beta.storage(), epsilon);
    (from_vec(out, shape(x)), stats)
}

/// The logits, their class ids, the loss and each row's log-sum-exp.
fn cross_entropy_parts(
    logits: FlexTensor,
    targets: IntTensor<Flex>,
    smoothing: f32,
) -> (FlexTensor, Vec<usize>, f32, Vec<f32>) {
    let logits = contiguous(&logits);
    let classes = last_dim(&logits);
    let targets = class_ids(targets, classes);
    let (loss, lse) = kernels::cross_entropy(logits.storage(), &targets, classes, smoothing);
    (logits, targets, loss, lse)
}

/// What causal attention's backward needs: q, k, v (`[b, h, t, d]`), the attention weights, the head
/// layout and the scores' scale.
#[derive(Clone, Debug)]
struct Attention {
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    weights: FlexTensor,
    heads: Heads,
    scale: f32,
}

/// `parts` head-major tensors `[b, h, t, d]` from rows `[b, t, parts * h * d]`.
fn split_heads(x: &FlexTensor, heads: Heads, parts: usize) -> Vec<FlexTensor> {
    let [b, t, h, d] = heads;
    let x = contiguous(x);
    kernels::split_heads(x.storage(), heads, parts)
        .into_iter()
        .map(|v| from_vec(v, Shape::from([b, h, t, d])))
        .collect()
}

/// Rows `[b, t, parts * h * d]` from head-major tensors.
fn merge_heads(parts: &[FlexTensor], heads: Heads) -> FlexTensor {
    let [b, t, h, d] = heads;
    let parts: Vec<FlexTensor> = parts.iter().map(contiguous).collect();
    let slices: Vec<&[f32]> = parts.iter().map(|p| p.storage()).collect();
    from_vec(kernels::merge_heads(&slices, heads), Shape::from([b, t, parts.len() * h * d]))
}

fn transposed(x: FlexTensor) -> FlexTensor {
    Flex::float_swap_dims(x, 2, 3)
}

/// The output `[b, t, width]` of causal attention over `qkv` `[b, t, 3 width]`, and its saved parts.
fn attention_forward(qkv: &FlexTensor, heads: usize) -> (FlexTensor, Attention) {
    let [b, t, w3] = [0, 1, 2].map(|i| shape(qkv)[i]);
    let layout = [b, t, heads, w3 / 3 / heads];
    let scale = (layout[3] as f32).powf(-0.5);
    let [q, k, v]: [FlexTensor; 3] = split_heads(qkv, layout, 3).try_into().expect("three parts");
    let scores = Flex::float_matmul(q.clone(), transposed(k.clone()));
    let weights = <Flex as FusedOps>::causal_softmax(scores, scale);
    let out = merge_heads(&[Flex::float_matmul(weights.clone(), v.clone())], layout);
    (out, Attention { q, k, v, weights, heads: layout, scale })
}

/// The geometry of `x` `[n, cin, h, w]` convolved by `weight` `[cout, cin, kh, kw]`.
fn conv_shape(x: &FlexTensor, weight: &FlexTensor, stride: [usize; 2], padding: [usize; 4]) -> ConvShape {
    let ([n, cin, h, w], [cout, _, kh, kw]) =
        ([0, 1, 2, 3].map(|i| shape(x)[i]), [0, 1, 2, 3].map(|i| shape(weight)[i]));
    ConvShape { n, cin, h, w, cout, kernel: [kh, kw], stride, padding }
}

/// The convolution's output and its contiguous input and weight (what the backward needs).
fn conv2d_forward(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: &FlexTensor,
    stride: [usize; 2],
    padding: [usize; 4],
) -> (FlexTensor, Layer<ConvShape>) {
    let s = conv_shape(x, weight, stride, padding);
    let (x, weight, bias) = (contiguous(x), contiguous(weight), contiguous(bias));
    let out = conv::conv2d(x.storage(), weight.storage(), bias.storage(), &s);
    let [ho, wo] = s.out_hw();
    (from_vec(out, Shape::from([s.n, s.cout, ho, wo])), Layer { x, weight, shape: s })
}

/// The layer's output `[rows, d_output]` and its contiguous input and weight (what the backward needs).
fn linear_forward(x: &FlexTensor, weight: &FlexTensor, bias: &FlexTensor) -> (FlexTensor, Layer<LinearShape>) {
    let (x, weight, bias) = (contiguous(x), contiguous(weight), contiguous(bias));
    let s = LinearShape { rows: shape(&x)[0], d_input: shape(&x)[1], d_output: shape(&weight)[1] };
    let y = linear::forward(x.storage(), weight.storage(), bias.storage(), s);
    (from_vec(y, Shape::from([s.rows, s.d_output])), Layer { x, weight, shape: s })
}

/// The pooled output of `x` `[n, c, h, w]`, each window's argmax, and the pooling's geometry.
fn max_pool_forward(x: &FlexTensor, kernel: [usize; 2]) -> (FlexTensor, (Vec<u32>, PoolShape)) {
    let x = contiguous(x);
    let [n, c, h, w] = [0, 1, 2, 3].map(|i| shape(&x)[i]);
    let s = PoolShape { planes: n * c, h, w, k: kernel };
    let (out, arg) = pool::max_pool(x.storage(), s);
    let [ho, wo] = s.out_hw();
    (from_vec(out, Shape::from([n, c, ho, wo])), (arg, s))
}

/// The layout of `x` `[n, c, ..]` as batch norm sees it.
fn bn_shape(x: &FlexTensor) -> BnShape {
    let dims = shape(x);
    let (n, c) = (dims[0], dims[1]);
    BnShape { n, c, plane: dims.num_elements() / (n * c).max(1) }
}

fn batch_norm_forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    stats: &FlexTensor,
    epsilon: f32,
) -> (FlexTensor, Bn) {
    let (x, gamma, beta, stats) = (contiguous(x), contiguous(gamma), contiguous(beta), contiguous(stats));
    let s = bn_shape(&x);
    let out = batch_norm::apply(x.storage(), gamma.storage(), beta.storage(), stats.storage(), epsilon, s);
    (from_vec(out, shape(&x)), Bn { x, gamma, stats, epsilon })
}

/// What batch norm's backward needs: the contiguous input, gamma, the batch's statistics, epsilon.
#[derive(Clone, Debug)]
struct Bn {
    x: FlexTensor,
    gamma: FlexTensor,
    stats: FlexTensor,
    epsilon: f32,
}

/// A layer of an input, a weight and a bias (convolution, linear) as its backward needs it: the
/// contiguous input and weight, and the geometry, whose kernels give the three gradients.
#[derive(Clone, Debug)]
struct Layer<S> {
    x: FlexTensor,
    weight: FlexTensor,
    shape: S,
}

/// The geometry of a [`Layer`]: its backward kernel and its bias's length.
trait LayerShape: Copy + std::fmt::Debug + Send + Sync + 'static {
    /// The gradients of the input (when `need_dx`), the weight and the bias.
    fn backward(&self, x: &[f32], weight: &[f32], g: &[f32], need_dx: bool) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>);
    /// The bias's length.
    fn outputs(&self) -> usize;
}

impl LayerShape for ConvShape {
    fn backward(&self, x: &[f32], weight: &[f32], g: &[f32], need_dx: bool) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
        conv::conv2d_backward(x, weight, g, self, need_dx)
    }

    fn outputs(&self) -> usize {
        self.cout
    }
}

impl LayerShape for LinearShape {
    fn backward(&self, x: &[f32], weight: &[f32], g: &[f32], need_dx: bool) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
        linear::backward(x, weight, g, *self, need_dx)
    }

    fn outputs(&self) -> usize {
        self.d_output
    }
}

impl FusedOps for Flex {
    fn causal_softmax(scores: FlexTensor, scale: f32) -> FlexTensor {
        let scores = contiguous(&scores);
        let out = kernels::causal_softmax(scores.storage(), last_dim(&scores), scale);
        from_vec(out, shape(&scores))
    }

    fn layer_norm(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, epsilon: f32) -> FlexTensor {
        layer_norm_with_stats(&x, &gamma, &beta, epsilon).0
    }

    fn cross_entropy(logits: FlexTensor, targets: IntTensor<Flex>, smoothing: f32) -> FlexTensor {
        let (_, _, loss, _) = cross_entropy_parts(logits, targets, smoothing);
        from_vec(vec![loss], Shape::from([1]))
    }

    fn gelu(x: FlexTensor) -> FlexTensor {
        let x = contiguous(&x);
        from_vec(kernels::gelu(x.storage()).0, shape(&x))
    }

    fn causal_attention(qkv: FlexTensor, heads: usize) -> FlexTensor {
        attention_forward(&qkv, heads).0
    }

    fn linear(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
        linear_forward(&x, &weight, &bias).0
    }

    fn conv2d(
        x: FlexTensor,
        weight: FlexTensor,
        bias: FlexTensor,
        stride: [usize; 2],
        padding: [usize; 4],
    ) -> FlexTensor {
        conv2d_forward(&x, &weight, &bias, stride, padding).0
    }

    fn max_pool2d(x: FlexTensor, kernel: [usize; 2]) -> FlexTensor {
        max_pool_forward(&x, kernel).0
    }

    fn batch_norm_stats(x: FlexTensor) -> FlexTensor {
        let x = contiguous(&x);
        let s = bn_shape(&x);
        from_vec(batch_norm::stats(x.storage(), s), Shape::from([2, s.c]))
    }

    fn batch_norm(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, stats: FlexTensor, epsilon: f32) -> FlexTensor {
        batch_norm_forward(&x, &gamma, &beta, &stats, epsilon).0
    }
}

#[derive(Debug)]
struct BatchNormBackward;

impl Backward<Flex, 3> for BatchNormBackward {
    type State = Bn;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, gamma_node, beta_node] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let Bn { x, gamma, stats, epsilon } = ops.state;
        let s = bn_shape(&x);
        let (dx, dgamma, dbeta) =
            batch_norm::backward(x.storage(), gamma.storage(), stats.storage(), epsilon, g.storage(), s);
        let gamma_shape = shape(&gamma);
        register_norm_grads(
            grads,
            [x_node, gamma_node, beta_node].map(|n| n.map(|n| n.id)),
            [dx, dgamma, dbeta],
            [shape(&x), gamma_shape],
        );
    }
}

/// Registers a normalization's gradients of the input, gamma and beta (shaped as gamma) for the
/// parents that are tracked.
fn register_norm_grads(
    grads: &mut Gradients,
    nodes: [Option<NodeId>; 3],
    values: [Vec<f32>; 3],
    [x_shape, gamma_shape]: [Shape; 2],
) {
    let shapes = [x_shape, gamma_shape.clone(), gamma_shape];
    for ((node, grad), shape) in nodes.into_iter().zip(values).zip(shapes) {
        if let Some(id) = node {
            grads.register::<Flex>(id, from_vec(grad, shape));
        }
    }
}

#[derive(Debug)]
struct MaxPoolBackward;

impl Backward<Flex, 1> for MaxPoolBackward {
    /// Each window's argmax within its plane, and the geometry.
    type State = (Vec<u32>, PoolShape);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let Some(parent) = parent else { return };
        let (arg, s) = ops.state;
        let dx = pool::max_pool_backward(g.storage(), &arg, s);
        let n = shape(&g)[0];
        grads.register::<Flex>(parent.id, from_vec(dx, Shape::from([n, s.planes / n.max(1), s.h, s.w])));
    }
}

/// The statistics are constants to autodiff: their dependence on the input is in batch norm's backward.
#[derive(Debug)]
struct BatchNormStatsBackward;

impl Backward<Flex, 1> for BatchNormStatsBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        grads.consume::<Flex>(&ops.node);
    }
}

/// The backward of a [`Layer`] of geometry `S`.
#[derive(Debug)]
struct LayerBackward<S>(std::marker::PhantomData<S>);

impl<S: LayerShape> Backward<Flex, 3> for LayerBackward<S> {
    type State = Layer<S>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, weight_node, bias_node] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let Layer { x, weight, shape: s } = ops.state;
        let (dx, dw, db) = s.backward(x.storage(), weight.storage(), g.storage(), x_node.is_some());
        let shapes = [shape(&x), shape(&weight), Shape::from([s.outputs()])];
        let values = [dx, Some(dw), Some(db)];
        for ((node, value), shape) in [x_node, weight_node, bias_node].into_iter().zip(values).zip(shapes) {
            if let (Some(node), Some(value)) = (node, value) {
                grads.register::<Flex>(node.id, from_vec(value, shape));
            }
        }
    }
}

#[derive(Debug)]
struct CausalSoftmaxBackward;

impl Backward<Flex, 1> for CausalSoftmaxBackward {
    /// The op's output and its scale.
    type State = (FlexTensor, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let Some(parent) = parent else { return };
        let (y, scale) = ops.state;
        let dx = kernels::causal_softmax_backward(y.storage(), g.storage(), last_dim(&y), scale);
        grads.register::<Flex>(parent.id, from_vec(dx, shape(&y)));
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl Backward<Flex, 3> for LayerNormBackward {
    /// The contiguous input, gamma and each row's mean and reciprocal standard deviation.
    type State = (FlexTensor, FlexTensor, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, gamma_node, beta_node] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let (x, gamma, stats) = ops.state;
        let (dx, dgamma, dbeta) = kernels::layer_norm_backward(x.storage(), gamma.storage(), &stats, g.storage());
        let gamma_shape = shape(&gamma);
        register_norm_grads(
            grads,
            [x_node, gamma_node, beta_node].map(|n| n.map(|n| n.id)),
            [dx, dgamma, dbeta],
            [shape(&x), gamma_shape],
        );
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<Flex, 1> for CrossEntropyBackward {
    /// The contiguous logits, the class ids, each row's log-sum-exp and the smoothing.
    type State = (FlexTensor, Vec<usize>, Vec<f32>, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let Some(parent) = parent else { return };
        let (logits, targets, lse, smoothing) = ops.state;
        let classes = last_dim(&logits);
        let dx = kernels::cross_entropy_backward(logits.storage(), &targets, &lse, classes, smoothing, g.storage()[0]);
        grads.register::<Flex>(parent.id, from_vec(dx, shape(&logits)));
    }
}

#[derive(Debug)]
struct GeluBackward;

impl Backward<Flex, 1> for GeluBackward {
    /// The contiguous input and its normal cdf.
    type State = (FlexTensor, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let g = contiguous(&grads.consume::<Flex>(&ops.node));
        let Some(parent) = parent else { return };
        let (x, cdf) = ops.state;
        grads.register::<Flex>(parent.id, from_vec(kernels::gelu_backward(x.storage(), &cdf, g.storage()), shape(&x)));
    }
}

#[derive(Debug)]
struct CausalAttentionBackward;

impl Backward<Flex, 1> for CausalAttentionBackward {
    type State = Attention;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let g = grads.consume::<Flex>(&ops.node);
        let Some(parent) = parent else { return };
        let Attention { q, k, v, weights, heads, scale } = ops.state;
        let [d_out] = split_heads(&g, heads, 1).try_into().expect("one part");
        let d_weights = contiguous(&Flex::float_matmul(d_out.clone(), transposed(v)));
        let d_v = Flex::float_matmul(transposed(weights.clone()), d_out);
        let d_scores = kernels::causal_softmax_backward(weights.storage(), d_weights.storage(), heads[1], scale);
        let d_scores = from_vec(d_scores, shape(&weights));
        let d_q = Flex::float_matmul(d_scores.clone(), k);
        let d_k = Flex::float_matmul(transposed(d_scores), q);
        grads.register::<Flex>(parent.id, merge_heads(&[d_q, d_k, d_v], heads));
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Flex, C> {
    fn causal_softmax(scores: FloatTensor<Self>, scale: f32) -> FloatTensor<Self> {
        match CausalSoftmaxBackward.prepare::<C>([scores.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = Flex::causal_softmax(scores.into_primitive(), scale);
                prep.finish((y.clone(), scale), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::causal_softmax(scores.into_primitive(), scale)),
        }
    }

    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), gamma.node(), beta.node()];
        let (x, gamma, beta) = (x.into_primitive(), gamma.into_primitive(), beta.into_primitive());
        match LayerNormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, stats) = layer_norm_with_stats(&x, &gamma, &beta, epsilon);
                prep.finish((contiguous(&x), contiguous(&gamma), stats), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(<Flex as FusedOps>::layer_norm(x, gamma, beta, epsilon)),
        }
    }

    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>, smoothing: f32) -> FloatTensor<Self> {
        match CrossEntropyBackward.prepare::<C>([logits.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (logits, targets, loss, lse) = cross_entropy_parts(logits.into_primitive(), targets, smoothing);
                prep.finish((logits, targets, lse, smoothing), from_vec(vec![loss], Shape::from([1])))
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::cross_entropy(logits.into_primitive(), targets, smoothing)),
        }
    }

    fn gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let x = contiguous(&x.into_primitive());
                let (out, cdf) = kernels::gelu(x.storage());
                let out = from_vec(out, shape(&x));
                prep.finish((x, cdf), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(<Flex as FusedOps>::gelu(x.into_primitive())),
        }
    }

    fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
        match CausalAttentionBackward.prepare::<C>([qkv.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, saved) = attention_forward(&qkv.into_primitive(), heads);
                prep.finish(saved, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(attention_forward(&qkv.into_primitive(), heads).0),
        }
    }

    fn linear(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node(), bias.node()];
        let (x, weight, bias) = (x.into_primitive(), weight.into_primitive(), bias.into_primitive());
        let (out, saved) = linear_forward(&x, &weight, &bias);
        match LayerBackward::<LinearShape>(Default::default()).prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(saved, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        stride: [usize; 2],
        padding: [usize; 4],
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node(), bias.node()];
        let (x, weight, bias) = (x.into_primitive(), weight.into_primitive(), bias.into_primitive());
        let (out, saved) = conv2d_forward(&x, &weight, &bias, stride, padding);
        match LayerBackward::<ConvShape>(Default::default()).prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(saved, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn max_pool2d(x: FloatTensor<Self>, kernel: [usize; 2]) -> FloatTensor<Self> {
        let node = x.node();
        let (out, saved) = max_pool_forward(&x.into_primitive(), kernel);
        match MaxPoolBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(saved, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn batch_norm_stats(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let node = x.node();
        let stats = <Flex as FusedOps>::batch_norm_stats(x.into_primitive());
        match BatchNormStatsBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), stats),
            OpsKind::UnTracked(prep) => prep.finish(stats),
        }
    }

    fn batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), gamma.node(), beta.node()];
        let (x, gamma, beta) = (x.into_primitive(), gamma.into_primitive(), beta.into_primitive());
        let (out, saved) = batch_norm_forward(&x, &gamma, &beta, &stats.into_primitive(), epsilon);
        match BatchNormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(saved, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}
