//! Flat parameter buffers <-> burn modules.
//!
//! A worker's trainable parameters live in one `Vec<f32>` (the master copy the optimizer updates and the
//! collective averages); the burn module is refreshed from it after every update. The order is the
//! module's visit order (field declaration order, depth first: PyTorch's `named_parameters` order),
//! which is identical on every worker because every worker builds the same module type.
//!
//! Running statistics (BatchNorm's `running_mean` / `running_var`) are visited by burn through the same
//! hooks as parameters; they are told apart by their field name (`running_*`) and kept in a separate
//! buffer, never touched by the optimizer. burn's `RunningState` is shared between clones of a module
//! and buffers each thread's latest update until synced (its own multi-thread data parallelism); reads
//! and writes here sync first, and [`crate::Worker`] detaches its replica so workers never share state.

use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Gradients, Tensor, TensorData};

use crate::error::OptimError;
use crate::muon::MuonMatrix;

/// What a parameter is, for weight-decay exclusion and state handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamRole {
    /// Any other trainable tensor (a linear or convolution weight, an embedding): always decayed.
    Weight,
    /// A bias (`bias`, or a norm's `beta`).
    Bias,
    /// A normalization scale (`gamma` / `weight` inside a `*Norm` module).
    Norm,
    /// An embedding table (`weight` inside an `Embedding`, e.g. a GPT's token and position tables).
    Embedding,
    /// A running statistic: not trainable.
    Running,
}

/// One tensor's place in a flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamEntry {
    /// Dotted module path, e.g. `layer1.0.bn1.gamma`.
    pub path: String,
    /// The tensor's shape as burn stores it (burn's `Linear` weight is `[d_input, d_output]`, the
    /// transpose of PyTorch's); its product is `range.len()`.
    pub shape: Vec<usize>,
    /// The tensor's elements in the flat buffer (the trainable one, or the running-statistics one for
    /// [`ParamRole::Running`]), row-major.
    pub range: Range<usize>,
    /// What the tensor is, from its field name and its module's type.
    pub role: ParamRole,
}

/// Where every trainable parameter and running statistic of a module lives in the flat buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamLayout {
    /// The trainable tensors in visit order; their ranges tile `0..len()` of the parameter buffer.
    pub trainable: Vec<ParamEntry>,
    /// The running statistics ([`ParamRole::Running`]) in visit order; their ranges tile
    /// `0..running_len()` of a separate buffer.
    pub running: Vec<ParamEntry>,
}

fn role(stack: &[(String, String)]) -> ParamRole {
    let Some((name, container)) = stack.last() else { return ParamRole::Weight };
    if name.starts_with("running_") {
        ParamRole::Running
    } else if name == "bias" || name == "beta" {
        ParamRole::Bias
    } else if container.contains("Norm") {
        ParamRole::Norm
    } else if container.contains("Embedding") {
        ParamRole::Embedding
    } else {
        ParamRole::Weight
    }
}

fn path(stack: &[(String, String)]) -> String {
    stack.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(".")
}

#[derive(Default)]
struct LayoutVisitor {
    stack: Vec<(String, String)>,
    layout: Option<ParamLayout>,
    trainable_len: usize,
    running_len: usize,
}

impl ModuleVisitor for LayoutVisitor {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.lazy_shape().to_vec();
        let n: usize = shape.iter().product();
        let role = role(&self.stack);
        let layout = self.layout.get_or_insert_with(|| ParamLayout { trainable: Vec::new(), running: Vec::new() });
        let (list, len) = if role == ParamRole::Running {
            (&mut layout.running, &mut self.running_len)
        } else {
            (&mut layout.trainable, &mut self.trainable_len)
        };
        list.push(ParamEntry { path: path(&self.stack), shape, range: *len..*len + n, role });
        *len += n;
    }
}

impl ParamLayout {
    /// The layout of `module`'s float tensors.
    pub fn of<M: Module>(module: &M) -> Self {
        let mut v = LayoutVisitor::default();
        module.visit(&mut v);
        v.layout.unwrap_or(ParamLayout { trainable: Vec::new(), running: Vec::new() })
    }

    /// Number of trainable parameters.
    pub fn len(&self) -> usize {
        self.trainable.last().map_or(0, |e| e.range.end)
    }

    /// Whether the module has no trainable parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of running-statistic elements.
    pub fn running_len(&self) -> usize {
        self.running.last().map_or(0, |e| e.range.end)
    }

    /// Ranges that `exclude_norm_and_bias` exempts from weight decay: biases, normalization scales and
    /// embedding tables (nanoGPT's rule decays every 2-D tensor, embeddings included; GPT-style
    /// recipes that exclude norms usually exclude embeddings too, and a tied LM head is the embedding).
    pub fn no_decay_ranges(&self) -> Vec<Range<usize>> {
        self.trainable
            .iter()
            .filter(|e| matches!(e.role, ParamRole::Bias | ParamRole::Norm | ParamRole::Embedding))
            .map(|e| e.range.clone())
            .collect()
    }

    /// The matrices `optimizer.kind = "muon"` updates with Muon: every weight of two or more dimensions
    /// (burn's Linear weights `[d_input, d_output]`, convolution kernels `[out, in, k...]` viewed as
    /// `out x (in k...)` as Keller Jordan's Muon views them) but the output head; embeddings, norms and
    /// biases are not weights. AdamW updates the rest, as torch's Muon guidance says. The head is the
    /// model's last weight, unless the model has an embedding table: then the head is taken to be
    /// tied to it (qsr's GPT), and every weight matrix is a hidden one.
    pub fn muon_matrices(&self) -> Vec<MuonMatrix> {
        let weights: Vec<&ParamEntry> =
            self.trainable.iter().filter(|e| e.role == ParamRole::Weight && e.shape.len() >= 2).collect();
        let tied = self.trainable.iter().any(|e| e.role == ParamRole::Embedding);
        let hidden = if tied { &weights[..] } else { &weights[..weights.len().saturating_sub(1)] };
        hidden
            .iter()
            .map(|e| {
                let (rows, cols) = (e.shape[0], e.shape[1..].iter().product());
                // A Linear weight is stored transposed to torch's (fan_out, fan_in); a kernel is not.
                let (fan_out, fan_in) = if e.shape.len() == 2 { (cols, rows) } else { (rows, cols) };
                MuonMatrix { range: e.range.clone(), rows, cols, fan_out, fan_in }
            })
            .collect()
    }

    /// Copies the trainable parameters of `module` into `out`.
    pub fn read_params<M: Module>(&self, module: &M, out: &mut [f32]) -> Result<(), OptimError> {
        self.read(module, out, Source::Params, false)
    }

    /// Copies the running statistics of `module` into `out`.
    pub fn read_running<M: Module>(&self, module: &M, out: &mut [f32]) -> Result<(), OptimError> {
        // burn keeps a BatchNorm's latest update in a per-thread slot until the state is synced;
        // `valid()` syncs it (the returned snapshot holds the current values).
        self.read(&module.valid(), out, Source::Params, true)
    }

    /// Moves the gradients of `module`'s trainable parameters out of `grads` into `out` (zero where a
    /// parameter took no part in the loss). Removing them lets the backend hand over its buffer without a
    /// copy where it can.
    pub fn read_grads<M: Module>(&self, module: &M, grads: &mut Gradients, out: &mut [f32]) -> Result<(), OptimError> {
        self.read(module, out, Source::Grads(grads), false)
    }

    /// Copies the gradients in `grads` (burn's optimizer input, keyed by parameter id) of `module`'s
    /// trainable parameters into `out` (zero where `grads` has none), leaving `grads` as it is.
    pub fn read_grads_params<M: Module>(
        &self,
        module: &M,
        grads: &GradientsParams,
        out: &mut [f32],
    ) -> Result<(), OptimError> {
        self.read(module, out, Source::GradsParams(grads), false)
    }

    /// Replaces each gradient in `grads` of `module`'s trainable parameters with its slice of `src`
    /// (parameters without a gradient stay without one).
    pub fn write_grads_params<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
        src: &[f32],
    ) -> Result<(), OptimError> {
        if src.len() != self.len() {
            return Err(OptimError::Layout(format!("buffer of {} elements for a layout of {}", src.len(), self.len())));
        }
        let mut v = GradsParamsWriter { stack: Vec::new(), src, grads, offset: 0 };
        module.visit(&mut v);
        if v.offset != self.len() {
            return Err(OptimError::Layout(format!("module has {} elements, layout {}", v.offset, self.len())));
        }
        Ok(())
    }

    fn read<M: Module>(
        &self,
        module: &M,
        out: &mut [f32],
        source: Source<'_>,
        running: bool,
    ) -> Result<(), OptimError> {
        let want = if running { self.running_len() } else { self.len() };
        if out.len() != want {
            return Err(OptimError::Layout(format!("buffer of {} elements for a layout of {want}", out.len())));
        }
        let mut v = ReadVisitor { stack: Vec::new(), out, source, running, offset: 0, error: None };
        module.visit(&mut v);
        if let Some(e) = v.error {
            return Err(e);
        }
        if v.offset != want {
            return Err(OptimError::Layout(format!("module has {} elements, layout {want}", v.offset)));
        }
        Ok(())
    }

    /// Replaces `module`'s trainable parameters with `src` (keeping ids and gradient tracking).
    pub fn write_params<M: Module>(&self, module: M, src: &[f32]) -> Result<M, OptimError> {
        self.write(module, src, false)
    }

    /// Replaces `module`'s running statistics with `src`.
    pub fn write_running<M: Module>(&self, module: M, src: &[f32]) -> Result<M, OptimError> {
        // Flush pending per-thread updates first, or the next forward pass would merge them back in.
        let _ = module.valid();
        self.write(module, src, true)
    }

    fn write<M: Module>(&self, module: M, src: &[f32], running: bool) -> Result<M, OptimError> {
        let want = if running { self.running_len() } else { self.len() };
        if src.len() != want {
            return Err(OptimError::Layout(format!("buffer of {} elements for a layout of {want}", src.len())));
        }
        let mut m = WriteMapper { stack: Vec::new(), src, running, offset: 0 };
        let module = module.map(&mut m);
        if m.offset != want {
            return Err(OptimError::Layout(format!("module has {} elements, layout {want}", m.offset)));
        }
        Ok(module)
    }
}

/// Device-resident flat buffers (see [`Residency::Device`](crate::Residency::Device)): the same layout as one burn tensor.
impl ParamLayout {
    /// The trainable parameters of `module` as one flat tensor on `device` (the module's device
    /// without autodiff): one concatenation, no host copy.
    pub fn params_tensor<M: Module>(&self, module: &M, device: &Device) -> Result<Tensor<1>, OptimError> {
        self.collect(module, None, device)
    }

    /// Moves the gradients of `module`'s trainable parameters out of `grads` into one flat tensor
    /// (zeros where a parameter took no part in the loss).
    pub fn grads_tensor<M: Module>(
        &self,
        module: &M,
        grads: &mut Gradients,
        device: &Device,
    ) -> Result<Tensor<1>, OptimError> {
        self.collect(module, Some(grads), device)
    }

    fn collect<M: Module>(
        &self,
        module: &M,
        grads: Option<&mut Gradients>,
        device: &Device,
    ) -> Result<Tensor<1>, OptimError> {
        let mut v = CollectVisitor { stack: Vec::new(), grads, parts: Vec::new(), offset: 0, device: device.clone() };
        module.visit(&mut v);
        if v.offset != self.len() {
            return Err(OptimError::Layout(format!("module has {} elements, layout {}", v.offset, self.len())));
        }
        if v.parts.is_empty() {
            return Ok(Tensor::<1>::zeros([0], device));
        }
        Ok(Tensor::cat(v.parts, 0))
    }

    /// Replaces `module`'s trainable parameters with slices of `flat` (keeping ids and gradient
    /// tracking); on a cubecl backend the slices are views of `flat`'s buffer.
    pub fn write_params_tensor<M: Module>(&self, module: M, flat: &Tensor<1>) -> Result<M, OptimError> {
        let n = flat.dims()[0];
        if n != self.len() {
            return Err(OptimError::Layout(format!("flat tensor of {n} elements for a layout of {}", self.len())));
        }
        let mut m = WriteTensorMapper { stack: Vec::new(), flat, offset: 0 };
        let module = module.map(&mut m);
        if m.offset != n {
            return Err(OptimError::Layout(format!("module has {} elements, layout {n}", m.offset)));
        }
        Ok(module)
    }
}

struct CollectVisitor<'a> {
    stack: Vec<(String, String)>,
    grads: Option<&'a mut Gradients>,
    parts: Vec<Tensor<1>>,
    offset: usize,
    device: Device,
}

impl ModuleVisitor for CollectVisitor<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if role(&self.stack) == ParamRole::Running {
            return;
        }
        let n = param.lazy_shape().num_elements();
        self.offset += n;
        let t = match &mut self.grads {
            None => Some(param.val().inner()),
            Some(g) => param.val().grad_remove(g).map(Tensor::inner),
        };
        self.parts.push(match t {
            Some(t) => t.reshape([n]),
            None => Tensor::<1>::zeros([n], &self.device),
        });
    }
}

struct WriteTensorMapper<'a> {
    stack: Vec<(String, String)>,
    flat: &'a Tensor<1>,
    offset: usize,
}

impl ModuleMapper for WriteTensorMapper<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if role(&self.stack) == ParamRole::Running {
            return param;
        }
        let n = param.lazy_shape().num_elements();
        let start = self.offset;
        self.offset += n;
        if start + n > self.flat.dims()[0] {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let autodiff = tensor.is_autodiff();
        let require_grad = tensor.is_require_grad();
        let mut fresh: Tensor<D> = self.flat.clone().narrow(0, start, n).reshape(tensor.shape());
        if autodiff {
            fresh = fresh.autodiff();
        }
        if require_grad {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

enum Source<'a> {
    Params,
    Grads(&'a mut Gradients),
    GradsParams(&'a GradientsParams),
}

struct ReadVisitor<'a> {
    stack: Vec<(String, String)>,
    out: &'a mut [f32],
    source: Source<'a>,
    running: bool,
    offset: usize,
    error: Option<OptimError>,
}

impl ModuleVisitor for ReadVisitor<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if (role(&self.stack) == ParamRole::Running) != self.running || self.error.is_some() {
            return;
        }
        let n = param.lazy_shape().num_elements();
        let range = self.offset..self.offset + n;
        self.offset += n;
        let Some(dst) = self.out.get_mut(range) else {
            self.error = Some(OptimError::Layout(format!("`{}` lies beyond the buffer", path(&self.stack))));
            return;
        };
        let tensor = match &mut self.source {
            Source::Params => Some(param.val()),
            Source::Grads(g) => param.val().grad_remove(g),
            Source::GradsParams(g) => g.get::<D>(param.id),
        };
        match tensor {
            None => dst.fill(0.0),
            Some(t) => {
                let data = t.into_data();
                match data.as_slice::<f32>() {
                    Ok(s) if s.len() == n => dst.copy_from_slice(s),
                    Ok(s) => {
                        self.error = Some(OptimError::Layout(format!(
                            "`{}` has {} elements, expected {n}",
                            path(&self.stack),
                            s.len()
                        )))
                    }
                    // Another float type (f16/bf16 weights): convert element by element.
                    Err(_) => match data.convert::<f32>().as_slice::<f32>() {
                        Ok(s) if s.len() == n => dst.copy_from_slice(s),
                        _ => {
                            self.error =
                                Some(OptimError::Layout(format!("`{}` is not readable as f32", path(&self.stack))))
                        }
                    },
                }
            }
        }
    }
}

struct WriteMapper<'a> {
    stack: Vec<(String, String)>,
    src: &'a [f32],
    running: bool,
    offset: usize,
}

impl ModuleMapper for WriteMapper<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if (role(&self.stack) == ParamRole::Running) != self.running {
            return param;
        }
        let n = param.lazy_shape().num_elements();
        let range = self.offset..self.offset + n;
        self.offset += n;
        let Some(values) = self.src.get(range) else { return param };
        let (id, tensor, mapper) = param.consume();
        let device = tensor.device();
        let require_grad = tensor.is_require_grad();
        let mut fresh = Tensor::<D>::from_data(TensorData::new(values.to_vec(), tensor.shape()), &device);
        if require_grad {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

struct GradsParamsWriter<'a> {
    stack: Vec<(String, String)>,
    src: &'a [f32],
    grads: &'a mut GradientsParams,
    offset: usize,
}

impl ModuleVisitor for GradsParamsWriter<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if role(&self.stack) == ParamRole::Running {
            return;
        }
        let n = param.lazy_shape().num_elements();
        let range = self.offset..self.offset + n;
        self.offset += n;
        let (Some(values), Some(old)) = (self.src.get(range), self.grads.get::<D>(param.id)) else { return };
        let fresh = Tensor::<D>::from_data(TensorData::new(values.to_vec(), old.shape()), &old.device());
        self.grads.register::<D>(param.id, fresh);
    }
}
