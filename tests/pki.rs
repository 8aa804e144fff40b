//! `opendsec ctl pki` (docs/tls.md): `init` makes a CA and a certificate for every
//! component a cluster config names, `issue` one more from that CA, `ca` a CA alone; the
//! certificates carry their identities, keys are 0600, bad input changes nothing; and what
//! they make works for mutual TLS: a server and a client of the cluster's CA complete a
//! handshake, while a client of another CA, or none, is refused.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use opendsec::pki::{CertInfo, Identity, Role, API_DNS_NAME};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

fn ctl(args: &[&str]) -> Output {
    Command::new(common::BIN)
        .arg("ctl")
        .args(args)
        .output()
        .unwrap()
}

/// `pki init` of `config` into `out`.
fn init(config: &Path, out: &Path) -> Output {
    ctl(&[
        "pki",
        "init",
        "-config",
        config.to_str().unwrap(),
        "-out",
        out.to_str().unwrap(),
    ])
}

/// The names in directory `d`.
fn names(d: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect()
}

fn ok(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn failed(o: &Output, code: i32, reason: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(code), "{err}");
    assert!(err.starts_with(&format!("error: {reason}:")), "{err}");
    err
}

const CONFIG: &str = r#"{
  "tls": {"dir": "/etc/opendsec/pki"},
  "iam": {"addr": "10.0.0.1:9461", "admin_token": "dsk.admin.secret"},
  "watcher": {"addr": "10.0.0.1:9462"},
  "apiserver": [{"addr": "10.0.0.1:7100"}, {"addr": "10.0.0.2:7100"}],
  "edges": [{"id": "n1", "addr": "10.0.0.5:9465"}, {"id": "n2", "addr": "0.0.0.0:9465"}]
}"#;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn info(p: &Path) -> CertInfo {
    CertInfo::from_pem(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn init_issue_and_ca_write_what_the_cluster_needs_and_refuse_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("opendsec.json");
    std::fs::write(&config, CONFIG).unwrap();
    let out = tmp.path().join("pki");
    let v = ok(&ctl(&[
        "pki",
        "init",
        "-config",
        config.to_str().unwrap(),
        "-out",
        out.to_str().unwrap(),
        "-hosts",
        "lb.example,192.0.2.10",
    ]));
    let written: Vec<String> = v["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            Path::new(p.as_str().unwrap())
                .file_name()
                .unwrap()
                .to_string_lossy()
                .to_string()
        })
        .collect();
    assert_eq!(
        written,
        [
            "iam-0.crt",
            "watcher-0.crt",
            "apiserver-0.crt",
            "apiserver-1.crt",
            "edge-n1.crt",
            "edge-n2.crt"
        ]
    );
    assert_eq!(mode(&out.join("ca.key")), 0o600);
    assert_eq!(mode(&out.join("ca.crt")), 0o644);
    // The sandbox access token secret: 32 random bytes in hex, owner only.
    assert_eq!(mode(&out.join("grant.key")), 0o600);
    let grant = std::fs::read_to_string(out.join("grant.key")).unwrap();
    assert_eq!(grant.trim().len(), 64);
    assert!(grant.trim().bytes().all(|b| b.is_ascii_hexdigit()));
    for stem in [
        "iam-0",
        "watcher-0",
        "apiserver-0",
        "apiserver-1",
        "edge-n1",
        "edge-n2",
    ] {
        assert_eq!(mode(&out.join(format!("{stem}.key"))), 0o600, "{stem}");
    }
    let ca = info(&out.join("ca.crt"));
    assert!(ca.is_ca);
    // An apiserver: its identity, the API name, its own address and the -hosts.
    let a1 = info(&out.join("apiserver-1.crt"));
    assert_eq!(
        a1.identities,
        [Identity::new(Role::Apiserver, "1").unwrap()]
    );
    assert_eq!(a1.dns_names, [API_DNS_NAME, "lb.example"]);
    assert_eq!(
        a1.ips,
        [
            "192.0.2.10".parse::<std::net::IpAddr>().unwrap(),
            "10.0.0.2".parse().unwrap()
        ]
    );
    assert!(!a1.is_ca);
    // 365 days by default, well inside the CA's 3650.
    let days = (a1.not_after - a1.not_before).whole_days();
    assert!((365..=366).contains(&days), "{days}");
    // An edge names its own address only: not the load balancer's names, nor an address
    // when it listens on a wildcard.
    let n1 = info(&out.join("edge-n1.crt"));
    assert!(n1.dns_names.is_empty(), "{n1:?}");
    assert_eq!(n1.ips, ["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]);
    let n2 = info(&out.join("edge-n2.crt"));
    assert_eq!(n2.identities, [Identity::new(Role::Edge, "n2").unwrap()]);
    assert!(n2.dns_names.is_empty() && n2.ips.is_empty(), "{n2:?}");

    // One more component from the same CA.
    let v = ok(&ctl(&[
        "pki",
        "issue",
        "-ca",
        out.to_str().unwrap(),
        "-role",
        "fleet",
        "-id",
        "f1",
        "-out",
        out.to_str().unwrap(),
        "-days",
        "30",
    ]));
    assert_eq!(v["identity"], "opendsec://fleet/f1");
    let f1 = info(&out.join("fleet-f1.crt"));
    assert_eq!(f1.identities, [Identity::new(Role::Fleet, "f1").unwrap()]);
    assert_eq!((f1.not_after - f1.not_before).whole_days(), 30);

    // Bad input: a clear error, nothing written.
    let before = names(&out);
    failed(&init(&config, &out), 1, "conflict");
    for (args, reason) in [
        (vec!["-role", "admin", "-id", "x"], "invalid"),
        (vec!["-role", "edge", "-id", "../x"], "invalid"),
        (
            vec!["-role", "edge", "-id", "n9", "-hosts", "a b"],
            "invalid",
        ),
        (vec!["-role", "edge", "-id", "n9", "-days", "0"], "invalid"),
        // An IAM replica: a decimal id, and the host the other replicas dial.
        (
            vec!["-role", "iam", "-id", "04", "-hosts", "iam4"],
            "invalid",
        ),
        (
            vec!["-role", "iam", "-id", "a", "-hosts", "iam4"],
            "invalid",
        ),
        (vec!["-role", "iam", "-id", "4"], "invalid"),
    ] {
        let mut a = vec![
            "pki",
            "issue",
            "-ca",
            out.to_str().unwrap(),
            "-out",
            out.to_str().unwrap(),
        ];
        a.extend(args.iter().copied());
        failed(&ctl(&a), 1, reason);
    }
    failed(
        &ctl(&[
            "pki",
            "issue",
            "-ca",
            "/nonexistent",
            "-role",
            "edge",
            "-id",
            "n9",
            "-out",
            "/tmp",
        ]),
        1,
        "not_found",
    );
    let after = names(&out);
    assert_eq!(before, after);
    // An invalid config writes nothing at all.
    std::fs::write(
        &config,
        r#"{"tls": {"dir": "/x"}, "edges": [{"id": "n 1"}]}"#,
    )
    .unwrap();
    let fresh = tmp.path().join("fresh");
    failed(&init(&config, &fresh), 1, "invalid");
    assert!(!fresh.exists());
    // A usage error exits 2.
    failed(&ctl(&["pki", "issue", "-role", "edge"]), 2, "invalid");

    // A node's trust directory (ca.crt alone) is not a place for a new CA either.
    let trust = tmp.path().join("trust");
    std::fs::create_dir(&trust).unwrap();
    std::fs::copy(out.join("ca.crt"), trust.join("ca.crt")).unwrap();
    failed(
        &ctl(&["pki", "ca", "-out", trust.to_str().unwrap()]),
        1,
        "conflict",
    );
    assert_eq!(
        std::fs::read(trust.join("ca.crt")).unwrap(),
        std::fs::read(out.join("ca.crt")).unwrap()
    );
    assert!(!trust.join("ca.key").exists());
    // A CA alone, for a rotation; another in the same place is refused.
    let next = tmp.path().join("next");
    ok(&ctl(&[
        "pki",
        "ca",
        "-out",
        next.to_str().unwrap(),
        "-days",
        "10",
    ]));
    let n = info(&next.join("ca.crt"));
    assert!(n.is_ca);
    assert_eq!((n.not_after - n.not_before).whole_days(), 10);
    failed(
        &ctl(&["pki", "ca", "-out", next.to_str().unwrap()]),
        1,
        "conflict",
    );
}

fn certs(p: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(p)
        .unwrap()
        .map(|c| c.unwrap())
        .collect()
}

fn key(p: &Path) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_file(p).unwrap()
}

fn roots(ca: &Path) -> Arc<rustls::RootCertStore> {
    let mut r = rustls::RootCertStore::empty();
    for c in certs(ca) {
        r.add(c).unwrap();
    }
    Arc::new(r)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A handshake between a server with `server` (stem in `dir`) requiring clients of `dir`'s
/// CA, and a client trusting `dir`'s CA that presents `client` (a directory and stem) or
/// nothing. Returns the identity the server saw, or the error.
async fn handshake(
    dir: &Path,
    server: &str,
    client: Option<(&Path, &str)>,
) -> Result<Vec<Identity>, String> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots(&dir.join("ca.crt")),
        provider(),
    )
    .build()
    .unwrap();
    let sc = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            certs(&dir.join(format!("{server}.crt"))),
            key(&dir.join(format!("{server}.key"))),
        )
        .unwrap();
    let cb = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(&dir.join("ca.crt")));
    let cc = match client {
        Some((d, stem)) => cb
            .with_client_auth_cert(
                certs(&d.join(format!("{stem}.crt"))),
                key(&d.join(format!("{stem}.key"))),
            )
            .unwrap(),
        None => cb.with_no_client_auth(),
    };
    let (a, b) = tokio::io::duplex(1 << 16);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(sc));
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cc));
    let name = ServerName::try_from(API_DNS_NAME).unwrap();
    let srv = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut s = acceptor.accept(a).await.map_err(|e| e.to_string())?;
        let seen = s
            .get_ref()
            .1
            .peer_certificates()
            .unwrap_or_default()
            .iter()
            .flat_map(|c| CertInfo::from_der(c).unwrap().identities)
            .collect::<Vec<_>>();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(seen)
    });
    let cli = async {
        use tokio::io::AsyncWriteExt;
        let mut c = connector
            .connect(name, b)
            .await
            .map_err(|e| e.to_string())?;
        c.write_all(b"hi").await.map_err(|e| e.to_string())?;
        c.flush().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(c)
    };
    // The side that refused says why; the other only hears an alert.
    let c = cli.await;
    let seen = srv.await.unwrap();
    match (c, seen) {
        (Err(client), Err(server)) if server.contains("received fatal alert") => Err(client),
        (Err(client), Ok(_)) => Err(client),
        (_, seen) => seen,
    }
}

#[tokio::test]
async fn the_certificates_make_mutual_tls_and_strangers_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("opendsec.json");
    std::fs::write(&config, CONFIG).unwrap();
    let (pki, other) = (tmp.path().join("pki"), tmp.path().join("other"));
    for d in [&pki, &other] {
        ok(&init(&config, d));
    }
    // An edge calls an apiserver: both sides check the other against the cluster's CA,
    // and the server reads the caller's identity from its certificate.
    assert_eq!(
        handshake(&pki, "apiserver-0", Some((&pki, "edge-n1")))
            .await
            .unwrap(),
        [Identity::new(Role::Edge, "n1").unwrap()]
    );
    // A client with a certificate from another CA, or with none, is refused.
    let e = handshake(&pki, "apiserver-0", Some((&other, "edge-n1")))
        .await
        .unwrap_err();
    assert!(e.contains("certificate") || e.contains("Unknown"), "{e}");
    let e = handshake(&pki, "apiserver-0", None).await.unwrap_err();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    // A server whose certificate lacks the API name is refused by the client.
    let e = handshake(&pki, "edge-n1", Some((&pki, "apiserver-0")))
        .await
        .unwrap_err();
    assert!(
        e.contains("NotValidForName") || e.to_lowercase().contains("name"),
        "{e}"
    );
}
