"""microVMs: the cluster's ``microvm`` backend (runtime ``qemu``) against QEMU's own mechanism
on the same VM, measured in one run on the same machine.

    sudo PYTHONPATH=sdk/python .venv/bin/python bench/microvm.py [-n 8] [-forks 3] [-json]

Needs root, QEMU and a running cluster with a ``microvm`` backend, reached through
OPENDSEC_ADDR / OPENDSEC_TOKEN / OPENDSEC_PROJECT / OPENDSEC_IMAGE_STORE, whose files are under
OPENDSEC_BENCH_STATE and whose log (``-log info``) is OPENDSEC_BENCH_LOG (bench/microvm.sh
starts one). Every VM is the same: a busybox image, ``memory_limit_mb=256`` (256 MiB of guest
RAM), ``cpu_cores_limit=1`` (one vCPU), ``disk_mb=64``.

Ours, through the SDK, each until the guest answered (``run_shell("echo hi")`` returned
``hi``):
  boot      ``run_sandbox`` + the first command, N times (a new sandbox each; stopped after).
  pause     ``pause()`` of a running VM (its vCPUs stop, devices and CPU state go to a file,
            the RAM stays in its own file out of the stream, QEMU exits, the RAM file is
            synced and dropped from the page cache), N times.
  resume    ``resume()`` + the first command, N times (a new QEMU, ``-incoming``, the edge's
            agent channel and ``PostRestore``).
  snapshot  ``create_snapshot(memory=True)`` of a running VM, N times; with ``paused_ms``,
            how long its vCPUs stood still (the edge's log).
  restore   ``run_sandbox`` of the snapshot's image + the first command, N times.
  fork(k)   ``fork(count=k)`` until every copy answered, for k = 1, 4, 8, FORKS times each;
            with the source's ``paused_ms``.
  answer    ``run_shell("echo hi")`` on a running VM, before each pause: the floor under
            every "until the guest answered" here (after a resume, a second command too).
  memory    PSS of the VM's QEMU process (``/proc/<pid>/smaps_rollup``) 3 s after its boot
            answered, and of each copy of a fork(8) 3 s after all answered.

The peer is QEMU alone with the command line of one of our VMs (read from
``/proc/<pid>/cmdline``): same kernel, initramfs, image and agent disks, the same memory,
vCPUs, devices and ``-sandbox`` flags; its own RAM file, sockets, config disk copy and
writable disk (a sparse copy, ``cp --sparse=always``, of the edge's empty disk template, or
of its snapshot's disk). "Answered" for the peer is the guest's agent (aether) echoing the
``RESET`` frame on a new connection to its agent port (docs/microvm.md "The agent channel"):
the guest kernel is up, aether runs as PID 1 from the VM's root and serves the port. No
command runs, no control plane is involved.
  answer    a new connection's ``RESET`` echoed by a running VM.
  boot      QEMU started until the guest answered.
  pause     QMP ``stop``, ``migrate`` to a file with every RAM page in the stream (QEMU's
            plain migration; ``max-bandwidth`` raised as our backend does), the file synced,
            ``quit``, until QEMU exited, and its RAM file removed.
  resume    a new QEMU with ``-incoming defer`` on a new RAM file, ``migrate-incoming`` of
            that file, ``cont``, until the guest answered.
  snapshot  ``stop``, ``migrate`` to a file (all RAM) synced, the writable disk copied,
            ``cont``: QEMU's ``savevm`` on raw disks (savevm needs qcow2); the VM stands still
            all along.
  restore   the snapshot's disk copied, a new QEMU ``-incoming`` of its stream, ``cont``,
            until the guest answered.
  fork(k)   a snapshot of the running peer as above, then k restores from it at once, until
            every copy answered.
  memory    as ours, 3 s after the guest answered.

Nothing here measures KVM unless the host has it; the backend logs which accelerator it
chose and the output names it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = os.environ.get("OPENDSEC_BIN", str(ROOT / "target/x86_64-unknown-linux-gnu/release/opendsec"))
sys.path.insert(0, str(ROOT / "sdk/python/tests"))

from oci import oci_layout
from opendsec import DSecClient, DSecError, DSecRunArgs, Sandbox

IMAGE = "root/bench/vm:1"
VM = {"backend": "microvm", "cpu_cores_limit": 1, "memory_limit_mb": 256, "disk_mb": 64}
SETTLE_S = 3.0
ANSWER_TIMEOUT_S = 300.0


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([BIN, "ctl", *args], check=False, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"opendsec ctl {' '.join(args)}: {r.stderr}")
    return r


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": statistics.median(xs), "p99": pct(xs, 99), "min": min(xs)}


def ms(t: float) -> float:
    return (time.perf_counter() - t) * 1000


# ---------------------------------------------------------------- the host's view of a VM


def qemu_pid(state: Path, sandbox_id: str) -> int:
    """The pid of the QEMU our cluster runs for ``sandbox_id``: a qemu-system process whose
    command line names that sandbox's directory under this run's state (so never anyone
    else's QEMU)."""
    mark = f"/microvms/{sandbox_id}/"
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-system-x86_64"):
            line = b" ".join(argv).decode(errors="replace")
            if str(state) in line and mark in line:
                return int(p.name)
    raise RuntimeError(f"no QEMU of {sandbox_id} under {state}")


def qemu_argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]


def pss_mib(pid: int) -> dict[str, float]:
    """PSS, and its anonymous and file parts, of ``pid`` in MiB (``smaps_rollup``)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("Pss", "Pss_Anon", "Pss_File"):
            out[k.lower()] = int(v.split()[0]) / 1024
    return out


class EdgeLog:
    """The ``paused_ms`` of each microVM snapshot the edge logged (a snapshot, or a fork's)."""

    PAT = re.compile(r"microVM snapshot taken sandbox_id=(\S+) paused_ms=([0-9.]+)")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = len(self._all())

    def _all(self) -> list[tuple[str, float]]:
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return []
        return [(m[1], float(m[2])) for m in self.PAT.finditer(text)]

    def new(self, sandbox_id: str) -> list[float]:
        """``paused_ms`` of ``sandbox_id``'s snapshots logged since the last call."""
        got = self._all()
        fresh, self.seen = got[self.seen:], len(got)
        return [p for s, p in fresh if s == sandbox_id]


# ---------------------------------------------------------------- the peer: QEMU alone


class Qmp:
    """A blocking QMP client on a unix socket."""

    def __init__(self, path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(path))
                break
            except OSError:
                s.close()
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"QMP {path}: QEMU exited ({proc.returncode}) or no socket") from None
                time.sleep(0.005)
        self.s = s
        self.r = s.makefile("rb")
        self.r.readline()  # the greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name: str, args: dict[str, Any] | None = None, fd: int | None = None) -> Any:
        msg = json.dumps({"execute": name, **({"arguments": args} if args else {})}).encode() + b"\n"
        if fd is None:
            self.s.sendall(msg)
        else:
            socket.send_fds(self.s, [msg], [fd])
        while True:
            line = self.r.readline()
            if not line:
                raise RuntimeError(f"QMP {name}: QEMU closed the socket")
            m = json.loads(line)
            if "event" in m:
                continue
            if "error" in m:
                raise RuntimeError(f"QMP {name}: {m['error']}")
            return m.get("return")

    def status(self) -> str:
        return str(self.cmd("query-status")["status"])

    def close(self) -> None:
        self.r.close()
        self.s.close()


def reset_frame(nonce: bytes) -> bytes:
    """The agent port's ``RESET``: kind 0, session 0, 16 bytes: ``ODSECMUX`` and a nonce."""
    return b"\0" + (0).to_bytes(4, "big") + (16).to_bytes(4, "big") + b"ODSECMUX" + nonce


class PeerVm:
    """One QEMU of the peer, in a directory of its own."""

    def __init__(self, peer: Peer, name: str) -> None:
        self.peer = peer
        self.dir = peer.work / name
        self.dir.mkdir()
        os.link(peer.config, self.dir / "config.img")
        self.proc: subprocess.Popen[bytes] | None = None
        self.q: Qmp | None = None

    def start(self, disk: Path | None, incoming: bool) -> None:
        """A sparse copy of ``disk`` as its writable disk (``None``: the one it has), a new
        RAM file, QEMU started."""
        if disk is not None:
            subprocess.run(["cp", "--sparse=always", str(disk), str(self.dir / "disk.img")], check=True)
        (self.dir / "ram").unlink(missing_ok=True)
        argv = self.peer.argv_for(self.dir, incoming)
        with open(self.dir / "qemu.log", "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self.peer.procs.append(self.proc)
        self.q = None

    def qmp(self) -> Qmp:
        assert self.proc is not None
        if self.q is None:
            self.q = Qmp(self.dir / "qmp.sock", self.proc)
        return self.q

    def answers(self, timeout: float = ANSWER_TIMEOUT_S) -> None:
        """Until the guest's aether echoes a ``RESET`` on a new connection to the agent port
        (reconnecting every 5 s without an echo, as the edge does)."""
        assert self.proc is not None
        frame = reset_frame(os.urandom(8))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer QEMU exited: {(self.dir / 'qemu.log').read_text()[-500:]}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(self.dir / "agent.sock"))
            except OSError:
                s.close()
                time.sleep(0.005)
                continue
            try:
                s.sendall(frame)
                s.settimeout(0.2)
                buf, tried = b"", time.monotonic()
                while time.monotonic() - tried < 5 and time.monotonic() < end:
                    try:
                        chunk = s.recv(65536)
                    except TimeoutError:
                        if self.proc.poll() is not None:
                            break
                        continue
                    if not chunk:
                        break
                    buf += chunk
                    if frame in buf:
                        return
            finally:
                s.close()
        raise RuntimeError(f"peer guest did not answer within {timeout:.0f} s")

    def save(self, stream: Path, then: str) -> int:
        """``stop``, then a plain migration (all RAM) into ``stream``, synced; then ``cont``
        (the VM goes on), ``quit`` (waits for QEMU's exit, removes the RAM file) or
        ``none`` (stays stopped). Returns the stream's size."""
        q = self.qmp()
        q.cmd("stop")
        q.cmd("migrate-set-parameters", {"max-bandwidth": 64 << 30})
        with open(stream, "wb") as f:
            q.cmd("getfd", {"fdname": "state"}, fd=f.fileno())
            q.cmd("migrate", {"uri": "fd:state"})
            while True:
                st = q.cmd("query-migrate").get("status")
                if st == "completed":
                    break
                if st in ("failed", "cancelled"):
                    raise RuntimeError(f"peer migration {st}")
                time.sleep(0.005)
            f.flush()
            os.fsync(f.fileno())
        if then == "cont":
            q.cmd("cont")
        elif then == "quit":
            self.quit()
            (self.dir / "ram").unlink(missing_ok=True)
        return stream.stat().st_size

    def restore(self, stream: Path, disk: Path | None) -> None:
        """A new QEMU on a copy of ``disk`` (``None``: its own) and a new RAM file, fed
        ``stream``, continued."""
        self.start(disk, incoming=True)
        q = self.qmp()
        with open(stream, "rb") as f:
            q.cmd("getfd", {"fdname": "state"}, fd=f.fileno())
            q.cmd("migrate-incoming", {"uri": "fd:state"})
            while (st := q.status()) in ("inmigrate", "prelaunch"):
                time.sleep(0.005)
        if st in ("paused", "postmigrate"):
            q.cmd("cont")
        elif st != "running":
            raise RuntimeError(f"peer restore ended {st}")

    def pss(self) -> dict[str, float]:
        assert self.proc is not None
        return pss_mib(self.proc.pid)

    def quit(self) -> None:
        """``quit`` over QMP (a kill if that fails), until QEMU exited."""
        if self.proc is None:
            return
        try:
            self.qmp().cmd("quit")
        except (RuntimeError, OSError):
            self.proc.kill()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.q is not None:
            self.q.close()
            self.q = None

    def remove(self) -> None:
        self.quit()
        shutil.rmtree(self.dir, ignore_errors=True)


class Peer:
    """QEMU alone with the command line of one of the cluster's VMs (a cold-booted one),
    rewritten into ``work``: the sandbox's directory (its RAM file, config disk, agent and
    QMP sockets) becomes each peer VM's own directory, its writable disk ``disk.img`` there."""

    def __init__(self, argv: list[str], sandbox_dir: Path, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sandbox_dir = str(sandbox_dir)
        rw = [a for a in argv if a.startswith("if=none") and "readonly=off" in a]
        if len(rw) != 1:
            raise RuntimeError(f"expected one writable disk in {argv}")
        self.rw = rw[0].split("file=", 1)[1]
        if "-incoming" in argv:
            raise RuntimeError("the peer's command line must be a cold-booted VM's")
        self.argv = argv
        work.mkdir(parents=True)
        self.config = work / "config.img"
        shutil.copyfile(sandbox_dir / "config.img", self.config)
        # The empty writable disk the edge gives a new VM: its template for this size.
        size = Path(self.rw).stat().st_size
        templates = sorted((Path(self.rw).parent / ".templates").glob(f"{size >> 20}-v*.img"))
        if not templates:
            raise RuntimeError(f"no disk template for {size >> 20} MB beside {self.rw}")
        self.fresh = work / "fresh.img"
        subprocess.run(["cp", "--sparse=always", str(templates[-1]), str(self.fresh)], check=True)

    def argv_for(self, d: Path, incoming: bool) -> list[str]:
        out = [a.replace(self.rw, str(d / "disk.img")).replace(self.sandbox_dir, str(d)) for a in self.argv]
        # Our QEMU inherits its agent and QMP sockets from the edge (chardev fd=N); the
        # peer makes its own at paths in its directory.
        for name in ("agent", "qmp"):
            prefix = f"socket,id={name},"
            out = [
                a.rsplit(",fd=", 1)[0] + f",path={d / (name + '.sock')}" if a.startswith(prefix) and ",fd=" in a else a
                for a in out
            ]
        # A boot's console goes to a socket pair the edge reads (-chardev socket,id=console,fd=N);
        # the peer's goes nowhere, as ours does once the agent answers.
        for i, a in enumerate(out):
            if a.startswith("socket,id=console,") and i > 0 and out[i - 1] == "-chardev":
                del out[i - 1 : i + 1]
                break
        out = ["null" if a == "chardev:console" else a for a in out]
        return out + (["-incoming", "defer"] if incoming else [])

    def vm(self, name: str) -> PeerVm:
        return PeerVm(self, name)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


# ---------------------------------------------------------------- the measurement


class Bench:
    def __init__(self, c: DSecClient, state: Path, log: EdgeLog) -> None:
        self.c, self.state, self.log = c, state, log
        self.live: list[Sandbox] = []
        self.peer: Peer | None = None
        self.out: dict[str, Any] = {}

    async def answer(self, sb: Sandbox) -> None:
        r = await sb.run_shell("echo hi")
        assert r.exit_code == 0 and r.stdout == "hi\n", r

    async def create(self, image: str = IMAGE) -> Sandbox:
        sb = await self.c.run_sandbox(DSecRunArgs(image=image, **VM), timeout=ANSWER_TIMEOUT_S)
        self.live.append(sb)
        return sb

    async def stop(self, *sbs: Sandbox) -> None:
        await asyncio.gather(*(sb.stop() for sb in sbs))
        for sb in sbs:
            self.live.remove(sb)

    def record(self, key: str, ours: list[float], peer: list[float], unit: str = "ms", **extra: Any) -> None:
        self.out[key] = {"unit": unit, "ours": summary(ours), "peer": summary(peer), **extra}

    async def setup(self) -> tuple[Sandbox, PeerVm]:
        """The subject VMs: one of ours (warms the image's disk) and the peer's, booted from
        its command line."""
        sb = await self.create()
        await self.answer(sb)
        pid = qemu_pid(self.state, sb.id)
        argv = qemu_argv(pid)
        sandbox_dir = next(Path(a.split("mem-path=", 1)[1]).parent for a in argv if "mem-path=" in a)
        self.peer = Peer(argv, sandbox_dir, self.state / "peer")
        self.out["qemu_argv"] = argv
        pvm = self.peer.vm("subject")
        await asyncio.to_thread(pvm.start, self.peer.fresh, False)
        await asyncio.to_thread(pvm.answers)
        return sb, pvm

    async def boot(self, n: int) -> None:
        assert self.peer is not None
        ours, peer, mem_ours, mem_peer = [], [], [], []
        for i in range(n):
            t = time.perf_counter()
            sb = await self.create()
            await self.answer(sb)
            ours.append(ms(t))
            await asyncio.sleep(SETTLE_S)
            mem_ours.append(pss_mib(qemu_pid(self.state, sb.id)))
            await self.stop(sb)

            vm = self.peer.vm(f"boot{i}")
            t = time.perf_counter()
            await asyncio.to_thread(vm.start, self.peer.fresh, False)
            await asyncio.to_thread(vm.answers)
            peer.append(ms(t))
            await asyncio.sleep(SETTLE_S)
            mem_peer.append(vm.pss())
            await asyncio.to_thread(vm.remove)
        self.record("boot", ours, peer)
        self.out["memory_idle"] = {
            "unit": "MiB",
            "ours": summary([m["pss"] for m in mem_ours]),
            "peer": summary([m["pss"] for m in mem_peer]),
            "ours_anon_file": [statistics.median(m["pss_anon"] for m in mem_ours),
                               statistics.median(m["pss_file"] for m in mem_ours)],
            "peer_anon_file": [statistics.median(m["pss_anon"] for m in mem_peer),
                               statistics.median(m["pss_file"] for m in mem_peer)],
        }

    async def pause_resume(self, n: int, sb: Sandbox, pvm: PeerVm) -> None:
        pause, resume, resume_call, ppause, presume, sizes = [], [], [], [], [], []
        cmd, pcmd, again = [], [], []
        stream = pvm.dir.parent / "pause.mig"
        for _ in range(n):
            t = time.perf_counter()
            await self.answer(sb)
            cmd.append(ms(t))
            t = time.perf_counter()
            await asyncio.to_thread(pvm.answers)
            pcmd.append(ms(t))

            t = time.perf_counter()
            await sb.pause()
            pause.append(ms(t))
            assert sb.state == "PAUSED", sb
            t = time.perf_counter()
            await sb.resume()
            resume_call.append(ms(t))
            await self.answer(sb)
            resume.append(ms(t))
            t = time.perf_counter()
            await self.answer(sb)
            again.append(ms(t))

            t = time.perf_counter()
            sizes.append(await asyncio.to_thread(pvm.save, stream, "quit"))
            ppause.append(ms(t))
            t = time.perf_counter()
            await asyncio.to_thread(pvm.restore, stream, None)
            await asyncio.to_thread(pvm.answers)
            presume.append(ms(t))
        stream.unlink()
        self.record("pause", pause, ppause, peer_stream_mb=statistics.median(sizes) / 2**20)
        self.record("resume", resume, presume, ours_resume_call=summary(resume_call),
                    ours_second_command=summary(again))
        self.record("answer", cmd, pcmd)

    async def snapshot_restore(self, n: int, sb: Sandbox, pvm: PeerVm) -> None:
        assert self.peer is not None
        snap, paused, psnap, restore, prestore = [], [], [], [], []
        keep = f"{IMAGE.rsplit('/', 1)[0]}/snap:0"
        pdir = self.peer.work / "snap0"
        for i in range(n):
            name = f"{IMAGE.rsplit('/', 1)[0]}/snap:{i}"
            t = time.perf_counter()
            await sb.create_snapshot(name, memory=True, overwrite=True)
            snap.append(ms(t))
            paused.extend(self.log.new(sb.id))
            if i:
                await self.c.delete_image(name)
            d = self.peer.work / f"snap{i}"
            d.mkdir()
            t = time.perf_counter()
            await asyncio.to_thread(peer_snapshot, pvm, d)
            psnap.append(ms(t))
            if i:
                shutil.rmtree(d)
        for i in range(n):
            t = time.perf_counter()
            cp = await self.create(keep)
            await self.answer(cp)
            restore.append(ms(t))
            await self.stop(cp)
            vm = self.peer.vm(f"restore{i}")
            t = time.perf_counter()
            await asyncio.to_thread(vm.restore, pdir / "state.mig", pdir / "disk.img")
            await asyncio.to_thread(vm.answers)
            prestore.append(ms(t))
            await asyncio.to_thread(vm.remove)
        await self.c.delete_image(keep)
        shutil.rmtree(pdir)
        self.record("snapshot", snap, psnap, ours_paused_ms=summary(paused) if paused else None)
        self.record("restore", restore, prestore)

    async def forks(self, rounds: int, sb: Sandbox, pvm: PeerVm) -> None:
        assert self.peer is not None
        for k in (1, 4, 8):
            ours, paused, peer, pstill, mem_ours, mem_peer = [], [], [], [], [], []
            for r in range(rounds):
                t = time.perf_counter()
                made = await sb.fork(count=k)
                copies = [m for m in made if not isinstance(m, DSecError)]
                self.live.extend(copies)
                if len(copies) != k:
                    raise RuntimeError(f"fork(count={k}): {made}")
                await asyncio.gather(*(self.answer(cp) for cp in copies))
                ours.append(ms(t))
                paused.extend(self.log.new(sb.id))
                if k == 8 and r == 0:
                    await asyncio.sleep(SETTLE_S)
                    mem_ours += [pss_mib(qemu_pid(self.state, cp.id))["pss"] for cp in copies]
                await self.stop(*copies)

                d = self.peer.work / "fork"
                d.mkdir()
                vms = [self.peer.vm(f"fork{j}") for j in range(k)]

                def one(vm: PeerVm, d: Path = d) -> None:
                    vm.restore(d / "state.mig", d / "disk.img")
                    vm.answers()

                t = time.perf_counter()
                still = await asyncio.to_thread(peer_snapshot, pvm, d)
                with ThreadPoolExecutor(k) as ex:
                    await asyncio.gather(*(asyncio.wrap_future(ex.submit(one, vm)) for vm in vms))
                peer.append(ms(t))
                pstill.append(still)
                if k == 8 and r == 0:
                    await asyncio.sleep(SETTLE_S)
                    mem_peer += [vm.pss()["pss"] for vm in vms]
                for vm in vms:
                    await asyncio.to_thread(vm.remove)
                shutil.rmtree(d)
            self.record(f"fork{k}", ours, peer, ours_paused_ms=summary(paused) if paused else None,
                        peer_paused_ms=summary(pstill))
            if mem_ours:
                self.out["memory_fork8_copy"] = {"unit": "MiB", "ours": summary(mem_ours), "peer": summary(mem_peer)}


def peer_snapshot(vm: PeerVm, d: Path) -> float:
    """QEMU's savevm on raw disks: ``stop``, all RAM into ``d/state.mig`` synced, the
    writable disk copied to ``d/disk.img``, ``cont``. Returns how long the VM stood still (ms)."""
    t = time.perf_counter()
    vm.save(d / "state.mig", "none")
    subprocess.run(["cp", "--sparse=always", str(vm.dir / "disk.img"), str(d / "disk.img")], check=True)
    vm.qmp().cmd("cont")
    return ms(t)


def accel(log: Path) -> str:
    m = re.search(r"microVMs start with this accelerator.*?accel=(\w+).*?machine=(.*?); \w+ kernel=(\S+)",
                  log.read_text(errors="replace"))
    return f"{m[1]}, {m[2]}, kernel {Path(m[3]).name}" if m else "unknown"


async def run(a: argparse.Namespace, state: Path, log_path: Path) -> dict[str, Any]:
    log = EdgeLog(log_path)
    async with DSecClient(retry_timeout=60) as c:
        b = Bench(c, state, log)
        try:
            sb, pvm = await b.setup()
            if a.only in ("all", "boot"):
                await b.boot(a.n)
            if a.only in ("all", "pause"):
                await b.pause_resume(a.n, sb, pvm)
            if a.only in ("all", "snapshot"):
                await b.snapshot_restore(a.n, sb, pvm)
            if a.only in ("all", "fork"):
                await b.forks(a.forks, sb, pvm)
        finally:
            # The peer's QEMUs first: a thread waiting on one of them ends once it is gone.
            if b.peer is not None:
                b.peer.kill_all()
            for s in list(b.live):
                try:
                    await asyncio.wait_for(s.stop(), 60)
                except (DSecError, TimeoutError) as e:
                    print(f"stopping {s.id}: {e!r}", file=sys.stderr)
    b.out["accel"] = accel(log_path)
    return b.out


ROWS = [
    ("answer", "answer of a running VM"),
    ("boot", "cold boot to first answer"),
    ("pause", "pause"),
    ("resume", "resume to first answer"),
    ("snapshot", "snapshot (memory)"),
    ("restore", "restore from snapshot to first answer"),
    ("fork1", "fork(count=1) until every copy answers"),
    ("fork4", "fork(count=4) until every copy answers"),
    ("fork8", "fork(count=8) until every copy answers"),
    ("memory_idle", "memory per idle VM, PSS (cold-booted)"),
    ("memory_fork8_copy", "memory per idle copy of a fork(8), PSS"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=8, help="rounds of boot, pause/resume, snapshot, restore")
    ap.add_argument("-forks", type=int, default=3, help="rounds of each fork(count=1, 4, 8)")
    ap.add_argument("-only", choices=["all", "boot", "pause", "snapshot", "fork"], default="all")
    ap.add_argument("-json", action="store_true")
    a = ap.parse_args()
    state = Path(os.environ["OPENDSEC_BENCH_STATE"])
    log_path = Path(os.environ["OPENDSEC_BENCH_LOG"])
    with tempfile.TemporaryDirectory() as d:
        files: dict[str, bytes | str] = {"bin/busybox": Path(shutil.which("busybox") or "/bin/busybox").read_bytes()}
        files.update({f"bin/{t}": "busybox" for t in ("sh", "cat", "echo", "sleep", "true")})
        files.update({"etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n", "etc/group": b"root:x:0:\n"})
        oci_layout(Path(d) / "vm", [files], env=["PATH=/bin"])
        subprocess.run([BIN, "ctl", "project", "create", "root", "bench"], check=False, capture_output=True)
        ctl("image", "import", f"{d}/vm", "-as", IMAGE, "-overwrite", "-q")
    started = time.perf_counter()
    out = asyncio.run(run(a, state, log_path))
    out["wall_s"] = time.perf_counter() - started
    out["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    out["cores"] = os.cpu_count()
    out["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=False,
                                   capture_output=True, text=True).stdout.strip()
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"microVMs at {out['commit']}, {out['date']}: {out['accel']}; {out['cores']} cores; "
          f"{out['wall_s']:.0f} s in all")
    print(f"{'measure':<42} {'ours p50':>9} {'p99':>9} {'peer p50':>9} {'p99':>9} {'n':>3}  unit")
    for key, label in ROWS:
        if key not in out:
            continue
        r = out[key]
        print(f"{label:<42} {r['ours']['p50']:9.0f} {r['ours']['p99']:9.0f} {r['peer']['p50']:9.0f} "
              f"{r['peer']['p99']:9.0f} {r['ours']['n']:3d}  {r['unit']}")
        for extra in ("ours_paused_ms", "peer_paused_ms", "ours_resume_call", "ours_second_command"):
            if r.get(extra):
                e = r[extra]
                print(f"  {extra}: p50 {e['p50']:.0f} p99 {e['p99']:.0f} (n={e['n']})")
        if "peer_stream_mb" in r:
            print(f"  peer stream: {r['peer_stream_mb']:.0f} MiB")
        if "ours_anon_file" in r:
            print(f"  anon/file PSS: ours {r['ours_anon_file'][0]:.0f}/{r['ours_anon_file'][1]:.0f}, "
                  f"peer {r['peer_anon_file'][0]:.0f}/{r['peer_anon_file'][1]:.0f} MiB")


if __name__ == "__main__":
    main()
