//! The address plan of sandbox networking (docs/network.md): the edge's subnet
//! (`edges[].network.subnet`, default [`DEFAULT_SUBNET`] 10.88.0.0/16) is cut into /30s,
//! one per sandbox slot, and each slot's host-side veth is named after it. Pure arithmetic,
//! no I/O; [`super::link`] makes the interfaces.
//!
//! Slot `n` is the /30 at `subnet + 4n`: `+1` is the host side (the sandbox's gateway), `+2`
//! the sandbox's `eth0`, `+3` the broadcast address. The host-side veth is named after its
//! /30: `odsv` and the network address in 8 hex digits (`odsv0a580004` for 10.88.0.4/30),
//! 12 bytes, under IFNAMSIZ. Edges sharing a machine have distinct subnets, so names never
//! clash between them; every veth of one edge starts with [`veth_prefix`] (`odsv0a58` for
//! 10.88.0.0/16), which is how the edge's nftables table and its cleanup tell its own
//! veths from another edge's, and [`slot_of_host_veth`] reads a name back to its slot.

use std::net::Ipv4Addr;

use super::Ipv4Net;

/// The default `edges[].network.subnet`: 10.88.0.0/16, 16,384 slots.
pub const DEFAULT_SUBNET: Ipv4Net = Ipv4Net::new_unchecked(Ipv4Addr::new(10, 88, 0, 0), 16);

/// The prefix of every host-side veth name ([`host_veth_name`]).
pub const HOST_VETH_PREFIX: &str = "odsv";

/// The prefix length of each sandbox's network.
pub const SLOT_PREFIX: u8 = 30;

/// The longest interface name the kernel takes (IFNAMSIZ 16, less the NUL).
pub const MAX_IFNAME: usize = 15;

/// A subnet or slot that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// The subnet cannot hold one /30.
    #[error("network subnet {subnet}: too small for one sandbox (a /30 at least)")]
    SubnetTooSmall { subnet: Ipv4Net },
    /// The slot is past the last /30 of the subnet.
    #[error(
        "network slot {slot}: outside subnet {subnet}, which has {slots} slots (0 to {})",
        .slots.saturating_sub(1)
    )]
    OutOfRange {
        slot: u32,
        subnet: Ipv4Net,
        slots: u32,
    },
}

/// The addresses of one slot: its /30, the host side's address (the sandbox's gateway, the
/// first usable address) and the sandbox's address (the second usable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotAddrs {
    pub slot: u32,
    /// The /30 (`network.prefix()` is [`SLOT_PREFIX`]).
    pub network: Ipv4Net,
    /// Host side, `network + 1`.
    pub gateway: Ipv4Addr,
    /// Sandbox side (`eth0`), `network + 2`.
    pub sandbox: Ipv4Addr,
}

/// How many slots (/30s) `subnet` holds: `2^(30 - prefix)`.
/// Errors: [`SlotError::SubnetTooSmall`] for a /31 or /32.
pub fn slot_count(subnet: Ipv4Net) -> Result<u32, SlotError> {
    if subnet.prefix() > SLOT_PREFIX {
        return Err(SlotError::SubnetTooSmall { subnet });
    }
    // prefix ≤ 30, so the shift is 0..=30 and fits a u32.
    Ok(1u32 << (SLOT_PREFIX - subnet.prefix()))
}

/// The addresses of slot `slot` of `subnet` (slot 0 is the subnet's first /30).
/// Errors: [`SlotError::SubnetTooSmall`]; [`SlotError::OutOfRange`] for a slot at or past
/// [`slot_count`].
pub fn slot_addrs(subnet: Ipv4Net, slot: u32) -> Result<SlotAddrs, SlotError> {
    let slots = slot_count(subnet)?;
    if slot >= slots {
        return Err(SlotError::OutOfRange {
            slot,
            subnet,
            slots,
        });
    }
    // slot < 2^(30 - prefix), so 4 * slot + 3 stays inside the subnet: no overflow, and the
    // host bits of `base` are zero at /30.
    let base = u32::from(subnet.addr()) | (slot << 2);
    let network = Ipv4Net::new_unchecked(Ipv4Addr::from(base), SLOT_PREFIX);
    Ok(SlotAddrs {
        slot,
        network,
        gateway: Ipv4Addr::from(base | 1),
        sandbox: Ipv4Addr::from(base | 2),
    })
}

/// The slot whose /30 holds `addr`, if `addr` is in `subnet` (how the DNS proxy and the
/// chains can tell a sandbox by its source address). `None` outside the subnet or for a
/// subnet smaller than a /30.
pub fn slot_of_addr(subnet: Ipv4Net, addr: Ipv4Addr) -> Option<u32> {
    if subnet.prefix() > SLOT_PREFIX || !subnet.contains(addr) {
        return None;
    }
    Some((u32::from(addr) - u32::from(subnet.addr())) >> 2)
}

/// The host-side veth name of the /30 `network`: [`HOST_VETH_PREFIX`] and its address in 8
/// lowercase hex digits (`odsv0a580004` for 10.88.0.4/30), 12 bytes.
pub fn host_veth_name(network: Ipv4Net) -> String {
    format!("{HOST_VETH_PREFIX}{:08x}", u32::from(network.addr()))
}

/// The start every host-side veth name of `subnet`'s slots shares: [`HOST_VETH_PREFIX`] and
/// the hex digits its prefix fixes whole (`odsv0a58` for a /16, `odsv0a5` for a /12 or /14).
/// Edges on one machine need subnets whose prefixes differ here (10.88.0.0/16 and
/// 10.89.0.0/16 do), or each would take the other's veths for its own.
pub fn veth_prefix(subnet: Ipv4Net) -> String {
    let hex = format!("{:08x}", u32::from(subnet.addr()));
    let nibbles = usize::from(subnet.prefix() / 4);
    format!("{HOST_VETH_PREFIX}{}", hex.get(..nibbles).unwrap_or(&hex))
}

/// The slot of `subnet` a host-side veth name stands for: the inverse of [`host_veth_name`].
/// `None` for any other name (another prefix, not 8 lowercase hex digits, an address outside
/// `subnet` or not the start of a /30).
pub fn slot_of_host_veth(subnet: Ipv4Net, name: &str) -> Option<u32> {
    let hex = name.strip_prefix(HOST_VETH_PREFIX)?;
    if hex.len() != 8 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let addr = Ipv4Addr::from(u32::from_str_radix(hex, 16).ok()?);
    let slot = slot_of_addr(subnet, addr)?;
    (slot_addrs(subnet, slot).ok()?.network.addr() == addr).then_some(slot)
}

/// Whether the kernel would take `name` as an interface name (`dev_valid_name`).
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_IFNAME
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
}

/// What [`attach`](super::link::attach) needs for one sandbox: its slot's addresses and the
/// host-side name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkPlan {
    pub host_name: String,
    pub addrs: SlotAddrs,
}

impl LinkPlan {
    /// The plan of slot `slot` of `subnet`, named [`host_veth_name`].
    /// Errors: as [`slot_addrs`].
    pub fn new(subnet: Ipv4Net, slot: u32) -> Result<LinkPlan, SlotError> {
        let addrs = slot_addrs(subnet, slot)?;
        Ok(LinkPlan {
            host_name: host_veth_name(addrs.network),
            addrs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        let (a, p) = s.split_once('/').unwrap();
        Ipv4Net::new(a.parse().unwrap(), p.parse().unwrap()).unwrap()
    }

    #[test]
    fn slots_of_the_default_subnet() {
        assert_eq!(DEFAULT_SUBNET, net("10.88.0.0/16"));
        assert_eq!(slot_count(DEFAULT_SUBNET).unwrap(), 16_384);
        let s0 = slot_addrs(DEFAULT_SUBNET, 0).unwrap();
        assert_eq!(s0.network, net("10.88.0.0/30"));
        assert_eq!(s0.gateway, Ipv4Addr::new(10, 88, 0, 1));
        assert_eq!(s0.sandbox, Ipv4Addr::new(10, 88, 0, 2));
        let s1 = slot_addrs(DEFAULT_SUBNET, 1).unwrap();
        assert_eq!(s1.network, net("10.88.0.4/30"));
        assert_eq!(s1.gateway, Ipv4Addr::new(10, 88, 0, 5));
        assert_eq!(s1.sandbox, Ipv4Addr::new(10, 88, 0, 6));
        let s64 = slot_addrs(DEFAULT_SUBNET, 64).unwrap();
        assert_eq!(s64.network, net("10.88.1.0/30"));
        let last = slot_addrs(DEFAULT_SUBNET, 16_383).unwrap();
        assert_eq!(last.slot, 16_383);
        assert_eq!(last.network, net("10.88.255.252/30"));
        assert_eq!(last.gateway, Ipv4Addr::new(10, 88, 255, 253));
        assert_eq!(last.sandbox, Ipv4Addr::new(10, 88, 255, 254));
    }

    #[test]
    fn a_slot_outside_the_subnet_is_an_error_naming_it() {
        let e = slot_addrs(DEFAULT_SUBNET, 16_384).unwrap_err();
        assert!(matches!(
            e,
            SlotError::OutOfRange {
                slot: 16_384,
                slots: 16_384,
                ..
            }
        ));
        assert_eq!(
            e.to_string(),
            "network slot 16384: outside subnet 10.88.0.0/16, which has 16384 slots \
             (0 to 16383)"
        );
        assert!(slot_addrs(DEFAULT_SUBNET, u32::MAX).is_err());
        assert!(LinkPlan::new(DEFAULT_SUBNET, 16_384).is_err());
    }

    #[test]
    fn small_and_large_subnets() {
        let one = net("192.168.7.8/30");
        assert_eq!(slot_count(one).unwrap(), 1);
        let s = slot_addrs(one, 0).unwrap();
        assert_eq!(
            (s.gateway, s.sandbox),
            (
                "192.168.7.9".parse().unwrap(),
                "192.168.7.10".parse().unwrap()
            )
        );
        assert!(slot_addrs(one, 1).is_err());
        for small in ["10.0.0.0/31", "10.0.0.1/32"] {
            let e = slot_addrs(net(small), 0).unwrap_err();
            assert!(matches!(e, SlotError::SubnetTooSmall { .. }), "{small}");
            assert!(e.to_string().contains(small), "{e}");
        }
        let all = net("0.0.0.0/0");
        assert_eq!(slot_count(all).unwrap(), 1 << 30);
        let top = slot_addrs(all, (1 << 30) - 1).unwrap();
        assert_eq!(top.network, net("255.255.255.252/30"));
        assert_eq!(top.sandbox, Ipv4Addr::new(255, 255, 255, 254));
        assert!(slot_addrs(all, 1 << 30).is_err());
    }

    #[test]
    fn every_slot_is_distinct_and_inside_the_subnet() {
        let subnet = net("172.20.0.0/22");
        let n = slot_count(subnet).unwrap();
        assert_eq!(n, 256);
        let mut seen = std::collections::BTreeSet::new();
        for slot in 0..n {
            let a = slot_addrs(subnet, slot).unwrap();
            assert!(subnet.contains(a.network.addr()) && subnet.contains(a.network.last()));
            assert!(a.network.contains(a.gateway) && a.network.contains(a.sandbox));
            assert_ne!(a.gateway, a.network.addr());
            assert_ne!(a.sandbox, a.network.last(), "broadcast");
            assert!(seen.insert(a.network));
            for x in [a.network.addr(), a.gateway, a.sandbox, a.network.last()] {
                assert_eq!(slot_of_addr(subnet, x), Some(slot));
            }
        }
        assert_eq!(slot_of_addr(subnet, "172.20.4.0".parse().unwrap()), None);
        assert_eq!(
            slot_of_addr(net("10.0.0.0/31"), "10.0.0.1".parse().unwrap()),
            None
        );
    }

    #[test]
    fn host_names_fit_ifnamsiz_and_read_back() {
        let name =
            |subnet: Ipv4Net, slot| host_veth_name(slot_addrs(subnet, slot).unwrap().network);
        assert_eq!(name(DEFAULT_SUBNET, 0), "odsv0a580000");
        assert_eq!(name(DEFAULT_SUBNET, 1), "odsv0a580004");
        assert_eq!(name(DEFAULT_SUBNET, 16_383), "odsv0a58fffc");
        let top = host_veth_name(net("255.255.255.252/30"));
        assert_eq!(top, "odsvfffffffc");
        assert!(valid_ifname(&top));
        for slot in [0, 1, 9, 10, 16_383] {
            let n = name(DEFAULT_SUBNET, slot);
            assert!(n.starts_with(&veth_prefix(DEFAULT_SUBNET)), "{n}");
            assert_eq!(slot_of_host_veth(DEFAULT_SUBNET, &n), Some(slot));
        }
        assert_eq!(veth_prefix(DEFAULT_SUBNET), "odsv0a58");
        assert_eq!(veth_prefix(net("10.89.0.0/16")), "odsv0a59");
        assert_eq!(veth_prefix(net("172.16.0.0/12")), "odsvac1");
        assert_eq!(veth_prefix(net("0.0.0.0/0")), "odsv");
        assert_eq!(veth_prefix(net("192.168.7.8/30")), "odsvc0a8070");
        for other in [
            "odsv",
            "odsv0a58000",
            "odsv0a5800040",
            "odsv0A580004",
            "odsv0a58000x",
            "odsv0a580005",
            "odsv0a590004",
            "odsv+a580004",
            "eth0",
            "xodsv0a580004",
        ] {
            assert_eq!(slot_of_host_veth(DEFAULT_SUBNET, other), None, "{other}");
        }
        assert!(valid_ifname("eth0"));
        for bad in ["", ".", "..", "a/b", "a b", "a:b", "sixteen-bytes-xx"] {
            assert!(!valid_ifname(bad), "{bad:?}");
        }
    }
}
