"""The SDK against a cluster with TLS (`opendsec cluster up -tls`): the apiserver's public port
speaks TLS only, with a certificate from the cluster's own CA (``<state-dir>/pki/ca.crt``, printed
as ``OPENDSEC_CA``) for ``api.opendsec.internal``, ``127.0.0.1`` and ``localhost``.

The module starts its own cluster (``running_cluster`` of cluster_fixture.py, which stops that
process and only that one at the end), separate from the session's plaintext one.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Iterator

import pytest
from cluster_fixture import WANTED, ctl, running_cluster

import opendsec
from opendsec import DSecClient, DSecError, DSecRunArgs, Sandbox

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[dict[str, str]]:
    """A running ``cluster up -tls`` of one simulated edge: the values of OPENDSEC_ADDR,
    OPENDSEC_TOKEN, OPENDSEC_PROJECT, OPENDSEC_IMAGE_STORE and OPENDSEC_CA."""
    with running_cluster(["-tls", "-sim-edges", "1"], wanted=(*WANTED, "OPENDSEC_CA")) as env:
        yield env


@pytest.fixture(autouse=True)
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients here name everything themselves: an OPENDSEC_CA (or address, token, project)
    in the caller's environment would otherwise turn the plaintext client into a TLS one."""
    for k in ("OPENDSEC_ADDR", "OPENDSEC_TOKEN", "OPENDSEC_PROJECT", "OPENDSEC_CA"):
        monkeypatch.delenv(k, raising=False)


def client(env: dict[str, str], **kw: object) -> DSecClient:
    """A client of the bootstrap administrator; ``kw`` overrides endpoint, ca_file, ..."""
    args: dict[str, object] = {
        "endpoint": env["OPENDSEC_ADDR"],
        "token": env["OPENDSEC_TOKEN"],
        "project": env["OPENDSEC_PROJECT"],
        "retry_timeout": 10,
    }
    args.update(kw)
    return DSecClient(**args)  # type: ignore[arg-type]


async def wait_state(sb: Sandbox, *states: str, within: float = 10.0) -> Sandbox:
    """Refreshes until the sandbox is in one of ``states`` (transitions may pass through -ING)."""
    end = time.monotonic() + within
    while sb.state not in states:
        if time.monotonic() > end:
            raise AssertionError(f"{sb.id} is {sb.state}, wanted {states}")
        await asyncio.sleep(0.05)
        await sb.refresh()
    return sb


async def refused(c: DSecClient) -> DSecError:
    """The error ``whoami`` fails with on ``c`` (which must fail)."""
    async with c:
        with pytest.raises(DSecError) as ei:
            await c.whoami()
    return ei.value


async def still_serving(env: dict[str, str]) -> None:
    """The cluster still answers a correct TLS client: a refusal was the client's fault."""
    async with client(env, ca_file=env["OPENDSEC_CA"]) as c:
        assert await c.whoami() == "admin"


def test_cluster_prints_its_ca(tls_cluster: dict[str, str]) -> None:
    ca = Path(tls_cluster["OPENDSEC_CA"])
    assert ca.name == "ca.crt" and ca.parent.name == "pki"
    assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")


async def test_tls_whoami_and_sim_sandbox(tls_cluster: dict[str, str]) -> None:
    task = f"tls-{secrets.token_hex(4)}"
    async with client(tls_cluster, ca_file=tls_cluster["OPENDSEC_CA"]) as c:
        assert c.server_name is None  # one address: checked against its host, 127.0.0.1
        assert await c.whoami() == "admin"
        snap = await c.cluster_status()
        assert len(snap.edges) == 1 and "sim" in snap.edges[0].backends

        sb = await c.run_sandbox(DSecRunArgs(backend="sim", task_id=task))
        try:
            assert sb.state == "RUNNING" and sb.id.startswith(sb.edge_id + ".")
            assert [s.id for s in await c.list_sandboxes(task_id=task)] == [sb.id]
            # The sim backend runs nothing: a command is refused, the same over TLS as without.
            with pytest.raises(DSecError) as ei:
                await sb.run_shell("echo hi")
            assert ei.value.reason == opendsec.INVALID
            assert ei.value.message == "backend sim runs nothing"
        finally:
            await sb.stop()
        await wait_state(sb, "STOPPED")
        assert (await c.get_sandbox(sb.id)).state == "STOPPED"
        assert await c.list_sandboxes(task_id=task) == []


async def test_two_addresses_default_to_api_name(tls_cluster: dict[str, str]) -> None:
    addr = tls_cluster["OPENDSEC_ADDR"]
    async with client(tls_cluster, endpoint=f"{addr},{addr}", ca_file=tls_cluster["OPENDSEC_CA"]) as c:
        assert c.addresses == [addr, addr]
        assert c.server_name == "api.opendsec.internal"
        for _ in range(4):  # calls are spread over both channels
            assert await c.whoami() == "admin"


async def test_plaintext_client_is_unavailable(tls_cluster: dict[str, str]) -> None:
    c = client(tls_cluster, retry_timeout=0)
    assert c.ca_file is None
    err = await refused(c)
    assert err.reason == opendsec.UNAVAILABLE
    await still_serving(tls_cluster)


@pytest.fixture
def other_ca(tls_cluster: dict[str, str], tmp_path: Path) -> Path:
    """The certificate of a second CA (``opendsec ctl pki ca``), unrelated to the cluster's."""
    out = tmp_path / "other-ca"
    r = ctl(tls_cluster, "pki", "ca", "-out", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "ca.crt").is_file() and (out / "ca.key").is_file()
    assert (out / "ca.crt").read_bytes() != Path(tls_cluster["OPENDSEC_CA"]).read_bytes()
    return out / "ca.crt"


async def test_other_ca_is_unavailable(tls_cluster: dict[str, str], other_ca: Path) -> None:
    err = await refused(client(tls_cluster, ca_file=str(other_ca), retry_timeout=0))
    assert err.reason == opendsec.UNAVAILABLE
    await still_serving(tls_cluster)


async def test_wrong_server_name_is_unavailable(tls_cluster: dict[str, str]) -> None:
    c = client(tls_cluster, ca_file=tls_cluster["OPENDSEC_CA"], server_name="wrong.example", retry_timeout=0)
    err = await refused(c)
    assert err.reason == opendsec.UNAVAILABLE
    await still_serving(tls_cluster)
