//! Writing a sandbox's limits: CPU quota and idleness, memory without swap, pids, and
//! disk I/O throttles.

use super::{
    pids_value, workload_memory_mb, write_file, write_if_present, write_raw, CgroupError, DiskIo,
    Limits, SandboxCgroup, AGENT_PIDS_MAX, WORKLOAD,
};

/// The CFS period for CPU quotas, in µs (the kernel's default).
const CPU_PERIOD_US: i64 = 100_000;
/// The smallest quota the kernel accepts, in µs.
const CPU_MIN_QUOTA_US: i64 = 1_000;

/// v1: the memory limit of cgroup `dir` (`None`: no limit), without swap on top.
fn set_memory_v1(dir: &std::path::Path, bytes: Option<i64>) -> Result<(), CgroupError> {
    let v = bytes.unwrap_or(-1).to_string();
    let limit = dir.join("memory.limit_in_bytes");
    let memsw = dir.join("memory.memsw.limit_in_bytes");
    // memsw must stay >= the memory limit: lowering goes limit first, raising memsw
    // first. Try the first order; EINVAL means it was a raise.
    match write_raw(&limit, &v) {
        Ok(()) => {
            write_if_present(&memsw, &v)?;
        }
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && memsw.exists() => {
            write_file(&memsw, &v)?;
            write_file(&limit, &v)?;
        }
        Err(source) => {
            return Err(CgroupError::Write {
                path: limit,
                value: v,
                source,
            })
        }
    }
    Ok(())
}

impl SandboxCgroup {
    /// Applies `limits` (see [`Cgroups::create`]); also what a warm sandbox taken for a
    /// request with other limits needs. The sandbox's own `pids.max` is the workload's
    /// `pids_max` plus the agents' reserve; the children's limits are written where their
    /// files exist already (v1; v2 once the setup process enabled the controllers).
    /// Errors: `Write` with the file the kernel refused.
    pub fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let at = self.layout.at.clone();
        if let Some(h) = at.cpu {
            self.set_cpu(h, limits)?;
        }
        if let Some(h) = at.memory {
            self.set_memory(h, limits.memory_mb)?;
        }
        if let Some(h) = at.pids {
            let total = if limits.pids_max > 0 {
                limits.pids_max.saturating_add(AGENT_PIDS_MAX)
            } else {
                0
            };
            write_file(&self.dir(h).join("pids.max"), &pids_value(total))?;
        }
        for (path, value) in self.child_limit_writes(limits) {
            write_if_present(&path, &value)?;
        }
        Ok(())
    }

    fn set_cpu(&self, h: usize, limits: &Limits) -> Result<(), CgroupError> {
        let dir = self.dir(h);
        let quota = (limits.cpu_cores.is_finite() && limits.cpu_cores > 0.0).then(|| {
            ((limits.cpu_cores * CPU_PERIOD_US as f64).round() as i64).max(CPU_MIN_QUOTA_US)
        });
        if self.is_v2(h) {
            let q = quota.map_or("max".to_string(), |q| q.to_string());
            write_file(&dir.join("cpu.max"), &format!("{q} {CPU_PERIOD_US}"))?;
            let idle = if limits.idle { "1" } else { "0" };
            if !write_if_present(&dir.join("cpu.idle"), idle)? {
                // Kernels before 5.15: the lowest weight is the closest to idle.
                let weight = if limits.idle { "1" } else { "100" };
                write_if_present(&dir.join("cpu.weight"), weight)?;
            }
        } else {
            write_file(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
            write_file(
                &dir.join("cpu.cfs_quota_us"),
                &quota.unwrap_or(-1).to_string(),
            )?;
            let shares = if limits.idle { "2" } else { "1024" };
            write_file(&dir.join("cpu.shares"), shares)?;
        }
        Ok(())
    }

    fn set_memory(&self, h: usize, memory_mb: i64) -> Result<(), CgroupError> {
        let dir = self.dir(h);
        let bytes = (memory_mb > 0).then(|| memory_mb.saturating_mul(1 << 20));
        if self.is_v2(h) {
            let v = bytes.map_or("max".to_string(), |b| b.to_string());
            write_file(&dir.join("memory.max"), &v)?;
            write_if_present(&dir.join("memory.swap.max"), "0")?;
            return Ok(());
        }
        set_memory_v1(&dir, bytes)?;
        // The OOM killer must act in the sandbox (not hang it at the limit).
        write_if_present(&dir.join("memory.oom_control"), "0")?;
        let workload = dir.join(WORKLOAD);
        if workload.join("memory.limit_in_bytes").exists() {
            let w = workload_memory_mb(memory_mb);
            set_memory_v1(&workload, (w > 0).then(|| w.saturating_mul(1 << 20)))?;
            write_if_present(&workload.join("memory.oom_control"), "0")?;
        }
        Ok(())
    }

    /// Throttles the sandbox's I/O on the block device `major:minor` (its loop device): v2
    /// `io.max`, v1 `blkio.throttle.*`; 0 in `io` removes that limit. Errors:
    /// `NoController` without an io/blkio controller, `Write`.
    pub fn set_disk_io(&self, major: u32, minor: u32, io: &DiskIo) -> Result<(), CgroupError> {
        let h = self
            .layout
            .at
            .io
            .ok_or(CgroupError::NoController { controller: "io" })?;
        let dir = self.dir(h);
        let bps = |mb: i64| (mb > 0).then(|| mb.saturating_mul(1 << 20));
        let ops = |n: i64| (n > 0).then_some(n);
        let vals = [
            ("rbps", "read_bps_device", bps(io.read_mbps)),
            ("wbps", "write_bps_device", bps(io.write_mbps)),
            ("riops", "read_iops_device", ops(io.read_iops)),
            ("wiops", "write_iops_device", ops(io.write_iops)),
        ];
        if self.is_v2(h) {
            let parts: Vec<String> = vals
                .iter()
                .map(|(k, _, v)| format!("{k}={}", v.map_or("max".into(), |v| v.to_string())))
                .collect();
            write_file(
                &dir.join("io.max"),
                &format!("{major}:{minor} {}", parts.join(" ")),
            )
        } else {
            for (_, file, v) in vals {
                write_file(
                    &dir.join(format!("blkio.throttle.{file}")),
                    &format!("{major}:{minor} {}", v.unwrap_or(0)),
                )?;
            }
            Ok(())
        }
    }
}
