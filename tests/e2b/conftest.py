"""The E2B compatibility suite's cluster: `opendsec cluster up` with its E2B gateway, and the
three variables E2B's SDKs read set to it (docs/e2b.md "For callers")."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sdk" / "python" / "tests"))

from cluster_fixture import running_cluster  # noqa: E402

E2B_VARS = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")


@contextlib.contextmanager
def _pointed_at(extra: list[str]) -> Iterator[dict[str, str]]:
    """`cluster up <extra>` with E2B_* pointing at its gateway while the block runs."""
    with running_cluster(extra, E2B_VARS + ("OPENDSEC_ADDR", "OPENDSEC_TOKEN", "OPENDSEC_IMAGE_STORE")) as env:
        old = {k: os.environ.get(k) for k in E2B_VARS}
        os.environ.update({k: env[k] for k in E2B_VARS})
        try:
            yield env
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def gateway() -> Iterator[dict[str, str]]:
    """A simulated one-edge cluster with its gateway (the control plane alone)."""
    with _pointed_at(["-sim-edges", "1"]) as env:
        yield env


@pytest.fixture(scope="module")
def linux() -> Iterator[dict[str, str]]:
    """A one-node cluster of real containers (root), template `base` the development image
    `host`: what commands and files run in. Skipped without root, except under CI=true."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("real containers need root; CI runs as root", pytrace=False)
        pytest.skip("real containers need root")
    with _pointed_at(["-sim-edges", "1", "-runtime", "linux", "-network", "off", "-disk-reserve-mb", "-1"]) as env:
        yield env


@pytest.fixture(scope="module")
def bash_image(linux, tmp_path_factory) -> str:
    """A store image of the `linux` cluster with bash (what snapshots and forks copy: the
    development image `host` is a node-local one), by its name, which E2B takes as a template."""
    from cluster_fixture import ctl

    from oci import bash_layout

    layout = tmp_path_factory.mktemp("bash-image") / "oci"
    bash_layout(layout)
    name = "root/e2b-bash:1"
    r = ctl(linux, "image", "import", str(layout), "-as", name, "-q")
    assert r.returncode == 0, r.stderr
    return name


# The code interpreter's tests run where its SDK is installed (scripts/test-e2b.sh installs it
# beside the current `e2b` release only).
collect_ignore = [] if __import__("importlib").util.find_spec("e2b_code_interpreter") else ["test_code_interpreter.py"]


@pytest.fixture(scope="module")
def code_interpreter(linux) -> str:
    """The `linux` cluster with the code interpreter's image imported (built first into
    target/code-interpreter-image when it is not there: a few minutes, PyPI needed)."""
    import subprocess

    from cluster_fixture import ctl

    layout = REPO / "target" / "code-interpreter-image"
    if not (layout / "index.json").is_file():
        subprocess.run(["bash", str(REPO / "packaging" / "code-interpreter" / "build.sh"), str(layout)], check=True)
    r = ctl(linux, "image", "import", f"{layout}#v1", "-as", "root/code-interpreter:v1", "-q")
    assert r.returncode == 0, r.stderr
    return "code-interpreter-v1"
