//! Local image sources (docs/images.md "Import"): an OCI layout directory, an OCI archive
//! (the same as a tar) and a `docker save` tar, each optionally `PATH#name:tag` to pick one of
//! several images. Resolves the image to its layers (where to read each blob, and the
//! digests to check it against) and its defaults (env, working directory, user), choosing
//! linux/amd64 from an index or manifest list.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use oci_spec::image::{Arch, ImageConfiguration, ImageIndex, ImageManifest, Os};
use serde::Deserialize;

use super::digest::{Digest, DigestReader};
use crate::types::names::shown;
use crate::types::Failure;

/// The largest JSON document (index, manifest, config) read whole.
const MAX_JSON: u64 = 8 << 20;
/// How deep indexes may nest.
const MAX_DEPTH: usize = 4;
/// The annotation naming an image in an OCI index.
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The annotation containerd and Docker add with the full reference.
const CONTAINERD_NAME: &str = "io.containerd.image.name";

/// Why a source could not be read as an image (`invalid` unless the machine failed).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The source is not what it must be (`invalid`).
    #[error("{source_name}: {why}")]
    Bad { source_name: String, why: String },
    /// Reading it failed (`invalid` when it does not exist, `internal` otherwise).
    #[error("{source_name}: reading {what}")]
    Io {
        source_name: String,
        what: String,
        #[source]
        source: io::Error,
    },
}

impl SourceError {
    /// The caller-facing failure.
    pub fn to_failure(&self) -> Failure {
        let msg = crate::types::chain(self);
        match self {
            SourceError::Bad { .. } => Failure::invalid(msg),
            SourceError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                Failure::invalid(msg)
            }
            SourceError::Io { .. } => Failure::internal(msg),
        }
    }
}

/// One layer of a resolved image.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRef {
    /// Where its blob is within the source (`blobs/sha256/<hex>`, `<id>/layer.tar`).
    pub member: String,
    /// The blob's digest, where the source names one.
    pub blob: Option<Digest>,
    /// The uncompressed tar's digest, from the image's config.
    pub diff_id: Digest,
}

/// An image read from a source: its layers bottom first and its defaults.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Resolved {
    pub layers: Vec<LayerRef>,
    pub env: Vec<String>,
    pub workdir: String,
    pub user: String,
    /// The image's name within the source, if it has one.
    pub name: String,
}

/// A local image source, read member by member.
pub struct Source {
    name: String,
    kind: Kind,
}

enum Kind {
    Dir(PathBuf),
    /// A tar: its path and where each regular member's bytes are.
    Tar(PathBuf, HashMap<String, (u64, u64)>),
}

impl Source {
    /// Opens `path` (a directory or a tar file). Errors: `Io` when it cannot be read, `Bad`
    /// when a tar cannot be listed.
    pub fn open(path: &Path) -> Result<Source, SourceError> {
        let name = path.display().to_string();
        let io_err = |what: &str, source: io::Error| SourceError::Io {
            source_name: name.clone(),
            what: what.into(),
            source,
        };
        let md = std::fs::metadata(path).map_err(|e| io_err("it", e))?;
        if md.is_dir() {
            return Ok(Source {
                kind: Kind::Dir(path.to_path_buf()),
                name,
            });
        }
        let file = File::open(path).map_err(|e| io_err("it", e))?;
        let mut members = HashMap::new();
        let mut archive = tar::Archive::new(io::BufReader::new(file));
        let entries = archive.entries().map_err(|e| SourceError::Bad {
            source_name: name.clone(),
            why: format!("not a tar: {e}"),
        })?;
        for entry in entries {
            let entry = entry.map_err(|e| SourceError::Bad {
                source_name: name.clone(),
                why: format!("not a valid tar: {e}"),
            })?;
            if !matches!(
                entry.header().entry_type(),
                tar::EntryType::Regular | tar::EntryType::Continuous
            ) {
                continue;
            }
            let member = clean(&String::from_utf8_lossy(&entry.path_bytes()));
            members.insert(member, (entry.raw_file_position(), entry.size()));
        }
        Ok(Source {
            kind: Kind::Tar(path.to_path_buf(), members),
            name,
        })
    }

    fn bad(&self, why: impl Into<String>) -> SourceError {
        SourceError::Bad {
            source_name: self.name.clone(),
            why: why.into(),
        }
    }

    fn has(&self, member: &str) -> bool {
        match &self.kind {
            Kind::Dir(d) => d.join(member).is_file(),
            Kind::Tar(_, m) => m.contains_key(member),
        }
    }

    /// The size in bytes of `member`, where it can be told without reading it.
    pub fn member_size(&self, member: &str) -> Option<u64> {
        let member = clean(member);
        if member.split('/').any(|c| c == "..") {
            return None;
        }
        match &self.kind {
            Kind::Dir(d) => std::fs::metadata(d.join(&member)).ok().map(|m| m.len()),
            Kind::Tar(_, m) => m.get(&member).map(|(_, size)| *size),
        }
    }

    /// Opens one member for reading. Errors: `Bad` when the source has no such member.
    pub fn open_member(&self, member: &str) -> Result<Box<dyn Read + Send>, SourceError> {
        let member = clean(member);
        if member.split('/').any(|c| c == "..") || member.is_empty() {
            return Err(self.bad(format!("member {} is outside the source", shown(&member))));
        }
        let io_err = |source: io::Error| SourceError::Io {
            source_name: self.name.clone(),
            what: member.clone(),
            source,
        };
        match &self.kind {
            Kind::Dir(d) => {
                let f = File::open(d.join(&member)).map_err(|e| {
                    if e.kind() == io::ErrorKind::NotFound {
                        self.bad(format!("it has no {}", shown(&member)))
                    } else {
                        io_err(e)
                    }
                })?;
                Ok(Box::new(f))
            }
            Kind::Tar(path, members) => {
                let Some((offset, size)) = members.get(&member) else {
                    return Err(self.bad(format!("it has no {}", shown(&member))));
                };
                let mut f = File::open(path).map_err(io_err)?;
                f.seek(SeekFrom::Start(*offset)).map_err(io_err)?;
                Ok(Box::new(f.take(*size)))
            }
        }
    }

    /// Reads a JSON member whole (at most 8 MiB), checking its digest where one is given.
    fn json(&self, member: &str, digest: Option<&Digest>) -> Result<Vec<u8>, SourceError> {
        let r = self.open_member(member)?;
        let mut hashed = DigestReader::new(r.take(MAX_JSON + 1));
        let mut body = Vec::new();
        hashed.read_to_end(&mut body).map_err(|e| SourceError::Io {
            source_name: self.name.clone(),
            what: member.into(),
            source: e,
        })?;
        if body.len() as u64 > MAX_JSON {
            return Err(self.bad(format!("{} is larger than {MAX_JSON} bytes", shown(member))));
        }
        if let Some(want) = digest {
            let (got, _, _) = hashed.finish().map_err(|e| SourceError::Io {
                source_name: self.name.clone(),
                what: member.into(),
                source: e,
            })?;
            if &got != want {
                return Err(self.bad(format!("{} is {got}, not {want}", shown(member))));
            }
        }
        Ok(body)
    }

    /// Resolves the image `select` names (`name:tag`, a tag, or a full reference as the
    /// source annotates it), or the source's only image when `select` is empty. Errors:
    /// `Bad` naming what is missing or ambiguous.
    pub fn resolve(&self, select: &str) -> Result<Resolved, SourceError> {
        if self.has("index.json") {
            return self.resolve_oci(select);
        }
        if self.has("manifest.json") {
            return self.resolve_docker(select);
        }
        Err(self.bad("neither an OCI layout (index.json) nor a docker save tar (manifest.json)"))
    }

    fn resolve_oci(&self, select: &str) -> Result<Resolved, SourceError> {
        let body = self.json("index.json", None)?;
        let index =
            ImageIndex::from_reader(&body[..]).map_err(|e| self.bad(format!("index.json: {e}")))?;
        let candidates: Vec<_> = index
            .manifests()
            .iter()
            .filter(|d| {
                let ann = d.annotations().clone().unwrap_or_default();
                let names = [ann.get(REF_NAME), ann.get(CONTAINERD_NAME)];
                select.is_empty() || names.iter().flatten().any(|n| matches_name(n, select))
            })
            .collect();
        let names = || {
            index
                .manifests()
                .iter()
                .filter_map(|d| d.annotations().as_ref()?.get(REF_NAME).cloned())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let desc = self.pick(&candidates, select, names)?;
        let name = desc
            .annotations()
            .as_ref()
            .and_then(|a| a.get(REF_NAME).cloned())
            .unwrap_or_default();
        let digest = self.digest(desc.digest().as_ref())?;
        let mut r = self.resolve_manifest(&digest, 0)?;
        r.name = name;
        Ok(r)
    }

    /// The one image `select` chose among `candidates` (the source's only one when `select`
    /// is empty). Errors: `Bad`, listing the names the source has (`names`).
    fn pick<'a, T>(
        &self,
        candidates: &[&'a T],
        select: &str,
        names: impl Fn() -> String,
    ) -> Result<&'a T, SourceError> {
        match candidates {
            [one] => Ok(*one),
            [] => Err(self.bad(format!(
                "no image named {} (it has: {})",
                shown(select),
                names()
            ))),
            _ if select.is_empty() => Err(self.bad(format!(
                "it holds several images; name one as PATH#name:tag (it has: {})",
                names()
            ))),
            _ => Err(self.bad(format!("several images match {}", shown(select)))),
        }
    }

    fn digest(&self, d: &str) -> Result<Digest, SourceError> {
        Digest::parse(d).map_err(|e| self.bad(e.to_string()))
    }

    fn blob_member(d: &Digest) -> String {
        format!("blobs/sha256/{}", d.hex())
    }

    /// A manifest, or an index to choose linux/amd64 from.
    fn resolve_manifest(&self, digest: &Digest, depth: usize) -> Result<Resolved, SourceError> {
        if depth > MAX_DEPTH {
            return Err(self.bad(format!("indexes nest deeper than {MAX_DEPTH}")));
        }
        let body = self.json(&Self::blob_member(digest), Some(digest))?;
        let value: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| self.bad(format!("manifest {digest}: {e}")))?;
        if value.get("manifests").is_some() {
            let index = ImageIndex::from_reader(&body[..])
                .map_err(|e| self.bad(format!("index {digest}: {e}")))?;
            let pick = index
                .manifests()
                .iter()
                .find(|d| {
                    d.platform()
                        .as_ref()
                        .is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)
                })
                .ok_or_else(|| self.bad(format!("index {digest} has no linux/amd64 image")))?;
            let next = self.digest(pick.digest().as_ref())?;
            return self.resolve_manifest(&next, depth + 1);
        }
        let m = ImageManifest::from_reader(&body[..])
            .map_err(|e| self.bad(format!("manifest {digest}: {e}")))?;
        let config_digest = self.digest(m.config().digest().as_ref())?;
        let blobs = m
            .layers()
            .iter()
            .map(|l| self.digest(l.digest().as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let members = blobs.iter().map(Self::blob_member).collect();
        self.with_config(
            &Self::blob_member(&config_digest),
            Some(&config_digest),
            members,
            blobs.into_iter().map(Some).collect(),
        )
    }

    fn with_config(
        &self,
        member: &str,
        digest: Option<&Digest>,
        members: Vec<String>,
        blobs: Vec<Option<Digest>>,
    ) -> Result<Resolved, SourceError> {
        let body = self.json(member, digest)?;
        from_config(&body, &shown(member), members, blobs, &|why| self.bad(why))
    }

    fn resolve_docker(&self, select: &str) -> Result<Resolved, SourceError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Entry {
            config: String,
            #[serde(default)]
            repo_tags: Option<Vec<String>>,
            layers: Vec<String>,
        }
        let body = self.json("manifest.json", None)?;
        let entries: Vec<Entry> =
            serde_json::from_slice(&body).map_err(|e| self.bad(format!("manifest.json: {e}")))?;
        let tags = |e: &Entry| e.repo_tags.clone().unwrap_or_default();
        let candidates: Vec<&Entry> = entries
            .iter()
            .filter(|e| select.is_empty() || tags(e).iter().any(|t| matches_name(t, select)))
            .collect();
        let all = || entries.iter().flat_map(tags).collect::<Vec<_>>().join(", ");
        let e = self.pick(&candidates, select, all)?;
        // `<hex>.json` (docker before 25) or `blobs/sha256/<hex>` names the config by its
        // digest; a layer's member names its blob's digest only in the second form.
        let named = |member: &str| -> Option<Digest> {
            let base = member.rsplit('/').next().unwrap_or(member);
            let hex = base.strip_suffix(".json").unwrap_or(base);
            Digest::parse(&format!("sha256:{hex}")).ok()
        };
        let config_digest = named(&e.config);
        let blobs = e
            .layers
            .iter()
            .map(|l| l.starts_with("blobs/sha256/").then(|| named(l)).flatten())
            .collect();
        let mut r = self.with_config(&e.config, config_digest.as_ref(), e.layers.clone(), blobs)?;
        r.name = tags(e).first().cloned().unwrap_or_default();
        Ok(r)
    }
}

/// The image `config` (JSON) describes, with `members` and `blobs` its layers bottom first
/// as the manifest lists them. Errors: `bad(why)` when the config does not parse, names a bad
/// diff_id, or lists another number of layers.
pub(super) fn from_config(
    config: &[u8],
    what: &str,
    members: Vec<String>,
    blobs: Vec<Option<Digest>>,
    bad: &dyn Fn(String) -> SourceError,
) -> Result<Resolved, SourceError> {
    let config = ImageConfiguration::from_reader(config)
        .map_err(|e| bad(format!("image config {what}: {e}")))?;
    let diff_ids = config
        .rootfs()
        .diff_ids()
        .iter()
        .map(|d| Digest::parse(d).map_err(|e| bad(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    if diff_ids.len() != members.len() {
        return Err(bad(format!(
            "the image has {} layers but its config lists {} diff_ids",
            members.len(),
            diff_ids.len()
        )));
    }
    let c = config.config().clone().unwrap_or_default();
    Ok(Resolved {
        layers: members
            .into_iter()
            .zip(blobs)
            .zip(diff_ids)
            .map(|((member, blob), diff_id)| LayerRef {
                member,
                blob,
                diff_id,
            })
            .collect(),
        env: c.env().clone().unwrap_or_default(),
        workdir: c.working_dir().clone().unwrap_or_default(),
        user: c.user().clone().unwrap_or_default(),
        name: String::new(),
    })
}

/// Whether the source's name `have` (`python:3.12`, `docker.io/library/python:3.12`, a bare
/// tag) is what the caller selected.
fn matches_name(have: &str, select: &str) -> bool {
    if have == select {
        return true;
    }
    // A full reference matches by its last path segment (`docker.io/library/py:1` ~ `py:1`),
    // and a bare tag in an OCI index matches `anything:tag`.
    let last = have.rsplit('/').next().unwrap_or(have);
    last == select || select.rsplit_once(':').is_some_and(|(_, tag)| tag == have)
}

fn clean(p: &str) -> String {
    p.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// Splits `PATH#name:tag` into the path and the selector (empty when there is none).
pub fn split_source(src: &str) -> (&str, &str) {
    match src.rsplit_once('#') {
        Some((p, s)) => (p, s),
        None => (src, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_by_reference_name_and_tag() {
        assert!(matches_name("py:1", "py:1"));
        assert!(matches_name("docker.io/library/py:1", "py:1"));
        assert!(matches_name("1", "py:1"));
        assert!(!matches_name("py:2", "py:1"));
        assert!(!matches_name("2", "py:1"));
        assert_eq!(split_source("a/b.tar#py:1"), ("a/b.tar", "py:1"));
        assert_eq!(split_source("dir"), ("dir", ""));
        assert_eq!(clean("./blobs//sha256/x"), "blobs/sha256/x");
    }
}
