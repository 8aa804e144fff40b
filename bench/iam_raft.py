"""What replicating IAM costs, and how long a leader's death stops admissions: the same control
plane with a standalone durable IAM (`iam.state`, every change fsynced, group-committed) and
with IAM as three Raft replicas (`iam.replicas`, each started as `opendsec iam -replica N`),
everything else equal, in one run.

    .venv/bin/python bench/iam_raft.py -work DIR [-pids FILE] [-runs 3] [-count 5000]
        [-concurrency 64] [-batch 32768] [-edges 8] [-rounds 20] [-only compare,failover]
        [-sides standalone,replicated[,leader-first]] [-keep-logs DIR] [-out FILE] [-json]

bench/iam_raft.sh builds the binary, makes DIR and removes it, and kills whatever this left
behind by the pids written to FILE (one a line, as each process starts). Every role is a
process of its own, on 127.0.0.1 only, plaintext with a service token, from a config written
here: one watcher, one apiserver (`-index 0`), `-edges` sim edges in one `opendsec edge -id
all` process (their capacity as `cluster up -sim-edges` gives them), per-principal rate
limits off (as bench/sdk_create.py: otherwise the default create_rate of 2000/s is what is
measured), and IAM either standalone (`iam.state` in DIR) or three replicas (`data_dir`s in
DIR, all on the same disk here). Logs: IAM at info (its Raft state changes), the rest at warn.

Parts:
  compare   RUNS fresh clusters of each kind, in the order S R R S S R ... so that the
            machine's drift falls on both alike. On each: 200 untimed creations, then (a)
            COUNT single creations from CONCURRENCY coroutines of one Python SDK client
            (`run_sandbox`, backend sim, 1 core, 512 MB: what bench/sdk_create.py does),
            creations/s = COUNT / wall time, p50 and p99 of each call; CPU seconds of every
            process over that phase; (b) one batch of BATCH through the Rust CLI, `opendsec ctl
            sandbox create -backend sim -count BATCH` (`CreateSandboxes`, streamed; wall time
            of the command, process start included, and the CLI's own "created N/N in T").
            `-sides ...,leader-first` adds replicated clusters whose other roles get a config
            listing the elected leader first in `iam.replicas` (IAM's clients call the first
            replica until it fails, so otherwise they call a follower 2 times in 3).
  failover  a fresh three-replica cluster; STREAM coroutines create sandboxes in a loop
            (PAUSE ms between calls each). ROUNDS times: after 1 s of steady stream, the
            leader (the replica whose /metrics has `opendsec_iam_leader 1`) is killed with
            SIGKILL; measured from the kill: until a survivor reports itself leader
            (`election`), until the first creation *sent after the kill* is answered with
            success (`recovery`, the figure the goal is about), and until any creation
            completes with success (`first_ok`, which may have been committed before the
            kill). Then the replica is started again on its data_dir and the round waits
            until it has caught up: its /readyz answers 200 and its `opendsec_iam_leases`
            reaches what the leader's said just before (leases only grow here: nothing is
            stopped). Every failed creation is counted and its error kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("OPENDSEC_BIN", os.path.join(ROOT, "target/x86_64-unknown-linux-gnu/release/opendsec"))
TICK = os.sysconf("SC_CLK_TCK")

# Only what this script sets decides where the clients go.
for _k in [k for k in os.environ if k.startswith("OPENDSEC_") and k != "OPENDSEC_BIN"]:
    del os.environ[_k]


# ------------------------------------------------------------------------- stats


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def summary(v: list[float]) -> dict[str, float]:
    if not v:
        return {"n": 0}
    return {"p50": statistics.median(v), "p90": pct(v, 0.90), "p99": pct(v, 0.99), "mean": statistics.fmean(v),
            "min": min(v), "max": max(v), "n": len(v)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"iam_raft: {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- processes


class Proc:
    """One role process, its stderr in `log`; its pid goes to the pids file at each start."""

    def __init__(self, name: str, args: list[str], logfile: str, pids: str | None) -> None:
        self.name, self.args, self.logfile, self.pids = name, args, logfile, pids
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.logfile, "ab") as lf:
            self.p = subprocess.Popen([BIN, *self.args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=lf, start_new_session=True)
        if self.pids:
            with open(self.pids, "a") as f:
                f.write(f"{self.p.pid}\n")

    @property
    def pid(self) -> int:
        assert self.p is not None
        return self.p.pid

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def sigkill(self) -> None:
        if self.p is not None:
            if self.p.poll() is None:
                self.p.kill()
            self.p.wait()

    def stop(self, grace: float = 3.0) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()

    def cpu_s(self) -> float:
        """User + system CPU seconds so far (0 once it has exited)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, ValueError, AssertionError):
            return 0.0


class Cluster:
    """A cluster of role processes from a config written here: IAM standalone with a state
    file (`mode` "standalone") or three replicas ("replicated")."""

    def __init__(self, mode: str, work: str, edges: int, pids: str | None) -> None:
        self.mode = mode
        self.dir = tempfile.mkdtemp(prefix=f"{mode[:4]}.", dir=work)
        self.pids = pids
        self.token = "dsk.admin." + secrets.token_hex(16)
        self.api = f"127.0.0.1:{free_port()}"
        edge_cfgs = [{
            "id": f"sim-{i}", "addr": f"127.0.0.1:{free_port()}",
            # What `cluster up -sim-edges` gives a sim edge.
            "capacity": {"cpu_cores": 8192, "memory_mb": 67108864, "disk_mb": 67108864},
            "mem_reserve_mb": -1, "disk_reserve_mb": -1, "state_dir": os.path.join(self.dir, "edges"),
            "backends": {"sim": {"runtime": "sim"}},
        } for i in range(edges)]
        iam: dict[str, Any] = {"admin_token": self.token}
        self.iam_metrics: list[int] = []
        if mode == "standalone":
            iam["addr"] = f"127.0.0.1:{free_port()}"
            iam["state"] = os.path.join(self.dir, "iam.state")
            self.iam_metrics = [free_port()]
        else:
            iam["replicas"] = [{
                "id": str(i), "addr": f"127.0.0.1:{free_port()}", "raft_addr": f"127.0.0.1:{free_port()}",
                "data_dir": os.path.join(self.dir, f"iam-{i}"),
            } for i in range(3)]
            self.iam_metrics = [free_port() for _ in range(3)]
        cfg = {
            "service_token": secrets.token_hex(20),
            "iam": iam,
            "watcher": {"addr": f"127.0.0.1:{free_port()}", "probe_interval": 0.25},
            "apiserver": [{"addr": self.api, "snapshot_refresh": 0.25}],
            "admission": {"create_rate": -1, "request_rate": -1},
            "edges": edge_cfgs,
        }
        self.cfg = os.path.join(self.dir, "opendsec.json")
        with open(self.cfg, "w") as f:
            json.dump(cfg, f, indent=1)
        common = ["-config", self.cfg, "-grace", "2s"]
        self.iams: list[Proc] = []
        if mode == "standalone":
            self.iams.append(self._proc("iam", ["iam", *common, "-log", "info", "-metrics",
                                                f"127.0.0.1:{self.iam_metrics[0]}"]))
        else:
            for i in range(3):
                self.iams.append(self._proc(f"iam-{i}", ["iam", *common, "-log", "info", "-replica", str(i),
                                                         "-metrics", f"127.0.0.1:{self.iam_metrics[i]}"]))
        self._cfg = cfg
        # The other roles' config: the same file, unless `leader_first` (see `start`).
        self.roles_cfg = self.cfg
        rc = ["-config", self.roles_cfg, "-grace", "2s"]
        self.others = [
            self._proc("watcher", ["watcher", *rc, "-log", "warn"]),
            self._proc("edges", ["edge", *rc, "-log", "warn", "-id", "all"]),
            self._proc("apiserver", ["apiserver", *rc, "-log", "warn", "-index", "0", "-drain-delay", "0s"]),
        ]

    def _proc(self, name: str, args: list[str]) -> Proc:
        return Proc(name, args, os.path.join(self.dir, f"{name}.log"), self.pids)

    @property
    def procs(self) -> list[Proc]:
        return self.iams + self.others

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e.update(OPENDSEC_ADDR=self.api, OPENDSEC_TOKEN=self.token, OPENDSEC_PROJECT="root")
        return e

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([BIN, "ctl", *args], env=self.env(), capture_output=True, text=True, timeout=timeout)

    def start(self, edges: int, leader_first: bool = False) -> float:
        """Starts every role and waits until every edge is healthy; returns the seconds taken.
        With `leader_first` (replicated only) the IAM replicas start first and, once one
        leads, the other roles get a config whose `iam.replicas` lists the leader first (the
        same replicas, rotated): IAM's clients call the first replica of the list until it
        fails, so their calls then go to the leader instead of (2 times in 3) a follower."""
        t0 = time.perf_counter()
        if leader_first and self.mode == "replicated":
            for p in self.iams:
                p.start()
            lead = None
            while lead is None and time.perf_counter() < t0 + 60:
                time.sleep(0.1)
                lead = asyncio.run(leader_of(self))
            if lead is None:
                raise RuntimeError(f"no IAM leader within 60 s\n{self.tails()}")
            cfg = json.loads(json.dumps(self._cfg))
            reps = cfg["iam"]["replicas"]
            cfg["iam"]["replicas"] = reps[lead:] + reps[:lead]
            path = os.path.join(self.dir, "roles.json")
            with open(path, "w") as f:
                json.dump(cfg, f, indent=1)
            for p in self.others:
                p.args = [path if x == self.roles_cfg else x for x in p.args]
            self.roles_cfg = path
            self.first_replica = lead
            for p in self.others:
                p.start()
        else:
            self.first_replica = 0
            for p in self.procs:
                p.start()
        deadline = t0 + 60
        last = ""
        while time.perf_counter() < deadline:
            dead = [p.name for p in self.procs if not p.alive()]
            if dead:
                raise RuntimeError(f"{self.mode}: {', '.join(dead)} exited while starting\n{self.tails()}")
            o = self.ctl("status", timeout=10)
            last = o.stdout + o.stderr
            if o.returncode == 0 and o.stdout.count('"healthy": true') >= edges:
                return time.perf_counter() - t0
            time.sleep(0.2)
        raise RuntimeError(f"{self.mode}: not ready within 60 s; last status: {last[-500:]}\n{self.tails()}")

    def stop(self) -> None:
        # The apiserver and edges first, IAM last (edges release leases on the way out).
        for p in reversed(self.others):
            p.stop()
        for p in self.iams:
            p.stop()

    def tails(self, n: int = 15) -> str:
        out = []
        for p in self.procs:
            try:
                with open(p.logfile, errors="replace") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            out.append(f"--- {p.name}.log\n" + "\n".join(lines[-n:]))
        return "\n".join(out)

    def notable_log_lines(self, limit: int = 12) -> dict[str, Any]:
        """WARN and ERROR lines per log: their count and the first few (ANSI colours gone)."""
        out: dict[str, Any] = {}
        for p in self.procs:
            try:
                with open(p.logfile, errors="replace") as f:
                    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in f.read().splitlines()]
            except OSError:
                continue
            bad = [ln for ln in lines if " WARN " in ln or " ERROR " in ln]
            if bad:
                out[p.name] = {"count": len(bad), "first": bad[:limit]}
        return out

    def keep_logs(self, dest: str | None, tag: str) -> None:
        if not dest:
            return
        d = os.path.join(dest, tag)
        os.makedirs(d, exist_ok=True)
        for p in self.procs:
            if os.path.exists(p.logfile):
                shutil.copy(p.logfile, d)
        shutil.copy(self.cfg, d)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


async def http_get(port: int, path: str, timeout: float = 0.5) -> tuple[int, str] | None:
    """A plain HTTP/1.0 GET on 127.0.0.1:port; None when nothing answers in time."""
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, TimeoutError):
        return None
    try:
        w.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await w.drain()
        data = await asyncio.wait_for(r.read(), timeout)
    except (OSError, TimeoutError):
        return None
    finally:
        w.close()
    head, _, body = data.decode(errors="replace").partition("\r\n\r\n")
    try:
        return int(head.split()[1]), body
    except (IndexError, ValueError):
        return None


def gauge(body: str, name: str) -> float | None:
    for ln in body.splitlines():
        if ln.startswith(name + " ") or ln.startswith(name + "{"):
            try:
                return float(ln.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


# ------------------------------------------------------------------------- compare


async def singles(c: Cluster, count: int, conc: int, warm: int) -> dict[str, Any]:
    from opendsec import DSecClient, DSecError, DSecRunArgs

    args = DSecRunArgs(backend="sim", cpu_cores_limit=1.0, memory_limit_mb=512)
    async with DSecClient(endpoint=c.api, token=c.token, project="root") as cl:
        done = 0
        while done < warm:
            n = min(conc, warm - done)
            await asyncio.gather(*(cl.run_sandbox(args) for _ in range(n)))
            done += n
        left = [count]
        lat: list[float] = []
        ends: list[float] = []
        errors: list[str] = []

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                t = time.perf_counter()
                try:
                    await cl.run_sandbox(args)
                except DSecError as e:
                    errors.append(f"{e.reason}: {e}")
                    continue
                t1 = time.perf_counter()
                lat.append((t1 - t) * 1000)
                ends.append(t1)

        cpu0 = {p.name: p.cpu_s() for p in c.procs}
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = {p.name: round(p.cpu_s() - cpu0[p.name], 2) for p in c.procs}
        cpu["client (python)"] = round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2)
    # Creations/s over each fifth of the phase (by completions): does it drift as IAM's state grows?
    fifths = []
    ends.sort()
    edges = [t0] + [ends[min(len(ends) - 1, (len(ends) * k) // 5 - 1)] for k in range(1, 6)] if ends else []
    for k in range(1, len(edges)):
        span = edges[k] - edges[k - 1]
        fifths.append(round((len(ends) // 5) / span) if span > 0 else None)
    return {"count": count, "failed": len(errors), "errors": errors[:5], "wall_s": wall, "per_s": count / wall,
            "per_s_by_fifth": fifths, "lat_ms": summary(lat), "cpu_s": cpu}


def batch(c: Cluster, n: int) -> dict[str, Any]:
    cpu0 = {p.name: p.cpu_s() for p in c.procs}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    o = c.ctl("sandbox", "create", "-backend", "sim", "-cpu", "1", "-mem", "512", "-count", str(n), timeout=300)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {p.name: round(p.cpu_s() - cpu0[p.name], 2) for p in c.procs}
    cpu["client (ctl)"] = round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2)
    lines = o.stdout.splitlines()
    last = lines[-1] if lines else ""
    m = re.match(r"created (\d+)/(\d+) in (\S+);", last)
    errs = [ln for ln in lines if "\terror\t" in ln]
    return {"count": n, "created": int(m.group(1)) if m else 0, "wall_s": wall, "ctl_says": last,
            "rc": o.returncode, "stderr": o.stderr.strip()[-500:], "errors": errs[:5], "cpu_s": cpu}


async def leader_of(c: Cluster) -> int | None:
    for i in range(len(c.iams)):
        r = await http_get(c.iam_metrics[i], "/metrics")
        if r and r[0] == 200 and gauge(r[1], "opendsec_iam_leader") == 1:
            return i
    return None


SIDES = {
    # side: (IAM mode, other roles' iam.replicas leader first)
    "standalone": ("standalone", False),
    "replicated": ("replicated", False),
    "leader-first": ("replicated", True),
}


def part_compare(a: argparse.Namespace) -> dict[str, Any]:
    sides = a.sides.split(",")
    for sd in sides:
        if sd not in SIDES:
            sys.exit(f"iam_raft.py: -sides: {sd!r} is none of {', '.join(SIDES)}")
    order: list[str] = []
    for blk in range(a.runs):
        order += sides if blk % 2 == 0 else sides[::-1]
    runs: list[dict[str, Any]] = []
    for i, side in enumerate(order):
        mode, lf = SIDES[side]
        c = Cluster(mode, a.work, a.edges, a.pids)
        try:
            up = c.start(a.edges, leader_first=lf)
            s = asyncio.run(singles(c, a.count, a.concurrency, a.warmup))
            b = batch(c, a.batch) if a.batch else None
            r = {"mode": side, "startup_s": up, "single": s, "batch": b, "log_warnings": c.notable_log_lines(),
                 "leader": asyncio.run(leader_of(c)) if mode == "replicated" else None,
                 "roles_call": c.first_replica if mode == "replicated" else None,
                 "load_avg": os.getloadavg()[0]}
            runs.append(r)
            log(f"{side}: {s['per_s']:.0f}/s p50 {s['lat_ms']['p50']:.1f} ms p99 {s['lat_ms']['p99']:.1f} ms"
                f" ({s['failed']} failed); batch {b['wall_s'] if b else 0:.2f} s ({b['ctl_says'] if b else ''})")
        finally:
            c.stop()
            c.keep_logs(a.keep_logs, f"compare-{i}-{side}")
            c.remove()
    out: dict[str, Any] = {"order": order, "sides": sides, "runs": runs, "medians": {}, "pairs": {}}
    # Each side's run against the standalone run of the same block (S R | R S | ...).
    if "standalone" in sides:
        k = len(sides)
        for other in sides:
            if other == "standalone":
                continue
            ps = []
            for blk in range(0, len(runs), k):
                b = {r["mode"]: r for r in runs[blk:blk + k]}
                s_, r_ = b["standalone"], b[other]
                ps.append({
                    "single_per_s_ratio": r_["single"]["per_s"] / s_["single"]["per_s"],
                    "single_p50_ratio": r_["single"]["lat_ms"]["p50"] / s_["single"]["lat_ms"]["p50"],
                    "batch_s_ratio": (r_["batch"]["wall_s"] / s_["batch"]["wall_s"]) if a.batch else None,
                })
            out["pairs"][other] = {"blocks": ps, "median": {
                key: statistics.median([p[key] for p in ps]) if ps[0][key] is not None else None
                for key in ("single_per_s_ratio", "single_p50_ratio", "batch_s_ratio")}}
    for side in sides:
        rs = [r for r in runs if r["mode"] == side]
        med = lambda f, rs=rs: statistics.median([f(r) for r in rs])  # noqa: E731
        out["medians"][side] = {
            "runs": len(rs),
            "single_per_s": med(lambda r: r["single"]["per_s"]),
            "single_p50_ms": med(lambda r: r["single"]["lat_ms"]["p50"]),
            "single_p99_ms": med(lambda r: r["single"]["lat_ms"]["p99"]),
            "single_failed": sum(r["single"]["failed"] for r in rs),
            "batch_s": med(lambda r: r["batch"]["wall_s"]) if a.batch else None,
            "batch_max_s": max(r["batch"]["wall_s"] for r in rs) if a.batch else None,
            "batch_failed": sum(r["batch"]["count"] - r["batch"]["created"] for r in rs) if a.batch else None,
            "single_cpu_s": {k: statistics.median([r["single"]["cpu_s"].get(k, 0) for r in rs])
                             for k in rs[0]["single"]["cpu_s"]},
            # IAM's CPU per single creation, all replicas together (ms).
            "iam_cpu_ms_per_creation": med(lambda r: 1000 * sum(v for k, v in r["single"]["cpu_s"].items()
                                                                if k.startswith("iam")) / r["single"]["count"]),
        }
    return out


# ------------------------------------------------------------------------- failover


async def failover(a: argparse.Namespace, c: Cluster) -> dict[str, Any]:
    from opendsec import DSecClient, DSecError, DSecRunArgs

    args = DSecRunArgs(backend="sim", cpu_cores_limit=1.0, memory_limit_mb=512)
    calls: list[tuple[float, float, bool, str]] = []  # (sent, answered, ok, error)
    ok_event = asyncio.Event()
    watch: dict[str, float | None] = {"kill": None}
    stop = [False]

    async def worker(cl: Any) -> None:
        while not stop[0]:
            t0 = time.perf_counter()
            try:
                await cl.run_sandbox(args)
                ok, err = True, ""
            except DSecError as e:
                ok, err = False, f"{e.reason}: {e}"
            t1 = time.perf_counter()
            calls.append((t0, t1, ok, err))
            k = watch["kill"]
            if ok and k is not None and t0 >= k:
                ok_event.set()
            await asyncio.sleep(a.pause / 1000)

    async def leader(exclude: int | None = None) -> int | None:
        for i, p in enumerate(c.iams):
            if i == exclude or not p.alive():
                continue
            r = await http_get(c.iam_metrics[i], "/metrics")
            if r and r[0] == 200 and gauge(r[1], "opendsec_iam_leader") == 1:
                return i
        return None

    async def find_leader(timeout: float = 30) -> int:
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            i = await leader()
            if i is not None:
                return i
            await asyncio.sleep(0.05)
        raise RuntimeError(f"no IAM leader within {timeout} s\n{c.tails()}")

    rounds: list[dict[str, Any]] = []
    async with DSecClient(endpoint=c.api, token=c.token, project="root") as cl:
        workers = [asyncio.create_task(worker(cl)) for _ in range(a.stream)]
        try:
            await asyncio.sleep(1.0)
            for rnd in range(a.rounds):
                await asyncio.sleep(a.steady)
                victim = await find_leader()
                ok_event.clear()
                n_before = len(calls)
                t_kill = time.perf_counter()
                watch["kill"] = t_kill
                c.iams[victim].sigkill()
                # A survivor reports itself leader.
                t_elect = None
                while time.perf_counter() - t_kill < a.round_timeout:
                    if await leader(exclude=victim) is not None:
                        t_elect = time.perf_counter()
                        break
                    await asyncio.sleep(0.02)
                try:
                    await asyncio.wait_for(ok_event.wait(), max(0.1, a.round_timeout - (time.perf_counter() - t_kill)))
                except TimeoutError:
                    pass
                after = calls[n_before:]
                first_sent_after = min((t1 for t0, t1, ok, _ in after if ok and t0 >= t_kill), default=None)
                first_ok = min((t1 for t0, t1, ok, _ in after if ok and t1 >= t_kill), default=None)
                new_leader = await leader(exclude=victim)
                # The victim comes back on its data_dir and catches up.
                t_restart = time.perf_counter()
                c.iams[victim].start()
                caught = None
                port = c.iam_metrics[victim]
                while time.perf_counter() - t_restart < a.round_timeout:
                    li = await leader(exclude=victim)
                    lr = await http_get(c.iam_metrics[li], "/metrics") if li is not None else None
                    want = gauge(lr[1], "opendsec_iam_leases") if lr and lr[0] == 200 else None
                    ready = await http_get(port, "/readyz")
                    mine = await http_get(port, "/metrics")
                    have = gauge(mine[1], "opendsec_iam_leases") if mine and mine[0] == 200 else None
                    if want is not None and have is not None and ready and ready[0] == 200 and have >= want:
                        caught = time.perf_counter()
                        break
                    await asyncio.sleep(0.05)
                # Calls that failed in this round (everything since the kill until caught up).
                failed = [e for t0, t1, ok, e in calls[n_before:] if not ok]
                r = {
                    "round": rnd, "victim": victim, "new_leader": new_leader,
                    "election_s": None if t_elect is None else t_elect - t_kill,
                    "recovery_s": None if first_sent_after is None else first_sent_after - t_kill,
                    "first_ok_s": None if first_ok is None else first_ok - t_kill,
                    "catch_up_s": None if caught is None else caught - t_restart,
                    "failed_calls": len(failed), "errors": failed[:3],
                    "max_call_s": max((t1 - t0 for t0, t1, _, _ in calls[n_before:]), default=None),
                }
                rounds.append(r)
                fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
                log(f"round {rnd + 1}/{a.rounds}: killed leader {victim}; leader {new_leader} after "
                    f"{fmt(r['election_s'])}, first creation sent after the kill answered after "
                    f"{fmt(r['recovery_s'])}, caught up {fmt(r['catch_up_s'])} after restart; {len(failed)} failed")
                if r["recovery_s"] is None or caught is None:
                    raise RuntimeError(f"round {rnd}: no recovery within {a.round_timeout} s\n{c.tails()}")
        finally:
            stop[0] = True
            # A creation still waiting on a broken cluster is not waited for long.
            _, pending = await asyncio.wait(workers, timeout=10)
            for t in pending:
                t.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    all_failed = [e for _, _, ok, e in calls if not ok]
    lat = [(t1 - t0) * 1000 for t0, t1, ok, _ in calls if ok]
    vals = lambda k: [r[k] for r in rounds if r[k] is not None]  # noqa: E731
    return {
        "rounds": rounds,
        "stream": {"workers": a.stream, "pause_ms": a.pause, "calls": len(calls), "failed": len(all_failed),
                   "errors": all_failed[:10], "lat_ms": summary(lat)},
        "recovery_s": summary(vals("recovery_s")),
        "first_ok_s": summary(vals("first_ok_s")),
        "election_s": summary(vals("election_s")),
        "catch_up_s": summary(vals("catch_up_s")),
        "max_call_s": summary(vals("max_call_s")),
    }


def part_failover(a: argparse.Namespace) -> dict[str, Any]:
    c = Cluster("replicated", a.work, a.edges, a.pids)
    try:
        up = c.start(a.edges)
        out = asyncio.run(failover(a, c))
        out["startup_s"] = up
        out["log_warnings"] = c.notable_log_lines(20)
        # The Raft state changes of each replica, for the record.
        changes = {}
        for p in c.iams:
            with open(p.logfile, errors="replace") as f:
                changes[p.name] = sum("IAM Raft state changed" in ln for ln in f)
        out["raft_state_changes_logged"] = changes
        return out
    finally:
        c.stop()
        c.keep_logs(a.keep_logs, "failover")
        c.remove()


# ------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem, 1), "kernel": platform.release(),
            "python": platform.python_version(), "load_at_start": os.getloadavg()}


def report(res: dict[str, Any]) -> str:
    out = []
    m = res["machine"]
    out.append(f"machine: {m['cores']} cores, {m['cpu']}, {m['mem_gib']} GiB, Linux {m['kernel']}; "
               f"load at start {m['load_at_start'][0]:.2f}; binary {res['binary']}")
    cmp_ = res.get("compare")
    goals = []
    if cmp_:
        meds = cmp_["medians"]
        out.append(f"\ncompare: {meds[cmp_['sides'][0]]['runs']} runs per side, order "
                   f"{' '.join(cmp_['order'])}; {res['args']['count']} singles from {res['args']['concurrency']} "
                   f"callers (Python SDK), batch of {res['args']['batch']} (ctl); medians")
        out.append(f"{'IAM':<30} {'creations/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'batch s':>8} {'failed':>7}"
                   f" {'IAM CPU ms/creation':>20}")
        names = {"standalone": "standalone, iam.state", "replicated": "3 Raft replicas",
                 "leader-first": "3 replicas, roles call leader"}
        for side in cmp_["sides"]:
            x = meds[side]
            out.append(f"{names[side]:<30} {x['single_per_s']:>12.0f} {x['single_p50_ms']:>8.1f} "
                       f"{x['single_p99_ms']:>8.1f} {(x['batch_s'] or 0):>8.2f} "
                       f"{x['single_failed'] + (x['batch_failed'] or 0):>7} {x['iam_cpu_ms_per_creation']:>20.2f}")
        for side, pr in cmp_["pairs"].items():
            bl = pr["blocks"]
            out.append(f"{side} / standalone, run beside run: creations/s "
                       + ", ".join(f"{p['single_per_s_ratio']:.2f}" for p in bl)
                       + f" (median {pr['median']['single_per_s_ratio']:.2f}); p50 "
                       + ", ".join(f"{p['single_p50_ratio']:.2f}" for p in bl)
                       + f" (median {pr['median']['single_p50_ratio']:.2f})"
                       + ("; batch time " + ", ".join(f"{p['batch_s_ratio']:.2f}" for p in bl)
                          + f" (median {pr['median']['batch_s_ratio']:.2f})"
                          if pr["median"]["batch_s_ratio"] is not None else ""))
        out.append("per run:")
        for run in cmp_["runs"]:
            sg, b = run["single"], run["batch"]
            out.append(f"  {run['mode']:<12} {sg['per_s']:>6.0f}/s p50 {sg['lat_ms']['p50']:>5.1f} p99 "
                       f"{sg['lat_ms']['p99']:>6.1f} ms | batch {b['wall_s'] if b else 0:.2f} s "
                       f"[{b['ctl_says'] if b else ''}] | load {run['load_avg']:.1f}"
                       + (f" | leader iam-{run['leader']}, roles call iam-{run['roles_call']}"
                          if run["leader"] is not None else "")
                       + f" | cpu s {sg['cpu_s']}")
        if "standalone" in meds and "replicated" in meds:
            s, r = meds["standalone"], meds["replicated"]
            ratio = r["single_per_s"] / s["single_per_s"]
            goals.append(("single creations through 3 replicas within 30 % of standalone",
                          f"{ratio:.2f}× the creations/s, medians (p50 {r['single_p50_ms'] / s['single_p50_ms']:.2f}×)",
                          ratio >= 0.7))
        if "replicated" in meds and meds["replicated"]["batch_s"] is not None:
            r = meds["replicated"]
            goals.append((f"a {res['args']['batch']} batch under 2 s through 3 replicas",
                          f"{r['batch_s']:.2f} s (max {r['batch_max_s']:.2f})", r["batch_s"] < 2.0))
    fo = res.get("failover")
    if fo:
        out.append(f"\nfailover: {len(fo['rounds'])} leader kills under a stream of {fo['stream']['workers']} "
                   f"creating coroutines ({fo['stream']['pause_ms']} ms apart each), {fo['stream']['calls']} "
                   f"creations, {fo['stream']['failed']} failed")
        out.append(f"{'from SIGKILL of the leader':<46} {'p50 s':>7} {'p90 s':>7} {'max s':>7}")
        for k, name in (("election_s", "until a survivor reports itself leader"),
                        ("recovery_s", "until a creation sent after it succeeds"),
                        ("first_ok_s", "until any creation succeeds"),
                        ("max_call_s", "longest creation in the round"),
                        ("catch_up_s", "restart → caught up (not from the kill)")):
            x = fo[k]
            if x.get("n"):
                out.append(f"{name:<46} {x['p50']:>7.2f} {x['p90']:>7.2f} {x['max']:>7.2f}")
        x = fo["recovery_s"]
        if x.get("n"):
            goals.append(("leader failover under 3 s (kill → next committed creation)",
                          f"p50 {x['p50']:.2f} s, max {x['max']:.2f} s", x["max"] < 3.0))
        if fo["stream"]["errors"]:
            out.append("failed creations (first): " + "; ".join(fo["stream"]["errors"][:5]))
    if goals:
        out.append("\ngoals:")
        for g, v, ok in goals:
            out.append(f"  {'MET    ' if ok else 'NOT MET'} {g}: {v}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(prefix_chars="-")
    ap.add_argument("-work", required=True, help="a directory for the clusters' files")
    ap.add_argument("-pids", help="append every started pid to this file")
    ap.add_argument("-only", default="compare,failover")
    ap.add_argument("-runs", type=int, default=3, help="clusters of each kind in compare")
    ap.add_argument("-sides", default="standalone,replicated",
                    help="compare these, in turn: standalone, replicated, leader-first")
    ap.add_argument("-count", type=int, default=5000)
    ap.add_argument("-concurrency", type=int, default=64)
    ap.add_argument("-warmup", type=int, default=200)
    ap.add_argument("-batch", type=int, default=32768)
    ap.add_argument("-edges", type=int, default=8)
    ap.add_argument("-rounds", type=int, default=20)
    ap.add_argument("-stream", type=int, default=4, help="creating coroutines during failover")
    ap.add_argument("-pause", type=float, default=10, help="ms between one coroutine's creations")
    ap.add_argument("-steady", type=float, default=1.0, help="s of steady stream before each kill")
    ap.add_argument("-round-timeout", type=float, default=30)
    ap.add_argument("-keep-logs", help="copy every cluster's logs and config here")
    ap.add_argument("-json", action="store_true")
    ap.add_argument("-out", help="also write the JSON here")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    res: dict[str, Any] = {"machine": machine(), "binary": os.environ.get("OPENDSEC_BIN_SRC", BIN), "args": vars(a),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    t0 = time.perf_counter()
    if "compare" in parts:
        res["compare"] = part_compare(a)
    if "failover" in parts:
        res["failover"] = part_failover(a)
    res["wall_s"] = time.perf_counter() - t0
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1) if a.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
