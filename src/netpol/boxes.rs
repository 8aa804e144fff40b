//! A policy's addresses and port limits as set elements (docs/network.md "Enforcement"). The
//! kernel keeps a set of address · protocol · port intervals (a concatenation with ranges) in
//! its `pipapo` backend, which refuses an element that overlaps one it holds. So the rules
//! become boxes of that three-dimensional space, and boxes that overlap go to different sets
//! ("layers"): a packet is allowed when any layer holds it, which is what the policy says, and
//! a typical policy needs one layer. Boxes of one network and protocol are merged into the
//! union of their port ranges first, so only nested networks with overlapping ports need
//! more layers.
//!
//! A box without a port limit spans every protocol and port: the kernel reads the two bytes
//! where a port would be for any protocol (for ICMP, the type and code or the checksum), so
//! such a box matches whatever the packet carries. A packet too short to have those bytes
//! matches no box.

use super::nfmsg::Elem;
use super::policy::NetRule;
use super::{PortLimit, Proto};

/// The key of a box's corner as the sets hold it: address (4 bytes), protocol (1, padded to
/// 4), port (2, big-endian, padded to 4).
pub const KEY_LEN: u32 = 12;
/// The lengths of the concatenated fields.
pub const FIELDS: [u32; 3] = [4, 1, 2];

/// Closed intervals of destination (or, for replies, source) address, IP protocol and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Box3 {
    pub addr: (u32, u32),
    pub proto: (u8, u8),
    pub port: (u16, u16),
}

fn overlap<T: Ord>(a: &(T, T), b: &(T, T)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

fn within<T: Ord>(inner: &(T, T), outer: &(T, T)) -> bool {
    outer.0 <= inner.0 && inner.1 <= outer.1
}

impl Box3 {
    fn intersects(&self, o: &Box3) -> bool {
        overlap(&self.addr, &o.addr)
            && overlap(&self.proto, &o.proto)
            && overlap(&self.port, &o.port)
    }

    fn contains(&self, o: &Box3) -> bool {
        within(&o.addr, &self.addr) && within(&o.proto, &self.proto) && within(&o.port, &self.port)
    }

    /// Whether a packet to `addr` of protocol `proto` whose port bytes read `port` is in it.
    #[cfg(test)]
    pub fn holds(&self, addr: u32, proto: u8, port: u16) -> bool {
        within(&(addr, addr), &self.addr)
            && within(&(proto, proto), &self.proto)
            && within(&(port, port), &self.port)
    }

    /// The set element: the box's low corner as key, its high corner as end key.
    pub fn elem(&self) -> Elem {
        Elem {
            key: key(self.addr.0, self.proto.0, self.port.0),
            key_end: Some(key(self.addr.1, self.proto.1, self.port.1)),
            ..Elem::default()
        }
    }
}

fn key(addr: u32, proto: u8, port: u16) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_LEN as usize);
    k.extend_from_slice(&addr.to_be_bytes());
    k.extend_from_slice(&[proto, 0, 0, 0]);
    k.extend_from_slice(&port.to_be_bytes());
    k.extend_from_slice(&[0, 0]);
    k
}

const ALL_PROTOS: (u8, u8) = (0, u8::MAX);
const ALL_PORTS: (u16, u16) = (0, u16::MAX);

fn proto_num(p: Proto) -> u8 {
    match p {
        Proto::Tcp => libc::IPPROTO_TCP as u8,
        Proto::Udp => libc::IPPROTO_UDP as u8,
    }
}

/// The protocol and port intervals a limit allows: one, or two for a port limit without
/// `/tcp` or `/udp`.
pub fn limit_parts(limit: PortLimit) -> Vec<((u8, u8), (u16, u16))> {
    match limit {
        PortLimit::Any => vec![(ALL_PROTOS, ALL_PORTS)],
        PortLimit::Ports(r, Some(p)) => vec![((proto_num(p), proto_num(p)), (r.lo(), r.hi()))],
        PortLimit::Ports(r, None) => [Proto::Tcp, Proto::Udp]
            .into_iter()
            .map(|p| ((proto_num(p), proto_num(p)), (r.lo(), r.hi())))
            .collect(),
    }
}

/// The policy's networks as layers of boxes, no two boxes of a layer overlapping. Boxes
/// inside another one are left out. Never empty: a policy without networks has one empty
/// layer.
pub fn layers(nets: &[NetRule]) -> Vec<Vec<Box3>> {
    let boxes: Vec<Box3> = nets
        .iter()
        .flat_map(|n| {
            let lo = u32::from(n.net.addr());
            let hi = u32::from(n.net.last());
            limit_parts(n.limit)
                .into_iter()
                .map(move |(proto, port)| Box3 {
                    addr: (lo, hi),
                    proto,
                    port,
                })
        })
        .collect();
    let mut boxes = merge_ports(boxes);
    // Large first, so that what they contain is seen to be contained.
    boxes.sort_by_key(|b| {
        let span = |lo: u64, hi: u64| hi - lo + 1;
        std::cmp::Reverse(
            span(u64::from(b.addr.0), u64::from(b.addr.1))
                * span(u64::from(b.proto.0), u64::from(b.proto.1))
                * span(u64::from(b.port.0), u64::from(b.port.1)),
        )
    });
    let mut out: Vec<Vec<Box3>> = vec![Vec::new()];
    'next: for b in boxes {
        if out.iter().flatten().any(|p| p.contains(&b)) {
            continue;
        }
        for layer in out.iter_mut() {
            if !layer.iter().any(|p| p.intersects(&b)) {
                layer.push(b);
                continue 'next;
            }
        }
        out.push(vec![b]);
    }
    out
}

/// `boxes` with those of one address interval and protocol interval merged where their port
/// ranges overlap or touch: rules naming one network with overlapping ports (`192.0.2.10:1-100`,
/// `192.0.2.10:50-200`) are one box, not a layer each.
fn merge_ports(mut boxes: Vec<Box3>) -> Vec<Box3> {
    // Same address and protocols next to each other, ports by their start.
    boxes.sort_unstable();
    let mut out: Vec<Box3> = Vec::with_capacity(boxes.len());
    for b in boxes {
        match out.last_mut() {
            Some(l)
                if l.addr == b.addr
                    && l.proto == b.proto
                    && u32::from(b.port.0) <= u32::from(l.port.1) + 1 =>
            {
                l.port.1 = l.port.1.max(b.port.1);
            }
            _ => out.push(b),
        }
    }
    out
}

/// The boxes of `*` under `limits` (every address; private ones are dropped before this is
/// looked at), none overlapping: one box when a limit is `Any`, else per protocol the union
/// of the port ranges.
pub fn any_public(limits: &[PortLimit]) -> Vec<Box3> {
    let all = |proto, port| Box3 {
        addr: (0, u32::MAX),
        proto,
        port,
    };
    if limits.contains(&PortLimit::Any) {
        return vec![all(ALL_PROTOS, ALL_PORTS)];
    }
    let mut out = Vec::new();
    for p in [Proto::Tcp, Proto::Udp] {
        let n = proto_num(p);
        let mut ranges: Vec<(u16, u16)> = limits
            .iter()
            .flat_map(|l| limit_parts(*l))
            .filter(|(proto, _)| *proto == (n, n))
            .map(|(_, port)| port)
            .collect();
        ranges.sort_unstable();
        let mut merged: Vec<(u16, u16)> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                Some(last) if u32::from(r.0) <= u32::from(last.1) + 1 => last.1 = last.1.max(r.1),
                _ => merged.push(r),
            }
        }
        out.extend(merged.into_iter().map(|port| all((n, n), port)));
    }
    out
}

/// The elements of a set of single-field IPv4 intervals holding `nets`, as the kernel's
/// interval tree wants them: the first address of each interval, then the first address past
/// it marked as an end (none past the last address); overlapping and adjacent networks merged
/// first, and an end at 0.0.0.0 first when the first interval starts later (what `nft` sends).
pub fn ipv4_intervals(nets: &[super::Ipv4Net]) -> Vec<Elem> {
    let mut iv: Vec<(u32, u32)> = nets
        .iter()
        .map(|n| (u32::from(n.addr()), u32::from(n.last())))
        .collect();
    iv.sort_unstable();
    let mut merged: Vec<(u32, u32)> = Vec::new();
    for (lo, hi) in iv {
        match merged.last_mut() {
            Some(last) if u64::from(lo) <= u64::from(last.1) + 1 => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    let at = |a: u32, end: bool| Elem {
        key: a.to_be_bytes().to_vec(),
        interval_end: end,
        ..Elem::default()
    };
    let mut out = Vec::new();
    if merged.first().is_some_and(|(lo, _)| *lo != 0) {
        out.push(at(0, true));
    }
    for (lo, hi) in merged {
        out.push(at(lo, false));
        if let Some(past) = hi.checked_add(1) {
            out.push(at(past, true));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netpol::{is_public, ClusterRules, Policy};
    use std::net::Ipv4Addr;

    fn policy(rules: &[&str]) -> Policy {
        let rules: Vec<(String, bool)> = rules.iter().map(|r| (r.to_string(), true)).collect();
        ClusterRules::default().resolve(rules).unwrap()
    }

    /// What the chain decides from the boxes: a layer, else a private drop, else `*`.
    fn decided(p: &Policy, addr: Ipv4Addr, proto: u8, port: u16) -> bool {
        let a = u32::from(addr);
        if layers(p.nets())
            .iter()
            .flatten()
            .any(|b| b.holds(a, proto, port))
        {
            return true;
        }
        is_public(addr)
            && any_public(p.any_public())
                .iter()
                .any(|b| b.holds(a, proto, port))
    }

    fn no_overlap(boxes: &[Box3]) {
        for (i, a) in boxes.iter().enumerate() {
            for b in &boxes[i + 1..] {
                assert!(!a.intersects(b), "{a:?} overlaps {b:?}");
            }
        }
    }

    #[test]
    fn boxes_decide_as_the_policy_does() {
        let cases: &[&[&str]] = &[
            &[
                "192.0.2.0/24:80",
                "192.0.2.7",
                "10.0.0.0/8:443/tcp",
                "10.1.0.0/16:400-500",
            ],
            &[
                "*:443",
                "*:80/tcp",
                "*:8000-8080/udp",
                "198.51.100.0/24:53/udp",
            ],
            &["*", "10.2.3.4:22"],
            &[
                "203.0.113.0/24:1-100",
                "203.0.113.128/25:50-200",
                "203.0.113.200:150-300/tcp",
            ],
            &[],
        ];
        let addrs = [
            "192.0.2.7",
            "192.0.2.8",
            "10.1.2.3",
            "10.2.3.4",
            "10.3.0.1",
            "198.51.100.9",
            "203.0.113.5",
            "203.0.113.200",
            "203.0.113.129",
            "8.8.8.8",
            "172.16.0.1",
        ];
        let ports = [0u16, 1, 22, 53, 80, 150, 250, 443, 450, 8000, 8080, 65535];
        for rules in cases {
            let p = policy(rules);
            for layer in layers(p.nets()) {
                no_overlap(&layer);
            }
            no_overlap(&any_public(p.any_public()));
            for a in addrs {
                let addr: Ipv4Addr = a.parse().unwrap();
                for port in ports {
                    for (proto, l4) in [
                        (6u8, Some((Proto::Tcp, port))),
                        (17, Some((Proto::Udp, port))),
                        (1, None),
                    ] {
                        assert_eq!(
                            decided(&p, addr, proto, port),
                            p.allows(addr, l4),
                            "{rules:?}: {a} proto {proto} port {port}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn overlapping_networks_with_different_ports_take_more_layers_and_contained_ones_none() {
        let p = policy(&[
            "10.0.0.0/8:443",
            "10.1.0.0/16:400-500",
            "10.1.2.0/24:443/tcp",
        ]);
        let l = layers(p.nets());
        // 10.1.0.0/16:400-500 overlaps the /8's 443 (both tcp and udp); the /24 is inside.
        assert_eq!(l.len(), 2);
        assert_eq!(l.iter().map(Vec::len).sum::<usize>(), 4);
        assert_eq!(layers(&[]), vec![Vec::<Box3>::new()]);
    }

    #[test]
    fn overlapping_ports_of_one_network_are_one_box_not_a_layer_each() {
        let rules: Vec<String> = (1000..2024)
            .map(|i| format!("192.0.2.10:{i}-{}", i + 2000))
            .collect();
        let refs: Vec<&str> = rules.iter().map(String::as_str).collect();
        let p = policy(&refs);
        let l = layers(p.nets());
        assert_eq!(l.len(), 1);
        assert_eq!(
            l[0].iter().map(|b| (b.proto.0, b.port)).collect::<Vec<_>>(),
            vec![(6, (1000, 4023)), (17, (1000, 4023))]
        );
        // Touching ranges merge too; a gap keeps two boxes.
        let p = policy(&[
            "192.0.2.10:1-10/tcp",
            "192.0.2.10:11-20/tcp",
            "192.0.2.10:30/tcp",
        ]);
        assert_eq!(layers(p.nets())[0].len(), 2);
    }

    #[test]
    fn any_public_merges_ranges_per_protocol() {
        let p = policy(&["*:80", "*:81-90/tcp", "*:100/udp"]);
        let b = any_public(p.any_public());
        assert_eq!(
            b.iter().map(|b| (b.proto.0, b.port)).collect::<Vec<_>>(),
            vec![(6, (80, 90)), (17, (80, 80)), (17, (100, 100))]
        );
        assert_eq!(any_public(&[]), vec![]);
    }

    #[test]
    fn private_ranges_become_merged_intervals_with_their_ends() {
        let e = ipv4_intervals(&crate::netpol::PRIVATE_RANGES);
        let shown: Vec<(Ipv4Addr, bool)> = e
            .iter()
            .map(|e| {
                (
                    Ipv4Addr::from(<[u8; 4]>::try_from(e.key.as_slice()).unwrap()),
                    e.interval_end,
                )
            })
            .collect();
        let v4 = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        // 0.0.0.0/8 starts at 0: no leading end; 224/4 and 240/4 touch: one interval, open
        // at the top.
        assert_eq!(shown.first(), Some(&(v4("0.0.0.0"), false)));
        assert_eq!(shown.get(1), Some(&(v4("1.0.0.0"), true)));
        assert_eq!(shown.last(), Some(&(v4("224.0.0.0"), false)));
        assert_eq!(shown.len(), 2 * 10 - 1);
        let one = ipv4_intervals(&["192.0.2.0/24".parse().unwrap()]);
        assert_eq!(one.len(), 3);
        assert!(one[0].interval_end && !one[1].interval_end && one[2].interval_end);
    }

    #[test]
    fn an_element_is_the_low_and_high_corner() {
        let b = Box3 {
            addr: (0xc000_0200, 0xc000_02ff),
            proto: (6, 6),
            port: (80, 90),
        };
        let e = b.elem();
        assert_eq!(e.key, vec![192, 0, 2, 0, 6, 0, 0, 0, 0, 80, 0, 0]);
        assert_eq!(
            e.key_end,
            Some(vec![192, 0, 2, 255, 6, 0, 0, 0, 0, 90, 0, 0])
        );
    }
}
