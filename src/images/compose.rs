//! Composing images (docs/images.md "Compose"): several images stacked bottom first into one
//! manifest, copying no data. Later parts lie on top; environment variables merge in order
//! with the caller's last; the working directory and user default to the topmost part's.

use std::collections::BTreeMap;

use super::digest::Digest;
use super::name::ImageRef;
use super::store::ImageManifest;
use crate::types::names::shown;
use crate::types::Failure;

/// The most layers an image may have: overlayfs stacks at most 500 lower directories.
pub const MAX_LAYERS: usize = 500;
/// The most parts one composition takes.
pub const MAX_PARTS: usize = 64;

/// Stacks `parts` (bottom first, each with its manifest) into a new manifest, with `env`
/// applied after the parts' own, and `workdir`/`user` ("" = the topmost part's that has one).
/// A layer that several parts hold is kept once, at its topmost place: everything it holds
/// would cover the lower copy anyway. Errors: `invalid` for no parts, too many parts or
/// layers, a bad env key or value, or a relative working directory.
pub fn compose(
    parts: &[(ImageRef, ImageManifest)],
    env: &BTreeMap<String, String>,
    workdir: &str,
    user: &str,
) -> Result<ImageManifest, Failure> {
    if parts.is_empty() {
        return Err(Failure::invalid("compose needs at least one part"));
    }
    if parts.len() > MAX_PARTS {
        return Err(Failure::invalid(format!(
            "compose takes at most {MAX_PARTS} parts, not {}",
            parts.len()
        )));
    }
    let all: Vec<&Digest> = parts.iter().flat_map(|(_, m)| m.layers.iter()).collect();
    let mut layers: Vec<Digest> = Vec::with_capacity(all.len());
    for (i, d) in all.iter().enumerate() {
        if !all.get(i + 1..).unwrap_or_default().contains(d) {
            layers.push((*d).clone());
        }
    }
    if layers.len() > MAX_LAYERS {
        return Err(Failure::invalid(format!(
            "the composed image would have {} layers; at most {MAX_LAYERS} can be stacked",
            layers.len()
        )));
    }
    let mut merged: Vec<String> = Vec::new();
    let mut set = |kv: String| {
        let key = kv
            .split_once('=')
            .map_or(kv.as_str(), |(k, _)| k)
            .to_string();
        match merged
            .iter_mut()
            .find(|e| e.split_once('=').map_or(e.as_str(), |(k, _)| k) == key)
        {
            Some(slot) => *slot = kv,
            None => merged.push(kv),
        }
    };
    for (_, m) in parts {
        for kv in &m.env {
            set(kv.clone());
        }
    }
    for (k, v) in env {
        check_env(k, v)?;
        set(format!("{k}={v}"));
    }
    check_workdir(workdir)?;
    check_user(user)?;
    let topmost = |f: fn(&ImageManifest) -> &str| {
        parts
            .iter()
            .rev()
            .map(|(_, m)| f(m))
            .find(|s| !s.is_empty())
            .unwrap_or_default()
            .to_string()
    };
    Ok(ImageManifest {
        layers,
        env: merged,
        workdir: if workdir.is_empty() {
            topmost(|m| &m.workdir)
        } else {
            workdir.to_string()
        },
        user: if user.is_empty() {
            topmost(|m| &m.user)
        } else {
            user.to_string()
        },
        source: format!(
            "compose of {}",
            parts
                .iter()
                .map(|(r, _)| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        ..Default::default()
    })
}

/// An environment variable: a key `[A-Za-z_][A-Za-z0-9_]*` of at most 256 bytes, a value
/// without NUL of at most 32 KiB. Errors: `invalid` naming the key.
pub fn check_env(key: &str, value: &str) -> Result<(), Failure> {
    let key_ok = key.len() <= 256
        && key
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !key_ok {
        return Err(Failure::invalid(format!(
            "env key {} must be [A-Za-z_][A-Za-z0-9_]*, at most 256 characters",
            shown(key)
        )));
    }
    if value.len() > 32 << 10 || value.contains('\0') {
        return Err(Failure::invalid(format!(
            "env {}: the value must hold no NUL and be at most 32 KiB",
            shown(key)
        )));
    }
    Ok(())
}

/// A working directory: "" or an absolute path without NUL, at most 4096 bytes.
pub fn check_workdir(w: &str) -> Result<(), Failure> {
    if !w.is_empty() && (!w.starts_with('/') || w.len() > 4096 || w.contains('\0')) {
        return Err(Failure::invalid(format!(
            "workdir {} must be an absolute path",
            shown(w)
        )));
    }
    Ok(())
}

/// A user: "", a name, `uid` or `uid:gid`, without NUL or `/`, at most 256 bytes.
pub fn check_user(u: &str) -> Result<(), Failure> {
    if u.len() > 256 || u.contains(['\0', '/', '\n']) {
        return Err(Failure::invalid(format!(
            "user {} must be a name or uid[:gid]",
            shown(u)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Reason;

    fn part(name: &str, layers: &[u8], env: &[&str], workdir: &str) -> (ImageRef, ImageManifest) {
        (
            ImageRef::parse(name).unwrap(),
            ImageManifest {
                layers: layers.iter().map(|n| Digest::of(&[*n])).collect(),
                env: env.iter().map(|s| s.to_string()).collect(),
                workdir: workdir.into(),
                user: String::new(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn later_parts_lie_on_top_and_env_merges_in_order_with_the_callers_last() {
        let parts = [
            part("root/py:3.12", &[1, 2], &["PATH=/usr/bin", "LANG=C"], "/"),
            part("root/ws:a", &[3], &["LANG=C.UTF-8", "REPO=x"], "/srv/repo"),
            part("root/tools:3", &[4], &["PATH=/opt/bin:/usr/bin"], ""),
        ];
        let env = BTreeMap::from([("TASK".to_string(), "4821".to_string())]);
        let m = compose(&parts, &env, "", "").unwrap();
        assert_eq!(
            m.layers,
            [1u8, 2, 3, 4].map(|n| Digest::of(&[n])).to_vec(),
            "bottom first"
        );
        assert_eq!(
            m.env,
            [
                "PATH=/opt/bin:/usr/bin",
                "LANG=C.UTF-8",
                "REPO=x",
                "TASK=4821"
            ]
        );
        assert_eq!(m.workdir, "/srv/repo", "the topmost part that sets one");
        let m = compose(&parts, &BTreeMap::new(), "/work", "1000:1000").unwrap();
        assert_eq!(
            (m.workdir.as_str(), m.user.as_str()),
            ("/work", "1000:1000")
        );
        assert!(m.source.contains("root/ws:a"));
    }

    #[test]
    fn a_shared_layer_is_kept_once_at_its_topmost_place() {
        let parts = [
            part("root/a:1", &[1, 2], &[], ""),
            part("root/b:1", &[1, 3], &[], ""),
        ];
        let m = compose(&parts, &BTreeMap::new(), "", "").unwrap();
        assert_eq!(m.layers, [2u8, 1, 3].map(|n| Digest::of(&[n])).to_vec());
    }

    #[test]
    fn bad_input_is_invalid_and_names_what() {
        let p = [part("root/a:1", &[1], &[], "")];
        let bad_key = BTreeMap::from([("A-B".to_string(), "1".to_string())]);
        let cases = [
            (compose(&[], &BTreeMap::new(), "", ""), "at least one"),
            (compose(&p, &bad_key, "", ""), "\"A-B\""),
            (compose(&p, &BTreeMap::new(), "rel", ""), "absolute"),
            (compose(&p, &BTreeMap::new(), "", "a/b"), "user"),
        ];
        for (r, what) in cases {
            let f = r.unwrap_err();
            assert_eq!(f.reason, Reason::Invalid);
            assert!(f.message.contains(what), "{}", f.message);
        }
        let many: Vec<_> = (0..MAX_PARTS + 1)
            .map(|i| part(&format!("root/p{i}:1"), &[i as u8], &[], ""))
            .collect();
        assert!(compose(&many, &BTreeMap::new(), "", "")
            .unwrap_err()
            .message
            .contains("at most"));
    }
}
