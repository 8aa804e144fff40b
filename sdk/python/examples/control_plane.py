"""A tour of the control plane on simulated sandboxes (the `sim` backend runs nothing).

Connects with the OPENDSEC_* variables printed by `opendsec cluster up`, then: creates a
project with a quota and a principal holding only what it needs; as that principal, creates a
batch of sandboxes for one task, shows what the quota refuses, pauses and stops the task; and
prints the project's usage.

    python3 sdk/python/examples/control_plane.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

from opendsec import DSecClient, DSecError, DSecRunArgs, QUOTA_EXCEEDED


async def main() -> int:
    """Runs the tour; returns the process exit code."""
    team = f"demo-{uuid.uuid4().hex[:6]}"
    project = f"root/{team}"
    async with DSecClient() as admin:
        print(f"connected as {await admin.whoami()}")
        await admin.create_project("root", team, quota={"sandboxes": 100, "cpu_cores": 200})
        token = await admin.create_principal(project, f"{team}-trainer", kind="agent", ttl=3600)
        await admin.grant(project, f"{team}-trainer", ["sandbox.create", "sandbox.operate"])
        print(f"project {project} (quota 100 sandboxes) and principal {team}-trainer created")

    async with DSecClient(token=token, project=project) as client:
        results = await client.run_sandboxes(DSecRunArgs(backend="sim", task_id="job-1"), 100)
        ok = [r for r in results if not isinstance(r, DSecError)]
        print(f"batch: {len(ok)}/100 sandboxes running, e.g. {ok[0].id}")
        try:
            await client.run_sandbox(DSecRunArgs(backend="sim"))
            print("unexpected: the 101st sandbox was admitted", file=sys.stderr)
            return 1
        except DSecError as e:
            assert e.reason == QUOTA_EXCEEDED, e
            print(f"101st sandbox refused: {e.reason}: {e.message}")
        paused = await client.pause_task("job-1")
        print(f"pause_task: {paused.affected} paused, {paused.failed} failed")
        stopped = await client.stop_task("job-1")
        print(f"stop_task: {stopped.affected} stopped, {stopped.failed} failed")
        left = await client.list_sandboxes()
        print(f"sandboxes left in {project}: {len(left)}")

    async with DSecClient() as admin:
        report = await admin.get_usage(project)
        for row in report.rows:
            print(f"usage {row.day} {row.project}: started {row.sandboxes_started}, {row.sandbox_hours:.4f} sandbox-hours")
    return 0 if not left else 1


if __name__ == "__main__":
    if not os.environ.get("OPENDSEC_TOKEN"):
        print("set the OPENDSEC_* variables printed by `opendsec cluster up` first", file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(main()))
