from opendsec._pb import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunShellRequest(_message.Message):
    __slots__ = ("sandbox_id", "cmd", "timeout", "session", "env", "cwd", "user", "request_id", "background")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    cmd: str
    timeout: float
    session: str
    env: _containers.ScalarMap[str, str]
    cwd: str
    user: str
    request_id: str
    background: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., cmd: _Optional[str] = ..., timeout: _Optional[float] = ..., session: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ..., request_id: _Optional[str] = ..., background: bool = ...) -> None: ...

class ShellResult(_message.Message):
    __slots__ = ("cmd_id", "exit_code", "stdout", "stderr", "done", "timed_out", "duration", "truncated", "dropped_bytes", "stdout_offset", "stderr_offset", "stdout_total", "stderr_total", "oom_killed", "state_lost")
    CMD_ID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    cmd_id: int
    exit_code: int
    stdout: bytes
    stderr: bytes
    done: bool
    timed_out: bool
    duration: float
    truncated: bool
    dropped_bytes: int
    stdout_offset: int
    stderr_offset: int
    stdout_total: int
    stderr_total: int
    oom_killed: bool
    state_lost: bool
    def __init__(self, cmd_id: _Optional[int] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., done: bool = ..., timed_out: bool = ..., duration: _Optional[float] = ..., truncated: bool = ..., dropped_bytes: _Optional[int] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ..., stdout_total: _Optional[int] = ..., stderr_total: _Optional[int] = ..., oom_killed: bool = ..., state_lost: bool = ...) -> None: ...

class GetOutputRequest(_message.Message):
    __slots__ = ("sandbox_id", "session", "cmd_id", "wait", "stdout_offset", "stderr_offset")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CMD_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    session: str
    cmd_id: int
    wait: float
    stdout_offset: int
    stderr_offset: int
    def __init__(self, sandbox_id: _Optional[str] = ..., session: _Optional[str] = ..., cmd_id: _Optional[int] = ..., wait: _Optional[float] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ...) -> None: ...

class ShellChunk(_message.Message):
    __slots__ = ("stdout", "stderr", "exit", "started", "offset")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit: ShellResult
    started: int
    offset: int
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[ShellResult, _Mapping]] = ..., started: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sessions: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("sandbox_id", "session")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    session: str
    def __init__(self, sandbox_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "type", "size", "mode", "mtime", "path", "owner", "group", "symlink_target", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SYMLINK_TARGET_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    size: int
    mode: int
    mtime: int
    path: str
    owner: str
    group: str
    symlink_target: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., mtime: _Optional[int] = ..., path: _Optional[str] = ..., owner: _Optional[str] = ..., group: _Optional[str] = ..., symlink_target: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "offset", "length", "session", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    offset: int
    length: int
    session: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., session: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "data", "mode", "append", "session", "offset", "metadata", "set_metadata", "user")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SET_METADATA_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    data: bytes
    mode: int
    append: bool
    session: str
    offset: int
    metadata: _containers.ScalarMap[str, str]
    set_metadata: bool
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ..., append: bool = ..., session: _Optional[str] = ..., offset: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., set_metadata: bool = ..., user: _Optional[str] = ...) -> None: ...

class PathRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "session", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    session: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., session: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class ListDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class WatchDirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "recursive", "include_entry", "allow_network_mounts", "session", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ENTRY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NETWORK_MOUNTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    recursive: bool
    include_entry: bool
    allow_network_mounts: bool
    session: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., recursive: bool = ..., include_entry: bool = ..., allow_network_mounts: bool = ..., session: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class FileEvent(_message.Message):
    __slots__ = ("name", "type", "entry")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    entry: FileInfo
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., entry: _Optional[_Union[FileInfo, _Mapping]] = ...) -> None: ...

class WatcherRef(_message.Message):
    __slots__ = ("sandbox_id", "watcher_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    watcher_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., watcher_id: _Optional[str] = ...) -> None: ...

class WatcherEvents(_message.Message):
    __slots__ = ("events", "dropped")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[FileEvent]
    dropped: int
    def __init__(self, events: _Optional[_Iterable[_Union[FileEvent, _Mapping]]] = ..., dropped: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "recursive", "session", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    recursive: bool
    session: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., recursive: bool = ..., session: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("sandbox_id", "source", "destination", "session", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    source: str
    destination: str
    session: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., source: _Optional[str] = ..., destination: _Optional[str] = ..., session: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class HttpRequest(_message.Message):
    __slots__ = ("sandbox_id", "url", "method", "headers", "body", "timeout")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    url: str
    method: str
    headers: _containers.ScalarMap[str, str]
    body: bytes
    timeout: float
    def __init__(self, sandbox_id: _Optional[str] = ..., url: _Optional[str] = ..., method: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., body: _Optional[bytes] = ..., timeout: _Optional[float] = ...) -> None: ...

class HttpResponse(_message.Message):
    __slots__ = ("status", "headers", "body")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    status: int
    headers: _containers.ScalarMap[str, str]
    body: bytes
    def __init__(self, status: _Optional[int] = ..., headers: _Optional[_Mapping[str, str]] = ..., body: _Optional[bytes] = ...) -> None: ...

class PortFrame(_message.Message):
    __slots__ = ("sandbox_id", "port", "data", "eof")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    data: bytes
    eof: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., data: _Optional[bytes] = ..., eof: bool = ...) -> None: ...

class StartProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "cmd", "args", "env", "cwd", "user", "tag", "stdin", "pty", "pty_cols", "pty_rows", "request_id")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    PTY_COLS_FIELD_NUMBER: _ClassVar[int]
    PTY_ROWS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    cmd: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    user: str
    tag: str
    stdin: bool
    pty: bool
    pty_cols: int
    pty_rows: int
    request_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., cmd: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ..., tag: _Optional[str] = ..., stdin: bool = ..., pty: bool = ..., pty_cols: _Optional[int] = ..., pty_rows: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ProcessRef(_message.Message):
    __slots__ = ("sandbox_id", "pid", "tag")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    pid: int
    tag: str
    def __init__(self, sandbox_id: _Optional[str] = ..., pid: _Optional[int] = ..., tag: _Optional[str] = ...) -> None: ...

class ConnectProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "process", "stdout_offset", "stderr_offset", "live")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process: ProcessRef
    stdout_offset: int
    stderr_offset: int
    live: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., process: _Optional[_Union[ProcessRef, _Mapping]] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ..., live: bool = ...) -> None: ...

class ProcessEvent(_message.Message):
    __slots__ = ("start_pid", "stdout", "stderr", "pty", "end", "keepalive", "offset")
    START_PID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    start_pid: int
    stdout: bytes
    stderr: bytes
    pty: bytes
    end: ProcessEnd
    keepalive: bool
    offset: int
    def __init__(self, start_pid: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., pty: _Optional[bytes] = ..., end: _Optional[_Union[ProcessEnd, _Mapping]] = ..., keepalive: bool = ..., offset: _Optional[int] = ...) -> None: ...

class ProcessEnd(_message.Message):
    __slots__ = ("exit_code", "exited", "status", "error")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    exited: bool
    status: str
    error: str
    def __init__(self, exit_code: _Optional[int] = ..., exited: bool = ..., status: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ProcessInputRequest(_message.Message):
    __slots__ = ("sandbox_id", "process", "data", "pty")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process: ProcessRef
    data: bytes
    pty: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., process: _Optional[_Union[ProcessRef, _Mapping]] = ..., data: _Optional[bytes] = ..., pty: bool = ...) -> None: ...

class SignalProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "process", "signal")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process: ProcessRef
    signal: int
    def __init__(self, sandbox_id: _Optional[str] = ..., process: _Optional[_Union[ProcessRef, _Mapping]] = ..., signal: _Optional[int] = ...) -> None: ...

class ResizePtyRequest(_message.Message):
    __slots__ = ("sandbox_id", "process", "cols", "rows")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process: ProcessRef
    cols: int
    rows: int
    def __init__(self, sandbox_id: _Optional[str] = ..., process: _Optional[_Union[ProcessRef, _Mapping]] = ..., cols: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class ListProcessesRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("pid", "tag", "cmd", "args", "env", "cwd")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    pid: int
    tag: str
    cmd: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    def __init__(self, pid: _Optional[int] = ..., tag: _Optional[str] = ..., cmd: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ...) -> None: ...

class ListProcessesResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessInfo]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessInfo, _Mapping]]] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("at",)
    AT_FIELD_NUMBER: _ClassVar[int]
    at: int
    def __init__(self, at: _Optional[int] = ...) -> None: ...

class PostRestoreRequest(_message.Message):
    __slots__ = ("sandbox_id", "hostname", "seed", "unix_time_ns")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    hostname: str
    seed: bytes
    unix_time_ns: int
    def __init__(self, sandbox_id: _Optional[str] = ..., hostname: _Optional[str] = ..., seed: _Optional[bytes] = ..., unix_time_ns: _Optional[int] = ...) -> None: ...
