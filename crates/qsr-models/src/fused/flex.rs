//! [`FusedOps`] on flex (the kernels on the tensors' buffers) and on autodiff over flex (one graph
//! node per op, with the backward in `kernels`).

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Shape, TensorData};

use super::{FusedOps, kernels};

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
        for (node, grad, shape) in
            [(x_node, dx, shape(&x)), (gamma_node, dgamma, shape(&gamma)), (beta_node, dbeta, shape(&gamma))]
        {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, from_vec(grad, shape));
            }
        }
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
}
