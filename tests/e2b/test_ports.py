"""Servers in a sandbox reached through the gateway (docs/e2b.md "Ports"): plain HTTP, a
streamed answer and a WebSocket, the caller's token always required; E2B's proxy answers for
a closed port and a missing sandbox; `/health` and `is_running()` following the sandbox."""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import time

import httpx
import pytest
from e2b import Sandbox, SandboxNotRunningException

# A WebSocket echo server (one text frame back per frame) and a server streaming three
# chunks a second apart, stdlib only, as the sandbox runs them.
SERVERS = r'''
import base64, hashlib, socket, socketserver, threading, time
class WS(socketserver.StreamRequestHandler):
    def handle(self):
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.request.recv(1024)
        key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
        acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        self.request.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
        while True:
            h = self.rfile.read(2)
            if len(h) < 2:
                return
            n = h[1] & 127
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            self.request.sendall(bytes([0x81, len(data) + 5]) + b"echo:" + data)
class Stream(socketserver.StreamRequestHandler):
    def handle(self):
        self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b""):
            pass
        self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(b"tick%d\n" % i), b"tick%d\n" % i))
            self.wfile.flush()
            time.sleep(1)
        self.wfile.write(b"0\r\n\r\n")
socketserver.ThreadingTCPServer.allow_reuse_address = True
threading.Thread(target=socketserver.ThreadingTCPServer(("127.0.0.1", 8765), WS).serve_forever, daemon=True).start()
socketserver.ThreadingTCPServer(("127.0.0.1", 8766), Stream).serve_forever()
'''


@pytest.fixture(scope="module")
def sbx(linux):
    s = Sandbox.create()
    s.files.write("/tmp/www/index.html", "hello from the sandbox\n")
    s.files.write("/tmp/www/big.bin", bytes(range(256)) * 20000)
    s.files.write("/tmp/servers.py", SERVERS)
    s.commands.run("cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
    s.commands.run("exec python3 /tmp/servers.py", background=True)
    yield s
    s.kill()


def headers(s: Sandbox, port: int, token: str | None = None) -> dict[str, str]:
    h = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(port)}
    h["X-Access-Token"] = token if token is not None else os.environ["E2B_API_KEY"]
    return h


def url(path: str = "/") -> str:
    return os.environ["E2B_SANDBOX_URL"] + path


def wait_listening(s: Sandbox, port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(url("/"), headers=headers(s, port), timeout=10)
        if r.status_code != 502:
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def test_plain_http_with_the_token_only(sbx):
    wait_listening(sbx, 8000)
    r = httpx.get(url("/index.html"), headers=headers(sbx, 8000))
    assert (r.status_code, r.text) == (200, "hello from the sandbox\n")
    big = httpx.get(url("/big.bin"), headers=headers(sbx, 8000))
    assert big.content == bytes(range(256)) * 20000
    # Paths the control plane knows are the sandbox's here.
    assert httpx.get(url("/v2/sandboxes"), headers=headers(sbx, 8000)).status_code == 404
    # The token is required, and must be one the cluster knows.
    h = headers(sbx, 8000)
    del h["X-Access-Token"]
    r = httpx.get(url("/index.html"), headers=h)
    assert (r.status_code, r.json()["code"]) == (401, 401)
    r = httpx.get(url("/index.html"), headers=headers(sbx, 8000, "dsk.nobody.wrong"))
    assert r.status_code == 401
    # The code interpreter SDKs send their token this way.
    h = headers(sbx, 8000)
    h["E2B-Traffic-Access-Token"] = h.pop("X-Access-Token")
    assert httpx.get(url("/index.html"), headers=h).status_code == 200


def test_e2b_proxy_answers_for_a_closed_port_and_a_missing_sandbox(sbx):
    r = httpx.get(url("/"), headers=headers(sbx, 8999))
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    h = headers(sbx, 8000)
    h["E2b-Sandbox-Id"] = "node-0-0000000000000000"
    r = httpx.get(url("/"), headers=h)
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


def test_a_port_that_is_no_port_is_a_400_not_envd(sbx):
    for bad in ("0", "65536", "http", "", "+80", "080"):
        h = headers(sbx, 8000)
        h["E2b-Sandbox-Port"] = bad
        r = httpx.get(url("/health"), headers=h)
        assert r.status_code == 400 and "not a port" in r.json()["message"], (bad, r.text)


def test_a_killed_sandbox_is_not_found_for_ports_commands_and_files(linux):
    s = Sandbox.create()
    s.files.write("/tmp/x", "x")
    s.kill()
    r = httpx.get(url("/"), headers=headers(s, 8000))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found", r.text
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        s.files.read("/tmp/x")
    with pytest.raises(SandboxNotRunningException):
        s.files.write("/tmp/y", "y")
    with pytest.raises(SandboxNotRunningException):
        s.files.make_dir("/tmp/d")
    with pytest.raises(SandboxNotRunningException):
        s.files.get_info("/tmp/x")


def test_a_streamed_answer_arrives_as_it_is_made(sbx):
    wait_listening(sbx, 8766)
    arrived = []
    start = time.monotonic()
    with httpx.stream("GET", url("/"), headers=headers(sbx, 8766), timeout=20) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            arrived.append((line, time.monotonic() - start))
    assert [a[0] for a in arrived] == ["tick0", "tick1", "tick2"]
    # The first line came before the server had written the last.
    assert arrived[0][1] < arrived[2][1] - 1.0


def test_a_websocket(sbx):
    # The WebSocket server answers no plain GET; the other server of its process does.
    wait_listening(sbx, 8766)
    gw = os.environ["E2B_SANDBOX_URL"].removeprefix("http://")
    host, port = gw.rsplit(":", 1)
    key = base64.b64encode(os.urandom(16)).decode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        h = headers(sbx, 8765)
        req = (
            f"GET /chat HTTP/1.1\r\nHost: {gw}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in h.items())
            + "\r\n"
        )
        s.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1024)
        assert head.startswith(b"HTTP/1.1 101"), head
        want = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        assert want in head
        for text in (b"one", b"two"):
            mask = os.urandom(4)
            s.sendall(bytes([0x81, 0x80 | len(text)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(text)))
            frame = s.recv(1024)
            assert frame == bytes([0x81, len(text) + 5]) + b"echo:" + text


def test_health_and_is_running_follow_the_sandbox(linux):
    s = Sandbox.create()
    assert s.is_running() is True
    s.kill()
    assert s.is_running() is False
    r = httpx.get(url("/health"), headers=headers(s, 49983))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


def test_the_gateways_own_refusals_are_json(linux):
    api = os.environ["E2B_API_URL"]
    key = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    r = httpx.post(api + "/v2/sandboxes", headers=key, content=b"{" + b" " * (3 << 20) + b"}")
    assert r.status_code == 413 and r.json()["code"] == 413
    r = httpx.request("PATCH", api + "/v2/sandboxes", headers=key)
    assert r.status_code == 405 and r.json()["code"] == 405


def test_a_control_call_with_an_unknown_token_is_refused_before_its_body(linux):
    # A body that never ends: a known token would wait for it (30 s at most); an unknown one
    # is answered at once, so nobody without a token can hold the gateway's connections.
    host, port = os.environ["E2B_API_URL"].removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: dsk.nobody.zzz\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 401"), head
