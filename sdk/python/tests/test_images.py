"""Images end to end: ``opendsecctl image import`` of OCI layouts made here, then the SDK's and
the CLI's image calls (list, get, compose, delete) and their permissions, against the cluster
of test_cluster.py (its image store lies in the cluster's own state directory).

The import writes layers as root (owners, whiteout devices): under CI=true not being root
fails the tests, elsewhere it skips them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_fixture import ctl
from oci import oci_layout
from test_cluster import admin, uniq

import opendsec
from opendsec import DSecClient, DSecError

pytestmark = pytest.mark.cluster


def _need_root() -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("image import writes layers as root; under CI=true it must run", pytrace=False)
        pytest.skip("image import needs root")


async def test_import_compose_list_get_delete_and_permissions(cluster, tmp_path):
    _need_root()
    top = uniq("img")
    project = f"root/{top}"
    base, tools, combo = f"{project}/base:1", f"{project}/tools:1", f"{project}/combo:1"
    oci_layout(
        tmp_path / "base",
        [{"etc/os": b"base\n", "srv/a": b"a\n"}, {"srv/b": b"b\n"}],
        env=["PATH=/usr/bin:/bin", "LANG=C"],
        workdir="/srv",
    )
    oci_layout(tmp_path / "tools", [{"opt/tool": b"#!/bin/sh\n"}], env=["LANG=C.UTF-8", "TOOL=1"])
    async with admin(cluster) as c:
        await c.create_project("root", top)

        # Import: progress on stderr, the registered image as JSON on stdout.
        r = ctl(cluster, "image", "import", str(tmp_path / "base"), "-as", base)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["name"] == base
        assert "layer 1/2" in r.stderr and "layer 2/2" in r.stderr, r.stderr
        # The same name again: conflict, found before any layer is read; -overwrite replaces.
        r = ctl(cluster, "image", "import", str(tmp_path / "base"), "-as", base)
        assert r.returncode == 1 and r.stderr.startswith("error: conflict:"), r.stderr
        r = ctl(cluster, "image", "import", str(tmp_path / "base"), "-as", base, "-overwrite")
        assert r.returncode == 0, r.stderr
        assert "already in the store" in r.stderr, "identical layers are stored once"
        r = ctl(cluster, "image", "import", f"{tmp_path / 'tools'}#1", "-as", tools, "-q")
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
        # Images live in projects that exist: importing into, composing into or listing a
        # missing one is not_found, and writes nothing.
        r = ctl(cluster, "image", "import", str(tmp_path / "base"), "-as", f"{project}/ghost/x:1", "-q")
        assert r.returncode == 1 and r.stderr.startswith("error: not_found:") and "ghost" in r.stderr, r.stderr
        r = ctl(cluster, "image", "compose", f"{project}/ghost/c:1", base)
        assert r.returncode == 1 and r.stderr.startswith("error: not_found:"), r.stderr
        with pytest.raises(DSecError) as ei:
            await c.list_images(f"{project}/ghost")
        assert ei.value.reason == opendsec.NOT_FOUND
        assert not (Path(cluster["OPENDSEC_IMAGE_STORE"]) / "images" / "root" / top / "ghost").exists()
        # A missing local path is invalid and never looked up in a registry.
        r = ctl(cluster, "image", "import", "./no-such-image.tar", "-as", f"{project}/py:1")
        assert r.returncode == 1 and "error: invalid:" in r.stderr, r.stderr
        # A `#` with no image name after it is a mistake, not "the only image there".
        r = ctl(cluster, "image", "import", f"{tmp_path / 'tools'}#", "-as", f"{project}/hash:1", "-q")
        assert r.returncode == 1 and "error: invalid:" in r.stderr and "nothing after `#`" in r.stderr, r.stderr

        got = await c.get_image(base)
        me = await c.whoami()
        assert got.name == base and len(got.layers) == 2
        assert all(layer.startswith("sha256:") for layer in got.layers)
        assert got.env == ["PATH=/usr/bin:/bin", "LANG=C"] and got.workdir == "/srv"
        assert got.created_by == me and got.created_at > 0 and got.source.endswith("base#1")
        store = Path(cluster["OPENDSEC_IMAGE_STORE"])
        for layer in got.layers:
            assert (store / "layers" / layer.split(":")[1] / "rootfs").is_dir()
        assert (store / "layers" / got.layers[0].split(":")[1] / "rootfs/etc/os").read_bytes() == b"base\n"

        assert [i.name for i in await c.list_images(project)] == [base, tools]

        # Compose: no data copied, later parts on top, env merged in order with env= last.
        t = await c.get_image(tools)
        img = await c.compose_image(combo, [base, tools], env={"TASK": "7"})
        assert img.layers == got.layers + t.layers
        assert img.env == ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "TOOL=1", "TASK=7"]
        assert img.workdir == "/srv"
        with pytest.raises(DSecError) as ei:
            await c.compose_image(combo, [base])
        assert ei.value.reason == opendsec.CONFLICT
        img = await c.compose_image(combo, [tools], workdir="/opt", overwrite=True)
        assert img.layers == t.layers and img.workdir == "/opt"
        with pytest.raises(DSecError) as ei:
            await c.compose_image(f"{project}/x:1", [base, f"{project}/missing:1"])
        assert ei.value.reason == opendsec.NOT_FOUND and "missing" in ei.value.message
        with pytest.raises(DSecError) as ei:
            await c.compose_image(f"{project}/x:1", [base], workdir="relative")
        assert ei.value.reason == opendsec.INVALID

        # Bad names are invalid and name the part; unknown ones not_found.
        with pytest.raises(DSecError) as ei:
            await c.get_image(f"{project}/Upper:1")
        assert ei.value.reason == opendsec.INVALID and "name" in ei.value.message
        with pytest.raises(DSecError) as ei:
            await c.get_image(f"{project}/base:bad tag")
        assert ei.value.reason == opendsec.INVALID and "tag" in ei.value.message
        with pytest.raises(DSecError) as ei:
            await c.get_image(f"{project}/base:2")
        assert ei.value.reason == opendsec.NOT_FOUND

        # layer.use lets a principal see and list; changing needs layer.publish.
        reader = uniq("reader")
        token = await c.create_principal(project, reader)
        await c.grant(project, reader, ["layer.use"])
        async with DSecClient(endpoint=cluster["OPENDSEC_ADDR"], token=token, project=project, retry_timeout=10) as p:
            assert (await p.get_image(base)).layers == got.layers
            assert [i.name for i in await p.list_images()] == [base, combo, tools]
            for call in (
                p.compose_image(f"{project}/mine:1", [base]),
                p.delete_image(base),
            ):
                with pytest.raises(DSecError) as ei:
                    await call
                assert ei.value.reason == opendsec.FORBIDDEN and "layer.publish" in ei.value.message
            with pytest.raises(DSecError) as ei:
                await p.list_images("root")
            assert ei.value.reason == opendsec.FORBIDDEN
        r = ctl(cluster, "image", "import", str(tmp_path / "tools"), "-as", f"{project}/nope:1", token=token)
        assert r.returncode == 1 and r.stderr.startswith("error: forbidden:"), r.stderr

        # The CLI's list, get, compose and delete.
        r = ctl(cluster, "image", "list", project)
        assert r.returncode == 0, r.stderr
        assert [i["name"] for i in json.loads(r.stdout)["images"]] == [base, combo, tools]
        r = ctl(cluster, "image", "get", tools)
        assert r.returncode == 0 and json.loads(r.stdout)["layers"] == t.layers, r.stderr
        r = ctl(cluster, "image", "compose", f"{project}/cli:1", base, tools, "-env", "A=1", "-workdir", "/w")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["layers"] == got.layers + t.layers and out["env"][-1] == "A=1" and out["workdir"] == "/w"
        r = ctl(cluster, "image", "delete", f"{project}/cli:1")
        assert r.returncode == 0, r.stderr

        # Delete removes the registration, not the layers (image gc reclaims those).
        await c.delete_image(combo)
        with pytest.raises(DSecError) as ei:
            await c.get_image(combo)
        assert ei.value.reason == opendsec.NOT_FOUND
        with pytest.raises(DSecError) as ei:
            await c.delete_image(combo)
        assert ei.value.reason == opendsec.NOT_FOUND
        assert (store / "layers" / t.layers[0].split(":")[1]).is_dir()
        assert [i.name for i in await c.list_images(project)] == [base, tools]

        # GC: the layers of a deleted image go, those of registered images stay; a dry run
        # only says so.
        await c.delete_image(tools)
        gone = t.layers[0].split(":")[1]
        r = ctl(cluster, "image", "gc", "-grace", "0s", "-dry-run")
        assert r.returncode == 0 and f"would remove layer {gone}" in r.stdout, r.stdout + r.stderr
        assert (store / "layers" / gone).is_dir()
        r = ctl(cluster, "image", "gc", "-grace", "0s")
        assert r.returncode == 0 and f"removed layer {gone}" in r.stdout, r.stdout + r.stderr
        assert not (store / "layers" / gone).exists()
        for layer in got.layers:
            assert (store / "layers" / layer.split(":")[1] / "rootfs").is_dir()
        r = ctl(cluster, "image", "gc", "-grace", "soon")
        assert r.returncode != 0 and "grace" in r.stderr, r.stderr
        r = ctl(cluster, "image", "gc", "-store", str(tmp_path / "no-store"), "-dry-run")
        assert r.returncode == 1 and "not an image store" in r.stderr, r.stderr

        # A project that still has images is not deleted (they would outlive it, out of
        # reach); once they are gone it is, and gc takes its empty directories.
        sub = f"{project}/sub"
        await c.create_project(project, "sub")
        await c.compose_image(f"{sub}/left:1", [base])
        with pytest.raises(DSecError) as ei:
            await c.delete_project(sub)
        assert ei.value.reason == opendsec.CONFLICT and f"{sub}/left:1" in ei.value.message, ei.value
        assert (await c.get_image(f"{sub}/left:1")).layers == got.layers
        await c.delete_image(f"{sub}/left:1")
        await c.delete_project(sub)
        r = ctl(cluster, "image", "gc", "-grace", "0s")
        assert r.returncode == 0, r.stderr
        assert not (store / "images" / "root" / top / "sub").exists()
        assert (store / "images" / "root" / top / "base" / "1.json").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_registry(tmp_path: Path, *, auth: bool, tls: bool) -> Iterator[dict[str, str]]:
    """A real OCI registry (Debian's docker-registry) on 127.0.0.1, on a free port; with
    ``auth``, HTTP Basic (user ``ci``, password ``pw``) from an htpasswd file; with ``tls``,
    HTTPS with a certificate from a CA made here. Yields ``addr`` and, with TLS, ``ca`` (the
    CA's PEM file, for ``SSL_CERT_FILE``)."""
    exe = shutil.which("docker-registry")
    if exe is None or shutil.which("skopeo") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("docker-registry and skopeo are needed (.ci/run installs them)", pytrace=False)
        pytest.skip("docker-registry or skopeo missing")
    d = tmp_path / f"registry-{secrets.token_hex(3)}"
    d.mkdir()
    port = _free_port()
    conf = [
        "version: 0.1",
        "log: {level: error}",
        f"storage: {{filesystem: {{rootdirectory: {d / 'data'}}}}}",
    ]
    out = {"addr": f"127.0.0.1:{port}"}
    if auth:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # bcrypt through libxcrypt: the registry's htpasswd takes only bcrypt

            hashed = crypt.crypt("pw", crypt.mksalt(crypt.METHOD_BLOWFISH))
        (d / "htpasswd").write_text(f"ci:{hashed}\n")
        conf.append(f"auth: {{htpasswd: {{realm: test, path: {d / 'htpasswd'}}}}}")
    if tls:
        (d / "ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
        for cmd in (
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=opendsec test CA"],
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
             "-subj", "/CN=127.0.0.1"],
            ["openssl", "x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "srv.pem", "-days", "1", "-extfile", "ext"],
        ):
            r = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
        conf.append(f"http: {{addr: 127.0.0.1:{port}, tls: {{certificate: {d / 'srv.pem'}, key: {d / 'srv.key'}}}}}")
        out["ca"] = str(d / "ca.pem")
    else:
        conf.append(f"http: {{addr: 127.0.0.1:{port}}}")
    (d / "registry.yml").write_text("\n".join(conf) + "\n")
    log = open(d / "registry.log", "w")
    proc = subprocess.Popen([exe, "serve", str(d / "registry.yml")], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((d / "registry.log").read_text()) from None
                time.sleep(0.1)
        yield out
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def push(layout: Path, dest: str, creds: str | None = None) -> None:
    """Pushes tag 1 of an OCI layout to a test registry with skopeo."""
    push = subprocess.run(
        ["skopeo", "--insecure-policy", "copy", "-q", f"oci:{layout}:1", f"docker://{dest}",
         "--dest-tls-verify=false", *(["--dest-creds", creds] if creds else [])],
        capture_output=True, text=True, timeout=120,
    )
    assert push.returncode == 0, push.stderr


async def test_import_from_a_registry_with_basic_auth_over_tls_from_flags_or_saved_logins(cluster, tmp_path):
    _need_root()
    with local_registry(tmp_path, auth=True, tls=True) as reg:
        await _registry_import(cluster, tmp_path, reg["addr"], {"SSL_CERT_FILE": reg["ca"]})


async def _registry_import(cluster: dict[str, str], tmp_path: Path, registry: str, tls: dict[str, str]) -> None:
    top = uniq("reg")
    project = f"root/{top}"
    oci_layout(
        tmp_path / "app",
        [{"etc/os": b"registry base\n"}, {"opt/app/run": b"#!/bin/sh\necho app\n"}],
        env=["PATH=/usr/bin:/bin", "FROM=registry"],
        workdir="/opt/app",
    )
    push(tmp_path / "app", f"{registry}/team/app:1", "ci:pw")
    ref = f"{registry}/team/app:1"

    def imp(
        *args: str, extra_env: dict[str, str] | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return ctl(cluster, "image", "import", *args, extra_env={**tls, **(extra_env or {})}, stdin=stdin)

    async with admin(cluster) as c:
        await c.create_project("root", top)

        # A certificate from a CA the machine does not trust fails TLS: unavailable.
        r = ctl(cluster, "image", "import", ref, "-as", f"{project}/app:1", "-username", "ci", "-password-stdin",
                stdin="pw\n")
        assert r.returncode == 1 and r.stderr.startswith("error: unavailable:"), r.stderr

        # No credentials: the registry refuses, and nothing is registered.
        r = imp(ref, "-as", f"{project}/app:1")
        assert r.returncode == 1 and r.stderr.startswith("error: unauthenticated:"), r.stderr
        with pytest.raises(DSecError) as ei:
            await c.get_image(f"{project}/app:1")
        assert ei.value.reason == opendsec.NOT_FOUND

        # -username with the password on stdin.
        r = imp(ref, "-as", f"{project}/app:1",
                "-username", "ci", "-password-stdin", stdin="pw\n")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["env"] == ["PATH=/usr/bin:/bin", "FROM=registry"] and got["workdir"] == "/opt/app"
        assert len(got["layers"]) == 2 and got["source"] == ref, got
        assert "layer 1/2" in r.stderr and "layer 2/2" in r.stderr, r.stderr
        # A wrong password is refused the same way.
        r = imp(ref, "-as", f"{project}/app:9",
                "-username", "ci", "-password-stdin", stdin="nope\n")
        assert r.returncode == 1 and r.stderr.startswith("error: unauthenticated:"), r.stderr

        # docker login's saved credentials, through DOCKER_CONFIG; the layers are in the store
        # already, so nothing is read again.
        cfg = tmp_path / "docker"
        cfg.mkdir()
        (cfg / "config.json").write_text(json.dumps(
            {"auths": {registry: {"auth": base64.b64encode(b"ci:pw").decode()}}}))
        r = imp(ref, "-as", f"{project}/app:2",
                extra_env={"DOCKER_CONFIG": str(cfg)})
        assert r.returncode == 0, r.stderr
        assert f"using the credentials for {registry}" in r.stderr, r.stderr
        assert r.stderr.count("already in the store") == 2, r.stderr
        assert json.loads(r.stdout)["layers"] == got["layers"]
        # -registry-auth FILE wins over DOCKER_CONFIG; -q prints nothing on stderr.
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"auths": {registry: {"auth": base64.b64encode(b"ci:wrong").decode()}}}))
        r = imp(ref, "-as", f"{project}/app:3", "-q",
                "-registry-auth", str(bad), extra_env={"DOCKER_CONFIG": str(cfg)})
        assert r.returncode == 1 and r.stderr.startswith("error: unauthenticated:"), r.stderr
        r = imp(ref, "-as", f"{project}/app:3", "-q",
                extra_env={"DOCKER_CONFIG": str(cfg)})
        assert r.returncode == 0 and r.stderr == "", r.stderr

        # A tag the registry lacks is not_found; bad flag combinations are usage errors that
        # change nothing; registry flags on a local path are refused.
        r = imp(f"{registry}/team/app:nope", "-as", f"{project}/app:4",
                extra_env={"DOCKER_CONFIG": str(cfg)})
        assert r.returncode == 1 and "\nerror: not_found:" in r.stderr, r.stderr
        r = imp(ref, "-as", f"{project}/app:4", "-username", "ci")
        assert r.returncode == 2 and "-password-stdin" in r.stderr, r.stderr
        r = imp(str(tmp_path / "app"), "-as", f"{project}/app:4", "-plain-http")
        assert r.returncode == 2 and "registry" in r.stderr, r.stderr
        r = imp("Not A Reference", "-as", f"{project}/app:4")
        assert r.returncode == 1 and r.stderr.startswith("error: invalid:"), r.stderr
        # A name that is also a path here is refused before any lookup; a -registry-auth
        # file that is not there is invalid.
        r = imp("tests", "-as", f"{project}/app:4")
        assert r.returncode == 2 and "./tests" in r.stderr, r.stderr
        r = imp(ref, "-as", f"{project}/app:4", "-registry-auth", str(tmp_path / "none.json"))
        assert r.returncode == 1 and r.stderr.startswith("error: invalid:") and "none.json" in r.stderr, r.stderr

        # image save: an OCI archive with no cluster, which imports to the same layers.
        saved = tmp_path / "saved.tar"
        r = ctl(cluster, "image", "save", ref, "-out", str(saved), "-username", "ci", "-password-stdin",
                stdin="pw\n", extra_env=tls)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["layers"] == 2 and out["bytes"] == saved.stat().st_size, out
        r = imp(f"{saved}#1", "-as", f"{project}/app:4", "-q")
        assert r.returncode == 0 and json.loads(r.stdout)["layers"] == got["layers"], r.stderr
        r = ctl(cluster, "image", "save", f"{registry}/team/app:nope", "-out", str(tmp_path / "nope.tar"),
                "-username", "ci", "-password-stdin", stdin="pw\n", extra_env=tls)
        assert r.returncode == 1 and "error: not_found:" in r.stderr, r.stderr
        assert not (tmp_path / "nope.tar").exists() and not (tmp_path / "nope.tar.partial").exists()
        assert [i.name for i in await c.list_images(project)] == [f"{project}/app:{n}" for n in (1, 2, 3, 4)]

