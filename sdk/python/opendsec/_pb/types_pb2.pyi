from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[SandboxState]
    CREATING: _ClassVar[SandboxState]
    RUNNING: _ClassVar[SandboxState]
    PAUSING: _ClassVar[SandboxState]
    PAUSED: _ClassVar[SandboxState]
    RESUMING: _ClassVar[SandboxState]
    STOPPING: _ClassVar[SandboxState]
    STOPPED: _ClassVar[SandboxState]
    FAILED: _ClassVar[SandboxState]
STATE_UNSPECIFIED: SandboxState
CREATING: SandboxState
RUNNING: SandboxState
PAUSING: SandboxState
PAUSED: SandboxState
RESUMING: SandboxState
STOPPING: SandboxState
STOPPED: SandboxState
FAILED: SandboxState

class SandboxSpec(_message.Message):
    __slots__ = ("backend", "image", "cpu_cores_limit", "memory_limit_mb", "gpus", "gpu_mode", "disk_mb", "ttl_running_stop", "ttl_max", "network_rules", "init_user", "task_id", "qos", "labels", "ttl_paused_s", "readonly_paths", "masked_paths")
    class NetworkRulesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bool
        def __init__(self, key: _Optional[str] = ..., value: bool = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MODE_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    TTL_RUNNING_STOP_FIELD_NUMBER: _ClassVar[int]
    TTL_MAX_FIELD_NUMBER: _ClassVar[int]
    NETWORK_RULES_FIELD_NUMBER: _ClassVar[int]
    INIT_USER_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TTL_PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    READONLY_PATHS_FIELD_NUMBER: _ClassVar[int]
    MASKED_PATHS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    image: str
    cpu_cores_limit: float
    memory_limit_mb: int
    gpus: int
    gpu_mode: str
    disk_mb: int
    ttl_running_stop: int
    ttl_max: int
    network_rules: _containers.ScalarMap[str, bool]
    init_user: str
    task_id: str
    qos: str
    labels: _containers.ScalarMap[str, str]
    ttl_paused_s: int
    readonly_paths: _containers.RepeatedScalarFieldContainer[str]
    masked_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, backend: _Optional[str] = ..., image: _Optional[str] = ..., cpu_cores_limit: _Optional[float] = ..., memory_limit_mb: _Optional[int] = ..., gpus: _Optional[int] = ..., gpu_mode: _Optional[str] = ..., disk_mb: _Optional[int] = ..., ttl_running_stop: _Optional[int] = ..., ttl_max: _Optional[int] = ..., network_rules: _Optional[_Mapping[str, bool]] = ..., init_user: _Optional[str] = ..., task_id: _Optional[str] = ..., qos: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., ttl_paused_s: _Optional[int] = ..., readonly_paths: _Optional[_Iterable[str]] = ..., masked_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("id", "project", "principal", "edge_id", "spec", "state", "created_at", "last_active_at", "ended_at", "message", "lease_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    project: str
    principal: str
    edge_id: str
    spec: SandboxSpec
    state: SandboxState
    created_at: int
    last_active_at: int
    ended_at: int
    message: str
    lease_id: str
    def __init__(self, id: _Optional[str] = ..., project: _Optional[str] = ..., principal: _Optional[str] = ..., edge_id: _Optional[str] = ..., spec: _Optional[_Union[SandboxSpec, _Mapping]] = ..., state: _Optional[_Union[SandboxState, str]] = ..., created_at: _Optional[int] = ..., last_active_at: _Optional[int] = ..., ended_at: _Optional[int] = ..., message: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("cpu_cores", "memory_mb", "gpus", "disk_mb", "sandboxes")
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    cpu_cores: float
    memory_mb: int
    gpus: int
    disk_mb: int
    sandboxes: int
    def __init__(self, cpu_cores: _Optional[float] = ..., memory_mb: _Optional[int] = ..., gpus: _Optional[int] = ..., disk_mb: _Optional[int] = ..., sandboxes: _Optional[int] = ...) -> None: ...

class EdgeState(_message.Message):
    __slots__ = ("id", "addr", "healthy", "draining", "zone", "backends", "capacity", "allocated", "sandboxes_by_backend", "max_sandboxes", "mem_available_mb", "disk_available_mb", "under_pressure", "pressure_reason", "cpu_usage", "mem_usage", "images", "last_seen", "consecutive_failures", "version", "admitted_seq", "incarnation", "memory_charges")
    class SandboxesByBackendEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MaxSandboxesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemoryChargesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: MemoryCharge
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[MemoryCharge, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_BY_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    MEM_AVAILABLE_MB_FIELD_NUMBER: _ClassVar[int]
    DISK_AVAILABLE_MB_FIELD_NUMBER: _ClassVar[int]
    UNDER_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_REASON_FIELD_NUMBER: _ClassVar[int]
    CPU_USAGE_FIELD_NUMBER: _ClassVar[int]
    MEM_USAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CHARGES_FIELD_NUMBER: _ClassVar[int]
    id: str
    addr: str
    healthy: bool
    draining: bool
    zone: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    capacity: Resources
    allocated: Resources
    sandboxes_by_backend: _containers.ScalarMap[str, int]
    max_sandboxes: _containers.ScalarMap[str, int]
    mem_available_mb: int
    disk_available_mb: int
    under_pressure: bool
    pressure_reason: str
    cpu_usage: float
    mem_usage: float
    images: _containers.RepeatedScalarFieldContainer[str]
    last_seen: int
    consecutive_failures: int
    version: str
    admitted_seq: int
    incarnation: str
    memory_charges: _containers.MessageMap[str, MemoryCharge]
    def __init__(self, id: _Optional[str] = ..., addr: _Optional[str] = ..., healthy: bool = ..., draining: bool = ..., zone: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ..., capacity: _Optional[_Union[Resources, _Mapping]] = ..., allocated: _Optional[_Union[Resources, _Mapping]] = ..., sandboxes_by_backend: _Optional[_Mapping[str, int]] = ..., max_sandboxes: _Optional[_Mapping[str, int]] = ..., mem_available_mb: _Optional[int] = ..., disk_available_mb: _Optional[int] = ..., under_pressure: bool = ..., pressure_reason: _Optional[str] = ..., cpu_usage: _Optional[float] = ..., mem_usage: _Optional[float] = ..., images: _Optional[_Iterable[str]] = ..., last_seen: _Optional[int] = ..., consecutive_failures: _Optional[int] = ..., version: _Optional[str] = ..., admitted_seq: _Optional[int] = ..., incarnation: _Optional[str] = ..., memory_charges: _Optional[_Mapping[str, MemoryCharge]] = ...) -> None: ...

class MemoryCharge(_message.Message):
    __slots__ = ("floor_mb", "overhead_mb")
    FLOOR_MB_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MB_FIELD_NUMBER: _ClassVar[int]
    floor_mb: int
    overhead_mb: int
    def __init__(self, floor_mb: _Optional[int] = ..., overhead_mb: _Optional[int] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("version", "generated_at", "edges")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATED_AT_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    version: int
    generated_at: int
    edges: _containers.RepeatedCompositeFieldContainer[EdgeState]
    def __init__(self, version: _Optional[int] = ..., generated_at: _Optional[int] = ..., edges: _Optional[_Iterable[_Union[EdgeState, _Mapping]]] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id", "project", "principal", "resources", "edge_id", "sandbox_id", "created_at", "bound_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    BOUND_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    project: str
    principal: str
    resources: Resources
    edge_id: str
    sandbox_id: str
    created_at: int
    bound_at: int
    def __init__(self, lease_id: _Optional[str] = ..., project: _Optional[str] = ..., principal: _Optional[str] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., edge_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., created_at: _Optional[int] = ..., bound_at: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
