//! Images from an OCI distribution registry (docs/images.md "Import from a registry"), through
//! `oci-client`: Docker Hub's short names (`python:3.12` is
//! `docker.io/library/python:3.12`), manifest lists and OCI indexes resolved to linux/amd64,
//! anonymous access, HTTP Basic and bearer token services. A redirect (a registry sending blobs
//! to a storage host) is followed without the credentials when it leaves the registry's host:
//! reqwest drops `Authorization` on a cross-host redirect.
//!
//! Only the manifest and config are read here; each layer is streamed into the importer
//! ([`super::layer`]), which checks its blob digest and diff_id as for any source.

use std::collections::HashMap;
use std::io::Read;
use std::str::FromStr;

use futures::TryStreamExt;
use oci_client::client::{linux_amd64_resolver, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};

use super::auth::Credentials;
use super::digest::Digest;
use super::oci::{from_config, Resolved, SourceError};
use crate::types::Failure;

/// Why a registry could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The reference does not parse (`invalid`).
    #[error("{reference}: not an image reference: {why}")]
    Reference { reference: String, why: String },
    /// The registry refused the credentials, or wants some (`unauthenticated`).
    #[error("{reference}: the registry refused access: {why}")]
    Denied { reference: String, why: String },
    /// No such repository or tag (`not_found`).
    #[error("{reference}: not in the registry: {why}")]
    NotFound { reference: String, why: String },
    /// The registry could not be reached or failed (`unavailable`).
    #[error("{reference}: the registry is unreachable or failing: {why}")]
    Unreachable { reference: String, why: String },
    /// The registry answered with something that is not a usable image (`invalid`).
    #[error(transparent)]
    Source(#[from] SourceError),
}

impl RegistryError {
    /// The caller-facing failure.
    pub fn to_failure(&self) -> Failure {
        let msg = crate::types::chain(self);
        match self {
            RegistryError::Reference { .. } => Failure::invalid(msg),
            RegistryError::Denied { .. } => Failure::unauthenticated(msg),
            RegistryError::NotFound { .. } => Failure::not_found(msg),
            RegistryError::Unreachable { .. } => Failure::unavailable(msg),
            RegistryError::Source(e) => e.to_failure(),
        }
    }
}

/// How to reach a registry.
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// Plain HTTP instead of HTTPS (`-plain-http`: a registry without TLS).
    pub plain_http: bool,
    pub credentials: Credentials,
}

/// Parses an image reference the way `docker pull` does: `python:3.12`,
/// `ghcr.io/org/image:tag`, `host:5000/team/app@sha256:…`, `[::1]:5000/team/app:1`; a missing
/// tag is `latest`. Errors: `Reference`.
pub fn parse_reference(s: &str) -> Result<Reference, RegistryError> {
    let refused = |why: String| RegistryError::Reference {
        reference: s.to_string(),
        why,
    };
    let Some(bracketed) = s.strip_prefix('[') else {
        return Reference::from_str(s).map_err(|e| refused(e.to_string()));
    };
    // oci-spec's grammar predates IPv6 hosts; the host is checked here and the rest parsed
    // under a stand-in host (one with a dot, so it is taken as a registry, not a Docker Hub
    // repository), then the reference rebuilt with the real one.
    let (host, rest) = bracketed
        .split_once(']')
        .ok_or_else(|| refused("an IPv6 host without its closing ]".into()))?;
    host.parse::<std::net::Ipv6Addr>()
        .map_err(|_| refused(format!("[{host}] is not an IPv6 address")))?;
    let (port, path) = match rest.split_once('/') {
        Some((p, path)) if !path.is_empty() => (p, path),
        _ => return Err(refused("no repository after the registry host".into())),
    };
    let registry = match port.strip_prefix(':') {
        None if port.is_empty() => format!("[{host}]"),
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse::<u16>()
                .map_err(|_| refused(format!("port {p} is out of range")))?;
            format!("[{host}]:{p}")
        }
        _ => {
            return Err(refused(format!(
                "{port:?} after the IPv6 host is not :PORT"
            )))
        }
    };
    let stand_in =
        Reference::from_str(&format!("ipv6.invalid/{path}")).map_err(|e| refused(e.to_string()))?;
    let repository = stand_in.repository().to_string();
    Ok(
        match (
            stand_in.tag().map(str::to_string),
            stand_in.digest().map(str::to_string),
        ) {
            (Some(t), Some(d)) => Reference::with_tag_and_digest(registry, repository, t, d),
            (None, Some(d)) => Reference::with_digest(registry, repository, d),
            (Some(t), None) => Reference::with_tag(registry, repository, t),
            // oci-spec fills in `latest` when neither is given.
            (None, None) => Reference::with_tag(registry, repository, "latest".into()),
        },
    )
}

/// One image in a registry, resolved to its layers.
pub struct Registry {
    client: Client,
    reference: Reference,
    /// The manifest's layer descriptors by blob digest, to stream each.
    layers: HashMap<String, OciDescriptor>,
    rt: tokio::runtime::Handle,
}

impl Registry {
    /// Reads the manifest (choosing linux/amd64 from a list or index) and the config of
    /// `reference`, and returns the registry handle with the image. Errors:
    /// [`RegistryError`].
    pub async fn resolve(
        reference: &str,
        opts: &RegistryOptions,
    ) -> Result<(Registry, Resolved), RegistryError> {
        let (client, parsed, auth) = connect(reference, opts)?;
        let shown = parsed.whole();
        let (manifest, _digest, config) = client
            .pull_manifest_and_config(&parsed, &auth)
            .await
            .map_err(|e| classify(&shown, e))?;
        let bad = |why: String| {
            SourceError::Bad {
                source_name: shown.clone(),
                why,
            }
            .into()
        };
        let want = Digest::parse(&manifest.config.digest).map_err(|e| bad(e.to_string()))?;
        let got = sha256(config.as_bytes());
        if want.to_string() != got {
            return Err(bad(format!(
                "its config is {got}, the manifest says {want}"
            )));
        }
        let mut blobs = Vec::with_capacity(manifest.layers.len());
        let mut layers = HashMap::new();
        for l in &manifest.layers {
            if l.media_type.contains("foreign") || l.media_type.contains("nondistributable") {
                return Err(bad(format!(
                    "layer {} is {}, which registries do not serve",
                    l.digest, l.media_type
                )));
            }
            blobs.push(Digest::parse(&l.digest).map_err(|e| bad(e.to_string()))?);
            layers.insert(l.digest.clone(), l.clone());
        }
        let members = blobs.iter().map(|b| b.to_string()).collect();
        let mut image = from_config(
            config.as_bytes(),
            &shown,
            members,
            blobs.into_iter().map(Some).collect(),
            &|why| SourceError::Bad {
                source_name: shown.clone(),
                why,
            },
        )?;
        image.name = shown;
        Ok((
            Registry {
                client,
                reference: parsed,
                layers,
                rt: tokio::runtime::Handle::current(),
            },
            image,
        ))
    }

    /// The reference as resolved (`docker.io/library/python:3.12`).
    pub fn reference(&self) -> String {
        self.reference.whole()
    }

    /// Streams the blob `member` (a layer's digest) as a blocking reader, with its size where
    /// the registry gives one; called from a blocking thread (it waits on the runtime).
    /// Errors: `NotFound` for a digest the manifest does not list, the registry's own
    /// failure otherwise.
    pub fn open_blob(
        &self,
        member: &str,
    ) -> Result<(Box<dyn Read + Send>, Option<u64>), RegistryError> {
        let shown = self.reference.whole();
        let desc = self
            .layers
            .get(member)
            .ok_or_else(|| RegistryError::NotFound {
                reference: shown.clone(),
                why: format!("the manifest lists no blob {member}"),
            })?;
        let stream = self
            .rt
            .block_on(self.client.pull_blob_stream(&self.reference, desc))
            .map_err(|e| classify(&shown, e))?;
        let size = stream
            .content_length
            .or(u64::try_from(desc.size).ok().filter(|s| *s > 0));
        Ok((Box::new(blob_reader(stream, &self.rt)), size))
    }
}

/// An HTTP client for `reference`'s registry, the parsed reference and the credentials.
fn connect(
    reference: &str,
    opts: &RegistryOptions,
) -> Result<(Client, Reference, RegistryAuth), RegistryError> {
    let parsed = parse_reference(reference)?;
    // reqwest is built without a TLS provider of its own; ring is the one we ship.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = ClientConfig {
        protocol: if opts.plain_http {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        platform_resolver: Some(Box::new(linux_amd64_resolver)),
        connect_timeout: Some(std::time::Duration::from_secs(30)),
        read_timeout: Some(std::time::Duration::from_secs(120)),
        user_agent: concat!("opendsec/", env!("CARGO_PKG_VERSION")),
        ..Default::default()
    };
    let client = Client::try_from(config).map_err(|e| RegistryError::Unreachable {
        reference: parsed.whole(),
        why: format!("making the HTTP client: {e}"),
    })?;
    let auth = match &opts.credentials {
        Credentials::Anonymous => RegistryAuth::Anonymous,
        Credentials::Basic { username, password } => {
            RegistryAuth::Basic(username.clone(), password.clone())
        }
    };
    Ok((client, parsed, auth))
}

/// What [`save`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    /// The reference as resolved, and the digest of the linux/amd64 manifest saved.
    pub reference: String,
    pub manifest: String,
    pub layers: usize,
    /// Bytes of the archive.
    pub bytes: u64,
}

const MANIFEST_TYPES: &[&str] = &[
    oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
    oci_client::manifest::IMAGE_MANIFEST_MEDIA_TYPE,
    oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE,
    oci_client::manifest::IMAGE_MANIFEST_LIST_MEDIA_TYPE,
];

/// Saves `reference` (its linux/amd64 image) as an OCI archive at `out`: `oci-layout`,
/// `index.json` naming it (`org.opencontainers.image.ref.name` = its tag,
/// `io.containerd.image.name` = the whole reference) and every blob under `blobs/sha256/`,
/// each checked against its digest as it is written. Written to `out.partial` and renamed
/// into place, so `out` is whole or absent. `progress(bytes)` is told the bytes of blobs
/// written so far. Runs on a blocking thread (it waits on `rt`). Errors: [`RegistryError`];
/// `Source` for a local write failure.
pub fn save(
    rt: &tokio::runtime::Handle,
    reference: &str,
    opts: &RegistryOptions,
    out: &std::path::Path,
    progress: &dyn Fn(u64),
) -> Result<Saved, RegistryError> {
    let (client, parsed, auth) = connect(reference, opts)?;
    let shown = parsed.whole();
    let bad = |why: String| -> RegistryError {
        SourceError::Bad {
            source_name: shown.clone(),
            why,
        }
        .into()
    };
    let (mut body, _) = rt
        .block_on(client.pull_manifest_raw(&parsed, &auth, MANIFEST_TYPES))
        .map_err(|e| classify(&shown, e))?;
    // The digest is of the bytes as served; a reference by digest must name those.
    let mut digest = sha256(&body);
    if let Some(want) = parsed.digest() {
        if want != digest {
            return Err(bad(format!("its manifest is {digest}, not {want}")));
        }
    }
    let mut value: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("its manifest: {e}")))?;
    if let Some(list) = value.get("manifests").and_then(|m| m.as_array()) {
        let pick = list
            .iter()
            .find(|m| {
                let p = m.get("platform");
                let field = |k: &str| p.and_then(|p| p.get(k)).and_then(|v| v.as_str());
                field("os") == Some("linux") && field("architecture") == Some("amd64")
            })
            .and_then(|m| m.get("digest")?.as_str())
            .ok_or_else(|| bad("its index has no linux/amd64 image".into()))?
            .to_string();
        let by_digest = parse_reference(&format!(
            "{}/{}@{pick}",
            parsed.registry(),
            parsed.repository()
        ))?;
        (body, _) = rt
            .block_on(client.pull_manifest_raw(&by_digest, &auth, MANIFEST_TYPES))
            .map_err(|e| classify(&shown, e))?;
        if sha256(&body) != pick {
            return Err(bad(format!("manifest {pick} is {}", sha256(&body))));
        }
        digest = pick;
        value =
            serde_json::from_slice(&body).map_err(|e| bad(format!("manifest {digest}: {e}")))?;
    }
    let media_type = value
        .get("mediaType")
        .and_then(|v| v.as_str())
        .unwrap_or(oci_client::manifest::OCI_IMAGE_MEDIA_TYPE)
        .to_string();
    let mut blobs: Vec<OciDescriptor> = Vec::new();
    let config = value
        .get("config")
        .ok_or_else(|| bad("its manifest names no config".into()))?;
    for d in std::iter::once(config).chain(
        value
            .get("layers")
            .and_then(|l| l.as_array())
            .map(|a| a.as_slice())
            .unwrap_or(&[]),
    ) {
        let desc: OciDescriptor = serde_json::from_value(d.clone())
            .map_err(|e| bad(format!("a descriptor of its manifest: {e}")))?;
        Digest::parse(&desc.digest).map_err(|e| bad(e.to_string()))?;
        if desc.size < 0 {
            return Err(bad(format!("blob {} has a negative size", desc.digest)));
        }
        blobs.push(desc);
    }
    let write_err = |what: &str, e: std::io::Error| -> RegistryError {
        SourceError::Io {
            source_name: out.display().to_string(),
            what: what.to_string(),
            source: e,
        }
        .into()
    };
    let mut partial = out.as_os_str().to_os_string();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let file = std::fs::File::create(&partial).map_err(|e| write_err("creating it", e))?;
    let written = (|| -> Result<u64, RegistryError> {
        let mut tar = tar::Builder::new(std::io::BufWriter::new(file));
        let put = |tar: &mut tar::Builder<_>, name: &str, data: &[u8]| {
            let mut h = tar::Header::new_ustar();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_mtime(0);
            tar.append_data(&mut h, name, data)
                .map_err(|e| write_err(name, e))
        };
        put(&mut tar, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        put(
            &mut tar,
            &format!("blobs/sha256/{}", hex_of(&digest)),
            &body,
        )?;
        let mut done = 0u64;
        for desc in &blobs {
            let stream = rt
                .block_on(client.pull_blob_stream(&parsed, desc))
                .map_err(|e| classify(&shown, e))?;
            let reader = blob_reader(stream, rt);
            let size = desc.size as u64;
            let mut hashed = super::digest::DigestReader::new(reader.take(size));
            let mut h = tar::Header::new_ustar();
            h.set_size(size);
            h.set_mode(0o644);
            h.set_mtime(0);
            let name = format!("blobs/sha256/{}", hex_of(&desc.digest));
            tar.append_data(&mut h, &name, &mut hashed).map_err(|e| {
                let why = format!("blob {}: {e}", desc.digest);
                if e.kind() == std::io::ErrorKind::InvalidData {
                    bad(why)
                } else {
                    RegistryError::Unreachable {
                        reference: shown.clone(),
                        why,
                    }
                }
            })?;
            let (got, n, _) = hashed.finish().map_err(|e| write_err(&name, e))?;
            if got.to_string() != desc.digest || n != size {
                return Err(bad(format!(
                    "blob {} is {got} ({n} bytes, the manifest says {size})",
                    desc.digest
                )));
            }
            done += size;
            progress(done);
        }
        let (name, tag) = match (parsed.tag(), parsed.digest()) {
            (Some(t), _) => (shown.clone(), t.to_string()),
            (None, _) => (shown.clone(), String::new()),
        };
        let mut annotations = serde_json::Map::new();
        annotations.insert("io.containerd.image.name".into(), name.into());
        if !tag.is_empty() {
            annotations.insert("org.opencontainers.image.ref.name".into(), tag.into());
        }
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE,
            "manifests": [{
                "mediaType": media_type,
                "digest": digest,
                "size": body.len(),
                "annotations": annotations,
                "platform": {"architecture": "amd64", "os": "linux"},
            }],
        });
        put(&mut tar, "index.json", index.to_string().as_bytes())?;
        let w = tar.into_inner().map_err(|e| write_err("finishing it", e))?;
        let f = w
            .into_inner()
            .map_err(|e| write_err("flushing it", e.into_error()))?;
        f.sync_all().map_err(|e| write_err("syncing it", e))?;
        Ok(f.metadata().map(|m| m.len()).unwrap_or(0))
    })();
    let bytes = match written {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    std::fs::rename(&partial, out).map_err(|e| write_err("moving it into place", e))?;
    Ok(Saved {
        reference: shown,
        manifest: digest,
        layers: blobs.len().saturating_sub(1),
        bytes,
    })
}

/// A blocking reader of a blob stream. oci-client checks the blob's digest too and fails the
/// stream's end when it is wrong: that is a bad blob (`InvalidData`, which the importer
/// reports as `invalid`), not a registry gone away.
fn blob_reader(
    stream: oci_client::client::SizedStream,
    rt: &tokio::runtime::Handle,
) -> impl Read + Send {
    let bytes = stream.stream.map_err(|e| {
        if e.get_ref()
            .is_some_and(|i| i.is::<oci_client::errors::DigestError>())
        {
            std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
        } else {
            e
        }
    });
    tokio_util::io::SyncIoBridge::new_with_handle(
        tokio_util::io::StreamReader::new(bytes),
        rt.clone(),
    )
}

fn sha256(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

fn hex_of(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

/// Sorts oci-client's errors into what the caller can act on.
fn classify(reference: &str, e: OciDistributionError) -> RegistryError {
    let why = crate::types::chain(&e);
    let reference = reference.to_string();
    match &e {
        OciDistributionError::AuthenticationFailure(_)
        | OciDistributionError::UnauthorizedError { .. } => {
            RegistryError::Denied { reference, why }
        }
        OciDistributionError::ImageManifestNotFoundError(_) => {
            RegistryError::NotFound { reference, why }
        }
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|x| &x.code).collect();
            if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            }) {
                RegistryError::NotFound { reference, why }
            } else if codes
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                RegistryError::Denied { reference, why }
            } else {
                RegistryError::Unreachable { reference, why }
            }
        }
        OciDistributionError::ServerError { code, .. } if *code == 404 => {
            RegistryError::NotFound { reference, why }
        }
        OciDistributionError::ServerError { code, .. } if *code == 401 || *code == 403 => {
            RegistryError::Denied { reference, why }
        }
        OciDistributionError::RequestError(_) if why.contains("InvalidContentType") => {
            RegistryError::Unreachable {
                reference,
                why: format!("{why} (the registry does not speak TLS: -plain-http?)"),
            }
        }
        OciDistributionError::RequestError(_)
        | OciDistributionError::IoError(_)
        | OciDistributionError::ServerError { .. } => RegistryError::Unreachable { reference, why },
        _ => RegistryError::Source(SourceError::Bad {
            source_name: reference,
            why,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_are_docker_hub_and_hosts_keep_their_port() {
        let r = parse_reference("python:3.12").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("docker.io", "library/python", Some("3.12"))
        );
        let r = parse_reference("org/app").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("docker.io", "org/app", Some("latest"))
        );
        let r = parse_reference("127.0.0.1:5000/team/app:1").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5000", "team/app", Some("1"))
        );
        let e = parse_reference("UPPER/Case:1").unwrap_err();
        assert_eq!(e.to_failure().reason, crate::types::Reason::Invalid);
    }

    #[test]
    fn ipv6_hosts_in_brackets_are_registries() {
        let digest = format!("sha256:{}", "a".repeat(64));
        for (s, registry, repository, tag, dig) in [
            (
                "[::1]:5000/team/app:1",
                "[::1]:5000",
                "team/app",
                Some("1"),
                None,
            ),
            ("[::1]/app", "[::1]", "app", Some("latest"), None),
            (
                "[fd00::5]:443/a/b/c:v1.2",
                "[fd00::5]:443",
                "a/b/c",
                Some("v1.2"),
                None,
            ),
            (
                &format!("[::1]:5000/team/app@{digest}"),
                "[::1]:5000",
                "team/app",
                None,
                Some(digest.as_str()),
            ),
        ] {
            let r = parse_reference(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(
                (r.registry(), r.repository(), r.tag(), r.digest()),
                (registry, repository, tag, dig),
                "{s}"
            );
            // Written back as given (save names the manifest by digest this way).
            let again = parse_reference(&r.whole()).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(again, r, "{s}");
        }
    }

    #[test]
    fn bad_ipv6_references_are_invalid_naming_the_reference() {
        for s in [
            "[::1",
            "[::1]",
            "[::1]/",
            "[::1]:5000",
            "[::1]:5000/",
            "[zz]:5000/a:1",
            "[]:5000/a:1",
            "[127.0.0.1]:5000/a:1",
            "[::1]:notaport/a:1",
            "[::1]:/a:1",
            "[::1]:99999/a:1",
            "[::1]5000/a:1",
            "[::1]:5000/UPPER:1",
            "[::1]:5000/a:bad tag",
        ] {
            let e = parse_reference(s).expect_err(s);
            let f = e.to_failure();
            assert_eq!(f.reason, crate::types::Reason::Invalid, "{s}");
            assert!(f.message.contains(s), "{s}: {}", f.message);
        }
    }
}
