//! SGD and AdamW over flat parameter buffers, with the exact update rules of `torch.optim.SGD` and
//! `torch.optim.AdamW` (single-tensor implementation, f32 arithmetic in PyTorch's operation order).
//!
//! State is ours and flat (one buffer per moment, laid out like the parameters), so a worker can keep it
//! local, average it at a synchronization (the authors' `--avg-m` / `--avg-v`), and checkpoint it.

use std::ops::Range;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::OptimError;

/// Elements per parallel task of an update.
const CHUNK: usize = 1 << 15;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    Sgd,
    Adamw,
}

/// Optimizer settings. The learning rate is not here: it comes from the schedule at every step.
/// Settings of the other optimizer kind are refused, so a recipe never carries a silently ignored value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    pub kind: OptimizerKind,
    /// SGD momentum (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    /// SGD dampening (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dampening: Option<f64>,
    /// SGD Nesterov momentum (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nesterov: Option<bool>,
    /// AdamW beta1 (default 0.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f64>,
    /// AdamW beta2 (default 0.999).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f64>,
    /// AdamW epsilon, added outside the square root (default 1e-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// Coupled (L2, SGD) or decoupled (AdamW) weight decay; default 0.
    #[serde(default)]
    pub weight_decay: f64,
    /// Apply no weight decay to normalization and bias parameters. Off by default: the paper decays
    /// every parameter.
    #[serde(default)]
    pub exclude_norm_and_bias: bool,
    /// Clip gradients to this global L2 norm before the update (as `torch.nn.utils.clip_grad_norm_`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
}

impl OptimizerConfig {
    /// SGD with momentum, no dampening, no Nesterov, coupled weight decay (the paper's ResNet setting is
    /// `sgd(0.9, 1e-4)`).
    pub fn sgd(momentum: f64, weight_decay: f64) -> Self {
        Self { kind: OptimizerKind::Sgd, momentum: Some(momentum), weight_decay, ..Self::empty(OptimizerKind::Sgd) }
    }

    /// AdamW with betas (0.9, 0.999), eps 1e-8 (the paper's ViT setting is `adamw(0.05)`).
    pub fn adamw(weight_decay: f64) -> Self {
        Self { weight_decay, ..Self::empty(OptimizerKind::Adamw) }
    }

    fn empty(kind: OptimizerKind) -> Self {
        Self {
            kind,
            momentum: None,
            dampening: None,
            nesterov: None,
            beta1: None,
            beta2: None,
            eps: None,
            weight_decay: 0.0,
            exclude_norm_and_bias: false,
            clip_grad_norm: None,
        }
    }

    pub fn momentum(&self) -> f64 {
        self.momentum.unwrap_or(0.0)
    }
    pub fn dampening(&self) -> f64 {
        self.dampening.unwrap_or(0.0)
    }
    pub fn nesterov(&self) -> bool {
        self.nesterov.unwrap_or(false)
    }
    pub fn beta1(&self) -> f64 {
        self.beta1.unwrap_or(0.9)
    }
    pub fn beta2(&self) -> f64 {
        self.beta2.unwrap_or(0.999)
    }
    pub fn eps(&self) -> f64 {
        self.eps.unwrap_or(1e-8)
    }

    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |field: &str, reason: String| Err(OptimError::Config { field: format!("optimizer.{field}"), reason });
        let in_unit = |field: &str, v: Option<f64>, closed: bool| -> Result<(), OptimError> {
            match v {
                Some(x) if !x.is_finite() || x < 0.0 || (if closed { x > 1.0 } else { x >= 1.0 }) => bad(
                    field,
                    format!("must be in [0, 1{} (got {x})", if closed { "]" } else { ")" }),
                ),
                _ => Ok(()),
            }
        };
        let foreign = |field: &str, set: bool, owner: &str| -> Result<(), OptimError> {
            if set { bad(field, format!("is a setting of `{owner}`, not of `{}`", self.kind_name())) } else { Ok(()) }
        };
        match self.kind {
            OptimizerKind::Sgd => {
                foreign("beta1", self.beta1.is_some(), "adamw")?;
                foreign("beta2", self.beta2.is_some(), "adamw")?;
                foreign("eps", self.eps.is_some(), "adamw")?;
                in_unit("momentum", self.momentum, false)?;
                in_unit("dampening", self.dampening, true)?;
                if self.nesterov() && (self.momentum() <= 0.0 || self.dampening() != 0.0) {
                    return bad("nesterov", "needs momentum > 0 and zero dampening (as in PyTorch)".into());
                }
            }
            OptimizerKind::Adamw => {
                foreign("momentum", self.momentum.is_some(), "sgd")?;
                foreign("dampening", self.dampening.is_some(), "sgd")?;
                foreign("nesterov", self.nesterov.is_some(), "sgd")?;
                in_unit("beta1", self.beta1, false)?;
                in_unit("beta2", self.beta2, false)?;
                if !(self.eps().is_finite() && self.eps() > 0.0) {
                    return bad("eps", format!("must be > 0 (got {})", self.eps()));
                }
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", format!("must be a finite number >= 0 (got {})", self.weight_decay));
        }
        if let Some(c) = self.clip_grad_norm
            && !(c.is_finite() && c > 0.0)
        {
            return bad("clip_grad_norm", format!("must be > 0 (got {c})"));
        }
        Ok(())
    }

    fn kind_name(&self) -> &'static str {
        match self.kind {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adamw => "adamw",
        }
    }
}

/// A worker's optimizer state, flat and laid out like the trainable parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimState {
    /// Optimizer steps taken (AdamW's bias-correction step; SGD's "first step" test).
    pub step: u64,
    /// SGD momentum buffer or AdamW `exp_avg` (empty for SGD without momentum).
    pub first_moment: Vec<f32>,
    /// AdamW `exp_avg_sq` (empty for SGD).
    pub second_moment: Vec<f32>,
}

/// A run of parameters sharing one weight-decay setting.
#[derive(Debug, Clone, PartialEq)]
pub struct DecaySegment {
    pub range: Range<usize>,
    pub decay: bool,
}

/// SGD or AdamW over a flat buffer of `len` parameters.
#[derive(Debug, Clone)]
pub struct Optimizer {
    config: OptimizerConfig,
    segments: Vec<DecaySegment>,
    state: OptimState,
}

impl Optimizer {
    /// `no_decay` lists the parameter ranges that `exclude_norm_and_bias` exempts from weight decay (it
    /// is ignored when the option is off). Ranges must lie inside `0..len`.
    pub fn new(config: OptimizerConfig, len: usize, no_decay: &[Range<usize>]) -> Result<Self, OptimError> {
        config.validate()?;
        let mut exempt = vec![false; 0];
        if config.exclude_norm_and_bias {
            exempt = vec![false; len];
            for r in no_decay {
                if r.end > len || r.start > r.end {
                    return Err(OptimError::Layout(format!("no-decay range {r:?} outside 0..{len}")));
                }
                exempt[r.clone()].iter_mut().for_each(|e| *e = true);
            }
        }
        // Merge into maximal runs so an update is a few long loops, not one per tensor.
        let mut segments: Vec<DecaySegment> = Vec::new();
        for i in 0..len {
            let decay = exempt.get(i).is_none_or(|e| !e);
            match segments.last_mut() {
                Some(s) if s.decay == decay => s.range.end = i + 1,
                _ => segments.push(DecaySegment { range: i..i + 1, decay }),
            }
        }
        let moment = |on: bool| if on { vec![0.0; len] } else { Vec::new() };
        let state = match config.kind {
            OptimizerKind::Sgd => OptimState { step: 0, first_moment: moment(config.momentum() != 0.0), second_moment: Vec::new() },
            OptimizerKind::Adamw => OptimState { step: 0, first_moment: moment(true), second_moment: moment(true) },
        };
        Ok(Self { config, segments, state })
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    pub fn state(&self) -> &OptimState {
        &self.state
    }

    pub fn state_mut(&mut self) -> &mut OptimState {
        &mut self.state
    }

    pub fn segments(&self) -> &[DecaySegment] {
        &self.segments
    }

    /// Replaces the state (from a checkpoint), checking that it fits this optimizer.
    pub fn load_state(&mut self, state: OptimState) -> Result<(), OptimError> {
        let want = (self.state.first_moment.len(), self.state.second_moment.len());
        let got = (state.first_moment.len(), state.second_moment.len());
        if want != got {
            return Err(OptimError::Layout(format!(
                "optimizer state has moments of {got:?} elements, this optimizer needs {want:?}"
            )));
        }
        self.state = state;
        Ok(())
    }

    /// One optimizer step: optional clipping of `grads` (in place), then the update of `params` with
    /// learning rate `lr`. Returns the global gradient norm when clipping is on.
    pub fn step(&mut self, params: &mut [f32], grads: &mut [f32], lr: f64) -> Option<f64> {
        assert_eq!(params.len(), grads.len(), "parameter and gradient buffers differ in length");
        let norm = self.config.clip_grad_norm.map(|max| clip_grad_norm(grads, max));
        self.state.step += 1;
        match self.config.kind {
            OptimizerKind::Sgd => self.sgd(params, grads, lr),
            OptimizerKind::Adamw => self.adamw(params, grads, lr),
        }
        norm
    }

    fn sgd(&mut self, params: &mut [f32], grads: &[f32], lr: f64) {
        let c = &self.config;
        let (mu, damp, nesterov) = (c.momentum() as f32, (1.0 - c.dampening()) as f32, c.nesterov());
        let neg_lr = -lr as f32;
        let first = self.state.step == 1;
        for seg in &self.segments {
            let wd = if seg.decay { c.weight_decay as f32 } else { 0.0 };
            let p = &mut params[seg.range.clone()];
            let g = &grads[seg.range.clone()];
            if mu == 0.0 {
                p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(p, g)| {
                    for (p, &g) in p.iter_mut().zip(g) {
                        let g = if wd != 0.0 { g + wd * *p } else { g };
                        *p += neg_lr * g;
                    }
                });
                continue;
            }
            let buf = &mut self.state.first_moment[seg.range.clone()];
            p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(buf.par_chunks_mut(CHUNK)).for_each(|((p, g), b)| {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                    // torch: d_p = grad.add(param, alpha=wd); buf.mul_(mu).add_(d_p, alpha=1-dampening)
                    let d = if wd != 0.0 { g + wd * *p } else { g };
                    *b = if first { d } else { *b * mu + damp * d };
                    let d = if nesterov { d + mu * *b } else { *b };
                    *p += neg_lr * d;
                }
            });
        }
    }

    fn adamw(&mut self, params: &mut [f32], grads: &[f32], lr: f64) {
        let c = &self.config;
        let (b1, b2) = (c.beta1(), c.beta2());
        let t = self.state.step as i32;
        // Scalars are computed in f64 as Python does, then used in f32 by the kernels.
        let step_size = (lr / (1.0 - b1.powi(t))) as f32;
        let bc2_sqrt = (1.0 - b2.powi(t)).sqrt() as f32;
        let weight = (1.0 - b1) as f32;
        let one_minus_b2 = (1.0 - b2) as f32;
        let (b2, eps) = (b2 as f32, c.eps() as f32);
        let neg_step = -step_size;
        let (m_all, v_all) = (&mut self.state.first_moment, &mut self.state.second_moment);
        for seg in &self.segments {
            let decay = if seg.decay { (1.0 - lr * c.weight_decay) as f32 } else { 1.0 };
            let r = seg.range.clone();
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            let (m, v) = (&mut m_all[r.clone()], &mut v_all[r]);
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| {
                    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                        *p *= decay;
                        // torch.lerp: self + w (end - self) for w < 0.5, else end - (end - self)(1 - w)
                        *m = if weight < 0.5 { *m + weight * (g - *m) } else { g - (g - *m) * (1.0 - weight) };
                        *v = *v * b2 + one_minus_b2 * g * g;
                        let denom = v.sqrt() / bc2_sqrt + eps;
                        // addcdiv: self + value * t1 / t2, evaluated left to right
                        *p += neg_step * *m / denom;
                    }
                });
        }
    }
}

/// Scales `grads` so their global L2 norm is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_`
/// (coefficient `max_norm / (norm + 1e-6)`, clamped to 1). Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f64) -> f64 {
    let sq: f64 = grads.par_chunks(CHUNK).map(|c| c.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>()).sum();
    let norm = sq.sqrt();
    let coef = (max_norm / (norm + 1e-6)).min(1.0) as f32;
    if coef < 1.0 {
        grads.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|g| *g *= coef));
    }
    norm
}
