//! aether's session table: one chronus per session name, started on first use as the
//! user of that first call, reached over a unix socket in the session's own directory.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::{watch, OnceCell};
use tonic::transport::Channel;

use super::cgroups::{SessionCgroup, Workload};
use super::requests::Requests;
use crate::guest::config::AetherConfig;
use crate::guest::lock;
use crate::guest::proctree;
use crate::guest::reaper::Reaper;
use crate::guest::{uds, user};
use crate::pb::runtime_client::RuntimeClient;
use crate::types::Failure;

/// Environment variables chronus inherits from aether (logging, test limits).
const PASS_ENV: [&str; 3] = [
    "OPENDSEC_LOG",
    "RUST_LOG",
    crate::guest::chronus::table::LIMITS_ENV,
];
/// How long a new chronus may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The session name a call means: "" is `default`. Errors: `invalid` unless 1 to 128
/// printable ASCII characters.
pub fn session_name(name: &str) -> Result<String, Failure> {
    let name = if name.is_empty() { "default" } else { name };
    if name.len() > 128 || !name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(Failure::invalid(format!(
            "session name {name:?} must be 1 to 128 printable ASCII characters"
        )));
    }
    Ok(name.to_string())
}

/// `<run_dir>/sessions/<first 16 hex digits of sha256(name)>`.
pub fn session_dir(run_dir: &Path, name: &str) -> PathBuf {
    let h = hex::encode(Sha256::digest(name.as_bytes()));
    run_dir.join("sessions").join(&h[..16])
}

/// A running session.
pub struct Live {
    pub pid: i32,
    pub dir: PathBuf,
    /// The user the session runs as: as its first call named it (or `init_user`), and the
    /// uid and gid that resolved to.
    pub user: String,
    pub uid: u32,
    pub gid: u32,
    pub client: RuntimeClient<Channel>,
    /// Turns true when chronus has ended.
    exited: watch::Receiver<bool>,
    /// The session's own cgroup, when it has one: its end kills what is left in it.
    cgroup: Option<(Arc<Workload>, String)>,
    /// This chronus replaces one that ended without the session being closed (killed from
    /// inside): the session's directory and variables are gone, which the next command's
    /// result tells (`state_lost`).
    restarted: std::sync::atomic::AtomicBool,
}

impl Live {
    /// Whether this chronus replaces one that ended; true only for the first caller.
    pub fn take_restarted(&self) -> bool {
        self.restarted
            .swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether this chronus has ended, or ends within `d` (a call it broke off by dying
    /// fails a moment before the reaper has seen it go).
    pub async fn ended_within(&self, d: Duration) -> bool {
        let mut exited = self.exited.clone();
        tokio::time::timeout(d, exited.wait_for(|e| *e))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

#[derive(Default)]
struct Slot {
    cell: OnceCell<Arc<Live>>,
}

/// A `default` session started ahead of its first call, as `init_user`, with the uid and
/// gid it runs as: the first command skips chronus's start (a sandbox's first command is
/// nearly always in `default`). It is not a session until that call takes it; a first call
/// as another user ends it and starts its own, so the first call still fixes the user.
struct Warm {
    slot: Arc<Slot>,
    uid: u32,
    gid: u32,
}

/// The user a session's first call fixed: the name (or spec) it gave and what that resolved
/// to.
#[derive(Debug, Clone)]
struct Fixed {
    user: String,
    uid: u32,
    gid: u32,
}

/// The sessions of this sandbox.
pub struct Sessions {
    cfg: Arc<AetherConfig>,
    reaper: Reaper,
    /// Where each session gets a cgroup of its own, when the sandbox has one.
    workload: Option<Arc<Workload>>,
    map: Mutex<HashMap<String, Arc<Slot>>>,
    warm: OnceCell<Option<Warm>>,
    warm_taken: std::sync::atomic::AtomicBool,
    /// The user of every session that has served a call, kept when its chronus ends (a
    /// session's own processes can kill it) until the session is closed: started again,
    /// it runs as that user, never as `init_user`.
    fixed: Mutex<HashMap<String, Fixed>>,
    /// The request ids of forwarded commands (see [`Requests`]).
    requests: Mutex<Requests>,
    me: Weak<Sessions>,
}

impl Sessions {
    /// The session table; with `workload`, every session gets its own cgroup there.
    pub fn new(
        cfg: Arc<AetherConfig>,
        reaper: Reaper,
        workload: Option<Arc<Workload>>,
    ) -> Arc<Sessions> {
        Arc::new_cyclic(|me| Sessions {
            cfg,
            reaper,
            workload,
            map: Mutex::new(HashMap::new()),
            warm: OnceCell::new(),
            warm_taken: std::sync::atomic::AtomicBool::new(false),
            fixed: Mutex::new(HashMap::new()),
            requests: Mutex::new(Requests::default()),
            me: me.clone(),
        })
    }

    /// Starts the `default` session's chronus ahead of its first call (see [`Warm`]).
    pub async fn prewarm(&self) {
        self.warm.get_or_init(|| self.start_warm()).await;
    }

    async fn start_warm(&self) -> Option<Warm> {
        let creds = user::resolve(&self.cfg.init_user, Path::new("/")).ok()?;
        let slot = Arc::new(Slot::default());
        match self.start("default", "", slot.clone()).await {
            Ok(live) => {
                let _ = slot.cell.set(live);
                Some(Warm {
                    slot,
                    uid: creds.uid,
                    gid: creds.gid,
                })
            }
            Err(f) => {
                tracing::debug!(error = %f.message, "no warm default session");
                None
            }
        }
    }

    /// The warm `default` session if the first call's user is the one it runs as; else
    /// it is ended. Only the first call to `default` asks.
    async fn take_warm(&self, user_spec: &str) -> Option<Arc<Slot>> {
        if self
            .warm_taken
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return None;
        }
        let warm = self.warm.get_or_init(|| self.start_warm()).await.as_ref()?;
        let spec = if user_spec.is_empty() {
            self.cfg.init_user.as_str()
        } else {
            user_spec
        };
        let alive = warm.slot.cell.get().is_some_and(|l| !*l.exited.borrow());
        // The warm session runs as `init_user` itself: no look-up in the image's passwd (a
        // read and parse of it, on the first command's path) for the call that names it.
        let same = spec == self.cfg.init_user
            || user::resolve(spec, Path::new("/"))
                .is_ok_and(|c| (c.uid, c.gid) == (warm.uid, warm.gid));
        if alive && same {
            return Some(warm.slot.clone());
        }
        if let Some(live) = warm.slot.cell.get() {
            end(live).await;
        }
        None
    }

    /// Notes that a command with `request_id` goes to `live`, session `name`'s chronus.
    /// Errors: `not_found` when that id went to an earlier chronus of the session, which
    /// ended (a retry: running it again here would run it twice, docs/sessions.md).
    pub fn forward(&self, name: &str, request_id: &str, live: &Live) -> Result<(), Failure> {
        lock(&self.requests).forward(name, request_id, live.pid)
    }

    /// The running session `name`, if any (no session is started).
    pub fn existing(&self, name: &str) -> Option<Arc<Live>> {
        lock(&self.map)
            .get(name)
            .and_then(|s| s.cell.get().cloned())
    }

    /// Session `name`, started as `user` ("" = the sandbox's `init_user`) if it does not
    /// run yet. A session's user is fixed by its first call: a later call naming another
    /// user (or one that does not exist) is refused; "" is always the session's own.
    /// Errors: `invalid` for an unknown user or another user than the session's;
    /// `unavailable` when chronus does not start.
    pub async fn get(&self, name: &str, user: &str) -> Result<Arc<Live>, Failure> {
        // A session whose chronus ended (killed from inside) starts again as its user.
        let fixed = lock(&self.fixed).get(name).cloned();
        let user = match &fixed {
            Some(f) => {
                same_user(name, &f.user, (f.uid, f.gid), user)?;
                if user.is_empty() {
                    f.user.as_str()
                } else {
                    user
                }
            }
            None => user,
        };
        let live = self.get_or_start(name, user).await?;
        if let Some(f) = fixed
            .as_ref()
            .filter(|f| (f.uid, f.gid) != (live.uid, live.gid))
        {
            // Its user's name resolves to other ids now (/etc/passwd was changed).
            let _ = self.close(name).await;
            return Err(Failure::invalid(format!(
                "user: session {name:?} runs as uid {}, gid {}, fixed by its first command; \
                 {:?} now resolves to uid {}, gid {}: the session is closed",
                f.uid, f.gid, f.user, live.uid, live.gid
            )));
        }
        same_user(name, &live.user, (live.uid, live.gid), user)?;
        lock(&self.fixed)
            .entry(name.to_string())
            .or_insert_with(|| Fixed {
                user: live.user.clone(),
                uid: live.uid,
                gid: live.gid,
            });
        Ok(live)
    }

    async fn get_or_start(&self, name: &str, user: &str) -> Result<Arc<Live>, Failure> {
        if name == "default" && !self.warm_taken.load(std::sync::atomic::Ordering::SeqCst) {
            if let Some(slot) = self.take_warm(user).await {
                let taken = self.install(name, &slot);
                if let Some(live) = slot.cell.get() {
                    if taken {
                        return Ok(live.clone());
                    }
                    end(live).await;
                }
            }
        }
        let slot = lock(&self.map).entry(name.to_string()).or_default().clone();
        let live = slot
            .cell
            .get_or_try_init(|| self.start(name, user, slot.clone()))
            .await?;
        Ok(live.clone())
    }

    /// Makes `slot` session `name` unless a call started that session meanwhile.
    fn install(&self, name: &str, slot: &Arc<Slot>) -> bool {
        let mut m = lock(&self.map);
        match m.get(name) {
            Some(s) if s.cell.initialized() => false,
            _ => {
                m.insert(name.to_string(), slot.clone());
                true
            }
        }
    }

    /// Names of the running sessions, sorted.
    pub fn list(&self) -> Vec<String> {
        let mut v: Vec<String> = lock(&self.map)
            .iter()
            .filter(|(_, s)| s.cell.initialized())
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    async fn start(
        &self,
        name: &str,
        user_spec: &str,
        slot: Arc<Slot>,
    ) -> Result<Arc<Live>, Failure> {
        let spec = if user_spec.is_empty() {
            self.cfg.init_user.as_str()
        } else {
            user_spec
        };
        // A session that served a call and was not closed: its chronus ended.
        let restarted = lock(&self.fixed).contains_key(name);
        let creds = user::resolve(spec, Path::new("/")).map_err(|e| {
            Failure::invalid(format!(
                "session {name:?}: {e}",
                e = crate::types::chain(&e)
            ))
        })?;
        let dir = session_dir(Path::new(&self.cfg.run_dir), name);
        prepare_dir(&dir, creds.uid, creds.gid).map_err(|e| {
            Failure::internal(format!(
                "session {name:?}: preparing {}: {e}",
                dir.display(),
                e = crate::types::chain(&e)
            ))
        })?;
        // aether's own executable (the read-only agent file it was started from), not a path
        // in the sandbox that its root could redirect; the config goes over stdin.
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg("chronus")
            .arg("--dir")
            .arg(&dir)
            .arg("--user")
            .arg(format!("{}:{}", creds.uid, creds.gid))
            .arg("--config")
            .arg("-")
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for k in PASS_ENV {
            if let Ok(v) = std::env::var(k) {
                cmd.env(k, v);
            }
        }
        // Non-dumpable from exec on: a root session must never ptrace a root chronus, not
        // even in the instant before it makes itself non-dumpable.
        crate::sys::process::exec_nondumpable(&mut cmd);
        // chronus stays in the agents' cgroup and moves its shell into the session's own
        // (or, without one, the workload's).
        let cgroup = self.session_cgroup(name, (creds.uid, creds.gid));
        let mut chronus_cfg = AetherConfig {
            workload_cgroup_dir_fds: Vec::new(),
            ..(*self.cfg).clone()
        };
        if let Some(cg) = &cgroup {
            chronus_cfg.workload_cgroup_fds = cg.fds();

            chronus_cfg.command_cgroup_dir_fd = cg.command_dir_fd();
            chronus_cfg.session_oom_fd = cg.oom_fd();
        }
        let inherited: Vec<i32> = chronus_cfg
            .workload_cgroup_fds
            .iter()
            .copied()
            .chain(chronus_cfg.command_cgroup_dir_fd)
            .chain(chronus_cfg.session_oom_fd.into_iter().flat_map(|o| o.fds()))
            .collect();
        if !inherited.is_empty() {
            crate::sys::process::inherit_at_exec(&mut cmd, &inherited);
        }
        let spawned = cmd.spawn();
        // chronus has its copies; aether keeps none.
        let cgroup_name = cgroup.map(
            |SessionCgroup {
                 name,
                 join,
                 command_dir,
                 oom,
             }| {
                drop((join, command_dir, oom));
                name
            },
        );
        let child = spawned.map_err(|e| {
            if let (Some(w), Some(n)) = (&self.workload, &cgroup_name) {
                w.remove(n);
            }
            Failure::unavailable(format!(
                "session {name:?}: starting {}: {e}",
                self.cfg.agent,
                e = crate::types::chain(&e)
            ))
        })?;
        let pid = child.id() as i32;
        let mut exit = self.reaper.watch(child.id());
        let mut child = child;
        if let Some(mut stdin) = child.stdin.take() {
            let json = serde_json::to_vec(&chronus_cfg).unwrap_or_default();
            // A pipe holds 64 KiB; a bigger config (a huge image env) is written by a thread.
            std::thread::spawn(move || {
                let _ = std::io::Write::write_all(&mut stdin, &json);
            });
        }
        let ready_pipe = child.stdout.take();
        drop(child);
        let sock = dir.join("chronus.sock");
        // chronus prints one line once its socket is bound; then a connect cannot fail.
        let ready = async {
            let Some(out) = ready_pipe else { return false };
            let Ok(out) = tokio::process::ChildStdout::from_std(out) else {
                return false;
            };
            let mut line = Vec::new();
            let mut r = tokio::io::BufReader::new(out);
            matches!(
                tokio::io::AsyncBufReadExt::read_until(&mut r, b'\n', &mut line).await,
                Ok(n) if n > 0
            ) && line == crate::guest::chronus::READY_LINE
        };
        let started = tokio::select! {
            ok = tokio::time::timeout(START_TIMEOUT, ready) => ok.unwrap_or(false),
            e = &mut exit => {
                return Err(Failure::unavailable(format!(
                    "session {name:?}: chronus exited at start ({:?})", e.ok()
                )));
            }
        };
        let client = match (started, uds::connect(&sock).await) {
            (true, Ok(c)) => c,
            _ => {
                proctree::kill_tree(pid, true, &HashSet::new());
                return Err(Failure::unavailable(format!(
                    "session {name:?}: chronus did not answer within {START_TIMEOUT:?}"
                )));
            }
        };
        let (tx, exited) = watch::channel(false);
        let me = self.me.clone();
        let name_owned = name.to_string();
        let workload = self.workload.clone();
        let cgroup = workload.clone().zip(cgroup_name.clone());
        tokio::spawn(async move {
            let e = exit.await;
            tracing::info!(session = %name_owned, pid, exit = ?e.ok(), "chronus ended");
            let _ = tx.send(true);
            if let Some(me) = me.upgrade() {
                let mut m = lock(&me.map);
                if m.get(&name_owned).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                    m.remove(&name_owned);
                }
            }
            // chronus is the subreaper of everything the session started; once it is gone
            // (closed, or killed from outside) its orphans would be aether's: end them.
            if let (Some(w), Some(n)) = (workload, cgroup_name) {
                w.kill(&n, 100).await;
                remove_cgroup(&w, &n).await;
            }
        });
        tracing::info!(session = %name, pid, uid = creds.uid, "session started");
        Ok(Arc::new(Live {
            pid,
            dir,
            user: spec.to_string(),
            uid: creds.uid,
            gid: creds.gid,
            client,
            exited,
            cgroup,
            restarted: std::sync::atomic::AtomicBool::new(restarted),
        }))
    }

    /// A new cgroup for session `name`, when the sandbox gives sessions their own; on a
    /// failure the session shares the process API's cgroup (it still starts).
    fn session_cgroup(&self, name: &str, owner: (u32, u32)) -> Option<SessionCgroup> {
        match self.workload.as_ref()?.make_session(Some(owner)) {
            Ok(cg) => {
                tracing::debug!(session = %name, cgroup = %cg.name, "session cgroup made");
                Some(cg)
            }
            Err(e) => {
                tracing::warn!(session = %name, error = %crate::types::chain(&e), "no cgroup of its own for a session");
                None
            }
        }
    }

    /// Ends session `name`: kills chronus's whole process tree, then deletes its
    /// directory. Errors: `not_found` for a session that does not run.
    pub async fn close(&self, name: &str) -> Result<(), Failure> {
        let slot = lock(&self.map).remove(name);
        // Closed, the name is free for a session of another user.
        let was_fixed = lock(&self.fixed).remove(name).is_some();
        let slot = slot.ok_or_else(|| {
            Failure::not_found(if was_fixed {
                format!("session {name:?} does not run (its chronus ended; it was closed now)")
            } else {
                format!("session {name:?} does not exist")
            })
        })?;
        let Some(live) = slot.cell.get() else {
            return Err(Failure::not_found(format!(
                "session {name:?} does not exist"
            )));
        };
        end(live).await;
        tracing::info!(session = %name, "session closed");
        Ok(())
    }

    /// Ends every session (aether's shutdown).
    pub async fn close_all(&self) {
        let mut slots: Vec<Arc<Slot>> = lock(&self.map).drain().map(|(_, s)| s).collect();
        if !self
            .warm_taken
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            if let Some(Some(w)) = self.warm.get() {
                slots.push(w.slot.clone());
            }
        }
        for s in slots {
            if let Some(live) = s.cell.get() {
                end(live).await;
            }
        }
    }
}

/// Removes an ended session's cgroup once the last of its processes is gone (the session's
/// end kills them; they take a moment to exit), giving up after a while: the sandbox's
/// removal takes what is left.
async fn remove_cgroup(w: &Workload, name: &str) {
    for _ in 0..40 {
        if w.remove(name) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tracing::warn!(
        cgroup = name,
        "a session's cgroup still holds processes; left for the sandbox's removal"
    );
}

/// Refuses a call to session `name` that names another user than the one it runs as
/// (`first`, which resolved to `ids`). Errors: `invalid`, naming the session and both users.
fn same_user(name: &str, first: &str, ids: (u32, u32), user: &str) -> Result<(), Failure> {
    if user.is_empty() || user == first {
        return Ok(());
    }
    let shown = if first.is_empty() { "root" } else { first };
    let first = format!("{shown:?} (uid {}, gid {})", ids.0, ids.1);
    match user::resolve(user, Path::new("/")) {
        Ok(c) if (c.uid, c.gid) == ids => Ok(()),
        Ok(c) => Err(Failure::invalid(format!(
            "user: session {name:?} runs as user {first}, fixed by its first command; \
             this call names user {user:?} (uid {}, gid {}): use another session for another user",
            c.uid, c.gid
        ))),
        Err(e) => Err(Failure::invalid(format!(
            "user: session {name:?} runs as user {first}, fixed by its first command; \
             this call names user {user:?}, which is not a user here ({e})"
        ))),
    }
}

async fn end(live: &Live) {
    let mut exited = live.exited.clone();
    for _ in 0..20 {
        if *exited.borrow() {
            break;
        }
        proctree::kill_tree(live.pid, true, &HashSet::new());
        let _ = tokio::time::timeout(Duration::from_millis(250), exited.changed()).await;
    }
    // Anything of the session that is not in chronus's tree any more is still in its
    // cgroup; and the close returns once the cgroup is gone.
    if let Some((w, name)) = &live.cgroup {
        let left = w.kill(name, 100).await;
        if left > 0 {
            tracing::warn!(cgroup = %name, left, "processes of a closed session still run");
        }
        remove_cgroup(w, name).await;
    }
    if let Err(e) = std::fs::remove_dir_all(&live.dir) {
        tracing::debug!(dir = %live.dir.display(), error = %crate::types::chain(&e), "cannot remove a session dir");
    }
}

/// Makes a fresh session dir owned by the session's user, mode 0700 (a stale one from a
/// session of the same name is removed first).
fn prepare_dir(dir: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::DirBuilder::new().mode(0o700).create(dir)?;
    std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_dirs() {
        assert_eq!(session_name("").expect("default"), "default");
        assert_eq!(session_name("a b~").expect("ok"), "a b~");
        assert!(session_name(&"x".repeat(129)).is_err());
        assert!(session_name("a\nb").is_err());
        assert!(session_name("é").is_err());
        let d = session_dir(Path::new("/run"), "default");
        let leaf = d.file_name().and_then(|n| n.to_str()).expect("leaf");
        assert_eq!(leaf.len(), 16);
        assert!(d.starts_with("/run/sessions"));
        assert_ne!(d, session_dir(Path::new("/run"), "other"));
    }
}
