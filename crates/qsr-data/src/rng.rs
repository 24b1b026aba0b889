//! Deterministic random streams. Every stream is a ChaCha8 generator whose 32-byte key is built from the
//! tuple it belongs to (e.g. seed, epoch, sample index, purpose), so results depend only on that tuple and never
//! on thread scheduling, rank or world size. Integer and float draws are done here from raw `u64`s (not with
//! `rand`'s distribution helpers) so the data order cannot change when `rand` changes its algorithms.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Purpose tags keep streams for different uses independent even for equal numbers.
pub(crate) const TAG_PERMUTATION: u64 = 0x7065_726d_5f71_7372; // "perm_qsr"
pub(crate) const TAG_AUGMENT: u64 = 0x6175_676d_5f71_7372; // "augm_qsr"

/// A stream keyed by four words.
pub fn stream(a: u64, b: u64, c: u64, tag: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[0..8].copy_from_slice(&a.to_le_bytes());
    key[8..16].copy_from_slice(&b.to_le_bytes());
    key[16..24].copy_from_slice(&c.to_le_bytes());
    key[24..32].copy_from_slice(&tag.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// Uniform integer in `0..n` (n > 0), unbiased (Lemire's multiply-and-reject).
pub fn below(rng: &mut impl RngCore, n: u64) -> u64 {
    debug_assert!(n > 0);
    let threshold = n.wrapping_neg() % n;
    loop {
        let m = u128::from(rng.next_u64()) * u128::from(n);
        if (m as u64) >= threshold {
            return (m >> 64) as u64;
        }
    }
}

/// Uniform float in `[0, 1)` with 53 random bits.
pub fn unit(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Uniform float in `[lo, hi)`.
pub fn uniform(rng: &mut impl RngCore, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * unit(rng)
}

/// Fisher-Yates permutation of `0..n`.
pub fn permutation(rng: &mut impl RngCore, n: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = below(rng, i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}
