"""DNS through E2B's own SDK, in real containers with sandbox networking on (docs/e2b.md
"Network", docs/network.md "DNS"): a sandbox reaches the internet by default, so it resolves
names; `allow_internet_access=False` leaves it no name resolution at all, not even through a
resolver of its own choosing, and not a single query of it reaches the upstream; `allow_out`
with a domain opens that domain's names and no other.

The cluster's DNS proxy asks a test upstream of this module's own (`-upstream-dns`): a small
resolver on the host's 127.0.0.1 that answers a test zone (names under `example.test`,
documentation addresses) and logs every query it gets. The edge runs in the cluster's process,
in the host's network namespace, so its upstream queries reach 127.0.0.1 there. No packet
leaves the machine: every DNS packet a sandbox sends, to any address, is redirected to the
proxy, and the proxy asks only this upstream."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from e2b import CommandExitException, Sandbox

A, PTR, AAAA = 1, 12, 28
# A documentation address (TEST-NET-3), public by the cluster's rules: no resolver is there,
# and no packet to its port 53 gets that far (the edge redirects it to its proxy).
ELSEWHERE = "203.0.113.53"

ZONE = {
    # (a) the default sandbox
    "allowed.example.test": "192.0.2.10",
    "10.2.0.192.in-addr.arpa": "allowed.example.test",
    "open-gai.example.test": "192.0.2.11",
    "open-udp.example.test": "192.0.2.12",
    "open-tcp.example.test": "192.0.2.13",
    # (b) `allow_internet_access=False`: names the upstream would answer, were it asked
    "closed.example.test": "192.0.2.20",
    "closed-gai.example.test": "192.0.2.21",
    "closed-udp.example.test": "192.0.2.22",
    "closed-tcp.example.test": "192.0.2.23",
    "20.2.0.192.in-addr.arpa": "closed.example.test",
    # (c) `allow_out` with one domain
    "only.example.test": "192.0.2.30",
    "sub.only.example.test": "192.0.2.31",
    "other.example.test": "192.0.2.32",
}


def encode_name(name: str) -> bytes:
    return b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"


def query(name: str, qtype: int = A, qid: int = 0x4D53) -> bytes:
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", qtype, 1)


class FakeUpstream:
    """A tiny authoritative resolver on 127.0.0.1, UDP and TCP on one port: the names of
    `zone` (an IPv4 address for an A record, a name for an `in-addr.arpa` PTR record),
    NXDOMAIN for any other name. It logs every query it gets as (protocol, name in lower
    case, type)."""

    def __init__(self, zone: dict[str, str], ttl: int = 300) -> None:
        self.zone = {k.lower(): v for k, v in zone.items()}
        self.ttl = ttl
        self.log: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.port = self.udp.getsockname()[1]
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind(("127.0.0.1", self.port))
        self.tcp.listen(16)
        for s in (self.udp, self.tcp):
            s.settimeout(0.2)
        self._threads = [
            threading.Thread(target=self._serve_udp, daemon=True),
            threading.Thread(target=self._serve_tcp, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def entries(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return list(self.log)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.udp.close()
        self.tcp.close()

    def answer(self, proto: str, msg: bytes) -> bytes | None:
        if len(msg) < 12:
            return None
        qid, flags, qd = struct.unpack("!HHH", msg[:6])
        if flags & 0x8000 or qd != 1:
            return None
        labels, i = [], 12
        while i < len(msg) and msg[i] != 0:
            n = msg[i]
            if n & 0xC0:
                return None
            labels.append(msg[i + 1 : i + 1 + n].decode("ascii", "replace"))
            i += 1 + n
        i += 1
        if i + 4 > len(msg):
            return None
        qtype, _ = struct.unpack("!HH", msg[i : i + 4])
        question = msg[12 : i + 4]
        name = ".".join(labels).lower()
        with self._lock:
            self.log.append((proto, name, qtype))
        value = self.zone.get(name)
        rtype = PTR if name.endswith(".in-addr.arpa") else A
        answer = b""
        if value is not None and qtype == rtype:
            rdata = socket.inet_aton(value) if rtype == A else encode_name(value)
            answer = struct.pack("!HHHIH", 0xC00C, rtype, 1, self.ttl, len(rdata)) + rdata
        rcode = 0 if value is not None else 3
        # a response, the query's opcode and RD, authoritative, recursion available
        flags = 0x8000 | (flags & 0x7900) | 0x0400 | 0x0080 | rcode
        return struct.pack("!HHHHHH", qid, flags, 1, 1 if answer else 0, 0, 0) + question + answer

    def _serve_udp(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.udp.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            reply = self.answer("udp", data)
            if reply:
                self.udp.sendto(reply, peer)

    def _serve_tcp(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        with conn:
            try:
                while not self._stop.is_set():
                    head = conn.recv(2, socket.MSG_WAITALL)
                    if len(head) < 2:
                        return
                    (n,) = struct.unpack("!H", head)
                    reply = self.answer("tcp", conn.recv(n, socket.MSG_WAITALL))
                    if reply:
                        conn.sendall(struct.pack("!H", len(reply)) + reply)
            except OSError:
                return


def test_fake_upstream_answers_its_zone():
    up = FakeUpstream(ZONE)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            s.sendto(query("Allowed.Example.test"), ("127.0.0.1", up.port))
            r = s.recv(512)
            assert (r[3] & 0xF, struct.unpack("!H", r[6:8])[0], socket.inet_ntoa(r[-4:])) == (0, 1, "192.0.2.10")
            s.sendto(query("missing.example.test"), ("127.0.0.1", up.port))
            assert s.recv(512)[3] & 0xF == 3
        with socket.create_connection(("127.0.0.1", up.port), timeout=5) as t:
            q = query("only.example.test")
            t.sendall(struct.pack("!H", len(q)) + q)
            assert socket.inet_ntoa(t.recv(512)[-4:]) == "192.0.2.30"
        assert up.entries() == [
            ("udp", "allowed.example.test", A),
            ("udp", "missing.example.test", A),
            ("tcp", "only.example.test", A),
        ]
    finally:
        up.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    up = FakeUpstream(ZONE)
    yield up
    up.close()


@pytest.fixture(scope="module")
def networked(upstream) -> Iterator[dict[str, str]]:
    """A one-node cluster of real containers with sandbox networking on, its DNS proxy asking
    `upstream`, and E2B's SDK pointed at its gateway. Skipped without root, except under
    CI=true."""
    from conftest import _pointed_at

    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("real containers need root; CI runs as root", pytrace=False)
        pytest.skip("real containers need root")
    flags = ["-sim-edges", "1", "-runtime", "linux", "-network", "on", "-disk-reserve-mb", "-1"]
    with _pointed_at([*flags, "-upstream-dns", f"127.0.0.1:{upstream.port}"]) as env:
        yield env


# Asks one name of one resolver directly (UDP or TCP, port 53), bypassing resolv.conf, or
# through the C library's getaddrinfo. Prints `rcode=N a=ADDR,...`, `no answer`, `gai=ADDR,...` or `gai-error=N`.
PROBE = r"""
import socket, struct, sys
how, server, name = sys.argv[1:4]
if how == "gai":
    try:
        print("gai=" + ",".join(sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)})))
    except socket.gaierror as e:
        print("gai-error=%d" % e.errno)
    sys.exit(0)
q = struct.pack("!HHHHHH", 0x5153, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
try:
    if how == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.sendto(q, (server, 53))
        r = s.recv(4096)
    else:
        s = socket.create_connection((server, 53), timeout=5)
        s.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", s.recv(2, socket.MSG_WAITALL))[0]
        r = s.recv(n, socket.MSG_WAITALL)
except (socket.timeout, TimeoutError, ConnectionError):
    print("no answer")
    sys.exit(0)
def skip(i):
    while r[i]:
        if r[i] & 0xC0:
            return i + 2
        i += 1 + r[i]
    return i + 1
i = skip(12) + 4
addrs = []
for _ in range(struct.unpack("!H", r[6:8])[0]):
    t, _, _, ln = struct.unpack("!HHIH", r[skip(i) : skip(i) + 10])
    i = skip(i) + 10
    if t == 1:
        addrs.append(socket.inet_ntoa(r[i : i + 4]))
    i += ln
print("rcode=%d a=%s" % (r[3] & 0xF, ",".join(addrs)))
"""


def probe(sbx: Sandbox, how: str, name: str, server: str = ELSEWHERE) -> str:
    return sbx.commands.run(f"/usr/bin/python3 /tmp/dnsprobe.py {how} {server} {name}").stdout.strip()


def prepared(sbx: Sandbox) -> Sandbox:
    sbx.files.write("/tmp/dnsprobe.py", PROBE)
    return sbx


def names_asked(entries: list[tuple[str, str, int]]) -> set[str]:
    return {name for _, name, _ in entries}


def gateway_of(sbx: Sandbox) -> str:
    """The sandbox's default gateway, from its routing table."""
    for line in sbx.commands.run("cat /proc/net/route").stdout.splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))
    raise AssertionError("no default route in the sandbox")


def assert_resolv_conf_names_the_gateway(sbx: Sandbox) -> None:
    servers = [
        line.split()[1]
        for line in sbx.commands.run("cat /etc/resolv.conf").stdout.splitlines()
        if line.startswith("nameserver")
    ]
    assert servers == [gateway_of(sbx)]


def assert_not_resolved(sbx: Sandbox, name: str) -> None:
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run(f"getent hosts {name}")
    # getent's 2: the key was not found
    assert (e.value.exit_code, e.value.stdout) == (2, ""), f"getent hosts {name}"


@pytest.fixture
def default_sbx(networked) -> Iterator[Sandbox]:
    s = Sandbox.create()
    try:
        yield prepared(s)
    finally:
        s.kill()


def test_default_sandbox_resolves_names_through_the_upstream(default_sbx, upstream):
    s = default_sbx
    assert_resolv_conf_names_the_gateway(s)
    r = s.commands.run("getent hosts allowed.example.test")
    assert r.stdout.split() == ["192.0.2.10", "allowed.example.test"]
    assert ("allowed.example.test", A) in {(n, t) for _, n, t in upstream.entries()}
    # a reverse lookup goes upstream too
    assert s.commands.run("getent hosts 192.0.2.10").stdout.split() == ["192.0.2.10", "allowed.example.test"]
    assert "10.2.0.192.in-addr.arpa" in names_asked(upstream.entries())
    assert probe(s, "gai", "open-gai.example.test") == "gai=192.0.2.11"
    # A query to another resolver's address gets the proxy's answer, from the upstream.
    assert probe(s, "udp", "open-udp.example.test") == "rcode=0 a=192.0.2.12"
    assert probe(s, "tcp", "open-tcp.example.test") == "rcode=0 a=192.0.2.13"
    assert {"open-gai.example.test", "open-udp.example.test", "open-tcp.example.test"} <= names_asked(
        upstream.entries()
    )
    # A name the upstream does not know is its NXDOMAIN, asked upstream.
    assert_not_resolved(s, "missing.example.test")
    assert "missing.example.test" in names_asked(upstream.entries())


def test_no_internet_access_means_no_name_resolution_at_all(networked, upstream):
    s = prepared(Sandbox.create(allow_internet_access=False))
    try:
        before = len(upstream.entries())
        assert_resolv_conf_names_the_gateway(s)
        assert_not_resolved(s, "closed.example.test")
        # nor the reverse lookup of an address
        assert_not_resolved(s, "192.0.2.20")
        assert probe(s, "gai", "closed-gai.example.test") == f"gai-error={socket.EAI_NONAME}"
        # Asking another resolver directly, over UDP and TCP, reaches only the proxy: NXDOMAIN.
        assert probe(s, "udp", "closed-udp.example.test") == "rcode=3 a="
        assert probe(s, "tcp", "closed-tcp.example.test") == "rcode=3 a="
        # Not one query of the sandbox reached the upstream.
        time.sleep(0.5)
        assert upstream.entries()[before:] == []
    finally:
        s.kill()


def test_allow_out_opens_one_domain_and_no_other(networked, upstream):
    s = prepared(Sandbox.create(network={"allow_out": ["only.example.test"]}, allow_internet_access=False))
    try:
        before = len(upstream.entries())
        assert s.commands.run("getent hosts only.example.test").stdout.split() == ["192.0.2.30", "only.example.test"]
        # a domain rule covers the names under it
        assert probe(s, "gai", "sub.only.example.test") == "gai=192.0.2.31"
        assert_not_resolved(s, "other.example.test")
        assert probe(s, "udp", "other.example.test") == "rcode=3 a="
        time.sleep(0.5)
        asked = upstream.entries()[before:]
        assert names_asked(asked) == {"only.example.test", "sub.only.example.test"}, asked
    finally:
        s.kill()
