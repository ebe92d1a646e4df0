"""E2B's code interpreter on Corral, driven by E2B's own SDK (`e2b-code-interpreter` from PyPI): values and
streams, errors, charts, DataFrames, contexts, per-cell env vars, execution counts, languages, interrupts and
timeouts, sync and async, and the code interpreter's refusals."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from e2b import InvalidArgumentException, NotFoundException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.charts import ChartType

from .e2b_support import Cleanup, E2BServer
from .e2b_support import cleanup as cleanup  # fixtures
from .e2b_support import e2b_env as e2b_env
from .e2b_support import e2b_server as e2b_server

pytestmark = [pytest.mark.runc]


@pytest.fixture
def sbx(e2b_env: E2BServer, cleanup: Cleanup) -> Sandbox:
    return cleanup.add(Sandbox.create(envs={"SANDBOX_WIDE": "yes"}))


def test_values_streams_and_errors(sbx: Sandbox) -> None:
    out: list[str] = []
    ex = sbx.run_code("import os\nprint('hello')\nx = 41\nx + 1", on_stdout=lambda m: out.append(m.line))
    assert ex.text == "42" and ex.logs.stdout == ["hello\n"] and out == ["hello\n"] and ex.error is None
    assert sbx.run_code("x").text == "41"  # state kept
    assert sbx.run_code("'a string'").text == "a string"  # the repr's quotes go, as E2B shows strings
    assert sbx.run_code("os.getcwd()").text == "/home/user"
    assert sbx.run_code("os.environ['SANDBOX_WIDE']").text == "yes"
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value and "ZeroDivisionError" in failed.error.traceback
    first, second = sbx.run_code("1").execution_count, sbx.run_code("2").execution_count
    assert first is not None and second == first + 1


def test_charts_images_and_dataframes(sbx: Sandbox) -> None:
    ex = sbx.run_code("""
        import matplotlib.pyplot as plt
        plt.bar(['a', 'b'], [3, 4], label='sold')
        plt.title('Sales')
        plt.show()
    """)
    [figure] = ex.results
    assert figure.png and figure.chart is not None and figure.chart.type is ChartType.BAR
    assert figure.chart.title == "Sales" and [b.value for b in figure.chart.elements] == [3, 4]
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3]})").results[0]
    assert frame.html and frame.data == {"a": [1, 2, 3]}


def test_contexts_and_env_vars(sbx: Sandbox) -> None:
    languages = [c.language for c in sbx.list_code_contexts()]
    assert "python" in languages and "javascript" in languages
    ctx = sbx.create_code_context(cwd="/tmp")
    sbx.run_code("y = 5", context=ctx)
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    assert sbx.run_code("y", context=ctx).text == "5"
    assert sbx.run_code("y").error is not None  # contexts are independent
    sbx.restart_code_context(ctx)
    assert sbx.run_code("y", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    assert sbx.run_code("import os; os.environ.get('FOO')", envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code("import os; os.environ.get('FOO', 'gone')").text == "gone"  # for that cell only
    with pytest.raises(InvalidArgumentException):
        sbx.run_code("1", language="js", context=ctx)


def test_javascript_and_bash(sbx: Sandbox) -> None:
    js = sbx.run_code("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)\n"
                      "await Promise.resolve('done')", language="js")
    assert js.logs.stdout == ["function\n"] and js.text == "done"
    assert sbx.run_code("pwd", language="bash").logs.stdout == ["/home/user\n"]


def test_compiled_languages_beside_e2bs_kernels(sbx: Sandbox) -> None:
    """Corral's own: C and C++ cells are compiled and run (no state between cells); a compile error is the
    cell's error, not a failed request."""
    ex = sbx.run_code('#include <stdio.h>\nint main(void) { printf("%d\\n", 6 * 7); return 0; }', language="c")
    assert "".join(ex.logs.stdout) == "42\n" and ex.error is None
    broken = sbx.run_code("int main(void) { return oops; }", language="c")
    assert broken.error is not None and "oops" in broken.error.value + broken.error.traceback


def test_timeouts_interrupt_and_the_session_survives(sbx: Sandbox) -> None:
    sbx.run_code("z = 7")
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(30)", timeout=2)
    assert time.monotonic() - started < 15
    assert sbx.run_code("z").text == "7"  # interrupted, not restarted


def test_a_sandbox_killed_under_a_cell_is_reported_killed(sbx: Sandbox) -> None:
    """Killed before the cell printed anything, even at once: the stream is cut (not a 502 refusal), and the SDK
    says the sandbox was killed (E2B's own suite kills at 2 s, within the wait for a refusal)."""
    timer = threading.Timer(0.5, sbx.kill)
    timer.start()
    try:
        with pytest.raises(TimeoutException, match="sandbox was killed while the request was in progress"):
            sbx.run_code("import time; time.sleep(300)", timeout=300)
    finally:
        timer.cancel()


def test_refusals(e2b_server: E2BServer, sbx: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        sbx.restart_code_context("no-such-context")
    url = f"{e2b_server.url}/execute"
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    assert httpx.post(url, json={"code": "1"}, headers=headers).status_code == 401  # no token
    r = httpx.post(url, json={"code": "1"}, headers={**headers, "X-API-KEY": e2b_server.keys["b_dev"]})
    assert r.status_code == 404  # another tenant's sandbox does not exist for it
    r = httpx.post(url, json={"code": "1", "language": "cobol"},
                   headers={**headers, "E2B-Traffic-Access-Token": sbx.traffic_access_token})
    assert r.status_code == 400 and "cobol" in r.text


@pytest.mark.anyio
async def test_async_twin(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(await AsyncSandbox.create())
    ex = await sbx.run_code("print('async')\n6 * 7")
    assert ex.text == "42" and ex.logs.stdout == ["async\n"]
    ctx = await sbx.create_code_context(language="javascript")
    assert (await sbx.run_code("1 + 1", context=ctx)).text == "2"
