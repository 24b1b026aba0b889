//! torchvision-style ImageFolder (documented on [`ImageFolder`]).

use std::path::{Path, PathBuf};

use crate::dataset::{Dataset, DatasetInfo, Image, Split};
use crate::error::{DataError, Result};

/// File extensions decoded (case-insensitive).
pub const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg"];

/// A folder of class sub-folders.
///
/// torchvision-style ImageFolder: `root/<class>/**/<image>.{png,jpg,jpeg}`; class names sorted -> label index.
/// Only paths are held in memory; images are decoded per sample in [`Dataset::load`] (ImageNet does not fit).
#[derive(Debug, Clone)]
pub struct ImageFolder {
    root: PathBuf,
    class_names: Vec<String>,
    samples: Vec<(PathBuf, u16)>,
    info: DatasetInfo,
}

fn is_image(p: &Path) -> bool {
    p.extension().and_then(|e| e.to_str()).is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| x.eq_ignore_ascii_case(e)))
}

/// All image files under `dir`, recursively, in sorted path order.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| DataError::io(dir, e)))
        .collect::<Result<_>>()?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out)?;
        } else if is_image(&p) {
            out.push(p);
        }
    }
    Ok(())
}

impl ImageFolder {
    /// Scans `root`. Errors: missing directory, no class folders, a class folder without images.
    pub fn new(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        if !root.is_dir() {
            return Err(DataError::MissingDir { path: root, what: "ImageFolder root".into() });
        }
        let mut class_names: Vec<String> = std::fs::read_dir(&root)
            .map_err(|e| DataError::io(&root, e))?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        class_names.sort();
        if class_names.is_empty() {
            return Err(DataError::Empty { path: root, detail: "no class sub-folders".into() });
        }
        if class_names.len() > usize::from(u16::MAX) {
            return Err(DataError::format(&root, format!("{} classes, at most 65535 supported", class_names.len())));
        }
        let mut samples = Vec::new();
        for (label, name) in class_names.iter().enumerate() {
            let dir = root.join(name);
            let mut files = Vec::new();
            walk(&dir, &mut files)?;
            if files.is_empty() {
                return Err(DataError::Empty {
                    path: dir,
                    detail: format!("class folder has no image files ({})", IMAGE_EXTENSIONS.join(", ")),
                });
            }
            samples.extend(files.into_iter().map(|f| (f, label as u16)));
        }
        let info = DatasetInfo {
            name: root.display().to_string(),
            len: samples.len(),
            classes: class_names.len(),
            channels: 3,
            size: None,
            pixel_max: 255,
            flip_ok: true,
        };
        Ok(ImageFolder { root, class_names, samples, info })
    }

    /// ImageNet laid out as `root/train/<wnid>/*.JPEG` and `root/val/<wnid>/*.JPEG`.
    pub fn imagenet(root: impl AsRef<Path>, split: Split) -> Result<Self> {
        let sub = match split {
            Split::Train => "train",
            Split::Test => "val",
        };
        Self::new(root.as_ref().join(sub))
    }

    /// The directory scanned, holding one sub-folder per class.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// Sorted class names; the label of a class is its index here.
    pub fn class_names(&self) -> &[String] {
        &self.class_names
    }
    /// `(path, label)` of every sample, in sample-index order.
    pub fn samples(&self) -> &[(PathBuf, u16)] {
        &self.samples
    }
}

/// The most bytes an image file may have (a 16k x 16k RGB PNG is about 768 MiB raw).
#[cfg(feature = "images")]
const IMAGE_BYTES: u64 = 1 << 30;

/// Decodes a PNG/JPEG file (format guessed from content) to 3-channel CHW `u8`. Without the crate's
/// `images` feature it refuses every file, naming the feature.
#[cfg(feature = "images")]
pub fn decode_rgb(path: &Path) -> Result<Image> {
    let bad = |reason: String| DataError::UnreadableImage { path: path.to_path_buf(), reason };
    let bytes = crate::idx::read_regular(path, IMAGE_BYTES, "an image file may have")?;
    let reader =
        image::ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(e.to_string()))?;
    let rgb = reader.decode().map_err(|e| bad(e.to_string()))?.into_rgb8();
    let (w, h) = (rgb.width() as usize, rgb.height() as usize);
    if w == 0 || h == 0 {
        return Err(bad("image has zero size".into()));
    }
    let hwc = rgb.into_raw();
    let plane = w * h;
    let mut data = vec![0u8; 3 * plane];
    for (p, px) in hwc.chunks_exact(3).enumerate() {
        data[p] = px[0];
        data[plane + p] = px[1];
        data[2 * plane + p] = px[2];
    }
    Ok(Image { data, channels: 3, height: h, width: w })
}

/// Decodes a PNG/JPEG file (format guessed from content) to 3-channel CHW `u8`. Without the crate's
/// `images` feature it refuses every file, naming the feature.
#[cfg(not(feature = "images"))]
pub fn decode_rgb(path: &Path) -> Result<Image> {
    let reason = "qsr-data was built without its `images` feature (PNG / JPEG decoding); turn it on".into();
    Err(DataError::UnreadableImage { path: path.to_path_buf(), reason })
}

impl Dataset for ImageFolder {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }
    fn label(&self, index: usize) -> u16 {
        self.samples[index].1
    }
    fn load(&self, index: usize) -> Result<(Image, u16)> {
        let (path, label) = self
            .samples
            .get(index)
            .ok_or_else(|| DataError::Config(format!("sample {index} out of range (len {})", self.samples.len())))?;
        Ok((decode_rgb(path)?, *label))
    }
}
