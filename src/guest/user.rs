//! Session users: resolving a `user` parameter (a name or `uid[:gid]`, docs/concepts.md) against
//! the sandbox's own /etc/passwd and /etc/group (never the host's NSS), and the environment a
//! session or process of that user starts with.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Why a user could not be resolved.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UserError {
    #[error("user {0:?} is not in the sandbox's /etc/passwd")]
    UnknownName(String),
    #[error("user {0:?} is not a name or uid[:gid]")]
    Malformed(String),
}

/// Who a session or process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (from /etc/group membership by name).
    pub groups: Vec<u32>,
    /// The login name, or the uid as text when /etc/passwd has none.
    pub name: String,
    /// Home directory (`/` when unknown).
    pub home: String,
    /// Login shell (`/bin/sh` when unknown).
    pub shell: String,
}

impl Credentials {
    /// root, whatever /etc/passwd says.
    pub fn root() -> Credentials {
        Credentials {
            uid: 0,
            gid: 0,
            groups: vec![],
            name: "root".into(),
            home: "/root".into(),
            shell: "/bin/sh".into(),
        }
    }
}

struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
    shell: String,
}

/// Most bytes of /etc/passwd or /etc/group read: the files are the sandbox's, and a huge
/// one must not make an agent hold it all.
const MAX_DB_BYTES: u64 = 4 << 20;

/// `path`'s text, at most [`MAX_DB_BYTES`] of it ("" when it cannot be read or is no
/// regular file); a line cut at the end is dropped.
fn read_db(path: &Path) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut buf = Vec::new();
    // Non-blocking, and a regular file only: the sandbox may put a FIFO there, which would
    // hold the reader (and the lock of `names`) for ever.
    let read = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .and_then(|f| {
            if f.metadata()?.is_file() {
                f.take(MAX_DB_BYTES).read_to_end(&mut buf)
            } else {
                Err(std::io::Error::other("not a regular file"))
            }
        });
    if read.is_err() {
        return String::new();
    }
    if buf.len() as u64 == MAX_DB_BYTES {
        let end = buf.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        buf.truncate(end);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

fn passwd(root: &Path) -> Vec<PasswdEntry> {
    let text = read_db(&root.join("etc/passwd"));
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            let [name, _, uid, gid, _, home, shell, ..] = f.as_slice() else {
                return None;
            };
            Some(PasswdEntry {
                name: name.to_string(),
                uid: uid.parse().ok()?,
                gid: gid.parse().ok()?,
                home: home.to_string(),
                shell: shell.to_string(),
            })
        })
        .collect()
}

fn groups_of(root: &Path, name: &str, primary: u32) -> Vec<u32> {
    let text = read_db(&root.join("etc/group"));
    let mut out: Vec<u32> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            let [_, _, gid, members, ..] = f.as_slice() else {
                return None;
            };
            if !members.split(',').any(|m| m == name) {
                return None;
            }
            gid.parse().ok()
        })
        .filter(|g| *g != primary)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Resolves `spec` (a name, `uid` or `uid:gid`; "" = root) against `<root>/etc/passwd`.
/// A numeric uid absent from passwd is allowed (gid = uid unless given, home `/`).
/// Errors: `UnknownName` for a name passwd lacks, `Malformed` otherwise.
pub fn resolve(spec: &str, root: &Path) -> Result<Credentials, UserError> {
    let spec = spec.trim();
    if spec.is_empty() || spec == "root" || spec == "0" {
        let entries = passwd(root);
        return Ok(match entries.into_iter().find(|e| e.uid == 0) {
            Some(e) => Credentials {
                uid: 0,
                gid: e.gid,
                groups: vec![],
                name: e.name,
                home: if e.home.is_empty() {
                    "/root".into()
                } else {
                    e.home
                },
                shell: if e.shell.is_empty() {
                    "/bin/sh".into()
                } else {
                    e.shell
                },
            },
            None => Credentials::root(),
        });
    }
    let entries = passwd(root);
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let gid_override = match group {
        Some(g) => Some(
            g.parse::<u32>()
                .map_err(|_| UserError::Malformed(spec.to_string()))?,
        ),
        None => None,
    };
    let found = if let Ok(uid) = user.parse::<u32>() {
        match entries.into_iter().find(|e| e.uid == uid) {
            Some(e) => e,
            None => PasswdEntry {
                name: uid.to_string(),
                uid,
                gid: gid_override.unwrap_or(uid),
                home: "/".into(),
                shell: "/bin/sh".into(),
            },
        }
    } else {
        if user.is_empty()
            || user.len() > 64
            || !user
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return Err(UserError::Malformed(spec.to_string()));
        }
        entries
            .into_iter()
            .find(|e| e.name == user)
            .ok_or_else(|| UserError::UnknownName(user.to_string()))?
    };
    let gid = gid_override.unwrap_or(found.gid);
    // (uid_t)-1 means "leave unchanged" to setresuid/setresgid: never a user.
    if found.uid == u32::MAX || gid == u32::MAX {
        return Err(UserError::Malformed(spec.to_string()));
    }
    let groups = groups_of(root, &found.name, gid);
    Ok(Credentials {
        uid: found.uid,
        gid,
        groups,
        name: found.name,
        home: if found.home.is_empty() {
            "/".into()
        } else {
            found.home
        },
        shell: if found.shell.is_empty() {
            "/bin/sh".into()
        } else {
            found.shell
        },
    })
}

/// The names of users and groups by number, from the sandbox's /etc/passwd and /etc/group
/// (file owners as `stat` and `list_dir` show them).
#[derive(Debug, Default)]
pub struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    /// Reads `<root>/etc/passwd` and `<root>/etc/group`; the first name of a number wins.
    pub fn load(root: &Path) -> Names {
        let mut n = Names::default();
        for e in passwd(root) {
            n.users.entry(e.uid).or_insert(e.name);
        }
        for l in read_db(&root.join("etc/group")).lines() {
            let f: Vec<&str> = l.split(':').collect();
            if let [name, _, gid, ..] = f.as_slice() {
                if let Ok(gid) = gid.parse::<u32>() {
                    n.groups.entry(gid).or_insert_with(|| name.to_string());
                }
            }
        }
        n
    }

    /// The user's name, or the uid as text.
    pub fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    /// The group's name, or the gid as text.
    pub fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

/// What identifies a version of a file: inode, size and change time (a rewrite in place
/// within the same nanosecond with the same size goes unseen, which costs a stale name).
type Stamp = Option<(u64, u64, i64, i64)>;

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.ino(), m.size(), m.ctime(), m.ctime_nsec()))
}

/// The sandbox's [`Names`] (root `/`), read again only when /etc/passwd or /etc/group
/// changed: two `stat` calls when they did not.
pub fn names() -> std::sync::Arc<Names> {
    use std::sync::{Arc, Mutex};
    type Cached = Option<((Stamp, Stamp), Arc<Names>)>;
    static CACHE: Mutex<Cached> = Mutex::new(None);
    let root = Path::new("/");
    let now = (
        stamp(&root.join("etc/passwd")),
        stamp(&root.join("etc/group")),
    );
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    match &*cache {
        Some((at, n)) if *at == now => n.clone(),
        _ => {
            let n = Arc::new(Names::load(root));
            *cache = Some((now, n.clone()));
            n
        }
    }
}

/// The default `PATH` when the image sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The environment a session or process of `creds` starts with: `PATH`, `HOME`, `USER`,
/// `LOGNAME`, then the image's variables, then the call's own (later ones win).
pub fn environ(
    creds: &Credentials,
    image_env: &BTreeMap<String, String>,
    extra: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".to_string(), creds.home.clone());
    env.insert("USER".to_string(), creds.name.clone());
    env.insert("LOGNAME".to_string(), creds.name.clone());
    for (k, v) in image_env.iter().chain(extra.iter()) {
        env.insert(k.clone(), v.clone());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with(passwd: &str, group: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(d.path().join("etc")).expect("mkdir");
        std::fs::write(d.path().join("etc/passwd"), passwd).expect("write");
        std::fs::write(d.path().join("etc/group"), group).expect("write");
        d
    }

    #[test]
    fn owners_are_named_from_the_sandbox_files_and_a_fifo_there_reads_as_none() {
        let d = root_with(
            "root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\nalias:x:1000:1000::/:/bin/sh\n",
            "root:x:0:\nstaff:x:50:\n",
        );
        let n = Names::load(d.path());
        assert_eq!(
            (n.user(0), n.user(1000), n.user(7)),
            ("root".into(), "alice".into(), "7".into())
        );
        assert_eq!(
            (n.group(50), n.group(1000)),
            ("staff".into(), "1000".into())
        );
        // A FIFO in place of /etc/passwd is no database: read at once as empty.
        std::fs::remove_file(d.path().join("etc/passwd")).expect("rm");
        nix::unistd::mkfifo(&d.path().join("etc/passwd"), nix::sys::stat::Mode::S_IRWXU)
            .expect("mkfifo");
        let n = Names::load(d.path());
        assert_eq!(n.user(0), "0");
        assert_eq!(n.group(0), "root");
    }

    #[test]
    fn names_uids_and_groups() {
        let d = root_with(
            "root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n",
            "root:x:0:\nalice:x:1000:\nwheel:x:10:alice,bob\n",
        );
        let r = resolve("", d.path()).expect("root");
        assert_eq!((r.uid, r.gid, r.home.as_str()), (0, 0, "/root"));
        let a = resolve("alice", d.path()).expect("alice");
        assert_eq!((a.uid, a.gid, a.groups.clone()), (1000, 1000, vec![10]));
        assert_eq!(a.home, "/home/alice");
        assert_eq!(resolve("1000", d.path()).expect("uid").name, "alice");
        let n = resolve("2000:3000", d.path()).expect("numeric");
        assert_eq!((n.uid, n.gid, n.home.as_str()), (2000, 3000, "/"));
        assert_eq!(
            resolve("mallory", d.path()),
            Err(UserError::UnknownName("mallory".into()))
        );
        assert!(matches!(
            resolve("a:b", d.path()),
            Err(UserError::Malformed(_))
        ));
        assert!(matches!(
            resolve("../x", d.path()),
            Err(UserError::Malformed(_))
        ));
        // (uid_t)-1 is "unchanged" to setresuid, never a user.
        for bad in ["4294967295", "5:4294967295"] {
            assert!(matches!(
                resolve(bad, d.path()),
                Err(UserError::Malformed(_))
            ));
        }
    }

    #[test]
    fn environment_layers() {
        let c = Credentials::root();
        let img = BTreeMap::from([("PATH".to_string(), "/x".to_string())]);
        let extra = BTreeMap::from([("A".to_string(), "1".to_string())]);
        let e = environ(&c, &img, &extra);
        assert_eq!(e["PATH"], "/x");
        assert_eq!(e["A"], "1");
        assert_eq!(e["HOME"], "/root");
    }
}
