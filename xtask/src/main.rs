//! Project automation: `cargo xtask <command>` (see `cargo xtask --help`).
//!
//! xtask only orchestrates cargo and the `qsr` binary; it holds no project logic.

// A developer tool over the repository and its own runs: qsr-files guards what users give qsr.
#![allow(clippy::disallowed_methods)]

mod bench;
mod chaos;
mod cuda;
mod file_docs;
mod gpu_features;
mod layers;
mod netem;
mod qsr_diff;
mod resume_check;
mod snippet;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The test suite as CI runs it, examples included (release build: training code is ~50x slower in debug).
    Ci,
    /// Rewrites README.md's diff between the plain burn example and its QSR version (the tidy step
    /// checks it).
    QsrDiff,
    /// The resume check of `cargo xtask ci` alone, on the examples and `qsr` already built: each burn
    /// example stopped after an epoch and resumed ends with the whole run's bits.
    ResumeCheck,
    /// A new project from README.md's `[dependencies]` block and the burn examples: adding the QSR
    /// lines to a built burn project compiles no burn crate again, and the QSR program runs.
    Snippet,
    /// The paper's communication plans (and their lr/H picture), then the README's main job.
    Demo {
        /// Where to write the picture.
        #[arg(long, default_value = "runs/demo/paper-plans.png")]
        plot: PathBuf,
    },
    /// Benchmarks side by side with their peers; rewrites docs/BENCHMARKS.md.
    Bench {
        /// Which group: sched, kernels, optim, comm, data or all.
        #[arg(default_value = "all")]
        which: String,
    },
    /// The CUDA + NCCL build of `qsr` without network access to LLVM (see xtask/src/cuda.rs).
    Cuda(cuda::CudaArgs),
    /// As root: K network namespaces with tc-shaped links; wall-clock of dp, constant H and QSR over them.
    Netem(Box<netem::NetemArgs>),
    /// Elastic jobs on loopback under injected faults (kill -9 / SIGSTOP of workers, rank 0, the
    /// store), each checked against its expected outcome and the invariants; replays from --seed.
    Chaos(chaos::ChaosArgs),
}

/// The workspace root. `cargo run` sets CARGO_MANIFEST_DIR at run time too: prefer it, because a
/// target dir shared by two checkouts can hand one checkout the other's (fresh-looking) xtask binary,
/// whose compile-time path would run everything in the other checkout.
fn root() -> PathBuf {
    let manifest =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest.parent().expect("xtask lives in the workspace").to_path_buf()
}

fn target_dir() -> PathBuf {
    std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| root().join("target"))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command) -> Result<()> {
    eprintln!("xtask: {c:?}");
    let status = c.status().with_context(|| format!("cannot start {c:?}"))?;
    if !status.success() {
        bail!("{c:?} failed with {status}");
    }
    Ok(())
}

#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Totals {
    fn add(&mut self, o: Totals) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.ignored += o.ignored;
    }
}

/// Runs `mpi_check` under mpirun; it prints `mpi_check: N ranks, M cases passed` per rank.
fn run_mpi_check(mut c: Command) -> Result<Totals> {
    eprintln!("xtask: {c:?}");
    let out = c.output().with_context(|| format!("cannot start {c:?} (is openmpi-bin installed?)"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{c:?} failed with {}", out.status);
    }
    let cases = text
        .lines()
        .filter_map(|l| l.strip_prefix("mpi_check: "))
        .filter_map(|l| l.split(", ").nth(1)?.split(' ').next()?.parse::<u64>().ok())
        .max()
        .context("mpi_check printed no result line")?;
    Ok(Totals { passed: cases, failed: 0, ignored: 0 })
}

/// Examples `cargo xtask ci` runs after the workspace tests, as (package, example), each counted as one passed
/// test when it exits 0. Each finishes in seconds and needs no data beyond the embedded digits. Not here:
/// qsr-comm's `mpi_check` (its own step, under mpirun), and the measurements `allreduce_bench` (qsr-comm) and
/// `loader_throughput` (qsr-data), which take tens of seconds and are `cargo xtask bench`'s.
const CI_EXAMPLES: [(&str, &str); 11] = [
    ("qsr-sched", "plan_qsr"),
    ("qsr-kernels", "fused_average"),
    ("qsr-models", "count_params"),
    ("qsr-data", "sharded_digits"),
    ("qsr-data", "sharded_text"),
    ("qsr-comm", "allreduce_threads"),
    ("qsr-comm", "allreduce_processes"),
    ("qsr-optim", "averager"),
    ("qsr-optim", "worker_custom_model"),
    ("qsr-optim", "burn_plain"),
    ("qsr-optim", "burn_qsr"),
];

/// Examples that also run as the ranks of a job, each under `qsr launch --nproc 2` (the `qsr` the test
/// step built), as a user runs their own binary.
const LAUNCHED_EXAMPLES: [(&str, &str); 3] =
    [("qsr-comm", "allreduce_processes"), ("qsr-optim", "averager"), ("qsr-optim", "burn_qsr")];

/// The crate that integrates with burn-train (tested in a step of its own, see `Cmd::Ci`).
const BURN_TRAIN: &str = "qsr-burn-train";

/// Builds `examples` in one cargo invocation over the packages `selection` names (the selection of the
/// test step before it, so the build reuses its artifacts: another selection would resolve other
/// features and rebuild burn), then runs each binary as its users would. Every example runs even after a
/// failure; any failure then fails the step, naming the examples.
fn run_examples(selection: &[&str], examples: &[(&str, &str)]) -> Result<Totals> {
    let mut b = cargo();
    b.args(["build", "--release", "--locked"]).args(selection);
    for (_, example) in examples {
        b.args(["--example", example]);
    }
    run(b)?;
    let mut totals = Totals::default();
    let mut failed = Vec::new();
    for &(package, example) in examples {
        let mut c = Command::new(target_dir().join("release/examples").join(example));
        eprintln!("xtask: {c:?}");
        let status = c.status().with_context(|| format!("cannot start example {package}/{example}"))?;
        if status.success() {
            println!("example {package}/{example} ... ok");
            totals.passed += 1;
        } else {
            println!("example {package}/{example} ... FAILED ({status})");
            totals.failed += 1;
            failed.push(format!("{package}/{example}"));
        }
    }
    if !failed.is_empty() {
        bail!("{} of {} examples failed: {}", failed.len(), examples.len(), failed.join(", "));
    }
    Ok(totals)
}

/// Runs each built example of `examples` as 2 ranks under `qsr launch`.
fn run_launched_examples(examples: &[(&str, &str)]) -> Result<Totals> {
    let mut totals = Totals::default();
    for &(package, example) in examples {
        let mut c = Command::new(target_dir().join("release/qsr"));
        c.args(["launch", "--nproc", "2", "--"]).arg(target_dir().join("release/examples").join(example));
        eprintln!("xtask: {c:?}");
        let status = c.status().with_context(|| format!("cannot start `qsr launch` for {package}/{example}"))?;
        if !status.success() {
            bail!("example {package}/{example} under `qsr launch --nproc 2` failed ({status})");
        }
        println!("example {package}/{example} as 2 launched ranks ... ok");
        totals.passed += 1;
    }
    Ok(totals)
}

/// Runs a libtest-style command, echoing its output and adding up its `test result:` lines.
fn run_tests(mut c: Command) -> Result<Totals> {
    use std::io::{BufRead, BufReader};
    eprintln!("xtask: {c:?}");
    let mut child = c.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("cannot start {c:?}"))?;
    let mut totals = Totals::default();
    let stdout = child.stdout.take().context("no stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let count = |word: &str| -> u64 {
                rest.split(';')
                    .filter_map(|part| part.trim().strip_suffix(word))
                    .filter_map(|n| n.trim().rsplit(' ').next()?.parse::<u64>().ok())
                    .sum()
            };
            totals.passed += count("passed");
            totals.failed += count("failed");
            totals.ignored += count("ignored");
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{c:?} failed with {status} ({} passed, {} failed)", totals.passed, totals.failed);
    }
    Ok(totals)
}

/// The tidy step, first in CI: formatting, the layering check (`layers.rs`), clippy with warnings denied (the workspace lints include
/// `missing_docs` and `undocumented_unsafe_blocks`), rustdoc with warnings denied, and `cargo package`. Release profile for
/// clippy and doc alike, so they share the dependencies' check builds.
fn tidy() -> Result<()> {
    let mut f = cargo();
    f.args(["fmt", "--all", "--", "--check"]);
    run(f).context("`cargo fmt --all` would change files: run it and commit")?;
    // Every crate's modules are layers: no file uses another that uses it back (docs/ARCHITECTURE.md).
    let mut crates: Vec<PathBuf> =
        std::fs::read_dir(root().join("crates"))?.map(|e| e.map(|e| e.path())).collect::<std::io::Result<_>>()?;
    crates.extend([root().join("xtask"), root().join("benches")]);
    crates.sort();
    layers::check(&crates)?;
    // Every source file says what it is for (its first line a `//!` comment).
    file_docs::check(&crates)?;
    qsr_diff::check(&root())?;
    gpu_features::check()?;
    let mut c = cargo();
    c.args(["clippy", "--release", "--locked", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    run(c)?;
    let mut d = cargo();
    d.args(["doc", "--release", "--locked", "--no-deps", "--workspace"]).env("RUSTDOCFLAGS", "-D warnings");
    run(d)?;
    // Every crate a user can depend on packages (manifest, files, local dependencies packaged together);
    // building the packages is left to the test steps, which compile the same sources.
    let mut p = cargo();
    p.args(["package", "--workspace", "--exclude", "xtask", "--exclude", "qsr-benches", "--no-verify", "--locked"]);
    run(p).context("`cargo package` failed for a library crate")
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Ci => {
            tidy()?;
            // qsr-burn-train is tested on its own: burn-train turns on burn features (`train`, datasets) that
            // the other crates do not use, and a build that unified them would test those crates on another
            // burn than their users get and rebuild burn again for the examples.
            let workspace = ["--workspace", "--exclude", BURN_TRAIN];
            let mut t = cargo();
            t.args(["test", "--release", "--locked"]).args(workspace);
            let mut totals = run_tests(t)?;
            // The crates' examples, each run as its users would run it.
            totals.add(run_examples(&workspace, &CI_EXAMPLES)?);
            totals.add(run_launched_examples(&LAUNCHED_EXAMPLES)?);
            // Whole resume: the burn examples stopped after an epoch and resumed end with the whole run's bits.
            totals.add(resume_check::run()?);
            // A burn user's project from the README's dependencies: qsr added without a second burn build.
            totals.add(snippet::run(&root(), &target_dir())?);
            // The fault campaign, one job per fault kind (docs/RELIABILITY.md); a job is a test.
            // The test step built `qsr` for the integration tests; `cargo build --bin qsr` alone would resolve
            // burn's dependencies without the dev-dependencies' features and compile burn again (7 min).
            let chaos = chaos::ChaosArgs {
                jobs: chaos::KINDS.len(),
                seed: Some(1),
                workers: 4,
                write_docs: false,
                prebuilt: true,
            };
            chaos::run(&chaos, &root(), &target_dir())?;
            totals.passed += chaos.jobs as u64;
            let burn_train = ["-p", BURN_TRAIN];
            let mut bt = cargo();
            bt.args(["test", "--release", "--locked"]).args(burn_train);
            totals.add(run_tests(bt)?);
            totals.add(run_examples(&burn_train, &[(BURN_TRAIN, "learner_digits")])?);
            // The cubecl kernels, on cubecl's wgpu runtime (Mesa lavapipe on a machine without a GPU).
            let mut k = cargo();
            k.args(["test", "--release", "--locked", "-p", "qsr-kernels", "--features", "wgpu"]);
            totals.add(run_tests(k)?);
            // Device-resident training on burn's wgpu backend with fusion and autotune, as the GPU builds
            // have them: the fused average through the fusion client, a medium GPT and a ResNet-20 step.
            let mut w = cargo();
            w.args(["test", "--release", "--locked", "-p", "qsr-optim", "--features", "wgpu", "--test", "it"]);
            w.args(["--", "device_wgpu"]);
            totals.add(run_tests(w)?);
            // The CUDA / NCCL code type-checks (CI has no GPU; the offline build route of `cargo xtask cuda`).
            cuda::run(&cuda::CudaArgs::check_only(), &root(), &target_dir())?;
            // The MPI backend under a real mpirun, where Open MPI is installed (.ci/run installs it and sets
            // QSR_REQUIRE_MPI=1, so there a missing MPI fails instead of skipping).
            let have_mpi = Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
            if !have_mpi {
                if std::env::var("QSR_REQUIRE_MPI").is_ok_and(|v| v == "1") {
                    bail!(
                        "QSR_REQUIRE_MPI=1 but `mpirun` is not available (apt-get install openmpi-bin libopenmpi-dev libclang-dev)"
                    );
                }
                eprintln!(
                    "xtask ci: SKIP the MPI backend test: no `mpirun` (apt-get install openmpi-bin libopenmpi-dev libclang-dev)"
                );
                println!("{} passed, {} failed, {} ignored", totals.passed, totals.failed, totals.ignored);
                return Ok(());
            }
            let mut b = cargo();
            b.args(["build", "--release", "--locked", "-p", "qsr-comm", "--features", "mpi", "--example", "mpi_check"]);
            run(b)?;
            let target = target_dir();
            let mut m = Command::new("mpirun");
            m.args(["--allow-run-as-root", "--oversubscribe", "-np", "3"])
                .arg(target.join("release/examples/mpi_check"));
            totals.add(run_mpi_check(m)?);
            // One closing line for the whole suite (cargo's own last line is the doc-test binary's).
            println!("{} passed, {} failed, {} ignored", totals.passed, totals.failed, totals.ignored);
            Ok(())
        }
        Cmd::ResumeCheck => resume_check::run().map(drop),
        Cmd::Snippet => snippet::run(&root(), &target_dir()).map(drop),
        Cmd::Demo { plot } => {
            // The paper's communication plans, then the README's main job.
            if let Some(dir) = plot.parent() {
                std::fs::create_dir_all(root().join(dir))?;
            }
            let mut q = cargo();
            q.args(["run", "--quiet", "--release", "--locked", "--bin", "qsr", "--", "plan"]);
            for r in [
                "imagenet-resnet152-dp",
                "imagenet-resnet152-h2",
                "imagenet-resnet152-qsr",
                "imagenet-vit-b-dp",
                "imagenet-vit-b-h4",
                "imagenet-vit-b-qsr-hbase4",
                "imagenet-vit-b-qsr-hbase8",
            ] {
                q.args(["--recipe", &format!("recipes/{r}.toml")]);
            }
            q.arg("--plot").arg(&plot);
            run(q)?;
            let mut c = cargo();
            c.args(["run", "--quiet", "--release", "--locked", "--bin", "qsr", "--", "compare"]);
            c.args(["--recipe", "recipes/digits-qsr.toml", "--seeds", "3"]);
            run(c)
        }
        Cmd::Bench { which } => bench::run(&which, &root(), &target_dir()),
        Cmd::QsrDiff => qsr_diff::write_readme(&root()),
        Cmd::Netem(args) => netem::run(&args, &root()),
        Cmd::Cuda(args) => cuda::run(&args, &root(), &target_dir()),
        Cmd::Chaos(args) => chaos::run(&args, &root(), &target_dir()),
    }
}
