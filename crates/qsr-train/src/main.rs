//! The `qsr` command line: plan, train, compare, plot, simulate, device-check, time-step, rendezvous,
//! launch (parsed and run by qsr-train's `cli`).

use std::process::ExitCode;

use clap::Parser;

/// glibc gives large freed blocks back to the kernel at once, and a training step frees and allocates
/// the same activation sizes every step: the kernel then clears fresh pages for each one (a sixth of
/// the medium GPT step on the CPU). Raising the thresholds to glibc's maximum keeps them for reuse;
/// the process keeps its peak heap, as a caching allocator does. The threads of the workers' compute
/// pools allocate from glibc's per-thread arenas, which unmap a whole 64 MiB heap once it empties
/// (whatever the trim threshold); a top pad of one heap keeps those too (medium GPT: 1.25x).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's tunables, and no other thread exists yet to allocate meanwhile.
    unsafe {
        // 32 MiB is the largest mmap threshold glibc accepts on 64-bit targets.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    qsr_train::run(qsr_train::Cli::parse())
}
