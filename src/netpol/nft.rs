//! Enforcement (docs/network.md "Enforcement"): the edge's nftables table, written over
//! netlink, one batch (one kernel transaction) per change. No `nft` command runs: it rereads
//! the whole ruleset each time, which costs 100–300 ms with thousands of sandboxes.
//!
//! # The table
//!
//! One `inet` table per edge, `opendsec-<edge id>`. Its hooked chains hold only fixed rules
//! and are rewritten whole (flush + add, atomically) by [`Firewall::install_base`] at every
//! edge start; everything per sandbox lives in sets, maps and regular chains that a restart
//! leaves alone, so running sandboxes keep their rules while the edge is down. `V` is the
//! edge's [`veth_prefix`] (its host-side veths, `odsv0a58*` for 10.88.0.0/16), `N` a slot:
//!
//! ```text
//! pre      filter prerouting -150  iifname V* iifname . ip saddr @guard accept; iifname V* drop;
//!                                  ip saddr <subnet> iifname != V* iifname != lo drop
//! pre-nat  nat prerouting -100     iifname V* udp|tcp dport 53
//!                                      dnat ip to (ip saddr & 255.255.255.252 | 0.0.0.1):<dns_port>
//! fwd      filter forward 0        oifname V* ct state established,related oifname vmap @ingress;
//!                                  oifname V* drop; iifname V* iifname vmap @egress; iifname V* drop
//! in       filter input 0          iifname V* udp|tcp dport <dns_port> accept; iifname V* drop;
//!                                  udp|tcp dport <dns_port> drop
//! out      filter output 0         oifname V* ct state established,related accept; oifname V* drop
//! post-nat nat postrouting 100     ip saddr <subnet> oifname != V* masquerade
//!
//! guard    set  iifname . ipv4_addr          "odsv<N>" . <sandbox N>      (per sandbox)
//! private  set  ipv4_addr, intervals         the private, link-local and multicast ranges
//! egress   map  iifname : verdict            "odsv<N>" : jump out-<N>     (per sandbox)
//! ingress  map  iifname : verdict            "odsv<N>" : jump in-<N>      (per sandbox)
//! ```
//!
//! - A packet from a sandbox whose source is not its own address is not in `guard` and is
//!   dropped, before NAT or routing (forged sources; IPv6, which sandboxes do not have).
//! - DNS to any address goes to the edge's DNS proxy on the sandbox's gateway (`+1` of its
//!   /30, computed from the source `guard` checked); nothing else of the host answers a
//!   sandbox (`in`), and the host opens nothing into one (`out`).
//! - A sandbox's own `out-<N>` chain decides every packet it sends, established connections
//!   included; falling off its end returns to `fwd`, which drops. `in-<N>` is the same
//!   policy seen from the replies (source address and port), so taking a rule back stops a
//!   connection in both directions at once; it first accepts the ICMP errors conntrack
//!   relates to the sandbox's connections (path MTU discovery needs them, and they come
//!   from no port a limit names). New connections into a sandbox never match `ingress` and
//!   are dropped, and `fwd` checks that before the sender's chain, whose accept would
//!   otherwise end the evaluation: a sandbox whose rules allow its neighbours' addresses
//!   (`10.0.0.0/8`) still cannot open a connection to one.
//! - Finding a packet's sandbox is one hash lookup whatever the number of sandboxes.
//!
//! # A sandbox's chains and sets
//!
//! `out-<N>` holds, in this order (see [`sandbox_rules`]):
//!
//! 1. one rule per layer `x-<N>-<i>` of the policy's addresses and networks with their port
//!    limits (sets of address · protocol · port intervals, [`super::boxes`]): accept;
//! 2. drop every private, link-local and multicast destination (the shared interval set
//!    `private`);
//! 3. the `*` rules' ports, set `s-<N>` (same shape): accept;
//! 4. per port limit of the domain rules, set `dns-<N>-<limit>` of the IPv4 addresses the DNS
//!    proxy resolved for it (one-hour timeout), with the limit: accept.
//!
//! The rules depend only on the number of layers and on the domain rules' port limits. An
//! update that keeps both (adding or removing addresses, networks, ports, `*`, or domains
//! under limits the sandbox has) changes only set elements: the kernel then checks nothing
//! but those elements. A change of rules makes it check the whole table for loops, which
//! costs time in proportion to the sandboxes on the edge (docs/benchmarks.md "Network").

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};

use rustables::{Batch as RsBatch, MsgType, ProtocolFamily, Table};

use super::boxes::{self, Box3};
use super::nfmsg::{self, Batch, Elem, Expr, Op, SetSpec, REG32};
use super::nlbatch::{BatchError, BatchSocket};
use super::slot::{host_veth_name, slot_addrs, veth_prefix, SlotAddrs};
use super::Policy;
use super::{Ipv4Net, PortLimit, Proto, PRIVATE_RANGES};

/// How long an address the DNS proxy resolved stays allowed after it was last added, in ms.
pub const RESOLVED_TIMEOUT_MS: u64 = 3_600_000;

/// `nf_conntrack` states, as `ct state` reads them (host byte order).
const CT_ESTABLISHED: u32 = 1 << 1;
const CT_RELATED: u32 = 1 << 2;
/// How often a listing the kernel interrupted is started again before its error is returned.
const MAX_DUMP_TRIES: u32 = 50;
/// The port sandboxes send DNS to.
const DNS_PORT: u16 = 53;
/// The shared set and maps (module doc).
const GUARD: &str = "guard";
/// Every private, link-local and multicast address ([`PRIVATE_RANGES`]), an interval set.
const PRIVATE: &str = "private";
const EGRESS: &str = "egress";
const INGRESS: &str = "ingress";
/// Regular chains of tables written before the maps replaced them; an edge start removes them.
const LEGACY_CHAINS: [&str; 4] = ["guard", "dns", "egress", "ingress"];
/// Registers: a 16-byte interface name fills `REG32..REG32+3`.
const R0: u32 = REG32;
const R1: u32 = REG32 + 1;
const R2: u32 = REG32 + 2;
const R4: u32 = REG32 + 4;

/// A change to the table that failed. No batch is applied in part: the table is as before.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// Reading the table over netlink failed.
    #[error("nftables table {table}: {what}: {source}")]
    Apply {
        table: String,
        what: String,
        #[source]
        source: rustables::error::QueryError,
    },
    /// The kernel refused a change, or sending it failed.
    #[error("nftables table {table}: {what}: {source}")]
    Commit {
        table: String,
        what: String,
        #[source]
        source: BatchError,
    },
}

/// The edge's table: its name, the edge's sandbox subnet and its DNS proxy's port. Every
/// method is a blocking netlink exchange of a few hundred microseconds; async callers run
/// them on a blocking thread. Needs CAP_NET_ADMIN in the caller's netns.
#[derive(Debug, Clone)]
pub struct Firewall {
    table: String,
    subnet: Ipv4Net,
    dns_port: u16,
    prefix: String,
    /// Every change of the table goes through this one socket.
    sock: Arc<BatchSocket>,
    /// The chain layout last written per slot, so that an update or a detach need not list
    /// the slot's chain: a listing opens a socket of its own, whose close waits for an RCU
    /// grace period once an earlier change deleted something (docs/benchmarks.md "Network").
    written: Arc<Mutex<HashMap<u32, Layout>>>,
    /// The slots the table may hold something of: learned by one listing at the first
    /// attach, then kept up to date by attach (before it sends) and detach (after). A slot
    /// outside it is attached without listing anything.
    present: Arc<Mutex<Option<BTreeSet<u32>>>>,
}

/// What a slot's chains refer to: how many layer sets, which resolved sets. Two policies
/// with the same layout differ only in set elements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Layout {
    layers: u32,
    resolved: BTreeSet<String>,
}

/// Which way a packet goes, for the rules of a sandbox's policy: what it sends (matched on
/// destination address and port) or the replies it gets (source address and port).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Out,
    In,
}

/// A policy as the table holds it: boxes per layer, the boxes of `*`, the resolved sets.
struct Plan {
    layers: Vec<Vec<Box3>>,
    any_public: Vec<Box3>,
    resolved: Vec<(PortLimit, String)>,
}

impl Plan {
    fn of(slot: u32, policy: &Policy) -> Plan {
        Plan {
            layers: boxes::layers(policy.nets()),
            any_public: boxes::any_public(policy.any_public()),
            resolved: resolved_limits(policy)
                .into_iter()
                .map(|l| (l, resolved_set_name(slot, l)))
                .collect(),
        }
    }
    fn layout(&self) -> Layout {
        Layout {
            layers: self.layers.len() as u32,
            resolved: self.resolved.iter().map(|(_, n)| n.clone()).collect(),
        }
    }
}

/// The name of the set of addresses the DNS proxy resolved for slot `slot` under `limit`:
/// `dns-<slot>-all`, `dns-<slot>-tcp-443`, `dns-<slot>-any-8000-8080`.
pub fn resolved_set_name(slot: u32, limit: PortLimit) -> String {
    match limit {
        PortLimit::Any => format!("dns-{slot}-all"),
        PortLimit::Ports(r, p) => {
            let proto = p.map_or("any", Proto::as_str);
            if r.lo() == r.hi() {
                format!("dns-{slot}-{proto}-{}", r.lo())
            } else {
                format!("dns-{slot}-{proto}-{}-{}", r.lo(), r.hi())
            }
        }
    }
}

/// The port limits of a policy's domain rules, each once: one resolved set each.
pub fn resolved_limits(policy: &Policy) -> BTreeSet<PortLimit> {
    policy.domains().iter().map(|d| d.limit).collect()
}

/// The set of layer `layer` of slot `slot`'s addresses and networks.
pub fn layer_set_name(slot: u32, layer: u32) -> String {
    format!("x-{slot}-{layer}")
}

/// The set of slot `slot`'s `*` ports.
pub fn any_public_set_name(slot: u32) -> String {
    format!("s-{slot}")
}

fn out_chain(slot: u32) -> String {
    format!("out-{slot}")
}
fn in_chain(slot: u32) -> String {
    format!("in-{slot}")
}

/// An interface name as `meta iifname` loads it: 16 bytes, NUL-padded.
fn ifname_key(name: &str) -> Vec<u8> {
    let mut k = name.as_bytes().to_vec();
    k.resize(16, 0);
    k
}

/// The set of boxes, as a set spec.
fn box_set() -> SetSpec {
    SetSpec {
        key_type: nfmsg::concat_type(&[
            nfmsg::TYPE_IPV4,
            nfmsg::TYPE_INET_PROTO,
            nfmsg::TYPE_INET_SERVICE,
        ]),
        key_len: boxes::KEY_LEN,
        flags: nfmsg::SET_INTERVAL | nfmsg::SET_CONCAT,
        fields: boxes::FIELDS.to_vec(),
        ..SetSpec::default()
    }
}

fn resolved_set() -> SetSpec {
    SetSpec {
        key_type: nfmsg::TYPE_IPV4,
        key_len: 4,
        flags: nfmsg::SET_TIMEOUT,
        timeout_ms: Some(RESOLVED_TIMEOUT_MS),
        ..SetSpec::default()
    }
}

/// Rules under construction: expressions in order.
#[derive(Default, Clone)]
struct R(Vec<Expr>);

impl R {
    fn new() -> R {
        R::default()
    }
    fn e(mut self, e: Expr) -> R {
        self.0.push(e);
        self
    }
    /// `iifname`/`oifname` compared with `name` (exact) or its start (`prefix`).
    fn ifname(self, input: bool, name: &str, prefix: bool, op: u32) -> R {
        let mut bytes = name.as_bytes().to_vec();
        if !prefix {
            bytes.push(0);
        }
        let key = if input {
            nfmsg::META_IIFNAME
        } else {
            nfmsg::META_OIFNAME
        };
        self.e(Expr::meta(key, R0)).e(Expr::cmp(R0, op, &bytes))
    }
    fn iif_prefix(self, p: &str) -> R {
        self.ifname(true, p, true, nfmsg::CMP_EQ)
    }
    fn oif_prefix(self, p: &str) -> R {
        self.ifname(false, p, true, nfmsg::CMP_EQ)
    }
    fn ipv4(self) -> R {
        self.e(Expr::meta(nfmsg::META_NFPROTO, R0)).e(Expr::cmp(
            R0,
            nfmsg::CMP_EQ,
            &[libc::NFPROTO_IPV4 as u8],
        ))
    }
    /// `ip saddr|daddr` into `reg`.
    fn load_addr(self, source: bool, reg: u32) -> R {
        self.e(Expr::payload(
            nfmsg::BASE_NETWORK,
            if source { 12 } else { 16 },
            4,
            reg,
        ))
    }
    /// `ip saddr|daddr` in `net` (`/0` matches every IPv4 packet).
    fn addr(self, source: bool, net: Ipv4Net) -> R {
        let r = self.ipv4();
        if net.prefix() == 0 {
            return r;
        }
        let r = r.load_addr(source, R0);
        let r = if net.prefix() < 32 {
            r.e(Expr::bitwise(R0, R0, &net.netmask().octets(), &[0; 4]))
        } else {
            r
        };
        r.e(Expr::cmp(R0, nfmsg::CMP_EQ, &net.addr().octets()))
    }
    fn l4proto(self, num: u8) -> R {
        self.e(Expr::meta(nfmsg::META_L4PROTO, R0))
            .e(Expr::cmp(R0, nfmsg::CMP_EQ, &[num]))
    }
    /// `meta l4proto tcp|udp`, and its port (`sport` or `dport`) in `lo..=hi`.
    fn port(self, proto: Proto, source: bool, lo: u16, hi: u16) -> R {
        let num = match proto {
            Proto::Tcp => libc::IPPROTO_TCP,
            Proto::Udp => libc::IPPROTO_UDP,
        } as u8;
        let r = self.l4proto(num).e(Expr::payload(
            nfmsg::BASE_TRANSPORT,
            if source { 0 } else { 2 },
            2,
            R0,
        ));
        if lo == hi {
            r.e(Expr::cmp(R0, nfmsg::CMP_EQ, &lo.to_be_bytes()))
        } else {
            // Network byte order compares like the numbers.
            r.e(Expr::cmp(R0, 5, &lo.to_be_bytes())) // NFT_CMP_GTE
                .e(Expr::cmp(R0, 3, &hi.to_be_bytes())) // NFT_CMP_LTE
        }
    }
    /// `ct state` one of `states` (a mask of `CT_*`).
    fn ct_state(self, states: u32) -> R {
        self.e(Expr::ct_state(R0))
            .e(Expr::bitwise(R0, R0, &states.to_ne_bytes(), &[0; 4]))
            .e(Expr::cmp(R0, nfmsg::CMP_NEQ, &[0; 4]))
    }
    fn established(self) -> R {
        self.ct_state(CT_ESTABLISHED | CT_RELATED)
    }
    /// The packet's address · protocol · port (destination, or source for replies) is in
    /// box set `set`.
    fn in_boxes(self, source: bool, set: &str) -> R {
        self.ipv4()
            .load_addr(source, R0)
            .e(Expr::meta(nfmsg::META_L4PROTO, R1))
            .e(Expr::payload(
                nfmsg::BASE_TRANSPORT,
                if source { 0 } else { 2 },
                2,
                R2,
            ))
            .e(Expr::lookup(set, R0, None))
    }
    fn accept(self) -> R {
        self.e(Expr::verdict(nfmsg::NF_ACCEPT, None))
    }
    fn drop(self) -> R {
        self.e(Expr::verdict(nfmsg::NF_DROP, None))
    }
    fn add(self, b: &mut Batch, chain: &str) {
        b.add_rule(chain, &self.0, None);
    }
}

/// A batch that adds `table` if missing, and its `hooked` chains (name, type, hook,
/// priority) if missing, flushed: what writes a table's fixed rules whole.
fn with_base_chains(table: &str, hooked: &[(&str, &str, u32, i32)]) -> Batch {
    let mut b = Batch::new(table);
    b.add_table();
    for &(name, kind, hook, prio) in hooked {
        b.add_base_chain(name, kind, hook, prio);
        b.flush_chain(name);
    }
    b
}

/// The table in a microVM's own network namespace (docs/microvm.md "Network").
pub const VM_TABLE: &str = "opendsec-vm";

/// Writes [`VM_TABLE`] whole (created, or its chains flushed and filled again, in one
/// transaction) in the calling thread's network namespace: a microVM's, where `tap` leads
/// to the guest at `guest` and `uplink` is the sandbox's `eth0`.
///
/// ```text
/// pre-nat  nat prerouting -100    iifname tap udp|tcp dport 53 dnat ip to <dns>:53
/// fwd      filter forward 0       iifname tap oifname uplink ip saddr <guest> accept;
///                                 iifname uplink oifname tap ct state established,related accept;
///                                 drop
/// in       filter input 0         iifname != lo drop
/// post-nat nat postrouting 100    oifname uplink masquerade
/// ```
///
/// What leaves is the sandbox's own address, which the edge's table polices as it does a
/// container's; the guest's DNS (to its gateway on the tap) goes to `dns`, the sandbox's
/// gateway, where the edge's table sends it on to its proxy. A forged source, IPv6 and
/// anything new from outside are dropped, and nothing of the namespace itself answers.
/// Errors: [`NftError::Commit`] (nothing changed).
pub fn install_vm_table(
    tap: &str,
    uplink: &str,
    guest: Ipv4Addr,
    dns: Ipv4Addr,
) -> Result<(), NftError> {
    let mut b = with_base_chains(
        VM_TABLE,
        &[
            ("pre-nat", "nat", nfmsg::HOOK_PREROUTING, -100),
            ("fwd", "filter", nfmsg::HOOK_FORWARD, 0),
            ("in", "filter", nfmsg::HOOK_INPUT, 0),
            ("post-nat", "nat", nfmsg::HOOK_POSTROUTING, 100),
        ],
    );
    let eq = nfmsg::CMP_EQ;
    for proto in [Proto::Udp, Proto::Tcp] {
        R::new()
            .ifname(true, tap, false, eq)
            .ipv4()
            .port(proto, false, DNS_PORT, DNS_PORT)
            .e(Expr::immediate(R0, &dns.octets()))
            .e(Expr::immediate(R1, &DNS_PORT.to_be_bytes()))
            .e(Expr::dnat_ipv4(R0, R1))
            .add(&mut b, "pre-nat");
    }
    R::new()
        .ifname(true, tap, false, eq)
        .ifname(false, uplink, false, eq)
        .addr(true, Ipv4Net::host(guest))
        .accept()
        .add(&mut b, "fwd");
    R::new()
        .ifname(true, uplink, false, eq)
        .ifname(false, tap, false, eq)
        .established()
        .accept()
        .add(&mut b, "fwd");
    R::new().drop().add(&mut b, "fwd");
    R::new()
        .ifname(true, "lo", false, nfmsg::CMP_NEQ)
        .drop()
        .add(&mut b, "in");
    R::new()
        .ifname(false, uplink, false, eq)
        .e(Expr::masquerade())
        .add(&mut b, "post-nat");
    BatchSocket::new()
        .send(b.finish())
        .map_err(|source| NftError::Commit {
            table: VM_TABLE.into(),
            what: "installing a microVM's table".into(),
            source,
        })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Firewall {
    /// The table of edge `edge_id` (`opendsec-<edge_id>`) for sandboxes of `subnet`, whose
    /// DNS proxy listens on `dns_port` of each gateway address.
    pub fn new(edge_id: &str, subnet: Ipv4Net, dns_port: u16) -> Firewall {
        Firewall {
            table: format!("opendsec-{edge_id}"),
            subnet,
            dns_port,
            prefix: veth_prefix(subnet),
            sock: Arc::new(BatchSocket::new()),
            written: Arc::default(),
            present: Arc::default(),
        }
    }

    /// Whether the table may hold something of `slot`, listing the table the first time.
    /// Marks the slot as holding something from now on (the caller is about to write it).
    fn may_hold_then_mark(&self, slot: u32) -> Result<bool, NftError> {
        if lock(&self.present).is_none() {
            let listed: BTreeSet<u32> = self.slots()?.into_iter().collect();
            lock(&self.present).get_or_insert(listed);
        }
        let mut g = lock(&self.present);
        let set = g.get_or_insert_with(BTreeSet::new);
        Ok(!set.insert(slot))
    }

    fn forget(&self, slot: u32) {
        lock(&self.written).remove(&slot);
        if let Some(p) = lock(&self.present).as_mut() {
            p.remove(&slot);
        }
    }

    /// The table's name.
    pub fn table_name(&self) -> &str {
        &self.table
    }

    fn table(&self) -> Table {
        Table::new(ProtocolFamily::Inet).with_name(&self.table)
    }

    fn send(&self, b: Batch, what: &str) -> Result<(), NftError> {
        self.sock
            .send(b.finish())
            .map_err(|source| NftError::Commit {
                table: self.table.clone(),
                what: what.to_string(),
                source,
            })
    }

    /// Creates the table, its set and maps if missing, and rewrites its hooked chains
    /// (module doc) in one transaction: what a restarted edge runs before adopting its
    /// sandboxes, whose own chains, sets and map elements it leaves in place.
    /// Errors: [`NftError`] (nothing changed).
    pub fn install_base(&self) -> Result<(), NftError> {
        let mut b = with_base_chains(
            &self.table,
            &[
                ("pre", "filter", nfmsg::HOOK_PREROUTING, -150),
                ("pre-nat", "nat", nfmsg::HOOK_PREROUTING, -100),
                ("fwd", "filter", nfmsg::HOOK_FORWARD, 0),
                ("in", "filter", nfmsg::HOOK_INPUT, 0),
                ("out", "filter", nfmsg::HOOK_OUTPUT, 0),
                ("post-nat", "nat", nfmsg::HOOK_POSTROUTING, 100),
            ],
        );
        // Nothing refers to these once the hooked chains are flushed.
        for c in LEGACY_CHAINS {
            b.destroy_chain(c);
        }
        b.add_set(
            GUARD,
            &SetSpec {
                key_type: nfmsg::concat_type(&[nfmsg::TYPE_IFNAME, nfmsg::TYPE_IPV4]),
                // A hash of the whole key: the kernel needs field lengths only for ranges.
                key_len: 20,
                ..SetSpec::default()
            },
        );
        // Rewritten at every start, so that a new release's list applies to running sandboxes.
        b.add_set(
            PRIVATE,
            &SetSpec {
                key_type: nfmsg::TYPE_IPV4,
                key_len: 4,
                flags: nfmsg::SET_INTERVAL,
                ..SetSpec::default()
            },
        );
        b.flush_set(PRIVATE);
        b.elements(
            Op::NewSetElem,
            PRIVATE,
            &boxes::ipv4_intervals(&PRIVATE_RANGES),
        );
        for map in [EGRESS, INGRESS] {
            b.add_set(
                map,
                &SetSpec {
                    key_type: nfmsg::TYPE_IFNAME,
                    key_len: 16,
                    verdict_map: true,
                    userdata: Some(nfmsg::host_order_key_userdata()),
                    ..SetSpec::default()
                },
            );
        }
        let p = self.prefix.as_str();
        R::new()
            .iif_prefix(p)
            .ipv4()
            .e(Expr::meta(nfmsg::META_IIFNAME, R0))
            .load_addr(true, R4)
            .e(Expr::lookup(GUARD, R0, None))
            .accept()
            .add(&mut b, "pre");
        R::new().iif_prefix(p).drop().add(&mut b, "pre");
        // A sandbox's address arriving on any other interface is forged: the DNS proxy
        // would take it for that sandbox. The host itself reaches its gateway addresses
        // over lo.
        R::new()
            .addr(true, self.subnet)
            .ifname(true, p, true, nfmsg::CMP_NEQ)
            .ifname(true, "lo", false, nfmsg::CMP_NEQ)
            .drop()
            .add(&mut b, "pre");
        for proto in [Proto::Udp, Proto::Tcp] {
            // The gateway is `+1` of the sandbox's /30, the sandbox `+2`.
            R::new()
                .iif_prefix(p)
                .ipv4()
                .port(proto, false, DNS_PORT, DNS_PORT)
                .load_addr(true, R0)
                .e(Expr::bitwise(R0, R0, &[255, 255, 255, 252], &[0, 0, 0, 1]))
                .e(Expr::immediate(R1, &self.dns_port.to_be_bytes()))
                .e(Expr::dnat_ipv4(R0, R1))
                .add(&mut b, "pre-nat");
        }
        // Towards a sandbox first: a packet from one sandbox to another must pass the
        // receiver's check (never a new connection) before the sender's rules can accept it.
        R::new()
            .oif_prefix(p)
            .established()
            .e(Expr::meta(nfmsg::META_OIFNAME, R0))
            .e(Expr::lookup(INGRESS, R0, Some(nfmsg::REG_VERDICT)))
            .add(&mut b, "fwd");
        R::new().oif_prefix(p).drop().add(&mut b, "fwd");
        R::new()
            .iif_prefix(p)
            .e(Expr::meta(nfmsg::META_IIFNAME, R0))
            .e(Expr::lookup(EGRESS, R0, Some(nfmsg::REG_VERDICT)))
            .add(&mut b, "fwd");
        R::new().iif_prefix(p).drop().add(&mut b, "fwd");
        for proto in [Proto::Udp, Proto::Tcp] {
            R::new()
                .iif_prefix(p)
                .port(proto, false, self.dns_port, self.dns_port)
                .accept()
                .add(&mut b, "in");
        }
        R::new().iif_prefix(p).drop().add(&mut b, "in");
        // The proxy listens on every address; it is for sandboxes only.
        for proto in [Proto::Udp, Proto::Tcp] {
            R::new()
                .port(proto, false, self.dns_port, self.dns_port)
                .drop()
                .add(&mut b, "in");
        }
        R::new()
            .oif_prefix(p)
            .established()
            .accept()
            .add(&mut b, "out");
        R::new().oif_prefix(p).drop().add(&mut b, "out");
        R::new()
            .addr(true, self.subnet)
            .ifname(false, p, true, nfmsg::CMP_NEQ)
            .e(Expr::masquerade())
            .add(&mut b, "post-nat");
        self.send(b, "installing the base chains")
    }

    /// Deletes the whole table (every sandbox's rules with it); `Ok(false)` when there was
    /// none. For an edge that turns networking off, and tests.
    /// Errors: [`NftError`].
    pub fn remove(&self) -> Result<bool, NftError> {
        if !self.exists()? {
            return Ok(false);
        }
        let mut b = RsBatch::new();
        b.add(&self.table(), MsgType::Del);
        self.sock
            .send(b.finalize())
            .map_err(|source| NftError::Commit {
                table: self.table.clone(),
                what: "deleting the table".into(),
                source,
            })?;
        lock(&self.written).clear();
        *lock(&self.present) = Some(BTreeSet::new());
        Ok(true)
    }

    fn apply_err(&self, what: &str) -> impl FnOnce(rustables::error::QueryError) -> NftError {
        let (table, what) = (self.table.clone(), what.to_string());
        move |source| NftError::Apply {
            table,
            what,
            source,
        }
    }

    fn exists(&self) -> Result<bool, NftError> {
        let tables = self
            .dump(rustables::list_tables)
            .map_err(self.apply_err("listing tables"))?;
        // Our name is ours in every family; only the inet one is ever made.
        Ok(tables.iter().any(|t| t.get_name() == Some(&self.table)))
    }

    /// Adds sandbox `addrs` with `policy`: its chains and sets (module doc) and its entries
    /// in the shared set and maps, in one transaction, replacing whatever the table held for
    /// the slot (so adopting a sandbox after a restart is the same call; addresses already
    /// resolved under a port limit the policy has are kept).
    /// Errors: [`NftError`] (nothing changed).
    pub fn attach(&self, addrs: &SlotAddrs, policy: &Policy) -> Result<(), NftError> {
        let slot = addrs.slot;
        let old = if self.may_hold_then_mark(slot)? {
            let known = lock(&self.written).get(&slot).cloned();
            match known {
                Some(l) => Some(l),
                None => self.listed_layout(slot)?,
            }
        } else {
            None
        };
        let plan = Plan::of(slot, policy);
        let mut b = Batch::new(&self.table);
        self.write_chains(&mut b, slot, &plan, old.as_ref());
        self.fill(&mut b, slot, &plan, plan.layers.len() as u32);
        let ifname = ifname_key(&host_veth_name(addrs.network));
        let mut guard = ifname.clone();
        guard.extend_from_slice(&addrs.sandbox.octets());
        b.elements(Op::NewSetElem, GUARD, &[Elem::key(guard)]);
        for (map, chain) in [(EGRESS, out_chain(slot)), (INGRESS, in_chain(slot))] {
            let e = Elem {
                jump: Some(chain),
                ..Elem::key(ifname.clone())
            };
            b.elements(Op::NewSetElem, map, &[e]);
        }
        self.send(b, &format!("adding sandbox slot {slot}"))?;
        lock(&self.written).insert(slot, plan.layout());
        Ok(())
    }

    /// Replaces the policy of attached sandbox `slot` in one transaction: what
    /// `UpdateNetwork` runs. When the new policy has the layout of the old one (module doc),
    /// only set elements change; else the slot's chains are rewritten too. Addresses already
    /// resolved under a port limit the new policy still has are kept.
    /// Errors: [`NftError`] (nothing changed).
    pub fn update(&self, slot: u32, policy: &Policy) -> Result<(), NftError> {
        let known = lock(&self.written).get(&slot).cloned();
        let listed = known.is_none();
        let old = match known {
            Some(l) => Some(l),
            None => self.listed_layout(slot)?,
        };
        let what = format!("updating sandbox slot {slot}");
        let plan = Plan::of(slot, policy);
        let (b, layout) = self.update_batch(slot, &plan, old.as_ref());
        match self.send(b, &what) {
            Ok(()) => {}
            // What was written is not what the table holds (someone removed a set): the
            // table's own word, then, and every object written again.
            Err(NftError::Commit {
                source:
                    BatchError::Refused {
                        errno: nix::errno::Errno::ENOENT,
                        ..
                    },
                ..
            }) if !listed => {
                let old = self.listed_layout(slot)?;
                let mut b = Batch::new(&self.table);
                self.write_chains(&mut b, slot, &plan, old.as_ref());
                self.fill(&mut b, slot, &plan, plan.layers.len() as u32);
                self.send(b, &what)?;
                lock(&self.written).insert(slot, plan.layout());
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        lock(&self.written).insert(slot, layout);
        Ok(())
    }

    /// The batch of an update from `old`, and the layout it leaves.
    fn update_batch(&self, slot: u32, plan: &Plan, old: Option<&Layout>) -> (Batch, Layout) {
        let mut b = Batch::new(&self.table);
        let new = plan.layout();
        match old {
            // Only elements: the old layer sets beyond the new ones are emptied.
            Some(o) if o.resolved == new.resolved && o.layers >= new.layers => {
                self.fill(&mut b, slot, plan, o.layers);
                (b, o.clone())
            }
            _ => {
                self.write_chains(&mut b, slot, plan, old);
                self.fill(&mut b, slot, plan, new.layers);
                (b, new)
            }
        }
    }

    /// Allows the DNS proxy's answer to sandbox `slot`: `addrs` join the slot's resolved set
    /// of each of `limits` in one transaction; a new one times out [`RESOLVED_TIMEOUT_MS`]
    /// later, one already there keeps its timeout. With `renew`, one already there gets a
    /// fresh timeout too: the batch adds it (a no-op when present), deletes it and adds it
    /// again, which the kernel applies as one change.
    /// Errors: [`NftError::Commit`] (nothing changed), also when the slot has no set for a
    /// limit (its policy changed meanwhile).
    pub fn add_resolved(
        &self,
        slot: u32,
        limits: &[PortLimit],
        addrs: &[Ipv4Addr],
        renew: bool,
    ) -> Result<(), NftError> {
        if limits.is_empty() || addrs.is_empty() {
            return Ok(());
        }
        let elems: Vec<Elem> = addrs
            .iter()
            .map(|a| Elem::key(a.octets().to_vec()))
            .collect();
        let mut b = Batch::new(&self.table);
        for limit in limits {
            let name = resolved_set_name(slot, *limit);
            b.elements(Op::NewSetElem, &name, &elems);
            if renew {
                b.elements(Op::DelSetElem, &name, &elems);
                b.elements(Op::NewSetElem, &name, &elems);
            }
        }
        self.send(
            b,
            &format!("adding resolved addresses of sandbox slot {slot}"),
        )
    }

    /// Removes everything of sandbox `slot`; `Ok(false)` when the table held nothing of it.
    /// Errors: [`NftError`].
    pub fn detach(&self, slot: u32) -> Result<bool, NftError> {
        let known = lock(&self.written).get(&slot).cloned();
        let layout = match known {
            Some(l) => Some(l),
            None => self.listed_layout(slot)?,
        };
        let (Some(layout), Ok(addrs)) = (layout, slot_addrs(self.subnet, slot)) else {
            self.forget(slot);
            return Ok(false);
        };
        let mut b = Batch::new(&self.table);
        let ifname = ifname_key(&host_veth_name(addrs.network));
        let mut guard = ifname.clone();
        guard.extend_from_slice(&addrs.sandbox.octets());
        b.elements(Op::DestroySetElem, GUARD, &[Elem::key(guard)]);
        for map in [EGRESS, INGRESS] {
            b.elements(Op::DestroySetElem, map, &[Elem::key(ifname.clone())]);
        }
        b.destroy_chain(&out_chain(slot));
        b.destroy_chain(&in_chain(slot));
        for i in 0..layout.layers {
            b.destroy_set(&layer_set_name(slot, i));
        }
        b.destroy_set(&any_public_set_name(slot));
        for s in &layout.resolved {
            b.destroy_set(s);
        }
        self.send(b, &format!("removing sandbox slot {slot}"))?;
        self.forget(slot);
        Ok(true)
    }

    /// The slots the table holds chains for, sorted: what the edge's cleanup compares with
    /// its sandboxes. Empty when there is no table.
    /// Errors: [`NftError::Apply`].
    pub fn slots(&self) -> Result<Vec<u32>, NftError> {
        let mut out: BTreeSet<u32> = BTreeSet::new();
        for c in self.chain_names()? {
            if let Some(n) = c.strip_prefix("out-").or_else(|| c.strip_prefix("in-")) {
                if let Ok(n) = n.parse() {
                    out.insert(n);
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Runs listing `f` again while the kernel interrupts it: a dump that another change to
    /// the ruleset overtook (another sandbox of the edge created or stopped meanwhile) is
    /// flagged and must be read again from the start.
    fn dump<T>(
        &self,
        f: impl Fn() -> Result<T, rustables::error::QueryError>,
    ) -> Result<T, rustables::error::QueryError> {
        use rustables::error::{DecodeError, QueryError};
        let mut tries = 0;
        loop {
            match f() {
                Err(QueryError::ProcessNetlinkError(DecodeError::ConcurrentGenerationUpdate))
                    if tries < MAX_DUMP_TRIES =>
                {
                    tries += 1;
                    std::thread::yield_now();
                }
                r => return r,
            }
        }
    }

    fn chain_names(&self) -> Result<Vec<String>, NftError> {
        if !self.exists()? {
            return Ok(Vec::new());
        }
        let chains = self
            .dump(|| rustables::list_chains_for_table(&self.table()))
            .map_err(self.apply_err("listing chains"))?;
        Ok(chains
            .iter()
            .filter_map(|c| c.get_name().cloned())
            .collect())
    }

    /// The names of every set of the table, read again while changes interrupt the listing.
    fn set_names(&self) -> Result<Vec<String>, NftError> {
        let req = nfmsg::list_sets_request(&self.table);
        let mut tries = 0;
        loop {
            match self.sock.dump(&req) {
                Ok(msgs) => {
                    return Ok(msgs
                        .iter()
                        .filter(|m| nfmsg::string_attr(m, 1).as_deref() == Some(&self.table))
                        .filter_map(|m| nfmsg::string_attr(m, 2))
                        .collect())
                }
                Err(BatchError::Interrupted) if tries < MAX_DUMP_TRIES => tries += 1,
                // No table, no sets.
                Err(BatchError::Refused {
                    errno: nix::errno::Errno::ENOENT,
                    ..
                }) => return Ok(Vec::new()),
                Err(source) => {
                    return Err(NftError::Commit {
                        table: self.table.clone(),
                        what: "listing sets".into(),
                        source,
                    })
                }
            }
        }
    }

    /// The layout of slot `slot` as the table's sets show it (every slot with a `*` set has
    /// chains); `None` when the table holds nothing of the slot. One listing teaches the
    /// layout of every slot: the slots not known yet are remembered.
    fn listed_layout(&self, slot: u32) -> Result<Option<Layout>, NftError> {
        let mut found: HashMap<u32, Layout> = HashMap::new();
        for name in self.set_names()? {
            let mut parts = name.splitn(3, '-');
            let (kind, n, rest) = (parts.next(), parts.next(), parts.next());
            let Some(n) = n.and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            match (kind, rest) {
                (Some("s"), None) => {
                    found.entry(n).or_default();
                }
                (Some("x"), Some(_)) => found.entry(n).or_default().layers += 1,
                (Some("dns"), Some(_)) => {
                    found.entry(n).or_default().resolved.insert(name.clone());
                }
                _ => {}
            }
        }
        let this = found.remove(&slot);
        let mut w = lock(&self.written);
        for (n, l) in found {
            w.entry(n).or_insert(l);
        }
        Ok(this)
    }

    /// Into `b`: creates the sets of `plan`, creates (or empties) `out-<slot>` and
    /// `in-<slot>` and writes the rules for `plan`'s layout into them, and deletes the sets
    /// of `old` the new rules no longer use.
    fn write_chains(&self, b: &mut Batch, slot: u32, plan: &Plan, old: Option<&Layout>) {
        let layers = plan.layers.len() as u32;
        for i in 0..layers {
            b.add_set(&layer_set_name(slot, i), &box_set());
        }
        b.add_set(&any_public_set_name(slot), &box_set());
        for (_, name) in &plan.resolved {
            b.add_set(name, &resolved_set());
        }
        for (dir, name) in [(Dir::Out, out_chain(slot)), (Dir::In, in_chain(slot))] {
            b.add_chain(&name);
            b.flush_chain(&name);
            for r in sandbox_rules(slot, dir, layers, &plan.resolved) {
                r.add(b, &name);
            }
        }
        if let Some(old) = old {
            for i in layers..old.layers {
                b.destroy_set(&layer_set_name(slot, i));
            }
            for s in &old.resolved {
                if !plan.resolved.iter().any(|(_, n)| n == s) {
                    b.destroy_set(s);
                }
            }
        }
    }

    /// Into `b`: empties the first `layers` layer sets and the `*` set of `slot`, and fills
    /// them with `plan`'s boxes.
    fn fill(&self, b: &mut Batch, slot: u32, plan: &Plan, layers: u32) {
        for i in 0..layers {
            let name = layer_set_name(slot, i);
            b.flush_set(&name);
            if let Some(boxes) = plan.layers.get(i as usize) {
                let elems: Vec<Elem> = boxes.iter().map(Box3::elem).collect();
                b.elements(Op::NewSetElem, &name, &elems);
            }
        }
        let name = any_public_set_name(slot);
        b.flush_set(&name);
        let elems: Vec<Elem> = plan.any_public.iter().map(Box3::elem).collect();
        b.elements(Op::NewSetElem, &name, &elems);
    }
}

/// The rules of a sandbox's chain, in the order of docs/network.md "Enforcement": accept what
/// the `layers` layer sets hold (the policy's addresses and networks, private ones included,
/// with their port limits); drop every private, link-local and multicast destination; accept
/// what the `*` set holds; accept what the DNS proxy resolved into `resolved` (each under its
/// port limit). What none matches falls off the end and is dropped by the caller. `Dir::In`
/// is the same from the replies' side: source address and port instead of destination.
fn sandbox_rules(slot: u32, dir: Dir, layers: u32, resolved: &[(PortLimit, String)]) -> Vec<R> {
    let source = dir == Dir::In;
    let mut out = Vec::new();
    if dir == Dir::In {
        // ICMP errors about a connection the sandbox opened (fragmentation needed, a host
        // unreachable) come from whichever router saw the packet, from no port: without this
        // a port limit would drop them, and path MTU discovery with them. Conntrack marks
        // only such errors `related` in ICMP; they carry no new connection.
        out.push(
            R::new()
                .ipv4()
                .l4proto(libc::IPPROTO_ICMP as u8)
                .ct_state(CT_RELATED)
                .accept(),
        );
    }
    for i in 0..layers {
        out.push(R::new().in_boxes(source, &layer_set_name(slot, i)).accept());
    }
    out.push(
        R::new()
            .ipv4()
            .load_addr(source, R0)
            .e(Expr::lookup(PRIVATE, R0, None))
            .drop(),
    );
    out.push(
        R::new()
            .in_boxes(source, &any_public_set_name(slot))
            .accept(),
    );
    for (limit, name) in resolved {
        let base = R::new()
            .ipv4()
            .load_addr(source, R0)
            .e(Expr::lookup(name, R0, None));
        // One rule per protocol a limit allows (both for a limit without `/tcp` or `/udp`).
        match *limit {
            PortLimit::Any => out.push(base.accept()),
            PortLimit::Ports(r, Some(p)) => out.push(base.port(p, source, r.lo(), r.hi()).accept()),
            PortLimit::Ports(r, None) => {
                for p in [Proto::Tcp, Proto::Udp] {
                    out.push(base.clone().port(p, source, r.lo(), r.hi()).accept());
                }
            }
        }
    }
    out
}
