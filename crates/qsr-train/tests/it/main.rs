//! The integration tests of qsr-train (the `qsr` binary and the trainer library): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

// Tests write their fixtures with std; the code under test opens paths through qsr-files.
#![allow(clippy::disallowed_methods)]

mod common;
mod elastic;
mod file_table;
mod hardening;
mod launch;
mod plan_cli;
mod recipes;
mod simulate;
mod srun;
mod sync_check;
mod text;
mod time_step;
mod train_cli;
