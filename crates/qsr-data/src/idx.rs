//! IDX files: MNIST, Fashion-MNIST (documented on [`mnist`]).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::dataset::{ImageSet, Split};
use crate::error::{DataError, Result};

/// Opens `path` if it is a regular file (links followed), through the one door (`qsr-files`): a FIFO
/// would block the read, a device such as `/dev/zero` never end it. Returns the file and its size.
pub(crate) fn open_regular(path: &Path) -> Result<(std::fs::File, u64)> {
    qsr_files::open(path, "data file").map_err(|e| match e {
        qsr_files::FileError::NotRegular { kind, .. } => DataError::NotAFile { path: path.to_path_buf(), kind },
        qsr_files::FileError::Io { source, .. } => DataError::io(path, source),
        other => DataError::io(path, other.into()),
    })
}

/// What a file system entry is, in words for an error: `file`, `directory`, `symbolic link`,
/// `FIFO`, `device`, `socket`.
pub use qsr_files::file_kind;

/// Reads a regular file of at most `limit` bytes whole (`what` names the reader in the refusal).
pub(crate) fn read_regular(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>> {
    let (file, len) = open_regular(path)?;
    if len > limit {
        return Err(DataError::TooLarge { path: path.to_path_buf(), bytes: len, limit, what });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| DataError::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(DataError::TooLarge { path: path.to_path_buf(), bytes: bytes.len() as u64, limit, what });
    }
    Ok(bytes)
}

/// Reads a whole regular file, transparently un-gzipping it when it starts with the gzip magic. The
/// compressed file and its content are each read up to 4 GiB.
pub fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    const LIMIT: u64 = 4 << 30;
    let raw = read_regular(path, LIMIT, "an IDX file may have")?;
    if raw.len() >= 2 && raw[0] == 0x1f && raw[1] == 0x8b {
        let mut out = Vec::with_capacity((raw.len() * 4).min(LIMIT as usize));
        let mut gz = crate::gz::decoder(&raw[..], path)?.take(LIMIT + 1);
        gz.read_to_end(&mut out).map_err(|e| {
            let kind = e.kind();
            DataError::io(path, std::io::Error::new(kind, format!("corrupt or truncated gzip stream: {e}")))
        })?;
        if out.len() as u64 > LIMIT {
            let what = "an IDX file may hold uncompressed";
            return Err(DataError::TooLarge { path: path.to_path_buf(), bytes: out.len() as u64, limit: LIMIT, what });
        }
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// The most data an IDX file may hold (the product of its dimensions): 4 GiB.
const IDX_LIMIT: u64 = 4 << 30;

/// Reads an IDX file of `ndim` dimensions: a plain file is checked against its header's size
/// before its data is read, a gzip stream is read no further than its header says, plus one byte.
fn read_idx(path: &Path, ndim: u8) -> Result<IdxArray> {
    let (file, len) = open_regular(path)?;
    let mut r = std::io::BufReader::new(file);
    let gz = std::io::BufRead::fill_buf(&mut r).map_err(|e| DataError::io(path, e))?.starts_with(&[0x1f, 0x8b]);
    let mut src: Box<dyn Read> = if gz { crate::gz::decoder(r, path)? } else { Box::new(r) };
    let mut head = Vec::new();
    (&mut src).take(header_len(ndim) as u64).read_to_end(&mut head).map_err(|e| DataError::io(path, e))?;
    let header = parse_header(&head, path, ndim)?;
    let want = header.data_len as u64;
    if want > IDX_LIMIT {
        let what = "an IDX file may hold (its header announces more)";
        return Err(DataError::TooLarge { path: path.to_path_buf(), bytes: want, limit: IDX_LIMIT, what });
    }
    if !gz && len != head.len() as u64 + want {
        return Err(header.size_error(path, len.saturating_sub(head.len() as u64)));
    }
    let mut data = Vec::new();
    src.take(want + 1).read_to_end(&mut data).map_err(|e| {
        let kind = e.kind();
        DataError::io(path, std::io::Error::new(kind, format!("corrupt or truncated gzip stream: {e}")))
    })?;
    if data.len() as u64 != want {
        return Err(header.size_error(path, data.len() as u64));
    }
    Ok(IdxArray { dims: header.dims, data })
}

/// Bytes of the header of an IDX file of `ndim` dimensions: the magic and one u32 per dimension.
fn header_len(ndim: u8) -> usize {
    4 + 4 * usize::from(ndim)
}

/// An IDX header: its dimensions and the data bytes they announce.
struct Header {
    dims: Vec<usize>,
    data_len: usize,
}

impl Header {
    /// The error of a file whose data (`have` bytes) is not the size the header announces.
    fn size_error(&self, path: &Path, have: u64) -> DataError {
        let (dims, want) = (&self.dims, self.data_len);
        if have < want as u64 {
            DataError::truncated(path, format!("header {dims:?} needs {want} data bytes, file has {have}"))
        } else {
            DataError::format(path, format!("header {dims:?} needs {want} data bytes, file has more (trailing data)"))
        }
    }
}

/// Parses the header at the start of `bytes`: the magic of unsigned bytes in `ndim` dimensions, then
/// the dimensions, whose product must fit a `usize`.
fn parse_header(bytes: &[u8], path: &Path, ndim: u8) -> Result<Header> {
    if bytes.len() < 4 {
        return Err(DataError::truncated(path, format!("{} bytes, shorter than the 4-byte IDX magic", bytes.len())));
    }
    let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let expected = 0x0800 | u32::from(ndim);
    if magic != expected {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: format!("{expected:#010x} (IDX, unsigned byte, {ndim} dimension(s))"),
        });
    }
    let len = header_len(ndim);
    if bytes.len() < len {
        return Err(DataError::truncated(path, format!("{} bytes, shorter than the {len}-byte header", bytes.len())));
    }
    let dims: Vec<usize> =
        bytes[4..len].chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    let data_len = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| DataError::format(path, format!("dimensions {dims:?} overflow")))?;
    Ok(Header { dims, data_len })
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
    let header = parse_header(bytes, path, expected_ndim)?;
    let data = &bytes[header_len(expected_ndim)..];
    if data.len() != header.data_len {
        return Err(header.size_error(path, data.len() as u64));
    }
    Ok(IdxArray { dims: header.dims, data: data.to_vec() })
}

/// Reads an IDX image file (`N x H x W`).
pub fn read_idx_images(path: &Path) -> Result<IdxArray> {
    read_idx(path, 3)
}

/// Reads an IDX label file (`N`).
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    Ok(read_idx(path, 1)?.data)
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
