//! Each replica's part of the training data: the Learner's loader cut into equal contiguous slices,
//! or, with [`LocalTrainingStrategy::with_shards`](crate::LocalTrainingStrategy::with_shards), the
//! loader the user's function builds for each rank and epoch.

use std::sync::Arc;

use burn::data::dataloader::DataLoader;
use burn::train::{LearnerModel, TrainLoader, TrainStep};

/// The part of the training data a replica asks for: rank `rank` of `world_size`, at `epoch` (burn-train
/// counts epochs from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// The replica's rank, `0..world_size`.
    pub rank: usize,
    /// The number of replicas in the job.
    pub world_size: usize,
    /// The epoch about to start.
    pub epoch: usize,
}

/// A user's function from a [`Shard`] to its training loader of batches `I`.
pub(crate) type BuildShard<I> = Arc<dyn Fn(Shard) -> Result<Arc<dyn DataLoader<I>>, String> + Send + Sync>;

/// The batches a model `M` trains on.
pub(crate) type Batch<M> = <M as TrainStep>::Input;

/// Where one replica's batches come from.
pub(crate) enum Source<M: LearnerModel> {
    /// The same slice of the Learner's loader every epoch.
    Slice(TrainLoader<M>),
    /// A loader built for each epoch.
    Built { build: BuildShard<Batch<M>>, rank: usize, world_size: usize },
}

impl<M: LearnerModel> Source<M> {
    /// The loader of `epoch`.
    pub(crate) fn for_epoch(&self, epoch: usize) -> Result<TrainLoader<M>, String> {
        match self {
            Source::Slice(loader) => Ok(loader.clone()),
            Source::Built { build, rank, world_size } => build(Shard { rank: *rank, world_size: *world_size, epoch })
                .map_err(|e| format!("the training loader of rank {rank} for epoch {epoch} (with_shards) failed: {e}")),
        }
    }
}

/// A `with_shards` loader must split the Learner's own training loader: each of the `k` ranks holds
/// `loader_items / k` items, rounded either way (`ShardedDataset` rounds down, like the contiguous
/// slices; a padded shard rounds up). Otherwise the shards are of another dataset than the one the
/// Learner was given, whose loader is then the only thing burn-train's own strategies would train on.
pub(crate) fn check_split(rank: usize, k: usize, shard_items: usize, loader_items: usize) -> Result<(), String> {
    let k = k.max(1);
    if (loader_items / k..=loader_items.div_ceil(k)).contains(&shard_items) {
        return Ok(());
    }
    Err(format!(
        "with_shards built rank {rank} a loader of {shard_items} items, but the Learner's training loader holds \
         {loader_items}, which {k} ranks split into {} items each: build the shards over the dataset the \
         Learner's training loader reads",
        loader_items / k
    ))
}

/// Each of `k` replicas' source, in rank order: `build`'s loaders, else `k` contiguous slices of `items /
/// k` items each of `loader` (the remainder dropped, so every replica takes the same number of steps),
/// cut in rank order so that thread and process launches give rank `r` the same slice.
pub(crate) fn sources<M: LearnerModel>(
    loader: &TrainLoader<M>,
    k: usize,
    build: Option<&BuildShard<Batch<M>>>,
) -> Vec<Source<M>> {
    match build {
        Some(build) => (0..k).map(|rank| Source::Built { build: Arc::clone(build), rank, world_size: k }).collect(),
        None => {
            let per = loader.num_items() / k.max(1);
            (0..k).map(|r| Source::Slice(loader.slice(r * per, (r + 1) * per))).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    /// The Learner trial: with `with_shards` the Learner's training loader was never read, so shards
    /// over another dataset went unnoticed. Its size now checks theirs.
    #[test]
    fn shards_of_another_dataset_than_the_learners_loader_are_refused() {
        assert!(super::check_split(0, 4, 449, 1797).is_ok(), "ShardedDataset rounds down");
        assert!(super::check_split(3, 4, 450, 1797).is_ok(), "a padded shard rounds up");
        let e = super::check_split(1, 4, 90, 1797).unwrap_err();
        assert!(e.contains("rank 1 a loader of 90 items") && e.contains("split into 449 items each"), "{e}");
        assert!(super::check_split(0, 2, 1797, 1797).is_err(), "each rank the whole dataset");
    }
}
