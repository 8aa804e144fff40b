"""``Sandbox.connect_port``: a TCP connection to a port on a sandbox's loopback, carried by
one ``ConnectPort`` call (docs/network.md "Ports into a sandbox"), as an asyncio reader and
writer pair."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Optional

import grpc
import grpc.aio

from opendsec._pb import runtime_pb2
from opendsec.errors import INVALID, TIMEOUT, UNAVAILABLE, DSecError, error_from_rpc

#: The most bytes one frame carries (the server's frames are no larger).
MAX_FRAME = 64 * 1024
#: How long ``wait_closed`` waits for the sandbox's side to finish before cutting the call.
CLOSE_WAIT_S = 5.0


class PortWriter:
    """The sending half of ``Sandbox.connect_port``, shaped like ``asyncio.StreamWriter``.

    ``write`` queues bytes (sent in frames of at most 64 KiB, in order); ``write_eof``
    half-closes (the service in the sandbox reads end of file, and may still answer);
    ``close`` half-closes too, and ``wait_closed`` then waits for the sandbox's side to end
    (at most ``CLOSE_WAIT_S`` seconds) before ending the call.
    """

    def __init__(self, queue: "asyncio.Queue[Optional[runtime_pb2.PortFrame]]", call: grpc.aio.Call,
                 pump: "asyncio.Task[None]") -> None:
        self._queue = queue
        self._call = call
        self._pump = pump
        self._eof = False
        self._closing = False

    def write(self, data: bytes) -> None:
        """Queues ``data`` to send. Raises ``DSecError(INVALID)`` after ``write_eof``/``close``."""
        if self._eof:
            raise DSecError(INVALID, "write after write_eof or close")
        raw = bytes(data)
        for i in range(0, len(raw), MAX_FRAME):
            self._queue.put_nowait(runtime_pb2.PortFrame(data=raw[i:i + MAX_FRAME]))

    def writelines(self, lines: "list[bytes]") -> None:
        """Queues each of ``lines``, in order (see ``write``)."""
        for line in lines:
            self.write(line)

    def can_write_eof(self) -> bool:
        """Always ``True``: ``write_eof`` half-closes."""
        return True

    def write_eof(self) -> None:
        """Half-closes: sends end of file after what was written. Idempotent."""
        if not self._eof:
            self._eof = True
            self._queue.put_nowait(runtime_pb2.PortFrame(eof=True))
            self._queue.put_nowait(None)

    async def drain(self) -> None:
        """Waits until the queued frames are taken for sending (flow control is gRPC's)."""
        sent = asyncio.ensure_future(self._queue.join())
        try:
            await asyncio.wait({sent, self._pump}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sent.cancel()

    def close(self) -> None:
        """Half-closes (``write_eof``) and marks the writer closing; see ``wait_closed``."""
        self._closing = True
        self.write_eof()

    def is_closing(self) -> bool:
        """Whether ``close`` was called."""
        return self._closing

    async def wait_closed(self) -> None:
        """Waits for the connection to end (see the class doc), then ends the call."""
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._pump), CLOSE_WAIT_S)
        self._call.cancel()
        self._pump.cancel()


async def open_port(stub: object, metadata: object, sandbox_id: str, port: int,
                    timeout: Optional[float]) -> "tuple[asyncio.StreamReader, PortWriter]":
    """Starts a ``ConnectPort`` call on ``stub`` and waits for the sandbox's side to connect.
    Raises ``DSecError``: ``unavailable`` (nothing listens there), ``timeout``, and the
    call's other failures."""
    queue: "asyncio.Queue[Optional[runtime_pb2.PortFrame]]" = asyncio.Queue()
    queue.put_nowait(runtime_pb2.PortFrame(sandbox_id=sandbox_id, port=port))

    async def frames() -> AsyncIterator[runtime_pb2.PortFrame]:
        while True:
            f = await queue.get()
            queue.task_done()
            if f is None:
                return
            yield f

    call = stub.ConnectPort(frames(), metadata=metadata)  # type: ignore[attr-defined]
    connected: object = None
    try:
        connected = await asyncio.wait_for(call.read(), timeout)
    except grpc.aio.AioRpcError as e:
        raise error_from_rpc(e) from None
    except asyncio.TimeoutError:
        raise DSecError(TIMEOUT, f"port {port}: not connected within {timeout}s") from None
    finally:
        # A call that did not connect ends here, its request stream with it.
        if connected is None or connected is grpc.aio.EOF:
            queue.put_nowait(None)
            call.cancel()
    if connected is grpc.aio.EOF:
        raise DSecError(UNAVAILABLE, f"port {port}: the call ended before the connection opened")
    reader = asyncio.StreamReader()

    async def pump() -> None:
        try:
            while True:
                f = await call.read()
                if f is grpc.aio.EOF:
                    break
                if f.data:
                    reader.feed_data(bytes(f.data))
                if f.eof:
                    reader.feed_eof()
            if not reader.at_eof():
                reader.feed_eof()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                reader.set_exception(error_from_rpc(e))
            elif not reader.at_eof():
                reader.feed_eof()

    task = asyncio.get_running_loop().create_task(pump())
    return reader, PortWriter(queue, call, task)
