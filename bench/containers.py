"""Real containers: OpenDsec's `container` backend (runtime `linux`, image `host`) against
crun and bubblewrap, measured in one run on the same machine.

    sudo .venv/bin/python bench/containers.py [-n 50] [-exec-n 500] [-k 50] [-json]

Needs root, crun and bwrap (`apt-get install -y crun bubblewrap`), and a running cluster whose
`container` backend is runtime `linux` with the development image `host`, reached through
OPENDSEC_ADDR / OPENDSEC_TOKEN / OPENDSEC_PROJECT (bench/containers.sh starts one). The
`opendsec` binary for `ctl exec` is OPENDSEC_BIN (default: the release build).

What it measures (each peer in the same run, interleaved so that noise falls on all alike):
  1. create → first command output, N times: ours `run_sandbox` + `run_shell("echo hi")`
     (also split into create and first run_shell; stop timed on its own); `crun run` of a
     bundle whose root is the host's / (read-only; namespaces mount, pid, uts, ipc, net,
     cgroup; the same CPU, memory and pids limits as ours); `bwrap --ro-bind / / --proc /proc
     --dev /dev --unshare-all echo hi`. For crun and bwrap the clock stops when "hi" is read
     from their stdout; their exit (crun: container deleted) is reported too.
  2. exec round trip of `true`, EXEC_N times: ours `sb.run_shell("true")` on a warm sandbox,
     `crun exec <id> true` on a running `sleep infinity` container, and our Rust CLI
     `opendsec ctl exec <id> true` (a new process each time) for reference.
  3. host memory per idle sandbox: K sandboxes, each after one `run_shell("true")`: PSS
     (/proc/<pid>/smaps_rollup) summed over the processes of the sandbox's cgroup, and the
     cgroup's memory usage; and the host's MemAvailable drop over the K. The same for K crun
     containers running `sleep infinity`.

crun cannot pivot_root onto / itself (EBUSY), so the bundle's root is a non-recursive bind
mount of / (the same file system, without submounts, as our overlay's lower layer sees it),
made in a private mount namespace that this script re-executes itself in. On a v1-hybrid
host whose cgroup2 mount still holds a controller crun refuses to run ("cgroups in hybrid
mode not supported"), so that namespace also unmounts /sys/fs/cgroup/unified: crun then
sees plain cgroup v1. Neither change is visible outside the benchmark's processes.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("OPENDSEC_BIN", os.path.join(ROOT, "target/x86_64-unknown-linux-gnu/release/opendsec"))
NS_MARK = "OPENDSEC_BENCH_NS"
UNIFIED = "/sys/fs/cgroup/unified"
CRUN_PARENT = "opendsec-bench"
PREFIX = f"odb{os.getpid()}"


# ------------------------------------------------------------------------- setup


def enter_namespace() -> None:
    """Re-executes this script in a private mount namespace (see the module doc); the
    namespace's changes are made by `prepare_namespace` in the new process."""
    if os.environ.get(NS_MARK):
        return
    if os.geteuid() != 0:
        sys.exit("containers.py needs root (crun, bwrap as root, /proc/<pid>/smaps_rollup of every sandbox)")
    missing = [t for t in ("crun", "bwrap", "unshare", "mount") if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: apt-get install -y crun bubblewrap util-linux mount")
    env = dict(os.environ, **{NS_MARK: "1"})
    os.execvpe("unshare", ["unshare", "-m", "--propagation", "private", sys.executable, *sys.argv], env)


def prepare_namespace(tmp: str) -> dict[str, Any]:
    """In the private namespace: makes crun usable on this host and returns the root path
    for its bundles and what was changed."""
    notes: dict[str, Any] = {"cgroup_mode": cgroup_mode()}
    if notes["cgroup_mode"] == "hybrid":
        try:
            with open(os.path.join(UNIFIED, "cgroup.controllers")) as f:
                ctl = f.read().split()
        except OSError:
            ctl = []
        if ctl:
            subprocess.run(["umount", UNIFIED], check=True)
            notes["unmounted_unified_for_crun"] = ctl
    root = os.path.join(tmp, "root")
    os.mkdir(root)
    subprocess.run(["mount", "--bind", "/", root], check=True)
    notes["crun_root"] = "non-recursive bind mount of / (private mount namespace)"
    return {"root": root, "notes": notes}


def cgroup_mode() -> str:
    """`unified` (v2 only), `hybrid` (v1 controllers and a cgroup2 at /sys/fs/cgroup/unified)
    or `legacy`."""
    fstypes = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            fstypes[parts[1]] = parts[2]
    if fstypes.get("/sys/fs/cgroup") == "cgroup2":
        return "unified"
    return "hybrid" if fstypes.get(UNIFIED) == "cgroup2" else "legacy"


def cgroup_roots() -> dict[str, str]:
    """The memory cgroup hierarchy's mount and whether it is v1 or v2."""
    if os.path.isdir("/sys/fs/cgroup/memory") and os.path.exists("/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        return {"memory": "/sys/fs/cgroup/memory", "version": "v1"}
    return {"memory": "/sys/fs/cgroup", "version": "v2"}


def crun_bundle(tmp: str, root: str, name: str, args: list[str], cpu: float, mem_mb: int) -> str:
    """A crun bundle (`crun spec`'s defaults: capabilities, mounts, no terminal) whose root is
    the host's / read-only, with our sandboxes' namespaces and limits."""
    d = os.path.join(tmp, name)
    os.mkdir(d)
    subprocess.run(["crun", "spec", "--bundle", d], check=True)
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    c["process"]["terminal"] = False
    c["process"]["args"] = args
    c["root"] = {"path": root, "readonly": True}
    c["hostname"] = "bench"
    lin = c.setdefault("linux", {})
    lin["namespaces"] = [{"type": t} for t in ("mount", "pid", "uts", "ipc", "network", "cgroup")]
    res = lin.setdefault("resources", {})
    res["memory"] = {"limit": mem_mb << 20, "swap": mem_mb << 20}
    res["cpu"] = {"quota": int(cpu * 100000), "period": 100000}
    res["pids"] = {"limit": 4096}
    with open(p, "w") as f:
        json.dump(c, f)
    return d


def set_cgroup_path(bundle: str, cid: str) -> None:
    """Each crun container gets /opendsec-bench/<id> in every hierarchy (removed by crun)."""
    p = os.path.join(bundle, "config.json")
    with open(p) as f:
        c = json.load(f)
    c["linux"]["cgroupsPath"] = f"/{CRUN_PARENT}/{cid}"
    with open(p, "w") as f:
        json.dump(c, f)


# ------------------------------------------------------------------------- stats


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def summary(v: list[float]) -> dict[str, float]:
    """Median, p99, min and max (same unit as `v`)."""
    if not v:
        return {}
    return {"p50": statistics.median(v), "p99": pct(v, 0.99), "min": min(v), "max": max(v), "n": len(v)}


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000


# ------------------------------------------------------------------------- peers


def run_until_output(argv: list[str], want: bytes) -> tuple[float, float]:
    """Runs argv; returns (ms until `want` was read from its stdout, ms until it exited)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stdout is not None
    buf = b""
    t_out = None
    while want not in buf:
        chunk = os.read(p.stdout.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    t_out = time.perf_counter()
    _, err = p.communicate()
    t_exit = time.perf_counter()
    if p.returncode != 0 or want not in buf:
        raise RuntimeError(f"{argv[0]} exited {p.returncode}: {buf!r} {err.decode(errors='replace')}")
    return ms(t0, t_out), ms(t0, t_exit)


def crun_delete(cid: str) -> None:
    subprocess.run(["crun", "delete", "-f", cid], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def crun_start_detached(bundle: str, cid: str) -> None:
    set_cgroup_path(bundle, cid)
    # The container inherits crun's stdio: no pipe, or reading it would wait for the container.
    subprocess.run(["crun", "run", "-d", "--bundle", bundle, cid], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def remove_crun_parents() -> None:
    for d in glob.glob(f"/sys/fs/cgroup/*/{CRUN_PARENT}") + glob.glob(f"/sys/fs/cgroup/{CRUN_PARENT}"):
        try:
            os.rmdir(d)
        except OSError:
            pass


# ------------------------------------------------------------------------- memory


def smaps(pid: int) -> dict[str, int]:
    """Pss, Pss_Anon, Pss_File, Rss of one process in KiB ({} when it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, rest = line.partition(":")
                if k in ("Rss", "Pss", "Pss_Anon", "Pss_File"):
                    out[k] = int(rest.split()[0])
    except OSError:
        return {}
    return out


def cgroup_procs(d: str) -> list[int]:
    pids: list[int] = []
    for root, _, files in os.walk(d):
        if "cgroup.procs" in files:
            with open(os.path.join(root, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
    return sorted(set(pids))


def cgroup_usage(d: str, version: str) -> dict[str, int]:
    """The memory cgroup's charge in bytes (v1: usage_in_bytes and the kernel part of it)."""
    def read(name: str) -> Optional[int]:
        try:
            with open(os.path.join(d, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    if version == "v1":
        return {"usage": read("memory.usage_in_bytes") or 0, "kmem": read("memory.kmem.usage_in_bytes") or 0}
    return {"usage": read("memory.current") or 0, "kmem": 0}


def measure_cgroup(d: str, version: str) -> dict[str, Any]:
    pids = cgroup_procs(d)
    tot = {"Rss": 0, "Pss": 0, "Pss_Anon": 0, "Pss_File": 0}
    for p in pids:
        for k, v in smaps(p).items():
            tot[k] += v
    u = cgroup_usage(d, version)
    return {"procs": len(pids), "pss_kib": tot["Pss"], "pss_anon_kib": tot["Pss_Anon"], "pss_file_kib": tot["Pss_File"],
            "rss_kib": tot["Rss"], "cgroup_usage_kib": u["usage"] // 1024, "cgroup_kmem_kib": u["kmem"] // 1024}


def mem_available_kib() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, rest = line.partition(":")
            out[k] = int(rest.split()[0])
    return out


def our_cgroup(sb_id: str, mem_root: str) -> str:
    hits = glob.glob(os.path.join(mem_root, "opendsec", "*", sb_id))
    if not hits:
        raise RuntimeError(f"no memory cgroup for sandbox {sb_id} under {mem_root}/opendsec")
    return hits[0]


def mem_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("procs", "pss_kib", "pss_anon_kib", "pss_file_kib", "rss_kib", "cgroup_usage_kib", "cgroup_kmem_kib")
    return {k: statistics.median([r[k] for r in rows]) for k in keys}


def settle() -> None:
    """Lets freed memory and the page cache settle before reading MemAvailable."""
    time.sleep(2)


# ------------------------------------------------------------------------- the runs

NO_CAPACITY_RETRIES = {"count": 0}


async def create(c: Any, args: Any) -> Any:
    """`run_sandbox`, retried on `no_capacity` (see `timed_create`)."""
    return (await timed_create(c, args))[0]


async def timed_create(c: Any, args: Any) -> tuple[Any, float, float]:
    """`run_sandbox`, timing the call that succeeded. A `no_capacity` refusal is retried
    after a pause, untimed, and counted in the output: the apiserver's view of the edge (the
    watcher's snapshot, once a second) still counts sandboxes stopped within the last
    second, so quick create/stop cycles can fill the edge's CPU capacity."""
    from opendsec import DSecError

    for attempt in range(5):
        t0 = time.perf_counter()
        try:
            sb = await c.run_sandbox(args)
            return sb, t0, time.perf_counter()
        except DSecError as e:
            if e.reason != "no_capacity" or attempt == 4:
                raise
            NO_CAPACITY_RETRIES["count"] += 1
            await asyncio.sleep(1.5)
    raise AssertionError("unreachable")


async def bench_create(c: Any, DSecRunArgs: Any, a: argparse.Namespace, tmp: str, root: str) -> dict[str, Any]:
    bundle = crun_bundle(tmp, root, "create", ["echo", "hi"], a.cpu, a.memory_mb)
    bwrap = ["bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-all", "echo", "hi"]
    r: dict[str, list[float]] = {k: [] for k in (
        "ours_create", "ours_first_shell", "ours_total", "ours_stop",
        "crun_output", "crun_exit", "bwrap_output", "bwrap_exit")}
    args = DSecRunArgs(backend="container", image="host", cpu_cores_limit=a.cpu, memory_limit_mb=a.memory_mb)
    for i in range(a.warmup + a.n):
        keep = i >= a.warmup
        sb, t0, t1 = await timed_create(c, args)
        try:
            res = await sb.run_shell("echo hi")
            t2 = time.perf_counter()
            if res.stdout != "hi\n":
                raise RuntimeError(f"sandbox {sb.id}: echo hi gave {res.stdout!r} {res.stderr!r}")
        finally:
            t3 = time.perf_counter()
            await sb.stop()
            t4 = time.perf_counter()
        cid = f"{PREFIX}-c{i}"
        set_cgroup_path(bundle, cid)
        try:
            co, ce = run_until_output(["crun", "run", "--bundle", bundle, cid], b"hi\n")
        finally:
            crun_delete(cid)
        bo, be = run_until_output(bwrap, b"hi\n")
        if keep:
            r["ours_create"].append(ms(t0, t1))
            r["ours_first_shell"].append(ms(t1, t2))
            r["ours_total"].append(ms(t0, t2))
            r["ours_stop"].append(ms(t3, t4))
            r["crun_output"].append(co)
            r["crun_exit"].append(ce)
            r["bwrap_output"].append(bo)
            r["bwrap_exit"].append(be)
    return {k: summary(v) for k, v in r.items()}


async def bench_exec(c: Any, DSecRunArgs: Any, a: argparse.Namespace, tmp: str, root: str) -> dict[str, Any]:
    bundle = crun_bundle(tmp, root, "exec", ["sleep", "infinity"], a.cpu, a.memory_mb)
    cid = f"{PREFIX}-exec"
    sb = await create(c, DSecRunArgs(backend="container", image="host", cpu_cores_limit=a.cpu,
                                     memory_limit_mb=a.memory_mb))
    r: dict[str, list[float]] = {"ours_sdk": [], "ours_cli": [], "crun_exec": []}
    try:
        crun_start_detached(bundle, cid)
        for _ in range(10):  # warm: the session's shell, the CLI binary's pages, crun's
            await sb.run_shell("true")
            subprocess.run(["crun", "exec", cid, "true"], check=True)
            subprocess.run([BIN, "ctl", "exec", sb.id, "true"], check=True)
        # Blocks of 50 per peer, in turn: each peer runs warm back to back, and noise from
        # the shared machine falls on all three alike.
        left = a.exec_n
        while left > 0:
            m = min(50, left)
            left -= m
            for _ in range(m):
                t0 = time.perf_counter()
                res = await sb.run_shell("true")
                r["ours_sdk"].append(ms(t0, time.perf_counter()))
                if res.exit_code != 0:
                    raise RuntimeError(f"run_shell true: exit {res.exit_code}")
            for _ in range(m):
                t0 = time.perf_counter()
                subprocess.run(["crun", "exec", cid, "true"], check=True)
                r["crun_exec"].append(ms(t0, time.perf_counter()))
            for _ in range(m):
                t0 = time.perf_counter()
                subprocess.run([BIN, "ctl", "exec", sb.id, "true"], check=True)
                r["ours_cli"].append(ms(t0, time.perf_counter()))
    finally:
        crun_delete(cid)
        await sb.stop()
    return {k: summary(v) for k, v in r.items()}


async def bench_memory(c: Any, DSecRunArgs: Any, a: argparse.Namespace, tmp: str, root: str) -> dict[str, Any]:
    cg = cgroup_roots()
    out: dict[str, Any] = {"k": a.k, "cgroup": cg["version"]}
    args = DSecRunArgs(backend="container", image="host", cpu_cores_limit=a.mem_cpu, memory_limit_mb=a.mem_memory_mb)
    sbs = []
    settle()
    before = before_ours = mem_available_kib()
    try:
        for _ in range(a.k):
            sb = await create(c, args)
            sbs.append(sb)
            await sb.run_shell("true")
        settle()
        after = mem_available_kib()
        rows = [measure_cgroup(our_cgroup(sb.id, cg["memory"]), cg["version"]) for sb in sbs]
        out["ours"] = mem_summary(rows)
        out["ours"]["host_memavailable_drop_kib"] = (before["MemAvailable"] - after["MemAvailable"]) / a.k
        out["ours"]["host_slab_growth_kib"] = (after["Slab"] - before["Slab"]) / a.k
    finally:
        await asyncio.gather(*(sb.stop() for sb in sbs), return_exceptions=True)
    bundle = crun_bundle(tmp, root, "mem", ["sleep", "infinity"], a.mem_cpu, a.mem_memory_mb)
    cids = [f"{PREFIX}-m{i}" for i in range(a.k)]
    settle()
    before = mem_available_kib()
    try:
        for cid in cids:
            crun_start_detached(bundle, cid)
        settle()
        after = mem_available_kib()
        rows = [measure_cgroup(os.path.join(cg["memory"], CRUN_PARENT, cid), cg["version"]) for cid in cids]
        out["crun"] = mem_summary(rows)
        out["crun"]["host_memavailable_drop_kib"] = (before["MemAvailable"] - after["MemAvailable"]) / a.k
        out["crun"]["host_slab_growth_kib"] = (after["Slab"] - before["Slab"]) / a.k
    finally:
        for cid in cids:
            crun_delete(cid)
    # How many idle sandboxes fit: the memory the host had available with the cluster up and
    # no sandbox, divided by the larger of the per-sandbox PSS and cgroup charge. The cgroup
    # charge holds the kernel objects the sandbox's setup made after joining it (namespaces,
    # mounts, the loop device's ext4); PSS holds a share of the agent binary's pages. The
    # host-wide MemAvailable drop is reported as a cross-check only: other work on a shared
    # machine moves it.
    avail = before_ours["MemAvailable"]
    o = out["ours"]
    per = max(o["pss_kib"], o["cgroup_usage_kib"])
    out["machine_mem_total_kib"] = before_ours["MemTotal"]
    out["available_with_cluster_kib"] = avail
    out["ours_per_sandbox_kib_for_estimate"] = per
    out["ours_idle_sandboxes_fit"] = int(avail // per) if per > 0 else None
    return out


def machine() -> dict[str, Any]:
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def ver(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            return ""

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_total_gib": round(mem_available_kib()["MemTotal"] / 2**20, 1),
            "kernel": platform.release(), "crun": ver(["crun", "--version"]), "bwrap": ver(["bwrap", "--version"]),
            "opendsec_commit": commit, "date": time.strftime("%Y-%m-%d")}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    t = []
    if "create" in res:
        cr = res["create"]
        ours, crun = cr["ours_total"]["p50"], cr["crun_output"]["p50"]
        t.append({"target": "create → first output p50 at or below crun's", "measured":
                  f"ours {ours:.1f} ms (create {cr['ours_create']['p50']:.1f} + first run_shell "
                  f"{cr['ours_first_shell']['p50']:.1f}), crun {crun:.1f} ms", "met": ours <= crun})
    if "exec" in res:
        e = res["exec"]["ours_sdk"]["p50"]
        t.append({"target": "exec round trip p50 under 2 ms", "measured": f"{e:.2f} ms (SDK run_shell)", "met": e < 2.0})
    if "memory" in res:
        m = res["memory"]["ours"]
        worst = max(m["pss_kib"], m["cgroup_usage_kib"]) / 1024
        t.append({"target": "under 4 MB host memory per idle sandbox", "measured":
                  f"PSS {m['pss_kib'] / 1024:.2f} MiB, cgroup {m['cgroup_usage_kib'] / 1024:.2f} MiB, "
                  f"host MemAvailable drop {m['host_memavailable_drop_kib'] / 1024:.2f} MiB", "met": worst < 4.0})
    return t


def table(res: dict[str, Any]) -> str:
    lines = []
    m = res["machine"]
    lines.append(f"machine: {m['cpus']} CPUs ({m['cpu']}), {m['mem_total_gib']} GiB, Linux {m['kernel']}, "
                 f"{m['crun']}, {m['bwrap']}, opendsec {m['opendsec_commit']}, cgroup {res['setup']['cgroup_mode']}")

    def row(name: str, s: dict[str, float]) -> str:
        return f"  {name:<40} p50 {s['p50']:8.2f} ms   p99 {s['p99']:8.2f} ms   (n={s['n']})"
    if "create" in res:
        cr = res["create"]
        lines.append("create → first output")
        for k, name in (("ours_total", "ours: run_sandbox + run_shell('echo hi')"), ("ours_create", "  ours: run_sandbox"),
                        ("ours_first_shell", "  ours: first run_shell"), ("crun_output", "crun run"),
                        ("bwrap_output", "bwrap --unshare-all"), ("ours_stop", "ours: stop (not in the above)"),
                        ("crun_exit", "crun run until exit (deleted)"), ("bwrap_exit", "bwrap until exit")):
            lines.append(row(name, cr[k]))
    if "exec" in res:
        e = res["exec"]
        lines.append("exec round trip of `true` on a warm sandbox")
        for k, name in (("ours_sdk", "ours: SDK run_shell"), ("crun_exec", "crun exec"), ("ours_cli", "ours: opendsec ctl exec")):
            lines.append(row(name, e[k]))
    if "memory" in res:
        mm = res["memory"]
        lines.append(f"host memory per idle sandbox (median of K={mm['k']}, KiB)")
        lines.append(f"  {'':<10}{'procs':>6}{'PSS':>9}{'anon':>9}{'file':>9}{'RSS':>9}{'cgroup':>9}{'kmem':>9}{'host drop':>11}")
        for k in ("ours", "crun"):
            x = mm[k]
            lines.append(f"  {k:<10}{x['procs']:>6.0f}{x['pss_kib']:>9.0f}{x['pss_anon_kib']:>9.0f}{x['pss_file_kib']:>9.0f}"
                         f"{x['rss_kib']:>9.0f}{x['cgroup_usage_kib']:>9.0f}{x['cgroup_kmem_kib']:>9.0f}"
                         f"{x['host_memavailable_drop_kib']:>11.0f}")
        lines.append(f"  fits: {mm['ours_idle_sandboxes_fit']} idle sandboxes in the {mm['available_with_cluster_kib'] / 2**20:.1f} GiB "
                     f"available with the cluster up ({mm['ours_per_sandbox_kib_for_estimate'] / 1024:.2f} MiB each, the "
                     f"larger of PSS and cgroup usage)")
    if res.get("no_capacity_retries"):
        lines.append(f"no_capacity refusals retried (untimed): {res['no_capacity_retries']}")
    lines.append("targets")
    for t in res["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['measured']}")
    return "\n".join(lines)


async def amain(a: argparse.Namespace, tmp: str, setup: dict[str, Any]) -> dict[str, Any]:
    from opendsec import DSecClient, DSecRunArgs

    res: dict[str, Any] = {"machine": machine(), "setup": setup["notes"],
                           "params": {"n": a.n, "exec_n": a.exec_n, "k": a.k, "cpu": a.cpu, "memory_mb": a.memory_mb}}
    async with DSecClient() as c:
        if "create" in a.only:
            res["create"] = await bench_create(c, DSecRunArgs, a, tmp, setup["root"])
        if "exec" in a.only:
            res["exec"] = await bench_exec(c, DSecRunArgs, a, tmp, setup["root"])
        if "memory" in a.only:
            res["memory"] = await bench_memory(c, DSecRunArgs, a, tmp, setup["root"])
    res["no_capacity_retries"] = NO_CAPACITY_RETRIES["count"]
    res["targets"] = targets(res)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prefix_chars="-")
    ap.add_argument("-n", type=int, default=50, help="create runs per peer (default 50)")
    ap.add_argument("-exec-n", "--exec-n", dest="exec_n", type=int, default=500, help="exec round trips (default 500)")
    ap.add_argument("-k", type=int, default=50, help="idle sandboxes for the memory test (default 50)")
    ap.add_argument("-warmup", "--warmup", type=int, default=3, help="untimed create runs first (default 3)")
    ap.add_argument("-cpu", "--cpu", type=float, default=1.0, help="CPU cores limit of each sandbox (default 1)")
    ap.add_argument("-memory-mb", "--memory-mb", dest="memory_mb", type=int, default=512, help="memory limit (default 512)")
    ap.add_argument("-mem-cpu", "--mem-cpu", dest="mem_cpu", type=float, default=0.25,
                    help="CPU limit in the memory test, so that K sandboxes fit the edge's capacity (default 0.25)")
    ap.add_argument("-mem-memory-mb", "--mem-memory-mb", dest="mem_memory_mb", type=int, default=256,
                    help="memory limit in the memory test (default 256)")
    ap.add_argument("-only", "--only", default="create,exec,memory", help="comma separated: create, exec, memory")
    ap.add_argument("-json", "--json", action="store_true", help="print JSON instead of the table")
    a = ap.parse_args()
    a.only = set(a.only.split(","))
    enter_namespace()
    # A SIGTERM (the wrapper's trap) unwinds through the finally blocks that clean up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="odb-crun.") as tmp:
        setup = prepare_namespace(tmp)
        try:
            res = asyncio.run(amain(a, tmp, setup))
        finally:
            remove_crun_parents()
            subprocess.run(["umount", setup["root"]], check=False)
    print(json.dumps(res, indent=2) if a.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
