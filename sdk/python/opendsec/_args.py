"""Strict argument checks for the SDK's calls.

Python's ``int("512")`` and ``bytes(5)`` succeed, so converting arguments would quietly
accept a string where a number belongs and turn ``write_file(p, 5)`` into five NUL bytes.
These checks raise ``TypeError`` or ``ValueError`` instead, which the public methods turn
into ``DSecError(INVALID)`` before anything is sent (``errors.bad_arguments_are_invalid``).
"""

from __future__ import annotations

import numbers
import operator
from typing import Callable, Optional, Union


def integer(name: str, v: object) -> int:
    """``v`` as an ``int``: an ``int`` or anything integral (``operator.index``: numpy's
    integers too); ``bool``, ``float`` and ``str`` are a ``TypeError``."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(v).__name__}") from None


def number(name: str, v: object) -> float:
    """``v`` (any real number: ``int``, ``float``, numpy's) as a ``float``; ``bool`` and
    ``str`` are a ``TypeError``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(v).__name__}")
    return float(v)


def optional_number(name: str, v: object) -> float:
    """:func:`number`, with ``None`` as 0 (no limit)."""
    return 0.0 if v is None else number(name, v)


def text(name: str, v: object, empty: bool = True) -> str:
    """``v`` as a ``str`` without NUL bytes (the sandbox's programs see C strings, where a
    NUL would cut it short), and not empty unless ``empty``."""
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, not {type(v).__name__}")
    if "\0" in v:
        raise ValueError(f"{name} must not contain a NUL byte")
    if not empty and not v:
        raise ValueError(f"{name} must not be empty")
    return v


def session(v: object) -> str:
    """A session name: :func:`text`, not empty ("" used to run in ``default``)."""
    return text("session", v, empty=False)


def path(v: object) -> str:
    """A path in the sandbox: :func:`text`, not empty."""
    return text("path", v, empty=False)


def optional_text(name: str, v: Optional[object]) -> str:
    """:func:`text`, with ``None`` as ""."""
    return "" if v is None else text(name, v)


def data(v: object) -> memoryview:
    """File contents: ``bytes``, ``bytearray``, ``memoryview`` or ``str`` (UTF-8)."""
    if isinstance(v, str):
        return memoryview(v.encode("utf-8"))
    if isinstance(v, (bytes, bytearray, memoryview)):
        return memoryview(bytes(v))
    raise TypeError(f"data must be bytes or str, not {type(v).__name__}")


def boolean(name: str, v: object) -> bool:
    """``v`` as a ``bool``: only ``True`` or ``False`` (``"false"`` would be true)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, not {type(v).__name__}")
    return v


def net_rules(v: Optional[object]) -> dict[str, bool]:
    """Network rules (docs/network.md): a ``dict`` of rule (``str``, not empty) to ``bool``
    (``None`` is empty). The rules' syntax is the server's to check; errors here name the
    rule whose key or value has the wrong type."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"network rules must be a dict of rule to bool, not {type(v).__name__}")
    out: dict[str, bool] = {}
    for k, allowed in v.items():
        rule = text("network rule", k, empty=False)
        out[rule] = boolean(f"network rule {rule!r}", allowed)
    return out


def str_map(what: str, v: Optional[object], check_key: Callable[[object], str]) -> dict[str, str]:
    """A ``dict`` of ``str`` to ``str`` named ``what`` (``None`` is empty): each key through
    ``check_key``, which returns it or raises naming it; each value :func:`text`, named
    ``what[key]``."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"{what} must be a dict, not {type(v).__name__}")
    out: dict[str, str] = {}
    for k, val in v.items():
        key = check_key(k)
        out[key] = text(f"{what}[{key!r}]", val)
    return out


def _env_name(k: object) -> str:
    key = text("env name", k, empty=False)
    if "=" in key:
        raise ValueError(f"env name {key!r} must not contain '='")
    return key


def env(v: Optional[object]) -> dict[str, str]:
    """A command's extra environment: ``str`` names (not empty, no ``=``) to ``str`` values."""
    return str_map("env", v, _env_name)


def metadata(v: Optional[object]) -> Optional[dict[str, str]]:
    """A file's metadata: ``None`` (keep it), or ``str`` keys (not empty) to ``str`` values;
    the agent checks the rest (docs/python-sdk.md "File metadata")."""
    if v is None:
        return None
    return str_map("metadata", v, lambda k: text("metadata key", k, empty=False))


def labels(v: Optional[object]) -> dict[str, str]:
    """A sandbox's labels: ``str`` names (not empty) to ``str`` values; errors name the label."""
    return str_map("labels", v, lambda k: text("label name", k, empty=False))


Bytes = Union[bytes, bytearray, memoryview, str]
