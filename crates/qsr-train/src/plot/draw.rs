//! PNG pictures drawn with plotters; text uses the embedded DejaVu Sans so no system font is needed.
//!
//! Tick positions and labels are computed here rather than by plotters, whose defaults print integer
//! steps as "100.0" and label a log axis at every 1..9 x 10^k (with 10^k twice). Legends go in a strip
//! below the charts so they never cover a curve.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result, anyhow, bail};
use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use qsr_sched::Plan;

const FONT: &str = "sans-serif";

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is a compile-time constant; failure would be a packaging bug, and then text is blank.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Series colours, distinguishable in print; series past the palette repeat it dashed.
pub(crate) const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
];

/// Whether series `i` is drawn dashed: every other pass through the palette, so no two series of a
/// plot look alike up to twice the palette's length.
fn dashed(i: usize) -> bool {
    (i / PALETTE.len()) % 2 == 1
}

/// The smallest step 1, 2 or 5 x 10^k giving at most `max_ticks` ticks over `span`; at least 1 on an
/// integer axis.
fn nice_step(span: f64, max_ticks: usize, integer: bool) -> f64 {
    let raw = (span / max_ticks.max(1) as f64).max(f64::MIN_POSITIVE);
    let pow = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * pow).find(|&s| s >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * pow);
    if integer { step.max(1.0) } else { step }
}

/// Decimal places needed to write multiples of `step` exactly (0 for steps of 1 and more).
fn decimals(step: f64) -> usize {
    (0..=15)
        .find(|&d| {
            let scaled = step * 10f64.powi(d as i32);
            scaled >= 1.0 - 1e-6 && (scaled - scaled.round()).abs() <= 1e-6 * scaled
        })
        .unwrap_or(15)
}

/// A tick label on a linear axis whose ticks are multiples of `step`: all labels share the step's decimal
/// places, so integer steps print "100", not "100.0".
fn linear_label(v: f64, step: f64) -> String {
    let v = (v / step).round() * step;
    // Avoid "-0" from rounding.
    let v = if v.abs() < step * 1e-9 { 0.0 } else { v };
    format!("{v:.*}", decimals(step))
}

/// A tick label on a log axis, whose ticks are d x 10^k: the shortest decimal ("200", "0.05", never
/// "10.0"), or "1e-5" / "1e6" style outside 10^-4..10^6.
fn log_label(v: f64) -> String {
    // Round away the error of d * 10^k (e.g. 0.30000000000000004) before printing the shortest form.
    let v: f64 = format!("{v:.5e}").parse().unwrap_or(v);
    if v != 0.0 && !(1e-4..1e6).contains(&v.abs()) { format!("{v:e}") } else { format!("{v}") }
}

/// One axis of a chart: its range in drawing coordinates (log10 of the value on a log axis), the
/// labelled ticks, the unlabelled grid lines between them, and how to label a tick.
struct Axis {
    range: std::ops::Range<f64>,
    log: bool,
    /// Label step of a linear axis (unused on a log axis).
    step: f64,
    major: Vec<f64>,
    minor: Vec<f64>,
}

impl Axis {
    /// A linear axis over `lo..hi` with at most `max_ticks` labels; `integer` keeps ticks on integers.
    fn linear(lo: f64, hi: f64, max_ticks: usize, integer: bool) -> Self {
        let (lo, hi) = if hi > lo { (lo, hi) } else { (lo, lo + 1.0) };
        let step = nice_step(hi - lo, max_ticks, integer);
        // Four or five grid lines per label step, matching its leading digit.
        let lead = (step / 10f64.powf(step.log10().floor())).round();
        let minor_step = step / if lead == 2.0 { 4.0 } else { 5.0 };
        let multiples = |s: f64| {
            let first = (lo / s - 1e-9).ceil() as i64;
            let last = (hi / s + 1e-9).floor() as i64;
            (first..=last).map(move |i| i as f64 * s)
        };
        let major: Vec<f64> = multiples(step).collect();
        let minor = multiples(minor_step).filter(|m| major.iter().all(|t| (t - m).abs() > minor_step * 1e-6)).collect();
        Self { range: lo..hi, log: false, step, major, minor }
    }

    /// A log axis over `lo..hi` (both positive). Labels go at 1-2-5 x 10^k over about two decades, at
    /// powers of ten over more, at every d x 10^k over less than one; the other d x 10^k get grid
    /// lines. An `integer` axis (H) labels no value below 1.
    fn log(lo: f64, hi: f64, max_ticks: usize, integer: bool) -> Self {
        let lo = lo.max(f64::MIN_POSITIVE);
        let hi = if hi > lo { hi } else { lo * 10.0 };
        // Exponents of finite doubles: an infinite bound would make the decades endless.
        let exponent = |v: f64| v.log10().clamp(-324.0, 308.0);
        let (e0, e1) = (exponent(lo).floor() as i32, exponent(hi).ceil() as i32);
        let within = |v: &f64| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9);
        let with_digits = |digits: &[f64], every: i32| -> Vec<f64> {
            (e0..=e1)
                .filter(|e| e.rem_euclid(every) == 0)
                .flat_map(|e| digits.iter().map(move |d| d * 10f64.powi(e)))
                .filter(within)
                .collect()
        };
        let decades = (e1 - e0).max(1);
        let every = (decades as usize).div_ceil(max_ticks.max(1)) as i32;
        let all = with_digits(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 1);
        let labelled = |t: Vec<f64>| -> Vec<f64> { t.into_iter().filter(|&v| !integer || v >= 1.0 - 1e-9).collect() };
        let tens = labelled(with_digits(&[1.0], every));
        let one_two_five = labelled(with_digits(&[1.0, 2.0, 5.0], 1));
        // 1-2-5 while that is up to seven labels (about two decades), else powers of ten; three labels at
        // least, to show the scale.
        let major = if (3..=7).contains(&one_two_five.len()) || (tens.len() < 3 && one_two_five.len() >= 3) {
            one_two_five
        } else if tens.len() >= 3 {
            tens
        } else {
            labelled(all.clone())
        };
        let minor = all.into_iter().filter(|m| !major.contains(m)).map(f64::log10).collect();
        Self {
            range: lo.log10()..hi.log10(),
            log: true,
            step: 1.0,
            major: major.into_iter().map(f64::log10).collect(),
            minor,
        }
    }

    /// A log axis for data in `min..=max`, padded and widened to at least a factor of 5 so a flat series
    /// (constant H) still shows two labels.
    fn log_for(min: f64, max: f64, max_ticks: usize, integer: bool) -> Self {
        let (mut lo, mut hi) = (min.max(1e-12) * 0.8, (max.max(min).max(1e-12) * 1.25).min(f64::MAX / 8.0));
        if hi / lo < 5.0 {
            let mid = lo.sqrt() * hi.sqrt();
            (lo, hi) = (mid / 5f64.sqrt(), mid * 5f64.sqrt());
        }
        Self::log(lo, hi, max_ticks, integer)
    }

    /// Where value `v` is drawn; `None` for a non-positive value on a log axis.
    fn to_coord(&self, v: f64) -> Option<f64> {
        if !v.is_finite() {
            None
        } else if !self.log {
            // Clipped to the axis, whose span stays finite (see `axis_for`).
            Some(v.clamp(self.range.start, self.range.end))
        } else if v > 0.0 {
            Some(v.log10())
        } else {
            None
        }
    }

    /// The label of the tick drawn at coordinate `c`.
    fn label(&self, c: f64) -> String {
        if self.log { log_label(10f64.powf(c)) } else { linear_label(c, self.step) }
    }

    /// The labels of all labelled ticks, bottom to top.
    #[cfg(test)]
    fn labels(&self) -> Vec<String> {
        self.major.iter().map(|&c| self.label(c)).collect()
    }

    /// The plotters coordinate: this range with our ticks.
    fn coord(&self) -> AxisCoord {
        AxisCoord { inner: self.range.clone().into(), major: self.major.clone(), minor: self.minor.clone() }
    }
}

/// An [`Axis`] as a plotters coordinate: linear in drawing coordinates, ticks where the axis puts them.
/// (plotters' own `with_key_points` drops the label formatter of an `f64` range.)
struct AxisCoord {
    inner: RangedCoordf64,
    major: Vec<f64>,
    minor: Vec<f64>,
}

impl Ranged for AxisCoord {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() { self.minor.clone() } else { self.major.clone() }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

/// Bytes shown in the binary unit that keeps the labels short: (divisor, unit name).
fn byte_unit(max_bytes: f64) -> (f64, &'static str) {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut i = 0;
    while i + 1 < units.len() && max_bytes >= 1024f64.powi(i as i32 + 1) {
        i += 1;
    }
    (1024f64.powi(i as i32), units[i])
}

/// One legend entry: a line sample in a colour, solid or dashed, and its text.
struct LegendEntry {
    text: String,
    colour: RGBColor,
    dashed: bool,
}

const LEGEND_FONT: u32 = 15;
const LEGEND_ROW: u32 = 26;
/// Line sample, then the gap before the text.
const LEGEND_SAMPLE: u32 = 36;
const LEGEND_GAP: u32 = 28;

/// Lays out items of the given widths left to right, wrapping at `avail` pixels, each row centred:
/// (row, x of the item's left edge).
fn flow(widths: &[u32], avail: u32) -> Vec<(u32, u32)> {
    let mut rows: Vec<Vec<usize>> = vec![vec![]];
    let mut used = 0;
    for (i, &w) in widths.iter().enumerate() {
        let row = rows.last_mut().expect("never empty");
        if !row.is_empty() && used + LEGEND_GAP + w > avail {
            rows.push(vec![i]);
            used = w;
        } else {
            used += if row.is_empty() { w } else { LEGEND_GAP + w };
            row.push(i);
        }
    }
    let mut out = vec![(0, 0); widths.len()];
    for (r, row) in rows.iter().enumerate() {
        let total: u32 =
            row.iter().map(|&i| widths[i]).sum::<u32>() + LEGEND_GAP * (row.len() as u32).saturating_sub(1);
        let mut x = avail.saturating_sub(total) / 2;
        for &i in row {
            out[i] = (r as u32, x);
            x += widths[i] + LEGEND_GAP;
        }
    }
    out
}

fn legend_layout(entries: &[LegendEntry], avail: u32) -> Vec<(u32, u32)> {
    let font = (FONT, LEGEND_FONT).into_font();
    let widths: Vec<u32> = entries
        .iter()
        .map(|e| {
            LEGEND_SAMPLE
                + font.box_size(&e.text).map_or(e.text.chars().count() as u32 * LEGEND_FONT * 6 / 10, |(w, _)| w)
        })
        .collect();
    flow(&widths, avail)
}

/// Height of the strip that holds the legend.
fn legend_height(entries: &[LegendEntry], avail: u32) -> u32 {
    let rows = legend_layout(entries, avail).iter().map(|&(r, _)| r + 1).max().unwrap_or(0);
    rows * LEGEND_ROW + 10
}

/// Draws the legend into its strip (outside every plot area, so it covers no curve).
fn draw_legend(area: &DrawingArea<BitMapBackend<'_>, Shift>, entries: &[LegendEntry]) -> DrawResult {
    let (w, _) = area.dim_in_pixel();
    for (e, (row, x)) in entries.iter().zip(legend_layout(entries, w)) {
        let (x, y) = (x as i32, (row * LEGEND_ROW + LEGEND_ROW / 2) as i32);
        let style = e.colour.stroke_width(2);
        if e.dashed {
            for (a, b) in [(0, 8), (12, 20), (24, 30)] {
                area.draw(&PathElement::new(vec![(x + a, y), (x + b, y)], style))?;
            }
        } else {
            area.draw(&PathElement::new(vec![(x, y), (x + 30, y)], style))?;
        }
        let font = (FONT, LEGEND_FONT).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(e.text.clone(), (x + LEGEND_SAMPLE as i32, y), font))?;
    }
    Ok(())
}

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
pub(crate) fn plan_png(path: &Path, plans: &[(&str, &Plan)]) -> Result<()> {
    register_font();
    let (width, height) = (1200u32, 700u32);
    let mut legend = Vec::new();
    for (i, (name, _)) in plans.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let (lr, h) = if plans.len() == 1 {
            ("learning rate".into(), "H".into())
        } else {
            (format!("{name} lr"), format!("{name} H"))
        };
        legend.push(LegendEntry { text: lr, colour, dashed: false });
        legend.push(LegendEntry { text: h, colour, dashed: true });
    }
    let legend_h = legend_height(&legend, width);
    let draw = |root: DrawingArea<BitMapBackend<'_>, Shift>| -> DrawResult {
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(height);
        let end = plans.iter().map(|(_, p)| p.end_step()).max().unwrap_or(1).max(1);
        let lr_max = plans.iter().map(|(_, p)| p.schedule().lr_max).fold(0.0, f64::max).max(f64::MIN_POSITIVE) * 1.05;
        let h_min = plans.iter().flat_map(|(_, p)| p.rounds().map(|r| r.len)).min().unwrap_or(1).max(1);
        let h_max = plans.iter().map(|(_, p)| p.summary().max_h).max().unwrap_or(1).max(1);
        let x = Axis::linear(0.0, end as f64, 10, true);
        let y = Axis::linear(0.0, lr_max, 10, false);
        let h = Axis::log_for(h_min as f64, h_max as f64, 10, true);
        let title = if plans.len() == 1 { format!("{}: lr and H", plans[0].0) } else { "lr and H".into() };
        let mut chart = ChartBuilder::on(&top)
            .caption(title, (FONT, 26))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(75)
            .right_y_label_area_size(75)
            .build_cartesian_2d(x.coord(), y.coord())?
            .set_secondary_coord(x.coord(), h.coord());
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("learning rate (solid)")
            .x_label_formatter(&|v| x.label(*v))
            .y_label_formatter(&|v| y.label(*v))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .draw()?;
        chart
            .configure_secondary_axes()
            .y_desc("H, local steps per round (dashed)")
            .y_label_formatter(&|v| h.label(*v))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .draw()?;
        for (i, (_, plan)) in plans.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            let pts = samples(plan, 2_000);
            chart.draw_series(LineSeries::new(pts.iter().map(|&(t, lr, _)| (t as f64, lr)), colour.stroke_width(2)))?;
            // H is a step function: hold each value until the next sample.
            let mut steps = Vec::with_capacity(pts.len() * 2);
            for w in pts.windows(2) {
                let hc = h.to_coord(w[0].2 as f64).unwrap_or(h.range.start);
                steps.push((w[0].0 as f64, hc));
                steps.push((w[1].0 as f64, hc));
            }
            chart.draw_secondary_series(DashedLineSeries::new(steps, 6, 4, colour.stroke_width(2)))?;
        }
        draw_legend(&bottom, &legend)?;
        root.present()?;
        Ok(())
    };
    render(path, (width, height + legend_h), draw)
}

/// Draws a `size` picture with `draw` into memory, then writes it to `path` as a PNG through the
/// file door (a link at `path` is replaced, not followed).
fn render(
    path: &Path,
    (width, height): (u32, u32),
    draw: impl FnOnce(DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult,
) -> Result<()> {
    let mut rgb = vec![0u8; 3 * width as usize * height as usize];
    draw(BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area())
        .map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    let mut png = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut png),
        &rgb,
        width,
        height,
        image::ExtendedColorType::Rgb8,
    )
    .with_context(|| format!("cannot encode {}", path.display()))?;
    crate::files::write_atomic(path, &png, "plot")
}

/// One run's records, read from `metrics.jsonl`.
pub(crate) struct RunSeries {
    /// The run's label in legends: the run directory's name unless the caller renames it.
    pub name: String,
    /// The records of `metrics.jsonl`, in file order.
    pub records: Vec<crate::records::Record>,
}

impl RunSeries {
    /// Reads `RUN_DIR/metrics.jsonl` (refused without a record); the run is named after its directory.
    pub(crate) fn load(run_dir: &Path) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let text = crate::files::read_text(&path, crate::files::METRICS_BYTES, "metrics file")?;
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            records.push(
                serde_json::from_str(line)
                    .with_context(|| format!("{}:{}: not a metrics record", path.display(), i + 1))?,
            );
        }
        if records.is_empty() {
            bail!("{}: no metrics records (has the run logged its first step?)", path.display());
        }
        let name =
            run_dir.file_name().map_or_else(|| run_dir.display().to_string(), |n| n.to_string_lossy().into_owned());
        Ok(Self { name, records })
    }

    fn of(&self, kind: &str) -> impl Iterator<Item = &crate::records::Record> {
        self.records.iter().filter(move |r| r.kind == kind)
    }
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// How one axis of a [`lines`] chart is scaled.
#[derive(Clone, Copy, PartialEq)]
enum Scale {
    /// Linear, ticks on integers (steps, H, counts).
    Integer,
    /// Linear, ticks on round decimals.
    Real,
    /// Logarithmic.
    Log,
    /// Logarithmic, labels on integers (H).
    IntegerLog,
}

/// The axis for data spanning `lo..=hi` (`lo > hi` when there is no data).
fn axis_for(lo: f64, hi: f64, scale: Scale, pad: bool, max_ticks: usize) -> Axis {
    let (lo, hi) = if lo > hi { (0.0, 1.0) } else { (lo, hi) };
    // Values near the largest double (a diverged loss) would make the span, and every tick, infinite.
    let (lo, hi) = (lo.max(-f64::MAX / 4.0), hi.min(f64::MAX / 4.0));
    match scale {
        Scale::Log => Axis::log_for(lo, hi, max_ticks, false),
        Scale::IntegerLog => Axis::log_for(lo, hi, max_ticks, true),
        Scale::Integer | Scale::Real => {
            let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 0.5, hi + 0.5) };
            let p = if pad { (hi - lo) * 0.05 } else { 0.0 };
            Axis::linear(lo - p, hi + p, max_ticks, scale == Scale::Integer)
        }
    }
}

/// A line chart of several series `(name, points)`, coloured by index; markers on a linear y axis;
/// a dashed grey vertical line at each of `marks` (an elastic run's membership changes).
fn lines(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    title: &str,
    (x_desc, x_scale): (&str, Scale),
    (y_desc, y_scale): (&str, Scale),
    series: &[(String, Vec<(f64, f64)>)],
    marks: &[f64],
) -> DrawResult {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in series.iter().flat_map(|(_, p)| p.iter()).filter(|(x, y)| x.is_finite() && y.is_finite()) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        if !matches!(y_scale, Scale::Log | Scale::IntegerLog) || y > 0.0 {
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    let xa = axis_for(x0, x1, x_scale, false, 8);
    let ya = axis_for(y0, y1, y_scale, true, 10);
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(xa.coord(), ya.coord())?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|v| xa.label(*v))
        .y_label_formatter(&|v| ya.label(*v))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 15))
        .draw()?;
    let y_span = chart.y_range();
    for x in marks.iter().filter_map(|&m| xa.to_coord(m)) {
        let grey = RGBColor(120, 120, 120).stroke_width(1);
        chart.draw_series(DashedLineSeries::new([(x, y_span.start), (x, y_span.end)], 5, 5, grey))?;
    }
    for (i, (_, p)) in series.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let pts: Vec<(f64, f64)> = p.iter().filter_map(|&(x, y)| Some((xa.to_coord(x)?, ya.to_coord(y)?))).collect();
        if dashed(i) {
            chart.draw_series(DashedLineSeries::new(pts.iter().copied(), 6, 4, c.stroke_width(2)))?;
        } else {
            chart.draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?;
        }
        if !matches!(y_scale, Scale::Log | Scale::IntegerLog) {
            chart.draw_series(pts.iter().map(|&pt| Circle::new(pt, 3, c.filled())))?;
        }
    }
    Ok(())
}

/// `qsr plot`: `schedule.png` (lr and H against step), `accuracy.png` (test accuracy against step and
/// against bytes sent), `loss.png` (train loss against step and bytes), `eval-loss.png` (the held-out
/// loss: test loss, or a language model's validation loss, against step and bytes), `wall-clock.png`
/// (test accuracy and train loss against wall-clock seconds), overlaying the runs.
pub(crate) fn runs_png(runs: &[RunSeries], out_dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    register_font();
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let series =
        |kind: &str, f: &dyn Fn(&crate::records::Record) -> Option<(f64, f64)>| -> Vec<(String, Vec<(f64, f64)>)> {
            runs.iter().map(|r| (r.name.clone(), r.of(kind).filter_map(f).collect())).collect()
        };
    let max_bytes = runs.iter().flat_map(|r| r.records.iter().map(|x| x.bytes)).max().unwrap_or(0);
    let (per, unit) = byte_unit(max_bytes as f64);
    let sent = format!("{unit} sent per rank");
    let sent = sent.as_str();
    let (width, height) = (1400u32, 560u32);
    // One legend for both panels: the runs have the same colours in each.
    let legend: Vec<LegendEntry> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| LegendEntry { text: r.name.clone(), colour: PALETTE[i % PALETTE.len()], dashed: dashed(i) })
        .collect();
    let legend_h = legend_height(&legend, width);
    let mut written = Vec::new();
    let mut draw = |file: &str, body: &dyn Fn(&DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult| -> Result<()> {
        let path = out_dir.join(file);
        render(&path, (width, height + legend_h), |root| {
            root.fill(&WHITE)?;
            let (top, bottom) = root.split_vertically(height);
            body(&top)?;
            draw_legend(&bottom, &legend)?;
            root.present()?;
            Ok(())
        })?;
        written.push(path);
        Ok(())
    };
    let step = ("step", Scale::Integer);
    let changes: Vec<&crate::records::Record> = runs.iter().flat_map(|r| r.of("membership")).collect();
    let at_step: Vec<f64> = changes.iter().map(|r| r.step as f64).collect();
    let at_bytes: Vec<f64> = changes.iter().map(|r| r.bytes as f64 / per).collect();
    let (at_step, at_bytes) = (at_step.as_slice(), at_bytes.as_slice());
    draw("schedule.png", &|root| {
        let (l, r) = root.split_horizontally(width / 2);
        lines(
            &l,
            "learning rate",
            step,
            ("lr", Scale::Real),
            &series("sync", &|r| Some((r.step as f64, r.lr))),
            at_step,
        )?;
        lines(
            &r,
            "H (local steps per round)",
            step,
            ("H", Scale::IntegerLog),
            &series("sync", &|r| Some((r.step as f64, r.h as f64))),
            at_step,
        )
    })?;
    let acc = ("top-1 accuracy", Scale::Real);
    draw("accuracy.png", &|root| {
        let (l, r) = root.split_horizontally(width / 2);
        lines(&l, "test accuracy", step, acc, &series("eval", &|r| r.accuracy.map(|a| (r.step as f64, a))), at_step)?;
        lines(
            &r,
            "test accuracy vs communication",
            (sent, Scale::Real),
            acc,
            &series("eval", &|r| r.accuracy.map(|a| (r.bytes as f64 / per, a))),
            at_bytes,
        )
    })?;
    let loss = ("loss", Scale::Log);
    draw("loss.png", &|root| {
        let (l, r) = root.split_horizontally(width / 2);
        lines(
            &l,
            "train loss (rank 0)",
            step,
            loss,
            &series("sync", &|r| r.loss.map(|v| (r.step as f64, v))),
            at_step,
        )?;
        lines(
            &r,
            "train loss vs communication",
            (sent, Scale::Real),
            loss,
            &series("sync", &|r| r.loss.map(|v| (r.bytes as f64 / per, v))),
            at_bytes,
        )
    })?;
    let wall = ("wall-clock (s)", Scale::Real);
    let at_wall: Vec<f64> = changes.iter().map(|r| r.wall_seconds).collect();
    draw("wall-clock.png", &|root| {
        let (l, r) = root.split_horizontally(width / 2);
        let accuracy = series("eval", &|r| r.accuracy.map(|a| (r.wall_seconds, a)));
        lines(&l, "test accuracy vs wall-clock", wall, acc, &accuracy, &at_wall)?;
        let train = series("sync", &|r| r.loss.map(|v| (r.wall_seconds, v)));
        lines(&r, "train loss (rank 0) vs wall-clock", wall, loss, &train, &at_wall)
    })?;
    draw("eval-loss.png", &|root| {
        let (l, r) = root.split_horizontally(width / 2);
        lines(&l, "held-out loss", step, loss, &series("eval", &|r| r.loss.map(|v| (r.step as f64, v))), at_step)?;
        lines(
            &r,
            "held-out loss vs communication",
            (sent, Scale::Real),
            loss,
            &series("eval", &|r| r.loss.map(|v| (r.bytes as f64 / per, v))),
            at_bytes,
        )
    })?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn distinct(labels: &[String]) -> bool {
        let mut s = labels.to_vec();
        s.sort();
        s.dedup();
        s.len() == labels.len()
    }

    #[test]
    fn integer_axis_labels_have_no_decimal_point() {
        for (lo, hi) in [(0.0, 5.0), (0.0, 62_400.0), (220.0, 880.0), (1.0, 3.0), (0.0, 1e9), (17.0, 18.0)] {
            let a = Axis::linear(lo, hi, 8, true);
            let labels = a.labels();
            assert!(!labels.is_empty(), "{lo}..{hi}");
            assert!(distinct(&labels), "{lo}..{hi}: {labels:?}");
            for l in &labels {
                assert!(l.parse::<i64>().is_ok(), "{lo}..{hi}: {l:?} is not an integer label");
            }
        }
        assert_eq!(Axis::linear(0.0, 880.0, 8, true).labels(), ["0", "200", "400", "600", "800"]);
    }

    #[test]
    fn real_axis_labels_share_the_step_decimals_and_are_distinct() {
        let a = Axis::linear(-0.01, 0.21, 10, false);
        assert_eq!(a.labels(), ["0.00", "0.05", "0.10", "0.15", "0.20"]);
        let a = Axis::linear(0.0, 12.6, 8, false);
        assert_eq!(a.labels(), ["0", "2", "4", "6", "8", "10", "12"]);
        for (lo, hi) in [(0.73, 0.95), (1e-6, 3e-6), (-1.0, 1.0)] {
            let labels = Axis::linear(lo, hi, 10, false).labels();
            assert!(labels.len() >= 2 && distinct(&labels), "{lo}..{hi}: {labels:?}");
            assert!(
                !labels
                    .iter()
                    .any(|l| l == "-0" || l.starts_with("-0.0") && l.trim_start_matches(['-', '0', '.']).is_empty())
            );
        }
    }

    #[test]
    fn log_axis_labels_are_distinct() {
        let mut lo = 1e-7;
        while lo < 1e5 {
            for ratio in [5.0, 8.0, 30.0, 120.0, 1e3, 1e5, 1e12] {
                let a = Axis::log(lo, lo * ratio, 10, false);
                let labels = a.labels();
                assert!(labels.len() >= 2, "{lo}x{ratio}: {labels:?}");
                assert!(labels.len() <= 10, "{lo}x{ratio}: {labels:?}");
                assert!(distinct(&labels), "{lo}x{ratio}: {labels:?}");
                assert!(
                    labels.iter().all(|l| !l.ends_with(".0") && !l.contains("0000000")),
                    "{lo}x{ratio}: {labels:?}"
                );
                // Minor grid lines never sit on a label.
                assert!(a.minor.iter().all(|m| a.major.iter().all(|t| (t - m).abs() > 1e-9)));
            }
            lo *= 3.7;
        }
        // H from 1 upwards: integer labels only.
        for (lo, hi) in [(0.8, 3.0), (1.6, 2.5), (1.6, 115.0), (0.8, 3000.0), (3.0, 15.0)] {
            let labels = Axis::log_for(lo / 0.8, hi / 1.25, 10, true).labels();
            assert!(labels.len() >= 2 && distinct(&labels), "{lo}..{hi}: {labels:?}");
            assert!(labels.iter().all(|l| l.parse::<u64>().is_ok()), "{lo}..{hi}: {labels:?}");
        }
    }

    #[test]
    fn log_axis_labels_powers_of_ten_over_decades_and_1_2_5_within() {
        assert_eq!(Axis::log(0.8, 3000.0, 10, true).labels(), ["1", "10", "100", "1000"]);
        assert_eq!(Axis::log(1.6, 115.0, 10, true).labels(), ["2", "5", "10", "20", "50", "100"]);
        assert_eq!(Axis::log(0.004, 3.0, 10, false).labels(), ["0.01", "0.1", "1"]);
        assert_eq!(Axis::log(1e-6, 1e-3, 10, false).labels(), ["1e-6", "1e-5", "0.0001", "0.001"]);
        assert_eq!(Axis::log(0.8, 115.0, 10, true).labels(), ["1", "2", "5", "10", "20", "50", "100"]);
        // A flat series (constant H = 2) still gets a readable axis.
        assert_eq!(Axis::log_for(2.0, 2.0, 10, true).labels(), ["1", "2", "3", "4"]);
    }

    #[test]
    fn bytes_use_the_unit_that_keeps_labels_short() {
        assert_eq!(byte_unit(500.0), (1.0, "B"));
        assert_eq!(byte_unit(12.0 * 1024.0 * 1024.0).1, "MiB");
        assert_eq!(byte_unit(300.0 * 1024f64.powi(3)).1, "GiB");
    }

    #[test]
    fn legend_rows_fit_and_do_not_overlap() {
        let widths = [200, 300, 150, 400, 90, 600];
        let pos = flow(&widths, 800);
        for (i, (&(r, x), &w)) in pos.iter().zip(&widths).enumerate() {
            assert!(x + w <= 800, "entry {i} overflows");
            for (j, (&(r2, x2), &w2)) in pos.iter().zip(&widths).enumerate().skip(i + 1) {
                assert!(r != r2 || x + w <= x2 || x2 + w2 <= x, "entries {i} and {j} overlap");
            }
        }
        assert_eq!(pos.iter().map(|p| p.0).max(), Some(2));
    }

    fn record(kind: &str, step: u64, h: u64) -> crate::records::Record {
        crate::records::Record {
            kind: kind.into(),
            step,
            epoch: step as f64 / 22.0,
            lr: 0.2 * (1.0 - step as f64 / 900.0),
            h,
            loss: Some(2.0 / (1.0 + step as f64)),
            accuracy: (kind == "eval").then_some(0.5 + step as f64 / 2000.0),
            train: None,
            syncs: step / h,
            bytes: step * 50_000,
            comm_seconds: 0.0,
            wall_seconds: step as f64 * 0.05,
            local_syncs: 0,
            local_bytes: 0,
            membership: None,
        }
    }

    /// Regression: a compare of 9 rules repeated colours (the palette had 6); now 10 colours, then dashed.
    #[test]
    fn series_past_the_palette_are_dashed_so_no_two_look_alike() {
        assert!((0..PALETTE.len()).all(|i| !dashed(i)));
        assert!((PALETTE.len()..2 * PALETTE.len()).all(dashed));
        let mut looks: Vec<_> = (0..2 * PALETTE.len()).map(|i| (PALETTE[i % PALETTE.len()], dashed(i))).collect();
        looks.dedup();
        assert_eq!(looks.len(), 2 * PALETTE.len());
    }

    #[test]
    fn runs_png_and_plan_png_render_to_files() {
        let dir = tempfile::tempdir().unwrap();
        let runs: Vec<RunSeries> = (0..3)
            .map(|k| RunSeries {
                name: format!("run {k}"),
                records: (1..40)
                    .map(|i| record(if i % 10 == 0 { "eval" } else { "sync" }, i * 22, 2 + k * i / 8))
                    .collect(),
            })
            .collect();
        let written = runs_png(&runs, dir.path()).unwrap();
        let names: Vec<_> = written.iter().filter_map(|p| p.file_name()?.to_str()).collect();
        assert_eq!(names, ["schedule.png", "accuracy.png", "loss.png", "wall-clock.png", "eval-loss.png"]);
        for p in &written {
            assert!(std::fs::read(p).unwrap().starts_with(b"\x89PNG"), "{}", p.display());
        }
        // An elastic run's membership change is marked: the charts differ from the same run without it.
        let mut marked = runs[0].records.clone();
        marked.insert(5, record("membership", 5 * 22, 2));
        let with = runs_png(&[RunSeries { name: "m".into(), records: marked }], &dir.path().join("marked")).unwrap();
        let unmarked = RunSeries { name: "m".into(), records: runs[0].records.clone() };
        let without = runs_png(&[unmarked], &dir.path().join("unmarked")).unwrap();
        for (a, b) in with.iter().zip(&without) {
            assert_ne!(std::fs::read(a).unwrap(), std::fs::read(b).unwrap(), "{} has no mark", a.display());
        }
        // No data at all still draws.
        runs_png(&[RunSeries { name: "empty".into(), records: vec![] }], &dir.path().join("empty")).unwrap();
        let plan = |rule| {
            Plan::new(qsr_sched::LrSchedule::new(qsr_sched::ScheduleKind::Cosine, 880, 44, 0.2, 1e-6), rule).unwrap()
        };
        let (qsr, constant) =
            (plan(qsr_sched::SyncRule::Qsr { h_base: 2, alpha: 0.06 }), plan(qsr_sched::SyncRule::Constant { h: 2 }));
        for (file, plans) in
            [("one.png", vec![("qsr", &qsr)]), ("two.png", vec![("qsr", &qsr), ("constant", &constant)])]
        {
            let png = dir.path().join(file);
            plan_png(&png, &plans).unwrap();
            assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"), "{file}");
        }
    }
}
