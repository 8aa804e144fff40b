//! Which component may call which method (docs/tls.md "Who may call what"): a tower layer
//! on every role's server that, with mTLS on, reads the caller's identity from its verified
//! certificate, checks its role against the method's list, and hands the identity to the
//! handlers (for checks that need the request, such as an edge registering only itself).
//!
//! A handshake without a client certificate completes (one from another CA does not); an
//! internal port then answers every call `unauthenticated`. The apiservers' public port
//! needs none (callers there use bearer tokens), and a component that presents one there is
//! known by it (the E2B gateway, whose forwarded client addresses are trusted).
//! Without TLS (development clusters with a `service_token`) the layer lets every call
//! through and the token checks in the handlers apply.

use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::pki::{CertInfo, Identity, Role};
use crate::types::Failure;

/// The set of access rules a server applies: one per kind of port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// IAM's port (`opendsec.v1.Iam`).
    Iam,
    /// A watcher's port (`opendsec.v1.Watcher`).
    Watcher,
    /// An edge's port (`opendsec.v1.Edge`, `opendsec.v1.Runtime`).
    Edge,
    /// The apiservers' public port (`opendsec.v1.DSec`): no role needed.
    Public,
    /// An IAM replica's Raft port (`opendsec.v1.Raft`).
    Raft,
}

use Role::{Apiserver, Edge, Fleet, Iam, Watcher};

impl Policy {
    /// The roles that may call `path` (`/package.Service/Method`). An unknown method is
    /// callable by nobody, so a service added later is closed until it is listed here.
    pub fn allowed(self, path: &str) -> &'static [Role] {
        let (service, method) = match path.strip_prefix('/').and_then(|p| p.split_once('/')) {
            Some(sm) => sm,
            None => return &[],
        };
        match (self, service) {
            (Policy::Iam, "opendsec.v1.Iam") => match method {
                "Reconcile" | "SweepUnbound" => &[Watcher],
                // Leader election (the holder must be the caller: see the handler).
                "Lock" | "Unlock" => &[Watcher, Fleet],
                "KvGet" | "KvList" | "KvPut" | "KvDelete" => &[Fleet],
                "GetLeases" => &[Edge],
                "ReleaseLeases" => &[Apiserver, Edge],
                // Authentication, admission and management on behalf of callers.
                _ => &[Apiserver],
            },
            (Policy::Watcher, "opendsec.v1.Watcher") => match method {
                "GetSnapshot" => &[Apiserver],
                "Register" => &[Edge],
                _ => &[],
            },
            (Policy::Edge, "opendsec.v1.Edge") => match method {
                "Status" => &[Apiserver, Watcher],
                _ => &[Apiserver],
            },
            (Policy::Edge, "opendsec.v1.Runtime") => &[Apiserver],
            (Policy::Raft, "opendsec.v1.Raft") => &[Iam],
            _ => &[],
        }
    }
}

/// The verified identity of a call's peer, in the request's extensions when it presented a
/// certificate of ours (see [`caller`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller(pub Identity);

/// The component that made this call, when it came over mTLS with a certificate of ours.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Identity> {
    req.extensions().get::<Caller>().map(|c| &c.0)
}

/// The layer that applies `policy` when `tls` is on.
#[derive(Debug, Clone, Copy)]
pub struct AclLayer {
    policy: Policy,
    tls: bool,
}

impl AclLayer {
    pub fn new(policy: Policy, tls: bool) -> AclLayer {
        AclLayer { policy, tls }
    }
}

impl<S> tower::Layer<S> for AclLayer {
    type Service = Acl<S>;
    fn layer(&self, inner: S) -> Acl<S> {
        Acl {
            inner,
            rules: *self,
        }
    }
}

/// The service [`AclLayer`] wraps a server's routes in.
#[derive(Debug, Clone)]
pub struct Acl<S> {
    inner: S,
    rules: AclLayer,
}

/// The identity in a peer's verified certificate chain: the first of ours in its leaf.
fn peer_identity<B>(req: &http::Request<B>) -> Option<Identity> {
    let certs = req
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()?
        .peer_certs()?;
    let leaf = certs.first()?;
    CertInfo::from_der(leaf).ok()?.identities.into_iter().next()
}

/// Decides a call: `Ok(identity)` to let it through, or the status to answer with.
fn decide(
    rules: AclLayer,
    path: &str,
    peer: Option<Identity>,
) -> Result<Option<Identity>, Failure> {
    if !rules.tls || rules.policy == Policy::Public {
        return Ok(peer);
    }
    let Some(who) = peer else {
        return Err(Failure::unauthenticated(
            "this port needs a client certificate with a component identity",
        ));
    };
    if rules.policy.allowed(path).contains(&who.role) {
        Ok(Some(who))
    } else {
        Err(Failure::forbidden(format!("{who} may not call {path}")))
    }
}

impl<S, B> tower::Service<http::Request<B>> for Acl<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if !self.rules.tls {
            return Either::Left(self.inner.call(req));
        }
        let peer = peer_identity(&req);
        match decide(self.rules, req.uri().path(), peer) {
            Ok(who) => {
                if let Some(who) = who {
                    req.extensions_mut().insert(Caller(who));
                }
                Either::Left(self.inner.call(req))
            }
            Err(f) => {
                tracing::warn!(path = %req.uri().path(), reason = f.reason.as_str(), error = %f.message, "call refused");
                Either::Right(futures::future::ready(Ok(super::to_status(&f).into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(role: Role, id: &str) -> Option<Identity> {
        Identity::new(role, id).ok()
    }

    #[test]
    fn only_the_listed_roles_may_call_a_method() {
        let iam = AclLayer::new(Policy::Iam, true);
        let admit = "/opendsec.v1.Iam/Admit";
        assert!(decide(iam, admit, id(Apiserver, "0")).is_ok());
        for r in [
            Edge,
            Watcher,
            Role::E2b,
            Role::Iam,
            Role::Ops,
            Role::Fleet,
            Role::Node,
        ] {
            let e = decide(iam, admit, id(r, "x")).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Forbidden, "{r}");
        }
        assert!(decide(iam, "/opendsec.v1.Iam/Reconcile", id(Watcher, "0")).is_ok());
        assert!(decide(iam, "/opendsec.v1.Iam/Reconcile", id(Apiserver, "0")).is_err());
        assert!(decide(iam, "/opendsec.v1.Iam/GetLeases", id(Edge, "n1")).is_ok());
        let e = decide(iam, admit, None).unwrap_err();
        assert_eq!(e.reason, crate::types::Reason::Unauthenticated);
        // A method of another service on this port, or no method, is nobody's.
        for path in [
            "/opendsec.v1.Edge/Status",
            "/",
            "",
            "/opendsec.v1.Iam",
            "/x/y",
        ] {
            assert!(decide(iam, path, id(Apiserver, "0")).is_err(), "{path}");
        }
        let edge = AclLayer::new(Policy::Edge, true);
        assert!(decide(edge, "/opendsec.v1.Edge/Status", id(Watcher, "0")).is_ok());
        assert!(decide(edge, "/opendsec.v1.Edge/StopSandbox", id(Watcher, "0")).is_err());
        assert!(decide(edge, "/opendsec.v1.Runtime/RunShell", id(Edge, "n2")).is_err());
        let w = AclLayer::new(Policy::Watcher, true);
        assert!(decide(w, "/opendsec.v1.Watcher/Register", id(Edge, "n1")).is_ok());
        assert!(decide(w, "/opendsec.v1.Watcher/Register", id(Apiserver, "0")).is_err());
    }

    #[test]
    fn the_public_port_and_plaintext_let_every_call_through() {
        let public = AclLayer::new(Policy::Public, true);
        assert_eq!(
            decide(public, "/opendsec.v1.DSec/CreateSandbox", None),
            Ok(None)
        );
        let plain = AclLayer::new(Policy::Iam, false);
        assert_eq!(decide(plain, "/opendsec.v1.Iam/Admit", None), Ok(None));
    }

    #[test]
    fn only_iam_replicas_call_the_raft_port() {
        let raft = AclLayer::new(Policy::Raft, true);
        let send = "/opendsec.v1.Raft/Send";
        assert!(decide(raft, send, id(Iam, "1")).is_ok());
        for r in [Apiserver, Edge, Watcher, Role::E2b, Role::Ops] {
            let e = decide(raft, send, id(r, "0")).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Forbidden, "{r:?}");
        }
        // Nothing else is served there, and the Raft service on another port is refused.
        assert!(decide(raft, "/opendsec.v1.Iam/Admit", id(Iam, "1")).is_err());
        let iam = AclLayer::new(Policy::Iam, true);
        assert!(decide(iam, send, id(Iam, "1")).is_err());
    }
}
