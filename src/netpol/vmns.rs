//! A microVM's network namespace (docs/microvm.md "Network"): the node's side of "network
//! for clones". Every VM's namespace holds the sandbox's `eth0` (its slot's veth, made by
//! [`super::network::Network::attach`] as for a container) and a persistent TAP device of
//! the same name with the same addresses in every VM, so that a copy restored from a
//! snapshot finds the network its guest already configured: the guest is always
//! [`GUEST`] behind [`GATEWAY`], and the namespace translates to the slot's address
//! ([`super::nft::install_vm_table`]). QEMU never enters the namespace: the edge opens the
//! tap there and hands QEMU the descriptor.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use futures::TryStreamExt;
use rtnetlink::LinkUnspec;

use super::link::SANDBOX_IFNAME;
use super::nft::{install_vm_table, NftError};
use super::slot::SLOT_PREFIX;

/// The tap's name in every VM's namespace.
pub const TAP: &str = "tap0";
/// The tap's address: the guest's gateway and its resolver.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 1);
/// The guest's address on its `eth0`.
pub const GUEST: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 2);
/// The prefix length of both.
pub const PREFIX: u8 = SLOT_PREFIX;
/// The tap's MAC address, the same in every VM: a copy's guest keeps its gateway's
/// neighbour entry from its snapshot, which a new tap must answer to.
pub const TAP_MAC: [u8; 6] = [0x02, 0xfc, 0, 0, 0, 0x01];
/// The guest NIC's MAC address, the same in every VM (locally administered): copies of
/// one snapshot keep it, each in a namespace of its own.
pub const GUEST_MAC: &str = "02:fc:00:00:00:02";
/// The tap's and the guest's MTU: the veth's.
pub const MTU: u32 = 1500;

/// A step of setting up a VM's namespace that failed.
#[derive(Debug, thiserror::Error)]
pub enum VmnsError {
    /// Entering the namespace (not one; no privilege), or a thread for it.
    #[error("entering the VM's network namespace: {0}")]
    Enter(#[source] io::Error),
    #[error("{what}: {source}")]
    Step {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Nft(#[from] NftError),
}

fn step(what: &'static str) -> impl FnOnce(io::Error) -> VmnsError {
    move |source| VmnsError::Step { what, source }
}

/// Sets up the namespace `netns`, whose `eth0` is attached already: forwarding on, the
/// persistent tap with [`GATEWAY`]`/30` up, IPv6 off on it, `lo` up, and the table that
/// sends the guest's traffic out as the slot's address and its DNS to `dns` (the slot's
/// gateway). Blocking (a thread of its own enters the namespace). Errors: the step that
/// failed; what was made stays until the namespace goes.
pub fn setup(netns: BorrowedFd<'_>, dns: Ipv4Addr) -> Result<(), VmnsError> {
    crate::sys::netns::run_in(netns, move || -> Result<(), VmnsError> {
        write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
        drop(crate::sys::tap::open(TAP, true).map_err(step("making the tap"))?);
        let ipv6 = Path::new("/proc/sys/net/ipv6/conf").join(TAP);
        if ipv6.is_dir() {
            std::fs::write(ipv6.join("disable_ipv6"), "1")
                .map_err(step("turning IPv6 off on the tap"))?;
        }
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(step("a runtime for netlink"))?
            .block_on(configure_tap())?;
        install_vm_table(TAP, SANDBOX_IFNAME, GUEST, dns)?;
        Ok(())
    })
    .map_err(VmnsError::Enter)?
}

/// Opens the VM's tap in `netns` for its QEMU (each start: creation, resume, copy).
/// Errors: entering the namespace, or the tap (absent: the namespace was not set up).
pub fn open_tap(netns: BorrowedFd<'_>) -> Result<OwnedFd, VmnsError> {
    crate::sys::netns::run_in(netns, || crate::sys::tap::open(TAP, true))
        .map_err(VmnsError::Enter)?
        .map_err(step("opening the tap"))
}

fn write_sysctl(path: &'static str, value: &str) -> Result<(), VmnsError> {
    std::fs::write(path, value).map_err(step(path))
}

async fn configure_tap() -> Result<(), VmnsError> {
    let nl = |e: rtnetlink::Error| io::Error::other(e.to_string());
    let (conn, handle, _) = rtnetlink::new_connection().map_err(step("netlink"))?;
    let task = tokio::spawn(conn);
    let index = |name: &'static str| {
        let handle = handle.clone();
        async move {
            handle
                .link()
                .get()
                .match_name(name.to_string())
                .execute()
                .try_next()
                .await
                .map_err(nl)
                .map_err(step("finding a link"))?
                .map(|m| m.header.index)
                .ok_or_else(|| step("finding a link")(io::Error::from(io::ErrorKind::NotFound)))
        }
    };
    let (tap, lo) = (index(TAP).await?, index("lo").await?);
    handle
        .address()
        .add(tap, IpAddr::V4(GATEWAY), PREFIX)
        .execute()
        .await
        .map_err(nl)
        .map_err(step("the tap's address"))?;
    handle
        .link()
        .set(
            LinkUnspec::new_with_index(tap)
                .address(TAP_MAC.to_vec())
                .mtu(MTU)
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(nl)
        .map_err(step("bringing the tap up"))?;
    handle
        .link()
        .set(LinkUnspec::new_with_index(lo).up().build())
        .execute()
        .await
        .map_err(nl)
        .map_err(step("bringing lo up"))?;
    task.abort();
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn inside(pin: &Path, cmd: &[&str]) -> String {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", pin.display()))
            .args(cmd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{cmd:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn a_vm_namespace_gets_its_tap_forwarding_and_table() {
        if !crate::sys::root_or_skip("a_vm_namespace_gets_its_tap_forwarding_and_table") {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let pin = t.path().join("netns");
        crate::sys::netns::create_pinned(&pin).unwrap();
        let ns = crate::sys::netns::open_pinned(&pin).unwrap();
        // eth0 as Network::attach leaves it (here one end of a veth pair: no edge).
        inside(
            &pin,
            &[
                "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
            ],
        );
        setup(ns.as_fd(), Ipv4Addr::new(10, 88, 0, 1)).unwrap();
        let addr = inside(&pin, &["ip", "-4", "-o", "addr", "show", "dev", "tap0"]);
        assert!(addr.contains("inet 169.254.0.1/30"), "{addr}");
        let link = inside(&pin, &["ip", "-o", "link", "show", "dev", "tap0"]);
        assert!(link.contains("mtu 1500"), "{link}");
        assert!(link.contains("link/ether 02:fc:00:00:00:01"), "{link}");
        assert!(link.contains("UP"), "{link}");
        assert_eq!(
            inside(&pin, &["cat", "/proc/sys/net/ipv4/ip_forward"]).trim(),
            "1"
        );
        assert_eq!(
            inside(&pin, &["cat", "/proc/sys/net/ipv6/conf/tap0/disable_ipv6"]).trim(),
            "1"
        );
        let table = inside(&pin, &["nft", "list", "table", "inet", "opendsec-vm"]);
        for want in [
            "iifname \"tap0\" meta nfproto ipv4 udp dport 53 dnat ip to 10.88.0.1:53",
            "iifname \"tap0\" meta nfproto ipv4 tcp dport 53 dnat ip to 10.88.0.1:53",
            "iifname \"tap0\" oifname \"eth0\" ip saddr 169.254.0.2 accept",
            "iifname \"eth0\" oifname \"tap0\" ct state established,related accept",
            "iifname != \"lo\" drop",
            "oifname \"eth0\" masquerade",
        ] {
            assert!(table.contains(want), "{want:?} is not in:\n{table}");
        }
        // The tap opens again for each QEMU start; the table may be written again.
        open_tap(ns.as_fd()).unwrap();
        crate::sys::netns::run_in(ns.as_fd(), || {
            install_vm_table(TAP, SANDBOX_IFNAME, GUEST, Ipv4Addr::new(10, 88, 0, 5))
        })
        .unwrap()
        .unwrap();
        let table = inside(&pin, &["nft", "list", "table", "inet", "opendsec-vm"]);
        assert_eq!(table.matches("dnat ip to").count(), 2, "{table}");
        assert!(table.contains("10.88.0.5:53"), "{table}");
        drop(ns);
        crate::sys::netns::remove_pinned(&pin).unwrap();
    }
}
