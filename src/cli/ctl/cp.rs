//! `cp <id>:<path> <local>` and `cp <local> <id>:<path>` (docs/cli.md `cp`): one file, up to
//! 64 MB, through `ReadFile`/`WriteFile`. `-` as the local side is stdin or stdout.

use std::io::Read;
use std::path::{Path, PathBuf};

use argh::FromArgs;

use super::values::{self, MAX_FILE};
use super::{output, CtlError, Ctx};
use crate::pb;
use crate::types::{Failure, Reason};

#[derive(FromArgs, Debug)]
/// copy one file (up to 64 MB) between this machine and a sandbox. Uploads print the file's
/// information as JSON; "-" as the local file is stdin or stdout.
#[argh(
    subcommand,
    name = "cp",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} $ID:/srv/out.log ./out.log",
    example = "{command_name} ./data.csv $ID:/srv/data.csv"
)]
pub struct CpArgs {
    /// source: <id>:<path> or a local file
    #[argh(positional)]
    pub src: String,
    /// destination: a local file or directory, or <id>:<path>
    #[argh(positional)]
    pub dst: String,
}

/// A sandbox side `<id>:<absolute path>`, told apart from local paths as scp does: the part
/// before the first `:` is not empty and has no `/`.
pub fn remote(arg: &str) -> Option<(&str, &str)> {
    let (id, path) = arg.split_once(':')?;
    if id.is_empty() || id.contains('/') {
        return None;
    }
    Some((id, path))
}

/// Which way a copy goes, with the sandbox id and path checked.
#[derive(Debug, PartialEq, Eq)]
pub enum Direction<'a> {
    Download {
        id: &'a str,
        path: &'a str,
        local: &'a str,
    },
    Upload {
        local: &'a str,
        id: &'a str,
        path: &'a str,
    },
}

/// Works out the direction. Errors: `invalid` unless exactly one side is a sandbox path,
/// for a bad id, or for a sandbox path that is not absolute.
pub fn direction<'a>(src: &'a str, dst: &'a str) -> Result<Direction<'a>, CtlError> {
    let d = match (remote(src), remote(dst)) {
        (Some((id, path)), None) => Direction::Download {
            id,
            path,
            local: dst,
        },
        (None, Some((id, path))) => Direction::Upload {
            local: src,
            id,
            path,
        },
        (Some(_), Some(_)) => {
            return Err(super::CtlError::usage(
                "cp copies between this machine and a sandbox, not between sandboxes",
            ))
        }
        (None, None) => {
            return Err(super::CtlError::usage(
                "one side of cp must be a sandbox path <id>:<path>",
            ))
        }
    };
    let (id, path) = match &d {
        Direction::Download { id, path, .. } | Direction::Upload { id, path, .. } => (*id, *path),
    };
    values::sandbox_id(id)?;
    if !path.starts_with('/') || path.contains('\0') {
        return Err(super::CtlError::usage(format!(
            "sandbox path {path:?} must be absolute"
        )));
    }
    Ok(d)
}

fn local_failure(what: &str, path: &Path, e: std::io::Error) -> Failure {
    let reason = match e.kind() {
        std::io::ErrorKind::NotFound => Reason::NotFound,
        std::io::ErrorKind::PermissionDenied => Reason::Forbidden,
        _ => Reason::Internal,
    };
    Failure::new(
        reason,
        format!(
            "{what} {}: {e}",
            path.display(),
            e = crate::types::chain(&e)
        ),
    )
}

fn too_big(what: &str, size: u64) -> Failure {
    Failure::invalid(format!(
        "{what} is {size} bytes; cp copies up to {MAX_FILE} bytes (64 MB): use the SDK's chunked reads and writes"
    ))
}

/// The last component of a sandbox path (`/a/b.txt` -> `b.txt`).
fn base_name(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().unwrap_or("")
}

impl CpArgs {
    /// Copies the file. Errors: invalid input; a local file error (`not_found`, `forbidden`,
    /// `internal`); the server's failure; `invalid` for files over 64 MB.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match direction(&self.src, &self.dst)? {
            Direction::Download { id, path, local } => download(ctx, id, path, local).await,
            Direction::Upload { local, id, path } => upload(ctx, local, id, path).await,
        }
    }
}

async fn download(ctx: &Ctx, id: &str, path: &str, local: &str) -> Result<(), CtlError> {
    let conn = ctx.connect()?;
    let req = pb::ReadFileRequest {
        sandbox_id: id.to_string(),
        path: path.to_string(),
        ..Default::default()
    };
    let data = conn
        .call(req, |mut c, r| async move { c.read_file(r).await })
        .await?
        .data;
    if data.len() as u64 >= MAX_FILE {
        // One read returns at most 64 MB: make sure nothing was cut off.
        let req = pb::PathRequest {
            sandbox_id: id.to_string(),
            path: path.to_string(),
            ..Default::default()
        };
        let info = conn
            .call(req, |mut c, r| async move { c.stat(r).await })
            .await?;
        if info.size as u64 > data.len() as u64 {
            return Err(too_big(path, info.size as u64).into());
        }
    }
    if local == "-" {
        return output::out(&data);
    }
    let mut target = PathBuf::from(local);
    if target.is_dir() {
        target.push(base_name(path));
    }
    std::fs::write(&target, &data).map_err(|e| local_failure("writing", &target, e))?;
    Ok(())
}

async fn upload(ctx: &Ctx, local: &str, id: &str, path: &str) -> Result<(), CtlError> {
    let (data, mode) = if local == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .lock()
            .take(MAX_FILE + 1)
            .read_to_end(&mut buf)
            .map_err(|e| local_failure("reading", Path::new("stdin"), e))?;
        if buf.len() as u64 > MAX_FILE {
            return Err(too_big("stdin", buf.len() as u64).into());
        }
        (buf, 0)
    } else {
        let p = Path::new(local);
        let meta = std::fs::metadata(p).map_err(|e| local_failure("reading", p, e))?;
        if !meta.is_file() {
            return Err(Failure::invalid(format!("{local} is not a regular file")).into());
        }
        if meta.len() > MAX_FILE {
            return Err(too_big(local, meta.len()).into());
        }
        let data = std::fs::read(p).map_err(|e| local_failure("reading", p, e))?;
        use std::os::unix::fs::PermissionsExt;
        (data, meta.permissions().mode() & 0o7777)
    };
    let mut target = path.to_string();
    if target.ends_with('/') {
        let name = Path::new(local)
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|_| local != "-");
        let Some(name) = name else {
            return Err(Failure::invalid(format!("give a file name after {path}")).into());
        };
        target.push_str(name);
    }
    let conn = ctx.connect()?;
    let req = pb::WriteFileRequest {
        sandbox_id: id.to_string(),
        path: target,
        data,
        mode,
        ..Default::default()
    };
    let info = conn
        .call(req, |mut c, r| async move { c.write_file(r).await })
        .await?;
    output::json(&info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_are_told_apart_like_scp() {
        assert_eq!(
            direction("node-a.x1:/etc/hosts", "./hosts").unwrap(),
            Direction::Download {
                id: "node-a.x1",
                path: "/etc/hosts",
                local: "./hosts"
            }
        );
        assert_eq!(
            direction("/tmp/a:b", "node-a.x1:/srv/a").unwrap(),
            Direction::Upload {
                local: "/tmp/a:b",
                id: "node-a.x1",
                path: "/srv/a"
            }
        );
        assert!(direction("./x:y", "-").unwrap_err().is_usage());
        assert!(direction("a:/x", "b:/y").is_err());
        assert!(direction("local", "other").is_err());
        assert!(direction("id:relative/path", "out")
            .unwrap_err()
            .message()
            .contains("absolute"));
        assert!(direction(":/x", "out").is_err());
    }

    #[test]
    fn base_names() {
        assert_eq!(base_name("/a/b.txt"), "b.txt");
        assert_eq!(base_name("/a/dir/"), "dir");
    }
}
