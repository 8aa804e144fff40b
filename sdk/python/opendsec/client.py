"""The OpenDsec client: :class:`DSecClient`."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import grpc
import grpc.aio

from opendsec import _transport
from opendsec._pb import opendsec_pb2, types_pb2
from opendsec._version import __version__
from opendsec.errors import INTERNAL, INVALID, UNAVAILABLE, DSecError, bad_arguments_are_invalid, error_from_rpc
from opendsec.models import (
    DSecRunArgs,
    ImageInfo,
    Project,
    TaskActionResult,
    TokenInfo,
    UsageReport,
)
from opendsec.sandbox import Sandbox

_log = logging.getLogger("opendsec")

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DSecClient", "DEFAULT_ADDR", "DEFAULT_PROJECT"]

#: Address used when neither ``endpoint`` nor ``OPENDSEC_ADDR`` is set.
DEFAULT_ADDR = "127.0.0.1:7100"
#: Project used when neither ``project`` nor ``OPENDSEC_PROJECT`` is set.
DEFAULT_PROJECT = "root"

_CREATING = types_pb2.SandboxState.Value("CREATING")
_FAILED = types_pb2.SandboxState.Value("FAILED")


def new_key() -> str:
    """A random idempotency key / request id (128 bits, hex)."""
    return secrets.token_hex(16)


def _key(idempotency_key: Optional[str]) -> str:
    """The caller's idempotency key, checked, or a random one."""
    if idempotency_key is None:
        return new_key()
    if not isinstance(idempotency_key, str) or not 1 <= len(idempotency_key) <= 256:
        raise DSecError(INVALID, "idempotency_key must be a string of 1 to 256 characters")
    return idempotency_key


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return v if v else None


#: Most sandboxes one batch creation may ask for (docs/concepts.md).
MAX_BATCH = 32768


def _perm_list(perms: Union[str, Sequence[str]]) -> list[str]:
    """Permissions as a list; one string is one permission (or a comma-separated list), never
    a sequence of letters."""
    if isinstance(perms, str):
        return [p.strip() for p in perms.split(",") if p.strip()]
    return list(perms)


@bad_arguments_are_invalid
class DSecClient:
    """An asynchronous connection to an OpenDsec cluster (its apiservers).

    Use it as an async context manager (``async with DSecClient() as c:``), or call
    :meth:`open` and :meth:`close` yourself. Every method is a coroutine.

    Args:
        endpoint: ``host:port`` of an apiserver, or several comma separated (calls are spread
            over them and move off one that goes down). Default: ``OPENDSEC_ADDR``, else
            ``127.0.0.1:7100``.
        token: The caller's credential ``dsk.…``, sent as ``authorization: Bearer <token>``.
            Default: ``OPENDSEC_TOKEN``, else none.
        project: Default project for creations, listings and task actions. Default:
            ``OPENDSEC_PROJECT``, else ``root``.
        ca_file: The cluster's CA certificate (PEM). Set, the client uses TLS; unset,
            plaintext. Default: ``OPENDSEC_CA``.
        server_name: The name the server certificate is checked against. Default: the
            address's host, or ``api.opendsec.internal`` with several addresses.
        retry_timeout: Seconds during which calls that the SDK retries keep retrying while
            a server is unreachable (``unavailable``). 0 disables retries.
    """

    def __init__(
        self,
        endpoint: Optional[str] = None,
        token: Optional[str] = None,
        project: Optional[str] = None,
        ca_file: Optional[str] = None,
        server_name: Optional[str] = None,
        retry_timeout: float = 60,
    ) -> None:
        self.endpoint: str = endpoint or _env("OPENDSEC_ADDR") or DEFAULT_ADDR
        self.addresses: list[str] = _transport.parse_addresses(self.endpoint)
        if not self.addresses:
            raise DSecError(INVALID, f"no apiserver address in {self.endpoint!r}")
        self.token: str = token if token is not None else (_env("OPENDSEC_TOKEN") or "")
        self.project: str = project or _env("OPENDSEC_PROJECT") or DEFAULT_PROJECT
        self.ca_file: Optional[str] = ca_file or _env("OPENDSEC_CA")
        if server_name is None and self.ca_file and len(self.addresses) > 1:
            server_name = _transport.DEFAULT_SERVER_NAME
        self.server_name: Optional[str] = server_name
        self.retry_timeout: float = float(retry_timeout or 0)
        self._pool: Optional[_transport.Pool] = None
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.token}"),) if self.token else ()
        )

    # ---------------------------------------------------------------- connection

    async def open(self) -> Self:
        """Creates the channels (one per address). Connections are made lazily by gRPC."""
        if self._pool is not None:
            return self
        creds = None
        if self.ca_file:
            # Off the event loop: the file may sit on a slow or network filesystem.
            ca = await asyncio.to_thread(Path(self.ca_file).read_bytes)
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
        opts = _transport.channel_options(f"opendsec-python/{__version__}", self.server_name if creds else None)
        eps = []
        for addr in self.addresses:
            if creds is not None:
                ch = grpc.aio.secure_channel(addr, creds, options=opts)
            else:
                ch = grpc.aio.insecure_channel(addr, options=opts)
            eps.append(_transport.Endpoint(addr, ch))
        self._pool = _transport.Pool(eps)
        return self

    async def close(self) -> None:
        """Closes every channel. Calls made afterwards open the client again."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"DSecClient(endpoint={self.endpoint!r}, project={self.project!r}, tls={bool(self.ca_file)})"

    async def _get_pool(self) -> _transport.Pool:
        if self._pool is None:
            await self.open()
        assert self._pool is not None
        return self._pool

    async def _retrier(self, retry: bool, timeout: Optional[float]) -> _transport.Retrier:
        return _transport.Retrier(await self._get_pool(), retry, self.retry_timeout, timeout)

    async def _unary(self, method: str, request: Any, *, retry: bool, timeout: Optional[float] = None) -> Any:
        """One unary call, retried on ``unavailable`` when ``retry`` (same request each time)."""
        r = await self._retrier(retry, timeout)
        while True:
            remaining = r.remaining()
            if retry:
                ep = r.pool.pick()
            else:  # not retried: connect first, so a dead address is skipped before sending
                wait = _transport.CONNECT_WAIT_S if remaining is None else min(_transport.CONNECT_WAIT_S, remaining)
                ep = await r.pool.pick_connected(wait)
                remaining = r.remaining()
            try:
                return await getattr(ep.stub, method)(request, timeout=remaining, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                err = error_from_rpc(e)
            await r.failed(err, ep)

    # ---------------------------------------------------------------- creation

    def _project(self, project: Optional[str]) -> str:
        return project or self.project

    async def run_sandbox(
        self, args: DSecRunArgs, timeout: Optional[float] = 120, idempotency_key: Optional[str] = None
    ) -> Sandbox:
        """Creates a sandbox and returns once it is ``RUNNING``.

        Retried while the server is unreachable (within ``retry_timeout``); the creation
        carries an idempotency key, so a retry returns the sandbox a lost first attempt
        created, never a second one. The key is random unless ``idempotency_key`` is given:
        a caller that restarts and asks again with its own key gets the sandbox it made
        before (while it lives), not a new one.

        Args:
            args: What to create.
            timeout: Limit for the whole creation (seconds); ``None`` for none. A sandbox
                still ``CREATING`` when it expires is stopped, not left behind.
            idempotency_key: 1 to 256 characters chosen by the caller; the same key with a
                different spec is ``conflict``.

        Raises:
            DSecError: e.g. ``quota_exceeded``, ``no_capacity``, ``invalid``, ``forbidden``,
                ``conflict``, ``timeout``.
        """
        req = opendsec_pb2.CreateSandboxRequest(
            spec=args.to_spec(), project=self._project(args.project), idempotency_key=_key(idempotency_key)
        )
        started = time.monotonic()
        info = await self._unary("CreateSandbox", req, retry=True, timeout=timeout)
        sb = Sandbox(self, info)
        try:
            await self._wait_created(sb, None if timeout is None else started + timeout)
        except DSecError as e:
            if e.reason == "timeout":
                # Nobody will get this sandbox: stop it rather than leave it holding quota.
                try:
                    await sb.stop()
                except DSecError:
                    pass
            raise
        return sb

    async def _wait_created(self, sb: Sandbox, deadline: Optional[float]) -> None:
        """Polls a sandbox the server returned while still ``CREATING`` until it is not."""
        delay = 0.05
        while sb.info.state == _CREATING:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DSecError("timeout", f"sandbox {sb.id} still CREATING when the timeout expired")
            await asyncio.sleep(delay if left is None else min(delay, left))
            delay = min(delay * 2, 1.0)
            await sb.refresh()
        if sb.info.state == _FAILED:
            raise DSecError(INTERNAL, f"sandbox {sb.id} failed: {sb.info.message}")

    async def run_container(
        self, args: DSecRunArgs, timeout: Optional[float] = 120, idempotency_key: Optional[str] = None
    ) -> Sandbox:
        """The same as :meth:`run_sandbox`, usually with :class:`DSecContainerRunArgs`."""
        return await self.run_sandbox(args, timeout=timeout, idempotency_key=idempotency_key)

    async def run_sandboxes(
        self,
        args: DSecRunArgs,
        count: int,
        timeout: Optional[float] = 600,
        idempotency_key: Optional[str] = None,
    ) -> list[Union[Sandbox, DSecError]]:
        """Creates ``count`` sandboxes of one spec (up to 32768) with one streamed call.

        Returns a list in index order: a :class:`Sandbox` for each success, a
        :class:`DSecError` for each failure (not raised). The call carries one idempotency
        key (random unless ``idempotency_key`` is given): after a broken stream it asks again
        with the same key, keeps the items it already has and fills in the missing ones, so
        only what is still missing gets created. A caller that restarts and asks again with
        its own key gets the sandboxes it made before (while they live); the same key with a
        different spec gives ``conflict`` items.

        Raises:
            DSecError: when the batch request itself fails (no permission, say) before any
                item arrived.
        """
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_BATCH:
            # Checked here too: the result list is allocated before the server could refuse.
            raise DSecError(INVALID, f"count must be within 1..{MAX_BATCH}, got {count!r}")
        req = opendsec_pb2.CreateSandboxesRequest(
            spec=args.to_spec(),
            project=self._project(args.project),
            count=count,
            idempotency_key=_key(idempotency_key),
        )
        return await self._stream_batch("CreateSandboxes", req, count, timeout)

    async def _stream_batch(
        self, method: str, req: Any, count: int, timeout: Optional[float]
    ) -> list[Union[Sandbox, DSecError]]:
        """Runs a streamed creation (``CreateSandboxes``, ``ForkSandbox``) of ``count`` items
        to the end: after a broken stream it asks again with the same request (and so the
        same idempotency key), keeping the items it has. Raises the last error when no item
        arrived at all; otherwise the missing items carry it."""
        results: list[Union[Sandbox, DSecError, None]] = [None] * count
        got = 0
        r = await self._retrier(True, timeout)
        while True:
            final: Optional[DSecError] = None
            try:
                remaining = r.remaining()
            except DSecError as e:
                final = e
            if final is None:
                ep = r.pool.pick()
                call = getattr(ep.stub, method)(req, timeout=remaining, metadata=self._metadata)
                try:
                    async for item in call:
                        r.progress()
                        i = item.index
                        if i >= count or results[i] is not None:
                            continue  # already received in an earlier attempt
                        if item.HasField("sandbox"):
                            results[i] = Sandbox(self, item.sandbox)
                        else:
                            results[i] = DSecError(item.error.reason or INTERNAL, item.error.message)
                        got += 1
                    err = DSecError(UNAVAILABLE, f"the {method} stream ended with {got} of {count} results")
                except grpc.aio.AioRpcError as e:
                    err = error_from_rpc(e)
                finally:
                    call.cancel()
                if got == count:
                    break
                try:
                    await r.failed(err, ep)
                    continue
                except DSecError as e:
                    final = e
            if got == 0:
                raise final
            for i, x in enumerate(results):
                if x is None:
                    results[i] = final
            break
        return results  # type: ignore[return-value]

    async def run_containers(
        self,
        args: DSecRunArgs,
        count: int,
        timeout: Optional[float] = 600,
        idempotency_key: Optional[str] = None,
    ) -> list[Union[Sandbox, DSecError]]:
        """The same as :meth:`run_sandboxes`."""
        return await self.run_sandboxes(args, count, timeout=timeout, idempotency_key=idempotency_key)

    # ---------------------------------------------------------------- queries

    async def get_sandbox(self, sandbox_id: str) -> Sandbox:
        """Looks a sandbox up by id (``not_found`` once its record is gone)."""
        info = await self._unary("GetSandbox", opendsec_pb2.SandboxRef(id=sandbox_id), retry=True)
        return Sandbox(self, info)

    async def list_sandboxes(
        self, task_id: str = "", include_ended: bool = False, project: Optional[str] = None
    ) -> list[Sandbox]:
        """Lists the sandboxes of a project and all its subprojects.

        Args:
            task_id: Only this task's sandboxes.
            include_ended: Include recently ended (``STOPPED``, ``FAILED``) ones.
            project: Default: the client's project.

        The sandboxes of an edge that does not answer (down, or unhealthy in the cluster's
        view) are missing from the list; the ``opendsec`` logger then warns, naming the edges.
        """
        req = opendsec_pb2.ListSandboxesRequest(
            project=self._project(project), task_id=task_id, include_ended=include_ended
        )
        resp = await self._unary("ListSandboxes", req, retry=True)
        if resp.unreachable_edges:
            _log.warning(
                "list_sandboxes: edges %s did not answer: their sandboxes are not listed",
                ", ".join(resp.unreachable_edges),
            )
        return [Sandbox(self, s) for s in resp.sandboxes]

    async def cluster_status(self) -> types_pb2.Snapshot:
        """The cluster snapshot (protobuf ``Snapshot``): each edge's state and capacity."""
        snap: types_pb2.Snapshot = await self._unary("ClusterStatus", types_pb2.Empty(), retry=True)
        return snap

    # ---------------------------------------------------------------- task actions

    async def _task(self, method: str, task_id: str, project: Optional[str]) -> TaskActionResult:
        req = opendsec_pb2.TaskRequest(project=self._project(project), task_id=task_id)
        return TaskActionResult.from_pb(await self._unary(method, req, retry=True))

    async def pause_task(self, task_id: str, project: Optional[str] = None) -> TaskActionResult:
        """Pauses every sandbox of the task."""
        return await self._task("PauseTask", task_id, project)

    async def resume_task(self, task_id: str, project: Optional[str] = None) -> TaskActionResult:
        """Resumes every paused sandbox of the task."""
        return await self._task("ResumeTask", task_id, project)

    async def stop_task(self, task_id: str, project: Optional[str] = None) -> TaskActionResult:
        """Stops every sandbox of the task."""
        return await self._task("StopTask", task_id, project)

    # ---------------------------------------------------------------- projects, principals, tokens
    # Management methods are never retried automatically: on failure the caller decides.

    async def whoami(self) -> str:
        """The principal of the current token."""
        resp = await self._unary("WhoAmI", types_pb2.Empty(), retry=False)
        return str(resp.principal)

    async def create_project(self, parent: str, name: str, quota: Optional[dict[str, float]] = None) -> Project:
        """Creates the subproject ``name`` of ``parent``; quota keys left out take the parent's limit."""
        req = opendsec_pb2.CreateProjectRequest(
            parent=parent, name=name, quota={k: float(v) for k, v in (quota or {}).items()}
        )
        return Project.from_pb(await self._unary("CreateProject", req, retry=False))

    async def get_project(self, project: Optional[str] = None) -> Project:
        """A project's quota, usage, direct grants and subprojects (default: the client's project)."""
        req = opendsec_pb2.ProjectRef(project=self._project(project))
        return Project.from_pb(await self._unary("GetProject", req, retry=False))

    async def set_quota(self, project: str, quota: dict[str, float]) -> Project:
        """Sets a project's quota, replaced as a whole; it may not exceed any ancestor's."""
        req = opendsec_pb2.SetQuotaRequest(project=project, quota={k: float(v) for k, v in quota.items()})
        return Project.from_pb(await self._unary("SetQuota", req, retry=False))

    async def delete_project(self, project: str) -> None:
        """Deletes an empty project (no subprojects, usage or principals of its own)."""
        await self._unary("DeleteProject", opendsec_pb2.ProjectRef(project=project), retry=False)

    async def create_principal(self, project: str, principal_id: str, kind: str = "agent", ttl: int = 0) -> str:
        """Creates a principal in ``project`` and returns its first token (returned only this once).

        Args:
            kind: ``user``, ``service`` or ``agent`` (a label only).
            ttl: The token's lifetime in seconds; 0 for the server default.
        """
        req = opendsec_pb2.CreatePrincipalRequest(project=project, principal_id=principal_id, kind=kind, ttl=int(ttl))
        resp = await self._unary("CreatePrincipal", req, retry=False)
        return str(resp.token)

    async def delete_principal(self, principal: str) -> None:
        """Deletes a principal and all its tokens."""
        await self._unary("DeletePrincipal", opendsec_pb2.PrincipalRef(principal=principal), retry=False)

    async def grant(self, project: str, principal: str, perms: Sequence[str]) -> Project:
        """Grants permissions (e.g. ``["sandbox.create", "sandbox.operate"]``) on ``project``."""
        req = opendsec_pb2.GrantRequest(project=project, principal=principal, permissions=_perm_list(perms))
        return Project.from_pb(await self._unary("Grant", req, retry=False))

    async def revoke(self, project: str, principal: str, perms: Sequence[str] = ()) -> Project:
        """Revokes permissions on ``project``; all of them when ``perms`` is empty."""
        req = opendsec_pb2.GrantRequest(project=project, principal=principal, permissions=_perm_list(perms))
        return Project.from_pb(await self._unary("Revoke", req, retry=False))

    async def create_token(
        self, principal: Optional[str] = None, ttl: int = 0, description: str = ""
    ) -> tuple[str, TokenInfo]:
        """Issues a token (by default for yourself); returns the secret and its record."""
        req = opendsec_pb2.CreateTokenRequest(principal=principal or "", ttl=int(ttl), description=description)
        resp = await self._unary("CreateToken", req, retry=False)
        return resp.token, TokenInfo.from_pb(resp.info)

    async def list_tokens(self, principal: Optional[str] = None) -> list[TokenInfo]:
        """A principal's tokens without their secrets (default: yourself)."""
        resp = await self._unary("ListTokens", opendsec_pb2.PrincipalRef(principal=principal or ""), retry=False)
        return [TokenInfo.from_pb(t) for t in resp.tokens]

    async def revoke_token(self, principal: str, token_id: str) -> None:
        """Revokes a token; it stops working on every apiserver within about a second."""
        req = opendsec_pb2.RevokeTokenRequest(principal=principal or "", token_id=token_id)
        await self._unary("RevokeToken", req, retry=False)

    async def list_images(self, project: Optional[str] = None) -> list[ImageInfo]:
        """The images of a project (default: the client's) and its subprojects, sorted by name.

        Needs ``layer.use`` on the project. Raises ``DSecError`` (``forbidden``, ``invalid``).
        """
        req = opendsec_pb2.ListImagesRequest(project=self._project(project))
        resp = await self._unary("ListImages", req, retry=True)
        return [ImageInfo.from_pb(i) for i in resp.images]

    async def get_image(self, name: str) -> ImageInfo:
        """One image, ``project/name:tag``. Needs ``layer.use`` on its project.

        Raises ``DSecError``: ``not_found``, ``forbidden``, ``invalid`` (a bad name, naming the part).
        """
        resp = await self._unary("GetImage", opendsec_pb2.ImageRef(name=name), retry=True)
        return ImageInfo.from_pb(resp)

    async def compose_image(
        self,
        name: str,
        parts: Sequence[str],
        env: Optional[dict[str, str]] = None,
        workdir: str = "",
        user: str = "",
        overwrite: bool = False,
    ) -> ImageInfo:
        """Stacks ``parts`` (images, bottom first) into the new image ``name``, copying no data.

        Later parts lie on top of earlier ones. Environment variables merge in order, ``env``
        last; ``workdir`` and ``user`` default to the topmost part's that sets them. Needs
        ``layer.publish`` on the new image's project and ``layer.use`` on each part's. Raises
        ``DSecError``: ``conflict`` (the name exists, without ``overwrite``), ``not_found``
        (a part), ``forbidden``, ``invalid``.
        """
        if isinstance(parts, str):
            raise DSecError(INVALID, "parts must be a list of image names, not one string")
        req = opendsec_pb2.ComposeImageRequest(
            name=name,
            parts=list(parts),
            env={str(k): str(v) for k, v in (env or {}).items()},
            workdir=workdir,
            user=user,
            overwrite=overwrite,
        )
        return ImageInfo.from_pb(await self._unary("ComposeImage", req, retry=False))

    async def delete_image(self, name: str) -> None:
        """Deletes an image's registration; ``opendsecctl image gc`` reclaims its layers. A
        memory snapshot's saved memory and disks go at once (sandboxes already created from
        it keep running).

        Needs ``layer.publish`` on its project. Raises ``DSecError``: ``not_found``, ``forbidden``.
        """
        await self._unary("DeleteImage", opendsec_pb2.ImageRef(name=name), retry=False)

    async def get_usage(
        self, project: Optional[str] = None, start: str = "", end: str = "", daily: bool = True
    ) -> UsageReport:
        """Usage of the project and its subprojects.

        Args:
            project: Default: the client's project.
            start, end: ``YYYY-MM-DD``, inclusive; empty for the server's default range.
            daily: One row per UTC day and project (default); ``False``: one row per project
                over the period, then a ``total`` row.
        """
        req = opendsec_pb2.GetUsageRequest(project=self._project(project), start=start, end=end, daily=daily)
        return UsageReport.from_pb(await self._unary("GetUsage", req, retry=False))
