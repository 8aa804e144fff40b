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
/// `ghcr.io/org/image:tag`, `host:5000/team/app@sha256:…`; a missing tag is `latest`.
/// Errors: `Reference`.
pub fn parse_reference(s: &str) -> Result<Reference, RegistryError> {
    Reference::from_str(s).map_err(|e| RegistryError::Reference {
        reference: s.to_string(),
        why: e.to_string(),
    })
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
        let parsed = parse_reference(reference)?;
        let shown = parsed.whole();
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
            reference: shown.clone(),
            why: format!("making the HTTP client: {e}"),
        })?;
        let auth = match &opts.credentials {
            Credentials::Anonymous => RegistryAuth::Anonymous,
            Credentials::Basic { username, password } => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
        };
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
        let got = format!("sha256:{}", hex::encode(Sha256::digest(config.as_bytes())));
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
        // oci-client checks the blob's digest too and fails the stream's end when it is
        // wrong: that is a bad layer (`invalid`), not a registry gone away.
        let bytes = stream.stream.map_err(|e| {
            if e.get_ref()
                .is_some_and(|i| i.is::<oci_client::errors::DigestError>())
            {
                std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
            } else {
                e
            }
        });
        let reader = tokio_util::io::StreamReader::new(bytes);
        Ok((
            Box::new(tokio_util::io::SyncIoBridge::new_with_handle(
                reader,
                self.rt.clone(),
            )),
            size,
        ))
    }
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
}
