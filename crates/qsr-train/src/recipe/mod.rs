//! Recipes: the TOML file of a run, resolved into typed sections. [`TrainRecipe`] is the whole recipe
//! of `qsr train`; [`load_plan`] reads only what a round plan needs (`[schedule]` and `[sync]`), for
//! `qsr plan`.

mod errors;
mod plan;
mod sets;
mod train;

pub(crate) use plan::{Beside, budget_alpha, read_table};
pub use plan::{PlanOverrides, PlanRecipe, load_plan};
pub use train::{CheckpointConfig, DataConfig, EvalConfig, TrainConfig, TrainRecipe};
pub(crate) use train::{open_corpus, open_dataset};
