"""Channels, address selection and the retry of ``unavailable`` (internal).

One ``grpc.aio`` channel per apiserver address. Calls go round-robin over the addresses
that are not known to be down; an address whose call failed with ``unavailable`` is skipped
until its channel has reconnected (``READY``), so calls move off a server that went down and
come back to it once it is up again. Retried calls move to the next address at once and,
once every address has failed, back off (100 ms doubling to 2 s) until ``retry_timeout``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional, Sequence

import grpc
import grpc.aio

from opendsec._pb import opendsec_pb2_grpc
from opendsec.errors import TIMEOUT, UNAVAILABLE, DSecError

MAX_MESSAGE_BYTES = 80 * 1024 * 1024
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0
DEFAULT_SERVER_NAME = "api.opendsec.internal"
CONNECT_WAIT_S = 5.0


def parse_addresses(endpoint: str) -> list[str]:
    """Splits a comma-separated address list, dropping blanks and an http(s):// prefix."""
    out: list[str] = []
    for part in endpoint.split(","):
        a = part.strip()
        for prefix in ("http://", "https://"):
            if a.startswith(prefix):
                a = a[len(prefix):]
        a = a.rstrip("/")
        if a:
            out.append(a)
    return out


def channel_options(user_agent: str, server_name: Optional[str]) -> list[tuple[str, object]]:
    """The channel arguments every connection uses (message size, keepalive, reconnects)."""
    opts: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_START_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX_S * 1000)),
        ("grpc.primary_user_agent", user_agent),
    ]
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
        opts.append(("grpc.default_authority", server_name))
    return opts


class Endpoint:
    """One apiserver address with its channel and stub."""

    def __init__(self, addr: str, channel: grpc.aio.Channel) -> None:
        self.addr = addr
        self.channel = channel
        self.stub = opendsec_pb2_grpc.DSecStub(channel)
        self.down = False

    def usable(self) -> bool:
        """Whether calls should go here: not failed, or reconnected since it failed."""
        if not self.down:
            # A channel that failed to connect on its own (no call of ours) counts as down too.
            return self.channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.TRANSIENT_FAILURE
        state = self.channel.get_state(try_to_connect=True)  # keeps it reconnecting meanwhile
        if state == grpc.ChannelConnectivity.READY:
            self.down = False
            return True
        return False


    async def connected(self, wait: float) -> bool:
        """Waits up to ``wait`` seconds for the channel to be ``READY``; False if it fails to connect."""
        deadline = time.monotonic() + wait
        state = self.channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.channel.wait_for_state_change(state), left)
            except asyncio.TimeoutError:
                return False
            state = self.channel.get_state(try_to_connect=True)
        self.down = False
        return True


class Pool:
    """The endpoints and the round-robin pick."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints:
            raise DSecError("invalid", "no apiserver address given")
        self.endpoints = list(endpoints)
        self._next = 0

    def pick(self) -> Endpoint:
        """The next usable endpoint in round-robin order; the next in order if none is usable."""
        n = len(self.endpoints)
        for i in range(n):
            ep = self.endpoints[(self._next + i) % n]
            if ep.usable():
                self._next = (self._next + i + 1) % n
                return ep
        ep = self.endpoints[self._next % n]
        self._next = (self._next + 1) % n
        return ep

    async def pick_connected(self, wait: float = CONNECT_WAIT_S) -> Endpoint:
        """Like :meth:`pick`, but first makes sure the endpoint's connection is up.

        For calls that are not retried: a call that fails because no connection could be
        made was never sent, so another address can safely be tried before sending it.
        An endpoint that cannot connect within ``wait`` seconds is marked down and the next
        one is tried; when none connects, the first pick is returned (and its call fails
        with ``unavailable``).
        """
        first: Optional[Endpoint] = None
        for _ in range(len(self.endpoints)):
            ep = self.pick()
            if first is None:
                first = ep
            elif ep is first:
                break
            if await ep.connected(wait):
                return ep
            ep.down = True
        assert first is not None
        return first

    async def close(self) -> None:
        """Closes every channel."""
        await asyncio.gather(*(ep.channel.close() for ep in self.endpoints), return_exceptions=True)


class Retrier:
    """The retry state of one logical call (which may span several RPCs).

    ``retry`` False: the first error is raised as is. Otherwise ``unavailable`` is retried:
    first on each other address at once, then after a backoff, until ``retry_timeout`` has
    passed since the call started or since it last made progress (``progress``).
    """

    def __init__(self, pool: Pool, retry: bool, retry_timeout: float, timeout: Optional[float]) -> None:
        self.pool = pool
        self.retry = retry and retry_timeout > 0
        self.retry_timeout = retry_timeout
        now = time.monotonic()
        self.deadline = None if timeout is None else now + timeout
        self.window_end = now + retry_timeout
        self.backoff = BACKOFF_START_S
        self.failovers = 0

    def remaining(self) -> Optional[float]:
        """Seconds left until the call's deadline (``None`` without one); raises ``timeout`` past it."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DSecError(TIMEOUT, "the call's timeout expired")
        return left

    def progress(self) -> None:
        """A message arrived: the retry window and the backoff start again."""
        self.window_end = time.monotonic() + self.retry_timeout
        self.backoff = BACKOFF_START_S
        self.failovers = 0

    async def failed(self, err: DSecError, ep: Optional[Endpoint]) -> None:
        """Called after a failed RPC: returns when the call should be tried again, else raises."""
        if err.reason != UNAVAILABLE:
            raise err
        if ep is not None:
            ep.down = True
        if not self.retry:
            raise err
        now = time.monotonic()
        if now >= self.window_end or (self.deadline is not None and now >= self.deadline):
            raise err
        self.failovers += 1
        if self.failovers < len(self.pool.endpoints):
            return  # another address, at once
        self.failovers = 0
        delay = min(self.backoff, self.window_end - now)
        if self.deadline is not None:
            delay = min(delay, self.deadline - now)
        await asyncio.sleep(max(delay, 0.0))
        self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
