"""E2B's own Python SDK watching directories through the gateway (docs/e2b.md "Watching a
directory"), in real containers: the sync SDK's polled watchers (CreateWatcher,
GetWatcherEvents, RemoveWatcher) and the async SDK's stream (WatchDir), every event type the
SDKs map, recursive watches following directories made later, and the errors."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import (
    AsyncSandbox,
    FilesystemEventType,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxException,
)


@pytest.fixture(scope="module")
def sbx(linux):
    s = Sandbox.create()
    yield s
    s.kill()


def poll(handle, until, within: float = 10.0):
    """Events from `handle` until `until(events)` holds or `within` seconds pass."""
    events = []
    end = time.monotonic() + within
    while time.monotonic() < end:
        events += handle.get_new_events()
        if until(events):
            break
        time.sleep(0.1)
    return events


def seen(events) -> list[tuple[str, FilesystemEventType]]:
    return [(e.name, e.type) for e in events]


def test_the_sync_sdk_sees_every_event_type(sbx):
    sbx.files.make_dir("/tmp/w1")
    h = sbx.files.watch_dir("/tmp/w1")
    sbx.files.write("/tmp/w1/a.txt", "hello")
    sbx.commands.run("chmod 600 /tmp/w1/a.txt && mv /tmp/w1/a.txt /tmp/w1/b.txt && rm /tmp/w1/b.txt")
    events = poll(h, lambda ev: ("b.txt", FilesystemEventType.REMOVE) in seen(ev))
    got = seen(events)
    for want in [
        ("a.txt", FilesystemEventType.CREATE),
        ("a.txt", FilesystemEventType.WRITE),
        ("a.txt", FilesystemEventType.CHMOD),
        ("a.txt", FilesystemEventType.RENAME),
        ("b.txt", FilesystemEventType.CREATE),
        ("b.txt", FilesystemEventType.REMOVE),
    ]:
        assert want in got, (want, got)
    # Each event is handed out once.
    assert h.get_new_events() == []
    h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()


def test_a_recursive_watch_follows_new_directories_and_a_flat_one_does_not(sbx):
    sbx.files.make_dir("/tmp/w2")
    deep = sbx.files.watch_dir("/tmp/w2", recursive=True)
    flat = sbx.files.watch_dir("/tmp/w2")
    sbx.files.make_dir("/tmp/w2/sub/inner")
    sbx.files.write("/tmp/w2/sub/inner/f.txt", "x")
    events = poll(deep, lambda ev: ("sub/inner/f.txt", FilesystemEventType.WRITE) in seen(ev))
    assert ("sub/inner/f.txt", FilesystemEventType.WRITE) in seen(events), seen(events)
    assert ("sub", FilesystemEventType.CREATE) in seen(events), seen(events)
    flat_events = seen(poll(flat, lambda ev: False, within=1.0))
    assert flat_events == [("sub", FilesystemEventType.CREATE)], flat_events
    deep.stop()
    flat.stop()


def test_watching_what_is_no_directory_is_refused(sbx):
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir("/tmp/no-such-dir")
    sbx.files.write("/tmp/w3-file", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.watch_dir("/tmp/w3-file")


def test_a_stopped_or_unknown_watcher_is_not_found(sbx):
    from e2b.sandbox_sync.filesystem.watch_handle import WatchHandle

    sbx.files.make_dir("/tmp/w4")
    h = sbx.files.watch_dir("/tmp/w4")
    h.stop()
    fs = sbx.files
    # Past the SDK's own check of a stopped handle: the sandbox no longer knows the id,
    # nor one it never gave.
    for wid in (h._watcher_id, "0123456789abcdef"):
        stale = WatchHandle(fs._rpc, wid, fs._connection_config, fs._envd_version)
        with pytest.raises(NotFoundException) as e:
            stale.get_new_events()
        assert "does not exist" in str(e.value), e.value
        with pytest.raises(NotFoundException):
            stale.stop()


async def test_the_async_sdk_streams_events_until_stopped(linux):
    sb = await AsyncSandbox.create()
    try:
        await sb.files.make_dir("/tmp/aw")
        got: list[tuple[str, FilesystemEventType]] = []
        exits: list[object] = []
        arrived = asyncio.Event()

        def on_event(e):
            got.append((e.name, e.type))
            if (e.name, e.type) == ("deep/f.txt", FilesystemEventType.WRITE):
                arrived.set()

        h = await sb.files.watch_dir("/tmp/aw", on_event, on_exit=exits.append, recursive=True)
        await sb.files.make_dir("/tmp/aw/deep")
        await sb.files.write("/tmp/aw/deep/f.txt", "x")
        await asyncio.wait_for(arrived.wait(), 10)
        assert ("deep", FilesystemEventType.CREATE) in got, got
        await h.stop()
        assert exits == [None]
        # Stopped means stopped: nothing more arrives.
        n = len(got)
        await sb.files.write("/tmp/aw/after.txt", "x")
        await asyncio.sleep(0.5)
        assert len(got) == n, got[n:]

        # A watch with a timeout ends with the SDK's TimeoutException.
        ended = asyncio.Event()
        errors: list[object] = []

        def on_exit(err):
            errors.append(err)
            ended.set()

        t0 = time.monotonic()
        await sb.files.watch_dir("/tmp/aw", lambda e: None, on_exit=on_exit, timeout=1)
        await asyncio.wait_for(ended.wait(), 10)
        assert time.monotonic() - t0 < 8
        assert type(errors[0]).__name__ == "TimeoutException", errors

        with pytest.raises(NotFoundException):
            await sb.files.watch_dir("/tmp/aw/none", lambda e: None)
    finally:
        await sb.kill()


def test_a_watcher_read_too_seldom_says_it_lost_events(sbx):
    sbx.files.make_dir("/tmp/w5")
    h = sbx.files.watch_dir("/tmp/w5")
    # Long names: more than the watcher holds between two reads (256 KiB of events).
    pad = "n" * 200
    r = sbx.commands.run(f"cd /tmp/w5 && for i in $(seq 3000); do : > {pad}$i; done")
    assert r.exit_code == 0
    time.sleep(0.5)
    with pytest.raises(SandboxException) as e:
        h.get_new_events()
    assert "lost" in str(e.value), e.value
    # It goes on with what comes next.
    sbx.files.write("/tmp/w5/after", "x")
    events = poll(h, lambda ev: ("after", FilesystemEventType.WRITE) in seen(ev))
    assert ("after", FilesystemEventType.WRITE) in seen(events), seen(events)
    h.stop()
