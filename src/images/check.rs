//! `image store-check` (docs/images.md "Checking a file system"): whether a directory (a newly
//! mounted NAS, say) can hold the image store. Each item does, in a scratch directory under
//! the store's `tmp/`, what the store relies on, and reports `ok` or why not. Items that are
//! not required (finding the holes of sparse files, `trusted.*` xattrs) only warn.
//! The scratch directory is removed at the end; one left by a crash is `image gc`'s.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{symlink, FileTypeExt, MetadataExt};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use rustix::fs::{FileType, Mode};

/// One checked item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckItem {
    /// What is checked, and why the store needs it.
    pub what: &'static str,
    /// A failure rules the file system out (otherwise it only warns).
    pub required: bool,
    /// `Err(why)` when the file system failed it.
    pub result: Result<(), String>,
}

/// A user id and group id no image file has here, for the chown item.
const OTHER_ID: u32 = 4_242_424;

type Item = (&'static str, bool, fn(&Path) -> Result<(), String>);

const ITEMS: &[Item] = &[
    ("write, sync and read back a file", true, write_sync_read),
    (
        "files a root process creates are root's (no root squash)",
        true,
        root_owned,
    ),
    (
        "chown to another user (image files keep their owners)",
        true,
        chown_other,
    ),
    (
        "exclusive create (one edge builds a VM disk at a time)",
        true,
        exclusive_create,
    ),
    (
        "rename a file over another (manifests, records)",
        true,
        rename_over,
    ),
    (
        "rename a directory (layers are published so)",
        true,
        rename_dir,
    ),
    ("hard links (snapshots link their disks)", true, hard_links),
    ("symbolic links", true, symlinks),
    (
        "finds the holes of sparse files (snapshots move only their data; NFS needs vers=4.2)",
        false,
        sparse_holes,
    ),
    (
        "0:0 character devices (layer whiteouts)",
        true,
        whiteout_devices,
    ),
    (
        "overlay over layers kept here, whiteouts honored",
        true,
        overlay_here,
    ),
    ("trusted.* xattrs", false, |d| {
        xattr(d, "trusted.opendsec-check")
    }),
    ("user.* xattrs", true, |d| xattr(d, "user.opendsec-check")),
];

/// Runs every item against `dir` (made if missing) and returns them in order. Errors: only
/// when the scratch directory cannot be made at all (then nothing can be checked).
pub fn store_check(dir: &Path) -> io::Result<Vec<CheckItem>> {
    let tmp = dir.join("tmp");
    fs::create_dir_all(&tmp)?;
    let scratch = tmp.join(format!(
        "store-check-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    fs::create_dir(&scratch)?;
    let mut out = Vec::with_capacity(ITEMS.len());
    for (i, (what, required, f)) in ITEMS.iter().enumerate() {
        let d = scratch.join(i.to_string());
        let result = fs::create_dir(&d)
            .map_err(|e| format!("making {}: {e}", d.display()))
            .and_then(|()| f(&d));
        out.push(CheckItem {
            what,
            required: *required,
            result,
        });
    }
    let _ = fs::remove_dir_all(&scratch);
    Ok(out)
}

fn e(what: &str) -> impl Fn(io::Error) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn write_sync_read(d: &Path) -> Result<(), String> {
    let p = d.join("f");
    let body: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut f = File::create(&p).map_err(e("create"))?;
    f.write_all(&body).map_err(e("write"))?;
    f.sync_all().map_err(e("fsync"))?;
    drop(f);
    let mut back = Vec::new();
    File::open(&p)
        .and_then(|mut f| f.read_to_end(&mut back))
        .map_err(e("read back"))?;
    if back != body {
        return Err("the bytes read back differ from those written".into());
    }
    Ok(())
}

fn root_owned(d: &Path) -> Result<(), String> {
    let p = d.join("f");
    File::create(&p).map_err(e("create"))?;
    let m = fs::metadata(&p).map_err(e("stat"))?;
    let (uid, gid) = (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    if (m.uid(), m.gid()) != (uid, gid) {
        return Err(format!(
            "a file made by {uid}:{gid} is owned by {}:{} (root squash?)",
            m.uid(),
            m.gid()
        ));
    }
    if uid != 0 {
        return Err(format!("this runs as uid {uid}, not root; run it as root"));
    }
    Ok(())
}

fn chown_other(d: &Path) -> Result<(), String> {
    let p = d.join("f");
    File::create(&p).map_err(e("create"))?;
    std::os::unix::fs::chown(&p, Some(OTHER_ID), Some(OTHER_ID)).map_err(e("chown"))?;
    let m = fs::metadata(&p).map_err(e("stat"))?;
    if (m.uid(), m.gid()) != (OTHER_ID, OTHER_ID) {
        return Err(format!(
            "chown to {OTHER_ID}:{OTHER_ID} left it {}:{}",
            m.uid(),
            m.gid()
        ));
    }
    Ok(())
}

fn exclusive_create(d: &Path) -> Result<(), String> {
    let p = d.join("f");
    let excl = || OpenOptions::new().write(true).create_new(true).open(&p);
    excl().map_err(e("first exclusive create"))?;
    match excl() {
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(err) => Err(format!("a second exclusive create failed otherwise: {err}")),
        Ok(_) => Err("a second exclusive create of the same name succeeded".into()),
    }
}

fn rename_over(d: &Path) -> Result<(), String> {
    let (a, b) = (d.join("new"), d.join("old"));
    fs::write(&b, b"old").map_err(e("write old"))?;
    fs::write(&a, b"new").map_err(e("write new"))?;
    fs::rename(&a, &b).map_err(e("rename over"))?;
    match fs::read(&b) {
        Ok(v) if v == b"new" => Ok(()),
        Ok(_) => Err("after the rename the file holds the old contents".into()),
        Err(err) => Err(format!("read after rename: {err}")),
    }
}

fn rename_dir(d: &Path) -> Result<(), String> {
    let a = d.join("staged");
    fs::create_dir_all(a.join("rootfs/etc")).map_err(e("mkdir"))?;
    fs::write(a.join("rootfs/etc/f"), b"x").map_err(e("write"))?;
    let b = d.join("placed");
    fs::rename(&a, &b).map_err(e("rename a directory"))?;
    if !b.join("rootfs/etc/f").is_file() || a.exists() {
        return Err("the renamed directory is not whole in its new place".into());
    }
    Ok(())
}

fn hard_links(d: &Path) -> Result<(), String> {
    let (a, b) = (d.join("a"), d.join("b"));
    fs::write(&a, b"x").map_err(e("write"))?;
    fs::hard_link(&a, &b).map_err(e("link"))?;
    let (ma, mb) = (
        fs::metadata(&a).map_err(e("stat"))?,
        fs::metadata(&b).map_err(e("stat"))?,
    );
    if ma.ino() != mb.ino() || ma.nlink() != 2 {
        return Err(format!(
            "the link is not the same file (inodes {} and {}, {} links)",
            ma.ino(),
            mb.ino(),
            ma.nlink()
        ));
    }
    Ok(())
}

fn symlinks(d: &Path) -> Result<(), String> {
    let p = d.join("l");
    symlink("../somewhere/else", &p).map_err(e("symlink"))?;
    match fs::read_link(&p) {
        Ok(t) if t == Path::new("../somewhere/else") => Ok(()),
        Ok(t) => Err(format!("the link reads back as {}", t.display())),
        Err(err) => Err(format!("readlink: {err}")),
    }
}

fn sparse_holes(d: &Path) -> Result<(), String> {
    let p = d.join("sparse");
    let mut f = File::create(&p).map_err(e("create"))?;
    // Data at 0 and at 64 MiB, a hole between.
    f.write_all(&[1u8; 4096]).map_err(e("write"))?;
    f.seek(SeekFrom::Start(64 << 20)).map_err(e("seek"))?;
    f.write_all(&[1u8; 4096]).map_err(e("write"))?;
    f.sync_all().map_err(e("fsync"))?;
    let hole = rustix::fs::seek(&f, rustix::fs::SeekFrom::Hole(0))
        .map_err(|err| format!("SEEK_HOLE: {err}"))?;
    if hole >= 64 << 20 {
        return Err(format!(
            "SEEK_HOLE finds no hole before the data at 64 MiB (first hole at {hole})"
        ));
    }
    Ok(())
}

fn whiteout_devices(d: &Path) -> Result<(), String> {
    let p = d.join("wh");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &p,
        FileType::CharacterDevice,
        Mode::empty(),
        0,
    )
    .map_err(|err| format!("mknod 0:0: {err}"))?;
    let m = fs::symlink_metadata(&p).map_err(e("stat"))?;
    if !m.file_type().is_char_device() || m.rdev() != 0 {
        return Err(format!(
            "it reads back as another kind (rdev {:#x})",
            m.rdev()
        ));
    }
    Ok(())
}

/// Two lower layers here, the top one deleting a file of the bottom one with a whiteout
/// device: a read-only overlay of them must hide the file and show the rest. Mounted on a
/// directory outside the store (overlayfs refuses lowers on some network file systems).
fn overlay_here(d: &Path) -> Result<(), String> {
    let (bottom, top) = (d.join("bottom"), d.join("top"));
    fs::create_dir_all(bottom.join("etc")).map_err(e("mkdir"))?;
    fs::create_dir_all(top.join("etc")).map_err(e("mkdir"))?;
    fs::write(bottom.join("etc/gone"), b"g").map_err(e("write"))?;
    fs::write(bottom.join("etc/kept"), b"k").map_err(e("write"))?;
    rustix::fs::mknodat(
        rustix::fs::CWD,
        top.join("etc/gone"),
        FileType::CharacterDevice,
        Mode::empty(),
        0,
    )
    .map_err(|err| format!("mknod the whiteout: {err}"))?;
    let target = MountPoint::new()?;
    let opts = format!("lowerdir={}:{}", top.display(), bottom.display());
    let opts_c = CString::new(opts.clone()).map_err(|_| "a path holds a NUL".to_string())?;
    mount(
        Some("overlay"),
        target.path(),
        Some("overlay"),
        MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        Some(opts_c.as_c_str()),
    )
    .map_err(|err| format!("mount -t overlay -o {opts}: {err}"))?;
    let seen = (
        target.path().join("etc/gone").exists(),
        fs::read(target.path().join("etc/kept")),
    );
    let _ = umount2(target.path(), MntFlags::MNT_DETACH);
    match seen {
        (false, Ok(k)) if k == b"k" => Ok(()),
        (true, _) => Err("the whiteout did not hide the file below it".into()),
        (_, Ok(_)) => Err("the kept file reads back wrong".into()),
        (_, Err(err)) => Err(format!("reading through the overlay: {err}")),
    }
}

fn xattr(d: &Path, name: &str) -> Result<(), String> {
    let p = d.join("f");
    File::create(&p).map_err(e("create"))?;
    rustix::fs::setxattr(&p, name, b"1", rustix::fs::XattrFlags::empty())
        .map_err(|err| format!("setxattr {name}: {err}"))?;
    let mut buf = [0u8; 8];
    let n = rustix::fs::getxattr(&p, name, &mut buf)
        .map_err(|err| format!("getxattr {name}: {err}"))?;
    if buf.get(..n) != Some(&b"1"[..]) {
        return Err(format!("{name} reads back differently"));
    }
    Ok(())
}

/// An empty directory under the system's temporary directory, removed when dropped.
struct MountPoint(std::path::PathBuf);

impl MountPoint {
    fn new() -> Result<MountPoint, String> {
        let p = std::env::temp_dir().join(format!(
            "opendsec-store-check-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        fs::create_dir(&p).map_err(e("a mount point"))?;
        Ok(MountPoint(p))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for MountPoint {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.0);
    }
}

/// The lines `image store-check` prints (`ok ITEM`, `FAIL ITEM: why` for a required item,
/// `warn ITEM: why` for another) and whether every required item passed.
pub fn report(dir: &Path, items: &[CheckItem]) -> (Vec<String>, bool) {
    let mut lines = Vec::with_capacity(items.len() + 1);
    let mut failed = 0;
    for i in items {
        lines.push(match &i.result {
            Ok(()) => format!("ok   {}", i.what),
            Err(why) if i.required => {
                failed += 1;
                format!("FAIL {}: {why}", i.what)
            }
            Err(why) => format!("warn {}: {why} (not required)", i.what),
        });
    }
    lines.push(if failed == 0 {
        format!("{} can hold the image store", dir.display())
    } else {
        format!(
            "{} cannot hold the image store: {failed} required item(s) failed",
            dir.display()
        )
    });
    (lines, failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_file_system_passes_every_required_item_and_leaves_nothing() {
        if !crate::sys::root_or_skip("store-check") {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let items = store_check(d.path()).unwrap();
        assert_eq!(items.len(), ITEMS.len());
        for i in &items {
            if i.required {
                assert_eq!(i.result, Ok(()), "{}", i.what);
            }
        }
        assert_eq!(
            fs::read_dir(d.path().join("tmp")).unwrap().count(),
            0,
            "the scratch directory is removed"
        );
        let (lines, ok) = report(d.path(), &items);
        assert!(ok, "{lines:?}");
        assert!(lines.last().unwrap().ends_with("can hold the image store"));
    }

    #[test]
    fn a_failed_required_item_rules_the_file_system_out_and_an_optional_one_warns() {
        let item = |what, required, result| CheckItem {
            what,
            required,
            result,
        };
        let items = [
            item("a", true, Ok(())),
            item("holes", false, Err("no SEEK_HOLE".to_string())),
        ];
        let (lines, ok) = report(Path::new("/mnt/s"), &items);
        assert!(ok);
        assert_eq!(lines[1], "warn holes: no SEEK_HOLE (not required)");
        let items = [item("chown", true, Err("EPERM".to_string()))];
        let (lines, ok) = report(Path::new("/mnt/s"), &items);
        assert!(!ok);
        assert_eq!(
            lines,
            [
                "FAIL chown: EPERM",
                "/mnt/s cannot hold the image store: 1 required item(s) failed"
            ]
        );
    }
}
