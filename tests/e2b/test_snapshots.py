"""E2B's own Python SDK taking snapshots and forks through the gateway (docs/e2b.md
"Snapshots and forks"), in real containers of a store image: a snapshot is an image that
`Sandbox.create` starts from, listed, renamed over and deleted as E2B does; a fork's copies
carry the source's files and go their own ways."""

from __future__ import annotations

import datetime as dt
import json
import os
import urllib.error
import urllib.request

import pytest
from e2b import NotFoundException, Sandbox, SandboxException


def raw(method: str, path: str, body: object = None) -> tuple[int, object]:
    """One control-plane request without the SDK: status and decoded body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(os.environ["E2B_API_URL"] + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("X-API-KEY", os.environ["E2B_API_KEY"])
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def read(sbx: Sandbox, path: str) -> str:
    return sbx.commands.run(f"cat {path}").stdout


@pytest.fixture(scope="module")
def source(bash_image):
    s = Sandbox.create(bash_image, timeout=600)
    yield s
    s.kill()


def test_a_snapshot_is_a_template_that_keeps_the_files_of_its_moment(source):
    source.files.write("/srv/state", "v1\n")
    snap = source.create_snapshot("warm")
    assert snap.snapshot_id == "root/warm:default"
    assert snap.names == ["root/warm:default"]
    source.files.write("/srv/state", "after\n")
    made = []
    try:
        copy = Sandbox.create(snap.snapshot_id)
        made.append(copy)
        assert read(copy, "/srv/state") == "v1\n"
        assert read(copy, "/srv/from-image") == "image\n"
        assert copy.get_info().template_id == "root/warm:default"
        # The same name again: E2B gives the name the new snapshot.
        source.files.write("/srv/state", "v2\n")
        again = source.create_snapshot("warm")
        assert again.snapshot_id == snap.snapshot_id
        newer = Sandbox.create(snap.snapshot_id)
        made.append(newer)
        assert read(newer, "/srv/state") == "v2\n"
        # The copy made before is its own sandbox, untouched.
        assert read(copy, "/srv/state") == "v1\n"
    finally:
        for s in made:
            s.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True


def test_snapshots_are_listed_by_sandbox_and_name_page_by_page(source, bash_image):
    other = Sandbox.create(bash_image)
    ids = []
    try:
        ids.append(source.create_snapshot().snapshot_id)
        ids.append(source.create_snapshot("listed:v1").snapshot_id)
        ids.append(other.create_snapshot("elsewhere").snapshot_id)
        assert ids[0].startswith("root/snapshot-") and ids[0].endswith(":default")
        assert ids[1] == "root/listed:v1"

        def every(paginator) -> list[str]:
            out = []
            while paginator.has_next:
                out += [s.snapshot_id for s in paginator.next_items()]
            return out

        assert every(source.list_snapshots()) == sorted(ids[:2])
        assert every(other.list_snapshots()) == [ids[2]]
        # One at a time: the page token carries on where the last page ended.
        assert every(Sandbox.list_snapshots(limit=1)) == sorted(
            i for i in every(Sandbox.list_snapshots())
        )
        assert set(ids) <= set(every(Sandbox.list_snapshots(limit=1)))
        for name in ("listed", "listed:v1", "root/listed", "root/listed:v1"):
            assert every(Sandbox.list_snapshots(name=name)) == ["root/listed:v1"], name
        assert every(Sandbox.list_snapshots(name="listed:v2")) == []
        for other_id in ("garbage!", "node-0-0000000000000000"):
            assert every(Sandbox.list_snapshots(sandbox_id=other_id)) == [], other_id
    finally:
        for i in ids:
            assert Sandbox.delete_snapshot(i) is True
        other.kill()
    assert every(source.list_snapshots()) == []


def test_snapshot_refusals(source, bash_image):
    # A container keeps no memory: a full (memory) snapshot is refused, not taken without it.
    with pytest.raises(SandboxException) as ei:
        source.create_snapshot("full", mode="full")
    assert "memory" in str(ei.value)
    for body, why in [
        ({"name": "Upper"}, "lower case"),
        ({"name": "root/elsewhere"}, "give its name alone"),
        ({"name": 5}, "name must be a string"),
        ({"name": "x", "keep": True}, "keep"),
    ]:
        status, err = raw("POST", f"/sandboxes/{source.sandbox_id}/snapshots", body)
        assert status == 400 and why in err["message"], (body, status, err)
    for query, why in [("limit=0", "limit"), ("limit=x", "limit"), ("nextToken=%3C%3E", "nextToken"),
                       # A snapshot's own name is no page token of ours: it would skip names.
                       ("nextToken=root%2Fe2b%2Fa%3Adefault", "nextToken")]:
        status, err = raw("GET", f"/snapshots?{query}")
        assert status == 400 and why in err["message"], (query, status, err)
    # The image the sandbox came from is no snapshot: its name is not taken over.
    status, err = raw("POST", f"/sandboxes/{source.sandbox_id}/snapshots", {"name": "e2b-bash:1"})
    assert status == 409 and "not a snapshot" in err["message"], err
    # Deleting: only snapshots, and each once; templates and images stay.
    assert Sandbox.delete_snapshot("base") is False
    assert Sandbox.delete_snapshot(bash_image) is False
    assert Sandbox.delete_snapshot("root/never-made:default") is False
    gone = Sandbox.create(bash_image)
    gone.kill()
    with pytest.raises(NotFoundException):
        gone.create_snapshot("late")
    # Nothing was made by the refusals.
    assert [s.snapshot_id for s in Sandbox.list_snapshots().next_items()] == []


def test_fork_makes_independent_copies_with_their_own_timeout(source):
    source.files.write("/srv/forked", "before\n")
    started = dt.datetime.now(dt.timezone.utc)
    copies = source.fork(timeout=90, count=2)
    try:
        assert len(copies) == 2 and all(isinstance(c, Sandbox) for c in copies), copies
        a, b = copies
        assert len({a.sandbox_id, b.sandbox_id, source.sandbox_id}) == 3
        for c in copies:
            assert read(c, "/srv/forked") == "before\n"
            info = c.get_info()
            assert (info.end_at - info.started_at).total_seconds() == 90
            assert info.started_at >= started - dt.timedelta(seconds=5)
        a.files.write("/srv/forked", "a\n")
        assert read(b, "/srv/forked") == "before\n"
        assert read(source, "/srv/forked") == "before\n"
        # The source runs on, its own timeout untouched.
        assert source.is_running()
        assert source.get_info().end_at - source.get_info().started_at == dt.timedelta(seconds=600)
    finally:
        for c in copies:
            if isinstance(c, Sandbox):
                c.kill()


def test_fork_refusals(source, linux):
    for body, why in [
        ({"count": 0}, "count must be a whole number within 1..=20"),
        ({"count": 21}, "count must be a whole number within 1..=20"),
        ({"count": "2"}, "count must be a whole number"),
        ({"timeout": -1}, "timeout must be a whole number"),
        ({"memory": True}, "memory"),
    ]:
        status, err = raw("POST", f"/sandboxes/{source.sandbox_id}/fork", body)
        assert status == 400 and why in err["message"], (body, status, err)
    # The development image `host` is the node's own, not the store's: nothing to copy.
    host = Sandbox.create()
    try:
        with pytest.raises(SandboxException) as ei:
            host.fork()
        assert "node-local image" in str(ei.value)
    finally:
        host.kill()
    with pytest.raises(NotFoundException):
        Sandbox.fork(host.sandbox_id)


def test_snapshots_under_one_name_at_once_all_succeed(source):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda _: source.create_snapshot("same").snapshot_id, range(6)))
    assert got == ["root/same:default"] * 6
    assert Sandbox.delete_snapshot("root/same:default") is True
