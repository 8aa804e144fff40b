from opendsec._pb import types_pb2 as _types_pb2
from opendsec._pb import runtime_pb2 as _runtime_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSandboxRequest(_message.Message):
    __slots__ = ("spec", "project", "idempotency_key")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.SandboxSpec
    project: str
    idempotency_key: str
    def __init__(self, spec: _Optional[_Union[_types_pb2.SandboxSpec, _Mapping]] = ..., project: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CreateSandboxesRequest(_message.Message):
    __slots__ = ("spec", "project", "count", "idempotency_key")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.SandboxSpec
    project: str
    count: int
    idempotency_key: str
    def __init__(self, spec: _Optional[_Union[_types_pb2.SandboxSpec, _Mapping]] = ..., project: _Optional[str] = ..., count: _Optional[int] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CreateSandboxesItem(_message.Message):
    __slots__ = ("index", "sandbox", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    sandbox: _types_pb2.Sandbox
    error: _types_pb2.ErrorDetail
    def __init__(self, index: _Optional[int] = ..., sandbox: _Optional[_Union[_types_pb2.Sandbox, _Mapping]] = ..., error: _Optional[_Union[_types_pb2.ErrorDetail, _Mapping]] = ...) -> None: ...

class SandboxRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("project", "task_id", "include_ended")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ENDED_FIELD_NUMBER: _ClassVar[int]
    project: str
    task_id: str
    include_ended: bool
    def __init__(self, project: _Optional[str] = ..., task_id: _Optional[str] = ..., include_ended: bool = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes", "unreachable_edges")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_EDGES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[_types_pb2.Sandbox]
    unreachable_edges: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[_types_pb2.Sandbox, _Mapping]]] = ..., unreachable_edges: _Optional[_Iterable[str]] = ...) -> None: ...

class SetSandboxTimeoutRequest(_message.Message):
    __slots__ = ("id", "timeout_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_s: int
    def __init__(self, id: _Optional[str] = ..., timeout_s: _Optional[int] = ...) -> None: ...

class UpdateNetworkRequest(_message.Message):
    __slots__ = ("id", "rules", "replace")
    class RulesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bool
        def __init__(self, key: _Optional[str] = ..., value: bool = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    id: str
    rules: _containers.ScalarMap[str, bool]
    replace: bool
    def __init__(self, id: _Optional[str] = ..., rules: _Optional[_Mapping[str, bool]] = ..., replace: bool = ...) -> None: ...

class TaskRequest(_message.Message):
    __slots__ = ("project", "task_id")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    project: str
    task_id: str
    def __init__(self, project: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class TaskActionResult(_message.Message):
    __slots__ = ("affected", "failed", "errors")
    AFFECTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    affected: int
    failed: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, affected: _Optional[int] = ..., failed: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("principal", "project", "kind", "token_id")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    principal: str
    project: str
    kind: str
    token_id: str
    def __init__(self, principal: _Optional[str] = ..., project: _Optional[str] = ..., kind: _Optional[str] = ..., token_id: _Optional[str] = ...) -> None: ...

class Project(_message.Message):
    __slots__ = ("path", "quota", "usage", "policies", "children")
    class QuotaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class UsageEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PoliciesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PermissionList
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PermissionList, _Mapping]] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    path: str
    quota: _containers.ScalarMap[str, float]
    usage: _containers.ScalarMap[str, float]
    policies: _containers.MessageMap[str, PermissionList]
    children: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., quota: _Optional[_Mapping[str, float]] = ..., usage: _Optional[_Mapping[str, float]] = ..., policies: _Optional[_Mapping[str, PermissionList]] = ..., children: _Optional[_Iterable[str]] = ...) -> None: ...

class PermissionList(_message.Message):
    __slots__ = ("permissions",)
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    permissions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, permissions: _Optional[_Iterable[str]] = ...) -> None: ...

class ProjectRef(_message.Message):
    __slots__ = ("project",)
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    project: str
    def __init__(self, project: _Optional[str] = ...) -> None: ...

class CreateProjectRequest(_message.Message):
    __slots__ = ("parent", "name", "quota")
    class QuotaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    parent: str
    name: str
    quota: _containers.ScalarMap[str, float]
    def __init__(self, parent: _Optional[str] = ..., name: _Optional[str] = ..., quota: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("project", "quota")
    class QuotaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    project: str
    quota: _containers.ScalarMap[str, float]
    def __init__(self, project: _Optional[str] = ..., quota: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CreatePrincipalRequest(_message.Message):
    __slots__ = ("project", "principal_id", "kind", "ttl")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    project: str
    principal_id: str
    kind: str
    ttl: int
    def __init__(self, project: _Optional[str] = ..., principal_id: _Optional[str] = ..., kind: _Optional[str] = ..., ttl: _Optional[int] = ...) -> None: ...

class CreatePrincipalResponse(_message.Message):
    __slots__ = ("principal_id", "token", "token_info")
    PRINCIPAL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INFO_FIELD_NUMBER: _ClassVar[int]
    principal_id: str
    token: str
    token_info: TokenInfo
    def __init__(self, principal_id: _Optional[str] = ..., token: _Optional[str] = ..., token_info: _Optional[_Union[TokenInfo, _Mapping]] = ...) -> None: ...

class PrincipalRef(_message.Message):
    __slots__ = ("principal",)
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    principal: str
    def __init__(self, principal: _Optional[str] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("project", "principal", "permissions")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    project: str
    principal: str
    permissions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, project: _Optional[str] = ..., principal: _Optional[str] = ..., permissions: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenInfo(_message.Message):
    __slots__ = ("id", "principal", "created_at", "expires_at", "description", "created_by")
    ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    principal: str
    created_at: int
    expires_at: int
    description: str
    created_by: str
    def __init__(self, id: _Optional[str] = ..., principal: _Optional[str] = ..., created_at: _Optional[int] = ..., expires_at: _Optional[int] = ..., description: _Optional[str] = ..., created_by: _Optional[str] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("principal", "ttl", "description")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    principal: str
    ttl: int
    description: str
    def __init__(self, principal: _Optional[str] = ..., ttl: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class CreateTokenResponse(_message.Message):
    __slots__ = ("token", "info")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    token: str
    info: TokenInfo
    def __init__(self, token: _Optional[str] = ..., info: _Optional[_Union[TokenInfo, _Mapping]] = ...) -> None: ...

class ListTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class RevokeTokenRequest(_message.Message):
    __slots__ = ("principal", "token_id")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    principal: str
    token_id: str
    def __init__(self, principal: _Optional[str] = ..., token_id: _Optional[str] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("project", "start", "end", "daily")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    DAILY_FIELD_NUMBER: _ClassVar[int]
    project: str
    start: str
    end: str
    daily: bool
    def __init__(self, project: _Optional[str] = ..., start: _Optional[str] = ..., end: _Optional[str] = ..., daily: bool = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("project", "day", "sandboxes_started", "sandbox_hours", "cpu_core_hours", "memory_gb_hours", "gpu_hours")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    DAY_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_STARTED_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_HOURS_FIELD_NUMBER: _ClassVar[int]
    CPU_CORE_HOURS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_HOURS_FIELD_NUMBER: _ClassVar[int]
    GPU_HOURS_FIELD_NUMBER: _ClassVar[int]
    project: str
    day: str
    sandboxes_started: int
    sandbox_hours: float
    cpu_core_hours: float
    memory_gb_hours: float
    gpu_hours: float
    def __init__(self, project: _Optional[str] = ..., day: _Optional[str] = ..., sandboxes_started: _Optional[int] = ..., sandbox_hours: _Optional[float] = ..., cpu_core_hours: _Optional[float] = ..., memory_gb_hours: _Optional[float] = ..., gpu_hours: _Optional[float] = ...) -> None: ...

class UsageReport(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ...) -> None: ...

class DrainEdgeRequest(_message.Message):
    __slots__ = ("edge_id", "undo")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    undo: bool
    def __init__(self, edge_id: _Optional[str] = ..., undo: bool = ...) -> None: ...

class IamBackupResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class IamRestoreRequest(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ImageInfo(_message.Message):
    __slots__ = ("name", "layers", "env", "workdir", "user", "parent", "source", "created_at", "created_by", "snapshot", "memory", "labels", "memory_limit_mb")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.RepeatedScalarFieldContainer[str]
    workdir: str
    user: str
    parent: str
    source: str
    created_at: int
    created_by: str
    snapshot: bool
    memory: bool
    labels: _containers.ScalarMap[str, str]
    memory_limit_mb: int
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[_Iterable[str]] = ..., env: _Optional[_Iterable[str]] = ..., workdir: _Optional[str] = ..., user: _Optional[str] = ..., parent: _Optional[str] = ..., source: _Optional[str] = ..., created_at: _Optional[int] = ..., created_by: _Optional[str] = ..., snapshot: bool = ..., memory: bool = ..., labels: _Optional[_Mapping[str, str]] = ..., memory_limit_mb: _Optional[int] = ...) -> None: ...

class RegisterImageRequest(_message.Message):
    __slots__ = ("image", "overwrite", "dry_run")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    image: ImageInfo
    overwrite: bool
    dry_run: bool
    def __init__(self, image: _Optional[_Union[ImageInfo, _Mapping]] = ..., overwrite: bool = ..., dry_run: bool = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ("project",)
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    project: str
    def __init__(self, project: _Optional[str] = ...) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInfo]
    def __init__(self, images: _Optional[_Iterable[_Union[ImageInfo, _Mapping]]] = ...) -> None: ...

class ImageRef(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ComposeImageRequest(_message.Message):
    __slots__ = ("name", "parts", "env", "workdir", "user", "overwrite")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    name: str
    parts: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    workdir: str
    user: str
    overwrite: bool
    def __init__(self, name: _Optional[str] = ..., parts: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., user: _Optional[str] = ..., overwrite: bool = ...) -> None: ...

class PackDiffRequest(_message.Message):
    __slots__ = ("id", "image", "scrub", "overwrite")
    ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SCRUB_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    id: str
    image: str
    scrub: _containers.RepeatedScalarFieldContainer[str]
    overwrite: bool
    def __init__(self, id: _Optional[str] = ..., image: _Optional[str] = ..., scrub: _Optional[_Iterable[str]] = ..., overwrite: bool = ...) -> None: ...

class ForkSandboxRequest(_message.Message):
    __slots__ = ("id", "count", "labels", "task_id", "ttl_running_stop", "ttl_max", "idempotency_key")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_RUNNING_STOP_FIELD_NUMBER: _ClassVar[int]
    TTL_MAX_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    id: str
    count: int
    labels: _containers.ScalarMap[str, str]
    task_id: str
    ttl_running_stop: int
    ttl_max: int
    idempotency_key: str
    def __init__(self, id: _Optional[str] = ..., count: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., task_id: _Optional[str] = ..., ttl_running_stop: _Optional[int] = ..., ttl_max: _Optional[int] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CreateSnapshotRequest(_message.Message):
    __slots__ = ("id", "image", "memory", "overwrite")
    ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    id: str
    image: str
    memory: bool
    overwrite: bool
    def __init__(self, id: _Optional[str] = ..., image: _Optional[str] = ..., memory: bool = ..., overwrite: bool = ...) -> None: ...
