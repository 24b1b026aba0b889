//! scikit-learn's digits, embedded (documented on [`digits()`]) as scikit-learn ships them, gzip-compressed:
//! with the `gzip` feature (on by default).

use std::io::Read;

use crate::dataset::{ImageSet, Split};
use crate::error::{DataError, Result};

static DIGITS_CSV_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");

/// Number of images in the file.
pub const DIGITS_TOTAL: usize = 1797;
/// Number of training images (the first rows); the rest are the test split.
pub const DIGITS_TRAIN: usize = 1437;
/// Number of test images (the last rows).
pub const DIGITS_TEST: usize = DIGITS_TOTAL - DIGITS_TRAIN;

fn parse_all() -> Result<(Vec<u8>, Vec<u16>)> {
    let src = std::path::PathBuf::from("<embedded digits.csv.gz>");
    let mut text = String::new();
    crate::gz::decoder(DIGITS_CSV_GZ, &src)?.read_to_string(&mut text).map_err(|e| DataError::io(&src, e))?;
    let mut images = Vec::with_capacity(DIGITS_TOTAL * 64);
    let mut labels = Vec::with_capacity(DIGITS_TOTAL);
    for (row, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let vals: Vec<f64> = line
            .split(',')
            .map(|v| v.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|e| DataError::format(&src, format!("row {row}: {e}")))?;
        if vals.len() != 65 {
            return Err(DataError::format(&src, format!("row {row}: {} values, expected 65", vals.len())));
        }
        for &v in &vals[..64] {
            if !(0.0..=16.0).contains(&v) {
                return Err(DataError::format(&src, format!("row {row}: pixel {v} outside 0..=16")));
            }
            images.push(v as u8);
        }
        labels.push(vals[64] as u16);
    }
    if labels.len() != DIGITS_TOTAL {
        return Err(DataError::format(&src, format!("{} rows, expected {DIGITS_TOTAL}", labels.len())));
    }
    Ok((images, labels))
}

/// The embedded digits, one split. Pixel maximum is 16 (not 255); flip is off (digits are not symmetric).
///
/// scikit-learn's digits (UCI "Optical Recognition of Handwritten Digits" test set, CC BY 4.0, distributed by
/// scikit-learn under BSD-3; see `data/README.md`), embedded so that the default dataset needs nothing
/// installed. 1797 images of 8x8, values 0..=16, 10 classes.
///
/// Split (fixed, documented in `data/README.md`): rows `0..1437` train, rows `1437..1797` test.
pub fn digits(split: Split) -> ImageSet {
    // The embedded file is fixed and checked by the tests, so a failure here is a build defect, not bad user data.
    let (images, labels) = parse_all().expect("embedded digits.csv.gz is valid");
    let range = match split {
        Split::Train => 0..DIGITS_TRAIN,
        Split::Test => DIGITS_TRAIN..DIGITS_TOTAL,
    };
    let imgs = images[range.start * 64..range.end * 64].to_vec();
    let labs = labels[range].to_vec();
    ImageSet::new("digits", imgs, labs, (1, 8, 8), 10, 16, false, "<embedded digits.csv.gz>")
        .expect("embedded digits are consistent")
}

/// All 1797 digits in file order (train followed by test).
pub fn digits_all() -> ImageSet {
    let (images, labels) = parse_all().expect("embedded digits.csv.gz is valid");
    ImageSet::new("digits", images, labels, (1, 8, 8), 10, 16, false, "<embedded digits.csv.gz>")
        .expect("embedded digits are consistent")
}
