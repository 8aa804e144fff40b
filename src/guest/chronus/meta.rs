//! File metadata (docs/python-sdk.md "File metadata"): string pairs kept on a file as its
//! `user.e2b.<key>` extended attributes, the names E2B's envd uses, so a file tagged
//! through either API reads the same through the other, and metadata set by a process in
//! the sandbox (`setfattr -n user.e2b.k -v v f`) shows as well.
//!
//! Reading never fails a call: an entry whose attributes cannot be read (a file system
//! without them, an entry removed meanwhile) has no metadata.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::Path;

use crate::types::{Failure, Reason};

/// The attribute name prefix of a metadata key.
pub const PREFIX: &str = "user.e2b.";
/// Most keys one file's metadata holds.
pub const MAX_KEYS: usize = 64;
/// Longest key, bytes (the kernel takes names of at most 255 bytes, the prefix included).
pub const MAX_KEY: usize = 200;
/// Most bytes of all keys and values together. ext4 keeps one 4 KiB block of attributes per
/// file, and each attribute costs about 24 bytes more than its name and value (and overlayfs
/// keeps attributes of its own there): 2 KiB of keys and values fits even with 64 keys.
pub const MAX_TOTAL: usize = 2048;
/// Longest value read: one a process in the sandbox set may be longer than [`MAX_TOTAL`],
/// up to what ext4 keeps.
const READ_VALUE: usize = 4096;
/// Most bytes of attribute names read from one file (the kernel's own limit).
const MAX_LIST: usize = 64 << 10;

/// Why metadata was refused; each is `invalid` to the caller.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetaError {
    #[error("metadata key {0}: keys are 1-{MAX_KEY} bytes of letters, digits and !#$%&'*+-.^_`|~")]
    BadKey(String),
    #[error("metadata of {0} bytes (keys and values together): at most {MAX_TOTAL}")]
    TooBig(usize),
    #[error("{0} metadata keys: at most {MAX_KEYS}")]
    TooMany(usize),
}

/// Whether `c` may be in a key: the characters of an HTTP header name (RFC 9110 `tchar`),
/// since E2B's SDKs send each key as an `X-Metadata-<key>` header.
fn key_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
}

/// Checks `meta` before anything is written. Errors: [`MetaError`].
pub fn check(meta: &HashMap<String, String>) -> Result<(), MetaError> {
    if meta.len() > MAX_KEYS {
        return Err(MetaError::TooMany(meta.len()));
    }
    for k in meta.keys() {
        if k.is_empty() || k.len() > MAX_KEY || !k.bytes().all(key_char) {
            return Err(MetaError::BadKey(crate::types::names::shown(k)));
        }
    }
    let total: usize = meta.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_TOTAL {
        return Err(MetaError::TooBig(total));
    }
    Ok(())
}

/// The attribute names in a `listxattr` answer.
fn names(list: &[u8]) -> impl Iterator<Item = &[u8]> {
    list.split(|b| *b == 0).filter(|n| !n.is_empty())
}

/// The metadata of `path` (not followed: a symlink has none). At most [`MAX_KEYS`] keys,
/// values of at most [`READ_VALUE`] bytes (a longer one, set by a process in the sandbox,
/// is left out); values that are not UTF-8 are shown lossily.
pub fn read(path: &Path) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut list = vec![0u8; MAX_LIST];
    let Ok(n) = rustix::fs::llistxattr(path, &mut list[..]) else {
        return out;
    };
    let mut value = vec![0u8; READ_VALUE];
    for name in names(list.get(..n).unwrap_or_default()) {
        let Some(key) = name.strip_prefix(PREFIX.as_bytes()) else {
            continue;
        };
        if out.len() == MAX_KEYS {
            break;
        }
        if let Ok(len) = rustix::fs::lgetxattr(path, name, &mut value[..]) {
            out.insert(
                String::from_utf8_lossy(key).into_owned(),
                String::from_utf8_lossy(value.get(..len).unwrap_or_default()).into_owned(),
            );
        }
    }
    out
}

/// Makes the metadata of the open file `f` exactly `meta` (already [`check`]ed): keys it
/// lacks are removed, the others set. Errors, for `path` in messages: `invalid` when the
/// file system keeps no user attributes or the metadata does not fit, `forbidden` when
/// the user may not change them, others `invalid`.
pub fn replace(f: impl AsFd, path: &Path, meta: &HashMap<String, String>) -> Result<(), Failure> {
    let fail = |e: rustix::io::Errno| {
        let shown = path.display();
        match e {
            rustix::io::Errno::NOTSUP => Failure::invalid(format!(
                "{shown}: this file system keeps no metadata (user extended attributes)"
            )),
            rustix::io::Errno::NOSPC | rustix::io::Errno::TOOBIG | rustix::io::Errno::RANGE => {
                Failure::invalid(format!(
                    "{shown}: the metadata does not fit (the file system keeps a few KiB per file)"
                ))
            }
            rustix::io::Errno::PERM | rustix::io::Errno::ACCESS => Failure::new(
                Reason::Forbidden,
                format!("{shown}: setting metadata: {}", std::io::Error::from(e)),
            ),
            e => Failure::invalid(format!(
                "{shown}: setting metadata: {}",
                std::io::Error::from(e)
            )),
        }
    };
    let mut list = vec![0u8; MAX_LIST];
    // Nothing to remove where nothing can be listed; setting reports what is wrong.
    let n = rustix::fs::flistxattr(f.as_fd(), &mut list[..]).unwrap_or_default();
    for name in names(list.get(..n).unwrap_or_default()) {
        let stale = name
            .strip_prefix(PREFIX.as_bytes())
            .is_some_and(|k| !std::str::from_utf8(k).is_ok_and(|k| meta.contains_key(k)));
        if stale {
            match rustix::fs::fremovexattr(f.as_fd(), name) {
                Ok(()) | Err(rustix::io::Errno::NODATA) => {}
                Err(e) => return Err(fail(e)),
            }
        }
    }
    for (k, v) in meta {
        let name = format!("{PREFIX}{k}");
        rustix::fs::fsetxattr(
            f.as_fd(),
            name.as_str(),
            v.as_bytes(),
            rustix::fs::XattrFlags::empty(),
        )
        .map_err(fail)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn keys_are_header_names_and_values_are_bounded() {
        assert_eq!(check(&map(&[("owner", "me"), ("a.b-c_d~1", "")])), Ok(()));
        for bad in ["", "a b", "a:b", "a/b", "é", "a\0b", "(x)"] {
            assert!(
                matches!(check(&map(&[(bad, "v")])), Err(MetaError::BadKey(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check(&map(&[(&"k".repeat(MAX_KEY + 1), "v")])),
            Err(MetaError::BadKey(_))
        ));
        assert_eq!(check(&map(&[("k", &"v".repeat(MAX_TOTAL - 1))])), Ok(()));
        assert_eq!(
            check(&map(&[("k", &"v".repeat(MAX_TOTAL))])),
            Err(MetaError::TooBig(MAX_TOTAL + 1))
        );
        let many: HashMap<String, String> = (0..=MAX_KEYS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert_eq!(check(&many), Err(MetaError::TooMany(MAX_KEYS + 1)));
    }

    /// A directory on a file system with user attributes (tmpfs has had them since 6.6,
    /// ext4 always): /dev/shm where it takes them, else /var/tmp or /tmp.
    fn scratch() -> Option<tempfile::TempDir> {
        scratches().into_iter().next()
    }

    /// Every such directory of [`scratch`]'s candidates.
    fn scratches() -> Vec<tempfile::TempDir> {
        let mut out = Vec::new();
        for base in ["/dev/shm", "/var/tmp", "/tmp"] {
            let Ok(d) = tempfile::tempdir_in(base) else {
                continue;
            };
            let probe = d.path().join("probe");
            if std::fs::write(&probe, b"").is_ok()
                && rustix::fs::setxattr(
                    &probe,
                    "user.e2b.probe",
                    b"1",
                    rustix::fs::XattrFlags::empty(),
                )
                .is_ok()
            {
                out.push(d);
            }
        }
        out
    }

    #[test]
    fn replace_sets_exactly_the_given_keys_and_read_finds_them() {
        let Some(d) = scratch() else {
            panic!("no directory here keeps user extended attributes");
        };
        let p = d.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        // Attributes of other names (a process's own) are left alone.
        rustix::fs::fsetxattr(&f, "user.other", b"x", rustix::fs::XattrFlags::empty()).unwrap();
        replace(&f, &p, &map(&[("a", "1"), ("b", "two")])).unwrap();
        assert_eq!(read(&p), map(&[("a", "1"), ("b", "two")]));
        replace(&f, &p, &map(&[("b", "2"), ("c", "")])).unwrap();
        assert_eq!(read(&p), map(&[("b", "2"), ("c", "")]));
        replace(&f, &p, &HashMap::new()).unwrap();
        assert_eq!(read(&p), HashMap::new());
        let mut other = [0u8; 8];
        assert_eq!(
            rustix::fs::fgetxattr(&f, "user.other", &mut other[..]).unwrap(),
            1
        );
        // Through a symlink nothing is read: the link has none.
        replace(&f, &p, &map(&[("a", "1")])).unwrap();
        let l = d.path().join("l");
        std::os::unix::fs::symlink(&p, &l).unwrap();
        assert_eq!(read(&l), HashMap::new());
        assert_eq!(read(&d.path().join("missing")), HashMap::new());
    }

    #[test]
    fn the_most_metadata_check_allows_fits_with_any_number_of_keys() {
        let dirs = scratches();
        assert!(
            !dirs.is_empty(),
            "no directory here keeps user extended attributes"
        );
        for d in &dirs {
            fits(d.path());
        }
    }

    fn fits(d: &Path) {
        let one = map(&[("k", &"v".repeat(MAX_TOTAL - 1))]);
        // 64 keys of 200-byte names would pass MAX_TOTAL alone: 64 keys of 32 bytes in all.
        let many: HashMap<String, String> = (0..MAX_KEYS)
            .map(|i| (format!("key{i:02}"), "v".repeat(MAX_TOTAL / MAX_KEYS - 5)))
            .collect();
        for (i, meta) in [one, many].into_iter().enumerate() {
            check(&meta).unwrap();
            let p = d.join(format!("f{i}"));
            let f = std::fs::File::create(&p).unwrap();
            replace(&f, &p, &meta).unwrap_or_else(|e| panic!("{}: {e:?}", d.display()));
            assert_eq!(read(&p), meta);
        }
    }

    #[test]
    fn metadata_that_does_not_fit_is_invalid_and_names_the_file() {
        let Some(d) = scratch() else {
            panic!("no directory here keeps user extended attributes");
        };
        let p = d.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        // 64 values of 4 KiB (more than `check` lets by, as a process in the sandbox may
        // try): more than ext4's block, and than tmpfs takes per inode.
        let big: HashMap<String, String> = (0..MAX_KEYS)
            .map(|i| (format!("k{i}"), "v".repeat(4096)))
            .collect();
        match replace(&f, &p, &big) {
            Err(e) => {
                assert_eq!(e.reason, Reason::Invalid, "{e:?}");
                assert!(e.message.contains(&p.display().to_string()), "{e:?}");
            }
            // A file system that takes it all is fine too, and then it reads back whole.
            Ok(()) => assert_eq!(read(&p), big),
        }
    }
}
