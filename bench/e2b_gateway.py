"""The E2B gateway's cost: E2B's own SDK through the gateway against our SDK straight to the
apiserver, in one run on one cluster (docs/e2b.md, docs/benchmarks.md "E2B gateway").

    sudo .venv-e2b/<release>/bin/python bench/e2b_gateway.py [-n 40] [-exec-n 300] [-snap-n 20]
        [-ci-n 10] [-ci-exec-n 100] [-json]

Needs root (real containers), E2B's SDK and ours in one environment (`pip install e2b
./sdk/python`), and starts its own `opendsec cluster up -runtime linux -network off` (the
development image `host` as template `base`). What it measures, the two SDKs interleaved
block by block so that the machine's noise falls on both alike:
  1. create → first command output, N times: E2B's `Sandbox.create()` + `commands.run("true")`
     against our `run_sandbox` + `run_shell("true")` (each sandbox stopped untimed);
  2. a warm command round trip, EXEC_N times: E2B's `commands.run("true")` against our
     `run_shell("true")`, each on one sandbox made beforehand. E2B's SDK runs every command
     as `/bin/bash -l -c CMD`, a login shell reading the image's profile, while run_shell
     uses a session's shell that is already running: the two differ by the profile.
  3. so the gateway's own cost is measured apart: the same process start, `/bin/true`
     without a shell, as envd's `process.Process/Start` through the gateway (HTTP/1.1 with
     keep-alive, as the Python SDK sends it) against the apiserver's `StartProcess` over
     gRPC, on one sandbox; and `/bin/bash -l -c true` that way, to show the profile's cost.
  4. snapshots and forks of a sandbox of a small store image with bash (built and imported
     here), SNAP_N times each: E2B's `create_snapshot()` against our `create_snapshot`,
     E2B's `fork(count=2)` against our `fork(count=2)` (the copies stopped untimed), and
     creation from the snapshot to a first command's output, E2B's against ours.
  5. the code interpreter (template `code-interpreter-v1`, image target/code-interpreter-image
     imported here as root/code-interpreter:v1), when `e2b_code_interpreter` is importable
     and the layout exists (else the output says why not): `Sandbox.create()` of
     `e2b_code_interpreter` (which waits for the Jupyter server) → `run_code("6*7")` giving
     "42", CI_N times (killed untimed), and a warm `run_code("6*7")`, CI_EXEC_N times. Our
     SDK has no run_code; its peer on the same image is a new process,
     `run_shell("python3 -c 'print(6*7)'")`, after `run_sandbox` and warm.
Prints medians and p99 in ms, and what the gateway adds.
(Not named e2b.py: a script of that name would be what `import e2b` finds.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("OPENDSEC_BIN", os.path.join(ROOT, "target/x86_64-unknown-linux-gnu/release/opendsec"))
BLOCK = 10


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def summary(v: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(v), 3), "p99": round(pct(v, 0.99), 3), "n": len(v)}


def start_cluster(state: str) -> tuple[subprocess.Popen, dict[str, str]]:
    args = [BIN, "cluster", "up", "-runtime", "linux", "-network", "off", "-sim-edges", "1",
            "-addr", "127.0.0.1:0", "-state-dir", state, "-disk-reserve-mb", "-1", "-log", "warn"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    env: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while "E2B_API_KEY" not in env:
        line = p.stdout.readline() if p.stdout else ""
        if not line or time.monotonic() > deadline:
            p.kill()
            sys.exit(f"cluster up printed no E2B_API_KEY (exit {p.poll()})")
        if line.startswith("export "):
            k, v = line.strip().removeprefix("export ").split("=", 1)
            env[k] = shlex.split(v)[0] if v else ""
    return p, env


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def e2b_create_first(n: int) -> list[float]:
    from e2b import Sandbox

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = Sandbox.create()
        s.commands.run("true")
        out.append(ms(t0))
        s.kill()
    return out


def e2b_exec(s, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.commands.run("true")
        out.append(ms(t0))
    return out


async def ours_create_first(c, args, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await c.run_sandbox(args)
        await sb.run_shell("true")
        out.append(ms(t0))
        await sb.stop()
    return out


async def ours_exec(sb, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sb.run_shell("true")
        out.append(ms(t0))
    return out


def connect_start(client, sandbox_id: str, cmd: list[str]) -> float:
    """One `process.Process/Start` through the gateway, read to its end envelope."""
    import struct

    body = json.dumps({"process": {"cmd": cmd[0], "args": cmd[1:]}, "stdin": False}).encode()
    t0 = time.perf_counter()
    r = client.post(
        "/process.Process/Start",
        content=b"\0" + struct.pack(">I", len(body)) + body,
        headers={"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": os.environ["E2B_API_KEY"],
                 "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
    )
    took = ms(t0)
    assert r.status_code == 200 and b'"end"' in r.content, r.content[:200]
    return took


async def direct_start(stub, sandbox_id: str, cmd: list[str], md) -> float:
    from opendsec._pb import runtime_pb2 as rt

    t0 = time.perf_counter()
    async for ev in stub.StartProcess(rt.StartProcessRequest(sandbox_id=sandbox_id, cmd=cmd[0], args=cmd[1:]), metadata=md):
        if ev.HasField("end"):
            break
    return ms(t0)


async def measure_start(a: argparse.Namespace, res: dict[str, list[float]]) -> None:
    import grpc
    import httpx
    from e2b import Sandbox
    from opendsec._pb import opendsec_pb2_grpc as svc

    loop = asyncio.get_running_loop()
    s = await loop.run_in_executor(None, Sandbox.create)
    edge, suffix = s.sandbox_id.rsplit("-", 1)
    ours_id = f"{edge}.{suffix}"
    md = (("authorization", "Bearer " + os.environ["OPENDSEC_TOKEN"]),)
    try:
        async with grpc.aio.insecure_channel(os.environ["OPENDSEC_ADDR"]) as ch:
            stub = svc.DSecStub(ch)
            with httpx.Client(base_url=os.environ["E2B_SANDBOX_URL"], timeout=30) as client:
                for name, cmd in (("true", ["/bin/true"]), ("bash_login_true", ["/bin/bash", "-l", "-c", "true"])):
                    connect_start(client, s.sandbox_id, cmd)
                    await direct_start(stub, ours_id, cmd, md)
                    g, d = [], []
                    for _ in range(a.exec_n // BLOCK):
                        g += [connect_start(client, s.sandbox_id, cmd) for _ in range(BLOCK)]
                        d += [await direct_start(stub, ours_id, cmd, md) for _ in range(BLOCK)]
                    res[f"gateway_start_{name}"] = g
                    res[f"direct_start_{name}"] = d
    finally:
        await loop.run_in_executor(None, s.kill)


def import_bash_image(name: str) -> None:
    """The small bash image of the E2B suite (sdk/python/tests/oci.py), imported as `name`."""
    sys.path.insert(0, os.path.join(ROOT, "sdk", "python", "tests"))
    from oci import bash_layout  # noqa: PLC0415 (the tests' helper, found by path)

    d = tempfile.mkdtemp(prefix="odb-e2b-img-")
    bash_layout(__import__("pathlib").Path(d) / "oci")
    env = dict(os.environ, OPENDSEC_PROJECT="root")
    subprocess.run([BIN, "ctl", "image", "import", os.path.join(d, "oci"), "-as", name, "-q"],
                   env=env, check=True, stdout=subprocess.DEVNULL)


async def measure_snapshots(a: argparse.Namespace, res: dict[str, list[float]]) -> None:
    from e2b import Sandbox
    from opendsec import DSecClient, DSecRunArgs

    image = "root/bench-bash:1"
    import_bash_image(image)
    loop = asyncio.get_running_loop()
    run = loop.run_in_executor
    args = DSecRunArgs(backend="container", image=image, cpu_cores_limit=1, memory_limit_mb=512)
    for k in ("e2b_snapshot", "ours_snapshot", "e2b_fork2", "ours_fork2", "e2b_from_snapshot", "ours_from_snapshot"):
        res[k] = []
    async with DSecClient() as c:
        e = await run(None, lambda: Sandbox.create(image, timeout=3600))
        o = await c.run_sandbox(args)
        try:
            await run(None, lambda: e.files.write("/srv/state", "x" * 4096))
            await o.write_file("/srv/state", b"x" * 4096)

            def e2b_snap() -> float:
                t0 = time.perf_counter()
                e.create_snapshot("bench-e2b")
                return ms(t0)

            async def ours_snap() -> float:
                t0 = time.perf_counter()
                await o.create_snapshot("root/bench-ours:1", overwrite=True)
                return ms(t0)

            def e2b_fork() -> float:
                t0 = time.perf_counter()
                copies = e.fork(count=2)
                took = ms(t0)
                for x in copies:
                    assert isinstance(x, Sandbox), x
                    x.kill()
                return took

            async def ours_fork() -> float:
                t0 = time.perf_counter()
                copies = await o.fork(count=2)
                took = ms(t0)
                for x in copies:
                    assert not isinstance(x, Exception), x
                    await x.stop()
                return took

            def e2b_from() -> float:
                t0 = time.perf_counter()
                s = Sandbox.create("root/bench-e2b:default")
                s.commands.run("true")
                took = ms(t0)
                s.kill()
                return took

            async def ours_from() -> float:
                t0 = time.perf_counter()
                sb = await c.run_sandbox(DSecRunArgs(backend="container", image="root/bench-ours:1",
                                                     cpu_cores_limit=1, memory_limit_mb=512))
                await sb.run_shell("true")
                took = ms(t0)
                await sb.stop()
                return took

            # Warm each path once, then interleave in blocks.
            await run(None, e2b_snap), await ours_snap()
            await run(None, e2b_fork), await ours_fork()
            await run(None, e2b_from), await ours_from()
            for _ in range(max(1, a.snap_n // 5)):
                for _ in range(5):
                    res["e2b_snapshot"].append(await run(None, e2b_snap))
                for _ in range(5):
                    res["ours_snapshot"].append(await ours_snap())
                for _ in range(5):
                    res["e2b_fork2"].append(await run(None, e2b_fork))
                for _ in range(5):
                    res["ours_fork2"].append(await ours_fork())
                for _ in range(5):
                    res["e2b_from_snapshot"].append(await run(None, e2b_from))
                for _ in range(5):
                    res["ours_from_snapshot"].append(await ours_from())
        finally:
            await run(None, e.kill)
            await o.stop()


CI_IMAGE = "root/code-interpreter:v1"
CI_LAYOUT = os.path.join(ROOT, "target", "code-interpreter-image")


def code_interpreter_missing() -> str | None:
    """Why run_code cannot be measured here, or None when it can."""
    try:
        import e2b_code_interpreter  # noqa: F401,PLC0415
    except ImportError as e:
        return f"not measured: e2b_code_interpreter is not importable ({e})"
    if not os.path.isfile(os.path.join(CI_LAYOUT, "index.json")):
        return (f"not measured: no image layout at {CI_LAYOUT} "
                "(sudo bash packaging/code-interpreter/build.sh target/code-interpreter-image)")
    return None


async def measure_code_interpreter(a: argparse.Namespace, res: dict[str, list[float]]) -> str:
    """The code interpreter (template code-interpreter-v1): create → first `run_code("6*7")`
    and a warm `run_code("6*7")`; beside them our SDK's nearest peer on the same image, a
    new `python3 -c 'print(6*7)'` through run_shell (our SDK has no run_code). Returns a
    note on the peer."""
    from e2b_code_interpreter import Sandbox as CISandbox
    from opendsec import DSecClient, DSecRunArgs

    env = dict(os.environ, OPENDSEC_PROJECT="root")
    subprocess.run([BIN, "ctl", "image", "import", CI_LAYOUT + "#v1", "-as", CI_IMAGE, "-q"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    loop = asyncio.get_running_loop()
    run = loop.run_in_executor
    py = "python3 -c 'print(6*7)'"
    args = DSecRunArgs(backend="container", image=CI_IMAGE, cpu_cores_limit=1, memory_limit_mb=512)

    def e2b_create_code(k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            s = CISandbox.create()
            ex = s.run_code("6*7")
            took = ms(t0)
            assert ex.text == "42", (ex.text, ex.error, ex.logs)
            out.append(took)
            s.kill()
        return out

    def e2b_code(s, k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            ex = s.run_code("6*7")
            took = ms(t0)
            assert ex.text == "42", (ex.text, ex.error, ex.logs)
            out.append(took)
        return out

    async def ours_create_py(c, k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            sb = await c.run_sandbox(args)
            r = await sb.run_shell(py)
            took = ms(t0)
            assert _stdout(r).strip() == "42", r
            out.append(took)
            await sb.stop()
        return out

    async def ours_py(sb, k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            r = await sb.run_shell(py)
            took = ms(t0)
            assert _stdout(r).strip() == "42", r
            out.append(took)
        return out

    for k in ("e2b_ci_create_first_run_code", "ours_ci_create_first_python3", "e2b_ci_run_code", "ours_ci_python3"):
        res[k] = []
    note = "our SDK has no run_code; peer: run_sandbox(image=%s) + run_shell(%r)" % (CI_IMAGE, py)
    async with DSecClient() as c:
        peer = True
        try:
            await ours_create_py(c, 1)
        except Exception as e:  # noqa: BLE001 (the peer is optional)
            peer = False
            note = f"our SDK has no run_code; the python3 peer failed, left out: {e!r}"[:300]
        await run(None, e2b_create_code, 1)
        done = 0
        while done < a.ci_n:
            k = min(5, a.ci_n - done)
            res["e2b_ci_create_first_run_code"] += await run(None, e2b_create_code, k)
            if peer:
                res["ours_ci_create_first_python3"] += await ours_create_py(c, k)
            done += k
        s = await run(None, CISandbox.create)
        o = await c.run_sandbox(args) if peer else None
        try:
            await run(None, e2b_code, s, 3)
            if o is not None:
                await ours_py(o, 3)
            done = 0
            while done < a.ci_exec_n:
                k = min(BLOCK * 2, a.ci_exec_n - done)
                res["e2b_ci_run_code"] += await run(None, e2b_code, s, k)
                if o is not None:
                    res["ours_ci_python3"] += await ours_py(o, k)
                done += k
        finally:
            await run(None, s.kill)
            if o is not None:
                await o.stop()
    for k in [k for k, v in res.items() if k.startswith("ours_ci_") and not v]:
        del res[k]
    return note


def _stdout(r) -> str:
    """run_shell's result as text, whatever its shape (an object with stdout, bytes, str)."""
    v = getattr(r, "stdout", r)
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


async def measure(a: argparse.Namespace) -> dict:
    from e2b import Sandbox
    from opendsec import DSecClient, DSecRunArgs

    args = DSecRunArgs(backend="container", image="host", cpu_cores_limit=1, memory_limit_mb=512)
    res: dict[str, list[float]] = {"e2b_create_first": [], "ours_create_first": [], "e2b_exec": [], "ours_exec": []}
    loop = asyncio.get_running_loop()
    async with DSecClient() as c:
        # Warm both paths once (connections, caches) before anything is timed.
        await loop.run_in_executor(None, e2b_create_first, 1)
        await ours_create_first(c, args, 1)
        done = 0
        while done < a.n:
            k = min(BLOCK, a.n - done)
            res["e2b_create_first"] += await loop.run_in_executor(None, e2b_create_first, k)
            res["ours_create_first"] += await ours_create_first(c, args, k)
            done += k
        warm_e2b = await loop.run_in_executor(None, Sandbox.create)
        warm_ours = await c.run_sandbox(args)
        try:
            await loop.run_in_executor(None, e2b_exec, warm_e2b, 5)
            await ours_exec(warm_ours, 5)
            done = 0
            while done < a.exec_n:
                k = min(BLOCK * 5, a.exec_n - done)
                res["e2b_exec"] += await loop.run_in_executor(None, e2b_exec, warm_e2b, k)
                res["ours_exec"] += await ours_exec(warm_ours, k)
                done += k
        finally:
            await loop.run_in_executor(None, warm_e2b.kill)
            await warm_ours.stop()
    await measure_start(a, res)
    if a.snap_n > 0:
        await measure_snapshots(a, res)
    ci = code_interpreter_missing() if a.ci_n > 0 or a.ci_exec_n > 0 else "not measured: -ci-n 0 -ci-exec-n 0"
    if ci is None:
        ci = await measure_code_interpreter(a, res)
    out = {k: summary(v) for k, v in res.items() if v}
    out["added_by_gateway_ms"] = {
        "create_first_p50 (E2B SDK vs ours, incl. bash -l)": round(out["e2b_create_first"]["p50"] - out["ours_create_first"]["p50"], 3),
        "exec_p50 (E2B SDK vs ours, incl. bash -l)": round(out["e2b_exec"]["p50"] - out["ours_exec"]["p50"], 3),
        "process_start_p50 (same /bin/true)": round(out["gateway_start_true"]["p50"] - out["direct_start_true"]["p50"], 3),
    }
    if a.snap_n > 0:
        for k in ("snapshot", "fork2"):
            out["added_by_gateway_ms"][f"{k}_p50"] = round(out[f"e2b_{k}"]["p50"] - out[f"ours_{k}"]["p50"], 3)
    out["run_code"] = ci
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=40, help="creations per SDK")
    ap.add_argument("-exec-n", dest="exec_n", type=int, default=300, help="warm round trips per SDK")
    ap.add_argument("-snap-n", dest="snap_n", type=int, default=20, help="snapshots, forks and creations from a snapshot per SDK (0: none)")
    ap.add_argument("-ci-n", dest="ci_n", type=int, default=10, help="code-interpreter creations → first run_code")
    ap.add_argument("-ci-exec-n", dest="ci_exec_n", type=int, default=100, help="warm run_code round trips")
    ap.add_argument("-json", action="store_true", help="print JSON only")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/e2b_gateway.py needs root (real containers)")
    state = tempfile.mkdtemp(prefix="odb-e2b-")
    p, env = start_cluster(state)
    try:
        os.environ.update(env)
        out = asyncio.run(measure(a))
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
            # The sandboxes' disks are gone with them once the cluster stopped them.
            shutil.rmtree(state, ignore_errors=True)
        except subprocess.TimeoutExpired:
            p.kill()
    if a.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:22} {v}")


if __name__ == "__main__":
    main()
