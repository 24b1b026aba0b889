//! The integration tests of qsr-sched (schedules, rules and plans): one test binary, a module per area, so
//! that a cold build links one binary rather than one per file.

mod fragment;
mod local;
mod paper;
mod props;
mod validation;
