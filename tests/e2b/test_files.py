"""E2B's own Python SDK reading and writing files through the gateway's envd (docs/e2b.md
"The in-sandbox API"), in real containers: byte-exact contents of any size, listings,
directories, renames, removals, the exceptions the SDK raises, and files surviving pauses."""

from __future__ import annotations

import os

import httpx
import pytest
from e2b import AsyncSandbox, FileType, NotFoundException, Sandbox


@pytest.fixture(scope="module")
def sbx(linux):
    s = Sandbox.create()
    yield s
    s.kill()


def test_text_and_binary_round_trip_byte_exact(sbx):
    info = sbx.files.write("/tmp/e2b/hello.txt", "héllo\n")
    assert (info.path, info.name) == ("/tmp/e2b/hello.txt", "hello.txt")
    assert sbx.files.read("/tmp/e2b/hello.txt") == "héllo\n"
    every_byte = bytes(range(256)) * 4
    sbx.files.write("/tmp/e2b/bin", every_byte)
    assert bytes(sbx.files.read("/tmp/e2b/bin", format="bytes")) == every_byte
    # The sandbox sees the same bytes.
    assert sbx.commands.run("sha256sum /tmp/e2b/bin | cut -c1-16").stdout.strip() == __import__(
        "hashlib"
    ).sha256(every_byte).hexdigest()[:16]
    # Empty files too.
    sbx.files.write("/tmp/e2b/empty", b"")
    assert bytes(sbx.files.read("/tmp/e2b/empty", format="bytes")) == b""


def test_a_file_larger_than_one_call_of_the_api(sbx):
    big = os.urandom(9 << 20) + b"tail"
    sbx.files.write("/tmp/e2b/big", big)
    assert sbx.commands.run("stat -c %s /tmp/e2b/big").stdout.strip() == str(len(big))
    assert bytes(sbx.files.read("/tmp/e2b/big", format="bytes")) == big


def test_several_files_at_once_and_missing_parents(sbx):
    infos = sbx.files.write_files(
        [{"path": "/tmp/e2b/many/a.txt", "data": "A"}, {"path": "/tmp/e2b/many/deep/b.txt", "data": b"B"}]
    )
    assert sorted(i.path for i in infos) == ["/tmp/e2b/many/a.txt", "/tmp/e2b/many/deep/b.txt"]
    assert sbx.commands.run("cat /tmp/e2b/many/a.txt /tmp/e2b/many/deep/b.txt").stdout == "AB"


def test_list_stat_exists_make_dir_rename_remove(sbx):
    sbx.files.write("/tmp/e2b/tree/x.txt", "12345")
    assert sbx.files.make_dir("/tmp/e2b/tree/sub") is True
    assert sbx.files.make_dir("/tmp/e2b/tree/sub") is False
    entries = {e.name: e for e in sbx.files.list("/tmp/e2b/tree")}
    assert set(entries) == {"x.txt", "sub"}
    assert entries["x.txt"].type == FileType.FILE and entries["x.txt"].size == 5
    assert entries["sub"].type == FileType.DIR
    deep = {e.path for e in sbx.files.list("/tmp/e2b", depth=2)}
    assert "/tmp/e2b/tree/x.txt" in deep
    info = sbx.files.get_info("/tmp/e2b/tree/x.txt")
    assert (info.size, info.permissions) == (5, "-rw-r--r--")
    assert sbx.files.exists("/tmp/e2b/tree/x.txt") is True
    assert sbx.files.exists("/tmp/e2b/tree/nope") is False
    moved = sbx.files.rename("/tmp/e2b/tree/x.txt", "/tmp/e2b/tree/sub/y.txt")
    assert moved.path == "/tmp/e2b/tree/sub/y.txt"
    assert sbx.files.read("/tmp/e2b/tree/sub/y.txt") == "12345"
    sbx.files.remove("/tmp/e2b/tree")
    assert sbx.files.exists("/tmp/e2b/tree") is False


def test_missing_files_are_not_found(sbx):
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/e2b/no/such/file")
    with pytest.raises(NotFoundException):
        sbx.files.get_info("/tmp/e2b/no/such/file")
    with pytest.raises(NotFoundException):
        sbx.files.list("/tmp/e2b/no/such/dir")


def test_files_need_the_access_token(sbx):
    url = f"{os.environ['E2B_SANDBOX_URL']}/files"
    r = httpx.get(url, params={"path": "/etc/hostname"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert (r.status_code, r.json()["code"]) == (401, 401)
    r = httpx.get(
        url,
        params={"path": "/etc/hostname"},
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "dsk.nobody.wrong"},
    )
    assert r.status_code == 401


def test_streamed_gzip_and_octet_stream_uploads(sbx):
    """envd 0.5.7's uploads: a file object and an iterable streamed as the body, gzip, and
    octet-stream asked for; each byte-exact, the big one across several calls of the API."""
    import hashlib
    import io

    big = os.urandom(20 << 20)
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    in_sandbox = lambda p: sbx.commands.run(f"sha256sum {p} | cut -d' ' -f1").stdout.strip()  # noqa: E731

    info = sbx.files.write("/tmp/up/file-object", io.BytesIO(big))
    assert (info.path, info.name) == ("/tmp/up/file-object", "file-object")
    assert in_sandbox("/tmp/up/file-object") == sha(big)

    pieces = [b"first,", b"", b"second," * 1000, os.urandom(3 << 20)]
    # Releases that take no iterables stream file objects the same way.
    sbx.files.write("/tmp/up/iterable", iter(pieces) if takes_iterables() else io.BytesIO(b"".join(pieces)))
    assert in_sandbox("/tmp/up/iterable") == sha(b"".join(pieces))

    sbx.files.write("/tmp/up/gz", big, gzip=True)
    assert in_sandbox("/tmp/up/gz") == sha(big)
    sbx.files.write("/tmp/up/text", "héllo", use_octet_stream=True)
    assert sbx.files.read("/tmp/up/text") == "héllo"
    sbx.files.write("/tmp/up/empty", b"", use_octet_stream=True)
    assert sbx.commands.run("stat -c %s /tmp/up/empty").stdout.strip() == "0"


def test_uploads_that_are_not_what_they_say_are_refused(sbx):
    import gzip as gz

    url = f"{os.environ['E2B_SANDBOX_URL']}/files"
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": os.environ["E2B_API_KEY"]}
    octet = {**headers, "Content-Type": "application/octet-stream"}
    r = httpx.post(url, content=b"x", headers=octet)
    assert r.status_code == 400 and "path" in r.json()["message"], r.text
    r = httpx.post(url, params={"path": "/tmp/bad"}, content=b"x", headers={**octet, "Content-Encoding": "br"})
    assert r.status_code == 400 and "br" in r.json()["message"], r.text
    r = httpx.post(url, params={"path": "/tmp/bad"}, content=b"not gzip", headers={**octet, "Content-Encoding": "gzip"})
    assert r.status_code == 400, r.text
    r = httpx.post(url, params={"path": "/tmp/bad"}, content=b"x", headers={**headers, "Content-Type": "text/plain"})
    assert r.status_code == 400, r.text
    # A gzip body that is fine, sent by hand.
    r = httpx.post(
        url, params={"path": "/tmp/good"}, content=gz.compress(b"by hand"), headers={**octet, "Content-Encoding": "gzip"}
    )
    assert r.status_code == 200 and r.json() == [{"path": "/tmp/good", "name": "good", "type": "file"}], r.text
    assert sbx.files.read("/tmp/good") == "by hand"


def takes_iterables() -> bool:
    """Whether this release of the SDK uploads iterables (2.63 does; 2.61 and 2.60 refuse
    them themselves, whatever envd says, and stream only file objects)."""
    from e2b.sandbox.filesystem import filesystem

    return hasattr(filesystem, "_is_chunk_iterable")


async def test_the_async_sdk_streams_an_upload(linux):
    import io

    s = await AsyncSandbox.create()
    try:
        async def chunks():
            for i in range(4):
                yield bytes([i]) * (3 << 20)

        data = chunks() if takes_iterables() else io.BytesIO(b"".join(bytes([i]) * (3 << 20) for i in range(4)))
        await s.files.write("/tmp/async-streamed", data)
        r = await s.commands.run("stat -c %s /tmp/async-streamed; od -An -tu1 -j $((9 << 20)) -N1 /tmp/async-streamed")
        assert r.stdout.split() == [str(12 << 20), "3"], r.stdout
    finally:
        await s.kill()


def test_files_written_before_each_of_five_pauses_all_persist(linux):
    s = Sandbox.create()
    try:
        for i in range(5):
            s.files.write(f"/tmp/cycle/{i}.txt", f"round {i}")
            s.pause()
            s = Sandbox.connect(s.sandbox_id)
        for i in range(5):
            assert s.files.read(f"/tmp/cycle/{i}.txt") == f"round {i}"
    finally:
        s.kill()


async def test_the_async_sdk_reads_and_writes(linux):
    s = await AsyncSandbox.create()
    try:
        await s.files.write("/tmp/async.bin", b"\x00\xffasync")
        assert bytes(await s.files.read("/tmp/async.bin", format="bytes")) == b"\x00\xffasync"
        assert [e.name for e in await s.files.list("/tmp") if e.name == "async.bin"] == ["async.bin"]
    finally:
        await s.kill()


def sdk_takes(method, param: str) -> bool:
    """Whether this release of the SDK has `param` on `method` (older ones lack metadata
    and the newer watch flags)."""
    import inspect

    return param in inspect.signature(method).parameters


def test_file_metadata_is_kept_replaced_and_shown_everywhere(sbx):
    """envd 0.6.2's metadata: `user.e2b.*` attributes on the file, set by an upload's
    headers, replaced (or cleared) by the next upload, shown by get_info, list and rename,
    and the same attributes a process in the sandbox sees."""
    if not sdk_takes(sbx.files.write, "metadata"):
        pytest.skip("this SDK release has no file metadata")
    info = sbx.files.write("/tmp/meta/a.txt", "x", metadata={"Kind": "report", "step": "1"})
    # Keys travel as header names: lower-cased.
    assert info.metadata == {"kind": "report", "step": "1"}
    assert sbx.files.get_info("/tmp/meta/a.txt").metadata == {"kind": "report", "step": "1"}
    got = sbx.commands.run("getfattr --version >/dev/null 2>&1 && getfattr -d /tmp/meta/a.txt || true").stdout
    if got:
        assert 'user.e2b.kind="report"' in got, got
    # Set in the sandbox, seen through the API.
    sbx.commands.run("cd /tmp/meta && touch b.txt && python3 -c \"import os; os.setxattr('b.txt', 'user.e2b.by', b'sandbox')\"")
    entries = {e.name: e for e in sbx.files.list("/tmp/meta")}
    assert entries["a.txt"].metadata == {"kind": "report", "step": "1"}
    assert entries["b.txt"].metadata == {"by": "sandbox"}
    moved = sbx.files.rename("/tmp/meta/a.txt", "/tmp/meta/c.txt")
    assert moved.metadata == {"kind": "report", "step": "1"}
    # The next upload replaces it all; one with none clears it.
    sbx.files.write("/tmp/meta/c.txt", "y", metadata={"step": "2"})
    assert sbx.files.get_info("/tmp/meta/c.txt").metadata == {"step": "2"}
    info = sbx.files.write("/tmp/meta/c.txt", "z")
    assert info.metadata is None
    assert sbx.files.get_info("/tmp/meta/c.txt").metadata is None
    # Octet-stream and gzip uploads carry it too.
    info = sbx.files.write("/tmp/meta/d.bin", b"1234", metadata={"k": "v"}, gzip=True)
    assert info.metadata == {"k": "v"}
    assert sbx.files.get_info("/tmp/meta/d.bin").metadata == {"k": "v"}
    # Owners by name, and a symlink's target.
    sbx.commands.run("ln -sf c.txt /tmp/meta/link")
    link = sbx.files.get_info("/tmp/meta/link")
    assert link.symlink_target == "c.txt" and link.metadata is None
    me = sbx.commands.run("id -un; id -gn").stdout.split()
    got = sbx.files.get_info("/tmp/meta/c.txt")
    assert [got.owner, got.group] == me


def test_metadata_the_sandbox_refuses_is_invalid_and_writes_nothing(sbx):
    from e2b import InvalidArgumentException

    if not sdk_takes(sbx.files.write, "metadata"):
        pytest.skip("this SDK release has no file metadata")
    sbx.files.write("/tmp/meta2/f", "before", metadata={"k": "v"})
    # 2 KiB of keys and values fits on every file system with user attributes, even with
    # 64 keys; a byte more is refused before anything is written.
    most = {"k": "v" * 2047}
    sbx.files.write("/tmp/meta2/most", "x", metadata=most)
    assert sbx.files.get_info("/tmp/meta2/most").metadata == most
    many = {f"key{i:02}": "v" * 27 for i in range(64)}
    sbx.files.write("/tmp/meta2/many", "x", metadata=many)
    assert sbx.files.get_info("/tmp/meta2/many").metadata == many
    for bad in ({"k": "v" * 2048}, {"k" * 201: "v"}, {f"k{i}": "v" for i in range(65)}):
        with pytest.raises(InvalidArgumentException):
            sbx.files.write("/tmp/meta2/f", "after", metadata=bad)
        assert sbx.files.read("/tmp/meta2/f") == "before"
        assert sbx.files.get_info("/tmp/meta2/f").metadata == {"k": "v"}
    # By hand: a value that is not printable ASCII, and a key sent twice.
    url = f"{os.environ['E2B_SANDBOX_URL']}/files"
    headers = [
        ("E2b-Sandbox-Id", sbx.sandbox_id),
        ("X-Access-Token", os.environ["E2B_API_KEY"]),
        ("Content-Type", "application/octet-stream"),
    ]
    for extra in ([("X-Metadata-k", "caf\u00e9".encode())], [("X-Metadata-k", "1"), ("X-Metadata-K", "2")]):
        r = httpx.post(url, params={"path": "/tmp/meta2/f"}, content=b"after", headers=headers + extra)
        assert r.status_code == 400 and "metadata" in r.json()["message"], r.text
    assert sbx.files.read("/tmp/meta2/f") == "before"


def test_watch_entries_carry_their_info_and_metadata(sbx):
    if not sdk_takes(sbx.files.watch_dir, "include_entry"):
        pytest.skip("this SDK release has no include_entry")
    import time

    from e2b import FilesystemEventType

    sbx.files.make_dir("/tmp/meta3")
    h = sbx.files.watch_dir("/tmp/meta3", include_entry=True)
    sbx.files.write("/tmp/meta3/f", "hello", metadata={"k": "v"})
    end, events = time.monotonic() + 20, []
    # Setting the metadata, after the data, is a change of attributes: `chmod`.
    while time.monotonic() < end:
        events += h.get_new_events()
        if any(e.name == "f" and e.type == FilesystemEventType.CHMOD for e in events):
            break
        time.sleep(0.2)
    h.stop()
    writes = [e for e in events if e.name == "f" and e.type == FilesystemEventType.WRITE]
    assert writes, events
    entry = writes[-1].entry
    assert entry is not None and entry.name == "f" and entry.type == FileType.FILE
    assert entry.path == "/tmp/meta3/f" and entry.size == 5
    attrs = [e for e in events if e.name == "f" and e.type == FilesystemEventType.CHMOD]
    assert attrs and attrs[-1].entry is not None and attrs[-1].entry.metadata == {"k": "v"}, events


def test_files_as_another_user_are_that_user_s(sbx):
    """`user=` on file calls: the calls run as that user, so the kernel decides what they may
    touch, and what they write is theirs; an unknown user is refused."""
    from e2b import InvalidArgumentException, SandboxException

    sbx.files.write("/tmp/users/private", "the default user's")
    sbx.commands.run("chmod 600 /tmp/users/private && chmod 1777 /tmp/users")
    info = sbx.files.write("/tmp/users/theirs.txt", "nobody's", user="nobody")
    assert info.path == "/tmp/users/theirs.txt"
    entry = sbx.files.get_info("/tmp/users/theirs.txt", user="nobody")
    assert entry.owner == "nobody"
    assert sbx.commands.run("stat -c %U /tmp/users/theirs.txt").stdout.strip() == "nobody"
    assert sbx.files.read("/tmp/users/theirs.txt", user="nobody") == "nobody's"
    with pytest.raises(SandboxException) as ei:
        sbx.files.read("/tmp/users/private", user="nobody")
    assert "ermission denied" in str(ei.value), ei.value
    with pytest.raises(SandboxException):
        sbx.files.write("/tmp/users/private", "overwritten", user="nobody")
    with pytest.raises(SandboxException):
        sbx.files.remove("/tmp/users/private", user="nobody")
    assert sbx.files.read("/tmp/users/private") == "the default user's"
    names = {e.name for e in sbx.files.list("/tmp/users", user="nobody")}
    assert names == {"private", "theirs.txt"}
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/tmp/users/theirs.txt", user="no-such-user")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/tmp/users/theirs.txt", user="a b")
    # `user:group` is no user for files, as for commands (a uid alone is one).
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/tmp/users/theirs.txt", user="root:0")
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("id -u", user="root:0")
    assert sbx.commands.run("id -un", user="65534").stdout == "nobody\n"


def test_a_refused_upload_is_answered_not_cut_off(sbx):
    """An upload refused before its body is read (here: a user the sandbox lacks) still
    reads the body through, so the SDK sees the 400, not a broken pipe."""
    from e2b import InvalidArgumentException

    big = os.urandom(24 << 20)
    with pytest.raises(InvalidArgumentException) as ei:
        sbx.files.write("/tmp/refused.bin", big, user="no-such-user")
    assert "no-such-user" in str(ei.value), ei.value
    assert not sbx.files.exists("/tmp/refused.bin")
