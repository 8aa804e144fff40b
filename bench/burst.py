"""A burst of container sandboxes on one node: create N at once, run a command in each,
end them all with one stop_task, and report the times, the failures by reason and the
host memory per sandbox.

    sudo .venv/bin/python bench/burst.py [-n 2000] [-c 200] [-json]

Needs a running cluster whose `container` backend is runtime `linux` with the image `host`
and whose edge admits N small sandboxes (overcommit raised), reached through OPENDSEC_ADDR /
OPENDSEC_TOKEN / OPENDSEC_PROJECT: bench/burst.sh starts one. Each sandbox has
cpu_cores_limit=0.1 and memory_limit_mb=128; at most C creations (and commands) are in
flight at once, the rest queued in the client.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import time
import uuid


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pct(v: list[float], q: float) -> float:
    if not v:
        return 0.0
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


async def main() -> None:
    from opendsec import DSecClient, DSecError, DSecRunArgs

    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2000, help="sandboxes")
    ap.add_argument("-c", type=int, default=200, help="creations in flight at once")
    ap.add_argument("-json", action="store_true")
    a = ap.parse_args()

    task = f"burst-{uuid.uuid4().hex[:8]}"
    args = DSecRunArgs(backend="container", image="host", cpu_cores_limit=0.1, memory_limit_mb=128, task_id=task)
    sem = asyncio.Semaphore(a.c)
    failures: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    create_s: list[float] = []
    cmd_s: list[float] = []
    cmd_failed = 0
    before = mem_available_mb()

    async with DSecClient() as c:

        async def one(i: int):
            async with sem:
                t = time.monotonic()
                try:
                    sb = await c.run_sandbox(args, timeout=600)
                except DSecError as e:
                    failures[e.reason] += 1
                    examples.setdefault(e.reason, str(e)[:300])
                    return None
                create_s.append(time.monotonic() - t)
                return sb

        t0 = time.monotonic()
        made = [sb for sb in await asyncio.gather(*(one(i) for i in range(a.n))) if sb is not None]
        create_wall = time.monotonic() - t0
        after = mem_available_mb()

        async def cmd(sb) -> bool:
            async with sem:
                t = time.monotonic()
                try:
                    r = await sb.run_shell("echo ok", timeout=60)
                except DSecError:
                    return False
                cmd_s.append(time.monotonic() - t)
                return r.exit_code == 0 and r.stdout.strip() == "ok"

        t1 = time.monotonic()
        oks = await asyncio.gather(*(cmd(sb) for sb in made))
        cmd_wall = time.monotonic() - t1
        cmd_failed = sum(1 for ok in oks if not ok)

        t2 = time.monotonic()
        stopped = await c.stop_task(task)
        stop_wall = time.monotonic() - t2

    out = {
        "requested": a.n,
        "in_flight": a.c,
        "created": len(made),
        "create_failures": dict(failures),
        "create_failure_examples": examples,
        "create_wall_s": round(create_wall, 2),
        "create_p50_s": round(pct(create_s, 0.5), 3),
        "create_p99_s": round(pct(create_s, 0.99), 3),
        "commands_failed": cmd_failed,
        "commands_wall_s": round(cmd_wall, 2),
        "command_p50_ms": round(pct(cmd_s, 0.5) * 1e3, 1),
        "command_p99_ms": round(pct(cmd_s, 0.99) * 1e3, 1),
        "stop_task_s": round(stop_wall, 2),
        "stop_task_affected": stopped.affected,
        "stop_task_failed": stopped.failed,
        "host_mem_per_sandbox_mb": round((before - after) / max(1, len(made)), 2),
    }
    if a.json:
        print(json.dumps(out))
    else:
        w = max(len(k) for k in out)
        for k, v in out.items():
            print(f"{k:<{w}}  {v}")
    if failures or cmd_failed or stopped.failed or len(made) != a.n:
        raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
