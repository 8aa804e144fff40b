//! Sandbox networking benchmark (bench/network.sh, docs/benchmarks.md "Network"): rule
//! updates with many sandboxes on the node against the `nft` command, DNS through the edge's
//! proxy against the upstream asked directly, TCP throughput through a sandbox's chains
//! against the same veth path without them, and the steps networking adds to a creation.
//!
//!     sudo target/x86_64-unknown-linux-gnu/release/examples/netpol_bench [-sandboxes 1000]
//!         [-updates 500] [-dns-n 2000] [-iperf-secs 5] [-iperf-rounds 5] [-create-n 100]
//!         [-only update,dns,iperf,create] [-json]
//!
//! Everything runs in a world it builds and removes (tests/common/netns.rs): a fresh "host"
//! netns on a thread of its own (the edge's, holding the table `opendsec-bench`, the
//! `Network` and the DNS proxy), an "internet" netns behind one uplink with servers on
//! documentation addresses (the test upstream resolver on 192.0.2.53, iperf3 on 192.0.2.10),
//! and sandbox netns held by `unshare -n sleep` children. No packet leaves them: the host
//! netns has `lo` and the uplink only. Children (sandboxes, iperf3) are ended by their pid.
//!
//! Two phases, each peer measured in the same phase, interleaved in blocks:
//!
//! 1. The table holds one sandbox (slot 0: a real netns; `public.test`, `*:443` and the iperf3
//!    server's address allowed): DNS answer times, iperf3 rounds (its chains / a plain veth
//!    outside the edge's prefix / its own veth with the table removed), and the steps a
//!    creation adds (policy, `Network::reserve`, `resolv_conf`, `Network::attach` of a fresh
//!    netns: veth, addresses, routes, chains), with `Network::release` on the side.
//! 2. `-sandboxes` more slots (the last of the subnet) get their rules (`Firewall::attach`:
//!    chains, sets and map entries without a veth, a realistic policy each), slot 0's rules
//!    are written again, then: `Firewall::update` of random slots against `nft -f` of a file
//!    flushing and filling the same slot's sets (both policies have the same layout, so an
//!    update changes set elements only), in the same table; then DNS, iperf3 and creation
//!    again.

#[allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#[path = "../tests/common/netns.rs"]
mod netns;

#[allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#[path = "../tests/common/dns.rs"]
mod dns;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hickory_server::proto::op::{Message, Query, ResponseCode};
use hickory_server::proto::rr::{Name, RecordType};
use nix::sched::CloneFlags;
use opendsec::netpol::dns::{DnsProxy, Upstream};
use opendsec::netpol::network::Network;
use opendsec::netpol::nft::{any_public_set_name, layer_set_name};
use opendsec::netpol::{slot_addrs, ClusterRules, Firewall, LinkPlan, Policy, DEFAULT_SUBNET};
use rand::Rng;
use serde_json::{json, Value};

use netns::{SandboxNs, PUBLIC_A};

const EDGE: &str = "bench";
const DNS_PORT: u16 = 15353;
const IPERF_PORT: u16 = 5201;
/// The plain veth of the throughput peer: outside the edge's subnet and veth prefix, so no
/// chain of the table matches it.
const PLAIN_HOST_IF: &str = "odbplain0";
const PLAIN_NET: &str = "10.99.0.0/16";

/// The sandbox measured in phase 1 and 2 (DNS, iperf3).
const MAIN_RULES: &[&str] = &["public.test", "*:443", "192.0.2.10"];
/// The policies of the filled slots: a few networks (one private, with a port and protocol),
/// a domain rule with a port limit, a plain domain, `*:443`. An update switches a slot
/// between the two; they have the same domain port limits, so an update keeps its sets.
const POLICY_A: &[&str] = &[
    "192.0.2.0/24:80",
    "198.51.100.0/24",
    "10.30.0.0/16:5432/tcp",
    "github.com:443",
    "pypi.org",
    "*:443",
];
const POLICY_B: &[&str] = &[
    "192.0.2.0/24:80",
    "203.0.113.0/24:8000-8080/tcp",
    "10.30.0.0/16:5432/tcp",
    "github.com:443",
    "pypi.org",
    "*:443",
];

struct Args {
    sandboxes: u32,
    updates: usize,
    dns_n: usize,
    dns_warmup: usize,
    iperf_secs: u32,
    iperf_rounds: usize,
    create_n: usize,
    only: BTreeSet<String>,
    json: bool,
}

impl Args {
    fn parse() -> Result<Args> {
        let mut a = Args {
            sandboxes: 1000,
            updates: 500,
            dns_n: 2000,
            dns_warmup: 200,
            iperf_secs: 5,
            iperf_rounds: 5,
            create_n: 100,
            only: ["update", "dns", "iperf", "create"]
                .into_iter()
                .map(String::from)
                .collect(),
            json: false,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let name = flag.trim_start_matches('-');
            if name == "json" {
                a.json = true;
                continue;
            }
            if name == "h" || name == "help" {
                println!("{}", USAGE);
                std::process::exit(0);
            }
            let v = it
                .next()
                .ok_or_else(|| anyhow!("{flag}: needs a value\n{USAGE}"))?;
            let bad = |e: std::num::ParseIntError| anyhow!("{flag} {v}: {e}");
            match name {
                "sandboxes" => a.sandboxes = v.parse().map_err(bad)?,
                "updates" => a.updates = v.parse().map_err(bad)?,
                "dns-n" => a.dns_n = v.parse().map_err(bad)?,
                "dns-warmup" => a.dns_warmup = v.parse().map_err(bad)?,
                "iperf-secs" => a.iperf_secs = v.parse().map_err(bad)?,
                "iperf-rounds" => a.iperf_rounds = v.parse().map_err(bad)?,
                "create-n" => a.create_n = v.parse().map_err(bad)?,
                "only" => a.only = v.split(',').map(String::from).collect(),
                _ => bail!("unknown flag {flag}\n{USAGE}"),
            }
        }
        for o in &a.only {
            if !["update", "dns", "iperf", "create"].contains(&o.as_str()) {
                bail!("-only {o}: one of update, dns, iperf, create");
            }
        }
        Ok(a)
    }
    fn has(&self, what: &str) -> bool {
        self.only.contains(what)
    }
}

const USAGE: &str = "netpol_bench [-sandboxes 1000] [-updates 500] [-dns-n 2000] \
[-dns-warmup 200] [-iperf-secs 5] [-iperf-rounds 5] [-create-n 100] \
[-only update,dns,iperf,create] [-json]";

// ------------------------------------------------------------------------------ stats

/// p50 (median), p99 (nearest rank, as bench/containers.py), min, max, n; `v` in ms.
fn summary(v: &[f64]) -> Value {
    if v.is_empty() {
        return json!({});
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let nth = |p: f64| {
        let i = (((n - 1) as f64) * p).round() as usize;
        s.get(i.min(n - 1)).copied().unwrap_or(f64::NAN)
    };
    let median = if n % 2 == 1 {
        nth(0.5)
    } else {
        let hi = s.get(n / 2).copied().unwrap_or(f64::NAN);
        let lo = s.get(n / 2 - 1).copied().unwrap_or(f64::NAN);
        (hi + lo) / 2.0
    };
    json!({
        "p50": median,
        "p99": nth(0.99),
        "min": s.first(),
        "max": s.last(),
        "n": n,
    })
}

/// `v[k]` without indexing: `Null` when `v` has no `k`.
fn at<'a>(v: &'a Value, k: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    v.get(k).unwrap_or(&NULL)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

// ------------------------------------------------------------------------------ helpers

fn policy_of(rules: &[&str]) -> BTreeMap<String, bool> {
    rules.iter().map(|r| (r.to_string(), true)).collect()
}

fn resolve(rules: &[&str]) -> Result<Policy> {
    Ok(ClusterRules::default().resolve(policy_of(rules))?)
}

fn cmd(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn in_netns(pid: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["-t", pid, "-n"];
    full.extend_from_slice(args);
    cmd("nsenter", &full)
}

/// Runs `f` on a thread of its own in netns `ns` (the caller's when `None`).
fn on_thread<T: Send + 'static>(
    ns: Option<&File>,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let ns = ns.map(File::try_clone).transpose()?;
    std::thread::spawn(move || {
        if let Some(ns) = ns {
            nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).context("setns")?;
        }
        f()
    })
    .join()
    .map_err(|_| anyhow!("a measuring thread panicked"))?
}

/// A child ended by its pid (and reaped) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ------------------------------------------------------------------------------ DNS

/// `n` queries for `name` (A) to `server` from netns `ns` (the caller's when `None`), one at a
/// time over one UDP socket, after `warmup` untimed ones: each answer's time in ms. Every
/// answer must be NOERROR with at least one record and the query's id.
fn dns_times(
    ns: Option<&File>,
    server: SocketAddr,
    name: &str,
    n: usize,
    warmup: usize,
) -> Result<Vec<f64>> {
    let mut q = Message::query();
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(Name::from_ascii(name)?, RecordType::A));
    let query = q.to_vec()?;
    let name = name.to_string();
    on_thread(ns, move || {
        let sock = UdpSocket::bind(("0.0.0.0", 0))?;
        sock.connect(server)?;
        sock.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut buf = vec![0u8; 4096];
        let mut out = Vec::with_capacity(n);
        let mut query = query;
        for i in 0..(warmup + n) {
            let id = (i as u16).wrapping_mul(7919).wrapping_add(1);
            if let Some(h) = query.get_mut(0..2) {
                h.copy_from_slice(&id.to_be_bytes());
            }
            let t0 = Instant::now();
            sock.send(&query)?;
            let len = loop {
                let len = sock
                    .recv(&mut buf)
                    .with_context(|| format!("{name} from {server}: no answer"))?;
                // A late answer to an earlier query: not this one.
                if buf.get(0..2) == Some(&id.to_be_bytes()[..]) {
                    break len;
                }
            };
            let t = t0.elapsed();
            let m = Message::from_vec(buf.get(..len).unwrap_or_default())?;
            if m.metadata.response_code != ResponseCode::NoError || m.answers.is_empty() {
                bail!(
                    "{name} from {server}: {} with {} records",
                    m.metadata.response_code,
                    m.answers.len()
                );
            }
            if i >= warmup {
                out.push(ms(t));
            }
        }
        Ok(out)
    })
}

/// The three DNS measurements, in blocks of 200 in turn.
fn bench_dns(a: &Args, sb: &SandboxNs, gateway: Ipv4Addr) -> Result<Value> {
    let proxy = SocketAddr::from((gateway, 53));
    let upstream = SocketAddr::from((dns::UPSTREAM, 53));
    let mut r: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    dns_times(Some(&sb.ns), proxy, "public.test", 0, a.dns_warmup)?;
    dns_times(Some(&sb.ns), proxy, "other.test", 0, a.dns_warmup)?;
    dns_times(None, upstream, "public.test", 0, a.dns_warmup)?;
    let mut left = a.dns_n;
    while left > 0 {
        let m = left.min(200);
        left -= m;
        r.entry("proxy_domain_rule").or_default().extend(dns_times(
            Some(&sb.ns),
            proxy,
            "public.test",
            m,
            0,
        )?);
        r.entry("proxy_star_only").or_default().extend(dns_times(
            Some(&sb.ns),
            proxy,
            "other.test",
            m,
            0,
        )?);
        r.entry("upstream_direct").or_default().extend(dns_times(
            None,
            upstream,
            "public.test",
            m,
            0,
        )?);
    }
    Ok(r.into_iter()
        .map(|(k, v)| (k.to_string(), summary(&v)))
        .collect())
}

// ------------------------------------------------------------------------------ iperf3

fn iperf_gbits(client: &SandboxNs, secs: u32) -> Result<f64> {
    let secs = secs.to_string();
    let server = PUBLIC_A.to_string();
    let port = IPERF_PORT.to_string();
    let out = in_netns(
        &client.pid(),
        &[
            "iperf3", "-c", &server, "-p", &port, "-t", &secs, "-O", "1", "-J",
        ],
    )?;
    let v: Value = serde_json::from_str(&out).context("iperf3 -J")?;
    let bps = v
        .pointer("/end/sum_received/bits_per_second")
        .and_then(Value::as_f64)
        .ok_or_else(|| anyhow!("iperf3 -J: no end.sum_received: {out}"))?;
    Ok(bps / 1e9)
}

fn start_iperf_server(internet: &SandboxNs) -> Result<Proc> {
    let pid = internet.pid();
    let server = PUBLIC_A.to_string();
    let port = IPERF_PORT.to_string();
    let child = Command::new("nsenter")
        .args(["-t", &pid, "-n", "iperf3", "-s", "-B", &server, "-p", &port])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s (apt-get install -y iperf3)")?;
    let p = Proc(child);
    let want = format!("{server}:{port}");
    for _ in 0..100 {
        if in_netns(&pid, &["ss", "-Hltn"])?.contains(&want) {
            return Ok(p);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("iperf3 -s never listened on {want}")
}

/// A netns with a veth to the host outside the edge's subnet and prefix: the throughput
/// peer that no chain of the table matches.
fn plain_netns() -> Result<SandboxNs> {
    let ns = SandboxNs::start();
    let pid = ns.pid();
    cmd(
        "ip",
        &[
            "link",
            "add",
            PLAIN_HOST_IF,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &pid,
        ],
    )?;
    cmd("ip", &["addr", "add", "10.99.0.1/30", "dev", PLAIN_HOST_IF])?;
    cmd("ip", &["link", "set", PLAIN_HOST_IF, "up"])?;
    in_netns(&pid, &["ip", "addr", "add", "10.99.0.2/30", "dev", "eth0"])?;
    in_netns(&pid, &["ip", "link", "set", "eth0", "up"])?;
    in_netns(&pid, &["ip", "link", "set", "lo", "up"])?;
    in_netns(&pid, &["ip", "route", "add", "default", "via", "10.99.0.1"])?;
    Ok(ns)
}

// ------------------------------------------------------------------------------ nft peer

/// The sets an update of a slot of the bench's policies writes (both policies have one layer
/// and the same domain port limits, so an update changes elements only).
fn update_sets(slot: u32) -> [String; 2] {
    [layer_set_name(slot, 0), any_public_set_name(slot)]
}

/// The elements of set `set` as `nft list set` prints them (`a . b . c, ...`), empty when it
/// has none.
fn listed_elements(table: &str, set: &str) -> Result<String> {
    let out = cmd("nft", &["list", "set", "inet", table, set])?;
    let Some(start) = out.find("elements = {") else {
        return Ok(String::new());
    };
    let rest = &out[start + "elements = {".len()..];
    let end = rest
        .find('}')
        .ok_or_else(|| anyhow!("unterminated elements in {out}"))?;
    Ok(rest[..end].split_whitespace().collect::<Vec<_>>().join(" "))
}

/// What an operator (or an implementation shelling out to `nft`) would write to give a
/// slot a policy of the same layout: each set flushed and filled, in one `nft -f` file (one
/// transaction). The elements are those our own sets hold for the policy (`template`, listed
/// by `nft` from slot `tslot`).
struct NftTemplate {
    elements: Vec<String>,
}

impl NftTemplate {
    fn read(table: &str, tslot: u32) -> Result<NftTemplate> {
        Ok(NftTemplate {
            elements: update_sets(tslot)
                .iter()
                .map(|s| listed_elements(table, s))
                .collect::<Result<_>>()?,
        })
    }

    fn file(&self, table: &str, slot: u32) -> String {
        let mut s = String::new();
        for (set, elements) in update_sets(slot).iter().zip(&self.elements) {
            s += &format!("flush set inet {table} {set}\n");
            if !elements.is_empty() {
                s += &format!("add element inet {table} {set} {{ {elements} }}\n");
            }
        }
        s
    }
}

fn nft_file(path: &std::path::Path, text: &str) -> Result<Duration> {
    std::fs::File::create(path)?.write_all(text.as_bytes())?;
    let p = path.to_str().ok_or_else(|| anyhow!("temp path"))?;
    let t0 = Instant::now();
    cmd("nft", &["-f", p])?;
    Ok(t0.elapsed())
}

/// Rule updates of random slots of `slots`: ours (`Firewall::update`) and the `nft -f` peer,
/// in blocks of 50 in turn; each update switches the slot between policies A and B.
fn bench_updates(fw: &Firewall, slots: std::ops::RangeInclusive<u32>, n: usize) -> Result<Value> {
    let table = fw.table_name().to_string();
    let (pa, pb) = (resolve(POLICY_A)?, resolve(POLICY_B)?);
    let tmp = tempfile::Builder::new().prefix("odb-nft.").tempdir()?;
    let path = tmp.path().join("update.nft");
    // Templates from our own sets, and a check that the peer writes the same elements.
    let (s0, s1) = (*slots.start(), *slots.start() + 1);
    let ta = NftTemplate::read(&table, s0)?;
    fw.update(s1, &pb)?;
    let tb = NftTemplate::read(&table, s1)?;
    nft_file(&path, &ta.file(&table, s1))?;
    nft_file(&path, &tb.file(&table, s1))?;
    let same = NftTemplate::read(&table, s1)?.elements == tb.elements;
    fw.update(s1, &pa)?;
    let mut state: HashMap<u32, bool> = HashMap::new();
    let mut rng = rand::rng();
    let mut ours = Vec::with_capacity(n);
    let mut peer = Vec::with_capacity(n);
    let mut left = n;
    while left > 0 {
        let m = left.min(50);
        left -= m;
        for _ in 0..m {
            let slot = rng.random_range(slots.clone());
            let b = state.entry(slot).or_insert(false);
            *b = !*b;
            let p = if *b { &pb } else { &pa };
            let t0 = Instant::now();
            fw.update(slot, p)?;
            ours.push(ms(t0.elapsed()));
        }
        for _ in 0..m {
            let slot = rng.random_range(slots.clone());
            let b = state.entry(slot).or_insert(false);
            *b = !*b;
            let t = if *b { &tb } else { &ta };
            peer.push(ms(nft_file(&path, &t.file(&table, slot))?));
        }
    }
    Ok(json!({
        "ours_firewall_update": summary(&ours),
        "nft_f": summary(&peer),
        "peer_writes_the_same_elements": same,
        "nft_file_example": ta.file(&table, 123),
    }))
}

// ------------------------------------------------------------------------------ creation

/// The steps networking adds to a creation, `n` times, each for a fresh netns (made
/// untimed): the policy, `reserve`, `resolv_conf`, opening the netns, `Network::attach`;
/// then `release` (timed on its own; not on the path to the first output). Each time also a
/// second netns the same way, but with `Network::attach`'s two steps timed apart: the veth
/// (`link::attach`: pair, addresses, routes) and the chains (`Firewall::attach`).
async fn bench_create(net: &Network, n: usize) -> Result<Value> {
    let rules = policy_of(POLICY_A);
    let fw = net.firewall().clone();
    let mut added = Vec::with_capacity(n);
    let mut release = Vec::with_capacity(n);
    let mut veth = Vec::with_capacity(n);
    let mut chains = Vec::with_capacity(n);
    for _ in 0..n {
        let sb = SandboxNs::start();
        let t0 = Instant::now();
        let policy = net.policy(&rules)?;
        let slot = net.reserve()?;
        let _conf = net.resolv_conf(slot)?;
        let ns = File::open(format!("/proc/{}/ns/net", sb.pid()))?;
        net.attach(ns.as_fd(), slot, &policy).await?;
        let t1 = Instant::now();
        net.release(slot).await?;
        let t2 = Instant::now();
        added.push(ms(t1 - t0));
        release.push(ms(t2 - t1));
        drop(ns);
        drop(sb);

        let sb = SandboxNs::start();
        let policy = net.policy(&rules)?;
        let slot = net.reserve()?;
        let ns = File::open(format!("/proc/{}/ns/net", sb.pid()))?;
        let plan = LinkPlan::new(DEFAULT_SUBNET, slot)?;
        let t0 = Instant::now();
        let at = opendsec::netpol::attach(ns.as_fd(), &plan).await?;
        let t1 = Instant::now();
        let fw2 = fw.clone();
        let addrs = at.addrs;
        let t2 = tokio::task::spawn_blocking(move || -> Result<Instant> {
            fw2.attach(&addrs, &policy)?;
            Ok(Instant::now())
        })
        .await??;
        veth.push(ms(t1 - t0));
        chains.push(ms(t2 - t1));
        net.release(slot).await?;
        drop(ns);
        drop(sb);
    }
    Ok(json!({
        "added": summary(&added),
        "release": summary(&release),
        "veth": summary(&veth),
        "chains": summary(&chains),
    }))
}

// ------------------------------------------------------------------------------ the run

async fn run(a: &Args) -> Result<Value> {
    let mut res = serde_json::Map::new();
    let w = netns::world();
    let ipid = w.internet.pid();
    // Replies to the un-NATed peers (table removed, plain veth) find their way back.
    for net in ["10.88.0.0/16", PLAIN_NET] {
        in_netns(&ipid, &["ip", "route", "add", net, "via", "203.0.113.1"])?;
    }
    let _upstream_log = dns::serve_upstream(&w.internet.ns);
    let net = Arc::new(Network::start(
        EDGE,
        DEFAULT_SUBNET,
        DNS_PORT,
        ClusterRules::default(),
    )?);
    let proxy = DnsProxy::start(
        net.clone(),
        DNS_PORT,
        &Upstream::Servers(vec![SocketAddr::from((dns::UPSTREAM, 53))]),
    )
    .await?;
    let fw = net.firewall().clone();

    // The measured sandbox, slot 0.
    let main = SandboxNs::start();
    let main_policy = resolve(MAIN_RULES)?;
    let slot0 = net.reserve()?;
    let attached = net.attach(main.ns.as_fd(), slot0, &main_policy).await?;
    let gateway = attached.addrs.gateway;
    let plain = if a.has("iperf") {
        Some(plain_netns()?)
    } else {
        None
    };
    let iperf_server = if a.has("iperf") {
        Some(start_iperf_server(&w.internet)?)
    } else {
        None
    };

    // Phase 1: one sandbox in the table.
    let mut p1 = serde_json::Map::new();
    if a.has("dns") {
        p1.insert(
            "dns".into(),
            tokio::task::block_in_place(|| bench_dns(a, &main, gateway))?,
        );
    }
    if let Some(plain) = &plain {
        let addrs = slot_addrs(DEFAULT_SUBNET, slot0)?;
        let r = tokio::task::block_in_place(|| -> Result<Value> {
            let mut r: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for _ in 0..a.iperf_rounds {
                r.entry("sandbox_chains")
                    .or_default()
                    .push(iperf_gbits(&main, a.iperf_secs)?);
                r.entry("plain_veth_table_present")
                    .or_default()
                    .push(iperf_gbits(plain, a.iperf_secs)?);
                fw.remove()?;
                let bare = iperf_gbits(&main, a.iperf_secs);
                fw.install_base()?;
                fw.attach(&addrs, &main_policy)?;
                r.entry("sandbox_veth_no_table").or_default().push(bare?);
            }
            Ok(json!(r))
        })?;
        p1.insert("iperf_gbit_s".into(), r);
    }
    if a.has("create") {
        p1.insert("create".into(), bench_create(&net, a.create_n).await?);
    }
    res.insert("one_sandbox".into(), Value::Object(p1));

    // Phase 2: `sandboxes` more.
    if a.sandboxes > 0 {
        let mut p2 = serde_json::Map::new();
        let pa = resolve(POLICY_A)?;
        // The last slots of the subnet: far from those `reserve` hands out next.
        let slots = opendsec::netpol::slot_count(DEFAULT_SUBNET)?;
        if a.sandboxes > slots / 2 {
            bail!("-sandboxes {}: at most {}", a.sandboxes, slots / 2);
        }
        let first = slots - a.sandboxes;
        let last = slots - 1;
        let mut fill = Vec::new();
        let t_fill = Instant::now();
        for slot in first..=last {
            let addrs = slot_addrs(DEFAULT_SUBNET, slot)?;
            let t0 = Instant::now();
            fw.attach(&addrs, &pa)?;
            fill.push(ms(t0.elapsed()));
        }
        let fill_s = t_fill.elapsed().as_secs_f64();
        let k = fill.len().min(100);
        p2.insert(
            "fill".into(),
            json!({
                "slots": a.sandboxes,
                "total_s": fill_s,
                "attach_first_100": summary(fill.get(..k).unwrap_or_default()),
                "attach_last_100": summary(fill.get(fill.len() - k..).unwrap_or_default()),
            }),
        );
        // Slot 0's rules written last, as before the maps (when that was the longest walk).
        fw.attach(&slot_addrs(DEFAULT_SUBNET, slot0)?, &main_policy)?;
        if a.has("update") {
            let fw2 = fw.clone();
            let n = a.updates;
            let r =
                tokio::task::spawn_blocking(move || bench_updates(&fw2, first..=last, n)).await??;
            p2.insert("update".into(), r);
        }
        if a.has("dns") {
            p2.insert(
                "dns".into(),
                tokio::task::block_in_place(|| bench_dns(a, &main, gateway))?,
            );
        }
        if let Some(plain) = &plain {
            let r = tokio::task::block_in_place(|| -> Result<Value> {
                let mut r: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
                for _ in 0..a.iperf_rounds {
                    r.entry("sandbox_chains_last")
                        .or_default()
                        .push(iperf_gbits(&main, a.iperf_secs)?);
                    r.entry("plain_veth_table_present")
                        .or_default()
                        .push(iperf_gbits(plain, a.iperf_secs)?);
                }
                Ok(json!(r))
            })?;
            p2.insert("iperf_gbit_s".into(), r);
        }
        if a.has("create") {
            p2.insert(
                "create".into(),
                bench_create(&net, a.create_n.div_ceil(2)).await?,
            );
        }
        res.insert("many_sandboxes".into(), Value::Object(p2));
    }

    drop(iperf_server);
    proxy.stop().await;
    fw.remove()?;
    drop(plain);
    drop(main);
    drop(w);
    Ok(Value::Object(res))
}

/// Runs [`run`] on a thread of its own in a fresh netns, on a 2-worker runtime (the edge's
/// shape); the netns goes with the threads.
fn in_fresh_netns(a: Args) -> Result<(Args, Value)> {
    std::thread::spawn(move || -> Result<(Args, Value)> {
        nix::sched::unshare(CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let v = rt.block_on(run(&a))?;
        Ok((a, v))
    })
    .join()
    .map_err(|_| anyhow!("the benchmark's thread panicked"))?
}

// ------------------------------------------------------------------------------ output

fn first_line(program: &str, args: &[&str]) -> String {
    cmd(program, args)
        .ok()
        .and_then(|s| s.lines().next().map(String::from))
        .unwrap_or_default()
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu,
        "kernel": first_line("uname", &["-r"]),
        "nft": first_line("nft", &["--version"]),
        "iperf3": first_line("iperf3", &["--version"]),
        "commit": first_line("git", &["rev-parse", "--short", "HEAD"]),
        "date": first_line("date", &["+%Y-%m-%d %H:%M"]),
        "loadavg_start": load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    })
}

fn targets(r: &Value) -> Vec<Value> {
    let mut t = Vec::new();
    let many = r
        .pointer("/params/sandboxes")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let g = |p: &str| r.pointer(p).cloned().unwrap_or(Value::Null);
    let u = g("/many_sandboxes/update");
    if !u.is_null() {
        let o = at(&u, "ours_firewall_update");
        let (p50, p99) = (f(o, "p50"), f(o, "p99"));
        let n = at(&u, "nft_f");
        t.push(json!({
            "target": format!("rule update with {many} sandboxes: p50 < 5 ms, p99 < 20 ms"),
            "measured": format!("ours p50 {p50:.2} ms, p99 {p99:.2} ms; nft -f p50 {:.1} ms, p99 {:.1} ms",
                f(n, "p50"), f(n, "p99")),
            "met": p50 < 5.0 && p99 < 20.0,
        }));
    }
    let d = g("/one_sandbox/dns");
    if !d.is_null() {
        let dr = f(at(&d, "proxy_domain_rule"), "p50");
        let so = f(at(&d, "proxy_star_only"), "p50");
        let up = f(at(&d, "upstream_direct"), "p50");
        t.push(json!({
            "target": "DNS through the proxy, allowed cached name: p50 < 1 ms",
            "measured": format!("domain rule {dr:.3} ms, under * only {so:.3} ms; upstream direct {up:.3} ms"),
            "met": dr < 1.0 && so < 1.0,
        }));
    }
    let i = g("/one_sandbox/iperf_gbit_s");
    if !i.is_null() {
        let rounds = |k: &str| -> Vec<f64> {
            at(&i, k)
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default()
        };
        let (s, bare, plain) = (
            rounds("sandbox_chains"),
            rounds("sandbox_veth_no_table"),
            rounds("plain_veth_table_present"),
        );
        // Each round measures the three back to back: the ratio within a round is what the
        // machine's noise touches least.
        let ratio = |other: &[f64]| -> f64 {
            let r: Vec<f64> = s.iter().zip(other).map(|(a, b)| a / b).collect();
            f(&summary(&r), "p50")
        };
        let (rb, rp) = (ratio(&bare), ratio(&plain));
        let med = |v: &[f64]| f(&summary(v), "p50");
        t.push(json!({
            "target": "TCP throughput ≥ 90 % of the veth path without the sandbox's chain",
            "measured": format!(
                "medians {:.2} Gbit/s, {:.2} without the table, {:.2} on a plain veth; median of the \
                 rounds' ratios {:.0} % of no table, {:.0} % of the plain veth",
                med(&s), med(&bare), med(&plain), 100.0 * rb, 100.0 * rp),
            "met": rb >= 0.9,
        }));
    }
    let c = g("/one_sandbox/create/added");
    if !c.is_null() {
        let p50 = f(&c, "p50");
        let p50_many = f(&g("/many_sandboxes/create/added"), "p50");
        t.push(json!({
            "target": "creation: ≤ 3 ms added to the p50 (steps measured directly)",
            "measured": format!("added p50 {p50:.2} ms (one sandbox in the table), {p50_many:.2} ms with {many} more"),
            "met": p50 <= 3.0,
        }));
    }
    t
}

fn line(name: &str, s: &Value, unit: &str) -> String {
    format!(
        "  {name:<46} p50 {:9.3} {unit}   p99 {:9.3} {unit}   (n={})",
        f(s, "p50"),
        f(s, "p99"),
        s.get("n").and_then(Value::as_u64).unwrap_or(0)
    )
}

fn table(r: &Value) -> String {
    let mut out = Vec::new();
    let m = at(r, "machine");
    out.push(format!(
        "machine: {} CPUs ({}), Linux {}, {}, {}, opendsec {}, {}, load {} (at the end {})",
        at(m, "cpus"),
        at(m, "cpu").as_str().unwrap_or(""),
        at(m, "kernel").as_str().unwrap_or(""),
        at(m, "nft").as_str().unwrap_or(""),
        at(m, "iperf3").as_str().unwrap_or(""),
        at(m, "commit").as_str().unwrap_or(""),
        at(m, "date").as_str().unwrap_or(""),
        at(m, "loadavg_start").as_str().unwrap_or(""),
        at(r, "loadavg_end").as_str().unwrap_or(""),
    ));
    for (phase, title) in [
        ("one_sandbox", "one sandbox in the table"),
        ("many_sandboxes", "with the filled slots"),
    ] {
        let Some(p) = r.get(phase) else { continue };
        out.push(title.to_string());
        if let Some(fl) = p.get("fill") {
            out.push(format!(
                "  filled {} slots in {:.1} s",
                at(fl, "slots"),
                f(fl, "total_s")
            ));
            out.push(line(
                "Firewall::attach, first 100",
                at(fl, "attach_first_100"),
                "ms",
            ));
            out.push(line(
                "Firewall::attach, last 100",
                at(fl, "attach_last_100"),
                "ms",
            ));
        }
        if let Some(u) = p.get("update") {
            out.push(format!(
                "  rule update of a random slot (set elements only; peer writes the same elements: {})",
                at(u, "peer_writes_the_same_elements")
            ));
            out.push(line(
                "ours: Firewall::update",
                at(u, "ours_firewall_update"),
                "ms",
            ));
            out.push(line(
                "nft -f (flush + fill the same sets)",
                at(u, "nft_f"),
                "ms",
            ));
        }
        if let Some(d) = p.get("dns") {
            out.push("  DNS answer time (A, cached, UDP)".into());
            out.push(line(
                "proxy, name under a domain rule",
                at(d, "proxy_domain_rule"),
                "ms",
            ));
            out.push(line(
                "proxy, name under * only",
                at(d, "proxy_star_only"),
                "ms",
            ));
            out.push(line(
                "upstream asked directly from the host",
                at(d, "upstream_direct"),
                "ms",
            ));
        }
        if let Some(i) = p.get("iperf_gbit_s").and_then(Value::as_object) {
            out.push("  iperf3 TCP sandbox → test host, Gbit/s per round".into());
            for (k, v) in i {
                let vals: Vec<f64> = v
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default();
                let shown: Vec<String> = vals.iter().map(|x| format!("{x:.2}")).collect();
                out.push(format!(
                    "  {k:<46} median {:6.2}   [{}]",
                    f(&summary(&vals), "p50"),
                    shown.join(", ")
                ));
            }
        }
        if let Some(c) = p.get("create") {
            out.push("  steps networking adds to a creation".into());
            out.push(line(
                "policy + reserve + resolv_conf + attach",
                at(c, "added"),
                "ms",
            ));
            out.push(line("  the veth alone (link::attach)", at(c, "veth"), "ms"));
            out.push(line(
                "  the chains alone (Firewall::attach)",
                at(c, "chains"),
                "ms",
            ));
            out.push(line("release (at stop)", at(c, "release"), "ms"));
        }
    }
    out.push("targets".into());
    for t in at(r, "targets").as_array().into_iter().flatten() {
        out.push(format!(
            "  [{}] {}: {}",
            if at(t, "met").as_bool() == Some(true) {
                "met"
            } else {
                "NOT met"
            },
            at(t, "target").as_str().unwrap_or(""),
            at(t, "measured").as_str().unwrap_or("")
        ));
    }
    out.join("\n")
}

fn main() -> Result<()> {
    let a = Args::parse()?;
    if !nix::unistd::geteuid().is_root() {
        bail!("netpol_bench needs root (network namespaces, nftables)");
    }
    let machine = machine();
    let (a, v) = in_fresh_netns(a)?;
    let mut r = json!({
        "machine": machine,
        "params": {
            "sandboxes": a.sandboxes, "updates": a.updates, "dns_n": a.dns_n,
            "dns_warmup": a.dns_warmup, "iperf_secs": a.iperf_secs,
            "iperf_rounds": a.iperf_rounds, "create_n": a.create_n,
        },
    });
    if let (Some(o), Value::Object(v)) = (r.as_object_mut(), v) {
        o.extend(v);
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        o.insert(
            "loadavg_end".into(),
            json!(load
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")),
        );
    }
    let t = targets(&r);
    if let Some(o) = r.as_object_mut() {
        o.insert("targets".into(), json!(t));
    }
    let text = if a.json {
        serde_json::to_string_pretty(&r)?
    } else {
        table(&r)
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}")?;
    Ok(())
}
