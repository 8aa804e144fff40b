"""Errors of the OpenDsec SDK: :class:`DSecError` and the stable reason strings.

Every failure the server reports carries a ``google.rpc.ErrorInfo`` in the gRPC
``grpc-status-details-bin`` trailer (the rich error model); its ``reason`` is what
:attr:`DSecError.reason` holds. The message text is for people and is never parsed.
A status without ErrorInfo (a transport failure, a proxy) gets the reason its gRPC code
implies; connection failures (refused, reset) are :data:`UNAVAILABLE`.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Final, Iterable, Optional, Union, cast

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "DSecError",
    "UNAUTHENTICATED",
    "FORBIDDEN",
    "NOT_FOUND",
    "QUOTA_EXCEEDED",
    "RATE_LIMITED",
    "NO_CAPACITY",
    "INVALID",
    "UNAVAILABLE",
    "TIMEOUT",
    "INTERNAL",
    "CONFLICT",
    "REASONS",
]

#: The token is invalid, expired or revoked.
UNAUTHENTICATED: Final[str] = "unauthenticated"
#: A permission is missing; the message names it.
FORBIDDEN: Final[str] = "forbidden"
#: No such sandbox, project, principal or image (or the sandbox was cleaned up).
NOT_FOUND: Final[str] = "not_found"
#: Over the quota of the project or one of its ancestors.
QUOTA_EXCEEDED: Final[str] = "quota_exceeded"
#: Over the rate limit: back off and retry.
RATE_LIMITED: Final[str] = "rate_limited"
#: The cluster cannot place the sandbox right now.
NO_CAPACITY: Final[str] = "no_capacity"
#: Bad arguments; read the message.
INVALID: Final[str] = "invalid"
#: A server is unreachable (restart, failover). The SDK retried already within ``retry_timeout``.
UNAVAILABLE: Final[str] = "unavailable"
#: The call timed out.
TIMEOUT: Final[str] = "timeout"
#: A server-side error.
INTERNAL: Final[str] = "internal"
#: The request conflicts with the current state (e.g. the name is taken).
CONFLICT: Final[str] = "conflict"

#: Every reason string the server may send.
REASONS: Final[frozenset[str]] = frozenset(
    {
        UNAUTHENTICATED,
        FORBIDDEN,
        NOT_FOUND,
        QUOTA_EXCEEDED,
        RATE_LIMITED,
        NO_CAPACITY,
        INVALID,
        UNAVAILABLE,
        TIMEOUT,
        INTERNAL,
        CONFLICT,
    }
)

_DETAILS_KEY = "grpc-status-details-bin"

# Reasons implied by a bare gRPC code (no ErrorInfo): the same table as the server's own
# clients use (src/rpc/status.rs).
_CODE_REASONS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RATE_LIMITED,
    grpc.StatusCode.INVALID_ARGUMENT: INVALID,
    grpc.StatusCode.OUT_OF_RANGE: INVALID,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.CANCELLED: UNAVAILABLE,
    grpc.StatusCode.UNKNOWN: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
    grpc.StatusCode.ALREADY_EXISTS: CONFLICT,
    grpc.StatusCode.FAILED_PRECONDITION: CONFLICT,
    grpc.StatusCode.ABORTED: CONFLICT,
}


class DSecError(Exception):
    """A failed OpenDsec call.

    Attributes:
        reason: A stable reason string, one of the module constants
            (:data:`UNAUTHENTICATED` ... :data:`INTERNAL`, :data:`CONFLICT`).
        message: The server's explanation, for people.
    """

    reason: str
    message: str

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message

    def __repr__(self) -> str:
        return f"DSecError(reason={self.reason!r}, message={self.message!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DSecError):
            return NotImplemented
        return self.reason == other.reason and self.message == other.message

    def __hash__(self) -> int:
        return hash((self.reason, self.message))

    def __reduce__(self) -> tuple[type[DSecError], tuple[str, str]]:  # keep pickling (e.g. multiprocessing) working
        return (DSecError, (self.reason, self.message))


def _reason_from_details(blob: bytes) -> Optional[str]:
    """Returns ErrorInfo.reason from a serialized ``google.rpc.Status``, if there is one."""
    try:
        st = status_pb2.Status.FromString(blob)
    except Exception:  # a malformed trailer is treated as absent
        return None
    for detail in st.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.reason:
                return str(info.reason)
    return None


def error_from_rpc(err: grpc.RpcError) -> DSecError:
    """Converts a gRPC error (sync or ``grpc.aio``) into a :class:`DSecError`.

    The reason comes from ``google.rpc.ErrorInfo`` in the ``grpc-status-details-bin``
    trailer; without one, from the status code (transport failures are ``unavailable``).
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else "") or ""
    raw = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    # Sync errors hold (key, value) namedtuples, grpc.aio ones a Metadata of pairs: both are pairs.
    trailers = cast("Iterable[tuple[str, Union[str, bytes]]]", raw or ())
    reason: Optional[str] = None
    for key, value in trailers:
        if key == _DETAILS_KEY:
            blob = value if isinstance(value, bytes) else str(value).encode("latin-1")
            reason = _reason_from_details(blob)
            if reason:
                break
    if reason is None:
        reason = _CODE_REASONS.get(code, INTERNAL)
        # gRPC's own message-size check (client or server side) is a bad request, not a rate
        # limit (09-python-sdk "Files": such errors report invalid).
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message:
            reason = INVALID
        if not message and code is not None:
            message = code.name
    return DSecError(reason, message)


def bad_arguments_are_invalid(cls: type) -> type:
    """Class decorator: in every public coroutine method, a ``TypeError`` or ``ValueError``
    raised while building the request (a string where a number belongs, an int too large for
    its field) becomes ``DSecError(INVALID)``, like any other bad input the server refuses."""
    import functools
    import inspect

    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(fn):
            continue

        def wrap(f: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            @functools.wraps(f)
            async def method(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await f(*args, **kwargs)
                except (TypeError, ValueError) as e:
                    raise DSecError(INVALID, f"bad argument to {f.__name__}: {e}") from e

            return method

        setattr(cls, name, wrap(fn))
    return cls
