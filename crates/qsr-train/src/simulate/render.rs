//! The table `qsr simulate` prints.

use std::fmt::Write as _;

use super::Report;

fn fmt_time(s: f64) -> String {
    if s >= 3600.0 { format!("{:.2} h", s / 3600.0) } else { format!("{s:.2} s") }
}

/// The report as a text table.
pub(crate) fn render(report: &Report) -> String {
    let mut out = String::new();
    let net = &report.network;
    let _ = writeln!(
        out,
        "network: {:.3} Gbit/s per link, {:.3} ms latency; compute {:.4} s per step ({})",
        net.bandwidth_bits_per_second / 1e9,
        net.latency_seconds * 1e3,
        report.step_seconds,
        report.step_source
    );
    if let Some(intra) = &report.intra {
        let _ = writeln!(
            out,
            "inside a node: {:.3} Gbit/s per link, {:.3} ms latency",
            intra.bandwidth_bits_per_second / 1e9,
            intra.latency_seconds * 1e3
        );
    }
    let has_local = report.rows.iter().any(|r| r.prediction.local_syncs > 0);
    let has_meas = report.rows.iter().any(|r| r.measured_seconds.is_some());
    let has_ref = report.rows.iter().any(|r| r.reference_seconds.is_some());
    let mut header =
        vec!["recipe", "rule", "params", "K", "steps", "syncs", "comm %", "compute", "comm", "per epoch", "predicted"];
    if has_local {
        header.extend(["local", "local comm"]);
    }
    if has_meas {
        header.extend(["measured", "pred/meas"]);
    }
    if has_ref {
        header.extend(["reference", "pred/ref"]);
    }
    let mut lines = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    for r in &report.rows {
        let p = &r.prediction;
        let mut l = vec![
            p.name.clone(),
            p.rule.clone(),
            r.params.to_string(),
            p.world_size.to_string(),
            p.steps.to_string(),
            p.syncs.to_string(),
            format!("{:.1}", p.comm_percent),
            fmt_time(p.compute_seconds),
            fmt_time(p.comm_seconds),
            p.mean_epoch_seconds().map_or("-".into(), fmt_time),
            fmt_time(p.total_seconds),
        ];
        if has_local {
            l.push(p.local_syncs.to_string());
            l.push(fmt_time(p.local_comm_seconds));
        }
        if has_meas {
            l.push(r.measured_seconds.map_or("-".into(), fmt_time));
            l.push(r.measured_seconds.map_or("-".into(), |m| format!("{:.3}", p.total_seconds / m)));
        }
        if has_ref {
            l.push(r.reference_seconds.map_or("-".into(), fmt_time));
            l.push(r.reference_seconds.map_or("-".into(), |m| format!("{:.3}", p.total_seconds / m)));
        }
        lines.push(l);
    }
    let widths: Vec<usize> =
        (0..lines[0].len()).map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0)).collect();
    for l in &lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}
