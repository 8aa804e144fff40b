//! Plain domain types shared by every role: reasons, ids, names, resources. No I/O here.

pub mod names;
pub mod reason;
pub mod resources;
pub mod spec_digest;

pub use reason::{Failure, Reason};
pub use resources::{charged_memory_mb, Res};

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

/// `e` and each of its causes, joined with ": " ("binding /x: Permission denied (os error 13)").
/// Every error keeps its cause either as its `source` or in its message, never both
/// (docs/architecture.md "Errors"), so each cause appears once here; a cause whose text its
/// parent already ends with (a wrapper that still prints it) is not repeated.
pub fn chain<E: std::error::Error + ?Sized>(e: &E) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !text.is_empty() && !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = c.source();
    }
    out
}
