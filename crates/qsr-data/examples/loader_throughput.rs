//! Loader throughput (images/s, augmentation included) for digits, Fashion-MNIST (if installed) and a generated
//! 224x224 JPEG ImageFolder. Run: `cargo run -p qsr-data --release --example loader_throughput`.
//! Not a test: it measures; the numbers depend on the machine (cores, disk cache).

use std::sync::Arc;
use std::time::{Duration, Instant};

use qsr_data::*;

fn measure(loader: &TrainLoader, threads: usize, prefetch: bool, min_time: Duration) -> (f64, usize) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    // warm-up (page cache, allocator)
    pool.install(|| loader.host_batch(0).unwrap());
    let t0 = Instant::now();
    let mut n = 0usize;
    if prefetch {
        let opts = PrefetchOptions { depth: 4, threads: Some(threads), end_step: None };
        let mut p = loader.prefetch(1, opts).unwrap();
        while t0.elapsed() < min_time {
            let b = p.next().unwrap().unwrap();
            n += b.len();
        }
    } else {
        let mut step = 1;
        while t0.elapsed() < min_time {
            n += pool.install(|| loader.host_batch(step).unwrap()).len();
            step += 1;
        }
    }
    (n as f64 / t0.elapsed().as_secs_f64(), n)
}

fn write_jpeg_folder(root: &std::path::Path, count: usize, size: u32) {
    for i in 0..count {
        let class = format!("class{:02}", i % 8);
        let dir = root.join(&class);
        std::fs::create_dir_all(&dir).unwrap();
        let mut state = i as u32 * 2_654_435_761;
        let img = image::RgbImage::from_fn(size, size, |x, y| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let noise = (state >> 24) as u8 / 4;
            image::Rgb([
                (x as u8).wrapping_add(noise),
                (y as u8).wrapping_add(i as u8),
                ((x + y) as u8 / 2).wrapping_add(noise),
            ])
        });
        img.save(dir.join(format!("{i:04}.jpg"))).unwrap();
    }
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let min_time =
        Duration::from_millis(std::env::var("QSR_BENCH_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000));
    let mut rows: Vec<(String, String, usize, usize, &str, f64)> = Vec::new();
    let mut run = |name: &str, tdesc: &str, loader: &TrainLoader| {
        for threads in [1, cores] {
            for prefetch in [false, true] {
                let (ips, _) = measure(loader, threads, prefetch, min_time);
                let mode = if prefetch { "prefetch" } else { "sequential" };
                rows.push((name.into(), tdesc.into(), loader.sampler().local_batch(), threads, mode, ips));
                eprintln!("{name:<28} {tdesc:<34} threads {threads} {mode:<10} {ips:>12.0} img/s");
            }
            if cores == 1 {
                break;
            }
        }
    };

    // digits 8x8: pad-1 random crop, no flip
    let d: Arc<dyn Dataset> = Arc::new(digits(Split::Train));
    let t = Transform::train_default(d.info());
    let l = TrainLoader::new(d.clone(), ShardedSampler::simple(d.len(), 1, 0, 64, 0).unwrap(), t).unwrap();
    run("digits 1x8x8", "pad 1 crop, normalize", &l);

    // Fashion-MNIST 28x28
    match fashion_mnist(FASHION_MNIST_DEFAULT_DIR, Split::Train) {
        Ok(fm) => {
            let fm: Arc<dyn Dataset> = Arc::new(fm);
            let t = Transform { crop: Crop::RandomPad { pad: 4 }, flip: true, normalize: Normalize::fashion_mnist() };
            let l = TrainLoader::new(fm.clone(), ShardedSampler::simple(fm.len(), 1, 0, 128, 0).unwrap(), t).unwrap();
            run("fashion-mnist 1x28x28", "pad 4 crop + flip, normalize", &l);
        }
        Err(e) => eprintln!("fashion-mnist skipped: {e}"),
    }

    // generated JPEG ImageFolder, 224x224
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    write_jpeg_folder(dir.path(), 256, 224);
    eprintln!("wrote 256 JPEGs in {:.2} s", t0.elapsed().as_secs_f64());
    let f: Arc<dyn Dataset> = Arc::new(ImageFolder::new(dir.path()).unwrap());
    let t = Transform { crop: Crop::random_resized(224), flip: true, normalize: Normalize::imagenet() };
    let l = TrainLoader::new(f.clone(), ShardedSampler::simple(f.len(), 1, 0, 32, 0).unwrap(), t).unwrap();
    run("imagefolder jpeg 3x224x224", "decode + RRC 224 + flip, normalize", &l);
    let t = Transform { crop: Crop::random_resized(128), flip: true, normalize: Normalize::imagenet() };
    let l = TrainLoader::new(f.clone(), ShardedSampler::simple(f.len(), 1, 0, 32, 0).unwrap(), t).unwrap();
    run("imagefolder jpeg 3x224x224", "decode + RRC 128 + flip, normalize", &l);
    // decode alone, for reference
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < min_time {
        f.load(n % f.len()).unwrap();
        n += 1;
    }
    let decode = n as f64 / t0.elapsed().as_secs_f64();

    println!("\n| dataset | transform | batch | threads | mode | images/s |");
    println!("|---|---|---|---|---|---|");
    for (name, t, b, th, mode, ips) in &rows {
        println!("| {name} | {t} | {b} | {th} | {mode} | {ips:.0} |");
    }
    println!("\nJPEG 224x224 decode alone, 1 thread: {decode:.0} images/s ({cores} cores available)");
}
