//! Helpers below the backends and the launch code that use them: over any [`Collective`], and the
//! arithmetic every backend shares (bf16 rounding, ring traffic, sized broadcasts, balanced splits).

use crate::{Collective, CommError};

/// Every rank's `mine`, in rank order (one broadcast per rank: for setup, not for data).
pub(crate) fn all_gather_bytes(comm: &mut dyn Collective, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
    (0..comm.world_size())
        .map(|root| {
            let mut b = if root == comm.rank() { mine.to_vec() } else { Vec::new() };
            comm.broadcast_bytes(&mut b, root)?;
            Ok(b)
        })
        .collect()
}

/// The bytes of `f`, to send or receive in place (the TCP ring and shared memory alike).
pub(crate) fn f32_bytes_mut(f: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no padding and every bit pattern is a valid f32 and a valid [u8; 4]; the
    // returned slice covers exactly the same memory and borrows `f` mutably.
    unsafe { std::slice::from_raw_parts_mut(f.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(f)) }
}

/// `x` rounded to bf16 (round to nearest even), as the f32 it stands for.
pub(crate) fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Bytes one rank sends (and receives) in a ring all-reduce of `len` elements over `k` ranks: `2 (k-1)/k`
/// of the buffer. Every backend accounts its all-reduce traffic with this (as qsr-sched plans it), so
/// simulated, TCP and NCCL runs report comparable bytes.
/// Elements are `elem_bytes` bytes on the wire (4 for f32, 2 for bf16).
pub(crate) fn ring_allreduce_bytes(len: usize, elem_bytes: u64, k: usize) -> u64 {
    if k <= 1 {
        return 0;
    }
    (len as u64 * elem_bytes) * 2 * (k as u64 - 1) / k as u64
}

/// Largest payload `broadcast_bytes` accepts (a bound on what a peer can make us allocate).
pub const MAX_BROADCAST_BYTES: usize = 256 << 20;

/// `broadcast_bytes` over a raw byte broadcast `raw(buf, is_length)`: the length first (even when
/// too large, so that every rank checks it against [`MAX_BROADCAST_BYTES`] and fails alike), then
/// the payload into `bytes`, resized on non-roots. A payload over the bound is
/// `CommError::InvalidArgument` on every rank; the caller marks itself broken on any error.
pub(crate) fn broadcast_sized(
    bytes: &mut Vec<u8>,
    root: usize,
    rank: usize,
    mut raw: impl FnMut(&mut [u8], bool) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let mut len = (bytes.len() as u64).to_le_bytes();
    raw(&mut len, true)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_BROADCAST_BYTES as u64 {
        let e = format!("rank {root} broadcasts {len} bytes, more than the bound {MAX_BROADCAST_BYTES}");
        return Err(CommError::InvalidArgument(e));
    }
    if rank != root {
        bytes.clear();
        bytes.resize(len as usize, 0);
    }
    raw(bytes, false)
}

/// Balanced split of `len` elements into `parts` contiguous ranges: the first `len % parts` ranges
/// get one extra element. Shared by the in-process and ring backends.
pub(crate) fn split_range(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let rem = len % parts;
    let start = i * base + i.min(rem);
    let size = base + usize::from(i < rem);
    start..start + size
}
