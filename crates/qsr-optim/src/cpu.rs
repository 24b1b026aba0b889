//! What the CPU can do, asked once per call site.

/// Whether `mul_add` can be one instruction (then the loops of the optimizers vectorize; otherwise it
/// is a libm `fmaf` call per element). Either way it rounds once, so the results are the same.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}
