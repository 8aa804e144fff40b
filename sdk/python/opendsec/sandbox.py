"""The sandbox handle: :class:`Sandbox`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Optional, Sequence, Union

import grpc
import grpc.aio

from opendsec import _args
from opendsec._pb import opendsec_pb2, runtime_pb2, types_pb2
from opendsec.errors import INVALID, UNAVAILABLE, DSecError, bad_arguments_are_invalid, error_from_rpc
from opendsec.models import FileInfo, HttpResult, ImageInfo, ShellResult
from opendsec.ports import PortWriter, open_port
from opendsec.watch import DirWatch

if TYPE_CHECKING:
    from opendsec.client import DSecClient

__all__ = ["Sandbox", "StreamItem", "FILE_CHUNK_BYTES"]

#: Bytes per call of :meth:`Sandbox.read_file` and :meth:`Sandbox.write_file`, which split
#: larger files into calls of this size. Our servers take up to 64 MiB per call, but a
#: message of 2 MiB also passes anything in between that keeps gRPC's default 4 MB limit,
#: and keeps the memory of each call small.
FILE_CHUNK_BYTES = 2 << 20
#: The most :meth:`Sandbox.read_file` returns by default (1 GiB): it holds the whole file in
#: memory, and a sparse file can be far larger than the sandbox's disk.
MAX_READ_BYTES = 1 << 30

#: What :meth:`Sandbox.stream_shell` yields: ``("stdout", bytes)``, ``("stderr", bytes)``,
#: then ``("exit", ShellResult)``.
StreamItem = tuple[str, Union[bytes, ShellResult]]


def _new_key() -> str:
    from opendsec.client import new_key

    return new_key()


@bad_arguments_are_invalid
class Sandbox:
    """A handle on one sandbox, returned by ``run_sandbox``, ``get_sandbox`` and the others.

    Attributes:
        info: The full record (protobuf ``Sandbox``) as last seen: ``project``,
            ``principal``, ``spec``, ``created_at``, ``last_active_at``, ``ended_at``,
            ``message``.
    """

    def __init__(self, client: "DSecClient", info: types_pb2.Sandbox) -> None:
        self._client = client
        self.info: types_pb2.Sandbox = info

    # ---------------------------------------------------------------- attributes

    @property
    def id(self) -> str:
        """The sandbox id, ``<edge-id>.<random>``."""
        return self.info.id

    @property
    def state(self) -> str:
        """The last seen state's name, e.g. ``"RUNNING"``; :meth:`refresh` updates it."""
        try:
            return types_pb2.SandboxState.Name(self.info.state)
        except ValueError:  # a state newer than this SDK
            return str(self.info.state)

    @property
    def edge_id(self) -> str:
        """The node it runs on now."""
        return self.info.edge_id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r}, edge_id={self.edge_id!r})"

    # ---------------------------------------------------------------- lifecycle

    async def _lifecycle(self, method: str) -> "Sandbox":
        self.info = await self._client._unary(method, opendsec_pb2.SandboxRef(id=self.id), retry=True)
        return self

    async def refresh(self) -> "Sandbox":
        """Fetches the record again; returns ``self``."""
        return await self._lifecycle("GetSandbox")

    async def stop(self) -> "Sandbox":
        """Stops the sandbox and cleans it up; its quota comes back at once."""
        return await self._lifecycle("StopSandbox")

    async def pause(self) -> "Sandbox":
        """Pauses the sandbox (a runtime call to it later resumes it)."""
        return await self._lifecycle("PauseSandbox")

    async def resume(self) -> "Sandbox":
        """Resumes a paused sandbox."""
        return await self._lifecycle("ResumeSandbox")

    async def touch(self) -> "Sandbox":
        """Resets the idle timer; resumes a paused sandbox."""
        return await self._lifecycle("TouchSandbox")

    async def set_timeout(self, timeout: int) -> "Sandbox":
        """Sets the lifetime to the sandbox's current age plus ``timeout`` seconds."""
        req = opendsec_pb2.SetSandboxTimeoutRequest(id=self.id, timeout_s=int(timeout))
        self.info = await self._client._unary("SetSandboxTimeout", req, retry=True)
        return self

    async def update_network(self, rules: dict[str, bool], replace: bool = False) -> "Sandbox":
        """Changes the sandbox's network rules (docs/network.md); returns ``self``, whose
        ``info.spec.network_rules`` are the rules now in force.

        ``rules`` maps each rule to ``True`` (allow) or ``False`` (take back), as
        ``DSecRunArgs.network_rules``. By default they are merged into the sandbox's current
        rules, a given rule replacing any spelling of the same rule; with ``replace=True``
        they replace the current rules entirely (``{}`` takes every one back; the cluster's
        default rules still apply). New allowances apply at once; taking one back also cuts
        the sandbox's open connections it allowed. Works on running and paused sandboxes.
        Needs ``sandbox.operate``. Not retried: on ``unavailable`` the caller decides (the
        same call again is harmless). Raises ``DSecError``: ``invalid`` (a malformed rule or
        an unknown rule set, named; more than 1024 rules; allowances on a node without sandbox
        networking), ``conflict`` (a stopped sandbox), ``forbidden``, ``not_found``.
        """
        req = opendsec_pb2.UpdateNetworkRequest(
            id=self.id, rules=_args.net_rules(rules), replace=_args.boolean("replace", replace)
        )
        self.info = await self._client._unary("UpdateNetwork", req, retry=False)
        return self

    # ---------------------------------------------------------------- images

    async def pack_diff(self, image: str, scrub: Sequence[str] = (), overwrite: bool = False) -> ImageInfo:
        """Saves the sandbox's file changes against its image as the new image ``image``.

        The new image is the sandbox's image with one layer more, and records it as ``parent``.
        The sandbox is frozen while its files are copied and runs on after. Build residue is
        left out: ``/tmp/*``, ``/var/tmp/*``, ``/root/.cache`` and shell and Python history,
        then ``scrub`` (globs relative to ``/``; ``*`` stops at ``/``). Container sandboxes of
        store images only. Needs ``sandbox.operate`` on the sandbox's project and
        ``layer.publish`` on the image's. Not retried. Raises ``DSecError``: ``conflict`` (the
        name exists, without ``overwrite``; a sandbox neither running nor paused),
        ``invalid`` (a bad name or glob, a node-local image, a device node in its files),
        ``forbidden``, ``not_found``, ``unavailable`` (the image store).
        """
        if isinstance(scrub, str):
            raise DSecError(INVALID, "scrub must be a list of globs, not one string")
        req = opendsec_pb2.PackDiffRequest(
            id=self.id, image=_args.text("image", image), scrub=[str(g) for g in scrub], overwrite=overwrite
        )
        return ImageInfo.from_pb(await self._client._unary("PackDiff", req, retry=False))

    async def create_snapshot(self, image: str, memory: bool = False, overwrite: bool = False) -> ImageInfo:
        """Saves the sandbox's files as they are (nothing scrubbed) as the new image ``image``.

        ``memory=True`` keeps memory too, which only microVMs have (a microVM needs it; on a
        container it is ``invalid``): sandboxes created from the image go on from this
        moment, with its processes running, and must ask for its ``memory_limit_mb`` (the
        returned image's). The sandbox stands still while its memory is copied, then goes
        on; a paused one stays paused. Deleting the image removes the saved memory; copies
        already made keep running. Permissions and errors as :meth:`pack_diff`. Not retried.
        """
        req = opendsec_pb2.CreateSnapshotRequest(
            id=self.id, image=_args.text("image", image), memory=bool(memory), overwrite=overwrite
        )
        return ImageInfo.from_pb(await self._client._unary("CreateSnapshot", req, retry=False))

    async def fork(
        self,
        count: int = 1,
        ttl_running_stop: int = 0,
        ttl_max: int = 0,
        labels: Optional[dict[str, str]] = None,
        task_id: str = "",
        timeout: Optional[float] = 600,
        idempotency_key: Optional[str] = None,
    ) -> list[Union["Sandbox", DSecError]]:
        """Copies this running (or paused) sandbox into ``count`` (1 to 256) running sandboxes.

        The source is frozen only while its writable layer (a microVM: its memory and disk)
        is copied, then carries on with its id and timeouts unchanged. The copies inherit its
        spec and files; a container's copies get no memory, a microVM's carry on from the
        moment of the fork with its processes running, each under its own name. ``labels``
        are added to theirs, ``task_id`` replaces the task
        ("" keeps the source's), ``ttl_running_stop`` and ``ttl_max`` are their timeouts in
        seconds (0 for the cluster default). Each copy is a creation in the source's project:
        it needs ``sandbox.create`` there and ``layer.use`` on the image's project, and counts
        against quota on its own. Forking itself needs ``sandbox.operate`` on the source.

        Returns a list in index order: a :class:`Sandbox` per copy made, a :class:`DSecError`
        per copy that failed (``no_capacity``, a quota, ...). The call carries an idempotency
        key (random unless given), so a retry after a lost connection makes only the copies
        still missing. Raises ``DSecError`` for the whole call: ``invalid`` (count, timeouts,
        a node-local image, a backend that cannot copy), ``forbidden``, ``not_found``,
        ``conflict`` (a source neither running nor paused), ``unavailable``.
        """
        from opendsec.client import _key

        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 256:
            raise DSecError(INVALID, f"count must be within 1..256, got {count!r}")
        req = opendsec_pb2.ForkSandboxRequest(
            id=self.id,
            count=count,
            labels=_args.labels(labels),
            task_id=_args.text("task_id", task_id),
            ttl_running_stop=_args.integer("ttl_running_stop", ttl_running_stop),
            ttl_max=_args.integer("ttl_max", ttl_max),
            idempotency_key=_key(idempotency_key),
        )
        return await self._client._stream_batch("ForkSandbox", req, count, timeout)

    # ---------------------------------------------------------------- commands

    def _shell_request(
        self,
        cmd: str,
        timeout: Optional[float],
        session: str,
        env: Optional[dict[str, str]],
        cwd: Optional[str],
        user: Optional[str],
        background: bool,
    ) -> runtime_pb2.RunShellRequest:
        return runtime_pb2.RunShellRequest(
            sandbox_id=self.id,
            cmd=_args.text("cmd", cmd),
            timeout=_args.optional_number("timeout", timeout),
            session=_args.session(session),
            env=_args.env(env),
            cwd=_args.optional_text("cwd", cwd),
            user=_args.optional_text("user", user),
            request_id=_new_key(),
            background=background,
        )

    async def run_shell(
        self,
        cmd: str,
        timeout: Optional[float] = None,
        session: str = "default",
        env: Optional[dict[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> ShellResult:
        """Runs a shell command in a session and returns its result when it ends.

        Args:
            cmd: A whole shell command (pipes, ``&&`` and so on work).
            timeout: Seconds; when it expires the command's processes are killed and
                ``timed_out`` is set. ``None``: no limit.
            session: Session name; ``cd`` and ``export`` carry over within a session.
            env, cwd: Environment variables and working directory for this command only.
            user: The session's user, fixed by its first command (name or ``uid[:gid]``).

        The request carries a request id: a retry after a lost connection never runs the
        command twice.
        """
        req = self._shell_request(cmd, timeout, session, env, cwd, user, background=False)
        return ShellResult.from_pb(await self._client._unary("RunShell", req, retry=True))

    async def run_shell_background(
        self,
        cmd: str,
        timeout: Optional[float] = None,
        session: str = "default",
        env: Optional[dict[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> int:
        """Starts a command and returns its number (``cmd_id``) at once; see :meth:`get_output`."""
        req = self._shell_request(cmd, timeout, session, env, cwd, user, background=True)
        res = await self._client._unary("RunShell", req, retry=True)
        return int(res.cmd_id)

    async def get_output(
        self,
        cmd_id: int,
        session: str = "default",
        wait: float = 0,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
    ) -> ShellResult:
        """Returns a command's recorded output, waiting up to ``wait`` seconds for it to end.

        ``stdout_offset`` and ``stderr_offset`` start from a byte position, for reading
        incrementally.
        """
        req = runtime_pb2.GetOutputRequest(
            sandbox_id=self.id,
            session=_args.session(session),
            cmd_id=int(cmd_id),
            wait=float(wait),
            stdout_offset=int(stdout_offset),
            stderr_offset=int(stderr_offset),
        )
        return ShellResult.from_pb(await self._client._unary("GetOutput", req, retry=True))

    async def stream_shell(
        self,
        cmd: str,
        timeout: Optional[float] = None,
        session: str = "default",
        env: Optional[dict[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> AsyncIterator[StreamItem]:
        """Runs a command and yields its output as it comes.

        Yields ``("stdout", bytes)`` and ``("stderr", bytes)`` chunks, then
        ``("exit", ShellResult)`` (a result without output). A broken connection resumes
        where it broke (``StreamOutput`` from the byte offsets received so far): the command
        keeps running in the sandbox and nothing is repeated or lost.
        """
        req = self._shell_request(cmd, timeout, session, env, cwd, user, background=False)
        pos = {"stdout": 0, "stderr": 0}
        cmd_id: Optional[int] = None
        client = self._client
        r = await client._retrier(True, None)
        while True:
            ep = r.pool.pick()
            if cmd_id is None:
                # Not started as far as we know: the same request id never runs it twice.
                call = ep.stub.StreamShell(req, metadata=client._metadata)
            else:
                resume = runtime_pb2.GetOutputRequest(
                    sandbox_id=self.id,
                    session=session,
                    cmd_id=cmd_id,
                    stdout_offset=pos["stdout"],
                    stderr_offset=pos["stderr"],
                )
                call = ep.stub.StreamOutput(resume, metadata=client._metadata)
            try:
                async for chunk in call:
                    r.progress()
                    kind = chunk.WhichOneof("kind")
                    if kind == "started":
                        cmd_id = chunk.started
                    elif kind == "stdout" or kind == "stderr":
                        data = bytes(getattr(chunk, kind))
                        start, have = chunk.offset, pos[kind]
                        end = start + len(data)
                        if end <= have:
                            continue  # already yielded
                        if start < have:
                            data = data[have - start:]
                        pos[kind] = end
                        yield kind, data
                    elif kind == "exit":
                        yield "exit", ShellResult.from_pb(chunk.exit)
                        return
                err = DSecError(UNAVAILABLE, "the output stream ended before the command's exit")
            except grpc.aio.AioRpcError as e:
                err = error_from_rpc(e)
            finally:
                call.cancel()
            await r.failed(err, ep)

    # ---------------------------------------------------------------- sessions

    async def list_sessions(self) -> list[str]:
        """The sandbox's session names."""
        req = runtime_pb2.ListSessionsRequest(sandbox_id=self.id)
        return list((await self._client._unary("ListSessions", req, retry=True)).sessions)

    async def close_session(self, session: str) -> None:
        """Ends a session, killing every process it started."""
        req = runtime_pb2.CloseSessionRequest(sandbox_id=self.id, session=_args.session(session))
        await self._client._unary("CloseSession", req, retry=True)

    # ---------------------------------------------------------------- files

    async def read_file(
        self,
        path: str,
        offset: int = 0,
        length: int = 0,
        session: str = "default",
        max_bytes: int = MAX_READ_BYTES,
    ) -> bytes:
        """Reads a file; ``length=0`` reads to the end. Past the end: ``b""``.

        Any size up to ``max_bytes`` (:data:`MAX_READ_BYTES` unless given) works: the file is
        read in calls of :data:`FILE_CHUNK_BYTES` each, one after the other. More than
        ``max_bytes`` to return is ``invalid`` before it is read (a sparse file can be far
        larger than the sandbox's disk): read it in pieces with ``offset`` and ``length``, or
        raise ``max_bytes``. A FIFO, socket or device is ``invalid`` ("not a regular file").
        """
        pos, length, limit = int(offset), int(length), int(max_bytes)
        if pos < 0 or length < 0:
            # One call: the server refuses it, naming the bad value.
            return await self._read_part(path, pos, length, session)

        def too_big(n: str) -> DSecError:
            return DSecError(
                INVALID,
                f"{path}: {n} bytes to read is over max_bytes {limit}: "
                "read it in pieces with offset and length, or raise max_bytes",
            )

        if length > limit:
            raise too_big(str(length))
        out = bytearray()
        sized = False
        while True:
            want = FILE_CHUNK_BYTES if length == 0 else min(FILE_CHUNK_BYTES, length - len(out))
            part = await self._read_part(path, pos, want, session)
            out += part
            pos += len(part)
            if len(part) < want or (length and len(out) == length):
                return bytes(out)
            if length == 0 and not sized:
                # More than one call's worth: how much is there?
                sized = True
                left = (await self.stat(path, session)).size - int(offset)
                if left > limit:
                    raise too_big(str(left))
            if len(out) > limit:
                raise too_big(f"more than {len(out)}")

    async def _read_part(self, path: str, offset: int, length: int, session: str) -> bytes:
        req = runtime_pb2.ReadFileRequest(
            sandbox_id=self.id, path=_args.path(path), offset=offset, length=length, session=_args.session(session)
        )
        return bytes((await self._client._unary("ReadFile", req, retry=True)).data)

    async def write_file(
        self,
        path: str,
        data: Union[bytes, bytearray, memoryview, str],
        mode: int = 0,
        append: bool = False,
        session: str = "default",
        metadata: Optional[dict[str, str]] = None,
    ) -> FileInfo:
        """Writes a file (``str`` is encoded as UTF-8). Not retried automatically.

        Any size (up to the sandbox's disk) works: more than :data:`FILE_CHUNK_BYTES` goes
        in several calls, the first replacing the file (or appending), the others writing
        at their offsets. A failure part way leaves the file partly written; writing it
        again from the start is safe. A full disk is ``invalid`` ("no space left on the
        sandbox's disk").

        Args:
            mode: Permission bits, e.g. ``0o755``; 0 for the default.
            append: Append instead of replacing.
            metadata: The file's metadata becomes exactly this (``{}`` clears it); ``None``
                keeps what it has. Keys and sizes: docs/python-sdk.md "File metadata";
                ``invalid`` when refused.
        """
        raw = _args.data(data)
        path = _args.path(path)
        session = _args.session(session)
        meta = _args.metadata(metadata)
        info: Optional[runtime_pb2.FileInfo] = None
        start = 0
        while info is None or start < len(raw):
            piece = raw[start : start + FILE_CHUNK_BYTES]
            req = runtime_pb2.WriteFileRequest(
                sandbox_id=self.id,
                path=path,
                data=bytes(piece),
                mode=int(mode),
                append=append,
                offset=0 if append else start,
                session=session,
                # The first piece carries it: the one that makes or replaces the file.
                metadata=meta if info is None and meta is not None else {},
                set_metadata=info is None and meta is not None,
            )
            info = await self._client._unary("WriteFile", req, retry=False)
            start += len(piece)
        return FileInfo.from_pb(info)

    async def list_dir(self, path: str, session: str = "default") -> list[FileInfo]:
        """Lists a directory."""
        req = runtime_pb2.PathRequest(sandbox_id=self.id, path=_args.path(path), session=_args.session(session))
        resp = await self._client._unary("ListDir", req, retry=True)
        return [FileInfo.from_pb(e) for e in resp.entries]

    async def stat(self, path: str, session: str = "default") -> FileInfo:
        """A file's information."""
        req = runtime_pb2.PathRequest(sandbox_id=self.id, path=_args.path(path), session=_args.session(session))
        return FileInfo.from_pb(await self._client._unary("Stat", req, retry=True))

    async def remove(self, path: str, recursive: bool = False, session: str = "default") -> None:
        """Removes a file; ``recursive=True`` removes a directory and its contents. Not retried."""
        req = runtime_pb2.RemoveRequest(
            sandbox_id=self.id, path=_args.path(path), recursive=bool(recursive), session=_args.session(session)
        )
        await self._client._unary("Remove", req, retry=False)

    def watch_dir(
        self,
        path: str,
        recursive: bool = False,
        include_entry: bool = False,
        allow_network_mounts: bool = False,
        session: str = "default",
        timeout: Optional[float] = 30,
    ) -> DirWatch:
        """Watches a directory for changes, by inotify in the sandbox (docs/python-sdk.md
        "Watching a directory"). Use the result in ``async with``, which returns once the
        watch is in place, and iterate it for :class:`FileEvent` s::

            async with sb.watch_dir("/work", recursive=True) as w:
                async for event in w:
                    ...

        Args:
            path: A directory; a relative one is resolved against the session's directory,
                as the session's user (who must be able to reach it).
            recursive: Also the directories below, those made later included.
            include_entry: Each event carries the entry's :class:`FileInfo` while it exists.
            allow_network_mounts: Watch a directory on NFS, CIFS or Ceph anyway (changes
                made on other machines go unseen); refused (``conflict``) otherwise.
            session: Whose directory and user resolve ``path``.
            timeout: Seconds for the watch to be in place; ``None`` for no limit.

        Raises:
            DSecError: ``invalid`` at once for bad arguments (an empty path, a NUL in it, a
                flag that is not a bool, a timeout not above 0); on entering the block,
                ``not_found`` (no such directory), ``invalid`` (not a directory),
                ``forbidden`` (the session's user may not list it), ``conflict`` (a network
                file system), ``quota_exceeded`` (the sandbox has 64 watches, or the tree
                has more than 16384 directories), ``timeout``.
        """
        try:
            req = runtime_pb2.WatchDirRequest(
                sandbox_id=self.id,
                path=_args.path(path),
                recursive=_args.boolean("recursive", recursive),
                include_entry=_args.boolean("include_entry", include_entry),
                allow_network_mounts=_args.boolean("allow_network_mounts", allow_network_mounts),
                session=_args.session(session),
            )
            if timeout is not None and not _args.number("timeout", timeout) > 0:
                raise ValueError(f"timeout must be above 0 or None, not {timeout!r}")
        except (TypeError, ValueError) as e:
            raise DSecError(INVALID, f"bad argument to watch_dir: {e}") from e
        return DirWatch(self._client, req, timeout)

    # ---------------------------------------------------------------- HTTP

    async def connect_port(
        self, port: int, timeout: Optional[float] = 30
    ) -> "tuple[asyncio.StreamReader, PortWriter]":
        """Opens a TCP connection to ``port`` on the sandbox's own loopback (a service that
        listens on 127.0.0.1 inside it) and returns an asyncio ``(reader, writer)`` pair once
        it is open (docs/network.md "Ports into a sandbox").

        The bytes travel through the apiserver and the edge in one ``ConnectPort`` call; the
        sandbox's network rules do not apply, and a paused sandbox is resumed. ``writer``
        is a ``PortWriter`` (``write``, ``drain``, ``write_eof``, ``close``,
        ``wait_closed``); ``reader`` is an ``asyncio.StreamReader`` that ends when the
        service closes its side. Needs ``sandbox.operate``. Not retried. Raises
        ``DSecError``: ``invalid`` (a port outside 1-65535; a backend that runs nothing),
        ``unavailable`` (nothing listens on the port), ``timeout`` (not connected within
        ``timeout`` seconds), ``conflict`` (a stopped sandbox), ``forbidden``,
        ``not_found``.
        """
        p = _args.integer("port", port)
        if not 1 <= p <= 65535:
            raise DSecError(INVALID, f"port: {p} is outside 1-65535")
        client = self._client
        pool = await client._get_pool()
        ep = await pool.pick_connected()
        return await open_port(ep.stub, client._metadata, self.id, p, timeout)

    async def http(
        self,
        url: str,
        method: str = "GET",
        headers: Optional[dict[str, str]] = None,
        body: Union[bytes, str] = b"",
        timeout: float = 30,
    ) -> HttpResult:
        """Makes an HTTP request from inside the sandbox's network namespace. Not retried."""
        raw = body.encode("utf-8") if isinstance(body, str) else bytes(body)
        req = runtime_pb2.HttpRequest(
            sandbox_id=self.id,
            url=url,
            method=method,
            headers={str(k): str(v) for k, v in (headers or {}).items()},
            body=raw,
            timeout=float(timeout),
        )
        resp = await self._client._unary("Http", req, retry=False)
        return HttpResult(status=resp.status, headers=dict(resp.headers), body=bytes(resp.body))
