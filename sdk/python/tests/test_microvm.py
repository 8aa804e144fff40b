"""microVM sandboxes through a real cluster (docs/microvm.md), under emulation on our test
machines: memory snapshots as images, and sandboxes restored from them.

Needs root, QEMU and a guest kernel: ``OPENDSEC_TEST_KERNEL``, else the one the Rust tests
fetch into ``target/guest-kernel`` (``cargo test --release`` runs first in
``scripts/test.sh``). Without a kernel the module is skipped, except with ``CI=true``,
where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterator

import pytest

import opendsec
from opendsec import DSecError, DSecRunArgs

from test_containers import LinuxCluster, run_linux_cluster

ROOT = Path(__file__).resolve().parents[3]


def guest_kernel() -> Path | None:
    k = os.environ.get("OPENDSEC_TEST_KERNEL")
    if k:
        return Path(k)
    found = sorted((ROOT / "target/guest-kernel/boot").glob("vmlinuz-*"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def vm() -> Iterator[LinuxCluster]:
    kernel = guest_kernel()
    missing = (
        "no guest kernel (OPENDSEC_TEST_KERNEL, or target/guest-kernel from the Rust tests)"
        if kernel is None or not kernel.is_file()
        else "no qemu-system-x86_64"
        if shutil.which("qemu-system-x86_64") is None
        else ""
    )
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(missing, pytrace=False)
        pytest.skip(missing)
    yield from run_linux_cluster({"microvm": {"runtime": "qemu", "kernel": str(kernel), "default_disk_mb": 256}})


def _vm_image(tmp_path: Path) -> Path:
    """An OCI layout of busybox with the tools the tests run."""
    from test_images import oci_layout

    busybox = next(p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.isfile(p))
    files: dict[str, bytes | str] = {"bin/busybox": Path(busybox).read_bytes()}
    tools = ("sh", "cat", "echo", "sleep", "hostname", "ls", "mkdir", "mv")
    files.update({f"bin/{t}": "busybox" for t in tools})
    files.update({"etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n", "etc/group": b"root:x:0:\n", "srv/keep": b"base\n"})
    oci_layout(tmp_path / "vm", [files], env=["PATH=/bin", "GREETING=from-the-image"], workdir="/srv")
    return tmp_path / "vm"


def _snapshot_dirs(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "snapshots").iterdir())


async def _vm_project(vm: LinuxCluster, tmp_path: Path, c, prefix: str) -> tuple[str, str, dict, dict]:
    """A new project holding the test image: its name, the image's, ``ctl``'s environment
    and the creation arguments of a small microVM in it."""
    from test_images import ctl

    project = f"root/{prefix}-{secrets.token_hex(3)}"
    base = f"{project}/base:1"
    env = dict(vm.env, OPENDSEC_IMAGE_STORE=str(vm.store))
    await c.create_project("root", project.split("/")[1])
    r = ctl(env, "image", "import", str(_vm_image(tmp_path)), "-as", base, "-q")
    assert r.returncode == 0, r.stderr
    args = dict(backend="microvm", cpu_cores_limit=1, memory_limit_mb=256, disk_mb=64, project=project)
    return project, base, env, args


async def _start_counting(sb) -> None:
    """Starts a loop in ``sb`` that writes 1, 2, 3... to /srv/count, one a second (renamed into
    place, so a reader never finds it empty)."""
    loop = "i=0; while :; do i=$((i+1)); echo $i > /srv/.count; mv /srv/.count /srv/count; sleep 1; done"
    r = await sb.run_shell(f"({loop}) > /dev/null 2>&1 &")
    assert r.exit_code == 0, r
    await asyncio.sleep(2)


def _host_of(sandbox_id: str) -> str:
    """The host name a sandbox's id gives its VM."""
    host = sandbox_id.rsplit(".", 1)[-1]
    return "".join(ch for ch in host if ch.isascii() and (ch.isalnum() or ch == "-"))[:63]


async def _count(sb) -> int:
    r = await sb.run_shell("cat /srv/count")
    assert r.exit_code == 0, r
    return int(r.stdout)


async def test_a_memory_snapshot_is_an_image_whose_sandboxes_go_on_from_it(vm, tmp_path):
    """``create_snapshot(memory=True)`` saves a running microVM, processes and all, as an image
    that records its memory; the source goes on. A sandbox created from the image carries
    on from that moment (the loop started before the snapshot still counts) under its own
    name, and needs the snapshot's memory; a container, a compose part and a snapshot
    without memory are ``invalid``. Deleting the image removes the saved memory and disks at
    once while its copy runs, pauses and resumes on. A paused source stays paused; the CLI's
    ``image snapshot -memory`` does the same (docs/images.md "Memory snapshots")."""
    from test_images import ctl

    async with vm.client(retry_timeout=60) as c:
        project, base, env, args = await _vm_project(vm, tmp_path, c, "vm")
        warm = f"{project}/warm:1"
        parent = await c.get_image(base)
        sb = await c.run_sandbox(DSecRunArgs(image=base, **args))
        copy = None
        try:
            await _start_counting(sb)
            assert await _count(sb) >= 1

            img = await sb.create_snapshot(warm, memory=True)
            assert (img.name, img.snapshot, img.memory, img.memory_limit_mb) == (warm, True, True, 256)
            assert (img.parent, img.env, img.workdir) == (base, parent.env, "/srv")
            assert img.source == f"snapshot of sandbox {sb.id}" and img.created_by == await c.whoami()
            assert (await c.get_image(warm)).memory_limit_mb == 256
            assert len(_snapshot_dirs(vm.store)) == 1
            # The source went on.
            await sb.refresh()
            assert sb.state == "RUNNING"
            before = await _count(sb)

            for call, reason in (
                (c.run_sandbox(DSecRunArgs(image=warm, **dict(args, memory_limit_mb=512))), opendsec.INVALID),
                (c.run_sandbox(DSecRunArgs(image=warm, **dict(args, disk_mb=32))), opendsec.INVALID),
                (c.run_sandbox(DSecRunArgs(image=warm, **dict(args, backend="container"))), opendsec.INVALID),
                (c.compose_image(f"{project}/composed:1", [warm]), opendsec.INVALID),
                (sb.create_snapshot(f"{project}/files:1"), opendsec.INVALID),
                (sb.create_snapshot(warm, memory=True), opendsec.CONFLICT),
            ):
                with pytest.raises(DSecError) as ei:
                    await call
                assert ei.value.reason == reason, ei.value
            assert len(_snapshot_dirs(vm.store)) == 1, "failed calls leave no snapshot behind"

            copy = await c.run_sandbox(DSecRunArgs(image=warm, **args))
            assert copy.id != sb.id
            r = await copy.run_shell("hostname; echo $GREETING")
            assert r.exit_code == 0 and r.stdout == f"{_host_of(copy.id)}\nfrom-the-image\n", r
            # The loop runs in the copy: its count goes on from the snapshot's.
            first = await _count(copy)
            assert 1 <= first
            await asyncio.sleep(3)
            assert await _count(copy) > first
            assert await _count(sb) > before

            # Deleting the image removes its memory and disks; the copy runs on.
            await c.delete_image(warm)
            assert _snapshot_dirs(vm.store) == []
            await copy.pause()
            await copy.resume()
            n = await _count(copy)
            await asyncio.sleep(2)
            assert await _count(copy) > n

            # A paused source is snapshotted too, and stays paused; through the CLI.
            await sb.pause()
            r = ctl(env, "image", "snapshot", sb.id, f"{project}/cli:1", "-memory")
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            # protobuf's JSON form: an int64 is a string.
            assert (out["memory"], out["memory_limit_mb"], out["parent"]) == (True, "256", base), out
            await sb.refresh()
            assert sb.state == "PAUSED"
            await sb.resume()
            assert await _count(sb) >= 1
            assert len(_snapshot_dirs(vm.store)) == 1
            await c.delete_image(f"{project}/cli:1")
            assert _snapshot_dirs(vm.store) == []
        finally:
            for s in (copy, sb):
                if s is not None:
                    await s.stop()


async def test_a_microvm_fork_copies_its_memory_into_sandboxes_that_carry_on(vm, tmp_path):
    """``fork(count=2)`` of a running microVM makes two sandboxes restored from one memory
    snapshot: the loop the source started counts on in each, each under its own name, and
    each goes its own way after (a file written in one is not in the others); the source
    runs on, and the snapshot is gone from the store once the copies are made
    (docs/images.md "Fork")."""
    async with vm.client(retry_timeout=60) as c:
        _, base, _, args = await _vm_project(vm, tmp_path, c, "vmf")
        sb = await c.run_sandbox(DSecRunArgs(image=base, **args))
        copies: list = []
        try:
            await _start_counting(sb)
            made = await sb.fork(count=2, labels={"branch": "b"})
            copies = [m for m in made if not isinstance(m, DSecError)]
            assert len(copies) == 2, made
            assert _snapshot_dirs(vm.store) == [], "the fork's snapshot is removed once its copies are made"
            ids = {sb.id, *(cp.id for cp in copies)}
            assert len(ids) == 3
            for i, cp in enumerate(copies):
                await cp.refresh()
                assert cp.state == "RUNNING" and cp.info.spec.labels["branch"] == "b"
                first = await _count(cp)
                await asyncio.sleep(2)
                assert await _count(cp) > first, "the source's loop runs on in the copy"
                r = await cp.run_shell(f"hostname; echo {i} > /srv/mine; cat /srv/mine")
                assert r.exit_code == 0 and r.stdout == f"{_host_of(cp.id)}\n{i}\n", r
            r = await sb.run_shell("cat /srv/mine")
            assert r.exit_code != 0, "a copy's file is its own"
            r = await copies[1].run_shell("cat /srv/mine")
            assert r.stdout == "1\n", r
            assert await _count(sb) >= 3
        finally:
            for s in (*copies, sb):
                await s.stop()
