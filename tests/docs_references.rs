//! The repository stands on its own: code comments and documentation cite pages in docs/,
//! never files outside the repository (a design document or a numbered spec page such as
//! `02-concepts.md`), and every docs/ page they cite exists.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};

const ROOTS: &[&str] = &[
    "src",
    "proto",
    "docs",
    "sdk",
    "tests",
    "bench",
    "scripts",
    ".ci",
    "README.md",
    "Cargo.toml",
    "clippy.toml",
];

/// Names of documents that live outside this repository.
const OUTSIDE: &[&str] = &[
    "DESIGN.md",
    "../shared",
    "/work/shared",
    "shared/spec",
    "spec/",
];

/// The numbered pages of the outside spec, cited as `22-components` or `02-concepts.md`.
const SPEC_PAGES: &[&str] = &[
    "concepts",
    "components",
    "iam",
    "configuration",
    "cli",
    "security",
    "python-sdk",
    "monitoring",
    "network",
    "e2b",
    "images",
    "operations",
    "deployment",
    "install",
    "cluster",
    "caller-guide",
    "troubleshooting",
    "versioning",
    "slo",
    "faq",
    "compare",
    "get-started",
];

fn files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for e in entries {
            let name = e.file_name().unwrap().to_string_lossy().to_string();
            // Generated stubs and build or environment output are not ours to word.
            if name == "_pb"
                || name.starts_with('.')
                || name == "__pycache__"
                || name == "target"
                // Virtual environments and build output of the SDK, never committed.
                || name == "build"
                || name == "site-packages"
            {
                continue;
            }
            files(&e, out);
        }
    } else if matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("rs" | "md" | "py" | "sh" | "toml" | "txt" | "proto")
    ) || p.ends_with(".ci/run")
    {
        out.push(p.to_path_buf());
    }
}

/// The outside citations in `text`, as (line number, what was cited).
fn outside_citations(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for o in OUTSIDE {
            if line.contains(o) {
                found.push((n + 1, o.to_string()));
            }
        }
        let b = line.as_bytes();
        for (i, w) in b.windows(3).enumerate() {
            let starts_word = i == 0 || !b[i - 1].is_ascii_alphanumeric();
            if !(starts_word && w[0].is_ascii_digit() && w[1].is_ascii_digit() && w[2] == b'-') {
                continue;
            }
            let rest = &line[i + 3..];
            for page in SPEC_PAGES {
                let Some(after) = rest.strip_prefix(page) else {
                    continue;
                };
                let whole_word = !after
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
                if whole_word {
                    found.push((n + 1, line[i..i + 3 + page.len()].to_string()));
                }
            }
        }
    }
    found
}

/// The `docs/<page>.md` names cited in `text`.
fn docs_citations(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("docs/") {
        let tail = &rest[at + 5..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_' || *c == '.')
            .collect();
        if let Some(page) = name.strip_suffix(".md").or_else(|| {
            name.find(".md")
                .map(|i| &name[..i])
                .filter(|p| !p.is_empty())
        }) {
            out.push(format!("docs/{page}.md"));
        }
        rest = &tail[name.len().min(tail.len())..];
        if name.is_empty() {
            rest = tail;
        }
    }
    out
}

#[test]
fn the_checker_catches_outside_citations() {
    assert_eq!(outside_citations("see 02-concepts §9").len(), 1);
    assert_eq!(outside_citations("(22-components \"Startup\")").len(), 1);
    assert_eq!(outside_citations("in 15-configuration.md").len(), 1);
    assert_eq!(outside_citations("DESIGN.md §7.9").len(), 1);
    assert_eq!(outside_citations("../shared/spec/10-cli.md").len(), 4);
    assert!(outside_citations("x86_64-unknown-linux-gnu, 2026-12-01, docs/cli.md").is_empty());
    assert_eq!(
        docs_citations("see docs/cli.md and (docs/concepts.md)."),
        vec!["docs/cli.md", "docs/concepts.md"]
    );
}

#[test]
fn comments_and_docs_cite_only_pages_of_this_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    for r in ROOTS {
        files(&root.join(r), &mut all);
    }
    assert!(all.len() > 50, "found only {} files", all.len());
    let me = root.join("tests/docs_references.rs");
    let mut bad = Vec::new();
    for f in &all {
        if *f == me {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let rel = f.strip_prefix(root).unwrap().display().to_string();
        for (line, what) in outside_citations(&text) {
            bad.push(format!(
                "{rel}:{line}: cites {what:?} outside the repository"
            ));
        }
        for page in docs_citations(&text) {
            if !root.join(&page).is_file() {
                bad.push(format!("{rel}: cites {page}, which does not exist"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "cite our docs/ pages instead:\n{}",
        bad.join("\n")
    );
}
