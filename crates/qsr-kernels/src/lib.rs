//! Fused flat-buffer operations used by parameter averaging.
//!
//! With K simulated workers in one process, a synchronization averages K replicas of the model: a pure
//! memory-bandwidth operation. [`average_and_broadcast`] reads every buffer once and writes the mean back
//! to all of them in the same pass (K reads + K writes per element, the minimum), instead of a mean into
//! a temporary followed by K copies.
//!
//! Every function here is deterministic: element `i` of the result is
//! `((b_0[i] + b_1[i]) + ... + b_{K-1}[i]) / K`, summed in f32 in rank order, independent of the
//! thread count and chunking, so every worker ends with bit-identical parameters.
//!
//! ```
//! // Two workers' flat parameters; after the call both hold their mean.
//! let mut a = vec![1.0f32, 2.0, 3.0];
//! let mut b = vec![3.0f32, 6.0, -1.0];
//! qsr_kernels::average_and_broadcast(&mut [a.as_mut_slice(), b.as_mut_slice()]);
//! assert_eq!(a, [2.0, 4.0, 1.0]);
//! assert_eq!(a, b);
//!
//! // Or the mean into a separate buffer, inputs untouched.
//! let mut out = vec![0.0f32; 3];
//! qsr_kernels::mean_into(&mut out, &[&[1.0, 1.0, 1.0], &[3.0, 5.0, 7.0]]);
//! assert_eq!(out, [2.0, 3.0, 4.0]);
//! ```
//!
//! `cargo run --release -p qsr-kernels --example fused_average` checks the fused kernel against a naive mean
//! on K = 4 buffers of 4 Mi elements and prints its bandwidth.
//!
//! Feature `cube` (through `wgpu` or `cuda`) adds the same operations as cubecl kernels on device buffers
//! (module `cube`) and the device check behind `qsr device-check` and `scripts/gpu-check.sh`:
//! `check_correctness` (the kernels bit for bit against the host path) and `measure_bandwidth` (the fused
//! kernel against a device copy of the same bytes).

mod host;
mod quant;

// cubecl kernels for replicas on a device (wgpu here, CUDA on a GPU machine); documented in cube.rs (an outer
// doc here would make rustdoc resolve that file's links from the crate root). A public module, not root
// re-exports: its `average_and_broadcast` and `mean_into` (device buffers) would clash with the host functions
// of the same names at the root, so the family stays `qsr_kernels::cube::*`.
#[cfg(feature = "cube")]
pub mod cube;

// Private: its items (no clash with the host path) are re-exported at the root below.
#[cfg(feature = "cube")]
mod device_check;

#[cfg(feature = "cube")]
pub use device_check::{Bandwidth, CaseResult, check_correctness, measure_bandwidth, random_replicas};
pub use host::{average_and_broadcast, mean_into, reduce_and_broadcast_serial, sum_into};
pub use quant::{Codec, ErrorFeedback, Quantized, WIRE_BLOCK, fp8_decode, fp8_encode};

/// Elements per parallel task: large enough to amortize scheduling, small enough to balance 2..64 cores.
pub const CHUNK: usize = 1 << 16;
