//! SGD, AdamW and Muon over flat parameter buffers, with the update rules of `torch.optim.SGD`,
//! `torch.optim.AdamW` and `torch.optim.Muon` (single-tensor implementation, foreach=False; Muon on the
//! weight matrices, AdamW on the rest) and of `clip_grad_norm_`, rounded as
//! torch's CPU kernels round them: f32 arithmetic in PyTorch's operation order, fused multiply-adds
//! where ATen fuses (`add` with `alpha`, `lerp`, `addcmul`), Python's f64 scalars converted to f32 where
//! ATen converts them. This reproduces torch 2.15's trajectories on an x86-64 CPU without AVX-512 (ATen's
//! AVX2 kernels) bit for bit, except that AdamW's square root is IEEE's where torch calls MKL's, which
//! is one ulp off on some inputs depending on the CPU ([`Optimizer::with_sqrt`] swaps it). Where ATen
//! picks wider vectors (AVX-512), only clipping's sums of squares run in another order.
//!
//! State is ours and flat (one buffer per moment, laid out like the parameters), so a worker can keep it
//! local, average it at a synchronization (the authors' `--avg-m` / `--avg-v`), and checkpoint it.

use std::ops::Range;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

#[cfg(target_arch = "x86_64")]
use crate::cpu::has_fma;
use crate::error::OptimError;
use crate::muon::{AdjustLr, MuonMatrix, MuonStep, NewtonSchulz};

/// Elements per parallel task of an update.
const CHUNK: usize = 1 << 15;

/// Which update rule an [`Optimizer`] applies (recipe key `optimizer.kind`: `"sgd"`, `"adamw"` or
/// `"muon"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// `torch.optim.SGD`: momentum, dampening, Nesterov, coupled (L2) weight decay.
    Sgd,
    /// `torch.optim.AdamW`: bias-corrected moments, decoupled weight decay, eps outside the root.
    Adamw,
    /// `torch.optim.Muon` on the model's hidden weight matrices (Nesterov momentum, Newton-Schulz
    /// orthogonalization in bf16, the lr adjusted to the shape, decoupled weight decay) and
    /// `torch.optim.AdamW` (`beta1`, `beta2`, eps 1e-8) with the same lr and weight decay on the rest:
    /// biases, norms, embeddings and the output head, as torch's guidance says. Which tensors are the
    /// matrices is the caller's ([`Optimizer::with_muon_matrices`]).
    Muon,
}

/// The moment buffers an optimizer keeps (SGD momentum or AdamW `exp_avg`; AdamW `exp_avg_sq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moments {
    /// SGD momentum / AdamW `exp_avg` / Muon's momentum buffer.
    pub first: bool,
    /// AdamW `exp_avg_sq` (Muon: of the parameters AdamW updates).
    pub second: bool,
}

/// Optimizer settings. The learning rate is not here: it comes from the schedule at every step.
/// Settings of the other optimizer kind are refused, so a recipe never carries a silently ignored value.
/// A recipe's `[optimizer]` section deserializes into this (keys `optimizer.<field>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The update rule (`optimizer.kind`); it decides which of the settings below are allowed.
    pub kind: OptimizerKind,
    /// SGD momentum (default 0), Muon's (default 0.95).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    /// SGD dampening (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dampening: Option<f64>,
    /// SGD Nesterov momentum (default false), Muon's (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nesterov: Option<bool>,
    /// AdamW beta1 (default 0.9), also of Muon's AdamW part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f64>,
    /// AdamW beta2 (default 0.999), also of Muon's AdamW part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f64>,
    /// AdamW epsilon, added outside the square root (default 1e-8); Muon's floor of the matrix norm in
    /// its Newton-Schulz iteration (torch's `eps`, default 1e-7; its AdamW part keeps 1e-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// Muon's Newton-Schulz coefficients `(a, b, c)` (default `(3.4445, -4.775, 2.0315)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_coefficients: Option<[f64; 3]>,
    /// Muon's Newton-Schulz steps, 1 to 99 (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_steps: Option<u32>,
    /// How Muon scales each matrix's lr (default `original`; `match_rms_adamw`, `spectral_unclamped`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adjust_lr_fn: Option<AdjustLr>,
    /// Coupled (L2, SGD) or decoupled (AdamW) weight decay; default 0.
    #[serde(default)]
    pub weight_decay: f64,
    /// Apply no weight decay to normalization, bias and embedding parameters. Off by default: the paper
    /// decays every parameter.
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

    /// Muon with torch's defaults (momentum 0.95, Nesterov, 5 Newton-Schulz steps, the original lr
    /// adjustment) on the matrices, AdamW (0.9, 0.999) on the rest; `weight_decay` for both (torch's
    /// Muon defaults to 0.1).
    pub fn muon(weight_decay: f64) -> Self {
        Self { weight_decay, ..Self::empty(OptimizerKind::Muon) }
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
            ns_coefficients: None,
            ns_steps: None,
            adjust_lr_fn: None,
            weight_decay: 0.0,
            exclude_norm_and_bias: false,
            clip_grad_norm: None,
        }
    }

    /// The momentum, when unset SGD's 0 (`torch.optim.SGD(momentum=...)`) and Muon's 0.95.
    pub fn momentum(&self) -> f64 {
        self.momentum.unwrap_or(if self.kind == OptimizerKind::Muon { 0.95 } else { 0.0 })
    }
    /// The moment buffers this optimizer keeps: SGD a first one with momentum, AdamW and Muon both
    /// (Muon's momentum buffer in the first on its matrices).
    pub fn moments(&self) -> Moments {
        match self.kind {
            OptimizerKind::Sgd => Moments { first: self.momentum() != 0.0, second: false },
            OptimizerKind::Adamw | OptimizerKind::Muon => Moments { first: true, second: true },
        }
    }
    /// SGD dampening, 0 when unset (`torch.optim.SGD(dampening=...)`).
    pub fn dampening(&self) -> f64 {
        self.dampening.unwrap_or(0.0)
    }
    /// Nesterov momentum, when unset false for SGD and true for Muon.
    pub fn nesterov(&self) -> bool {
        self.nesterov.unwrap_or(self.kind == OptimizerKind::Muon)
    }
    /// AdamW beta1, 0.9 when unset (`torch.optim.AdamW(betas=(beta1, _))`).
    pub fn beta1(&self) -> f64 {
        self.beta1.unwrap_or(0.9)
    }
    /// AdamW beta2, 0.999 when unset (`torch.optim.AdamW(betas=(_, beta2))`).
    pub fn beta2(&self) -> f64 {
        self.beta2.unwrap_or(0.999)
    }
    /// The epsilon AdamW adds outside its root: `eps`, 1e-8 when unset (`torch.optim.AdamW(eps=...)`),
    /// and always 1e-8 in Muon's AdamW part.
    pub fn eps(&self) -> f64 {
        match self.kind {
            OptimizerKind::Muon => 1e-8,
            _ => self.eps.unwrap_or(1e-8),
        }
    }

    /// Muon's Newton-Schulz iteration, torch's defaults where unset.
    pub(crate) fn newton_schulz(&self) -> NewtonSchulz {
        NewtonSchulz {
            coefficients: self.ns_coefficients.unwrap_or([3.4445, -4.775, 2.0315]),
            steps: self.ns_steps.unwrap_or(5),
            eps: self.eps.unwrap_or(1e-7),
        }
    }

    /// Checks the settings, returning [`OptimError::Config`] naming the first bad one (`optimizer.<key>`):
    /// a setting of the other kind (e.g. `beta1` for SGD), momentum / betas outside `[0, 1)`, dampening
    /// outside `[0, 1]`, Nesterov without momentum > 0 and zero dampening, eps <= 0, a negative or
    /// non-finite weight decay, a clipping norm <= 0.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |field: &str, reason: String| Err(OptimError::Config { field: format!("optimizer.{field}"), reason });
        let in_unit = |field: &str, v: Option<f64>, closed: bool| -> Result<(), OptimError> {
            match v {
                Some(x) if !x.is_finite() || x < 0.0 || (if closed { x > 1.0 } else { x >= 1.0 }) => {
                    bad(field, format!("must be in [0, 1{} (got {x})", if closed { "]" } else { ")" }))
                }
                _ => Ok(()),
            }
        };
        let foreign = |field: &str, set: bool, owner: &str| -> Result<(), OptimError> {
            if set { bad(field, format!("is a setting of `{owner}`, not of `{}`", self.kind_name())) } else { Ok(()) }
        };
        if self.kind != OptimizerKind::Muon {
            foreign("ns_coefficients", self.ns_coefficients.is_some(), "muon")?;
            foreign("ns_steps", self.ns_steps.is_some(), "muon")?;
            foreign("adjust_lr_fn", self.adjust_lr_fn.is_some(), "muon")?;
        }
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
            OptimizerKind::Muon => self.validate_muon()?,
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

    fn validate_muon(&self) -> Result<(), OptimError> {
        let bad = |field: &str, reason: String| Err(OptimError::Config { field: format!("optimizer.{field}"), reason });
        if self.dampening.is_some() {
            return bad("dampening", "is a setting of `sgd`, not of `muon`".into());
        }
        for (field, v) in [("momentum", self.momentum), ("beta1", self.beta1), ("beta2", self.beta2)] {
            if let Some(x) = v.filter(|x| !(x.is_finite() && (0.0..1.0).contains(x))) {
                return bad(field, format!("must be in [0, 1) (got {x})"));
            }
        }
        let ns = self.newton_schulz();
        if !(ns.eps.is_finite() && ns.eps > 0.0) {
            return bad("eps", format!("must be > 0 (got {})", ns.eps));
        }
        if !(1..100).contains(&ns.steps) {
            return bad("ns_steps", format!("must be in 1..=99, as torch's Muon allows (got {})", ns.steps));
        }
        if ns.coefficients.iter().any(|c| !c.is_finite()) {
            return bad("ns_coefficients", format!("must be finite (got {:?})", ns.coefficients));
        }
        Ok(())
    }

    fn kind_name(&self) -> &'static str {
        match self.kind {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Muon => "muon",
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
    /// The elements of the flat parameter buffer in this run.
    pub range: Range<usize>,
    /// Whether `weight_decay` applies here (false for ranges `exclude_norm_and_bias` exempts).
    pub decay: bool,
}

/// SGD, AdamW or Muon over a flat buffer of `len` parameters.
#[derive(Debug, Clone)]
pub struct Optimizer {
    config: OptimizerConfig,
    segments: Vec<DecaySegment>,
    /// Muon's matrices ([`Optimizer::with_muon_matrices`]; empty for the other kinds).
    matrices: Vec<MuonMatrix>,
    /// `segments` without the matrices: where the element-wise rule (SGD, AdamW) applies.
    elementwise: Vec<DecaySegment>,
    state: OptimState,
    /// The parameter tensors, tiling the buffer in order (clipping takes a norm per tensor first).
    tensors: Vec<Range<usize>>,
    /// AdamW's square root, when not the IEEE one.
    sqrt: Option<fn(f32) -> f32>,
}

impl Optimizer {
    /// `no_decay` lists the parameter ranges that `exclude_norm_and_bias` exempts from weight decay (it
    /// is ignored when the option is off). Ranges must lie inside `0..len`. The buffer counts as one
    /// tensor until [`Optimizer::with_tensors`] says otherwise.
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
        let Moments { first, second } = config.moments();
        let state = OptimState { step: 0, first_moment: moment(first), second_moment: moment(second) };
        let tensors = std::iter::once(0..len).collect();
        let elementwise = segments.clone();
        Ok(Self { config, segments, matrices: Vec::new(), elementwise, state, tensors, sqrt: None })
    }

    /// Declares the matrices Muon updates (`optimizer.kind = "muon"`; refused for the other kinds):
    /// non-overlapping ranges inside the buffer, each `rows x cols` elements. AdamW updates every other
    /// parameter, so a Muon optimizer without matrices is AdamW.
    pub fn with_muon_matrices(mut self, mut matrices: Vec<MuonMatrix>) -> Result<Self, OptimError> {
        if self.config.kind != OptimizerKind::Muon && !matrices.is_empty() {
            return Err(OptimError::Layout(format!(
                "Muon matrices given to a `{}` optimizer",
                self.config.kind_name()
            )));
        }
        matrices.sort_by_key(|m| m.range.start);
        let len = self.segments.last().map_or(0, |s| s.range.end);
        let mut end = 0;
        for m in &matrices {
            if m.range.start < end || m.range.end > len || m.rows * m.cols != m.range.len() || m.range.is_empty() {
                let (r, rows, cols) = (&m.range, m.rows, m.cols);
                return Err(OptimError::Layout(format!(
                    "Muon matrix {r:?} of {rows} x {cols} overlaps another or does not fit a buffer of {len}"
                )));
            }
            end = m.range.end;
        }
        self.elementwise = self
            .segments
            .iter()
            .flat_map(|s| outside(&s.range, &matrices).into_iter().map(|range| DecaySegment { range, decay: s.decay }))
            .collect();
        self.matrices = matrices;
        Ok(self)
    }

    /// The matrices Muon updates.
    pub fn muon_matrices(&self) -> &[MuonMatrix] {
        &self.matrices
    }

    /// Declares the parameter tensors (ranges that tile `0..len` in order), so gradient clipping sums
    /// squares per tensor in the order `torch.nn.utils.clip_grad_norm_` does. The update itself is
    /// elementwise and does not depend on them.
    pub fn with_tensors(mut self, tensors: &[Range<usize>]) -> Result<Self, OptimError> {
        let len = self.segments.last().map_or(0, |s| s.range.end);
        let mut end = 0;
        for r in tensors {
            if r.start != end || r.end < r.start {
                let msg = format!("tensor range {r:?} does not follow the previous one (ending at {end})");
                return Err(OptimError::Layout(msg));
            }
            end = r.end;
        }
        if end != len {
            return Err(OptimError::Layout(format!("tensor ranges cover 0..{end}, the buffer has {len} parameters")));
        }
        self.tensors = tensors.to_vec();
        Ok(self)
    }

    /// Replaces AdamW's square root of the second moment (IEEE `f32::sqrt` by default). torch's CPU
    /// `sqrt` calls MKL, whose result depends on the CPU and can be one ulp off the IEEE root; a test
    /// swaps in an emulation of it to check the rest of the update bit for bit.
    pub fn with_sqrt(mut self, sqrt: fn(f32) -> f32) -> Self {
        self.sqrt = Some(sqrt);
        self
    }

    /// The settings this optimizer was built with.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// The step count and moments (for checkpoints and averaging).
    pub fn state(&self) -> &OptimState {
        &self.state
    }

    /// The state, mutable: the driver overwrites the moments with their averages at a sync. Keep the
    /// moments' lengths; [`Optimizer::load_state`] is the checked way to replace it.
    pub fn state_mut(&mut self) -> &mut OptimState {
        &mut self.state
    }

    /// The weight-decay runs, maximal and in order, tiling `0..len`.
    pub fn segments(&self) -> &[DecaySegment] {
        &self.segments
    }

    /// The parameter tensors clipping sums over (one range per tensor).
    pub fn tensors(&self) -> &[Range<usize>] {
        &self.tensors
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
        let norm = self.config.clip_grad_norm.map(|max| clip_grad_norm_per_tensor(grads, &self.tensors, max));
        self.state.step += 1;
        match self.config.kind {
            OptimizerKind::Sgd => self.sgd(params, grads, lr),
            OptimizerKind::Adamw | OptimizerKind::Muon => match self.sqrt {
                None => self.adamw(params, grads, lr, f32::sqrt),
                Some(sqrt) => self.adamw(params, grads, lr, sqrt),
            },
        }
        if self.config.kind == OptimizerKind::Muon {
            self.muon(params, grads, lr);
        }
        norm
    }

    fn muon(&mut self, params: &mut [f32], grads: &[f32], lr: f64) {
        let c = &self.config;
        let step = MuonStep {
            lr,
            weight_decay: c.weight_decay,
            momentum: c.momentum(),
            nesterov: c.nesterov(),
            ns: c.newton_schulz(),
            adjust: c.adjust_lr_fn.unwrap_or_default(),
        };
        for m in &self.matrices {
            let r = m.range.clone();
            step.update(m, &mut params[r.clone()], &grads[r.clone()], &mut self.state.first_moment[r]);
        }
    }

    fn sgd(&mut self, params: &mut [f32], grads: &[f32], lr: f64) {
        let c = &self.config;
        // Python floats become f32 where ATen reads the scalar (`alpha.to<float>()`, wrapped numbers).
        let mut k = Sgd {
            wd: 0.0,
            mu: c.momentum() as f32,
            damp: (1.0 - c.dampening()) as f32,
            neg_lr: -lr as f32,
            first: self.state.step == 1,
            nesterov: c.nesterov(),
        };
        let momentum = k.mu != 0.0;
        for seg in &self.elementwise {
            k.wd = if seg.decay { c.weight_decay as f32 } else { 0.0 };
            let p = &mut params[seg.range.clone()];
            let g = &grads[seg.range.clone()];
            if momentum {
                let buf = &mut self.state.first_moment[seg.range.clone()];
                p.par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .zip(buf.par_chunks_mut(CHUNK))
                    .for_each(|((p, g), b)| sgd_chunk(k, p, g, b));
            } else {
                p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(p, g)| sgd_chunk(k, p, g, &mut []));
            }
        }
    }

    fn adamw<S: Fn(f32) -> f32 + Copy + Sync>(&mut self, params: &mut [f32], grads: &[f32], lr: f64, sqrt: S) {
        let c = &self.config;
        let (b1, b2) = (c.beta1(), c.beta2());
        // Python's scalars: `beta ** step` is libm's pow (as is f64::powf), `bias_correction2 ** 0.5` too.
        let t = self.state.step as f64;
        let step_size = lr / (1.0 - b1.powf(t));
        let mut k = Adamw {
            decay: 1.0,
            weight: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            bc2_sqrt: (1.0 - b2.powf(t)).powf(0.5) as f32,
            eps: c.eps() as f32,
            neg_step: -step_size as f32,
        };
        let (m_all, v_all) = (&mut self.state.first_moment, &mut self.state.second_moment);
        for seg in &self.elementwise {
            // param.mul_(1 - lr * weight_decay); a factor of exactly 1 changes nothing where torch skips it
            k.decay = if seg.decay { (1.0 - lr * c.weight_decay) as f32 } else { 1.0 };
            let r = seg.range.clone();
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            let (m, v) = (&mut m_all[r.clone()], &mut v_all[r]);
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| adamw_chunk(k, sqrt, p, g, m, v));
        }
    }
}

/// The parts of `range` outside every matrix of `matrices` (sorted, non-overlapping).
fn outside(range: &Range<usize>, matrices: &[MuonMatrix]) -> Vec<Range<usize>> {
    let mut parts = Vec::new();
    let mut at = range.start;
    for m in matrices.iter().filter(|m| m.range.start < range.end && m.range.end > range.start) {
        if m.range.start > at {
            parts.push(at..m.range.start);
        }
        at = at.max(m.range.end);
    }
    if at < range.end {
        parts.push(at..range.end);
    }
    parts
}

/// One SGD step's constants, as f32 the way ATen's kernels see them.
#[derive(Clone, Copy)]
struct Sgd {
    wd: f32,
    mu: f32,
    /// 1 - dampening
    damp: f32,
    neg_lr: f32,
    first: bool,
    nesterov: bool,
}

impl Sgd {
    /// `torch.optim.SGD`'s single-tensor step. ATen computes `add(x, y, alpha)` as `fma(y, alpha, x)`
    /// (`vec::fmadd`, and GCC contracts the scalar remainder the same way), so each `alpha` term is a
    /// `mul_add`. `buf` is empty without momentum.
    #[inline(always)]
    fn update(self, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
        if buf.is_empty() {
            for (p, &g) in p.iter_mut().zip(g) {
                // grad.add(param, alpha=wd) (skipped without decay); param.add_(grad, alpha=-lr)
                let d = if self.wd != 0.0 { p.mul_add(self.wd, g) } else { g };
                *p = d.mul_add(self.neg_lr, *p);
            }
            return;
        }
        for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
            let d = if self.wd != 0.0 { p.mul_add(self.wd, g) } else { g };
            // The first step clones grad; then buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            *b = if self.first { d } else { d.mul_add(self.damp, *b * self.mu) };
            // Nesterov: grad.add(buf, alpha=momentum)
            let d = if self.nesterov { b.mul_add(self.mu, d) } else { *b };
            *p = d.mul_add(self.neg_lr, *p);
        }
    }
}

/// One AdamW step's constants, as f32 the way ATen's kernels see them.
#[derive(Clone, Copy)]
struct Adamw {
    decay: f32,
    /// lerp weight, 1 - beta1
    weight: f32,
    b2: f32,
    one_minus_b2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step: f32,
}

impl Adamw {
    /// `torch.optim.AdamW`'s single-tensor step, each operation rounded as ATen's CPU kernel rounds it.
    #[inline(always)]
    fn update<S: Fn(f32) -> f32>(self, sqrt: S, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let small = self.weight.abs() < 0.5;
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *p *= self.decay;
            // exp_avg.lerp_(grad, w): ATen's lerp_vec is fma(w, g - m, m) for |w| < 0.5, else
            // fma(w - 1, g - m, g)
            let diff = g - *m;
            *m = if small { diff.mul_add(self.weight, *m) } else { diff.mul_add(self.weight - 1.0, g) };
            // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): addcmul's
            // `self + value * t1 * t2` is contracted to fma(value * t1, t2, self)
            *v = (self.one_minus_b2 * g).mul_add(g, *v * self.b2);
            // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): a true division
            let denom = sqrt(*v) / self.bc2_sqrt + self.eps;
            // param.addcdiv_(exp_avg, denom, value=-step_size): self + (value * t1) / t2, unfused
            *p += self.neg_step * *m / denom;
        }
    }
}

fn sgd_chunk(k: Sgd, p: &mut [f32], g: &[f32], b: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { sgd_fma(k, p, g, b) };
    }
    k.update(p, g, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sgd_fma(k: Sgd, p: &mut [f32], g: &[f32], b: &mut [f32]) {
    k.update(p, g, b)
}

fn adamw_chunk<S: Fn(f32) -> f32>(k: Adamw, sqrt: S, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { adamw_fma(k, sqrt, p, g, m, v) };
    }
    k.update(sqrt, p, g, m, v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn adamw_fma<S: Fn(f32) -> f32>(k: Adamw, sqrt: S, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    k.update(sqrt, p, g, m, v)
}

/// `torch.linalg.vector_norm(t, 2)` of one f32 tensor, reduced as ATen's AVX2 kernel does: eight lane
/// sums of rounded squares, the lanes added in order, then the remainder (whose first four squares
/// GCC vectorizes, rounded; the rest are fused), and the square root.
fn torch_norm(x: &[f32]) -> f32 {
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    let mut lanes = [0.0f32; 8];
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x * x;
        }
    }
    let mut sum = lanes[1..].iter().fold(lanes[0], |s, &l| s + l);
    let (rounded, fused) = rest.split_at(if rest.len() >= 4 { 4 } else { 0 });
    for &x in rounded {
        sum += x * x;
    }
    for &x in fused {
        sum = x.mul_add(x, sum);
    }
    sum.sqrt()
}

/// Scales `grads`, one tensor, so its L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_`. Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f64) -> f64 {
    let len = grads.len();
    clip_grad_norm_per_tensor(grads, std::slice::from_ref(&(0..len)), max_norm)
}

/// Scales `grads` so the global L2 norm of the tensors at `tensors` is at most `max_norm`, bit for bit
/// as `torch.nn.utils.clip_grad_norm_(foreach=False)` on f32 CPU tensors: f32 norms per tensor, the norm
/// of those, and the coefficient `max_norm / (norm + 1e-6)` clamped to 1. Returns the norm before
/// clipping. Elements outside `tensors` are scaled too.
pub fn clip_grad_norm_per_tensor(grads: &mut [f32], tensors: &[Range<usize>], max_norm: f64) -> f64 {
    let norms: Vec<f32> = tensors.par_iter().map(|r| torch_norm(&grads[r.clone()])).collect();
    let total = torch_norm(&norms);
    // `max_norm / tensor` is Tensor.__rtruediv__: a reciprocal, then a multiply by f32(max_norm).
    let coef = (1.0 / (total + 1e-6_f64 as f32)) * max_norm as f32;
    // torch.clamp(max=1.0), which keeps a NaN; a factor of exactly 1 changes nothing.
    let coef = if coef > 1.0 { 1.0 } else { coef };
    if coef != 1.0 {
        grads.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|g| *g *= coef));
    }
    f64::from(total)
}
