//! IDX files: MNIST, Fashion-MNIST (documented on [`mnist`]).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::dataset::{ImageSet, Split};
use crate::error::{DataError, Result};

/// Opens `path` if it is a regular file (links followed): a FIFO would block the read, a device such as
/// `/dev/zero` never end it. Returns the file and its size.
pub(crate) fn open_regular(path: &Path) -> Result<(std::fs::File, u64)> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
    let t = meta.file_type();
    let kind = match () {
        _ if t.is_file() => return Ok((std::fs::File::open(path).map_err(|e| DataError::io(path, e))?, meta.len())),
        _ if t.is_dir() => "directory",
        _ if t.is_fifo() => "FIFO",
        _ if t.is_char_device() || t.is_block_device() => "device",
        _ if t.is_socket() => "socket",
        _ => "special file",
    };
    Err(DataError::NotAFile { path: path.to_path_buf(), kind })
}

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
        let mut out = Vec::with_capacity(raw.len() * 4);
        let mut gz = flate2::read::MultiGzDecoder::new(&raw[..]).take(LIMIT + 1);
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

/// Reads an IDX file of `ndim` dimensions: a plain file is checked against its header's size
/// before its data is read, a gzip stream is read no further than its header says, plus one byte.
fn read_idx(path: &Path, ndim: u8) -> Result<IdxArray> {
    let (file, len) = open_regular(path)?;
    let mut r = std::io::BufReader::new(file);
    let gz = std::io::BufRead::fill_buf(&mut r).map_err(|e| DataError::io(path, e))?.starts_with(&[0x1f, 0x8b]);
    let mut src: Box<dyn Read> = if gz { Box::new(flate2::read::MultiGzDecoder::new(r)) } else { Box::new(r) };
    let header_len = 4 + 4 * usize::from(ndim);
    let mut header = Vec::with_capacity(header_len);
    (&mut src).take(header_len as u64).read_to_end(&mut header).map_err(|e| DataError::io(path, e))?;
    // The header alone, parsed for its dimensions (its data check fails for lack of data: ignored).
    let want = match parse_idx(&header, path, ndim) {
        Ok(a) => a.data.len(),
        Err(DataError::Truncated { .. }) if header.len() == header_len => idx_data_len(&header, path)?,
        Err(e) => return Err(e),
    };
    if !gz && len != (header_len + want) as u64 {
        return Err(parse_idx_sizes(path, &header, want, len - header_len as u64));
    }
    let mut data = Vec::new();
    src.take(want as u64 + 1).read_to_end(&mut data).map_err(|e| {
        let kind = e.kind();
        DataError::io(path, std::io::Error::new(kind, format!("corrupt or truncated gzip stream: {e}")))
    })?;
    if data.len() != want {
        return Err(parse_idx_sizes(path, &header, want, data.len() as u64));
    }
    let dims = header[4..].chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    Ok(IdxArray { dims, data })
}

/// The data bytes an IDX header of the right length announces (the product of its dimensions).
fn idx_data_len(header: &[u8], path: &Path) -> Result<usize> {
    let dims: Vec<usize> =
        header[4..].chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| DataError::format(path, format!("dimensions {dims:?} overflow")))
}

/// The error of an IDX file whose data is not the size its header announces.
fn parse_idx_sizes(path: &Path, header: &[u8], want: usize, have: u64) -> DataError {
    let dims: Vec<usize> =
        header[4..].chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    if have < want as u64 {
        DataError::truncated(path, format!("header {dims:?} needs {want} data bytes, file has {have}"))
    } else {
        DataError::format(path, format!("header {dims:?} needs {want} data bytes, file has more (trailing data)"))
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
