//! From sample indices to batches: host-side `f32` batches built in parallel (rayon), burn tensors on a device,
//! micro-batches for gradient accumulation, an ordered prefetcher, and the evaluation iterator.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use burn::tensor::{Device, Int, Tensor, TensorData};
use rayon::prelude::*;

use crate::augment::{SampleKey, Transform};
use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::sampler::{ShardedSampler, check_micro};

/// A batch in host memory: images `f32` NCHW (normalized), labels as `i64`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostBatch {
    /// Pixels after the transform, `N * C * H * W` values in NCHW order (sample `i` is the `i`-th `C*H*W` run).
    pub images: Vec<f32>,
    /// Class index of each sample, in batch order.
    pub labels: Vec<i64>,
    /// `[N, C, H, W]`.
    pub shape: [usize; 4],
    /// Dataset indices of the samples, in batch order (for debugging and BN re-estimation bookkeeping).
    pub indices: Vec<usize>,
}

/// A batch on a device, ready for a burn model.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `[N, C, H, W]`, f32 (the device's float dtype).
    pub images: Tensor<4>,
    /// `[N]` class indices.
    pub labels: Tensor<1, Int>,
}

impl HostBatch {
    /// Number of samples `N`.
    pub fn len(&self) -> usize {
        self.shape[0]
    }
    /// Whether the batch holds no samples.
    pub fn is_empty(&self) -> bool {
        self.shape[0] == 0
    }
    /// Copies to `device` as burn tensors.
    pub fn to_batch(&self, device: &Device) -> Batch {
        self.clone().into_batch(device)
    }
    /// Moves to `device` as burn tensors.
    pub fn into_batch(self, device: &Device) -> Batch {
        let n = self.shape[0];
        let images = Tensor::<4>::from_data(TensorData::new(self.images, self.shape), device);
        let labels = Tensor::<1, Int>::from_data(TensorData::new(self.labels, [n]), device);
        Batch { images, labels }
    }
    /// Splits into consecutive micro-batches of `micro_batch` samples (must divide the batch).
    pub fn split(&self, micro_batch: usize) -> Result<Vec<HostBatch>> {
        let parts = check_micro(self.len(), micro_batch)?;
        let per = self.shape[1] * self.shape[2] * self.shape[3];
        Ok((0..parts)
            .map(|p| {
                let r = p * micro_batch..(p + 1) * micro_batch;
                HostBatch {
                    images: self.images[r.start * per..r.end * per].to_vec(),
                    labels: self.labels[r.clone()].to_vec(),
                    shape: [micro_batch, self.shape[1], self.shape[2], self.shape[3]],
                    indices: self.indices[r].to_vec(),
                }
            })
            .collect())
    }
    /// Concatenates batches of equal sample shape (inverse of [`split`](Self::split)).
    pub fn concat(parts: &[HostBatch]) -> Result<HostBatch> {
        let first = parts.first().ok_or_else(|| DataError::Config("concat of no batches".into()))?;
        let mut out = HostBatch {
            images: vec![],
            labels: vec![],
            shape: [0, first.shape[1], first.shape[2], first.shape[3]],
            indices: vec![],
        };
        for p in parts {
            if p.shape[1..] != first.shape[1..] {
                return Err(DataError::Config(format!("concat of shapes {:?} and {:?}", first.shape, p.shape)));
            }
            out.images.extend_from_slice(&p.images);
            out.labels.extend_from_slice(&p.labels);
            out.indices.extend_from_slice(&p.indices);
            out.shape[0] += p.shape[0];
        }
        Ok(out)
    }
}

/// Loads and transforms `indices` into one host batch, in parallel on the current rayon pool. Sample `i`'s
/// randomness is keyed by `(seed, epoch, i)`, so the result does not depend on the number of threads.
pub fn load_batch(
    dataset: &dyn Dataset,
    transform: &Transform,
    indices: &[usize],
    seed: u64,
    epoch: u64,
) -> Result<HostBatch> {
    let info = dataset.info();
    let (c, h, w) = transform.output_shape(info)?;
    let per = c * h * w;
    let mut images = vec![0f32; indices.len() * per];
    let labels: Vec<i64> = images
        .par_chunks_mut(per.max(1))
        .zip(indices.par_iter())
        .map(|(out, &i)| {
            if i >= dataset.len() {
                return Err(DataError::Config(format!("sample {i} out of range (len {})", dataset.len())));
            }
            let (img, label) = dataset.load(i)?;
            if img.channels != c {
                return Err(DataError::Config(format!("sample {i} has {} channels, expected {c}", img.channels)));
            }
            transform.apply(&img, info.pixel_max, SampleKey { seed, epoch, index: i as u64 }, out)?;
            Ok(i64::from(label))
        })
        .collect::<Result<_>>()?;
    Ok(HostBatch { images, labels, shape: [indices.len(), c, h, w], indices: indices.to_vec() })
}

/// Training batches: sampler + dataset + transform. `host_batch(step)` is a pure function of
/// (dataset, transform, seed, rank, world size, global step).
#[derive(Clone)]
pub struct TrainLoader {
    dataset: Arc<dyn Dataset>,
    sampler: ShardedSampler,
    transform: Transform,
    shape: (usize, usize, usize),
}

impl std::fmt::Debug for TrainLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainLoader")
            .field("dataset", self.dataset.info())
            .field("sampler", self.sampler.config())
            .field("transform", &self.transform)
            .finish()
    }
}

impl TrainLoader {
    /// Checks that the sampler was made for this dataset's length and that the transform fits the dataset.
    pub fn new(dataset: Arc<dyn Dataset>, sampler: ShardedSampler, transform: Transform) -> Result<Self> {
        if sampler.config().len != dataset.len() {
            return Err(DataError::Config(format!(
                "sampler is for {} samples, dataset {} has {}",
                sampler.config().len,
                dataset.info().name,
                dataset.len()
            )));
        }
        let shape = transform.output_shape(dataset.info())?;
        Ok(TrainLoader { dataset, sampler, transform, shape })
    }
    /// The training set the batches are drawn from.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }
    /// The sharded sampler that picks each step's sample indices.
    pub fn sampler(&self) -> &ShardedSampler {
        &self.sampler
    }
    /// The per-sample transform (augmentation and normalization).
    pub fn transform(&self) -> &Transform {
        &self.transform
    }
    /// `(C, H, W)` of one sample of the output.
    pub fn sample_shape(&self) -> (usize, usize, usize) {
        self.shape
    }
    /// This worker's local batch at `global_step`.
    pub fn host_batch(&self, global_step: u64) -> Result<HostBatch> {
        let idx = self.sampler.batch_indices(global_step);
        let epoch = self.sampler.position(global_step).epoch;
        load_batch(&*self.dataset, &self.transform, &idx, self.sampler.config().seed, epoch)
    }
    /// The local batch at `global_step` split into micro-batches, in order.
    pub fn host_micro_batches(&self, global_step: u64, micro_batch: usize) -> Result<Vec<HostBatch>> {
        check_micro(self.sampler.local_batch(), micro_batch)?;
        self.host_batch(global_step)?.split(micro_batch)
    }
    /// This worker's local batch at `global_step` on `device`.
    pub fn batch(&self, global_step: u64, device: &Device) -> Result<Batch> {
        Ok(self.host_batch(global_step)?.into_batch(device))
    }
    /// Starts a prefetcher delivering the batches of steps `start_step..` in order.
    pub fn prefetch(&self, start_step: u64, options: PrefetchOptions) -> Result<Prefetcher> {
        Prefetcher::start(self.clone(), start_step, options)
    }
}

/// Prefetch settings.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefetchOptions {
    /// Batches prepared ahead (channel capacity), at least 1.
    pub depth: usize,
    /// Threads for decoding/augmenting inside a batch; `None` = rayon's global pool.
    pub threads: Option<usize>,
    /// Stop after the batch of `end_step - 1`; `None` = endless (the trainer decides when to stop).
    pub end_step: Option<u64>,
}

impl Default for PrefetchOptions {
    fn default() -> Self {
        PrefetchOptions { depth: 3, threads: None, end_step: None }
    }
}

/// Prepares host batches ahead on a background thread (one producer, so delivery is in step order; rayon
/// parallelism inside each batch). The content equals `TrainLoader::host_batch(step)` whatever the thread count.
/// Dropping it stops the producer and joins it.
pub struct Prefetcher {
    rx: Option<Receiver<(u64, Result<HostBatch>)>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    next_step: u64,
    end_step: Option<u64>,
    failed: bool,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").field("next_step", &self.next_step).field("end_step", &self.end_step).finish()
    }
}

impl Prefetcher {
    fn start(loader: TrainLoader, start_step: u64, options: PrefetchOptions) -> Result<Self> {
        if options.depth == 0 {
            return Err(DataError::Config("prefetch depth must be at least 1".into()));
        }
        let pool = match options.threads {
            Some(n) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n.max(1))
                    .thread_name(|i| format!("qsr-data-{i}"))
                    .build()
                    .map_err(|e| DataError::Prefetch(format!("cannot build thread pool: {e}")))?,
            ),
            None => None,
        };
        let (tx, rx) = sync_channel(options.depth);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let end = options.end_step;
        let handle = std::thread::Builder::new()
            .name("qsr-data-prefetch".into())
            .spawn(move || produce(loader, start_step, end, pool, tx, stop2))
            .map_err(|e| DataError::Prefetch(format!("cannot spawn prefetch thread: {e}")))?;
        Ok(Prefetcher { rx: Some(rx), stop, handle: Some(handle), next_step: start_step, end_step: end, failed: false })
    }

    /// The global step of the batch the next call returns (what a checkpoint records).
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The next batch on `device`.
    pub fn next_batch(&mut self, device: &Device) -> Option<Result<Batch>> {
        self.next().map(|r| r.map(|b| b.into_batch(device)))
    }
}

fn produce(
    loader: TrainLoader,
    start: u64,
    end: Option<u64>,
    pool: Option<rayon::ThreadPool>,
    tx: SyncSender<(u64, Result<HostBatch>)>,
    stop: Arc<AtomicBool>,
) {
    let mut step = start;
    while end.is_none_or(|e| step < e) && !stop.load(Ordering::Relaxed) {
        let batch = match &pool {
            Some(p) => p.install(|| loader.host_batch(step)),
            None => loader.host_batch(step),
        };
        let failed = batch.is_err();
        if tx.send((step, batch)).is_err() || failed {
            return; // receiver gone (dropped) or an error was delivered: stop
        }
        step += 1;
    }
}

impl Iterator for Prefetcher {
    type Item = Result<HostBatch>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.end_step.is_some_and(|e| self.next_step >= e) {
            return None;
        }
        let rx = self.rx.as_ref()?;
        match rx.recv() {
            Ok((step, batch)) => {
                debug_assert_eq!(step, self.next_step);
                if batch.is_err() {
                    self.failed = true;
                } else {
                    self.next_step += 1;
                }
                Some(batch)
            }
            Err(_) => {
                self.failed = true;
                Some(Err(DataError::Prefetch(format!("producer ended before step {}", self.next_step))))
            }
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Dropping the receiver makes a producer blocked in `send` return at once.
        drop(self.rx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Evaluation batches over a whole split in fixed order (no randomness; the last batch may be smaller).
#[derive(Clone)]
pub struct EvalLoader {
    dataset: Arc<dyn Dataset>,
    transform: Transform,
    batch_size: usize,
    indices: Vec<usize>,
}

impl std::fmt::Debug for EvalLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvalLoader")
            .field("dataset", self.dataset.info())
            .field("batch_size", &self.batch_size)
            .field("samples", &self.indices.len())
            .finish()
    }
}

impl EvalLoader {
    /// `transform` must not be random (use [`Transform::eval_default`]).
    pub fn new(dataset: Arc<dyn Dataset>, transform: Transform, batch_size: usize) -> Result<Self> {
        if batch_size == 0 {
            return Err(DataError::Config("eval batch size must be at least 1".into()));
        }
        if transform.is_random() {
            return Err(DataError::Config("evaluation transform must not flip or crop randomly".into()));
        }
        transform.output_shape(dataset.info())?;
        let indices = (0..dataset.len()).collect();
        Ok(EvalLoader { dataset, transform, batch_size, indices })
    }
    /// Keeps only samples `rank, rank + world, ...` (distributed evaluation; the union over ranks is everything).
    pub fn shard(mut self, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(DataError::Config(format!("rank {rank} not in 0..{world_size}")));
        }
        self.indices = (rank..self.dataset.len()).step_by(world_size).collect();
        Ok(self)
    }
    /// Samples this loader evaluates: the whole dataset, or this rank's shard after [`EvalLoader::shard`].
    pub fn num_samples(&self) -> usize {
        self.indices.len()
    }
    /// Batches of at most `batch_size` samples covering `num_samples()`; the last may be shorter.
    pub fn num_batches(&self) -> usize {
        self.indices.len().div_ceil(self.batch_size)
    }
    /// Batch `i` of `num_batches()`.
    pub fn host_batch(&self, i: usize) -> Result<HostBatch> {
        let lo = i * self.batch_size;
        if lo >= self.indices.len() {
            return Err(DataError::Config(format!("eval batch {i} out of range ({})", self.num_batches())));
        }
        let hi = (lo + self.batch_size).min(self.indices.len());
        load_batch(&*self.dataset, &self.transform, &self.indices[lo..hi], 0, 0)
    }
    /// Iterates the batches in order.
    pub fn iter(&self) -> impl Iterator<Item = Result<HostBatch>> + '_ {
        (0..self.num_batches()).map(move |i| self.host_batch(i))
    }
}
