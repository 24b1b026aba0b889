//! `cargo xtask bench [sched|kernels|optim|comm|data|all]`: runs the benchmarks side by side with their
//! peers (burn's optimizer, memcpy, MPI_Allreduce, raw loopback TCP) and rewrites the matching section of
//! docs/BENCHMARKS.md (between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`) with ratio tables and
//! the machine they ran on.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

pub const GROUPS: [&str; 6] = ["sched", "kernels", "optim", "comm", "data", "train"];

fn cargo(root: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root);
    c
}

fn output(mut c: Command) -> Result<String> {
    eprintln!("xtask bench: {c:?}");
    let out = c.output().with_context(|| format!("cannot start {c:?}"))?;
    if !out.status.success() {
        bail!("{c:?} failed with {}:\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Median times in milliseconds by benchmark id, from criterion's text output.
pub fn criterion_medians(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    let mut last_id = String::new();
    for line in text.lines() {
        if let Some((head, rest)) = line.split_once("time:") {
            let id = if head.trim().is_empty() { last_id.clone() } else { head.trim().to_string() };
            let inner = rest.trim().trim_start_matches('[').trim_end_matches(']');
            let parts: Vec<&str> = inner.split_whitespace().collect();
            if parts.len() >= 4 {
                let (v, unit) = (parts[2], parts[3]);
                if let Ok(v) = v.parse::<f64>() {
                    let ms = match unit {
                        "ns" => v * 1e-6,
                        "µs" | "us" => v * 1e-3,
                        "ms" => v,
                        "s" => v * 1e3,
                        _ => continue,
                    };
                    out.push((id, ms));
                }
            }
        } else if !line.starts_with(' ') && !line.trim().is_empty() && !line.contains(':') {
            last_id = line.trim().to_string();
        }
    }
    out
}

fn get(m: &[(String, f64)], id: &str) -> Option<f64> {
    m.iter().find(|(k, _)| k == id).map(|(_, v)| *v)
}

fn criterion(root: &Path, bench: &str) -> Result<Vec<(String, f64)>> {
    let mut c = cargo(root);
    c.args(["bench", "--locked", "-p", "qsr-benches", "--bench", bench]);
    Ok(criterion_medians(&output(c)?))
}

fn section_sched(root: &Path) -> Result<String> {
    let m = criterion(root, "sched")?;
    let mut o = String::from("| benchmark | median | per 1000 rounds |\n|---|---|---|\n");
    for (id, ms) in &m {
        let rounds = id.split('_').rev().nth(1).and_then(|r| r.parse::<f64>().ok());
        let per = rounds.map_or("-".to_string(), |r| format!("{:.4} ms", ms / r * 1000.0));
        let _ = writeln!(o, "| {id} | {ms:.3} ms | {per} |");
    }
    Ok(o)
}

fn section_kernels(root: &Path) -> Result<String> {
    let m = criterion(root, "kernels")?;
    let fused = get(&m, "average_k4_64MiB/fused_average_and_broadcast").context("no fused result")?;
    let mut o = String::from(
        "| operation (K = 4 x 64 MiB) | median | GiB/s (read + write) | fused bandwidth vs this |\n|---|---|---|---|\n",
    );
    let bytes = 2.0 * 4.0 * 64.0 * 1024.0 * 1024.0;
    for (id, ms) in &m {
        let gib = bytes / (ms / 1e3) / (1024.0 * 1024.0 * 1024.0);
        let _ = writeln!(o, "| {id} | {ms:.2} ms | {gib:.2} | {:.2}x |", ms / fused);
    }
    Ok(o)
}

fn section_optim(root: &Path) -> Result<String> {
    let m = criterion(root, "optim")?;
    let mut o = String::from("| rule (ResNet-18 sized) | qsr | burn ModuleOptimizer | speed-up |\n|---|---|---|---|\n");
    for rule in ["sgd_momentum_wd", "adamw_wd"] {
        let g = format!("optimizer_step_resnet18_{rule}");
        if let (Some(q), Some(b)) = (get(&m, &format!("{g}/qsr")), get(&m, &format!("{g}/burn_module_optimizer"))) {
            let _ = writeln!(o, "| {rule} | {q:.1} ms | {b:.1} ms | {:.2}x |", b / q);
        }
    }
    Ok(o)
}

fn sweep(json: &Path) -> Result<Vec<(u64, f64)>> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(json).with_context(|| format!("{} missing", json.display()))?)?;
    Ok(v.as_array()
        .map(|rows| rows.iter().filter_map(|r| Some((r["bytes"].as_u64()?, r["busbw_gbs"].as_f64()?))).collect())
        .unwrap_or_default())
}

fn section_comm(root: &Path, target: &Path) -> Result<String> {
    let mut b = cargo(root);
    b.args(["build", "--release", "--locked", "-p", "qsr-comm", "--features", "mpi", "--example", "allreduce_bench"]);
    output(b)?;
    let exe = target.join("release/examples/allreduce_bench");
    let tmp = std::env::temp_dir().join("qsr-bench-comm");
    std::fs::create_dir_all(&tmp)?;
    // Gloo (torch.distributed) is a peer only where Python torch is importable.
    let gloo =
        Command::new("python3").args(["-c", "import torch.distributed"]).output().is_ok_and(|o| o.status.success());
    let mut o = String::from(
        "busbw GB/s (algbw x 2(n-1)/n), sizes 4 KiB..256 MiB; ratios of our ring to MPI_Allreduce (our MPI backend, \
         Open MPI's default transport), to Gloo (torch.distributed, `benches/peers/gloo_allreduce.py`) and to raw \
         loopback TCP, in the same run.\n\n\
         | ranks | size | tcp ring | mpi | gloo | raw tcp | ring / mpi | ring / gloo | ring / raw |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for ranks in [2usize, 4] {
        let mut results = Vec::new();
        for backend in ["tcp", "raw-tcp", "mpi", "gloo"] {
            let json = tmp.join(format!("{backend}-{ranks}.json"));
            if backend == "gloo" {
                if gloo {
                    let mut c = Command::new("python3");
                    c.arg(root.join("benches/peers/gloo_allreduce.py"));
                    c.args([
                        "--ranks",
                        &ranks.to_string(),
                        "--min-bytes",
                        "4096",
                        "--max-bytes",
                        "268435456",
                        "--json",
                    ])
                    .arg(&json);
                    output(c)?;
                    results.push(sweep(&json)?);
                } else {
                    results.push(Vec::new());
                }
                continue;
            }
            let mut c = if backend == "mpi" {
                let mut c = Command::new("mpirun");
                c.args(["--allow-run-as-root", "--oversubscribe", "-np", &ranks.to_string()]).arg(&exe);
                c
            } else {
                let mut c = Command::new(&exe);
                c.args(["--ranks", &ranks.to_string()]);
                c
            };
            c.args(["--backend", backend, "--min-bytes", "4096", "--max-bytes", "268435456", "--json"]).arg(&json);
            output(c)?;
            results.push(sweep(&json)?);
        }
        for (bytes, tcp) in &results[0] {
            let find = |r: &Vec<(u64, f64)>| r.iter().find(|(b, _)| b == bytes).map(|(_, v)| *v);
            let (raw, mpi, gl) = (find(&results[1]), find(&results[2]), find(&results[3]));
            let ratio = |d: Option<f64>| d.map_or("-".into(), |d| format!("{:.2}", tcp / d));
            let val = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
            let _ = writeln!(
                o,
                "| {ranks} | {} | {tcp:.2} | {} | {} | {} | {} | {} | {} |",
                human(*bytes),
                val(mpi),
                val(gl),
                val(raw),
                ratio(mpi),
                ratio(gl),
                ratio(raw)
            );
        }
    }
    Ok(o)
}

fn section_data(root: &Path) -> Result<String> {
    let mut c = cargo(root);
    c.args(["run", "--release", "--locked", "-p", "qsr-data", "--example", "loader_throughput"]);
    Ok(format!("```text\n{}```\n", output(c)?))
}

/// End-to-end training throughput of `qsr train` (K = 4 threads) for data parallel and QSR on the digits
/// recipes: steps/s and the share of wall time spent in collectives.
fn section_train(root: &Path, target: &Path) -> Result<String> {
    let mut b = cargo(root);
    b.args(["build", "--release", "--locked", "--bin", "qsr"]);
    output(b)?;
    let qsr = target.join("release/qsr");
    let tmp = std::env::temp_dir().join("qsr-bench-train");
    let mut o = String::from(
        "| recipe | rule | steps | steps/s | syncs | comm share of wall | test accuracy |\n|---|---|---|---|---|---|---|\n",
    );
    for recipe in ["digits-mlp-qsr", "digits-qsr"] {
        for label in ["dp", "qsr"] {
            let dir = tmp.join(format!("{recipe}-{label}"));
            let mut c = Command::new(&qsr);
            c.current_dir(root)
                .args(["train", "--recipe", &format!("recipes/{recipe}.toml"), "--quiet", "--out"])
                .arg(&dir);
            if label == "dp" {
                // A rule's own keys go with it: replace the whole sync table.
                c.args(["--set", "sync={ rule = \"dp\" }"]);
            }
            output(c)?;
            let s: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("summary.json"))?)?;
            let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
            let _ = writeln!(
                o,
                "| {recipe} | {label} | {} | {:.1} | {} | {:.0}% | {:.2}% |",
                s["steps"],
                f("steps_per_second"),
                s["syncs"],
                100.0 * f("comm_seconds") / f("wall_seconds"),
                100.0 * f("final_test_accuracy")
            );
        }
    }
    o.push_str(&gpt_tokens_per_second(root, target)?);
    Ok(o)
}

/// The Python that runs the PyTorch peer: `QSR_BENCH_PYTHON`, else the bench venv.
fn bench_python() -> PathBuf {
    std::env::var_os("QSR_BENCH_PYTHON")
        .map_or_else(|| PathBuf::from("/var/tmp/qsr-bench-venv/bin/python"), PathBuf::from)
}

/// Tokens/s of one training step of the small GPT (2 layers, 4 heads, width 64, 16 windows of 64
/// tokens, AdamW with clipping): qsr's `gpt_step` example against PyTorch eager on the same model, batch
/// and thread count, alternated three times; medians.
fn gpt_tokens_per_second(root: &Path, target: &Path) -> Result<String> {
    let mut b = cargo(root);
    b.args(["build", "--release", "--locked", "--example", "gpt_step"]);
    output(b)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).to_string();
    let python = bench_python();
    let has_torch = Command::new(&python).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success());
    let (mut ours, mut torch) = measure_gpt(root, target, has_torch.then_some(python.as_path()), &threads)?;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let q = median(&mut ours);
    let mut o = format!(
        "\nOne training step of a small GPT (2 layers, 4 heads, width 64, 16 windows of 64 tokens, AdamW with \
         clipping; `gpt_step` example vs `benches/peers/gpt_step.py`, PyTorch eager, {threads} threads), median \
         of 3 alternated runs of 30 steps each:\n\n| implementation | tokens/s | ratio to PyTorch |\n|---|---|---|\n"
    );
    if torch.is_empty() {
        let _ = writeln!(o, "| qsr (burn flex) | {q:.0} | - |");
        let _ = writeln!(
            o,
            "\nPyTorch skipped: `{}` cannot import torch (set QSR_BENCH_PYTHON, or `python3 -m venv /var/tmp/qsr-bench-venv && /var/tmp/qsr-bench-venv/bin/pip install torch`).",
            python.display()
        );
    } else {
        let t = median(&mut torch);
        let _ = writeln!(o, "| qsr (burn flex) | {q:.0} | {:.2} |", q / t);
        let _ = writeln!(o, "| PyTorch eager | {t:.0} | 1.00 |");
    }
    Ok(o)
}

/// Tokens/s of 3 alternated runs of 30 steps: qsr's `gpt_step`, then (with a `python` that has torch) the
/// PyTorch peer.
fn measure_gpt(root: &Path, target: &Path, python: Option<&Path>, threads: &str) -> Result<(Vec<f64>, Vec<f64>)> {
    let tmp = std::env::temp_dir().join("qsr-bench-gpt");
    std::fs::create_dir_all(&tmp)?;
    let tps = |json: &Path| -> Result<f64> {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json)?)?;
        v["tokens_per_second"].as_f64().ok_or_else(|| anyhow::anyhow!("{}: no tokens_per_second", json.display()))
    };
    let (mut ours, mut torch) = (Vec::new(), Vec::new());
    for i in 0..3 {
        let json = tmp.join(format!("qsr-{i}.json"));
        let mut c = Command::new(target.join("release/examples/gpt_step"));
        c.args(["--steps", "30", "--json"]).arg(&json);
        output(c)?;
        ours.push(tps(&json)?);
        if let Some(python) = python {
            let json = tmp.join(format!("torch-{i}.json"));
            let mut c = Command::new(python);
            c.arg(root.join("benches/peers/gpt_step.py"))
                .args(["--threads", threads, "--steps", "30", "--json"])
                .arg(&json);
            output(c)?;
            torch.push(tps(&json)?);
        }
    }
    Ok((ours, torch))
}

fn human(b: u64) -> String {
    if b >= 1 << 20 { format!("{} MiB", b >> 20) } else { format!("{} KiB", b >> 10) }
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {cpu}")
}

/// Replaces (or appends) the section `name` of the benchmarks document.
pub fn replace_section(doc: &str, name: &str, body: &str) -> String {
    let (open, close) = (format!("<!-- bench:{name} -->"), format!("<!-- /bench:{name} -->"));
    let block = format!("{open}\n{body}{close}");
    match (doc.find(&open), doc.find(&close)) {
        (Some(a), Some(b)) if b > a => format!("{}{block}{}", &doc[..a], &doc[b + close.len()..]),
        _ => format!("{}\n\n### `cargo xtask bench {name}`\n\n{block}\n", doc.trim_end()),
    }
}

pub fn run(which: &str, root: &Path, target: &Path) -> Result<()> {
    let groups: Vec<&str> = match which {
        "all" => GROUPS.to_vec(),
        g if GROUPS.contains(&g) => vec![g],
        other => bail!("unknown bench group `{other}` (expected {} or all)", GROUPS.join(", ")),
    };
    let doc_path: PathBuf = root.join("docs/BENCHMARKS.md");
    for g in groups {
        let table = match g {
            "sched" => section_sched(root)?,
            "kernels" => section_kernels(root)?,
            "optim" => section_optim(root)?,
            "comm" => section_comm(root, target)?,
            "train" => section_train(root, target)?,
            _ => section_data(root)?,
        };
        print!("{table}");
        let date = output({
            let mut c = Command::new("date");
            c.arg("-u").arg("+%Y-%m-%d");
            c
        })
        .unwrap_or_default();
        let body = format!("Measured {} on {} by `cargo xtask bench {g}`.\n\n{table}", date.trim(), machine());
        let doc = std::fs::read_to_string(&doc_path).unwrap_or_default();
        std::fs::write(&doc_path, replace_section(&doc, g, &body))
            .with_context(|| format!("cannot write {}", doc_path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criterion_output_is_parsed_to_milliseconds() {
        let text = "average_k4_64MiB/fused_average_and_broadcast\n                        time:   [46.017 ms 47.490 ms 49.063 ms]\n                        thrpt:  [10.191 GiB/s 10.528 GiB/s 10.865 GiB/s]\ncursor_advance_1M_steps time:   [26.917 ms 27.539 ms 28.183 ms]\nshort time: [1.5 µs 2.0 µs 2.5 µs]\n";
        let m = criterion_medians(text);
        assert_eq!(m[0], ("average_k4_64MiB/fused_average_and_broadcast".to_string(), 47.490));
        assert_eq!(m[1], ("cursor_advance_1M_steps".to_string(), 27.539));
        assert!((m[2].1 - 0.002).abs() < 1e-12);
    }

    #[test]
    fn sections_are_replaced_in_place_or_appended() {
        let doc = "# B\n\n<!-- bench:comm -->\nold\n<!-- /bench:comm -->\ntail\n";
        let new = replace_section(doc, "comm", "new\n");
        assert_eq!(new, "# B\n\n<!-- bench:comm -->\nnew\n<!-- /bench:comm -->\ntail\n");
        let appended = replace_section("# B\n", "data", "rows\n");
        assert!(appended.contains("<!-- bench:data -->\nrows\n<!-- /bench:data -->"));
    }
}
