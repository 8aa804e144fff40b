//! Mutual TLS between the roles, attacked from outside (docs/tls.md): on a cluster started
//! with TLS, every method of every internal service is called by a client with no
//! certificate, with one from another CA, and with a certificate of every role; each is
//! refused or let through exactly as the access rules say. Clients check whom they reach,
//! an edge registers only itself, and the public port takes TLS with bearer tokens.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use opendsec::pb;
use opendsec::pki::{save_issued, Ca, Identity, Role};
use opendsec::roles::cluster::{LocalCluster, UpOptions};
use opendsec::rpc::client::{with_token, Dialer};
use opendsec::rpc::failure_from_status;
use opendsec::rpc::tls::Tls;
use opendsec::types::{Failure, Reason};
use tonic::codegen::http;
use tonic::transport::Channel;

const PROTOS: [&str; 4] = [
    include_str!("../proto/opendsec/v1/iam.proto"),
    include_str!("../proto/opendsec/v1/cluster.proto"),
    include_str!("../proto/opendsec/v1/runtime.proto"),
    include_str!("../proto/opendsec/v1/opendsec.proto"),
];

/// Every `(service, method)` the proto files declare, read from them so that a method added
/// later is covered without touching this test.
fn methods(service: &str) -> Vec<String> {
    let mut out = Vec::new();
    for text in PROTOS {
        let mut current = String::new();
        for line in text.lines() {
            let l = line.trim();
            if let Some(rest) = l.strip_prefix("service ") {
                current = rest.trim_end_matches('{').trim().to_string();
            } else if let Some(rest) = l.strip_prefix("rpc ") {
                if current == service {
                    out.push(rest.split('(').next().unwrap().trim().to_string());
                }
            } else if l == "}" {
                current.clear();
            }
        }
    }
    assert!(!out.is_empty(), "no methods of {service}");
    out
}

/// Who may call what: written out here from docs/tls.md, not taken from the code.
fn expected(service: &str, method: &str) -> &'static [Role] {
    match (service, method) {
        ("Iam", "Reconcile" | "SweepUnbound") => &[Role::Watcher],
        ("Iam", "GetLeases") => &[Role::Edge],
        ("Iam", "Lock" | "Unlock") => &[Role::Watcher, Role::Fleet],
        ("Iam", "KvGet" | "KvList" | "KvPut" | "KvDelete") => &[Role::Fleet],
        ("Iam", "ReleaseLeases") => &[Role::Apiserver, Role::Edge],
        ("Iam", _) => &[Role::Apiserver],
        ("Watcher", "GetSnapshot") => &[Role::Apiserver],
        ("Watcher", "Register") => &[Role::Edge],
        ("Edge", "Status") => &[Role::Apiserver, Role::Watcher],
        ("Edge" | "Runtime", _) => &[Role::Apiserver],
        _ => &[],
    }
}

struct World {
    cluster: LocalCluster,
    _dir: tempfile::TempDir,
    pki: std::path::PathBuf,
    certs: tempfile::TempDir,
}

async fn up() -> World {
    let dir = tempfile::tempdir().unwrap();
    let o = UpOptions {
        sim_edges: 2,
        addr: "127.0.0.1:0".into(),
        state_dir: dir.path().display().to_string(),
        disk_reserve_mb: -1,
        tls: true,
        ..Default::default()
    };
    let cluster = LocalCluster::up(&o).await.unwrap();
    assert!(cluster.cfg.service_token.is_empty());
    let pki = dir.path().join("pki");
    assert_eq!(Path::new(&cluster.cfg.tls.dir), pki);
    World {
        cluster,
        _dir: dir,
        pki,
        certs: tempfile::tempdir().unwrap(),
    }
}

impl World {
    /// A dialer presenting a certificate for `role`/`id` from `ca` (the cluster's unless
    /// given), trusting the cluster's CA.
    fn dialer_from(&self, ca: &Ca, role: Role, id: &str) -> Dialer {
        let who = Identity::new(role, id).unwrap();
        let dir = self
            .certs
            .path()
            .join(format!("{role}-{id}-{}", rand_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let issued = ca.issue(&who, &["127.0.0.1".into()], 1).unwrap();
        save_issued(&dir, &who, &issued).unwrap();
        // The bundle holds the cluster's CA (to trust the servers) and the issuer.
        let mut bundle = std::fs::read_to_string(self.pki.join("ca.crt")).unwrap();
        bundle.push_str(&ca.cert_pem);
        std::fs::write(dir.join("ca.crt"), bundle).unwrap();
        Dialer::new(Some(Arc::new(Tls::load(&dir, &who).unwrap()))).unwrap()
    }

    fn dialer(&self, role: Role, id: &str) -> Dialer {
        self.dialer_from(&Ca::load(&self.pki).unwrap(), role, id)
    }

    fn addr(&self, service: &str) -> String {
        let cfg = &self.cluster.cfg;
        match service {
            "Iam" => cfg.iam.addr.clone(),
            "Watcher" => cfg.watcher.addr.clone(),
            "Edge" | "Runtime" => cfg.edges[0].addr.clone(),
            _ => cfg.apiserver[0].addr.clone(),
        }
    }

    fn role_of(service: &str) -> Role {
        match service {
            "Iam" => Role::Iam,
            "Watcher" => Role::Watcher,
            "Edge" | "Runtime" => Role::Edge,
            _ => Role::Apiserver,
        }
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Calls `/opendsec.v1.<service>/<method>` with an empty message and returns how it ended.
async fn call(ch: Channel, service: &str, method: &str) -> Result<(), Failure> {
    let mut g = tonic::client::Grpc::new(ch);
    g.ready()
        .await
        .map_err(|e| Failure::unavailable(format!("{e:?}")))?;
    let path =
        http::uri::PathAndQuery::try_from(format!("/opendsec.v1.{service}/{method}")).unwrap();
    let codec = tonic_prost::ProstCodec::<pb::Empty, pb::Empty>::default();
    let mut req = tonic::Request::new(pb::Empty {});
    req.set_timeout(Duration::from_secs(10));
    g.unary(req, path, codec)
        .await
        .map(|_| ())
        .map_err(|s| failure_from_status(&s))
}

/// A TLS client of `addr` that trusts `ca`, checks the server for `name` and presents no
/// certificate.
fn tls_client(ca: &[u8], addr: &str, name: &str) -> Channel {
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name(name);
    opendsec::rpc::client::endpoint(&opendsec::rpc::client::https(addr), Duration::from_secs(2))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_lazy()
}

/// A TLS client that trusts the cluster's CA and presents no certificate.
fn anonymous(w: &World, addr: &str) -> Channel {
    let ca = std::fs::read(w.pki.join("ca.crt")).unwrap();
    tls_client(&ca, addr, "127.0.0.1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_internal_method_admits_exactly_the_roles_it_lists() {
    let w = up().await;
    let roles = [
        (Role::Apiserver, "0"),
        (Role::Edge, "sim-0"),
        (Role::Watcher, "0"),
        (Role::Iam, "0"),
        (Role::E2b, "0"),
        (Role::Ops, "op"),
        (Role::Fleet, "0"),
        (Role::Node, "n1"),
    ];
    let dialers: Vec<(Role, Dialer)> = roles.iter().map(|(r, id)| (*r, w.dialer(*r, id))).collect();
    let other_ca = Ca::generate(30).unwrap();
    let foreign = w.dialer_from(&other_ca, Role::Apiserver, "0");
    let mut checked = 0;
    for service in ["Iam", "Watcher", "Edge", "Runtime"] {
        let addr = w.addr(service);
        let server_role = World::role_of(service);
        for method in methods(service) {
            let allowed = expected(service, &method);
            for (role, d) in &dialers {
                let ch = d
                    .channel(&addr, Duration::from_secs(2), server_role)
                    .unwrap();
                let got = call(ch, service, &method).await;
                if allowed.contains(role) {
                    if let Err(f) = &got {
                        assert!(
                            f.reason != Reason::Forbidden
                                && !f.message.contains("needs a client certificate"),
                            "{role} calling {service}/{method} was refused: {f}"
                        );
                    }
                } else {
                    let f = got.expect_err(&format!("{role} called {service}/{method}"));
                    assert_eq!(
                        f.reason,
                        Reason::Forbidden,
                        "{role} {service}/{method}: {f}"
                    );
                    assert!(f.message.contains(&format!("opendsec://{role}/")), "{f}");
                }
                checked += 1;
            }
            // No certificate: the port answers `unauthenticated`.
            let f = call(anonymous(&w, &addr), service, &method)
                .await
                .expect_err("a call without a certificate");
            assert_eq!(f.reason, Reason::Unauthenticated, "{service}/{method}: {f}");
            // A certificate of another CA never completes the handshake.
            let ch = foreign
                .channel(&addr, Duration::from_secs(2), server_role)
                .unwrap();
            let f = call(ch, service, &method)
                .await
                .expect_err("another CA's certificate");
            assert_eq!(f.reason, Reason::Unavailable, "{service}/{method}: {f}");
            // Plaintext reaches nothing: the client reads a TLS alert where it expected HTTP/2.
            let ch = opendsec::rpc::client::channel(&addr, Duration::from_secs(2)).unwrap();
            let f = call(ch, service, &method).await.expect_err("plaintext");
            assert!(
                matches!(f.reason, Reason::Unavailable | Reason::Internal),
                "{service}/{method}: {f}"
            );
        }
    }
    assert!(checked > 8 * 60, "only {checked} calls checked");
    // A lock is held only in the caller's own name.
    let ch = w
        .dialer(Role::Watcher, "0")
        .channel(&w.addr("Iam"), Duration::from_secs(2), Role::Iam)
        .unwrap();
    let mut iam = pb::iam_client::IamClient::new(ch);
    // (A lock of its own: the cluster's watcher holds watcher-reconcile.)
    let lock = |holder: &str| pb::LockRequest {
        name: "watcher-test".into(),
        holder: holder.into(),
        ttl_ms: 5_000,
    };
    let f = failure_from_status(&iam.lock(lock("watcher/1")).await.unwrap_err());
    assert_eq!(f.reason, Reason::Forbidden, "{f}");
    let f = failure_from_status(
        &iam.unlock(pb::UnlockRequest {
            name: "watcher-test".into(),
            holder: "watcher/1".into(),
        })
        .await
        .unwrap_err(),
    );
    assert_eq!(f.reason, Reason::Forbidden, "{f}");
    let held = iam.lock(lock("watcher/0")).await.unwrap().into_inner();
    assert!(held.fence > 0);
    let mut foreign = lock("watcher/0");
    foreign.name = "fleet-controller".into();
    let f = failure_from_status(&iam.lock(foreign).await.unwrap_err());
    assert_eq!(f.reason, Reason::Forbidden, "{f}");
    w.cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_registers_only_itself_and_clients_check_whom_they_reach() {
    let w = up().await;
    let watcher = w.cluster.cfg.watcher.addr.clone();
    let edge0 = w.cluster.cfg.edges[0].addr.clone();
    let d = w.dialer(Role::Edge, "sim-0");
    let mut c = pb::watcher_client::WatcherClient::new(
        d.channel(&watcher, Duration::from_secs(2), Role::Watcher)
            .unwrap(),
    );
    let reg = |id: &str| pb::RegisterEdgeRequest {
        edge_id: id.into(),
        addr: edge0.clone(),
    };
    // Its own name: accepted.
    c.register(reg("sim-0")).await.unwrap();
    // Another edge's, or a new one: refused, and the other's address stays.
    for id in ["sim-1", "sim-9"] {
        let s = c.register(reg(id)).await.unwrap_err();
        let f = failure_from_status(&s);
        assert_eq!(f.reason, Reason::Forbidden, "{f}");
        assert!(f.message.contains("opendsec://edge/sim-0"), "{f}");
    }
    // The watcher still reaches sim-1 at its own address: the snapshot says so.
    let apiserver = w.dialer(Role::Apiserver, "0");
    let mut wc = pb::watcher_client::WatcherClient::new(
        apiserver
            .channel(&watcher, Duration::from_secs(2), Role::Watcher)
            .unwrap(),
    );
    let snap = wc
        .get_snapshot(pb::GetSnapshotRequest { min_version: 0 })
        .await
        .unwrap()
        .into_inner();
    let e1 = snap.edges.iter().find(|e| e.id == "sim-1").unwrap();
    assert_eq!(e1.addr, w.cluster.cfg.edges[1].addr);
    // A client that means to reach IAM refuses a server with an edge's certificate, even
    // at the right name (the edge's address is 127.0.0.1, as IAM's is).
    let ch = apiserver
        .channel(&edge0, Duration::from_secs(2), Role::Iam)
        .unwrap();
    let f = call(ch, "Iam", "GetEpoch").await.unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable, "{f}");
    // And reaches IAM itself.
    let ch = apiserver
        .channel(&w.cluster.cfg.iam.addr, Duration::from_secs(2), Role::Iam)
        .unwrap();
    call(ch, "Iam", "GetEpoch").await.unwrap();
    // An edge is checked by its id too (as the apiserver and the watcher reach edges): edge
    // sim-1's certificate at the address where sim-0 is expected is refused.
    let edge1 = w.cluster.cfg.edges[1].addr.clone();
    let to = |addr: &str, id: &str| {
        apiserver
            .channel_to(addr, Duration::from_secs(2), Role::Edge, Some(id))
            .unwrap()
    };
    let f = call(to(&edge1, "sim-0"), "Edge", "Status")
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable, "{f}");
    call(to(&edge0, "sim-0"), "Edge", "Status").await.unwrap();
    call(to(&edge1, "sim-1"), "Edge", "Status").await.unwrap();
    w.cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_sees_and_releases_only_the_leases_bound_to_it() {
    let w = up().await;
    let token = w.cluster.admin_token.clone();
    let mut c = pb::d_sec_client::DSecClient::new(anonymous(&w, &w.cluster.api_addrs[0]));
    let sb = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                project: "root".into(),
                spec: Some(pb::SandboxSpec {
                    backend: "sim".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    let lease = sb.lease_id.clone();
    assert!(!lease.is_empty());
    let (own, other) = if sb.edge_id == "sim-0" {
        ("sim-0", "sim-1")
    } else {
        ("sim-1", "sim-0")
    };
    let iam = w.cluster.cfg.iam.addr.clone();
    let client = |id: &str| {
        pb::iam_client::IamClient::new(
            w.dialer(Role::Edge, id)
                .channel(&iam, Duration::from_secs(2), Role::Iam)
                .unwrap(),
        )
    };
    let ids = pb::GetLeasesRequest {
        lease_ids: vec![lease.clone()],
    };
    // Another edge learns nothing of it, and cannot free its quota.
    let mut theirs = client(other);
    let got = theirs.get_leases(ids.clone()).await.unwrap().into_inner();
    assert!(got.leases.is_empty(), "{got:?}");
    let released = theirs
        .release_leases(pb::ReleaseLeasesRequest {
            lease_ids: vec![lease.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .released;
    assert_eq!(released, 0);
    // Its own edge sees it, still held.
    let mut mine = client(own);
    let got = mine.get_leases(ids).await.unwrap().into_inner();
    assert_eq!(got.leases.len(), 1, "{got:?}");
    assert_eq!(got.leases[0].lease_id, lease);
    let now = c
        .get_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(now.state(), pb::SandboxState::Running);
    w.cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_port_serves_tls_with_bearer_tokens() {
    let w = up().await;
    let api = w.cluster.api_addrs[0].clone();
    let token = w.cluster.admin_token.clone();
    // TLS without a client certificate, checked against the apiservers' fixed name.
    let ca = std::fs::read(w.pki.join("ca.crt")).unwrap();
    for name in ["api.opendsec.internal", "127.0.0.1", "localhost"] {
        let ch = tls_client(&ca, &api, name);
        let mut c = pb::d_sec_client::DSecClient::new(ch);
        let me = c
            .who_am_i(with_token(pb::Empty {}, &token))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(me.principal, "admin", "{name}");
        // Without a token: unauthenticated, as over plaintext.
        let s = c.who_am_i(pb::Empty {}).await.unwrap_err();
        assert_eq!(failure_from_status(&s).reason, Reason::Unauthenticated);
    }
    // A sandbox's whole life over TLS, the apiserver reaching IAM, watcher and edge by mTLS.
    let mut c = pb::d_sec_client::DSecClient::new(anonymous(&w, &api));
    let sb = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                project: "root".into(),
                spec: Some(pb::SandboxSpec {
                    backend: "sim".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sb.state(), pb::SandboxState::Running);
    let stopped = c
        .stop_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.state(), pb::SandboxState::Stopped);
    // A wrong name, and plaintext, are refused.
    let ch = tls_client(&ca, &api, "iam.opendsec.internal");
    let f = call(ch, "DSec", "WhoAmI").await.unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable, "{f}");
    let ch = opendsec::rpc::client::channel(&api, Duration::from_secs(2)).unwrap();
    let f = call(ch, "DSec", "WhoAmI").await.unwrap_err();
    assert!(
        matches!(f.reason, Reason::Unavailable | Reason::Internal),
        "{f}"
    );
    w.cluster.down().await;
}

/// One HTTP/1.1 request to the gateway at `port` from the loopback address `from`.
async fn http_from(
    from: &str,
    port: u16,
    method: &str,
    path: &str,
    key: &str,
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = s.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nX-API-KEY: {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_gateway_reaches_the_apiservers_over_tls_as_itself() {
    let dir = tempfile::tempdir().unwrap();
    let o = UpOptions {
        sim_edges: 1,
        addr: "127.0.0.1:0".into(),
        e2b_addr: "127.0.0.1:0".into(),
        state_dir: dir.path().display().to_string(),
        disk_reserve_mb: -1,
        host_image: true,
        tls: true,
        ..Default::default()
    };
    let cluster = LocalCluster::up(&o).await.unwrap();
    let port: u16 = cluster
        .e2b_addr
        .clone()
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap();
    let admin = cluster.admin_token.clone();
    // A sandbox through the gateway, with the access token E2B's SDKs need: made with
    // grant.key, as there is no service token.
    let (code, body) = http_from(
        "127.0.0.1",
        port,
        "POST",
        "/sandboxes",
        &admin,
        r#"{"templateID":"base"}"#,
    )
    .await;
    assert_eq!(code, 201, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let tok = v["envdAccessToken"].as_str().unwrap();
    assert!(tok.starts_with("dsg."), "{body}");
    // A principal whose key has never been used.
    let ca = std::fs::read(Path::new(&cluster.cfg.tls.dir).join("ca.crt")).unwrap();
    let ch = tls_client(&ca, &cluster.api_addrs[0], "api.opendsec.internal");
    let mut c = pb::d_sec_client::DSecClient::new(ch);
    let fresh = c
        .create_principal(with_token(
            pb::CreatePrincipalRequest {
                project: "root".into(),
                principal_id: "fresh".into(),
                kind: "agent".into(),
                ttl: 0,
            },
            &admin,
        ))
        .await
        .unwrap()
        .into_inner()
        .token;
    c.grant(with_token(
        pb::GrantRequest {
            project: "root".into(),
            principal: "fresh".into(),
            permissions: vec!["sandbox.create".into(), "sandbox.operate".into()],
        },
        &admin,
    ))
    .await
    .unwrap();
    // A guesser at 127.0.0.2 is locked out. The apiserver takes the address the gateway
    // forwards because the gateway's certificate says what it is; were it ignored, every
    // caller would share the gateway's 127.0.0.1 and the fresh key below would be refused.
    let mut codes = Vec::new();
    for i in 0..12 {
        let key = format!("dsk.fresh.guess{i}.wrong");
        let (code, body) = http_from("127.0.0.2", port, "GET", "/v2/sandboxes", &key, "").await;
        assert!(code == 401 || code == 429, "{code} {body}");
        codes.push(code);
    }
    assert_eq!(codes.last(), Some(&429), "{codes:?}");
    let (code, body) = http_from("127.0.0.1", port, "GET", "/v2/sandboxes", &fresh, "").await;
    assert_eq!(code, 200, "{body}");
    cluster.down().await;
}

/// A watcher that answers every call, for handshakes alone.
struct FakeWatcher;

#[tonic::async_trait]
impl pb::watcher_server::Watcher for FakeWatcher {
    async fn get_snapshot(
        &self,
        _: tonic::Request<pb::GetSnapshotRequest>,
    ) -> Result<tonic::Response<pb::Snapshot>, tonic::Status> {
        Ok(tonic::Response::new(pb::Snapshot::default()))
    }
    async fn register(
        &self,
        _: tonic::Request<pb::RegisterEdgeRequest>,
    ) -> Result<tonic::Response<pb::RegisterEdgeResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::RegisterEdgeResponse {
            known: true,
        }))
    }
}

/// Whether an apiserver loaded from `client` reaches a watcher loaded from `server`: each
/// holds the certificate and trust of one moment of a rotation.
async fn talks(server: &Path, client: &Path) -> bool {
    use opendsec::rpc::acl::Policy;
    let watcher = Identity::new(Role::Watcher, "0").unwrap();
    let tls = Tls::load(server, &watcher).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let router = opendsec::rpc::serve::builder(Some(&tls), Policy::Watcher)
        .unwrap()
        .add_service(pb::watcher_server::WatcherServer::new(FakeWatcher));
    let sd = opendsec::shutdown::Shutdown::new();
    let task = tokio::spawn(opendsec::rpc::serve::serve(router, l, sd.clone()));
    let me = Identity::new(Role::Apiserver, "0").unwrap();
    let d = Dialer::new(Some(Arc::new(Tls::load(client, &me).unwrap()))).unwrap();
    let mut c = pb::watcher_client::WatcherClient::new(
        d.channel(&addr, Duration::from_secs(2), Role::Watcher)
            .unwrap(),
    );
    let ok = c
        .get_snapshot(pb::GetSnapshotRequest { min_version: 0 })
        .await
        .is_ok();
    sd.fire();
    let _ = task.await;
    ok
}

/// `opendsec ctl pki rotate -dir DIR -step N`: its exit code and output.
fn rotate(dir: &Path, step: u8) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_opendsec"))
        .args(["ctl", "pki", "rotate", "-dir"])
        .arg(dir)
        .args(["-step", &step.to_string()])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A copy of the files a component would have been given at this moment.
fn deliver(dir: &Path, to: &Path) -> std::path::PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    to.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ca_rotates_in_three_steps_and_each_step_keeps_old_and_new_talking() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let ca = Ca::generate(3650).unwrap();
    ca.save(&dir).unwrap();
    for (role, id) in [(Role::Watcher, "0"), (Role::Apiserver, "0")] {
        let who = Identity::new(role, id).unwrap();
        save_issued(
            &dir,
            &who,
            &ca.issue(&who, &["127.0.0.1".into()], 30).unwrap(),
        )
        .unwrap();
    }
    let p0 = deliver(&dir, &tmp.path().join("p0"));
    assert!(talks(&p0, &p0).await);
    // Dropping the old CA before anything was reissued is refused, and changes nothing.
    let (code, out) = rotate(&dir, 3);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("run steps 1 and 2 first"), "{out}");

    let (code, out) = rotate(&dir, 1);
    assert_eq!(code, 0, "{out}");
    let p1 = deliver(&dir, &tmp.path().join("p1"));
    let (code, out) = rotate(&dir, 1);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("under way"), "{out}");
    // Restarted and not yet restarted components talk, either way round.
    assert!(talks(&p0, &p1).await && talks(&p1, &p0).await);
    // Step 3 now would strand every certificate still from the old CA: refused.
    let (code, out) = rotate(&dir, 3);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("still from the old CA"), "{out}");
    assert!(
        out.contains("watcher-0.crt") && out.contains("apiserver-0.crt"),
        "{out}"
    );

    let (code, out) = rotate(&dir, 2);
    assert_eq!(code, 0, "{out}");
    let p2 = deliver(&dir, &tmp.path().join("p2"));
    assert!(talks(&p1, &p2).await && talks(&p2, &p1).await);
    // What step 1 is for: a certificate from the new CA is refused by a component that
    // trusts only the old one, either way round.
    assert!(!talks(&p0, &p2).await && !talks(&p2, &p0).await);

    let (code, out) = rotate(&dir, 3);
    assert_eq!(code, 0, "{out}");
    let p3 = deliver(&dir, &tmp.path().join("p3"));
    assert!(talks(&p2, &p3).await && talks(&p3, &p2).await);
    // The old CA is gone: its certificates are refused now.
    assert!(!talks(&p3, &p1).await);
    assert!(!dir.join("next").exists());
    // The directory is a plain one again: its CA issues, and a new rotation may begin.
    let new_ca = Ca::load(&dir).unwrap();
    assert_ne!(new_ca.cert_pem, ca.cert_pem);
    assert_eq!(
        std::fs::read_to_string(dir.join("ca.crt")).unwrap(),
        new_ca.cert_pem
    );
    let (code, out) = rotate(&dir, 1);
    assert_eq!(code, 0, "{out}");
}
