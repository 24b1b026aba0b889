//! Learning-rate schedules, synchronization rules and the round planner of local gradient methods.
//!
//! This crate answers, for every global step `t`, the two questions everything else in qsr depends on:
//! *what is the learning rate* and *does step `t` end a round* (a synchronization). It implements the
//! Quadratic Synchronization Rule (QSR, Gu et al., ICLR 2024) and the baselines of the paper with the exact
//! semantics of the authors' code, so that the paper's communication numbers are reproduced to the round:
//!
//! ```
//! use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
//!
//! // ViT-B, Local AdamW, 300 epochs of 312 steps, QSR with h_base = 4, alpha = 0.0175.
//! let schedule = LrSchedule::new(ScheduleKind::Cosine, 93_600, 10_000, 0.008, 1e-6);
//! let plan = Plan::new(schedule, SyncRule::Qsr { h_base: 4, alpha: 0.0175 }).unwrap();
//! let summary = plan.summary();
//! assert_eq!(summary.rounds, 9_711);
//! assert_eq!(format!("{:.1}", summary.comm_percent), "10.4");
//! ```
//!
//! The crate is pure: no I/O, no clock, no randomness. Same inputs, same rounds.

#![forbid(unsafe_code)]

mod budget;
mod comm;
mod error;
mod fragment;
mod local;
mod meet;
mod plan;
mod round;
mod rule;
mod schedule;
mod section;

pub use budget::{alpha_for_budget, least_alpha_within};
pub use comm::{CommVolume, Encoding, ring_allreduce_bytes_per_rank};
pub use error::ConfigError;
pub use fragment::{
    FragmentPlan, FragmentSummary, FragmentSync, MAX_FRAGMENTS, fragments_syncing_after, split_elements, split_tensors,
};
pub use local::LocalSummary;
pub use meet::{APART_FLOOR, APART_SHARE, Apart, round_apart};
pub use plan::{Cursor, Plan, PlanSummary, Rounds, StepInfo};
pub use round::{Round, SyncMode};
pub use rule::{RoundStart, SyncRule};
pub use schedule::{LrSchedule, ScheduleKind};
pub use section::{LocalSync, StreamingConfig, SyncSection};

/// Largest `total_steps` / run length a plan accepts (10^9 steps). Planning is O(rounds), so this
/// bounds the worst case (data parallel, a round per step) to seconds (measurements:
/// docs/BENCHMARKS.md, section "Planning (qsr-sched)"); the largest published training runs take
/// about 10^6 steps.
pub const MAX_STEPS: u64 = 1_000_000_000;
