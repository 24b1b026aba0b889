//! Parameter counting and BatchNorm running statistics for any burn module.
//!
//! burn 0.22.1 keeps BN running statistics in `burn::nn::BatchNorm::{running_mean, running_var}`,
//! each a `burn::module::RunningState<Tensor<1>>`. A `ModuleVisitor` sees them through
//! `visit_float` like parameters (so `Module::num_params` counts them), right after
//! `enter_module("running_mean" | "running_var", "Struct:BatchNorm")`. The functions here use that
//! path to tell trainable parameters from running statistics.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

/// burn's container tag for a BatchNorm's fields.
const BN_CONTAINER: &str = "Struct:BatchNorm";

/// Whether a float tensor reached by a visitor under (field, parent container) is a BN running
/// statistic rather than a trainable parameter.
pub fn is_bn_running_stat(field: &str, container: &str) -> bool {
    container == BN_CONTAINER && (field == "running_mean" || field == "running_var")
}

/// Visits float tensors, sorting them into trainable parameters and BN running statistics.
struct Sorter<F: FnMut(bool, &ParamId, usize)> {
    stack: Vec<(String, String)>,
    f: F,
}

impl<F: FnMut(bool, &ParamId, usize)> ModuleVisitor for Sorter<F> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let stat = self.stack.last().is_some_and(|(n, c)| is_bn_running_stat(n, c));
        // lazy_shape: counting must not materialise lazily initialised parameters
        (self.f)(stat, &param.id, param.lazy_shape().num_elements());
    }
}

fn sort<M: Module>(module: &M, f: impl FnMut(bool, &ParamId, usize)) {
    let mut v = Sorter { stack: Vec::new(), f };
    module.visit(&mut v);
}

/// Number of trainable parameters, as PyTorch's `sum(p.numel() for p in model.parameters())`:
/// float parameters minus BN running statistics (burn's `num_params` counts those too).
/// Does not allocate lazily initialised parameters.
pub fn param_count<M: Module>(module: &M) -> usize {
    let mut n = 0;
    sort(module, |stat, _, numel| {
        if !stat {
            n += numel;
        }
    });
    n
}

/// Ids of the trainable float parameters (everything `visit_float` reaches except BN running
/// statistics), in visit order.
pub fn trainable_param_ids<M: Module>(module: &M) -> Vec<ParamId> {
    let mut ids = Vec::new();
    sort(module, |stat, id, _| {
        if !stat {
            ids.push(*id);
        }
    });
    ids
}

/// Ids of the BN running statistics (`running_mean`, `running_var` of every `BatchNorm`), in visit
/// order.
pub fn bn_running_stat_ids<M: Module>(module: &M) -> Vec<ParamId> {
    let mut ids = Vec::new();
    sort(module, |stat, id, _| {
        if stat {
            ids.push(*id);
        }
    });
    ids
}
