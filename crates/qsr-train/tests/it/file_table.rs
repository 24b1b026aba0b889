//! Issue 56, the one file door: every file `qsr` reads or writes, each replaced by a FIFO, a link to
//! `/dev/zero`, a link to a regular file, a directory and a sparse 3 GB file. Reads refuse what is not
//! a regular file within its bound at once, naming the file; writes replace what is there without
//! following a link (its target is untouched) or opening a FIFO; a directory in a file's place is an
//! error naming it. No case may hang: each command has a minute.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::{RECIPE, qsr_cmd};

/// What a case puts where `qsr` expects a file.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Planted {
    Fifo,
    LinkToDevZero,
    LinkToFile,
    Directory,
    Sparse3Gb,
}

const PLANTED: [Planted; 5] =
    [Planted::Fifo, Planted::LinkToDevZero, Planted::LinkToFile, Planted::Directory, Planted::Sparse3Gb];

/// A link's target: a regular file that must keep its content.
const KEPT: &str = "keep me\n";

/// Replaces `path` (removed first if present) with `kind`; a link to a file links to `link_target`.
fn plant(path: &Path, kind: Planted, link_target: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    if path.is_dir() && !path.is_symlink() {
        std::fs::remove_dir_all(path).unwrap();
    } else if path.symlink_metadata().is_ok() {
        std::fs::remove_file(path).unwrap();
    }
    match kind {
        Planted::Fifo => assert!(Command::new("mkfifo").arg(path).status().unwrap().success()),
        Planted::LinkToDevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
        Planted::LinkToFile => std::os::unix::fs::symlink(link_target, path).unwrap(),
        Planted::Directory => std::fs::create_dir(path).unwrap(),
        Planted::Sparse3Gb => std::fs::File::create(path).unwrap().set_len(3 << 30).unwrap(),
    }
}

/// Runs `qsr args`, killed and failed if it runs past a minute (the defects these pin were hangs).
fn run(args: &[String]) -> Output {
    let child = qsr_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (pid, start) = (child.id(), Instant::now());
    let watchdog = std::thread::spawn(move || {
        while start.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(200));
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return false;
            }
        }
        let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        true
    });
    let out = child.wait_with_output().unwrap();
    assert!(!watchdog.join().unwrap() || out.status.success(), "qsr {args:?} still ran after a minute");
    out
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn text(p: &Path) -> String {
    p.display().to_string()
}

/// A short digits run into `out` with `extra` flags: 2 workers in threads unless they say `--nproc`.
fn train(out: &Path, extra: &[&str]) -> Vec<String> {
    let workers: &[&str] = if extra.contains(&"--nproc") { &[] } else { &["--workers", "2"] };
    let out = text(out);
    let base = [&["train", "--recipe", RECIPE, "--out", &out, "--quiet"][..], workers].concat();
    args(&[&base[..], &["--set", "schedule.total_steps=100", "--set", "eval.every_epochs=1"], extra].concat())
}

/// Whether `out` refused the planted file as bad input (status 2), naming it, and did not panic.
fn refused_naming(out: &Output, file: &str) -> Result<(), String> {
    let err = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(2) if err.contains(file) && !err.contains("panicked") => Ok(()),
        _ => Err(format!("expected a refusal naming {file}, got {:?}: {err}", out.status)),
    }
}

/// Whether `out` succeeded, with `path` now a regular file of its own.
fn replaced(out: &Output, path: &Path) -> Result<(), String> {
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("expected success, got {:?}: {err}", out.status));
    }
    match path.symlink_metadata() {
        Ok(m) if m.is_file() && m.len() < 1 << 30 => Ok(()),
        other => Err(format!("{} is not a new regular file: {other:?}", path.display())),
    }
}

/// Sets a case up in a fresh directory; returns the path to plant and the command.
type Setup = Box<dyn Fn(&Path) -> (PathBuf, Vec<String>)>;
/// What the command must do with a kind planted at the path.
type Expect = Box<dyn Fn(Planted, &Output, &Path) -> Result<(), String>>;

/// One row of the table: a file, how a command reaches it, and what each planted kind must give.
struct Row {
    /// The file, as the table's failures name it.
    name: &'static str,
    setup: Setup,
    expect: Expect,
}

impl Row {
    fn new(
        name: &'static str,
        setup: impl Fn(&Path) -> (PathBuf, Vec<String>) + 'static,
        expect: impl Fn(Planted, &Output, &Path) -> Result<(), String> + 'static,
    ) -> Self {
        Self { name, setup: Box::new(setup), expect: Box::new(expect) }
    }
}

/// A file `qsr` only reads: a link to a regular file is read through (and then judged as what it
/// holds); everything else is refused naming the file.
fn read_only(kind: Planted, out: &Output, path: &Path) -> Result<(), String> {
    let err = String::from_utf8_lossy(&out.stderr);
    match kind {
        Planted::LinkToFile if err.contains("not a regular file") => Err(format!("a link was not read: {err}")),
        Planted::LinkToFile => Ok(()),
        _ => refused_naming(out, &path.file_name().unwrap().to_string_lossy()),
    }
}

/// A file `qsr` writes whole: replaced whatever it was, but for a directory, which is an error naming it.
fn written(kind: Planted, out: &Output, path: &Path) -> Result<(), String> {
    match kind {
        Planted::Directory => {
            let err = String::from_utf8_lossy(&out.stderr);
            let name = path.file_name().unwrap().to_string_lossy();
            match out.status.success() || !err.contains(&*name) || err.contains("panicked") {
                true => Err(format!("a directory as {name} must fail naming it: {:?} {err}", out.status)),
                false => Ok(()),
            }
        }
        _ => replaced(out, path),
    }
}

/// A halted digits run in `dir/run` with its latest checkpoint; returns the run and that checkpoint.
fn halted(dir: &Path) -> (PathBuf, PathBuf) {
    let run = dir.join("run");
    let out = run_ok(&train(&run, &["--set", "schedule.total_steps=200", "--halt-after", "60"]));
    assert!(out.status.success());
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    let step = run.join("ckpt").join(latest.trim());
    (run, step)
}

fn run_ok(a: &[String]) -> Output {
    let out = run(a);
    assert!(out.status.success(), "qsr {a:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn resume(run: &Path) -> Vec<String> {
    args(&["train", "--resume", &text(run), "--quiet", "--workers", "2"])
}

/// A checkpoint's file, resumed from: every planted kind is refused naming it (a checkpoint holds no
/// links, a sparse file fails its bound or its checksum).
fn checkpoint_row(name: &'static str) -> Row {
    Row::new(
        name,
        move |dir| {
            let (run, step) = halted(dir);
            (step.join(name), resume(&run))
        },
        |_, out, path| refused_naming(out, &path.file_name().unwrap().to_string_lossy()),
    )
}

/// A fresh digits run into `dir/run`, with `file` planted in it.
fn fresh_run(file: &'static str, extra: &'static [&'static str]) -> impl Fn(&Path) -> (PathBuf, Vec<String>) {
    move |dir| (dir.join("run").join(file), train(&dir.join("run"), extra))
}

/// Whether `out` succeeded.
fn succeeded(out: &Output) -> Result<(), String> {
    out.status.success().then_some(()).ok_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

fn table() -> Vec<Row> {
    vec![
        Row::new(
            "recipe",
            |dir| {
                let recipe = dir.join("recipe.toml");
                (recipe.clone(), args(&["plan", "--recipe", &text(&recipe)]))
            },
            read_only,
        ),
        Row::new(
            "text corpus",
            |dir| {
                let corpus = dir.join("corpus.txt");
                let base = ["train", "--recipe", "recipes/shakespeare-char-qsr.toml", "--quiet"];
                let sets = ["--set", "data.dataset=text", "--set", &format!("data.path={}", text(&corpus))];
                (corpus.clone(), args(&[&base[..], &["--out", &text(&dir.join("run"))], &sets].concat()))
            },
            read_only,
        ),
        checkpoint_row("manifest.json"),
        checkpoint_row("state.json"),
        checkpoint_row("model.safetensors"),
        checkpoint_row("optim-rank0.safetensors"),
        Row::new(
            "LATEST",
            |dir| {
                let (run, _) = halted(dir);
                (run.join("ckpt/LATEST"), resume(&run))
            },
            |_, out, _| refused_naming(out, "LATEST"),
        ),
        Row::new("run summary", fresh_run("summary.json", &[]), written),
        Row::new("metrics file", fresh_run("metrics.jsonl", &[]), written),
        Row::new("run recipe", fresh_run("recipe.toml", &[]), written),
        // The lock is opened in place: a large file is still a lock, anything else is refused.
        Row::new("run lock", fresh_run("lock", &[]), |kind, out, path| match kind {
            Planted::Sparse3Gb => succeeded(out),
            _ => refused_or_failed_naming(out, path),
        }),
        // Left by a dead launcher: cleared before rank 0 starts (a directory there is an error).
        Row::new(
            "rendezvous port file",
            fresh_run(".rendezvous-port", &["--nproc", "2"]),
            |kind, out, path| match kind {
                Planted::Directory => refused_or_failed_naming(out, path),
                _ => succeeded(out),
            },
        ),
        Row::new(
            "rank log",
            |dir| {
                let logs = dir.join("logs");
                let a = ["launch", "--nproc", "1", "--log-dir", &text(&logs), "--", "echo", "hello"];
                (logs.join("rank-0.stdout.log"), args(&a))
            },
            written,
        ),
        Row::new(
            "plot",
            |dir| {
                let run = dir.join("run");
                run_ok(&train(&run, &[]));
                (run.join("loss.png"), args(&["plot", &text(&run)]))
            },
            written,
        ),
    ]
}

/// Whether `out` failed (refused or not) naming the file at `path`, without a panic.
fn refused_or_failed_naming(out: &Output, path: &Path) -> Result<(), String> {
    let err = String::from_utf8_lossy(&out.stderr);
    let name = path.file_name().unwrap().to_string_lossy();
    match !out.status.success() && err.contains(&*name) && !err.contains("panicked") {
        true => Ok(()),
        false => Err(format!("expected a failure naming {name}, got {:?}: {err}", out.status)),
    }
}

#[test]
fn every_file_qsr_reads_or_writes_refuses_or_replaces_what_is_not_a_regular_file() {
    let mut failures = Vec::new();
    for row in table() {
        for kind in PLANTED {
            let dir = tempfile::tempdir().unwrap();
            let (path, command) = (row.setup)(dir.path());
            let target = dir.path().join("target");
            std::fs::write(&target, KEPT).unwrap();
            plant(&path, kind, &target);
            let out = run(&command);
            if let Err(e) = (row.expect)(kind, &out, &path) {
                failures.push(format!("{} as {kind:?}: {e}", row.name));
            }
            if std::fs::read_to_string(&target).unwrap() != KEPT {
                failures.push(format!("{} as {kind:?}: the link's target was written", row.name));
            }
        }
    }
    assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
}
