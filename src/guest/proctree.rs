//! Process trees by parent pid, read from /proc: what a session or a timed-out command
//! started, so it can be killed as a whole (docs/architecture.md, `proctree`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// One /proc entry: its parent, its process group and whether it is a zombie (dead,
/// waiting to be reaped).
#[derive(Debug, Clone, Copy)]
struct Entry {
    ppid: i32,
    pgid: i32,
    zombie: bool,
}

fn snapshot() -> HashMap<i32, Entry> {
    let mut out = HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some(e) = parse_stat(&stat) {
            out.insert(pid, e);
        }
    }
    out
}

/// Parses `/proc/<pid>/stat`: "pid (comm) S ppid pgid ...", comm holding any bytes, so
/// the fields are read after the last ')'.
fn parse_stat(stat: &str) -> Option<Entry> {
    let rest = stat.rsplit_once(')').map(|(_, r)| r)?;
    let mut f = rest.split_whitespace();
    let state = f.next().unwrap_or("");
    let ppid = f.next().and_then(|p| p.parse().ok())?;
    let pgid = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    Some(Entry {
        ppid,
        pgid,
        zombie: state == "Z" || state == "X",
    })
}

/// The live (non-zombie) descendants of `root`, not counting `root`, skipping the
/// subtrees rooted at any pid in `skip`.
pub fn descendants(root: i32, skip: &HashSet<i32>) -> Vec<i32> {
    descendants_in(&snapshot(), root, skip)
}

fn descendants_in(procs: &HashMap<i32, Entry>, root: i32, skip: &HashSet<i32>) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, e) in procs {
        children.entry(e.ppid).or_default().push(*pid);
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for c in children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
            if skip.contains(c) {
                continue;
            }
            if procs.get(c).is_some_and(|e| !e.zombie) {
                out.push(*c);
            }
            stack.push(*c);
        }
    }
    out
}

/// Whether `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// Kills the tree under `root` (and `root` itself when `with_root`), outside the subtrees
/// in `skip`, so that nothing escapes: every member is first stopped (a stopped process
/// cannot fork, and its children stay in the tree while it lives), new members are looked
/// for until none appear, then all get SIGKILL. Returns how many processes were killed.
pub fn kill_tree(root: i32, with_root: bool, skip: &HashSet<i32>) -> usize {
    let mut stopped: HashSet<i32> = HashSet::new();
    if with_root && alive(root) {
        let _ = kill(Pid::from_raw(root), Signal::SIGSTOP);
        stopped.insert(root);
    }
    for _ in 0..64 {
        let fresh: Vec<i32> = descendants(root, skip)
            .into_iter()
            .filter(|p| !stopped.contains(p))
            .collect();
        if fresh.is_empty() {
            break;
        }
        for p in fresh {
            let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
            stopped.insert(p);
        }
    }
    let mut killed = 0;
    for p in &stopped {
        if kill(Pid::from_raw(*p), Signal::SIGKILL).is_ok() {
            killed += 1;
        }
    }
    killed
}

/// Kills the job led by `leader` (a command's subshell), so that nothing of it escapes,
/// fork storms included. When `leader` leads its own process group (and it is not the
/// caller's), the whole group is stopped first with one signal (a stopped process cannot
/// fork, and a storm no longer takes the CPU the rest needs); then every descendant that
/// left the group (`setpgid`, `setsid`) is stopped, new ones looked for until none appear;
/// then the group gets SIGKILL at once (the kernel lets no member fork past a group signal),
/// then the stopped ones. When `leader` leads no group (a shell without job control), its
/// tree is killed as [`kill_tree`] does, unless `group_only` (the leader was reaped: its
/// pid may be another process's now). Returns how many live processes of the job were
/// found (0: it is gone, zombies aside).
pub fn kill_job(leader: i32, group_only: bool) -> usize {
    if leader <= 1 || leader == std::process::id() as i32 {
        return 0;
    }
    let own_group = nix::unistd::getpgrp().as_raw();
    let group = Pid::from_raw(leader);
    // One file and one signal before anything else: a storm is frozen at once.
    let leads = leader != own_group
        && match read_entry(leader) {
            Some(e) if !e.zombie => e.pgid == leader,
            // A group is named after its leader, and a pid is not reused while a group
            // bears it: members with that group id are the job's, even once it is gone.
            _ => true,
        };
    let stopped_group = leads && nix::sys::signal::killpg(group, Signal::SIGSTOP).is_ok();
    if !stopped_group {
        if group_only {
            return 0;
        }
        let live = usize::from(alive(leader)) + descendants(leader, &HashSet::new()).len();
        if live > 0 {
            kill_tree(leader, true, &HashSet::new());
        }
        return live;
    }
    let procs = snapshot();
    let members = procs
        .values()
        .filter(|e| e.pgid == leader && !e.zombie)
        .count();
    let mut stopped: HashSet<i32> = HashSet::new();
    let mut procs = procs;
    for _ in 0..64 {
        let fresh: Vec<i32> = descendants_in(&procs, leader, &HashSet::new())
            .into_iter()
            .filter(|p| procs.get(p).is_some_and(|e| e.pgid != leader) && !stopped.contains(p))
            .collect();
        if fresh.is_empty() {
            break;
        }
        for p in fresh {
            let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
            stopped.insert(p);
        }
        procs = snapshot();
    }
    let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
    for p in &stopped {
        let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
    }
    members + stopped.len()
}

fn read_entry(pid: i32) -> Option<Entry> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat)
}

/// Kills the tree under `root` (see [`kill_tree`]) pass after pass, `pause` apart, until a
/// pass finds nothing or `rounds` passes were made: a shell running a script starts the
/// next command as soon as the previous one dies.
pub async fn kill_tree_until_empty(root: i32, skip: &HashSet<i32>, rounds: usize, pause: Duration) {
    for _ in 0..rounds {
        if kill_tree(root, false, skip) == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_its_own_children() {
        let mut c = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn");
        let me = std::process::id() as i32;
        let d = descendants(me, &HashSet::new());
        assert!(d.contains(&(c.id() as i32)));
        assert!(alive(c.id() as i32));
        let skip = HashSet::from([c.id() as i32]);
        assert!(!descendants(me, &skip).contains(&(c.id() as i32)));
        assert_eq!(kill_tree(c.id() as i32, true, &HashSet::new()), 1);
        let _ = c.wait();
        assert!(!alive(c.id() as i32));
    }
}
