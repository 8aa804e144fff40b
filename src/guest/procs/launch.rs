//! From a `StartProcessRequest` to what `sys::spawn` runs: the user, environment, working
//! directory and program path, checked before anything is forked so that bad requests get
//! a precise error.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::{ProcError, DEFAULT_PTY_SIZE, PROCESS_OOM_SCORE_ADJ};
use crate::guest::config::AetherConfig;
use crate::guest::user::{self, Credentials};
use crate::pb;
use crate::sys::spawn::{Ids, SpawnSpec};

/// Builds the spawn spec for `req`: `user` "" is the sandbox's `init_user`; the environment
/// is [`user::environ`] of the user, the image's variables and `req.env`; `cwd` "" is the
/// image's workdir or else the user's home, `~` expands to the home and a relative cwd is
/// taken from the home; `cmd` without `/` is looked up on the environment's `PATH`.
/// Errors: `EmptyCommand`, `ResolveUser`, `Cwd`, `ProgramNotFound`, `PtySize` (all before any
/// process exists).
pub(super) fn prepare(
    cfg: &AetherConfig,
    root: &Path,
    req: &pb::StartProcessRequest,
) -> Result<SpawnSpec, ProcError> {
    if req.cmd.is_empty() {
        return Err(ProcError::EmptyCommand);
    }
    let who = if req.user.is_empty() {
        cfg.init_user.as_str()
    } else {
        req.user.as_str()
    };
    let creds = user::resolve(who, root).map_err(|source| ProcError::ResolveUser {
        user: who.to_string(),
        source,
    })?;
    let extra: BTreeMap<String, String> = req
        .env
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let env = user::environ(&creds, &cfg.env, &extra);
    let cwd = working_dir(&req.cwd, &cfg.workdir, &creds.home, |p| p.is_dir());
    if !cwd.is_dir() {
        return Err(ProcError::Cwd { path: cwd });
    }
    let program = find_program(&req.cmd, env.get("PATH").map(String::as_str), &cwd)?;
    let pty = if req.pty {
        let (cols, rows) = match (req.pty_cols, req.pty_rows) {
            (0, 0) => DEFAULT_PTY_SIZE,
            (c, r) => (c, r),
        };
        match (u16::try_from(cols), u16::try_from(rows)) {
            (Ok(c), Ok(r)) if c > 0 && r > 0 => Some((c, r)),
            _ => return Err(ProcError::PtySize { cols, rows }),
        }
    } else {
        None
    };
    Ok(SpawnSpec {
        program,
        argv0: req.cmd.clone(),
        args: req.args.clone(),
        env,
        cwd,
        ids: ids_for(&creds),
        stdin: req.stdin,
        pty,
        oom_score_adj: cfg.protect_from_oom.then_some(PROCESS_OOM_SCORE_ADJ),
        cgroup_procs_fds: cfg.workload_cgroup_fds.clone(),
    })
}

/// The credentials to switch to: always as root (so supplementary groups are reset too);
/// none when an unprivileged agent starts a process as itself (tests).
fn ids_for(creds: &Credentials) -> Option<Ids> {
    let same = creds.uid == nix::unistd::geteuid().as_raw()
        && creds.gid == nix::unistd::getegid().as_raw();
    if same && !nix::unistd::geteuid().is_root() {
        return None;
    }
    Some(Ids {
        uid: creds.uid,
        gid: creds.gid,
        groups: creds.groups.clone(),
    })
}

/// `requested`, else the image's `workdir`, else `home`; `~` and `~/x` expand to the home,
/// other relative paths are taken from the home (as E2B's envd does).
///
/// A home directory that does not exist (`nobody`'s `/nonexistent`) is `/` when nothing else
/// names a directory, as `login` does; a directory the caller names must exist.
fn working_dir(
    requested: &str,
    workdir: &str,
    home: &str,
    is_dir: impl Fn(&Path) -> bool,
) -> PathBuf {
    let home = Path::new(if home.is_empty() { "/" } else { home });
    let p = match (requested, workdir) {
        ("", "") if !is_dir(home) => return PathBuf::from("/"),
        ("", "") => return home.to_path_buf(),
        ("", w) => w,
        (r, _) => r,
    };
    if p == "~" {
        return home.to_path_buf();
    }
    if let Some(rest) = p.strip_prefix("~/") {
        return home.join(rest);
    }
    home.join(p) // an absolute `p` replaces `home`
}

/// `cmd` itself when it contains a `/`; otherwise the first executable regular file named
/// `cmd` in the directories of `path` (empty entries and relative ones count from `cwd`).
fn find_program(cmd: &str, path: Option<&str>, cwd: &Path) -> Result<PathBuf, ProcError> {
    if cmd.contains('/') {
        return Ok(PathBuf::from(cmd));
    }
    let path = path.unwrap_or(user::DEFAULT_PATH);
    for dir in path.split(':') {
        let candidate = cwd.join(dir).join(cmd);
        let executable = std::fs::metadata(&candidate)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        if executable {
            return Ok(candidate);
        }
    }
    Err(ProcError::ProgramNotFound {
        program: cmd.to_string(),
        path: path.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn working_dirs() {
        assert_eq!(
            working_dir("", "", "/home/a", |_| true),
            PathBuf::from("/home/a")
        );
        assert_eq!(
            working_dir("", "/app", "/home/a", |_| true),
            PathBuf::from("/app")
        );
        assert_eq!(
            working_dir("/tmp", "/app", "/home/a", |_| true),
            PathBuf::from("/tmp")
        );
        assert_eq!(
            working_dir("~", "/app", "/home/a", |_| true),
            PathBuf::from("/home/a")
        );
        assert_eq!(
            working_dir("~/x", "", "/home/a", |_| true),
            PathBuf::from("/home/a/x")
        );
        assert_eq!(
            working_dir("x/y", "", "/home/a", |_| true),
            PathBuf::from("/home/a/x/y")
        );
        assert_eq!(working_dir("", "", "", |_| true), PathBuf::from("/"));
        // nobody's home does not exist: `/`, unless the caller named a directory.
        let none = |_: &Path| false;
        assert_eq!(
            working_dir("", "", "/nonexistent", none),
            PathBuf::from("/")
        );
        assert_eq!(
            working_dir("~/x", "", "/nonexistent", none),
            PathBuf::from("/nonexistent/x")
        );
    }

    #[test]
    fn programs_on_path() {
        let cwd = Path::new("/");
        let sh = find_program("sh", Some("/nonexistent:/bin:/usr/bin"), cwd).expect("sh");
        assert!(sh.ends_with("sh"));
        assert_eq!(
            find_program("./x", Some(""), cwd).expect("as given"),
            PathBuf::from("./x")
        );
        assert!(matches!(
            find_program("no-such-program-xyz", Some("/bin:/usr/bin"), cwd),
            Err(ProcError::ProgramNotFound { .. })
        ));
        // A directory on PATH named like the program is skipped.
        assert!(find_program("tmp", Some("/"), cwd).is_err());
    }
}
