"""Plain data types of the SDK: creation arguments and the results of calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from opendsec import _args
from opendsec._pb import opendsec_pb2, runtime_pb2, types_pb2

__all__ = [
    "DSecRunArgs",
    "DSecContainerRunArgs",
    "ShellResult",
    "FileInfo",
    "HttpResult",
    "TaskActionResult",
    "Project",
    "TokenInfo",
    "UsageRow",
    "UsageReport",
    "ImageInfo",
]


@dataclass
class DSecRunArgs:
    """What to create: the arguments of :meth:`DSecClient.run_sandbox` and friends.

    The default backend, ``sim``, only simulates and runs nothing: always set ``backend``.
    Zero timeouts and sizes mean the cluster's defaults.
    """

    #: ``container``, ``microvm`` or ``sim`` (``fncall`` and ``fullvm`` are not built yet).
    backend: str = "sim"
    #: Image name: one the edges offer, e.g. ``host`` (the development image of
    #: ``cluster up``), or ``<project>/<name>:<tag>`` for a project's image.
    image: str = ""
    #: CPU cores; may be fractional.
    cpu_cores_limit: float = 1.0
    #: Memory (MB).
    memory_limit_mb: int = 2048
    #: Number of GPUs; GPU sandboxes are not built yet, so anything but 0 is ``invalid``.
    gpus: int = 0
    #: ``exclusive``, ``shared``, or ``""`` (the node decides).
    gpu_mode: str = ""
    #: Writable disk size (MB); 0 means the backend's default.
    disk_mb: int = 0
    #: Idle timeout (seconds); 0 means the cluster default.
    ttl_running_stop: int = 0
    #: Lifetime from creation (seconds), paused time included; 0 means the cluster default.
    ttl_max: int = 0
    #: Network rules (docs/network.md), e.g. ``{"pypi": True, "192.0.2.0/24:443": True,
    #: "*": False}``: what the sandbox may reach, on top of the cluster's default rules; a
    #: ``False`` takes a default back. Everything else is denied. ``invalid`` for a malformed
    #: rule, or on an edge whose sandbox networking is off.
    network_rules: dict[str, bool] = field(default_factory=dict)
    #: The sandbox's default user, also the sessions' default user; ``""``: the image's own
    #: (a Dockerfile's ``USER``), else ``root``.
    init_user: str = ""
    #: Task name, for task actions such as ``pause_task``.
    task_id: str = ""
    #: ``LS`` (latency-sensitive) or ``BE`` (best effort).
    qos: str = "LS"
    #: Arbitrary key-value labels, kept in the sandbox's spec.
    labels: dict[str, str] = field(default_factory=dict)
    #: The project to create in; ``None``: the client's project.
    project: Optional[str] = None
    #: Absolute paths made read-only in the sandbox (docs/containers.md).
    readonly_paths: list[str] = field(default_factory=list)
    #: Absolute paths hidden in the sandbox (an empty directory or file in their place).
    masked_paths: list[str] = field(default_factory=list)

    def _image(self) -> str:
        return self.image

    def to_spec(self) -> types_pb2.SandboxSpec:
        """Returns the protobuf ``SandboxSpec`` these arguments ask for."""
        return types_pb2.SandboxSpec(
            backend=_args.text("backend", self.backend),
            image=_args.text("image", self._image()),
            cpu_cores_limit=_args.number("cpu_cores_limit", self.cpu_cores_limit),
            memory_limit_mb=_args.integer("memory_limit_mb", self.memory_limit_mb),
            gpus=_args.integer("gpus", self.gpus),
            gpu_mode=_args.text("gpu_mode", self.gpu_mode),
            disk_mb=_args.integer("disk_mb", self.disk_mb),
            ttl_running_stop=_args.integer("ttl_running_stop", self.ttl_running_stop),
            ttl_max=_args.integer("ttl_max", self.ttl_max),
            network_rules=_args.net_rules(self.network_rules),
            init_user=_args.text("init_user", self.init_user),
            task_id=_args.text("task_id", self.task_id),
            qos=_args.text("qos", self.qos),
            labels=_args.labels(self.labels),
            readonly_paths=[_args.text("readonly path", p) for p in (self.readonly_paths or [])],
            masked_paths=[_args.text("masked path", p) for p in (self.masked_paths or [])],
        )


@dataclass
class DSecContainerRunArgs(DSecRunArgs):
    """:class:`DSecRunArgs` for containers: ``backend="container"`` by default, and a
    ``container_image`` field that replaces ``image`` when set."""

    backend: str = "container"
    #: The image to start from; replaces ``image`` when set.
    container_image: str = ""

    def _image(self) -> str:
        return self.container_image or self.image


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


@dataclass
class ShellResult:
    """The result of a shell command (``run_shell``, ``get_output``, the end of ``stream_shell``)."""

    #: The command's number in its session.
    cmd_id: int = 0
    #: Exit code.
    exit_code: int = 0
    #: Raw stdout bytes returned by this call.
    stdout_bytes: bytes = b""
    #: Raw stderr bytes returned by this call.
    stderr_bytes: bytes = b""
    #: Whether the command has ended.
    done: bool = False
    #: Whether it was killed by its timeout.
    timed_out: bool = False
    #: Run time (seconds).
    duration: float = 0.0
    #: The output exceeds what one call returns and was not all returned.
    truncated: bool = False
    #: Bytes dropped past the per-stream record limit.
    dropped_bytes: int = 0
    #: Where the returned stdout starts in the command's stdout.
    stdout_offset: int = 0
    #: Where the returned stderr starts in the command's stderr.
    stderr_offset: int = 0
    #: Stdout bytes recorded so far.
    stdout_total: int = 0
    #: Stderr bytes recorded so far.
    stderr_total: int = 0
    #: The kernel's OOM killer ended a process of the command (the sandbox's
    #: ``memory_limit_mb``): ``exit_code`` is then 137. A plain ``kill -9`` leaves it False.
    oom_killed: bool = False
    #: The session's directory and variables did not carry over across this command:
    #: either the command ended so that its session could not take in its changes (killed
    #: by its timeout, ``exec``, its shell killed; the next command runs with the state
    #: from before it), or it is the first command after the session's agent was killed
    #: from inside the sandbox, and ran in a fresh shell (docs/sessions.md).
    state_lost: bool = False

    @property
    def stdout(self) -> str:
        """Stdout decoded as UTF-8 (undecodable bytes become U+FFFD)."""
        return _decode(self.stdout_bytes)

    @property
    def stderr(self) -> str:
        """Stderr decoded as UTF-8 (undecodable bytes become U+FFFD)."""
        return _decode(self.stderr_bytes)

    @property
    def ok(self) -> bool:
        """``done and exit_code == 0 and not timed_out``."""
        return self.done and self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_pb(cls, m: runtime_pb2.ShellResult) -> "ShellResult":
        """Builds a result from the protobuf message."""
        return cls(
            cmd_id=m.cmd_id,
            exit_code=m.exit_code,
            stdout_bytes=bytes(m.stdout),
            stderr_bytes=bytes(m.stderr),
            done=m.done,
            timed_out=m.timed_out,
            duration=m.duration,
            truncated=m.truncated,
            dropped_bytes=m.dropped_bytes,
            stdout_offset=m.stdout_offset,
            stderr_offset=m.stderr_offset,
            stdout_total=m.stdout_total,
            stderr_total=m.stderr_total,
            oom_killed=m.oom_killed,
            state_lost=m.state_lost,
        )


@dataclass
class FileInfo:
    """A file's information (``stat``, ``list_dir``, ``write_file``)."""

    #: Base name.
    name: str = ""
    #: ``file``, ``dir``, ``symlink`` or ``other``.
    type: str = ""
    #: Size in bytes.
    size: int = 0
    #: Permission bits, e.g. ``0o644``.
    mode: int = 0
    #: Modification time (unix seconds).
    mtime: int = 0
    #: Absolute path, when the server sends it.
    path: str = ""
    #: The owner's name in the sandbox's /etc/passwd, else the uid as text.
    owner: str = ""
    #: The group's name in the sandbox's /etc/group, else the gid as text.
    group: str = ""
    #: A symlink's target as written; ``""`` for other types.
    symlink_target: str = ""
    #: The file's metadata (``user.e2b.*`` extended attributes), by key; see
    #: docs/python-sdk.md "File metadata".
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, m: runtime_pb2.FileInfo) -> "FileInfo":
        """Builds a FileInfo from the protobuf message."""
        return cls(
            name=m.name,
            type=m.type,
            size=m.size,
            mode=m.mode,
            mtime=m.mtime,
            path=m.path,
            owner=m.owner,
            group=m.group,
            symlink_target=m.symlink_target,
            metadata=dict(m.metadata),
        )


@dataclass
class FileEvent:
    """A change under a watched directory (:meth:`Sandbox.watch_dir`)."""

    #: The path relative to the watched directory; ``"."`` for the directory itself.
    name: str = ""
    #: ``create``, ``write``, ``remove``, ``rename`` (the old name; the new one comes as
    #: ``create``) or ``chmod`` (any change of attributes).
    type: str = ""
    #: The entry's information as of the event, with ``include_entry=True`` and while the
    #: entry exists; else ``None``.
    entry: Optional[FileInfo] = None

    @classmethod
    def from_pb(cls, m: runtime_pb2.FileEvent) -> "FileEvent":
        """Builds a FileEvent from the protobuf message."""
        return cls(name=m.name, type=m.type, entry=FileInfo.from_pb(m.entry) if m.HasField("entry") else None)


@dataclass
class HttpResult:
    """The response to :meth:`Sandbox.http`."""

    #: HTTP status code.
    status: int = 0
    #: Response headers.
    headers: dict[str, str] = field(default_factory=dict)
    #: Response body.
    body: bytes = b""


@dataclass
class TaskActionResult:
    """The result of ``pause_task``, ``resume_task`` and ``stop_task``."""

    #: Sandboxes the action succeeded on.
    affected: int = 0
    #: Sandboxes it failed on.
    failed: int = 0
    #: The failures, ``"<sandbox-id>: <reason>: <message>"`` each.
    errors: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: opendsec_pb2.TaskActionResult) -> "TaskActionResult":
        """Builds a result from the protobuf message."""
        return cls(affected=m.affected, failed=m.failed, errors=list(m.errors))


@dataclass
class Project:
    """A project: its quota, current usage, direct grants and subprojects."""

    #: Path, e.g. ``root/team-a``.
    path: str = ""
    #: Quota per key (``sandboxes``, ``cpu_cores``, ``memory_mb``, ``gpus``).
    quota: dict[str, float] = field(default_factory=dict)
    #: Current usage per key.
    usage: dict[str, float] = field(default_factory=dict)
    #: Principal -> permissions held directly on this project.
    policies: dict[str, list[str]] = field(default_factory=dict)
    #: Subproject paths.
    children: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: opendsec_pb2.Project) -> "Project":
        """Builds a Project from the protobuf message."""
        return cls(
            path=m.path,
            quota=dict(m.quota),
            usage=dict(m.usage),
            policies={k: list(v.permissions) for k, v in m.policies.items()},
            children=list(m.children),
        )


@dataclass
class TokenInfo:
    """A token's record, without its secret."""

    #: Token id.
    id: str = ""
    #: The principal it belongs to.
    principal: str = ""
    #: Creation time (unix seconds).
    created_at: int = 0
    #: Expiry (unix seconds); 0: never.
    expires_at: int = 0
    #: Free text given at creation.
    description: str = ""
    #: The principal that created it.
    created_by: str = ""

    @classmethod
    def from_pb(cls, m: opendsec_pb2.TokenInfo) -> "TokenInfo":
        """Builds a TokenInfo from the protobuf message."""
        return cls(
            id=m.id,
            principal=m.principal,
            created_at=m.created_at,
            expires_at=m.expires_at,
            description=m.description,
            created_by=m.created_by,
        )


@dataclass
class UsageRow:
    """One project's usage on one UTC day (or ``day == "total"``)."""

    #: Project path.
    project: str = ""
    #: ``YYYY-MM-DD`` or ``total``.
    day: str = ""
    #: Sandboxes started.
    sandboxes_started: int = 0
    #: Sandbox-hours (quota held, running and paused).
    sandbox_hours: float = 0.0
    #: CPU core-hours.
    cpu_core_hours: float = 0.0
    #: Memory GB-hours.
    memory_gb_hours: float = 0.0
    #: GPU-hours.
    gpu_hours: float = 0.0

    @classmethod
    def from_pb(cls, m: opendsec_pb2.UsageRow) -> "UsageRow":
        """Builds a row from the protobuf message."""
        return cls(
            project=m.project,
            day=m.day,
            sandboxes_started=m.sandboxes_started,
            sandbox_hours=m.sandbox_hours,
            cpu_core_hours=m.cpu_core_hours,
            memory_gb_hours=m.memory_gb_hours,
            gpu_hours=m.gpu_hours,
        )


@dataclass
class UsageReport:
    """The result of :meth:`DSecClient.get_usage`."""

    #: One row per project and day.
    rows: list[UsageRow] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: opendsec_pb2.UsageReport) -> "UsageReport":
        """Builds a report from the protobuf message."""
        return cls(rows=[UsageRow.from_pb(r) for r in m.rows])


@dataclass
class ImageInfo:
    """A store image (``<project>/<name>:<tag>``): its layers and the defaults of its sandboxes."""

    #: ``project/name:tag``.
    name: str = ""
    #: Layer digests (``sha256:<hex>``), bottom first.
    layers: list[str] = field(default_factory=list)
    #: ``KEY=value`` defaults, in order.
    env: list[str] = field(default_factory=list)
    #: Default working directory ("" = ``/``).
    workdir: str = ""
    #: Default user ("" = root).
    user: str = ""
    #: The image it was made from (``pack_diff``), if any.
    parent: str = ""
    #: Where it came from, for people.
    source: str = ""
    #: Registration time (unix seconds).
    created_at: int = 0
    #: The principal that registered it.
    created_by: str = ""
    #: Made by ``create_snapshot``.
    snapshot: bool = False
    #: A snapshot that includes a microVM's memory.
    memory: bool = False
    #: A memory snapshot's memory (MiB): sandboxes created from it must set
    #: ``memory_limit_mb`` to this (0 for other images).
    memory_limit_mb: int = 0
    #: What else is kept about it (a template built through the E2B gateway keeps its
    #: start and ready commands as ``e2b.start_cmd`` and ``e2b.ready_cmd``).
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, m: opendsec_pb2.ImageInfo) -> "ImageInfo":
        """Builds an ImageInfo from the protobuf message."""
        return cls(
            name=m.name,
            layers=list(m.layers),
            env=list(m.env),
            workdir=m.workdir,
            user=m.user,
            parent=m.parent,
            source=m.source,
            created_at=m.created_at,
            created_by=m.created_by,
            snapshot=m.snapshot,
            memory=m.memory,
            memory_limit_mb=m.memory_limit_mb,
            labels=dict(m.labels),
        )
