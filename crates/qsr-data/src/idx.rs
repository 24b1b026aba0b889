//! IDX files: MNIST, Fashion-MNIST (documented on [`mnist`]).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::dataset::{ImageSet, Split};
use crate::error::{DataError, Result};

/// Reads a whole file, transparently un-gzipping it when it starts with the gzip magic.
pub fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    if raw.len() >= 2 && raw[0] == 0x1f && raw[1] == 0x8b {
        let mut out = Vec::with_capacity(raw.len() * 4);
        flate2::read::MultiGzDecoder::new(&raw[..]).read_to_end(&mut out).map_err(|e| {
            let kind = e.kind();
            DataError::io(path, std::io::Error::new(kind, format!("corrupt or truncated gzip stream: {e}")))
        })?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// An IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions from the header, outermost first: `[N, H, W]` for an image file, `[N]` for a label file.
    pub dims: Vec<usize>,
    /// The values, row-major: exactly the product of `dims` bytes.
    pub data: Vec<u8>,
}

/// Parses IDX bytes; `path` only names the file in errors. `expected_ndim` is 1 for labels, 3 for images.
pub fn parse_idx(bytes: &[u8], path: &Path, expected_ndim: u8) -> Result<IdxArray> {
    if bytes.len() < 4 {
        return Err(DataError::truncated(path, format!("{} bytes, shorter than the 4-byte IDX magic", bytes.len())));
    }
    let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let expected = 0x0800 | u32::from(expected_ndim);
    if magic != expected {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: format!("{expected:#010x} (IDX, unsigned byte, {expected_ndim} dimension(s))"),
        });
    }
    let ndim = usize::from(expected_ndim);
    let header = 4 + 4 * ndim;
    if bytes.len() < header {
        return Err(DataError::truncated(
            path,
            format!("{} bytes, shorter than the {header}-byte header", bytes.len()),
        ));
    }
    let dims: Vec<usize> =
        (0..ndim).map(|i| u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize).collect();
    let want = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| DataError::format(path, format!("dimensions {dims:?} overflow")))?;
    let have = bytes.len() - header;
    if have < want {
        return Err(DataError::truncated(path, format!("header {dims:?} needs {want} data bytes, file has {have}")));
    }
    if have > want {
        return Err(DataError::format(
            path,
            format!("header {dims:?} needs {want} data bytes, file has {have} (trailing data)"),
        ));
    }
    Ok(IdxArray { dims, data: bytes[header..].to_vec() })
}

/// Reads an IDX image file (`N x H x W`).
pub fn read_idx_images(path: &Path) -> Result<IdxArray> {
    parse_idx(&read_maybe_gz(path)?, path, 3)
}

/// Reads an IDX label file (`N`).
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    Ok(parse_idx(&read_maybe_gz(path)?, path, 1)?.data)
}

/// Reads an image file and a label file into a 1-channel [`ImageSet`], checking counts and label range.
pub fn load_idx_pair(name: &str, images: &Path, labels: &Path, classes: usize, flip_ok: bool) -> Result<ImageSet> {
    let img = read_idx_images(images)?;
    let lab = read_idx_labels(labels)?;
    let (n, h, w) = (img.dims[0], img.dims[1], img.dims[2]);
    if n != lab.len() {
        return Err(DataError::CountMismatch {
            images_path: images.to_path_buf(),
            labels_path: labels.to_path_buf(),
            images: n,
            labels: lab.len(),
        });
    }
    if let Some((index, &l)) = lab.iter().enumerate().find(|(_, l)| usize::from(**l) >= classes) {
        return Err(DataError::LabelOutOfRange { path: labels.to_path_buf(), index, label: l.into(), classes });
    }
    let labels16 = lab.into_iter().map(u16::from).collect();
    ImageSet::new(name, img.data, labels16, (1, h, w), classes, 255, flip_ok, images)
}

/// Finds `{prefix}-{kind}` under `dir` in the usual spellings (`-idx3-ubyte`, `.idx3-ubyte`, with or without `.gz`).
fn find_idx(dir: &Path, prefix: &str, kind: &str, ndim: u8) -> Result<PathBuf> {
    let names = [
        format!("{prefix}-{kind}-idx{ndim}-ubyte.gz"),
        format!("{prefix}-{kind}-idx{ndim}-ubyte"),
        format!("{prefix}-{kind}.idx{ndim}-ubyte.gz"),
        format!("{prefix}-{kind}.idx{ndim}-ubyte"),
    ];
    names.iter().map(|n| dir.join(n)).find(|p| p.is_file()).ok_or_else(|| DataError::MissingFile {
        path: dir.join(&names[0]),
        what: format!("none of {names:?} in {}", dir.display()),
    })
}

fn idx_dataset(name: &str, dir: &Path, split: Split, flip_ok: bool) -> Result<ImageSet> {
    if !dir.is_dir() {
        return Err(DataError::MissingDir { path: dir.to_path_buf(), what: format!("{name} IDX directory") });
    }
    let prefix = match split {
        Split::Train => "train",
        Split::Test => "t10k",
    };
    let images = find_idx(dir, prefix, "images", 3)?;
    let labels = find_idx(dir, prefix, "labels", 1)?;
    load_idx_pair(name, &images, &labels, 10, flip_ok)
}

/// MNIST from its four IDX files (`train-images-idx3-ubyte[.gz]`, ...) in `dir`. No flip by default.
///
/// IDX files (MNIST, Fashion-MNIST), raw or gzip-compressed (detected by content, not by name).
/// Format: magic `00 00 08 ndim` (0x08 = unsigned byte), `ndim` big-endian u32 dimensions, then the data.
pub fn mnist(dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    idx_dataset("mnist", dir.as_ref(), split, false)
}

/// Fashion-MNIST (same file names as MNIST; Debian's `dataset-fashion-mnist` puts them in
/// `/usr/share/datasets/fashion-mnist`). Flip is off by default like MNIST; set `info.flip_ok` to enable it.
pub fn fashion_mnist(dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    idx_dataset("fashion-mnist", dir.as_ref(), split, false)
}

/// Where Debian's `dataset-fashion-mnist` package installs the files.
pub const FASHION_MNIST_DEFAULT_DIR: &str = "/usr/share/datasets/fashion-mnist";
