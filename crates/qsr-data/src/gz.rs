//! gzip streams (IDX files as distributed, the embedded digits), behind the `gzip` feature: its
//! decoder's features differ from what a burn program already builds, and would rebuild burn there.

use std::io::Read;
use std::path::Path;

#[cfg(not(feature = "gzip"))]
use crate::error::DataError;
use crate::error::Result;

/// A reader of what the gzip stream `r` (of the file `path`) holds, its members concatenated.
#[cfg(feature = "gzip")]
pub(crate) fn decoder<'a>(r: impl Read + 'a, _path: &Path) -> Result<Box<dyn Read + 'a>> {
    Ok(Box::new(flate2::read::MultiGzDecoder::new(r)))
}

/// Without the `gzip` feature: refuses, naming the file and the feature.
#[cfg(not(feature = "gzip"))]
pub(crate) fn decoder<'a>(_r: impl Read + 'a, path: &Path) -> Result<Box<dyn Read + 'a>> {
    let reason =
        "gzip-compressed, and qsr-data was built without its `gzip` feature: turn it on, or decompress the file";
    Err(DataError::format(path, reason))
}
