"""OCI image layouts written by the tests themselves (docs/testing.md): layers from a dict of
files, gzip, one manifest and an index. No SDK import, so E2B's suite (tests/e2b) uses it too."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path


def _blob(blobs: Path, data: bytes) -> str:
    d = hashlib.sha256(data).hexdigest()
    (blobs / d).write_bytes(data)
    return f"sha256:{d}"


def _layer(files: dict[str, bytes | str]) -> bytes:
    """A layer tar: ``bytes`` are a file's contents (mode 0755 for programs, else 0644), a
    ``str`` is a symlink's target."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                t.addfile(info)
                continue
            info.size = len(data)
            info.mode = 0o755 if data.startswith((b"\x7fELF", b"#!")) else 0o644
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def oci_layout(
    path: Path,
    layers: list[dict[str, bytes | str]],
    env: list[str],
    workdir: str = "",
    tag: str = "1",
    user: str = "",
) -> None:
    """An OCI image layout at ``path``: one image of ``layers`` (bottom first, gzip), tagged ``tag``."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    descs, diff_ids = [], []
    for files in layers:
        raw = _layer(files)
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        gz = gzip.compress(raw, mtime=0)
        descs.append(
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _blob(blobs, gz), "size": len(gz)}
        )
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": env, "WorkingDir": workdir, "User": user},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _blob(blobs, config),
                "size": len(config),
            },
            "layers": descs,
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": _blob(blobs, manifest),
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (path / "index.json").write_text(json.dumps(index))


def bash_layout(path: Path) -> None:
    """An OCI layout of a tiny image with bash (E2B's SDKs start every command as
    `bash -l -c`): the host's bash and the libraries it loads, busybox for the usual tools,
    and /srv/from-image."""
    files: dict[str, bytes | str] = {}
    bash = shutil.which("bash") or "/bin/bash"
    files["bin/bash"] = Path(bash).read_bytes()
    for line in subprocess.run(["ldd", bash], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if lib.startswith("/"):
            files[lib.lstrip("/")] = Path(lib).resolve().read_bytes()
    busybox = next(p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.isfile(p))
    files["bin/busybox"] = Path(busybox).read_bytes()
    tools = ("sh", "cat", "echo", "ls", "mkdir", "rm", "sleep", "sha256sum", "cut", "stat", "id", "env")
    # What E2B's template builds run (docs/e2b.md "Template builds"): tar for COPY steps,
    # cut and grep for USER steps.
    tools += ("tar", "gzip", "cp", "mv", "chown", "chmod", "mktemp", "dirname", "basename", "grep", "pwd", "touch", "test", "[")
    for tool in tools:
        files[f"bin/{tool}"] = "busybox"
    files["etc/passwd"] = b"root:x:0:0:root:/root:/bin/bash\n"
    files["etc/group"] = b"root:x:0:\n"
    files["root/.keep"] = b""
    files["home/.keep"] = b""
    files["tmp/.keep"] = b""
    files["srv/from-image"] = b"image\n"
    oci_layout(path, [files], env=["PATH=/bin"], workdir="/root")
