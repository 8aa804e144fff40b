"""The SDK against an in-process fake server: errors, retries, failover, batches, streams."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

import opendsec
from fake_server import UNAVAILABLE_FAULT, Fault, FakeServer, dead_addr
from opendsec import (
    DSecClient,
    DSecContainerRunArgs,
    DSecError,
    DSecRunArgs,
    Sandbox,
)

def client_for(*addrs: str, **kw) -> DSecClient:
    kw.setdefault("retry_timeout", 5)
    return DSecClient(endpoint=",".join(addrs), **kw)


async def new_sandbox(c: DSecClient) -> Sandbox:
    return await c.run_sandbox(DSecRunArgs(backend="sim"))


# ------------------------------------------------------------------ errors


async def test_reason_comes_from_error_info_not_code_or_message(fake):
    # RESOURCE_EXHAUSTED alone would mean rate_limited; the ErrorInfo says quota_exceeded.
    fake.service.faults["CreateSandbox"].append(
        Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota_exceeded", "project root/x: sandboxes 3/3 (not_found)")
    )
    async with client_for(fake.addr) as c:
        with pytest.raises(DSecError) as ei:
            await new_sandbox(c)
    assert ei.value.reason == opendsec.QUOTA_EXCEEDED
    assert ei.value.message == "project root/x: sandboxes 3/3 (not_found)"


@pytest.mark.parametrize("reason", sorted(opendsec.REASONS - {"unavailable"}))
async def test_every_reason_round_trips(fake, reason):
    fake.service.faults["GetSandbox"].append(Fault(grpc.StatusCode.INTERNAL, reason, "why"))
    async with client_for(fake.addr) as c:
        with pytest.raises(DSecError) as ei:
            await c.get_sandbox("x")
    assert (ei.value.reason, ei.value.message) == (reason, "why")
    assert fake.service.calls["GetSandbox"] == 1  # only unavailable is retried


async def test_bare_status_maps_by_code(fake):
    fake.service.faults["WhoAmI"].append(Fault(grpc.StatusCode.PERMISSION_DENIED, message="nope", bare=True))
    async with client_for(fake.addr) as c:
        with pytest.raises(DSecError) as ei:
            await c.whoami()
    assert ei.value.reason == opendsec.FORBIDDEN


async def test_not_found_from_server(fake):
    async with client_for(fake.addr) as c:
        with pytest.raises(DSecError) as ei:
            await c.get_sandbox("nope")
    assert ei.value.reason == opendsec.NOT_FOUND


async def test_connection_refused_is_unavailable():
    async with client_for(dead_addr(), retry_timeout=0) as c:
        with pytest.raises(DSecError) as ei:
            await c.get_sandbox("x")
    assert ei.value.reason == opendsec.UNAVAILABLE


def test_dsec_error_shape():
    e = DSecError("forbidden", "missing sandbox.create")
    assert (e.reason, e.message) == ("forbidden", "missing sandbox.create")
    assert "forbidden" in str(e)
    assert e == DSecError("forbidden", "missing sandbox.create")
    import pickle

    assert pickle.loads(pickle.dumps(e)) == e


# ------------------------------------------------------------------ retries


async def test_unavailable_is_retried_then_succeeds(fake):
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        fake.service.faults["GetSandbox"] += [UNAVAILABLE_FAULT, Fault(grpc.StatusCode.UNAVAILABLE, bare=True)]
        t0 = time.monotonic()
        got = await c.get_sandbox(sb.id)
        assert got.id == sb.id and got.state == "RUNNING"
        assert fake.service.calls["GetSandbox"] == 3
        assert time.monotonic() - t0 >= 0.1 + 0.2 - 0.05  # backoff 100 ms, then 200 ms


async def test_creation_retry_reuses_idempotency_key(fake):
    # The first attempt creates the sandbox but its answer is lost.
    fake.service.faults["CreateSandbox.after"].append(UNAVAILABLE_FAULT)
    async with client_for(fake.addr) as c:
        sb = await c.run_sandbox(DSecContainerRunArgs(container_image="root/py:3.12", labels={"a": "b"}))
    keys = fake.service.create_keys
    assert len(keys) == 2 and keys[0] == keys[1] and len(keys[0]) >= 16
    assert fake.service.created_count == 1
    assert sb.info.spec.backend == "container" and sb.info.spec.image == "root/py:3.12"
    assert dict(sb.info.spec.labels) == {"a": "b"}


async def test_separate_creations_get_separate_keys(fake):
    async with client_for(fake.addr) as c:
        await new_sandbox(c)
        await new_sandbox(c)
    assert len(set(fake.service.create_keys)) == 2


async def test_a_callers_own_key_survives_a_client_restart(fake):
    # A trainer restarts and asks again with the keys it chose: the same sandboxes, no new ones.
    async with client_for(fake.addr) as c:
        sb = await c.run_sandbox(DSecRunArgs(backend="sim"), idempotency_key="trainer-7/step-3")
        batch = await c.run_sandboxes(DSecRunArgs(backend="sim"), 3, idempotency_key="trainer-7/batch-3")
    async with client_for(fake.addr) as c2:
        again = await c2.run_sandbox(DSecRunArgs(backend="sim"), idempotency_key="trainer-7/step-3")
        batch2 = await c2.run_sandboxes(DSecRunArgs(backend="sim"), 3, idempotency_key="trainer-7/batch-3")
    assert again.id == sb.id
    assert [b.id for b in batch2] == [b.id for b in batch]
    assert fake.service.created_count == 4
    assert fake.service.create_keys == ["trainer-7/step-3", "trainer-7/step-3"]
    assert fake.service.batch_keys == ["trainer-7/batch-3", "trainer-7/batch-3"]


async def test_a_bad_idempotency_key_is_invalid_before_anything_is_sent(fake):
    async with client_for(fake.addr) as c:
        for bad in ["", "x" * 257, 7]:
            with pytest.raises(DSecError) as e:
                await c.run_sandbox(DSecRunArgs(backend="sim"), idempotency_key=bad)  # type: ignore[arg-type]
            assert e.value.reason == "invalid"
            with pytest.raises(DSecError) as e:
                await c.run_sandboxes(DSecRunArgs(backend="sim"), 2, idempotency_key=bad)  # type: ignore[arg-type]
            assert e.value.reason == "invalid"
    assert fake.service.calls["CreateSandbox"] == 0 and fake.service.calls["CreateSandboxes"] == 0


async def test_run_sandbox_whose_wait_times_out_stops_what_it_created(fake):
    fake.service.new_state = opendsec._pb.types_pb2.SandboxState.Value("CREATING")
    async with client_for(fake.addr) as c:
        with pytest.raises(DSecError) as e:
            await c.run_sandbox(DSecRunArgs(backend="sim"), timeout=0.5)
    assert e.value.reason == "timeout"
    assert fake.service.calls["StopSandbox"] == 1
    (sb,) = fake.service.sandboxes.values()
    assert sb.state == opendsec._pb.types_pb2.SandboxState.Value("STOPPED")


async def test_run_shell_retry_never_runs_twice(fake):
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        fake.service.run_shell_fail_after_exec = 2
        r = await sb.run_shell("echo hi", session="s1", env={"A": "1"}, cwd="/tmp", user="1000", timeout=5)
    assert r.ok and r.stdout == "hi\n" and r.stdout_bytes == b"hi\n"
    reqs = fake.service.run_requests
    assert len(reqs) == 3 and len({q.request_id for q in reqs}) == 1
    assert fake.service.executions[reqs[0].request_id] == 1
    q = reqs[0]
    assert (q.cmd, q.session, dict(q.env), q.cwd, q.user, q.timeout) == ("echo hi", "s1", {"A": "1"}, "/tmp", "1000", 5.0)


async def test_retry_timeout_zero_disables_retries(fake):
    async with client_for(fake.addr, retry_timeout=0) as c:
        sb = await new_sandbox(c)
        fake.service.faults["GetSandbox"].append(UNAVAILABLE_FAULT)
        with pytest.raises(DSecError) as ei:
            await sb.refresh()
    assert ei.value.reason == opendsec.UNAVAILABLE
    assert fake.service.calls["GetSandbox"] == 1


async def test_retries_stop_after_retry_timeout():
    async with client_for(dead_addr(), retry_timeout=0.6) as c:
        t0 = time.monotonic()
        with pytest.raises(DSecError) as ei:
            await c.get_sandbox("x")
        took = time.monotonic() - t0
    assert ei.value.reason == opendsec.UNAVAILABLE
    # It waited for retry_timeout and then gave up (a hang fails the bound); the exact time
    # is measured in bench/revocation.py.
    assert 0.5 <= took < 15


@pytest.mark.parametrize(
    "method, call",
    [
        ("WriteFile", lambda sb, c: sb.write_file("/tmp/a", "x")),
        ("Remove", lambda sb, c: sb.remove("/tmp/a")),
        ("Http", lambda sb, c: sb.http("http://127.0.0.1:8000/")),
        ("WhoAmI", lambda sb, c: c.whoami()),
        ("CreateProject", lambda sb, c: c.create_project("root", "p")),
        ("GetUsage", lambda sb, c: c.get_usage()),
        ("UpdateNetwork", lambda sb, c: sb.update_network({"pypi": True})),
    ],
)
async def test_non_retried_methods_fail_at_once(fake, method, call):
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        fake.service.faults[method].append(UNAVAILABLE_FAULT)
        with pytest.raises(DSecError) as ei:
            await call(sb, c)
        assert ei.value.reason == opendsec.UNAVAILABLE
        assert fake.service.calls[method] == 1
        await call(sb, c)  # and the next call goes through
        assert fake.service.calls[method] == 2


@pytest.mark.parametrize(
    "method, call",
    [
        ("StopSandbox", lambda sb, c: sb.stop()),
        ("PauseSandbox", lambda sb, c: sb.pause()),
        ("ResumeSandbox", lambda sb, c: sb.resume()),
        ("TouchSandbox", lambda sb, c: sb.touch()),
        ("SetSandboxTimeout", lambda sb, c: sb.set_timeout(60)),
        ("ReadFile", lambda sb, c: sb.read_file("/f")),
        ("ListSandboxes", lambda sb, c: c.list_sandboxes()),
        ("PauseTask", lambda sb, c: c.pause_task("t")),
    ],
)
async def test_retried_methods_retry(fake, method, call):
    fake.service.files["/f"] = b"data"
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        fake.service.faults[method].append(UNAVAILABLE_FAULT)
        await call(sb, c)
    assert fake.service.calls[method] == 2


# ------------------------------------------------------------------ addresses


async def test_failover_from_dead_to_live_address(fake):
    async with client_for(dead_addr(), fake.addr) as c:
        sb = await new_sandbox(c)  # the first pick is the dead address
        assert sb.id.startswith("a-")
        # Afterwards the dead address is avoided, even by calls that are not retried.
        for _ in range(4):
            assert await c.whoami() == "anonymous"
    assert fake.service.calls["WhoAmI"] == 4


async def test_non_retried_call_skips_dead_address_before_sending(fake):
    async with client_for(dead_addr(), fake.addr, retry_timeout=0) as c:
        assert await c.whoami() == "anonymous"  # the first pick is the dead address
    assert fake.service.calls["WhoAmI"] == 1


async def test_round_robin_over_live_addresses(fake, fake2):
    async with client_for(fake.addr, fake2.addr) as c:
        for _ in range(6):
            await c.whoami()
    assert fake.service.calls["WhoAmI"] == 3 and fake2.service.calls["WhoAmI"] == 3


async def test_moves_off_an_address_that_goes_down(fake):
    other = await FakeServer("b").start()
    try:
        async with client_for(fake.addr, other.addr) as c:
            for _ in range(2):
                await c.whoami()
            await other.stop()
            for _ in range(3):
                await c.list_sandboxes()  # retried: the stopped server is left for the live one
            for _ in range(3):
                await c.whoami()  # not retried, but the dead server is avoided
        assert fake.service.calls["ListSandboxes"] == 3
    finally:
        await other.stop()


async def test_all_down_then_back(fake):
    # One address, the server restarts: calls retry until it is back.
    port = fake.port
    async with client_for(fake.addr, retry_timeout=10) as c:
        await c.whoami()
        await fake.stop()

        async def restart():
            await asyncio.sleep(0.5)
            fake.server = None
            import grpc.aio as aio
            from fake_server import add_to_server

            srv = aio.server()
            add_to_server(fake.service, srv)
            assert srv.add_insecure_port(f"127.0.0.1:{port}") == port
            await srv.start()
            fake.server = srv

        task = asyncio.create_task(restart())
        got = await c.list_sandboxes()
        await task
        assert got == []


# ------------------------------------------------------------------ environment


def test_env_defaults():
    c = DSecClient()
    assert c.addresses == ["127.0.0.1:7100"]
    assert c.token == "" and c.project == "root" and c.ca_file is None and c.server_name is None
    assert c.retry_timeout == 60


def test_env_variables(monkeypatch, tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    monkeypatch.setenv("OPENDSEC_ADDR", "10.0.0.11:7100, 10.0.0.12:7100,")
    monkeypatch.setenv("OPENDSEC_TOKEN", "dsk.me.secret")
    monkeypatch.setenv("OPENDSEC_PROJECT", "root/team-a")
    monkeypatch.setenv("OPENDSEC_CA", str(ca))
    c = DSecClient()
    assert c.addresses == ["10.0.0.11:7100", "10.0.0.12:7100"]
    assert (c.token, c.project, c.ca_file) == ("dsk.me.secret", "root/team-a", str(ca))
    assert c.server_name == "api.opendsec.internal"  # several addresses with TLS
    c2 = DSecClient(endpoint="h:1", token="t", project="root/p", ca_file=None, server_name="n", retry_timeout=0)
    assert (c2.addresses, c2.token, c2.project, c2.server_name, c2.retry_timeout) == (["h:1"], "t", "root/p", "n", 0)
    assert c2.ca_file == str(ca)  # None means "from the environment"
    assert DSecClient(endpoint="h:1").server_name is None  # one address: its own host name


async def test_token_and_project_go_on_the_wire(fake, monkeypatch):
    monkeypatch.setenv("OPENDSEC_ADDR", fake.addr)
    monkeypatch.setenv("OPENDSEC_TOKEN", "dsk.alice.s3cret")
    monkeypatch.setenv("OPENDSEC_PROJECT", "root/team-a")
    async with DSecClient() as c:
        assert await c.whoami() == "alice"
        sb = await c.run_sandbox(DSecRunArgs(backend="sim"))
        sb2 = await c.run_sandbox(DSecRunArgs(backend="sim", project="root/other"))
    assert fake.service.metadata[0]["authorization"] == "Bearer dsk.alice.s3cret"
    assert sb.info.project == "root/team-a" and sb2.info.project == "root/other"


async def test_no_token_sends_no_authorization(fake):
    async with client_for(fake.addr) as c:
        await c.whoami()
    assert "authorization" not in fake.service.metadata[0]


async def test_tls_with_ca_file_fails_against_plaintext_server(fake, tmp_path):
    # A CA file switches the client to TLS; a plaintext server then cannot be reached.
    import subprocess

    key, crt = tmp_path / "ca.key", tmp_path / "ca.crt"
    r = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
         "-days", "1", "-subj", "/CN=test-ca"],
        capture_output=True,
    )
    if r.returncode != 0:
        pytest.skip("openssl not available")
    async with client_for(fake.addr, ca_file=str(crt), retry_timeout=0) as c:
        with pytest.raises(DSecError) as ei:
            await c.whoami()
    assert ei.value.reason == opendsec.UNAVAILABLE
    assert fake.service.calls["WhoAmI"] == 0


# ------------------------------------------------------------------ batches


async def test_batch_in_order(fake):
    fake.service.batch_reverse = True
    fake.service.batch_item_errors[3] = ("no_capacity", "all edges full")
    async with client_for(fake.addr) as c:
        res = await c.run_sandboxes(DSecRunArgs(backend="sim", task_id="job"), 6)
    assert len(res) == 6
    assert isinstance(res[3], DSecError) and res[3].reason == opendsec.NO_CAPACITY
    ok = [x for x in res if isinstance(x, Sandbox)]
    assert len(ok) == 5 and all(x.info.spec.task_id == "job" for x in ok)
    key = fake.service.batch_keys[0]
    for i, x in enumerate(res):
        if i != 3:
            assert fake.service.created_by_key[f"{key}/{i}"] == x.id


async def test_batch_retry_after_broken_stream_creates_only_missing(fake):
    fake.service.batch_break_after = [4, 2]  # two broken streams, then a whole one
    async with client_for(fake.addr) as c:
        res = await c.run_sandboxes(DSecRunArgs(backend="sim"), 10)
    keys = fake.service.batch_keys
    assert len(keys) == 3 and len(set(keys)) == 1  # the same key each time
    assert fake.service.created_count == 10  # nothing created twice
    key = keys[0]
    assert [x.id for x in res] == [fake.service.created_by_key[f"{key}/{i}"] for i in range(10)]


async def test_batch_request_failure_raises(fake):
    fake.service.faults["CreateSandboxes"].append(Fault(grpc.StatusCode.PERMISSION_DENIED, "forbidden", "no sandbox.create"))
    async with client_for(fake.addr) as c:
        with pytest.raises(DSecError) as ei:
            await c.run_containers(DSecContainerRunArgs(), 3)
    assert ei.value.reason == opendsec.FORBIDDEN


async def test_batch_gives_up_after_retry_timeout_keeping_what_it_has(fake):
    fake.service.batch_break_after = [2] + [0] * 1000
    async with client_for(fake.addr, retry_timeout=0.5) as c:
        res = await c.run_sandboxes(DSecRunArgs(backend="sim"), 4)
    assert [isinstance(x, Sandbox) for x in res] == [True, True, False, False]
    assert all(x.reason == opendsec.UNAVAILABLE for x in res[2:])


# ------------------------------------------------------------------ streams


def _chunks():
    return [
        ("stdout", b"hello "),
        ("stderr", b"warn 1\n"),
        ("stdout", b"world\n"),
        ("stdout", b"line 3\n"),
        ("stderr", b"warn 2\n"),
        ("stdout", b"line 4\n"),
    ]


async def _collect(sb, **kw):
    out, err, ends = b"", b"", []
    async for kind, data in sb.stream_shell("make test", **kw):
        if kind == "stdout":
            out += data
        elif kind == "stderr":
            err += data
        else:
            ends.append(data)
    return out, err, ends


async def test_stream_shell_whole(fake):
    fake.service.stream_chunks = _chunks()
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        out, err, ends = await _collect(sb)
    assert out == b"hello world\nline 3\nline 4\n" and err == b"warn 1\nwarn 2\n"
    assert len(ends) == 1 and ends[0].exit_code == 3 and ends[0].done and ends[0].stdout_bytes == b""


async def test_stream_shell_resumes_without_loss_or_duplication(fake):
    fake.service.stream_chunks = _chunks()
    fake.service.stream_break_after = [3, 3]  # StreamShell breaks after 3 chunks, StreamOutput after 3
    fake.service.stream_resume_overlap = 4  # and resends 4 bytes it had already sent
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        out, err, ends = await _collect(sb, timeout=30, session="build")
    assert out == b"hello world\nline 3\nline 4\n" and err == b"warn 1\nwarn 2\n"
    assert len(ends) == 1 and ends[0].exit_code == 3
    kinds = [k for k, _ in fake.service.stream_requests]
    assert kinds == ["StreamShell", "StreamOutput", "StreamOutput"]
    r1, r2 = fake.service.stream_requests[1][1], fake.service.stream_requests[2][1]
    assert (r1.cmd_id, r1.session, r1.stdout_offset, r1.stderr_offset) == (7, "build", 12, 7)
    assert (r2.stdout_offset, r2.stderr_offset) == (19, 7)
    assert sum(fake.service.executions.values()) == 1


async def test_stream_shell_broken_before_start_reuses_request_id(fake):
    fake.service.stream_chunks = _chunks()
    fake.service.stream_break_before_started = 1
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        out, err, _ = await _collect(sb)
    assert out == b"hello world\nline 3\nline 4\n" and err == b"warn 1\nwarn 2\n"
    ids = [q.request_id for k, q in fake.service.stream_requests]
    assert len(ids) == 2 and ids[0] == ids[1]
    assert sum(fake.service.executions.values()) == 1


# ------------------------------------------------------------------ the rest of the surface


async def test_files_and_http(fake):
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        fi = await sb.write_file("/tmp/a.txt", "héllo", mode=0o644)
        assert (fi.name, fi.type, fi.size) == ("a.txt", "file", 6)
        await sb.write_file("/tmp/a.txt", b"!", append=True)
        assert await sb.read_file("/tmp/a.txt") == "héllo!".encode()
        assert await sb.read_file("/tmp/a.txt", offset=1, length=2) == "é".encode()
        await sb.remove("/tmp/a.txt")
        with pytest.raises(DSecError) as ei:
            await sb.read_file("/tmp/a.txt")
        assert ei.value.reason == opendsec.NOT_FOUND
        h = await sb.http("http://127.0.0.1:8000/health")
        assert (h.status, h.headers, h.body) == (200, {"x": "y"}, b"ok")


async def test_files_larger_than_one_call_are_chunked(fake):
    """A file of more than one call's worth (an 80 MB message would not pass) goes in
    FILE_CHUNK_BYTES pieces both ways, and comes back byte for byte."""
    chunk = opendsec.sandbox.FILE_CHUNK_BYTES
    data = os.urandom(2 * chunk + 12345)
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        fi = await sb.write_file("/big", data)
        assert fi.size == len(data)
        assert fake.service.calls["WriteFile"] == 3
        assert fake.service.files["/big"] == data
        await sb.write_file("/big", data[:10])  # a rewrite replaces, shorter
        assert fake.service.files["/big"] == data[:10]
        await sb.write_file("/big", data)
        fake.service.calls["ReadFile"] = 0
        assert await sb.read_file("/big") == data
        assert fake.service.calls["ReadFile"] == 3
        assert await sb.read_file("/big", offset=chunk - 1, length=chunk + 2) == data[chunk - 1 : 2 * chunk + 1]
        await sb.write_file("/big", data[:5], append=True)
        assert fake.service.files["/big"] == data + data[:5]
        assert await sb.read_file("/big", offset=len(data) + 5) == b""
        # More than max_bytes to return is refused after one call and a stat, not read
        # into memory (a sparse file can be far larger than the disk).
        fake.service.calls["ReadFile"] = 0
        with pytest.raises(DSecError) as e:
            await sb.read_file("/big", max_bytes=chunk + 1)
        assert e.value.reason == "invalid" and "max_bytes" in e.value.message, e.value
        assert fake.service.calls["ReadFile"] == 1
        assert await sb.read_file("/big", offset=chunk, max_bytes=chunk + 12350) == data[chunk:] + data[:5]
        with pytest.raises(DSecError):
            await sb.read_file("/big", length=chunk + 2, max_bytes=chunk + 1)


async def test_lifecycle_and_tasks(fake):
    async with client_for(fake.addr) as c:
        sb = await c.run_sandbox(DSecRunArgs(backend="sim", task_id="t1"))
        assert (await sb.pause()).state == "PAUSED"
        assert (await sb.resume()).state == "RUNNING"
        res = await c.pause_task("t1")
        assert res.affected == 1 and res.failed == 0
        assert (await sb.refresh()).state == "PAUSED"
        assert (await sb.stop()).state == "STOPPED"
        assert [s.id for s in await c.list_sandboxes(task_id="t1")] == [sb.id]


async def test_management_results(fake):
    async with client_for(fake.addr) as c:
        p = await c.create_project("root", "team", quota={"sandboxes": 5})
        assert p.path == "root/team" and p.quota == {"sandboxes": 5.0}
        rep = await c.get_usage("root/team", start="2026-01-01", end="2026-01-31")
        assert rep.rows[0].project == "root/team" and rep.rows[0].sandboxes_started == 3


async def test_client_opens_lazily_and_closes(fake):
    c = client_for(fake.addr)
    assert await c.whoami() == "anonymous"
    await c.close()
    await c.close()
    assert await c.whoami() == "anonymous"  # reopens
    await c.close()


def test_public_names_have_docstrings():
    for name in opendsec.__all__:
        obj = getattr(opendsec, name)
        if isinstance(obj, (str, frozenset)):
            continue
        assert obj.__doc__, name
        for attr, member in vars(obj).items() if isinstance(obj, type) else ():
            if not attr.startswith("_") and callable(member):
                assert member.__doc__, f"{name}.{attr}"


def _make_pki(tmp_path):
    """A CA and a server certificate for api.opendsec.internal, made with the openssl CLI."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not available")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
        "-subj", "/CN=api.opendsec.internal")
    (tmp_path / "ext.cnf").write_text("subjectAltName=DNS:api.opendsec.internal\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "srv.crt", "-days", "1", "-extfile", "ext.cnf")
    return tmp_path / "ca.crt", (tmp_path / "srv.key").read_bytes(), (tmp_path / "srv.crt").read_bytes()


async def test_tls_server_name(tmp_path):
    import grpc.aio as aio
    from fake_server import FakeDSec, add_to_server

    ca, key, crt = _make_pki(tmp_path)
    service = FakeDSec("tls")
    srv = aio.server()
    add_to_server(service, srv)
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, crt)]))
    await srv.start()
    addr = f"127.0.0.1:{port}"
    try:
        # Several addresses: the certificate is checked against api.opendsec.internal.
        async with client_for(dead_addr(), addr, ca_file=str(ca), token="dsk.tls-user.x") as c:
            assert c.server_name == "api.opendsec.internal"
            assert await c.whoami() == "tls-user"
        # One address: the name must be given, else the certificate does not match 127.0.0.1.
        async with client_for(addr, ca_file=str(ca), server_name="api.opendsec.internal") as c:
            assert await c.whoami() == "anonymous"
        async with client_for(addr, ca_file=str(ca), retry_timeout=0) as c:
            with pytest.raises(DSecError) as ei:
                await c.whoami()
            assert ei.value.reason == opendsec.UNAVAILABLE
    finally:
        await srv.stop(None)


async def test_batch_count_is_checked_before_anything_is_allocated_or_sent():
    from opendsec import DSecClient, DSecError, DSecRunArgs, INVALID

    # No server at all: the check must come first.
    async with DSecClient(endpoint="127.0.0.1:1", token="dsk.a.b", retry_timeout=0) as c:
        for bad in (0, 32769, 10**9, 2**40, -1):
            try:
                await c.run_sandboxes(DSecRunArgs(backend="sim"), bad)
            except DSecError as e:
                assert e.reason == INVALID
            else:
                raise AssertionError(f"count {bad} accepted")


def test_one_permission_string_is_not_split_into_letters():
    from opendsec.client import _perm_list

    assert _perm_list("sandbox.create") == ["sandbox.create"]
    assert _perm_list("sandbox.create,layer.use") == ["sandbox.create", "layer.use"]
    assert _perm_list(["a", "b"]) == ["a", "b"]


async def test_wrong_argument_types_are_invalid_not_python_exceptions():
    from opendsec import DSecClient, DSecError, DSecRunArgs, INVALID

    async with DSecClient(endpoint="127.0.0.1:1", token="dsk.a.b", retry_timeout=0) as c:
        for call in (
            lambda: c.run_sandbox(DSecRunArgs(backend="sim", memory_limit_mb="lots")),
            lambda: c.run_sandbox(DSecRunArgs(backend="sim", memory_limit_mb=2**63)),
            lambda: c.create_project("root", "x", {"sandboxes": "ten"}),
            lambda: c.create_project("root", 123),
        ):
            try:
                await call()
            except DSecError as e:
                assert e.reason == INVALID, e
            else:
                raise AssertionError("accepted")


async def test_arguments_python_would_convert_are_invalid_and_nothing_is_sent(fake):
    """``int("512")``, ``float("5")`` and ``bytes(5)`` succeed in Python, and a NUL cuts a
    string short in the sandbox: none of them may reach the server as something else."""
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        creates = fake.service.calls["CreateSandbox"]
        before = dict(fake.service.calls)
        bad = {
            "memory_limit_mb as str": lambda: c.run_sandbox(DSecRunArgs(backend="sim", memory_limit_mb="512")),
            "cpu as str": lambda: c.run_sandbox(DSecRunArgs(backend="sim", cpu_cores_limit="1")),
            "disk_mb as float": lambda: c.run_sandbox(DSecRunArgs(backend="sim", disk_mb=1.5)),
            "ttl as bool": lambda: c.run_sandbox(DSecRunArgs(backend="sim", ttl_max=True)),
            "label value as int": lambda: c.run_sandbox(DSecRunArgs(backend="sim", labels={"step": 3})),
            "labels as list": lambda: c.run_sandbox(DSecRunArgs(backend="sim", labels=["a"])),  # type: ignore[arg-type]
            "empty label name": lambda: c.run_sandbox(DSecRunArgs(backend="sim", labels={"": "x"})),
            "fork labels as list": lambda: sb.fork(labels=["a"]),  # type: ignore[arg-type]
            "fork label value as int": lambda: sb.fork(labels={"n": 1}),  # type: ignore[dict-item]
            "timeout as str": lambda: sb.run_shell("true", timeout="5"),
            "empty session": lambda: sb.run_shell("true", session=""),
            "NUL in cmd": lambda: sb.run_shell("echo a\0; rm -rf /x"),
            "env with =": lambda: sb.run_shell("true", env={"A=B": "c"}),
            "env value as int": lambda: sb.run_shell("true", env={"A": 1}),
            "background NUL": lambda: sb.run_shell_background("sleep 1\0"),
            "data as int": lambda: sb.write_file("/tmp/x", 5),
            "data as list": lambda: sb.write_file("/tmp/x", [1, 2]),
            "empty path": lambda: sb.write_file("", b"x"),
            "NUL in path": lambda: sb.read_file("/etc/passwd\0.txt"),
            "session of stat": lambda: sb.stat("/tmp", session=""),
        }
        for what, call in bad.items():
            with pytest.raises(DSecError) as ei:
                await call()
            assert ei.value.reason == opendsec.INVALID, (what, ei.value)
        assert dict(fake.service.calls) == before, "a bad argument reached the server"
        assert fake.service.calls["CreateSandbox"] == creates
        # numpy-like integers and ints for floats still work.
        r = await sb.run_shell("true", timeout=5)
        assert r.exit_code == 0


def test_a_message_over_grpcs_size_limit_is_invalid_not_rate_limited():
    """gRPC's own size check answers RESOURCE_EXHAUSTED; that is a bad request (docs/python-sdk.md
    "Files"), while a bare RESOURCE_EXHAUSTED from elsewhere stays rate_limited."""
    from opendsec.errors import error_from_rpc

    class Err(grpc.RpcError):
        def __init__(self, details: str) -> None:
            self._details = details

        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return self._details

        def trailing_metadata(self):
            return ()

    big = error_from_rpc(Err("CLIENT: Sent message larger than max (100000079 vs. 83886080)"))
    assert big.reason == opendsec.INVALID
    assert error_from_rpc(Err("slow down")).reason == opendsec.RATE_LIMITED


async def test_a_list_missing_an_edge_warns_naming_it(fake, caplog):
    """The apiserver names the edges that did not answer a list; the SDK says so."""
    async with client_for(fake.addr) as c:
        await new_sandbox(c)
        with caplog.at_level("WARNING", logger="opendsec"):
            assert len(await c.list_sandboxes()) == 1
        assert caplog.records == []
        fake.service.unreachable_edges = ["node-1", "node-2"]
        with caplog.at_level("WARNING", logger="opendsec"):
            assert len(await c.list_sandboxes()) == 1
        assert [r.getMessage() for r in caplog.records] == [
            "list_sandboxes: edges node-1, node-2 did not answer: their sandboxes are not listed"
        ]


# ------------------------------------------------------------------ network rules


async def test_update_network_sends_rules_and_replace_and_updates_info(fake):
    async with client_for(fake.addr) as c:
        sb = await c.run_sandbox(DSecRunArgs(backend="sim", network_rules={"pypi": True}))
        assert await sb.update_network({"github.com:443": True, "pypi": False}) is sb
        req = fake.service.network_requests[-1]
        assert (req.id, dict(req.rules), req.replace) == (sb.id, {"github.com:443": True, "pypi": False}, False)
        assert dict(sb.info.spec.network_rules) == {"github.com:443": True, "pypi": False}
        await sb.update_network({"192.0.2.10": True}, replace=True)
        assert fake.service.network_requests[-1].replace is True
        assert dict(sb.info.spec.network_rules) == {"192.0.2.10": True}
        await sb.update_network({}, replace=True)
        assert dict(sb.info.spec.network_rules) == {}


@pytest.mark.parametrize(
    "rules, replace, says",
    [
        (["pypi"], False, "must be a dict"),
        ("pypi", False, "must be a dict"),
        ({"pypi": "false"}, False, "network rule 'pypi' must be a bool, not str"),
        ({"pypi": 1}, False, "must be a bool, not int"),
        ({"": True}, False, "must not be empty"),
        ({3: True}, False, "network rule must be a str"),
        ({"pypi": True}, "yes", "replace must be a bool"),
    ],
)
async def test_update_network_checks_its_arguments_before_sending(fake, rules, replace, says):
    async with client_for(fake.addr) as c:
        sb = await new_sandbox(c)
        with pytest.raises(DSecError) as ei:
            await sb.update_network(rules, replace=replace)
    assert ei.value.reason == opendsec.INVALID
    assert says in ei.value.message, ei.value.message
    assert fake.service.calls["UpdateNetwork"] == 0
