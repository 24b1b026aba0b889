//! README.md's dependencies, built as a burn user builds them: a new project from the README's
//! `[dependencies]` block and the two programs its diff shows (`burn_plain.rs`, `burn_qsr.rs`).
//!
//! First the plain program with the block's lines other than the QSR ones (a burn project before qsr),
//! then the QSR program with the whole block, in the same project and target dir. The second build
//! must compile no burn crate again (every burn artifact of the first build is reused), and the QSR
//! program must run. The project lies beside a link to this repository, as the README's `path`s say.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::Totals;

/// What opens the block in README.md; the block ends at the next fence.
const BEGIN: &str = "<!-- snippet: Cargo.toml -->\n```toml\n";
/// The comment that marks a line QSR adds.
const QSR_LINE: &str = "# QSR";
const PROGRAMS: [&str; 2] = ["crates/qsr-optim/examples/burn_plain.rs", "crates/qsr-optim/examples/burn_qsr.rs"];

/// The README's `[dependencies]` block, as written.
pub(crate) fn block(root: &Path) -> Result<String> {
    let readme = std::fs::read_to_string(root.join("README.md")).context("cannot read README.md")?;
    let start = readme.find(BEGIN).map(|s| s + BEGIN.len());
    let block = start.and_then(|s| Some(&readme[s..s + readme[s..].find("```")?]));
    let block = block.with_context(|| format!("README.md has no block opened by `{}`", BEGIN.trim_end()))?;
    if !block.starts_with("[dependencies]\n") {
        bail!("README.md's dependencies block does not start with `[dependencies]`");
    }
    Ok(block.to_owned())
}

/// The lines of the block that QSR adds.
pub(crate) fn qsr_lines(block: &str) -> usize {
    block.lines().filter(|l| l.contains(QSR_LINE)).count()
}

/// Builds the plain project, then the QSR one, compares their burn artifacts and runs the QSR program.
pub(crate) fn run(root: &Path, target: &Path) -> Result<Totals> {
    let block = block(root)?;
    let dir = target.join("snippet");
    let app = dir.join("app");
    std::fs::create_dir_all(app.join("src")).with_context(|| format!("cannot create {}", app.display()))?;
    let link = dir.join("qsr");
    if std::fs::symlink_metadata(&link).is_ok() {
        std::fs::remove_file(&link).with_context(|| format!("cannot remove {}", link.display()))?;
    }
    std::os::unix::fs::symlink(root, &link).with_context(|| format!("cannot link {}", link.display()))?;
    let plain: String = block.lines().filter(|l| !l.contains(QSR_LINE)).map(|l| format!("{l}\n")).collect();
    let before = build(root, &app, &plain, PROGRAMS[0])?;
    let after = build(root, &app, &block, PROGRAMS[1])?;
    let rebuilt: Vec<&String> = before.iter().filter(|(k, v)| after.get(*k) != Some(v)).map(|(k, _)| k).collect();
    if before.is_empty() || !rebuilt.is_empty() {
        bail!("adding the README's QSR dependencies compiled these burn crates again: {rebuilt:?}");
    }
    println!("the README's dependencies add qsr to a built burn project without compiling burn again ... ok");
    let program = app.join("target/release/app");
    eprintln!("xtask: {}", program.display());
    let status = Command::new(&program).status().with_context(|| format!("cannot start {}", program.display()))?;
    if !status.success() {
        bail!("the README's QSR program failed: {status}");
    }
    println!("the README's QSR program, built from its dependencies block, runs ... ok");
    Ok(Totals { passed: 2, ..Totals::default() })
}

/// Builds `program` in the project `app` with `dependencies`; returns each burn crate's artifacts.
fn build(root: &Path, app: &Path, dependencies: &str, program: &str) -> Result<BTreeMap<String, Vec<String>>> {
    let manifest = format!(
        "[package]\nname = \"app\"\nversion = \"0.1.0\"\nedition = \"2024\"\npublish = false\n\n[workspace]\n\n{dependencies}"
    );
    std::fs::write(app.join("Cargo.toml"), manifest).context("cannot write the project's Cargo.toml")?;
    std::fs::copy(root.join(program), app.join("src/main.rs")).with_context(|| format!("cannot copy {program}"))?;
    // The workspace's lock: the versions the tests built. burn's default features name optional crates
    // (burn-train's terminal UI) that the workspace never resolved: cargo resolves them from the
    // registry's index as a user's build does, and builds none of them.
    std::fs::copy(root.join("Cargo.lock"), app.join("Cargo.lock")).context("cannot copy Cargo.lock")?;
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(app).env_remove("CARGO_TARGET_DIR").env_remove("RUSTFLAGS");
    c.args(["build", "--release", "--message-format=json-render-diagnostics"]);
    eprintln!("xtask: {c:?} ({program})");
    let started = std::time::Instant::now();
    let out = c.stderr(std::process::Stdio::inherit()).output().with_context(|| format!("cannot start {c:?}"))?;
    if !out.status.success() {
        bail!("building {program} with the README's dependencies failed: {}", out.status);
    }
    eprintln!("xtask: built {program} in {:.0?}", started.elapsed());
    let mut artifacts = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        if message["reason"] == "compiler-artifact" && name.starts_with("burn") {
            let files = message["filenames"].as_array().into_iter().flatten().filter_map(|f| f.as_str());
            artifacts.insert(name.to_owned(), files.map(str::to_owned).collect());
        }
    }
    Ok(artifacts)
}
