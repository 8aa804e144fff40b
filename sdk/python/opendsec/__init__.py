"""OpenDsec's asynchronous Python SDK (gRPC + asyncio).

Example::

    import asyncio
    from opendsec import DSecClient, DSecRunArgs

    async def main() -> None:
        async with DSecClient() as client:  # reads the OPENDSEC_* variables
            sb = await client.run_sandbox(DSecRunArgs(backend="container", image="host"))
            try:
                r = await sb.run_shell("python3 -c 'print(6*7)'")
                print(r.stdout)
            finally:
                await sb.stop()

    asyncio.run(main())
"""

from opendsec._version import __version__
from opendsec.client import DEFAULT_ADDR, DEFAULT_PROJECT, DSecClient
from opendsec.errors import (
    CONFLICT,
    FORBIDDEN,
    INTERNAL,
    INVALID,
    NO_CAPACITY,
    NOT_FOUND,
    QUOTA_EXCEEDED,
    RATE_LIMITED,
    REASONS,
    TIMEOUT,
    UNAUTHENTICATED,
    UNAVAILABLE,
    DSecError,
)
from opendsec.ports import PortWriter
from opendsec.models import (
    DSecContainerRunArgs,
    DSecRunArgs,
    FileEvent,
    FileInfo,
    HttpResult,
    ImageInfo,
    Project,
    ShellResult,
    TaskActionResult,
    TokenInfo,
    UsageReport,
    UsageRow,
)
from opendsec.sandbox import Sandbox
from opendsec.watch import DirWatch

__all__ = [
    "__version__",
    "DSecClient",
    "DEFAULT_ADDR",
    "DEFAULT_PROJECT",
    "DSecRunArgs",
    "DSecContainerRunArgs",
    "Sandbox",
    "ShellResult",
    "FileInfo",
    "FileEvent",
    "DirWatch",
    "HttpResult",
    "PortWriter",
    "TaskActionResult",
    "Project",
    "TokenInfo",
    "UsageRow",
    "UsageReport",
    "ImageInfo",
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
