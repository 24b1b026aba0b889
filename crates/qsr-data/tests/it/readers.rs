//! Readers on small files written here, and every bad-data case: each gives its error (naming the file), never
//! a panic.

use std::io::Write;
use std::path::{Path, PathBuf};

use qsr_data::*;

fn idx_bytes(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    for d in dims {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(data);
    v
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn write(path: &Path, bytes: &[u8]) -> PathBuf {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// 3 images of 2x3 with pixel value = 10*image + position, labels 7, 0, 9.
fn write_small_mnist(dir: &Path, gzip: bool, prefix: &str) {
    let pixels: Vec<u8> = (0..3).flat_map(|i| (0..6).map(move |p| 10 * i + p)).collect();
    let img = idx_bytes(0x0803, &[3, 2, 3], &pixels);
    let lab = idx_bytes(0x0801, &[3], &[7, 0, 9]);
    let (img, lab, ext) = if gzip { (gz(&img), gz(&lab), ".gz") } else { (img, lab, "") };
    write(&dir.join(format!("{prefix}-images-idx3-ubyte{ext}")), &img);
    write(&dir.join(format!("{prefix}-labels-idx1-ubyte{ext}")), &lab);
}

fn assert_names(err: &DataError, file: &Path) {
    let msg = err.to_string();
    let name = file.file_name().unwrap().to_string_lossy();
    assert!(msg.contains(&*name), "message {msg:?} does not name {name}");
}

#[test]
fn idx_raw_and_gz() {
    for gzip in [false, true] {
        let d = tempfile::tempdir().unwrap();
        write_small_mnist(d.path(), gzip, "train");
        write_small_mnist(d.path(), gzip, "t10k");
        let s = mnist(d.path(), Split::Train).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s.shape(), Some((1, 2, 3)));
        assert_eq!(s.labels, vec![7, 0, 9]);
        assert_eq!(s.image(1), &[10, 11, 12, 13, 14, 15]);
        assert_eq!(fashion_mnist(d.path(), Split::Test).unwrap().len(), 3);
    }
}

#[test]
fn idx_wrong_magic() {
    let d = tempfile::tempdir().unwrap();
    write_small_mnist(d.path(), false, "train");
    let p = write(&d.path().join("train-images-idx3-ubyte"), &idx_bytes(0x0801, &[3, 2, 3], &[0; 18]));
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::BadMagic { .. }), "{e}");
    assert_names(&e, &p);
    assert!(e.to_string().contains("magic"));
    // a PNG (or anything) posing as a label file
    let p = write(&d.path().join("train-labels-idx1-ubyte"), b"\x89PNG\r\n\x1a\n....");
    write_small_mnist(d.path(), false, "t10k");
    let e = load_idx_pair("x", &d.path().join("t10k-images-idx3-ubyte"), &p, 10, false).unwrap_err();
    assert!(matches!(e, DataError::BadMagic { .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn idx_truncated() {
    let d = tempfile::tempdir().unwrap();
    write_small_mnist(d.path(), false, "train");
    // header says 3 images of 2x3, only 17 bytes follow
    let p = write(&d.path().join("train-images-idx3-ubyte"), &idx_bytes(0x0803, &[3, 2, 3], &[0; 17]));
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::Truncated { .. }), "{e}");
    assert_names(&e, &p);
    assert!(e.to_string().contains("truncated"));
    // shorter than the header
    let p = write(&d.path().join("train-images-idx3-ubyte"), &[0, 0, 8, 3, 0, 0]);
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::Truncated { .. }), "{e}");
    assert_names(&e, &p);
    // empty file
    let p = write(&d.path().join("train-images-idx3-ubyte"), &[]);
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::Truncated { .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn idx_truncated_gzip() {
    let d = tempfile::tempdir().unwrap();
    write_small_mnist(d.path(), true, "train");
    let p = d.path().join("train-images-idx3-ubyte.gz");
    let full = std::fs::read(&p).unwrap();
    write(&p, &full[..full.len() / 2]);
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::Io { .. }), "{e}");
    assert_names(&e, &p);
    assert!(e.to_string().contains("gzip"));
}

#[test]
fn idx_count_mismatch() {
    let d = tempfile::tempdir().unwrap();
    write_small_mnist(d.path(), false, "train");
    let p = write(&d.path().join("train-labels-idx1-ubyte"), &idx_bytes(0x0801, &[2], &[1, 2]));
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::CountMismatch { images: 3, labels: 2, .. }), "{e}");
    assert_names(&e, &p);
    assert_names(&e, &d.path().join("train-images-idx3-ubyte"));
}

#[test]
fn idx_label_out_of_range() {
    let d = tempfile::tempdir().unwrap();
    write_small_mnist(d.path(), false, "train");
    let p = write(&d.path().join("train-labels-idx1-ubyte"), &idx_bytes(0x0801, &[3], &[1, 10, 2]));
    let e = mnist(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::LabelOutOfRange { index: 1, label: 10, classes: 10, .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn idx_missing_directory_and_file() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("no-such-dir");
    let e = fashion_mnist(&missing, Split::Train).unwrap_err();
    assert!(matches!(e, DataError::MissingDir { .. }), "{e}");
    assert_names(&e, &missing);
    let e = mnist(d.path(), Split::Test).unwrap_err();
    assert!(matches!(e, DataError::MissingFile { .. }), "{e}");
    assert!(e.to_string().contains("t10k-images-idx3-ubyte"), "{e}");
}

// ---------------------------------------------------------------- CIFAR

/// `n` records; record i has label `labels(i)` and pixel j = (i + j) % 251.
fn cifar_bytes(n: usize, label_bytes: &dyn Fn(usize) -> Vec<u8>) -> Vec<u8> {
    let mut v = Vec::new();
    for i in 0..n {
        v.extend(label_bytes(i));
        v.extend((0..3072).map(|j| ((i + j) % 251) as u8));
    }
    v
}

#[test]
fn cifar10_reads_batches_in_order() {
    let d = tempfile::tempdir().unwrap();
    let sub = d.path().join("cifar-10-batches-bin");
    for b in 1..=5 {
        write(&sub.join(format!("data_batch_{b}.bin")), &cifar_bytes(2, &|i| vec![((b * 2 + i) % 10) as u8]));
    }
    write(&sub.join("test_batch.bin"), &cifar_bytes(3, &|i| vec![i as u8]));
    let tr = cifar10(d.path(), Split::Train).unwrap();
    assert_eq!(tr.len(), 10);
    assert_eq!(tr.shape(), Some((3, 32, 32)));
    assert_eq!(tr.labels, vec![2, 3, 4, 5, 6, 7, 8, 9, 0, 1]);
    assert!(tr.info().flip_ok);
    let te = cifar10(&sub, Split::Test).unwrap();
    assert_eq!(te.labels, vec![0, 1, 2]);
    // record layout: R plane, G plane, B plane = our CHW
    let img = te.image(1);
    assert_eq!(img.len(), 3072);
    assert_eq!(img[0], 1);
    assert_eq!(img[1024], ((1 + 1024) % 251) as u8);
}

#[test]
fn cifar100_fine_and_coarse() {
    let d = tempfile::tempdir().unwrap();
    write(&d.path().join("train.bin"), &cifar_bytes(4, &|i| vec![i as u8, 90 + i as u8]));
    write(&d.path().join("test.bin"), &cifar_bytes(1, &|_| vec![19, 99]));
    let fine = cifar100(d.path(), Split::Train).unwrap();
    assert_eq!((fine.classes(), fine.labels.clone()), (100, vec![90, 91, 92, 93]));
    let coarse = cifar100_with(d.path(), Split::Test, Cifar100Label::Coarse).unwrap();
    assert_eq!((coarse.classes(), coarse.labels.clone()), (20, vec![19]));
}

#[test]
fn cifar_truncated() {
    let d = tempfile::tempdir().unwrap();
    let mut bytes = cifar_bytes(2, &|_| vec![1]);
    bytes.truncate(3073 + 1000);
    let p = write(&d.path().join("test_batch.bin"), &bytes);
    let e = cifar10(d.path(), Split::Test).unwrap_err();
    assert!(matches!(e, DataError::Truncated { .. }), "{e}");
    assert_names(&e, &p);
    let p = write(&d.path().join("test_batch.bin"), &[]);
    let e = cifar10(d.path(), Split::Test).unwrap_err();
    assert!(matches!(e, DataError::Truncated { .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn cifar_label_out_of_range() {
    let d = tempfile::tempdir().unwrap();
    let p = write(&d.path().join("test_batch.bin"), &cifar_bytes(3, &|i| vec![if i == 2 { 10 } else { 0 }]));
    let e = cifar10(d.path(), Split::Test).unwrap_err();
    assert!(matches!(e, DataError::LabelOutOfRange { index: 2, label: 10, .. }), "{e}");
    assert_names(&e, &p);
    let p = write(&d.path().join("test.bin"), &cifar_bytes(1, &|_| vec![20, 5]));
    let e = cifar100_with(d.path(), Split::Test, Cifar100Label::Coarse).unwrap_err();
    assert!(matches!(e, DataError::LabelOutOfRange { .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn cifar_missing() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("cifar");
    let e = cifar10(&missing, Split::Train).unwrap_err();
    assert!(matches!(e, DataError::MissingDir { .. }), "{e}");
    assert_names(&e, &missing);
    // batch 1 present, batch 3 missing
    write(&d.path().join("data_batch_1.bin"), &cifar_bytes(1, &|_| vec![0]));
    write(&d.path().join("data_batch_2.bin"), &cifar_bytes(1, &|_| vec![0]));
    let e = cifar10(d.path(), Split::Train).unwrap_err();
    assert!(matches!(e, DataError::MissingFile { .. }), "{e}");
    assert!(e.to_string().contains("data_batch_3.bin"), "{e}");
}

// ---------------------------------------------------------------- ImageFolder

fn png(path: &Path, w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    image::RgbImage::from_fn(w, h, |x, y| image::Rgb(f(x, y))).save(path).unwrap();
}

#[test]
#[cfg_attr(not(feature = "images"), ignore = "decodes PNG / JPEG: needs the images feature")]
fn image_folder_png_and_jpeg() {
    let d = tempfile::tempdir().unwrap();
    let r = d.path();
    // classes deliberately created out of order; labels follow sorted names
    png(&r.join("zebra/b.png"), 5, 4, |x, y| [x as u8 * 10, y as u8 * 20, 200]);
    png(&r.join("zebra/a.png"), 3, 2, |_, _| [1, 2, 3]);
    png(&r.join("ant/sub/x.jpg"), 16, 16, |_, _| [200, 100, 50]);
    png(&r.join("ant/y.JPEG"), 8, 8, |_, _| [10, 20, 30]);
    std::fs::write(r.join("ant/notes.txt"), "not an image").unwrap();
    // a grayscale PNG is converted to RGB
    std::fs::create_dir_all(r.join("mole")).unwrap();
    image::GrayImage::from_fn(4, 4, |_, _| image::Luma([77])).save(r.join("mole/g.png")).unwrap();

    let f = ImageFolder::new(r).unwrap();
    assert_eq!(f.class_names(), &["ant", "mole", "zebra"]);
    assert_eq!(f.len(), 5);
    assert_eq!(f.classes(), 3);
    assert_eq!(f.shape(), None);
    let names: Vec<String> =
        f.samples().iter().map(|(p, _)| p.strip_prefix(r).unwrap().display().to_string()).collect();
    assert_eq!(names, ["ant/sub/x.jpg", "ant/y.JPEG", "mole/g.png", "zebra/a.png", "zebra/b.png"]);
    assert_eq!((0..5).map(|i| f.label(i)).collect::<Vec<_>>(), vec![0, 0, 1, 2, 2]);

    let (img, l) = f.load(4).unwrap();
    assert_eq!((img.channels, img.height, img.width, l), (3, 4, 5, 2));
    assert_eq!((img.at(0, 3, 4), img.at(1, 3, 4), img.at(2, 3, 4)), (40, 60, 200));
    let (img, _) = f.load(0).unwrap();
    assert_eq!((img.height, img.width), (16, 16));
    for (c, want) in [200i32, 100, 50].into_iter().enumerate() {
        assert!((i32::from(img.at(c, 8, 8)) - want).abs() <= 3, "jpeg pixel");
    }
    let (img, _) = f.load(2).unwrap();
    assert_eq!((img.at(0, 1, 1), img.at(1, 1, 1), img.at(2, 1, 1)), (77, 77, 77));

    // through the loader: RandomResizedCrop to 8x8 makes a uniform batch from different sizes
    let ds: std::sync::Arc<dyn Dataset> = std::sync::Arc::new(f);
    let t = Transform { crop: Crop::random_resized(8), flip: true, normalize: Normalize::imagenet() };
    let b = load_batch(&*ds, &t, &[0, 1, 2, 3, 4], 1, 0).unwrap();
    assert_eq!(b.shape, [5, 3, 8, 8]);
    assert_eq!(b.labels, vec![0, 0, 1, 2, 2]);
    // a fixed-size crop cannot batch a folder of arbitrary sizes: a configuration error, not a panic
    let e = load_batch(&*ds, &Transform::normalize_only(Normalize::imagenet()), &[0], 0, 0).unwrap_err();
    assert!(matches!(e, DataError::Config(_)), "{e}");
}

#[test]
fn image_folder_empty_root() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("stray.png"), b"x").unwrap();
    let e = ImageFolder::new(d.path()).unwrap_err();
    assert!(matches!(e, DataError::Empty { .. }), "{e}");
    assert_names(&e, d.path());
}

#[test]
fn image_folder_empty_class() {
    let d = tempfile::tempdir().unwrap();
    png(&d.path().join("cat/a.png"), 2, 2, |_, _| [0, 0, 0]);
    std::fs::create_dir_all(d.path().join("dog/nested")).unwrap();
    std::fs::write(d.path().join("dog/readme.txt"), "x").unwrap();
    let e = ImageFolder::new(d.path()).unwrap_err();
    assert!(matches!(e, DataError::Empty { .. }), "{e}");
    assert!(e.to_string().contains("dog"), "{e}");
}

#[test]
fn image_folder_missing_dir() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("imagenet");
    let e = ImageFolder::imagenet(&missing, Split::Train).unwrap_err();
    assert!(matches!(e, DataError::MissingDir { .. }), "{e}");
    assert!(e.to_string().contains("imagenet"), "{e}");
}

#[test]
#[cfg_attr(not(feature = "images"), ignore = "decodes PNG / JPEG: needs the images feature")]
fn image_folder_unreadable_image() {
    let d = tempfile::tempdir().unwrap();
    png(&d.path().join("cat/good.png"), 2, 2, |_, _| [0, 0, 0]);
    let bad = write(&d.path().join("cat/bad.png"), b"\x89PNG\r\n\x1a\n this is not really a png");
    let bad_jpg = write(&d.path().join("dog/bad.jpg"), &[0xff, 0xd8, 0xff, 0xe0, 0, 16, 1, 2]);
    let f = ImageFolder::new(d.path()).unwrap();
    assert_eq!(f.len(), 3);
    let e = f.load(0).unwrap_err();
    assert!(matches!(e, DataError::UnreadableImage { .. }), "{e}");
    assert_names(&e, &bad);
    let e = f.load(2).unwrap_err();
    assert!(matches!(e, DataError::UnreadableImage { .. }), "{e}");
    assert_names(&e, &bad_jpg);
    // inside a batch the error is returned, the batch is not half-built
    let t =
        Transform { crop: Crop::CenterResize { resize: 4, size: 2 }, flip: false, normalize: Normalize::imagenet() };
    let e = load_batch(&f, &t, &[1, 0], 0, 0).unwrap_err();
    assert_names(&e, &bad);
}

#[test]
fn an_idx_header_announcing_more_than_four_gib_is_refused_before_reading() {
    // A small gzip stream whose header promises 60000 x 300 x 300 bytes (5.4 GB): refused from the
    // header, not decompressed until memory runs out.
    let d = tempfile::tempdir().unwrap();
    let img = write(&d.path().join("x-images-idx3-ubyte.gz"), &gz(&idx_bytes(0x0803, &[60_000, 300, 300], &[0; 64])));
    let err = read_idx_images(&img).unwrap_err();
    assert!(matches!(err, DataError::TooLarge { bytes: 5_400_000_000, .. }), "{err}");
    assert_names(&err, &img);
    // A header whose dimensions overflow is refused too, plain or compressed.
    let huge = idx_bytes(0x0803, &[u32::MAX, u32::MAX, u32::MAX], &[]);
    for bytes in [huge.clone(), gz(&huge)] {
        let p = write(&d.path().join("y-images-idx3-ubyte"), &bytes);
        let err = read_idx_images(&p).unwrap_err();
        assert!(err.to_string().contains("overflow"), "{err}");
    }
}

#[test]
fn a_fifo_or_a_device_is_refused_as_a_data_file_naming_what_it_is() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("labels.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for (path, kind) in [(fifo.as_path(), "FIFO"), (Path::new("/dev/zero"), "device"), (d.path(), "directory")] {
        let err = read_idx_labels(path).unwrap_err();
        assert!(matches!(err, DataError::NotAFile { .. }) && err.to_string().contains(kind), "{err}");
    }
}
