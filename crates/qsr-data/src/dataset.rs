//! The dataset abstraction (documented on [`Dataset`]).

use std::path::PathBuf;

use crate::error::{DataError, Result};

/// Which half of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// The training split.
    Train,
    /// The test (evaluation) split.
    Test,
}

/// One decoded image: `u8` pixels in CHW order (planar), any size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Pixels, `channels * height * width` bytes, channel-major (CHW).
    pub data: Vec<u8>,
    /// Number of channels (1 for grayscale, 3 for RGB).
    pub channels: usize,
    /// Rows, in pixels.
    pub height: usize,
    /// Columns, in pixels.
    pub width: usize,
}

impl Image {
    /// Pixel (channel, row, column).
    #[inline]
    pub fn at(&self, c: usize, y: usize, x: usize) -> u8 {
        self.data[(c * self.height + y) * self.width + x]
    }
}

/// Static facts about a dataset that transforms need before seeing any sample.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DatasetInfo {
    /// Short name ("digits", "fashion-mnist", "cifar10", a folder path...).
    pub name: String,
    /// Number of samples.
    pub len: usize,
    /// Number of classes; every label is below it.
    pub classes: usize,
    /// Channels of every sample (1 or 3).
    pub channels: usize,
    /// `(height, width)` when every sample has that size; `None` for folders of arbitrary images.
    pub size: Option<(usize, usize)>,
    /// Raw value that means "full intensity": 255 for 8-bit images, 16 for digits. Pixels are divided by it
    /// before normalization so that mean/std settings are on the usual 0..1 scale.
    pub pixel_max: u8,
    /// Whether a horizontal flip is a label-preserving augmentation (not for digits or handwriting).
    pub flip_ok: bool,
}

/// A finite, indexable set of labelled images. `load` must be a pure function of `index` (it is called from
/// many threads, in any order).
///
/// The dataset abstraction: small datasets live in memory as one `u8` buffer ([`ImageSet`]); large ones
/// ([`crate::ImageFolder`]) decode one sample at a time, since ImageNet does not fit in memory. Both are
/// [`Dataset`]s, so the sampler, transforms and loaders do not care which.
pub trait Dataset: Send + Sync {
    /// The dataset's name, size, classes and image format.
    fn info(&self) -> &DatasetInfo;
    /// Number of samples (`info().len`).
    fn len(&self) -> usize {
        self.info().len
    }
    /// Whether the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of classes (`info().classes`).
    fn classes(&self) -> usize {
        self.info().classes
    }
    /// `(channels, height, width)` of every sample if fixed.
    fn shape(&self) -> Option<(usize, usize, usize)> {
        let i = self.info();
        i.size.map(|(h, w)| (i.channels, h, w))
    }
    /// Label of sample `index` without decoding the image.
    fn label(&self, index: usize) -> u16;
    /// Decode sample `index`.
    fn load(&self, index: usize) -> Result<(Image, u16)>;
}

/// An in-memory dataset: all images in one buffer (`N*C*H*W`, CHW per image), labels `< classes`.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSet {
    /// All pixels, `len * C * H * W` bytes: image `i` is bytes `i*C*H*W..(i+1)*C*H*W`, CHW.
    pub images: Vec<u8>,
    /// Label of each image, `< info.classes`.
    pub labels: Vec<u16>,
    /// Name, length, classes and the fixed image size (`size` is always `Some`).
    pub info: DatasetInfo,
}

impl ImageSet {
    /// Checks sizes and labels. `source` names the file(s) in errors.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: impl Into<String>,
        images: Vec<u8>,
        labels: Vec<u16>,
        (channels, height, width): (usize, usize, usize),
        classes: usize,
        pixel_max: u8,
        flip_ok: bool,
        source: impl Into<PathBuf>,
    ) -> Result<Self> {
        let source = source.into();
        let per = channels * height * width;
        if per == 0 {
            return Err(DataError::format(source, "image size is zero"));
        }
        if images.len() != per * labels.len() {
            return Err(DataError::format(
                source,
                format!(
                    "{} pixel bytes for {} labels of {}x{}x{}",
                    images.len(),
                    labels.len(),
                    channels,
                    height,
                    width
                ),
            ));
        }
        if let Some((index, &l)) = labels.iter().enumerate().find(|(_, l)| usize::from(**l) >= classes) {
            return Err(DataError::LabelOutOfRange { path: source, index, label: l.into(), classes });
        }
        let info = DatasetInfo {
            name: name.into(),
            len: labels.len(),
            classes,
            channels,
            size: Some((height, width)),
            pixel_max,
            flip_ok,
        };
        Ok(ImageSet { images, labels, info })
    }

    /// Channels per image.
    pub fn channels(&self) -> usize {
        self.info.channels
    }
    /// Height of every image, in pixels.
    pub fn height(&self) -> usize {
        self.info.size.map_or(0, |s| s.0)
    }
    /// Width of every image, in pixels.
    pub fn width(&self) -> usize {
        self.info.size.map_or(0, |s| s.1)
    }
    /// Bytes of one image.
    pub fn image_len(&self) -> usize {
        self.channels() * self.height() * self.width()
    }
    /// The pixels of image `index` (CHW), borrowed.
    pub fn image(&self, index: usize) -> &[u8] {
        let n = self.image_len();
        &self.images[index * n..(index + 1) * n]
    }
    /// A subset (in the given order), e.g. a fixed validation split.
    pub fn subset(&self, indices: &[usize]) -> ImageSet {
        let mut images = Vec::with_capacity(indices.len() * self.image_len());
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            images.extend_from_slice(self.image(i));
            labels.push(self.labels[i]);
        }
        let mut info = self.info.clone();
        info.len = labels.len();
        ImageSet { images, labels, info }
    }
}

impl Dataset for ImageSet {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }
    fn label(&self, index: usize) -> u16 {
        self.labels[index]
    }
    fn load(&self, index: usize) -> Result<(Image, u16)> {
        if index >= self.labels.len() {
            return Err(DataError::Config(format!("sample {index} out of range (len {})", self.labels.len())));
        }
        let img = Image {
            data: self.image(index).to_vec(),
            channels: self.channels(),
            height: self.height(),
            width: self.width(),
        };
        Ok((img, self.labels[index]))
    }
}

impl<D: Dataset + ?Sized> Dataset for std::sync::Arc<D> {
    fn info(&self) -> &DatasetInfo {
        (**self).info()
    }
    fn label(&self, index: usize) -> u16 {
        (**self).label(index)
    }
    fn load(&self, index: usize) -> Result<(Image, u16)> {
        (**self).load(index)
    }
}

/// `n` samples of a dataset spread evenly over it (sample `i * len / n` for `i < n`): a smaller
/// training set that keeps the class mix of a shuffled one, or the training images a train-accuracy
/// evaluation reads.
pub struct Spread {
    inner: std::sync::Arc<dyn Dataset>,
    indices: Vec<usize>,
    info: DatasetInfo,
}

impl Spread {
    /// `n` samples of `inner`; refused for `n = 0` or more than it has.
    pub fn new(inner: std::sync::Arc<dyn Dataset>, n: usize) -> Result<Self> {
        let len = inner.len();
        if n == 0 || n > len {
            return Err(DataError::Config(format!("{}: cannot take {n} of its {len} samples", inner.info().name)));
        }
        let indices = (0..n).map(|i| i * len / n).collect();
        let info = DatasetInfo { len: n, ..inner.info().clone() };
        Ok(Self { inner, indices, info })
    }
}

impl Dataset for Spread {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }
    fn label(&self, index: usize) -> u16 {
        self.inner.label(self.indices[index])
    }
    fn load(&self, index: usize) -> Result<(Image, u16)> {
        let at = *self.indices.get(index).ok_or_else(|| {
            DataError::Config(format!("{}: sample {index} of {}", self.info.name, self.indices.len()))
        })?;
        self.inner.load(at)
    }
}

#[cfg(test)]
mod spread_tests {
    use super::*;

    #[test]
    fn a_spread_takes_evenly_spaced_samples_and_refuses_more_than_there_are() {
        let set: std::sync::Arc<dyn Dataset> = std::sync::Arc::new(crate::digits(Split::Train));
        let spread = Spread::new(set.clone(), 100).unwrap();
        assert_eq!(spread.len(), 100);
        assert_eq!(spread.label(1), set.label(set.len() / 100));
        assert_eq!(spread.load(99).unwrap(), set.load(99 * set.len() / 100).unwrap());
        assert!(spread.load(100).is_err());
        assert!(Spread::new(set.clone(), 0).is_err());
        let too_many = Spread::new(set.clone(), set.len() + 1).err().unwrap().to_string();
        assert!(too_many.contains(&format!("cannot take {} of its {}", set.len() + 1, set.len())), "{too_many}");
    }
}
