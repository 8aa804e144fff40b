"""Images: import into the store, and containers from a composed store image against the
development image ``host``, measured in one run on the same machine.

    sudo .venv/bin/python bench/images.py [-n 30] [-imports 3] [-json]

Needs root, umoci, the base image layout that scripts/build-base-image.sh makes
(target/quickstart-image, tag ``python3``), and a running ``cluster up -runtime linux`` reached
through OPENDSEC_ADDR / OPENDSEC_TOKEN / OPENDSEC_PROJECT / OPENDSEC_IMAGE_STORE, whose edge
state directory is OPENDSEC_BENCH_STATE (bench/images.sh starts one).

What it measures:
  0. (see 1.) the same import from a local docker-registry against ``skopeo copy`` to a layout
     followed by ``umoci unpack`` (the issue's peer pipeline).
  1. import of the base image (one layer of ~160 MB unpacked) into the store, IMPORTS times,
     its layer removed from the store before each: ``opendsec ctl image import``, against the
     peer ``umoci unpack`` of the same layout into a fresh directory, interleaved.
  2. create → first output (``run_sandbox`` + ``run_shell("echo hi")``), N times interleaved:
     from a composed image of 3 parts and 11 layers (the base, and two images of 5 small layers
     each) with a warm layer cache, against the image ``host``. Then the first use on a cold
     cache: the composed image's cached copies removed before each of a few creations.
  3. pack_diff of a sandbox that installed 100 MB (2,000 files of 50 KiB of random bytes under
     /opt/pkg; one small file changed before each round, so every round writes a new layer):
     the time and the layer's space in the store, PACKS times, against the peer ``tar`` of
     the same tree into a fresh directory (``tar -c | tar -x`` then ``sync -f``), alternated.
  4. fork(count=8) of a container of the base image, time until all 8 answer a command,
     N/3 times, against ``run_sandboxes`` of 8 from the same image to the same point.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = os.environ.get("OPENDSEC_BIN", str(ROOT / "target/x86_64-unknown-linux-gnu/release/opendsec"))
LAYOUT = ROOT / "target" / "quickstart-image"

from opendsec import DSecClient, DSecError, DSecRunArgs  # noqa: E402


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([BIN, "ctl", *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"opendsec ctl {' '.join(args)}: {r.stderr}")
    return r


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": statistics.median(xs), "p99": pct(xs, 99), "min": min(xs)}


def small_layout(path: Path, tag: str, n: int) -> None:
    """An OCI layout of ``n`` small layers (a file each)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')

    def blob(data: bytes) -> str:
        d = hashlib.sha256(data).hexdigest()
        (blobs / d).write_bytes(data)
        return f"sha256:{d}"

    descs, diff_ids = [], []
    for i in range(n):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as t:
            data = f"{tag} {i}\n".encode()
            info = tarfile.TarInfo(f"opt/{tag}/{i}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        raw = out.getvalue()
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        gz = gzip.compress(raw, mtime=0)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": blob(gz), "size": len(gz)})
    config = json.dumps(
        {"architecture": "amd64", "os": "linux", "config": {"Env": [f"PART_{tag.upper()}=1"]},
         "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    ).encode()
    manifest = json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
         "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
         "layers": descs}
    ).encode()
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": blob(manifest), "size": len(manifest),
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}))


def timed_imports(store: Path, rounds: int, src: str, flags: list[str],
                  peer: Callable[[Path], None]) -> tuple[list[float], list[float]]:
    """``rounds`` times, alternated: ``opendsec ctl image import`` of ``src`` as
    root/bench/base:1 with its layers removed from the store first, and ``peer(dir)`` into a
    fresh directory next to the store. Returns both lists of seconds."""
    ours, theirs = [], []
    for _ in range(rounds):
        got = json.loads(ctl("image", "get", "root/bench/base:1").stdout)
        for layer in got["layers"]:
            shutil.rmtree(store / "layers" / layer.split(":")[1], ignore_errors=True)
        t = time.perf_counter()
        ctl("image", "import", src, "-as", "root/bench/base:1", "-overwrite", "-q", *flags)
        ours.append(time.perf_counter() - t)
        with tempfile.TemporaryDirectory(dir=store.parent) as d:
            t = time.perf_counter()
            peer(Path(d))
            theirs.append(time.perf_counter() - t)
    return ours, theirs


def quiet(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def imports(store: Path, rounds: int) -> dict[str, Any]:
    ours, peer = timed_imports(store, rounds, f"{LAYOUT}#python3", [],
                               lambda d: quiet("umoci", "unpack", "--image", f"{LAYOUT}:python3", f"{d}/bundle"))
    return {"ours_s": summary(ours), "umoci_unpack_s": summary(peer)}


def registry_imports(store: Path, rounds: int) -> dict[str, Any]:
    """Import of the base image from a local docker-registry (plain HTTP, no auth), against the
    peer pipeline ``skopeo copy`` to an OCI layout then ``umoci unpack``, alternated."""
    import socket

    with tempfile.TemporaryDirectory(dir=store.parent) as d:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        conf = Path(d) / "registry.yml"
        conf.write_text(f"version: 0.1\nlog: {{level: error}}\nstorage: {{filesystem: {{rootdirectory: {d}/data}}}}\n"
                        f"http: {{addr: 127.0.0.1:{port}}}\n")
        reg = subprocess.Popen(["docker-registry", "serve", str(conf)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    time.sleep(0.1)
            ref = f"127.0.0.1:{port}/bench/base:1"
            quiet("skopeo", "--insecure-policy", "copy", "-q", f"oci:{LAYOUT}:python3", f"docker://{ref}",
                  "--dest-tls-verify=false")

            def peer(out: Path) -> None:
                quiet("skopeo", "--insecure-policy", "copy", "-q", f"docker://{ref}", f"oci:{out}/layout:1",
                      "--src-tls-verify=false")
                quiet("umoci", "unpack", "--image", f"{out}/layout:1", f"{out}/bundle")

            ours, theirs = timed_imports(store, rounds, ref, ["-plain-http"], peer)
        finally:
            reg.terminate()
            reg.wait(timeout=10)
    return {"ours_s": summary(ours), "skopeo_umoci_s": summary(theirs)}


async def first_output(c: DSecClient, image: str) -> float:
    t = time.perf_counter()
    sb = await c.run_sandbox(DSecRunArgs(backend="container", image=image, cpu_cores_limit=1, memory_limit_mb=256, disk_mb=64))
    try:
        r = await sb.run_shell("echo hi")
        took = time.perf_counter() - t
        assert r.stdout == "hi\n", r
        return took
    finally:
        await sb.stop()


async def creations(n: int, state: Path, store: Path, composed: str) -> dict[str, Any]:
    async with DSecClient(retry_timeout=30) as c:
        await first_output(c, composed)  # warms the cache
        ours, host = [], []
        for _ in range(n):
            ours.append(await first_output(c, composed))
            host.append(await first_output(c, "host"))
        got = json.loads(ctl("image", "get", composed).stdout)
        cold = []
        for _ in range(max(3, n // 10)):
            for layer in got["layers"]:
                # The node's cached copies only: the store may live under the state directory too.
                for d in state.rglob(f"layers/{layer.split(':')[1]}"):
                    if not d.is_relative_to(store):
                        shutil.rmtree(d)
            cold.append(await first_output(c, composed))
    s_ours, s_host = summary([x * 1000 for x in ours]), summary([x * 1000 for x in host])
    return {
        "composed_ms": s_ours,
        "host_ms": s_host,
        "p50_ratio": s_ours["p50"] / s_host["p50"],
        "cold_cache_ms": summary([x * 1000 for x in cold]),
        "layers": len(got["layers"]),
    }


INSTALL = "mkdir -p /opt/pkg && for i in $(seq 1 2000); do head -c 51200 /dev/urandom > /opt/pkg/f$i; done"


def tree_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


async def packs(store: Path, rounds: int) -> dict[str, Any]:
    """pack_diff of a sandbox that installed 100 MB, against tar of the same tree."""
    async with DSecClient(retry_timeout=30) as c:
        sb = await c.run_sandbox(
            DSecRunArgs(backend="container", image="root/bench/base:1", cpu_cores_limit=1, memory_limit_mb=512, disk_mb=1024)
        )
        ours: list[float] = []
        peer: list[float] = []
        space: list[int] = []
        try:
            r = await sb.run_shell(INSTALL, timeout=600)
            assert r.exit_code == 0, r
            with tempfile.TemporaryDirectory(dir=store.parent) as d:
                src = Path(d) / "src"
                subprocess.run(["sh", "-c", INSTALL.replace("/opt/pkg", f"{src}/opt/pkg")], check=True)
                for i in range(rounds):
                    await sb.run_shell(f"echo {i} > /opt/stamp")
                    t = time.perf_counter()
                    img = await sb.pack_diff(f"root/bench/packed:{i}")
                    ours.append(time.perf_counter() - t)
                    layer = store / "layers" / img.layers[-1].split(":")[1]
                    space.append(tree_bytes(layer))
                    ctl("image", "delete", img.name)
                    shutil.rmtree(layer)
                    out = Path(d) / f"peer{i}"
                    out.mkdir()
                    t = time.perf_counter()
                    subprocess.run(f"tar -C {src} -cf - . | tar -C {out} -xf - && sync -f {out}", shell=True, check=True)
                    peer.append(time.perf_counter() - t)
                    shutil.rmtree(out)
        finally:
            await sb.stop()
    return {"ours_s": summary(ours), "tar_s": summary(peer), "layer_mb": statistics.median(space) / 1e6}


async def forks(rounds: int) -> dict[str, Any]:
    """fork(count=8) until all 8 answer a command, against run_sandboxes(8) to the same point."""
    args = DSecRunArgs(backend="container", image="root/bench/base:1", cpu_cores_limit=0.1, memory_limit_mb=128, disk_mb=256)
    async with DSecClient(retry_timeout=30) as c:
        sb = await c.run_sandbox(args)
        ours: list[float] = []
        peer: list[float] = []
        try:
            await sb.run_shell("mkdir -p /srv/work && head -c 10485760 /dev/urandom > /srv/work/state")

            for _ in range(rounds):
                t = time.perf_counter()
                made = await sb.fork(count=8)
                live = [m for m in made if not isinstance(m, DSecError)]
                assert len(live) == 8, made
                rs = await asyncio.gather(*(m.run_shell("true") for m in live))
                ours.append(time.perf_counter() - t)
                assert all(r.exit_code == 0 for r in rs), rs
                await asyncio.gather(*(m.stop() for m in live))
                t = time.perf_counter()
                made = await c.run_sandboxes(args, 8)
                live = [m for m in made if not isinstance(m, DSecError)]
                assert len(live) == 8, made
                rs = await asyncio.gather(*(m.run_shell("true") for m in live))
                peer.append(time.perf_counter() - t)
                await asyncio.gather(*(m.stop() for m in live))
        finally:
            await sb.stop()
    return {"fork8_ms": summary([x * 1000 for x in ours]), "create8_ms": summary([x * 1000 for x in peer])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("-imports", type=int, default=3)
    ap.add_argument("-packs", type=int, default=5)
    ap.add_argument("-only", choices=["all", "pack", "fork"], default="all",
                    help="pack or fork: only items 3 or 4 (the base image is imported either way)")
    ap.add_argument("-json", action="store_true")
    a = ap.parse_args()
    store = Path(os.environ["OPENDSEC_IMAGE_STORE"])
    state = Path(os.environ["OPENDSEC_BENCH_STATE"])
    with tempfile.TemporaryDirectory() as d:
        small_layout(Path(d) / "a", "a", 5)
        small_layout(Path(d) / "b", "b", 5)
        subprocess.run([BIN, "ctl", "project", "create", "root", "bench"], capture_output=True)
        ctl("image", "import", f"{LAYOUT}#python3", "-as", "root/bench/base:1", "-overwrite", "-q")
        ctl("image", "import", f"{d}/a#a", "-as", "root/bench/a:1", "-overwrite", "-q")
        ctl("image", "import", f"{d}/b#b", "-as", "root/bench/b:1", "-overwrite", "-q")
    ctl("image", "compose", "root/bench/combo:1", "root/bench/base:1", "root/bench/a:1", "root/bench/b:1", "-overwrite")
    out: dict[str, Any] = {}
    if a.only in ("all", "pack"):
        out["pack"] = asyncio.run(packs(store, a.packs))
    if a.only in ("all", "fork"):
        out["fork"] = asyncio.run(forks(max(3, a.n // 3)))
    if a.only == "all":
        out["import"] = imports(store, a.imports)
        out["registry_import"] = registry_imports(store, a.imports)
        out["create"] = asyncio.run(creations(a.n, state, store, "root/bench/combo:1"))
    if a.json:
        print(json.dumps(out, indent=2))
        return
    if "pack" in out:
        p = out["pack"]
        print(f"pack_diff of 100 MB installed: p50 {p['ours_s']['p50']:.2f} s, p99 {p['ours_s']['p99']:.2f} s, "
              f"layer {p['layer_mb']:.1f} MB in the store; tar of the same tree p50 {p['tar_s']['p50']:.2f} s, "
              f"p99 {p['tar_s']['p99']:.2f} s (n={p['ours_s']['n']})")
    if "fork" in out:
        f = out["fork"]
        print(f"fork(count=8) until all answer: p50 {f['fork8_ms']['p50']:.0f} ms, p99 {f['fork8_ms']['p99']:.0f} ms; "
              f"run_sandboxes(8) p50 {f['create8_ms']['p50']:.0f} ms, p99 {f['create8_ms']['p99']:.0f} ms "
              f"(n={f['fork8_ms']['n']})")
    if a.only != "all":
        return
    i, c, r = out["import"], out["create"], out["registry_import"]
    print(f"import of the base image: ours p50 {i['ours_s']['p50']:.2f} s (min {i['ours_s']['min']:.2f}), "
          f"umoci unpack p50 {i['umoci_unpack_s']['p50']:.2f} s (min {i['umoci_unpack_s']['min']:.2f}), n={a.imports}")
    print(f"import from a local registry: ours p50 {r['ours_s']['p50']:.2f} s (min {r['ours_s']['min']:.2f}), "
          f"skopeo copy + umoci unpack p50 {r['skopeo_umoci_s']['p50']:.2f} s "
          f"(min {r['skopeo_umoci_s']['min']:.2f}), n={a.imports}")
    print(f"create -> first output, composed image of {c['layers']} layers: p50 {c['composed_ms']['p50']:.1f} ms, "
          f"p99 {c['composed_ms']['p99']:.1f} ms; host: p50 {c['host_ms']['p50']:.1f} ms, p99 {c['host_ms']['p99']:.1f} ms; "
          f"ratio of p50s {c['p50_ratio']:.3f} (n={a.n})")
    print(f"first use on a cold layer cache: p50 {c['cold_cache_ms']['p50']:.1f} ms (n={c['cold_cache_ms']['n']})")


if __name__ == "__main__":
    main()
