//! The source tree's layering, read from the code as a newcomer reads it:
//! every `crate::` and `super::` path (and a parent's paths into its own
//! child modules) is an arrow from one file to another. Two rules
//! (docs/architecture.md):
//!
//! - Arrows between top-level modules point down: a module only names
//!   modules on a lower floor of [`FLOORS`]. Modules on one floor stand side
//!   by side and never name each other (the proxy, the lock service and the
//!   admin API share what they need through a floor below them).
//! - No loop among files: within a module too, a facade (`mod.rs`) may name
//!   its files, and its files name each other only one way.
//!
//! And one of size: no file above [`MAX_LINES`] but those in [`LONG_FILES`],
//! each with the reason it stays whole.
//!
//! Unit-test modules (`tests.rs`, `mod tests { .. }`) are left out: tests
//! may reach anywhere. Doc links count: a link is a reference a reader
//! follows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules by floor, lowest first. A new module goes on the
/// lowest floor whose modules it needs below it.
const FLOORS: &[&[&str]] = &[
    // Plain values and parsers; nothing of the crate below them.
    &[
        "token",
        "key",
        "id",
        "clock",
        "slot",
        "bearer",
        "proxy_protocol",
        "metrics",
        "tls",
        "h1",
        "ring",
    ],
    // What operators are shown of past requests: the last refusals and
    // raises (their tokens as text, from `token`).
    &["refusals", "raises"],
    // The validated configuration, as data.
    &["config"],
    // The store contract and its engines.
    &["store"],
    // Admission and ordering.
    &["fence"],
    // Errors as HTTP answers (problem+json, S3, gRPC).
    &["error"],
    // What the services share: routing (and `explain`), upstream exchanges.
    &["routing", "upstream"],
    // The services, side by side.
    &["proxy", "lease", "admin"],
    // Listeners, workers, reload, shutdown.
    &["workers"],
    &["server"],
];

const MAX_LINES: usize = 800;

/// Files allowed above [`MAX_LINES`] (paths as `src/x/y.rs`), with why.
const LONG_FILES: &[(&str, &str)] = &[(
    "src/config/tests.rs",
    "unit tests only: every rejected value of every setting, one table per setting, read with the helpers at its top",
)];

struct File {
    /// Module path, e.g. `["fence", "admit"]`; `[]` for lib.rs.
    module: Vec<String>,
    code: String,
}

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            source_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn module_of(src: &Path, path: &Path) -> Vec<String> {
    let rel = path
        .strip_prefix(src)
        .expect("under src/")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The file's text without its unit-test module (by convention the last
/// item, `#[cfg(test)] mod tests { .. }`).
fn without_tests(text: &str) -> &str {
    match text.find("\n#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    }
}

/// Inside an inline `mod NAME { .. }` (prost's oneof enums), `super::`
/// names the file's own module: rewritten to `self::`, which is no arrow.
fn inline_supers_to_self(code: &str) -> String {
    let mut out = code.to_string();
    let mut from = 0;
    while let Some(at) = out[from..].find("mod ").map(|i| from + i) {
        let line_end = out[at..].find('\n').map_or(out.len(), |e| at + e);
        let Some(open) = out[at..line_end].ends_with('{').then_some(line_end - 1) else {
            from = at + 4;
            continue;
        };
        let mut depth = 0usize;
        let mut close = out.len();
        for (i, c) in out[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let inner = out[open..close].replace("super::", "self::");
        out.replace_range(open..close, &inner);
        from = open + 1;
    }
    out
}

/// The binary's files (`src/main.rs` and its modules in `src/cli/`): the
/// top of the house, above every floor; only their size is checked.
fn binary(src: &Path, path: &Path) -> bool {
    path == src.join("main.rs") || path.starts_with(src.join("cli"))
}

/// `src/` and every `.rs` file under it.
fn sources() -> (PathBuf, Vec<PathBuf>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    source_files(&src, &mut paths);
    (src, paths)
}

/// Every source file, the binary's included, with its line count.
fn all_lines() -> Vec<(String, usize)> {
    let (src, paths) = sources();
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).expect("read a source file");
            let rel = p.strip_prefix(&src).expect("under src/").display();
            (format!("src/{rel}"), text.lines().count())
        })
        .collect()
}

/// The library's files, without their unit-test modules.
fn load() -> Vec<File> {
    let (src, paths) = sources();
    paths
        .iter()
        .filter(|p| !binary(&src, p))
        .map(|p| {
            let text = std::fs::read_to_string(p).expect("read a source file");
            File {
                module: module_of(&src, p),
                code: inline_supers_to_self(without_tests(&text)),
            }
        })
        .filter(|f| f.module.last().is_none_or(|m| m != "tests"))
        .collect()
}

/// `mod NAME;` declarations of a file (its child modules).
fn children(code: &str) -> BTreeSet<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("pub(crate) mod "))
                .or_else(|| l.strip_prefix("mod "))?;
            rest.strip_suffix(';').map(str::to_string)
        })
        .collect()
}

fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path that starts with one of `heads` followed by `::`, as the
/// list of its segments (a `{a, b::c}` group gives one path per member).
fn paths(code: &str, heads: &BTreeSet<String>) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let starts_word = i == 0 || !ident_char(bytes[i - 1] as char);
        let head = starts_word
            .then(|| {
                heads
                    .iter()
                    .find(|h| bytes[i..].starts_with(format!("{h}::").as_bytes()))
            })
            .flatten();
        let Some(head) = head else {
            i += 1;
            continue;
        };
        let mut segs = vec![head.clone()];
        let mut j = i + head.len() + 2;
        loop {
            let word: String = code[j..].chars().take_while(|c| ident_char(*c)).collect();
            if !word.is_empty() {
                j += word.len();
                segs.push(word);
                if code[j..].starts_with("::") {
                    j += 2;
                    continue;
                }
                out.push(segs);
            } else if code[j..].starts_with('{') {
                let end = code[j..].find('}').map_or(code.len(), |e| j + e);
                for member in code[j + 1..end].split(',') {
                    let mut p = segs.clone();
                    p.extend(
                        member
                            .trim()
                            .split("::")
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty() && s != "self" && s != "*"),
                    );
                    out.push(p);
                }
                j = end;
            } else {
                out.push(segs);
            }
            break;
        }
        i = j.max(i + 1);
    }
    out
}

/// File-to-file arrows: for each file's module, the modules it names.
fn arrows(files: &[File]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
    let resolve = |path: Vec<String>| -> Option<Vec<String>> {
        (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|p| modules.contains(p))
    };
    let mut out = BTreeMap::new();
    for f in files {
        let mut heads: BTreeSet<String> = children(&f.code);
        heads.insert("crate".into());
        heads.insert("super".into());
        let mut to = BTreeSet::new();
        for p in paths(&f.code, &heads) {
            let mut base: Vec<String> = match p[0].as_str() {
                "crate" => Vec::new(),
                "super" => f.module[..f.module.len().saturating_sub(1)].to_vec(),
                child => {
                    let mut b = f.module.clone();
                    b.push(child.to_string());
                    b
                }
            };
            let mut rest = &p[1..];
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            base.extend(rest.iter().cloned());
            if let Some(target) = resolve(base) {
                if target != f.module && !target.is_empty() {
                    to.insert(target);
                }
            }
        }
        out.insert(f.module.clone(), to);
    }
    out
}

fn floor(module: &str) -> Option<usize> {
    FLOORS.iter().position(|f| f.contains(&module))
}

fn name(m: &[String]) -> String {
    format!("src/{}", m.join("/"))
}

#[test]
fn every_module_has_a_floor() {
    let files = load();
    let unplaced: BTreeSet<String> = files
        .iter()
        .filter_map(|f| f.module.first())
        .filter(|m| floor(m).is_none())
        .cloned()
        .collect();
    assert!(
        unplaced.is_empty(),
        "modules with no floor in tests/layers.rs FLOORS (and docs/architecture.md): {unplaced:?}"
    );
}

#[test]
fn arrows_between_modules_point_down() {
    let files = load();
    let mut wrong = Vec::new();
    for (from, targets) in arrows(&files) {
        let Some(top) = from.first() else { continue };
        for to in targets {
            let other = &to[0];
            if other == top {
                continue;
            }
            match (floor(top), floor(other)) {
                (Some(a), Some(b)) if b < a => {}
                _ => wrong.push(format!("{} -> {}", name(&from), name(&to))),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "arrows that do not point down (see FLOORS):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_loop_among_files() {
    let files = load();
    let graph = arrows(&files);
    // Depth-first search; a grey node met again closes a loop.
    #[derive(Clone, Copy, PartialEq)]
    enum Seen {
        Grey,
        Black,
    }
    fn visit(
        at: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        seen: &mut BTreeMap<Vec<String>, Seen>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<String>> {
        seen.insert(at.clone(), Seen::Grey);
        stack.push(at.clone());
        for next in graph.get(at).into_iter().flatten() {
            match seen.get(next) {
                Some(Seen::Grey) => {
                    let from = stack.iter().position(|m| m == next).unwrap_or(0);
                    let mut lp: Vec<String> = stack[from..].iter().map(|m| name(m)).collect();
                    lp.push(name(next));
                    return Some(lp);
                }
                Some(Seen::Black) => {}
                None => {
                    if let Some(lp) = visit(next, graph, seen, stack) {
                        return Some(lp);
                    }
                }
            }
        }
        stack.pop();
        seen.insert(at.clone(), Seen::Black);
        None
    }
    let mut seen = BTreeMap::new();
    for m in graph.keys() {
        if !seen.contains_key(m) {
            if let Some(lp) = visit(m, &graph, &mut seen, &mut Vec::new()) {
                panic!("a loop among files: {}", lp.join(" -> "));
            }
        }
    }
}

#[test]
fn files_stay_short() {
    let long: Vec<String> = all_lines()
        .into_iter()
        .filter(|(n, lines)| *lines > MAX_LINES && !LONG_FILES.iter().any(|(l, _)| n == l))
        .map(|(n, lines)| format!("{n} ({lines} lines)"))
        .collect();
    assert!(
        long.is_empty(),
        "files above {MAX_LINES} lines (split them by concern, or list them in LONG_FILES with why): {long:?}"
    );
}

/// The checker itself: an upward arrow and a loop are seen.
#[test]
fn the_checker_sees_arrows_and_loops() {
    let file = |module: &[&str], code: &str| File {
        module: module.iter().map(|s| s.to_string()).collect(),
        code: code.to_string(),
    };
    let files = vec![
        file(
            &["store"],
            "mod api;\nuse api::{Advance, X};\n/// [`crate::fence::Fence`]\n",
        ),
        file(&["store", "api"], "use super::Y;\n"),
        file(&["fence"], "use crate::store::{self, api::Advance};\n"),
    ];
    let graph = arrows(&files);
    let of = |m: &[&str]| {
        graph[&m.iter().map(|s| s.to_string()).collect::<Vec<_>>()]
            .iter()
            .map(|t| t.join("/"))
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(
        of(&["store"]),
        BTreeSet::from(["store/api".into(), "fence".into()])
    );
    assert_eq!(of(&["store", "api"]), BTreeSet::from(["store".into()]));
    assert_eq!(
        of(&["fence"]),
        BTreeSet::from(["store".into(), "store/api".into()])
    );
    assert!(floor("fence") > floor("store"));
}
