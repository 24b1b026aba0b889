//! The lr schedule a caller's loop follows ([`AveragerConfig::schedule`](super::AveragerConfig::schedule)):
//! a clone of its burn scheduler, the loop's steps, and a digest of the lrs, which the ranks compare.

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::LearningRate;
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

/// The lr schedule a loop follows, for [`AveragerConfig::schedule`](super::AveragerConfig::schedule): a clone of the caller's burn
/// scheduler before its first step, the steps the loop takes, and a digest of the lrs it gives over
/// them (what the ranks compare at construction, and a saved state records).
#[derive(Clone)]
pub struct Schedule {
    sched: ModuleLrScheduler,
    steps: u64,
    digest: String,
}

impl Schedule {
    /// `sched` (cloned, not stepped) over `steps` steps.
    pub(super) fn new(sched: ModuleLrScheduler, steps: u64) -> Self {
        let mut hasher = Sha256::new();
        let mut sampled = sched.clone();
        for _ in 0..steps {
            hasher.update(sampled.step().base().to_le_bytes());
        }
        let digest = hasher.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
        Self { sched, steps, digest }
    }

    /// The schedule whose steps use `lrs`, in order.
    pub(super) fn of_lrs(lrs: Vec<f64>) -> Self {
        let steps = lrs.len() as u64;
        Self::new(Sampled { lrs: lrs.into(), at: 0 }.into(), steps)
    }

    /// The steps the loop takes.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// A clone of the scheduler before its first step.
    pub(super) fn scheduler(&self) -> ModuleLrScheduler {
        self.sched.clone()
    }

    /// Its lrs, step by step.
    pub(super) fn lrs(&self) -> impl Iterator<Item = f64> + use<> {
        let mut sched = self.sched.clone();
        (0..self.steps).map(move |_| sched.step().base())
    }
}

impl std::fmt::Debug for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schedule").field("steps", &self.steps).field("lrs", &self.digest).finish()
    }
}

impl PartialEq for Schedule {
    fn eq(&self, other: &Self) -> bool {
        (self.steps, &self.digest) == (other.steps, &other.digest)
    }
}

impl Serialize for Schedule {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serde_json::json!({ "steps": self.steps, "lrs": self.digest }).serialize(serializer)
    }
}

/// A scheduler that replays sampled lrs ([`Schedule::of_lrs`]); past them, the last one.
#[derive(Clone)]
struct Sampled {
    lrs: std::sync::Arc<[f64]>,
    at: usize,
}

impl LrScheduler for Sampled {
    fn step(&mut self) -> LearningRate {
        let lr = self.lrs.get(self.at).or(self.lrs.last()).copied().unwrap_or(0.0);
        self.at += 1;
        lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::default()
    }

    fn load_record(&mut self, _record: LrSchedulerRecord) {}
}
