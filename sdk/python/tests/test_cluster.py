"""The SDK against a real in-process cluster (`opendsec cluster up -sim-edges 2`): the session's
``cluster`` fixture of cluster_fixture.py, registered in conftest.py.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

import opendsec
from opendsec import DSecClient, DSecError, DSecRunArgs, Sandbox

pytestmark = pytest.mark.cluster


def admin(cluster: dict[str, str], **kw) -> DSecClient:
    """A client with the bootstrap administrator's token."""
    kw.setdefault("token", cluster["OPENDSEC_TOKEN"])
    kw.setdefault("project", cluster["OPENDSEC_PROJECT"])
    return DSecClient(endpoint=cluster["OPENDSEC_ADDR"], retry_timeout=10, **kw)


def uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


async def wait_state(sb: Sandbox, *states: str, within: float = 10.0) -> Sandbox:
    """Refreshes until the sandbox is in one of ``states`` (transitions may pass through -ING)."""
    end = time.monotonic() + within
    while sb.state not in states:
        if time.monotonic() > end:
            raise AssertionError(f"{sb.id} is {sb.state}, wanted {states}")
        await asyncio.sleep(0.05)
        await sb.refresh()
    return sb


async def delete_project(c: DSecClient, path: str, within: float = 10.0) -> None:
    """Deletes a project once the quota of its just-stopped sandboxes is released.

    A stop returns once the sandbox is STOPPED; IAM hears about the released lease a moment
    later, and until then the project still holds quota (``conflict``).
    """
    end = time.monotonic() + within
    while True:
        try:
            await c.delete_project(path)
            return
        except DSecError as e:
            if e.reason != opendsec.CONFLICT or time.monotonic() > end:
                raise
        await asyncio.sleep(0.1)


async def test_cluster_status(cluster):
    async with admin(cluster) as c:
        snap = await c.cluster_status()
    assert len(snap.edges) == 2
    assert all("sim" in e.backends for e in snap.edges)


async def test_sandbox_lifecycle(cluster):
    task = uniq("life")
    async with admin(cluster) as c:
        sb = await c.run_sandbox(DSecRunArgs(backend="sim", task_id=task, labels={"t": "lifecycle"}))
        try:
            assert sb.state == "RUNNING" and sb.id and sb.edge_id
            assert sb.id.startswith(sb.edge_id + ".")
            assert sb.info.spec.task_id == task and dict(sb.info.spec.labels) == {"t": "lifecycle"}

            got = await c.get_sandbox(sb.id)
            assert got.id == sb.id and got.state == "RUNNING"
            listed = await c.list_sandboxes(task_id=task)
            assert [s.id for s in listed] == [sb.id]

            await wait_state(await sb.pause(), "PAUSED")
            await wait_state(await sb.resume(), "RUNNING")
            await wait_state(await sb.touch(), "RUNNING")
        finally:
            await sb.stop()
        await wait_state(sb, "STOPPED")
        assert (await c.get_sandbox(sb.id)).state == "STOPPED"  # kept for a while after it ended
        assert await c.list_sandboxes(task_id=task) == []
        assert [s.id for s in await c.list_sandboxes(task_id=task, include_ended=True)] == [sb.id]

        with pytest.raises(DSecError) as ei:
            await c.get_sandbox("no-such-edge.nothing")
        assert ei.value.reason == opendsec.NOT_FOUND


async def test_update_network(cluster):
    # The simulated edges have no sandbox networking: rules that allow something are refused
    # naming the node setting; rules are checked by the apiserver first; taking rules back
    # works and shows in the record.
    async with admin(cluster) as c:
        sb = await c.run_sandbox(DSecRunArgs(backend="sim"))
        try:
            with pytest.raises(DSecError) as ei:
                await sb.update_network({"x.io:70000": True})
            assert ei.value.reason == opendsec.INVALID
            assert 'network rule "x.io:70000": port outside 1-65535' in ei.value.message
            with pytest.raises(DSecError) as ei:
                await sb.update_network({"192.0.2.10": True})
            assert ei.value.reason == opendsec.INVALID
            assert "edges[].network.enabled is false" in ei.value.message

            await sb.update_network({"*": False})
            assert dict(sb.info.spec.network_rules) == {"*": False}
            assert dict((await c.get_sandbox(sb.id)).info.spec.network_rules) == {"*": False}
            await sb.update_network({}, replace=True)
            assert dict(sb.info.spec.network_rules) == {}
        finally:
            await sb.stop()
        with pytest.raises(DSecError) as ei:
            await sb.update_network({}, replace=True)
        assert ei.value.reason == opendsec.CONFLICT


async def test_run_sandboxes_100_in_order_and_task_actions(cluster):
    task = uniq("batch")
    async with admin(cluster) as c:
        res = await c.run_sandboxes(DSecRunArgs(backend="sim", task_id=task, cpu_cores_limit=0.1, memory_limit_mb=64), 100)
        try:
            errors = [x for x in res if isinstance(x, DSecError)]
            assert errors == [], errors[:3]
            assert len(res) == 100 and len({x.id for x in res}) == 100
            assert all(x.state == "RUNNING" for x in res)
            listed = await c.list_sandboxes(task_id=task)
            assert {s.id for s in listed} == {x.id for x in res}

            r = await c.pause_task(task)
            assert (r.affected, r.failed, r.errors) == (100, 0, [])
            r = await c.resume_task(task)
            assert (r.affected, r.failed) == (100, 0)
        finally:
            r = await c.stop_task(task)
        assert r.affected == 100 and r.failed == 0
        assert await c.list_sandboxes(task_id=task) == []


async def test_iam_flow(cluster):
    top = uniq("sdk")
    sub = "sub"
    principal = uniq("agent")
    async with admin(cluster) as c:
        me = await c.whoami()
        assert me

        proj = await c.create_project("root", top, quota={"sandboxes": 3, "cpu_cores": 8})
        assert proj.path == f"root/{top}" and proj.quota.get("sandboxes") == 3
        child = await c.create_project(proj.path, sub)
        assert child.path == f"root/{top}/{sub}"
        assert child.quota.get("sandboxes", 3) <= 3  # inherits at most the parent's limit

        token = await c.create_principal(proj.path, principal, kind="agent", ttl=3600)
        assert token
        started: list[Sandbox] = []
        try:
            async with DSecClient(endpoint=cluster["OPENDSEC_ADDR"], token=token, project=child.path, retry_timeout=10) as p:
                assert await p.whoami() == principal

                # No grant yet: forbidden, to create and to operate an admin's sandbox.
                with pytest.raises(DSecError) as ei:
                    await p.run_sandbox(DSecRunArgs(backend="sim"))
                assert ei.value.reason == opendsec.FORBIDDEN
                theirs = await c.run_sandbox(DSecRunArgs(backend="sim", project=proj.path, cpu_cores_limit=0.5))
                started.append(theirs)
                with pytest.raises(DSecError) as ei:
                    await p.get_sandbox(theirs.id)
                assert ei.value.reason == opendsec.FORBIDDEN

                got = await c.grant(proj.path, principal, ["sandbox.create", "sandbox.operate"])
                assert set(got.policies.get(principal, [])) >= {"sandbox.create", "sandbox.operate"}
                # The refusal is not remembered past about a second (it was 30 s once).
                end = time.monotonic() + 10
                while True:
                    try:
                        assert (await p.get_sandbox(theirs.id)).id == theirs.id
                        break
                    except DSecError as e:
                        assert e.reason == opendsec.FORBIDDEN
                        assert time.monotonic() < end, "a granted permission still refused after 10 s"
                        await asyncio.sleep(0.1)

                # Two sandboxes in the parent project itself (`theirs` is one), one in the child:
                # the parent is full.
                started.append(await c.run_sandbox(DSecRunArgs(backend="sim", project=proj.path, cpu_cores_limit=0.5)))
                started.append(await p.run_sandbox(DSecRunArgs(backend="sim", cpu_cores_limit=0.5)))
                with pytest.raises(DSecError) as ei:
                    await p.run_sandbox(DSecRunArgs(backend="sim", cpu_cores_limit=0.5))
                assert ei.value.reason == opendsec.QUOTA_EXCEEDED
                child_now = await c.get_project(child.path)
                assert child_now.usage.get("sandboxes", 0) == 1  # the child itself was under its quota

                # Still forbidden outside the granted subtree.
                with pytest.raises(DSecError) as ei:
                    await p.run_sandbox(DSecRunArgs(backend="sim", project="root"))
                assert ei.value.reason == opendsec.FORBIDDEN
                with pytest.raises(DSecError) as ei:
                    await p.create_project(proj.path, "nope")
                assert ei.value.reason == opendsec.FORBIDDEN

                # A second token for itself, listed and then revoked: it stops working (about 1 s).
                tok2, info = await p.create_token(description="sdk test")
                assert info.principal == principal and info.description == "sdk test"
                assert info.id in {t.id for t in await p.list_tokens()}
                async with DSecClient(endpoint=cluster["OPENDSEC_ADDR"], token=tok2, retry_timeout=0) as p2:
                    assert await p2.whoami() == principal
                    await c.revoke_token(principal, info.id)
                    end = time.monotonic() + 15  # about 1 s; timed in bench/revocation.py
                    while True:
                        try:
                            await p2.whoami()
                        except DSecError as e:
                            assert e.reason == opendsec.UNAUTHENTICATED
                            break
                        assert time.monotonic() < end, "revoked token still accepted after 15 s"
                        await asyncio.sleep(0.1)
                assert info.id not in {t.id for t in await c.list_tokens(principal)}
                assert await p.whoami() == principal  # the first token still works

                revoked = await c.revoke(proj.path, principal)
                assert principal not in revoked.policies
        finally:
            for sb in started:  # as the admin: the principal may have lost its grant by now
                await (await c.get_sandbox(sb.id)).stop()
            await c.delete_principal(principal)
            await delete_project(c, f"root/{top}/{sub}")
            await delete_project(c, f"root/{top}")
        with pytest.raises(DSecError) as ei:
            await c.get_project(f"root/{top}")
        assert ei.value.reason == opendsec.NOT_FOUND


async def test_bad_token_is_unauthenticated(cluster):
    async with admin(cluster, token="dsk.nobody.not-a-secret") as c:
        with pytest.raises(DSecError) as ei:
            await c.whoami()
    assert ei.value.reason == opendsec.UNAUTHENTICATED


async def test_get_usage(cluster):
    top = uniq("usage")
    async with admin(cluster) as c:
        proj = await c.create_project("root", top, quota={"sandboxes": 5})
        try:
            sb = await c.run_sandbox(DSecRunArgs(backend="sim", project=proj.path))
            await sb.stop()
            today = time.strftime("%Y-%m-%d", time.gmtime())
            report = await c.get_usage(proj.path, start=today, end=today)
            rows = [r for r in report.rows if r.project == proj.path]
            assert rows, report
            assert sum(r.sandboxes_started for r in rows if r.day != "total") == 1
            assert all(r.day in (today, "total") for r in report.rows)
            assert all(r.sandbox_hours >= 0 for r in rows)
            total = await c.get_usage("root", start=today, end=today, daily=False)
            assert any(r.project == proj.path for r in total.rows)
        finally:
            await delete_project(c, proj.path)
