//! The read-only disks a microVM gets besides its writable one (docs/microvm.md "Disks"):
//! the agent disk, holding this build's binary, made once per node and binary and shared by
//! every VM; the image disk, one per image per node, its layers flattened into one tree and
//! shared by every VM of that image; and each VM's config disk. The writable disk is the
//! container backend's sparse ext4 disk (`container::disk`), attached to QEMU instead of a
//! loop device.
//!
//! Read-only disks are ext4 without a journal, made by `mkfs.ext4 -d` from a directory:
//! nothing ever writes them, and the guest mounts them read-only with `noload`.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::Digest;

use crate::guest::vminit::{self, VmConfig, AGENT_FILE};

/// Space an ext4 image gets beyond its files' sizes: metadata, inode tables, and files
/// rounded up to whole blocks.
const SLACK_MB: u64 = 8;

/// Why a disk could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DisksError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// mkfs.ext4 is not installed, could not start, or failed.
    #[error("making {path}: {message}")]
    Mkfs { path: PathBuf, message: String },
    /// The image's layers could not be stacked to be read as one tree.
    #[error("stacking the layers of {path}: {message}")]
    Stack { path: PathBuf, message: String },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> DisksError {
    let path = path.to_path_buf();
    move |source| DisksError::Io { what, path, source }
}

/// The agent disk for `binary` in `dir`: `agent-<first 16 hex of its SHA-256>.ext4`, made
/// the first time (into a temporary name, then renamed, so racing edges each see a whole
/// one) and reused after. The binary is copied as given; strip it first to keep the disk
/// small. Errors: `Io` reading the binary or writing the disk, `Mkfs`.
pub fn agent_disk(binary: &Path, dir: &Path) -> Result<PathBuf, DisksError> {
    let digest = file_digest(binary)?;
    let out = dir.join(format!(
        "agent-{}.ext4",
        digest.get(..16).unwrap_or(&digest)
    ));
    if out.is_file() {
        return Ok(out);
    }
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    // A staging directory of this build's own, removed whatever happens.
    let stage = Staging(dir.join(format!(
        ".agent-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )));
    let files = stage.0.join("files");
    fs::create_dir_all(&files).map_err(io_err("creating", &files))?;
    let copy = files.join(AGENT_FILE);
    fs::copy(binary, &copy).map_err(io_err("copying the agent to", &copy))?;
    let tmp = stage.0.join("disk.ext4");
    ext4_from(&tmp, &files)?;
    fs::rename(&tmp, &out).map_err(io_err("renaming a new agent disk to", &out))?;
    Ok(out)
}

/// The file system of the image disks (`erofs_images`, docs/microvm.md "The backend").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// ext4 without a journal, sized to the tree.
    Ext4,
    /// EROFS, read-only by design and packed (`mkfs.erofs` from erofs-utils).
    Erofs,
}

impl ImageFormat {
    fn extension(self) -> &'static str {
        match self {
            ImageFormat::Ext4 => "ext4",
            ImageFormat::Erofs => "erofs",
        }
    }
}

/// `mkfs.erofs` on `PATH` or in the sbin directories.
pub fn mkfs_erofs() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.erofs"))
        .find(|p| p.is_file())
}

/// The image disk for an image whose layers are `lowers` (topmost first, as containers
/// stack them) in `dir`: `image-<key>.ext4` (or `.erofs` in `format` EROFS), made the first
/// time and shared after by every VM of the image. `key` names the image's content (a digest of its store layers), so a
/// changed image gets a disk of its own. Several layers are read as one tree through a
/// read-only overlay mount, which applies their whiteouts, and the disk holds that tree's
/// files with their owners, modes and extended attributes. Errors: `Stack` when the layers
/// cannot be mounted together, `Io`, `Mkfs`.
pub fn image_disk(
    lowers: &[PathBuf],
    key: &str,
    dir: &Path,
    format: ImageFormat,
) -> Result<PathBuf, DisksError> {
    let out = dir.join(format!("image-{key}.{}", format.extension()));
    let build = |out: &Path, tree: &Path| match format {
        ImageFormat::Ext4 => ext4_from(out, tree),
        ImageFormat::Erofs => erofs_from(out, tree),
    };
    if out.is_file() {
        return Ok(out);
    }
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    let stage = Staging(dir.join(format!(
        ".image-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )));
    fs::create_dir_all(&stage.0).map_err(io_err("creating", &stage.0))?;
    let mut lowers = lowers.to_vec();
    // overlayfs refuses a lower named twice; a run of one layer is the same tree as one.
    lowers.dedup();
    let tmp = stage.0.join("disk");
    match lowers.as_slice() {
        [] => {
            let empty = stage.0.join("empty");
            fs::create_dir_all(&empty).map_err(io_err("creating", &empty))?;
            build(&tmp, &empty)?;
        }
        [one] => build(&tmp, one)?,
        many => {
            let merged = Merged::mount(&stage.0, many, &out)?;
            build(&tmp, &merged.0)?;
        }
    }
    fs::rename(&tmp, &out).map_err(io_err("renaming a new image disk to", &out))?;
    Ok(out)
}

/// A read-only overlay of an image's layers, unmounted when dropped.
struct Merged(PathBuf);

/// The kernel reads one page of mount options; a little less leaves room for its own.
const MAX_MOUNT_OPTIONS: usize = 4000;

impl Merged {
    /// Mounts `lowers` (topmost first) at `<stage>/merged`, each named by a short link in
    /// `<stage>/l` so that images of many layers fit the mount's options.
    fn mount(stage: &Path, lowers: &[PathBuf], out: &Path) -> Result<Merged, DisksError> {
        let err = |message: String| DisksError::Stack {
            path: out.to_path_buf(),
            message,
        };
        let links = stage.join("l");
        fs::create_dir_all(&links).map_err(io_err("creating", &links))?;
        let mut names = Vec::with_capacity(lowers.len());
        for (i, l) in lowers.iter().enumerate() {
            let link = links.join(i.to_string());
            std::os::unix::fs::symlink(l, &link).map_err(io_err("linking", &link))?;
            names.push(link.display().to_string());
        }
        let opts = format!("lowerdir={}", names.join(":"));
        if opts.len() > MAX_MOUNT_OPTIONS {
            return Err(err(format!(
                "{} layers are more than one mount can stack",
                lowers.len()
            )));
        }
        let merged = stage.join("merged");
        fs::create_dir_all(&merged).map_err(io_err("creating", &merged))?;
        nix::mount::mount(
            Some("overlay"),
            &merged,
            Some("overlay"),
            nix::mount::MsFlags::MS_RDONLY
                | nix::mount::MsFlags::MS_NODEV
                | nix::mount::MsFlags::MS_NOSUID,
            Some(opts.as_str()),
        )
        .map_err(|e| err(format!("mount overlay: {e}")))?;
        Ok(Merged(merged))
    }
}

impl Drop for Merged {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A directory removed with everything in it when dropped.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Writes the config disk for `cfg` at `path` (mode 0600: it holds the sandbox's env).
/// Errors: `Io`.
pub fn config_disk(path: &Path, cfg: &VmConfig) -> Result<(), DisksError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&vminit::config_disk(cfg)))
        .map_err(io_err("writing the config disk", path))
}

/// The hex SHA-256 of a file's bytes.
fn file_digest(path: &Path) -> Result<String, DisksError> {
    let mut f = fs::File::open(path).map_err(io_err("opening", path))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err("reading", path))?;
        if n == 0 {
            break;
        }
        h.update(buf.get(..n).unwrap_or_default());
    }
    Ok(hex::encode(h.finalize()))
}

/// An inode's share of the disk (ext4's inode size).
const INODE_BYTES: u64 = 256;

/// Bytes `dir`'s regular files take, each rounded up to 4 KiB blocks, and how many entries
/// it holds (directories included).
fn tree_size(dir: &Path) -> io::Result<(u64, u64)> {
    let (mut total, mut entries) = (0, 0);
    for e in fs::read_dir(dir)? {
        let e = e?;
        let t = e.file_type()?;
        entries += 1;
        if t.is_dir() {
            let (t, n) = tree_size(&e.path())?;
            total += t + 4096;
            entries += n;
        } else {
            total += e.metadata()?.len().div_ceil(4096) * 4096;
        }
    }
    Ok((total, entries))
}

/// Runs `program` (a mkfs) with `args`, which make the image at `out`. Errors: `Mkfs` with
/// what it said.
fn run_mkfs(out: &Path, program: &Path, args: &[&std::ffi::OsStr]) -> Result<(), DisksError> {
    let err = |message: String| DisksError::Mkfs {
        path: out.to_path_buf(),
        message,
    };
    let run = Command::new(program)
        .env_clear()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| err(format!("starting {}: {e}", program.display())))?;
    if !run.status.success() {
        return Err(err(format!(
            "{} exited with {}: {}",
            program.display(),
            run.status,
            String::from_utf8_lossy(&run.stderr).trim()
        )));
    }
    Ok(())
}

/// An EROFS image of `dir` at `out`, owners, modes, extended attributes and times kept,
/// uncompressed (a guest reads it without decompressing, and the page cache holds it once).
/// Errors: `Mkfs`.
fn erofs_from(out: &Path, dir: &Path) -> Result<(), DisksError> {
    let program = mkfs_erofs().ok_or_else(|| DisksError::Mkfs {
        path: out.to_path_buf(),
        message: "mkfs.erofs not found (erofs-utils)".into(),
    })?;
    run_mkfs(
        out,
        &program,
        &[
            "--quiet".as_ref(),
            "--preserve-mtime".as_ref(),
            out.as_os_str(),
            dir.as_os_str(),
        ],
    )
}

/// Makes a journal-less ext4 image at `out` holding `dir`'s files, owned by root, sized to
/// them plus [`SLACK_MB`]. Errors: `Io`, `Mkfs`.
fn ext4_from(out: &Path, dir: &Path) -> Result<(), DisksError> {
    let program =
        crate::backends::container::disk::mkfs_program().ok_or_else(|| DisksError::Mkfs {
            path: out.to_path_buf(),
            message: "mkfs.ext4 not found (e2fsprogs)".into(),
        })?;
    let (used, entries) = tree_size(dir).map_err(io_err("measuring", dir))?;
    // An eighth more for the inode tables and directories of many small files.
    let size_mb = (used + used / 8 + entries * INODE_BYTES).div_ceil(1 << 20) + SLACK_MB;
    // Inodes for every entry: ext4's default of one per 16 KiB runs out on an image of
    // many small files (a Debian base has one file per 10 KiB).
    let inodes = (entries + entries / 8 + 1024).to_string();
    let f = fs::File::create(out).map_err(io_err("creating", out))?;
    f.set_len(size_mb << 20).map_err(io_err("sizing", out))?;
    drop(f);
    let flags = [
        "-q",
        "-F",
        "-m",
        "0",
        "-b",
        "4096",
        "-O",
        "^has_journal,^resize_inode",
        "-E",
        "root_owner=0:0",
        "-N",
        inodes.as_str(),
        "-d",
    ];
    let args: Vec<&std::ffi::OsStr> = flags
        .iter()
        .map(|a| a.as_ref())
        .chain([dir.as_os_str(), out.as_os_str()])
        .collect();
    run_mkfs(out, program, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of an ext4 image, read on the host with debugfs (empty when it is not there).
    fn debugfs_cat(disk: &Path, path: &str) -> Vec<u8> {
        Command::new("debugfs")
            .args(["-R", &format!("cat {path}")])
            .arg(disk)
            .stderr(Stdio::null())
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default()
    }

    #[test]
    fn an_agent_disk_holds_the_binary_and_is_made_once_per_binary() {
        let dir = tempfile::tempdir().expect("dir");
        let bin = dir.path().join("opendsec");
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        fs::write(&bin, &body).expect("binary");
        let disks = dir.path().join("disks");
        let disk = agent_disk(&bin, &disks).expect("agent disk");
        assert_eq!(debugfs_cat(&disk, &format!("/{AGENT_FILE}")), body);
        let made = mtime(&disk);
        // The same binary: the same disk, not made again; nothing else left behind.
        assert_eq!(agent_disk(&bin, &disks).expect("again"), disk);
        assert_eq!(mtime(&disk), made);
        let names = names_in(&disks);
        assert_eq!(names.len(), 1, "{names:?}");
        // Another binary: another disk.
        fs::write(&bin, b"another build").expect("binary");
        let other = agent_disk(&bin, &disks).expect("other");
        assert_ne!(other, disk);
        assert_eq!(
            debugfs_cat(&other, &format!("/{AGENT_FILE}")),
            b"another build"
        );
    }

    fn mtime(p: &Path) -> std::time::SystemTime {
        fs::metadata(p).expect("stat").modified().expect("mtime")
    }

    fn names_in(dir: &Path) -> Vec<std::ffi::OsString> {
        fs::read_dir(dir)
            .expect("list")
            .flatten()
            .map(|e| e.file_name())
            .collect()
    }

    /// The names in an ext4 image's directory, read with debugfs.
    fn debugfs_ls(disk: &Path, path: &str) -> Vec<String> {
        let out = Command::new("debugfs")
            .args(["-R", &format!("ls -l {path}")])
            .arg(disk)
            .stderr(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        out.lines()
            .filter_map(|l| l.split_whitespace().last().map(str::to_string))
            .filter(|n| n != "." && n != "..")
            .collect()
    }

    #[test]
    fn an_image_disk_is_its_layers_as_one_tree_made_once() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "stacking layers needs root (the tests run as root)"
        );
        let dir = tempfile::tempdir().expect("dir");
        let (lower, upper) = (dir.path().join("lower"), dir.path().join("upper"));
        for d in [&lower, &upper] {
            fs::create_dir_all(d.join("etc")).expect("mkdir");
        }
        fs::write(lower.join("etc/kept"), "kept\n").expect("write");
        fs::write(lower.join("etc/changed"), "old\n").expect("write");
        fs::write(lower.join("etc/deleted"), "gone\n").expect("write");
        std::os::unix::fs::chown(lower.join("etc/kept"), Some(1234), Some(5678)).expect("chown");
        fs::write(upper.join("etc/changed"), "new\n").expect("write");
        // A whiteout, as layers carry a deletion: a character device 0/0.
        nix::sys::stat::mknod(
            &upper.join("etc/deleted"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .expect("whiteout");
        let disks = dir.path().join("disks");
        let disk = image_disk(
            &[upper.clone(), lower.clone()],
            "k1",
            &disks,
            ImageFormat::Ext4,
        )
        .expect("disk");
        assert_eq!(debugfs_cat(&disk, "/etc/kept"), b"kept\n");
        assert_eq!(debugfs_cat(&disk, "/etc/changed"), b"new\n");
        let mut names = debugfs_ls(&disk, "/etc");
        names.sort();
        assert_eq!(names, ["changed", "kept"]);
        let stat = Command::new("debugfs")
            .args(["-R", "stat /etc/kept"])
            .arg(&disk)
            .stderr(Stdio::null())
            .output()
            .expect("debugfs");
        let stat = String::from_utf8_lossy(&stat.stdout);
        assert!(
            stat.contains("User:  1234") && stat.contains("Group:  5678"),
            "{stat}"
        );
        // Made once per key; nothing left mounted or staged.
        let made = mtime(&disk);
        assert_eq!(
            image_disk(&[upper, lower], "k1", &disks, ImageFormat::Ext4).expect("again"),
            disk
        );
        assert_eq!(mtime(&disk), made);
        let left = names_in(&disks);
        assert_eq!(left.len(), 1, "{left:?}");
        let mounts = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        assert!(!mounts.contains(&disks.display().to_string()), "{mounts}");
    }

    #[test]
    fn an_image_of_many_small_files_fits_its_disk() {
        let dir = tempfile::tempdir().expect("dir");
        let tree = dir.path().join("tree");
        for d in 0..50 {
            let sub = tree.join(format!("d{d}"));
            fs::create_dir_all(&sub).expect("mkdir");
            for f in 0..100 {
                fs::write(sub.join(format!("f{f}")), b"x").expect("write");
            }
        }
        let disk = image_disk(
            &[tree],
            "many",
            &dir.path().join("disks"),
            ImageFormat::Ext4,
        )
        .expect("disk");
        assert_eq!(debugfs_cat(&disk, "/d49/f99"), b"x");
        assert_eq!(debugfs_ls(&disk, "/d0").len(), 100);
    }

    #[test]
    fn a_config_disk_reads_back_and_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("config.img");
        let cfg = VmConfig {
            sandbox_id: "n1.abc".into(),
            env: [("TOKEN".to_string(), "secret".to_string())].into(),
            ..Default::default()
        };
        config_disk(&path, &cfg).expect("write");
        assert_eq!(
            vminit::parse_config(&fs::read(&path).expect("read")).expect("parse"),
            cfg
        );
        let mode = fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
