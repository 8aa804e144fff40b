//! Mutual TLS between the roles (docs/tls.md "Between components"): what a component loads
//! from `tls.dir` (the CA bundle, its own certificate and key), the server settings of its
//! port, and client connections that check the role of the component they reach.
//!
//! A server checks the chain of a caller's certificate here, during the handshake; which
//! role may call which method is [`super::acl`]'s job. A client checks the server's chain,
//! its name (the address dialled, or `api.opendsec.internal` for apiservers) and its
//! identity: a certificate of another role is refused even where it carries the right
//! address, so an edge on the same machine as IAM cannot stand in for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tonic::transport::{Certificate, Channel, Endpoint, Identity as TonicIdentity};

use crate::pki::{self, CertInfo, Identity, Role};

/// How long a TLS handshake may take on a server before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a component's TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Bad { path: PathBuf, why: String },
    #[error("{path} is for {found}, not {want}")]
    WrongIdentity {
        path: PathBuf,
        found: String,
        want: Identity,
    },
    #[error("TLS settings: {0}")]
    Rustls(#[from] rustls::Error),
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate of a PEM file. Errors: `Bad` when there is none or one does not parse.
pub fn pem_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Bad {
            path: path.to_path_buf(),
            why: format!("not PEM certificates: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Bad {
            path: path.to_path_buf(),
            why: "holds no certificate".into(),
        });
    }
    Ok(certs)
}

/// The trust anchors of a CA bundle (`ca.crt`; during a CA rotation it holds two CAs).
/// Errors: `Read`, `Bad` (no certificate, or one that is not a usable CA).
pub fn load_roots(path: &Path) -> Result<(Vec<u8>, RootCertStore, Vec<CertInfo>), TlsError> {
    let pem = read(path)?;
    let certs = pem_certs(path, &pem)?;
    let mut roots = RootCertStore::empty();
    let mut infos = Vec::new();
    for c in certs {
        let info = CertInfo::from_der(&c).map_err(|why| TlsError::Bad {
            path: path.to_path_buf(),
            why,
        })?;
        if !info.is_ca {
            return Err(TlsError::Bad {
                path: path.to_path_buf(),
                why: "holds a certificate that is not a CA's".into(),
            });
        }
        roots.add(c).map_err(|e| TlsError::Bad {
            path: path.to_path_buf(),
            why: e.to_string(),
        })?;
        infos.push(info);
    }
    Ok((pem, roots, infos))
}

/// One component's TLS material, loaded once at start and shared by its server and clients.
pub struct Tls {
    me: Identity,
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    roots: Arc<RootCertStore>,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// (identity label, expiry in Unix seconds): the CAs (`ca`) and the own certificate.
    expiries: Vec<(String, i64)>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("me", &self.me).finish()
    }
}

impl Tls {
    /// Loads `dir/ca.crt` and `dir/<role>-<id>.crt|.key` for `me`. The certificate must name
    /// `me` and chain to a CA of the bundle, so a misplaced file fails at start rather than
    /// at the first call. Errors: `Read`, `Bad`, `WrongIdentity`, `Rustls`.
    pub fn load(dir: &Path, me: &Identity) -> Result<Tls, TlsError> {
        let ca_path = dir.join(pki::CA_CERT);
        let (ca_pem, roots, cas) = load_roots(&ca_path)?;
        let cert_path = dir.join(format!("{}.crt", me.file_stem()));
        let key_path = dir.join(format!("{}.key", me.file_stem()));
        let cert_pem = read(&cert_path)?;
        let key_pem = read(&key_path)?;
        let certs = pem_certs(&cert_path, &cert_pem)?;
        // pem_certs never returns an empty list.
        let Some((leaf, chain)) = certs.split_first() else {
            return Err(TlsError::Bad {
                path: cert_path,
                why: "holds no certificate".into(),
            });
        };
        let info = CertInfo::from_der(leaf).map_err(|why| TlsError::Bad {
            path: cert_path.clone(),
            why,
        })?;
        if !info.identities.contains(me) {
            let found = info
                .identities
                .iter()
                .map(Identity::uri)
                .collect::<Vec<_>>()
                .join(", ");
            return Err(TlsError::WrongIdentity {
                path: cert_path,
                found: if found.is_empty() {
                    "no identity".into()
                } else {
                    found
                },
                want: me.clone(),
            });
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Bad {
            path: key_path.clone(),
            why: format!("not a PEM private key: {e}"),
        })?;
        let roots = Arc::new(roots);
        // The chain and the key pair are checked by building a client config with them:
        // rustls refuses a key that does not match the certificate.
        let verifier = rustls::server::WebPkiClientVerifier::builder(roots.clone())
            .build()
            .map_err(|e| TlsError::Bad {
                path: ca_path.clone(),
                why: e.to_string(),
            })?;
        verifier
            .verify_client_cert(leaf, chain, UnixTime::now())
            .map_err(|e| TlsError::Bad {
                path: cert_path.clone(),
                why: format!("does not chain to a CA of {}: {e}", ca_path.display()),
            })?;
        ClientConfig::builder()
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(|e| TlsError::Bad {
                path: key_path,
                why: format!("does not go with {}: {e}", cert_path.display()),
            })?;
        let mut expiries: Vec<(String, i64)> = cas
            .iter()
            .map(|c| ("ca".to_string(), c.not_after.unix_timestamp()))
            .collect();
        expiries.push((me.uri(), info.not_after.unix_timestamp()));
        Ok(Tls {
            me: me.clone(),
            ca_pem,
            cert_pem,
            key_pem,
            roots,
            certs,
            key,
            expiries,
        })
    }

    /// The identity this component presents.
    pub fn identity(&self) -> &Identity {
        &self.me
    }

    /// Sets `opendsec_tls_cert_expiry_timestamp_seconds{identity}` for the certificates
    /// loaded: the component's own and (as `ca`) the earliest-expiring CA of the bundle
    /// (docs/tls.md "Expiry").
    pub fn export_metrics(&self) {
        let mut ca: Option<i64> = None;
        for (who, at) in &self.expiries {
            if who == "ca" {
                ca = Some(ca.map_or(*at, |c| c.min(*at)));
            } else {
                metrics::gauge!("opendsec_tls_cert_expiry_timestamp_seconds", "identity" => who.clone())
                    .set(*at as f64);
            }
        }
        if let Some(at) = ca {
            metrics::gauge!("opendsec_tls_cert_expiry_timestamp_seconds", "identity" => "ca")
                .set(at as f64);
        }
    }

    /// The server settings of this component's port. A client certificate is checked
    /// against the CA bundle during the handshake whenever one is presented (one from
    /// another CA ends the handshake), but is optional there: a port that needs one answers
    /// a call without it with `unauthenticated` ([`super::acl`]), which tells an operator
    /// more than a failed handshake, and the apiservers' public port takes bearer tokens.
    pub fn server(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new()
            .identity(TonicIdentity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(true)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// A client config that presents this component's certificate and accepts only a
    /// server of role `expect` (see the module's comment).
    pub fn client_config(&self, expect: Role) -> Result<Arc<ClientConfig>, TlsError> {
        self.client_config_for(expect, None)
    }

    /// As [`Tls::client_config`], and with `id` only the server of that identity: an
    /// apiserver reaching edge `n1` refuses edge `n2`'s certificate at `n1`'s address.
    pub fn client_config_for(
        &self,
        expect: Role,
        id: Option<&str>,
    ) -> Result<Arc<ClientConfig>, TlsError> {
        let webpki = WebPkiServerVerifier::builder(self.roots.clone())
            .build()
            .map_err(|e| TlsError::Bad {
                path: PathBuf::from(pki::CA_CERT),
                why: e.to_string(),
            })?;
        let mut cfg = ClientConfig::builder()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(RoleVerifier {
                inner: webpki,
                expect,
                id: id.map(str::to_string),
            }))
            .with_client_auth_cert(self.certs.clone(), self.key.clone_key())?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// The settings for a client of the public port (the E2B gateway): the cluster's CA,
    /// this component's certificate, and the apiservers' name.
    pub fn public_client(&self) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(TonicIdentity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(pki::API_DNS_NAME)
    }
}

/// Checks a server's chain and name as WebPKI does, then that it is a `expect` component
/// (with `id`, that very one).
#[derive(Debug)]
struct RoleVerifier {
    inner: Arc<WebPkiServerVerifier>,
    expect: Role,
    id: Option<String>,
}

impl ServerCertVerifier for RoleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let info = CertInfo::from_der(end_entity).map_err(|_| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding)
        })?;
        if info
            .identities
            .iter()
            .any(|i| i.role == self.expect && self.id.as_ref().is_none_or(|id| &i.id == id))
        {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The name a client checks on a server of role `expect` reached at `host`: apiservers by
/// their fixed name, others by the address dialled.
fn server_name(expect: Role, host: &str) -> Result<ServerName<'static>, std::io::Error> {
    let name = if expect == Role::Apiserver {
        pki::API_DNS_NAME
    } else {
        host.trim_start_matches('[').trim_end_matches(']')
    };
    ServerName::try_from(name.to_string()).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("server name {name:?}: {e}"),
        )
    })
}

/// A lazily connecting channel over TLS on `ep` (whose URI is `http://host:port`), that
/// accepts only a server of role `expect` (see [`Tls::client_config`]).
pub fn channel(ep: Endpoint, config: Arc<ClientConfig>, expect: Role) -> Channel {
    let connector = tower::service_fn(move |uri: tonic::codegen::http::Uri| {
        let config = config.clone();
        async move {
            let host = uri.host().unwrap_or_default().to_string();
            let port = uri.port_u16().unwrap_or(443);
            let name = server_name(expect, &host)?;
            let tcp = tokio::net::TcpStream::connect((
                host.trim_start_matches('[').trim_end_matches(']'),
                port,
            ))
            .await?;
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    });
    ep.connect_with_connector_lazy(connector)
}

/// The TLS material of component `me` under the config's `tls.dir`, its expiry exported as
/// a metric; `None` where the config has no `tls.dir` (plaintext with a `service_token`).
/// Errors: as [`Tls::load`].
pub fn for_component(
    cfg: &crate::config::Config,
    me: &Identity,
) -> Result<Option<Arc<Tls>>, TlsError> {
    if cfg.tls.dir.is_empty() {
        return Ok(None);
    }
    let tls = Tls::load(Path::new(&cfg.tls.dir), me)?;
    tls.export_metrics();
    tracing::info!(identity = %me, dir = %cfg.tls.dir, "mutual TLS on");
    Ok(Some(Arc::new(tls)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{save_issued, Ca};

    fn setup() -> (tempfile::TempDir, Ca, Identity) {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::generate(30).unwrap();
        ca.save(dir.path()).unwrap();
        let me = Identity::new(Role::Edge, "n1").unwrap();
        let issued = ca.issue(&me, &["127.0.0.1".into()], 1).unwrap();
        save_issued(dir.path(), &me, &issued).unwrap();
        (dir, ca, me)
    }

    #[test]
    fn a_component_loads_its_own_material_and_exports_its_expiry() {
        let (dir, ca, me) = setup();
        let tls = Tls::load(dir.path(), &me).unwrap();
        assert_eq!(tls.identity(), &me);
        assert_eq!(tls.expiries.len(), 2);
        assert_eq!(
            tls.expiries[0],
            ("ca".into(), ca.not_after.unix_timestamp())
        );
        assert_eq!(tls.expiries[1].0, "opendsec://edge/n1");
        assert!(tls.expiries[1].1 <= ca.not_after.unix_timestamp());
        for r in [Role::Iam, Role::Apiserver] {
            tls.client_config(r).unwrap();
        }
    }

    #[test]
    fn misplaced_or_mismatched_files_fail_at_load() {
        let (dir, ca, me) = setup();
        // Another identity's files are not there.
        let other = Identity::new(Role::Edge, "n2").unwrap();
        assert!(matches!(
            Tls::load(dir.path(), &other),
            Err(TlsError::Read { .. })
        ));
        // n2's name on n1's certificate.
        std::fs::copy(
            dir.path().join("edge-n1.crt"),
            dir.path().join("edge-n2.crt"),
        )
        .unwrap();
        std::fs::copy(
            dir.path().join("edge-n1.key"),
            dir.path().join("edge-n2.key"),
        )
        .unwrap();
        let e = Tls::load(dir.path(), &other).unwrap_err();
        assert!(matches!(e, TlsError::WrongIdentity { .. }), "{e}");
        // A key that is not the certificate's.
        let again = ca.issue(&me, &[], 1).unwrap();
        std::fs::write(dir.path().join("edge-n1.key"), again.key_pem).unwrap();
        let e = Tls::load(dir.path(), &me).unwrap_err();
        assert!(e.to_string().contains("does not go with"), "{e}");
        // A certificate from another CA.
        let foreign = Ca::generate(30).unwrap().issue(&me, &[], 1).unwrap();
        save_issued(dir.path(), &me, &foreign).unwrap();
        let e = Tls::load(dir.path(), &me).unwrap_err();
        assert!(e.to_string().contains("does not chain"), "{e}");
        // A bundle that holds a component's certificate, or nothing.
        std::fs::copy(dir.path().join("edge-n1.crt"), dir.path().join("ca.crt")).unwrap();
        let e = Tls::load(dir.path(), &me).unwrap_err();
        assert!(e.to_string().contains("not a CA"), "{e}");
        std::fs::write(dir.path().join("ca.crt"), "").unwrap();
        let e = Tls::load(dir.path(), &me).unwrap_err();
        assert!(e.to_string().contains("no certificate"), "{e}");
    }

    #[test]
    fn a_bundle_of_two_cas_trusts_both() {
        let (dir, _ca, me) = setup();
        let new = Ca::generate(30).unwrap();
        let mut bundle = std::fs::read_to_string(dir.path().join("ca.crt")).unwrap();
        bundle.push_str(&new.cert_pem);
        std::fs::write(dir.path().join("ca.crt"), &bundle).unwrap();
        // The old CA's certificate still loads, and so does one from the new CA.
        Tls::load(dir.path(), &me).unwrap();
        save_issued(dir.path(), &me, &new.issue(&me, &[], 1).unwrap()).unwrap();
        let tls = Tls::load(dir.path(), &me).unwrap();
        assert_eq!(tls.expiries.iter().filter(|(w, _)| w == "ca").count(), 2);
    }
}
