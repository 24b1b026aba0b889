//! The integration tests of qsr-models (models): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

mod batch_norm;
mod common;
mod config;
mod forward_shapes;
mod fused;
mod gpt;
mod param_counts;
mod training;
mod vit_reference;
