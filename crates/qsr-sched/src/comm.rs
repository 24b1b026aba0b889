//! Communication accounting: how a payload is laid out on the wire ([`Encoding`]) and the bytes a
//! ring all-reduce moves per rank, per sync and over a plan ([`CommVolume`]).

use serde::{Deserialize, Serialize};

/// How a payload of values is laid out on the wire: `per_value` bytes each, plus `per_block` bytes
/// for every block of `block` values (a quantized payload's scales). `Encoding::F32` is 4 bytes per
/// value; int8 with one f32 scale per 64 values is `Encoding::quantized(64)`, 1 + 4/64 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Encoding {
    /// Bytes of each value.
    pub per_value: u64,
    /// Bytes added per block of values (0 for plain floats).
    pub per_block: u64,
    /// Values per block (at least 1).
    pub block: u64,
}

impl Encoding {
    /// f32: 4 bytes per value.
    pub const F32: Encoding = Encoding::plain(4);
    /// bf16: 2 bytes per value.
    pub const BF16: Encoding = Encoding::plain(2);

    /// `bytes` bytes per value and nothing else.
    pub const fn plain(bytes: u64) -> Encoding {
        Encoding { per_value: bytes, per_block: 0, block: 1 }
    }

    /// One byte per value and an f32 scale per `block` values (int8, fp8); `block` 0 counts as 1.
    pub const fn quantized(block: u64) -> Encoding {
        Encoding { per_value: 1, per_block: 4, block: if block == 0 { 1 } else { block } }
    }

    /// Codes narrower than a byte, packed, and an f32 scale per `block` values: `bits` bits per value
    /// (int4: 4, int2: 2), every block counted whole, as the ring sends them (`block` 0 counts as 1).
    pub const fn packed(bits: u64, block: u64) -> Encoding {
        let block = if block == 0 { 1 } else { block };
        Encoding { per_value: 0, per_block: 4 + (block * bits).div_ceil(8), block }
    }

    /// Bytes of one block of values on the wire.
    fn block_bytes(&self) -> u128 {
        u128::from(self.block.max(1)) * u128::from(self.per_value) + u128::from(self.per_block)
    }

    /// Bytes of `values` values (the last block may be shorter; it still carries its `per_block`).
    pub fn bytes(&self, values: u64) -> u64 {
        let blocks = values.div_ceil(self.block.max(1));
        let total = u128::from(values) * u128::from(self.per_value) + u128::from(blocks) * u128::from(self.per_block);
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// Bytes per value, scales included, of a long payload (for rates and ratios).
    pub fn bytes_per_value(&self) -> f64 {
        self.block_bytes() as f64 / self.block.max(1) as f64
    }
}

/// Bytes one rank sends (and receives) in a ring all-reduce of `params` values in `encoding` across
/// `world_size` ranks: reduce-scatter then all-gather move `2 (K-1)/K` of the buffer, whose segments
/// are whole blocks (a last short block counted whole, as the ring pads it). Zero for a single rank.
pub fn ring_allreduce_bytes_per_rank(params: u64, encoding: Encoding, world_size: u64) -> u64 {
    if world_size <= 1 {
        return 0;
    }
    let total = u128::from(params.div_ceil(encoding.block.max(1))) * encoding.block_bytes();
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
    /// Volume of `syncs` all-reduces over `steps` steps, each of `params` values in `encoding`
    /// ([`Encoding::F32`] for f32) across `world_size` = K ranks. `comm_percent` is 0 when `steps` is 0.
    pub fn new(syncs: u64, steps: u64, params: u64, encoding: Encoding, world_size: u64) -> Self {
        let bytes_per_sync = ring_allreduce_bytes_per_rank(params, encoding, world_size);
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
