//! What the edge measures on its host (22-components §5 "Reporting"): MemAvailable and
//! MemTotal from `/proc/meminfo`, CPU use from `/proc/stat` smoothed over 10 s, CPU
//! pressure (`/proc/pressure/cpu`, "some avg10"), and the size and free space of the file
//! system holding `state_dir`. Parsers are pure; `HostProbe` does the reading.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One reading of the host. Sizes in MB.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostSample {
    pub cpus: f64,
    pub mem_total_mb: i64,
    pub mem_available_mb: i64,
    pub disk_total_mb: i64,
    pub disk_free_mb: i64,
    /// `/proc/pressure/cpu` some avg10 (percent); `None` without PSI.
    pub cpu_pressure: Option<f64>,
    /// CPU busy share over the last ~10 s, 0..1.
    pub cpu_usage: f64,
}

impl HostSample {
    /// Share of memory in use, 0..1.
    pub fn mem_usage(&self) -> f64 {
        if self.mem_total_mb <= 0 {
            return 0.0;
        }
        (1.0 - self.mem_available_mb as f64 / self.mem_total_mb as f64).clamp(0.0, 1.0)
    }
}

/// `(MemTotal, MemAvailable)` in MB from `/proc/meminfo` text.
pub fn parse_meminfo(text: &str) -> Option<(i64, i64)> {
    let field = |name: &str| -> Option<i64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: i64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb / 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

/// `(busy, total)` jiffies of the aggregate `cpu` line of `/proc/stat`.
pub fn parse_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    let total: u64 = v.iter().sum();
    Some((total.saturating_sub(idle), total))
}

/// `some avg10` (percent) from `/proc/pressure/cpu` text.
pub fn parse_psi(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("avg10="))
        .and_then(|v| v.parse().ok())
}

/// `(total, free)` MB of the file system holding `path` (or its nearest existing ancestor).
pub fn fs_space(path: &Path) -> Option<(i64, i64)> {
    let mut p = path;
    loop {
        if p.exists() {
            break;
        }
        p = p.parent()?;
    }
    let st = rustix::fs::statvfs(p).ok()?;
    let unit = if st.f_frsize > 0 {
        st.f_frsize
    } else {
        st.f_bsize
    };
    let mb = |blocks: u64| (blocks.saturating_mul(unit) / (1024 * 1024)) as i64;
    Some((mb(st.f_blocks), mb(st.f_bavail)))
}

/// CPU use over a sliding window of `/proc/stat` readings.
#[derive(Debug, Default)]
pub struct CpuWindow {
    window: Duration,
    points: VecDeque<(Instant, u64, u64)>,
}

impl CpuWindow {
    pub fn new(window: Duration) -> CpuWindow {
        CpuWindow {
            window,
            points: VecDeque::new(),
        }
    }

    /// Adds a reading taken at `at` and returns the busy share since the oldest reading
    /// still inside the window (0 until there are two readings).
    pub fn push(&mut self, at: Instant, busy: u64, total: u64) -> f64 {
        self.points.push_back((at, busy, total));
        while self.points.len() > 2
            && self
                .points
                .get(1)
                .is_some_and(|p| at.duration_since(p.0) >= self.window)
        {
            self.points.pop_front();
        }
        let (Some(first), Some(last)) = (self.points.front(), self.points.back()) else {
            return 0.0;
        };
        let dt = last.2.saturating_sub(first.2);
        if dt == 0 {
            return 0.0;
        }
        (last.1.saturating_sub(first.1) as f64 / dt as f64).clamp(0.0, 1.0)
    }
}

/// Reads the host. `proc_root` is `/proc` except in tests.
#[derive(Debug)]
pub struct HostProbe {
    proc_root: PathBuf,
    state_dir: PathBuf,
    cpu: CpuWindow,
}

impl HostProbe {
    pub fn new(proc_root: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> HostProbe {
        HostProbe {
            proc_root: proc_root.into(),
            state_dir: state_dir.into(),
            cpu: CpuWindow::new(Duration::from_secs(10)),
        }
    }

    /// Takes one reading. Values that cannot be read are 0 (`cpu_pressure`: `None`).
    pub fn sample(&mut self) -> HostSample {
        let read = |name: &str| std::fs::read_to_string(self.proc_root.join(name)).ok();
        let (mem_total_mb, mem_available_mb) = read("meminfo")
            .as_deref()
            .and_then(parse_meminfo)
            .unwrap_or((0, 0));
        let cpu_usage = match read("stat").as_deref().and_then(parse_stat) {
            Some((busy, total)) => self.cpu.push(Instant::now(), busy, total),
            None => 0.0,
        };
        let cpu_pressure = read("pressure/cpu").as_deref().and_then(parse_psi);
        let (disk_total_mb, disk_free_mb) = fs_space(&self.state_dir).unwrap_or((0, 0));
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0);
        HostSample {
            cpus,
            mem_total_mb,
            mem_available_mb,
            disk_total_mb,
            disk_free_mb,
            cpu_pressure,
            cpu_usage,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_stat_and_psi_parse() {
        let mi = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:    2048000 kB\n";
        assert_eq!(parse_meminfo(mi), Some((24000, 2000)));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
        let st = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n";
        assert_eq!(parse_stat(st), Some((150, 1000)));
        assert_eq!(parse_stat("intr 1 2\n"), None);
        let psi = "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_psi(psi), Some(12.5));
        assert_eq!(parse_psi(""), None);
    }

    #[test]
    fn cpu_window_averages_over_the_window() {
        let t0 = Instant::now();
        let mut w = CpuWindow::new(Duration::from_secs(10));
        assert_eq!(w.push(t0, 0, 0), 0.0);
        // 50% busy for 5 s, then 100% busy for 5 s.
        assert!((w.push(t0 + Duration::from_secs(5), 250, 500) - 0.5).abs() < 1e-9);
        assert!((w.push(t0 + Duration::from_secs(10), 750, 1000) - 0.75).abs() < 1e-9);
        // 15 s: the first 5 s fall out of the window.
        let u = w.push(t0 + Duration::from_secs(15), 1250, 1500);
        assert!((u - 1.0).abs() < 1e-9, "{u}");
    }

    #[test]
    fn probe_reads_a_fake_proc_and_the_real_fs() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let proc_root = dir.path().join("proc");
        std::fs::create_dir_all(proc_root.join("pressure")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(
            proc_root.join("meminfo"),
            "MemTotal: 2097152 kB\nMemAvailable: 1048576 kB\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(proc_root.join("stat"), "cpu 1 0 1 8 0 0 0 0\n")
            .unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(
            proc_root.join("pressure/cpu"),
            "some avg10=7.00 avg60=0 avg300=0 total=0\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut p = HostProbe::new(&proc_root, dir.path().join("not/yet/made"));
        let s = p.sample();
        assert_eq!((s.mem_total_mb, s.mem_available_mb), (2048, 1024));
        assert_eq!(s.cpu_pressure, Some(7.0));
        assert!((s.mem_usage() - 0.5).abs() < 1e-9);
        assert!(
            s.disk_total_mb > 0 && s.disk_free_mb <= s.disk_total_mb,
            "statvfs of the nearest existing ancestor"
        );
        assert!(s.cpus >= 1.0);
        std::fs::remove_file(proc_root.join("pressure/cpu")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.sample().cpu_pressure, None, "no PSI file: no pressure");
    }
}
