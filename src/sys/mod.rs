//! The only module where `unsafe` and raw syscalls are allowed (docs/architecture.md "Rules of the codebase"). Every
//! `unsafe` block carries a SAFETY comment naming the invariant it relies on; raw return
//! codes go through [`cvt`], which turns -1 into `io::Error::last_os_error()`.
#![allow(unsafe_code)]

pub mod loopdev;
pub mod mountfd;
pub mod random;

use std::io;

pub mod pty;
pub mod spawn;

/// Turns a raw syscall return code into a `Result`: -1 becomes the thread's `errno`.
pub fn cvt<T: IsMinusOne>(ret: T) -> io::Result<T> {
    if ret.is_minus_one() {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Integer return codes of raw syscalls.
pub trait IsMinusOne {
    fn is_minus_one(&self) -> bool;
}

macro_rules! minus_one {
    ($($t:ty),*) => { $(impl IsMinusOne for $t { fn is_minus_one(&self) -> bool { *self == -1 } })* };
}
minus_one!(i32, i64, isize);

pub mod fd;
pub mod jail;
pub mod net;
pub mod netns;
pub mod process;
pub mod tap;

/// For tests that need root (docs/architecture.md "Rules of the codebase"): true as root; otherwise a skip line and false,
/// except under `CI=true`, where a missing privilege fails the test (CI runs as root, so a
/// silent skip would hide it).
// A test helper (the tests in tests/ call it): failing the test under CI is its job.
#[allow(clippy::panic)]
pub fn root_or_skip(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test} needs root; CI runs as root");
    }
    // Both streams: the harness captures stdout of passing tests, and a skip must be seen.
    eprintln!("SKIPPED {test}: needs root (run as root, or with CI=true to make it fail)");
    println!("SKIPPED {test}: needs root");
    false
}
