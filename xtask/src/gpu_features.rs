//! Tidy check: every GPU build has burn's fusion and autotune (docs/architecture/build.md).
//!
//! The workspace takes burn with `default-features = false`, which also drops burn-cubecl's default
//! `fusion` and `autotune`; qsr's `cuda` / `wgpu` features name them again. This resolves each GPU
//! build's features and fails if burn-cubecl lacks either, so no later manifest change drops them
//! silently. The `-plain` features (gpu-check's "before" build) are left out on purpose.

use anyhow::{Context, Result, bail};

use crate::cargo;

/// The GPU builds users get: (package, features).
const GPU_BUILDS: [(&str, &str); 5] = [
    ("qsr-train", "cuda"),
    ("qsr-train", "cuda,nccl"),
    ("qsr-train", "wgpu"),
    ("qsr-optim", "cuda"),
    ("qsr-optim", "wgpu"),
];

/// burn-cubecl features each GPU build must have.
const REQUIRED: [&str; 2] = ["fusion", "autotune"];

pub(crate) fn check() -> Result<()> {
    for (package, features) in GPU_BUILDS {
        let have = burn_cubecl_features(package, features)?;
        let missing: Vec<&str> = REQUIRED.into_iter().filter(|f| !have.iter().any(|h| h == f)).collect();
        if !missing.is_empty() {
            bail!(
                "`-p {package} --features {features}` builds burn-cubecl without {missing:?} (it has {have:?}): \
                 name burn/fusion and burn/autotune in that feature (docs/architecture/build.md)"
            );
        }
    }
    eprintln!("xtask: every GPU build has burn-cubecl's {REQUIRED:?}");
    Ok(())
}

/// burn-cubecl's resolved features in `-p package --features features`.
fn burn_cubecl_features(package: &str, features: &str) -> Result<Vec<String>> {
    let mut c = cargo();
    c.args(["tree", "--locked", "-e", "features", "-i", "burn-cubecl", "--prefix", "none", "-p", package]);
    c.args(["--features", features]);
    let out = c.output().with_context(|| format!("cannot start {c:?}"))?;
    if !out.status.success() {
        bail!("{c:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(features_of("burn-cubecl", &String::from_utf8_lossy(&out.stdout)))
}

/// The features `cargo tree -e features --prefix none` lists for `krate` (`krate feature "name"`).
fn features_of(krate: &str, tree: &str) -> Vec<String> {
    let prefix = format!("{krate} feature \"");
    let mut found: Vec<String> =
        tree.lines().filter_map(|l| l.strip_prefix(&prefix)?.split('"').next().map(str::to_owned)).collect();
    found.sort();
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_read_from_cargo_trees_lines() {
        let tree = "burn-cubecl v0.22.1\nburn-cubecl feature \"fusion\"\nburn-dispatch feature \"autotune\"\n\
                    burn-cubecl feature \"std\" (*)\nburn-cubecl feature \"fusion\" (*)\n";
        assert_eq!(features_of("burn-cubecl", tree), ["fusion", "std"]);
    }
}
