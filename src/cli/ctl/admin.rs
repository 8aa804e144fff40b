//! Cluster commands (docs/cli.md): `status`, `edge drain`, `iam backup|restore`, and
//! `version`. All but `version` need `project.admin` on root except `status`.

use std::io::{Read, Write};
use std::path::Path;

use argh::FromArgs;

use super::{output, CtlError, Ctx};
use crate::pb;
use crate::types::{names, Failure, Reason};

#[derive(FromArgs, Debug)]
/// cluster snapshot: each edge's health, draining state, capacity, allocations, sandbox
/// counts, free memory and disk, pressure
#[argh(subcommand, name = "status", help_triggers("-h", "--help", "help"))]
pub struct StatusArgs {}

#[derive(FromArgs, Debug)]
/// operate edges
#[argh(subcommand, name = "edge", help_triggers("-h", "--help", "help"))]
pub struct EdgeArgs {
    #[argh(subcommand)]
    pub cmd: EdgeCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum EdgeCmd {
    Drain(DrainArgs),
}

#[derive(FromArgs, Debug)]
/// stop (-undo: resume) placing new sandboxes on an edge; its sandboxes keep running
#[argh(subcommand, name = "drain", help_triggers("-h", "--help", "help"))]
pub struct DrainArgs {
    /// edge id
    #[argh(positional)]
    pub edge: String,
    /// resume placing sandboxes on the edge
    #[argh(switch)]
    pub undo: bool,
}

#[derive(FromArgs, Debug)]
/// back up and restore IAM, list and change its replicas (needs project.admin on root)
#[argh(subcommand, name = "iam", help_triggers("-h", "--help", "help"))]
pub struct IamArgs {
    #[argh(subcommand)]
    pub cmd: IamCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum IamCmd {
    Backup(BackupArgs),
    Restore(RestoreArgs),
    Members(MembersArgs),
    Member(MemberArgs),
}

#[derive(FromArgs, Debug)]
/// change IAM's membership: add a replica started with -join, or remove one (its machine is
/// gone, say); one change at a time (docs/iam-replicas.md)
#[argh(subcommand, name = "member", help_triggers("-h", "--help", "help"))]
pub struct MemberArgs {
    #[argh(subcommand)]
    pub cmd: MemberCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum MemberCmd {
    Add(MemberAddArgs),
    Remove(MemberRemoveArgs),
}

#[derive(FromArgs, Debug)]
/// add replica ID, running with -join at these addresses (a learner, a voter once caught up)
#[argh(subcommand, name = "add", help_triggers("-h", "--help", "help"))]
pub struct MemberAddArgs {
    /// the new replica's id (a decimal number, as in iam.replicas)
    #[argh(positional)]
    pub id: String,
    /// its Raft address, host:port
    #[argh(option)]
    pub raft_addr: String,
    /// its IAM address, host:port
    #[argh(option)]
    pub iam_addr: String,
}

#[derive(FromArgs, Debug)]
/// remove replica ID from the group; prints the members
#[argh(subcommand, name = "remove", help_triggers("-h", "--help", "help"))]
pub struct MemberRemoveArgs {
    /// the replica's id
    #[argh(positional)]
    pub id: String,
}

#[derive(FromArgs, Debug)]
/// list IAM's replicas: id, addresses, which leads, voter or learner, and (in the leader's
/// answer) how far each has the log
#[argh(subcommand, name = "members", help_triggers("-h", "--help", "help"))]
pub struct MembersArgs {}

#[derive(FromArgs, Debug)]
/// back up IAM into a file (gzipped JSON, mode 0600): principals, projects, grants, quotas,
/// token hashes, usage
#[argh(subcommand, name = "backup", help_triggers("-h", "--help", "help"))]
pub struct BackupArgs {
    /// the file to write
    #[argh(option)]
    pub out: String,
}

#[derive(FromArgs, Debug)]
/// replace IAM's contents with a backup (quota leases of running sandboxes are kept)
#[argh(subcommand, name = "restore", help_triggers("-h", "--help", "help"))]
pub struct RestoreArgs {
    /// a file written by iam backup
    #[argh(positional)]
    pub file: String,
}

#[derive(FromArgs, Debug)]
/// print this build's version
#[argh(subcommand, name = "version", help_triggers("-h", "--help", "help"))]
pub struct VersionArgs {}

impl StatusArgs {
    /// Prints the cluster `Snapshot`. Errors: the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let conn = ctx.connect()?;
        output::json(
            &conn
                .call(
                    pb::Empty {},
                    |mut c, r| async move { c.cluster_status(r).await },
                )
                .await?,
        )
    }
}

impl EdgeArgs {
    /// Drains (or undrains) and prints the edge's `EdgeState`.
    /// Errors: `invalid` edge id; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let EdgeCmd::Drain(a) = self.cmd;
        names::check_edge_id(&a.edge)?;
        let conn = ctx.connect()?;
        let req = pb::DrainEdgeRequest {
            edge_id: a.edge,
            undo: a.undo,
        };
        output::json(
            &conn
                .call(req, |mut c, r| async move { c.drain_edge(r).await })
                .await?,
        )
    }
}

impl IamArgs {
    /// Backs up into a file or restores from one. Errors: `invalid` for a file that is not a
    /// gzipped backup; local file errors; the server's failure.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match self.cmd {
            IamCmd::Backup(a) => {
                if a.out.is_empty() {
                    return Err(Failure::invalid("-out: give a file name").into());
                }
                let conn = ctx.connect()?;
                let data = conn
                    .call(
                        pb::Empty {},
                        |mut c, r| async move { c.iam_backup(r).await },
                    )
                    .await?
                    .data;
                write_private(Path::new(&a.out), &data)?;
                output::err(format!("wrote {} bytes to {}\n", data.len(), a.out).as_bytes())
            }
            IamCmd::Members(_) => {
                let conn = ctx.connect()?;
                output::json(
                    &conn
                        .call(
                            pb::Empty {},
                            |mut c, r| async move { c.iam_members(r).await },
                        )
                        .await?,
                )
            }
            IamCmd::Member(MemberArgs {
                cmd: MemberCmd::Add(a),
            }) => {
                let conn = ctx.connect()?;
                let req = pb::IamMemberAddRequest {
                    id: a.id,
                    raft_addr: a.raft_addr,
                    iam_addr: a.iam_addr,
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.iam_member_add(r).await })
                        .await?,
                )
            }
            IamCmd::Member(MemberArgs {
                cmd: MemberCmd::Remove(a),
            }) => {
                let conn = ctx.connect()?;
                let req = pb::IamMemberRemoveRequest { id: a.id };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.iam_member_remove(r).await })
                        .await?,
                )
            }
            IamCmd::Restore(a) => {
                let path = Path::new(&a.file);
                let data = std::fs::read(path).map_err(|e| file_failure("reading", path, e))?;
                check_backup(&data).map_err(|why| {
                    Failure::invalid(format!("{} is not an IAM backup: {why}", a.file))
                })?;
                let conn = ctx.connect()?;
                let req = pb::IamRestoreRequest { data };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.iam_restore(r).await })
                        .await?,
                )
            }
        }
    }
}

impl VersionArgs {
    /// Prints `opendsec <version>`.
    pub fn run(self) -> Result<(), CtlError> {
        output::out(format!("opendsec {}\n", crate::VERSION).as_bytes())
    }
}

fn file_failure(what: &str, path: &Path, e: std::io::Error) -> Failure {
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

/// Checks that `data` is a whole gzip stream (a backup is gzipped JSON).
pub fn check_backup(data: &[u8]) -> Result<(), String> {
    if !data.starts_with(&[0x1f, 0x8b]) {
        return Err("not gzip data".into());
    }
    let mut sink = [0u8; 64 * 1024];
    let mut gz = flate2::read::GzDecoder::new(data);
    loop {
        match gz.read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => {
                return Err(format!(
                    "damaged gzip data: {e}",
                    e = crate::types::chain(&e)
                ))
            }
        }
    }
}

/// Writes `data` to `path` readable by its owner only: a temp file beside it, created with
/// mode 0600 (never wider, even briefly), fsynced, then renamed over `path`.
/// Errors: local file failures (`not_found`, `forbidden`, `internal`), naming the path.
pub fn write_private(path: &Path, data: &[u8]) -> Result<(), Failure> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Failure::invalid(format!("-out: {} is not a file name", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{:x}",
        name.to_string_lossy(),
        std::process::id(),
        rand::random::<u64>()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(file_failure("writing", &tmp, e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(file_failure("writing", path, e));
    }
    // Make the rename itself durable; a directory that cannot be opened is not an error.
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn private_file_replaces_a_wider_one_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("iam.json.gz");
        std::fs::write(&p, b"old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_private(&p, b"new bytes").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new bytes");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // No temp files are left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let e = write_private(&dir.path().join("missing/x.gz"), b"x").unwrap_err();
        assert_eq!(e.reason, Reason::NotFound);
    }

    #[test]
    fn backups_must_be_whole_gzip() {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(br#"{"principals":[]}"#).unwrap();
        let gz = enc.finish().unwrap();
        assert!(check_backup(&gz).is_ok());
        assert!(check_backup(b"{}").is_err());
        assert!(check_backup(&gz[..gz.len() - 6]).is_err());
    }
}
