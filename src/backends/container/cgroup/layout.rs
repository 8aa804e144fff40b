//! Which mounted hierarchy holds each controller: parsing /proc/self/mountinfo and
//! deciding per controller between a v1 hierarchy and cgroup v2.

use std::path::PathBuf;

/// A controller the backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ctl {
    Cpu,
    Cpuacct,
    Memory,
    Pids,
    Freezer,
    Io,
}

impl Ctl {
    pub(super) const ALL: [Ctl; 6] = [
        Ctl::Cpu,
        Ctl::Cpuacct,
        Ctl::Memory,
        Ctl::Pids,
        Ctl::Freezer,
        Ctl::Io,
    ];

    pub(super) fn v1_name(self) -> &'static str {
        match self {
            Ctl::Cpu => "cpu",
            Ctl::Cpuacct => "cpuacct",
            Ctl::Memory => "memory",
            Ctl::Pids => "pids",
            Ctl::Freezer => "freezer",
            Ctl::Io => "blkio",
        }
    }

    /// The v2 controller to enable, or `None` where v2 has it built in (freezer) or folded
    /// into another (cpuacct into cpu).
    pub(super) fn v2_name(self) -> Option<&'static str> {
        match self {
            Ctl::Cpu => Some("cpu"),
            Ctl::Memory => Some("memory"),
            Ctl::Pids => Some("pids"),
            Ctl::Io => Some("io"),
            Ctl::Cpuacct | Ctl::Freezer => None,
        }
    }
}

/// One mounted hierarchy the sandboxes use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hierarchy {
    pub(super) mount: PathBuf,
    pub(super) v2: bool,
    /// v1: the controllers as mounted, e.g. `memory` or `cpu,cpuacct`; v2: empty.
    pub(super) name: String,
}

/// Which hierarchy (an index into `hierarchies`) holds each controller.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Placement {
    pub(super) cpu: Option<usize>,
    pub(super) memory: Option<usize>,
    pub(super) pids: Option<usize>,
    pub(super) io: Option<usize>,
    pub(super) freezer: Option<usize>,
}

/// One cgroup mount from /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CgroupMount {
    pub(super) mount: PathBuf,
    pub(super) v2: bool,
    /// v1: the controllers of the hierarchy (only those named in the super options).
    pub(super) controllers: Vec<String>,
}

/// Parses the cgroup and cgroup2 mounts out of /proc/self/mountinfo text. Read-only mounts
/// are skipped (nothing can be created there).
pub(super) fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        let (Some(mount), Some(opts), Some(fstype), Some(super_opts)) =
            (pre.get(4), pre.get(5), post.first(), post.get(2))
        else {
            continue;
        };
        let v2 = match *fstype {
            "cgroup" => false,
            "cgroup2" => true,
            _ => continue,
        };
        if opts.split(',').any(|o| o == "ro") {
            continue;
        }
        let controllers = if v2 {
            Vec::new()
        } else {
            super_opts
                .split(',')
                .filter(|o| Ctl::ALL.iter().any(|c| c.v1_name() == *o))
                .map(str::to_string)
                .collect()
        };
        out.push(CgroupMount {
            mount: PathBuf::from(unescape_mount(mount)),
            v2,
            controllers,
        });
    }
    out
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
pub(super) fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut rest = b;
    while let Some((&c, tail)) = rest.split_first() {
        match tail {
            [d1 @ b'0'..=b'9', d2 @ b'0'..=b'9', d3 @ b'0'..=b'9', after @ ..] if c == b'\\' => {
                let v = (d1 - b'0')
                    .wrapping_mul(64)
                    .wrapping_add((d2 - b'0') * 8)
                    .wrapping_add(d3 - b'0');
                out.push(v);
                rest = after;
            }
            _ => {
                out.push(c);
                rest = tail;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Decides which hierarchy holds each controller: a v1 hierarchy that has it, else the v2
/// one when its root lists it in `cgroup.controllers`. The freezer falls back to v2, where
/// it is built in. The first mount of a hierarchy wins (the same one may be mounted twice).
pub(super) fn place(
    mounts: &[CgroupMount],
    v2_controllers: &[String],
) -> (Vec<Hierarchy>, Placement) {
    let mut hierarchies: Vec<Hierarchy> = Vec::new();
    let mut index = |h: Hierarchy| -> usize {
        match hierarchies
            .iter()
            .position(|x| x.v2 == h.v2 && x.name == h.name)
        {
            Some(i) => i,
            None => {
                hierarchies.push(h);
                hierarchies.len() - 1
            }
        }
    };
    let v2_mount = mounts.iter().find(|m| m.v2);
    let mut at = Placement::default();
    for ctl in Ctl::ALL {
        let v1 = mounts
            .iter()
            .find(|m| !m.v2 && m.controllers.iter().any(|c| c == ctl.v1_name()));
        let slot = if let Some(m) = v1 {
            Some(index(Hierarchy {
                mount: m.mount.clone(),
                v2: false,
                name: m.controllers.join(","),
            }))
        } else if let Some(m) = v2_mount {
            let on_v2 = match ctl.v2_name() {
                Some(n) => v2_controllers.iter().any(|c| c == n),
                None => ctl == Ctl::Freezer,
            };
            on_v2.then(|| {
                index(Hierarchy {
                    mount: m.mount.clone(),
                    v2: true,
                    name: String::new(),
                })
            })
        } else {
            None
        };
        match ctl {
            Ctl::Cpu => at.cpu = slot,
            Ctl::Memory => at.memory = slot,
            Ctl::Pids => at.pids = slot,
            Ctl::Io => at.io = slot,
            Ctl::Freezer => at.freezer = slot,
            // Only accounted: it needs its directory (processes join it) but no file of ours.
            Ctl::Cpuacct => {}
        }
    }
    (hierarchies, at)
}

/// A single path component: no separators, not `.` or `..`, not empty.
pub(super) fn valid_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\0')
}

/// `opendsec/<edge_id>` as a relative path; `None` when a component is unusable.
pub(super) fn parent_path(parent: &str) -> Option<PathBuf> {
    let trimmed = parent.trim_matches('/');
    if trimmed.is_empty() {
        return Some(PathBuf::new());
    }
    trimmed
        .split('/')
        .all(valid_component)
        .then(|| PathBuf::from(trimmed))
}

#[cfg(test)]
mod tests {
    use super::super::{CgroupVersion, Cgroups};
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const PURE_V2: &str = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    /// Debian's old systemd hybrid with `cpu,cpuacct` together, memory moved to v2
    /// (`cgroup_no_v1=memory`), a read-only duplicate, and no v1 freezer.
    const MIXED: &str = "\
30 24 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:5 - cgroup2 cgroup2 rw
31 24 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:6 - cgroup cgroup rw,cpu,cpuacct
50 24 0:27 / /mnt/a\\040b ro,nosuid - cgroup cgroup rw,cpu,cpuacct
32 24 0:28 / /sys/fs/cgroup/pids rw,nosuid shared:7 - cgroup cgroup rw,pids
";

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn hybrid_layout_uses_v1_for_everything() {
        let mounts = parse_mountinfo(HYBRID);
        assert_eq!(mounts.len(), 10, "tmpfs skipped: {mounts:?}");
        let (hs, at) = place(&mounts, &strs(&["hugetlb"]));
        let names: Vec<&str> = hs.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(
            names,
            ["cpu", "cpuacct", "memory", "pids", "freezer", "blkio"]
        );
        assert!(hs.iter().all(|h| !h.v2));
        let cg = Cgroups::from_parts("opendsec/e1".into(), hs, at);
        assert_eq!(cg.version(), CgroupVersion::V1);
        let mounts = cg.open("e1.x").mounts();
        assert_eq!(
            mounts[2],
            (
                PathBuf::from("/sys/fs/cgroup/memory/opendsec/e1/e1.x"),
                "memory".into()
            )
        );
        assert!(cg.layout.v2_enable.is_empty());
    }

    #[test]
    fn pure_v2_layout() {
        let mounts = parse_mountinfo(PURE_V2);
        let (hs, at) = place(&mounts, &strs(&["cpuset", "cpu", "io", "memory", "pids"]));
        assert_eq!(hs.len(), 1);
        assert_eq!(at.freezer, Some(0));
        let cg = Cgroups::from_parts("opendsec/e1".into(), hs, at);
        assert_eq!(cg.version(), CgroupVersion::V2);
        assert_eq!(cg.layout.v2_enable, ["cpu", "memory", "pids", "io"]);
        assert_eq!(
            cg.open("e1.x").mounts(),
            [(
                PathBuf::from("/sys/fs/cgroup/opendsec/e1/e1.x"),
                String::new()
            )]
        );
    }

    #[test]
    fn mixed_layout_places_each_controller() {
        let mounts = parse_mountinfo(MIXED);
        assert!(
            !mounts.iter().any(|m| m.mount.starts_with("/mnt")),
            "ro skipped"
        );
        assert_eq!(unescape_mount("/mnt/a\\040b"), "/mnt/a b");
        let (hs, at) = place(&mounts, &strs(&["memory", "io"]));
        let cg = Cgroups::from_parts("p".into(), hs, at.clone());
        assert_eq!(cg.version(), CgroupVersion::V2);
        let names: Vec<(bool, &str)> = cg
            .layout
            .hierarchies
            .iter()
            .map(|h| (h.v2, h.name.as_str()))
            .collect();
        assert_eq!(names, [(false, "cpu,cpuacct"), (true, ""), (false, "pids")]);
        assert_eq!(
            (at.cpu, at.memory, at.pids, at.io, at.freezer),
            (Some(0), Some(1), Some(2), Some(1), Some(1))
        );
        assert_eq!(cg.layout.v2_enable, ["memory", "io"]);
        let m = cg.open("s").mounts();
        assert_eq!(m[1].1, "unified");
        assert_eq!(m[0].1, "cpu,cpuacct");
    }
}
