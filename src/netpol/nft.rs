//! Enforcement (docs/network.md "Enforcement"): the edge's nftables table, written over
//! netlink with rustables, one batch (one kernel transaction) per change. No `nft` command
//! runs: it rereads the whole ruleset each time, which costs 100–300 ms with thousands of
//! sandboxes, while a sandbox's change here touches only its own chains.
//!
//! # The table
//!
//! One `inet` table per edge, `opendsec-<edge id>`. Its hooked chains hold only fixed rules
//! and are rewritten whole (flush + add, atomically) by [`Firewall::install_base`] at every
//! edge start; everything per sandbox lives in regular chains that a restart leaves alone,
//! so running sandboxes keep their rules while the edge is down. `V` is the edge's
//! [`veth_prefix`] (its host-side veths, `odsv0a58*` for 10.88.0.0/16), `N` a slot:
//!
//! ```text
//! pre      filter prerouting -150  iifname V* jump guard; iifname V* drop;
//!                                  ip saddr <subnet> iifname != V* iifname != lo drop
//! guard                            iifname odsv<N> ip saddr <sandbox N> accept   (per sandbox)
//! pre-nat  nat prerouting -100     iifname V* jump dns
//! dns                              iifname odsv<N> udp|tcp dport 53 dnat ip to <gateway N>:<dns_port>
//! fwd      filter forward 0        oifname V* jump ingress; oifname V* drop;
//!                                  iifname V* jump egress; iifname V* drop
//! egress                           iifname odsv<N> goto out-<N>                  (per sandbox)
//! ingress                          oifname odsv<N> ct state established,related goto in-<N>
//! in       filter input 0          iifname V* udp|tcp dport <dns_port> accept; iifname V* drop;
//!                                  udp|tcp dport <dns_port> drop
//! out      filter output 0         oifname V* ct state established,related accept; oifname V* drop
//! post-nat nat postrouting 100     ip saddr <subnet> oifname != V* masquerade
//! ```
//!
//! - A packet from a sandbox whose source is not its own address matches no `guard` rule and
//!   is dropped, before NAT or routing (forged sources; IPv6, which sandboxes do not have).
//! - DNS to any address is sent to the edge's DNS proxy on the gateway; nothing else of the
//!   host answers a sandbox (`in`), and the host opens nothing into one (`out`).
//! - A sandbox's own `out-<N>` chain decides every packet it sends, established connections
//!   included, in the order of [`sandbox_rules`]; falling off its end returns to `fwd`, which
//!   drops. `in-<N>` is the same policy seen from the replies (source address and port), so
//!   taking a rule back stops a connection in both directions at once; it first accepts the
//!   ICMP errors conntrack relates to the sandbox's connections (path MTU discovery needs
//!   them, and they come from no port a limit names). New connections into
//!   a sandbox never match `ingress` and are dropped, and `fwd` checks that before the
//!   sender's chain, whose accept would otherwise end the evaluation: a sandbox whose rules
//!   allow its neighbours' addresses (`10.0.0.0/8`) still cannot open a connection to one.
//! - Per sandbox, one set per port limit of its domain rules (`dns-<N>-<limit>`, IPv4
//!   addresses, one-hour timeout) holds what the DNS proxy resolved for it.
//!
//! Rules of the shared chains (`guard`, `dns`, `egress`, `ingress`) carry their slot in their
//! user data (`slot <N>`), which is how [`Firewall::detach`] finds them.

use rustables::expr::{
    Bitwise, Cmp, CmpOp, Conntrack, ConntrackKey, ExpressionVariant, HighLevelPayload,
    IPv4HeaderField, Immediate, Lookup, Masquerade, Meta, MetaType, Nat, NatType,
    NetworkHeaderField, Register, TCPHeaderField, TransportHeaderField, UDPHeaderField,
    VerdictKind,
};
use rustables::{
    Batch, Chain, ChainPolicy, ChainType, Hook, HookClass, MsgType, ProtocolFamily, Rule, Set,
    Table,
};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::nlbatch::{BatchError, BatchSocket};

use super::slot::{host_veth_name, veth_prefix, SlotAddrs};
use super::Policy;
use super::{Ipv4Net, PortLimit, Proto, PRIVATE_RANGES};

/// How long an address the DNS proxy resolved stays allowed after it was last added, in ms.
pub const RESOLVED_TIMEOUT_MS: u64 = 3_600_000;

/// `NFT_SET_TIMEOUT`: elements expire.
const NFT_SET_TIMEOUT: u32 = 0x10;
/// `nf_conntrack` states, as `ct state` reads them (host byte order).
const CT_ESTABLISHED: u32 = 1 << 1;
const CT_RELATED: u32 = 1 << 2;
/// How often a listing the kernel interrupted is started again before its error is returned.
const MAX_DUMP_TRIES: u32 = 50;
/// The port sandboxes send DNS to.
const DNS_PORT: u16 = 53;

/// A change to the table that failed. No batch is applied in part: the table is as before.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// A rule or object could not be built (a name too long for the kernel).
    #[error("nftables table {table}: building {what}: {source}")]
    Build {
        table: String,
        what: String,
        #[source]
        source: rustables::error::BuilderError,
    },
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
    /// The resolved sets last written per slot, so that an update need not list the slot's
    /// chain: a listing opens a socket of its own, whose close waits for an RCU grace period
    /// once an earlier change deleted something (docs/benchmarks.md "Network").
    written: Arc<std::sync::Mutex<HashMap<u32, BTreeSet<String>>>>,
    /// The slots the table may hold something of: learned by one listing at the first
    /// attach, then kept up to date by attach (before it sends) and detach (after). A slot
    /// outside it is attached without listing the shared chains, which costs time in
    /// proportion to the sandboxes on the edge.
    present: Arc<std::sync::Mutex<Option<BTreeSet<u32>>>>,
}

/// Which way a packet goes, for the rules of a sandbox's policy: what it sends (matched on
/// destination address and port) or the replies it gets (source address and port).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Out,
    In,
}

/// One rule under construction: rustables' [`Rule`] and the few matches we need.
struct R(Rule);

impl R {
    fn new(chain: &Chain) -> Result<R, rustables::error::BuilderError> {
        Ok(R(Rule::new(chain)?))
    }
    fn e(mut self, e: impl Into<rustables::expr::RawExpression>) -> R {
        self.0.add_expr(e);
        self
    }
    /// `iifname`/`oifname` equal to `name` (exact) or starting with it (`prefix`).
    fn ifname(self, input: bool, name: &str, prefix: bool, op: CmpOp) -> R {
        let mut bytes = name.as_bytes().to_vec();
        if !prefix {
            bytes.push(0);
        }
        self.e(Meta::new(if input {
            MetaType::IifName
        } else {
            MetaType::OifName
        }))
        .e(Cmp::new(op, bytes))
    }
    fn iif(self, name: &str) -> R {
        self.ifname(true, name, false, CmpOp::Eq)
    }
    fn oif(self, name: &str) -> R {
        self.ifname(false, name, false, CmpOp::Eq)
    }
    fn iif_prefix(self, p: &str) -> R {
        self.ifname(true, p, true, CmpOp::Eq)
    }
    fn oif_prefix(self, p: &str) -> R {
        self.ifname(false, p, true, CmpOp::Eq)
    }
    fn ipv4(self) -> R {
        self.e(Meta::new(MetaType::NfProto))
            .e(Cmp::new(CmpOp::Eq, [libc::NFPROTO_IPV4 as u8]))
    }
    /// `ip saddr|daddr` in `net` (`/0` matches every IPv4 packet).
    fn addr(self, source: bool, net: Ipv4Net) -> Result<R, rustables::error::BuilderError> {
        let r = self.ipv4();
        if net.prefix() == 0 {
            return Ok(r);
        }
        let r = r.e(
            HighLevelPayload::Network(NetworkHeaderField::IPv4(if source {
                IPv4HeaderField::Saddr
            } else {
                IPv4HeaderField::Daddr
            }))
            .build(),
        );
        let r = if net.prefix() < 32 {
            r.e(Bitwise::new(net.netmask().octets(), [0u8; 4])?)
        } else {
            r
        };
        Ok(r.e(Cmp::new(CmpOp::Eq, net.addr().octets())))
    }
    /// `meta l4proto tcp|udp`, and its port (`sport` or `dport`) in `lo..=hi`.
    fn port(self, proto: Proto, source: bool, lo: u16, hi: u16) -> R {
        let (num, field) = match proto {
            Proto::Tcp => (
                libc::IPPROTO_TCP,
                TransportHeaderField::Tcp(if source {
                    TCPHeaderField::Sport
                } else {
                    TCPHeaderField::Dport
                }),
            ),
            Proto::Udp => (
                libc::IPPROTO_UDP,
                TransportHeaderField::Udp(if source {
                    UDPHeaderField::Sport
                } else {
                    UDPHeaderField::Dport
                }),
            ),
        };
        let r = self
            .e(Meta::new(MetaType::L4Proto))
            .e(Cmp::new(CmpOp::Eq, [num as u8]))
            .e(HighLevelPayload::Transport(field).build());
        if lo == hi {
            r.e(Cmp::new(CmpOp::Eq, lo.to_be_bytes()))
        } else {
            // Network byte order compares like the numbers.
            r.e(Cmp::new(CmpOp::Gte, lo.to_be_bytes()))
                .e(Cmp::new(CmpOp::Lte, hi.to_be_bytes()))
        }
    }
    /// `ct state` one of `states` (a mask of `CT_*`).
    fn ct_state(self, states: u32) -> Result<R, rustables::error::BuilderError> {
        Ok(self
            .e(Conntrack::new(ConntrackKey::State))
            .e(Bitwise::new(states.to_ne_bytes(), 0u32.to_ne_bytes())?)
            .e(Cmp::new(CmpOp::Neq, 0u32.to_ne_bytes())))
    }
    fn established(self) -> Result<R, rustables::error::BuilderError> {
        self.ct_state(CT_ESTABLISHED | CT_RELATED)
    }
    fn verdict(self, v: VerdictKind) -> R {
        self.e(Immediate::new_verdict(v))
    }
    fn accept(self) -> R {
        self.verdict(VerdictKind::Accept)
    }
    fn drop(self) -> R {
        self.verdict(VerdictKind::Drop)
    }
    fn tag(mut self, slot: u32) -> R {
        self.0.set_userdata(slot_tag(slot));
        self
    }
    fn add(self, b: &mut Batch) {
        b.add(&self.0, MsgType::Add);
    }
}

fn slot_tag(slot: u32) -> Vec<u8> {
    format!("slot {slot}").into_bytes()
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

fn out_chain(slot: u32) -> String {
    format!("out-{slot}")
}
fn in_chain(slot: u32) -> String {
    format!("in-{slot}")
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

    fn present(&self) -> std::sync::MutexGuard<'_, Option<BTreeSet<u32>>> {
        match self.present.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Whether the table may hold something of `slot`, listing the table the first time.
    /// Marks the slot as holding something from now on (the caller is about to write it).
    fn may_hold_then_mark(&self, slot: u32) -> Result<bool, NftError> {
        if self.present().is_none() {
            let listed: BTreeSet<u32> = self.slots()?.into_iter().collect();
            self.present().get_or_insert(listed);
        }
        let mut g = self.present();
        let set = g.get_or_insert_with(BTreeSet::new);
        Ok(!set.insert(slot))
    }

    fn written(&self) -> std::sync::MutexGuard<'_, HashMap<u32, BTreeSet<String>>> {
        match self.written.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The table's name.
    pub fn table_name(&self) -> &str {
        &self.table
    }

    fn table(&self) -> Table {
        Table::new(ProtocolFamily::Inet).with_name(&self.table)
    }

    fn chain(&self, t: &Table, name: &str) -> Chain {
        Chain::new(t).with_name(name)
    }

    fn build_err(&self, what: &str) -> impl FnOnce(rustables::error::BuilderError) -> NftError {
        let (table, what) = (self.table.clone(), what.to_string());
        move |source| NftError::Build {
            table,
            what,
            source,
        }
    }

    fn send(&self, b: Batch, what: &str) -> Result<(), NftError> {
        self.sock
            .send(b.finalize())
            .map_err(|source| NftError::Commit {
                table: self.table.clone(),
                what: what.to_string(),
                source,
            })
    }

    /// Creates the table and its regular chains if missing, and rewrites its hooked chains
    /// (module doc) in one transaction: what a restarted edge runs before adopting its
    /// sandboxes, whose own rules it leaves in place.
    /// Errors: [`NftError`] (nothing changed).
    pub fn install_base(&self) -> Result<(), NftError> {
        let be = |w: &str| self.build_err(w);
        let t = self.table();
        let mut b = Batch::new();
        b.add(&t, MsgType::Add);
        for name in ["guard", "dns", "egress", "ingress"] {
            b.add(&self.chain(&t, name), MsgType::Add);
        }
        let hooked = |name: &str, class: HookClass, prio: i32, ty: ChainType| {
            self.chain(&t, name)
                .with_hook(Hook::new(class, prio))
                .with_type(ty)
                .with_policy(ChainPolicy::Accept)
        };
        let pre = hooked("pre", HookClass::PreRouting, -150, ChainType::Filter);
        let pre_nat = hooked("pre-nat", HookClass::PreRouting, -100, ChainType::Nat);
        let fwd = hooked("fwd", HookClass::Forward, 0, ChainType::Filter);
        let input = hooked("in", HookClass::In, 0, ChainType::Filter);
        let output = hooked("out", HookClass::Out, 0, ChainType::Filter);
        let post_nat = hooked("post-nat", HookClass::PostRouting, 100, ChainType::Nat);
        for c in [&pre, &pre_nat, &fwd, &input, &output, &post_nat] {
            b.add(c, MsgType::Add);
            // A rule without a handle deletes every rule of its chain.
            b.add(&Rule::new(c).map_err(be("flushing a chain"))?, MsgType::Del);
        }
        let p = self.prefix.as_str();
        let jump = |c: &str| VerdictKind::Jump { chain: c.into() };
        let new = |c: &Chain| R::new(c).map_err(be("a base rule"));
        new(&pre)?.iif_prefix(p).verdict(jump("guard")).add(&mut b);
        new(&pre)?.iif_prefix(p).drop().add(&mut b);
        // A sandbox's address arriving on any other interface is forged: the DNS proxy
        // would take it for that sandbox. The host itself reaches its gateway addresses
        // over lo.
        new(&pre)?
            .addr(true, self.subnet)
            .map_err(be("a base rule"))?
            .ifname(true, p, true, CmpOp::Neq)
            .ifname(true, "lo", false, CmpOp::Neq)
            .drop()
            .add(&mut b);
        new(&pre_nat)?
            .iif_prefix(p)
            .verdict(jump("dns"))
            .add(&mut b);
        // Towards a sandbox first: a packet from one sandbox to another must pass the
        // receiver's check (never a new connection) before the sender's rules can accept it.
        new(&fwd)?
            .oif_prefix(p)
            .verdict(jump("ingress"))
            .add(&mut b);
        new(&fwd)?.oif_prefix(p).drop().add(&mut b);
        new(&fwd)?.iif_prefix(p).verdict(jump("egress")).add(&mut b);
        new(&fwd)?.iif_prefix(p).drop().add(&mut b);
        for proto in [Proto::Udp, Proto::Tcp] {
            new(&input)?
                .iif_prefix(p)
                .port(proto, false, self.dns_port, self.dns_port)
                .accept()
                .add(&mut b);
        }
        new(&input)?.iif_prefix(p).drop().add(&mut b);
        // The proxy listens on every address; it is for sandboxes only.
        for proto in [Proto::Udp, Proto::Tcp] {
            new(&input)?
                .port(proto, false, self.dns_port, self.dns_port)
                .drop()
                .add(&mut b);
        }
        new(&output)?
            .oif_prefix(p)
            .established()
            .map_err(be("a base rule"))?
            .accept()
            .add(&mut b);
        new(&output)?.oif_prefix(p).drop().add(&mut b);
        new(&post_nat)?
            .addr(true, self.subnet)
            .map_err(be("a base rule"))?
            .ifname(false, p, true, CmpOp::Neq)
            .e(Masquerade::default())
            .add(&mut b);
        self.send(b, "installing the base chains")
    }

    /// Deletes the whole table (every sandbox's rules with it); `Ok(false)` when there was
    /// none. For an edge that turns networking off, and tests.
    /// Errors: [`NftError::Apply`].
    pub fn remove(&self) -> Result<bool, NftError> {
        if !self.exists()? {
            return Ok(false);
        }
        let mut b = Batch::new();
        b.add(&self.table(), MsgType::Del);
        self.send(b, "deleting the table")?;
        self.written().clear();
        *self.present() = Some(BTreeSet::new());
        Ok(true)
    }

    fn exists(&self) -> Result<bool, NftError> {
        let tables = self
            .dump(rustables::list_tables)
            .map_err(|source| NftError::Apply {
                table: self.table.clone(),
                what: "listing tables".into(),
                source,
            })?;
        // Our name is ours in every family; only the inet one is ever made.
        Ok(tables.iter().any(|t| t.get_name() == Some(&self.table)))
    }

    /// Adds sandbox `addrs` with `policy`: its chains and sets (module doc) and its rules in
    /// the shared chains, in one transaction, replacing whatever the table held for the slot
    /// (so adopting a sandbox after a restart is the same call).
    /// Errors: [`NftError`] (nothing changed).
    pub fn attach(&self, addrs: &SlotAddrs, policy: &Policy) -> Result<(), NftError> {
        let slot = addrs.slot;
        let be = |w: &str| self.build_err(w);
        let t = self.table();
        let mut b = Batch::new();
        let old = if self.may_hold_then_mark(slot)? {
            self.slot_objects(slot)?
        } else {
            SlotObjects::default()
        };
        self.delete_shared_rules(&mut b, &old);
        let sets = self.write_policy(&mut b, &t, slot, policy, &old.sets)?;
        let veth = host_veth_name(addrs.network);
        let new = |c: &str| R::new(&self.chain(&t, c)).map_err(be("a sandbox's rule"));
        new("guard")?
            .iif(&veth)
            .addr(true, Ipv4Net::host(addrs.sandbox))
            .map_err(be("a sandbox's rule"))?
            .accept()
            .tag(slot)
            .add(&mut b);
        for proto in [Proto::Udp, Proto::Tcp] {
            new("dns")?
                .iif(&veth)
                .port(proto, false, DNS_PORT, DNS_PORT)
                .e(Immediate::new_data(
                    addrs.gateway.octets().to_vec(),
                    Register::Reg1,
                ))
                .e(Immediate::new_data(
                    self.dns_port.to_be_bytes().to_vec(),
                    Register::Reg2,
                ))
                .e(Nat::default()
                    .with_nat_type(NatType::DNat)
                    .with_family(ProtocolFamily::Ipv4)
                    .with_ip_register(Register::Reg1)
                    .with_port_register(Register::Reg2))
                .tag(slot)
                .add(&mut b);
        }
        new("egress")?
            .iif(&veth)
            .verdict(VerdictKind::Goto {
                chain: out_chain(slot),
            })
            .tag(slot)
            .add(&mut b);
        new("ingress")?
            .oif(&veth)
            .established()
            .map_err(be("a sandbox's rule"))?
            .verdict(VerdictKind::Goto {
                chain: in_chain(slot),
            })
            .tag(slot)
            .add(&mut b);
        self.send(b, &format!("adding sandbox slot {slot}"))?;
        self.written().insert(slot, sets);
        Ok(())
    }

    /// Replaces the policy of attached sandbox `slot` (its `out-`/`in-` chains and resolved
    /// sets) in one transaction: what `UpdateNetwork` runs. Addresses already resolved under a
    /// port limit the new policy still has are kept.
    /// Errors: [`NftError`] (nothing changed).
    pub fn update(&self, slot: u32, policy: &Policy) -> Result<(), NftError> {
        let t = self.table();
        let known = self.written().get(&slot).cloned();
        let listed = known.is_none();
        let old = match known {
            Some(s) => s,
            None => self.sets_of(slot)?,
        };
        let what = format!("updating sandbox slot {slot}");
        let mut b = Batch::new();
        let sets = self.write_policy(&mut b, &t, slot, policy, &old)?;
        match self.send(b, &what) {
            Ok(()) => {}
            // What was written is not what the table holds (someone removed a set): the
            // table's own word, then.
            Err(NftError::Commit {
                source:
                    BatchError::Refused {
                        errno: nix::errno::Errno::ENOENT,
                        ..
                    },
                ..
            }) if !listed => {
                let old = self.sets_of(slot)?;
                let mut b = Batch::new();
                let again = self.write_policy(&mut b, &t, slot, policy, &old)?;
                self.send(b, &what)?;
                self.written().insert(slot, again);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        self.written().insert(slot, sets);
        Ok(())
    }

    /// Allows the DNS proxy's answer to sandbox `slot`: `addrs` join the slot's resolved set
    /// of each of `limits` in one transaction; a new one times out [`RESOLVED_TIMEOUT_MS`]
    /// later, one already there keeps its timeout. With `renew`, one already there gets a
    /// fresh timeout too: the batch adds it (a no-op when present), deletes it and adds it
    /// again, which the kernel applies as one change. A renewal costs an RCU grace period
    /// (milliseconds) when the netlink socket closes, because it deleted something; a plain
    /// add does not.
    /// Errors: [`NftError::Apply`] (nothing changed), also when the slot has no set for a
    /// limit (its policy changed meanwhile).
    pub fn add_resolved(
        &self,
        slot: u32,
        limits: &[PortLimit],
        addrs: &[std::net::Ipv4Addr],
        renew: bool,
    ) -> Result<(), NftError> {
        if limits.is_empty() || addrs.is_empty() {
            return Ok(());
        }
        let t = self.table();
        let mut b = Batch::new();
        for limit in limits {
            let name = resolved_set_name(slot, *limit);
            let mut sb = rustables::set::SetBuilder::<std::net::Ipv4Addr>::new(&name, &t)
                .map_err(self.build_err("a resolved set's elements"))?;
            for a in addrs {
                sb.add(a);
            }
            let (_, elements) = sb.finish();
            b.add(&elements, MsgType::Add);
            if renew {
                b.add(&elements, MsgType::Del);
                b.add(&elements, MsgType::Add);
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
        let old = self.slot_objects(slot)?;
        if old.is_empty() {
            self.written().remove(&slot);
            if let Some(p) = self.present().as_mut() {
                p.remove(&slot);
            }
            return Ok(false);
        }
        let be = |w: &str| self.build_err(w);
        let t = self.table();
        let mut b = Batch::new();
        self.delete_shared_rules(&mut b, &old);
        for name in [out_chain(slot), in_chain(slot)] {
            if old.chains.contains(&name) {
                let c = self.chain(&t, &name);
                b.add(
                    &Rule::new(&c).map_err(be("flushing a chain"))?,
                    MsgType::Del,
                );
                b.add(&c, MsgType::Del);
            }
        }
        for s in &old.sets {
            b.add(&self.set(&t, s), MsgType::Del);
        }
        self.send(b, &format!("removing sandbox slot {slot}"))?;
        self.written().remove(&slot);
        if let Some(p) = self.present().as_mut() {
            p.remove(&slot);
        }
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
        for r in self.shared_rules()?.into_iter().filter_map(|(_, r)| r) {
            out.insert(r);
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
            .map_err(|source| NftError::Apply {
                table: self.table.clone(),
                what: "listing chains".into(),
                source,
            })?;
        Ok(chains
            .iter()
            .filter_map(|c| c.get_name().cloned())
            .collect())
    }

    fn list_rules(&self, chain: &str) -> Result<Vec<Rule>, NftError> {
        let t = self.table();
        let c = self.chain(&t, chain);
        self.dump(|| rustables::list_rules_for_chain(&c))
            .map_err(|source| NftError::Apply {
                table: self.table.clone(),
                what: format!("listing chain {chain}"),
                source,
            })
    }

    /// Every rule of the shared chains with the slot its tag names (`None` untagged).
    fn shared_rules(&self) -> Result<Vec<(Rule, Option<u32>)>, NftError> {
        if !self.exists()? {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for chain in ["guard", "dns", "egress", "ingress"] {
            for r in self.list_rules(chain)? {
                let slot = r
                    .get_userdata()
                    .and_then(|u| std::str::from_utf8(u).ok())
                    .and_then(|u| u.strip_prefix("slot "))
                    .and_then(|n| n.parse().ok());
                out.push((r, slot));
            }
        }
        Ok(out)
    }

    /// The names of the sets `out-<slot>` looks up (the slot's resolved sets).
    fn sets_of(&self, slot: u32) -> Result<BTreeSet<String>, NftError> {
        let mut out = BTreeSet::new();
        for r in self.list_rules(&out_chain(slot))? {
            for e in r.get_expressions().into_iter().flat_map(|l| l.iter()) {
                if let Some(ExpressionVariant::Lookup(l)) = e.get_data() {
                    if let Some(s) = l.get_set() {
                        out.insert(s.clone());
                    }
                }
            }
        }
        Ok(out)
    }

    fn slot_objects(&self, slot: u32) -> Result<SlotObjects, NftError> {
        let chains: BTreeSet<String> = self
            .chain_names()?
            .into_iter()
            .filter(|c| *c == out_chain(slot) || *c == in_chain(slot))
            .collect();
        let sets = if chains.contains(&out_chain(slot)) {
            self.sets_of(slot)?
        } else {
            BTreeSet::new()
        };
        let rules = self
            .shared_rules()?
            .into_iter()
            .filter(|(_, s)| *s == Some(slot))
            .map(|(r, _)| r)
            .collect();
        Ok(SlotObjects {
            chains,
            sets,
            rules,
        })
    }

    fn delete_shared_rules(&self, b: &mut Batch, old: &SlotObjects) {
        for r in &old.rules {
            // Listed rules carry their table, chain and handle: what a deletion needs.
            b.add(r, MsgType::Del);
        }
    }

    fn set(&self, t: &Table, name: &str) -> Set {
        let mut s = Set::default()
            .with_table(t.get_name().cloned().unwrap_or_default())
            .with_name(name);
        s.family = ProtocolFamily::Inet;
        s
    }

    /// Into `b`: creates (or empties) `out-<slot>` and `in-<slot>` and writes the policy's
    /// rules into them, creating the resolved sets it needs and deleting those of `old_sets`
    /// it no longer uses. Returns the names of the sets the policy has.
    fn write_policy(
        &self,
        b: &mut Batch,
        t: &Table,
        slot: u32,
        policy: &Policy,
        old_sets: &BTreeSet<String>,
    ) -> Result<BTreeSet<String>, NftError> {
        let be = |w: &str| self.build_err(w);
        let limits = resolved_limits(policy);
        let sets: Vec<(PortLimit, String)> = limits
            .iter()
            .map(|l| (*l, resolved_set_name(slot, *l)))
            .collect();
        for (id, (_, name)) in (1u32..).zip(&sets) {
            // The kernel wants an id on every new set, unique in the batch; rules made in
            // the same batch find the set by its name (or this id).
            let mut s = self
                .set(t, name)
                .with_id(id)
                .with_key_type(7u32) // ipv4_addr
                .with_key_len(4u32)
                .with_flags(NFT_SET_TIMEOUT)
                .with_timeout(RESOLVED_TIMEOUT_MS);
            s.family = ProtocolFamily::Inet;
            b.add(&s, MsgType::Add);
        }
        for (dir, name) in [(Dir::Out, out_chain(slot)), (Dir::In, in_chain(slot))] {
            let c = self.chain(t, &name);
            b.add(&c, MsgType::Add);
            b.add(
                &Rule::new(&c).map_err(be("flushing a chain"))?,
                MsgType::Del,
            );
            for r in sandbox_rules(&c, dir, policy, &sets).map_err(be("a policy rule"))? {
                r.add(b);
            }
        }
        for old in old_sets {
            if !sets.iter().any(|(_, n)| n == old) {
                b.add(&self.set(t, old), MsgType::Del);
            }
        }
        Ok(sets.into_iter().map(|(_, n)| n).collect())
    }
}

/// What the table holds of one slot.
#[derive(Default)]
struct SlotObjects {
    chains: BTreeSet<String>,
    sets: BTreeSet<String>,
    rules: Vec<Rule>,
}

impl SlotObjects {
    fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.sets.is_empty() && self.rules.is_empty()
    }
}

/// The rules of a sandbox's chain, in the order of docs/network.md "Enforcement": accept the
/// policy's addresses and networks (private ones included, with their port limits); drop
/// every private, link-local and multicast destination; accept public destinations under
/// `*`; accept what the DNS proxy resolved into `sets` (each under its port limit). What
/// none matches falls off the end and is dropped by the caller. `Dir::In` is the same from
/// the replies' side: source address and port instead of destination.
fn sandbox_rules(
    c: &Chain,
    dir: Dir,
    policy: &Policy,
    sets: &[(PortLimit, String)],
) -> Result<Vec<R>, rustables::error::BuilderError> {
    let source = dir == Dir::In;
    let mut out = Vec::new();
    if dir == Dir::In {
        // ICMP errors about a connection the sandbox opened (fragmentation needed, a host
        // unreachable) come from whichever router saw the packet, from no port: without this
        // a port limit would drop them, and path MTU discovery with them. Conntrack marks
        // only such errors `related` in ICMP; they carry no new connection.
        out.push(
            R::new(c)?
                .ipv4()
                .e(Meta::new(MetaType::L4Proto))
                .e(Cmp::new(CmpOp::Eq, [libc::IPPROTO_ICMP as u8]))
                .ct_state(CT_RELATED)?
                .accept(),
        );
    }
    // One rule per protocol a limit allows (both for a limit without `/tcp` or `/udp`).
    let limited = |base: R, limit: PortLimit| -> Vec<R> {
        match limit {
            PortLimit::Any => vec![base],
            PortLimit::Ports(r, Some(p)) => vec![base.port(p, source, r.lo(), r.hi())],
            PortLimit::Ports(r, None) => {
                let twin = R(base.0.clone());
                vec![
                    base.port(Proto::Tcp, source, r.lo(), r.hi()),
                    twin.port(Proto::Udp, source, r.lo(), r.hi()),
                ]
            }
        }
    };
    for n in policy.nets() {
        let base = R::new(c)?.addr(source, n.net)?;
        out.extend(limited(base, n.limit).into_iter().map(R::accept));
    }
    for p in PRIVATE_RANGES {
        out.push(R::new(c)?.addr(source, p)?.drop());
    }
    for l in policy.any_public() {
        let base = R::new(c)?.ipv4();
        out.extend(limited(base, *l).into_iter().map(R::accept));
    }
    for (id, (limit, name)) in (1u32..).zip(sets) {
        let field = if source {
            IPv4HeaderField::Saddr
        } else {
            IPv4HeaderField::Daddr
        };
        let mut set = Set::default().with_name(name).with_id(id);
        set.family = ProtocolFamily::Inet;
        let base = R::new(c)?
            .ipv4()
            .e(HighLevelPayload::Network(NetworkHeaderField::IPv4(field)).build())
            .e(Lookup::new(&set)?);
        out.extend(limited(base, *limit).into_iter().map(R::accept));
    }
    Ok(out)
}
