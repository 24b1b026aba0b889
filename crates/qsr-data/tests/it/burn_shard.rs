//! `ShardedDataset`: a burn dataset's shards follow the trainer's sampler, cover the data disjointly,
//! reshuffle per epoch, and feed burn's `DataLoader`.

use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::tensor::Device;
use qsr_data::{ShardedDataset, ShardedSampler};

#[test]
fn shards_are_the_trainers_order_disjoint_and_reshuffled_per_epoch() {
    // Class-ordered data: items 0..30 are class 0, 30..60 class 1, 60..90 class 2.
    let items: Vec<u32> = (0..91).collect();
    let shards: Vec<_> =
        (0..3).map(|r| ShardedDataset::new(InMemDataset::new(items.clone()), r, 3, 5).unwrap()).collect();
    for epoch in 0..3 {
        let mut all = Vec::new();
        for (rank, shard) in shards.iter().enumerate() {
            shard.set_epoch(epoch);
            assert_eq!(shard.epoch(), epoch);
            let got: Vec<usize> = shard.iter().map(|i| i.unwrap() as usize).collect();
            assert_eq!(got, ShardedSampler::simple(91, 3, rank, 1, 5).unwrap().shard(epoch), "not the trainer's order");
            // Every class reaches every rank (a contiguous slice would give rank 0 only class 0).
            for class in 0..3 {
                assert!(got.iter().any(|&i| i / 30 == class), "rank {rank} has no item of class {class}");
            }
            all.extend(got);
        }
        assert_eq!(all.len(), 90, "floor(91 / 3) items per rank");
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 90, "shards overlap");
    }
    let e0: Vec<u32> = {
        shards[0].set_epoch(0);
        shards[0].iter().map(Result::unwrap).collect()
    };
    shards[0].set_epoch(1);
    assert_ne!(shards[0].iter().map(Result::unwrap).collect::<Vec<_>>(), e0);
    assert!(shards[0].get(30).is_err(), "an index past the shard is an error, not a panic");
}

#[test]
fn bad_shard_settings_are_refused_naming_them() {
    let data = || InMemDataset::new(vec![1u8, 2, 3]);
    let err = ShardedDataset::new(data(), 2, 2, 0).err().unwrap().to_string();
    assert!(err.contains("rank 2") && err.contains("world_size 2"), "{err}");
    let err = ShardedDataset::new(data(), 0, 4, 0).err().unwrap().to_string();
    assert!(err.contains("3 items") && err.contains("4 ranks"), "{err}");
}

#[derive(Clone, Debug)]
struct Collect;

impl Batcher<u32, Vec<u32>> for Collect {
    fn batch(&self, items: Vec<u32>, _device: &Device) -> Vec<u32> {
        items
    }
}

#[test]
fn a_data_loader_over_the_shard_sees_each_epochs_order() {
    let shard = Arc::new(ShardedDataset::new(InMemDataset::new((0..40u32).collect()), 1, 4, 9).unwrap());
    let loader = DataLoaderBuilder::new(Collect).batch_size(4).build(Arc::clone(&shard));
    for epoch in 0..2 {
        shard.set_epoch(epoch);
        let seen: Vec<u32> = loader.iter().flat_map(|b| b.unwrap()).collect();
        assert_eq!(seen, shard.iter().map(Result::unwrap).collect::<Vec<_>>());
        assert_eq!(seen.len(), 10);
    }
}
