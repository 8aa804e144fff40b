//! Sending one nftables batch (one kernel transaction) over a netlink socket the table keeps
//! (docs/network.md "Enforcement"), and the table's listings that `nfmsg` reads. `nfmsg`
//! (or rustables) builds the batch; this sends it, because rustables' own `Batch::send` opens a socket with the default buffers and asks an
//! acknowledgement for every message: a policy of a few hundred rules then fails with
//! `EMSGSIZE` (the batch is larger than the send buffer) or `ENOBUFS` (the acknowledgements
//! overflow the receive buffer, after the kernel has committed the batch, so the caller is
//! told it failed while it took effect).
//!
//! Here the send buffer is sized to the batch, and no message asks for an acknowledgement:
//! the kernel runs an nftables batch within the `send` call itself, and reports only the
//! messages it refused. So when `send` returns, everything the kernel has to say is already
//! queued on the socket, and reading until the queue is empty tells the outcome: no error
//! message means the whole batch was committed, any error means none of it was.
//!
//! One socket serves every batch of a table: opening one per batch costs a socket setup, and
//! its close waits for an RCU grace period once the batch deleted something.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::sys::socket::{
    self, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

/// `NLM_F_ACK`: the sender wants an acknowledgement.
const NLM_F_ACK: u16 = 0x4;
/// `NLMSG_ERROR`: an error report (or an acknowledgement, with error 0).
const NLMSG_ERROR: u16 = 0x2;
/// `NLMSG_DONE`: the end of a listing.
const NLMSG_DONE: u16 = 0x3;
/// `NLM_F_DUMP_INTR`: a change overtook the listing.
const NLM_F_DUMP_INTR: u16 = 0x10;
/// The size of `struct nlmsghdr`.
const NLMSG_HDRLEN: usize = 16;
/// Smallest send and receive buffers asked for, in bytes. The kernel doubles what it is
/// given (its bookkeeping); these are the values before that.
const MIN_BUFFER: usize = 1 << 20;
/// Room for one error report, which carries the refused message back (a rule: a few KiB).
const RECV_CHUNK: usize = 1 << 17;

/// Why a batch did not apply. In every case the kernel applied none of it.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Opening, binding or sizing the socket, or sending.
    #[error("netlink {step}: {source}")]
    Socket {
        step: &'static str,
        #[source]
        source: Errno,
    },
    /// The kernel refused message number `index` of the batch (0 is the batch's begin
    /// marker) with `errno`. `errors` counts every message it refused; `all` lists the first
    /// few as (index, errno).
    #[error("the kernel refused message {index} of the batch: {errno} ({errors} refused in all: {all:?})")]
    Refused {
        index: u32,
        errno: Errno,
        errors: usize,
        all: Vec<(u32, Errno)>,
    },
    /// The kernel's reports overflowed the socket's receive buffer: at least one message
    /// was refused, but which is unknown.
    #[error("the kernel's error reports overflowed the netlink socket")]
    Overflow,
    /// A listing that another change overtook: it must be read again from the start.
    #[error("the listing was interrupted by a change of the ruleset")]
    Interrupted,
}

/// The netlink socket of one table, opened at its first batch and kept; a socket that failed
/// is dropped and the next batch opens another.
#[derive(Debug, Default)]
pub struct BatchSocket {
    sock: Mutex<Option<Open>>,
}

#[derive(Debug)]
struct Open {
    fd: OwnedFd,
    /// The send buffer asked for so far (before the kernel doubles it).
    sndbuf: usize,
}

impl BatchSocket {
    /// A socket that opens at its first [`BatchSocket::send`].
    pub fn new() -> BatchSocket {
        BatchSocket::default()
    }

    /// Sends `batch` (begin marker, messages, end marker: `nfmsg::Batch::finish` or rustables'
    /// `Batch::finalize`) as
    /// one transaction and returns once the kernel has committed it.
    /// Errors: [`BatchError`]; the kernel applied nothing of the batch.
    pub fn send(&self, mut batch: Vec<u8>) -> Result<(), BatchError> {
        clear_ack_requests(&mut batch);
        let (mut guard, open) = self.checkout()?;
        let result = open.exchange(&batch);
        match result {
            // A refused batch leaves the socket as good as before; a socket error may not.
            Ok(open) => {
                *guard = Some(open);
                Ok(())
            }
            Err((Some(open), e)) => {
                *guard = Some(open);
                Err(e)
            }
            Err((None, e)) => Err(e),
        }
    }

    /// The socket, locked, drained and taken out of its slot (the caller puts it back): anything
    /// left from an earlier exchange would be read as this one's outcome, and a socket that
    /// cannot even be drained is replaced.
    fn checkout(&self) -> Result<(std::sync::MutexGuard<'_, Option<Open>>, Open), BatchError> {
        let mut guard = match self.sock.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let open = match guard.take() {
            Some(o) if matches!(o.drain(), Ok(()) | Err(BatchError::Refused { .. })) => o,
            _ => Open::new()?,
        };
        Ok((guard, open))
    }

    /// Sends dump request `request` (one message with `NLM_F_DUMP`) and returns the payload
    /// of every message of the answer (after the netlink header), in order.
    /// Errors: [`BatchError::Interrupted`] when a change overtook the listing (read it again);
    /// [`BatchError::Refused`] with the kernel's errno; [`BatchError::Socket`].
    pub fn dump(&self, request: &[u8]) -> Result<Vec<Vec<u8>>, BatchError> {
        let (mut guard, open) = self.checkout()?;
        let result = open.listing(request);
        // A listing cut short leaves messages queued; the next exchange drains them.
        if !matches!(result, Err(BatchError::Socket { .. })) {
            *guard = Some(open);
        }
        result
    }
}

impl Open {
    fn listing(&self, request: &[u8]) -> Result<Vec<Vec<u8>>, BatchError> {
        let err = |step| move |source| BatchError::Socket { step, source };
        socket::send(self.fd.as_raw_fd(), request, MsgFlags::empty()).map_err(err("send"))?;
        let mut out = Vec::new();
        let mut interrupted = false;
        let mut buf = vec![0u8; RECV_CHUNK];
        loop {
            let n = match socket::recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(source) => {
                    return Err(BatchError::Socket {
                        step: "recv",
                        source,
                    })
                }
            };
            let data = buf.get(..n).unwrap_or_default();
            let mut at = 0;
            while let (Some(len), Some(kind), Some(flags)) =
                (u32_at(data, at), u16_at(data, at + 4), u16_at(data, at + 6))
            {
                let Some(next) = next_message(at, len) else {
                    break;
                };
                let end = at + len as usize;
                if end > data.len() {
                    break;
                }
                if flags & NLM_F_DUMP_INTR != 0 {
                    interrupted = true;
                }
                match kind {
                    NLMSG_DONE => {
                        return if interrupted {
                            Err(BatchError::Interrupted)
                        } else {
                            Ok(out)
                        };
                    }
                    NLMSG_ERROR => {
                        let error = u32_at(data, at + NLMSG_HDRLEN).map_or(0, |e| e as i32);
                        if error != 0 {
                            let errno = Errno::from_raw(error.saturating_neg());
                            return Err(BatchError::Refused {
                                index: 0,
                                errno,
                                errors: 1,
                                all: vec![(0, errno)],
                            });
                        }
                    }
                    _ => out.extend(data.get(at + NLMSG_HDRLEN..end).map(<[u8]>::to_vec)),
                }
                at = next;
            }
        }
    }

    fn new() -> Result<Open, BatchError> {
        let err = |step| move |source| BatchError::Socket { step, source };
        let fd = socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(err("socket"))?;
        socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(err("bind"))?;
        // Forced: beyond the sysctl limits (rmem_max), which a large policy's batch exceeds;
        // the edge has CAP_NET_ADMIN, which forcing needs.
        socket::setsockopt(&fd, sockopt::SndBufForce, &MIN_BUFFER)
            .map_err(err("SO_SNDBUFFORCE"))?;
        socket::setsockopt(&fd, sockopt::RcvBufForce, &MIN_BUFFER)
            .map_err(err("SO_RCVBUFFORCE"))?;
        Ok(Open {
            fd,
            sndbuf: MIN_BUFFER,
        })
    }

    /// Sends and reads the outcome. On error, the socket comes back when it can be used again.
    #[allow(clippy::result_large_err)]
    fn exchange(mut self, batch: &[u8]) -> Result<Open, (Option<Open>, BatchError)> {
        let fail = |step| move |source| (None, BatchError::Socket { step, source });
        // The kernel refuses a message larger than the send buffer (less its own header).
        if batch.len() + 4096 > self.sndbuf {
            let size = batch.len() + 4096;
            socket::setsockopt(&self.fd, sockopt::SndBufForce, &size)
                .map_err(fail("SO_SNDBUFFORCE"))?;
            self.sndbuf = size;
        }
        let sent =
            socket::send(self.fd.as_raw_fd(), batch, MsgFlags::empty()).map_err(fail("send"))?;
        if sent != batch.len() {
            return Err((
                None,
                BatchError::Socket {
                    step: "send (short)",
                    source: Errno::EMSGSIZE,
                },
            ));
        }
        match self.drain() {
            Ok(()) => Ok(self),
            Err(e @ BatchError::Refused { .. }) => Err((Some(self), e)),
            Err(e) => Err((None, e)),
        }
    }

    /// Reads every queued message without waiting. Errors: the first error report as
    /// [`BatchError::Refused`], [`BatchError::Overflow`], [`BatchError::Socket`].
    fn drain(&self) -> Result<(), BatchError> {
        let mut buf = vec![0u8; RECV_CHUNK];
        let mut first: Option<(u32, Errno)> = None;
        let mut all = Vec::new();
        let mut errors = 0;
        loop {
            let n = match socket::recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(Errno::EAGAIN) => break,
                Err(Errno::EINTR) => continue,
                Err(Errno::ENOBUFS) => return Err(BatchError::Overflow),
                Err(source) => {
                    return Err(BatchError::Socket {
                        step: "recv",
                        source,
                    })
                }
            };
            for (seq, errno) in error_reports(buf.get(..n).unwrap_or_default()) {
                errors += 1;
                first.get_or_insert((seq, errno));
                if all.len() < 8 {
                    all.push((seq, errno));
                }
            }
        }
        match first {
            None => Ok(()),
            Some((index, errno)) => Err(BatchError::Refused {
                index,
                errno,
                errors,
                all,
            }),
        }
    }
}

/// The native-endian `u32` at `at`, if `data` holds it.
fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 4] = data.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_ne_bytes(bytes))
}

/// The native-endian `u16` at `at`, if `data` holds it.
fn u16_at(data: &[u8], at: usize) -> Option<u16> {
    let bytes: [u8; 2] = data.get(at..at.checked_add(2)?)?.try_into().ok()?;
    Some(u16::from_ne_bytes(bytes))
}

/// The offset of the message after the one at `at` of length `len` (messages are 4-byte
/// aligned), or `None` when `len` cannot be a message's.
fn next_message(at: usize, len: u32) -> Option<usize> {
    let len = usize::try_from(len).ok()?;
    if len < NLMSG_HDRLEN {
        return None;
    }
    at.checked_add(len.checked_add(3)? & !3)
}

/// Clears `NLM_F_ACK` on every message of `batch`, so that only refusals are reported.
fn clear_ack_requests(batch: &mut [u8]) {
    let mut at = 0;
    while let (Some(len), Some(flags)) = (u32_at(batch, at), u16_at(batch, at + 6)) {
        if let Some(b) = batch.get_mut(at + 6..at + 8) {
            b.copy_from_slice(&(flags & !NLM_F_ACK).to_ne_bytes());
        }
        match next_message(at, len) {
            Some(next) => at = next,
            None => break,
        }
    }
}

/// The `(sequence number, errno)` of every error report in one datagram; acknowledgements
/// (error 0) are skipped.
fn error_reports(data: &[u8]) -> Vec<(u32, Errno)> {
    let mut out = Vec::new();
    let mut at = 0;
    while let (Some(len), Some(kind)) = (u32_at(data, at), u16_at(data, at + 4)) {
        let Some(next) = next_message(at, len) else {
            break;
        };
        if at + len as usize > data.len() {
            break;
        }
        // struct nlmsgerr { int error; struct nlmsghdr msg; ... }: the refused message's
        // header follows the error, and its sequence number is the message's index.
        if kind == NLMSG_ERROR {
            let error = u32_at(data, at + NLMSG_HDRLEN).map(|e| e as i32);
            let seq = u32_at(data, at + NLMSG_HDRLEN + 4 + 8);
            if let (Some(error), Some(seq)) = (error, seq) {
                if error != 0 {
                    out.push((seq, Errno::from_raw(error.saturating_neg())));
                }
            }
        }
        at = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(payload);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    #[test]
    fn every_ack_request_is_cleared_and_nothing_else_changes() {
        let mut batch = msg(0x10, NLM_F_ACK | 0x1, 0, &[1, 2, 3]);
        batch.extend(msg(0xa06, NLM_F_ACK | 0x400, 1, &[9; 8]));
        batch.extend(msg(0x11, 0x1, 2, &[]));
        let mut want = msg(0x10, 0x1, 0, &[1, 2, 3]);
        want.extend(msg(0xa06, 0x400, 1, &[9; 8]));
        want.extend(msg(0x11, 0x1, 2, &[]));
        clear_ack_requests(&mut batch);
        assert_eq!(batch, want);
        // A truncated or zero-length header stops the walk instead of looping or panicking.
        let mut junk = vec![0u8; 20];
        clear_ack_requests(&mut junk);
        let mut short = vec![0xff; 7];
        clear_ack_requests(&mut short);
    }

    #[test]
    fn error_reports_name_the_refused_message_and_skip_acks() {
        let report = |error: i32, seq: u32| {
            let mut p = error.to_ne_bytes().to_vec();
            p.extend(msg(0xa06, 0, seq, &[]));
            msg(NLMSG_ERROR, 0, seq, &p)
        };
        let mut data = report(0, 3);
        data.extend(report(-(Errno::ENOENT as i32), 7));
        data.extend(report(-(Errno::EEXIST as i32), 9));
        assert_eq!(
            error_reports(&data),
            vec![(7, Errno::ENOENT), (9, Errno::EEXIST)]
        );
        // A length running past the datagram ends the walk.
        let mut cut = report(-1, 1);
        cut.truncate(30);
        assert_eq!(error_reports(&cut), vec![]);
    }
}
