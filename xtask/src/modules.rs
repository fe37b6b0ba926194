//! The eBPF crate's module dependencies, read from its sources: which module names which
//! (`crate::m` paths and the top-level items of `use crate::{..}` groups, comments included,
//! as a reader sees them). `lint` refuses a cycle: stages call each other only through the
//! pipeline, and the maps depend on types alone.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{Context as _, Result};

/// Module → the modules it names. The crate root (`main.rs`, `lib.rs`) declares every module
/// and is left out.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The graph of the modules in `src` (one file each).
pub fn graph(src: &Path) -> Result<Graph> {
    let mut texts = BTreeMap::new();
    for entry in fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_some_and(|e| e == "rs") && name != "main" && name != "lib" {
            let text =
                fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            texts.insert(name.to_string(), text);
        }
    }
    Ok(graph_of(&texts))
}

/// The graph of modules given by name and source text.
fn graph_of(texts: &BTreeMap<String, String>) -> Graph {
    let modules: BTreeSet<&String> = texts.keys().collect();
    texts
        .iter()
        .map(|(m, text)| {
            let deps = named(text)
                .into_iter()
                .filter(|d| d != m && modules.contains(d))
                .collect();
            (m.clone(), deps)
        })
        .collect()
}

/// The first path segment after every `crate::` in `text`, and the first segment of each
/// top-level item of a `crate::{..}` group.
fn named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item = String::new();
            let mut start_of_item = true;
            for c in group.chars() {
                if start_of_item && (c.is_ascii_alphanumeric() || c == '_') {
                    item.push(c);
                    continue;
                }
                if !item.is_empty() {
                    out.insert(std::mem::take(&mut item));
                    start_of_item = false;
                }
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start_of_item = true,
                    _ => {}
                }
            }
            if !item.is_empty() {
                out.insert(item);
            }
        } else {
            let ident: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !ident.is_empty() {
                out.insert(ident);
            }
        }
    }
    out
}

/// The modules that reach themselves through their dependencies.
pub fn in_cycles(g: &Graph) -> Vec<String> {
    g.keys()
        .filter(|&m| {
            let mut seen = BTreeSet::new();
            let mut todo: Vec<&String> = g[m].iter().collect();
            while let Some(d) = todo.pop() {
                if d == m {
                    return true;
                }
                if seen.insert(d) {
                    todo.extend(g.get(d).into_iter().flatten());
                }
            }
            false
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph_from(files: &[(&str, &str)]) -> Graph {
        graph_of(
            &files
                .iter()
                .map(|(m, text)| (m.to_string(), text.to_string()))
                .collect(),
        )
    }

    #[test]
    fn nested_use_groups_and_paths_are_read() {
        let t = "use crate::{\n    ctx::{A, b::C},\n    maps::{FP_X, FP_Y},\n    parse::{self, P},\n    route, settings,\n};\nfn f() { crate::stats::count(); }";
        let got: Vec<String> = named(t).into_iter().collect();
        assert_eq!(
            got,
            ["ctx", "maps", "parse", "route", "settings", "stats"],
            "top-level items of the group and the path after crate::"
        );
    }

    #[test]
    fn a_cycle_through_a_third_module_is_found() {
        let g = graph_from(&[
            ("a", "use crate::b::X;"),
            ("b", "use crate::{c::Y};"),
            ("c", "// see crate::a::f"),
            ("d", "use crate::a;"),
        ]);
        assert_eq!(
            in_cycles(&g),
            ["a", "b", "c"],
            "d only depends on the cycle"
        );
        let acyclic = graph_from(&[("a", "use crate::b;"), ("b", "")]);
        assert!(in_cycles(&acyclic).is_empty(), "no cycle in a → b");
    }
}
