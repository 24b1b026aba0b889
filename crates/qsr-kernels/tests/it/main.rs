//! The integration tests of qsr-kernels (fused averaging kernels): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

mod cube_wgpu;
mod host;
mod quant;
