//! Data for qsr: dataset readers (IDX/MNIST/Fashion-MNIST, CIFAR-10/100 binary, ImageFolder, embedded digits),
//! the per-epoch sharded sampler of the QSR paper's code, seeded augmentation, micro-batching into burn tensors,
//! and an ordered prefetcher.
//!
//! Determinism is the design constraint: a training batch is a pure function of (dataset, transform, seed, rank,
//! world size, global step), so a resumed run or a run with a different thread count sees exactly the same data.
//!
//! ```
//! use std::sync::Arc;
//! use qsr_data::*;
//! let train = Arc::new(digits(Split::Train));
//! // Worker 0 of K = 4, local batch 32, seed 42 (the other ranks differ only in `rank`).
//! let sampler = ShardedSampler::simple(train.len(), 4, 0, 32, 42).unwrap();
//! let transform = Transform::train_default(train.info());
//! let loader = TrainLoader::new(train, sampler, transform).unwrap();
//! let device = burn::tensor::Device::flex();
//! let batch = loader.batch(0, &device).unwrap();
//! assert_eq!(batch.images.dims(), [32, 1, 8, 8]);
//! assert_eq!(batch.labels.dims(), [32]);
//! ```
//!
//! `cargo run --release -p qsr-data --example sharded_digits` reads the digits for two workers and shows that
//! their shards are disjoint.

#![forbid(unsafe_code)]

mod augment;
mod burn_shard;
mod cifar;
mod dataset;
#[cfg(feature = "gzip")]
mod digits;
mod error;
mod folder;
mod gz;
mod idx;
mod loader;
// The one public module: its deterministic-stream primitives have generic names (`stream`, `below`, `unit`,
// `uniform`, `permutation`) that would read ambiguously at the crate root, so they stay `qsr_data::rng::*`.
pub mod rng;
mod sampler;
mod text;

pub use augment::{Crop, Normalize, SampleKey, Transform, random_resized_crop_params, resample, resize_shorter};
pub use burn_shard::{LoopEpochs, ShardedDataset, epochs_set_on_this_thread, loop_epochs_on_this_thread};
pub use cifar::{Cifar100Label, cifar10, cifar100, cifar100_with, read_cifar_files};
pub use dataset::{Dataset, DatasetInfo, Image, ImageSet, Split, Spread};
#[cfg(feature = "gzip")]
pub use digits::{DIGITS_TEST, DIGITS_TOTAL, DIGITS_TRAIN, digits, digits_all};
pub use error::{DataError, Result};
pub use folder::{IMAGE_EXTENSIONS, ImageFolder, decode_rgb};
pub use idx::{
    FASHION_MNIST_DEFAULT_DIR, IdxArray, fashion_mnist, file_kind, load_idx_pair, mnist, parse_idx, read_idx_images,
    read_idx_labels, read_maybe_gz,
};
pub use loader::{Batch, EvalLoader, HostBatch, PrefetchOptions, Prefetcher, TrainLoader, load_batch};
pub use sampler::{EpochStep, SamplerConfig, SamplerState, ShardedSampler, check_micro};
pub use text::{CharVocab, Corpus, SHAKESPEARE_DEFAULT_DIR, TextBatch, TextWindows, eval_window_starts};
