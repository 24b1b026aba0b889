//! The tidy rule that every Rust source file says what it is for: its first line is a `//!` comment.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// Fails naming every `.rs` file under `dirs` (recursively, `target` directories skipped) whose first
/// line is not a `//!` module comment.
pub(crate) fn check(dirs: &[PathBuf]) -> Result<()> {
    let mut missing = Vec::new();
    for dir in dirs {
        visit(dir, &mut missing)?;
    }
    if !missing.is_empty() {
        missing.sort();
        let list: Vec<String> = missing.iter().map(|p| format!("  {}", p.display())).collect();
        bail!("these source files do not start with a `//!` comment saying what they are for:\n{}", list.join("\n"));
    }
    Ok(())
}

fn visit(dir: &Path, missing: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                visit(&path, missing)?;
            }
        } else if path.extension().is_some_and(|e| e == "rs") && !starts_with_module_doc(&path)? {
            missing.push(path);
        }
    }
    Ok(())
}

fn starts_with_module_doc(path: &Path) -> Result<bool> {
    let text = std::fs::read_to_string(path)?;
    Ok(text.lines().next().is_some_and(|l| l.starts_with("//!")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_a_module_comment_is_named() {
        let dir = std::env::temp_dir().join(format!("file-docs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(dir.join("src/good.rs"), "//! Says what it is.\nfn f() {}\n").unwrap();
        assert!(check(std::slice::from_ref(&dir)).is_ok());
        std::fs::write(dir.join("src/bad.rs"), "use std::fmt;\n").unwrap();
        let e = check(std::slice::from_ref(&dir)).unwrap_err().to_string();
        assert!(e.contains("bad.rs") && !e.contains("good.rs"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
