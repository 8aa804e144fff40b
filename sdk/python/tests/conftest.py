"""Shared fixtures: in-process fake servers."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cluster_fixture import cluster  # noqa: E402,F401  (the session's cluster)
from fake_server import FakeServer  # noqa: E402


@pytest.fixture
async def fake():
    """One running fake DSec server."""
    srv = await FakeServer("a").start()
    yield srv
    await srv.stop()


@pytest.fixture
async def fake2():
    """A second running fake DSec server."""
    srv = await FakeServer("b").start()
    yield srv
    await srv.stop()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, request):
    """Unit tests never see the caller's OPENDSEC_* variables (the cluster tests set their own)."""
    if "cluster" in request.keywords:
        return
    for k in ("OPENDSEC_ADDR", "OPENDSEC_TOKEN", "OPENDSEC_PROJECT", "OPENDSEC_CA"):
        monkeypatch.delenv(k, raising=False)
