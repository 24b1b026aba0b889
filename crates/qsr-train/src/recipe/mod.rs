//! Recipes: the TOML file of a run, resolved into typed sections. [`TrainRecipe`] is the whole recipe
//! of `qsr train`; [`load_plan`] reads only what a round plan needs (`[schedule]` and `[sync]`), for
//! `qsr plan`.

mod plan;
mod train;

pub(crate) use plan::read_table;
pub use plan::{
    LocalSync, PlanOverrides, PlanRecipe, StreamingSync, SyncSection, fragment_plan, load_plan, streaming_warnings,
};
pub use train::{CheckpointConfig, DataConfig, EvalConfig, TrainConfig, TrainRecipe};
pub(crate) use train::{open_corpus, open_dataset};
