//! The qsr reference trainer. For now it plans: `qsr plan` turns a recipe's lr schedule and sync rule into
//! the exact round plan, its communication share and a picture of lr and H over training. Later layers
//! (models, data, the round driver) compose here into `qsr train`; this crate owns no method logic.

pub mod plan_cmd;
pub mod plot;
pub mod recipe;
