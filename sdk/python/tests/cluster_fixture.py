"""The session's simulated cluster (`opendsec cluster up -sim-edges 2`), shared by the cluster
test modules through conftest.py.

The fixture starts the binary (``<repo>/target/x86_64-unknown-linux-gnu/release/opendsec`` or
``$OPENDSEC_BIN``) with a temporary state directory, reads the ``export OPENDSEC_...=`` lines it
prints, and stops it (SIGTERM, then SIGKILL) at the end. Without the binary the tests are
skipped, except under ``CI=true``, where they fail: CI never skips them silently.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[3]
DEFAULT_BIN = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "opendsec"
START_TIMEOUT_S = float(os.environ.get("OPENDSEC_CLUSTER_START_TIMEOUT", "90"))
WANTED = ("OPENDSEC_ADDR", "OPENDSEC_TOKEN", "OPENDSEC_PROJECT", "OPENDSEC_IMAGE_STORE")


def _parse_export(line: str) -> tuple[str, str] | None:
    """``export NAME=value`` (value possibly shell-quoted) -> (NAME, value)."""
    line = line.strip()
    if not line.startswith("export "):
        return None
    name, sep, value = line[len("export "):].partition("=")
    if not sep:
        return None
    try:
        parts = shlex.split(value)
    except ValueError:
        parts = [value]
    return name.strip(), (parts[0] if parts else "")


@contextlib.contextmanager
def running_cluster(extra: list[str], wanted: tuple[str, ...] = WANTED) -> Iterator[dict[str, str]]:
    """Runs ``opendsec cluster up -addr 127.0.0.1:0 -state-dir <tmp> <extra...>`` until the
    block ends, yielding the values of the ``export`` lines named in ``wanted``. Fails the test
    when the cluster does not print them in time; skips it without the binary (except under
    ``CI=true``)."""
    binary = Path(os.environ.get("OPENDSEC_BIN") or DEFAULT_BIN)
    if not binary.is_file():
        msg = f"opendsec binary not found at {binary} (build it with cargo build --release, or set OPENDSEC_BIN)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; under CI=true the cluster tests must run", pytrace=False)
        pytest.skip(msg)

    log = tempfile.NamedTemporaryFile(prefix="opendsec-cluster-", suffix=".log", delete=False)
    state = tempfile.TemporaryDirectory(prefix="opendsec-cluster-state-")
    args = [str(binary), "cluster", "up", "-addr", "127.0.0.1:0", "-state-dir", state.name, *extra]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    stdout_lines: list[str] = []

    def pump() -> None:  # keeps reading so the pipe never fills up
        assert proc.stdout is not None
        for line in proc.stdout:
            stdout_lines.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def diagnostics() -> str:
        log.flush()
        err = Path(log.name).read_text(errors="replace")[-4000:]
        return f"stdout:\n{''.join(stdout_lines)[-2000:]}\nstderr ({log.name}):\n{err}"

    env: dict[str, str] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not all(k in env for k in wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"cluster up printed no {wanted} within {START_TIMEOUT_S:.0f} s")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"cluster up exited with {proc.wait()} before printing {wanted}")
            kv = _parse_export(line)
            if kv and kv[0] in wanted:
                env[kv[0]] = kv[1]
    except BaseException as e:
        failure = f"{e}\n"
        stop()
    else:
        failure = ""
    if failure:
        pytest.fail(failure + diagnostics(), pytrace=False)
    try:
        yield env
    finally:
        stop()
        state.cleanup()


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, str]]:
    """A running cluster: the values of OPENDSEC_ADDR, OPENDSEC_TOKEN, OPENDSEC_PROJECT and
    OPENDSEC_IMAGE_STORE (in the cluster's own temporary state directory, or on the NFS mount
    OPENDSEC_TEST_NFS_STORE names)."""
    extra = ["-sim-edges", "2"]
    nfs = os.environ.get("OPENDSEC_TEST_NFS_STORE")
    if nfs:  # scripts/test-nfs.sh: the store on an NFS 4.2 mount
        extra += ["-image-store", tempfile.mkdtemp(prefix="opendsec-store-", dir=nfs)]
    with running_cluster(extra) as env:
        yield env


def ctl(
    cluster: dict[str, str],
    *args: str,
    token: str | None = None,
    extra_env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    binary = Path(os.environ.get("OPENDSEC_BIN") or DEFAULT_BIN)
    env = dict(os.environ)
    # No saved logins of the machine's own: each test names its credentials files.
    env.pop("DOCKER_CONFIG", None)
    env.pop("REGISTRY_AUTH_FILE", None)
    env["HOME"] = "/nonexistent"
    env.update(
        OPENDSEC_ADDR=cluster["OPENDSEC_ADDR"],
        OPENDSEC_TOKEN=token or cluster["OPENDSEC_TOKEN"],
        OPENDSEC_PROJECT="root",
        OPENDSEC_IMAGE_STORE=cluster["OPENDSEC_IMAGE_STORE"],
    )
    env.update(extra_env or {})
    return subprocess.run(
        [str(binary), "ctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )
