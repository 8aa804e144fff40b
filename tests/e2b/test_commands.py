"""E2B's own Python SDK running commands and terminals through the gateway's envd
(docs/e2b.md "The in-sandbox API"), in real containers: exact output, exit codes, the
exceptions the SDK raises, and E2B's known failure modes."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    PtySize,
    Sandbox,
    TimeoutException,
)


@pytest.fixture(scope="module")
def sbx(linux):
    s = Sandbox.create(envs={"FROM_CREATE": "made", "SHADOWED": "create"})
    yield s
    s.kill()


def pids(s: Sandbox) -> list[int]:
    return sorted(p.pid for p in s.commands.list())


def wait_until(what: str, f, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not f():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_output_exit_codes_and_streams_apart(sbx):
    r = sbx.commands.run("echo out; echo err >&2; printf 'no newline'")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\nno newline", "err\n", 0)
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; echo why >&2; exit 3")
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "partial\n", "why\n")
    seen: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"


def test_environment_working_directory_and_user(sbx):
    # Creation envs apply to every command; the command's own win.
    r = sbx.commands.run("echo $FROM_CREATE $SHADOWED $ONLY; pwd", envs={"SHADOWED": "cmd", "ONLY": "1"}, cwd="/tmp")
    assert r.stdout == "made cmd 1\n/tmp\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"
    # nobody's home (/nonexistent) is not there: its commands start in `/`, as login does.
    assert sbx.commands.run("pwd; id -un", user="nobody").stdout == "/\nnobody\n"


def started(s: Sandbox, marker: str) -> bool:
    return s.commands.run(f"test -e {marker} && echo yes || true").stdout == "yes\n"


# The commands killed below first show they are past their login shell's start-up: a login
# shell killed while it reads the profile can leave the profile's lock files behind (on the
# development image, pyenv's rehash lock), and the next login shell then waits on them.


def test_background_list_and_kill(sbx):
    h = sbx.commands.run("touch /tmp/bg.started; exec sleep 300", background=True)
    wait_until("the command to start", lambda: started(sbx, "/tmp/bg.started"))
    assert h.pid in pids(sbx)
    assert sbx.commands.kill(h.pid) is True
    wait_until("the killed command to leave the list", lambda: h.pid not in pids(sbx))
    assert sbx.commands.kill(h.pid) is False
    assert sbx.commands.run("echo still here").stdout == "still here\n"


def sleeps(s: Sandbox, pattern: str) -> int:
    """How many `sleep` processes run with an argument matching `pattern`."""
    return int(s.commands.run(f"pgrep -a -x sleep | grep -c -E ' {pattern}$' || true").stdout.strip())


def test_kill_ends_the_whole_tree(sbx):
    h = sbx.commands.run("sleep 301 & sleep 302 & wait", background=True)
    wait_until("both children", lambda: sleeps(sbx, "30[12]") == 2)
    assert sbx.commands.kill(h.pid) is True
    wait_until("no child left", lambda: sleeps(sbx, "30[12]") == 0)


def test_kill_ends_what_left_the_process_group_too(sbx):
    # A terminal's shell puts each job in a group of its own; setsid leaves the group too.
    t = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(t.pid, b"sleep 311 & sleep 312 & setsid sleep 313 & echo started\n")
    wait_until("the terminal's jobs", lambda: sleeps(sbx, "31[123]") == 3)
    assert sbx.pty.kill(t.pid) is True
    wait_until("no job left", lambda: sleeps(sbx, "31[123]") == 0)
    h = sbx.commands.run("setsid sleep 321 & sleep 322", background=True)
    wait_until("both", lambda: sleeps(sbx, "32[12]") == 2)
    assert sbx.commands.kill(h.pid) is True
    wait_until("none", lambda: sleeps(sbx, "32[12]") == 0)


def test_a_timeout_raises_promptly_and_the_command_is_gone(sbx):
    started_at = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 60", timeout=2)
    assert time.monotonic() - started_at < 5
    wait_until("no sleep left", lambda: sleeps(sbx, "60") == 0)


def test_stdin_send_and_close(sbx):
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "line one\n")
    sbx.commands.send_stdin(h.pid, "line two\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "line one\nline two\ndone\n"


def test_connect_follows_a_running_command_past_a_long_line(sbx):
    sbx.commands.run("rm -f /tmp/go.fifo; mkfifo /tmp/go.fifo")
    h = sbx.commands.run("read go < /tmp/go.fifo; head -c 8192 /dev/zero | tr '\\0' x; echo; echo end", background=True)
    again = sbx.commands.connect(h.pid)
    # It waits on the FIFO: nothing was printed before the connect.
    sbx.commands.run("echo go > /tmp/go.fifo", timeout=10)
    seen: list[str] = []
    r = again.wait(on_stdout=seen.append)
    assert r.stdout == "x" * 8192 + "\nend\n"
    assert "".join(seen) == r.stdout


def test_a_streaming_method_sent_as_unary_is_refused_by_name(sbx):
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": os.environ["E2B_API_KEY"],
         "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    r = httpx.post(os.environ["E2B_SANDBOX_URL"] + "/process.Process/Start",
                   json={"process": {"cmd": "/bin/true"}}, headers=h)
    assert r.status_code == 400 and "streaming method" in r.json()["message"], r.text
    h["Content-Type"] = "application/connect+json"
    r = httpx.post(os.environ["E2B_SANDBOX_URL"] + "/process.Process/List", content=b"", headers=h)
    assert "unary method" in r.text, r.text


def test_a_terminal(sbx):
    t = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(t.pid, b"echo $((6*7))\n")
    sbx.pty.resize(t.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(t.pid, b"stty size; exit\n")
    out: list[bytes] = []
    t.wait(on_pty=out.append)
    text = b"".join(out)
    assert b"42\r\n" in text and b"30 100\r\n" in text, text


def test_a_wrong_access_token_is_refused(sbx):
    for token in ("dsk.nobody.wrong", None):
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/json"}
        if token:
            headers["X-Access-Token"] = token
        r = httpx.post(f"{os.environ['E2B_SANDBOX_URL']}/process.Process/List", headers=headers, content=b"{}")
        assert (r.status_code, r.json()["code"]) == (401, "unauthenticated")


async def test_the_async_sdk_runs_commands(linux):
    s = await AsyncSandbox.create()
    try:
        r = await s.commands.run("echo async; exit 0")
        assert (r.stdout, r.exit_code) == ("async\n", 0)
        h = await s.commands.run("touch /tmp/a.started; exec sleep 300", background=True)
        for _ in range(100):
            if (await s.commands.run("test -e /tmp/a.started && echo yes || true")).stdout == "yes\n":
                break
        assert await s.commands.kill(h.pid) is True
        r = await s.commands.run("echo after")
        assert r.stdout == "after\n"
    finally:
        await s.kill()


def test_after_pause_and_resume_a_background_server_is_listed_and_killable(linux):
    s = Sandbox.create()
    try:
        h = s.commands.run("touch /tmp/s.started; exec sleep 303", background=True)
        wait_until("the command to start", lambda: started(s, "/tmp/s.started"))
        s.pause()
        s2 = Sandbox.connect(s.sandbox_id)
        assert h.pid in pids(s2)
        assert s2.commands.kill(h.pid) is True
        wait_until("gone", lambda: h.pid not in pids(s2))
    finally:
        s.kill()


def test_a_call_after_a_timeout_pause_resumes_it_for_its_idle_timeout(linux):
    """A sandbox its timeout paused (lifecycle on_timeout pause) and a command resumed runs
    on while used, and pauses again after its timeout of idleness (docs/e2b.md "Pausing on
    timeout"); it used to be paused again at once, its spent lifetime still counting."""
    s = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        wait_until("the timeout to pause it", lambda: s.get_info().state.value == "paused", 20)
        assert s.commands.run("echo back").stdout == "back\n"
        for _ in range(3):
            time.sleep(1)
            assert s.get_info().state.value == "running"
            assert s.commands.run("true").exit_code == 0
        wait_until("idleness to pause it again", lambda: s.get_info().state.value == "paused", 20)
        assert s.commands.run("echo again").stdout == "again\n"
    finally:
        s.kill()
