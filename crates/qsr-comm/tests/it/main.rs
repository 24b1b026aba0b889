//! The integration tests of qsr-comm (collectives): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

mod common;
// The wire protocol is private to qsr-comm; the tests compile its source file to reach it.
mod bf16;
mod doubling;
mod hosts;
mod inproc;
mod processes;
mod quantized;
mod shm;
mod tcp_faults;
mod tcp_launch;
mod tcp_threads;
#[allow(dead_code)]
#[path = "../../src/wire.rs"]
mod wire;
mod wire_fuzz;
