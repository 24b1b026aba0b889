//! `cargo xtask cuda`: the CUDA + NCCL build of `qsr` on a machine that cannot download LLVM.
//!
//! burn 0.22.1's CUDA runtime (cubecl-cuda 0.11.3) links cubecl's LLVM->PTX compiler, whose build
//! script downloads an LLVM bundle. qsr compiles its kernels with NVRTC instead (cubecl's
//! `cuda-cpp`, enabled by qsr-kernels' `cuda` feature), so the LLVM code is linked but never called.
//! This command:
//! 1. sets `DOCS_RS=1`, which the build scripts of tracel-llvm-bundler and cubecl-llvm honour by
//!    skipping the LLVM set-up, and `CUDARC_CUDA_VERSION` (default 13000; cudarc loads libcuda at
//!    run time, so no toolkit is needed to compile);
//! 2. with `--check`, only type-checks (what CI runs; nothing is linked);
//! 3. otherwise links the `qsr` binary, collecting the symbols the skipped LLVM set-up left
//!    undefined from the linker's errors into a static archive of functions that abort, and links
//!    again with it. Those stubs are unreachable with NVRTC; if one ever ran, it would abort loudly;
//! 4. with `--package`, also links `qsr-plain` (feature `cuda-plain`: burn's CUDA backend without
//!    fusion and autotune) so that scripts/gpu-check.sh can attribute what those two give.
//!
//! Where LLVM can be downloaded, plain `cargo build --release --features cuda,nccl -p qsr-train`
//! builds the same binary without any of this.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

#[derive(Debug, clap::Args)]
pub(crate) struct CudaArgs {
    /// Type-check the CUDA and NCCL code only (no link).
    #[arg(long)]
    check: bool,
    /// Where to put the linked binary (and, with --package, the device-check bundle).
    #[arg(long, default_value = "dist/gpu")]
    out: PathBuf,
    /// Also write qsr.xz, qsr-plain.xz (burn's CUDA backend without fusion and autotune, the "before"
    /// build of the step comparison) and the Fashion-MNIST files scripts/gpu-check.sh needs into --out.
    #[arg(long)]
    package: bool,
}

impl CudaArgs {
    pub(crate) fn check_only() -> Self {
        CudaArgs { check: true, out: PathBuf::from("dist/gpu"), package: false }
    }
}

const FEATURES: &str = "cuda,nccl";
/// The "before" build gpu-check times beside `FEATURES`' (docs/architecture/build.md).
const PLAIN_FEATURES: &str = "cuda-plain";

fn cuda_env(c: &mut Command) {
    c.env("DOCS_RS", "1");
    if std::env::var_os("CUDARC_CUDA_VERSION").is_none() {
        c.env("CUDARC_CUDA_VERSION", "13000");
    }
}

pub(crate) fn run(args: &CudaArgs, root: &Path, target: &Path) -> Result<()> {
    if args.check {
        let mut c = crate::cargo();
        cuda_env(&mut c);
        c.args(["check", "--release", "--locked", "-p", "qsr-train", "--features", FEATURES, "--all-targets"]);
        return crate::run(c);
    }
    let out_dir = root.join(&args.out);
    std::fs::create_dir_all(&out_dir)?;
    let dest = out_dir.join("qsr");
    link(FEATURES, target, &dest)?;
    if args.package {
        let plain = out_dir.join("qsr-plain");
        link(PLAIN_FEATURES, target, &plain)?;
        package(&out_dir, &[&dest, &plain])?;
    }
    Ok(())
}

/// Links `qsr` with `features` (stubbing the LLVM symbols the skipped set-up left undefined) and
/// writes it, stripped, to `dest`.
fn link(features: &str, target: &Path, dest: &Path) -> Result<()> {
    let stub_dir = target.join("qsr-cuda-stub");
    std::fs::create_dir_all(&stub_dir)?;
    let symbols_file = stub_dir.join("symbols.txt");
    let mut symbols: BTreeSet<String> = std::fs::read_to_string(&symbols_file)
        .map(|s| s.lines().map(str::to_string).filter(|l| !l.is_empty()).collect())
        .unwrap_or_default();
    const ATTEMPTS: usize = 10;
    for attempt in 0..ATTEMPTS {
        let archive = if symbols.is_empty() { None } else { Some(write_stub_archive(&stub_dir, &symbols)?) };
        let mut c = crate::cargo();
        cuda_env(&mut c);
        c.args(["rustc", "--release", "--locked", "-p", "qsr-train", "--bin", "qsr", "--features", features]);
        if let Some(a) = &archive {
            c.arg("--").arg(format!("-Clink-arg={}", a.display()));
        }
        eprintln!("xtask cuda: {features}: link attempt {} with {} stubbed symbols", attempt + 1, symbols.len());
        let out = c.output().with_context(|| format!("cannot start {c:?}"))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            return install(&target.join("release/qsr"), dest, symbols.len());
        }
        // The linker lists only some unresolved references per run (rustc elides long output):
        // take every LLVM symbol the LLVM crates' objects leave undefined as well.
        let mut missing = undefined_symbols(&stderr);
        missing.extend(llvm_symbols_in_rlibs(&target.join("release/deps")));
        let new: Vec<_> = missing.into_iter().filter(|s| !symbols.contains(s)).collect();
        if new.is_empty() {
            eprint!("{stderr}");
            bail!("the CUDA build failed for a reason other than unresolved LLVM symbols (output above)");
        }
        if let Some(bad) = new.iter().find(|s| !is_llvm_symbol(s)) {
            eprint!("{stderr}");
            bail!(
                "unresolved symbol `{bad}` is not part of the LLVM C API or cubecl's LLVM shims: refusing to stub it"
            );
        }
        symbols.extend(new);
        std::fs::write(&symbols_file, symbols.iter().map(|s| format!("{s}\n")).collect::<String>())?;
    }
    bail!("the CUDA build ({features}) still had unresolved symbols after {ATTEMPTS} link attempts")
}

/// Copies the linked binary to `dest` and strips it.
fn install(bin: &Path, dest: &Path, stubbed: usize) -> Result<()> {
    std::fs::copy(bin, dest).with_context(|| format!("cannot copy {} to {}", bin.display(), dest.display()))?;
    crate::run({
        let mut s = Command::new("strip");
        s.arg(dest);
        s
    })?;
    eprintln!("xtask cuda: {} ({stubbed} stubbed LLVM symbols)", dest.display());
    Ok(())
}

/// Names from GNU ld's / lld's "undefined reference to `sym'" / "undefined symbol: sym" lines.
pub(crate) fn undefined_symbols(linker_output: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in linker_output.lines() {
        if let Some(i) = line.find("undefined reference to `") {
            let rest = &line[i + "undefined reference to `".len()..];
            if let Some(end) = rest.find('\'') {
                out.insert(rest[..end].to_string());
            }
        } else if let Some(i) = line.find("undefined symbol: ") {
            out.insert(line[i + "undefined symbol: ".len()..].trim().to_string());
        }
    }
    out
}

/// LLVM symbols left undefined by the objects of the crates that wrap LLVM (`nm -u` on their rlibs).
fn llvm_symbols_in_rlibs(deps: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(deps) else { return out };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let wraps_llvm = ["libcubecl_llvm-", "libpliron_llvm-", "libllvm_sys-"].iter().any(|p| name.starts_with(p));
        if !wraps_llvm || !name.ends_with(".rlib") {
            continue;
        }
        // nm complains about the rlib's metadata member; the object members are what we read.
        if let Ok(o) = Command::new("nm").arg("-u").arg(e.path()).output() {
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                if let Some(sym) = line.split_whitespace().last()
                    && is_llvm_symbol(sym)
                {
                    out.insert(sym.to_string());
                }
            }
        }
    }
    out
}

/// Only the LLVM C API and cubecl's C++ shims around it may be stubbed; anything else unresolved is
/// a real build problem.
pub(crate) fn is_llvm_symbol(s: &str) -> bool {
    (s.starts_with("LLVM") || s.starts_with("cubecl_") || s.starts_with("lld"))
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A C file defining each symbol as a function that aborts, compiled into a static archive.
fn write_stub_archive(dir: &Path, symbols: &BTreeSet<String>) -> Result<PathBuf> {
    let mut src = String::from(
        "/* Generated by `cargo xtask cuda`: LLVM entry points qsr's NVRTC build never calls. */\n#include <stdio.h>\n#include <stdlib.h>\n",
    );
    for s in symbols {
        src.push_str(&format!(
            "void {s}(void) {{ fputs(\"qsr: LLVM function {s} called in a build without LLVM (cargo xtask cuda)\\n\", stderr); abort(); }}\n"
        ));
    }
    let c = dir.join("llvm_stub.c");
    let o = dir.join("llvm_stub.o");
    let a = dir.join("libqsr_llvm_stub.a");
    std::fs::write(&c, src)?;
    let mut cc = Command::new("cc");
    cc.args(["-c", "-O1", "-fPIC", "-o"]).arg(&o).arg(&c);
    crate::run(cc)?;
    let _ = std::fs::remove_file(&a);
    let mut ar = Command::new("ar");
    ar.arg("rcs").arg(&a).arg(&o);
    crate::run(ar)?;
    Ok(a)
}

/// Each binary as `<name>.xz`, plus the Fashion-MNIST IDX files (from Debian's dataset-fashion-mnist)
/// for the device check.
fn package(out_dir: &Path, bins: &[&Path]) -> Result<()> {
    for bin in bins {
        let mut xz = Command::new("xz");
        xz.args(["-6", "-T2", "-k", "-f"]).arg(bin);
        crate::run(xz)?;
    }
    let data = Path::new("/usr/share/datasets/fashion-mnist");
    let dest = out_dir.join("fashion-mnist");
    std::fs::create_dir_all(&dest)?;
    for f in [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ] {
        std::fs::copy(data.join(f), dest.join(f)).with_context(|| {
            format!("cannot copy {} (apt-get install dataset-fashion-mnist)", data.join(f).display())
        })?;
    }
    for bin in bins {
        let _ = std::fs::remove_file(bin);
    }
    eprintln!(
        "xtask cuda: packaged {} (qsr.xz, qsr-plain.xz, fashion-mnist/) for scripts/gpu-check.sh",
        out_dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_gnu_ld_and_lld_undefined_symbols() {
        let out = "note: /usr/bin/ld: foo.o: in function `x':\n\
                   foo.rs:(.text+0x1): undefined reference to `LLVMContextCreate'\n\
                   ld.lld: error: undefined symbol: cubecl_llvm_shim_write_bitcode\n\
                   /usr/bin/ld: bar.o: undefined reference to `LLVMContextCreate'\n";
        let got: Vec<_> = undefined_symbols(out).into_iter().collect();
        assert_eq!(got, ["LLVMContextCreate", "cubecl_llvm_shim_write_bitcode"]);
    }

    #[test]
    fn only_llvm_symbols_may_be_stubbed() {
        assert!(is_llvm_symbol("LLVMBuildAdd"));
        assert!(is_llvm_symbol("cubecl_set_llvm_options"));
        assert!(!is_llvm_symbol("cuInit"));
        assert!(!is_llvm_symbol("ncclAllReduce"));
        assert!(!is_llvm_symbol("LLVM-evil; rm"));
    }
}
