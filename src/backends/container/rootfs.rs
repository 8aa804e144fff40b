//! The mount steps of the container setup process, all inside the sandbox's own mount
//! namespace (never the host's mount table): the writable disk, the overlay root, /proc,
//! /dev, a read-only /sys with the sandbox's own cgroup, /run/opendsec with the read-only
//! agent, then pivot_root and the masked and read-only paths.

use std::fs;
use std::os::unix::fs::{symlink, DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use super::setup::{SetupSpec, AETHER_CONFIG, AGENT_PATH, DEFAULT_MASKED, DEFAULT_READONLY};

/// A failed mount step, with the path it was about.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("{step} {path}")]
    Mount {
        step: &'static str,
        path: String,
        source: nix::Error,
    },
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: String,
        source: std::io::Error,
    },
}

fn m(
    step: &'static str,
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), RootfsError> {
    mount(src, target, fstype, flags, data).map_err(|source| RootfsError::Mount {
        step,
        path: target.display().to_string(),
        source,
    })
}

fn io<T>(step: &'static str, path: &Path, r: std::io::Result<T>) -> Result<T, RootfsError> {
    r.map_err(|source| RootfsError::Io {
        step,
        path: path.display().to_string(),
        source,
    })
}

fn mkdir(p: &Path, mode: u32) -> Result<(), RootfsError> {
    let r = fs::DirBuilder::new().recursive(true).mode(mode).create(p);
    io("mkdir", p, r)
}

fn touch(p: &Path) -> Result<(), RootfsError> {
    if p.exists() {
        return Ok(());
    }
    io("create", p, fs::write(p, b""))
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

/// Writes the sandbox's `/etc/resolv.conf` (sandbox networking: the DNS proxy on its
/// gateway, docs/network.md). Runs after the pivot, so every path resolves inside the
/// sandbox; magic links (this process's `/proc/self/fd`) are refused; and what the image had
/// there (a file, a link to anywhere) is unlinked and replaced by a new regular file, never
/// written through. A missing `/etc` is made.
pub fn write_resolv_conf(content: &str) -> Result<(), RootfsError> {
    use rustix::fs::{openat2, unlinkat, AtFlags, Mode, OFlags, ResolveFlags, CWD};
    let etc = Path::new("/etc");
    let open_etc = || {
        openat2(
            CWD,
            "/etc",
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::NO_MAGICLINKS,
        )
    };
    let dir = match open_etc() {
        Err(rustix::io::Errno::NOENT) => {
            mkdir(etc, 0o755)?;
            io("open", etc, open_etc().map_err(std::io::Error::from))?
        }
        r => io("open", etc, r.map_err(std::io::Error::from))?,
    };
    let file = etc.join("resolv.conf");
    match unlinkat(&dir, "resolv.conf", AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return io("unlink", &file, Err(e.into())),
    }
    let fd = rustix::fs::openat(
        &dir,
        "resolv.conf",
        OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    );
    let fd = io("create", &file, fd.map_err(std::io::Error::from))?;
    let mut f = fs::File::from(fd);
    io(
        "write",
        &file,
        std::io::Write::write_all(&mut f, content.as_bytes()),
    )
}

/// Stops mount events from propagating back to the host.
pub fn make_private() -> Result<(), RootfsError> {
    m(
        "make / private",
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )
}

/// Mounts a small tmpfs at `<dir>/mnt` to hold the disk and root mount points; returns
/// (disk mount point, root mount point).
pub fn scratch(dir: &Path) -> Result<(PathBuf, PathBuf), RootfsError> {
    let mnt = dir.join("mnt");
    mkdir(&mnt, 0o700)?;
    m(
        "mount scratch tmpfs",
        Some("tmpfs"),
        &mnt,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=700,size=64k"),
    )?;
    let (disk, root) = (mnt.join("disk"), mnt.join("root"));
    mkdir(&disk, 0o700)?;
    mkdir(&root, 0o755)?;
    Ok((disk, root))
}

/// Mounts the ext4 writable layer and the overlay root on top of the image's lowers.
pub fn overlay(
    device: &Path,
    disk: &Path,
    root: &Path,
    lowers: &[PathBuf],
    hide: &[String],
) -> Result<(), RootfsError> {
    let dev = device.to_string_lossy();
    // nodev on both: a device node in an image or written by the sandbox opens nothing
    // (the sandbox's /dev is a separate tmpfs with a few nodes bound in).
    m(
        "mount disk",
        Some(&dev),
        disk,
        Some("ext4"),
        MsFlags::MS_NODEV,
        None,
    )?;
    overlay_on(disk, root, lowers, hide)
}

/// Mounts the overlay root on top of the image's lowers, its upper layer in `disk` (the
/// writable layer, mounted there already: by [`overlay`], or a prepared disk attached).
/// `hide`: paths of the lowers the sandbox must not see (see [`hide_in_upper`]).
pub fn overlay_on(
    disk: &Path,
    root: &Path,
    lowers: &[PathBuf],
    hide: &[String],
) -> Result<(), RootfsError> {
    let (upper, work) = (disk.join("upper"), disk.join("work"));
    mkdir(&upper, 0o755)?;
    mkdir(&work, 0o700)?;
    // overlayfs refuses a lower named twice. The same layer twice in a row is the same tree
    // as once (an image packed from a sandbox that changed nothing ends with the empty
    // layer its parent ended with), so a run of one layer counts once.
    let mut lowers = lowers.to_vec();
    lowers.dedup();
    let lowers = lowers.as_slice();
    for p in hide {
        hide_in_upper(&upper, lowers, p)?;
    }
    let lower: Vec<String> = lowers
        .iter()
        .map(|l| l.to_string_lossy().into_owned())
        .collect();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.join(":"),
        upper.display(),
        work.display()
    );
    if opts.len() <= MAX_MOUNT_OPTIONS {
        return m(
            "mount overlay",
            Some("overlay"),
            root,
            Some("overlay"),
            MsFlags::MS_NODEV,
            Some(&opts),
        );
    }
    overlay_staged(disk, root, lowers, &upper, &work)
}

/// The kernel reads at most one page of mount options; a little less leaves room for what
/// it adds.
const MAX_MOUNT_OPTIONS: usize = 4000;

/// Mounts an overlay whose lower paths do not fit in one page of options (an image of many
/// layers): each lower gets a short symlink (`<disk>/../lowers/<i>`), and the mount names the
/// links relative to that directory, which this process enters for the mount alone
/// (overlayfs resolves lower paths, links included, when it mounts).
fn overlay_staged(
    disk: &Path,
    root: &Path,
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
) -> Result<(), RootfsError> {
    let links = disk.parent().unwrap_or(disk).join("lowers");
    let io = |what: &'static str, path: &Path| {
        let path = path.display().to_string();
        move |source| RootfsError::Io {
            step: what,
            path,
            source,
        }
    };
    if links.exists() {
        std::fs::remove_dir_all(&links).map_err(io("clear lower links", &links))?;
    }
    mkdir(&links, 0o700)?;
    let mut names = Vec::with_capacity(lowers.len());
    for (i, l) in lowers.iter().enumerate() {
        let name = i.to_string();
        std::os::unix::fs::symlink(l, links.join(&name)).map_err(io("link lower", l))?;
        names.push(name);
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        names.join(":"),
        upper.display(),
        work.display()
    );
    if opts.len() > MAX_MOUNT_OPTIONS {
        return Err(RootfsError::Io {
            step: "mount overlay",
            path: root.display().to_string(),
            source: std::io::Error::other(format!(
                "{} lower layers do not fit in one overlay mount",
                lowers.len()
            )),
        });
    }
    let back = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    std::env::set_current_dir(&links).map_err(io("enter lower links", &links))?;
    let mounted = m(
        "mount overlay",
        Some("overlay"),
        root,
        Some("overlay"),
        MsFlags::MS_NODEV,
        Some(&opts),
    );
    std::env::set_current_dir(&back).map_err(io("leave lower links", &back))?;
    mounted
}

/// Hides `path` (absolute, inside the sandbox) of the topmost lower that has it, through the
/// upper layer: a directory becomes opaque (`trusted.overlay.opaque`: empty, and what the
/// sandbox writes there goes to its own disk), a file gets a whiteout (a 0:0 character
/// device). Each directory made in the upper layer on the way takes the lower's mode and
/// owner, which the merged view shows. A path no lower has is left alone.
fn hide_in_upper(upper: &Path, lowers: &[PathBuf], path: &str) -> Result<(), RootfsError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let rel = Path::new(path.trim_start_matches('/'));
    let Some(lower) = lowers
        .iter()
        .find(|l| l.join(rel).symlink_metadata().is_ok())
    else {
        return Ok(());
    };
    // Parents first, as the lower has them.
    let mut made = upper.to_path_buf();
    let mut seen = lower.clone();
    let parts: Vec<_> = rel.components().collect();
    for (i, c) in parts.iter().enumerate() {
        made.push(c);
        seen.push(c);
        let last = i + 1 == parts.len();
        let md = io("stat", &seen, seen.symlink_metadata())?;
        if last && !md.is_dir() {
            if made.symlink_metadata().is_err() {
                let r = rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &made,
                    rustix::fs::FileType::CharacterDevice,
                    rustix::fs::Mode::empty(),
                    0,
                );
                io("whiteout", &made, r.map_err(std::io::Error::from))?;
            }
            return Ok(());
        }
        if !md.is_dir() {
            // A link or file on the way: nothing below it to hide this way.
            return Ok(());
        }
        if made.symlink_metadata().is_err() {
            io("mkdir", &made, fs::create_dir(&made))?;
            io(
                "chmod",
                &made,
                fs::set_permissions(&made, fs::Permissions::from_mode(md.mode() & 0o7777)),
            )?;
            io(
                "chown",
                &made,
                std::os::unix::fs::chown(&made, Some(md.uid()), Some(md.gid())),
            )?;
        }
        if last {
            let r = rustix::fs::setxattr(
                &made,
                "trusted.overlay.opaque",
                b"y",
                rustix::fs::XattrFlags::empty(),
            );
            io("make opaque", &made, r.map_err(std::io::Error::from))?;
        }
    }
    Ok(())
}

/// /proc (of the new pid namespace: the caller must be its PID 1), /dev, /sys read-only with
/// the sandbox's cgroup, /run/opendsec with the agent and aether's config.
pub fn populate(root: &Path, spec: &SetupSpec) -> Result<(), RootfsError> {
    let proc_ = root.join("proc");
    mkdir(&proc_, 0o555)?;
    m(
        "mount proc",
        Some("proc"),
        &proc_,
        Some("proc"),
        NOSUID_NODEV_NOEXEC,
        None,
    )?;
    dev(root)?;
    let sys = root.join("sys");
    mkdir(&sys, 0o555)?;
    m(
        "mount sysfs",
        Some("sysfs"),
        &sys,
        Some("sysfs"),
        NOSUID_NODEV_NOEXEC | MsFlags::MS_RDONLY,
        None,
    )?;
    cgroup(root, spec)?;
    run(root, spec)
}

fn dev(root: &Path) -> Result<(), RootfsError> {
    let dev = root.join("dev");
    mkdir(&dev, 0o755)?;
    m(
        "mount /dev",
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )?;
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(name);
        touch(&target)?;
        let src = Path::new("/dev").join(name);
        let s = src.to_string_lossy();
        m(
            "bind device",
            Some(&s),
            &target,
            None,
            MsFlags::MS_BIND,
            None,
        )?;
    }
    let pts = dev.join("pts");
    mkdir(&pts, 0o755)?;
    m(
        "mount devpts",
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )?;
    let shm = dev.join("shm");
    mkdir(&shm, 0o1777)?;
    m(
        "mount /dev/shm",
        Some("shm"),
        &shm,
        Some("tmpfs"),
        NOSUID_NODEV_NOEXEC,
        Some("mode=1777,size=65536k"),
    )?;
    let mq = dev.join("mqueue");
    mkdir(&mq, 0o755)?;
    m(
        "mount mqueue",
        Some("mqueue"),
        &mq,
        Some("mqueue"),
        NOSUID_NODEV_NOEXEC,
        None,
    )?;
    for (link, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let p = dev.join(link);
        io("symlink", &p, symlink(to, &p))?;
    }
    Ok(())
}

fn cgroup(root: &Path, spec: &SetupSpec) -> Result<(), RootfsError> {
    let cg = root.join("sys/fs/cgroup");
    if !cg.is_dir() || spec.cgroup_mounts.is_empty() {
        return Ok(());
    }
    let ro_bind = |src: &Path, target: &Path| -> Result<(), RootfsError> {
        let s = src.to_string_lossy();
        m(
            "bind cgroup",
            Some(&s),
            target,
            None,
            MsFlags::MS_BIND,
            None,
        )?;
        m(
            "remount cgroup read-only",
            None,
            target,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
            None,
        )
    };
    if let [(dir, name)] = spec.cgroup_mounts.as_slice() {
        if name.is_empty() {
            return ro_bind(dir, &cg);
        }
    }
    m(
        "mount cgroup tmpfs",
        Some("tmpfs"),
        &cg,
        Some("tmpfs"),
        NOSUID_NODEV_NOEXEC,
        Some("mode=755,size=64k"),
    )?;
    for (dir, name) in &spec.cgroup_mounts {
        let target = cg.join(name);
        mkdir(&target, 0o555)?;
        ro_bind(dir, &target)?;
    }
    m(
        "remount cgroup tmpfs read-only",
        None,
        &cg,
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
        Some("mode=755,size=64k"),
    )
}

fn run(root: &Path, spec: &SetupSpec) -> Result<(), RootfsError> {
    let run = root.join("run");
    mkdir(&run, 0o755)?;
    m(
        "mount /run",
        Some("tmpfs"),
        &run,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=755"),
    )?;
    let inside = |p: &str| root.join(p.trim_start_matches('/'));
    let agent = inside(AGENT_PATH);
    if let Some(parent) = agent.parent() {
        mkdir(parent, 0o755)?;
    }
    touch(&agent)?;
    let src = spec.agent.to_string_lossy();
    // The file itself is bound (not its directory), so the sandbox keeps this inode even if
    // the agent is replaced on the host.
    m(
        "bind agent",
        Some(&src),
        &agent,
        None,
        MsFlags::MS_BIND,
        None,
    )?;
    m(
        "remount agent read-only",
        None,
        &agent,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NODEV,
        None,
    )?;
    let cfg = inside(AETHER_CONFIG);
    let json = serde_json::to_vec(&spec.aether).unwrap_or_default();
    io("write aether config", &cfg, fs::write(&cfg, json))?;
    io(
        "chmod aether config",
        &cfg,
        fs::set_permissions(&cfg, fs::Permissions::from_mode(0o600)),
    )?;
    // Read-only, as the agent is: the sandbox's root (without CAP_SYS_ADMIN) can neither
    // rewrite it nor remove the mount point (found by a fresh user's trial).
    let cfg_src = cfg.to_string_lossy().into_owned();
    m(
        "bind aether config",
        Some(&cfg_src),
        &cfg,
        None,
        MsFlags::MS_BIND,
        None,
    )?;
    m(
        "remount aether config read-only",
        None,
        &cfg,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
        None,
    )?;
    mkdir(&inside("/run/opendsec/sessions"), 0o711)
}

/// Makes `root` the process's root: the pivot_root(".", ".") of runc, then detaches the old
/// root, so nothing of the host's tree stays reachable.
pub fn pivot(root: &Path) -> Result<(), RootfsError> {
    io("chdir", root, std::env::set_current_dir(root))?;
    nix::unistd::pivot_root(".", ".").map_err(|source| RootfsError::Mount {
        step: "pivot_root",
        path: root.display().to_string(),
        source,
    })?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|source| RootfsError::Mount {
        step: "detach old root",
        path: "/".into(),
        source,
    })?;
    io("chdir /", Path::new("/"), std::env::set_current_dir("/"))
}

/// After the pivot: Docker's masked and read-only paths plus the caller's. A missing path
/// is skipped; paths resolve inside the sandbox's root.
pub fn restrict(readonly: &[String], masked: &[String]) -> Result<(), RootfsError> {
    let masked_all = DEFAULT_MASKED
        .iter()
        .map(|s| s.to_string())
        .chain(masked.iter().cloned());
    for p in masked_all {
        let path = Path::new(&p);
        let Ok(meta) = fs::metadata(path) else {
            continue;
        };
        if meta.is_dir() {
            m(
                "mask directory",
                Some("tmpfs"),
                path,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
                Some("size=0,mode=555"),
            )?;
        } else {
            m(
                "mask file",
                Some("/dev/null"),
                path,
                None,
                MsFlags::MS_BIND,
                None,
            )?;
        }
    }
    let ro_all = DEFAULT_READONLY
        .iter()
        .map(|s| s.to_string())
        .chain(readonly.iter().cloned());
    for p in ro_all {
        let path = Path::new(&p);
        if fs::symlink_metadata(path).is_err() {
            continue;
        }
        m(
            "bind read-only path",
            Some(&p),
            path,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None,
        )?;
        m(
            "remount read-only path",
            None,
            path,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
            None,
        )?;
    }
    Ok(())
}
