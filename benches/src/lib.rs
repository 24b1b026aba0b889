//! Criterion benches of qsr live in `benches/`; run them with `cargo xtask bench`.
