//! Augmentation and normalization: crops, flips and normalization keyed by (seed, epoch, sample).

use qsr_data::rng::stream;
use qsr_data::*;

fn img(c: usize, h: usize, w: usize, f: impl Fn(usize, usize, usize) -> u8) -> Image {
    let mut data = Vec::with_capacity(c * h * w);
    for ch in 0..c {
        for y in 0..h {
            for x in 0..w {
                data.push(f(ch, y, x));
            }
        }
    }
    Image { data, channels: c, height: h, width: w }
}

fn key(index: u64, epoch: u64) -> SampleKey {
    SampleKey { seed: 17, epoch, index }
}

fn run(t: &Transform, im: &Image, pixel_max: u8, k: SampleKey, out_hw: (usize, usize)) -> Vec<f32> {
    let mut out = vec![0f32; im.channels * out_hw.0 * out_hw.1];
    t.apply(im, pixel_max, k, &mut out).unwrap();
    out
}

fn raw(c: usize) -> Normalize {
    Normalize::identity(c)
}

#[test]
fn same_key_same_pixels_different_key_different_crop() {
    let im = img(3, 32, 32, |c, y, x| (c * 50 + y * 7 + x * 3) as u8);
    let t = Transform { crop: Crop::RandomPad { pad: 4 }, flip: true, normalize: Normalize::cifar10() };
    let a = run(&t, &im, 255, key(5, 2), (32, 32));
    assert_eq!(a, run(&t, &im, 255, key(5, 2), (32, 32)));
    assert_ne!(a, run(&t, &im, 255, key(6, 2), (32, 32)), "other sample index");
    assert_ne!(a, run(&t, &im, 255, key(5, 3), (32, 32)), "other epoch");
    assert_ne!(a, run(&t, &im, 255, SampleKey { seed: 18, ..key(5, 2) }, (32, 32)), "other seed");
    let big = img(3, 50, 70, |c, y, x| (c * 50 + y * 3 + x) as u8);
    let t = Transform { crop: Crop::random_resized(16), flip: true, normalize: Normalize::imagenet() };
    let a = run(&t, &big, 255, key(1, 0), (16, 16));
    assert_eq!(a, run(&t, &big, 255, key(1, 0), (16, 16)));
    assert_ne!(a, run(&t, &big, 255, key(2, 0), (16, 16)));
    assert_ne!(a, run(&t, &big, 255, key(1, 1), (16, 16)));
}

#[test]
fn flip_reverses_columns_and_can_be_off() {
    let im = img(2, 3, 5, |c, y, x| (c * 100 + y * 10 + x) as u8);
    let plain: Vec<f32> = im.data.iter().map(|&v| f32::from(v) / 255.0).collect();
    let mirrored: Vec<f32> = {
        let m = img(2, 3, 5, |c, y, x| (c * 100 + y * 10 + (4 - x)) as u8);
        m.data.iter().map(|&v| f32::from(v) / 255.0).collect()
    };
    let t = Transform { crop: Crop::None, flip: true, normalize: raw(2) };
    let (mut n_plain, mut n_flip) = (0, 0);
    for i in 0..100 {
        let o = run(&t, &im, 255, key(i, 0), (3, 5));
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        if close(&o, &plain) {
            n_plain += 1;
        } else if close(&o, &mirrored) {
            n_flip += 1;
        } else {
            panic!("neither the image nor its mirror");
        }
    }
    assert!(n_plain > 25 && n_flip > 25, "{n_plain} / {n_flip}");
    let off = Transform { flip: false, ..t };
    assert!(
        (0..100)
            .all(|i| { run(&off, &im, 255, key(i, 0), (3, 5)).iter().zip(&plain).all(|(x, y)| (x - y).abs() < 1e-6) })
    );
}

#[test]
fn random_pad_crop_offsets_and_zero_padding() {
    // pixel value = 8*y + x + 1 (1..=64), so every source position is identifiable and 0 means padding
    let (h, w, pad) = (8usize, 8usize, 2usize);
    let im = img(1, h, w, |_, y, x| (8 * y + x + 1) as u8);
    let norm = Normalize::new(vec![0.25], vec![0.5]);
    let t = Transform { crop: Crop::RandomPad { pad }, flip: false, normalize: norm };
    let mut offsets = std::collections::HashSet::new();
    for i in 0..400 {
        let o = run(&t, &im, 64, key(i, 0), (h, w));
        let vals: Vec<i32> = o.iter().map(|&v| ((v * 0.5 + 0.25) * 64.0).round() as i32).collect();
        // find the shift from any non-padding pixel
        let (p, &v) = vals.iter().enumerate().find(|(_, v)| **v > 0).unwrap();
        let (sy, sx) = ((v - 1) / 8, (v - 1) % 8);
        let (dy, dx) = (sy - (p / w) as i32, sx - (p % w) as i32);
        assert!(dy.abs() <= pad as i32 && dx.abs() <= pad as i32, "offset ({dy},{dx}) out of range");
        offsets.insert((dy, dx));
        for y in 0..h as i32 {
            for x in 0..w as i32 {
                let (yy, xx) = (y + dy, x + dx);
                let want = if (0..8).contains(&yy) && (0..8).contains(&xx) { 8 * yy + xx + 1 } else { 0 };
                assert_eq!(vals[(y * 8 + x) as usize], want);
            }
        }
        // padding is a raw zero, i.e. (0 - mean) / std after normalization
        for (v, raw) in o.iter().zip(&vals) {
            if *raw == 0 {
                assert_eq!(*v, (0.0 - 0.25) / 0.5);
            }
        }
    }
    assert_eq!(offsets.len(), 25, "all (2*pad+1)^2 offsets occur");
}

#[test]
fn normalization_per_channel() {
    let im = img(3, 1, 2, |c, _, x| (c * 60 + x * 255) as u8 % 255);
    let n = Normalize::new(vec![0.1, 0.2, 0.3], vec![0.5, 0.25, 2.0]);
    let o = run(&Transform::normalize_only(n.clone()), &im, 255, key(0, 0), (1, 2));
    for c in 0..3 {
        for x in 0..2 {
            let v = f32::from(im.at(c, 0, x)) / 255.0;
            assert!((o[c * 2 + x] - (v - n.mean[c]) / n.std[c]).abs() < 1e-6);
        }
    }
    // wrong channel count is a configuration error
    let info = DatasetInfo {
        name: "x".into(),
        len: 1,
        classes: 1,
        channels: 3,
        size: Some((1, 2)),
        pixel_max: 255,
        flip_ok: true,
    };
    let bad = Transform::normalize_only(Normalize::new(vec![0.1, 0.2], vec![1.0, 1.0]));
    assert!(matches!(bad.output_shape(&info), Err(DataError::Config(_))));
    let bad = Transform::normalize_only(Normalize::new(vec![0.1], vec![0.0]));
    assert!(matches!(bad.output_shape(&info), Err(DataError::Config(_))));
}

#[test]
fn random_resized_crop_params_in_range_and_fallback() {
    let mut r = stream(1, 2, 3, 4);
    let mut areas = vec![];
    for _ in 0..2000 {
        let (top, left, h, w) = random_resized_crop_params(&mut r, 120, 90, (0.08, 1.0), (0.75, 4.0 / 3.0));
        assert!(h >= 1 && w >= 1 && top + h <= 120 && left + w <= 90);
        areas.push((h * w) as f64 / (120.0 * 90.0));
    }
    let small = areas.iter().filter(|&&a| a < 0.3).count();
    assert!(small > 300, "small crops occur: {small}");
    // impossible scale -> torchvision fallback: whole image clamped to the ratio range, centered
    let mut r = stream(0, 0, 0, 0);
    assert_eq!(random_resized_crop_params(&mut r, 100, 10, (2.0, 3.0), (0.75, 4.0 / 3.0)), (43, 0, 13, 10));
    assert_eq!(random_resized_crop_params(&mut r, 10, 100, (2.0, 3.0), (0.75, 4.0 / 3.0)), (0, 43, 10, 13));
    assert_eq!(random_resized_crop_params(&mut r, 30, 30, (2.0, 3.0), (0.75, 4.0 / 3.0)), (0, 0, 30, 30));
}

#[test]
fn resized_crop_of_whole_image_at_same_size_is_identity() {
    let im = img(3, 16, 16, |c, y, x| (c * 70 + y * 11 + x * 5) as u8);
    let t = Transform {
        crop: Crop::RandomResized { size: 16, scale: (1.0, 1.0), ratio: (1.0, 1.0) },
        flip: false,
        normalize: raw(3),
    };
    let o = run(&t, &im, 255, key(3, 0), (16, 16));
    for (a, &b) in o.iter().zip(&im.data) {
        assert!((a * 255.0 - f32::from(b)).abs() < 1e-3);
    }
}

#[test]
fn center_resize_eval() {
    // 20 high x 10 wide, resize shorter side to 5 -> 10x5, center crop 4 -> rows 3..7, cols 0..4 (round-half-even)
    let im = img(1, 20, 10, |_, _, x| (x * 20) as u8);
    let t = Transform { crop: Crop::CenterResize { resize: 5, size: 4 }, flip: false, normalize: raw(1) };
    assert!(!t.is_random());
    let o = run(&t, &im, 255, key(0, 0), (4, 4));
    let o2 = run(&t, &im, 255, key(99, 9), (4, 4));
    assert_eq!(o, o2, "no randomness in eval");
    // horizontal gradient 0,20,..,180 downscaled x2: interior output column j averages columns 2j-1..2j+2
    // with triangle weights -> 20 * (2j + 0.5)
    for y in 0..4 {
        for j in 1..4 {
            assert!((o[y * 4 + j] * 255.0 - 20.0 * (2.0 * j as f32 + 0.5)).abs() < 1e-3, "{}", o[y * 4 + j] * 255.0);
        }
    }
    // constant image stays constant at any scale
    let c = img(3, 37, 53, |_, _, _| 200);
    let t = Transform { crop: Crop::CenterResize { resize: 24, size: 16 }, flip: false, normalize: raw(3) };
    assert!(run(&t, &c, 255, key(0, 0), (16, 16)).iter().all(|v| (v * 255.0 - 200.0).abs() < 1e-3));
    let t = Transform { crop: Crop::random_resized(9), flip: true, normalize: raw(3) };
    assert!(run(&t, &c, 255, key(4, 0), (9, 9)).iter().all(|v| (v * 255.0 - 200.0).abs() < 1e-3));
    // upscaling works too
    let t = Transform { crop: Crop::CenterResize { resize: 80, size: 64 }, flip: false, normalize: raw(3) };
    assert!(run(&t, &c, 255, key(0, 0), (64, 64)).iter().all(|v| (v * 255.0 - 200.0).abs() < 1e-3));
}

#[test]
fn presets() {
    let info = |name: &str, c, size, flip_ok| DatasetInfo {
        name: name.into(),
        len: 1,
        classes: 10,
        channels: c,
        size,
        pixel_max: 255,
        flip_ok,
    };
    let t = Transform::train_default(&info("cifar10", 3, Some((32, 32)), true));
    assert_eq!((t.crop.clone(), t.flip), (Crop::RandomPad { pad: 4 }, true));
    assert_eq!(t.normalize, Normalize::cifar10());
    let t = Transform::train_default(&info("/data/imagenet/train", 3, None, true));
    assert_eq!(t.crop, Crop::random_resized(224));
    assert_eq!(t.normalize, Normalize::imagenet());
    let e = Transform::eval_default(&info("/data/imagenet/val", 3, None, true));
    assert_eq!(e.crop, Crop::CenterResize { resize: 256, size: 224 });
    assert!(!Transform::train_default(&info("mnist", 1, Some((28, 28)), false)).flip);
    // serde round trip (configs are stored with runs)
    let s = serde_json::to_string(&t).unwrap();
    assert_eq!(serde_json::from_str::<Transform>(&s).unwrap(), t);
}
