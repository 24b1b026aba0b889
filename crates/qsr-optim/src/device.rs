//! Device-resident replicas: a worker's flat parameters and optimizer state as burn tensors on the
//! training device, and the in-process group that averages K such replicas where they live.
//!
//! On a GPU the host-resident path copies every step's gradients down and parameters up; here they
//! stay on the device. The optimizer is the same SGD / AdamW as [`crate::Optimizer`], written as burn
//! tensor operations in PyTorch's operation order (on the CPU backend it follows the host optimizer
//! to f32 rounding, 1e-6 relative in the tests; gradient clipping sums its squares in f32 where the
//! host uses f64, and a GPU compiler may contract `a * b + c` into one FMA).
//!
//! [`DeviceGroup`] is the synchronization of K simulated workers on one device: the last of the K
//! to arrive averages all K flat tensors. On a cubecl backend (features `cuda` / `wgpu`) that is one
//! launch of qsr-kernels' fused average-and-broadcast over the K buffers in place; elsewhere it is
//! the same arithmetic in burn operations (`((t_0 + t_1) + ...) / K`).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};

use crate::error::OptimError;
use crate::optim::{OptimState, OptimizerConfig, OptimizerKind};

/// One f32 value per element, uploaded once.
fn tensor_from(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::<1>::from_data(TensorData::new(values, [n]), device)
}

/// Downloads a flat tensor.
pub(crate) fn to_host(t: &Tensor<1>) -> Result<Vec<f32>, OptimError> {
    let data = t.clone().into_data();
    data.convert::<f32>().try_to_vec::<f32>().map_err(|e| OptimError::Layout(format!("reading a device tensor: {e:?}")))
}

/// SGD or AdamW over a flat parameter tensor; state on the device.
#[derive(Debug, Clone)]
pub struct DeviceOptimizer {
    config: OptimizerConfig,
    /// 1 where weight decay applies, 0 where `exclude_norm_and_bias` exempts (None: decay everywhere).
    decay_mask: Option<Tensor<1>>,
    step: u64,
    first_moment: Option<Tensor<1>>,
    second_moment: Option<Tensor<1>>,
    len: usize,
}

impl DeviceOptimizer {
    /// Same arguments as [`crate::Optimizer::new`], plus the device the state lives on.
    pub fn new(
        config: OptimizerConfig,
        len: usize,
        no_decay: &[std::ops::Range<usize>],
        device: &Device,
    ) -> Result<Self, OptimError> {
        config.validate()?;
        if config.kind == OptimizerKind::Muon {
            return Err(OptimError::Config {
                field: "optimizer.kind".into(),
                reason:
                    "muon's Newton-Schulz iteration runs on host-resident workers only (driver.residency = \"host\")"
                        .into(),
            });
        }
        if config.exclude_norm_and_bias
            && let Some(r) = no_decay.iter().find(|r| r.end > len || r.start > r.end)
        {
            return Err(OptimError::Layout(format!("no-decay range {r:?} outside 0..{len}")));
        }
        let decay_mask = if config.exclude_norm_and_bias && config.weight_decay != 0.0 {
            let mut mask = vec![1.0f32; len];
            for r in no_decay {
                mask[r.clone()].iter_mut().for_each(|m| *m = 0.0);
            }
            Some(tensor_from(mask, device))
        } else {
            None
        };
        let zeros = || Some(Tensor::<1>::zeros([len], device));
        let (first_moment, second_moment) = match config.kind {
            OptimizerKind::Sgd if config.momentum() != 0.0 => (zeros(), None),
            OptimizerKind::Sgd => (None, None),
            // Muon is refused above.
            OptimizerKind::Adamw | OptimizerKind::Muon => (zeros(), zeros()),
        };
        Ok(Self { config, decay_mask, step: 0, first_moment, second_moment, len })
    }

    /// The settings this optimizer was built with.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// The state, downloaded (for checkpoints).
    pub fn state(&self) -> Result<OptimState, OptimError> {
        let get = |t: &Option<Tensor<1>>| t.as_ref().map_or(Ok(Vec::new()), to_host);
        Ok(OptimState {
            step: self.step,
            first_moment: get(&self.first_moment)?,
            second_moment: get(&self.second_moment)?,
        })
    }

    /// Replaces the state (from a checkpoint), checking that it fits this optimizer.
    pub fn load_state(&mut self, state: OptimState, device: &Device) -> Result<(), OptimError> {
        let want = |t: &Option<Tensor<1>>| if t.is_some() { self.len } else { 0 };
        let want = (want(&self.first_moment), want(&self.second_moment));
        let got = (state.first_moment.len(), state.second_moment.len());
        if want != got {
            return Err(OptimError::Layout(format!(
                "optimizer state has moments of {got:?} elements, this optimizer needs {want:?}"
            )));
        }
        // A moment this optimizer has stays present, even for an empty layout.
        let up = |has: bool, v: Vec<f32>| has.then(|| tensor_from(v, device));
        let (has_m, has_v) = (self.first_moment.is_some(), self.second_moment.is_some());
        self.step = state.step;
        self.first_moment = up(has_m, state.first_moment);
        self.second_moment = up(has_v, state.second_moment);
        Ok(())
    }

    /// The moments, for averaging at a sync (`None` where the optimizer has none).
    pub fn moments_mut(&mut self) -> (&mut Option<Tensor<1>>, &mut Option<Tensor<1>>) {
        (&mut self.first_moment, &mut self.second_moment)
    }

    /// One step: optional clipping, then the update. Returns the new parameters.
    pub fn step(&mut self, params: Tensor<1>, grads: Tensor<1>, lr: f64) -> Tensor<1> {
        let grads = match self.config.clip_grad_norm {
            Some(max) => {
                // The norm is read back (one scalar) as torch.nn.utils.clip_grad_norm_ computes it.
                let norm = f64::from(grads.clone().powi_scalar(2).sum().into_scalar::<f32>()).sqrt();
                let coef = (max / (norm + 1e-6)).min(1.0) as f32;
                if coef < 1.0 { grads.mul_scalar(coef) } else { grads }
            }
            None => grads,
        };
        self.step += 1;
        match self.config.kind {
            OptimizerKind::Sgd => self.sgd(params, grads, lr),
            OptimizerKind::Adamw | OptimizerKind::Muon => self.adamw(params, grads, lr),
        }
    }

    fn sgd(&mut self, p: Tensor<1>, g: Tensor<1>, lr: f64) -> Tensor<1> {
        let c = &self.config;
        let (mu, damp, nesterov) = (c.momentum() as f32, (1.0 - c.dampening()) as f32, c.nesterov());
        let wd = c.weight_decay as f32;
        let neg_lr = -lr as f32;
        // torch: d_p = grad.add(param, alpha=wd)
        let d = if wd == 0.0 {
            g
        } else {
            match &self.decay_mask {
                Some(mask) => g + p.clone().mul_scalar(wd) * mask.clone(),
                None => g + p.clone().mul_scalar(wd),
            }
        };
        if mu == 0.0 {
            return p + d.mul_scalar(neg_lr);
        }
        let buf = match self.first_moment.take() {
            Some(b) if self.step > 1 => b.mul_scalar(mu) + d.clone().mul_scalar(damp),
            _ => d.clone(),
        };
        let d = if nesterov { d + buf.clone().mul_scalar(mu) } else { buf.clone() };
        self.first_moment = Some(buf);
        p + d.mul_scalar(neg_lr)
    }

    fn adamw(&mut self, p: Tensor<1>, g: Tensor<1>, lr: f64) -> Tensor<1> {
        let c = &self.config;
        let (b1, b2) = (c.beta1(), c.beta2());
        let t = self.step as i32;
        // Scalars in f64 as Python computes them, then used in f32.
        let step_size = (lr / (1.0 - b1.powi(t))) as f32;
        let bc2_sqrt = (1.0 - b2.powi(t)).sqrt() as f32;
        let weight = (1.0 - b1) as f32;
        let one_minus_b2 = (1.0 - b2) as f32;
        let (b2, eps) = (b2 as f32, c.eps() as f32);
        let p = if c.weight_decay == 0.0 {
            p
        } else {
            match &self.decay_mask {
                // The host's f32 factor where the mask is 1, exactly 1 where it is 0: (d - 1) * mask + 1
                // (d - 1 is exact for d in [0.5, 1], so the masked factor rounds to d itself).
                Some(mask) => {
                    let d = (1.0 - lr * c.weight_decay) as f32;
                    p * mask.clone().mul_scalar(d - 1.0).add_scalar(1.0)
                }
                None => p.mul_scalar((1.0 - lr * c.weight_decay) as f32),
            }
        };
        let m = self.first_moment.take().expect("AdamW has a first moment");
        let v = self.second_moment.take().expect("AdamW has a second moment");
        // torch.lerp(m, g, w): m + w (g - m) for w < 0.5, else g - (g - m)(1 - w)
        let m = if weight < 0.5 {
            m.clone() + (g.clone() - m).mul_scalar(weight)
        } else {
            g.clone() - (g.clone() - m).mul_scalar(1.0 - weight)
        };
        let v = v.mul_scalar(b2) + g.clone().mul_scalar(one_minus_b2) * g;
        let denom = v.clone().sqrt().div_scalar(bc2_sqrt).add_scalar(eps);
        let p = p + m.clone().mul_scalar(-step_size) / denom;
        self.first_moment = Some(m);
        self.second_moment = Some(v);
        p
    }
}

/// Every element finite (one scalar read back).
pub(crate) fn all_finite(t: &Tensor<1>) -> bool {
    t.clone().is_finite().all().into_scalar::<bool>()
}

struct Exchange {
    generation: u64,
    arrived: usize,
    deposits: Vec<Option<Vec<Tensor<1>>>>,
    results: Vec<Option<Vec<Tensor<1>>>>,
    /// Whether the last round used the fused kernel.
    fused: bool,
    failed: Option<String>,
}

struct Shared {
    k: usize,
    timeout: Duration,
    round: Mutex<Exchange>,
    done: Condvar,
}

/// One rank's handle on an in-process group of K replicas on one device. Dropping it (a worker that
/// failed, or finished) tells the others: a rank still waiting, or calling later, gets an error at
/// once instead of a timeout.
pub struct DeviceGroup {
    rank: usize,
    shared: Arc<Shared>,
}

/// How long a rank waits for the others before the group reports them (a stuck worker thread; a
/// dead one is reported at once by its handle's drop).
pub const DEFAULT_DEVICE_GROUP_TIMEOUT: Duration = Duration::from_secs(120);

impl Drop for DeviceGroup {
    fn drop(&mut self) {
        if let Ok(mut round) = self.shared.round.lock() {
            if round.failed.is_none() {
                let how = if std::thread::panicking() { "panicked" } else { "left the group" };
                round.failed = Some(format!("rank {} {how}", self.rank));
            }
            self.shared.done.notify_all();
        }
    }
}

impl DeviceGroup {
    /// K handles, rank order.
    pub fn new(k: usize) -> Vec<DeviceGroup> {
        Self::with_timeout(k, DEFAULT_DEVICE_GROUP_TIMEOUT)
    }

    /// K handles, rank order, whose ranks wait at most `timeout` for the others at each average
    /// before failing the group ([`DeviceGroup::new`] uses [`DEFAULT_DEVICE_GROUP_TIMEOUT`]).
    pub fn with_timeout(k: usize, timeout: Duration) -> Vec<DeviceGroup> {
        let shared = Arc::new(Shared {
            k,
            timeout,
            round: Mutex::new(Exchange {
                generation: 0,
                arrived: 0,
                deposits: vec![None; k],
                results: vec![None; k],
                fused: false,
                failed: None,
            }),
            done: Condvar::new(),
        });
        (0..k).map(|rank| DeviceGroup { rank, shared: Arc::clone(&shared) }).collect()
    }

    /// This handle's rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// K, the number of replicas in the group.
    pub fn world_size(&self) -> usize {
        self.shared.k
    }

    /// Replaces each tensor of `tensors` with its element-wise mean over the K ranks (every rank passes
    /// the same number of tensors with the same lengths). Returns the averaged tensors and whether the
    /// fused device kernel did the work.
    pub fn average(&self, tensors: Vec<Tensor<1>>) -> Result<(Vec<Tensor<1>>, bool), OptimError> {
        let k = self.shared.k;
        if k == 1 {
            return Ok((tensors, false));
        }
        let err = OptimError::DeviceGroup;
        // This rank's queued work on its tensors finishes before another thread reads them.
        #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
        fused::finish_own_work(&tensors).map_err(err)?;
        let mut round = self.shared.round.lock().map_err(|_| err("a worker panicked while averaging".into()))?;
        if let Some(why) = &round.failed {
            return Err(err(why.clone()));
        }
        round.deposits[self.rank] = Some(tensors);
        round.arrived += 1;
        let generation = round.generation;
        if round.arrived == k {
            let deposits: Vec<Vec<Tensor<1>>> =
                round.deposits.iter_mut().map(|d| d.take().expect("every rank deposited")).collect();
            let outcome = average_deposits(deposits);
            round.arrived = 0;
            round.generation += 1;
            let fused = match outcome {
                Ok((per_rank, fused)) => {
                    round.results = per_rank.into_iter().map(Some).collect();
                    fused
                }
                Err(e) => {
                    round.failed = Some(e.clone());
                    self.shared.done.notify_all();
                    return Err(err(e));
                }
            };
            round.fused = fused;
            self.shared.done.notify_all();
            let mine = round.results[self.rank].take().expect("result for every rank");
            return Ok((mine, fused));
        }
        while round.generation == generation && round.failed.is_none() {
            let (r, timeout) = self
                .shared
                .done
                .wait_timeout(round, self.shared.timeout)
                .map_err(|_| err("a worker panicked while averaging".into()))?;
            round = r;
            if timeout.timed_out() && round.generation == generation {
                let missing: Vec<usize> = (0..k).filter(|&j| round.deposits[j].is_none()).collect();
                let why =
                    format!("rank(s) {missing:?} did not reach the synchronization within {:?}", self.shared.timeout);
                round.failed = Some(why.clone());
                self.shared.done.notify_all();
                return Err(err(why));
            }
        }
        // A round that completed stands even if a rank left right after it.
        if round.generation == generation {
            let why = round.failed.clone().unwrap_or_else(|| "the round did not complete".into());
            return Err(err(why));
        }
        let fused = round.fused;
        let mine = round.results[self.rank].take().expect("result for every rank");
        Ok((mine, fused))
    }
}

/// Averages slot by slot across ranks: `deposits[rank][slot]`. Returns per-rank results.
fn average_deposits(deposits: Vec<Vec<Tensor<1>>>) -> Result<(Vec<Vec<Tensor<1>>>, bool), String> {
    let k = deposits.len();
    let slots = deposits[0].len();
    if let Some(r) = deposits.iter().position(|d| d.len() != slots) {
        return Err(format!("rank {r} averages {} tensors, rank 0 {slots}", deposits[r].len()));
    }
    for s in 0..slots {
        let n = deposits[0][s].dims()[0];
        if let Some(r) = deposits.iter().position(|d| d[s].dims()[0] != n) {
            return Err(format!("tensor {s}: rank {r} has {} elements, rank 0 {n}", deposits[r][s].dims()[0]));
        }
    }
    #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
    match fused::average_in_place(&deposits)? {
        fused::InPlace::Done => return Ok((deposits, true)),
        fused::InPlace::NotCube => {}
        fused::InPlace::Unfit(why) => warn_unfit_once(&why),
    }
    let mut per_rank: Vec<Vec<Tensor<1>>> = vec![Vec::with_capacity(slots); k];
    for s in 0..slots {
        // ((t_0 + t_1) + ... + t_{K-1}) / K, as the host path and the kernel compute it.
        let mut acc = deposits[0][s].clone();
        for d in &deposits[1..] {
            acc = acc + d[s].clone();
        }
        let mean = acc.div_scalar(k as f32);
        for out in per_rank.iter_mut() {
            out.push(mean.clone());
        }
    }
    // The means run on this thread's stream before other ranks read them on theirs: under burn's
    // fusion a mean still queued here was read wrong from another stream.
    #[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
    fused::finish_own_work(&per_rank[0])?;
    Ok((per_rank, false))
}

/// Says once per process why device averages run as burn operations instead of the fused kernel.
#[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
fn warn_unfit_once(why: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        qsr_comm::notice(true, &format!("device averages run as burn operations, not qsr's fused kernel: {why}"));
    });
}

/// The cubecl path: the K ranks' buffers averaged in place by one kernel launch per slot.
#[cfg(any(feature = "cuda-plain", feature = "wgpu-plain"))]
mod fused {
    use burn::tensor::Tensor;

    #[cfg(feature = "fusion")]
    use unfused::CubeBackend;
    #[cfg(not(feature = "fusion"))]
    type CubeBackend = burn::backend::Cube;
    type CubeTensor = burn::backend::tensor::FloatTensor<CubeBackend>;

    /// burn's fused backend over cubecl is `Fusion<CubeBackend>`; the kernel needs `CubeBackend`'s
    /// buffers, which burn names only per runtime (`burn::backend::wgpu::CubeBackend`).
    #[cfg(feature = "fusion")]
    mod unfused {
        use burn::backend::fusion::{Fusion, FusionBackend};

        pub(crate) trait Unfused {
            type Inner: FusionBackend;
        }

        impl<B: FusionBackend> Unfused for Fusion<B> {
            type Inner = B;
        }

        pub(crate) type CubeBackend = <burn::backend::Cube as Unfused>::Inner;
    }

    /// `t`'s cubecl buffer, or `None` on another backend. Under fusion the operations queued on the
    /// tensor's stream run first; a clone is resolved, so fusion keeps the buffer (and sees writes to it).
    fn cube_tensor(t: &Tensor<1>) -> Option<CubeTensor> {
        let prim = t.clone().try_into_primitive::<burn::backend::Cube>().ok()?;
        #[cfg(feature = "fusion")]
        let prim = prim.client.clone().resolve_tensor_float::<CubeBackend>(prim);
        Some(prim)
    }

    /// Waits for the calling thread's queued work on `tensors` (fusion's queue, then its stream).
    pub(crate) fn finish_own_work(tensors: &[Tensor<1>]) -> Result<(), String> {
        match tensors.first() {
            Some(t) if t.clone().try_into_primitive::<burn::backend::Cube>().is_ok() => {
                t.device().sync().map_err(|e| format!("the device failed while averaging: {e:?}"))
            }
            _ => Ok(()),
        }
    }

    /// What [`average_in_place`] did.
    pub(crate) enum InPlace {
        /// Averaged by the kernel.
        Done,
        /// Not cubecl tensors (another backend): burn operations average them.
        NotCube,
        /// cubecl tensors the kernel cannot take, and why: burn operations average them.
        Unfit(String),
    }

    /// The K ranks' deposits averaged in place, one launch per slot, when they are plain cubecl f32
    /// buffers of exactly their length.
    pub(crate) fn average_in_place(deposits: &[Vec<Tensor<1>>]) -> Result<InPlace, String> {
        if deposits.len() > qsr_kernels::cube::MAX_BUFFERS {
            let max = qsr_kernels::cube::MAX_BUFFERS;
            return Ok(InPlace::Unfit(format!("{} ranks, beyond the kernel's {max} buffers", deposits.len())));
        }
        let mut plan = Vec::with_capacity(deposits[0].len());
        for s in 0..deposits[0].len() {
            let len = deposits[0][s].dims()[0];
            let mut handles = Vec::with_capacity(deposits.len());
            let mut client = None;
            for d in deposits {
                let Some(prim) = cube_tensor(&d[s]) else { return Ok(InPlace::NotCube) };
                if let Some(why) = unfit(&prim, len, deposits.len()) {
                    return Ok(InPlace::Unfit(format!("tensor {s}: {why}")));
                }
                client.get_or_insert(prim.client.clone());
                handles.push(prim.handle.clone());
            }
            plan.push((client.expect("at least one rank"), handles, len));
        }
        // Every rank finished its own work before depositing (`finish_own_work`); the kernels finish
        // before any rank reads the results on its own stream.
        let mut last = None;
        for (client, handles, len) in plan {
            qsr_kernels::cube::average_and_broadcast_many(&client, &handles, len).map_err(|e| e.to_string())?;
            last = Some(client);
        }
        if let Some(client) = last {
            qsr_kernels::cube::sync(&client).map_err(|e| e.to_string())?;
        }
        Ok(InPlace::Done)
    }

    /// Why the kernel cannot average `prim` of `len` values across `k` ranks, if it cannot.
    fn unfit(prim: &CubeTensor, len: usize, k: usize) -> Option<String> {
        if !k.checked_mul(len).is_some_and(|n| n <= u32::MAX as usize) {
            Some(format!("{k} x {len} values exceed the kernel's u32 indices"))
        } else if !prim.is_contiguous() || prim.handle.size_in_used() != (len * 4) as u64 {
            Some("a view, not a whole contiguous buffer".into())
        } else if prim.dtype != burn::tensor::DType::F32 {
            Some(format!("{:?}, not f32", prim.dtype))
        } else {
            None
        }
    }
}
