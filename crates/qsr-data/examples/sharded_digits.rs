//! The embedded sklearn digits read through the authors' data order for K = 2 workers: one [`ShardedSampler`]
//! and [`TrainLoader`] per rank (same seed), the first batch's labels of each worker, and a check that the two
//! shards of an epoch are disjoint and that each worker's prefetched batches over the epoch are exactly its shard.
//!
//! ```sh
//! cargo run --release -p qsr-data --example sharded_digits
//! ```

use std::collections::HashSet;
use std::sync::Arc;

use qsr_data::{Dataset, PrefetchOptions, ShardedSampler, Split, TrainLoader, Transform, digits};

const WORKERS: usize = 2;
const LOCAL_BATCH: usize = 16;
const SEED: u64 = 42;

fn main() -> qsr_data::Result<()> {
    let train: Arc<dyn Dataset> = Arc::new(digits(Split::Train));
    let transform = Transform::train_default(train.info());
    let loaders = (0..WORKERS)
        .map(|rank| {
            let sampler = ShardedSampler::simple(train.len(), WORKERS, rank, LOCAL_BATCH, SEED)?;
            TrainLoader::new(train.clone(), sampler, transform.clone())
        })
        .collect::<qsr_data::Result<Vec<_>>>()?;
    let steps = loaders[0].sampler().steps_per_epoch();
    println!(
        "digits: {} training images, K = {WORKERS} workers x local batch {LOCAL_BATCH}, {steps} steps per epoch",
        train.len()
    );

    for (rank, loader) in loaders.iter().enumerate() {
        let batch = loader.host_batch(0)?;
        let [n, c, h, w] = batch.shape;
        println!("worker {rank}, step 0: images [{n}, {c}, {h}, {w}], labels {:?}", batch.labels);
    }

    for epoch in 0..2 {
        let shards: Vec<HashSet<usize>> =
            loaders.iter().map(|l| l.sampler().shard(epoch).into_iter().collect()).collect();
        let common = shards[0].intersection(&shards[1]).count();
        assert_eq!(common, 0, "epoch {epoch}: the shards share {common} samples");
        println!(
            "epoch {epoch}: shards of {} and {} distinct samples, {common} in common",
            shards[0].len(),
            shards[1].len()
        );
    }

    // The batches a worker reads over epoch 0, prefetched in step order, are its shard of epoch 0, in order.
    for (rank, loader) in loaders.iter().enumerate() {
        let options = PrefetchOptions { end_step: Some(steps as u64), ..PrefetchOptions::default() };
        let mut seen = Vec::new();
        for batch in loader.prefetch(0, options)? {
            seen.extend(batch?.indices);
        }
        assert_eq!(seen, loader.sampler().shard(0), "worker {rank}");
    }
    println!("each worker's {steps} prefetched batches of epoch 0 are exactly its shard");
    Ok(())
}
