"""E2B's own Python SDK against the gateway's control plane (docs/e2b.md "What works"): every
call is the SDK's public API, unchanged; only the three E2B_* variables point it at us."""

from __future__ import annotations

import datetime as dt
import inspect
import json
import os
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
)


def raw(method: str, path: str, body: object = None, key: str | None = None) -> tuple[int, dict, object]:
    """One control-plane request without the SDK: status, headers and the decoded body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(os.environ["E2B_API_URL"] + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is None:
        key = os.environ["E2B_API_KEY"]
    if key:
        req.add_header("X-API-KEY", key)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            return r.status, dict(r.headers), json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, dict(e.headers), json.loads(text) if text else None


def test_create_get_info_and_kill(gateway):
    sbx = Sandbox.create(metadata={"run": "a b&c=d", "who": "test"}, envs={"A": "1"}, timeout=120)
    try:
        assert "." not in sbx.sandbox_id and sbx.sandbox_id.startswith("sim-0-")
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"run": "a b&c=d", "who": "test"}
        assert info.state == SandboxState.RUNNING
        life = (info.end_at - info.started_at).total_seconds()
        assert life == 120
        assert abs((info.started_at - dt.datetime.now(dt.timezone.utc)).total_seconds()) < 30
        assert info.cpu_count == 1 and info.memory_mb == 512
        assert info.lifecycle == {"on_timeout": "kill", "auto_resume": True}
        assert sbx.get_metrics() == []
    finally:
        assert sbx.kill() is True
    # E2B forgets a killed sandbox: a second kill is False and reading it is not found.
    assert sbx.kill() is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)


def test_list_filters_and_pages(gateway):
    tag = uuid.uuid4().hex
    made = [Sandbox.create(metadata={"tag": tag, "i": str(i), "odd": "x y/z%"}) for i in range(3)]
    try:
        made[0].pause()
        pages, listed = 0, []
        p = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=2)
        while p.has_next:
            items = p.next_items()
            pages += 1
            listed += items
        assert pages == 2
        # Each once, newest first (start times are whole seconds: ties in id order).
        ids = [s.sandbox_id for s in listed]
        assert sorted(ids) == sorted(s.sandbox_id for s in made)
        keys = [(s.started_at, s.sandbox_id) for s in listed]
        assert keys == sorted(keys, reverse=True)
        running = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, state=[SandboxState.RUNNING])).next_items()
        assert sorted(s.sandbox_id for s in running) == sorted(s.sandbox_id for s in made[1:])
        paused = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, state=[SandboxState.PAUSED])).next_items()
        assert [s.sandbox_id for s in paused] == [made[0].sandbox_id]
        assert paused[0].state == SandboxState.PAUSED
        # Metadata values with spaces, slashes and percent signs match exactly.
        odd = Sandbox.list(query=SandboxQuery(metadata={"tag": tag, "odd": "x y/z%"})).next_items()
        assert len(odd) == 3
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": tag, "odd": "x y"})).next_items() == []
        asc = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), order="asc").next_items()
        assert [s.sandbox_id for s in asc] == list(reversed(ids))
        by_template = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, template="base")).next_items()
        assert len(by_template) == 3
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, template="other")).next_items() == []
    finally:
        for s in made:
            s.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items() == []


def test_pause_connect_and_timeouts(gateway):
    sbx = Sandbox.create(timeout=60, lifecycle={"on_timeout": "pause"})
    try:
        info = sbx.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}
        assert sbx.pause() is not False
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        # Pausing a paused sandbox: E2B's 409, which the SDK reports as False.
        assert Sandbox.pause(sbx.sandbox_id) is False
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.sandbox_id == sbx.sandbox_id
        info = again.get_info()
        assert info.state == SandboxState.RUNNING
        left = (info.end_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
        assert 590 <= left <= 601
        # Connect never shortens the timeout; set_timeout does as asked, both ways.
        Sandbox.connect(sbx.sandbox_id, timeout=30)
        assert Sandbox.get_info(sbx.sandbox_id).end_at == info.end_at
        sbx.set_timeout(40)
        left = (sbx.get_info().end_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
        assert 30 <= left <= 41
        # The lifecycle survives a connect.
        assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
    finally:
        sbx.kill()


def test_errors_are_the_sdk_exceptions(gateway):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="dsk.nobody.nosecret")
    with pytest.raises(SandboxException) as e:
        Sandbox.create("no-such-template")
    assert "404" in str(e.value) and "no-such-template" in str(e.value)
    # Options the gateway cannot honour are refused by name, never ignored.
    with pytest.raises(SandboxException) as e:
        Sandbox.create(network={"allow_out": ["192.0.2.1"]})
    assert "400" in str(e.value) and "allowOut" in str(e.value)
    with pytest.raises(SandboxException) as e:
        Sandbox.create(lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    assert "400" in str(e.value) and "autoPauseMemory" in str(e.value)
    with pytest.raises(SandboxException) as e:
        Sandbox.create(timeout=10**9)
    assert "400" in str(e.value)
    # A refused creation made nothing.
    assert [s for s in Sandbox.list().next_items() if s.template_id == "no-such-template"] == []


def test_wire_details_the_sdks_rely_on(gateway):
    # Every error is JSON {code, message} with code equal to the status, 404 on DELETE included.
    status, headers, body = raw("DELETE", "/sandboxes/sim-0-0000000000000000")
    assert status == 404 and body["code"] == 404 and "not found" in body["message"]
    assert headers.get("should-retry") == "false"
    status, _, body = raw("GET", "/v2/sandboxes", key="")
    assert status == 401 and body["code"] == 401
    status, _, body = raw("POST", "/v2/sandboxes", {"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]})
    assert status == 400 and "volumeMounts" in body["message"]
    status, _, body = raw("POST", "/v2/sandboxes", {"templateID": "base", "surprise": 1})
    assert status == 400 and "surprise" in body["message"]
    status, _, body = raw("GET", "/v2/sandboxes?nextToken=forged")
    assert status == 400 and "nextToken" in body["message"]
    status, _, body = raw("GET", "/v2/sandboxes?limit=101")
    assert status == 400 and "limit" in body["message"]
    status, _, body = raw("GET", "/nope")
    assert status == 404 and body["code"] == 404
    # The Sandbox object carries what the SDK requires, and the sandbox's own access token
    # for envd (never the caller's API key).
    status, _, body = raw("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {}, "envVars": {}})
    assert status == 201
    try:
        assert set(body) >= {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"}
        token = body["envdAccessToken"]
        assert token.startswith("dsg.") and token != os.environ["E2B_API_KEY"]
        assert body["trafficAccessToken"] == token
    finally:
        assert raw("DELETE", f"/sandboxes/{body['sandboxID']}")[0] == 204


def test_idempotency_key_returns_the_same_sandbox(gateway):
    key = uuid.uuid4().hex
    if "idempotency_key" in inspect.signature(Sandbox.create).parameters:
        a = Sandbox.create(idempotency_key=key).sandbox_id
        b = Sandbox.create(idempotency_key=key).sandbox_id
    else:  # SDK releases before the option: the header as later ones send it
        def create() -> str:
            req = urllib.request.Request(
                os.environ["E2B_API_URL"] + "/v2/sandboxes",
                data=b'{"templateID":"base"}',
                method="POST",
                headers={"X-API-KEY": os.environ["E2B_API_KEY"], "Idempotency-Key": key},
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())["sandboxID"]

        a, b = create(), create()
    try:
        assert a == b
    finally:
        assert Sandbox.kill(a) is True


async def test_the_async_sdk(gateway):
    sbx = await AsyncSandbox.create(metadata={"async": "yes"})
    try:
        info = await sbx.get_info()
        assert info.metadata == {"async": "yes"}
    finally:
        assert await sbx.kill() is True
    assert await AsyncSandbox.kill(sbx.sandbox_id) is False
