//! The integration tests of qsr-comm (collectives): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

// Tests write their fixtures with std; the code under test opens paths through qsr-files.
#![allow(clippy::disallowed_methods)]

mod bf16;
mod common;
mod doubling;
mod hosts;
mod inproc;
mod launch_fuzz;
mod processes;
mod quantized;
mod shm;
mod tcp_faults;
mod tcp_launch;
mod tcp_threads;
