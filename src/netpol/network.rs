//! An edge's sandbox networking (docs/network.md): the one owner of its address plan, its
//! veths and its nftables table, shared by every backend of the edge that runs sandboxes in
//! network namespaces. A backend reserves a slot before it builds a sandbox (the slot's
//! gateway goes into the sandbox's `/etc/resolv.conf`), attaches the sandbox's netns once it
//! exists, records the slot, and releases it when the sandbox goes; after a restart it holds
//! the recorded slots again ([`Network::adopt`]) and [`Network::cleanup`] removes every veth
//! and chain of a slot nobody holds.

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::link::{self, Attached, LinkError};
use super::nft::{Firewall, NftError};
use super::slot::{
    slot_addrs, slot_count, slot_of_addr, slot_of_host_veth, veth_prefix, LinkPlan, SlotError,
};
use super::{ClusterRules, Ipv4Net, NetpolError, Policy};

/// Why a sandbox's networking could not be set up or taken down.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// Every slot of the subnet is in use.
    #[error("sandbox network {subnet}: all {slots} addresses are in use")]
    Exhausted { subnet: Ipv4Net, slots: u32 },
    #[error(transparent)]
    Slot(#[from] SlotError),
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Nft(#[from] NftError),
    /// An adopted sandbox's slot has no veth in this subnet (the subnet changed while it
    /// ran): its real veth is one this edge's table does not filter.
    #[error(
        "sandbox network slot {slot}: no veth {veth} in subnet {subnet} (did edges[].network.subnet change?)"
    )]
    NotHere {
        slot: u32,
        veth: String,
        subnet: Ipv4Net,
    },
    /// Turning on IPv4 forwarding at start.
    #[error("turning on IPv4 forwarding")]
    Forwarding(#[source] std::io::Error),
    /// A blocking step's thread failed.
    #[error("sandbox network: {0}")]
    Task(String),
}

/// Per slot, when each (port limit, address) was last added to its resolved sets.
type ResolvedRecord = HashMap<u32, HashMap<(super::PortLimit, Ipv4Addr), Instant>>;

/// How many renewals of resolved addresses may run at once on an edge.
pub const MAX_RENEWALS: usize = 4;
/// An address the DNS proxy added less than this long ago is not touched again.
pub const RENEW_AFTER: Duration = Duration::from_secs(300);
/// An address added this long ago may be close to its hour: the next answer naming it waits
/// for its renewal.
pub const ADD_AGAIN_AFTER: Duration = Duration::from_secs(3000);
/// The most addresses remembered per slot.
const MAX_REMEMBERED: usize = 4096;

/// An edge's sandbox networking; see the module doc.
pub struct Network {
    subnet: Ipv4Net,
    slots: u32,
    rules: ClusterRules,
    firewall: Firewall,
    held: Mutex<BTreeSet<u32>>,
    /// Where [`Network::reserve`] looks first.
    next: Mutex<u32>,
    /// [`RENEW_AFTER`] and [`ADD_AGAIN_AFTER`], unless a test shortened them.
    renew_after: Duration,
    add_again_after: Duration,
    /// When each slot's resolved addresses were last added ([`Network::add_resolved`]).
    resolved: Mutex<ResolvedRecord>,
    /// Renewals of resolved addresses in flight ([`Network::add_resolved`]).
    renewals: Arc<tokio::sync::Semaphore>,
    /// The policy of each attached slot: what the DNS proxy answers by. Written after the
    /// table, so a name the proxy allows always has its sets in the table.
    policies: RwLock<HashMap<u32, Arc<Policy>>>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("subnet", &self.subnet)
            .field("table", &self.firewall.table_name())
            .finish()
    }
}

impl Network {
    /// Starts edge `edge_id`'s networking in the caller's netns: IPv4 forwarding on, and the
    /// base of its table installed (docs/network.md "Enforcement"), leaving the chains of
    /// sandboxes that outlived the previous edge process in place. `rules` are the config's
    /// rule sets and default rules. Needs root.
    /// Errors: [`NetworkError::Slot`] for a subnet smaller than a /30,
    /// [`NetworkError::Forwarding`], [`NetworkError::Nft`].
    pub fn start(
        edge_id: &str,
        subnet: Ipv4Net,
        dns_port: u16,
        rules: ClusterRules,
    ) -> Result<Network, NetworkError> {
        let slots = slot_count(subnet)?;
        link::enable_ipv4_forwarding().map_err(NetworkError::Forwarding)?;
        let firewall = Firewall::new(edge_id, subnet, dns_port);
        firewall.install_base()?;
        tracing::info!(%subnet, table = firewall.table_name(), dns_port, "sandbox networking on");
        Ok(Network {
            subnet,
            slots,
            rules,
            firewall,
            held: Mutex::new(BTreeSet::new()),
            next: Mutex::new(0),
            renewals: Arc::new(tokio::sync::Semaphore::new(MAX_RENEWALS)),
            resolved: Mutex::new(HashMap::new()),
            renew_after: RENEW_AFTER,
            add_again_after: ADD_AGAIN_AFTER,
            policies: RwLock::new(HashMap::new()),
        })
    }

    /// The same network with other [`RENEW_AFTER`] and [`ADD_AGAIN_AFTER`] (tests see a
    /// renewal in seconds rather than minutes).
    pub fn with_resolved_timings(
        mut self,
        renew_after: Duration,
        add_again_after: Duration,
    ) -> Self {
        self.renew_after = renew_after;
        self.add_again_after = add_again_after;
        self
    }

    fn held(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        match self.held.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn set_policy(&self, slot: u32, policy: Option<&Policy>) {
        let mut p = match self.policies.write() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        };
        match policy {
            Some(policy) => p.insert(slot, Arc::new(policy.clone())),
            None => p.remove(&slot),
        };
        drop(p);
        // Its sets may have changed (or gone): what was added to them is not known any more.
        self.resolved().remove(&slot);
    }

    fn resolved(&self) -> std::sync::MutexGuard<'_, ResolvedRecord> {
        match self.resolved.lock() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        }
    }

    /// The sandbox subnet.
    pub fn subnet(&self) -> Ipv4Net {
        self.subnet
    }

    /// The slot and current policy of the attached sandbox whose address is `addr`; `None`
    /// for any other address (a gateway, an address outside the subnet, a free slot). How
    /// the DNS proxy tells sandboxes apart: the `guard` chain drops every packet whose
    /// source is not its sandbox's own address, so the source cannot be forged.
    pub fn sandbox_policy(&self, addr: Ipv4Addr) -> Option<(u32, Arc<Policy>)> {
        let slot = slot_of_addr(self.subnet, addr)?;
        if slot_addrs(self.subnet, slot).ok()?.sandbox != addr {
            return None;
        }
        let p = match self.policies.read() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        };
        p.get(&slot).map(|p| (slot, p.clone()))
    }

    /// Lets sandbox `slot` reach `addrs` (what the DNS proxy resolved for it) under each of
    /// `limits`: they are in its sets when this returns, for an hour
    /// ([`super::nft::RESOLVED_TIMEOUT_MS`]) from at most [`RENEW_AFTER`] ago.
    ///
    /// The edge remembers when it last added each address, so a name asked again and again
    /// costs no netlink exchange: an address added less than [`RENEW_AFTER`] ago is left
    /// alone; one added earlier (but within [`ADD_AGAIN_AFTER`]) gets its hour renewed in the
    /// background, at most [`MAX_RENEWALS`] at a time for the whole edge (best effort: a
    /// renewal deletes and re-adds, and the socket's close then waits for an RCU grace
    /// period, milliseconds an answer should not wait for); anything else is added (renewed)
    /// before this returns. A slot's record is dropped whenever its policy is written, so an
    /// address is never taken for present in a set that was replaced.
    /// Errors: [`NetworkError::Nft`].
    pub async fn add_resolved(
        &self,
        slot: u32,
        limits: Vec<super::PortLimit>,
        addrs: Vec<Ipv4Addr>,
    ) -> Result<(), NetworkError> {
        let now = Instant::now();
        let (mut fresh, mut renew, mut stale) = (true, false, false);
        {
            let rec = self.resolved();
            let seen = rec.get(&slot);
            for l in &limits {
                for a in &addrs {
                    match seen.and_then(|m| m.get(&(*l, *a))) {
                        None => fresh = false,
                        Some(t) => {
                            let age = now.saturating_duration_since(*t);
                            if age >= self.add_again_after {
                                fresh = false;
                                stale = true;
                            } else if age >= self.renew_after {
                                renew = true;
                            }
                        }
                    }
                }
            }
        }
        if !fresh {
            let fw = self.firewall.clone();
            let (l2, a2) = (limits.clone(), addrs.clone());
            tokio::task::spawn_blocking(move || fw.add_resolved(slot, &l2, &a2, stale))
                .await
                .map_err(|e| NetworkError::Task(e.to_string()))??;
            self.note_resolved(slot, &limits, &addrs, now);
            return Ok(());
        }
        if renew {
            if let Ok(permit) = self.renewals.clone().try_acquire_owned() {
                let fw = self.firewall.clone();
                let done = tokio::task::spawn_blocking(move || {
                    let r = fw.add_resolved(slot, &limits, &addrs, true);
                    drop(permit);
                    r.map(|()| (limits, addrs))
                });
                match done.await {
                    Ok(Ok((limits, addrs))) => self.note_resolved(slot, &limits, &addrs, now),
                    Ok(Err(e)) => {
                        tracing::debug!(slot, error = %crate::types::chain(&e), "renewing resolved addresses")
                    }
                    Err(e) => tracing::debug!(slot, error = %e, "renewing resolved addresses"),
                }
            }
        }
        Ok(())
    }

    fn note_resolved(
        &self,
        slot: u32,
        limits: &[super::PortLimit],
        addrs: &[Ipv4Addr],
        at: Instant,
    ) {
        let mut rec = self.resolved();
        let m = rec.entry(slot).or_default();
        // A name with ever new addresses must not grow the record without end: forgetting
        // costs only a netlink exchange the next time.
        if m.len() > MAX_REMEMBERED {
            m.clear();
        }
        for l in limits {
            for a in addrs {
                m.insert((*l, *a), at);
            }
        }
    }

    /// The edge's table.
    pub fn firewall(&self) -> &Firewall {
        &self.firewall
    }

    /// A sandbox's policy from its `network_rules` and the config's rule sets and defaults.
    /// Errors: [`NetpolError`] (`invalid`), naming the rule.
    pub fn policy<'a>(
        &self,
        rules: impl IntoIterator<Item = (&'a String, &'a bool)>,
    ) -> Result<Policy, NetpolError> {
        self.rules.resolve(rules)
    }

    /// Takes a free slot for a new sandbox: the first free one after the slot handed out
    /// last, wrapping around, so that a slot just released (whose address the kernel's
    /// connection tracking may still remember) is the last to be used again.
    /// Errors: [`NetworkError::Exhausted`].
    pub fn reserve(&self) -> Result<u32, NetworkError> {
        let mut held = self.held();
        let mut next = match self.next.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let free = (*next..self.slots)
            .chain(0..*next)
            .find(|s| !held.contains(s));
        let Some(slot) = free else {
            return Err(NetworkError::Exhausted {
                subnet: self.subnet,
                slots: self.slots,
            });
        };
        held.insert(slot);
        *next = (slot + 1) % self.slots;
        Ok(slot)
    }

    /// The `/etc/resolv.conf` of the sandbox in `slot`: its gateway, where the edge's DNS
    /// proxy answers (port 53 is redirected to it).
    pub fn resolv_conf(&self, slot: u32) -> Result<String, NetworkError> {
        let a = slot_addrs(self.subnet, slot)?;
        Ok(format!(
            "# Written by OpenDsec: the edge's DNS proxy (docs/network.md).\nnameserver {}\noptions edns0\n",
            a.gateway
        ))
    }

    /// Connects the sandbox whose netns is `netns` in reserved `slot` and installs its
    /// `policy`. On failure, nothing of it is left (the veth is removed again).
    /// Errors: [`NetworkError::Link`], [`NetworkError::Nft`].
    pub async fn attach(
        &self,
        netns: BorrowedFd<'_>,
        slot: u32,
        policy: &Policy,
    ) -> Result<Attached, NetworkError> {
        let plan = LinkPlan::new(self.subnet, slot)?;
        let attached = link::attach(netns, &plan).await?;
        let fw = self.firewall.clone();
        let (addrs, policy2) = (attached.addrs, policy.clone());
        let res = tokio::task::spawn_blocking(move || fw.attach(&addrs, &policy2))
            .await
            .map_err(|e| NetworkError::Task(e.to_string()))
            .and_then(|r| r.map_err(NetworkError::from));
        if let Err(e) = res {
            if let Err(d) = link::detach(&plan.host_name).await {
                tracing::warn!(slot, error = %crate::types::chain(&d), "removing a sandbox's veth after its rules failed");
            }
            return Err(e);
        }
        self.set_policy(slot, Some(policy));
        Ok(attached)
    }

    /// Holds `slot` for a sandbox adopted after a restart and writes its `policy` again (its
    /// chains normally survived; this also repairs them).
    /// Errors: [`NetworkError::Slot`] (a recorded slot outside the subnet: the config
    /// changed), [`NetworkError::NotHere`] (no veth of that slot in this subnet: the subnet
    /// changed, and the sandbox's veth is one no rule of this table matches), and
    /// [`NetworkError::Link`], [`NetworkError::Nft`].
    pub async fn adopt(&self, slot: u32, policy: &Policy) -> Result<(), NetworkError> {
        let addrs = slot_addrs(self.subnet, slot)?;
        let veth = super::slot::host_veth_name(addrs.network);
        if !link::veth_exists(&veth).await? {
            return Err(NetworkError::NotHere {
                slot,
                veth,
                subnet: self.subnet,
            });
        }
        self.held().insert(slot);
        let fw = self.firewall.clone();
        let policy2 = policy.clone();
        tokio::task::spawn_blocking(move || fw.attach(&addrs, &policy2))
            .await
            .map_err(|e| NetworkError::Task(e.to_string()))??;
        self.set_policy(slot, Some(policy));
        Ok(())
    }

    /// Replaces the policy of the sandbox in `slot` (`UpdateNetwork`).
    /// Errors: [`NetworkError::Nft`].
    pub async fn update(&self, slot: u32, policy: &Policy) -> Result<(), NetworkError> {
        let fw = self.firewall.clone();
        let policy2 = policy.clone();
        tokio::task::spawn_blocking(move || fw.update(slot, &policy2))
            .await
            .map_err(|e| NetworkError::Task(e.to_string()))??;
        self.set_policy(slot, Some(policy));
        Ok(())
    }

    /// Removes the rules and veth of `slot` and frees it; idempotent. The slot stays held
    /// when a step fails, so that it is not handed out while something of it is left (the
    /// edge's next cleanup retries).
    /// Errors: [`NetworkError::Nft`], [`NetworkError::Link`].
    pub async fn release(&self, slot: u32) -> Result<(), NetworkError> {
        let plan = LinkPlan::new(self.subnet, slot)?;
        // The proxy stops answering first: nothing is added to sets being removed.
        self.set_policy(slot, None);
        let fw = self.firewall.clone();
        tokio::task::spawn_blocking(move || fw.detach(slot))
            .await
            .map_err(|e| NetworkError::Task(e.to_string()))??;
        link::detach(&plan.host_name).await?;
        self.held().remove(&slot);
        Ok(())
    }

    /// Tries [`Network::release`] of `slot` again in the background, after each of `pauses`
    /// in turn, until it succeeds: what a stop whose release failed (the kernel short of
    /// memory, the edge of file descriptors) calls, so that the slot's veth and rules do not
    /// stay until the edge's next start. The slot stays held, and so is not handed out,
    /// until then. Needs a Tokio runtime.
    pub fn release_later(self: &Arc<Self>, slot: u32, pauses: &[Duration]) {
        let net = Arc::clone(self);
        let pauses = pauses.to_vec();
        tokio::spawn(async move {
            for pause in pauses {
                tokio::time::sleep(pause).await;
                match net.release(slot).await {
                    Ok(()) => {
                        tracing::info!(slot, "a failed release of a network slot was finished");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(slot, error = %crate::types::chain(&e), "releasing a network slot again failed");
                    }
                }
            }
        });
    }

    /// Whether `slot` is held (reserved, attached or adopted, and not released).
    pub fn is_held(&self, slot: u32) -> bool {
        self.held().contains(&slot)
    }

    /// At the edge's exit: deletes the table when no sandbox holds a slot (they were all
    /// stopped), so a stopped edge leaves nothing in the host's ruleset; with sandboxes left
    /// running (`keep_sandboxes_on_exit`) their rules stay. `Ok(true)` when it was deleted.
    /// Errors: [`NetworkError::Nft`].
    pub async fn shutdown(&self) -> Result<bool, NetworkError> {
        if !self.held().is_empty() {
            return Ok(false);
        }
        let fw = self.firewall.clone();
        Ok(tokio::task::spawn_blocking(move || fw.remove())
            .await
            .map_err(|e| NetworkError::Task(e.to_string()))??)
    }

    /// Removes every veth and every rule of a slot no sandbox holds: what a failed creation,
    /// a crash mid-creation or a sandbox that died while the edge was down left. Call it
    /// after adopting the recorded sandboxes. Returns what was removed (`veth NAME`,
    /// `rules of slot N`).
    /// Errors: the first [`NetworkError`]; the other strays are still tried.
    pub async fn cleanup(&self) -> Result<Vec<String>, NetworkError> {
        let held = self.held().clone();
        let mut removed = Vec::new();
        let mut first_err = None;
        for name in link::list_strays(&veth_prefix(self.subnet)).await? {
            match slot_of_host_veth(self.subnet, &name) {
                Some(s) if held.contains(&s) => continue,
                // Another edge's veth under a shared prefix is not ours to touch.
                None => continue,
                Some(_) => {}
            }
            match link::detach(&name).await {
                Ok(_) => removed.push(format!("veth {name}")),
                Err(e) => {
                    first_err.get_or_insert(NetworkError::from(e));
                }
            }
        }
        let fw = self.firewall.clone();
        let slots = tokio::task::spawn_blocking(move || fw.slots())
            .await
            .map_err(|e| NetworkError::Task(e.to_string()))??;
        for slot in slots.into_iter().filter(|s| !held.contains(s)) {
            let fw = self.firewall.clone();
            match tokio::task::spawn_blocking(move || fw.detach(slot)).await {
                Ok(Ok(_)) => removed.push(format!("rules of network slot {slot}")),
                Ok(Err(e)) => {
                    first_err.get_or_insert(NetworkError::from(e));
                }
                Err(e) => {
                    first_err.get_or_insert(NetworkError::Task(e.to_string()));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }
}
