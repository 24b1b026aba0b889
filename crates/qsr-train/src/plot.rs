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
