"""Quickstart: create a sandbox, run a command in it, print its output, stop it.

Connects with the OPENDSEC_ADDR, OPENDSEC_TOKEN, OPENDSEC_PROJECT (and OPENDSEC_CA)
variables, e.g. as printed by `opendsec cluster up`. The backend comes from
OPENDSEC_BACKEND (default "container") and the image from OPENDSEC_IMAGE (default "host",
the development image of `cluster up`).

    python3 sdk/python/examples/quickstart.py        # prints 42
"""

from __future__ import annotations

import asyncio
import os
import sys

from opendsec import DSecClient, DSecError, DSecRunArgs


async def main() -> int:
    """Runs the quickstart; returns the process exit code."""
    backend = os.environ.get("OPENDSEC_BACKEND") or "container"
    image = os.environ.get("OPENDSEC_IMAGE") or "host"
    async with DSecClient() as client:  # reads the OPENDSEC_* variables
        try:
            sb = await client.run_sandbox(
                DSecRunArgs(backend=backend, image=image, cpu_cores_limit=1, memory_limit_mb=1024, ttl_running_stop=600)
            )
        except DSecError as e:
            print(f"could not create a {backend} sandbox from {image!r}: {e.reason}: {e.message}", file=sys.stderr)
            return 1
        print(f"sandbox {sb.id} on {sb.edge_id} is {sb.state}", file=sys.stderr)
        try:
            r = await sb.run_shell("python3 -c 'print(6*7)'", timeout=60)
            print(r.stdout, end="")  # 42
            if not r.ok:
                print(f"exit code {r.exit_code}: {r.stderr}", file=sys.stderr)
                return 1
        except DSecError as e:
            print(f"run_shell failed: {e.reason}: {e.message}", file=sys.stderr)
            return 1
        finally:
            await sb.stop()
            print(f"sandbox {sb.id} is {sb.state}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
