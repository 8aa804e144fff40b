//! Plain domain types shared by every role: reasons, ids, names, resources. No I/O here.

pub mod names;
pub mod reason;
pub mod resources;
pub mod spec_digest;

pub use reason::{Failure, Reason};
pub use resources::Res;

/// Seconds since the Unix epoch, as every record and API field counts time.
pub fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Seconds since the Unix epoch with sub-second precision, for usage accounting.
pub fn now_f() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
