//! Network policy rules (docs/network.md): parsing the rules callers and administrators write,
//! and resolving a sandbox's effective policy from the config's rule sets and default rules
//! and the sandbox's own `network_rules`. Pure data, no I/O: the edge's nftables chains, its
//! DNS proxy and admission all read the [`Policy`] computed here.
//!
//! - [`rule`]: one rule string → [`Rule`] (target + [`PortLimit`]), canonical `Display`.
//! - [`policy`]: [`ClusterRules`] (the config's `network.rule_sets` and `default_rules`,
//!   checked once) and [`Policy`] (what one sandbox may reach).
//! - [`PRIVATE_RANGES`] and [`is_public`]: the addresses `*` and domains never reach.
//! - [`slot`]: the address plan: the edge's subnet cut into one /30 per sandbox slot, and the
//!   host-side veth names ([`LinkPlan`]).
//! - [`link`]: the topology (I/O, root): each sandbox's veth pair, /30 and default route over
//!   rtnetlink ([`attach`], [`detach`], [`list_strays`]).
//! - [`nft`]: enforcement (I/O, root): the edge's nftables table, each sandbox's chains
//!   and sets ([`Firewall`]); `boxes` turns a policy's rules into set elements, `nfmsg`
//!   writes the messages and `nlbatch` sends them over one netlink socket.
//! - [`network`]: an edge's networking as its backends use it: slots, attach, release,
//!   adoption and the cleanup of strays ([`network::Network`]).
//!
//! Every error of the rules is a [`NetpolError`]; all of them mean `invalid` to a caller.
//! The address plan's are [`SlotError`]s, the topology's [`LinkError`]s.

mod boxes;
pub mod dns;
mod dns_tcp;
pub mod link;
pub mod network;
mod nfmsg;
pub mod nft;
mod nlbatch;
pub mod policy;
pub mod rule;
pub mod slot;
pub mod vmns;

use std::net::Ipv4Addr;

pub use link::{attach, detach, list_strays, Attached, LinkError, SANDBOX_IFNAME};
pub use nft::{Firewall, NftError};
pub use nlbatch::BatchError;
pub use policy::{parse_rule_list, ClusterRules, DomainRule, NetRule, Policy};
pub use rule::{Domain, Ipv4Net, PortLimit, PortRange, Proto, Rule, RuleProblem, Target};
pub use slot::{
    host_veth_name, slot_addrs, slot_count, slot_of_addr, slot_of_host_veth, veth_prefix, LinkPlan,
    SlotAddrs, SlotError, DEFAULT_SUBNET, HOST_VETH_PREFIX,
};

use crate::types::names::shown;
use crate::types::Failure;

/// A rule, a rule set or a set of rules that cannot be used. Messages name the entry (quoted,
/// cut to 64 characters) and what is wrong, e.g.
/// `network rule "github.com:70000": port outside 1-65535`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetpolError {
    /// The rule does not parse.
    #[error("network rule {}: {problem}", shown(.entry))]
    Rule { entry: String, problem: RuleProblem },
    /// The rule names a rule set the config does not define.
    #[error(
        "network rule {}: no rule set named {} in network.rule_sets",
        shown(.entry),
        shown(.name)
    )]
    UnknownRuleSet { entry: String, name: String },
    /// Two spellings of one rule with different values (`github.com: true` and
    /// `*.github.com: false` in the same map).
    #[error(
        "network rules {} and {} are the same rule with different values",
        shown(.first),
        shown(.second)
    )]
    Conflict { first: String, second: String },
    /// A key of `network.rule_sets` that is not a rule set name.
    #[error(
        "network.rule_sets: {} is not a rule set name (1 to 63 characters of a-z, 0-9, '-' \
         and '_', starting with a letter or digit)",
        shown(.set)
    )]
    RuleSetName { set: String },
    /// An entry of a rule set that does not parse, or names a rule set or `*`.
    #[error("network.rule_sets {}: entry {}: {problem}", shown(.set), shown(.entry))]
    RuleSetEntry {
        set: String,
        entry: String,
        problem: RuleProblem,
    },
    /// A problem with `network.default_rules` (the inner error says which rule).
    #[error("network.default_rules: {0}")]
    DefaultRules(Box<NetpolError>),
}

impl NetpolError {
    /// The caller-facing failure: always `invalid`, with this message.
    pub fn to_failure(&self) -> Failure {
        Failure::invalid(self.to_string())
    }
}

/// The most rules one sandbox's `network_rules` may hold: checked by admission on creation
/// and by `UpdateNetwork` on the merged result, so that repeated merges cannot grow a
/// sandbox's chains without bound.
pub const MAX_NETWORK_RULES: usize = 1024;

const fn net(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Ipv4Net {
    Ipv4Net::new_unchecked(Ipv4Addr::new(a, b, c, d), prefix)
}

/// The private, link-local, multicast and reserved ranges (docs/network.md "Private
/// addresses"): `*` never reaches them, addresses a domain resolves to inside them are never
/// allowed, and only an address or network rule naming them opens them.
pub const PRIVATE_RANGES: [Ipv4Net; 11] = [
    net(0, 0, 0, 0, 8),
    net(10, 0, 0, 0, 8),
    net(100, 64, 0, 0, 10),
    net(127, 0, 0, 0, 8),
    net(169, 254, 0, 0, 16),
    net(172, 16, 0, 0, 12),
    net(192, 0, 0, 0, 24),
    net(192, 168, 0, 0, 16),
    net(198, 18, 0, 0, 15),
    net(224, 0, 0, 0, 4),
    net(240, 0, 0, 0, 4),
];

/// Whether `a` is outside every range of [`PRIVATE_RANGES`]: what `*` allows, and what a
/// resolved address must be to join a sandbox's allowed set.
pub fn is_public(a: Ipv4Addr) -> bool {
    !PRIVATE_RANGES.iter().any(|n| n.contains(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_ranges_are_valid_networks() {
        for n in PRIVATE_RANGES {
            assert_eq!(Ipv4Net::new(n.addr(), n.prefix()), Some(n), "{n}");
        }
    }

    #[test]
    fn is_public_on_the_boundaries_of_each_range() {
        for n in PRIVATE_RANGES {
            let first = u32::from(n.addr());
            let last = u32::from(n.last());
            assert!(!is_public(Ipv4Addr::from(first)), "{n} first");
            assert!(!is_public(Ipv4Addr::from(last)), "{n} last");
            // Just outside, unless a neighbouring range continues there.
            if let Some(before) = first.checked_sub(1) {
                let b = Ipv4Addr::from(before);
                let inside_other = PRIVATE_RANGES.iter().any(|m| m.contains(b));
                assert_eq!(is_public(b), !inside_other, "{n} before: {b}");
            }
            if let Some(after) = last.checked_add(1) {
                let a = Ipv4Addr::from(after);
                let inside_other = PRIVATE_RANGES.iter().any(|m| m.contains(a));
                assert_eq!(is_public(a), !inside_other, "{n} after: {a}");
            }
        }
        let public = [
            "1.0.0.0",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "191.255.255.255",
            "192.0.1.0",
            "192.0.2.1",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "198.51.100.7",
            "203.0.113.9",
            "223.255.255.255",
        ];
        for a in public {
            assert!(is_public(a.parse().unwrap()), "{a}");
        }
        let private = [
            "0.0.0.0",
            "0.255.255.255",
            "10.0.0.0",
            "10.255.255.255",
            "100.64.0.0",
            "100.127.255.255",
            "127.0.0.1",
            "169.254.169.254",
            "172.16.0.0",
            "172.31.255.255",
            "192.0.0.0",
            "192.0.0.255",
            "192.168.0.0",
            "192.168.255.255",
            "198.18.0.0",
            "198.19.255.255",
            "224.0.0.0",
            "239.255.255.255",
            "240.0.0.0",
            "255.255.255.255",
        ];
        for a in private {
            assert!(!is_public(a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn errors_become_invalid() {
        let e = Rule::parse("x.io:0").unwrap_err();
        let f = e.to_failure();
        assert_eq!(f.reason, crate::types::Reason::Invalid);
        assert_eq!(f.message, "network rule \"x.io:0\": port outside 1-65535");
    }
}
