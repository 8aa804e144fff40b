//! Pseudo-terminals for processes started with a PTY: opening a master/slave pair, setting
//! the window size, and making the slave the controlling terminal of a new session.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::fcntl::{open, OFlag};
use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt, Winsize};
use nix::sys::stat::Mode;

/// An open pseudo-terminal: the master side stays with the agent, the slave side becomes
/// the child's stdin, stdout and stderr.
#[derive(Debug)]
pub struct Pty {
    pub master: OwnedFd,
    pub slave: OwnedFd,
}

/// Opens a new PTY pair of `cols` x `rows` characters. Both fds are close-on-exec and the
/// slave is opened without becoming anyone's controlling terminal (the child claims it with
/// [`make_controlling`]). Errors: the kernel's (`/dev/ptmx` missing, `/dev/pts` not mounted).
pub fn open_pty(cols: u16, rows: u16) -> io::Result<Pty> {
    let master = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname_r(&master)?;
    let slave = open(
        name.as_str(),
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let master: OwnedFd = master.into();
    set_size(master.as_fd(), cols, rows)?;
    Ok(Pty { master, slave })
}

/// Sets the window size of the terminal behind `fd` (either side of a PTY); the kernel
/// sends SIGWINCH to the terminal's foreground process group. Errors: `ENOTTY` when `fd` is
/// not a terminal.
pub fn set_size(fd: BorrowedFd<'_>, cols: u16, rows: u16) -> io::Result<()> {
    let ws = Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `struct winsize` through the pointer, which points to a
    // live, initialised local for the duration of the call; `fd` is borrowed, so it is open.
    crate::sys::cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) })?;
    Ok(())
}

/// Makes the terminal at `fd` the controlling terminal of the calling process, which must
/// be a session leader without one (right after `setsid`). Async-signal-safe: meant for a
/// forked child before exec.
pub fn make_controlling(fd: RawFd) -> io::Result<()> {
    // SAFETY: TIOCSCTTY takes an integer argument (0: do not steal the terminal from another
    // session), no pointer; an invalid fd only makes the call fail with EBADF.
    crate::sys::cvt(unsafe { libc::ioctl(fd, libc::TIOCSCTTY, 0) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_and_resizes() {
        let p = match open_pty(80, 24) {
            Ok(p) => p,
            Err(e) => {
                println!("skip: no PTYs here: {e}");
                return;
            }
        };
        let size = nix::sys::termios::tcgetattr(p.slave.as_fd()).map(|_| ());
        assert!(size.is_ok(), "slave is a terminal");
        set_size(p.master.as_fd(), 100, 40).expect("resize");
        let mut ws = Winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // Read back through the slave, as a program in the PTY would.
        nix::ioctl_read_bad!(get_size, libc::TIOCGWINSZ, Winsize);
        // SAFETY: TIOCGWINSZ writes one `struct winsize` into `ws`, a live local.
        unsafe { get_size(p.slave.as_raw_fd(), &mut ws) }.expect("TIOCGWINSZ");
        assert_eq!((ws.ws_col, ws.ws_row), (100, 40));
    }
}
