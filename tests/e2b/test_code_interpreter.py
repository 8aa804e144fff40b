"""E2B's code interpreter SDK (`e2b-code-interpreter`) against the template
`code-interpreter-v1` (docs/e2b.md "Code interpreter"): our server on port 49999 of the
sandbox, over Jupyter kernels: results, logs, errors, display data (PNG charts, pandas tables
as HTML and data), contexts, environment variables, timeouts that interrupt the kernel."""

from __future__ import annotations

import time

import pytest
from e2b_code_interpreter import Sandbox


@pytest.fixture(scope="module")
def ci(code_interpreter):
    s = Sandbox.create(code_interpreter, timeout=900)
    yield s
    s.kill()


def test_code_runs_keeps_its_state_and_reports_output(ci):
    seen: list[str] = []
    e = ci.run_code("x = 41\nprint('out')\nimport sys; print('err', file=sys.stderr)\nx + 1", on_stdout=lambda m: seen.append(m.line))
    assert e.text == "42" and e.error is None
    assert e.logs.stdout == ["out\n"] and e.logs.stderr == ["err\n"]
    assert seen == ["out\n"]
    assert ci.run_code("x").text == "41"
    assert e.execution_count >= 1


def test_errors_come_back_as_the_kernel_gives_them(ci):
    e = ci.run_code("raise ValueError('bad input')")
    assert e.error is not None and (e.error.name, e.error.value) == ("ValueError", "bad input")
    assert "ValueError" in e.error.traceback
    assert ci.run_code("1 + 1").text == "2"


def test_charts_are_png_and_tables_are_html_and_data(ci):
    e = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert any(r.png for r in e.results), [r.formats() for r in e.results]
    e = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    main = [r for r in e.results if r.is_main_result][0]
    assert "<table" in main.html
    assert main.data == {"columns": ["a", "b"], "index": [0, 1], "data": [[1, "x"], [2, "y"]]}


def test_envs_apply_to_one_execution(ci):
    e = ci.run_code("import os; os.environ.get('ODSEC_CI')", envs={"ODSEC_CI": "yes"})
    assert e.text == "'yes'"
    assert ci.run_code("import os; os.environ.get('ODSEC_CI')").text is None


def test_contexts_are_kernels_of_their_own(ci):
    c = ci.create_code_context(cwd="/tmp")
    assert c.language == "python" and c.cwd == "/tmp"
    assert ci.run_code("import os; os.getcwd()", context=c).text == "'/tmp'"
    ci.run_code("only_here = 1", context=c)
    assert ci.run_code("'only_here' in globals()").text == "False"
    assert ci.run_code("only_here", context=c).text == "1"
    assert c.id in [x.id for x in ci.list_code_contexts()]
    ci.restart_code_context(c)
    assert ci.run_code("only_here", context=c).error.name == "NameError"
    ci.remove_code_context(c)
    assert c.id not in [x.id for x in ci.list_code_contexts()]


def test_a_timeout_interrupts_the_kernel(ci):
    from e2b import TimeoutException

    start = time.monotonic()
    with pytest.raises(TimeoutException):
        ci.run_code("import time\ntime.sleep(60)", timeout=2)
    # The kernel was interrupted: the next code runs at once, not after the sleep.
    assert ci.run_code("'free'").text == "'free'"
    assert time.monotonic() - start < 30


def test_a_kernel_killed_from_inside_is_an_error_and_its_context_lives_on(ci):
    c = ci.create_code_context()
    ci.run_code("state = 1", context=c)
    start = time.monotonic()
    e = ci.run_code("import os\nos.kill(os.getpid(), 9)", context=c, timeout=60)
    assert e.error is not None and e.error.name == "KernelDied", e
    assert time.monotonic() - start < 30
    # The context has a fresh kernel: it runs code, and its state is gone.
    assert ci.run_code("state", context=c).error.name == "NameError"
    assert ci.run_code("6 * 7", context=c).text == "42"
    ci.remove_code_context(c)


def test_bash_runs_in_a_bash_kernel(ci):
    e = ci.run_code("X=41; echo $((X + 1))", language="bash")
    assert e.error is None and "".join(e.logs.stdout) == "42\n", e
    assert "".join(ci.run_code("echo $X", language="bash").logs.stdout) == "41\n"


def test_a_context_id_that_is_no_context_s_is_a_plain_400(ci):
    import httpx

    url = ci._jupyter_url + "/execute"
    headers = {"E2b-Sandbox-Id": ci.sandbox_id, "E2b-Sandbox-Port": "49999"}
    if ci._envd_access_token:
        headers["X-Access-Token"] = ci._envd_access_token
    for bad in (5, "", [1], {"a": 1}):
        r = httpx.post(url, json={"code": "1", "context_id": bad}, headers=headers, timeout=30)
        assert (r.status_code, r.text) == (400, "context_id must be a context's id"), bad
    r = httpx.post(url, json={"code": "1", "context_id": "nope"}, headers=headers, timeout=30)
    assert r.status_code == 404
