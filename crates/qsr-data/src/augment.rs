//! Augmentation and normalization (documented on [`Transform`]).

use serde::{Deserialize, Serialize};

use crate::dataset::{DatasetInfo, Image};
use crate::error::{DataError, Result};
use crate::rng;

/// How a sample is cropped/resized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Crop {
    /// Keep the image as is (all samples must have the dataset's fixed size).
    None,
    /// Zero-pad `pad` pixels on every side, then take a random crop of the original size (CIFAR recipe).
    RandomPad {
        /// Zero pixels added on each side before cropping (4 for 32x32 CIFAR images).
        pad: usize,
    },
    /// torchvision `RandomResizedCrop(size, scale, ratio)`: random area fraction and log-uniform aspect ratio,
    /// 10 attempts then the center-crop fallback, resized to `size x size` (bilinear, antialiased).
    RandomResized {
        /// Side of the square output, in pixels (224 for ImageNet).
        size: usize,
        /// Range `(min, max)` of the crop's area as a fraction of the image's; torchvision's default `(0.08, 1.0)`.
        scale: (f64, f64),
        /// Range `(min, max)` of the crop's aspect ratio width / height, drawn log-uniformly; default `(3/4, 4/3)`.
        ratio: (f64, f64),
    },
    /// Evaluation: resize the shorter side to `resize` (torchvision `Resize(int)`), then center-crop `size x size`.
    CenterResize {
        /// Length, in pixels, the shorter side is resized to (256 for ImageNet).
        resize: usize,
        /// Side of the square center crop, in pixels, at most `resize` (224 for ImageNet).
        size: usize,
    },
}

impl Crop {
    /// RandomResizedCrop with torchvision's defaults (scale 0.08..1, ratio 3/4..4/3).
    pub fn random_resized(size: usize) -> Crop {
        Crop::RandomResized { size, scale: (0.08, 1.0), ratio: (3.0 / 4.0, 4.0 / 3.0) }
    }
    fn is_random(&self) -> bool {
        matches!(self, Crop::RandomPad { .. } | Crop::RandomResized { .. })
    }
}

/// Per-channel normalization on the 0..1 scale (after division by `pixel_max`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Normalize {
    /// Per-channel mean on the 0..1 scale, subtracted first; one value per channel, or one for all.
    pub mean: Vec<f32>,
    /// Per-channel standard deviation on the 0..1 scale, divided by after the mean; one value per channel, or
    /// one for all; every value finite and > 0.
    pub std: Vec<f32>,
}

impl Normalize {
    /// `(x - mean[c]) / std[c]` with the given statistics (checked by [`Transform::output_shape`]).
    pub fn new(mean: Vec<f32>, std: Vec<f32>) -> Self {
        Normalize { mean, std }
    }
    /// Identity (values stay in 0..1).
    pub fn identity(channels: usize) -> Self {
        Normalize { mean: vec![0.0; channels], std: vec![1.0; channels] }
    }
    /// ImageNet's RGB statistics (torchvision's mean 0.485/0.456/0.406, std 0.229/0.224/0.225).
    pub fn imagenet() -> Self {
        Self::new(vec![0.485, 0.456, 0.406], vec![0.229, 0.224, 0.225])
    }
    /// CIFAR-10's RGB training-set statistics.
    pub fn cifar10() -> Self {
        Self::new(vec![0.4914, 0.4822, 0.4465], vec![0.2470, 0.2435, 0.2616])
    }
    /// CIFAR-100's RGB training-set statistics.
    pub fn cifar100() -> Self {
        Self::new(vec![0.5071, 0.4865, 0.4409], vec![0.2673, 0.2564, 0.2762])
    }
    /// MNIST's statistics (mean 0.1307, std 0.3081).
    pub fn mnist() -> Self {
        Self::new(vec![0.1307], vec![0.3081])
    }
    /// Fashion-MNIST's statistics (mean 0.2860, std 0.3530).
    pub fn fashion_mnist() -> Self {
        Self::new(vec![0.2860], vec![0.3530])
    }
    /// Mean/std of the digits training split, pixels / 16.
    pub fn digits() -> Self {
        Self::new(vec![0.3054], vec![0.3755])
    }
    /// The usual statistics for a dataset name of this crate (ImageNet's for anything else with 3 channels).
    pub fn for_dataset(info: &DatasetInfo) -> Self {
        match info.name.as_str() {
            "digits" => Self::digits(),
            "mnist" => Self::mnist(),
            "fashion-mnist" => Self::fashion_mnist(),
            "cifar10" => Self::cifar10(),
            "cifar100" => Self::cifar100(),
            _ if info.channels == 3 => Self::imagenet(),
            _ => Self::identity(info.channels),
        }
    }
}

/// A complete per-sample transform.
///
/// Augmentation and normalization, from a `u8` CHW [`Image`] straight into the `f32` slot of a batch.
///
/// Order of operations: crop (and resize) -> horizontal flip -> divide by the dataset's `pixel_max` -> per-channel
/// `(x - mean) / std`. Padding is done with raw zeros before normalization (as torchvision's `RandomCrop(padding=4)`
/// on a PIL image), so a padded pixel ends up as `(0 - mean) / std`.
///
/// All randomness of one sample comes from one ChaCha8 stream keyed by (seed, epoch, sample index), so a sample's
/// pixels never depend on which thread produced them, on the rank, or on the world size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transform {
    /// How the sample is cropped and resized, first.
    pub crop: Crop,
    /// Random horizontal flip with probability 1/2.
    pub flip: bool,
    /// Per-channel normalization, applied last.
    pub normalize: Normalize,
}

/// Identifies one sample draw; the key of its random stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SampleKey {
    /// Run seed of the data (the sampler's seed).
    pub seed: u64,
    /// Epoch of the draw: the same sample is augmented differently every epoch.
    pub epoch: u64,
    /// Index of the sample in its dataset.
    pub index: u64,
}

impl Transform {
    /// Training default: small fixed-size images (<= 64 px) get random crop with `pad = max(1, h/8)` (4 for 32x32)
    /// and flip where the dataset allows it; larger or variable-size images get RandomResizedCrop 224 + flip.
    pub fn train_default(info: &DatasetInfo) -> Self {
        match info.size {
            Some((h, w)) if h.max(w) <= 64 => Transform {
                crop: Crop::RandomPad { pad: (h.min(w) / 8).max(1) },
                flip: info.flip_ok,
                normalize: Normalize::for_dataset(info),
            },
            _ => Transform {
                crop: Crop::random_resized(224),
                flip: info.flip_ok,
                normalize: Normalize::for_dataset(info),
            },
        }
    }
    /// Evaluation default: small images unchanged; larger ones resize 256 / center-crop 224.
    pub fn eval_default(info: &DatasetInfo) -> Self {
        match info.size {
            Some((h, w)) if h.max(w) <= 64 => {
                Transform { crop: Crop::None, flip: false, normalize: Normalize::for_dataset(info) }
            }
            _ => Transform {
                crop: Crop::CenterResize { resize: 256, size: 224 },
                flip: false,
                normalize: Normalize::for_dataset(info),
            },
        }
    }
    /// Only normalization.
    pub fn normalize_only(normalize: Normalize) -> Self {
        Transform { crop: Crop::None, flip: false, normalize }
    }

    /// Whether the transform draws random numbers.
    pub fn is_random(&self) -> bool {
        self.flip || self.crop.is_random()
    }

    /// `(channels, height, width)` of the output for this dataset; checks the settings.
    pub fn output_shape(&self, info: &DatasetInfo) -> Result<(usize, usize, usize)> {
        let c = info.channels;
        for (name, v) in [("mean", &self.normalize.mean), ("std", &self.normalize.std)] {
            if v.len() != c && v.len() != 1 {
                return Err(DataError::Config(format!("normalize {name} has {} values for {c} channels", v.len())));
            }
        }
        if self.normalize.std.iter().any(|s| s.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) || !s.is_finite())
        {
            return Err(DataError::Config("normalize std must be positive".into()));
        }
        match &self.crop {
            Crop::None | Crop::RandomPad { .. } => match info.size {
                Some((h, w)) => Ok((c, h, w)),
                None => Err(DataError::Config(format!(
                    "{}: images have no fixed size; use a RandomResized or CenterResize crop",
                    info.name
                ))),
            },
            Crop::RandomResized { size, scale, ratio } => {
                if *size == 0 || !(scale.0 > 0.0 && scale.0 <= scale.1) || !(ratio.0 > 0.0 && ratio.0 <= ratio.1) {
                    return Err(DataError::Config(format!("bad RandomResized crop {:?}", self.crop)));
                }
                Ok((c, *size, *size))
            }
            Crop::CenterResize { resize, size } => {
                if *size == 0 || size > resize {
                    return Err(DataError::Config(format!("center crop {size} must be in 1..=resize {resize}")));
                }
                Ok((c, *size, *size))
            }
        }
    }

    /// Transforms `img` into `out` (length `C*H*W` of [`output_shape`](Self::output_shape)).
    pub fn apply(&self, img: &Image, pixel_max: u8, key: SampleKey, out: &mut [f32]) -> Result<()> {
        let mut r = rng::stream(key.seed, key.epoch, key.index, rng::TAG_AUGMENT);
        let c = img.channels;
        let scale = 1.0 / f32::from(pixel_max.max(1));
        let mean = |ch: usize| self.normalize.mean[if self.normalize.mean.len() == 1 { 0 } else { ch }];
        let std = |ch: usize| self.normalize.std[if self.normalize.std.len() == 1 { 0 } else { ch }];
        match &self.crop {
            Crop::None | Crop::RandomPad { .. } => {
                let (h, w) = (img.height, img.width);
                if out.len() != c * h * w {
                    return Err(DataError::Config(format!(
                        "image of {c}x{h}x{w} does not fit an output of {} values (images of different sizes need a resizing crop)",
                        out.len()
                    )));
                }
                let pad = if let Crop::RandomPad { pad } = self.crop { pad } else { 0 };
                let (top, left) = if pad > 0 {
                    let n = 2 * pad as u64 + 1;
                    (rng::below(&mut r, n) as isize, rng::below(&mut r, n) as isize)
                } else {
                    (0, 0)
                };
                let flip = self.flip && rng::unit(&mut r) < 0.5;
                let pad = pad as isize;
                for ch in 0..c {
                    let (m, s) = (mean(ch), 1.0 / std(ch));
                    for y in 0..h {
                        let sy = y as isize + top - pad;
                        let row = &mut out[(ch * h + y) * w..(ch * h + y + 1) * w];
                        for (x, o) in row.iter_mut().enumerate() {
                            let xo = if flip { w - 1 - x } else { x };
                            let sx = xo as isize + left - pad;
                            let v = if sy >= 0 && sy < h as isize && sx >= 0 && sx < w as isize {
                                img.at(ch, sy as usize, sx as usize)
                            } else {
                                0
                            };
                            *o = (f32::from(v) * scale - m) * s;
                        }
                    }
                }
            }
            Crop::RandomResized { size, scale: sc, ratio } => {
                let (top, left, ch_, cw) = random_resized_crop_params(&mut r, img.height, img.width, *sc, *ratio);
                let flip = self.flip && rng::unit(&mut r) < 0.5;
                let tmp = resample(img, top, left, ch_, cw, *size, *size);
                finish(&tmp, c, *size, *size, flip, scale, &mean, &std, out)?;
            }
            Crop::CenterResize { resize, size } => {
                let (nh, nw) = resize_shorter(img.height, img.width, *resize);
                // Resize the whole image (torchvision Resize), then cut the center crop out of it.
                let full = resample(img, 0, 0, img.height, img.width, nh, nw);
                let top = ((nh as f64 - *size as f64) / 2.0).round_ties_even().max(0.0) as usize;
                let left = ((nw as f64 - *size as f64) / 2.0).round_ties_even().max(0.0) as usize;
                let mut crop = vec![0f32; c * size * size];
                for ch in 0..c {
                    for y in 0..*size {
                        let src = &full[(ch * nh + top + y) * nw + left..][..*size];
                        crop[(ch * size + y) * size..][..*size].copy_from_slice(src);
                    }
                }
                finish(&crop, c, *size, *size, false, scale, &mean, &std, out)?;
            }
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    src: &[f32],
    c: usize,
    h: usize,
    w: usize,
    flip: bool,
    scale: f32,
    mean: &dyn Fn(usize) -> f32,
    std: &dyn Fn(usize) -> f32,
    out: &mut [f32],
) -> Result<()> {
    if out.len() != c * h * w {
        return Err(DataError::Config(format!("output of {} values, transform makes {c}x{h}x{w}", out.len())));
    }
    for ch in 0..c {
        let (m, s) = (mean(ch), 1.0 / std(ch));
        for y in 0..h {
            let srow = &src[(ch * h + y) * w..][..w];
            let orow = &mut out[(ch * h + y) * w..][..w];
            for x in 0..w {
                let v = srow[if flip { w - 1 - x } else { x }];
                orow[x] = (v * scale - m) * s;
            }
        }
    }
    Ok(())
}

/// torchvision `Resize(int)` output size: the shorter side becomes `size`, the longer one keeps the aspect
/// (truncated).
pub fn resize_shorter(h: usize, w: usize, size: usize) -> (usize, usize) {
    if h <= w {
        (size, ((size as u64 * w as u64) / h.max(1) as u64).max(1) as usize)
    } else {
        (((size as u64 * h as u64) / w.max(1) as u64).max(1) as usize, size)
    }
}

/// torchvision `RandomResizedCrop.get_params`: returns `(top, left, height, width)` of the crop.
/// Ten attempts with area fraction uniform in `scale` and aspect ratio log-uniform in `ratio`; if none fits,
/// the fallback is a center crop of the whole image clamped to the ratio range.
pub fn random_resized_crop_params(
    r: &mut impl rand::RngCore,
    height: usize,
    width: usize,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> (usize, usize, usize, usize) {
    let area = (height * width) as f64;
    let (lr0, lr1) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * rng::uniform(r, scale.0, scale.1);
        let aspect = rng::uniform(r, lr0, lr1).exp();
        let w = (target * aspect).sqrt().round_ties_even() as usize;
        let h = (target / aspect).sqrt().round_ties_even() as usize;
        if 0 < w && w <= width && 0 < h && h <= height {
            let top = rng::below(r, (height - h + 1) as u64) as usize;
            let left = rng::below(r, (width - w + 1) as u64) as usize;
            return (top, left, h, w);
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (h, w) = if in_ratio < ratio.0 {
        (((width as f64 / ratio.0).round_ties_even() as usize).clamp(1, height), width)
    } else if in_ratio > ratio.1 {
        (height, ((height as f64 * ratio.1).round_ties_even() as usize).clamp(1, width))
    } else {
        (height, width)
    };
    ((height - h) / 2, (width - w) / 2, h, w)
}

/// For each output coordinate: first source index and the normalized weights (PIL-style triangle filter whose
/// support widens with the downscaling factor, i.e. antialiased bilinear).
fn coefficients(in_len: usize, out_len: usize) -> Vec<(usize, Vec<f32>)> {
    let scale = in_len as f64 / out_len as f64;
    let fscale = scale.max(1.0);
    let support = fscale;
    (0..out_len)
        .map(|o| {
            let center = (o as f64 + 0.5) * scale;
            let lo = ((center - support + 0.5).floor().max(0.0)) as usize;
            let hi = ((center + support + 0.5).floor() as usize).min(in_len).max(lo + 1);
            let mut ws: Vec<f64> = (lo..hi)
                .map(|i| {
                    let d = ((i as f64 - center + 0.5) / fscale).abs();
                    (1.0 - d).max(0.0)
                })
                .collect();
            let sum: f64 = ws.iter().sum();
            if sum > 0.0 {
                ws.iter_mut().for_each(|w| *w /= sum);
            } else {
                ws.iter_mut().for_each(|w| *w = 0.0);
                let nearest = (center.floor() as usize).clamp(lo, hi - 1);
                ws[nearest - lo] = 1.0;
            }
            (lo, ws.into_iter().map(|w| w as f32).collect())
        })
        .collect()
}

/// Resamples the region `(top, left, h, w)` of `img` to `out_h x out_w` (CHW f32, raw pixel units), separable
/// horizontal then vertical pass.
pub fn resample(img: &Image, top: usize, left: usize, h: usize, w: usize, out_h: usize, out_w: usize) -> Vec<f32> {
    let c = img.channels;
    let cx = coefficients(w, out_w);
    let cy = coefficients(h, out_h);
    // horizontal pass over the rows of the region: c x h x out_w
    let mut tmp = vec![0f32; c * h * out_w];
    for ch in 0..c {
        for y in 0..h {
            let src = &img.data[(ch * img.height + top + y) * img.width + left..][..w];
            let dst = &mut tmp[(ch * h + y) * out_w..][..out_w];
            for (d, (lo, ws)) in dst.iter_mut().zip(&cx) {
                *d = ws.iter().zip(&src[*lo..]).map(|(wt, &p)| wt * f32::from(p)).sum();
            }
        }
    }
    let mut out = vec![0f32; c * out_h * out_w];
    for ch in 0..c {
        for (oy, (lo, ws)) in cy.iter().enumerate() {
            let dst = &mut out[(ch * out_h + oy) * out_w..][..out_w];
            for (k, wt) in ws.iter().enumerate() {
                let src = &tmp[(ch * h + lo + k) * out_w..][..out_w];
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += wt * s;
                }
            }
        }
    }
    out
}
