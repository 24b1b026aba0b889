//! Initial weights that depend only on a seed, whatever the threads around them.

use burn::module::Module;
use burn::tensor::Device;

use crate::flat::ParamLayout;

/// Builds a model whose initial weights depend only on `seed`: burn draws them from one global RNG that
/// every thread shares, so a threaded run (or two tests at once) otherwise starts from other weights
/// each time. Seeds `device`'s RNG and runs `init` under a process-wide lock, initializing every
/// parameter before the lock is released (burn initializes them lazily, at first use).
///
/// ```
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::Device;
/// let device = Device::flex();
/// let a: Linear = qsr_optim::seeded_init(&device, 7, || LinearConfig::new(4, 2).init(&device));
/// let b: Linear = qsr_optim::seeded_init(&device, 7, || LinearConfig::new(4, 2).init(&device));
/// assert_eq!(a.weight.val().into_data(), b.weight.val().into_data());
/// ```
pub fn seeded_init<M: Module>(device: &Device, seed: u64, init: impl FnOnce() -> M) -> M {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    device.seed(seed);
    let model = init();
    let layout = ParamLayout::of(&model);
    let mut values = vec![0.0; layout.len()];
    // Reading every parameter draws its lazily initialized values now, under the lock.
    let _ = layout.read_params(&model, &mut values);
    model
}
