//! `qsr plot`: the runs' metrics drawn into PNGs (the drawing itself is `draw`, shared with
//! `qsr plan --png` and `qsr compare`).

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::exit::bad_input;

pub(crate) mod draw;

/// `qsr plot RUN_DIR... [--out DIR]`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct PlotArgs {
    /// Run directories (each with a metrics.jsonl).
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// Where to write the PNGs (default: the first run directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Runs `qsr plot`: draws the runs' metrics into PNGs and returns their paths.
pub(crate) fn plot(args: &PlotArgs) -> Result<Vec<PathBuf>> {
    let series: Vec<draw::RunSeries> =
        args.runs.iter().map(|d| draw::RunSeries::load(d)).collect::<Result<_>>().map_err(bad_input)?;
    let out = args.out.clone().unwrap_or_else(|| args.runs[0].clone());
    draw::runs_png(&series, Path::new(&out))
}
