//! The cluster's certificates (docs/tls.md): a CA, and one certificate per component
//! instance whose identity is the URI SAN `opendsec://<role>/<id>`, as `opendsec ctl pki`
//! makes them. Keys are ECDSA P-256, written 0600; certificates and the CA's public half
//! 0644.
//!
//! A directory made here holds `ca.crt`, `ca.key` (only on the machine that issues), and
//! `<role>-<id>.crt` / `<role>-<id>.key` per component.

pub mod cluster;
pub mod rotate;

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

/// The CA's files in a directory.
pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";

/// The DNS name every apiserver certificate carries, so that clients may check one name
/// whatever address they dialled (docs/tls.md).
pub const API_DNS_NAME: &str = "api.opendsec.internal";

/// The scheme of a component's identity URI.
pub const SCHEME: &str = "opendsec";

/// What a component is: the first part of its identity, what each service's access rules
/// name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Edge,
    Apiserver,
    Watcher,
    Iam,
    Fleet,
    Node,
    Ops,
    /// The E2B gateway (it calls the apiserver as its callers, with their tokens, over
    /// the public port, and needs a certificate only to trust it).
    E2b,
}

impl Role {
    pub const ALL: [Role; 8] = [
        Role::Edge,
        Role::Apiserver,
        Role::Watcher,
        Role::Iam,
        Role::Fleet,
        Role::Node,
        Role::Ops,
        Role::E2b,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Edge => "edge",
            Role::Apiserver => "apiserver",
            Role::Watcher => "watcher",
            Role::Iam => "iam",
            Role::Fleet => "fleet",
            Role::Node => "node",
            Role::Ops => "ops",
            Role::E2b => "e2b",
        }
    }

    /// The role named `s`. Errors: `BadRole` with the names there are.
    pub fn parse(s: &str) -> Result<Role, PkiError> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| PkiError::BadRole(s.to_string()))
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A component instance's identity: `opendsec://<role>/<id>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub role: Role,
    pub id: String,
}

impl Identity {
    /// The identity of `role` instance `id`. Errors: `BadId` unless `id` is 1 to 64 of
    /// `[A-Za-z0-9._-]` (it is a URI path segment and a file name).
    pub fn new(role: Role, id: &str) -> Result<Identity, PkiError> {
        let ok = !id.is_empty()
            && id.len() <= 64
            && id != "."
            && id != ".."
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok {
            return Err(PkiError::BadId(id.to_string()));
        }
        Ok(Identity {
            role,
            id: id.to_string(),
        })
    }

    pub fn uri(&self) -> String {
        format!("{SCHEME}://{}/{}", self.role, self.id)
    }

    /// The identity a URI names, if it is one of ours.
    pub fn from_uri(uri: &str) -> Option<Identity> {
        let rest = uri.strip_prefix(SCHEME)?.strip_prefix("://")?;
        let (role, id) = rest.split_once('/')?;
        Identity::new(Role::parse(role).ok()?, id).ok()
    }

    /// The base name of its files in a directory: `<role>-<id>`.
    pub fn file_stem(&self) -> String {
        format!("{}-{}", self.role, self.id)
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

/// Why a certificate could not be made, read or written.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("unknown role {0:?} (edge, apiserver, watcher, iam, fleet, node, ops, e2b)")]
    BadRole(String),
    #[error("component id {0:?}: 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-'")]
    BadId(String),
    #[error("host {0:?} is neither an IP address nor a DNS name")]
    BadHost(String),
    #[error("{0} days: a certificate is valid 1 to 36500 days")]
    BadDays(i64),
    #[error("the CA expires {expires}: it can issue no certificate valid a day or more")]
    Expired { expires: String },
    #[error("{0} is there already: a CA is never replaced; remove it first, or write elsewhere")]
    Exists(PathBuf),
    #[error("making a certificate: {0}")]
    Make(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a certificate: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("CA rotation step {step}: {why}")]
    Rotation { step: u8, why: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A CA that can issue: its certificate (PEM) and key.
pub struct Ca {
    pub cert_pem: String,
    key: KeyPair,
    /// When it expires.
    pub not_after: OffsetDateTime,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued").finish_non_exhaustive()
    }
}

/// Checks a validity in days (1 to 36500). Errors: `BadDays`.
pub fn check_days(days: i64) -> Result<(), PkiError> {
    valid_for(days).map(|_| ())
}

/// Checks a host a certificate may name: an IP address or a DNS name. Errors: `BadHost`.
pub fn check_host(h: &str) -> Result<(), PkiError> {
    host_san(h).map(|_| ())
}

fn valid_for(days: i64) -> Result<Duration, PkiError> {
    if !(1..=36500).contains(&days) {
        return Err(PkiError::BadDays(days));
    }
    Ok(Duration::days(days))
}

/// A host for a certificate's SANs: an IP address, else a DNS name.
fn host_san(h: &str) -> Result<SanType, PkiError> {
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
        // A mistyped address ("10.0.0.256", "1.2.3") is not a host name.
        && !h
            .rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
    if !ok {
        return Err(PkiError::BadHost(h.to_string()));
    }
    Ok(SanType::DnsName(
        h.to_string()
            .try_into()
            .map_err(|_| PkiError::BadHost(h.to_string()))?,
    ))
}

impl Ca {
    /// A new CA named "OpenDsec cluster CA", valid `days` from now (an hour back, for
    /// clocks a little behind). Errors: `BadDays`, `Make`.
    pub fn generate(days: i64) -> Result<Ca, PkiError> {
        let valid = valid_for(days)?;
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "OpenDsec cluster CA");
        dn.push(DnType::OrganizationName, "OpenDsec");
        p.distinguished_name = dn;
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = OffsetDateTime::now_utc();
        p.not_before = now - Duration::hours(1);
        p.not_after = now + valid;
        let cert = p.self_signed(&key)?;
        Ok(Ca {
            cert_pem: cert.pem(),
            key,
            not_after: p.not_after,
        })
    }

    /// The CA in `dir` (`ca.crt`, `ca.key`). Errors: `Io`, `Parse`.
    pub fn load(dir: &Path) -> Result<Ca, PkiError> {
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let cert_pem = std::fs::read_to_string(&cert_path).map_err(io_err(&cert_path))?;
        let key_pem = std::fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| PkiError::Parse {
            path: key_path.clone(),
            message: e.to_string(),
        })?;
        let info = CertInfo::from_pem(&cert_pem).map_err(|message| PkiError::Parse {
            path: cert_path.clone(),
            message,
        })?;
        // A leaf in ca.crt, or a key of another CA, would issue what nothing verifies.
        if !info.is_ca {
            return Err(PkiError::Parse {
                path: cert_path,
                message: "not a CA certificate".into(),
            });
        }
        if info.public_key != rcgen::PublicKeyData::subject_public_key_info(&key) {
            return Err(PkiError::Parse {
                path: key_path,
                message: format!("not the key of {}", cert_path.display()),
            });
        }
        Ok(Ca {
            cert_pem,
            key,
            not_after: info.not_after,
        })
    }

    /// Writes `ca.key` (0600), then `ca.crt` (0644), into `dir` (made if missing), never
    /// over a CA that is there: each file is linked into place only where no file of that
    /// name is (a trust directory with only `ca.crt` counts too). Errors: `Exists`, `Io`.
    pub fn save(&self, dir: &Path) -> Result<(), PkiError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        for f in [CA_KEY, CA_CERT] {
            let p = dir.join(f);
            if std::fs::symlink_metadata(&p).is_ok() {
                return Err(PkiError::Exists(p));
            }
        }
        write_new(
            &dir.join(CA_KEY),
            self.key.serialize_pem().as_bytes(),
            0o600,
        )?;
        write_new(&dir.join(CA_CERT), self.cert_pem.as_bytes(), 0o644)
    }

    /// A certificate for `who`, valid `days` from now but never past the CA's own
    /// expiry, for both ends of mTLS (server and client auth), with `hosts` (IP
    /// addresses or DNS names) as further SANs; an apiserver's also carries
    /// [`API_DNS_NAME`]. Errors: `BadDays`, `BadHost`, `Expired`, `Make`.
    pub fn issue(&self, who: &Identity, hosts: &[String], days: i64) -> Result<Issued, PkiError> {
        let valid = valid_for(days)?;
        let now = OffsetDateTime::now_utc();
        if self.not_after <= now + Duration::days(1) {
            return Err(PkiError::Expired {
                expires: self.not_after.to_string(),
            });
        }
        let mut sans = vec![SanType::URI(
            who.uri()
                .try_into()
                .map_err(|_| PkiError::BadId(who.id.clone()))?,
        )];
        if who.role == Role::Apiserver {
            sans.push(host_san(API_DNS_NAME)?);
        }
        for h in hosts {
            let san = host_san(h)?;
            if !sans.contains(&san) {
                sans.push(san);
            }
        }
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, who.uri());
        dn.push(DnType::OrganizationName, "OpenDsec");
        p.distinguished_name = dn;
        p.subject_alt_names = sans;
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        p.not_before = now - Duration::hours(1);
        p.not_after = (now + valid).min(self.not_after);
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)?;
        let cert = p.signed_by(&key, &issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Writes `issued` for `who` into `dir` as `<role>-<id>.crt` (0644) and `.key` (0600),
/// made if missing; returns the certificate's path. Errors: `Io`.
pub fn save_issued(dir: &Path, who: &Identity, issued: &Issued) -> Result<PathBuf, PkiError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let stem = who.file_stem();
    let cert = dir.join(format!("{stem}.crt"));
    write_file(&cert, issued.cert_pem.as_bytes(), 0o644)?;
    write_file(
        &dir.join(format!("{stem}.key")),
        issued.key_pem.as_bytes(),
        0o600,
    )?;
    Ok(cert)
}

/// A file of `bytes` with `mode` beside `path`, under a name no other writer uses, synced;
/// returns its path. A key never exists, even briefly, with a wider mode. Errors: `Io`.
fn temp_beside(path: &Path, bytes: &[u8], mode: u32) -> Result<PathBuf, PkiError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    if let Err(e) = f.write_all(bytes).and_then(|()| f.sync_all()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(&tmp)(e));
    }
    Ok(tmp)
}

/// Writes `bytes` to `path` with `mode`, replacing what is there atomically. Errors: `Io`.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PkiError> {
    let tmp = temp_beside(path, bytes, mode)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(path)(e)
    })
}

/// Writes `bytes` to `path` with `mode` only where nothing is at `path`, atomically (a
/// hard link into place fails on an existing name, whoever made it meanwhile).
/// Errors: `Exists`, `Io`.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PkiError> {
    let tmp = temp_beside(path, bytes, mode)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Err(PkiError::Exists(path.to_path_buf()))
        }
        Err(e) => Err(io_err(path)(e)),
    }
}

/// What a certificate says that the cluster reads: its identities (URI SANs of ours), DNS
/// and IP SANs, and its validity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    pub identities: Vec<Identity>,
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
    pub is_ca: bool,
    /// Its SubjectPublicKeyInfo, DER.
    pub public_key: Vec<u8>,
}

impl CertInfo {
    /// Reads a DER certificate. Errors: what the parser said.
    pub fn from_der(der: &[u8]) -> Result<CertInfo, String> {
        use x509_parser::extensions::GeneralName;
        let (_, x) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
        let mut info = CertInfo {
            identities: Vec::new(),
            dns_names: Vec::new(),
            ips: Vec::new(),
            not_before: x.validity().not_before.to_datetime(),
            not_after: x.validity().not_after.to_datetime(),
            is_ca: x.is_ca(),
            public_key: x.public_key().raw.to_vec(),
        };
        if let Ok(Some(san)) = x.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::URI(u) => info.identities.extend(Identity::from_uri(u)),
                    GeneralName::DNSName(d) => info.dns_names.push(d.to_string()),
                    GeneralName::IPAddress(b) => match b.len() {
                        4 => info
                            .ips
                            .extend(<[u8; 4]>::try_from(*b).ok().map(IpAddr::from)),
                        16 => info
                            .ips
                            .extend(<[u8; 16]>::try_from(*b).ok().map(IpAddr::from)),
                        _ => {}
                    },
                    _ => {}
                }
            }
        }
        Ok(info)
    }

    /// Reads the first certificate of a PEM text. Errors: no certificate, or the parser's.
    pub fn from_pem(pem: &str) -> Result<CertInfo, String> {
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|e| e.to_string())?;
        if p.label != "CERTIFICATE" {
            return Err(format!("a PEM block {:?}, not a certificate", p.label));
        }
        CertInfo::from_der(&p.contents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn identities_are_uris_of_known_roles_and_safe_ids() {
        let i = Identity::new(Role::Edge, "n1").unwrap();
        assert_eq!(i.uri(), "opendsec://edge/n1");
        assert_eq!(i.file_stem(), "edge-n1");
        assert_eq!(Identity::from_uri("opendsec://edge/n1"), Some(i));
        for bad in ["", "..", "a/b", "a b", &"x".repeat(65)] {
            assert!(
                matches!(Identity::new(Role::Iam, bad), Err(PkiError::BadId(_))),
                "{bad}"
            );
        }
        assert!(Identity::from_uri("opendsec://root/n1").is_none());
        assert!(Identity::from_uri("https://edge/n1").is_none());
        assert!(Identity::from_uri("opendsec://edge/n1/x").is_none());
        assert!(matches!(Role::parse("admin"), Err(PkiError::BadRole(_))));
    }

    #[test]
    fn a_ca_issues_certificates_that_carry_their_identity_and_end_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::generate(30).unwrap();
        ca.save(dir.path()).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join(CA_KEY)), 0o600);
        assert_eq!(mode(&dir.path().join(CA_CERT)), 0o644);
        let ca = Ca::load(dir.path()).unwrap();
        let who = Identity::new(Role::Apiserver, "0").unwrap();
        let issued = ca
            .issue(&who, &["10.0.0.1".into(), "lb.example".into()], 365)
            .unwrap();
        let cert = save_issued(dir.path(), &who, &issued).unwrap();
        assert_eq!(cert, dir.path().join("apiserver-0.crt"));
        assert_eq!(mode(&dir.path().join("apiserver-0.key")), 0o600);
        let info = CertInfo::from_pem(&issued.cert_pem).unwrap();
        assert_eq!(info.identities, vec![who]);
        assert_eq!(
            info.dns_names,
            vec![API_DNS_NAME.to_string(), "lb.example".into()]
        );
        assert_eq!(info.ips, vec!["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert!(!info.is_ca);
        // 365 days asked, the CA lives 30: the certificate ends with the CA.
        let ca_info = CertInfo::from_pem(&ca.cert_pem).unwrap();
        assert!(ca_info.is_ca);
        assert_eq!(info.not_after, ca_info.not_after);
        // Other roles carry no API name.
        let edge = Identity::new(Role::Edge, "n1").unwrap();
        let info = CertInfo::from_pem(&ca.issue(&edge, &[], 10).unwrap().cert_pem).unwrap();
        assert!(info.dns_names.is_empty());
        assert!(info.not_after < ca_info.not_after);
    }

    #[test]
    fn bad_input_is_refused() {
        let ca = Ca::generate(30).unwrap();
        let who = Identity::new(Role::Edge, "n1").unwrap();
        assert!(matches!(ca.issue(&who, &[], 0), Err(PkiError::BadDays(0))));
        assert!(matches!(Ca::generate(40000), Err(PkiError::BadDays(_))));
        for h in ["", "a..b", "-a.b", "a b", "a,b", "10.0.0.256", "1.2.3"] {
            assert!(
                matches!(
                    ca.issue(&who, &[h.to_string()], 1),
                    Err(PkiError::BadHost(_))
                ),
                "{h}"
            );
        }
        // A CA is never written over, not even a trust directory's lone ca.crt.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CA_CERT), "trusted").unwrap();
        assert!(matches!(ca.save(dir.path()), Err(PkiError::Exists(_))));
        assert_eq!(
            std::fs::read_to_string(dir.path().join(CA_CERT)).unwrap(),
            "trusted"
        );
        assert!(!dir.path().join(CA_KEY).exists());
        // A leaf where the CA goes, or another CA's key, is refused.
        let leaf = ca.issue(&who, &[], 1).unwrap();
        let other = Ca::generate(30).unwrap();
        for (cert, key) in [
            (leaf.cert_pem.clone(), leaf.key_pem.clone()),
            (ca.cert_pem.clone(), other.key.serialize_pem()),
        ] {
            let d = tempfile::tempdir().unwrap();
            std::fs::write(d.path().join(CA_CERT), cert).unwrap();
            std::fs::write(d.path().join(CA_KEY), key).unwrap();
            assert!(matches!(Ca::load(d.path()), Err(PkiError::Parse { .. })));
        }
        // A CA about to expire issues nothing.
        let mut ending = Ca::generate(30).unwrap();
        ending.not_after = OffsetDateTime::now_utc() + Duration::hours(2);
        assert!(matches!(
            ending.issue(&who, &[], 1),
            Err(PkiError::Expired { .. })
        ));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CA_CERT), "not a certificate").unwrap();
        std::fs::write(dir.path().join(CA_KEY), "nor a key").unwrap();
        assert!(matches!(Ca::load(dir.path()), Err(PkiError::Parse { .. })));
        assert!(matches!(
            Ca::load(&dir.path().join("missing")),
            Err(PkiError::Io { .. })
        ));
    }
}
