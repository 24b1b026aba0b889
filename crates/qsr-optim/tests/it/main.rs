//! The integration tests of qsr-optim (optimizers, the driver and the Averager): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

// Tests write their fixtures with std; the code under test opens paths through qsr-files.
#![allow(clippy::disallowed_methods)]

mod common;

mod averager;
mod averager_muon;
mod averager_schedule;
mod averager_streaming;
mod device_wgpu;
mod driver;
mod streaming;
mod torch_fixtures;
mod torch_muon;
