"""What mutual TLS costs: the same calls against a cluster started with `cluster up -tls` and
one without, measured in the same run, interleaved in blocks so that the machine's drift
falls on both alike.

    .venv/bin/python bench/tls.py -part exec -plain STATE -tls STATE -out FILE [-exec-n 1000]
    .venv/bin/python bench/tls.py -part control -plain STATE -tls STATE -out FILE [-create-n 300] [-first-n 50]
    .venv/bin/python bench/tls.py -report FILE [FILE ...] [-json]

bench/tls.sh starts the clusters and runs all three. STATE is a cluster's -state-dir, holding
`cluster.env` (what `cluster up` printed) and `cluster.json` (its -write-config): the TLS one
must have `tls.dir` set and no service token, the plaintext one the opposite, or the run stops.
The TLS client checks the apiserver against the cluster's `OPENDSEC_CA` (SDK `ca_file`); a
client without it is checked to be refused there. What TLS covers: SDK → apiserver (TLS), and
apiserver → IAM, → edge, watcher → edge, edge → IAM (mutual TLS). The edge → sandbox agent
hop is a unix socket on both sides.

Parts:
  exec     two single-node clusters with real containers (`-runtime linux -network off`):
           one sandbox each (backend container, image host), warm-up, then EXEC_N
           `run_shell("true")` each (the SDK's RunShell; what bench/containers.py times), in
           blocks of BLOCK per cluster in turn, the first of each pair alternating.
  control  two sim clusters: (a) CREATE_N single `run_sandbox` (backend sim) one at a time
           per cluster, blocks of BLOCK/2 in turn; creations/s is 1000 / mean ms (one caller,
           one at a time: the latency's inverse, not the cluster's capacity). (b) FIRST_N
           fresh DSecClients per cluster, each timed from its construction to its first
           `whoami` answer (channel, TCP connect, TLS handshake with the certificate check,
           HTTP/2 setup, the call), alternating clusters, against WARM_N `whoami` calls on a
           client kept open. Each fresh client gets a connection of its own: within one
           process gRPC shares a connection between channels of the same target and arguments
           (its global subchannel pool), so a fresh plaintext client would ride on the warm
           one's connection (a TLS client's new credentials keep it apart), and the benchmark
           adds `grpc.use_local_subchannel_pool` to the SDK's channel options. A check that a
           fresh client's whoami opened a new TCP connection is part of the output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("plain", "tls")

# Only the files given decide where the clients go: a stray OPENDSEC_CA would turn the
# plaintext client into a TLS one.
for _k in [k for k in os.environ if k.startswith("OPENDSEC_") and k != "OPENDSEC_BIN"]:
    del os.environ[_k]


# ------------------------------------------------------------------------- stats


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def summary(v: list[float]) -> dict[str, float]:
    """Median, p90, p99, mean, min, max (same unit as `v`)."""
    return {"p50": statistics.median(v), "p90": pct(v, 0.90), "p99": pct(v, 0.99), "mean": statistics.fmean(v),
            "min": min(v), "max": max(v), "n": len(v)}


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000


# ------------------------------------------------------------------------- clusters


class Cluster:
    """One cluster as `cluster up` described it: its env block and its effective config."""

    def __init__(self, side: str, state: str) -> None:
        self.side = side
        self.env: dict[str, str] = {}
        with open(os.path.join(state, "cluster.env")) as f:
            for line in f:
                line = line.strip()
                if line.startswith("export ") and "=" in line:
                    k, v = line.removeprefix("export ").split("=", 1)
                    self.env[k] = v
        with open(os.path.join(state, "cluster.json")) as f:
            cfg = json.load(f)
        tls_dir = (cfg.get("tls") or {}).get("dir", "")
        token = cfg.get("service_token", "")
        if side == "tls" and not (tls_dir and not token and self.env.get("OPENDSEC_CA")):
            sys.exit(f"tls.py: {state} is not a TLS cluster (tls.dir {tls_dir!r}, OPENDSEC_CA "
                     f"{self.env.get('OPENDSEC_CA')!r}, service token set: {bool(token)})")
        if side == "plain" and (tls_dir or not token or self.env.get("OPENDSEC_CA")):
            sys.exit(f"tls.py: {state} is not a plaintext cluster (tls.dir {tls_dir!r})")
        self.ca: str | None = self.env.get("OPENDSEC_CA") if side == "tls" else None
        self.addr = self.env["OPENDSEC_ADDR"]

    def client(self, ca: Any = "default") -> Any:
        from opendsec import DSecClient

        return DSecClient(endpoint=self.addr, token=self.env["OPENDSEC_TOKEN"],
                          project=self.env.get("OPENDSEC_PROJECT"), ca_file=self.ca if ca == "default" else ca)


def local_subchannels() -> None:
    """Each channel gets connections of its own (see the module doc)."""
    from opendsec import _transport

    orig = _transport.channel_options

    def opts(user_agent: str, server_name: str | None) -> list[tuple[str, object]]:
        return orig(user_agent, server_name) + [("grpc.use_local_subchannel_pool", 1)]

    _transport.channel_options = opts


def tcp_conns_to(addr: str) -> int:
    """Established TCP connections on this machine to `addr`'s port (gRPC's client sockets
    are IPv6 ones, the loopback address v4-mapped: both tables are read)."""
    port = int(addr.rsplit(":", 1)[1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                parts = line.split()
                rem, st = parts[2], parts[3]
                if st == "01" and int(rem.rsplit(":", 1)[1], 16) == port:
                    n += 1
    return n


async def refused_without_ca(c: Cluster) -> str:
    """A client without the CA (plaintext) against the TLS port: must fail."""
    from opendsec import DSecError

    cl = c.client(ca=None)
    cl.retry_timeout = 3
    try:
        await asyncio.wait_for(cl.whoami(), 10)
    except DSecError as e:
        return e.reason
    except TimeoutError:
        return "timeout"
    finally:
        await cl.close()
    raise RuntimeError("a plaintext client was answered by the TLS cluster")


# ------------------------------------------------------------------------- parts


async def part_exec(a: argparse.Namespace, cl: dict[str, Cluster]) -> dict[str, Any]:
    from opendsec import DSecRunArgs

    out: dict[str, Any] = {"refused_without_ca": await refused_without_ca(cl["tls"])}
    clients = {s: await cl[s].client().open() for s in SIDES}
    sbs: dict[str, Any] = {}
    r: dict[str, list[float]] = {s: [] for s in SIDES}
    try:
        for s in SIDES:
            sbs[s] = await clients[s].run_sandbox(DSecRunArgs(backend="container", image="host", cpu_cores_limit=1.0,
                                                              memory_limit_mb=512))
        for s in SIDES:
            for _ in range(a.warmup):
                await sbs[s].run_shell("true")
        left, rnd = a.exec_n, 0
        while left > 0:
            m = min(a.block, left)
            left -= m
            for s in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
                sb = sbs[s]
                for _ in range(m):
                    t0 = time.perf_counter()
                    res = await sb.run_shell("true")
                    r[s].append(ms(t0, time.perf_counter()))
                    if res.exit_code != 0:
                        raise RuntimeError(f"{s}: run_shell true: exit {res.exit_code}")
            rnd += 1
    finally:
        for s, sb in sbs.items():
            try:
                await sb.stop()
            except Exception as e:  # noqa: BLE001 - the cluster's stop removes it anyway
                print(f"tls.py: stopping {s} sandbox {sb.id}: {e}", file=sys.stderr)
        for c in clients.values():
            await c.close()
    out["exec"] = {s: summary(r[s]) for s in SIDES}
    return out


async def part_control(a: argparse.Namespace, cl: dict[str, Cluster]) -> dict[str, Any]:
    from opendsec import DSecRunArgs

    local_subchannels()
    out: dict[str, Any] = {"refused_without_ca": await refused_without_ca(cl["tls"])}
    warm = {s: await cl[s].client().open() for s in SIDES}
    try:
        # (a) single creations, one at a time.
        args = DSecRunArgs(backend="sim", cpu_cores_limit=0.5, memory_limit_mb=256)
        for s in SIDES:
            for _ in range(a.create_warmup):
                await warm[s].run_sandbox(args)
        cr: dict[str, list[float]] = {s: [] for s in SIDES}
        blk = max(1, a.block // 2)
        left, rnd = a.create_n, 0
        while left > 0:
            m = min(blk, left)
            left -= m
            for s in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
                for _ in range(m):
                    t0 = time.perf_counter()
                    await warm[s].run_sandbox(args)
                    cr[s].append(ms(t0, time.perf_counter()))
            rnd += 1
        out["create"] = {s: summary(cr[s]) for s in SIDES}
        for s in SIDES:
            out["create"][s]["per_s"] = 1000 / out["create"][s]["mean"]

        # (b) a fresh client's first call against a warm one's.
        for s in SIDES:
            for _ in range(20):
                await warm[s].whoami()
        # One check that a fresh client opens a connection of its own.
        checks = {}
        for s in SIDES:
            before = tcp_conns_to(cl[s].addr)
            c = cl[s].client()
            await c.whoami()
            checks[s] = tcp_conns_to(cl[s].addr) - before
            await c.close()
        out["fresh_client_new_connections"] = checks
        if any(v < 1 for v in checks.values()):
            raise RuntimeError(f"a fresh client opened no connection of its own: {checks}")
        first: dict[str, list[float]] = {s: [] for s in SIDES}
        wm: dict[str, list[float]] = {s: [] for s in SIDES}
        per_round = max(1, a.warm_n // a.first_n)
        for i in range(a.first_warmup + a.first_n):
            keep = i >= a.first_warmup
            for s in (SIDES if i % 2 == 0 else SIDES[::-1]):
                t0 = time.perf_counter()
                c = cl[s].client()
                await c.whoami()
                t1 = time.perf_counter()
                await c.close()
                if keep:
                    first[s].append(ms(t0, t1))
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    await warm[s].whoami()
                    t1 = time.perf_counter()
                    if keep:
                        wm[s].append(ms(t0, t1))
        out["first_call"] = {s: summary(first[s]) for s in SIDES}
        out["warm_call"] = {s: summary(wm[s]) for s in SIDES}
    finally:
        for c in warm.values():
            await c.close()
    return out


# ------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import grpc

    git = ["git", "-C", ROOT, "log", "--oneline", "-1"]
    commit = subprocess.run(git, check=False, capture_output=True, text=True).stdout.strip()
    bin_ = os.environ.get("OPENDSEC_BIN", "")
    built = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.stat(bin_).st_mtime)) if os.path.exists(bin_) else ""
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(), "python": platform.python_version(),
            "grpcio": grpc.__version__, "head": commit, "binary": bin_, "binary_built": built,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


ROWS = (
    ("exec", "exec round trip: run_shell(\"true\"), warm container sandbox"),
    ("create", "sim creation, run_sandbox, one at a time"),
    ("first_call", "fresh DSecClient → first whoami answered"),
    ("warm_call", "warm client's whoami"),
)


def table(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"machine: {m['cpus']} CPUs ({m['cpu']}), Linux {m['kernel']}, Python {m['python']}, grpcio {m['grpcio']}",
             f"HEAD {m['head']}; {m['date']}; binary {m['binary']} built {m['binary_built']}"]
    for part in res["parts"]:
        lines.append(f"part {part['part']}: {part['seconds']:.0f} s, "
                     f"load average {part['load_before']} → {part['load_after']}, "
                     f"plaintext client refused by the TLS cluster: {part['refused_without_ca']}")
        if "fresh_client_new_connections" in part:
            lines.append(f"  new TCP connections per fresh client (check): {part['fresh_client_new_connections']}")
    lines.append(f"{'ms':<58}{'plain p50':>10}{'p90':>8}{'p99':>8}{'TLS p50':>10}{'p90':>8}{'p99':>8}"
                 f"{'TLS/plain p50':>15}{'n':>6}")
    for key, name in ROWS:
        for part in res["parts"]:
            if key not in part:
                continue
            p, t = part[key]["plain"], part[key]["tls"]
            lines.append(f"{name:<58}{p['p50']:>10.2f}{p['p90']:>8.2f}{p['p99']:>8.2f}{t['p50']:>10.2f}{t['p90']:>8.2f}"
                         f"{t['p99']:>8.2f}{t['p50'] / p['p50']:>15.3f}{p['n']:>6}")
            if key == "create":
                lines.append(f"{'  creations/s (1000 / mean)':<58}{p['per_s']:>10.0f}{'':>16}"
                             f"{t['per_s']:>10.0f}{'':>16}"
                             f"{t['per_s'] / p['per_s']:>15.3f}")
            if key == "first_call" and "warm_call" in part:
                w = part["warm_call"]
                lines.append(f"{'  first call less a warm one (p50)':<58}{p['p50'] - w['plain']['p50']:>10.2f}{'':>16}"
                             f"{t['p50'] - w['tls']['p50']:>10.2f}")
    for part in res["parts"]:
        if "exec" in part:
            e = part["exec"]
            ratio = e["tls"]["p50"] / e["plain"]["p50"]
            lines.append(f"goal: TLS adds under 10 % p50 to an exec round trip: {'met' if ratio < 1.10 else 'NOT met'} "
                         f"({e['tls']['p50']:.2f} against {e['plain']['p50']:.2f} ms, {100 * (ratio - 1):+.1f} %)")
    return "\n".join(lines)


# ------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-part", "--part", choices=("exec", "control"))
    ap.add_argument("-plain", "--plain", help="the plaintext cluster's state dir")
    ap.add_argument("-tls", "--tls", help="the TLS cluster's state dir")
    ap.add_argument("-out", "--out", help="write the part's JSON here")
    ap.add_argument("-report", "--report", nargs="+", metavar="FILE", help="print the parts' JSON files as one result")
    ap.add_argument("-json", "--json", action="store_true", help="-report prints JSON instead of the table")
    ap.add_argument("-exec-n", "--exec-n", dest="exec_n", type=int, default=1000,
                    help="exec round trips per cluster (1000)")
    ap.add_argument("-warmup", "--warmup", type=int, default=50, help="untimed round trips per cluster first (50)")
    ap.add_argument("-block", "--block", type=int, default=50, help="calls per cluster in turn (50; creations: half)")
    ap.add_argument("-create-n", "--create-n", dest="create_n", type=int, default=300,
                    help="sim creations per cluster (300)")
    ap.add_argument("-create-warmup", "--create-warmup", dest="create_warmup", type=int, default=20)
    ap.add_argument("-first-n", "--first-n", dest="first_n", type=int, default=50,
                    help="fresh clients per cluster (50)")
    ap.add_argument("-first-warmup", "--first-warmup", dest="first_warmup", type=int, default=5)
    ap.add_argument("-warm-n", "--warm-n", dest="warm_n", type=int, default=200,
                    help="warm whoami calls per cluster (200)")
    ap.add_argument("-only", "--only", default="exec,control", help="(read by tls.sh: which parts run)")
    a = ap.parse_args()
    if a.report:
        res: dict[str, Any] = {"machine": machine(), "parts": []}
        for p in a.report:
            with open(p) as f:
                res["parts"].append(json.load(f))
        print(json.dumps(res, indent=2) if a.json else table(res))
        return 0
    if not (a.part and a.plain and a.tls and a.out):
        ap.error("-part, -plain, -tls and -out, or -report")
    cl = {"plain": Cluster("plain", a.plain), "tls": Cluster("tls", a.tls)}
    t0, load0 = time.perf_counter(), loadavg()
    fn = part_exec if a.part == "exec" else part_control
    out = asyncio.run(fn(a, cl))
    out.update(part=a.part, seconds=time.perf_counter() - t0, load_before=load0, load_after=loadavg(),
               params={k: getattr(a, k) for k in ("exec_n", "warmup", "block", "create_n", "create_warmup",
                                                   "first_n", "first_warmup", "warm_n")})
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
