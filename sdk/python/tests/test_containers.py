"""End-to-end acceptance tests: real Linux container sandboxes driven through the Python SDK.

A module fixture starts ``opendsec cluster up -config F`` with one edge whose ``container``
backend has runtime ``linux`` and the development image ``host`` (the host's / as a read-only
lower layer), in a fresh temporary state directory. The config is what ``cluster up -runtime
linux -sim-edges 1`` generates, with three changes that keep these tests independent of
anything else on the machine: a unique edge id (the container backend's cgroups live under
``opendsec/<edge id>``, and an edge starting up removes every sandbox there it has no record
of, so two clusters with the default id ``node-0`` would stop each other's sandboxes), a CPU
overcommit (a 2-core test machine would otherwise admit only two 1-core sandboxes), and
``pids_max: 1024`` (so that a fork bomb reaches the limit in about a second).

The edge and apiserver kill tests run the roles as separate processes instead (``procs.py``).

Needs root and the release binary (``target/x86_64-unknown-linux-gnu/release/opendsec`` or
``$OPENDSEC_BIN``); without either the tests are skipped, except under ``CI=true``, where
they fail. Every sandbox is stopped and every process started here is killed (by pid) at the
end, also when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import json
import os
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

import opendsec
from opendsec import DSecClient, DSecError, DSecRunArgs, Sandbox

from procs import RoleCluster

pytestmark = pytest.mark.containers

REPO = Path(__file__).resolve().parents[3]
SDK = REPO / "sdk" / "python"
DEFAULT_BIN = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "opendsec"
START_TIMEOUT_S = float(os.environ.get("OPENDSEC_CLUSTER_START_TIMEOUT", "90"))
LEAK_CYCLES = int(os.environ.get("OPENDSEC_LEAK_CYCLES", "500"))
#: "0" turns the machine-wide leak counts (all mounts, loop devices, cgroups, processes) into
#: a report only; the counts scoped to this test's cluster are always asserted.
LEAK_GLOBAL = os.environ.get("OPENDSEC_LEAK_GLOBAL", "1") != "0"
#: The container backend's pids limit in the module cluster (see the module doc).
PIDS_MAX = 1024
WANTED = ("OPENDSEC_ADDR", "OPENDSEC_TOKEN", "OPENDSEC_PROJECT")
EPERM, EAGAIN, ENOSYS = 1, 11, 38


def require_root_and_binary() -> Path:
    """The opendsec binary; skips without it or without root, except under ``CI=true`` (fails)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("container sandboxes need root")
    binary = Path(os.environ.get("OPENDSEC_BIN") or DEFAULT_BIN)
    if not binary.is_file():
        problems.append(f"opendsec binary not found at {binary} (cargo build --release, or set OPENDSEC_BIN)")
    if problems:
        msg = "; ".join(problems)
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; under CI=true the container tests must run", pytrace=False)
        pytest.skip(msg)
    return binary


def parse_export(line: str) -> Optional[tuple[str, str]]:
    """``export NAME=value`` (value possibly shell-quoted) -> (NAME, value)."""
    line = line.strip()
    if not line.startswith("export "):
        return None
    name, sep, value = line[len("export "):].partition("=")
    if not sep:
        return None
    parts = shlex.split(value) if value else [""]
    return name.strip(), (parts[0] if parts else "")


# ---------------------------------------------------------------------------------------------
# What a sandbox leaves on the host, and a last-resort sweep of it.


def cgroup_dirs(edge_id: str, sandbox_id: str = "*") -> list[str]:
    """The sandbox cgroup directories of ``edge_id`` on every hierarchy (v1 and v2)."""
    pats = [f"/sys/fs/cgroup/*/opendsec/{edge_id}/{sandbox_id}", f"/sys/fs/cgroup/opendsec/{edge_id}/{sandbox_id}"]
    return sorted(d for p in pats for d in glob.glob(p) if os.path.isdir(d))


def loop_devices() -> dict[str, str]:
    """Attached loop devices: ``/dev/loopN`` -> backing file."""
    out = {}
    for f in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            out["/dev/" + f.split("/")[3]] = Path(f).read_text().strip()
        except OSError:  # detached meanwhile
            pass
    return out


def mountinfo() -> list[str]:
    return Path("/proc/self/mountinfo").read_text().splitlines()


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def sandbox_like_pids() -> list[int]:
    """Processes anywhere on the host that a sandbox or an agent could have left: those in a
    PID namespace other than ours (every sandbox has its own, and no process can leave it)
    and those running an opendsec binary. Unrelated programs of the machine are not counted."""
    ours = os.readlink("/proc/self/ns/pid")
    out = []
    for p in pids():
        try:
            if os.readlink(f"/proc/{p}/ns/pid") != ours or "opendsec" in os.readlink(f"/proc/{p}/exe"):
                out.append(p)
        except OSError:
            continue
    return out


def pids_in_cgroups(edge_id: str) -> list[int]:
    """Processes (anywhere on the host) whose cgroup is under ``opendsec/<edge_id>``."""
    mark = f"/opendsec/{edge_id}/"
    out = []
    for p in pids():
        try:
            if mark in Path(f"/proc/{p}/cgroup").read_text():
                out.append(p)
        except OSError:
            pass
    return out


def descendants(root: int) -> list[int]:
    """Processes below ``root`` (children, grandchildren, ...), from /proc/*/stat."""
    parent: dict[int, int] = {}
    for p in pids():
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        parent[p] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        cur = todo.pop()
        kids = [p for p, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out


def traces(edge_id: str, state_dir: Path, sandbox_id: str) -> dict[str, list[str]]:
    """Everything of one sandbox still on the host; all lists empty once it is cleaned up."""
    return {
        "cgroups": cgroup_dirs(edge_id, sandbox_id),
        "loop devices": [f"{d} ({b})" for d, b in loop_devices().items() if sandbox_id in b],
        "mounts": [m for m in mountinfo() if sandbox_id in m],
        "files": [
            str(p)
            for p in state_dir.rglob(f"*{sandbox_id}*")
            if "edges" not in p.relative_to(state_dir).parts  # the edge's record of it is kept
        ],
        "processes": [str(p) for p in pids_in_cgroups(edge_id) if sandbox_id in _cgroup_of(p)],
    }


def _cgroup_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def sweep(edge_id: str, state_dir: Path) -> list[str]:
    """Last resort after a failed test: kills what is left of the edge's sandboxes (by the pids
    in its cgroups), detaches their loop devices and removes their cgroups. Returns what it did."""
    did = []
    for d in glob.glob(f"/sys/fs/cgroup/freezer/opendsec/{edge_id}/*"):
        try:
            Path(d, "freezer.state").write_text("THAWED")
        except OSError:
            pass
    for d in glob.glob(f"/sys/fs/cgroup/opendsec/{edge_id}/*") + glob.glob(f"/sys/fs/cgroup/unified/opendsec/{edge_id}/*"):
        try:
            Path(d, "cgroup.freeze").write_text("0")
        except OSError:
            pass
    for _ in range(3):
        left = pids_in_cgroups(edge_id)
        if not left:
            break
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
                did.append(f"killed {p}")
            except OSError:
                pass
        time.sleep(0.5)
    for dev, backing in loop_devices().items():
        if backing.startswith(str(state_dir)):
            subprocess.run(["losetup", "-d", dev], capture_output=True)
            did.append(f"detached {dev}")
    for d in cgroup_dirs(edge_id):
        try:
            os.rmdir(d)
            did.append(f"removed {d}")
        except OSError:
            pass
    # The edge's own (empty) parent cgroups stay after it exits; the ids here are unique per run.
    for d in glob.glob(f"/sys/fs/cgroup/*/opendsec/{edge_id}") + glob.glob(f"/sys/fs/cgroup/opendsec/{edge_id}"):
        try:
            os.rmdir(d)
        except OSError:
            pass
    return did


async def stop_all(c: DSecClient) -> None:
    """Stops every sandbox of the client's project (best effort)."""
    try:
        for sb in await c.list_sandboxes():
            try:
                await sb.stop()
            except DSecError:
                pass
    except DSecError:
        pass


# ---------------------------------------------------------------------------------------------
# The module's cluster.


@dataclass
class LinuxCluster:
    """A running ``opendsec cluster up`` with real containers."""

    proc: subprocess.Popen
    env: dict[str, str]
    state_dir: Path
    edge_id: str
    log_path: str
    store: Path

    def client(self, **kw) -> DSecClient:
        kw.setdefault("retry_timeout", 30)
        return DSecClient(
            endpoint=self.env["OPENDSEC_ADDR"], token=self.env["OPENDSEC_TOKEN"], project=self.env["OPENDSEC_PROJECT"], **kw
        )

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def traces(self, sandbox_id: str) -> dict[str, list[str]]:
        return traces(self.edge_id, self.state_dir, sandbox_id)


def store_root(base: Path) -> Path:
    """The image store of the cluster whose files are under ``base``: on the NFS 4.2 mount
    ``OPENDSEC_TEST_NFS_STORE`` names when set (scripts/test-nfs.sh runs the image tests there),
    else beside its state."""
    nfs = os.environ.get("OPENDSEC_TEST_NFS_STORE")
    return Path(nfs) / base.name if nfs else base / "images"


@pytest.fixture(scope="module")
def linux() -> Iterator[LinuxCluster]:
    yield from run_linux_cluster()


def run_linux_cluster(more_backends: Optional[dict] = None) -> Iterator[LinuxCluster]:
    """A cluster of one real edge with the ``container`` backend, and ``more_backends``
    (backend name -> its config) beside it; torn down, leftovers swept, when the caller
    is done with it."""
    binary = require_root_and_binary()
    # Short: aether's unix socket lives under it, and socket paths have a 108-byte limit.
    base = Path(tempfile.mkdtemp(prefix="odc-", dir="/tmp"))
    state_dir = base / "state"
    edge_id = f"e2e-{secrets.token_hex(3)}"
    config = {
        "service_token": secrets.token_hex(20),
        "iam": {"addr": "127.0.0.1:0", "admin_token": f"dsk.admin.{secrets.token_hex(20)}"},
        "watcher": {"addr": "127.0.0.1:0", "probe_interval": 0.25, "reconcile_interval": 5.0},
        "apiserver": [{"addr": "127.0.0.1:0", "snapshot_refresh": 0.25}],
        "image_store": {"root": str(store_root(base))},
        "edges": [
            {
                "id": edge_id,
                "addr": "127.0.0.1:0",
                "state_dir": str(state_dir),
                "persist_state": True,
                "images": {"host": ["/"]},
                "cpu_overcommit": 32,
                "mem_reserve_mb": 0,
                "disk_reserve_mb": 512,
                "backends": {
                    "container": {"runtime": "linux", "default_disk_mb": 1024, "pids_max": PIDS_MAX},
                    **(more_backends or {}),
                },
            }
        ],
    }
    cfg_path = base / "opendsec.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    os.chmod(cfg_path, 0o600)
    log_path = str(base / "cluster.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [str(binary), "cluster", "up", "-config", str(cfg_path), "-log", "info"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    log.close()
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # keeps reading so that the pipe never fills up
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    env: dict[str, str] = {}
    failure = ""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not failure and not all(k in env for k in WANTED):
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            failure = f"cluster up printed no {WANTED} within {START_TIMEOUT_S:.0f} s"
            break
        if line is None:
            failure = f"cluster up exited with {proc.wait()} before printing {WANTED}"
            break
        kv = parse_export(line)
        if kv and kv[0] in WANTED:
            env[kv[0]] = kv[1]
    cluster = LinuxCluster(proc, env, state_dir, edge_id, log_path, store_root(base))
    try:
        if failure:
            pytest.fail(f"{failure}\n{cluster.log_tail()}", pytrace=False)
        yield cluster
    finally:
        if env and proc.poll() is None:

            async def stop_everything() -> None:
                async with cluster.client(retry_timeout=5) as c:
                    await stop_all(c)

            try:
                asyncio.run(asyncio.wait_for(stop_everything(), 120))
            except Exception as e:  # keep tearing down
                print(f"stopping the sandboxes at teardown: {e!r}")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        left = sweep(edge_id, state_dir)
        if left:
            print(f"teardown swept leftovers of {edge_id}: {left}")
        shutil.rmtree(base, ignore_errors=True)


def container(**kw) -> DSecRunArgs:
    """Arguments for a container sandbox from the ``host`` image (1 core, 512 MB, 256 MB disk by default)."""
    kw.setdefault("cpu_cores_limit", 1)
    kw.setdefault("memory_limit_mb", 512)
    kw.setdefault("disk_mb", 256)
    return DSecRunArgs(backend="container", image="host", **kw)


async def wait_state(sb: Sandbox, *states: str, within: float = 15.0) -> Sandbox:
    """Refreshes until the sandbox is in one of ``states``."""
    end = time.monotonic() + within
    while sb.state not in states:
        if time.monotonic() > end:
            raise AssertionError(f"{sb.id} is {sb.state} ({sb.info.message!r}), wanted {states} within {within:.0f} s")
        await asyncio.sleep(0.2)
        await sb.refresh()
    return sb


async def wait_clean(cluster: LinuxCluster, sandbox_id: str, within: float = 5.0) -> None:
    """Asserts that nothing of the sandbox is left on the host (allowing ``within`` seconds)."""
    end = time.monotonic() + within
    while True:
        t = cluster.traces(sandbox_id)
        if not any(t.values()):
            return
        if time.monotonic() > end:
            raise AssertionError(f"left behind by {sandbox_id}: { {k: v for k, v in t.items() if v} }")
        await asyncio.sleep(0.2)


async def sh(sb: Sandbox, cmd: str, **kw):
    kw.setdefault("timeout", 60)
    return await sb.run_shell(cmd, **kw)


# ---------------------------------------------------------------------------------------------
# 1. The quickstart.


async def test_quickstart_prints_42(linux):
    env = {**os.environ, **linux.env, "PYTHONPATH": str(SDK)}
    env.pop("OPENDSEC_CA", None)
    r = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SDK / "examples" / "quickstart.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert (r.returncode, r.stdout) == (0, "42\n"), f"stderr:\n{r.stderr}\n{linux.log_tail()}"


async def test_cli_exec_and_cp(linux, tmp_path):
    """`opendsec ctl exec` exits with the command's code, quotes several arguments as ssh and
    docker exec do, and `ctl cp` copies both ways (docs/cli.md)."""
    binary = require_root_and_binary()
    env = {**os.environ, **linux.env}
    env.pop("OPENDSEC_CA", None)

    def ctl(*args: str, stdin: Optional[bytes] = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(binary), "ctl", *args], env=env, capture_output=True, timeout=120, input=stdin)

    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=128))
        try:
            r = await asyncio.to_thread(ctl, "exec", sb.id, "python3", "-c", "print(6*7)")
            assert (r.returncode, r.stdout) == (0, b"42\n"), r.stderr
            r = await asyncio.to_thread(ctl, "exec", sb.id, "exit 7")
            assert r.returncode == 7, r.stderr
            # Several arguments are each quoted: the ; stays an argument of echo.
            r = await asyncio.to_thread(ctl, "exec", sb.id, "--", "echo", "a;b", "$HOME")
            assert r.stdout == b"a;b $HOME\n", r.stderr
            r = await asyncio.to_thread(ctl, "exec", sb.id, "echo out; echo err >&2; exit 3")
            assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
            src = tmp_path / "in.bin"
            src.write_bytes(bytes(range(256)) * 1000)
            r = await asyncio.to_thread(ctl, "cp", str(src), f"{sb.id}:/tmp/in.bin")
            assert r.returncode == 0, r.stderr
            assert await sb.read_file("/tmp/in.bin") == src.read_bytes()
            back = tmp_path / "back.bin"
            r = await asyncio.to_thread(ctl, "cp", f"{sb.id}:/tmp/in.bin", str(back))
            assert r.returncode == 0, r.stderr
            assert back.read_bytes() == src.read_bytes()
            r = await asyncio.to_thread(ctl, "cp", f"{sb.id}:/nonexistent", str(back))
            assert r.returncode != 0 and b"not_found" in r.stderr
        finally:
            await sb.stop()


async def test_agents_are_read_only(linux):
    """The agent binary and aether's config in the sandbox cannot be changed, even by root in
    it (docs/containers.md), and the config is root's only to read."""
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=128))
        try:
            r = await sb.run_shell("echo x >> /run/opendsec/bin/opendsec; echo rc=$?; "
                                   "awk '$5 == \"/run/opendsec/bin/opendsec\" {print $6}' /proc/self/mountinfo")
            # The write fails (the running binary is busy, and its mount is read-only anyway).
            assert r.stdout.startswith("rc=1\nro,"), r
            r = await sb.run_shell("cat /proc/1/exe > /dev/null && echo readable; echo x > /proc/1/exe; echo rc=$?")
            assert "rc=1" in r.stdout, r
            r = await sb.run_shell("stat -c '%a %U' /run/opendsec/aether.json; cat /run/opendsec/aether.json",
                                   session="agent", user="1000")
            assert r.stdout.startswith("600 root") and "Permission denied" in r.stderr, r
            # Nor can root in the sandbox rewrite it: it is bound read-only over itself.
            r = await sb.run_shell("echo garbage > /run/opendsec/aether.json", timeout=30)
            assert r.exit_code == 1 and "Read-only file system" in r.stderr, r
            r = await sb.run_shell("echo fresh", session="later", timeout=30)
            assert (r.exit_code, r.stdout) == (0, "fresh\n"), r
        finally:
            await sb.stop()
        # Hiding or freezing the agents' directory is refused before anything is made.
        for field in ("masked_paths", "readonly_paths"):
            for p in ("/run/opendsec", "/run", "/run/opendsec/bin", "/proc"):
                with pytest.raises(DSecError) as ei:
                    await c.run_sandbox(container(memory_limit_mb=256, disk_mb=128, **{field: [p]}))
                assert ei.value.reason == opendsec.INVALID, (field, p, ei.value)


# ---------------------------------------------------------------------------------------------
# 2. The RL pattern: a root grader session and an unprivileged agent session.


async def test_rl_grader_and_agent_sessions(linux):
    secret = f"s3cret-{secrets.token_hex(8)}"
    async with linux.client() as c:
        sb = await c.run_sandbox(container())
        try:
            r = await sh(sb, f"mkdir -p /grader && umask 077 && printf %s {secret} > /grader/secret && stat -c '%a %u' /grader/secret",
                         session="grader")
            assert (r.exit_code, r.stdout) == (0, "600 0\n"), r
            r = await sh(sb, "echo score for $(cat /grader/secret)", session="grader")
            assert (r.exit_code, r.stdout) == (0, f"score for {secret}\n"), r

            # The agent runs as uid 1000 ...
            r = await sh(sb, "id -u", session="agent", user="1000")
            assert (r.exit_code, r.stdout) == (0, "1000\n"), r
            # The user was fixed by the first command: another one is refused, naming both.
            with pytest.raises(DSecError) as e:
                await sh(sb, "id -u", session="agent", user="0")
            assert e.value.reason == opendsec.INVALID and "1000" in str(e.value) and '"0"' in str(e.value), e.value
            # ... and cannot read the secret ...
            r = await sh(sb, "cat /grader/secret", session="agent")
            assert r.exit_code != 0 and "Permission denied" in r.stderr and secret not in r.stdout, r
            with pytest.raises(DSecError) as ei:
                await sb.read_file("/grader/secret", session="agent")
            assert ei.value.reason == opendsec.FORBIDDEN, ei.value
            assert (await sb.read_file("/grader/secret", session="grader")).decode() == secret
            # ... nor write the image's files.
            r = await sh(sb, "touch /etc/x", session="agent")
            assert r.exit_code != 0 and "Permission denied" in r.stderr, r
            r = await sh(sb, "test -e /etc/x; echo $?", session="grader")
            assert r.stdout == "1\n", "the agent's touch created /etc/x"

            # The grader's output records: found as root, closed to the agent.
            r = await sh(sb, "stat -c '%u %a %n' /run/opendsec/sessions/*", session="grader")
            dirs = dict(line.rsplit(" ", 1)[::-1] for line in r.stdout.splitlines())  # path -> "uid mode"
            # aether keeps a `default` session warm (started as init_user, root): not this test's.
            default_dir = "/run/opendsec/sessions/" + hashlib.sha256(b"default").hexdigest()[:16]
            dirs.pop(default_dir, None)
            assert sorted(dirs.values()) == ["0 700", "1000 700"], r.stdout
            grader_dir = next(p for p, v in dirs.items() if v == "0 700")
            r = await sh(sb, f"grep -rl -- {secret} {grader_dir}/rec", session="grader")
            records = r.stdout.split()
            assert r.exit_code == 0 and records, f"no output record holds the secret: {r}"

            r = await sh(sb, "ls /run/opendsec/sessions", session="agent")
            assert r.exit_code != 0 and "Permission denied" in r.stderr, r
            r = await sh(sb, f"ls {grader_dir} {grader_dir}/rec", session="agent")
            assert r.exit_code != 0 and r.stdout == "" and "Permission denied" in r.stderr, r
            r = await sh(sb, f"cat {records[0]}", session="agent")
            assert r.exit_code != 0 and secret not in r.stdout and "Permission denied" in r.stderr, r
            with pytest.raises(DSecError) as ei:
                await sb.read_file(records[0], session="agent")
            assert ei.value.reason == opendsec.FORBIDDEN, ei.value
            with pytest.raises(DSecError) as ei:
                await sb.list_dir(grader_dir, session="agent")
            assert ei.value.reason == opendsec.FORBIDDEN, ei.value
        finally:
            await sb.stop()


# ---------------------------------------------------------------------------------------------
# 3. Isolation.

#: Run inside the sandbox: each syscall with harmless arguments, printing {name: [ret, errno]}.
SYSCALLS_PY = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return [ret, ctypes.get_errno()]
def addr(b):
    return ctypes.cast(b, ctypes.c_void_p).value
tmp, none, tmpfs = (ctypes.create_string_buffer(s) for s in (b"/tmp", b"none", b"tmpfs"))
mnt_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY)
print(json.dumps({
    "mount": call(165, addr(none), addr(tmp), addr(tmpfs), 0, 0),
    "umount2": call(166, addr(tmp), 0),
    "pivot_root": call(155, addr(tmp), addr(tmp)),
    "setns": call(308, mnt_ns, 0),
    "unshare(CLONE_NEWUSER)": call(272, 0x10000000),
    "open_by_handle_at": call(304, -100, 0, 0),
    "bpf": call(321, 0, 0, 0),
    "keyctl": call(250, 0, 0, 0, 0, 0),
    "kexec_load": call(246, 0, 0, 0, 0),
    "init_module": call(175, 0, 0, 0),
    "perf_event_open": call(298, 0, 0, -1, -1, 0),
    "userfaultfd": call(323, 0),
    "clone3": call(435, 0, 0),
}))
"""

#: Run inside the sandbox: the pids it sees and whether any other process's command line has 4242.
PROCS_PY = r"""
import json, os
me = os.getpid()
seen, marked = [], []
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == me:
        continue
    seen.append(int(p))
    try:
        if b"4242" in open(f"/proc/{p}/cmdline", "rb").read():
            marked.append(int(p))
    except OSError:
        pass
print(json.dumps({"pids": sorted(seen), "marked": marked}))
"""


async def test_isolation(linux):
    marker = subprocess.Popen(["sleep", "4242"], start_new_session=True)
    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    try:
        async with linux.client() as c:
            sb = await c.run_sandbox(container())
            try:
                await sb.write_file("/tmp/syscalls.py", SYSCALLS_PY)
                r = await sh(sb, "python3 /tmp/syscalls.py")
                assert r.exit_code == 0, r
                got = json.loads(r.stdout)
                want = {name: [-1, EPERM] for name in got}
                want["clone3"] = [-1, ENOSYS]  # so that libc falls back to clone, which is filtered
                assert got == want

                r = await sh(sb, "mknod /tmp/blk b 7 0")
                assert r.exit_code != 0 and "Operation not permitted" in r.stderr, r
                r = await sh(sb, "test -e /tmp/blk; echo $?")
                assert r.stdout == "1\n"

                for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern", "/sys/kernel/mm/ksm/run",
                             "/sys/kernel/profiling"):
                    r = await sh(sb, f"echo 1 > {path}")
                    assert r.exit_code != 0 and r.stderr, f"{path}: {r}"
                assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern

                # The host's processes are invisible: the marker is running on the host only.
                assert b"4242" in Path(f"/proc/{marker.pid}/cmdline").read_bytes()
                await sb.write_file("/tmp/procs.py", PROCS_PY)
                r = await sh(sb, "python3 /tmp/procs.py")
                seen = json.loads(r.stdout)
                assert seen["marked"] == [], seen
                # aether (1), the session's chronus and shell, the shell of this command.
                assert 1 in seen["pids"] and len(seen["pids"]) <= 8, seen
                r = await sh(sb, "cat /proc/1/cmdline | tr '\\0' ' '")
                assert r.stdout.startswith("aether "), r
            finally:
                await sb.stop()
    finally:
        marker.kill()
        marker.wait()


# ---------------------------------------------------------------------------------------------
# 4. Resources.


async def test_memory_limit_kills_the_command_not_the_sandbox(linux):
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=128))
        try:
            r = await sh(sb, 'python3 -c "x=bytearray(400<<20)"')
            assert r.done and not r.timed_out, r
            assert r.exit_code == 137 or (r.exit_code != 0 and "Killed" in r.stderr), r
            assert "MemoryError" not in r.stderr, r  # killed by the cgroup, not refused by malloc
            assert r.oom_killed, r  # the OOM killer, told apart from any SIGKILL
            r = await sh(sb, "sh -c 'kill -9 $$'")
            assert (r.exit_code, r.oom_killed) == (137, False), r
            r = await sh(sb, "echo ok")
            assert (r.exit_code, r.stdout) == (0, "ok\n"), r
            r = await sh(sb, "cat /proc/1/comm; tr '\\0' ' ' < /proc/1/cmdline")
            assert r.stdout.startswith("opendsec\naether "), r  # aether: the agent executable, argv[0] aether
        finally:
            await sb.stop()


#: Run inside the sandbox: forks children (each execs sleep) until fork fails, records
#: "<children> <errno>" in /tmp/bomb.state, holds them for argv[1] seconds, then kills them all.
BOMB_PY = r"""
import os, signal, sys, time
kids, err = [], None
end = time.monotonic() + 8
while time.monotonic() < end:
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        try:
            os.execv("/bin/sleep", ["sleep", "60"])
        finally:
            os._exit(127)
    kids.append(pid)
with open("/tmp/bomb.state.tmp", "w") as f:
    f.write(f"{len(kids)} {err}\n")
os.rename("/tmp/bomb.state.tmp", "/tmp/bomb.state")
time.sleep(float(sys.argv[1]))
for k in kids:
    os.kill(k, signal.SIGKILL)
for k in kids:
    os.waitpid(k, 0)
print(len(kids), err)
"""


async def test_pids_limit_contains_a_fork_bomb(linux):
    async with linux.client() as c:
        bomb, other = await asyncio.gather(c.run_sandbox(container()), c.run_sandbox(container(memory_limit_mb=256)))
        try:
            await bomb.write_file("/tmp/bomb.py", BOMB_PY)
            cmd_id = await bomb.run_shell_background("timeout 10 python3 /tmp/bomb.py 3", session="bomb")
            # Wait for the bomb to hit the limit. Read through aether's file API: the sandbox
            # cannot fork a shell now.
            end = time.monotonic() + 10
            state = b""
            while not state:
                try:
                    state = await bomb.read_file("/tmp/bomb.state")
                except DSecError as e:
                    assert e.reason == opendsec.NOT_FOUND, e
                    assert time.monotonic() < end, "the fork bomb did not reach the pids limit within 10 s"
                    await asyncio.sleep(0.1)
            n, err = state.decode().split()
            assert err == str(EAGAIN), f"fork stopped with errno {err} after {n} children, wanted EAGAIN"
            # A session may take all of pids_max but a margin that the sandbox's other
            # sessions keep (docs/architecture.md "Cgroups").
            session_max = PIDS_MAX - min(64, PIDS_MAX // 4)
            assert session_max - 32 <= int(n) < session_max, state

            # Another sandbox is not affected while this one is at its limit.
            t0 = time.monotonic()
            r = await other.run_shell("echo alive", timeout=10)
            took = time.monotonic() - t0
            assert (r.ok, r.stdout) == (True, "alive\n"), r
            assert took < 5, f"echo alive in another sandbox took {took:.1f} s during the fork bomb"

            r = await bomb.get_output(cmd_id, session="bomb", wait=30)
            assert (r.done, r.exit_code, r.stdout) == (True, 0, f"{n} {EAGAIN}\n"), r
            r = await sh(bomb, "echo ok", session="bomb")  # forks work again once the children are gone
            assert (r.exit_code, r.stdout) == (0, "ok\n"), r
        finally:
            await asyncio.gather(bomb.stop(), other.stop())


def sandbox_pids(edge_id: str, sandbox_id: str) -> int:
    """The sandbox's pids.current (every process and thread in it), v1 or v2; 0 if unreadable."""
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        try:
            return int(Path(root, "opendsec", edge_id, sandbox_id, "pids.current").read_text())
        except (OSError, ValueError):
            continue
    return 0


# Issue 7 item 2: during a fork bomb, a command in another session and a new session's first
# command answer within 1 s, and stop within 2 s. The machines are shared and noisy, so the
# tests allow three times that, which still fails where the sessions used to hang (16 s in
# bash's fork retries, or for good in reclaim); each run prints what it measured. Where the
# tests run slower than this machine (scripts/v2-guest.sh, an emulated guest, sets
# OPENDSEC_TEST_TIME_SCALE), the bounds widen by that factor.
TIME_SCALE = max(1.0, float(os.environ.get("OPENDSEC_TEST_TIME_SCALE", "1")))
ANSWER_WITHIN = 3.0 * TIME_SCALE
STOP_WITHIN = 6.0 * TIME_SCALE


def sandbox_ooms(edge_id: str, sandbox_id: str) -> int:
    """Times a cgroup in the sandbox ran out of memory (v2: memory.events' ``oom`` and
    ``oom_kill``, which count the cgroups below; v1: every cgroup's own memory.oom_control
    ``oom_kill``, summed). v2 counts ``oom`` as well because that event is what chronus acts
    on: where the kernel's OOM killer finds its candidate already dying (a fork bomb's
    processes end all the time, and chronus may have killed the session first) it kills
    nothing and ``oom_kill`` stays 0, though the session did fill its memory."""
    n = 0
    for root in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup"):
        top = Path(root, "opendsec", edge_id, sandbox_id)
        if root.endswith("memory"):
            for f in top.rglob("memory.oom_control"):
                for line in f.read_text().splitlines():
                    if line.startswith("oom_kill "):
                        n += int(line.split()[1])
        else:
            try:
                for line in Path(top, "memory.events").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key in ("oom", "oom_kill"):
                        n += int(value)
            except OSError:
                pass
    return n


def sandbox_cpu_stat(edge_id: str, sandbox_id: str) -> str:
    """The sandbox cgroup's cpu.stat (throttling counts), v1 or v2, on one line."""
    for root in ("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"):
        try:
            return " ".join(Path(root, "opendsec", edge_id, sandbox_id, "cpu.stat").read_text().split())
        except OSError:
            continue
    return "unreadable"


async def answer_within(linux, sb: Sandbox, call, name: str, what: str, limit: float = 40):
    """Awaits ``call`` for at most ``limit`` s; past that, fails with what the sandbox's
    cgroups say (processes, OOMs, throttling) at the moment and once more 30 s later, so a
    rare hang on a loaded machine says whether the bomb was still running or the sandbox was
    held by its CPU quota."""
    try:
        return await asyncio.wait_for(call, limit)
    except TimeoutError:
        def state() -> str:
            return (
                f"pids {sandbox_pids(linux.edge_id, sb.id)}, ooms {sandbox_ooms(linux.edge_id, sb.id)}, "
                f"cpu.stat {sandbox_cpu_stat(linux.edge_id, sb.id)}"
            )

        first = state()
        await asyncio.sleep(30)
        raise AssertionError(
            f"{name} did not answer within {limit:.0f} s during the bomb ({what}); then: {first}; 30 s later: {state()}"
        ) from None


async def assert_answers_during_bomb(linux, args: DSecRunArgs, bomb: str, loaded, what: str, after=None) -> None:
    """Starts ``bomb`` in session "bomb", waits for ``loaded(sb)`` to say it is at its limit,
    then times a command in an existing session, a new session's first command and a file
    call, awaits ``after(sb, command id)`` if given, and times stop (issue 7 item 2)."""
    async with linux.client() as c:
        sb = await c.run_sandbox(args)
        stopped = False
        try:
            r = await sh(sb, "echo ready", session="other")
            assert (r.exit_code, r.stdout) == (0, "ready\n"), r
            r = await sh(sb, "cd /tmp && export KEPT=yes", session="bomb")
            assert r.exit_code == 0, r
            cmd_id = await sb.run_shell_background(bomb, session="bomb")
            fill_within = 30 * TIME_SCALE
            end = time.monotonic() + fill_within
            while not loaded(sb):
                assert time.monotonic() < end, f"the bomb did not reach its limit ({what}) within {fill_within:.0f} s"
                await asyncio.sleep(0.1)
            took = {}
            calls = [
                ("run_shell in another session", lambda: sb.run_shell("echo alive", session="other", timeout=20), "alive\n"),
                ("a new session's first command", lambda: sb.run_shell("echo new", session="fresh", timeout=20), "new\n"),
            ]
            for name, call, want in calls:
                t0 = time.monotonic()
                r = await answer_within(linux, sb, call(), name, what)
                took[name] = time.monotonic() - t0
                assert (r.exit_code, r.stdout) == (0, want), (name, r)
            t0 = time.monotonic()
            fi = await answer_within(linux, sb, sb.stat("/tmp"), "stat", what)
            took["stat"] = time.monotonic() - t0
            assert fi.type == "dir", fi
            if after is not None:
                await after(sb, cmd_id)
            t0 = time.monotonic()
            await sb.stop()
            stopped = True
            took["stop"] = time.monotonic() - t0
            print(f"\n{what}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in took.items()))
            for name, t in took.items():
                limit = STOP_WITHIN if name == "stop" else ANSWER_WITHIN
                assert t < limit, f"{name} took {t:.2f} s during the bomb ({what})"
            await wait_clean(linux, sb.id)
        finally:
            if not stopped:
                try:
                    await sb.stop()
                except DSecError as e:
                    print(f"stopping {sb.id}: {e}")


async def test_fork_bomb_does_not_starve_the_agents(linux):
    """A bash fork bomb fills its session's share of pids_max: a command in another session,
    a new session's first command and a file call still answer, and stop wins the race
    against the bomb (the agents live in a cgroup of their own beside the workload's, and
    each session in one of its own below that)."""
    await assert_answers_during_bomb(
        linux,
        container(cpu_cores_limit=0.5),
        ":(){ :|:& };:",
        lambda sb: sandbox_pids(linux.edge_id, sb.id) >= PIDS_MAX - 64,
        "bash fork bomb at pids_max",
    )


async def test_fork_bomb_at_the_memory_limit_leaves_other_sessions_room(linux):
    """A fork bomb that fills a small sandbox's memory (128 MB, well before its pids: it is
    OOM at about 500 processes here and 250 in the v2 guest; at 256 MB it was 970 here and 850
    there, so a run could sit at the session's pids limit and never fill memory) runs out of
    memory within its own session's memory cgroup, and chronus then kills all of it at once
    (docs/sessions.md "Out of memory"): another session's command, a new session and a file
    call answer (they took 5 to 70 s while the bomb thrashed in reclaim, and hung for good
    before the sessions had memory cgroups of their own), the bomb's session keeps its shell
    and state, and stop wins."""

    async def bomb_is_gone(sb: Sandbox, cmd_id: int) -> None:
        # The bomb's command itself ended at once (`bomb` returns after its first fork);
        # what it left running in its command's cgroup is what is killed.
        end = time.monotonic() + 5 * TIME_SCALE
        while (n := sandbox_pids(linux.edge_id, sb.id)) > 64:
            assert time.monotonic() < end, f"{n} processes and threads are left in the sandbox"
            await asyncio.sleep(0.1)
        r = await sh(sb, 'echo "$KEPT $PWD"', session="bomb")
        assert (r.exit_code, r.stdout) == (0, "yes /tmp\n"), r

    await assert_answers_during_bomb(
        linux,
        container(cpu_cores_limit=0.5, memory_limit_mb=128),
        "bomb(){ bomb|bomb & }; bomb",
        lambda sb: sandbox_ooms(linux.edge_id, sb.id) > 0,
        "fork bomb at 128 MB",
        after=bomb_is_gone,
    )


def _allocated_on_host(root) -> int:
    """Bytes allocated to the files under `root` on its own file system: what the host
    spends there, whatever else the machine writes meanwhile. Mounts below it (a sandbox's
    disk image, mounted) are not entered: their blocks are the image file's."""
    dev = os.lstat(root).st_dev
    total = 0
    for d, dirs, files in os.walk(root):
        keep = []
        for name in dirs:
            try:
                if os.lstat(os.path.join(d, name)).st_dev == dev:
                    keep.append(name)
            except OSError:
                pass
        dirs[:] = keep
        for name in files:
            try:
                st = os.lstat(os.path.join(d, name))
            except OSError:
                continue
            if st.st_dev == dev:
                total += st.st_blocks * 512
    return total


async def test_disk_limit(linux):
    async with linux.client() as c:
        sb = await c.run_sandbox(container(disk_mb=64))
        try:
            img = next(linux.state_dir.rglob(f"{sb.id}.img"))
            before = _allocated_on_host(linux.state_dir)
            r = await sh(sb, "dd if=/dev/zero of=/tmp/fill bs=1M count=200")
            assert r.exit_code != 0 and "No space left on device" in r.stderr, r
            r = await sh(sb, "sync; stat -c %s /tmp/fill")
            written = int(r.stdout)
            assert 0 < written <= 64 << 20, r
            used = _allocated_on_host(linux.state_dir) - before
            allocated = os.stat(img).st_blocks * 512
            print(f"\ndisk_mb=64: dd wrote {written >> 20} MiB; the image holds {allocated >> 20} MiB; "
                  f"the state dir grew by {used / (1 << 20):.0f} MiB")
            assert allocated <= (64 << 20) + (4 << 20), f"the 64 MiB disk image takes {allocated} bytes"
            assert used < 128 << 20, f"the state dir grew by {used >> 20} MiB"
            # The sandbox's own limit, not the cluster's: never no_capacity (retry elsewhere).
            with pytest.raises(DSecError) as ei:
                await sb.write_file("/tmp/more", b"x" * (1 << 20))
            assert ei.value.reason == opendsec.INVALID, ei.value
            assert "no space left on the sandbox's disk (disk_mb 64)" in str(ei.value), ei.value
            r = await sh(sb, "rm /tmp/fill && echo x > /tmp/after && cat /tmp/after")
            assert (r.exit_code, r.stdout) == (0, "x\n"), r
        finally:
            await sb.stop()


# ---------------------------------------------------------------------------------------------
# 5. Robustness.


async def test_large_output_is_capped_and_counted(linux):
    total = 73400320  # 70 MiB
    limit = 64 << 20  # recorded per stream
    async with linux.client() as c:
        sb = await c.run_sandbox(container())
        try:
            r = await sh(sb, f"head -c {total} /dev/zero", timeout=180)
            assert (r.done, r.exit_code, r.truncated) == (True, 0, True), r
            assert r.dropped_bytes == total - limit, r
            got = len(r.stdout_bytes)
            assert got > 0 and r.stdout_bytes == bytes(got)
            while got < limit:  # the rest of the record, in pieces
                more = await sb.get_output(r.cmd_id, stdout_offset=got)
                assert more.stdout_offset == got and more.stdout_bytes, more
                assert more.stdout_bytes == bytes(len(more.stdout_bytes))
                got += len(more.stdout_bytes)
            assert got == limit
        finally:
            await sb.stop()


async def test_large_file_round_trip(linux):
    """More than one gRPC message's worth (80 MB) in one write_file and one read_file: the
    SDK chunks both ways; pieces with offset and length still work."""
    size, chunk = 200 << 20, 32 << 20
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=1024, disk_mb=512))
        try:
            data = os.urandom(size)
            want = hashlib.sha256(data).hexdigest()
            info = await sb.write_file("/tmp/big", data)
            assert info.size == size
            r = await sh(sb, "sha256sum /tmp/big")
            assert r.stdout.split()[0] == want
            got = await sb.read_file("/tmp/big")
            assert len(got) == size and hashlib.sha256(got).hexdigest() == want
            del got
            assert await sb.read_file("/tmp/big", offset=size - 10, length=100) == data[-10:]
            assert await sb.read_file("/tmp/big", offset=chunk, length=chunk) == data[chunk : 2 * chunk]
            await sb.write_file("/tmp/big", data[:3], append=True)
            assert (await sb.stat("/tmp/big")).size == size + 3
            # A FIFO is not read (it would block the call for ever), nor a device.
            await sh(sb, "mkfifo /tmp/fifo")
            for p in ("/tmp/fifo", "/dev/zero"):
                with pytest.raises(DSecError) as ei:
                    await asyncio.wait_for(sb.read_file(p), timeout=10)
                assert ei.value.reason == opendsec.INVALID and "not a regular file" in str(ei.value), ei.value
        finally:
            await sb.stop()


async def test_file_metadata_owner_and_link_target(linux):
    """docs/python-sdk.md "File metadata": write_file(metadata=) replaces the file's
    metadata (the first piece of a large write carries it), None keeps it, {} clears it;
    stat and list_dir show it, and metadata a process in the sandbox set; refused metadata
    is `invalid` and leaves the file as it was; owners by name, a symlink's target."""
    from opendsec.sandbox import FILE_CHUNK_BYTES

    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=256))
        try:
            await sh(sb, "mkdir -p /tmp/m")
            big = os.urandom(FILE_CHUNK_BYTES + 5)
            info = await sb.write_file("/tmp/m/big", big, metadata={"Kind": "blob", "n": "1"})
            assert info.size == len(big) and info.metadata == {"Kind": "blob", "n": "1"}
            assert (await sb.stat("/tmp/m/big")).metadata == {"Kind": "blob", "n": "1"}
            await sb.write_file("/tmp/m/big", b"small")
            assert (await sb.stat("/tmp/m/big")).metadata == {"Kind": "blob", "n": "1"}
            await sb.write_file("/tmp/m/big", b"small", metadata={"n": "2"})
            assert (await sb.stat("/tmp/m/big")).metadata == {"n": "2"}
            await sh(sb, "cd /tmp/m && touch by-sandbox && python3 -c \"import os; os.setxattr('by-sandbox', 'user.e2b.who', b'me')\"")
            entries = {e.name: e for e in await sb.list_dir("/tmp/m")}
            assert entries["by-sandbox"].metadata == {"who": "me"}
            assert entries["big"].metadata == {"n": "2"}
            for bad in ({"a b": "v"}, {"k": "v" * 4097}, {f"k{i}": "" for i in range(65)}):
                with pytest.raises(DSecError) as ei:
                    await sb.write_file("/tmp/m/big", b"changed", metadata=bad)
                assert ei.value.reason == opendsec.INVALID and "metadata" in str(ei.value), ei.value
                assert await sb.read_file("/tmp/m/big") == b"small"
            with pytest.raises(DSecError) as ei:
                await sb.write_file("/tmp/m/big", b"changed", metadata={"k": 1})  # type: ignore[dict-item]
            assert ei.value.reason == opendsec.INVALID
            await sb.write_file("/tmp/m/big", b"small", metadata={})
            assert (await sb.stat("/tmp/m/big")).metadata == {}
            await sh(sb, "ln -s big /tmp/m/link")
            link = await sb.stat("/tmp/m/link")
            assert (link.type, link.symlink_target, link.metadata) == ("symlink", "big", {})
            me = (await sh(sb, "id -un; id -gn")).stdout.split()
            got = await sb.stat("/tmp/m/big")
            assert [got.owner, got.group] == me
        finally:
            await sb.stop()


async def test_http_inside_the_sandbox(linux):
    """sb.http() reaches a server listening on the sandbox's own loopback (its network
    namespace), and a closed port is `unavailable`."""
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=128))
        try:
            await sb.run_shell("mkdir -p /srv/www && echo hello-from-inside > /srv/www/index.html")
            await sb.run_shell_background("cd /srv/www && exec python3 -m http.server 8000 --bind 127.0.0.1")
            deadline = time.monotonic() + 20
            while True:
                try:
                    r = await sb.http("http://127.0.0.1:8000/index.html", timeout=5)
                    break
                except DSecError as e:
                    assert e.reason == opendsec.UNAVAILABLE and time.monotonic() < deadline, e
                    await asyncio.sleep(0.2)
            assert (r.status, r.body) == (200, b"hello-from-inside\n")
            with pytest.raises(DSecError) as ei:
                await sb.http("http://127.0.0.1:8001/", timeout=5)
            assert ei.value.reason == opendsec.UNAVAILABLE
            assert "connection refused on port 8001 in the sandbox" in str(ei.value), ei.value
            for port in (0, 65536, 70000):
                with pytest.raises(DSecError) as ei:
                    await sb.http(f"http://127.0.0.1:{port}/", timeout=5)
                assert ei.value.reason == opendsec.INVALID and "port" in str(ei.value), ei.value
            # The host's own loopback is another namespace: nothing the host listens on is
            # reachable as 127.0.0.1 from inside (the cluster's apiserver listens there).
            port = linux.env["OPENDSEC_ADDR"].rsplit(":", 1)[1]
            with pytest.raises(DSecError) as ei:
                await sb.http(f"http://127.0.0.1:{port}/", timeout=5)
            assert ei.value.reason == opendsec.UNAVAILABLE
        finally:
            await sb.stop()


async def collect_events(w, until, within: float = 10.0) -> list[tuple[str, str]]:
    """(name, type) of the events of watch ``w`` until ``until(events)`` holds."""
    got: list[tuple[str, str]] = []

    async def read() -> None:
        async for e in w:
            got.append((e.name, e.type))
            if until(got):
                return

    try:
        await asyncio.wait_for(read(), within)
    except asyncio.TimeoutError:
        pass
    return got


async def test_watch_dir_sees_changes_below_a_directory_and_refuses_what_it_cannot_watch(linux):
    """sb.watch_dir() (docs/python-sdk.md "Watching a directory"): the watch is in place when
    the block is entered; a relative path is the session's; every event type, names
    relative to the watched directory, recursion into directories made later, entries with
    include_entry, the end when the directory goes, and the errors."""
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=128))
        try:
            r = await sh(sb, "mkdir -p /tmp/wd/top && cd /tmp/wd")
            assert r.exit_code == 0, r
            async with sb.watch_dir("top", recursive=True) as w:
                r = await sh(
                    sb,
                    # In a subshell: a shell whose directory it is would keep the directory
                    # alive past its removal below (the kernel reports the removal only
                    # once nothing holds it).
                    "(cd top && echo hi > a && chmod 600 a && mkdir -p x/y && echo deep > x/y/b"
                    " && mv a c && rm c)",
                )
                assert r.exit_code == 0, r
                got = await collect_events(w, lambda ev: ("c", "remove") in ev and ("x/y/b", "write") in ev)
            for want in [("a", "create"), ("a", "write"), ("a", "chmod"), ("a", "rename"), ("c", "create"),
                         ("c", "remove"), ("x", "create"), ("x/y/b", "write")]:
                assert want in got, (want, got)

            async with sb.watch_dir("/tmp/wd/top", include_entry=True) as w:
                await sb.write_file("/tmp/wd/top/new.txt", b"12345")
                async for e in w:
                    if e.name == "new.txt" and e.type == "write":
                        assert e.entry is not None and e.entry.type == "file", e
                        assert e.entry.path == "/tmp/wd/top/new.txt", e
                        break

            # Removing the watched directory ends the iteration, after saying so.
            async with sb.watch_dir("/tmp/wd/top") as w:
                await sb.remove("/tmp/wd/top", recursive=True)
                got = await collect_events(w, lambda ev: False)
            assert got[-1] == (".", "remove"), got

            for path, reason in [("/tmp/wd/none", opendsec.NOT_FOUND), ("/etc/hostname", opendsec.INVALID)]:
                with pytest.raises(DSecError) as ei:
                    async with sb.watch_dir(path):
                        pass
                assert ei.value.reason == reason, (path, ei.value)
            for bad in [dict(path=""), dict(path="a\0b"), dict(path=5), dict(path="/tmp", recursive="yes"),
                        dict(path="/tmp", timeout=0), dict(path="/tmp", timeout=-1)]:
                with pytest.raises(DSecError) as ei:
                    sb.watch_dir(**bad)
                assert ei.value.reason == opendsec.INVALID, (bad, ei.value)

            # A caller's timeout around one read leaves the watch as it was.
            assert (await sh(sb, "mkdir -p /tmp/wd2")).exit_code == 0
            async with sb.watch_dir("/tmp/wd2") as w:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(w.__anext__(), 0.5)
                await sb.write_file("/tmp/wd2/late", b"x")
                e = await asyncio.wait_for(w.__anext__(), 10)
                assert (e.name, e.type) == ("late", "create"), e

            # Another user's session watches only what that user may list: aether watches
            # as root, and keeps to the user's rights.
            r = await sh(sb, "mkdir -p /tmp/priv/open /tmp/priv/closed && chmod 755 /tmp/priv /tmp/priv/open"
                             " && chmod 700 /tmp/priv/closed")
            assert r.exit_code == 0, r
            r = await sh(sb, "id -u", session="nobody", user="65534")
            assert (r.exit_code, r.stdout) == (0, "65534\n"), r
            with pytest.raises(DSecError) as ei:
                async with sb.watch_dir("/tmp/priv/closed", session="nobody"):
                    pass
            assert ei.value.reason == opendsec.FORBIDDEN, ei.value
            async with sb.watch_dir("/tmp/priv", recursive=True, session="nobody") as w:
                await sh(sb, "touch /tmp/priv/closed/secret /tmp/priv/open/seen")
                got = await collect_events(w, lambda ev: ("open/seen", "create") in ev)
            assert ("open/seen", "create") in got and not any("secret" in n for n, _ in got), got
        finally:
            await sb.stop()


async def test_watches_are_bounded_given_back_and_keep_up_with_a_flood(linux):
    """A sandbox has at most 64 watches; closing them gives the places back all the way to
    aether (nothing leaks through the apiserver and the edge). A flood of changes reaches a
    reader whole and in order, and the sandbox watches on after it."""
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=256))
        try:
            assert (await sh(sb, "mkdir /tmp/w")).exit_code == 0
            for round_ in range(2):
                async with contextlib.AsyncExitStack() as stack:
                    for _ in range(64):
                        await stack.enter_async_context(sb.watch_dir("/tmp/w"))
                    with pytest.raises(DSecError) as ei:
                        async with sb.watch_dir("/tmp/w"):
                            pass
                    assert ei.value.reason == opendsec.QUOTA_EXCEEDED, (round_, ei.value)
                # The places come back as the calls end in the sandbox.
                end = time.monotonic() + 10
                while True:
                    try:
                        async with sb.watch_dir("/tmp/w"):
                            break
                    except DSecError as e:
                        assert e.reason == opendsec.QUOTA_EXCEEDED and time.monotonic() < end, e
                        await asyncio.sleep(0.2)

            # A flood (30000 files made as fast as bash can) while the caller reads: every
            # event arrives, in order. (A reader that falls behind loses its watch as
            # `unavailable` rather than holding events without bound: a unit test of the
            # hub; here the calls between aether and the caller hold megabytes.)
            async with sb.watch_dir("/tmp/w") as w:
                seen: list[str] = []

                async def read() -> None:
                    async for e in w:
                        seen.append(e.name)
                        if len(seen) == 30000:
                            return

                reader = asyncio.create_task(read())
                t0 = time.monotonic()
                r = await sh(sb, "cd /tmp/w && for i in $(seq 30000); do : > f$i; done; echo done", timeout=120)
                assert (r.exit_code, r.stdout) == (0, "done\n"), r
                await asyncio.wait_for(reader, 60)
                print(f"\n30000 events in {time.monotonic() - t0:.1f} s")
                assert seen == [f"f{i}" for i in range(1, 30001)], seen[:5]
            # The sandbox goes on watching.
            async with sb.watch_dir("/tmp/w") as w:
                await sb.write_file("/tmp/w/after", b"x")
                got = await collect_events(w, lambda ev: ("after", "write") in ev)
            assert ("after", "write") in got, got
        finally:
            await sb.stop()


async def test_connect_port_reaches_a_service_on_the_sandbox_loopback(linux):
    """sb.connect_port() is a TCP connection to the sandbox's own loopback through the API:
    bytes both ways, half-close, a paused sandbox resumed, a closed port `unavailable`, a
    bad port `invalid`, and never the host's loopback."""
    echo = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', 9000)); s.listen()\n"
        "while True:\n"
        "    c, _ = s.accept()\n"
        "    data = b''\n"
        "    while True:\n"
        "        b = c.recv(65536)\n"
        "        if not b: break\n"
        "        data += b\n"
        "    c.sendall(b'got %d bytes: ' % len(data) + data[:16]); c.close()\n"
    )
    async with linux.client() as c:
        sb = await c.run_sandbox(container(memory_limit_mb=256, disk_mb=128))
        try:
            await sb.write_file("/tmp/echo.py", echo)
            await sb.run_shell_background("exec python3 /tmp/echo.py")
            deadline = time.monotonic() + 20
            while True:
                try:
                    reader, writer = await sb.connect_port(9000, timeout=10)
                    break
                except DSecError as e:
                    assert e.reason == opendsec.UNAVAILABLE and time.monotonic() < deadline, e
                    await asyncio.sleep(0.2)
            # 300 KB in frames of 64 KiB, then a half-close: the service reads to its end
            # and only then answers, over the direction still open.
            payload = bytes(range(256)) * 1200
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), timeout=20)
            assert answer == b"got 307200 bytes: " + payload[:16], answer[:64]
            writer.close()
            await writer.wait_closed()

            # A paused sandbox is resumed for the connection.
            await sb.pause()
            reader, writer = await sb.connect_port(9000, timeout=20)
            writer.write(b"after pause")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), timeout=20) == b"got 11 bytes: after pause"
            await writer.wait_closed()

            with pytest.raises(DSecError) as ei:
                await sb.connect_port(9001)
            assert ei.value.reason == opendsec.UNAVAILABLE, ei.value
            assert "nothing listens on it in the sandbox" in str(ei.value), ei.value
            for port in (0, 65536, -1):
                with pytest.raises(DSecError) as ei:
                    await sb.connect_port(port)
                assert ei.value.reason == opendsec.INVALID and "port" in str(ei.value), ei.value
            # The host's loopback is another namespace: the apiserver's port is closed here.
            port = int(linux.env["OPENDSEC_ADDR"].rsplit(":", 1)[1])
            with pytest.raises(DSecError) as ei:
                await sb.connect_port(port)
            assert ei.value.reason == opendsec.UNAVAILABLE, ei.value
        finally:
            await sb.stop()
        with pytest.raises(DSecError) as ei:
            await sb.connect_port(9000)
        assert ei.value.reason in (opendsec.CONFLICT, opendsec.NOT_FOUND), ei.value


async def test_bytes_timeouts_and_pause(linux):
    async with linux.client() as c:
        sb = await c.run_sandbox(container())
        try:
            r = await sh(sb, "printf 'h\\xc3\\xa9llo \\xe2\\x9c\\x93 \\xe6\\x97\\xa5\\xe6\\x9c\\xac\\n'")
            assert r.stdout_bytes == "héllo ✓ 日本\n".encode()
            r = await sh(sb, "printf 'héllo ✓ 日本\\n'")
            assert (r.stdout_bytes, r.stdout) == ("héllo ✓ 日本\n".encode(), "héllo ✓ 日本\n")

            r = await sh(sb, "head -c 4096 /dev/urandom | tee /tmp/b")
            assert r.exit_code == 0 and len(r.stdout_bytes) == 4096
            assert await sb.read_file("/tmp/b") == r.stdout_bytes

            t0 = time.monotonic()
            r = await sb.run_shell("trap '' TERM; sleep 100", timeout=2)
            took = time.monotonic() - t0
            assert (r.done, r.timed_out) == (True, True), r
            assert took < 10, f"a 2 s timeout of a TERM-ignoring command returned after {took:.1f} s"
            r = await sh(sb, "echo ok")
            assert (r.exit_code, r.stdout) == (0, "ok\n"), r

            await sb.write_file("/tmp/kept", "before the pause")
            await wait_state(await sb.pause(), "PAUSED")
            r = await sh(sb, "echo resumed; cat /tmp/kept")
            assert (r.exit_code, r.stdout) == (0, "resumed\nbefore the pause"), r
            await wait_state(await sb.refresh(), "RUNNING")
        finally:
            await sb.stop()


# The processes of the sandbox that are not aether (PID 1), a chronus, the session's shell
# ($$ in a command), this command's own subshell or its children (ps, awk).
LEFT_BEHIND = (
    "me=$BASHPID; ps -eo pid=,ppid=,comm= | awk -v s=$$ -v me=$me "
    "'$1 != 1 && $1 != s && $1 != me && $2 != me && $2 != 1'"
)


async def test_session_shell_semantics(linux):
    """A timeout stops the whole command (fork storms included) and keeps the session; a command
    that ends its shell keeps or reports the session's state; no job notice or internal path leaks
    into a caller's output; a session's user is fixed (docs/sessions.md)."""
    async with linux.client() as c:
        sb = await c.run_sandbox(container())
        try:
            await sh(sb, "cd /usr && export Z=kept && Y=var")
            t0 = time.monotonic()
            r = await sb.run_shell("sleep 5; touch /tmp/x; sleep 40", timeout=1)
            took = time.monotonic() - t0
            assert (r.done, r.timed_out, r.state_lost) == (True, True, True), r
            assert took < 6, f"a 1 s timeout returned after {took:.1f} s"
            await asyncio.sleep(max(0.0, 6 - took))
            r = await sh(sb, "test -e /tmp/x && echo there || echo absent")
            assert r.stdout == "absent\n", "the script went on after its timeout"

            # Each command runs in a cgroup of its own, which a timeout kills whole: fork storms
            # up to the session's pids limit and orphans that left the command's process group
            # and tree included (tests/container_backend.rs times them; the bound here is loose).
            storms = [
                "while :; do :; done",
                "trap '' TERM; bash -c 'trap \"\" TERM; sleep 100' & setsid sleep 101 & sleep 102",
                "b() { b | b & }; b; sleep 100",
                "(setsid sleep 103 </dev/null >/dev/null 2>&1 &); sleep 104",
            ]
            for cmd in storms:
                t0 = time.monotonic()
                r = await sb.run_shell(cmd, timeout=1)
                took = time.monotonic() - t0
                assert r.timed_out, (cmd, r)
                assert took < 6, f"{cmd!r}: a 1 s timeout returned after {took:.1f} s"
                # Nothing of it is left: only this session's shell and what runs this command.
                end = time.monotonic() + 5
                while True:
                    r = await sh(sb, LEFT_BEHIND)
                    if r.stdout == "" or time.monotonic() > end:
                        break
                    await asyncio.sleep(0.2)
                assert r.stdout == "", f"{cmd!r} left behind:\n{r.stdout}"
                r = await sh(sb, "pwd; echo $Z $Y")
                assert r.stdout == "/usr\nkept var\n", (cmd, r)

            r = await sh(sb, "cd /tmp; export A=1; exit 3")
            assert (r.exit_code, r.state_lost) == (3, False), r
            r = await sh(sb, "set -e; cd /; export B=2; false; echo no")
            assert (r.exit_code, r.stdout, r.state_lost) == (1, "", False), r
            r = await sh(sb, "pwd; echo $A $B")
            assert r.stdout == "/\n1 2\n", r
            r = await sh(sb, "cd /usr; exec true")
            assert (r.exit_code, r.state_lost) == (0, True), r
            r = await sh(sb, "pwd")
            assert r.stdout == "/\n", r

            await sh(sb, "sleep 100 & echo $! > /tmp/job")
            await sh(sb, "kill -9 $(cat /tmp/job)")
            await sb.run_shell_background("sleep 100", timeout=0.3)
            r = await sh(sb, "sleep 1; echo ok")
            assert (r.stdout, r.stderr) == ("ok\n", ""), r
            r = await sh(sb, "if then fi (")
            assert r.exit_code != 0 and "syntax" in r.stderr, r
            assert "/run/opendsec" not in r.stderr, r.stderr

            with pytest.raises(DSecError) as e:
                await sb.run_shell("id -u", user="nosuchuser")
            assert e.value.reason == opendsec.INVALID, e.value
            assert "default" in str(e.value) and "nosuchuser" in str(e.value), e.value
            r = await sh(sb, "id -u", user="root")
            assert r.stdout == "0\n", r
        finally:
            await sb.stop()


async def test_ttls_stop_and_clean_up(linux):
    async with linux.client() as c:
        idle, busy = await asyncio.gather(
            c.run_sandbox(container(memory_limit_mb=256, ttl_running_stop=3)),
            c.run_sandbox(container(memory_limit_mb=256, ttl_max=5)),
        )
        try:
            for sb in (idle, busy):  # both exist on the host now
                t = linux.traces(sb.id)
                assert t["cgroups"] and t["loop devices"] and t["files"], t
            await sh(busy, "echo working")
            await busy.run_shell_background("sleep 60")
            t0 = time.monotonic()

            async def keep_busy() -> None:
                while True:
                    await asyncio.sleep(0.5)
                    try:
                        await busy.run_shell("true", timeout=5)
                    except DSecError:
                        return

            keeper = asyncio.create_task(keep_busy())
            try:
                await wait_state(idle, "STOPPED", within=15)
                await wait_state(busy, "STOPPED", within=15)
            finally:
                keeper.cancel()
            print(f"\nidle sandbox stopped by ttl_running_stop=3, busy one by ttl_max=5 ({busy.info.message!r}); "
                  f"{time.monotonic() - t0:.1f} s")
            for sb in (idle, busy):
                await wait_clean(linux, sb.id)
        finally:
            await asyncio.gather(idle.stop(), busy.stop(), return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# 6. Leaks.


def leak_counts(cluster: LinuxCluster) -> dict[str, int]:
    """Counts of what sandboxes use on the host: this cluster's own, and machine-wide."""
    sd = str(cluster.state_dir)
    files = [
        p
        for p in cluster.state_dir.rglob("*")
        if p.relative_to(cluster.state_dir).parts[0] not in ("edges", "agents")  # records, agent copies
    ]
    own_pids = set(pids_in_cgroups(cluster.edge_id)) | set(descendants(cluster.proc.pid))
    loops = loop_devices()
    mounts = mountinfo()
    return {
        "own mounts": sum(1 for m in mounts if sd in m),
        "own loop devices": sum(1 for b in loops.values() if b.startswith(sd)),
        "own cgroup dirs": len(cgroup_dirs(cluster.edge_id)),
        "own processes": len(own_pids),
        "state files": len(files),
        "cluster fds": len(os.listdir(f"/proc/{cluster.proc.pid}/fd")),
        "cluster threads": len(os.listdir(f"/proc/{cluster.proc.pid}/task")),
        "mounts": len(mounts),
        "loop devices": len(loops),
        "cgroup dirs": sum(
            len(dirs) for top in glob.glob("/sys/fs/cgroup/*/opendsec") + glob.glob("/sys/fs/cgroup/opendsec")
            for _, dirs, _ in os.walk(top)
        ),
        "processes": len(sandbox_like_pids()),
    }


GLOBAL_KEYS = ("mounts", "loop devices", "cgroup dirs", "processes")


# Machine-wide, only sandbox-like processes are counted (sandbox_like_pids: in another PID
# namespace, or an opendsec binary), but other clusters of the machine may start some: this
# much growth is noise. This cluster's own processes are compared exactly. (Counting every
# process, an unrelated login shell of the machine once made a run fail.)
PROCESS_NOISE = 5


def leaks(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The counts that changed, as (before, after).

    This cluster's own counts must be equal. The machine-wide ones may only go down (other
    programs here, e.g. other clusters, end their own sandboxes meanwhile), and processes may
    grow by PROCESS_NOISE (unrelated programs coming and going). The cluster's open fds may go down too
    (idle connections between its roles close after a while). Its threads are reported only:
    tokio's blocking pool grows and shrinks on its own.
    """
    out = {}
    for k, b in before.items():
        a = after[k]
        if k == "cluster threads" or (k in GLOBAL_KEYS and not LEAK_GLOBAL):
            continue
        if k in GLOBAL_KEYS or k == "cluster fds":
            # Machine-wide counts, and the cluster's idle connections (closed after a while).
            if a <= b + (PROCESS_NOISE if k == "processes" else 0):
                continue
        elif a == b:
            continue
        out[k] = (b, a)
    return out


async def test_no_leaks_after_many_cycles(linux):
    # A small CPU share, so 8 at a time fit this 2-core host; a no_capacity answer would be
    # retried here, as a client should, and reported (test_placement_counts_a_sandbox_once
    # checks that a placement is not counted twice).
    args = container(cpu_cores_limit=0.1, memory_limit_mb=128, disk_mb=64)
    failures: list[str] = []
    no_capacity = 0

    async def cycle(c: DSecClient, i: int) -> None:
        nonlocal no_capacity
        while True:
            try:
                sb = await c.run_sandbox(args, timeout=120)
                break
            except DSecError as e:
                if e.reason == opendsec.NO_CAPACITY and no_capacity < 10 * LEAK_CYCLES:
                    no_capacity += 1
                    await asyncio.sleep(0.25)
                    continue
                failures.append(f"cycle {i} run_sandbox: {e}")
                return
        try:
            r = await sb.run_shell("true", timeout=60)
            if not r.ok:
                failures.append(f"cycle {i}: true -> {r}")
        except DSecError as e:
            failures.append(f"cycle {i} run_shell: {e}")
        finally:
            try:
                await sb.stop()
            except DSecError as e:
                failures.append(f"cycle {i} stop: {e}")

    async def run(c: DSecClient, n: int, width: int = 8) -> None:
        todo = iter(range(n))

        async def worker() -> None:
            for i in todo:
                await cycle(c, i)

        await asyncio.gather(*(worker() for _ in range(width)))

    async with linux.client() as c:
        # Warm up: the disk template, the agent copy, connections and thread pools. The
        # watcher's lease reconciliation (every 5 s) opens its connection to IAM the first
        # time it finds a sandbox: keep one alive over a whole pass.
        held = await c.run_sandbox(args)
        await run(c, 16)
        await asyncio.sleep(6)
        await held.stop()
        assert failures == [], failures[:5]
        await asyncio.sleep(1)
        before = leak_counts(linux)
        t0 = time.monotonic()
        await run(c, LEAK_CYCLES)
        took = time.monotonic() - t0
        assert failures == [], f"{len(failures)} failed cycles, e.g. {failures[:5]}"
        assert await c.list_sandboxes() == []
        # A stop returns once the sandbox is STOPPED; allow a moment for anything asynchronous,
        # and for unrelated processes on the machine to come and go.
        end = time.monotonic() + 15
        while True:
            after = leak_counts(linux)
            diff = leaks(before, after)
            if not diff or time.monotonic() > end:
                break
            await asyncio.sleep(0.5)
    print(f"\n{LEAK_CYCLES} create/run/stop cycles, 8 at a time, in {took:.1f} s ({LEAK_CYCLES / took:.1f}/s; "
          f"{no_capacity} creations retried after no_capacity)\nbefore: {before}\nafter:  {after}")
    assert diff == {}, f"counts (before, after) that changed over {LEAK_CYCLES} cycles: {diff}"


async def test_placement_counts_a_sandbox_once(linux):
    """Two sandboxes of a quarter of the edge's CPU each, running and shown in the snapshot:
    two more of a quarter each still fit."""
    async with linux.client() as c:
        edge = next(e for e in (await c.cluster_status()).edges if e.id == linux.edge_id)
        quarter = edge.capacity.cpu_cores / 4
        args = container(cpu_cores_limit=quarter, memory_limit_mb=128, disk_mb=64)
        started: list[Sandbox] = []
        try:
            t0 = time.monotonic()
            started += [await c.run_sandbox(args), await c.run_sandbox(args)]
            while True:  # the snapshot shows them (it refreshes every 0.25 s)
                edge = next(e for e in (await c.cluster_status()).edges if e.id == linux.edge_id)
                if edge.allocated.cpu_cores >= 2 * quarter - 1e-6:
                    break
                await asyncio.sleep(0.05)
            if time.monotonic() - t0 > 1.5:
                pytest.skip("the snapshot took too long to show the sandboxes to observe the double count")
            for _ in range(2):
                try:
                    started.append(await c.run_sandbox(args))
                except DSecError as e:  # no_capacity while double counted; anything else fails
                    if e.reason != opendsec.NO_CAPACITY:
                        pytest.fail(f"run_sandbox: {e}")
                    raise
        finally:
            await asyncio.gather(*(sb.stop() for sb in started), return_exceptions=True)


async def test_bad_specs_are_refused_at_admission_and_hold_nothing(linux):
    """A spec the container backend cannot start (too little memory, an ``init_user`` the image
    does not have) is ``invalid`` naming the field, at once, and changes nothing: no record, no
    quota held (a creation taking the project's whole quota succeeds right after), no start in
    the usage report, nothing on the node (docs/containers.md "Minimums")."""
    top = f"adm-{secrets.token_hex(3)}"
    async with linux.client() as c:
        proj = await c.create_project("root", top, quota={"sandboxes": 1, "memory_mb": 256})
        before = set(cgroup_dirs(linux.edge_id))
        try:
            bad = [
                ("memory_limit_mb", container(project=proj.path, memory_limit_mb=8)),
                ("memory_limit_mb", container(project=proj.path, memory_limit_mb=31)),
                ("init_user", container(project=proj.path, memory_limit_mb=128, init_user="nosuchuser")),
            ]
            # Twice each: a refusal that kept the project's only sandbox of quota would make the
            # second attempt quota_exceeded instead.
            for field, args in bad + bad:
                t0 = time.monotonic()
                with pytest.raises(DSecError) as ei:
                    await c.run_sandbox(args, timeout=60)
                took = time.monotonic() - t0
                assert ei.value.reason == opendsec.INVALID, (field, ei.value)
                assert field in str(ei.value), (field, ei.value)
                assert took < 10, f"{field}: refused after {took:.1f} s, not at admission"
            assert await c.list_sandboxes(project=proj.path, include_ended=True) == []
            assert (await c.get_project(proj.path)).usage.get("sandboxes", 0) == 0
            # Nor did any refusal count as a started sandbox in the usage report.
            report = await c.get_usage(proj.path)
            assert sum(r.sandboxes_started for r in report.rows if r.day != "total") == 0, report
            assert set(cgroup_dirs(linux.edge_id)) == before
            # The whole quota is there: one sandbox with all of the project's memory.
            sb = await c.run_sandbox(container(project=proj.path, memory_limit_mb=256), timeout=60)
            try:
                r = await sh(sb, "echo hi")
                assert r.stdout == "hi\n", r
            finally:
                await sb.stop()
        finally:
            for left in await c.list_sandboxes(project=proj.path):
                await left.stop()
            end = time.monotonic() + 10
            while True:
                try:
                    await c.delete_project(proj.path)
                    break
                except DSecError as e:
                    if e.reason != opendsec.CONFLICT or time.monotonic() > end:
                        raise
                await asyncio.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# 7. Killing the edge and the apiserver (roles as separate processes).


@pytest.fixture
def role_cluster() -> Iterator:
    """Starts a role cluster whose edge runs real containers; on the way out stops its
    sandboxes, kills its processes (by pid) and sweeps what an interrupted test left."""
    binary = require_root_and_binary()
    made: list[tuple[RoleCluster, Path, str]] = []

    def start(apiservers: int = 1, image_store: bool = False) -> RoleCluster:
        base = Path(tempfile.mkdtemp(prefix="odr-", dir="/tmp"))  # short: aether's socket is under it
        rc = RoleCluster(binary, base, apiservers=apiservers)
        if image_store:
            rc.config["image_store"] = {"root": str(store_root(base))}
        edge_id = f"e2e-r{secrets.token_hex(3)}"
        edge = rc.config["edges"][0]
        edge["id"] = edge_id
        edge["backends"]["container"] = {"runtime": "linux", "default_disk_mb": 1024, "pids_max": PIDS_MAX}
        edge["images"] = {"host": ["/"]}
        edge["persist_state"] = True
        rc.config_path.write_text(json.dumps(rc.config, indent=2))
        argv = rc.roles["edge"].argv
        argv[argv.index("-id") + 1] = edge_id
        made.append((rc, base, edge_id))
        return rc.start()

    try:
        yield start
    finally:
        for rc, base, edge_id in made:

            async def stop_everything() -> None:
                async with DSecClient(endpoint=",".join(rc.api_addrs), token=rc.admin_token, project="root",
                                      retry_timeout=5) as c:
                    await stop_all(c)

            try:
                asyncio.run(asyncio.wait_for(stop_everything(), 60))
            except Exception as e:  # keep tearing down
                print(f"stopping the sandboxes at teardown: {e!r}")
            rc.close()
            left = sweep(edge_id, base / "edge")
            if left:
                print(f"teardown swept leftovers of {edge_id}: {left}")
            shutil.rmtree(base, ignore_errors=True)


def role_client(rc: RoleCluster, endpoint: Optional[str] = None, **kw) -> DSecClient:
    kw.setdefault("retry_timeout", 30)
    return DSecClient(endpoint=endpoint or rc.endpoint, token=rc.admin_token, project="root", **kw)


async def container_edge_up(c: DSecClient, within: float = 30.0, rc: Optional[RoleCluster] = None) -> None:
    """Waits until a healthy edge offers the container backend. With `rc`, waits on each of its
    apiservers: each fetches the watcher's snapshot on its own, so one may see the edge a
    refresh later than another and place nothing until it does."""
    if rc is not None:
        for addr in rc.api_addrs:
            async with role_client(rc, endpoint=addr) as one:
                await container_edge_up(one, within)
        return
    end = time.monotonic() + within
    while True:
        try:
            snap = await c.cluster_status()
            if any(e.healthy and "container" in e.backends for e in snap.edges):
                return
        except DSecError:
            pass
        assert time.monotonic() < end, "no healthy edge with the container backend"
        await asyncio.sleep(0.1)


async def test_edge_sigkill_during_background_command(role_cluster):
    rc = role_cluster()
    try:
        async with role_client(rc) as c:
            await container_edge_up(c)
            sb = await c.run_sandbox(container())
            try:
                await sb.write_file("/tmp/before", "written before the kill")
                cmd_id = await sb.run_shell_background("sleep 3; echo done")
                rc.kill("edge")
                await asyncio.to_thread(rc.restart, "edge")  # the same port and state directory
                r = await sb.get_output(cmd_id, wait=10)
                assert (r.done, r.exit_code, r.stdout) == (True, 0, "done\n"), r
                r = await sh(sb, "cat /proc/1/comm /tmp/before")
                assert (r.exit_code, r.stdout) == (0, "opendsec\nwritten before the kill"), r
                assert (await sb.refresh()).state == "RUNNING"
            finally:
                await sb.stop()
        rc.check_alive()
    except BaseException:
        print(rc.logs())
        raise


async def test_apiserver_sigkill_during_stream(role_cluster):
    rc = role_cluster(apiservers=2)
    try:
        async with role_client(rc, endpoint=",".join(rc.api_addrs)) as c:
            await container_edge_up(c, rc=rc)
            sb = await c.run_sandbox(container())
            try:
                out = b""
                exit_result = None
                kills: list[str] = []
                restart: Optional[asyncio.Task] = None
                # The stream runs on one of the two apiservers: kill the first early, start it
                # again, then kill the second, so that one of the kills certainly breaks it.
                async for kind, data in sb.stream_shell("for i in $(seq 1 50); do echo $i; sleep 0.1; done", timeout=120):
                    if kind == "stdout":
                        out += data
                    elif kind == "exit":
                        exit_result = data
                    n = out.count(b"\n")
                    if n >= 10 and not kills:
                        rc.kill("apiserver")
                        kills.append("apiserver")
                        restart = asyncio.create_task(asyncio.to_thread(rc.restart, "apiserver"))
                    elif n >= 25 and len(kills) == 1:
                        assert restart is not None
                        await restart  # up again before the other one goes
                        rc.kill("apiserver1")
                        kills.append("apiserver1")
                assert kills == ["apiserver", "apiserver1"], f"the command ended after {out!r}"
                assert out.decode().split("\n") == [str(i) for i in range(1, 51)] + [""], out
                assert exit_result is not None and exit_result.exit_code == 0, exit_result
            finally:
                await sb.stop()
        rc.roles["apiserver1"].start()
        await asyncio.to_thread(rc.roles["apiserver1"].wait_ready)
        rc.check_alive()
    except BaseException:
        print(rc.logs())
        raise


async def test_a_sandbox_from_a_store_image_has_its_files_and_defaults(linux, tmp_path):
    """An image imported with ``opendsecctl image import`` (busybox, a deleted file, a replaced
    directory; ``ENV``, ``WORKDIR`` and ``USER`` in its config) runs as a container: the files
    as the layers say, the image's user, working directory and environment as the sessions'
    defaults, and a creation's own ``init_user`` over the image's. Creating from an image one
    may not use is ``forbidden``, from an unknown one ``not_found`` (docs/images.md)."""
    from test_images import ctl, local_registry, oci_layout, push

    busybox = next(p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.isfile(p))
    base = {"bin/busybox": Path(busybox).read_bytes()}
    base.update({f"bin/{t}": "busybox" for t in ("sh", "cat", "ls", "id", "pwd", "echo")})
    base.update(
        {
            "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/srv:/bin/sh\n",
            "etc/group": b"root:x:0:\napp:x:1000:\n",
            "etc/gone": b"deleted above\n",
            "srv/old/x": b"replaced above\n",
        }
    )
    top = {"etc/.wh.gone": b"", "srv/old/.wh..wh..opq": b"", "srv/old/new": b"new\n"}
    oci_layout(tmp_path / "busy", [base, top], env=["PATH=/bin", "GREETING=hi"], workdir="/srv", user="app")
    project = f"root/img-{secrets.token_hex(3)}"
    image = f"{project}/busy:1"
    env = dict(linux.env, OPENDSEC_IMAGE_STORE=str(linux.store))
    async with linux.client() as c:
        await c.create_project("root", project.split("/")[1])
        r = ctl(env, "image", "import", str(tmp_path / "busy"), "-as", image, "-q")
        assert r.returncode == 0, r.stderr
        args = dict(backend="container", cpu_cores_limit=1, memory_limit_mb=256, disk_mb=64)
        sb = await c.run_sandbox(DSecRunArgs(image=image, project=project, **args))
        try:
            r = await sb.run_shell("id -u; pwd; echo $GREETING; cat /etc/gone 2>/dev/null || echo gone; ls /srv/old")
            assert (r.exit_code, r.stdout) == (0, "1000\n/srv\nhi\ngone\nnew\n"), r
        finally:
            await sb.stop()
        sb = await c.run_sandbox(DSecRunArgs(image=image, project=project, init_user="root", **args))
        try:
            assert (await sb.run_shell("id -u")).stdout == "0\n"
        finally:
            await sb.stop()

        # The same image through a registry (anonymous, plain HTTP): the same files, the
        # whiteout and the opaque directory included, and the same defaults.
        with local_registry(tmp_path, auth=False, tls=False) as reg:
            push(tmp_path / "busy", f"{reg['addr']}/rl/busy:1")
            r = ctl(env, "image", "import", f"{reg['addr']}/rl/busy:1", "-as", f"{project}/from-registry:1",
                    "-plain-http", "-q")
            assert r.returncode == 0, r.stderr
        sb = await c.run_sandbox(DSecRunArgs(image=f"{project}/from-registry:1", project=project, **args))
        try:
            r = await sb.run_shell("id -u; pwd; echo $GREETING; cat /etc/gone 2>/dev/null || echo gone; ls /srv/old")
            assert (r.exit_code, r.stdout) == (0, "1000\n/srv\nhi\ngone\nnew\n"), r
        finally:
            await sb.stop()

        with pytest.raises(DSecError) as ei:
            await c.run_sandbox(DSecRunArgs(image=f"{project}/nope:1", project=project, **args))
        assert ei.value.reason == opendsec.NOT_FOUND, ei.value
        with pytest.raises(DSecError) as ei:
            await c.run_sandbox(DSecRunArgs(image=f"{project}/Busy:1", project=project, **args))
        assert ei.value.reason == opendsec.INVALID and "name" in ei.value.message, ei.value

        # A principal of a sibling project with sandbox rights there, but no layer.use on the
        # image's project.
        other = f"other-{secrets.token_hex(3)}"
        await c.create_project("root", other)
        token = await c.create_principal(f"root/{other}", "runner")
        await c.grant(f"root/{other}", "runner", ["sandbox.create"])
        async with DSecClient(endpoint=linux.env["OPENDSEC_ADDR"], token=token, project=f"root/{other}", retry_timeout=10) as p:
            with pytest.raises(DSecError) as ei:
                await p.run_sandbox(DSecRunArgs(image=image, **args))
            assert ei.value.reason == opendsec.FORBIDDEN and "layer.use" in ei.value.message, ei.value


def _busybox_image(tmp_path: Path, name: str) -> Path:
    """An OCI layout of busybox with a few files to change, delete and scrub."""
    from test_images import oci_layout

    busybox = next(p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.isfile(p))
    base: dict[str, bytes | str] = {"bin/busybox": Path(busybox).read_bytes()}
    tools = ("sh", "cat", "ls", "echo", "rm", "mkdir", "ln", "mkfifo", "readlink", "stat", "dd", "truncate", "mknod")
    base.update({f"bin/{t}": "busybox" for t in tools})
    base.update(
        {
            "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n",
            "srv/keep": b"base\n",
            "srv/gone": b"deleted by the sandbox\n",
            "srv/dir/old": b"replaced by the sandbox\n",
            "tmp/base-file": b"in the image\n",
            "root/.bash_history": b"history in the image\n",
        }
    )
    oci_layout(tmp_path / name, [base], env=["PATH=/bin", "GREETING=hi"], workdir="/srv")
    return tmp_path / name


async def test_pack_diff_and_snapshots_make_images_from_a_running_sandbox(linux, tmp_path):
    """``pack_diff`` saves a container's changes against its store image as a new image of one
    layer more (changed, deleted and replaced files, links and fifos; /tmp, caches, shell
    history and the caller's globs left out, a scrubbed file of the image deleted in the new
    one), recording its parent and keeping its defaults; the source runs on. A snapshot keeps
    everything; ``memory=True`` on a container, a node-local image, a sparse file beyond the
    disk and bad globs are ``invalid``; a taken name ``conflict``; without
    ``layer.publish`` ``forbidden`` (docs/images.md "Images from sandboxes")."""
    from test_images import ctl

    project = f"root/pack-{secrets.token_hex(3)}"
    base = f"{project}/base:1"
    env = dict(linux.env, OPENDSEC_IMAGE_STORE=str(linux.store))
    args = dict(backend="container", cpu_cores_limit=1, memory_limit_mb=256, disk_mb=64, project=project)
    async with linux.client() as c:
        await c.create_project("root", project.split("/")[1])
        r = ctl(env, "image", "import", str(_busybox_image(tmp_path, "busy")), "-as", base, "-q")
        assert r.returncode == 0, r.stderr
        parent = await c.get_image(base)
        sb = await c.run_sandbox(DSecRunArgs(image=base, **args))
        try:
            r = await sb.run_shell(
                "set -e; echo changed > /srv/keep; rm /srv/gone; rm -r /srv/dir; mkdir /srv/dir;"
                " echo new > /srv/dir/new; echo t > /tmp/t; mkdir -p /root/.cache /srv/repo/.git;"
                " echo c > /root/.cache/c; echo more >> /root/.bash_history; echo g > /srv/repo/.git/HEAD;"
                " echo code > /srv/repo/main.py; ln -s /etc/passwd /srv/link; ln /srv/keep /srv/hard;"
                " mkfifo /srv/fifo; dd if=/dev/zero of=/srv/blob bs=1024 count=2048 2>/dev/null"
            )
            assert r.exit_code == 0, r
            img = await sb.pack_diff(f"{project}/packed:1", scrub=["srv/repo/.git"])
            assert img.name == f"{project}/packed:1" and img.parent == base and not img.snapshot
            assert img.layers[:-1] == parent.layers and len(img.layers) == len(parent.layers) + 1
            assert (img.env, img.workdir) == (parent.env, "/srv")
            assert img.created_by == await c.whoami() and img.source.startswith("pack_diff of sandbox")
            assert (await c.get_image(img.name)).layers == img.layers
            layer = Path(env["OPENDSEC_IMAGE_STORE"]) / "layers" / img.layers[-1].split(":")[1] / "rootfs"
            assert (layer / "srv/keep").read_bytes() == b"changed\n"
            # The source runs on, its files untouched, and it was thawed.
            r = await sb.run_shell("cat /srv/keep /tmp/t /root/.cache/c")
            assert (r.exit_code, r.stdout) == (0, "changed\nt\nc\n"), r
            await sb.refresh()
            assert sb.state == "RUNNING"

            # A paused sandbox is packed too, and stays paused.
            await sb.pause()
            snap = await sb.create_snapshot(f"{project}/snap:1")
            assert snap.snapshot and snap.parent == base and snap.layers[:-1] == parent.layers
            await sb.refresh()
            assert sb.state == "PAUSED"
            await sb.resume()

            # The same files again make the same layer: stored once.
            again = await sb.pack_diff(f"{project}/packed:2", scrub=["srv/repo/.git"])
            assert again.layers == img.layers

            for call, reason in (
                (sb.pack_diff(f"{project}/packed:1"), opendsec.CONFLICT),
                (sb.create_snapshot(f"{project}/m:1", memory=True), opendsec.INVALID),
                (sb.pack_diff(f"{project}/x:1", scrub=["../etc"]), opendsec.INVALID),
                (sb.pack_diff(f"{project}/Bad:1"), opendsec.INVALID),
                (sb.pack_diff(f"{project}/ghost/x:1"), opendsec.NOT_FOUND),
            ):
                with pytest.raises(DSecError) as ei:
                    await call
                assert ei.value.reason == reason, ei.value
            assert (await sb.pack_diff(f"{project}/packed:1", overwrite=True)).parent == base

            # Without layer.publish: forbidden, and nothing registered.
            token = await c.create_principal(project, "operator")
            await c.grant(project, "operator", ["sandbox.operate", "layer.use"])
            async with DSecClient(endpoint=linux.env["OPENDSEC_ADDR"], token=token, project=project, retry_timeout=10) as p:
                other = await p.get_sandbox(sb.id)
                with pytest.raises(DSecError) as ei:
                    await other.pack_diff(f"{project}/mine:1")
                assert ei.value.reason == opendsec.FORBIDDEN and "layer.publish" in ei.value.message, ei.value
            with pytest.raises(DSecError) as ei:
                await c.get_image(f"{project}/mine:1")
            assert ei.value.reason == opendsec.NOT_FOUND

            # The CLI: pack with -scrub lists, snapshot -memory refused.
            r = ctl(env, "image", "pack", sb.id, f"{project}/cli:1", "-scrub", "srv/repo/.git,srv/fifo", "-scrub", "srv/blob")
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["parent"] == base and out["layers"][:-1] == parent.layers
            r = ctl(env, "image", "snapshot", sb.id, f"{project}/cli-snap:1", "-memory")
            assert r.returncode == 1 and r.stderr.startswith("error: invalid:") and "memory" in r.stderr, r.stderr
            r = ctl(env, "image", "snapshot", sb.id, f"{project}/cli-snap:1")
            assert r.returncode == 0 and json.loads(r.stdout)["snapshot"] is True, r.stderr

            # The sandbox's root cannot make a device node for a pack to copy (no CAP_MKNOD;
            # a pack would refuse one, naming it).
            r = await sb.run_shell("mknod /srv/null c 1 3")
            assert r.exit_code == 1 and "not permitted" in r.stderr, r

            # What a pack must never take: a sparse file beyond the disk (64 MB).
            r = await sb.run_shell("truncate -s 1G /srv/sparse")
            assert r.exit_code == 0, r
            with pytest.raises(DSecError) as ei:
                await sb.pack_diff(f"{project}/sparse:1")
            assert ei.value.reason == opendsec.INVALID and "srv/sparse" in ei.value.message, ei.value
            await sb.run_shell("rm /srv/sparse")
        finally:
            await sb.stop()

        # Sandboxes of the new images: the changes, without the residue.
        check = (
            "cat /srv/keep; cat /srv/gone 2>/dev/null || echo no-gone; ls /srv/dir; ls -A /tmp;"
            " ls /root/.cache 2>/dev/null || echo no-cache; cat /root/.bash_history 2>/dev/null || echo no-history;"
            " ls -A /srv/repo; readlink /srv/link; [ /srv/hard -ef /srv/keep ] && echo linked; [ -p /srv/fifo ] && echo fifo;"
            " stat -c %s /srv/blob; echo $GREETING; pwd"
        )
        sb2 = await c.run_sandbox(DSecRunArgs(image=f"{project}/packed:2", **args))
        try:
            r = await sb2.run_shell(check)
            assert r.exit_code == 0, r
            assert r.stdout == (
                "changed\nno-gone\nnew\nbase-file\nno-cache\nno-history\nmain.py\n/etc/passwd\nlinked\nfifo\n2097152\nhi\n/srv\n"
            ), r
        finally:
            await sb2.stop()
        sb3 = await c.run_sandbox(DSecRunArgs(image=f"{project}/snap:1", **args))
        try:
            r = await sb3.run_shell("cat /tmp/t /root/.cache/c /srv/repo/.git/HEAD; tail -n1 /root/.bash_history")
            assert (r.exit_code, r.stdout) == (0, "t\nc\ng\nmore\n"), r
        finally:
            await sb3.stop()

        # A sandbox of a node-local image has no store layers to stack a new one on.
        host = await c.run_sandbox(container(project=project))
        try:
            with pytest.raises(DSecError) as ei:
                await host.pack_diff(f"{project}/from-host:1")
            assert ei.value.reason == opendsec.INVALID and "node-local" in ei.value.message, ei.value
        finally:
            await host.stop()


async def test_fork_copies_a_container_with_its_files_into_independent_sandboxes(linux, tmp_path):
    """``fork(count=N)`` makes N running copies of a container with the source's files (as the
    moment of the fork, nothing scrubbed) and its image's defaults; copies are independent of
    each other and of the source, which runs on with its id; labels are added, ``task_id``
    replaces the task; each copy is charged to quota (a fork past it fails per copy with
    ``quota_exceeded``); a retry with the same key makes nothing new; copies fork again; a
    node-local image is ``invalid``, a stopped source ``conflict``, count outside 1..256
    ``invalid``, no ``sandbox.operate`` ``forbidden``; the snapshot is registered as no image
    and ``image gc`` reclaims it once the copies are gone (docs/images.md "Fork")."""
    from test_images import ctl

    project = f"root/fork-{secrets.token_hex(3)}"
    base = f"{project}/base:1"
    store = linux.store
    env = dict(linux.env, OPENDSEC_IMAGE_STORE=str(store))
    args = dict(backend="container", cpu_cores_limit=0.25, memory_limit_mb=128, disk_mb=64, project=project)
    async with linux.client() as c:
        await c.create_project("root", project.split("/")[1], quota={"sandboxes": 6})
        r = ctl(env, "image", "import", str(_busybox_image(tmp_path, "busy")), "-as", base, "-q")
        assert r.returncode == 0, r.stderr
        sb = await c.run_sandbox(DSecRunArgs(image=base, labels={"run": "r1"}, task_id="t0", **args))
        made: list[opendsec.Sandbox] = [sb]
        try:
            r = await sb.run_shell("echo state > /srv/state; echo t > /tmp/t; rm /srv/gone")
            assert r.exit_code == 0, r
            forks = await sb.fork(count=3, labels={"branch": "b"}, task_id="t1", ttl_max=600, idempotency_key="k1")
            assert all(isinstance(f, opendsec.Sandbox) for f in forks), forks
            copies = [f for f in forks if isinstance(f, opendsec.Sandbox)]
            made += copies
            assert len({f.id for f in copies} | {sb.id}) == 4
            for f in copies:
                assert f.state == "RUNNING" and f.info.project == project
                assert f.info.spec.image == base and f.info.spec.task_id == "t1"
                assert dict(f.info.spec.labels) == {"run": "r1", "branch": "b"}
                assert f.info.spec.ttl_max == 600
                r = await f.run_shell("cat /srv/state /tmp/t /srv/keep; cat /srv/gone 2>/dev/null || echo gone; echo $GREETING; pwd")
                assert (r.exit_code, r.stdout) == (0, "state\nt\nbase\ngone\nhi\n/srv\n"), r
            # The copies stack the source's layers and one more, its snapshot, which the in-use
            # records keep from `image gc` while they run.
            inuse = (store / "inuse" / copies[0].edge_id / copies[0].id).read_text().split()
            assert inuse[:-1] == (await c.get_image(base)).layers, inuse
            fork_layer = inuse[-1].split(":")[1]
            r = ctl(env, "image", "gc", "-store", str(store), "-grace", "0s")
            assert r.returncode == 0 and (store / "layers" / fork_layer).is_dir(), r.stderr
            # The source runs on, with its id and task; it and the copies change apart.
            await sb.refresh()
            assert sb.state == "RUNNING" and sb.info.spec.task_id == "t0"
            await copies[0].run_shell("echo mine > /srv/state")
            await sb.run_shell("echo later > /srv/later")
            for f, want in ((copies[1], "state\n"), (sb, "state\n")):
                r = await f.run_shell("cat /srv/state")
                assert r.stdout == want, (f, r)
            r = await copies[2].run_shell("cat /srv/later 2>/dev/null || echo none")
            assert r.stdout == "none\n", r

            # The same key again: the same copies, nothing new created.
            again = await sb.fork(count=3, labels={"branch": "b"}, task_id="t1", ttl_max=600, idempotency_key="k1")
            assert [f.id for f in again if isinstance(f, opendsec.Sandbox)] == [f.id for f in copies]

            # A copy forks again: its own change comes along. Quota 6: 4 used, 1 room left
            # after this one, so of the next fork's 2 copies one is made, one refused.
            grand = await copies[0].fork()
            assert isinstance(grand[0], opendsec.Sandbox), grand
            made.append(grand[0])
            r = await grand[0].run_shell("cat /srv/state")
            assert r.stdout == "mine\n", r
            mixed = await sb.fork(count=2)
            made += [f for f in mixed if isinstance(f, opendsec.Sandbox)]
            assert sorted(type(f).__name__ for f in mixed) == ["DSecError", "Sandbox"], mixed
            refused = next(f for f in mixed if isinstance(f, DSecError))
            assert refused.reason == opendsec.QUOTA_EXCEEDED, refused

            # The snapshot is no image.
            assert [i.name for i in await c.list_images(project)] == [base]

            # The CLI: one line per copy and the summary (quota full: the copy fails, exit 1).
            r = ctl(env, "sandbox", "fork", sb.id, "-count", "1", "-label", "via=cli")
            assert r.returncode == 1 and r.stdout.startswith("0\terror\tquota_exceeded"), (r.stdout, r.stderr)
            await made.pop().stop()
            r = ctl(env, "sandbox", "fork", sb.id, "-count", "1", "-label", "via=cli")
            assert r.returncode == 0, (r.stdout, r.stderr)
            first = r.stdout.splitlines()[0].split("\t")
            assert first[0] == "0" and first[1].startswith(sb.id.split(".")[0] + "."), r.stdout
            cli_copy = await c.get_sandbox(first[1])
            made.append(cli_copy)
            assert cli_copy.info.spec.labels["via"] == "cli"
            for bad in (["-count", "0"], ["-count", "257"], ["-label", "novalue"]):
                r = ctl(env, "sandbox", "fork", sb.id, *bad)
                assert r.returncode == 2 and "error" in r.stderr, (bad, r.stderr)

            for call, reason in (
                (sb.fork(count=0), opendsec.INVALID),
                (sb.fork(count=257), opendsec.INVALID),
                (sb.fork(labels={"n": 1}), opendsec.INVALID),  # type: ignore[dict-item]
                (sb.fork(ttl_max="60"), opendsec.INVALID),  # type: ignore[arg-type]
                (sb.fork(ttl_max=-1), opendsec.INVALID),
            ):
                with pytest.raises(DSecError) as ei:
                    await call
                assert ei.value.reason == reason, ei.value

            # Without sandbox.operate on the source: forbidden, nothing made.
            token = await c.create_principal(project, "maker")
            await c.grant(project, "maker", ["sandbox.create", "layer.use"])
            async with DSecClient(endpoint=linux.env["OPENDSEC_ADDR"], token=token, project=project, retry_timeout=10) as p:
                with pytest.raises(DSecError) as ei:
                    await opendsec.Sandbox(p, sb.info).fork()
                assert ei.value.reason == opendsec.FORBIDDEN and "sandbox.operate" in ei.value.message, ei.value
        finally:
            for f in made:
                await f.stop()

        # A stopped source: conflict.
        with pytest.raises(DSecError) as ei:
            await sb.fork()
        assert ei.value.reason == opendsec.CONFLICT and "STOPPED" in ei.value.message, ei.value

        # A sandbox of a node-local image: invalid.
        host = await c.run_sandbox(container(project=project))
        try:
            with pytest.raises(DSecError) as ei:
                await host.fork()
            assert ei.value.reason == opendsec.INVALID and "node-local" in ei.value.message, ei.value
        finally:
            await host.stop()

        # With every copy gone, the snapshot's layer is garbage.
        layers_before = set(os.listdir(store / "layers"))
        r = ctl(env, "image", "gc", "-store", str(store), "-grace", "0s")
        assert r.returncode == 0, r.stderr
        kept = set(os.listdir(store / "layers"))
        base_layers = {d.split(":")[1] for d in (await c.get_image(base)).layers}
        assert base_layers <= kept and fork_layer in layers_before and fork_layer not in kept, (layers_before, kept)


async def test_edge_and_importer_sigkill_mid_write_leave_nothing_half_written(role_cluster, tmp_path):
    """Restart drill (docs/images.md "Images from sandboxes"): an importer killed while it
    writes a layer, and an edge killed while it packs a sandbox's files, leave only what
    ``image gc`` removes in ``tmp/`` and never a half-written layer or manifest; the sandbox,
    which the pack held frozen, runs again after the edge's restart, and packs then.

    OPENDSEC_TEST_DRILL_MB sizes the written files (256 MB by default): the NFS guest, which runs
    under emulation, sets it lower, as the drill is about what is left, not about size."""
    from test_images import ctl, oci_layout

    mb = int(os.environ.get("OPENDSEC_TEST_DRILL_MB", "256"))

    rc = role_cluster(image_store=True)
    store = store_root(rc.dir)
    env = {"OPENDSEC_ADDR": rc.endpoint, "OPENDSEC_TOKEN": rc.admin_token, "OPENDSEC_IMAGE_STORE": str(store)}
    binary = Path(os.environ.get("OPENDSEC_BIN") or DEFAULT_BIN)

    def half_written() -> list[str]:
        bad = [f"layers/{d.name}" for d in (store / "layers").iterdir() if not (d / "meta.json").is_file()]
        bad += [str(m.relative_to(store)) for m in (store / "images").rglob("*") if m.is_file() and not m.name.endswith(".json")]
        return bad

    async def until_staging(within: float = 30.0) -> None:
        end = time.monotonic() + within
        while not any((store / "tmp").iterdir()):
            assert time.monotonic() < end, "no layer was being written"
            await asyncio.sleep(0.01)

    try:
        async with role_client(rc) as c:
            await container_edge_up(c)
            project = f"root/drill-{secrets.token_hex(3)}"
            await c.create_project("root", project.split("/")[1])
            image = f"{project}/busy:1"
            r = ctl(env, "image", "import", str(_busybox_image(tmp_path, "busy")), "-as", image, "-q")
            assert r.returncode == 0, r.stderr

            # The importer, killed mid-layer (a layer of random data).
            big = tmp_path / "big"
            big.mkdir()
            oci_layout(big / "layout", [{"srv/big": os.urandom(mb << 20)}], env=[])
            imp = subprocess.Popen(
                [str(binary), "ctl", "image", "import", str(big / "layout"), "-as", f"{project}/big:1", "-q"],
                env=dict(os.environ, **env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            try:
                await until_staging()
            finally:
                imp.kill()
                imp.wait(timeout=15)

            # The edge, killed mid-pack of a sandbox that wrote as much.
            # Memory well above the file: on cgroup v2 its dirty pages count against the limit,
            # and under emulation (the NFS guest) writeback is slow enough to OOM dd.
            args = dict(backend="container", cpu_cores_limit=1, memory_limit_mb=768, disk_mb=512, project=project)
            sb = await c.run_sandbox(DSecRunArgs(image=image, **args))
            try:
                r = await sb.run_shell(f"dd if=/dev/urandom of=/srv/data bs=1M count={mb} 2>/dev/null && echo ok", timeout=120)
                assert r.stdout == "ok\n", r
                pack = asyncio.ensure_future(sb.pack_diff(f"{project}/packed:1"))
                await until_staging()
                rc.kill("edge")
                with pytest.raises(DSecError) as ei:
                    await pack
                assert ei.value.reason in (opendsec.UNAVAILABLE, opendsec.INTERNAL), ei.value
                await asyncio.to_thread(rc.restart, "edge")
                await container_edge_up(c)
                # Thawed at adoption: it runs, and is RUNNING, not PAUSED.
                r = await sh(sb, "stat -c %s /srv/data")
                assert (r.exit_code, r.stdout) == (0, f"{mb << 20}\n"), r
                assert (await sb.refresh()).state == "RUNNING"

                assert any((store / "tmp").iterdir()), "the interrupted writes are left for gc"
                assert half_written() == []
                with pytest.raises(DSecError) as ei:
                    await c.get_image(f"{project}/packed:1")
                assert ei.value.reason == opendsec.NOT_FOUND
                with pytest.raises(DSecError) as ei:
                    await c.get_image(f"{project}/big:1")
                assert ei.value.reason == opendsec.NOT_FOUND
                r = ctl(env, "image", "gc", "-grace", "0s")
                assert r.returncode == 0 and "removed tmp/" in r.stdout, r.stdout + r.stderr
                assert list((store / "tmp").iterdir()) == [] and half_written() == []

                img = await sb.pack_diff(f"{project}/packed:1")
                assert len(img.layers) == 2
            finally:
                await sb.stop()
        rc.check_alive()
    except BaseException:
        print(rc.logs())
        raise
