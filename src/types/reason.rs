//! The stable error reasons of docs/concepts.md, carried on every gRPC error as
//! `google.rpc.ErrorInfo.reason`. The SDK and the CLI read the reason, never the message.

use std::fmt;

/// One stable reason string per kind of failure (docs/concepts.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    Unauthenticated,
    Forbidden,
    NotFound,
    QuotaExceeded,
    RateLimited,
    NoCapacity,
    Invalid,
    Unavailable,
    Timeout,
    Internal,
    Conflict,
}

impl Reason {
    /// The wire string, e.g. `quota_exceeded`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Unauthenticated => "unauthenticated",
            Reason::Forbidden => "forbidden",
            Reason::NotFound => "not_found",
            Reason::QuotaExceeded => "quota_exceeded",
            Reason::RateLimited => "rate_limited",
            Reason::NoCapacity => "no_capacity",
            Reason::Invalid => "invalid",
            Reason::Unavailable => "unavailable",
            Reason::Timeout => "timeout",
            Reason::Internal => "internal",
            Reason::Conflict => "conflict",
        }
    }

    /// Parses a wire string; unknown strings are `None`.
    pub fn parse(s: &str) -> Option<Reason> {
        Some(match s {
            "unauthenticated" => Reason::Unauthenticated,
            "forbidden" => Reason::Forbidden,
            "not_found" => Reason::NotFound,
            "quota_exceeded" => Reason::QuotaExceeded,
            "rate_limited" => Reason::RateLimited,
            "no_capacity" => Reason::NoCapacity,
            "invalid" => Reason::Invalid,
            "unavailable" => Reason::Unavailable,
            "timeout" => Reason::Timeout,
            "internal" => Reason::Internal,
            "conflict" => Reason::Conflict,
            _ => return None,
        })
    }

    /// Every reason, for tests and the SDK's constants.
    pub const ALL: [Reason; 11] = [
        Reason::Unauthenticated,
        Reason::Forbidden,
        Reason::NotFound,
        Reason::QuotaExceeded,
        Reason::RateLimited,
        Reason::NoCapacity,
        Reason::Invalid,
        Reason::Unavailable,
        Reason::Timeout,
        Reason::Internal,
        Reason::Conflict,
    ];
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason with its human message: what domain code returns when the caller must be told.
/// Converted to a gRPC status in exactly one place (`rpc::status`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Failure {
    pub reason: Reason,
    pub message: String,
}

impl Failure {
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        Failure {
            reason,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(Reason::Invalid, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(Reason::NotFound, m)
    }
    pub fn forbidden(m: impl Into<String>) -> Self {
        Self::new(Reason::Forbidden, m)
    }
    pub fn unauthenticated(m: impl Into<String>) -> Self {
        Self::new(Reason::Unauthenticated, m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(Reason::Internal, m)
    }
    pub fn unavailable(m: impl Into<String>) -> Self {
        Self::new(Reason::Unavailable, m)
    }
    pub fn conflict(m: impl Into<String>) -> Self {
        Self::new(Reason::Conflict, m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips() {
        for r in Reason::ALL {
            assert_eq!(Reason::parse(r.as_str()), Some(r));
        }
        assert_eq!(Reason::parse("nope"), None);
    }
}
