"""Directory watches (docs/python-sdk.md "Watching a directory"): :class:`DirWatch`, what
:meth:`Sandbox.watch_dir` returns, over one ``WatchDir`` call."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

import grpc
import grpc.aio

from opendsec._pb import runtime_pb2
from opendsec.errors import TIMEOUT, UNAVAILABLE, DSecError, error_from_rpc
from opendsec.models import FileEvent

if TYPE_CHECKING:
    from typing_extensions import Self

    from opendsec.client import DSecClient


class DirWatch:
    """A watch on a directory of a sandbox, used as an async context manager and iterated
    for :class:`FileEvent` s::

        async with sb.watch_dir("/work", recursive=True) as w:
            await sb.write_file("/work/a.txt", b"x")
            async for event in w:
                print(event.type, event.name)   # "create a.txt", "write a.txt"

    Entering the block returns once the watch is in place in the sandbox: every change
    after that is seen. Iteration ends when the directory itself is removed; leaving the
    block ends the watch. A broken connection raises ``DSecError`` (``unavailable``): the
    events of the gap cannot be replayed, so the watch is not resumed behind the caller's
    back; watch again to go on. The kernel dropping events (far more changes than read)
    raises ``unavailable`` too.
    """

    def __init__(self, client: "DSecClient", request: runtime_pb2.WatchDirRequest,
                 timeout: Optional[float]) -> None:
        self._client = client
        self._request = request
        self._timeout = timeout
        self._call: Optional["grpc.aio.UnaryStreamCall[runtime_pb2.WatchDirRequest, runtime_pb2.FileEvent]"] = None
        # Filled by a task of its own, so that a caller's timeout around one read (which
        # cancels what it awaits) does not cancel the call.
        self._queue: "asyncio.Queue[object]" = asyncio.Queue(maxsize=1024)
        self._pump: Optional[asyncio.Task[None]] = None

    async def __aenter__(self) -> Self:
        client = self._client
        ep = await (await client._get_pool()).pick_connected()
        call = ep.stub.WatchDir(self._request, metadata=client._metadata)
        self._call = call
        try:
            first = await asyncio.wait_for(call.read(), self._timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None
        except asyncio.TimeoutError:
            call.cancel()
            raise DSecError(TIMEOUT, f"watch {self._request.path}: not in place within {self._timeout}s") from None
        if first is grpc.aio.EOF or first.type != "start":
            call.cancel()
            raise DSecError(UNAVAILABLE, f"watch {self._request.path}: the call ended before the watch was in place")
        self._pump = asyncio.get_running_loop().create_task(self._run(call))
        return self

    async def _run(self, call: "grpc.aio.UnaryStreamCall[runtime_pb2.WatchDirRequest, runtime_pb2.FileEvent]") -> None:
        end: object = _END
        try:
            while True:
                m = await call.read()
                if not isinstance(m, runtime_pb2.FileEvent):
                    break  # the end of the stream (grpc.aio.EOF)
                await self._queue.put(FileEvent.from_pb(m))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                end = error_from_rpc(e)
        await self._queue.put(end)

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the watch (the sandbox drops it)."""
        if self._pump is not None:
            self._pump.cancel()
        if self._call is not None:
            self._call.cancel()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> FileEvent:
        """The next event. A plain coroutine, not a generator's step: a caller's timeout
        around it cancels only the wait, and the next call goes on where it left off."""
        if self._pump is None:
            raise DSecError(UNAVAILABLE, "the watch is not open: use it in `async with`")
        item = await self._queue.get()
        if item is _END:
            # Later calls end at once too.
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, DSecError):
            self._queue.put_nowait(_END)
            raise item
        return item  # type: ignore[return-value]


#: What the pump puts last in the queue of a watch that ended without an error.
_END = object()
