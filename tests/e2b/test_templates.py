"""A gateway of its own (`opendsec e2b -config FILE -index 1`, docs/e2b.md "For
administrators") with the settings the generated cluster's gateway has none of: HTTPS from a
certificate of its own, and templates with a start command and a port to wait for."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

E2B_VARS = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(d: Path) -> tuple[str, str]:
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            # A server's certificate, not an authority's: TLS stacks refuse a CA as the peer.
            "-addext", "basicConstraints=critical,CA:FALSE",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A cluster of real containers and, beside its own gateway, a TLS one with templates
    `ready` (a web server on 8123, waited for) and `never-ready` (waits 2 s for a port
    nothing opens). Yields the variables for E2B's SDK pointed at the TLS gateway."""
    from cluster_fixture import DEFAULT_BIN, running_cluster

    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("real containers need root; CI runs as root", pytrace=False)
        pytest.skip("real containers need root")
    d = tmp_path_factory.mktemp("own-gateway")
    written = d / "cluster.json"
    flags = ["-sim-edges", "1", "-runtime", "linux", "-network", "off", "-disk-reserve-mb", "-1"]
    with running_cluster([*flags, "-write-config", str(written)], E2B_VARS + ("OPENDSEC_ADDR",)) as env:
        cert, key = self_signed(d)
        port, ready = free_port(), free_port()
        cfg = json.loads(written.read_text())
        cfg["e2b"]["gateways"].append({"addr": f"127.0.0.1:{port}", "tls_cert": cert, "tls_key": key})
        host = {"image": "host", "cpu": 1, "memory_mb": 256}
        cfg["e2b"]["templates"]["ready"] = {
            **host,
            "start_cmd": "mkdir -p /tmp/www && echo served > /tmp/www/index.html && "
            "cd /tmp/www && exec python3 -m http.server 8123 --bind 127.0.0.1",
            "ready_port": 8123,
            "ready_timeout_s": 30,
        }
        cfg["e2b"]["templates"]["never-ready"] = {**host, "start_cmd": "sleep 600", "ready_port": 8124, "ready_timeout_s": 2}
        path = d / "e2b.json"
        path.write_text(json.dumps(cfg))
        binary = os.environ.get("OPENDSEC_BIN") or str(DEFAULT_BIN)
        log = open(d / "e2b.log", "w")
        gw = subprocess.Popen(
            [binary, "e2b", "-config", str(path), "-index", "1", "-metrics", f"127.0.0.1:{ready}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{ready}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert gw.poll() is None and time.monotonic() < deadline, (d / "e2b.log").read_text()
                time.sleep(0.1)
            url = f"https://127.0.0.1:{port}"
            yield {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": env["E2B_API_KEY"], "cert": cert, "port": str(port)}
        finally:
            gw.terminate()
            gw.wait(timeout=30)
            log.close()


def test_the_gateway_serves_https_with_its_own_certificate(own):
    import ssl

    trusting = ssl.create_default_context(cafile=own["cert"])
    r = httpx.get(f"{own['E2B_API_URL']}/v2/sandboxes", headers={"X-API-Key": own["E2B_API_KEY"]}, verify=trusting)
    assert r.status_code == 200 and r.http_version == "HTTP/1.1", r.text
    with httpx.Client(http2=False, verify=trusting) as c:
        assert c.get(f"{own['E2B_API_URL']}/health").status_code == 204
    # In the clear, nothing answers: the port speaks TLS only.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{own['port']}/health", timeout=5)
    # A client that does not trust the certificate refuses it.
    untrusting = ssl.create_default_context(cafile="/etc/ssl/certs/ca-certificates.crt")
    with socket.create_connection(("127.0.0.1", int(own["port"]))) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            untrusting.wrap_socket(raw, server_hostname="localhost")


def sdk(own: dict[str, str], code: str) -> dict:
    """Runs `code` with E2B's SDK in a process of its own pointed at the TLS gateway and
    trusting its certificate (the SDK's HTTP client reads the trusted certificates once per
    process), and returns the JSON it prints last."""
    import sys

    env = {**os.environ, **{k: own[k] for k in E2B_VARS}, "SSL_CERT_FILE": own["cert"]}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_template_s_start_command_runs_and_its_port_is_waited_for(own):
    got = sdk(
        own,
        """
import json
from e2b import Sandbox
sbx = Sandbox.create("ready")
try:
    # The creation answered once the port took connections: the server is up at once.
    r = sbx.commands.run("python3 -c \\"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/').read().decode())\\"")
    procs = [[p.tag, p.cmd, p.args[:2]] for p in sbx.commands.list()]
    print(json.dumps({"out": r.stdout.strip(), "procs": procs}))
finally:
    sbx.kill()
""",
    )
    assert got["out"] == "served"
    assert [p for p in got["procs"] if p[0] == "e2b-start"] == [["e2b-start", "bash", ["-l", "-c"]]], got


def test_a_template_whose_port_never_listens_fails_and_leaves_nothing(own):
    got = sdk(
        own,
        """
import json, time
from e2b import Sandbox, SandboxException
def listed():
    return {s.sandbox_id for s in Sandbox.list(limit=100).next_items()}
before = listed()
start = time.monotonic()
try:
    Sandbox.create("never-ready")
    err = None
except SandboxException as e:
    err = str(e)
took = time.monotonic() - start
# The sandbox it made is stopped.
deadline = time.monotonic() + 10
while listed() - before and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"err": err, "took": took, "left": sorted(listed() - before)}))
""",
    )
    assert got["err"] and "nothing listened on port 8124 within 2 s" in got["err"], got
    assert got["took"] < 20 and got["left"] == [], got


def test_a_replayed_keyed_creation_starts_the_template_once_and_keeps_the_sandbox(own):
    import ssl

    trusting = ssl.create_default_context(cafile=own["cert"])
    headers = {"X-API-Key": own["E2B_API_KEY"], "Idempotency-Key": f"replay-{time.time_ns()}"}
    url = f"{own['E2B_API_URL']}/v2/sandboxes"
    with httpx.Client(verify=trusting, timeout=60) as c:
        first = c.post(url, json={"templateID": "ready", "timeout": 120}, headers=headers)
        assert first.status_code == 201, first.text
        again = c.post(url, json={"templateID": "ready", "timeout": 120}, headers=headers)
        assert again.status_code == 201, again.text
        sid = first.json()["sandboxID"]
        assert again.json()["sandboxID"] == sid
        info = c.get(f"{own['E2B_API_URL']}/sandboxes/{sid}", headers={"X-API-Key": own["E2B_API_KEY"]})
        assert info.status_code == 200 and info.json()["state"] == "running", info.text
        got = sdk(
            own,
            f"""
import json
from e2b import Sandbox
sbx = Sandbox.connect("{sid}")
print(json.dumps([p.tag for p in sbx.commands.list()]))
sbx.kill()
""",
        )
        assert got.count("e2b-start") == 1, got
