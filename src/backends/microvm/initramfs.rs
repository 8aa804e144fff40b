//! The guest's initramfs (docs/microvm.md "Guest kernel"): aether as `/init`, and the kernel
//! modules a modular kernel (Debian's cloud kernel) needs before it can see its disks and
//! the agent port, in load order. Written as a `newc` cpio archive, uncompressed (the
//! kernel unpacks it faster than it would inflate it under TCG). Built once per node and
//! kernel and shared by every VM.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Modules loaded before anything else, dependencies first (a kernel with them built in
/// has none of these files; a missing one is skipped unless it is [`REQUIRED`]).
pub const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio-rng",
    "virtio_balloon",
    "libcrc32c",
    "erofs",
    "overlay",
];

/// What a guest cannot come up without (its disks and the agent port): each must be a
/// module file or built in (`modules.builtin`), or the initramfs is refused.
pub const REQUIRED: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
];

/// The file names a module may have in a kernel's package, plain first.
const MODULE_SUFFIXES: &[&str] = &[".ko", ".ko.xz", ".ko.zst", ".ko.gz"];

/// Where aether finds the modules in the initramfs, and the file naming their order.
pub const MODULE_DIR: &str = "modules";
pub const MODULE_ORDER: &str = "modules/order";

/// One member of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Dir {
        path: String,
        mode: u32,
    },
    File {
        path: String,
        mode: u32,
        data: Vec<u8>,
    },
    /// A character device node (`/dev/console` for the kernel to open as init's stdio
    /// before anything mounts devtmpfs).
    CharDev {
        path: String,
        mode: u32,
        major: u32,
        minor: u32,
    },
}

/// Writes `entries` as a newc archive (with its trailer) to `w`.
pub fn write_newc<W: Write>(w: &mut W, entries: &[Entry]) -> std::io::Result<()> {
    let mut offset = 0usize;
    let put = |w: &mut W, b: &[u8], offset: &mut usize| -> std::io::Result<()> {
        w.write_all(b)?;
        *offset += b.len();
        Ok(())
    };
    let pad = |w: &mut W, offset: &mut usize| -> std::io::Result<()> {
        let n = (4 - *offset % 4) % 4;
        w.write_all([0u8; 3].get(..n).unwrap_or_default())?;
        *offset += n;
        Ok(())
    };
    let trailer = Entry::File {
        path: "TRAILER!!!".into(),
        mode: 0,
        data: Vec::new(),
    };
    for (ino, e) in entries.iter().chain(std::iter::once(&trailer)).enumerate() {
        let (path, mode, data, rdev): (&str, u32, &[u8], (u32, u32)) = match e {
            Entry::Dir { path, mode } => (path, 0o040000 | mode, &[], (0, 0)),
            Entry::File { path, mode, data } if path == "TRAILER!!!" => (path, *mode, data, (0, 0)),
            Entry::File { path, mode, data } => (path, 0o100000 | mode, data, (0, 0)),
            Entry::CharDev {
                path,
                mode,
                major,
                minor,
            } => (path, 0o020000 | mode, &[], (*major, *minor)),
        };
        let nlink = if matches!(e, Entry::Dir { .. }) { 2 } else { 1 };
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            ino + 1,
            mode,
            0,
            0,
            nlink,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            path.len() + 1,
            0
        );
        put(w, header.as_bytes(), &mut offset)?;
        put(w, path.as_bytes(), &mut offset)?;
        put(w, &[0], &mut offset)?;
        pad(w, &mut offset)?;
        put(w, data, &mut offset)?;
        pad(w, &mut offset)?;
    }
    Ok(())
}

/// Why the initramfs could not be made.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A module the guest needs is neither in `dir` nor built into the kernel.
    #[error("kernel module {name} is neither under {dir} nor built in (modules.builtin)")]
    MissingModule { name: String, dir: PathBuf },
}

/// The modules directory of `kernel` (`.../boot/vmlinuz-<release>` →
/// `.../lib/modules/<release>`), when there is one: an installed kernel's, or one unpacked
/// from its package into a directory of its own.
pub fn modules_of(kernel: &Path) -> Option<PathBuf> {
    let name = kernel.file_name()?.to_str()?;
    let release = name.strip_prefix("vmlinuz-")?;
    let root = kernel.parent()?.parent()?;
    let dir = root.join("lib/modules").join(release);
    dir.is_dir().then_some(dir)
}

/// Finds module `name`'s file under `dir` (any depth, plain or compressed) and returns it
/// with its file name.
fn find_module(dir: &Path, name: &str) -> Option<(PathBuf, String)> {
    let wanted: Vec<String> = MODULE_SUFFIXES
        .iter()
        .map(|x| format!("{name}{x}"))
        .collect();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let file = e.file_name().to_string_lossy().into_owned();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(p),
                Ok(t) if t.is_file() && wanted.contains(&file) => return Some((p, file)),
                _ => {}
            }
        }
    }
    None
}

/// Whether `modules.builtin` in `dir` lists module `name` (lines such as
/// `kernel/drivers/block/virtio_blk.ko`; `-` and `_` are the same in module names).
fn built_in(dir: &Path, name: &str) -> bool {
    let norm = |n: &str| n.replace('-', "_");
    let want = norm(name);
    std::fs::read_to_string(dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .any(|f| norm(f.split(".ko").next().unwrap_or(f)) == want)
}

/// Writes the guest initramfs to `out` (atomically: a temporary file of its own renamed, so
/// builders racing for the same `out` each leave a whole one): `agent` as `/init`,
/// `/dev/console` and `/dev/null`, and, from `modules` when given, the [`MODULES`] it has
/// with their order (a kernel given no modules directory is taken to have them built in).
/// Returns the modules included. Errors: `MissingModule` for a [`REQUIRED`] module neither
/// there nor built in; the file that could not be read or written.
pub fn build(
    agent: &Path,
    modules: Option<&Path>,
    out: &Path,
) -> Result<Vec<String>, InitramfsError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| InitramfsError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    let mut entries = vec![
        Entry::Dir {
            path: "dev".into(),
            mode: 0o755,
        },
        Entry::CharDev {
            path: "dev/console".into(),
            mode: 0o600,
            major: 5,
            minor: 1,
        },
        Entry::CharDev {
            path: "dev/null".into(),
            mode: 0o666,
            major: 1,
            minor: 3,
        },
        Entry::Dir {
            path: "proc".into(),
            mode: 0o555,
        },
        Entry::Dir {
            path: "sys".into(),
            mode: 0o555,
        },
        Entry::Dir {
            path: "run".into(),
            mode: 0o755,
        },
        Entry::Dir {
            path: "mnt".into(),
            mode: 0o755,
        },
        Entry::Dir {
            path: MODULE_DIR.into(),
            mode: 0o755,
        },
        Entry::File {
            path: "init".into(),
            mode: 0o755,
            data: read(agent)?,
        },
    ];
    let mut included = Vec::new();
    if let Some(dir) = modules {
        for m in MODULES {
            match find_module(dir, m) {
                Some((p, file)) => {
                    entries.push(Entry::File {
                        path: format!("{MODULE_DIR}/{file}"),
                        mode: 0o644,
                        data: read(&p)?,
                    });
                    included.push(file);
                }
                None if REQUIRED.contains(m) && !built_in(dir, m) => {
                    return Err(InitramfsError::MissingModule {
                        name: (*m).to_string(),
                        dir: dir.to_path_buf(),
                    });
                }
                None => {}
            }
        }
    }
    entries.push(Entry::File {
        path: MODULE_ORDER.into(),
        mode: 0o644,
        data: included.join("\n").into_bytes(),
    });
    let tmp = out.with_extension(format!(
        "tmp.{}.{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let werr = |source| InitramfsError::Write {
        path: out.to_path_buf(),
        source,
    };
    let written = (|| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        write_newc(&mut f, &entries)?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, out)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(werr(e));
    }
    Ok(included)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archive_lists_its_members_as_cpio_reads_them() {
        let mut buf = Vec::new();
        write_newc(
            &mut buf,
            &[
                Entry::Dir {
                    path: "modules".into(),
                    mode: 0o755,
                },
                Entry::CharDev {
                    path: "modules/console".into(),
                    mode: 0o600,
                    major: 5,
                    minor: 1,
                },
                Entry::File {
                    path: "modules/order".into(),
                    mode: 0o644,
                    data: b"virtio\nvirtio_blk".to_vec(),
                },
            ],
        )
        .expect("write");
        assert_eq!(buf.len() % 4, 0);
        let text = String::from_utf8_lossy(&buf);
        assert!(text.starts_with("070701"));
        assert!(text.contains("modules/order\0"));
        assert!(text.contains("virtio\nvirtio_blk"));
        assert!(text.contains("TRAILER!!!\0"));
        // The node's header carries its device numbers (rdevmajor, rdevminor: the 10th
        // and 11th of its 8-digit fields).
        let at = text.find("modules/console\0").expect("node") - 110;
        let field = |i: usize| &text[at + 6 + 8 * i..at + 14 + 8 * i];
        assert_eq!(
            (field(1), field(9), field(10)),
            ("00002180", "00000005", "00000001")
        );
        // Where busybox is there, its cpio lists exactly our members.
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("a.cpio");
        std::fs::write(&path, &buf).expect("save");
        if let Ok(out) = std::process::Command::new("busybox")
            .args(["cpio", "-t", "-F"])
            .arg(&path)
            .output()
        {
            let listed = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                listed.lines().collect::<Vec<_>>(),
                ["modules", "modules/console", "modules/order"]
            );
            // The node is a character device 5,1 (`crw-------`, "5, 1" in the size column).
            let out = std::process::Command::new("busybox")
                .args(["cpio", "-tv", "-F"])
                .arg(&path)
                .output()
                .expect("cpio -tv");
            let long = String::from_utf8_lossy(&out.stdout).into_owned();
            let node = long
                .lines()
                .find(|l| l.ends_with("modules/console"))
                .expect("listed");
            assert!(node.starts_with("crw-------"), "{node}");
        }
    }

    #[test]
    fn the_modules_of_a_kernel_are_found_beside_it_and_taken_in_order() {
        let root = tempfile::tempdir().expect("dir");
        let boot = root.path().join("boot");
        let mods = root
            .path()
            .join("lib/modules/6.1.0-x-cloud-amd64/kernel/drivers");
        std::fs::create_dir_all(&boot).expect("boot");
        std::fs::create_dir_all(mods.join("virtio")).expect("mods");
        std::fs::write(boot.join("vmlinuz-6.1.0-x-cloud-amd64"), b"k").expect("kernel");
        std::fs::write(mods.join("virtio/virtio_blk.ko"), b"blk").expect("blk");
        std::fs::write(mods.join("virtio/virtio.ko"), b"core").expect("core");
        std::fs::write(mods.join("erofs.ko.xz"), b"xz").expect("erofs");
        let kernel = boot.join("vmlinuz-6.1.0-x-cloud-amd64");
        let dir = modules_of(&kernel).expect("modules dir");
        assert!(dir.ends_with("lib/modules/6.1.0-x-cloud-amd64"));
        assert_eq!(modules_of(&root.path().join("bzImage")), None);
        let agent = root.path().join("agent");
        std::fs::write(&agent, b"#!agent").expect("agent");
        let out = root.path().join("initrd");
        // The required modules this kernel lacks as files must be built in.
        match build(&agent, Some(&dir), &out) {
            Err(InitramfsError::MissingModule { name, .. }) => assert_eq!(name, "virtio_ring"),
            other => panic!("{other:?}"),
        }
        assert!(!out.exists());
        std::fs::write(
            dir.join("modules.builtin"),
            "kernel/drivers/virtio/virtio_ring.ko\nkernel/drivers/virtio/virtio_mmio.ko\n\
             kernel/drivers/char/virtio_console.ko\n",
        )
        .expect("builtin");
        let got = build(&agent, Some(&dir), &out).expect("build");
        assert_eq!(got, ["virtio.ko", "virtio_blk.ko", "erofs.ko.xz"]);
        let text = String::from_utf8_lossy(&std::fs::read(&out).expect("read")).into_owned();
        assert!(text.contains("init\0") && text.contains("#!agent"));
        assert!(text.contains("virtio.ko\nvirtio_blk.ko\nerofs.ko.xz"));
        assert!(text.contains("dev/console\0") && text.contains("dev/null\0"));
        let left: Vec<_> = std::fs::read_dir(root.path())
            .expect("list")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
