//! The integration tests of qsr-optim (optimizers, the driver and the Averager): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

mod common;

mod averager;
mod averager_streaming;
mod device_wgpu;
mod driver;
mod streaming;
mod torch_fixtures;
