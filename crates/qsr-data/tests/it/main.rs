//! The integration tests of qsr-data (datasets, samplers and loaders): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

// Tests write their fixtures with std; the code under test opens paths through qsr-files.
#![allow(clippy::disallowed_methods)]

mod augment;
mod burn_shard;
mod digits;
mod loader;
mod readers;
mod real_data;
mod sampler;
mod text;
