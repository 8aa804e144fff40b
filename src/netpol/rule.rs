//! One network rule, parsed (docs/network.md "Rules"): a rule set name, a domain, an IPv4
//! address or network, or `*`, optionally limited to `:port` or `:lo-hi` and then `/tcp` or
//! `/udp`. Parsing is pure and total: any string either becomes a [`Rule`] in canonical form
//! or a [`NetpolError::Rule`] naming the entry and what is wrong with it.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use super::NetpolError;

/// Longest domain name (RFC 1035 §2.3.4), without the `*.` of a wildcard.
pub const MAX_DOMAIN: usize = 253;
/// Longest label of a domain, and longest rule set name.
pub const MAX_LABEL: usize = 63;

/// What is wrong with one rule; the `Display` text follows the entry in error messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleProblem {
    #[error("empty rule")]
    Empty,
    #[error("no destination before ':'")]
    NoDestination,
    #[error("not a rule set name, domain, IPv4 address or network")]
    Unrecognized,
    #[error("bad domain: {0}")]
    BadDomain(String),
    #[error("bad IPv4 address")]
    BadAddress,
    #[error("bad IPv4 network: {0}")]
    BadNetwork(String),
    #[error("IPv6 is not supported: sandboxes have IPv4 addresses only")]
    Ipv6,
    #[error("bad port: expected a number or a range lo-hi")]
    BadPort,
    #[error("port outside 1-65535")]
    PortOutOfRange,
    #[error("port range {lo}-{hi} runs backwards")]
    PortRangeBackwards { lo: u16, hi: u16 },
    #[error("protocol must be tcp or udp, not {0}")]
    BadProtocol(String),
    #[error("a protocol needs a port, as in :443/tcp")]
    ProtocolWithoutPort,
    /// Only for entries of `network.rule_sets`, which list destinations.
    #[error("a rule set entry is a domain, IPv4 address or network, not a rule set name or '*'")]
    NotADestination,
}

/// A transport protocol a port limit can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    /// `tcp` or `udp`.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An inclusive port range `lo..=hi` with `1 <= lo <= hi`; a single port has `lo == hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    lo: u16,
    hi: u16,
}

impl PortRange {
    /// The range `lo..=hi`; `None` when `lo` is 0 or `lo > hi`.
    pub fn new(lo: u16, hi: u16) -> Option<PortRange> {
        (lo >= 1 && lo <= hi).then_some(PortRange { lo, hi })
    }
    /// One port; `None` for 0.
    pub fn single(port: u16) -> Option<PortRange> {
        PortRange::new(port, port)
    }
    pub fn lo(self) -> u16 {
        self.lo
    }
    pub fn hi(self) -> u16 {
        self.hi
    }
    pub fn contains(self, port: u16) -> bool {
        self.lo <= port && port <= self.hi
    }
    /// The ports in both ranges, if any.
    pub fn intersect(self, other: PortRange) -> Option<PortRange> {
        PortRange::new(self.lo.max(other.lo), self.hi.min(other.hi))
    }
}

impl fmt::Display for PortRange {
    /// `443` or `8000-8080`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lo == self.hi {
            write!(f, "{}", self.lo)
        } else {
            write!(f, "{}-{}", self.lo, self.hi)
        }
    }
}

/// Which traffic to a destination a rule allows: all of it (no `:port`, ICMP included), or
/// TCP and UDP (or one of them) to a port range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PortLimit {
    /// No port limit: every protocol and port.
    Any,
    /// `:ports` (TCP or UDP) or `:ports/proto`.
    Ports(PortRange, Option<Proto>),
}

impl PortLimit {
    /// Whether a packet matches. `l4` is the packet's protocol and destination port, `None`
    /// for traffic that is neither TCP nor UDP (ICMP), which only [`PortLimit::Any`] matches.
    pub fn matches(self, l4: Option<(Proto, u16)>) -> bool {
        match (self, l4) {
            (PortLimit::Any, _) => true,
            (PortLimit::Ports(..), None) => false,
            (PortLimit::Ports(range, proto), Some((p, port))) => {
                range.contains(port) && proto.is_none_or(|want| want == p)
            }
        }
    }

    /// The traffic both limits allow, if any: a rule set entry's own limit narrowed by the
    /// limit written on the rule that names the set (`mirror:443` with entry
    /// `10.30.0.10:400-500/tcp` gives `443/tcp`).
    pub fn intersect(self, other: PortLimit) -> Option<PortLimit> {
        match (self, other) {
            (PortLimit::Any, x) | (x, PortLimit::Any) => Some(x),
            (PortLimit::Ports(a, pa), PortLimit::Ports(b, pb)) => {
                let range = a.intersect(b)?;
                let proto = match (pa, pb) {
                    (None, p) | (p, None) => p,
                    (Some(x), Some(y)) if x == y => Some(x),
                    _ => return None,
                };
                Some(PortLimit::Ports(range, proto))
            }
        }
    }

    /// Whether every packet `other` allows, `self` allows too.
    pub fn covers(self, other: PortLimit) -> bool {
        match (self, other) {
            (PortLimit::Any, _) => true,
            (PortLimit::Ports(..), PortLimit::Any) => false,
            (PortLimit::Ports(a, pa), PortLimit::Ports(b, pb)) => {
                a.lo <= b.lo && b.hi <= a.hi && (pa.is_none() || pa == pb)
            }
        }
    }
}

impl fmt::Display for PortLimit {
    /// The rule suffix: empty, `:443`, `:8000-8080/tcp`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortLimit::Any => Ok(()),
            PortLimit::Ports(r, None) => write!(f, ":{r}"),
            PortLimit::Ports(r, Some(p)) => write!(f, ":{r}/{p}"),
        }
    }
}

/// An IPv4 network: an address with its host bits zero and a prefix length 0 to 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Net {
    /// For constants whose host bits are known to be zero.
    pub(crate) const fn new_unchecked(addr: Ipv4Addr, prefix: u8) -> Ipv4Net {
        Ipv4Net { addr, prefix }
    }
    /// The network `addr/prefix`; `None` when `prefix > 32` or `addr` has host bits set.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Option<Ipv4Net> {
        (prefix <= 32 && u32::from(addr) & !mask(prefix) == 0).then_some(Ipv4Net { addr, prefix })
    }
    /// The /32 of one address.
    pub fn host(addr: Ipv4Addr) -> Ipv4Net {
        Ipv4Net { addr, prefix: 32 }
    }
    /// The network address (host bits zero).
    pub fn addr(self) -> Ipv4Addr {
        self.addr
    }
    pub fn prefix(self) -> u8 {
        self.prefix
    }
    /// The netmask, e.g. 255.255.0.0 for a /16.
    pub fn netmask(self) -> Ipv4Addr {
        Ipv4Addr::from(mask(self.prefix))
    }
    /// The last address of the network.
    pub fn last(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) | !mask(self.prefix))
    }
    pub fn contains(self, a: Ipv4Addr) -> bool {
        u32::from(a) & mask(self.prefix) == u32::from(self.addr)
    }
    /// Whether the two networks share an address.
    pub fn overlaps(self, other: Ipv4Net) -> bool {
        self.contains(other.addr) || other.contains(self.addr)
    }
}

const fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else if prefix >= 32 {
        u32::MAX
    } else {
        u32::MAX << (32 - prefix)
    }
}

impl FromStr for Ipv4Net {
    type Err = RuleProblem;
    /// `a.b.c.d/n` with zero host bits, or a bare address (a /32).
    fn from_str(s: &str) -> Result<Ipv4Net, RuleProblem> {
        let target = match s.split_once('/') {
            Some((addr, prefix)) => parse_net(addr, prefix)?,
            None => Target::Addr(Ipv4Addr::from_str(s).map_err(|_| RuleProblem::BadAddress)?),
        };
        match target {
            Target::Net(n) => Ok(n),
            Target::Addr(a) => Ok(Ipv4Net::host(a)),
            _ => Err(RuleProblem::BadAddress),
        }
    }
}

impl fmt::Display for Ipv4Net {
    /// Always `a.b.c.d/n`, `/32` included.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A domain name, lower case, that a rule allows together with all its subdomains. Labels
/// are RFC 1123 host name labels (`a-z`, `0-9`, `-` inside), 1 to 63 characters; the
/// whole name at most 253; the last label not all digits (so `1.2.3` is never a domain).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Domain(String);

impl Domain {
    /// Checks and lower-cases a domain written without `*.` and without a trailing dot.
    /// Errors: [`RuleProblem::BadDomain`] saying what is wrong.
    pub fn parse(s: &str) -> Result<Domain, RuleProblem> {
        let bad = |m: String| Err(RuleProblem::BadDomain(m));
        let name = s.to_ascii_lowercase();
        if name.is_empty() {
            return bad("empty".into());
        }
        if name.len() > MAX_DOMAIN {
            return bad(format!("longer than {MAX_DOMAIN} characters"));
        }
        let mut last = "";
        for label in name.split('.') {
            if label.is_empty() {
                return bad("empty label".into());
            }
            if label.len() > MAX_LABEL {
                return bad(format!("label longer than {MAX_LABEL} characters"));
            }
            if label.contains('*') {
                return bad("'*' only as a whole first label, as in *.example.com".into());
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return bad(format!(
                    "label {} holds a character other than a-z, 0-9 and '-'",
                    crate::types::names::shown(label)
                ));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return bad(format!(
                    "label {} starts or ends with '-'",
                    crate::types::names::shown(label)
                ));
            }
            last = label;
        }
        if last.bytes().all(|b| b.is_ascii_digit()) {
            return bad("the last label is all digits".into());
        }
        Ok(Domain(name))
    }

    /// The name, e.g. `github.com`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `name` (lower case, no trailing dot) is this domain or one of its subdomains.
    /// `api.github.com` is under `github.com`; `notgithub.com` and `com` are not.
    pub fn covers(&self, name: &str) -> bool {
        match name.strip_suffix(self.0.as_str()) {
            Some("") => true,
            Some(rest) => rest.len() > 1 && rest.ends_with('.'),
            None => false,
        }
    }
}

impl fmt::Display for Domain {
    /// The name; a one-label domain (only writable as `*.internal`) keeps its `*.`, so that
    /// the text parses back as a domain and not as a rule set name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.contains('.') {
            f.write_str(&self.0)
        } else {
            write!(f, "*.{}", self.0)
        }
    }
}

/// What a rule names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// A rule set of the config's `network.rule_sets` (a word without dots: `pypi`).
    RuleSet(String),
    /// A domain and its subdomains (`github.com`, or `*.github.com`, which means the same).
    Domain(Domain),
    /// One IPv4 address (`1.2.3.4`, or `1.2.3.4/32`, which means the same).
    Addr(Ipv4Addr),
    /// An IPv4 network (`10.20.0.0/16`), prefix 0 to 31.
    Net(Ipv4Net),
    /// `*`: every public address (not in [`super::PRIVATE_RANGES`]).
    AnyPublic,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::RuleSet(n) => f.write_str(n),
            Target::Domain(d) => d.fmt(f),
            Target::Addr(a) => a.fmt(f),
            Target::Net(n) => n.fmt(f),
            Target::AnyPublic => f.write_str("*"),
        }
    }
}

/// One parsed rule: a target and a port limit. Two spellings of the same meaning parse to
/// the same value (`*.GitHub.com` and `github.com`; `1.2.3.4/32` and `1.2.3.4`; `:443-443`
/// and `:443`), and `Display` writes the canonical spelling, which parses back to the same
/// value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub target: Target,
    pub limit: PortLimit,
}

impl Rule {
    /// Parses one rule, case-insensitively (docs/network.md "Rules"):
    /// `target[:port|:lo-hi[/tcp|/udp]]`, where target is a rule set name (a word of `a-z`,
    /// `0-9`, `-`, `_` without dots), a domain (`x.y`, `*.x`), an IPv4 address, a network
    /// `a.b.c.d/n` (host bits zero) or `*`.
    /// Errors: [`NetpolError::Rule`] with the entry and a [`RuleProblem`].
    pub fn parse(entry: &str) -> Result<Rule, NetpolError> {
        parse_rule(entry).map_err(|problem| NetpolError::Rule {
            entry: entry.to_string(),
            problem,
        })
    }
}

impl FromStr for Rule {
    type Err = NetpolError;
    fn from_str(s: &str) -> Result<Rule, NetpolError> {
        Rule::parse(s)
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.target, self.limit)
    }
}

/// Whether `s` is a valid rule set name: 1 to 63 characters of `a-z`, `0-9`, `-` and `_`,
/// starting with a letter or digit.
pub fn is_rule_set_name(s: &str) -> bool {
    s.len() <= MAX_LABEL
        && s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn parse_rule(entry: &str) -> Result<Rule, RuleProblem> {
    if entry.is_empty() {
        return Err(RuleProblem::Empty);
    }
    let s = entry.to_ascii_lowercase();
    if looks_ipv6(&s) {
        return Err(RuleProblem::Ipv6);
    }
    let (dest, limit) = match s.split_once(':') {
        Some((d, p)) => (d, parse_limit(p)?),
        None => (s.as_str(), PortLimit::Any),
    };
    if dest.is_empty() {
        return Err(RuleProblem::NoDestination);
    }
    Ok(Rule {
        target: parse_target(dest)?,
        limit,
    })
}

/// IPv6 in any of its spellings: `[::1]:53`, `2001:db8::1`, `2001:db8::/32`, `fe80::1%eth0`.
fn looks_ipv6(s: &str) -> bool {
    if s.starts_with('[') {
        return true;
    }
    // Without a prefix length or a zone (`fe80::1%eth0`).
    let addr = s.split(['/', '%']).next().unwrap_or(s);
    addr.matches(':').count() >= 2 && Ipv6Addr::from_str(addr).is_ok()
}

fn parse_target(d: &str) -> Result<Target, RuleProblem> {
    if d == "*" {
        return Ok(Target::AnyPublic);
    }
    if let Some((addr, after)) = d.split_once('/') {
        if after == "tcp" || after == "udp" {
            return Err(RuleProblem::ProtocolWithoutPort);
        }
        if after.bytes().any(|b| b.is_ascii_alphabetic()) {
            if addr.contains('.') || is_rule_set_name(addr) || addr == "*" {
                return Err(RuleProblem::BadProtocol(crate::types::names::shown(after)));
            }
            return Err(RuleProblem::Unrecognized);
        }
        return parse_net(addr, after);
    }
    if d.bytes().all(|b| b.is_ascii_digit() || b == b'.') && d.contains('.') {
        return Ipv4Addr::from_str(d)
            .map(Target::Addr)
            .map_err(|_| RuleProblem::BadAddress);
    }
    if let Some(rest) = d.strip_prefix("*.") {
        return Domain::parse(rest).map(Target::Domain);
    }
    if d.contains('.') {
        return Domain::parse(d).map(Target::Domain);
    }
    if is_rule_set_name(d) {
        return Ok(Target::RuleSet(d.to_string()));
    }
    Err(RuleProblem::Unrecognized)
}

fn parse_net(addr: &str, prefix: &str) -> Result<Target, RuleProblem> {
    let bad = |m: String| Err(RuleProblem::BadNetwork(m));
    let Ok(ip) = Ipv4Addr::from_str(addr) else {
        return bad(format!(
            "{} is not an IPv4 address",
            crate::types::names::shown(addr)
        ));
    };
    if prefix.is_empty() || prefix.len() > 2 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return bad("the prefix length must be a number from 0 to 32".into());
    }
    let bits: u8 = prefix
        .parse()
        .map_err(|_| RuleProblem::BadNetwork("the prefix length must be 0 to 32".into()))?;
    if bits > 32 {
        return bad("the prefix length must be a number from 0 to 32".into());
    }
    if bits == 32 {
        return Ok(Target::Addr(ip));
    }
    match Ipv4Net::new(ip, bits) {
        Some(n) => Ok(Target::Net(n)),
        None => {
            let net = Ipv4Addr::from(u32::from(ip) & mask(bits));
            bad(format!("host bits set; the network is {net}/{bits}"))
        }
    }
}

fn parse_limit(p: &str) -> Result<PortLimit, RuleProblem> {
    let (range, proto) = match p.split_once('/') {
        Some((r, proto)) => (r, Some(proto)),
        None => (p, None),
    };
    let proto = match proto {
        None => None,
        Some("tcp") => Some(Proto::Tcp),
        Some("udp") => Some(Proto::Udp),
        Some(other) => return Err(RuleProblem::BadProtocol(crate::types::names::shown(other))),
    };
    let range = match range.split_once('-') {
        Some((lo, hi)) => {
            let (lo, hi) = (port(lo)?, port(hi)?);
            PortRange::new(lo, hi).ok_or(RuleProblem::PortRangeBackwards { lo, hi })?
        }
        None => {
            let p = port(range)?;
            PortRange::single(p).ok_or(RuleProblem::PortOutOfRange)?
        }
    };
    Ok(PortLimit::Ports(range, proto))
}

/// A port number 1 to 65535, digits only (no sign, no spaces; leading zeros allowed).
fn port(s: &str) -> Result<u16, RuleProblem> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RuleProblem::BadPort);
    }
    let digits = s.trim_start_matches('0');
    if digits.is_empty() || digits.len() > 5 {
        return Err(RuleProblem::PortOutOfRange);
    }
    match digits.parse::<u32>() {
        Ok(n @ 1..=65535) => u16::try_from(n).map_err(|_| RuleProblem::PortOutOfRange),
        _ => Err(RuleProblem::PortOutOfRange),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> Rule {
        Rule::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }
    fn err(s: &str) -> String {
        Rule::parse(s).unwrap_err().to_string()
    }
    fn ports(lo: u16, hi: u16, p: Option<Proto>) -> PortLimit {
        PortLimit::Ports(PortRange::new(lo, hi).unwrap(), p)
    }
    fn dom(s: &str) -> Target {
        Target::Domain(Domain::parse(s).unwrap())
    }

    #[test]
    fn every_rule_kind_parses() {
        let any = PortLimit::Any;
        let cases: Vec<(&str, Target, PortLimit, &str)> = vec![
            ("pypi", Target::RuleSet("pypi".into()), any, "pypi"),
            (
                "my_mirror-2",
                Target::RuleSet("my_mirror-2".into()),
                any,
                "my_mirror-2",
            ),
            ("github.com", dom("github.com"), any, "github.com"),
            ("*.github.com", dom("github.com"), any, "github.com"),
            ("GitHub.COM", dom("github.com"), any, "github.com"),
            (
                "xn--bcher-kva.example",
                dom("xn--bcher-kva.example"),
                any,
                "xn--bcher-kva.example",
            ),
            ("*.internal", dom("internal"), any, "*.internal"),
            (
                "1.2.3.4",
                Target::Addr(Ipv4Addr::new(1, 2, 3, 4)),
                any,
                "1.2.3.4",
            ),
            (
                "1.2.3.4/32",
                Target::Addr(Ipv4Addr::new(1, 2, 3, 4)),
                any,
                "1.2.3.4",
            ),
            (
                "203.0.113.0/24",
                Target::Net(Ipv4Net::new(Ipv4Addr::new(203, 0, 113, 0), 24).unwrap()),
                any,
                "203.0.113.0/24",
            ),
            (
                "0.0.0.0/0",
                Target::Net(Ipv4Net::new(Ipv4Addr::UNSPECIFIED, 0).unwrap()),
                any,
                "0.0.0.0/0",
            ),
            ("*", Target::AnyPublic, any, "*"),
            (
                "pypi.org:443",
                dom("pypi.org"),
                ports(443, 443, None),
                "pypi.org:443",
            ),
            (
                "10.0.0.0/8:5432/tcp",
                Target::Net(Ipv4Net::new(Ipv4Addr::new(10, 0, 0, 0), 8).unwrap()),
                ports(5432, 5432, Some(Proto::Tcp)),
                "10.0.0.0/8:5432/tcp",
            ),
            ("*:443", Target::AnyPublic, ports(443, 443, None), "*:443"),
            (
                "example.com:8000-8080",
                dom("example.com"),
                ports(8000, 8080, None),
                "example.com:8000-8080",
            ),
            (
                "1.1.1.1:53/UDP",
                Target::Addr(Ipv4Addr::new(1, 1, 1, 1)),
                ports(53, 53, Some(Proto::Udp)),
                "1.1.1.1:53/udp",
            ),
            (
                "pypi:443-443",
                Target::RuleSet("pypi".into()),
                ports(443, 443, None),
                "pypi:443",
            ),
            (
                "x.io:1-65535/tcp",
                dom("x.io"),
                ports(1, 65535, Some(Proto::Tcp)),
                "x.io:1-65535/tcp",
            ),
            ("x.io:0443", dom("x.io"), ports(443, 443, None), "x.io:443"),
        ];
        for (text, target, limit, canon) in cases {
            let r = ok(text);
            assert_eq!(r.target, target, "{text}");
            assert_eq!(r.limit, limit, "{text}");
            assert_eq!(r.to_string(), canon, "{text}");
            assert_eq!(ok(canon), r, "{text}");
        }
    }

    #[test]
    fn every_error_names_the_entry_and_the_problem() {
        let long_label = format!("{}.com", "a".repeat(64));
        let long_name = format!("{}.com", vec!["a".repeat(60); 5].join("."));
        let cases: Vec<(&str, &str)> = vec![
            ("", "network rule \"\": empty rule"),
            (":443", "network rule \":443\": no destination before ':'"),
            ("github.com:70000", "network rule \"github.com:70000\": port outside 1-65535"),
            ("github.com:0", "network rule \"github.com:0\": port outside 1-65535"),
            ("github.com:000", "network rule \"github.com:000\": port outside 1-65535"),
            ("x.io:99999999999999999999", "network rule \"x.io:99999999999999999999\": port outside 1-65535"),
            ("x.io:0-80", "network rule \"x.io:0-80\": port outside 1-65535"),
            ("x.io:", "network rule \"x.io:\": bad port: expected a number or a range lo-hi"),
            ("x.io:+443", "network rule \"x.io:+443\": bad port: expected a number or a range lo-hi"),
            ("x.io:https", "network rule \"x.io:https\": bad port: expected a number or a range lo-hi"),
            ("x.io:80-", "network rule \"x.io:80-\": bad port: expected a number or a range lo-hi"),
            ("x.io:-80", "network rule \"x.io:-80\": bad port: expected a number or a range lo-hi"),
            ("x.io:1-2-3", "network rule \"x.io:1-2-3\": bad port: expected a number or a range lo-hi"),
            ("x.io:443:80", "network rule \"x.io:443:80\": bad port: expected a number or a range lo-hi"),
            ("x.io:8080-8000", "network rule \"x.io:8080-8000\": port range 8080-8000 runs backwards"),
            ("x.io:53/icmp", "network rule \"x.io:53/icmp\": protocol must be tcp or udp, not \"icmp\""),
            ("x.io:53/", "network rule \"x.io:53/\": protocol must be tcp or udp, not \"\""),
            ("x.io/tcp", "network rule \"x.io/tcp\": a protocol needs a port, as in :443/tcp"),
            ("*/udp", "network rule \"*/udp\": a protocol needs a port, as in :443/tcp"),
            ("x.io/sctp", "network rule \"x.io/sctp\": protocol must be tcp or udp, not \"sctp\""),
            ("1.2.3.4.5", "network rule \"1.2.3.4.5\": bad IPv4 address"),
            ("256.1.1.1", "network rule \"256.1.1.1\": bad IPv4 address"),
            ("010.0.0.1", "network rule \"010.0.0.1\": bad IPv4 address"),
            ("1.2.3", "network rule \"1.2.3\": bad IPv4 address"),
            ("10.0.0.1/8", "network rule \"10.0.0.1/8\": bad IPv4 network: host bits set; the network is 10.0.0.0/8"),
            ("10.0.0.0/33", "network rule \"10.0.0.0/33\": bad IPv4 network: the prefix length must be a number from 0 to 32"),
            ("10.0.0.0/", "network rule \"10.0.0.0/\": bad IPv4 network: the prefix length must be a number from 0 to 32"),
            ("10.0.0.0/+8", "network rule \"10.0.0.0/+8\": bad IPv4 network: the prefix length must be a number from 0 to 32"),
            ("10.0.0.0/8/16", "network rule \"10.0.0.0/8/16\": bad IPv4 network: the prefix length must be a number from 0 to 32"),
            ("github.com/24", "network rule \"github.com/24\": bad IPv4 network: \"github.com\" is not an IPv4 address"),
            ("::1", "network rule \"::1\": IPv6 is not supported: sandboxes have IPv4 addresses only"),
            ("2001:db8::/32", "network rule \"2001:db8::/32\": IPv6 is not supported: sandboxes have IPv4 addresses only"),
            ("[2001:db8::1]:443", "network rule \"[2001:db8::1]:443\": IPv6 is not supported: sandboxes have IPv4 addresses only"),
            ("fe80::1%eth0", "network rule \"fe80::1%eth0\": IPv6 is not supported: sandboxes have IPv4 addresses only"),
            ("::ffff:1.2.3.4", "network rule \"::ffff:1.2.3.4\": IPv6 is not supported: sandboxes have IPv4 addresses only"),
            ("github.com.", "network rule \"github.com.\": bad domain: empty label"),
            ("a..b", "network rule \"a..b\": bad domain: empty label"),
            (".github.com", "network rule \".github.com\": bad domain: empty label"),
            ("*.", "network rule \"*.\": bad domain: empty"),
            ("*.*.x.io", "network rule \"*.*.x.io\": bad domain: '*' only as a whole first label, as in *.example.com"),
            ("a.*.io", "network rule \"a.*.io\": bad domain: '*' only as a whole first label, as in *.example.com"),
            ("*x.io", "network rule \"*x.io\": bad domain: '*' only as a whole first label, as in *.example.com"),
            ("under_score.io", "network rule \"under_score.io\": bad domain: label \"under_score\" holds a character other than a-z, 0-9 and '-'"),
            ("b\u{fc}cher.de", "network rule \"b\u{fc}cher.de\": bad domain: label \"b\u{fc}cher\" holds a character other than a-z, 0-9 and '-'"),
            ("-x.io", "network rule \"-x.io\": bad domain: label \"-x\" starts or ends with '-'"),
            ("x-.io", "network rule \"x-.io\": bad domain: label \"x-\" starts or ends with '-'"),
            ("x.123", "network rule \"x.123\": bad domain: the last label is all digits"),
            ("*.123", "network rule \"*.123\": bad domain: the last label is all digits"),
            ("py$pi", "network rule \"py$pi\": not a rule set name, domain, IPv4 address or network"),
            ("-pypi", "network rule \"-pypi\": not a rule set name, domain, IPv4 address or network"),
            (" pypi", "network rule \" pypi\": not a rule set name, domain, IPv4 address or network"),
            ("**", "network rule \"**\": not a rule set name, domain, IPv4 address or network"),
        ];
        for (text, want) in cases {
            assert_eq!(err(text), want, "{text:?}");
        }
        assert_eq!(
            err(&long_label),
            format!(
                "network rule {}: bad domain: label longer than 63 characters",
                crate::types::names::shown(&long_label)
            )
        );
        assert!(long_name.len() > MAX_DOMAIN);
        assert!(err(&long_name).ends_with(": bad domain: longer than 253 characters"));
        // 253 exactly is fine, and so is its wildcard form of 255 characters.
        let max = format!(
            "{}.{}.com",
            vec!["a".repeat(63); 3].join("."),
            "b".repeat(57)
        );
        assert_eq!(max.len(), MAX_DOMAIN);
        ok(&max);
        ok(&format!("*.{max}:65535/udp"));
        // A huge entry is cut in the message.
        let huge = "x".repeat(100_000);
        assert!(err(&huge).len() < 200);
    }

    #[test]
    fn domains_cover_their_subdomains_only() {
        let d = Domain::parse("github.com").unwrap();
        assert!(d.covers("github.com"));
        assert!(d.covers("api.github.com"));
        assert!(d.covers("a.b.github.com"));
        assert!(!d.covers("notgithub.com"));
        assert!(!d.covers("com"));
        assert!(!d.covers("github.com.evil.io"));
        assert!(!d.covers(".github.com"));
        assert!(!d.covers(""));
    }

    #[test]
    fn port_limits_match_intersect_and_cover() {
        let p443 = ports(443, 443, None);
        let p443t = ports(443, 443, Some(Proto::Tcp));
        let range = ports(400, 500, Some(Proto::Udp));
        assert!(PortLimit::Any.matches(None));
        assert!(PortLimit::Any.matches(Some((Proto::Udp, 1))));
        assert!(!p443.matches(None));
        assert!(p443.matches(Some((Proto::Udp, 443))));
        assert!(p443.matches(Some((Proto::Tcp, 443))));
        assert!(!p443.matches(Some((Proto::Tcp, 444))));
        assert!(!p443t.matches(Some((Proto::Udp, 443))));
        assert!(range.matches(Some((Proto::Udp, 400))));
        assert!(range.matches(Some((Proto::Udp, 500))));
        assert!(!range.matches(Some((Proto::Udp, 501))));

        assert_eq!(PortLimit::Any.intersect(p443), Some(p443));
        assert_eq!(p443.intersect(PortLimit::Any), Some(p443));
        assert_eq!(p443.intersect(p443t), Some(p443t));
        assert_eq!(p443t.intersect(range), None);
        assert_eq!(
            ports(1, 1000, None).intersect(range),
            Some(ports(400, 500, Some(Proto::Udp)))
        );
        assert_eq!(p443.intersect(ports(80, 80, None)), None);

        assert!(PortLimit::Any.covers(p443));
        assert!(!p443.covers(PortLimit::Any));
        assert!(p443.covers(p443t));
        assert!(!p443t.covers(p443));
        assert!(ports(1, 1000, None).covers(range));
    }

    #[test]
    fn networks() {
        let n = Ipv4Net::new(Ipv4Addr::new(100, 64, 0, 0), 10).unwrap();
        assert_eq!(n.last(), Ipv4Addr::new(100, 127, 255, 255));
        assert_eq!(n.netmask(), Ipv4Addr::new(255, 192, 0, 0));
        assert!(n.contains(Ipv4Addr::new(100, 64, 0, 0)));
        assert!(n.contains(Ipv4Addr::new(100, 127, 255, 255)));
        assert!(!n.contains(Ipv4Addr::new(100, 128, 0, 0)));
        assert!(!n.contains(Ipv4Addr::new(100, 63, 255, 255)));
        assert!(Ipv4Net::new(Ipv4Addr::new(100, 65, 0, 0), 10).is_none());
        assert!(Ipv4Net::new(Ipv4Addr::new(0, 0, 0, 0), 33).is_none());
        let all = Ipv4Net::new(Ipv4Addr::UNSPECIFIED, 0).unwrap();
        assert!(all.contains(Ipv4Addr::BROADCAST));
        assert_eq!(all.last(), Ipv4Addr::BROADCAST);
        assert!(all.overlaps(n) && n.overlaps(all));
        let h = Ipv4Net::host(Ipv4Addr::new(1, 2, 3, 4));
        assert_eq!(h.to_string(), "1.2.3.4/32");
        assert!(h.contains(Ipv4Addr::new(1, 2, 3, 4)));
        assert!(!h.contains(Ipv4Addr::new(1, 2, 3, 5)));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// Accepted rules re-parse from their canonical text to the same value, and that
        /// text is a fixed point.
        fn round_trips(s: &str) -> Result<(), TestCaseError> {
            if let Ok(r) = Rule::parse(s) {
                let canon = r.to_string();
                let again = Rule::parse(&canon);
                prop_assert_eq!(again.as_ref(), Ok(&r), "{:?} -> {:?}", s, canon);
                prop_assert_eq!(r.to_string(), canon);
            }
            Ok(())
        }

        fn arb_target() -> impl Strategy<Value = Target> {
            prop_oneof![
                "[a-z0-9][a-z0-9_-]{0,20}".prop_map(Target::RuleSet),
                "([a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?\\.){0,4}[a-z]([a-z0-9-]{0,8}[a-z0-9])?"
                    .prop_map(|d| Target::Domain(Domain::parse(&d).unwrap())),
                any::<u32>().prop_map(|a| Target::Addr(Ipv4Addr::from(a))),
                (any::<u32>(), 0u8..32).prop_map(|(a, p)| {
                    Target::Net(Ipv4Net::new(Ipv4Addr::from(a & mask(p)), p).unwrap())
                }),
                Just(Target::AnyPublic),
            ]
        }

        fn arb_limit() -> impl Strategy<Value = PortLimit> {
            prop_oneof![
                Just(PortLimit::Any),
                (
                    1u16..,
                    1u16..,
                    proptest::option::of(prop_oneof![Just(Proto::Tcp), Just(Proto::Udp)])
                )
                    .prop_map(|(a, b, p)| {
                        PortLimit::Ports(PortRange::new(a.min(b), a.max(b)).unwrap(), p)
                    }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]

            #[test]
            fn arbitrary_strings_never_panic(s in "\\PC{0,80}") {
                round_trips(&s)?;
            }

            #[test]
            fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
                round_trips(&String::from_utf8_lossy(&b))?;
            }

            #[test]
            fn rule_like_strings_never_panic(
                s in "!?(\\*|\\*\\.|[a-zA-Z0-9_*-]{0,12}\\.){0,4}[a-zA-Z0-9_*-]{0,12}\
                      (/[0-9a-z+]{0,3})?(:[0-9+-]{0,7}(/(tcp|udp|TCP|Udp|icmp|))?)?"
            ) {
                round_trips(&s)?;
            }

            #[test]
            fn address_like_strings_never_panic(
                s in "\\[?[0-9a-fA-F:.]{0,20}\\]?(/[0-9]{0,3})?(:[0-9]{0,6}(-[0-9]{0,6})?)?"
            ) {
                round_trips(&s)?;
            }

            #[test]
            fn every_rule_value_round_trips(target in arb_target(), limit in arb_limit()) {
                let r = Rule { target, limit };
                prop_assert_eq!(Rule::parse(&r.to_string()), Ok(r.clone()));
            }
        }
    }
}
