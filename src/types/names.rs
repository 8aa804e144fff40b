//! Name rules of 13-iam and 15-configuration: project paths, principal ids, edge ids,
//! permissions and the token format. Untrusted strings pass through here first.

use super::Failure;

/// The seven permissions of 13-iam §3.
pub const PERMISSIONS: [&str; 7] = [
    "sandbox.create",
    "sandbox.operate",
    "layer.use",
    "layer.publish",
    "project.admin",
    "fleet.view",
    "fleet.operate",
];

/// Quota keys of 13-iam §4.
pub const QUOTA_KEYS: [&str; 4] = ["sandboxes", "cpu_cores", "memory_mb", "gpus"];

const MAX_NAME: usize = 128;

/// A user-supplied value for an error message: quoted, and cut to 64 characters so a huge
/// input cannot make a huge error.
pub fn shown(v: &str) -> String {
    let cut: String = v.chars().take(64).collect();
    if cut.len() < v.len() {
        format!("{cut:?}... ({} bytes)", v.len())
    } else {
        format!("{cut:?}")
    }
}

/// Checks one path segment of a project (`team-a`): no `/`, no whitespace, not empty.
pub fn check_project_name(name: &str) -> Result<(), Failure> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(Failure::invalid(format!(
            "project name {} must be 1 to {MAX_NAME} characters",
            shown(name)
        )));
    }
    // Printable ASCII only: names travel in headers and logs, and look-alike or invisible
    // characters (a zero-width space shows `root/` for `root/\u{200b}`) invite confusion.
    // `:` is refused too: `<project>/<name>:<tag>` image names would become ambiguous.
    if name.contains('/') || name.contains(':') || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Failure::invalid(format!(
            "project name {} may hold only printable ASCII without '/', ':' or spaces",
            shown(name)
        )));
    }
    if name == "." || name == ".." {
        return Err(Failure::invalid(format!(
            "project name {name:?} is reserved"
        )));
    }
    Ok(())
}

/// Checks a full project path (`root/team-a/rl`): starts at `root`, valid segments.
pub fn check_project_path(path: &str) -> Result<(), Failure> {
    let mut parts = path.split('/');
    if parts.next() != Some("root") {
        return Err(Failure::invalid(format!(
            "project {} must start with \"root\"",
            shown(path)
        )));
    }
    for p in parts {
        check_project_name(p).map_err(|e| {
            Failure::invalid(format!("project path {}: {}", shown(path), e.message))
        })?;
    }
    if path.len() > 1024 {
        return Err(Failure::invalid("project path longer than 1024 characters"));
    }
    Ok(())
}

/// The ancestors of a project path, root first, the path itself last.
pub fn project_chain(path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for (i, seg) in path.split('/').enumerate() {
        if i > 0 {
            cur.push('/');
        }
        cur.push_str(seg);
        out.push(cur.clone());
    }
    out
}

/// The parent of a project path; `None` for root.
pub fn project_parent(path: &str) -> Option<&str> {
    path.rfind('/').map(|i| &path[..i])
}

/// True when `path` is `ancestor` or lies under it.
pub fn project_within(path: &str, ancestor: &str) -> bool {
    path == ancestor
        || (path.len() > ancestor.len()
            && path.starts_with(ancestor)
            && path.as_bytes().get(ancestor.len()) == Some(&b'/'))
}

/// Checks a principal id: 1..128 characters, no `.`, `/` or whitespace.
pub fn check_principal_id(id: &str) -> Result<(), Failure> {
    if id.is_empty() || id.len() > MAX_NAME {
        return Err(Failure::invalid(format!(
            "principal id {} must be 1 to {MAX_NAME} characters",
            shown(id)
        )));
    }
    // Tokens carry the id in an HTTP header, so it must be header-safe: printable ASCII.
    if id.contains('.') || id.contains('/') || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Failure::invalid(format!(
            "principal id {} may hold only printable ASCII without '.', '/' or spaces",
            shown(id)
        )));
    }
    Ok(())
}

/// Checks an edge id: `[a-z0-9-]`, 1 to 32 characters (15-configuration `edges[].id`).
pub fn check_edge_id(id: &str) -> Result<(), Failure> {
    if id.is_empty()
        || id.len() > 32
        || !id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(Failure::invalid(format!(
            "edge id {id:?} must be 1 to 32 characters of [a-z0-9-]"
        )));
    }
    Ok(())
}

/// Checks a permission name against the seven of 13-iam §3.
pub fn check_permission(p: &str) -> Result<(), Failure> {
    if PERMISSIONS.contains(&p) {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "unknown permission {p:?}; known: {}",
            PERMISSIONS.join(", ")
        )))
    }
}

/// A parsed bearer token: `dsk.<principal>.<id>.<secret>`, or the legacy primary form
/// `dsk.<principal>.<secret>` whose id is `primary`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenParts<'a> {
    pub principal: &'a str,
    pub id: &'a str,
    pub secret: &'a str,
}

/// Splits a token; any other shape is `unauthenticated` (the token cannot be valid).
pub fn parse_token(token: &str) -> Result<TokenParts<'_>, Failure> {
    let bad =
        || Failure::unauthenticated("malformed token: expected dsk.<principal>.<id>.<secret>");
    if token.len() > 512 {
        return Err(bad());
    }
    let parts: Vec<&str> = token.split('.').collect();
    match parts.as_slice() {
        ["dsk", p, s] if !p.is_empty() && !s.is_empty() => Ok(TokenParts {
            principal: p,
            id: "primary",
            secret: s,
        }),
        ["dsk", p, i, s] if !p.is_empty() && !i.is_empty() && !s.is_empty() => Ok(TokenParts {
            principal: p,
            id: i,
            secret: s,
        }),
        _ => Err(bad()),
    }
}

/// Splits `project/name:tag` into the image's project (everything before the last `/`).
/// Edge-local image names without `/` (like `host`) have no project.
pub fn image_project(image: &str) -> Option<&str> {
    image.rfind('/').map(|i| &image[..i])
}

/// Checks a caller's `readonly_paths`/`masked_paths` entry: absolute, at most 4096 bytes, no
/// NUL, no `.` or `..` component, not `/` itself. Errors: the reason why, for `invalid`.
pub fn check_sandbox_path(p: &str) -> Result<(), String> {
    if !p.starts_with('/') || p.len() > 4096 || p.contains('\0') {
        return Err(format!(
            "path {} must be absolute (at most 4096 bytes)",
            shown(p)
        ));
    }
    if p.split('/').any(|c| c == "." || c == "..") {
        return Err(format!("path {} must not contain . or ..", shown(p)));
    }
    let p = p.trim_end_matches('/');
    if p.is_empty() {
        return Err("path / cannot be masked or made read-only".into());
    }
    // The agents live in /run/opendsec, and they need /proc and /dev: hiding them would
    // leave a sandbox that cannot start or run anything.
    const AGENTS: &str = "/run/opendsec";
    let squeezed: String = {
        let mut out = String::new();
        for c in p.split('/').filter(|c| !c.is_empty()) {
            out.push('/');
            out.push_str(c);
        }
        out
    };
    let within = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
    if within(&squeezed, AGENTS)
        || within(AGENTS, &squeezed)
        || ["/proc", "/dev"].contains(&squeezed.as_str())
    {
        return Err(format!(
            "path {} holds the sandbox's agents or /proc or /dev and cannot be masked or made read-only",
            shown(&squeezed)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_paths() {
        assert!(check_project_path("root").is_ok());
        assert!(check_project_path("root/team-a/rl").is_ok());
        assert!(check_project_path("team-a").is_err());
        assert!(check_project_path("root//x").is_err());
        assert!(check_project_path("root/a b").is_err());
        assert!(check_project_path("root/..").is_err());
        assert_eq!(
            project_chain("root/a/b"),
            vec!["root", "root/a", "root/a/b"]
        );
        assert_eq!(project_parent("root/a/b"), Some("root/a"));
        assert_eq!(project_parent("root"), None);
        assert!(project_within("root/a/b", "root/a"));
        assert!(!project_within("root/ab", "root/a"));
        assert!(project_within("root", "root"));
    }

    #[test]
    fn principals_and_edges() {
        assert!(check_principal_id("trainer-1").is_ok());
        assert!(check_principal_id("a.b").is_err());
        assert!(check_principal_id("a/b").is_err());
        assert!(check_principal_id("").is_err());
        for bad in ["ümlaut", "a\u{200b}", "x\ny", "a\x01"] {
            assert!(check_principal_id(bad).is_err(), "{bad:?}");
        }
        for bad in ["a:b", "\u{200b}", "ctl\x07", "ünï"] {
            assert!(check_project_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_project_name("$(id)").is_ok());
        let long = "z".repeat(20000);
        assert!(check_project_path(&long).unwrap_err().message.len() < 300);
        assert!(check_edge_id("node-a1").is_ok());
        assert!(check_edge_id("Node").is_err());
        assert!(check_edge_id(&"a".repeat(33)).is_err());
    }

    #[test]
    fn tokens() {
        let t = parse_token("dsk.admin.s3cret").unwrap();
        assert_eq!(
            (t.principal, t.id, t.secret),
            ("admin", "primary", "s3cret")
        );
        let t = parse_token("dsk.bob.t1.xyz").unwrap();
        assert_eq!((t.principal, t.id, t.secret), ("bob", "t1", "xyz"));
        for bad in [
            "",
            "dsk",
            "dsk..x",
            "abc.bob.x",
            "dsk.bob.t1.x.y",
            "dsk.bob..x",
        ] {
            assert!(parse_token(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn images() {
        assert_eq!(image_project("root/team/py:3.12"), Some("root/team"));
        assert_eq!(image_project("host"), None);
    }
}
