//! gRPC plumbing shared by every role: the one place a `Failure` becomes a `tonic::Status`
//! (and back), metadata helpers for tokens, and client channels.

pub mod acl;
pub mod client;
pub mod failover;
pub mod grant;
pub mod serve;
pub mod status;
pub mod tls;
pub mod uds;

pub use status::{failure_from_status, to_status};

/// Metadata key carrying the caller's bearer token (`authorization: Bearer dsk...`).
pub const AUTHORIZATION: &str = "authorization";
/// Metadata key carrying the shared component secret (`service_token`) between roles.
pub const SERVICE_TOKEN: &str = "x-opendsec-service-token";
/// Metadata key with which an apiserver tells IAM the original caller's address.
pub const CLIENT_ADDR: &str = "x-opendsec-client-addr";

/// Most bytes one message may carry (docs/python-sdk.md: messages may be up to 80 MB).
pub const MAX_MESSAGE: usize = 80 * 1024 * 1024;

/// Reads `authorization: Bearer <token>` from a request; empty when absent.
pub fn bearer<T>(req: &tonic::Request<T>) -> String {
    req.metadata()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .unwrap_or(v)
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

/// The peer address of a request as text, or the forwarded client address when a trusted
/// component (checked by the caller of this function) set one.
pub fn peer_addr<T>(req: &tonic::Request<T>) -> String {
    if let Some(v) = req
        .metadata()
        .get(CLIENT_ADDR)
        .and_then(|v| v.to_str().ok())
    {
        return v.to_string();
    }
    req.remote_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_default()
}

/// Checks the component secret on an internal call. With no `service_token` configured every
/// caller is accepted: the cluster runs with TLS, and [`acl`] has checked the caller's
/// certificate and role before any handler runs (docs/tls.md).
pub fn check_service_token<T>(
    req: &tonic::Request<T>,
    expected: &str,
) -> Result<(), tonic::Status> {
    if expected.is_empty() {
        return Ok(());
    }
    let got = req
        .metadata()
        .get(SERVICE_TOKEN)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if constant_time_eq(got.as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(to_status(&crate::types::Failure::unauthenticated(
            "missing or wrong service token",
        )))
    }
}

/// Compares secrets without leaking their common prefix length through timing.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
