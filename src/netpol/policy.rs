//! A sandbox's effective network policy (docs/network.md "Rules"): the config's default
//! rules under the sandbox's own `network_rules`, the sandbox's value winning per rule, rule
//! sets expanded, normalized into the shapes the enforcement needs: networks with port limits
//! for the nftables chain, domains for the DNS proxy, and the port limits of `*`.

use std::borrow::Borrow;
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use super::rule::{is_rule_set_name, Domain, Ipv4Net, PortLimit, Proto, Rule, RuleProblem, Target};
use super::{is_public, NetpolError};

/// The config's `network.rule_sets` and `network.default_rules`, parsed and checked once
/// (docs/configuration.md `network`). Build it at start; [`ClusterRules::resolve`] then
/// computes each sandbox's [`Policy`] without parsing the config again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterRules {
    rule_sets: BTreeMap<String, Vec<Rule>>,
    defaults: BTreeMap<Rule, bool>,
}

impl ClusterRules {
    /// Checks and parses the config's rule sets and default rules.
    /// Errors: [`NetpolError::RuleSetName`] for a bad set name; [`NetpolError::RuleSetEntry`]
    /// for an entry that does not parse or is not a destination (a rule set name, `*`);
    /// [`NetpolError::DefaultRules`] around the error of a bad default rule (one that does not
    /// parse, names an unknown rule set, or conflicts with another spelling of itself).
    pub fn new(
        rule_sets: &BTreeMap<String, Vec<String>>,
        default_rules: &BTreeMap<String, bool>,
    ) -> Result<ClusterRules, NetpolError> {
        let mut sets = BTreeMap::new();
        for (set, entries) in rule_sets {
            if !is_rule_set_name(set) {
                return Err(NetpolError::RuleSetName { set: set.clone() });
            }
            let entry_err = |entry: &str, problem| NetpolError::RuleSetEntry {
                set: set.clone(),
                entry: entry.to_string(),
                problem,
            };
            let mut parsed = Vec::with_capacity(entries.len());
            for entry in entries {
                let rule = Rule::parse(entry).map_err(|e| match e {
                    NetpolError::Rule { problem, .. } => entry_err(entry, problem),
                    other => other,
                })?;
                if matches!(rule.target, Target::RuleSet(_) | Target::AnyPublic) {
                    return Err(entry_err(entry, RuleProblem::NotADestination));
                }
                parsed.push(rule);
            }
            sets.insert(set.clone(), parsed);
        }
        let mut this = ClusterRules {
            rule_sets: sets,
            defaults: BTreeMap::new(),
        };
        this.defaults = this
            .check(default_rules)
            .map_err(|e| NetpolError::DefaultRules(Box::new(e)))?;
        Ok(this)
    }

    /// The entries of rule set `name`, parsed; `None` if the config has no such set.
    pub fn rule_set(&self, name: &str) -> Option<&[Rule]> {
        self.rule_sets.get(name).map(Vec::as_slice)
    }

    /// The default rules, canonical rule → value.
    pub fn defaults(&self) -> &BTreeMap<Rule, bool> {
        &self.defaults
    }

    /// Checks a sandbox's `network_rules` (rule → allowed), as admission does before
    /// accepting them, and returns them as canonical rule → value.
    /// Errors: [`NetpolError::Rule`] for a rule that does not parse;
    /// [`NetpolError::UnknownRuleSet`] for a rule set name the config does not define (with
    /// `true` or `false`: taking back a set that does not exist is a typo, not a no-op);
    /// [`NetpolError::Conflict`] when two spellings of one rule (`github.com`,
    /// `*.GitHub.com`) carry different values. Entries are checked in key order, so the error
    /// is the same for the same map.
    pub fn check<I, K, B>(&self, rules: I) -> Result<BTreeMap<Rule, bool>, NetpolError>
    where
        I: IntoIterator<Item = (K, B)>,
        K: AsRef<str>,
        B: Borrow<bool>,
    {
        let mut sorted: Vec<(K, bool)> = rules.into_iter().map(|(k, v)| (k, *v.borrow())).collect();
        sorted.sort_by(|a, b| a.0.as_ref().cmp(b.0.as_ref()));
        let mut out: BTreeMap<Rule, (&str, bool)> = BTreeMap::new();
        for (key, value) in &sorted {
            let key = key.as_ref();
            let rule = Rule::parse(key)?;
            if let Target::RuleSet(name) = &rule.target {
                if !self.rule_sets.contains_key(name) {
                    return Err(NetpolError::UnknownRuleSet {
                        entry: key.to_string(),
                        name: name.clone(),
                    });
                }
            }
            insert_once(&mut out, rule, key, *value)?;
        }
        Ok(out.into_iter().map(|(r, (_, v))| (r, v)).collect())
    }

    /// The effective policy of a sandbox whose own `network_rules` are `rules`: the default
    /// rules, then the sandbox's rules over them (for the same rule the sandbox's value wins,
    /// so `false` takes a default back; a `false` for a rule that is not a default changes
    /// nothing, and `false` never denies what another rule allows), then every allowed rule
    /// set replaced by its entries, each narrowed by the port limit written on the rule that
    /// named the set (an entry left with no traffic is dropped).
    /// Errors: those of [`ClusterRules::check`].
    pub fn resolve<I, K, B>(&self, rules: I) -> Result<Policy, NetpolError>
    where
        I: IntoIterator<Item = (K, B)>,
        K: AsRef<str>,
        B: Borrow<bool>,
    {
        let own = self.check(rules)?;
        let mut effective: BTreeMap<&Rule, bool> =
            self.defaults.iter().map(|(r, v)| (r, *v)).collect();
        for (r, v) in &own {
            effective.insert(r, *v);
        }
        let mut b = Builder::default();
        for (rule, allowed) in effective {
            if !allowed {
                continue;
            }
            match &rule.target {
                Target::RuleSet(name) => {
                    for entry in self.rule_set(name).unwrap_or_default() {
                        if let Some(limit) = entry.limit.intersect(rule.limit) {
                            b.add(&entry.target, limit);
                        }
                    }
                }
                target => b.add(target, rule.limit),
            }
        }
        Ok(b.finish())
    }
}

/// Adds `rule` (written as `key`) unless another spelling of it is there with another value.
fn insert_once<'a>(
    out: &mut BTreeMap<Rule, (&'a str, bool)>,
    rule: Rule,
    key: &'a str,
    value: bool,
) -> Result<(), NetpolError> {
    match out.entry(rule) {
        Entry::Vacant(v) => {
            v.insert((key, value));
        }
        Entry::Occupied(o) => {
            let (first, old) = *o.get();
            if old != value {
                return Err(NetpolError::Conflict {
                    first: first.to_string(),
                    second: key.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Parses the command line's rule list (docs/network.md "Rules"): rules separated by commas,
/// spaces around them ignored, `!rule` meaning `false` (`pypi,github.com:443,!npm`). An
/// empty string is no rules. Keys keep the spelling given; of two spellings of one rule with
/// the same value, the first is kept. Rule set names are not looked up here (the server
/// does that).
/// Errors: [`NetpolError::Rule`] for a bad or empty rule (`a,,b`); [`NetpolError::Conflict`]
/// for a rule given both with and without `!`.
pub fn parse_rule_list(s: &str) -> Result<BTreeMap<String, bool>, NetpolError> {
    let mut out = BTreeMap::new();
    if s.trim().is_empty() {
        return Ok(out);
    }
    let mut seen: BTreeMap<Rule, (&str, bool)> = BTreeMap::new();
    for item in s.split(',') {
        let item = item.trim();
        let (key, value) = match item.strip_prefix('!') {
            Some(r) => (r, false),
            None => (item, true),
        };
        let rule = Rule::parse(key)?;
        if !seen.contains_key(&rule) {
            out.insert(key.to_string(), value);
        }
        insert_once(&mut seen, rule, key, value)?;
    }
    Ok(out)
}

/// An address or network a sandbox may reach, with the traffic allowed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NetRule {
    /// A /32 for an address rule.
    pub net: Ipv4Net,
    pub limit: PortLimit,
}

/// A domain (and its subdomains) a sandbox may resolve, with the traffic allowed to the
/// public addresses it resolves to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DomainRule {
    pub domain: Domain,
    pub limit: PortLimit,
}

/// What one sandbox may reach, normalized: each list sorted, without duplicates, and without
/// a port limit another one for the same destination already covers (`github.com` and
/// `github.com:443` leave `github.com`). Empty lists mean deny everything.
///
/// How the edge uses it (docs/network.md "Enforcement"): the sandbox's chain accepts
/// [`Policy::nets`] (private ranges included), then drops private destinations, then accepts
/// public destinations under [`Policy::any_public`] and the addresses the DNS proxy resolved
/// for it (with [`Policy::name_limits`]), then drops the rest. The DNS proxy answers a name
/// only if [`Policy::allows_name`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    nets: Vec<NetRule>,
    domains: Vec<DomainRule>,
    any_public: Vec<PortLimit>,
}

impl Policy {
    /// Address and network rules, sorted by network.
    pub fn nets(&self) -> &[NetRule] {
        &self.nets
    }
    /// Domain rules, sorted by domain.
    pub fn domains(&self) -> &[DomainRule] {
        &self.domains
    }
    /// The port limits of `*` rules: empty when no `*` is allowed; `[PortLimit::Any]` for a
    /// plain `*`.
    pub fn any_public(&self) -> &[PortLimit] {
        &self.any_public
    }
    /// Whether the sandbox may reach nothing at all.
    pub fn is_deny_all(&self) -> bool {
        self.nets.is_empty() && self.domains.is_empty() && self.any_public.is_empty()
    }

    /// Whether the DNS proxy may resolve `name` for this sandbox (any case, with or without a
    /// trailing dot): an allowed domain or a subdomain of one, or any name at all when `*`
    /// is allowed (with whatever port limit).
    pub fn allows_name(&self, name: &str) -> bool {
        !self.any_public.is_empty() || !self.name_limits(name).is_empty()
    }

    /// The traffic allowed to the public addresses `name` resolves to, from the domain rules
    /// covering it (not from `*`, which covers public addresses already): empty when no
    /// domain rule covers the name.
    pub fn name_limits(&self, name: &str) -> Vec<PortLimit> {
        let name = normalize_name(name);
        let mut out = Vec::new();
        let mut suffix = name.as_str();
        loop {
            if !suffix.is_empty() {
                let start = self.domains.partition_point(|r| r.domain.as_str() < suffix);
                out.extend(
                    self.domains
                        .iter()
                        .skip(start)
                        .take_while(|r| r.domain.as_str() == suffix)
                        .map(|r| r.limit),
                );
            }
            match suffix.split_once('.') {
                Some((_, rest)) => suffix = rest,
                None => break,
            }
        }
        reduce(out)
    }

    /// Whether a packet to `dst` passes the rules that need no DNS: an address or network
    /// rule, or `*` for a public `dst`. `l4` is the protocol and destination port, `None`
    /// for traffic that is neither TCP nor UDP.
    pub fn allows(&self, dst: Ipv4Addr, l4: Option<(Proto, u16)>) -> bool {
        self.nets
            .iter()
            .any(|r| r.net.contains(dst) && r.limit.matches(l4))
            || (is_public(dst) && self.any_public.iter().any(|l| l.matches(l4)))
    }

    /// Whether a packet to `dst`, an address the DNS proxy resolved from `name`, passes:
    /// [`Policy::allows`], or `dst` is public and a domain rule covering `name` allows the
    /// traffic. A private address a domain resolves to passes only through an address or
    /// network rule naming it.
    pub fn allows_resolved(&self, name: &str, dst: Ipv4Addr, l4: Option<(Proto, u16)>) -> bool {
        self.allows(dst, l4)
            || (is_public(dst) && self.name_limits(name).iter().any(|l| l.matches(l4)))
    }
}

/// A query name as domain rules compare it: lower case, without the trailing dot.
fn normalize_name(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// Sorted, without duplicates or limits another one covers.
fn reduce(mut limits: Vec<PortLimit>) -> Vec<PortLimit> {
    limits.sort();
    limits.dedup();
    let kept: Vec<PortLimit> = limits
        .iter()
        .copied()
        .filter(|l| !limits.iter().any(|m| m != l && m.covers(*l)))
        .collect();
    kept
}

#[derive(Default)]
struct Builder {
    nets: BTreeMap<Ipv4Net, Vec<PortLimit>>,
    domains: BTreeMap<Domain, Vec<PortLimit>>,
    any_public: Vec<PortLimit>,
}

impl Builder {
    fn add(&mut self, target: &Target, limit: PortLimit) {
        match target {
            Target::Addr(a) => self.nets.entry(Ipv4Net::host(*a)).or_default().push(limit),
            Target::Net(n) => self.nets.entry(*n).or_default().push(limit),
            Target::Domain(d) => self.domains.entry(d.clone()).or_default().push(limit),
            Target::AnyPublic => self.any_public.push(limit),
            // Rule sets are expanded by the caller and never hold rule set names.
            Target::RuleSet(_) => {}
        }
    }

    fn finish(self) -> Policy {
        Policy {
            nets: self
                .nets
                .into_iter()
                .flat_map(|(net, l)| {
                    reduce(l)
                        .into_iter()
                        .map(move |limit| NetRule { net, limit })
                })
                .collect(),
            domains: self
                .domains
                .into_iter()
                .flat_map(|(domain, l)| {
                    reduce(l).into_iter().map(move |limit| DomainRule {
                        domain: domain.clone(),
                        limit,
                    })
                })
                .collect(),
            any_public: reduce(self.any_public),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netpol::PortRange;

    fn cluster(sets: &[(&str, &[&str])], defaults: &[(&str, bool)]) -> ClusterRules {
        try_cluster(sets, defaults).unwrap()
    }
    fn try_cluster(
        sets: &[(&str, &[&str])],
        defaults: &[(&str, bool)],
    ) -> Result<ClusterRules, NetpolError> {
        let sets = sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
            .collect();
        let defaults = defaults.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        ClusterRules::new(&sets, &defaults)
    }
    /// The spec's example config.
    fn example(defaults: &[(&str, bool)]) -> ClusterRules {
        cluster(
            &[
                ("pypi", &["pypi.org", "files.pythonhosted.org"]),
                ("npm", &["registry.npmjs.org"]),
                (
                    "github",
                    &[
                        "github.com",
                        "codeload.github.com",
                        "objects.githubusercontent.com",
                    ],
                ),
                ("mirror", &["10.30.0.10:443/tcp"]),
            ],
            defaults,
        )
    }
    fn resolve(c: &ClusterRules, rules: &[(&str, bool)]) -> Policy {
        c.resolve(rules.iter().copied()).unwrap()
    }
    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }
    fn p(lo: u16, hi: u16, proto: Option<Proto>) -> PortLimit {
        PortLimit::Ports(PortRange::new(lo, hi).unwrap(), proto)
    }
    fn domains(pol: &Policy) -> Vec<String> {
        pol.domains()
            .iter()
            .map(|d| format!("{}{}", d.domain, d.limit))
            .collect()
    }
    fn nets(pol: &Policy) -> Vec<String> {
        pol.nets()
            .iter()
            .map(|n| format!("{}{}", n.net, n.limit))
            .collect()
    }
    const TCP443: Option<(Proto, u16)> = Some((Proto::Tcp, 443));
    const TCP80: Option<(Proto, u16)> = Some((Proto::Tcp, 80));
    const UDP53: Option<(Proto, u16)> = Some((Proto::Udp, 53));
    const ICMP: Option<(Proto, u16)> = None;

    #[test]
    fn nothing_allowed_by_default() {
        let pol = resolve(&example(&[]), &[]);
        assert!(pol.is_deny_all());
        assert_eq!(pol, Policy::default());
        assert!(!pol.allows_name("pypi.org"));
        assert!(!pol.allows(ip("192.0.2.1"), TCP443));
        assert!(!pol.allows_resolved("pypi.org", ip("192.0.2.1"), TCP443));
    }

    #[test]
    fn python_packages_only() {
        let pol = resolve(&example(&[]), &[("pypi", true)]);
        assert_eq!(domains(&pol), ["files.pythonhosted.org", "pypi.org"]);
        assert!(pol.nets().is_empty() && pol.any_public().is_empty());
        assert!(pol.allows_name("pypi.org"));
        assert!(pol.allows_name("PyPI.org."));
        assert!(pol.allows_name("test.pypi.org"));
        assert!(!pol.allows_name("github.com"));
        assert!(!pol.allows_name("org"));
        assert!(!pol.allows_name("evilpypi.org"));
        assert!(pol.allows_resolved("pypi.org", ip("192.0.2.1"), TCP443));
        assert!(pol.allows_resolved("pypi.org", ip("192.0.2.1"), ICMP));
        // Never a private address, even for an allowed domain.
        assert!(!pol.allows_resolved("pypi.org", ip("10.0.0.1"), TCP443));
        assert!(!pol.allows_resolved("pypi.org", ip("169.254.169.254"), TCP80));
        assert!(!pol.allows_resolved("github.com", ip("192.0.2.1"), TCP443));
        assert!(!pol.allows(ip("192.0.2.1"), TCP443));
    }

    #[test]
    fn the_internet_https_only() {
        let pol = resolve(&example(&[]), &[("*:443", true)]);
        assert_eq!(pol.any_public(), [p(443, 443, None)]);
        assert!(pol.allows_name("anything.example"));
        assert!(pol.allows(ip("192.0.2.1"), TCP443));
        assert!(pol.allows(ip("192.0.2.1"), Some((Proto::Udp, 443))));
        assert!(!pol.allows(ip("192.0.2.1"), TCP80));
        assert!(!pol.allows(ip("192.0.2.1"), ICMP));
        assert!(!pol.allows(ip("10.0.0.1"), TCP443));
        assert!(!pol.allows(ip("127.0.0.1"), TCP443));
        // `*` opens no private address, not even through a name.
        assert!(!pol.allows_resolved("x.example", ip("192.168.1.1"), TCP443));
        assert!(pol.name_limits("x.example").is_empty());
    }

    #[test]
    fn the_internet_plus_one_internal_database() {
        let pol = resolve(&example(&[]), &[("*", true), ("10.20.0.15:5432/tcp", true)]);
        assert_eq!(pol.any_public(), [PortLimit::Any]);
        assert_eq!(nets(&pol), ["10.20.0.15/32:5432/tcp"]);
        assert!(pol.allows(ip("10.20.0.15"), Some((Proto::Tcp, 5432))));
        assert!(!pol.allows(ip("10.20.0.15"), Some((Proto::Udp, 5432))));
        assert!(!pol.allows(ip("10.20.0.15"), TCP443));
        assert!(!pol.allows(ip("10.20.0.16"), Some((Proto::Tcp, 5432))));
        assert!(pol.allows(ip("198.51.100.1"), ICMP));
        assert!(pol.allows(ip("198.51.100.1"), UDP53));
    }

    #[test]
    fn the_sandbox_takes_a_default_back() {
        let c = example(&[("*", true)]);
        assert_eq!(resolve(&c, &[]).any_public(), [PortLimit::Any]);
        let pol = resolve(&c, &[("*", false)]);
        assert!(pol.is_deny_all());
        let pol = resolve(
            &c,
            &[
                ("*", false),
                ("pypi.org:443", true),
                ("files.pythonhosted.org:443", true),
            ],
        );
        assert!(pol.any_public().is_empty());
        assert_eq!(
            domains(&pol),
            ["files.pythonhosted.org:443", "pypi.org:443"]
        );
        assert!(pol.allows_resolved("pypi.org", ip("192.0.2.1"), TCP443));
        assert!(!pol.allows_resolved("pypi.org", ip("192.0.2.1"), TCP80));
        assert!(!pol.allows_name("github.com"));
    }

    #[test]
    fn false_only_takes_back_the_same_rule() {
        // The key, not the destination: `*:443` stays when `*` is taken back, and a
        // domain allowed by a rule set stays when the domain alone is set false.
        let c = example(&[("*:443", true), ("pypi", true), ("mirror", true)]);
        let pol = resolve(&c, &[("*", false), ("pypi.org", false)]);
        assert_eq!(pol.any_public(), [p(443, 443, None)]);
        assert!(pol.allows_name("pypi.org"));
        assert_eq!(nets(&pol), ["10.30.0.10/32:443/tcp"]);
        // Another spelling of a default is the same rule, so it takes the default back.
        let c = example(&[("github.com", true)]);
        assert!(resolve(&c, &[("*.GitHub.com", false)]).is_deny_all());
        // A false for something that is no default changes nothing.
        assert!(resolve(&example(&[]), &[("*", false), ("pypi", false)]).is_deny_all());
        // And true for a default is the default.
        assert_eq!(
            resolve(&example(&[("mirror", true)]), &[("mirror", true)]),
            resolve(&example(&[("mirror", true)]), &[])
        );
    }

    #[test]
    fn rule_sets_expand_and_narrow_by_the_rule_s_ports() {
        let c = example(&[("mirror", true)]);
        let pol = resolve(&c, &[("github:443", true)]);
        assert_eq!(
            domains(&pol),
            [
                "codeload.github.com:443",
                "github.com:443",
                "objects.githubusercontent.com:443"
            ]
        );
        assert_eq!(nets(&pol), ["10.30.0.10/32:443/tcp"]);
        // A port the entry's own limit excludes leaves nothing of the entry.
        let c = example(&[]);
        assert!(resolve(&c, &[("mirror:80", true)]).is_deny_all());
        assert!(resolve(&c, &[("mirror:443/udp", true)]).is_deny_all());
        assert_eq!(
            nets(&resolve(&c, &[("mirror:400-500", true)])),
            ["10.30.0.10/32:443/tcp"]
        );
        // The port-limited rule set is another rule than the set itself.
        assert_eq!(
            nets(&resolve(&c, &[("mirror", false), ("mirror:443", true)])),
            ["10.30.0.10/32:443/tcp"]
        );
    }

    #[test]
    fn limits_are_normalized() {
        let c = example(&[]);
        let pol = resolve(
            &c,
            &[
                ("github.com:443", true),
                ("github.com", true),
                ("github", true),
                ("1.2.3.4", true),
                ("1.2.3.4/32:53/udp", true),
                ("10.0.0.0/8:443", true),
                ("10.0.0.0/8:443/tcp", true),
                ("10.0.0.0/8:80/tcp", true),
                ("*:443/tcp", true),
                ("*:1-1000", true),
            ],
        );
        assert_eq!(
            domains(&pol),
            [
                "codeload.github.com",
                "github.com",
                "objects.githubusercontent.com"
            ]
        );
        assert_eq!(
            nets(&pol),
            ["1.2.3.4/32", "10.0.0.0/8:80/tcp", "10.0.0.0/8:443"]
        );
        assert_eq!(pol.any_public(), [p(1, 1000, None)]);
    }

    #[test]
    fn allows_name_with_subdomains_and_star() {
        let c = example(&[]);
        let pol = resolve(
            &c,
            &[("*.example.com:443", true), ("api.example.org", true)],
        );
        assert!(pol.allows_name("example.com"));
        assert!(pol.allows_name("a.b.example.com."));
        assert!(pol.allows_name("EXAMPLE.COM"));
        assert!(!pol.allows_name("badexample.com"));
        assert!(!pol.allows_name("example.com.evil.io"));
        assert!(pol.allows_name("api.example.org"));
        assert!(pol.allows_name("v1.api.example.org"));
        // Parent domains are not covered.
        assert!(!pol.allows_name("example.org"));
        assert!(!pol.allows_name(""));
        assert!(!pol.allows_name("."));
        assert_eq!(pol.name_limits("x.example.com"), [p(443, 443, None)]);
        assert_eq!(pol.name_limits("v1.api.example.org"), [PortLimit::Any]);
        // A subdomain also allowed on its own gets the union of both limits, reduced.
        let pol = resolve(&c, &[("example.com:443", true), ("api.example.com", true)]);
        assert_eq!(pol.name_limits("api.example.com"), [PortLimit::Any]);
        assert_eq!(pol.name_limits("www.example.com"), [p(443, 443, None)]);
        // `*`, with any port limit, lets every name resolve.
        let pol = resolve(&c, &[("*:443", true)]);
        assert!(pol.allows_name("anything.at.all"));
        assert!(pol.allows_name("localhost"));
        // A one-label domain (`*.internal`) covers its names.
        let pol = resolve(&c, &[("*.internal", true)]);
        assert!(pol.allows_name("db.internal"));
        assert!(pol.allows_name("internal"));
        assert!(!pol.allows_name("internal.com"));
    }

    #[test]
    fn named_private_networks_open_private_addresses() {
        let c = example(&[]);
        let pol = resolve(
            &c,
            &[("10.0.0.0/8", true), ("169.254.169.254:80/tcp", true)],
        );
        assert!(pol.allows(ip("10.1.2.3"), ICMP));
        assert!(pol.allows(ip("169.254.169.254"), TCP80));
        assert!(!pol.allows(ip("169.254.169.253"), TCP80));
        assert!(!pol.allows(ip("192.0.2.1"), TCP80));
        // A domain resolving into a named network passes through that network's rule.
        assert!(pol.allows_resolved("db.corp.example", ip("10.1.2.3"), TCP443));
        // A public address named by a rule needs no `*`.
        let pol = resolve(&c, &[("203.0.113.0/24:22/tcp", true)]);
        assert!(pol.allows(ip("203.0.113.255"), Some((Proto::Tcp, 22))));
        assert!(!pol.allows(ip("203.0.114.0"), Some((Proto::Tcp, 22))));
    }

    #[test]
    fn resolution_errors() {
        let c = example(&[]);
        let err =
            |rules: &[(&str, bool)]| c.resolve(rules.iter().copied()).unwrap_err().to_string();
        assert_eq!(
            err(&[("pypo", true)]),
            "network rule \"pypo\": no rule set named \"pypo\" in network.rule_sets"
        );
        assert_eq!(
            err(&[("pypo:443", false)]),
            "network rule \"pypo:443\": no rule set named \"pypo\" in network.rule_sets"
        );
        assert_eq!(
            err(&[("github.com:70000", true)]),
            "network rule \"github.com:70000\": port outside 1-65535"
        );
        assert_eq!(
            err(&[("github.com", true), ("*.GitHub.com", false)]),
            "network rules \"*.GitHub.com\" and \"github.com\" are the same rule with different \
             values"
        );
        // The same rule twice with one value is fine.
        resolve(&c, &[("github.com", true), ("*.github.com", true)]);
        // Works from the proto's map type.
        let m: std::collections::HashMap<String, bool> =
            [("pypi".to_string(), true)].into_iter().collect();
        assert_eq!(domains(&c.resolve(&m).unwrap()).len(), 2);
    }

    #[test]
    fn config_errors_name_the_set_and_entry() {
        let e = |sets: &[(&str, &[&str])], defaults: &[(&str, bool)]| {
            try_cluster(sets, defaults).unwrap_err().to_string()
        };
        assert_eq!(
            e(&[("pypi", &["pypi.org", "pypi.org:0"])], &[]),
            "network.rule_sets \"pypi\": entry \"pypi.org:0\": port outside 1-65535"
        );
        assert_eq!(
            e(&[("all", &["npm"])], &[]),
            "network.rule_sets \"all\": entry \"npm\": a rule set entry is a domain, IPv4 \
             address or network, not a rule set name or '*'"
        );
        assert_eq!(
            e(&[("web", &["*:443"])], &[]),
            "network.rule_sets \"web\": entry \"*:443\": a rule set entry is a domain, IPv4 \
             address or network, not a rule set name or '*'"
        );
        for bad in ["PyPI", "py.pi", "", "-x", "*", "a:1"] {
            assert_eq!(
                e(&[(bad, &[])], &[]),
                format!(
                    "network.rule_sets: {bad:?} is not a rule set name (1 to 63 characters of \
                     a-z, 0-9, '-' and '_', starting with a letter or digit)"
                )
            );
        }
        assert_eq!(
            e(&[], &[("pypi", true)]),
            "network.default_rules: network rule \"pypi\": no rule set named \"pypi\" in \
             network.rule_sets"
        );
        assert_eq!(
            e(&[], &[("10.0.0.1/8", true)]),
            "network.default_rules: network rule \"10.0.0.1/8\": bad IPv4 network: host bits \
             set; the network is 10.0.0.0/8"
        );
        // Valid: empty sets, a false default, underscores in set names.
        let c = cluster(&[("my_set", &[])], &[("my_set", true), ("*", false)]);
        assert!(resolve(&c, &[]).is_deny_all());
        assert_eq!(c.rule_set("my_set"), Some(&[][..]));
        assert_eq!(c.defaults().len(), 2);
    }

    #[test]
    fn command_line_lists() {
        let m = parse_rule_list("pypi, github.com:443,!npm").unwrap();
        let want: BTreeMap<String, bool> = [
            ("pypi".to_string(), true),
            ("github.com:443".to_string(), true),
            ("npm".to_string(), false),
        ]
        .into_iter()
        .collect();
        assert_eq!(m, want);
        assert_eq!(
            parse_rule_list("!*").unwrap(),
            [("*".to_string(), false)].into_iter().collect()
        );
        assert!(parse_rule_list("").unwrap().is_empty());
        assert!(parse_rule_list("  ").unwrap().is_empty());
        assert_eq!(parse_rule_list("github.com,*.github.com").unwrap().len(), 1);
        assert_eq!(
            parse_rule_list("a.io,,b.io").unwrap_err().to_string(),
            "network rule \"\": empty rule"
        );
        assert_eq!(
            parse_rule_list("pypi,!").unwrap_err().to_string(),
            "network rule \"\": empty rule"
        );
        assert_eq!(
            parse_rule_list("pypi,!pypi").unwrap_err().to_string(),
            "network rules \"pypi\" and \"pypi\" are the same rule with different values"
        );
        assert_eq!(
            parse_rule_list("x.io:99999").unwrap_err().to_string(),
            "network rule \"x.io:99999\": port outside 1-65535"
        );
        assert_eq!(
            parse_rule_list("!!pypi").unwrap_err().to_string(),
            "network rule \"!pypi\": not a rule set name, domain, IPv4 address or network"
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1024))]

            /// Any map resolves or fails cleanly; what resolves is consistent with itself.
            #[test]
            fn arbitrary_rule_maps_resolve_without_panicking(
                rules in proptest::collection::btree_map(
                    "(pypi|mirror|github|\\*|[a-z]{1,3}\\.(io|com)|10\\.[0-9]{1,3}\\.0\\.0/16|\
                      [0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3})(:[0-9]{1,5}(-[0-9]{1,5})?\
                      (/(tcp|udp))?)?",
                    any::<bool>(),
                    0..8,
                ),
                name in "[a-z.]{0,20}",
                dst in any::<u32>(),
                port in any::<u16>(),
            ) {
                let c = example(&[("*:443", true), ("mirror", true)]);
                if let Ok(pol) = c.resolve(&rules) {
                    for d in pol.domains() {
                        prop_assert!(pol.allows_name(d.domain.as_str()));
                        let sub = format!("x.{}", d.domain.as_str());
                        prop_assert!(pol.allows_name(&sub));
                    }
                    let _ = pol.allows_name(&name);
                    let dst = Ipv4Addr::from(dst);
                    let l4 = Some((Proto::Tcp, port));
                    if !is_public(dst) {
                        prop_assert_eq!(
                            pol.allows_resolved(&name, dst, l4),
                            pol.nets().iter().any(|n| n.net.contains(dst) && n.limit.matches(l4))
                        );
                    }
                    for n in pol.nets() {
                        let probe = match n.limit {
                            PortLimit::Any => None,
                            PortLimit::Ports(r, p) => Some((p.unwrap_or(Proto::Udp), r.lo())),
                        };
                        prop_assert!(pol.allows(n.net.addr(), probe));
                    }
                }
            }
        }
    }
}
