//! What a node-local image says about how to run it. A lower directory unpacked by umoci
//! (`umoci unpack --image IMG BUNDLE`) is `BUNDLE/rootfs` beside an OCI runtime
//! `BUNDLE/config.json`, whose `process.env` and `process.cwd` are the image's environment
//! and working directory; they become the defaults of every session and process (aether's
//! `env` and `workdir`). Images without one (the development image `host`) have none.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// The most of a config.json this reads; an OCI config is a few KB.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// An image's run defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageDefaults {
    pub env: BTreeMap<String, String>,
    /// "" when the image sets none.
    pub workdir: String,
}

/// Reads the defaults of the image whose topmost lower directory is `top`: from
/// `<top>/../config.json` when `top` is a bundle's `rootfs`. A missing, oversized or
/// malformed file gives no defaults (the image still runs).
pub fn defaults(top: &Path) -> ImageDefaults {
    let Some(bundle) = top.parent() else {
        return ImageDefaults::default();
    };
    if top.file_name().is_none_or(|n| n != "rootfs") {
        return ImageDefaults::default();
    }
    let mut text = String::new();
    let read = std::fs::File::open(bundle.join("config.json"))
        .and_then(|f| f.take(MAX_CONFIG_BYTES).read_to_string(&mut text));
    if read.is_err() {
        return ImageDefaults::default();
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return ImageDefaults::default();
    };
    let process = v.get("process");
    let env = process
        .and_then(|p| p.get("env"))
        .and_then(|e| e.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|e| e.as_str())
                .filter_map(|e| e.split_once('='))
                .filter(|(k, _)| !k.is_empty())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let workdir = process
        .and_then(|p| p.get("cwd"))
        .and_then(|c| c.as_str())
        .filter(|c| c.starts_with('/'))
        .unwrap_or_default()
        .to_string();
    ImageDefaults { env, workdir }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_bundles_process_defaults() {
        let d = tempfile::tempdir().expect("tempdir");
        let rootfs = d.path().join("rootfs");
        std::fs::create_dir_all(&rootfs).expect("mkdir");
        assert_eq!(defaults(&rootfs), ImageDefaults::default());
        std::fs::write(
            d.path().join("config.json"),
            r#"{"process": {"env": ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8", "=x", "junk"],
                "cwd": "/srv/app", "user": {"uid": 0, "gid": 0}}}"#,
        )
        .expect("write");
        let got = defaults(&rootfs);
        assert_eq!(got.workdir, "/srv/app");
        assert_eq!(
            got.env.get("PATH").map(String::as_str),
            Some("/opt/bin:/usr/bin")
        );
        assert_eq!(got.env.len(), 2);
        // Not a bundle's rootfs, or a broken file: no defaults.
        assert_eq!(defaults(d.path()), ImageDefaults::default());
        std::fs::write(d.path().join("config.json"), "{not json").expect("write");
        assert_eq!(defaults(&rootfs), ImageDefaults::default());
    }
}
