//! PNG pictures drawn with plotters; text uses the embedded DejaVu Sans so no system font is needed.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use qsr_sched::Plan;

const FONT: &str = "sans-serif";

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is a compile-time constant; failure would be a packaging bug, and then text is blank.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Series colours, distinguishable in print.
pub const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Samples of (step, lr, H) at most `bins` points, H being the length of the round covering the step.
fn samples(plan: &Plan, bins: u64) -> Vec<(u64, f64, u64)> {
    let end = plan.end_step();
    let stride = end.div_ceil(bins).max(1);
    let mut out = Vec::new();
    let mut next = 0u64;
    for r in plan.rounds() {
        while next < r.end() {
            out.push((next, plan.lr(next), r.len));
            next += stride;
        }
    }
    if let Some(last) = plan.rounds().last() {
        out.push((end - 1, plan.lr(end - 1), last.len));
    }
    out
}

/// lr (left axis) and H (right axis, log scale) against step, one colour per plan: the picture of the H
/// schedule that reviewers of the paper asked for.
pub fn plan_png(path: &Path, plans: &[(&str, &Plan)]) -> Result<()> {
    register_font();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
        root.fill(&WHITE)?;
        let end = plans.iter().map(|(_, p)| p.end_step()).max().unwrap_or(1);
        let lr_max = plans.iter().map(|(_, p)| p.schedule().lr_max).fold(0.0, f64::max) * 1.05;
        let h_max = plans.iter().map(|(_, p)| p.summary().max_h).max().unwrap_or(1).max(2) as f64 * 1.5;
        let title = if plans.len() == 1 { format!("{}: lr and H", plans[0].0) } else { "lr and H".into() };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 26))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(75)
            .right_y_label_area_size(75)
            .build_cartesian_2d(0u64..end, 0.0..lr_max)?
            .set_secondary_coord(0u64..end, (0.8f64..h_max).log_scale());
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("learning rate (solid)")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .draw()?;
        chart
            .configure_secondary_axes()
            .y_desc("H, local steps per round (dashed)")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .draw()?;
        for (i, (name, plan)) in plans.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            let pts = samples(plan, 2_000);
            chart
                .draw_series(LineSeries::new(pts.iter().map(|&(t, lr, _)| (t, lr)), colour.stroke_width(2)))?
                .label(format!("{name} lr"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
            // H is a step function: hold each value until the next sample.
            let mut steps = Vec::with_capacity(pts.len() * 2);
            for w in pts.windows(2) {
                steps.push((w[0].0, w[0].2 as f64));
                steps.push((w[1].0, w[0].2 as f64));
            }
            chart
                .draw_secondary_series(DashedLineSeries::new(steps, 6, 4, colour.stroke_width(2)))?
                .label(format!("{name} H"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 8, y)], colour.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .label_font((FONT, 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("{e}")).with_context(|| format!("cannot draw {}", path.display()))
}

/// One run's records, read from `metrics.jsonl`.
pub struct RunSeries {
    pub name: String,
    pub records: Vec<crate::train::Record>,
}

impl RunSeries {
    /// Reads `RUN_DIR/metrics.jsonl` (and the run name from `summary.json` / `recipe.toml` if present).
    pub fn load(run_dir: &Path) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            records.push(serde_json::from_str(line).with_context(|| format!("{}:{}: not a metrics record", path.display(), i + 1))?);
        }
        let name = run_dir.file_name().map_or_else(|| run_dir.display().to_string(), |n| n.to_string_lossy().into_owned());
        Ok(Self { name, records })
    }

    fn of(&self, kind: &str) -> impl Iterator<Item = &crate::train::Record> {
        self.records.iter().filter(move |r| r.kind == kind)
    }
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// A line chart of several series: `(name, points)`.
fn lines(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_y: bool,
) -> DrawResult {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let mut builder = ChartBuilder::on(area);
    builder.caption(title, (FONT, 20)).margin(10).x_label_area_size(40).y_label_area_size(70);
    if log_y {
        let mut chart = builder.build_cartesian_2d(x0..x1, (y0.max(1e-12) * 0.8..y1 * 1.25).log_scale())?;
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).label_style((FONT, 13)).axis_desc_style((FONT, 15)).draw()?;
        for (i, (name, p)) in series.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(2)))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        }
        chart.configure_series_labels().label_font((FONT, 13)).background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    } else {
        let pad = (y1 - y0) * 0.05;
        let mut chart = builder.build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))?;
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).label_style((FONT, 13)).axis_desc_style((FONT, 15)).draw()?;
        for (i, (name, p)) in series.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(2)))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
            chart.draw_series(p.iter().map(|&(x, y)| Circle::new((x, y), 3, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// `qsr plot`: `schedule.png` (lr and H against step), `accuracy.png` (test accuracy against step and
/// against bytes sent), `loss.png` (train loss against step and bytes), overlaying the runs.
pub fn runs_png(runs: &[RunSeries], out_dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    register_font();
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let series = |kind: &str, f: &dyn Fn(&crate::train::Record) -> Option<(f64, f64)>| -> Vec<(String, Vec<(f64, f64)>)> {
        runs.iter().map(|r| (r.name.clone(), r.of(kind).filter_map(f).collect())).collect()
    };
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let mut written = Vec::new();
    let mut draw = |file: &str, body: &dyn Fn(&DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> DrawResult| -> Result<()> {
        let path = out_dir.join(file);
        let res = (|| -> DrawResult {
            let root = BitMapBackend::new(&path, (1400, 560)).into_drawing_area();
            root.fill(&WHITE)?;
            body(&root)?;
            root.present()?;
            Ok(())
        })();
        res.map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
        written.push(path);
        Ok(())
    };
    draw("schedule.png", &|root| {
        let (l, r) = root.split_horizontally(700);
        lines(&l, "learning rate", "step", "lr", &series("sync", &|r| Some((r.step as f64, r.lr))), false)?;
        lines(&r, "H (local steps per round)", "step", "H", &series("sync", &|r| Some((r.step as f64, r.h as f64))), true)
    })?;
    draw("accuracy.png", &|root| {
        let (l, r) = root.split_horizontally(700);
        lines(&l, "test accuracy", "step", "top-1 accuracy", &series("eval", &|r| r.accuracy.map(|a| (r.step as f64, a))), false)?;
        lines(&r, "test accuracy vs communication", "MiB sent per rank", "top-1 accuracy", &series("eval", &|r| r.accuracy.map(|a| (mib(r.bytes), a))), false)
    })?;
    draw("loss.png", &|root| {
        let (l, r) = root.split_horizontally(700);
        lines(&l, "train loss (rank 0)", "step", "loss", &series("sync", &|r| r.loss.map(|v| (r.step as f64, v))), true)?;
        lines(&r, "train loss vs communication", "MiB sent per rank", "loss", &series("sync", &|r| r.loss.map(|v| (mib(r.bytes), v))), true)
    })?;
    Ok(written)
}
