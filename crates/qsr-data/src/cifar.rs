//! CIFAR-10 / CIFAR-100 binary files (documented on [`cifar10`]).

use std::path::{Path, PathBuf};

use crate::dataset::{ImageSet, Split};
use crate::error::{DataError, Result};

const PIXELS: usize = 3 * 32 * 32;

/// Which label of CIFAR-100 to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Cifar100Label {
    /// 100 fine classes (the usual benchmark).
    Fine,
    /// 20 superclasses.
    Coarse,
}

/// Reads CIFAR binary files in order. `label_bytes` is 1 (CIFAR-10) or 2 (CIFAR-100: coarse, fine);
/// `label_at` picks which of them is the label.
pub fn read_cifar_files(
    name: &str,
    files: &[PathBuf],
    label_bytes: usize,
    label_at: usize,
    classes: usize,
) -> Result<ImageSet> {
    let record = label_bytes + PIXELS;
    let mut images = Vec::new();
    let mut labels = Vec::new();
    for path in files {
        let bytes = crate::idx::read_regular(path, 4 << 30, "a CIFAR batch file may have")?;
        if bytes.is_empty() {
            return Err(DataError::truncated(path, "file is empty"));
        }
        if bytes.len() % record != 0 {
            return Err(DataError::truncated(
                path,
                format!(
                    "{} bytes is not a whole number of {record}-byte records ({} records + {} bytes)",
                    bytes.len(),
                    bytes.len() / record,
                    bytes.len() % record
                ),
            ));
        }
        images.reserve(bytes.len() / record * PIXELS);
        for (i, rec) in bytes.chunks_exact(record).enumerate() {
            let l = rec[label_at];
            if usize::from(l) >= classes {
                return Err(DataError::LabelOutOfRange { path: path.clone(), index: i, label: l.into(), classes });
            }
            labels.push(u16::from(l));
            images.extend_from_slice(&rec[label_bytes..]);
        }
    }
    let source = files.first().cloned().unwrap_or_default();
    ImageSet::new(name, images, labels, (3, 32, 32), classes, 255, true, source)
}

/// `dir` itself or the sub-folder the official archive unpacks to, whichever holds `probe`.
fn resolve(dir: &Path, sub: &str, probe: &str, name: &str) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Err(DataError::MissingDir { path: dir.to_path_buf(), what: format!("{name} directory") });
    }
    for d in [dir.to_path_buf(), dir.join(sub)] {
        if d.join(probe).is_file() {
            return Ok(d);
        }
    }
    Err(DataError::MissingFile { path: dir.join(probe), what: format!("{name} binary file (also looked in {sub}/)") })
}

fn existing(d: &Path, names: &[String]) -> Result<Vec<PathBuf>> {
    names
        .iter()
        .map(|n| {
            let p = d.join(n);
            if p.is_file() { Ok(p) } else { Err(DataError::MissingFile { path: p, what: "CIFAR binary file".into() }) }
        })
        .collect()
}

/// CIFAR-10 from `data_batch_{1..5}.bin` / `test_batch.bin` in `dir` or `dir/cifar-10-batches-bin`.
///
/// CIFAR-10 / CIFAR-100 "binary version" files: fixed-size records of label byte(s) + 3072 pixel bytes
/// (1024 R, 1024 G, 1024 B, row-major 32x32), which is already our CHW layout.
pub fn cifar10(dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    let names: Vec<String> = match split {
        Split::Train => (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
        Split::Test => vec!["test_batch.bin".into()],
    };
    let d = resolve(dir.as_ref(), "cifar-10-batches-bin", &names[0], "CIFAR-10")?;
    read_cifar_files("cifar10", &existing(&d, &names)?, 1, 0, 10)
}

/// CIFAR-100 (fine labels) from `train.bin` / `test.bin` in `dir` or `dir/cifar-100-binary`.
pub fn cifar100(dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    cifar100_with(dir, split, Cifar100Label::Fine)
}

/// CIFAR-100 with the chosen label kind.
pub fn cifar100_with(dir: impl AsRef<Path>, split: Split, label: Cifar100Label) -> Result<ImageSet> {
    let name = match split {
        Split::Train => "train.bin",
        Split::Test => "test.bin",
    };
    let d = resolve(dir.as_ref(), "cifar-100-binary", name, "CIFAR-100")?;
    let (at, classes) = match label {
        Cifar100Label::Fine => (1, 100),
        Cifar100Label::Coarse => (0, 20),
    };
    read_cifar_files("cifar100", &existing(&d, &[name.to_string()])?, 2, at, classes)
}
