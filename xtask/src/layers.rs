//! The layering check of `cargo xtask ci`'s tidy step: the source files of every crate can be drawn
//! as layers, none using another that uses it back, directly or around a circle.
//!
//! A file's module path comes from its place under `src/` (`lib.rs`, `main.rs` and `mod.rs` name
//! their folder). A `crate::a::b::Name` or `super::x` path (read as text, `use` groups expanded), or
//! `child::Name` for a `mod child;` the file declares, is an edge to the deepest module it names; the
//! crate root and `#[cfg(test)]` code are left out. A circle made only of a module and its own
//! descendants (a parent using its child files, the children using `super::`) is the usual Rust
//! layering; any other circle fails, one through a parent and a file outside it too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// A module path inside a crate: `["tcp", "engine"]` for `src/tcp/engine.rs`.
type Module = Vec<String>;

/// Fails naming every cycle between the modules of the crates under `roots` (each a crate folder).
pub(crate) fn check(roots: &[PathBuf]) -> Result<()> {
    let mut cycles = Vec::new();
    for root in roots {
        let src = root.join("src");
        if !src.is_dir() {
            continue;
        }
        let name = root.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        for cycle in crate_cycles(&src)? {
            cycles.push(format!("{name}: {}", cycle.join(" <-> ")));
        }
    }
    if !cycles.is_empty() {
        bail!(
            "modules use each other around a circle (move what they share into a module below both):\n  {}",
            cycles.join("\n  ")
        );
    }
    Ok(())
}

/// The cycles of one crate's modules, each as sorted module names.
fn crate_cycles(src: &Path) -> Result<Vec<Vec<String>>> {
    let mut files = BTreeMap::new();
    collect(src, src, &mut files)?;
    let modules: BTreeSet<Module> = files.keys().cloned().collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (m, path) in &files {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let children = declared_children(&text).into_iter().map(|c| [m.clone(), vec![c]].concat());
        let targets = references(&text)
            .into_iter()
            .filter_map(|(sup, segs)| target(m, sup, &segs, &modules))
            .chain(children.filter(|c| modules.contains(c)))
            .filter(|t| !t.is_empty() && t != m);
        edges.entry(m.clone()).or_default().extend(targets);
    }
    // Circles without a parent's edges to its own files (siblings using each other, even under one
    // parent), and circles with them that leave the parent's subtree.
    let own_files: BTreeMap<Module, BTreeSet<Module>> =
        edges.iter().map(|(m, ts)| (m.clone(), ts.iter().filter(|t| !t.starts_with(m)).cloned().collect())).collect();
    let siblings = strongly_connected(&own_files).into_iter().filter(|c| c.len() > 1);
    let through_parent = strongly_connected(&edges).into_iter().filter(|c| c.len() > 1 && !within_one_subtree(c));
    let found: BTreeSet<Vec<Module>> = siblings.chain(through_parent).collect();
    Ok(found.into_iter().map(|c| c.into_iter().map(|m| display(&m)).collect()).collect())
}

/// Whether every module of `circle` lies in the subtree of one of them: a parent and its own files.
fn within_one_subtree(circle: &[Module]) -> bool {
    circle.iter().any(|root| circle.iter().all(|m| m.starts_with(root)))
}

/// The child modules a file declares (`mod child;`) and names in its code (`child::Name`).
fn declared_children(text: &str) -> Vec<String> {
    let code = text.find("#[cfg(test)]").map_or(text, |i| &text[..i]);
    code.lines()
        .filter_map(|line| {
            let decl = line.trim_start();
            // Any visibility: `pub`, `pub(crate)`, `pub(super)`, `pub(in path)`.
            let decl = match decl.strip_prefix("pub") {
                Some(rest) if rest.starts_with('(') => rest.split_once(')').map_or(rest, |(_, r)| r).trim_start(),
                Some(rest) => rest.trim_start(),
                None => decl,
            };
            let name = decl.strip_prefix("mod ")?.strip_suffix(';')?.trim();
            name.chars().all(|c| c.is_alphanumeric() || c == '_').then(|| name.to_string())
        })
        .filter(|name| names_path(code, name))
        .collect()
}

/// Whether `code` has a path starting with `name::` (not as the tail of a longer path or identifier).
fn names_path(code: &str, name: &str) -> bool {
    let pat = format!("{name}::");
    code.match_indices(&pat).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
    })
}

fn display(m: &Module) -> String {
    if m.is_empty() { "lib".into() } else { m.join("::") }
}

/// Every `.rs` file under `dir`, by module path.
fn collect(src: &Path, dir: &Path, out: &mut BTreeMap<Module, PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect(src, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src)?.with_extension("");
            let mut m: Module = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if m.last().is_some_and(|l| matches!(l.as_str(), "lib" | "main" | "mod")) {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    Ok(())
}

/// The `crate::` and `super::` paths of a file's code before its tests: (whether it is `super`, the
/// segments after it).
fn references(text: &str) -> Vec<(bool, Vec<String>)> {
    let code = text.find("#[cfg(test)]").map_or(text, |i| &text[..i]);
    let mut out = Vec::new();
    for (kw, sup) in [("crate::", false), ("super::", true)] {
        let mut rest = code;
        while let Some(i) = rest.find(kw) {
            let before = rest[..i].chars().next_back();
            rest = &rest[i + kw.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                let inner = &group[..group.find('}').unwrap_or(group.len())];
                out.extend(inner.split(',').map(|p| (sup, segments(p.trim()))));
            } else {
                out.push((sup, segments(rest)));
            }
        }
    }
    out
}

/// The identifier segments at the start of a path: `a::b::Name` from `a::b::Name::new(..)`.
fn segments(path: &str) -> Vec<String> {
    let mut segs = Vec::new();
    for seg in path.split("::") {
        let ident: String = seg.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if ident.is_empty() {
            break;
        }
        let whole = ident.len() == seg.len();
        segs.push(ident);
        if !whole {
            break;
        }
    }
    segs
}

/// The deepest module a path names, from module `m`.
fn target(m: &Module, sup: bool, segs: &[String], modules: &BTreeSet<Module>) -> Option<Module> {
    let base: Module = if sup { m[..m.len().saturating_sub(1)].to_vec() } else { Vec::new() };
    // `super::Item` names the parent itself.
    let least = usize::from(!sup);
    (least..=segs.len()).rev().map(|i| [base.clone(), segs[..i].to_vec()].concat()).find(|c| modules.contains(c))
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct T<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<Module, usize>,
        low: BTreeMap<Module, usize>,
        stack: Vec<Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit(t: &mut T<'_>, v: &Module) {
        let i = t.index.len();
        t.index.insert(v.clone(), i);
        t.low.insert(v.clone(), i);
        t.stack.push(v.clone());
        for w in t.edges.get(v).into_iter().flatten() {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                t.low.entry(v.clone()).and_modify(|l| *l = (*l).min(lw));
            } else if t.stack.contains(w) {
                let iw = t.index[w];
                t.low.entry(v.clone()).and_modify(|l| *l = (*l).min(iw));
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                let done = &w == v;
                comp.push(w);
                if done {
                    break;
                }
            }
            comp.sort();
            t.out.push(comp);
        }
    }
    let mut t = T { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate's `src/` with `files` (path, text), in a fresh folder.
    fn tree(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("xtask-layers-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join("src").join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    #[test]
    fn siblings_using_each_other_are_a_cycle_and_a_parent_using_its_children_is_not() {
        let sibs = tree(
            "sibs",
            &[
                ("lib.rs", "mod a; mod b; mod c;"),
                ("a.rs", "use crate::b::X;"),
                ("b.rs", "use crate::{c::Y, d};"),
                ("c.rs", "fn f() { crate::a::g(); }"),
            ],
        );
        let err = check(std::slice::from_ref(&sibs)).unwrap_err().to_string();
        assert!(err.contains("a <-> b <-> c"), "{err}");
        let parent = tree(
            "parent",
            &[
                ("lib.rs", "mod p; use crate::p::Q;"),
                ("p/mod.rs", "mod q; use crate::p::q::Z;"),
                ("p/q.rs", "use super::W; #[cfg(test)] mod t { use crate::x::Y; }"),
            ],
        );
        check(std::slice::from_ref(&parent)).unwrap();
        for root in [sibs, parent] {
            let _ = std::fs::remove_dir_all(root);
        }
    }

    #[test]
    fn a_circle_through_a_parent_and_a_file_outside_it_fails() {
        // qsr-comm's old circle: hier -> tcp (a parent) -> tcp::doubling (its child) -> hier; the
        // same parent and child using each other alone are allowed.
        let crate_with = |name: &str, doubling: &str| {
            tree(
                name,
                &[
                    ("lib.rs", "mod hier; mod tcp;"),
                    ("hier.rs", "use crate::tcp::Ring;"),
                    ("tcp/mod.rs", "mod doubling;\npub struct Ring;\nfn f() { doubling::halve(); }"),
                    ("tcp/doubling.rs", doubling),
                ],
            )
        };
        let through = crate_with("through", "use crate::hier::status_word;");
        let err = check(std::slice::from_ref(&through)).unwrap_err().to_string();
        assert!(err.contains("hier <-> tcp <-> tcp::doubling"), "{err}");
        let own = crate_with("own", "use super::Ring;");
        check(std::slice::from_ref(&own)).unwrap();
        // Two files of one parent using each other stay a circle when the parent joins it.
        let siblings = tree(
            "siblings-under-parent",
            &[
                ("lib.rs", "mod m;"),
                ("m/mod.rs", "pub(super) mod a;\nmod b;\npub struct P;\nfn f() { a::x(); b::y(); }"),
                ("m/a.rs", "use super::b::Y; use super::P;"),
                ("m/b.rs", "use super::a::X;"),
            ],
        );
        let err = check(std::slice::from_ref(&siblings)).unwrap_err().to_string();
        assert!(err.contains("m::a <-> m::b"), "{err}");
        for root in [through, own, siblings] {
            let _ = std::fs::remove_dir_all(root);
        }
    }

    #[test]
    fn this_workspace_is_layered() {
        // The run-time root: a shared target dir may hand this checkout another's fresh-looking binary.
        let root = crate::root();
        let mut crates: Vec<PathBuf> =
            std::fs::read_dir(root.join("crates")).unwrap().map(|e| e.unwrap().path()).collect();
        crates.extend([root.join("xtask"), root.join("benches")]);
        check(&crates).unwrap();
    }

    #[test]
    fn paths_name_the_deepest_module() {
        let refs = references("use crate::{tcp::engine::Plan, wire};\nlet x = super::inner::f();\nmy_crate::no");
        let segs: Vec<Vec<String>> = refs.into_iter().map(|(_, s)| s).collect();
        assert_eq!(segs, [vec!["tcp", "engine", "Plan"], vec!["wire"], vec!["inner", "f"]]);
    }
}
