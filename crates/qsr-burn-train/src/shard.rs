//! The training loader cut into equal slices, one per replica.

use burn::train::{LearnerModel, TrainLoader};

/// `k` contiguous slices of `items / k` items each (the remainder dropped, so every replica takes the
/// same number of steps), cut in rank order: thread and process launches give rank `r` the same slice.
pub(crate) fn split<M: LearnerModel>(loader: &TrainLoader<M>, k: usize) -> Vec<TrainLoader<M>> {
    let per = loader.num_items() / k.max(1);
    (0..k).map(|r| loader.slice(r * per, (r + 1) * per)).collect()
}
