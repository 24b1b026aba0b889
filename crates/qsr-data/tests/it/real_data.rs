//! Reads the real Fashion-MNIST IDX .gz files (Debian package `dataset-fashion-mnist`, or `QSR_FASHION_MNIST_DIR`).
//! Missing directory: a failure when `QSR_REQUIRE_DATA=1` (CI), otherwise a printed skip.

use std::path::PathBuf;

use qsr_data::*;

fn data_dir() -> Option<PathBuf> {
    let dir =
        PathBuf::from(std::env::var("QSR_FASHION_MNIST_DIR").unwrap_or_else(|_| FASHION_MNIST_DEFAULT_DIR.into()));
    if dir.is_dir() {
        return Some(dir);
    }
    if std::env::var("QSR_REQUIRE_DATA").as_deref() == Ok("1") {
        panic!("QSR_REQUIRE_DATA=1 but {} is missing (apt-get install dataset-fashion-mnist)", dir.display());
    }
    eprintln!("SKIP: {} missing (apt-get install dataset-fashion-mnist, or set QSR_FASHION_MNIST_DIR)", dir.display());
    None
}

#[test]
fn fashion_mnist_train_and_test() {
    let Some(dir) = data_dir() else { return };
    let train = fashion_mnist(&dir, Split::Train).unwrap();
    let test = fashion_mnist(&dir, Split::Test).unwrap();
    assert_eq!(train.len(), 60_000);
    assert_eq!(test.len(), 10_000);
    assert_eq!(train.shape(), Some((1, 28, 28)));
    assert_eq!(train.classes(), 10);
    // first labels, read once from the files with Python's gzip module
    assert_eq!(&train.labels[..10], &[9, 0, 0, 3, 0, 2, 7, 2, 5, 5]);
    assert_eq!(&test.labels[..10], &[9, 2, 1, 1, 6, 1, 4, 6, 5, 7]);
    // pixel range 0..=255 actually used; sums of the first images (also from Python)
    assert_eq!(*train.images.iter().max().unwrap(), 255);
    assert_eq!(*train.images.iter().min().unwrap(), 0);
    assert_eq!(train.image(0).iter().map(|&v| u64::from(v)).sum::<u64>(), 76_247);
    assert_eq!(test.image(0).iter().map(|&v| u64::from(v)).sum::<u64>(), 33_456);
    // every class present in both splits, 6000 / 1000 each
    for c in 0..10u16 {
        assert_eq!(train.labels.iter().filter(|&&l| l == c).count(), 6000);
        assert_eq!(test.labels.iter().filter(|&&l| l == c).count(), 1000);
    }
}

#[test]
fn fashion_mnist_batches_through_loader() {
    let Some(dir) = data_dir() else { return };
    let train = std::sync::Arc::new(fashion_mnist(&dir, Split::Train).unwrap());
    let sampler = ShardedSampler::simple(train.len(), 2, 1, 64, 7).unwrap();
    assert_eq!(sampler.steps_per_epoch(), 60_000 / 128);
    let t = Transform::train_default(train.info());
    assert!(!t.flip, "no flip by default for (Fashion-)MNIST");
    let loader = TrainLoader::new(train, sampler, t).unwrap();
    let b = loader.host_batch(1000).unwrap();
    assert_eq!(b.shape, [64, 1, 28, 28]);
    assert!(b.images.iter().all(|v| v.is_finite()));
}
