//! One rank's shard of any burn [`Dataset`](burn::data::dataset::Dataset), in the trainer's data order.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::ThreadId;

use burn::data::dataset::Dataset;

use crate::error::{DataError, Result};
use crate::sampler::ShardedSampler;

thread_local! {
    /// The `set_epoch` calls this thread made.
    static EPOCHS_SET: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The loop this thread last ran through [`ShardedDataset::epochs`].
    static LOOP: std::cell::Cell<Option<LoopEpochs>> = const { std::cell::Cell::new(None) };
}

/// How many times this thread called [`ShardedDataset::set_epoch`]: where the epochs of the loop
/// running on it begin. qsr-optim's `Averager`, stepped on the same thread, reads it to measure an
/// epoch's steps against the steps its schedule was given.
pub fn epochs_set_on_this_thread() -> u64 {
    EPOCHS_SET.with(std::cell::Cell::get)
}

/// The epochs of a loop over [`ShardedDataset::epochs`], as the thread that runs it last saw them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopEpochs {
    /// The epochs the loop runs in all: the end of its range (`start..epochs`).
    pub epochs: u64,
    /// [`epochs_set_on_this_thread`] before its latest epoch began: a reader that began counting
    /// later than this sees another loop's.
    pub set_before: u64,
}

/// The loop this thread runs (or ran last) through [`ShardedDataset::epochs`], if any: how
/// qsr-optim's `Averager` knows the epochs the loop takes, to check the steps its schedule was given.
pub fn loop_epochs_on_this_thread() -> Option<LoopEpochs> {
    LOOP.with(std::cell::Cell::get)
}

/// Rank `rank`'s shard of a burn dataset, reshuffled every epoch as `qsr train` reshuffles its data.
///
/// Each epoch one permutation of all N items, the same on every rank (seeded by `seed` and the epoch),
/// strided over the K ranks like torch's `DistributedSampler`: rank k sees `perm[k], perm[k + K], ...`,
/// `floor(N / K)` items, so every rank takes the same number of steps and the shards are disjoint. A
/// contiguous slice per rank would hand each rank a few classes of class-ordered data; strides over a
/// permutation do not.
///
/// Loop over [`epochs`](Self::epochs) (`for epoch in shard.epochs(start..EPOCHS)`), which calls
/// [`set_epoch`](Self::set_epoch) before each epoch (as with torch's `DistributedSampler.set_epoch`)
/// and tells an `Averager` the loop's length; a burn `DataLoader` built once over an `Arc` of the
/// shard, before the epoch loop, sees the new order. The shard already holds the epoch's order, a
/// function of (seed, epoch): build the loader without `.shuffle(..)`, whose generator restarts with
/// the process (a resumed run would see another order; on top of the shard it also leaves the
/// trainer's order). The dataset's length is read once, at construction: the dataset must not
/// change length afterwards.
///
/// ```
/// use std::sync::Arc;
/// use burn::data::dataset::{Dataset, InMemDataset};
/// use qsr_data::ShardedDataset;
///
/// let items: Vec<u32> = (0..10).collect();
/// let shards: Vec<_> = (0..2).map(|rank| ShardedDataset::new(InMemDataset::new(items.clone()), rank, 2, 7).unwrap()).collect();
/// let items_of = |s: &ShardedDataset<_>| s.iter().map(Result::unwrap).collect::<Vec<u32>>();
/// let mut seen: Vec<u32> = shards.iter().flat_map(items_of).collect();
/// seen.sort();
/// assert_eq!(seen, items); // disjoint, and together the whole dataset
/// let first = items_of(&shards[0]);
/// shards[0].set_epoch(1);
/// assert_ne!(items_of(&shards[0]), first); // another order next epoch
/// let shard = Arc::new(ShardedDataset::new(InMemDataset::new(items), 0, 2, 7).unwrap());
/// assert_eq!(shard.len(), 5); // an `Arc` of it is a dataset too: give one to the DataLoader
/// ```
#[derive(Debug)]
pub struct ShardedDataset<D> {
    inner: D,
    sampler: ShardedSampler,
    /// The epoch whose order `indices` holds.
    order: RwLock<(u64, Arc<Vec<usize>>)>,
    /// Items read since the last `set_epoch`: more than the shard holds means a second pass.
    reads: AtomicUsize,
    /// Whether the second pass was warned of (once per dataset).
    warned: AtomicBool,
    /// This shard's rank and the world size, for the warning.
    member: (usize, usize),
    /// Each reading thread's last index since the last `set_epoch`: a loader reads its part in order,
    /// a `.shuffle` on top does not.
    last_reads: Mutex<Vec<(ThreadId, usize)>>,
    /// `set_epoch` calls: from the second, the shard serves a loader that outlives an epoch.
    epochs_set: AtomicUsize,
    /// Whether a shuffled read was warned of (once per dataset).
    warned_shuffle: AtomicBool,
}

/// Reading threads remembered at most (a loop without `set_epoch` would add a loader's every epoch).
const THREADS: usize = 64;

impl<D> ShardedDataset<D> {
    /// Rank `rank` of `world_size` over `dataset` (of at least `world_size` items), epoch 0's order.
    /// Every rank must pass the same `seed` and an equal dataset.
    pub fn new<I>(dataset: D, rank: usize, world_size: usize, seed: u64) -> Result<Self>
    where
        D: Dataset<I>,
    {
        let len = dataset.len();
        if world_size == 0 || rank >= world_size {
            return Err(DataError::Config(format!("shard: rank {rank} is not in 0..world_size {world_size}")));
        }
        if len < world_size {
            return Err(DataError::Config(format!(
                "shard: a dataset of {len} items cannot give each of {world_size} ranks an item"
            )));
        }
        let sampler = ShardedSampler::simple(len, world_size, rank, 1, seed)?;
        let order = RwLock::new((0, Arc::new(sampler.shard(0))));
        let (reads, warned) = (AtomicUsize::new(0), AtomicBool::new(false));
        Ok(Self {
            inner: dataset,
            sampler,
            order,
            reads,
            warned,
            member: (rank, world_size),
            last_reads: Mutex::new(Vec::new()),
            epochs_set: AtomicUsize::new(0),
            warned_shuffle: AtomicBool::new(false),
        })
    }

    /// Switches to `epoch`'s order (every rank at the same epoch, before iterating it).
    pub fn set_epoch(&self, epoch: u64) {
        EPOCHS_SET.with(|n| n.set(n.get() + 1));
        let shard = Arc::new(self.sampler.shard(epoch));
        let mut order = self.order.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        *order = (epoch, shard);
        self.reads.store(0, Ordering::Relaxed);
        self.last_reads.lock().unwrap_or_else(PoisonError::into_inner).clear();
        self.epochs_set.fetch_add(1, Ordering::Relaxed);
    }

    /// The loop's epochs `range` (`start..epochs`; `start` after a resume): before yielding each
    /// epoch the shard switches to its order ([`set_epoch`](Self::set_epoch)), and an `Averager`
    /// stepped on this thread learns that the loop runs `range.end` epochs, so after the first it
    /// checks the steps its schedule was given against them.
    ///
    /// ```
    /// use burn::data::dataset::{Dataset, InMemDataset};
    /// let shard = qsr_data::ShardedDataset::new(InMemDataset::new((0..10).collect::<Vec<u32>>()), 0, 2, 7).unwrap();
    /// for epoch in shard.epochs(1..3) {
    ///     assert_eq!(shard.epoch(), epoch); // this epoch's order
    ///     assert_eq!(shard.iter().count(), 5);
    /// }
    /// assert_eq!(qsr_data::loop_epochs_on_this_thread().map(|l| l.epochs), Some(3));
    /// ```
    pub fn epochs(&self, range: std::ops::Range<u64>) -> impl Iterator<Item = u64> + '_ {
        let epochs = range.end;
        range.inspect(move |&epoch| {
            LOOP.with(|l| l.set(Some(LoopEpochs { epochs, set_before: epochs_set_on_this_thread() })));
            self.set_epoch(epoch);
        })
    }

    /// Notes the read of `index`; the first read out of its thread's order in a shard serving a second
    /// epoch warns, once: a loader built once with `.shuffle(seed)` draws each epoch's order from a
    /// generator that restarts with the process, so a resumed run reads another order than the run it
    /// continues, and not the trainer's.
    fn note_order(&self, index: usize) {
        let thread = std::thread::current().id();
        let in_order = {
            let mut last = self.last_reads.lock().unwrap_or_else(PoisonError::into_inner);
            match last.iter_mut().find(|(t, _)| *t == thread) {
                Some((_, previous)) => std::mem::replace(previous, index) + 1 == index,
                None => {
                    if last.len() == THREADS {
                        last.clear();
                    }
                    last.push((thread, index));
                    true
                }
            }
        };
        if in_order || self.epochs_set.load(Ordering::Relaxed) < 2 || self.warned_shuffle.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let (rank, k) = self.member;
        // Every rank runs the same loop: rank 0 says it for all.
        if rank != 0 {
            return;
        }
        warn(&format!(
            "ShardedDataset (rank {rank} of {k}): read out of order in epoch {}: is its loader built with `.shuffle(..)`? The shard already holds each epoch's order, a function of (seed, epoch); a loader's shuffle draws from a generator that restarts with the process, so a resumed run would read another order. Build the loader without `.shuffle` (reading the shard out of order on purpose is fine)",
            self.epoch()
        ));
    }

    /// Counts a read; the first read of a second pass over one epoch's shard warns, once: a loop
    /// that forgets `set_epoch` repeats epoch 0's order (and shard) in every epoch.
    fn count_read(&self) {
        let len = self.sampler.shard_len();
        if self.reads.fetch_add(1, Ordering::Relaxed) == len && !self.warned.swap(true, Ordering::Relaxed) {
            let ((rank, k), epoch) = (self.member, self.epoch());
            let message = format!(
                "ShardedDataset (rank {rank} of {k}): epoch {epoch}'s shard of {len} items is read a second time without `set_epoch`; loop over `shard.epochs(start..EPOCHS)` (or call `shard.set_epoch(epoch)` before each epoch), or every epoch repeats this order (a second pass on purpose, such as an evaluation on training data, is fine)"
            );
            // Every rank runs the same loop: rank 0 says it for all.
            if rank == 0 {
                warn(&message);
            }
        }
    }

    /// The epoch whose order the shard holds.
    pub fn epoch(&self) -> u64 {
        self.order.read().unwrap_or_else(std::sync::PoisonError::into_inner).0
    }

    /// The dataset this shard reads from.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    fn indices(&self) -> Arc<Vec<usize>> {
        Arc::clone(&self.order.read().unwrap_or_else(std::sync::PoisonError::into_inner).1)
    }
}

impl<D: Dataset<I>, I> Dataset<I> for ShardedDataset<D> {
    fn get(&self, index: usize) -> std::result::Result<I, burn::data::dataset::DatasetError> {
        self.count_read();
        self.note_order(index);
        let indices = self.indices();
        match indices.get(index) {
            Some(&i) => self.inner.get(i),
            None => Err(burn::data::dataset::DatasetError::new(DataError::Config(format!(
                "shard: index {index} is past the shard's {} items",
                indices.len()
            )))),
        }
    }

    fn len(&self) -> usize {
        self.sampler.shard_len()
    }
}

/// A warning to the person running the job, as qsr's other crates give theirs.
fn warn(message: &str) {
    qsr_notice::notice(true, message);
}

#[cfg(test)]
mod tests {
    use burn::data::dataset::{Dataset, InMemDataset};

    use super::ShardedDataset;

    fn pass(shard: &ShardedDataset<InMemDataset<u32>>) {
        shard.iter().for_each(|item| assert!(item.is_ok()));
    }

    /// Issue 46: a loop that forgets `set_epoch` reads epoch 0's shard again in its second epoch,
    /// which warns once; one that calls it never warns.
    #[test]
    fn a_second_pass_without_set_epoch_warns_once() {
        let shard = ShardedDataset::new(InMemDataset::new((0..20).collect()), 1, 2, 7).unwrap();
        for epoch in 0..3 {
            shard.set_epoch(epoch);
            pass(&shard);
        }
        assert!(!shard.warned.load(std::sync::atomic::Ordering::Relaxed));
        pass(&shard);
        assert!(shard.warned.load(std::sync::atomic::Ordering::Relaxed), "the second pass of epoch 2 warns");
    }

    /// The trial's one-loader program: burn's `.shuffle(seed)` on top of the shard made a resumed run
    /// read another order, silently. A loader built once with it warns in its second epoch; one
    /// without it, and a shuffled loader built afresh for each epoch's shard, never warn.
    #[test]
    fn a_shuffled_loader_over_a_shard_that_outlives_an_epoch_warns() {
        use std::sync::Arc;

        use burn::data::dataloader::DataLoaderBuilder;
        use burn::data::dataloader::batcher::Batcher;
        use std::sync::atomic::Ordering::Relaxed;

        #[derive(Clone)]
        struct Items;
        impl Batcher<u32, Vec<u32>> for Items {
            fn batch(&self, items: Vec<u32>, _: &burn::tensor::Device) -> Vec<u32> {
                items
            }
        }
        let shard = |seed| Arc::new(ShardedDataset::new(InMemDataset::new((0..64).collect()), 0, 2, seed).unwrap());
        let epochs = |shard: &Arc<ShardedDataset<InMemDataset<u32>>>, shuffle: bool| {
            let builder = DataLoaderBuilder::new(Items).batch_size(4);
            let loader = if shuffle { builder.shuffle(3) } else { builder }.build(Arc::clone(shard));
            for epoch in 0..3 {
                shard.set_epoch(epoch);
                assert_eq!(loader.iter().map(|b| b.unwrap().len()).sum::<usize>(), 32);
            }
        };
        let (plain, shuffled) = (shard(7), shard(7));
        epochs(&plain, false);
        epochs(&shuffled, true);
        assert!(!plain.warned_shuffle.load(Relaxed));
        assert!(shuffled.warned_shuffle.load(Relaxed), "the shuffled loader read out of order");
        // A fresh shard and loader per epoch, as with_shards builds them: shuffled, yet the same order
        // on a resumed run.
        for epoch in 0..3 {
            let fresh = shard(7);
            fresh.set_epoch(epoch);
            let loader = DataLoaderBuilder::new(Items).batch_size(4).shuffle(3).build(Arc::clone(&fresh));
            assert_eq!(loader.iter().count(), 8);
            assert!(!fresh.warned_shuffle.load(Relaxed));
        }
    }
}
