use serde::{Deserialize, Serialize};

/// Bytes one rank sends (and receives) in a ring all-reduce of `params` elements of `bytes_per_elem`
/// bytes across `world_size` ranks: reduce-scatter then all-gather move `2 (K-1)/K` of the buffer.
/// Zero for a single rank.
pub fn ring_allreduce_bytes_per_rank(params: u64, bytes_per_elem: u64, world_size: u64) -> u64 {
    if world_size <= 1 {
        return 0;
    }
    let total = u128::from(params) * u128::from(bytes_per_elem);
    let moved = 2 * u128::from(world_size - 1) * total / u128::from(world_size);
    u64::try_from(moved).unwrap_or(u64::MAX)
}

/// Communication of a whole run under a ring all-reduce, per rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommVolume {
    /// Synchronizations (all-reduces of the model) over the run: the plan's round count.
    pub syncs: u64,
    /// Optimizer steps the run performs (`run_steps`).
    pub steps: u64,
    /// `100 * syncs / steps`; data parallel is 100.
    pub comm_percent: f64,
    /// Bytes one rank sends in one ring all-reduce of the model ([`ring_allreduce_bytes_per_rank`]).
    pub bytes_per_sync: u64,
    /// `syncs * bytes_per_sync`, saturating.
    pub bytes_per_rank: u64,
    /// What data parallel would send over the same steps.
    pub data_parallel_bytes_per_rank: u64,
}

impl CommVolume {
    /// Volume of `syncs` all-reduces over `steps` steps, each of `params` elements of `bytes_per_elem` bytes
    /// (4 for f32) across `world_size` = K ranks. `comm_percent` is 0 when `steps` is 0.
    pub fn new(syncs: u64, steps: u64, params: u64, bytes_per_elem: u64, world_size: u64) -> Self {
        let bytes_per_sync = ring_allreduce_bytes_per_rank(params, bytes_per_elem, world_size);
        CommVolume {
            syncs,
            steps,
            comm_percent: if steps == 0 { 0.0 } else { 100.0 * syncs as f64 / steps as f64 },
            bytes_per_sync,
            bytes_per_rank: syncs.saturating_mul(bytes_per_sync),
            data_parallel_bytes_per_rank: steps.saturating_mul(bytes_per_sync),
        }
    }
}
