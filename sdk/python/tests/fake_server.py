"""An in-process fake of the DSec service for the SDK's unit tests.

It keeps just enough state to check what the SDK does on the wire: idempotency keys,
request ids, resume offsets, metadata. Errors carry ``google.rpc.ErrorInfo`` in the
``grpc-status-details-bin`` trailer exactly as the real server sends them.
"""

from __future__ import annotations

import collections
import socket
from typing import Optional

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from google.protobuf import message_factory

from opendsec._pb import opendsec_pb2, runtime_pb2, types_pb2

RUNNING = types_pb2.SandboxState.Value("RUNNING")
PAUSED = types_pb2.SandboxState.Value("PAUSED")
STOPPED = types_pb2.SandboxState.Value("STOPPED")
CREATING = types_pb2.SandboxState.Value("CREATING")


def rich_trailer(code: grpc.StatusCode, reason: str, message: str) -> tuple[tuple[str, bytes], ...]:
    """The ``grpc-status-details-bin`` trailer of a rich error with ErrorInfo.reason."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain="opendsec.io")
    detail = any_pb2.Any()
    detail.Pack(info)
    st = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (("grpc-status-details-bin", st.SerializeToString()),)


class Fault:
    """An error to return: a gRPC code, and a reason in ErrorInfo unless ``bare``."""

    def __init__(self, code: grpc.StatusCode, reason: str = "", message: str = "", bare: bool = False) -> None:
        self.code, self.reason, self.message, self.bare = code, reason, message, bare

    async def raise_in(self, context: grpc.aio.ServicerContext) -> None:
        md = () if self.bare else rich_trailer(self.code, self.reason, self.message)
        await context.abort(self.code, self.message, trailing_metadata=md)


UNAVAILABLE_FAULT = Fault(grpc.StatusCode.UNAVAILABLE, "unavailable", "apiserver restarting")


def add_to_server(servicer: object, server: grpc.aio.Server) -> None:
    """Registers the DSec methods `servicer` defines, built from the service descriptor.
    Methods it does not define are left out, so grpc answers them UNIMPLEMENTED."""
    service = opendsec_pb2.DESCRIPTOR.services_by_name["DSec"]
    handlers = {}
    for m in service.methods:
        fn = getattr(servicer, m.name, None)
        if fn is None:
            continue
        req = message_factory.GetMessageClass(m.input_type)
        resp = message_factory.GetMessageClass(m.output_type)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class FakeDSec:
    """The fake service. Tests set the knobs and read the records."""

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.calls: collections.Counter[str] = collections.Counter()
        self.metadata: list[dict[str, str]] = []
        # method -> faults returned (in order) before the method behaves normally
        self.faults: dict[str, list[Fault]] = collections.defaultdict(list)
        self.sandboxes: dict[str, types_pb2.Sandbox] = {}
        #: Edges ListSandboxes reports as not answering.
        self.unreachable_edges: list[str] = []
        self.create_keys: list[str] = []
        self.created_by_key: dict[str, str] = {}  # idempotency key -> sandbox id
        self.created_count = 0
        self.new_state = RUNNING  # the state new sandboxes are created in
        # batch
        self.batch_keys: list[str] = []
        self.batch_break_after: list[int] = []  # per attempt: items sent before breaking
        self.batch_item_errors: dict[int, tuple[str, str]] = {}
        self.batch_reverse = False
        # shell
        self.run_requests: list[runtime_pb2.RunShellRequest] = []
        self.executions: collections.Counter[str] = collections.Counter()  # request_id -> runs
        self.run_shell_fail_after_exec: int = 0  # RunShell: run, then fail with unavailable N times
        self.stream_chunks: list[tuple[str, bytes]] = []
        self.stream_break_after: list[int] = []  # per attempt: chunks sent before breaking
        self.stream_break_before_started = 0  # StreamShell attempts that break before `started`
        self.stream_resume_overlap = 0  # StreamOutput resends this many bytes before the offset
        self.stream_requests: list[tuple[str, object]] = []
        self.files: dict[str, bytes] = {}
        self.network_requests: list[opendsec_pb2.UpdateNetworkRequest] = []

    # ------------------------------------------------------------ helpers

    async def _enter(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] += 1
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        queue = self.faults.get(method)
        if queue:
            await queue.pop(0).raise_in(context)

    def _new_sandbox(self, spec: types_pb2.SandboxSpec, project: str) -> types_pb2.Sandbox:
        self.created_count += 1
        sid = f"{self.name}-edge.sb{self.created_count:05d}"
        sb = types_pb2.Sandbox(
            id=sid,
            project=project or "root",
            principal="admin",
            edge_id=f"{self.name}-edge",
            spec=spec,
            state=self.new_state,
        )
        self.sandboxes[sid] = sb
        return sb

    def _principal(self, context: grpc.aio.ServicerContext) -> str:
        for k, v in context.invocation_metadata():
            if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
                return v[len("Bearer "):].split(".")[1] if v.count(".") >= 2 else v[len("Bearer "):]
        return ""

    async def _get(self, sid: str, context: grpc.aio.ServicerContext) -> types_pb2.Sandbox:
        sb = self.sandboxes.get(sid)
        if sb is None:
            await Fault(grpc.StatusCode.NOT_FOUND, "not_found", f"no sandbox {sid}").raise_in(context)
        return sb

    # ------------------------------------------------------------ lifecycle

    async def CreateSandbox(self, request, context):
        await self._enter("CreateSandbox", context)
        self.create_keys.append(request.idempotency_key)
        sid = self.created_by_key.get(request.idempotency_key)
        if sid is None:
            sid = self._new_sandbox(request.spec, request.project).id
            self.created_by_key[request.idempotency_key] = sid
        faults = self.faults.get("CreateSandbox.after")
        if faults:  # created, but the answer is lost
            await faults.pop(0).raise_in(context)
        return self.sandboxes[sid]

    async def CreateSandboxes(self, request, context):
        await self._enter("CreateSandboxes", context)
        attempt = len(self.batch_keys)
        self.batch_keys.append(request.idempotency_key)
        limit = self.batch_break_after[attempt] if attempt < len(self.batch_break_after) else None
        order = range(request.count - 1, -1, -1) if self.batch_reverse else range(request.count)
        sent = 0
        for i in order:
            if limit is not None and sent >= limit:
                await UNAVAILABLE_FAULT.raise_in(context)
            key = f"{request.idempotency_key}/{i}"
            if i in self.batch_item_errors:
                reason, msg = self.batch_item_errors[i]
                yield opendsec_pb2.CreateSandboxesItem(index=i, error=types_pb2.ErrorDetail(reason=reason, message=msg))
            else:
                sid = self.created_by_key.get(key)
                if sid is None:
                    sid = self._new_sandbox(request.spec, request.project).id
                    self.created_by_key[key] = sid
                yield opendsec_pb2.CreateSandboxesItem(index=i, sandbox=self.sandboxes[sid])
            sent += 1

    async def GetSandbox(self, request, context):
        await self._enter("GetSandbox", context)
        return await self._get(request.id, context)

    async def ListSandboxes(self, request, context):
        await self._enter("ListSandboxes", context)
        out = [s for s in self.sandboxes.values() if not request.task_id or s.spec.task_id == request.task_id]
        return opendsec_pb2.ListSandboxesResponse(sandboxes=out, unreachable_edges=self.unreachable_edges)

    async def _set_state(self, method: str, request, context, state: int):
        await self._enter(method, context)
        sb = await self._get(request.id, context)
        sb.state = state
        return sb

    async def StopSandbox(self, request, context):
        return await self._set_state("StopSandbox", request, context, STOPPED)

    async def PauseSandbox(self, request, context):
        return await self._set_state("PauseSandbox", request, context, PAUSED)

    async def ResumeSandbox(self, request, context):
        return await self._set_state("ResumeSandbox", request, context, RUNNING)

    async def TouchSandbox(self, request, context):
        return await self._set_state("TouchSandbox", request, context, RUNNING)

    async def SetSandboxTimeout(self, request, context):
        await self._enter("SetSandboxTimeout", context)
        sb = await self._get(request.id, context)
        sb.spec.ttl_max = request.timeout_s
        return sb

    async def UpdateNetwork(self, request, context):
        await self._enter("UpdateNetwork", context)
        sb = await self._get(request.id, context)
        self.network_requests.append(request)
        if request.replace:
            sb.spec.network_rules.clear()
        sb.spec.network_rules.update(dict(request.rules))
        return sb

    async def PauseTask(self, request, context):
        await self._enter("PauseTask", context)
        n = 0
        for s in self.sandboxes.values():
            if s.spec.task_id == request.task_id:
                s.state = PAUSED
                n += 1
        return opendsec_pb2.TaskActionResult(affected=n)

    # ------------------------------------------------------------ runtime

    async def RunShell(self, request, context):
        await self._enter("RunShell", context)
        self.run_requests.append(request)
        first = self.executions[request.request_id] == 0
        if first:
            self.executions[request.request_id] += 1
        if self.run_shell_fail_after_exec > 0:
            self.run_shell_fail_after_exec -= 1
            await UNAVAILABLE_FAULT.raise_in(context)
        return runtime_pb2.ShellResult(cmd_id=1, exit_code=0, stdout=b"hi\n", done=True)

    def _chunks_from(self, out_off: int, err_off: int) -> list[runtime_pb2.ShellChunk]:
        """The recorded chunks from the given offsets on (overlapping back by the knob)."""
        res = []
        pos = {"stdout": 0, "stderr": 0}
        want = {"stdout": max(out_off - self.stream_resume_overlap, 0), "stderr": max(err_off - self.stream_resume_overlap, 0)}
        for kind, data in self.stream_chunks:
            start = pos[kind]
            pos[kind] += len(data)
            if pos[kind] <= want[kind]:
                continue
            cut = max(want[kind] - start, 0)
            res.append(runtime_pb2.ShellChunk(offset=start + cut, **{kind: data[cut:]}))
        return res

    def _exit_chunk(self) -> runtime_pb2.ShellChunk:
        return runtime_pb2.ShellChunk(exit=runtime_pb2.ShellResult(cmd_id=7, exit_code=3, done=True, duration=0.5))

    async def StreamShell(self, request, context):
        await self._enter("StreamShell", context)
        self.stream_requests.append(("StreamShell", request))
        if self.executions[request.request_id] == 0:
            self.executions[request.request_id] = 1  # a repeated request id is not run again
        attempt = len(self.stream_requests) - 1
        if self.stream_break_before_started > 0:
            self.stream_break_before_started -= 1
            await UNAVAILABLE_FAULT.raise_in(context)
        yield runtime_pb2.ShellChunk(started=7)
        limit = self.stream_break_after[attempt] if attempt < len(self.stream_break_after) else None
        for n, chunk in enumerate(self._chunks_from(0, 0)):
            if limit is not None and n >= limit:
                await UNAVAILABLE_FAULT.raise_in(context)
            yield chunk
        yield self._exit_chunk()

    async def StreamOutput(self, request, context):
        await self._enter("StreamOutput", context)
        self.stream_requests.append(("StreamOutput", request))
        attempt = len(self.stream_requests) - 1
        limit = self.stream_break_after[attempt] if attempt < len(self.stream_break_after) else None
        for n, chunk in enumerate(self._chunks_from(request.stdout_offset, request.stderr_offset)):
            if limit is not None and n >= limit:
                await UNAVAILABLE_FAULT.raise_in(context)
            yield chunk
        yield self._exit_chunk()

    async def WriteFile(self, request, context):
        await self._enter("WriteFile", context)
        old = self.files.get(request.path, b"")
        if request.append:
            data = old + request.data
        elif request.offset > 0:
            at = request.offset
            data = old[:at].ljust(at, b"\0") + request.data + old[at + len(request.data):]
        else:
            data = request.data
        self.files[request.path] = data
        return runtime_pb2.FileInfo(name=request.path.rsplit("/", 1)[-1], type="file", size=len(data), path=request.path)

    async def ReadFile(self, request, context):
        await self._enter("ReadFile", context)
        data = self.files.get(request.path)
        if data is None:
            await Fault(grpc.StatusCode.NOT_FOUND, "not_found", request.path).raise_in(context)
        end = len(data) if request.length == 0 else request.offset + request.length
        return runtime_pb2.ReadFileResponse(data=data[request.offset:end])

    async def Stat(self, request, context):
        await self._enter("Stat", context)
        data = self.files.get(request.path)
        if data is None:
            await Fault(grpc.StatusCode.NOT_FOUND, "not_found", request.path).raise_in(context)
        return runtime_pb2.FileInfo(path=request.path, type="file", size=len(data))

    async def Remove(self, request, context):
        await self._enter("Remove", context)
        self.files.pop(request.path, None)
        return types_pb2.Empty()

    async def Http(self, request, context):
        await self._enter("Http", context)
        return runtime_pb2.HttpResponse(status=200, headers={"x": "y"}, body=b"ok")

    # ------------------------------------------------------------ IAM

    async def WhoAmI(self, request, context):
        await self._enter("WhoAmI", context)
        return opendsec_pb2.WhoAmIResponse(principal=self._principal(context) or "anonymous")

    async def CreateProject(self, request, context):
        await self._enter("CreateProject", context)
        return opendsec_pb2.Project(path=f"{request.parent}/{request.name}", quota=dict(request.quota))

    async def GetUsage(self, request, context):
        await self._enter("GetUsage", context)
        return opendsec_pb2.UsageReport(
            rows=[opendsec_pb2.UsageRow(project=request.project, day="2026-01-01", sandboxes_started=3, sandbox_hours=1.5)]
        )


class FakeServer:
    """A running fake on 127.0.0.1 with a random port."""

    def __init__(self, name: str = "fake") -> None:
        self.service = FakeDSec(name)
        self.server: Optional[grpc.aio.Server] = None
        self.port = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> "FakeServer":
        self.server = grpc.aio.server()
        add_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)


def dead_addr() -> str:
    """A loopback address nothing listens on (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"
