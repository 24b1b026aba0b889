//! The authors' data order (documented on [`ShardedSampler`]).

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::rng;

/// Everything that determines the order; serializable so checkpoints can record (and check) it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Number of samples N in the dataset.
    pub len: usize,
    /// K, the number of workers.
    pub world_size: usize,
    /// This worker, `0..world_size`.
    pub rank: usize,
    /// B/K, samples per worker per optimizer step (all micro-batches together).
    pub local_batch: usize,
    /// Steps per epoch; `None` = `floor(N / (K * local_batch))` (drop the remainder, as the authors do).
    pub steps_per_epoch: Option<usize>,
    /// Seed of the per-epoch permutations (the recipe's top-level `seed` in `qsr train`); it also keys augmentation.
    pub seed: u64,
}

/// Where a global step falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EpochStep {
    /// 0-based epoch, `global_step / steps_per_epoch`.
    pub epoch: u64,
    /// Step within the epoch, `0..steps_per_epoch`.
    pub step: u64,
}

/// The sampler position for a checkpoint: the config it was made with and the next global step to read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The sampler's settings; [`ShardedSampler::from_state`] validates them again.
    pub config: SamplerConfig,
    /// Next global step (0-based) whose batch is to be read.
    pub next_step: u64,
}

/// Per-epoch permuted, sharded sampler. Cheap to clone; caches the permutation of the last epoch asked for.
///
/// The authors' data order (paper.md, "Data order"): each epoch one global permutation of all N indices, the same
/// on every worker (a ChaCha8 stream keyed by seed, epoch and N), split into K disjoint shards strided like torch's
/// `DistributedSampler` (worker k takes `perm[k], perm[k+K], ...`); every worker uses exactly
/// `steps_per_epoch * local_batch` samples of its shard, so over one epoch the union of the shards is the prefix
/// `perm[..K * steps_per_epoch * local_batch]`. Rounds are not aligned to epochs: the trainer asks for the batch of
/// a *global step* and the sampler maps it to (epoch, step in epoch). A batch is a pure function of
/// (seed, rank, world size, global step), so a resumed run sees exactly the same data.
#[derive(Debug)]
pub struct ShardedSampler {
    config: SamplerConfig,
    steps_per_epoch: usize,
    cache: Mutex<Option<(u64, Arc<Vec<u32>>)>>,
}

impl Clone for ShardedSampler {
    fn clone(&self) -> Self {
        let cache = self.cache.lock().map(|c| c.clone()).unwrap_or(None);
        ShardedSampler { config: self.config.clone(), steps_per_epoch: self.steps_per_epoch, cache: Mutex::new(cache) }
    }
}

impl PartialEq for ShardedSampler {
    fn eq(&self, other: &Self) -> bool {
        self.config == other.config
    }
}

impl ShardedSampler {
    /// Validates the config: K >= 1, rank < K, local_batch >= 1, at least one step per epoch, and a given
    /// `steps_per_epoch` no larger than `floor(N / (K * local_batch))` (shards must stay disjoint).
    pub fn new(config: SamplerConfig) -> Result<Self> {
        let c = &config;
        if c.world_size == 0 || c.rank >= c.world_size {
            return Err(DataError::Config(format!("rank {} not in 0..world_size {}", c.rank, c.world_size)));
        }
        if c.local_batch == 0 {
            return Err(DataError::Config("local_batch must be at least 1".into()));
        }
        if c.len > u32::MAX as usize {
            return Err(DataError::Config(format!("dataset of {} samples exceeds u32 indices", c.len)));
        }
        let max_steps = c.len / (c.world_size * c.local_batch);
        let steps = c.steps_per_epoch.unwrap_or(max_steps);
        if steps == 0 || steps > max_steps {
            return Err(DataError::Config(format!(
                "steps_per_epoch {steps} impossible: N = {} with K = {} workers x local batch {} allows 1..={max_steps}",
                c.len, c.world_size, c.local_batch
            )));
        }
        Ok(ShardedSampler { config, steps_per_epoch: steps, cache: Mutex::new(None) })
    }

    /// Shorthand for the default steps per epoch.
    pub fn simple(len: usize, world_size: usize, rank: usize, local_batch: usize, seed: u64) -> Result<Self> {
        Self::new(SamplerConfig { len, world_size, rank, local_batch, steps_per_epoch: None, seed })
    }

    /// The same sampler for another rank (same seed and shape).
    pub fn for_rank(&self, rank: usize) -> Result<Self> {
        Self::new(SamplerConfig { rank, ..self.config.clone() })
    }

    /// The settings the sampler was made with.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }
    /// Steps per epoch in effect: the configured value, or `floor(N / (K * local_batch))` by default.
    pub fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }
    /// Samples per worker per optimizer step, B/K.
    pub fn local_batch(&self) -> usize {
        self.config.local_batch
    }
    /// Samples this worker uses per epoch (`steps_per_epoch * local_batch`).
    pub fn shard_len(&self) -> usize {
        self.steps_per_epoch * self.config.local_batch
    }

    /// (epoch, step in epoch) of a global step.
    pub fn position(&self, global_step: u64) -> EpochStep {
        let s = self.steps_per_epoch as u64;
        EpochStep { epoch: global_step / s, step: global_step % s }
    }

    /// Inverse of [`position`](Self::position).
    pub fn global_step(&self, pos: EpochStep) -> u64 {
        pos.epoch * self.steps_per_epoch as u64 + pos.step
    }

    /// The global permutation of epoch `epoch`, identical on every rank.
    pub fn permutation(&self, epoch: u64) -> Arc<Vec<u32>> {
        if let Ok(guard) = self.cache.lock()
            && let Some((e, p)) = guard.as_ref()
            && *e == epoch
        {
            return p.clone();
        }
        let mut r = rng::stream(self.config.seed, epoch, self.config.len as u64, rng::TAG_PERMUTATION);
        let p = Arc::new(rng::permutation(&mut r, self.config.len));
        if let Ok(mut guard) = self.cache.lock() {
            *guard = Some((epoch, p.clone()));
        }
        p
    }

    /// This worker's samples of `epoch`, in the order it uses them: `perm[rank + K*j]`, `j < shard_len`.
    pub fn shard(&self, epoch: u64) -> Vec<usize> {
        let p = self.permutation(epoch);
        let k = self.config.world_size;
        (0..self.shard_len()).map(|j| p[self.config.rank + k * j] as usize).collect()
    }

    /// Sample indices of this worker's local batch at `global_step`.
    pub fn batch_indices(&self, global_step: u64) -> Vec<usize> {
        let EpochStep { epoch, step } = self.position(global_step);
        let p = self.permutation(epoch);
        let (k, b) = (self.config.world_size, self.config.local_batch);
        let start = step as usize * b;
        (start..start + b).map(|j| p[self.config.rank + k * j] as usize).collect()
    }

    /// The local batch of `global_step` split into its micro-batches, in order (gradient accumulation).
    pub fn micro_batch_indices(&self, global_step: u64, micro_batch: usize) -> Result<Vec<Vec<usize>>> {
        check_micro(self.config.local_batch, micro_batch)?;
        Ok(self.batch_indices(global_step).chunks(micro_batch).map(<[usize]>::to_vec).collect())
    }

    /// Checkpoint state whose next step is `next_step`.
    pub fn state(&self, next_step: u64) -> SamplerState {
        SamplerState { config: self.config.clone(), next_step }
    }

    /// Rebuilds the sampler from a checkpoint; returns it with the step to continue at.
    pub fn from_state(state: &SamplerState) -> Result<(Self, u64)> {
        Ok((Self::new(state.config.clone())?, state.next_step))
    }
}

/// `local_batch = micro_batch * accumulation_steps` must hold exactly.
pub fn check_micro(local_batch: usize, micro_batch: usize) -> Result<usize> {
    if micro_batch == 0 || !local_batch.is_multiple_of(micro_batch) {
        return Err(DataError::Config(format!(
            "micro-batch {micro_batch} does not divide the local batch {local_batch}"
        )));
    }
    Ok(local_batch / micro_batch)
}
