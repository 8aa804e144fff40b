//! A sandbox's link to its host (docs/network.md): one veth pair per sandbox, a /30 from the
//! edge's subnet (`edges[].network.subnet`, default 10.88.0.0/16), and a default route
//! through the host side. Everything is done over rtnetlink; no `ip`
//! command is run. The address plan (slots, addresses, names) is [`super::slot`].
//!
//! # Shape
//!
//! Slot `n` of the subnet is the /30 starting at `subnet + 4n`
//! ([`slot_addrs`](super::slot::slot_addrs)):
//!
//! ```text
//!   host (caller's) netns                  sandbox netns
//!   odsv<hex>  10.88.x.(4n+1)/30  <--veth-->  eth0  10.88.x.(4n+2)/30
//!   (the gateway)                            default via 10.88.x.(4n+1), lo up
//! ```
//!
//! The host-side name is [`host_veth_name`](super::slot::host_veth_name) (`odsv` and the /30's
//! address in hex), read back with [`slot_of_host_veth`](super::slot::slot_of_host_veth); the
//! sandbox side is always [`SANDBOX_IFNAME`] (`eth0`). Because the name is the slot, the edge must
//! not hand a slot out again while its veth still exists: [`list_strays`] finds every
//! host-side veth, so the edge's cleanup can [`detach`] those whose sandbox is gone.
//!
//! # Steps of [`attach`], and failure
//!
//! 1. One `RTM_NEWLINK` creates the pair: the host side in the caller's netns, the peer
//!    created directly in the sandbox's netns (`IFLA_NET_NS_FD` in the peer's attributes)
//!    under its final name `eth0`. The kernel makes both ends or neither, and the peer never
//!    exists in the host netns (where a name like `eth0` is usually taken).
//! 2. Host side: IPv6 off (below), the gateway address /30, up.
//! 3. Sandbox side (a netlink socket opened inside its netns, below): IPv6 off on `eth0`, the
//!    sandbox address /30, `eth0` and `lo` up, the default route via the gateway.
//!
//! When a step after 1 fails, the host side is deleted, which deletes the pair (the peer with
//! it, in whatever netns it is), and the step's error is returned; when that deletion fails
//! too, [`LinkError::CleanupFailed`] keeps both. A pre-existing link of the same name (host
//! side) or an `eth0` already in the sandbox makes step 1 fail with `EEXIST` and nothing is
//! made, nor removed. The future is not cancel-safe: dropped midway it can leave a pair
//! behind, which [`list_strays`] then reports.
//!
//! The kernel removes the pair by itself when the sandbox's netns goes away (its last process
//! exits and nothing holds the netns open): a veth in a dying netns is deleted with its peer.
//! Strays are therefore pairs whose netns is still held (a bind mount, a leftover process) or
//! that an interrupted attach left.
//!
//! # Opening netlink inside the sandbox's netns
//!
//! A netlink socket belongs to the netns of the thread that created it, for its whole life.
//! So [`attach`] starts a dedicated `std::thread` that `setns(fd, CLONE_NEWNET)`s into the
//! sandbox's netns (a dup of the caller's fd), writes the sandbox-side IPv6 sysctl there, and,
//! with the caller's tokio runtime entered (`Handle::enter`), creates the rtnetlink
//! connection, so the socket is registered with the caller's reactor. It sends the connection
//! back over a oneshot channel and exits: a thread in a foreign netns is never returned to a
//! pool (which `spawn_blocking` would do). The connection task then runs on the caller's
//! runtime like any other; the calling task's thread never changes netns. The caller's
//! runtime must have I/O enabled.
//!
//! # IPv6
//!
//! Sandboxes have IPv4 only (docs/network.md). Per end of the pair, in the netns where it
//! lives:
//!
//! - `net.ipv6.conf.<ifname>.disable_ipv6 = 1`. There is no netlink attribute for it
//!   (`IFLA_INET6_CONF` is read-only; only the token and the address generation mode can be
//!   set), so it is written to `/proc/sys/net/ipv6/conf/<ifname>/disable_ipv6`. `/proc/sys/net`
//!   resolves to the netns of the thread that opens it, so the sandbox side is written from
//!   the dedicated thread above (the sandbox's own sysctl; nothing of the host's changes), the
//!   host side from the calling thread (only that one interface). With IPv6 off the interface
//!   has no IPv6 address and drops every IPv6 packet it receives; on the host side that also
//!   stops a sandbox's forged router advertisements from configuring the host.
//! - `IFLA_AF_SPEC/AF_INET6/IFLA_INET6_ADDR_GEN_MODE = none` over netlink, before the link is
//!   up: no link-local address is generated even if IPv6 were enabled again later. (It does not
//!   stop SLAAC from a router advertisement, which is why the sysctl is the main switch.)
//!
//! The sandbox's `lo` keeps `::1`: loopback only, and some programs bind it. Where the kernel
//! has no IPv6 at all (`/proc/sys/net/ipv6` absent, `ipv6.disable=1`), both steps are skipped
//! and [`Attached::ipv6`] says so. Dropping IPv6 a sandbox sends anyway (raw sockets) is the
//! nftables chain's job.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use futures::TryStreamExt;
use nix::sched::CloneFlags;
use rtnetlink::packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoVeth, LinkAttribute,
    LinkInfo, LinkMessage,
};
use rtnetlink::{LinkUnspec, LinkVeth, RouteMessageBuilder};

use super::slot::{valid_ifname, LinkPlan, SlotAddrs, SLOT_PREFIX};

/// The name of the sandbox side of the pair, inside the sandbox's netns.
pub const SANDBOX_IFNAME: &str = "eth0";

/// A failed topology step. Variants are named after the step, and carry the host-side veth
/// name (which names the sandbox's slot), and the interface and netns concerned.
/// Netlink errors are kept as `io::Error`s with the kernel's errno (`EEXIST`, `ENODEV`, ...).
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// An interface name the kernel would refuse (empty, over 15 bytes, `/`, `:`, whitespace,
    /// NUL, `.` or `..`).
    #[error("interface name {name:?}: not a valid interface name")]
    InvalidName { name: String },
    /// Called outside a tokio runtime.
    #[error("the netlink calls of the network topology need a tokio runtime")]
    NoRuntime,
    /// Opening a netlink socket failed.
    #[error("veth {host}: opening netlink in the {side}")]
    Connect {
        host: String,
        side: Side,
        #[source]
        source: io::Error,
    },
    /// Duplicating the sandbox's netns fd, or starting the thread that enters it, failed.
    #[error("veth {host}: preparing to enter the sandbox netns")]
    NetnsThread {
        host: String,
        #[source]
        source: io::Error,
    },
    /// The thread that enters the sandbox's netns ended without an answer.
    #[error("veth {host}: the thread entering the sandbox netns ended without an answer")]
    NetnsThreadLost { host: String },
    /// `setns` into the sandbox's netns failed (not a netns fd, no privilege).
    #[error("veth {host}: entering the sandbox netns")]
    EnterNetns {
        host: String,
        #[source]
        source: nix::Error,
    },
    /// Creating the pair failed; nothing was made. `EEXIST`: the host-side name is taken in
    /// the host netns, or `eth0` exists in the sandbox's.
    #[error(
        "veth {host}: creating the pair ({host} in the host netns, {SANDBOX_IFNAME} in the \
         sandbox netns)"
    )]
    CreateVeth {
        host: String,
        #[source]
        source: io::Error,
    },
    /// Looking an interface up failed.
    #[error("veth {host}: looking up {ifname} in the {side}")]
    Lookup {
        host: String,
        ifname: String,
        side: Side,
        #[source]
        source: io::Error,
    },
    /// An interface that must exist does not.
    #[error("veth {host}: no interface {ifname} in the {side}")]
    Missing {
        host: String,
        ifname: String,
        side: Side,
    },
    /// Restricting the host-side veth's ARP answers failed (its sysctls).
    #[error("veth {host}: restricting its ARP answers")]
    Arp {
        host: String,
        #[source]
        source: io::Error,
    },
    /// Turning IPv6 off on an interface failed (its sysctl or its address generation mode).
    #[error("veth {host}: turning IPv6 off on {ifname} in the {side}")]
    Ipv6Off {
        host: String,
        ifname: String,
        side: Side,
        #[source]
        source: io::Error,
    },
    /// Adding an address failed.
    #[error("veth {host}: adding {addr}/{prefix} to {ifname} in the {side}")]
    Address {
        host: String,
        ifname: String,
        side: Side,
        addr: Ipv4Addr,
        prefix: u8,
        #[source]
        source: io::Error,
    },
    /// Bringing an interface up failed.
    #[error("veth {host}: bringing {ifname} up in the {side}")]
    Up {
        host: String,
        ifname: String,
        side: Side,
        #[source]
        source: io::Error,
    },
    /// Adding the sandbox's default route failed (`EEXIST`: it already has one).
    #[error("veth {host}: adding the default route via {gateway} in the sandbox netns")]
    Route {
        host: String,
        gateway: Ipv4Addr,
        #[source]
        source: io::Error,
    },
    /// Listing the host's links failed.
    #[error("listing links with prefix {prefix:?}")]
    List {
        prefix: String,
        #[source]
        source: io::Error,
    },
    /// [`detach`] found a link of that name that is not a veth, and left it alone.
    #[error("interface {name}: not a veth; left in place")]
    NotVeth { name: String },
    /// Deleting the host side (and so the pair) failed.
    #[error("veth {name}: deleting it")]
    Delete {
        name: String,
        #[source]
        source: io::Error,
    },
    /// A step of [`attach`] failed, and deleting what it had made failed too: both are kept,
    /// the step's error first. The pair may still exist; [`list_strays`] reports it.
    #[error(
        "{}; cleaning up after it failed too: {}",
        crate::types::chain(&**.primary),
        crate::types::chain(&**.cleanup)
    )]
    CleanupFailed {
        primary: Box<LinkError>,
        cleanup: Box<LinkError>,
    },
}

/// Which netns a step ran in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The caller's netns (the edge's, or the node's).
    Host,
    /// The sandbox's netns.
    Sandbox,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Host => "host netns",
            Side::Sandbox => "sandbox netns",
        })
    }
}

/// Whether IPv6 was turned off on both ends, or the kernel has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ipv6 {
    /// `disable_ipv6 = 1` and address generation mode `none` on both ends.
    Off,
    /// The kernel has no IPv6 (`/proc/sys/net/ipv6` is absent): nothing to turn off.
    NotInKernel,
}

/// A sandbox attached by [`attach`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    /// The host-side veth's name (what [`detach`] takes) and its ifindex in the host netns.
    pub host_name: String,
    pub host_index: u32,
    /// `eth0`'s ifindex inside the sandbox's netns.
    pub sandbox_index: u32,
    pub addrs: SlotAddrs,
    pub ipv6: Ipv6,
}

/// Connects the sandbox whose network namespace is `netns` (an fd of `/proc/<pid>/ns/net`
/// or a bind mount of it) to the caller's netns, as [`LinkPlan`] says: the steps and the
/// failure handling are in the module's doc. Needs CAP_NET_ADMIN over both netns and a
/// tokio runtime with I/O.
///
/// Errors: [`LinkError::CreateVeth`] (nothing made; `EEXIST` for a name clash on either side),
/// [`LinkError::EnterNetns`] (not a netns), and one variant per later step (the pair removed
/// again), or [`LinkError::CleanupFailed`] when removing it failed too.
pub async fn attach(netns: BorrowedFd<'_>, plan: &LinkPlan) -> Result<Attached, LinkError> {
    let host = plan.host_name.as_str();
    if !valid_ifname(host) {
        return Err(LinkError::InvalidName { name: host.into() });
    }
    let nl = Netlink::here(host)?;
    create_pair(&nl, netns, host).await?;
    match configure(&nl, netns, plan).await {
        Ok(a) => Ok(a),
        Err(primary) => match delete(&nl, host).await {
            Ok(_) => Err(primary),
            Err(cleanup) => {
                tracing::warn!(
                    veth = host,
                    error = %crate::types::chain(&cleanup),
                    "removing a half-made veth pair"
                );
                Err(LinkError::CleanupFailed {
                    primary: Box::new(primary),
                    cleanup: Box::new(cleanup),
                })
            }
        },
    }
}

/// Deletes the host-side veth `name` in the caller's netns, and so the pair. `Ok(true)` when
/// it was deleted, `Ok(false)` when there was none (idempotent).
/// Errors: [`LinkError::InvalidName`]; [`LinkError::NotVeth`] for a link of that name that is
/// not a veth (never deleted); [`LinkError::Lookup`] / [`LinkError::Delete`] from netlink.
pub async fn detach(name: &str) -> Result<bool, LinkError> {
    if !valid_ifname(name) {
        return Err(LinkError::InvalidName { name: name.into() });
    }
    let nl = Netlink::here(name)?;
    delete(&nl, name).await
}

/// Whether the caller's netns has a veth named `name` (what an adopted sandbox's slot must
/// still have).
/// Errors: [`LinkError::InvalidName`]; [`LinkError::Lookup`] from netlink.
pub async fn veth_exists(name: &str) -> Result<bool, LinkError> {
    if !valid_ifname(name) {
        return Err(LinkError::InvalidName { name: name.into() });
    }
    let nl = Netlink::here(name)?;
    Ok(host_link(&nl, name).await?.is_some_and(|m| is_veth(&m)))
}

/// The names of the veths in the caller's netns whose name starts with `prefix` (normally
/// [`HOST_VETH_PREFIX`](super::slot::HOST_VETH_PREFIX)), sorted: the edge compares them
/// with its sandboxes and [`detach`]es the rest. Links of other kinds are never listed.
/// Errors: [`LinkError::List`].
pub async fn list_strays(prefix: &str) -> Result<Vec<String>, LinkError> {
    let list_err = |source| LinkError::List {
        prefix: prefix.into(),
        source,
    };
    let nl = Netlink::here(prefix).map_err(|e| match e {
        LinkError::Connect { source, .. } => list_err(source),
        other => other,
    })?;
    let mut links = nl.handle.link().get().execute();
    let mut out = Vec::new();
    while let Some(m) = links.try_next().await.map_err(|e| list_err(to_io(e)))? {
        if let Some(name) = link_name(&m) {
            if name.starts_with(prefix) && is_veth(&m) {
                out.push(name.to_string());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// An rtnetlink connection whose task ends when this is dropped.
struct Netlink {
    handle: rtnetlink::Handle,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Netlink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Netlink {
    /// A connection in the calling thread's netns.
    fn here(host: &str) -> Result<Netlink, LinkError> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| LinkError::NoRuntime)?;
        let (conn, handle, _unsolicited) =
            rtnetlink::new_connection().map_err(|source| LinkError::Connect {
                host: host.into(),
                side: Side::Host,
                source,
            })?;
        let task = rt.spawn(conn);
        Ok(Netlink { handle, task })
    }

    /// A connection inside `netns`, opened by a dedicated thread (module doc), which also
    /// turns IPv6 off on the sandbox's `eth0` there.
    async fn inside(netns: BorrowedFd<'_>, host: &str) -> Result<(Netlink, Ipv6), LinkError> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| LinkError::NoRuntime)?;
        let thread_err = |source| LinkError::NetnsThread {
            host: host.into(),
            source,
        };
        let fd: OwnedFd = netns.try_clone_to_owned().map_err(thread_err)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let thread_rt = rt.clone();
        let name = host.to_string();
        std::thread::Builder::new()
            .name("netns-link".into())
            .spawn(move || {
                let _ = tx.send(open_inside(fd, &thread_rt, &name));
            })
            .map_err(thread_err)?;
        let (conn, handle, ipv6) = rx
            .await
            .map_err(|_| LinkError::NetnsThreadLost { host: host.into() })??;
        let task = rt.spawn(conn);
        Ok((Netlink { handle, task }, ipv6))
    }
}

type Connection = rtnetlink::proto::Connection<rtnetlink::packet_route::RouteNetlinkMessage>;

/// On the dedicated thread: enter `netns` (this thread only, for the rest of its short life),
/// turn IPv6 off on `eth0`, and open a netlink socket registered with `rt`'s reactor.
fn open_inside(
    netns: OwnedFd,
    rt: &tokio::runtime::Handle,
    host: &str,
) -> Result<(Connection, rtnetlink::Handle, Ipv6), LinkError> {
    nix::sched::setns(netns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| {
        LinkError::EnterNetns {
            host: host.into(),
            source,
        }
    })?;
    drop(netns);
    let ipv6 = disable_ipv6(SANDBOX_IFNAME).map_err(|source| LinkError::Ipv6Off {
        host: host.into(),
        ifname: SANDBOX_IFNAME.into(),
        side: Side::Sandbox,
        source,
    })?;
    let _entered = rt.enter();
    let (conn, handle, _unsolicited) =
        rtnetlink::new_connection().map_err(|source| LinkError::Connect {
            host: host.into(),
            side: Side::Sandbox,
            source,
        })?;
    Ok((conn, handle, ipv6))
}

/// `net.ipv4.ip_forward = 1` in the calling thread's netns: the host routes its sandboxes'
/// packets (which its nftables table then filters, docs/network.md). Idempotent.
/// Errors: writing `/proc/sys/net/ipv4/ip_forward` (the path in the message).
pub fn enable_ipv4_forwarding() -> io::Result<()> {
    let path = Path::new("/proc/sys/net/ipv4/ip_forward");
    if std::fs::read(path).is_ok_and(|v| v.trim_ascii() == b"1") {
        return Ok(());
    }
    std::fs::write(path, b"1")
        .map_err(|e| io::Error::new(e.kind(), format!("writing {}: {e}", path.display())))
}

/// `net.ipv6.conf.<ifname>.disable_ipv6 = 1` in the calling thread's netns, or
/// [`Ipv6::NotInKernel`] when the kernel has no IPv6.
fn disable_ipv6(ifname: &str) -> io::Result<Ipv6> {
    let net = Path::new("/proc/sys/net");
    if !net.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "/proc/sys/net is missing (is /proc mounted?)",
        ));
    }
    if !net.join("ipv6").is_dir() {
        return Ok(Ipv6::NotInKernel);
    }
    let path = net.join("ipv6/conf").join(ifname).join("disable_ipv6");
    std::fs::write(&path, b"1")
        .map_err(|e| io::Error::new(e.kind(), format!("writing {}: {e}", path.display())))?;
    Ok(Ipv6::Off)
}

/// `arp_ignore = 1` and `arp_announce = 2` on host-side veth `ifname` (calling thread's
/// netns): by default Linux answers ARP on any interface for any of the host's addresses,
/// which would show a sandbox the host's other addresses; now the veth answers for its
/// gateway address only, and asks with it.
fn arp_for_own_address_only(ifname: &str) -> io::Result<()> {
    let conf = Path::new("/proc/sys/net/ipv4/conf").join(ifname);
    for (key, value) in [("arp_ignore", b"1"), ("arp_announce", b"2")] {
        let path = conf.join(key);
        std::fs::write(&path, value)
            .map_err(|e| io::Error::new(e.kind(), format!("writing {}: {e}", path.display())))?;
    }
    Ok(())
}

/// Step 1: the pair, the peer made directly inside `netns` as `eth0`.
async fn create_pair(nl: &Netlink, netns: BorrowedFd<'_>, host: &str) -> Result<(), LinkError> {
    let peer = LinkUnspec::new_with_name(SANDBOX_IFNAME)
        .setns_by_fd(netns.as_raw_fd())
        .build();
    let msg = LinkVeth::new(host, SANDBOX_IFNAME)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    nl.handle
        .link()
        .add(msg)
        .execute()
        .await
        .map_err(|e| LinkError::CreateVeth {
            host: host.into(),
            source: to_io(e),
        })
}

/// Steps 2 and 3 (module doc).
async fn configure(
    nl: &Netlink,
    netns: BorrowedFd<'_>,
    plan: &LinkPlan,
) -> Result<Attached, LinkError> {
    let host = plan.host_name.as_str();
    let a = plan.addrs;
    let host_index = index_of(nl, host, host, Side::Host).await?;
    let host_ipv6 = disable_ipv6(host).map_err(|source| LinkError::Ipv6Off {
        host: host.into(),
        ifname: host.into(),
        side: Side::Host,
        source,
    })?;
    if host_ipv6 == Ipv6::Off {
        no_addr_gen(nl, host_index, host, host, Side::Host).await?;
    }
    arp_for_own_address_only(host).map_err(|source| LinkError::Arp {
        host: host.into(),
        source,
    })?;
    add_address(nl, host_index, a.gateway, host, host, Side::Host).await?;
    set_up(nl, host_index, host, host, Side::Host).await?;

    let (sb, sb_ipv6) = Netlink::inside(netns, host).await?;
    let eth0 = index_of(&sb, SANDBOX_IFNAME, host, Side::Sandbox).await?;
    let lo = index_of(&sb, "lo", host, Side::Sandbox).await?;
    if sb_ipv6 == Ipv6::Off {
        no_addr_gen(&sb, eth0, SANDBOX_IFNAME, host, Side::Sandbox).await?;
    }
    add_address(&sb, eth0, a.sandbox, SANDBOX_IFNAME, host, Side::Sandbox).await?;
    set_up(&sb, eth0, SANDBOX_IFNAME, host, Side::Sandbox).await?;
    set_up(&sb, lo, "lo", host, Side::Sandbox).await?;
    let route = RouteMessageBuilder::<Ipv4Addr>::new()
        .gateway(a.gateway)
        .output_interface(eth0)
        .build();
    sb.handle
        .route()
        .add(route)
        .execute()
        .await
        .map_err(|e| LinkError::Route {
            host: host.into(),
            gateway: a.gateway,
            source: to_io(e),
        })?;
    let ipv6 = if host_ipv6 == Ipv6::Off && sb_ipv6 == Ipv6::Off {
        Ipv6::Off
    } else {
        Ipv6::NotInKernel
    };
    Ok(Attached {
        host_name: host.into(),
        host_index,
        sandbox_index: eth0,
        addrs: a,
        ipv6,
    })
}

/// The host-side link `name`, if there is one.
/// Errors: [`LinkError::Lookup`].
async fn host_link(nl: &Netlink, name: &str) -> Result<Option<LinkMessage>, LinkError> {
    get_link(nl, name)
        .await
        .map_err(|source| LinkError::Lookup {
            host: name.into(),
            ifname: name.into(),
            side: Side::Host,
            source,
        })
}

/// Deletes the veth `name` if it exists: `Ok(false)` when it does not.
async fn delete(nl: &Netlink, name: &str) -> Result<bool, LinkError> {
    let Some(m) = host_link(nl, name).await? else {
        return Ok(false);
    };
    if !is_veth(&m) {
        return Err(LinkError::NotVeth { name: name.into() });
    }
    match nl.handle.link().del(m.header.index).execute().await {
        Ok(()) => Ok(true),
        Err(e) => {
            let e = to_io(e);
            if e.raw_os_error() == Some(libc::ENODEV) {
                // Gone in between (its netns died, or another cleanup got there first).
                Ok(false)
            } else {
                Err(LinkError::Delete {
                    name: name.into(),
                    source: e,
                })
            }
        }
    }
}

/// The link named `name`, `None` when there is none.
async fn get_link(nl: &Netlink, name: &str) -> io::Result<Option<LinkMessage>> {
    let mut s = nl.handle.link().get().match_name(name).execute();
    match s.try_next().await {
        Ok(m) => Ok(m),
        Err(e) => {
            let e = to_io(e);
            if e.raw_os_error() == Some(libc::ENODEV) {
                Ok(None)
            } else {
                Err(e)
            }
        }
    }
}

async fn index_of(nl: &Netlink, ifname: &str, host: &str, side: Side) -> Result<u32, LinkError> {
    match get_link(nl, ifname).await {
        Ok(Some(m)) => Ok(m.header.index),
        Ok(None) => Err(LinkError::Missing {
            host: host.into(),
            ifname: ifname.into(),
            side,
        }),
        Err(source) => Err(LinkError::Lookup {
            host: host.into(),
            ifname: ifname.into(),
            side,
            source,
        }),
    }
}

/// IPv6 address generation mode `none` (no link-local address), set while the link is down.
async fn no_addr_gen(
    nl: &Netlink,
    index: u32,
    ifname: &str,
    host: &str,
    side: Side,
) -> Result<(), LinkError> {
    let msg = LinkUnspec::new_with_index(index)
        .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
            vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
        )]))
        .build();
    nl.handle
        .link()
        .set(msg)
        .execute()
        .await
        .map_err(|e| LinkError::Ipv6Off {
            host: host.into(),
            ifname: ifname.into(),
            side,
            source: to_io(e),
        })
}

async fn add_address(
    nl: &Netlink,
    index: u32,
    addr: Ipv4Addr,
    ifname: &str,
    host: &str,
    side: Side,
) -> Result<(), LinkError> {
    nl.handle
        .address()
        .add(index, IpAddr::V4(addr), SLOT_PREFIX)
        .execute()
        .await
        .map_err(|e| LinkError::Address {
            host: host.into(),
            ifname: ifname.into(),
            side,
            addr,
            prefix: SLOT_PREFIX,
            source: to_io(e),
        })
}

async fn set_up(
    nl: &Netlink,
    index: u32,
    ifname: &str,
    host: &str,
    side: Side,
) -> Result<(), LinkError> {
    nl.handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(|e| LinkError::Up {
            host: host.into(),
            ifname: ifname.into(),
            side,
            source: to_io(e),
        })
}

fn link_name(m: &LinkMessage) -> Option<&str> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

fn is_veth(m: &LinkMessage) -> bool {
    m.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))),
        _ => false,
    })
}

/// A netlink error as the kernel's errno where it has one.
fn to_io(e: rtnetlink::Error) -> io::Error {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io(),
        other => io::Error::other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_cleanup_keeps_both_errors() {
        let primary = LinkError::Route {
            host: "odsv3".into(),
            gateway: Ipv4Addr::new(10, 88, 0, 13),
            source: io::Error::from_raw_os_error(libc::EEXIST),
        };
        let cleanup = LinkError::Delete {
            name: "odsv3".into(),
            source: io::Error::from_raw_os_error(libc::EBUSY),
        };
        let both = LinkError::CleanupFailed {
            primary: Box::new(primary),
            cleanup: Box::new(cleanup),
        };
        let text = crate::types::chain(&both);
        assert!(
            text.starts_with(
                "veth odsv3: adding the default route via 10.88.0.13 in the sandbox netns: \
                 File exists"
            ),
            "{text}"
        );
        assert!(
            text.ends_with(
                "cleaning up after it failed too: veth odsv3: deleting it: \
                 Device or resource busy (os error 16)"
            ),
            "{text}"
        );
    }

    #[test]
    fn netlink_errors_keep_the_errno() {
        let mut m = rtnetlink::packet_core::ErrorMessage::default();
        m.code = std::num::NonZeroI32::new(-libc::EEXIST);
        let e = to_io(rtnetlink::Error::NetlinkError(m));
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
    }

    #[tokio::test]
    async fn bad_names_are_refused_before_any_netlink() {
        assert!(matches!(
            detach("much-too-long-name").await,
            Err(LinkError::InvalidName { .. })
        ));
        assert!(matches!(
            detach("").await,
            Err(LinkError::InvalidName { .. })
        ));
    }
}
