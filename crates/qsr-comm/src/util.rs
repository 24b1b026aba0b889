//! Helpers over any [`Collective`], below the backends and the launch code that use them.

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

/// Says something the person running the job must see: through `tracing` when the program
/// installed a subscriber, else on stderr (the rank's log), since a library can assume neither.
pub fn notice(warning: bool, msg: &str) {
    if warning {
        if tracing::enabled!(tracing::Level::WARN) {
            tracing::warn!("{msg}");
        } else {
            eprintln!("qsr-comm: warning: {msg}");
        }
    } else if tracing::enabled!(tracing::Level::INFO) {
        tracing::info!("{msg}");
    } else {
        eprintln!("qsr-comm: {msg}");
    }
}

/// The bytes of `f`, to send or receive in place (the TCP ring and shared memory alike).
pub(crate) fn f32_bytes_mut(f: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no padding and every bit pattern is a valid f32 and a valid [u8; 4]; the
    // returned slice covers exactly the same memory and borrows `f` mutably.
    unsafe { std::slice::from_raw_parts_mut(f.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(f)) }
}
