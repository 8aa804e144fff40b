//! Process trees by parent pid, read from /proc: what a session or a timed-out command
//! started, so it can be killed as a whole (22-components §11, `proctree`).

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
        // "pid (comm) S ppid ...": comm may hold spaces and parentheses, so parse after
        // the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().unwrap_or("");
        let Some(ppid) = f.next().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let pgid = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        out.insert(
            pid,
            Entry {
                ppid,
                pgid,
                zombie: state == "Z" || state == "X",
            },
        );
    }
    out
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
/// fork storms included: when `leader` leads its own process group (and it is not the
/// caller's), first every descendant that left the group (`setpgid`, `setsid`) is stopped,
/// new ones looked for until none appear (a stopped process cannot fork, and its children
/// stay in the tree); then the whole group gets SIGKILL at once (the kernel lets no member
/// fork past a group signal), then the stopped ones. When `leader` leads no group (a shell
/// without job control), its tree is killed as [`kill_tree`] does. Returns how many live
/// processes of the job were found (0: it is gone, zombies aside).
pub fn kill_job(leader: i32) -> usize {
    if leader <= 1 || leader == std::process::id() as i32 {
        return 0;
    }
    let procs = snapshot();
    let own_group = nix::unistd::getpgrp().as_raw();
    // A group is named after its leader, and a pid is not reused while a group bears it:
    // members with that group id are the job's, even once the leader is gone.
    let leads = leader != own_group
        && match procs.get(&leader) {
            Some(e) if !e.zombie => e.pgid == leader,
            _ => procs.values().any(|e| e.pgid == leader && !e.zombie),
        };
    if !leads {
        let live = usize::from(alive(leader)) + descendants(leader, &HashSet::new()).len();
        if live > 0 {
            kill_tree(leader, true, &HashSet::new());
        }
        return live;
    }
    let members = procs
        .iter()
        .filter(|(_, e)| e.pgid == leader && !e.zombie)
        .count();
    let mut stopped: HashSet<i32> = HashSet::new();
    for _ in 0..64 {
        let procs = snapshot();
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
    }
    let _ = nix::sys::signal::killpg(Pid::from_raw(leader), Signal::SIGKILL);
    for p in &stopped {
        let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
    }
    members + stopped.len()
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
