//! Training and evaluation loaders: batches as a pure function of the step, prefetching in step order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use qsr_data::*;

fn digits_loader(world: usize, rank: usize, batch: usize, seed: u64) -> TrainLoader {
    let train: Arc<dyn Dataset> = Arc::new(digits(Split::Train));
    let sampler = ShardedSampler::simple(train.len(), world, rank, batch, seed).unwrap();
    let t = Transform::train_default(train.info());
    TrainLoader::new(train, sampler, t).unwrap()
}

#[test]
fn host_batch_follows_the_sampler() {
    let l = digits_loader(2, 1, 16, 3);
    assert_eq!(l.sampler().steps_per_epoch(), 1437 / 32);
    for step in [0u64, 44, 45, 100] {
        let b = l.host_batch(step).unwrap();
        assert_eq!(b.shape, [16, 1, 8, 8]);
        assert_eq!(b.images.len(), 16 * 64);
        assert_eq!(b.indices, l.sampler().batch_indices(step));
        let ds = l.dataset();
        assert_eq!(b.labels, b.indices.iter().map(|&i| i64::from(ds.label(i))).collect::<Vec<_>>());
        assert_eq!(b, l.host_batch(step).unwrap(), "pure function of the step");
    }
    assert_ne!(l.host_batch(0).unwrap().images, l.host_batch(45).unwrap().images);
}

#[test]
fn loader_rejects_mismatched_sampler() {
    let train: Arc<dyn Dataset> = Arc::new(digits(Split::Train));
    let sampler = ShardedSampler::simple(1000, 1, 0, 10, 0).unwrap();
    let e = TrainLoader::new(train, sampler, Transform::normalize_only(Normalize::digits())).unwrap_err();
    assert!(matches!(e, DataError::Config(_)), "{e}");
}

#[test]
fn micro_batches_concatenate_to_the_batch() {
    let l = digits_loader(1, 0, 32, 9);
    for step in [0u64, 43, 44] {
        let whole = l.host_batch(step).unwrap();
        let parts = l.host_micro_batches(step, 8).unwrap();
        assert_eq!(parts.len(), 4);
        assert!(parts.iter().all(|p| p.shape == [8, 1, 8, 8]));
        assert_eq!(HostBatch::concat(&parts).unwrap(), whole);
        let idx = l.sampler().micro_batch_indices(step, 8).unwrap();
        assert_eq!(parts.iter().map(|p| p.indices.clone()).collect::<Vec<_>>(), idx);
    }
    assert!(matches!(l.host_micro_batches(0, 12), Err(DataError::Config(_))));
}

#[test]
fn batches_become_burn_tensors() {
    let device = Device::flex();
    let l = digits_loader(1, 0, 8, 1);
    let host = l.host_batch(2).unwrap();
    let b = l.batch(2, &device).unwrap();
    assert_eq!(b.images.dims(), [8, 1, 8, 8]);
    assert_eq!(b.labels.dims(), [8]);
    let imgs: Vec<f32> = b.images.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    assert_eq!(imgs, host.images);
    let labels: Vec<i64> = b.labels.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
    assert_eq!(labels, host.labels);
}

#[test]
fn prefetcher_order_equals_sequential_order_for_any_thread_count() {
    let l = digits_loader(3, 2, 12, 77);
    let spe = l.sampler().steps_per_epoch() as u64; // 39: the range crosses an epoch boundary
    let (start, end) = (spe - 5, spe + 6);
    let sequential: Vec<HostBatch> = (start..end).map(|s| l.host_batch(s).unwrap()).collect();
    for threads in [Some(1), Some(3), None] {
        for depth in [1, 4] {
            let mut p = l.prefetch(start, PrefetchOptions { depth, threads, end_step: Some(end) }).unwrap();
            assert_eq!(p.next_step(), start);
            let got: Vec<HostBatch> = p.by_ref().map(|b| b.unwrap()).collect();
            assert_eq!(got, sequential, "threads {threads:?} depth {depth}");
            assert_eq!(p.next_step(), end);
            assert!(p.next().is_none());
        }
    }
    // ImageFolder-like decode path (random-resized crop, flip) across thread counts
    let big = Transform { crop: Crop::random_resized(6), flip: true, normalize: Normalize::digits() };
    let ds: Arc<dyn Dataset> = Arc::new(digits(Split::Train));
    let l = TrainLoader::new(ds, ShardedSampler::simple(1437, 1, 0, 64, 1).unwrap(), big).unwrap();
    let a: Vec<_> = l
        .prefetch(0, PrefetchOptions { depth: 2, threads: Some(1), end_step: Some(3) })
        .unwrap()
        .map(|b| b.unwrap())
        .collect();
    let b: Vec<_> = l
        .prefetch(0, PrefetchOptions { depth: 2, threads: Some(4), end_step: Some(3) })
        .unwrap()
        .map(|b| b.unwrap())
        .collect();
    assert_eq!(a, b);
}

#[test]
fn prefetcher_resumes_at_a_step_and_delivers_tensors() {
    let l = digits_loader(1, 0, 16, 5);
    let mut p = l.prefetch(100, PrefetchOptions::default()).unwrap();
    let device = Device::flex();
    let b = p.next_batch(&device).unwrap().unwrap();
    assert_eq!(b.images.dims(), [16, 1, 8, 8]);
    assert_eq!(p.next_step(), 101);
    assert_eq!(p.next().unwrap().unwrap(), l.host_batch(101).unwrap());
}

#[test]
fn prefetcher_shuts_down_on_drop() {
    let l = digits_loader(1, 0, 64, 5);
    let t0 = Instant::now();
    for _ in 0..20 {
        // endless producer, blocked on a full channel when dropped
        let mut p = l.prefetch(0, PrefetchOptions { depth: 2, threads: Some(2), end_step: None }).unwrap();
        p.next().unwrap().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        drop(p);
    }
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
#[cfg_attr(not(feature = "images"), ignore = "decodes PNG / JPEG: needs the images feature")]
fn prefetcher_delivers_errors_in_order_then_stops() {
    let d = tempfile::tempdir().unwrap();
    for i in 0..4 {
        let p = d.path().join(format!("c/{i}.png"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        image::RgbImage::from_fn(4, 4, |_, _| image::Rgb([9, 9, 9])).save(&p).unwrap();
    }
    std::fs::write(d.path().join("c/9.png"), b"garbage").unwrap();
    let f: Arc<dyn Dataset> = Arc::new(ImageFolder::new(d.path()).unwrap());
    let t = Transform { crop: Crop::random_resized(4), flip: true, normalize: Normalize::imagenet() };
    let l = TrainLoader::new(f, ShardedSampler::simple(5, 1, 0, 1, 0).unwrap(), t).unwrap();
    let bad_step = (0..5u64).find(|&s| l.sampler().batch_indices(s) == vec![4]).unwrap();
    let mut p = l.prefetch(0, PrefetchOptions::default()).unwrap();
    for _ in 0..bad_step {
        p.next().unwrap().unwrap();
    }
    let e = p.next().unwrap().unwrap_err();
    assert!(matches!(e, DataError::UnreadableImage { .. }), "{e}");
    assert!(e.to_string().contains("9.png"));
    assert!(p.next().is_none());
}

#[test]
fn eval_iterates_the_test_split_in_fixed_order() {
    let test: Arc<dyn Dataset> = Arc::new(digits(Split::Test));
    let t = Transform::eval_default(test.info());
    let e = EvalLoader::new(test.clone(), t.clone(), 100).unwrap();
    assert_eq!(e.num_batches(), 4);
    let batches: Vec<HostBatch> = e.iter().map(|b| b.unwrap()).collect();
    assert_eq!(batches.iter().map(|b| b.len()).collect::<Vec<_>>(), vec![100, 100, 100, 60]);
    let all = HostBatch::concat(&batches).unwrap();
    assert_eq!(all.indices, (0..360).collect::<Vec<_>>());
    // no augmentation: exactly the normalized pixels
    let ds = digits(Split::Test);
    let n = Normalize::digits();
    for (v, &p) in all.images.iter().zip(&ds.images) {
        assert!((v - (f32::from(p) / 16.0 - n.mean[0]) / n.std[0]).abs() < 1e-5);
    }
    assert_eq!(e.iter().map(|b| b.unwrap()).collect::<Vec<_>>(), batches, "same every time");
    // distributed eval: the shards partition the split
    let mut idx: Vec<usize> = (0..3)
        .flat_map(|r| e.clone().shard(r, 3).unwrap().iter().flat_map(|b| b.unwrap().indices).collect::<Vec<_>>())
        .collect();
    idx.sort();
    assert_eq!(idx, (0..360).collect::<Vec<_>>());
    // random transforms are refused for evaluation
    assert!(EvalLoader::new(test.clone(), Transform::train_default(test.info()), 10).is_err());
}
