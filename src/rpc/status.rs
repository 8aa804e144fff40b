//! `Failure` <-> `tonic::Status`, with the reason in `google.rpc.ErrorInfo` (docs/concepts.md).

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::types::{Failure, Reason};

/// The ErrorInfo domain of every OpenDsec error.
pub const DOMAIN: &str = "opendsec.io";

fn code_of(r: Reason) -> Code {
    match r {
        Reason::Unauthenticated => Code::Unauthenticated,
        Reason::Forbidden => Code::PermissionDenied,
        Reason::NotFound => Code::NotFound,
        Reason::QuotaExceeded | Reason::RateLimited | Reason::NoCapacity => Code::ResourceExhausted,
        Reason::Invalid => Code::InvalidArgument,
        Reason::Unavailable => Code::Unavailable,
        Reason::Timeout => Code::DeadlineExceeded,
        Reason::Internal => Code::Internal,
        Reason::Conflict => Code::FailedPrecondition,
    }
}

/// Builds the gRPC status for a failure: a matching code, the message, and ErrorInfo.reason.
/// Longest message put on the wire: clients cap the trailers' size (16 KB in grpc), and a
/// message echoing a huge input would otherwise turn into a transport error with the wrong
/// reason.
pub const MAX_MESSAGE_LEN: usize = 2048;

pub fn to_status(f: &Failure) -> Status {
    let mut msg = f.message.clone();
    if msg.len() > MAX_MESSAGE_LEN {
        let mut cut = MAX_MESSAGE_LEN;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
        msg.push_str("... (truncated)");
    }
    Status::with_error_details(
        code_of(f.reason),
        msg,
        ErrorDetails::with_error_info(f.reason.as_str(), DOMAIN, std::collections::HashMap::new()),
    )
}

impl From<Failure> for Status {
    fn from(f: Failure) -> Status {
        to_status(&f)
    }
}

/// Reads the reason back from a status. A status without ErrorInfo (a transport error, a
/// proxy) gets the reason its code implies: connection failures are `unavailable`.
pub fn failure_from_status(s: &Status) -> Failure {
    if let Some(info) = s.get_error_details().error_info() {
        if let Some(r) = Reason::parse(&info.reason) {
            return Failure::new(r, s.message().to_string());
        }
    }
    let reason = match s.code() {
        Code::Unauthenticated => Reason::Unauthenticated,
        Code::PermissionDenied => Reason::Forbidden,
        Code::NotFound => Reason::NotFound,
        Code::ResourceExhausted => Reason::RateLimited,
        Code::InvalidArgument | Code::OutOfRange => Reason::Invalid,
        // tonic reports a client-side deadline as Cancelled "Timeout expired".
        Code::Cancelled if s.message().contains("Timeout expired") => Reason::Timeout,
        Code::Unavailable | Code::Cancelled | Code::Unknown => Reason::Unavailable,
        Code::DeadlineExceeded => Reason::Timeout,
        Code::AlreadyExists | Code::FailedPrecondition | Code::Aborted => Reason::Conflict,
        _ => Reason::Internal,
    };
    let msg = if s.message().is_empty() {
        format!("{:?}", s.code())
    } else {
        s.message().to_string()
    };
    Failure::new(reason, with_cause(msg, s))
}

/// A client-side transport error's message with its innermost cause ("tcp connect error:
/// Connection refused (os error 111)"), which tonic keeps only in the status's source chain;
/// a status that came over the wire has no source and keeps its message.
fn with_cause(message: String, status: &Status) -> String {
    let mut cause: Option<&dyn std::error::Error> = std::error::Error::source(status);
    let mut last = None;
    while let Some(c) = cause {
        last = Some(c.to_string());
        cause = c.source();
    }
    match last {
        Some(c) if !message.contains(&c) => format!("{message}: {c}"),
        _ => message,
    }
}

/// Converts a failure into the per-item error of batch results.
pub fn error_detail(f: &Failure) -> crate::pb::ErrorDetail {
    crate::pb::ErrorDetail {
        reason: f.reason.as_str().to_string(),
        message: f.message.clone(),
    }
}

/// Reads a per-item error back.
pub fn failure_from_detail(d: &crate::pb::ErrorDetail) -> Failure {
    Failure::new(
        Reason::parse(&d.reason).unwrap_or(Reason::Internal),
        d.message.clone(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_survives_the_round_trip() {
        for r in Reason::ALL {
            let s = to_status(&Failure::new(r, "why"));
            let f = failure_from_status(&s);
            assert_eq!(f.reason, r);
            assert_eq!(f.message, "why");
        }
    }

    #[test]
    fn huge_messages_are_cut_and_keep_their_reason() {
        let s = to_status(&Failure::invalid("é".repeat(10_000)));
        assert!(s.message().len() < MAX_MESSAGE_LEN + 32);
        assert_eq!(failure_from_status(&s).reason, Reason::Invalid);
    }

    #[test]
    fn a_client_side_transport_error_names_its_os_cause() {
        let mut s = Status::unavailable("tcp connect error");
        s.set_source(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        let f = failure_from_status(&s);
        assert_eq!(f.reason, Reason::Unavailable);
        assert_eq!(f.message, "tcp connect error: connection refused");
        // A cause already in the message is not repeated.
        let mut s = Status::unavailable("tcp connect error: connection refused");
        s.set_source(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(
            failure_from_status(&s).message,
            "tcp connect error: connection refused"
        );
    }

    #[test]
    fn bare_statuses_map_by_code() {
        assert_eq!(
            failure_from_status(&Status::unavailable("down")).reason,
            Reason::Unavailable
        );
        assert_eq!(
            failure_from_status(&Status::deadline_exceeded("slow")).reason,
            Reason::Timeout
        );
    }
}
