//! Replicated IAM over an in-process network that drops, delays, reorders and partitions
//! messages: committed changes are applied once on every replica, in the same order, and a
//! replica cut off from the majority answers `unavailable`.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use raft::prelude::{Message, MessageType};
use rand::Rng;

use super::super::command::{AdmitItem, Command, NewToken, Outcome};
use super::super::state::{Actor, ROOT};
use super::super::tokens::hash_secret;
use super::*;
use crate::types::{Reason, Res};

const NOW: i64 = 1_790_000_000;

/// Delivery rules between replicas.
#[derive(Default)]
struct Rules {
    /// Probability of losing a message.
    drop: f64,
    /// Delay range in milliseconds (each message its own: later ones may overtake).
    delay_ms: (u64, u64),
    /// Replicas in different groups do not hear each other; absent = group 0.
    group: HashMap<u64, u32>,
    /// Replicas that hear nobody and whom nobody hears.
    down: HashSet<u64>,
    /// Lose every leadership hand-over (`MsgTimeoutNow`).
    no_handover: bool,
}

struct Queued {
    at: Instant,
    seq: u64,
    msg: Message,
    reporter: Reporter,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    // BinaryHeap is a max-heap: the earliest delivery first.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Default)]
struct NetState {
    rules: Rules,
    nodes: HashMap<u64, Replica>,
    queue: BinaryHeap<Queued>,
    seq: u64,
    stop: bool,
    delivered: u64,
    dropped: u64,
}

/// The network: one delivery thread, rules changed by the test at any time.
struct Net {
    st: Mutex<NetState>,
    wake: Condvar,
}

impl Net {
    fn new() -> Arc<Net> {
        let net = Arc::new(Net {
            st: Mutex::new(NetState::default()),
            wake: Condvar::new(),
        });
        let n = net.clone();
        std::thread::spawn(move || n.deliver());
        net
    }

    fn rules(&self, f: impl FnOnce(&mut Rules)) {
        f(&mut self.st.lock().unwrap().rules);
    }

    fn connected(rules: &Rules, a: u64, b: u64) -> bool {
        !rules.down.contains(&a)
            && !rules.down.contains(&b)
            && rules.group.get(&a).copied().unwrap_or(0)
                == rules.group.get(&b).copied().unwrap_or(0)
    }

    fn deliver(self: Arc<Net>) {
        let mut st = self.st.lock().unwrap();
        loop {
            if st.stop {
                return;
            }
            let now = Instant::now();
            match st.queue.peek().map(|q| q.at) {
                Some(at) if at <= now => {
                    let Some(q) = st.queue.pop() else { continue };
                    let (from, to) = (q.msg.from, q.msg.to);
                    // Rules apply at delivery too: a partition cuts what is in flight.
                    let ok = Self::connected(&st.rules, from, to);
                    let node = st.nodes.get(&to).cloned();
                    let snap = q.msg.get_msg_type() == MessageType::MsgSnapshot;
                    match node.filter(|_| ok) {
                        Some(n) => {
                            st.delivered += 1;
                            n.step(q.msg);
                            if snap {
                                q.reporter.snapshot_sent(to, true);
                            }
                        }
                        None => {
                            st.dropped += 1;
                            if snap {
                                q.reporter.snapshot_sent(to, false);
                            }
                        }
                    }
                }
                Some(at) => {
                    st = self.wake.wait_timeout(st, at - now).unwrap().0;
                }
                None => {
                    st = self.wake.wait(st).unwrap();
                }
            }
        }
    }

    fn link(self: &Arc<Net>, from: u64) -> Arc<dyn Transport> {
        Arc::new(Link {
            from,
            net: self.clone(),
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Ok(mut st) = self.st.lock() {
            st.stop = true;
        }
        self.wake.notify_all();
    }
}

struct Link {
    from: u64,
    net: Arc<Net>,
}

impl Transport for Link {
    fn send(&self, msgs: Vec<Message>, reporter: &Reporter) {
        let mut rng = rand::rng();
        let mut st = self.net.st.lock().unwrap();
        for mut m in msgs {
            m.from = self.from;
            let snap = m.get_msg_type() == MessageType::MsgSnapshot;
            let lost = rng.random_bool(st.rules.drop.clamp(0.0, 1.0))
                || !Net::connected(&st.rules, self.from, m.to)
                || (st.rules.no_handover && m.get_msg_type() == MessageType::MsgTimeoutNow);
            if lost {
                st.dropped += 1;
                if snap {
                    reporter.snapshot_sent(m.to, false);
                } else {
                    reporter.unreachable(m.to);
                }
                continue;
            }
            let (lo, hi) = st.rules.delay_ms;
            let d = if hi > lo {
                rng.random_range(lo..=hi)
            } else {
                lo
            };
            st.seq += 1;
            let seq = st.seq;
            st.queue.push(Queued {
                at: Instant::now() + Duration::from_millis(d),
                seq,
                msg: m,
                reporter: reporter.clone(),
            });
        }
        drop(st);
        self.net.wake.notify_all();
    }
}

/// A group of replicas on one network, each in its own directory.
struct Group {
    net: Arc<Net>,
    dirs: Vec<tempfile::TempDir>,
    replicas: BTreeMap<u64, Replica>,
    ids: Vec<u64>,
    snapshot_every: u64,
}

impl Group {
    fn new(n: u64, snapshot_every: u64) -> Group {
        let net = Net::new();
        let ids: Vec<u64> = (1..=n).collect();
        let mut g = Group {
            net,
            dirs: (0..n).map(|_| tempfile::tempdir().unwrap()).collect(),
            replicas: BTreeMap::new(),
            ids: ids.clone(),
            snapshot_every,
        };
        for id in ids {
            g.start(id);
        }
        g
    }

    fn opts(&self, id: u64) -> Options {
        let mut o = Options::new(
            id,
            self.ids.clone(),
            self.dirs[(id - 1) as usize].path().to_path_buf(),
        );
        // A fast clock keeps the tests short; the ratios are the production ones.
        o.tick = Duration::from_millis(20);
        o.commit_timeout = Duration::from_secs(2);
        o.snapshot_every = self.snapshot_every;
        o.metrics = false;
        o.members = self.ids.iter().map(|id| member(*id)).collect();
        o
    }

    fn start(&mut self, id: u64) {
        let opts = self.opts(id);
        self.open(opts);
    }

    /// Starts a new replica `id` (raft id) with `join`: it knows the group's addresses
    /// but no membership.
    fn join(&mut self, id: u64) {
        while self.dirs.len() < id as usize {
            self.dirs.push(tempfile::tempdir().unwrap());
        }
        let mut opts = self.opts(id);
        opts.join = true;
        self.open(opts);
    }

    fn open(&mut self, opts: Options) {
        let id = opts.id;
        let r = Replica::open(opts, self.net.link(id)).unwrap();
        self.net.st.lock().unwrap().nodes.insert(id, r.clone());
        self.replicas.insert(id, r);
    }

    async fn stop(&mut self, id: u64) {
        self.net.st.lock().unwrap().nodes.remove(&id);
        if let Some(r) = self.replicas.remove(&id) {
            r.close().await;
        }
    }

    fn get(&self, id: u64) -> &Replica {
        &self.replicas[&id]
    }

    /// Waits for a leader that every live replica agrees on.
    async fn leader(&self) -> u64 {
        let t0 = Instant::now();
        loop {
            let seen: HashSet<u64> = self.replicas.values().map(|r| r.leader()).collect();
            if seen.len() == 1 && !seen.contains(&0) {
                let l = *seen.iter().next().unwrap();
                if self.replicas.get(&l).is_some_and(|r| r.is_leader()) {
                    return l;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no leader: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every live replica holds the same state; returns it.
    /// Waits until every running replica has exactly `want` as voters (a new member is a
    /// learner until it has caught up).
    async fn voters_become(&self, want: &[u64]) {
        let t0 = Instant::now();
        loop {
            let mut all = true;
            for r in self.replicas.values() {
                all &= r.status().await.is_some_and(|s| s.voters == want);
            }
            if all {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "voters never became {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn converged(&self) -> IamState {
        let t0 = Instant::now();
        loop {
            let states: Vec<IamState> = self.replicas.values().map(|r| r.read().clone()).collect();
            let mut applied = HashSet::new();
            for r in self.replicas.values() {
                applied.insert(r.status().await.map(|s| s.applied));
            }
            if states.windows(2).all(|w| w[0] == w[1]) && applied.len() == 1 {
                return states[0].clone();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "replicas did not converge: applied {applied:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The addresses of raft id `id` (unused by the in-process network, but replicated).
fn member(id: u64) -> Member {
    Member {
        id: replica_id(id),
        addr: format!("iam{id}:7001"),
        raft_addr: format!("iam{id}:7011"),
    }
}

fn admin() -> Actor {
    Actor {
        principal: "admin".into(),
        token_id: "primary".into(),
        secret_hash: hash_secret("adminsecret"),
    }
}

fn bootstrap(sandboxes: f64) -> Command {
    Command::Bootstrap {
        admin_id: "admin".into(),
        admin_token: Some(NewToken {
            id: "primary".into(),
            hash: hash_secret("adminsecret"),
        }),
        root_quota: [("sandboxes".to_string(), sandboxes)].into_iter().collect(),
        max_token_ttl_s: 0,
        now: NOW,
    }
}

fn admit(lease: &str) -> Command {
    Command::Admit {
        actor: admin(),
        image_project: String::new(),
        items: vec![AdmitItem {
            lease_id: lease.into(),
            project: ROOT.into(),
            resources: Res {
                cpu_cores: 1.0,
                ..Default::default()
            },
            edge_id: "e1".into(),
            sandbox_id: format!("e1.{lease}"),
            keep_binding: false,
            spec_digest: String::new(),
        }],
        now: NOW,
    }
}

fn release(lease: &str) -> Command {
    Command::ReleaseLeases {
        lease_ids: vec![lease.into()],
        at: NOW,
        now: NOW,
        not_created: false,
    }
}

/// Proposes until the change is known to have applied: a `unavailable` answer leaves it
/// unknown, so the same command (idempotent by lease id) is sent again, as an apiserver does.
async fn settle(r: &Replica, cmd: Command) -> Outcome {
    let t0 = Instant::now();
    loop {
        match r.propose(cmd.clone()).await {
            Ok(o) => return o,
            Err(f) if f.reason == Reason::Unavailable => {
                assert!(t0.elapsed() < Duration::from_secs(60), "{f}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(f) => panic!("{cmd:?}: {f}"),
        }
    }
}

fn admitted_ok(o: &Outcome) -> bool {
    match o {
        Outcome::Admitted { results, .. } => results.iter().all(|r| r.is_ok()),
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_commit_from_any_replica_and_converge() {
    let g = Group::new(3, 10_000);
    g.leader().await;
    settle(g.get(1), bootstrap(1000.0)).await;
    for (i, id) in [1, 2, 3, 2, 1, 3].into_iter().enumerate() {
        let o = g.get(id).propose(admit(&format!("l{i}"))).await.unwrap();
        assert!(admitted_ok(&o), "{o:?}");
        // The proposer answers after applying: its own state already has the lease.
        assert!(g.get(id).read().leases.contains_key(&format!("l{i}")));
    }
    // A refused command is refused the same way everywhere and changes nothing.
    let again = g.get(2).propose(bootstrap(5.0)).await.unwrap_err();
    assert_eq!(again.reason, Reason::Conflict);
    let st = g.converged().await;
    assert_eq!(st.leases.len(), 6);
    assert_eq!(st.projects[ROOT].usage.sandboxes, 6);
    // A consistent read on a follower sees what was committed before it.
    let leader = g.leader().await;
    let follower = g.ids.iter().copied().find(|i| *i != leader).unwrap();
    g.get(leader).propose(admit("fresh")).await.unwrap();
    g.get(follower).read_index().await.unwrap();
    assert!(g.get(follower).read().leases.contains_key("fresh"));
}

/// Many clients admit and release through random replicas while the network loses 10 % of
/// messages, delays and reorders the rest, and partitions the group (isolating the leader,
/// then splitting it) again and again. Afterwards: every replica holds the same state, each
/// acknowledged admission is there unless its release was acknowledged, nothing that was
/// never admitted is, usage equals the live leases exactly, and the quota was never
/// exceeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admissions_stay_exact_through_loss_reordering_and_partitions() {
    const LIMIT: usize = 40;
    let g = Arc::new(tokio::sync::RwLock::new(Group::new(3, 50)));
    g.read().await.leader().await;
    {
        let gr = g.read().await;
        settle(gr.get(1), bootstrap(LIMIT as f64)).await;
        gr.net.rules(|r| {
            r.drop = 0.1;
            r.delay_ms = (0, 15);
        });
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..6u64 {
        let g = g.clone();
        let stop = stop.clone();
        clients.push(tokio::spawn(async move {
            // (lease, admission acknowledged, release acknowledged, release tried): an
            // `unavailable` answer leaves a change unknown (it may commit later).
            let mut log: Vec<(String, bool, bool, bool)> = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let lease = format!("c{c}-{i}");
                let r = {
                    let gr = g.read().await;
                    let id = gr.ids[rand::rng().random_range(0..gr.ids.len())];
                    gr.get(id).clone()
                };
                let admitted = match r.propose(admit(&lease)).await {
                    Ok(o) => admitted_ok(&o),
                    Err(f) => {
                        assert_eq!(f.reason, Reason::Unavailable, "{f}");
                        false
                    }
                };
                let mut released = false;
                let tried_release = admitted && i % 2 == 0;
                if tried_release {
                    released = match r.propose(release(&lease)).await {
                        Ok(Outcome::Released(n)) => {
                            assert_eq!(n, 1, "{lease} released {n} leases");
                            true
                        }
                        Ok(o) => panic!("{o:?}"),
                        Err(f) => {
                            assert_eq!(f.reason, Reason::Unavailable, "{f}");
                            false
                        }
                    };
                }
                log.push((lease, admitted, released, tried_release));
            }
            log
        }));
    }
    // The faults: isolate the leader, heal, split 1|2 3, heal, ... for a few seconds each.
    for round in 0..6 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let gr = g.read().await;
        let leader = gr.leader().await;
        gr.net.rules(|r| {
            r.group.clear();
            if round % 2 == 0 {
                r.group.insert(leader, 1);
            } else {
                r.group.insert(1 + (round as u64 % 3), 1);
            }
        });
        drop(gr);
        tokio::time::sleep(Duration::from_millis(900)).await;
        g.read().await.net.rules(|r| r.group.clear());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut acked_in = HashSet::new();
    let mut acked_out = HashSet::new();
    let mut tried = HashSet::new();
    let mut release_unknown = HashSet::new();
    for c in clients {
        for (lease, a, r, tried_release) in c.await.unwrap() {
            tried.insert(lease.clone());
            if a {
                acked_in.insert(lease.clone());
            }
            if r {
                acked_out.insert(lease.clone());
            } else if tried_release {
                release_unknown.insert(lease);
            }
        }
    }
    let gr = g.read().await;
    gr.net.rules(|r| {
        r.drop = 0.0;
        r.delay_ms = (0, 0);
    });
    let st = gr.converged().await;
    let live: HashSet<String> = st.leases.keys().cloned().collect();
    for l in &acked_in {
        if !acked_out.contains(l) && !release_unknown.contains(l) {
            assert!(live.contains(l), "acknowledged admission {l} was lost");
        }
    }
    for l in &live {
        assert!(tried.contains(l), "{l} was never admitted");
        assert!(
            !acked_out.contains(l),
            "acknowledged release of {l} was lost"
        );
    }
    assert_eq!(st.projects[ROOT].usage.sandboxes as usize, live.len());
    assert!(
        live.len() <= LIMIT,
        "{} leases over a quota of {LIMIT}",
        live.len()
    );
    assert!(
        acked_in.len() >= 20,
        "too little progress to mean anything: {} admissions",
        acked_in.len()
    );
}

/// Clients increment one key by read, then compare-and-set, and contend for one lock,
/// through random replicas while the network loses, reorders and partitions. No increment
/// is lost or doubled (the final value counts every acknowledged one, and no two clients
/// were acknowledged for writing the same value) and no fence is handed to two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compare_and_set_and_locks_stay_exact_through_loss_and_partitions() {
    const KEY: &str = "nodes/counter";
    let g = Arc::new(Group::new(3, 50));
    g.leader().await;
    settle(g.get(1), bootstrap(10.0)).await;
    g.net.rules(|r| {
        r.drop = 0.1;
        r.delay_ms = (0, 15);
    });
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..4u64 {
        let (g, stop) = (g.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            // (values written and acknowledged, writes left unknown, fences granted to me)
            let (mut acked, mut unknown, mut fences) = (Vec::new(), 0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = g
                    .get(g.ids[rand::rng().random_range(0..g.ids.len())])
                    .clone();
                if r.read_index().await.is_err() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let (n, rev) = r.read().kv.get(KEY).map_or((0, 0), |v| {
                    let n: u64 = std::str::from_utf8(&v.value).unwrap().parse().unwrap();
                    (n, v.revision)
                });
                let put = Command::KvPut {
                    key: KEY.into(),
                    value: (n + 1).to_string().into_bytes(),
                    if_revision: Some(rev),
                };
                match r.propose(put).await {
                    Ok(Outcome::Revision(_)) => acked.push(n + 1),
                    Ok(o) => panic!("{o:?}"),
                    Err(f) if f.reason == Reason::Conflict => {}
                    Err(f) => {
                        assert_eq!(f.reason, Reason::Unavailable, "{f}");
                        unknown += 1;
                    }
                }
                let now_ms = (crate::types::now_f() * 1000.0) as i64;
                let lock = Command::Lock {
                    name: "w".into(),
                    holder: format!("c{c}"),
                    ttl_ms: 1_000,
                    now_ms,
                };
                match r.propose(lock).await {
                    Ok(Outcome::Locked { fence, .. }) => fences.push(fence),
                    Ok(o) => panic!("{o:?}"),
                    Err(f) => assert!(
                        matches!(f.reason, Reason::Conflict | Reason::Unavailable),
                        "{f}"
                    ),
                }
            }
            (acked, unknown, fences)
        }));
    }
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let leader = g.leader().await;
        g.net.rules(|r| {
            r.group.clear();
            r.group.insert(
                if round % 2 == 0 {
                    leader
                } else {
                    1 + round % 3
                },
                1,
            );
        });
        tokio::time::sleep(Duration::from_millis(800)).await;
        g.net.rules(|r| r.group.clear());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut values, mut unknown, mut holder_of) = (HashSet::new(), 0, HashMap::new());
    for (c, h) in clients.into_iter().enumerate() {
        let (acked, u, fences) = h.await.unwrap();
        for v in acked {
            assert!(
                values.insert(v),
                "two clients were acknowledged for writing {v}"
            );
        }
        unknown += u;
        for f in fences {
            let first = *holder_of.entry(f).or_insert(c);
            assert_eq!(first, c, "fence {f} was granted to clients {first} and {c}");
        }
    }
    g.net.rules(|r| {
        r.drop = 0.0;
        r.delay_ms = (0, 0);
    });
    let st = g.converged().await;
    let last: u64 = std::str::from_utf8(&st.kv[KEY].value)
        .unwrap()
        .parse()
        .unwrap();
    // Every committed write added exactly one: acknowledged ones all count, and unknown
    // ones may have committed too.
    assert!(
        last >= values.len() as u64,
        "{last} < {} acknowledged",
        values.len()
    );
    assert!(
        last <= values.len() as u64 + unknown,
        "{last} writes from {} + {unknown}",
        values.len()
    );
    assert!(
        values.len() >= 10,
        "too little progress: {} increments",
        values.len()
    );
    assert!(!holder_of.is_empty(), "nobody ever took the lock");
    assert!(st.revision >= last + holder_of.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_minority_makes_no_progress_and_answers_unavailable() {
    let g = Group::new(3, 10_000);
    let leader = g.leader().await;
    settle(g.get(1), bootstrap(100.0)).await;
    // Cut the leader off: it steps down (check quorum), the other two elect a new one.
    g.net.rules(|r| {
        r.group.insert(leader, 1);
    });
    let t0 = Instant::now();
    let f = g.get(leader).propose(admit("lost")).await.unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable, "{f}");
    assert!(t0.elapsed() >= Duration::from_secs(2) - Duration::from_millis(50));
    let f = g.get(leader).read_index().await.unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable);
    assert!(!g.get(leader).is_leader());
    // The majority goes on.
    let other = g.ids.iter().copied().find(|i| *i != leader).unwrap();
    assert!(admitted_ok(&settle(g.get(other), admit("kept")).await));
    assert!(!g.get(leader).read().leases.contains_key("kept"));
    // Healed, the old leader catches up; what it was asked while cut off applied at most
    // once (its proposal may have been retried into the new term).
    g.net.rules(|r| r.group.clear());
    let st = g.converged().await;
    assert!(st.leases.contains_key("kept"));
    assert_eq!(st.projects[ROOT].usage.sandboxes as usize, st.leases.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_of_three_down_fail_then_recover_and_a_restarted_replica_catches_up_by_snapshot() {
    let mut g = Group::new(3, 20);
    g.leader().await;
    settle(g.get(1), bootstrap(1000.0)).await;
    for i in 0..10 {
        settle(g.get(1), admit(&format!("a{i}"))).await;
    }
    g.stop(3).await;
    g.stop(2).await;
    let f = g.get(1).propose(admit("none")).await.unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable);
    // One comes back: a majority again, from the same files.
    g.start(2);
    g.leader().await;
    for i in 0..60 {
        settle(g.get(2), admit(&format!("b{i}"))).await;
    }
    // Replica 3 was away for more than a snapshot's worth of entries, which the others have
    // dropped from their logs: it is caught up from a snapshot.
    g.start(3);
    let st = g.converged().await;
    assert_eq!(st.projects[ROOT].usage.sandboxes as usize, st.leases.len());
    assert!(st.leases.contains_key("a0") && st.leases.contains_key("b59"));
    let st3 = g.get(3).status().await.unwrap();
    assert!(st3.applied >= 70, "{st3:?}");
    assert_eq!(st3.snapshots_installed, 1, "{st3:?}");
    // Everything survives a restart of every replica.
    let before = st.clone();
    for id in [1, 2, 3] {
        g.stop(id).await;
    }
    for id in [1, 2, 3] {
        g.start(id);
    }
    g.leader().await;
    assert_eq!(g.converged().await, before);
}

/// Three replicas over the real transport (gRPC on loopback, plaintext with a component
/// secret): they commit, and the `Raft` service refuses a wrong secret, a message meant for
/// another replica and bytes that are not a message, changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_commit_over_grpc_and_the_raft_port_refuses_bad_input() {
    use super::transport::{GrpcTransport, RaftService};
    use crate::rpc::client::{internal, Dialer};
    use protobuf::Message as _;

    const TOKEN: &str = "component-secret";
    let listeners: Vec<tokio::net::TcpListener> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
        }
        v
    };
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let shutdown = crate::shutdown::Shutdown::new();
    let mut replicas = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        let peers: Vec<(u64, String)> = (0..3)
            .filter(|j| *j != i)
            .map(|j| (j as u64 + 1, addrs[j].clone()))
            .collect();
        let t = GrpcTransport::new(&peers, &Dialer::plain(), TOKEN).unwrap();
        let mut o = Options::new(id, vec![1, 2, 3], dirs[i].path().to_path_buf());
        o.metrics = false;
        let r = Replica::open(o, Arc::new(t)).unwrap();
        let mut b = crate::rpc::serve::builder(None, crate::rpc::acl::Policy::Raft).unwrap();
        let router = b.add_service(RaftService::new(r.clone(), TOKEN).server());
        tokio::spawn(crate::rpc::serve::serve(router, l, shutdown.clone()));
        replicas.push(r);
    }
    settle(&replicas[2], bootstrap(10.0)).await;
    assert!(admitted_ok(&settle(&replicas[1], admit("a")).await));
    let before = replicas[0].status().await.unwrap();

    let ch = crate::rpc::client::channel(&addrs[0], Duration::from_secs(2)).unwrap();
    let mut client = crate::pb::raft_client::RaftClient::new(ch);
    let vote = |to: u64| {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgRequestVote);
        m.to = to;
        m.from = 2;
        m.term = 1_000_000;
        m.write_to_bytes().unwrap()
    };
    let send =
        |messages: Vec<Vec<u8>>, token: &str| internal(crate::pb::RaftBatch { messages }, token);
    let e = client.send(send(vec![vote(1)], "wrong")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let e = client.send(send(vec![vote(3)], TOKEN)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = client
        .send(send(vec![b"\xff\xff\xff not protobuf".to_vec()], TOKEN))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    // A membership change is forwarded only in the form replicas make it.
    let propose = |ty: raft::prelude::EntryType, data: Vec<u8>| {
        let mut e = raft::prelude::Entry::default();
        e.set_entry_type(ty);
        e.data = data.into();
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgPropose);
        m.to = 1;
        m.from = 2;
        m.set_entries(vec![e].into());
        m.write_to_bytes().unwrap()
    };
    let mut cc = raft::prelude::ConfChange::default();
    cc.set_change_type(raft::prelude::ConfChangeType::RemoveNode);
    cc.node_id = 3;
    cc.context = b"not a member change".to_vec().into();
    let cc_v2 = raft::prelude::ConfChangeV2::default();
    // A voter added at once, skipping the learner stage: only a leader promotes.
    let mut voter = raft::prelude::ConfChange::default();
    voter.set_change_type(raft::prelude::ConfChangeType::AddNode);
    voter.node_id = 4;
    voter.context = machine::MemberChange {
        tag: 7,
        member: member(4),
    }
    .encode()
    .into();
    for (ty, data) in [
        (
            raft::prelude::EntryType::EntryConfChange,
            voter.write_to_bytes().unwrap(),
        ),
        (
            raft::prelude::EntryType::EntryConfChange,
            cc.write_to_bytes().unwrap(),
        ),
        (
            raft::prelude::EntryType::EntryConfChangeV2,
            cc_v2.write_to_bytes().unwrap(),
        ),
        (raft::prelude::EntryType::EntryConfChange, b"\xff".to_vec()),
    ] {
        let e = client
            .send(send(vec![propose(ty, data)], TOKEN))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }
    assert_eq!(replicas[0].status().await.unwrap().voters, vec![1, 2, 3]);
    // None of it reached the node: the term did not move to the forged vote's.
    let after = replicas[0].status().await.unwrap();
    assert_eq!(after.term, before.term);
    for r in &replicas {
        r.close().await;
    }
    shutdown.fire();
}

/// A replica started with `join` holds nothing and takes no part until a member adds it;
/// the leader then catches it up with one snapshot and it counts for the majority. Bad
/// changes are refused and change nothing. A removed leader hands leadership on and the
/// removed replica answers nothing; the membership survives restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_replica_is_added_caught_up_by_snapshot_and_a_removed_leader_steps_down() {
    let mut g = Group::new(3, 10_000);
    g.leader().await;
    settle(g.get(1), bootstrap(1000.0)).await;
    for i in 0..10 {
        settle(g.get(2), admit(&format!("a{i}"))).await;
    }
    g.leader().await;
    g.join(4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s4 = g.get(4).status().await.unwrap();
    assert!(s4.voters.is_empty() && s4.applied == 0, "{s4:?}");
    assert_eq!(s4.leader, 0);
    assert!(g.get(4).read().leases.is_empty());
    assert_eq!(
        g.get(4).read_index().await.unwrap_err().reason,
        Reason::Unavailable
    );

    // Refused: a member's id, a member's address, removing a non-member. Nothing changes.
    let add = |id: u64, raft_addr: &str| {
        Change::Add(Member {
            id,
            addr: format!("new{id}:7001"),
            raft_addr: raft_addr.into(),
        })
    };
    let f = g.get(2).change_member(add(1, "x:1")).await.unwrap_err();
    assert_eq!(f.reason, Reason::Conflict, "{f}");
    let f = g
        .get(2)
        .change_member(add(3, &member(1).raft_addr))
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Conflict, "{f}");
    let f = g.get(2).change_member(Change::Remove(9)).await.unwrap_err();
    assert_eq!(f.reason, Reason::NotFound, "{f}");
    assert_eq!(g.get(1).status().await.unwrap().voters, vec![1, 2, 3]);

    // Added through a follower (the change goes to the leader inside Raft).
    let leader = g.get(1).leader();
    let follower = [1, 2, 3].into_iter().find(|i| *i != leader).unwrap();
    assert_eq!(g.get(follower).leader_addr(), Some(member(leader).addr));
    assert_eq!(g.get(4).leader_addr(), None);
    g.get(follower)
        .change_member(Change::Add(member(4)))
        .await
        .unwrap();
    g.voters_become(&[1, 2, 3, 4]).await;
    let st = g.converged().await;
    assert_eq!(st.leases.len(), 10);
    for id in 1..=4 {
        let s = g.get(id).status().await.unwrap();
        assert_eq!(s.voters, vec![1, 2, 3, 4], "replica {id}");
        assert_eq!(s.members, (1..=4).map(member).collect::<Vec<_>>(), "{id}");
    }
    let s4 = g.get(4).status().await.unwrap();
    assert_eq!(s4.snapshots_installed, 1, "{s4:?}");
    let f = g.get(1).change_member(Change::Add(member(4))).await;
    assert_eq!(f.unwrap_err().reason, Reason::Conflict);

    // A member that never answers stays a learner: it counts for no majority, so the
    // group goes on as before; then it is removed.
    g.get(1)
        .change_member(Change::Add(member(5)))
        .await
        .unwrap();
    settle(g.get(2), admit("l5")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = g.get(g.leader().await).status().await.unwrap();
    assert_eq!((s.voters, s.learners), (vec![1, 2, 3, 4], vec![5]));
    g.get(1)
        .change_member(Change::Remove(replica_id(5)))
        .await
        .unwrap();
    let s = g.get(1).status().await.unwrap();
    assert!(s.learners.is_empty() && s.members.iter().all(|m| m.id != replica_id(5)));

    // Four voters: with one down, the three others (4 among them) are needed.
    let down = if leader == 4 { 1 } else { leader };
    g.stop(down).await;
    g.leader().await;
    settle(g.get(4), admit("b0")).await;
    g.start(down);
    g.leader().await;
    settle(g.get(down), admit("b1")).await;

    // Remove the leader, with its hand-over lost on the way: it stops leading by itself,
    // the others elect and take changes while it still runs, and it answers nothing.
    let leader = g.leader().await;
    let asker = [1, 2, 3, 4].into_iter().find(|i| *i != leader).unwrap();
    g.net.rules(|r| r.no_handover = true);
    g.get(asker)
        .change_member(Change::Remove(replica_id(leader)))
        .await
        .unwrap();
    let t0 = Instant::now();
    while !g.get(leader).removed() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gone = g.get(leader).clone();
    let f = gone.propose(admit("c0")).await.unwrap_err();
    assert_eq!(f.reason, Reason::Unavailable);
    assert!(f.message.contains("removed"), "{f}");
    assert!(gone.failed());
    settle(g.get(asker), admit("c1")).await;
    let new_leader = g.get(asker).leader();
    assert!(new_leader != leader && new_leader != 0, "{new_leader}");
    assert!(!gone.is_leader());
    g.net.rules(|r| r.no_handover = false);
    g.stop(leader).await;
    let rest: Vec<u64> = g.replicas.keys().copied().collect();
    let voters: Vec<u64> = (1..=4).filter(|i| *i != leader).collect();
    assert_eq!(rest, voters);
    for id in &rest {
        let s = g.get(*id).status().await.unwrap();
        assert_eq!(s.voters, voters);
        assert!(s.members.iter().all(|m| m.id != replica_id(leader)));
    }
    let before = g.converged().await;
    assert_eq!(before.leases.len(), 14);

    // A restart keeps the membership; the removed replica stays out.
    for id in &rest {
        g.stop(*id).await;
    }
    for id in &rest {
        g.start(*id);
    }
    g.leader().await;
    assert_eq!(g.converged().await, before);
    assert_eq!(g.get(rest[0]).status().await.unwrap().voters, voters);
    g.start(leader);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(g.get(leader).removed());

    // Added again, the same replica takes part again.
    g.get(rest[0])
        .change_member(Change::Add(member(leader)))
        .await
        .unwrap();
    let t0 = Instant::now();
    while g.get(leader).removed() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    g.voters_become(&[1, 2, 3, 4]).await;
    g.leader().await;
    settle(g.get(leader), admit("d0")).await;
    let st = g.converged().await;
    assert_eq!(st.leases.len(), 15);

    // A member that lost its data directory, started again with `join`, is refused what it
    // can no longer hold (no panic, nothing applied); removed and added again, it is
    // caught up.
    let wiped = [1, 2, 3, 4]
        .into_iter()
        .find(|i| *i != g.get(1).leader())
        .unwrap();
    g.stop(wiped).await;
    g.dirs[(wiped - 1) as usize] = tempfile::tempdir().unwrap();
    g.join(wiped);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = g
        .get(wiped)
        .status()
        .await
        .expect("the replica's thread is alive");
    assert_eq!(s.applied, 0, "{s:?}");
    assert!(!g.get(wiped).failed());
    let asker = [1, 2, 3, 4].into_iter().find(|i| *i != wiped).unwrap();
    g.get(asker)
        .change_member(Change::Remove(replica_id(wiped)))
        .await
        .unwrap();
    g.get(asker)
        .change_member(Change::Add(member(wiped)))
        .await
        .unwrap();
    g.voters_become(&[1, 2, 3, 4]).await;
    assert_eq!(g.converged().await, st);
    assert_eq!(g.get(wiped).status().await.unwrap().snapshots_installed, 1);
}
