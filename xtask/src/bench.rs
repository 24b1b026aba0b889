//! `cargo xtask bench [sched|kernels|optim|comm|data|all]`: runs the benchmarks side by side with their
//! peers (burn's optimizer, memcpy, MPI_Allreduce, raw loopback TCP) and rewrites the matching section of
//! docs/BENCHMARKS.md (between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`) with ratio tables and
//! the machine they ran on.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

pub(crate) const GROUPS: [&str; 7] = ["sched", "kernels", "optim", "comm", "comm-quantized", "data", "train"];

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
pub(crate) fn criterion_medians(text: &str) -> Vec<(String, f64)> {
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
    let (averaging, coding): (Vec<_>, Vec<_>) = m.iter().partition(|(id, _)| id.starts_with("average_"));
    for (id, ms) in averaging {
        let gib = bytes / (ms / 1e3) / (1024.0 * 1024.0 * 1024.0);
        let _ = writeln!(o, "| {id} | {ms:.2} ms | {gib:.2} | {:.2}x |", ms / fused);
    }
    // The streaming syncs' coding: 4 Mi values encoded and decoded in place, one thread.
    let copy = get(&m, "round_block_4Mi/copy_only");
    o.push_str(
        "\n| coding (4 Mi values, one thread) | median | ns per value | vs a copy of the buffer |\n|---|---|---|---|\n",
    );
    for (id, ms) in coding {
        let ns = ms * 1e6 / (4.0 * 1024.0 * 1024.0);
        let vs = copy.map_or("-".into(), |c| format!("{:.1}x", ms / c));
        let _ = writeln!(o, "| {id} | {ms:.2} ms | {ns:.2} | {vs} |");
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

/// One measured size of a sweep: (bytes, median time per call in us, busbw GB/s).
type Point = (u64, f64, f64);

fn sweep(json: &Path) -> Result<Vec<Point>> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(json).with_context(|| format!("{} missing", json.display()))?)?;
    Ok(v.as_array()
        .map(|rows| {
            rows.iter()
                .filter_map(|r| Some((r["bytes"].as_u64()?, r["time_us"].as_f64()?, r["busbw_gbs"].as_f64()?)))
                .collect()
        })
        .unwrap_or_default())
}

/// The all-reduce peers of `cargo xtask bench comm`, each run as `allreduce_bench --backend <name>`
/// (MPI under mpirun, with Open MPI's shared-memory or TCP transport) or by its Python script.
const COMM_PEERS: [&str; 7] = ["auto", "tcp", "mpi", "mpi-tcp", "gloo", "raw-shm", "raw-tcp"];

/// Runs one sweep of `backend` at `ranks` over `min..=max` bytes (`extra` passed on); empty when
/// the peer is not installed (Gloo without torch).
fn comm_sweep(
    ctx: &CommBench,
    backend: &str,
    ranks: usize,
    (min, max): (u64, u64),
    extra: &[&str],
) -> Result<Vec<Point>> {
    let json = ctx.tmp.join(format!("{backend}-{ranks}-{min}-{max}{}.json", extra.join("")));
    let sizes = ["--min-bytes".to_string(), min.to_string(), "--max-bytes".into(), max.to_string()];
    let mut c = match backend {
        "gloo" if !ctx.gloo => return Ok(Vec::new()),
        "gloo" => {
            let mut c = Command::new("python3");
            c.arg(ctx.root.join("benches/peers/gloo_allreduce.py")).args(["--ranks", &ranks.to_string()]);
            c
        }
        "mpi" | "mpi-tcp" => {
            let mut c = Command::new("mpirun");
            c.args(["--allow-run-as-root", "--oversubscribe", "-np", &ranks.to_string()]);
            if backend == "mpi-tcp" {
                c.args(["--mca", "btl", "tcp,self"]);
            }
            c.arg(&ctx.exe).args(["--backend", "mpi"]);
            c
        }
        _ => {
            let mut c = Command::new(&ctx.exe);
            c.args(["--ranks", &ranks.to_string(), "--backend", backend]);
            c
        }
    };
    c.args(&sizes).args(extra).arg("--json").arg(&json);
    output(c)?;
    sweep(&json)
}

struct CommBench {
    root: PathBuf,
    exe: PathBuf,
    tmp: PathBuf,
    gloo: bool,
}

/// Builds the all-reduce bench (with `features`) and says where it and its peers are.
fn comm_bench(root: &Path, target: &Path, features: &[&str]) -> Result<CommBench> {
    let mut b = cargo(root);
    b.args(["build", "--release", "--locked", "-p", "qsr-comm", "--example", "allreduce_bench"]).args(features);
    output(b)?;
    let tmp = std::env::temp_dir().join("qsr-bench-comm");
    std::fs::create_dir_all(&tmp)?;
    // Gloo (torch.distributed) is a peer only where Python torch is importable.
    let gloo =
        Command::new("python3").args(["-c", "import torch.distributed"]).output().is_ok_and(|o| o.status.success());
    Ok(CommBench { root: root.to_path_buf(), exe: target.join("release/examples/allreduce_bench"), tmp, gloo })
}

fn section_comm(root: &Path, target: &Path) -> Result<String> {
    let ctx = comm_bench(root, target, &["--features", "mpi"])?;
    let mut o = String::from(
        "busbw GB/s (algbw x 2(n-1)/n), sizes 4 KiB..256 MiB, and the 8 B latency; `ours` is what `qsr_comm::connect` \
         picks (shared memory, every rank being on this host), next to our TCP ring, MPI_Allreduce (our MPI backend \
         under Open MPI's shared-memory transport and under `--mca btl tcp,self`), Gloo (torch.distributed, \
         `benches/peers/gloo_allreduce.py`, where torch is installed), one memcpy of the buffer (`raw shm`) and raw \
         loopback TCP, all in the same run.\n\n",
    );
    let mut latency = String::from(
        "| ranks | ours (us) | tcp ring | mpi shm | mpi tcp | ours / mpi shm |\n|---|---|---|---|---|---|\n",
    );
    o.push_str(
        "| ranks | size | ours | tcp ring | mpi shm | mpi tcp | gloo | raw shm | raw tcp | ours / mpi shm | ours / mpi tcp | ours / gloo | ours / raw shm | ring / mpi tcp | ring / raw tcp |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for ranks in [2usize, 4, 8] {
        let mut results = Vec::new();
        for peer in COMM_PEERS {
            results.push(comm_sweep(&ctx, peer, ranks, (4096, 256 << 20), &[])?);
        }
        let lat: Vec<Option<f64>> = ["auto", "tcp", "mpi", "mpi-tcp"]
            .iter()
            .map(|p| Ok(comm_sweep(&ctx, p, ranks, (8, 8), &["--iters", "2000"])?.first().map(|r| r.1)))
            .collect::<Result<_>>()?;
        let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        let _ = writeln!(
            latency,
            "| {ranks} | {} | {} | {} | {} | {} |",
            us(lat[0]),
            us(lat[1]),
            us(lat[2]),
            us(lat[3]),
            lat[0].zip(lat[2]).map_or("-".into(), |(a, m)| format!("{:.2}", a / m))
        );
        for &(bytes, _, ours) in &results[0] {
            let bw = |i: usize| results[i].iter().find(|r| r.0 == bytes).map(|r| r.2);
            let val = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
            let ratio = |a: Option<f64>, d: Option<f64>| a.zip(d).map_or("-".into(), |(a, d)| format!("{:.2}", a / d));
            let cols: Vec<String> = (1..COMM_PEERS.len()).map(|i| val(bw(i))).collect();
            let _ = writeln!(
                o,
                "| {ranks} | {} | {ours:.2} | {} | {} | {} | {} | {} | {} | {} |",
                human(bytes),
                cols.join(" | "),
                ratio(Some(ours), bw(2)),
                ratio(Some(ours), bw(3)),
                ratio(Some(ours), bw(4)),
                ratio(Some(ours), bw(5)),
                ratio(bw(1), bw(3)),
                ratio(bw(1), bw(6)),
            );
        }
    }
    let _ = write!(o, "\n8 B all-reduce latency (median us per call):\n\n{latency}");
    o.push_str(&shm_cutover(&ctx)?);
    o.push_str(&tcp_cutover(&ctx)?);
    Ok(o)
}

/// `cargo xtask bench comm-quantized`: the TCP ring's f32 all-reduce against its int8, fp8 and int2
/// ones (block-scaled, re-quantized at each hop) at 4 ranks, 64 KiB..64 MiB of f32: time per call and
/// the bytes a rank sends.
fn section_comm_quantized(root: &Path, target: &Path) -> Result<String> {
    let ctx = &comm_bench(root, target, &[])?;
    let mut o = String::from(
        "The TCP ring at 4 ranks with block-scaled int8 / fp8 / int2 payloads (`all_reduce_quantized`) against \
         f32: median us per call for a buffer of that many f32 bytes, and the bytes rank 0 sends per call \
         (`CommStats`):\n\n\
         | size (f32) | f32 us | int8 us | fp8 us | int2 us | int8 / f32 time | int2 / f32 time | f32 bytes sent | int8 / f32 bytes | int2 / f32 bytes |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    let (min, max) = (64u64 << 10, 64u64 << 20);
    let run = |wire: &str| comm_sweep(ctx, "tcp", 4, (min, max), &["--wire", wire]);
    let (f, i, e, t) = (run("f32")?, run("int8")?, run("fp8")?, run("int2")?);
    let sent = |wire: &str| wire_bytes(&ctx.tmp.join(format!("tcp-4-{min}-{max}--wire{wire}.json")));
    let (fs, is, ts) = (sent("f32")?, sent("int8")?, sent("int2")?);
    for ((((a, b), c), d), ((x, y), z)) in f.iter().zip(&i).zip(&e).zip(&t).zip(fs.iter().zip(&is).zip(&ts)) {
        let _ = writeln!(
            o,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {x} | {:.3} | {:.3} |",
            human(a.0),
            a.1,
            b.1,
            c.1,
            d.1,
            b.1 / a.1,
            d.1 / a.1,
            *y as f64 / *x as f64,
            *z as f64 / *x as f64
        );
    }
    Ok(o)
}

/// The bytes rank 0 sent per call at each size of a sweep's JSON.
fn wire_bytes(json: &Path) -> Result<Vec<u64>> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json)?)?;
    Ok(v.as_array().map(|rows| rows.iter().filter_map(|r| r["wire_bytes"].as_u64()).collect()).unwrap_or_default())
}

/// The TCP ring's all-reduce by recursive doubling against the pipelined ring, 64 B..64 KiB at 4 and
/// 8 ranks (shared memory off): where `TcpConfig::doubling_bytes` should cut over. Two ranks and
/// buffers of fewer values than ranks always take the ring, so they are not measured here.
fn tcp_cutover(ctx: &CommBench) -> Result<String> {
    let mut o = String::from(
        "\nTCP, recursive doubling (log2 K exchanges between pairs) against the ring (2 (K-1) hops), median us \
         per call; `TcpConfig::doubling_bytes` takes doubling up to its value (from 3 ranks, for at least one \
         value per rank):\n\n\
         | ranks | size | doubling | ring | doubling / ring |\n|---|---|---|---|---|\n",
    );
    for ranks in [4usize, 8] {
        let on = comm_sweep(ctx, "tcp", ranks, (64, 64 << 10), &["--iters", "500", "--doubling-bytes", "1048576"])?;
        let off = comm_sweep(ctx, "tcp", ranks, (64, 64 << 10), &["--iters", "500", "--doubling-bytes", "0"])?;
        for (a, b) in on.iter().zip(&off) {
            let _ = writeln!(o, "| {ranks} | {} | {:.1} | {:.1} | {:.2} |", human(a.0), a.1, b.1, a.1 / b.1);
        }
    }
    Ok(o)
}

/// The shared-memory all-reduce with one stage against two, 8 B..64 KiB at 2 and 4 ranks: where
/// `ShmConfig::one_stage_bytes` should cut over.
fn shm_cutover(ctx: &CommBench) -> Result<String> {
    let mut o = String::from(
        "\nShared memory, one stage (every rank reduces the whole buffer) against two (each reduces its share), \
         median us per call; `ShmConfig::one_stage_bytes` takes one stage up to its value:\n\n\
         | ranks | size | one stage | two stages | one / two |\n|---|---|---|---|---|\n",
    );
    for ranks in [2usize, 4] {
        let one = comm_sweep(ctx, "shm", ranks, (8, 64 << 10), &["--iters", "1000", "--one-stage-bytes", "1048576"])?;
        let two = comm_sweep(ctx, "shm", ranks, (8, 64 << 10), &["--iters", "1000", "--one-stage-bytes", "0"])?;
        for (a, b) in one.iter().zip(&two) {
            let _ = writeln!(o, "| {ranks} | {} | {:.1} | {:.1} | {:.2} |", human(a.0), a.1, b.1, a.1 / b.1);
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
            let _ = std::fs::remove_dir_all(&dir); // the last bench's run: qsr refuses to train over it
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
    o.push_str(&step_tables(root, target)?);
    Ok(o)
}

/// The Python that runs the PyTorch peer: `QSR_BENCH_PYTHON`, else the bench venv.
fn bench_python() -> PathBuf {
    std::env::var_os("QSR_BENCH_PYTHON")
        .map_or_else(|| PathBuf::from("/var/tmp/qsr-bench-venv/bin/python"), PathBuf::from)
}

/// One model's step as `qsr time-step` and `benches/peers/train_step.py` both take it.
struct StepCase {
    name: &'static str,
    args: &'static [&'static str],
    steps: &'static str,
}

const STEP_CASES: [StepCase; 4] = [
    StepCase { name: "GPT small (2 x 64, context 64, batch 16)", args: &["--model", "gpt"], steps: "30" },
    StepCase {
        name: "GPT medium (4 x 256, 8 heads, context 128, batch 16)",
        args: &["--model", "gpt", "--layers", "4", "--heads", "8", "--width", "256", "--context", "128"],
        steps: "8",
    },
    StepCase { name: "digits CNN (1 x 8 x 8, batch 64)", args: &["--model", "cnn"], steps: "30" },
    StepCase { name: "ResNet-20 (3 x 32 x 32, batch 128)", args: &["--model", "resnet20"], steps: "6" },
];

/// Alternated runs of each step case (odd, so that a median is a run).
const STEP_REPEATS: usize = 5;

/// One training step of each [`STEP_CASES`] model at 1 and 2 intra-op threads: `qsr time-step` against
/// PyTorch eager (`benches/peers/train_step.py`) on the same model, batch and thread count,
/// [`STEP_REPEATS`] alternated runs: medians of the rates, and each ratio the median of the runs' paired
/// ratios (run i over PyTorch's run i, taken moments apart), which a shared machine's slow spells
/// disturb less than a ratio of medians; then where qsr's step goes, phase by phase.
fn step_tables(root: &Path, target: &Path) -> Result<String> {
    let python = bench_python();
    let has_torch = Command::new(&python).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success());
    let python = has_torch.then_some(python.as_path());
    let libtorch = python.map(|p| build_libtorch_qsr(root, target, p));
    let mut tables = StepTables::new();
    for case in &STEP_CASES {
        for threads in ["1", "2"] {
            let lt = libtorch.as_ref().and_then(|r| r.as_ref().ok());
            tables.add(case, threads, measure_step(root, target, (python, lt), case, threads)?);
        }
    }
    if python.is_none() {
        let _ = writeln!(
            tables.ratios,
            "\nPyTorch skipped: `{}` cannot import torch (set QSR_BENCH_PYTHON, or `python3 -m venv \
             /var/tmp/qsr-bench-venv && /var/tmp/qsr-bench-venv/bin/pip install torch==2.9.0`).",
            bench_python().display()
        );
    }
    if !tables.failures.is_empty() {
        let _ = write!(tables.backends, "\nburn-tch failed (a burn-tch bug, not timed):\n\n{}", tables.failures);
    }
    if let Some(Err(why)) = &libtorch {
        let _ = writeln!(tables.backends, "\nLibTorch skipped: {why}.");
    }
    Ok(tables.ratios + &tables.backends + &tables.phases)
}

/// The step section's tables as [`step_tables`] fills them, one row per (case, threads).
struct StepTables {
    ratios: String,
    backends: String,
    phases: String,
    /// burn-tch's failures, one line each.
    failures: String,
}

impl StepTables {
    fn new() -> Self {
        Self {
            ratios: String::from(
                "\nOne training step on one worker (`qsr time-step` vs `benches/peers/train_step.py`, PyTorch \
                 eager), medians of 5 alternated runs; each ratio the median of the runs' paired ratios:\n\n\
                 | model | threads | qsr | PyTorch | ratio |\n\
                 |---|---|---|---|---|\n",
            ),
            backends: String::from(
                "\nThe CPU backends side by side (same step, same runs; ratios to PyTorch eager): flex as shipped \
                 (`simd`, `rayon`, `x86-v4`, qsr's fused ops) and burn's LibTorch backend (burn-tch over PyTorch \
                 2.9.0's kernels, feature `qsr-train/tch`; qsr's fused ops fall back to burn's ops there):\n\n\
                 | model | threads | flex | LibTorch (burn-tch) | PyTorch |\n|---|---|---|---|---|\n",
            ),
            phases: String::from(
                "\nWhere qsr's step goes (mean ms per step of the median run; collectives excluded: one worker):\n\n\
                 | model | threads | step ms | forward | backward | gradients | optimizer | write-back |\n\
                 |---|---|---|---|---|---|---|---|\n",
            ),
            failures: String::new(),
        }
    }

    /// One row of each table from a case's runs at `threads`.
    fn add(&mut self, case: &StepCase, threads: &str, runs: StepRuns) {
        let StepRuns { mut ours, torch, libtorch, libtorch_error } = runs;
        if let Some(why) = libtorch_error {
            let _ = writeln!(self.failures, "- {} at {threads} thread(s) on LibTorch: `{why}`", case.name);
        }
        let rate_of = |v: &serde_json::Value| v["per_second"].as_f64().unwrap_or(0.0);
        let paired = |rates: &[f64]| median(rates.iter().zip(&torch).map(|(r, t)| r / t).collect());
        let ours_rates: Vec<f64> = ours.iter().map(rate_of).collect();
        let (flex_ratio, libtorch_ratio) = (paired(&ours_rates), paired(&libtorch));
        ours.sort_by(|a, b| f64::total_cmp(&rate_of(a), &rate_of(b)));
        let q = &ours[ours.len() / 2];
        let rate = q["per_second"].as_f64().unwrap_or(f64::NAN);
        let unit = format!("{}/s", q["unit"].as_str().unwrap_or("items"));
        let torch_rate = median(torch);
        let (t, ratio) = match torch_rate.is_nan() {
            false => (format!("{torch_rate:.0} {unit}"), format!("{flex_ratio:.2}")),
            true => ("-".into(), "-".into()),
        };
        let _ = writeln!(self.ratios, "| {} | {threads} | {rate:.0} {unit} | {t} | {ratio} |", case.name);
        let cell = |r: f64, ratio: f64| match (r.is_nan(), ratio.is_nan()) {
            (true, _) => "-".to_string(),
            (false, true) => format!("{r:.0}"),
            (false, false) => format!("{r:.0} ({ratio:.2})"),
        };
        let _ = writeln!(
            self.backends,
            "| {} | {threads} | {} | {} | {t} |",
            case.name,
            cell(rate, flex_ratio),
            cell(median(libtorch), libtorch_ratio)
        );
        let p = &q["phases_ms"];
        let ms = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
        let _ = writeln!(
            self.phases,
            "| {} | {threads} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            case.name,
            q["step_ms_median"].as_f64().unwrap_or(f64::NAN),
            ms("forward"),
            ms("backward"),
            ms("gradients"),
            ms("optimizer"),
            ms("write_back")
        );
    }
}

/// The median of `v` (NaN for none).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// [`STEP_REPEATS`] alternated runs of one case: qsr's JSON results, then (with a `python` that has
/// torch) the peer's rates.
fn measure_step(
    root: &Path,
    target: &Path,
    (python, libtorch): (Option<&Path>, Option<&LibTorchQsr>),
    case: &StepCase,
    threads: &str,
) -> Result<StepRuns> {
    let tmp = std::env::temp_dir().join("qsr-bench-step");
    std::fs::create_dir_all(&tmp)?;
    let read = |json: &Path| -> Result<serde_json::Value> { Ok(serde_json::from_slice(&std::fs::read(json)?)?) };
    let (mut ours, mut torch, mut burn_tch) = (Vec::new(), Vec::new(), Vec::new());
    let mut libtorch_error = None;
    for i in 0..STEP_REPEATS {
        let json = tmp.join(format!("qsr-{i}.json"));
        let mut c = Command::new(target.join("release/qsr"));
        c.arg("time-step").args(case.args).args(["--threads", threads, "--steps", case.steps, "--json"]).arg(&json);
        output(c)?;
        ours.push(read(&json)?);
        if let Some(lt) = libtorch.filter(|_| libtorch_error.is_none()) {
            let json = tmp.join(format!("libtorch-{i}.json"));
            let mut c = Command::new(&lt.binary);
            // PyTorch's kernels take their thread count from OpenMP's variable, not from qsr's pool.
            c.env("LD_LIBRARY_PATH", &lt.lib_dir).env("OMP_NUM_THREADS", threads);
            c.arg("time-step").args(case.args).args(["--device", "libtorch"]);
            c.args(["--threads", threads, "--steps", case.steps, "--json"]).arg(&json);
            // burn-tch fails on some models: a row without it, and why, rather than no table.
            match output(c) {
                Ok(_) => burn_tch.push(read(&json)?["per_second"].as_f64().unwrap_or(f64::NAN)),
                Err(e) => libtorch_error = Some(first_torch_error(&format!("{e:#}"))),
            }
        }
        if let Some(python) = python {
            let json = tmp.join(format!("torch-{i}.json"));
            let mut c = Command::new(python);
            c.arg(root.join("benches/peers/train_step.py"))
                .args(case.args)
                .args(["--threads", threads, "--steps", case.steps, "--json"])
                .arg(&json);
            output(c)?;
            let v = read(&json)?;
            torch.push(v["per_second"].as_f64().with_context(|| format!("{}: no per_second", json.display()))?);
        }
    }
    Ok(StepRuns { ours, torch, libtorch: burn_tch, libtorch_error })
}

/// The first line of the error PyTorch raised (what a failed LibTorch run says), else the first line.
fn first_torch_error(stderr: &str) -> String {
    let from = stderr.find("Torch(\"").map_or(stderr, |i| &stderr[i + 7..]);
    // Debug-printed errors carry their newlines escaped.
    let line = from.lines().next().unwrap_or("");
    line.split("\\n").next().unwrap_or("").chars().take(160).collect()
}

/// [`measure_step`]'s runs: qsr's JSON results, the PyTorch peer's rates, and qsr on burn's LibTorch
/// backend (each empty where it was not run).
struct StepRuns {
    ours: Vec<serde_json::Value>,
    torch: Vec<f64>,
    libtorch: Vec<f64>,
    /// Why the LibTorch runs stopped, if they failed.
    libtorch_error: Option<String>,
}

/// A `qsr` built with burn's LibTorch backend (feature `qsr-train/tch`) and where its libraries are.
struct LibTorchQsr {
    binary: PathBuf,
    lib_dir: PathBuf,
}

/// Builds `qsr` with LibTorch against `python`'s PyTorch (2.9.0, what tch 0.22 takes) as
/// `release/qsr-libtorch`, then the default `qsr` again; the reason it could not, otherwise.
fn build_libtorch_qsr(root: &Path, target: &Path, python: &Path) -> Result<LibTorchQsr, String> {
    let probe = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(torch.__version__); print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let out = String::from_utf8_lossy(&probe.stdout).into_owned();
    let mut lines = out.lines();
    let (version, lib_dir) = (lines.next().unwrap_or(""), PathBuf::from(lines.next().unwrap_or("")));
    if !version.starts_with("2.9.0") {
        return Err(format!("burn-tch 0.22 takes PyTorch 2.9.0, {} has `{version}`", python.display()));
    }
    let bin_dir = python.parent().unwrap_or(Path::new("."));
    let path = std::env::join_paths(
        std::iter::once(bin_dir.to_path_buf())
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .map_err(|e| e.to_string())?;
    let mut b = cargo(root);
    b.args(["build", "--release", "--locked", "--features", "qsr-train/tch", "--bin", "qsr"]);
    b.env("LIBTORCH_USE_PYTORCH", "1").env("PATH", path);
    output(b).map_err(|e| format!("the LibTorch build failed: {e:#}"))?;
    let binary = target.join("release/qsr-libtorch");
    std::fs::copy(target.join("release/qsr"), &binary).map_err(|e| e.to_string())?;
    let mut again = cargo(root);
    again.args(["build", "--release", "--locked", "--bin", "qsr"]);
    output(again).map_err(|e| format!("rebuilding the default qsr failed: {e:#}"))?;
    Ok(LibTorchQsr { binary, lib_dir })
}

fn human(b: u64) -> String {
    match b {
        _ if b >= 1 << 20 => format!("{} MiB", b >> 20),
        _ if b >= 1 << 10 => format!("{} KiB", b >> 10),
        _ => format!("{b} B"),
    }
}

/// Today's date (UTC), `YYYY-MM-DD`.
pub(crate) fn today() -> String {
    let mut c = Command::new("date");
    c.arg("-u").arg("+%Y-%m-%d");
    output(c).unwrap_or_default().trim().to_string()
}

/// The machine in words: cores and CPU model.
pub(crate) fn machine() -> String {
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
pub(crate) fn replace_section(doc: &str, name: &str, body: &str) -> String {
    let (open, close) = (format!("<!-- bench:{name} -->"), format!("<!-- /bench:{name} -->"));
    let block = format!("{open}\n{body}{close}");
    match (doc.find(&open), doc.find(&close)) {
        (Some(a), Some(b)) if b > a => format!("{}{block}{}", &doc[..a], &doc[b + close.len()..]),
        _ => format!("{}\n\n### `cargo xtask bench {name}`\n\n{block}\n", doc.trim_end()),
    }
}

pub(crate) fn run(which: &str, root: &Path, target: &Path) -> Result<()> {
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
            "comm-quantized" => section_comm_quantized(root, target)?,
            "train" => section_train(root, target)?,
            _ => section_data(root)?,
        };
        print!("{table}");
        let body = format!("Measured {} on {} by `cargo xtask bench {g}`.\n\n{table}", today(), machine());
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
