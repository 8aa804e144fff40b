"""Sim creations through the whole stack from the Python SDK: SDK → apiserver → IAM → edge.

Starts `opendsec cluster up` with 8 sim edges from a generated config whose per-principal
rate limits are off (the default create_rate of 2000/s would otherwise be what is measured),
then measures:
  - single creations: C concurrent coroutines calling run_sandbox until N are made;
  - one batch: run_sandboxes(args, B);
over R runs each, and prints medians and p99 as JSON.

    .venv/bin/python bench/sdk_create.py [--runs 5] [--count 5000] [--concurrency 64] [--batch 32768]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from opendsec import DSecClient, DSecError, DSecRunArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("OPENDSEC_BIN", os.path.join(ROOT, "target/x86_64-unknown-linux-gnu/release/opendsec"))


def start_cluster(state: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """Writes a generated config with the rate limits off, then runs every role from it."""
    cfg = os.path.join(state, "cluster.json")
    gen = subprocess.Popen([BIN, "cluster", "up", "-sim-edges", "8", "-addr", "127.0.0.1:0", "-state-dir", state,
                            "-disk-reserve-mb", "-1", "-log", "warn", "-write-config", cfg], stdout=subprocess.PIPE, text=True)
    for _ in range(3):
        gen.stdout.readline()
    gen.send_signal(signal.SIGTERM)
    gen.wait(timeout=30)
    with open(cfg) as f:
        c = json.load(f)
    c["admission"]["create_rate"] = -1
    c["admission"]["request_rate"] = -1
    for k in ("iam", "watcher"):
        c[k]["addr"] = "127.0.0.1:0"
    for a in c["apiserver"]:
        a["addr"] = "127.0.0.1:0"
    for e in c["edges"]:
        e["addr"] = "127.0.0.1:0"
    with open(cfg, "w") as f:
        json.dump(c, f)
    p = subprocess.Popen([BIN, "cluster", "up", "-config", cfg, "-log", "warn"], stdout=subprocess.PIPE, text=True)
    env = {}
    for _ in range(3):
        k, v = p.stdout.readline().strip().removeprefix("export ").split("=", 1)
        env[k] = v
    return p, env


async def singles(env: dict[str, str], count: int, conc: int) -> tuple[float, list[float]]:
    async with DSecClient(endpoint=env["OPENDSEC_ADDR"], token=env["OPENDSEC_TOKEN"]) as c:
        left = [count]
        lat: list[float] = []

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                t = time.perf_counter()
                await c.run_sandbox(DSecRunArgs(backend="sim", memory_limit_mb=512))
                lat.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return count / (time.perf_counter() - t0), lat


async def batch(env: dict[str, str], n: int) -> tuple[float, int]:
    async with DSecClient(endpoint=env["OPENDSEC_ADDR"], token=env["OPENDSEC_TOKEN"]) as c:
        t0 = time.perf_counter()
        res = await c.run_sandboxes(DSecRunArgs(backend="sim", memory_limit_mb=512), n)
        return time.perf_counter() - t0, sum(isinstance(r, DSecError) for r in res)


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32768)
    a = ap.parse_args()
    rates, p50s, p99s, batch_s, failures = [], [], [], [], 0
    for _ in range(a.runs):
        with tempfile.TemporaryDirectory() as state:
            p, env = start_cluster(state)
            try:
                rate, lat = asyncio.run(singles(env, a.count, a.concurrency))
                rates.append(rate)
                p50s.append(pct(lat, 0.5))
                p99s.append(pct(lat, 0.99))
                if a.batch:
                    s, f = asyncio.run(batch(env, a.batch))
                    batch_s.append(s)
                    failures += f
            finally:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    out = {
        "runs": a.runs, "count": a.count, "concurrency": a.concurrency, "batch": a.batch,
        "single_per_s_median": statistics.median(rates), "single_p50_ms_median": statistics.median(p50s),
        "single_p99_ms_median": statistics.median(p99s),
        "batch_s_median": statistics.median(batch_s) if batch_s else None,
        "batch_per_s_median": a.batch / statistics.median(batch_s) if batch_s else None,
        "batch_failures": failures, "single_per_s_all": rates, "batch_s_all": batch_s,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
