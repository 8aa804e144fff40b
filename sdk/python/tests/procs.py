"""Running OpenDsec's roles as separate processes from one config file (test helper).

:class:`RoleCluster` writes a cluster config with fixed loopback ports (picked by binding
port 0 first), starts ``opendsec iam|watcher|apiserver|edge -config F`` each as its own
process, waits for its ``/readyz``, and can SIGKILL and restart any of them on the same
ports. :meth:`RoleCluster.close` kills every process it started, by pid; the fixture in
``test_roles.py`` calls it also when a test fails.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
DEFAULT_BIN = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "opendsec"
READY_TIMEOUT_S = float(os.environ.get("OPENDSEC_ROLE_READY_TIMEOUT", "60"))


def binary_or_skip() -> Path:
    """The opendsec binary; skips the test without it, except under ``CI=true`` (fails)."""
    binary = Path(os.environ.get("OPENDSEC_BIN") or DEFAULT_BIN)
    if not binary.is_file():
        msg = f"opendsec binary not found at {binary} (build it with cargo build --release, or set OPENDSEC_BIN)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; under CI=true the role tests must run", pytrace=False)
        pytest.skip(msg)
    return binary


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Role:
    """One role process: its command line, log file and metrics port."""

    def __init__(self, name: str, argv: list[str], metrics_port: int, log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is already running"
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"--- start #{self.starts} at {time.strftime('%H:%M:%S')}\n".encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(
                self.argv + ["-metrics", f"127.0.0.1:{self.metrics_port}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout
        while not self.ready():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}\n{self.tail()}")
            if time.monotonic() > end:
                raise AssertionError(f"{self.name} not ready within {timeout:.0f} s\n{self.tail()}")
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to the process (by pid) and waits for it to end."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=15)

    def tail(self, n: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} log ({self.log_path}):\n{text[-n:]}"


class RoleCluster:
    """A cluster of separately running role processes over one config file."""

    def __init__(
        self, binary: Path, workdir: Path, apiservers: int = 1, admission: Optional[dict[str, Any]] = None,
        sim: Optional[dict[str, Any]] = None, iam_replicas: int = 0, watchers: int = 1, tls: bool = False,
    ) -> None:
        """``iam_replicas`` > 0 runs IAM as that many Raft replicas (roles ``iam0``, ``iam1``,
        ...) instead of one ``iam``; ``watchers`` > 1 runs that many ``watcher.replicas``
        (roles ``watcher0``, ...) with a 3 s reconciliation lock. ``tls`` gives every role a
        certificate from ``opendsec ctl pki init`` in ``<workdir>/pki`` (:attr:`pki`), mutual
        TLS between them and TLS on the public port, instead of a service token."""
        self.binary = binary
        self.dir = workdir
        # Listen addresses (IAM's two per replica), then one metrics port (/readyz) for each
        # process.
        n_iam, n_watch = max(iam_replicas, 1), max(watchers, 1)
        ports = iter(free_ports(3 * n_iam + 2 * n_watch + 2 * (1 + apiservers)))
        self.admin_token = f"dsk.admin.{secrets.token_hex(20)}"
        if iam_replicas:
            iam: dict[str, Any] = {
                "admin_token": self.admin_token,
                "replicas": [
                    {"id": str(i), "addr": f"127.0.0.1:{next(ports)}", "raft_addr": f"127.0.0.1:{next(ports)}",
                     "data_dir": str(workdir / f"iam-{i}")}
                    for i in range(iam_replicas)
                ],
            }
        else:
            iam = {"addr": f"127.0.0.1:{next(ports)}", "admin_token": self.admin_token, "state": str(workdir / "iam.state")}
        if watchers > 1:
            watcher: dict[str, Any] = {
                "replicas": [{"id": f"w{i}", "addr": f"127.0.0.1:{next(ports)}"} for i in range(watchers)],
                "probe_interval": 0.25, "lock_ttl": 3,
            }
        else:
            watcher = {"addr": f"127.0.0.1:{next(ports)}", "probe_interval": 0.25}
        edge_addr = f"127.0.0.1:{next(ports)}"
        self.api_addrs = [f"127.0.0.1:{next(ports)}" for _ in range(apiservers)]
        self.pki = workdir / "pki"
        self.config: dict[str, Any] = {
            **({"tls": {"dir": str(self.pki)}} if tls else {"service_token": secrets.token_hex(20)}),
            "iam": iam,
            "watcher": watcher,
            "apiserver": [{"addr": a, "snapshot_refresh": 0.25} for a in self.api_addrs],
            "admission": dict(admission or {}),
            "edges": [
                {
                    "id": "e1",
                    "addr": edge_addr,
                    "backends": {"sim": {"runtime": "sim", **(sim or {})}},
                    "persist_state": True,
                    "state_dir": str(workdir / "edge"),
                    "capacity": {"cpu_cores": 4096, "memory_mb": 67108864},
                    "mem_reserve_mb": -1,
                    "disk_reserve_mb": -1,
                }
            ],
        }
        self.config_path = workdir / "opendsec.json"
        self.config_path.write_text(json.dumps(self.config, indent=2))
        if tls:
            self.ctl("pki", "init", "-config", str(self.config_path), "-out", str(self.pki))
        cfg = ["-config", str(self.config_path), "-log", "warn"]
        b = str(binary)
        self.roles: dict[str, Role] = {}
        if iam_replicas:
            for i in range(iam_replicas):
                argv = [b, "iam", *cfg, "-replica", str(i)]
                self.roles[f"iam{i}"] = Role(f"iam{i}", argv, next(ports), workdir / f"iam{i}.log")
        else:
            self.roles["iam"] = Role("iam", [b, "iam", *cfg], next(ports), workdir / "iam.log")
        if watchers > 1:
            for i in range(watchers):
                argv = [b, "watcher", *cfg, "-replica", f"w{i}"]
                self.roles[f"watcher{i}"] = Role(f"watcher{i}", argv, next(ports), workdir / f"watcher{i}.log")
        else:
            self.roles["watcher"] = Role("watcher", [b, "watcher", *cfg], next(ports), workdir / "watcher.log")
        self.roles["edge"] = Role("edge", [b, "edge", *cfg, "-id", "e1"], next(ports), workdir / "edge.log")
        for i in range(apiservers):
            name = "apiserver" if i == 0 else f"apiserver{i}"
            self.roles[name] = Role(name, [b, "apiserver", *cfg, "-index", str(i)], next(ports), workdir / f"{name}.log")

    @property
    def endpoint(self) -> str:
        return self.api_addrs[0]

    def start(self) -> "RoleCluster":
        """Starts every role (IAM, watcher, edge, then the apiservers) and waits until each is ready."""
        order = [n for n in self.roles if n.startswith(("iam", "watcher"))] + ["edge"]
        order += [n for n in self.roles if n.startswith("apiserver")]
        for name in order:
            self.roles[name].start()
        for name in order:
            self.roles[name].wait_ready()
        return self

    def ctl(self, *args: str) -> str:
        """Runs ``opendsec ctl ARGS``, which must succeed; its output."""
        p = subprocess.run([str(self.binary), "ctl", *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"ctl {' '.join(args)}: {p.stdout}{p.stderr}"
        return p.stdout + p.stderr

    def metric(self, name: str, line: str) -> bool:
        """Whether role ``name`` is running and its /metrics has exactly ``line``."""
        role = self.roles[name]
        if role.proc is None or role.proc.poll() is not None:
            return False
        try:
            port = role.metrics_port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                return line in r.read().decode(errors="replace").splitlines()
        except (urllib.error.URLError, OSError):
            return False

    def iam_leader(self, timeout: float = 30.0) -> str:
        """The IAM replica role whose /metrics says it leads."""
        end = time.monotonic() + timeout
        while True:
            for name in self.roles:
                if name.startswith("iam") and self.metric(name, "opendsec_iam_leader 1"):
                    return name
            if time.monotonic() > end:
                raise AssertionError(f"no IAM leader within {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        self.roles[name].kill(signal.SIGKILL)

    def restart(self, name: str, wait: bool = True) -> None:
        """SIGKILLs a role and starts it again on the same ports (and state files)."""
        role = self.roles[name]
        role.kill(signal.SIGKILL)
        role.start()
        if wait:
            role.wait_ready()

    def close(self) -> None:
        """Kills every process this cluster started (by pid), also after a failure."""
        for role in self.roles.values():
            try:
                role.kill(signal.SIGKILL)
            except Exception:  # keep killing the others
                pass

    def check_alive(self) -> None:
        """Raises if a role process has died on its own."""
        for role in self.roles.values():
            if role.proc is not None and role.proc.poll() is not None:
                raise AssertionError(f"{role.name} exited with {role.proc.returncode}\n{role.tail()}")

    def logs(self) -> str:
        return "\n".join(r.tail() for r in self.roles.values())
