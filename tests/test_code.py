"""Code sessions in real sandboxes: state, rich results, errors, interrupts, OOM, bash and javascript."""

from __future__ import annotations

import asyncio
import base64
import struct
import time

import pytest

from corral import InvalidRequestError
from tests.conftest import spec

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_state_value_and_streaming(sandbox):
    r = await sandbox.run_code("x = 41")
    assert r.error is None and r.results == () and r.language == "python" and r.session == "default"
    r = await sandbox.run_code("x + 1")
    assert [(x.is_main_result, x.data) for x in r.results] == [(True, {"text/plain": "42"})]
    chunks: list[tuple[float, bytes]] = []
    start = time.monotonic()
    r = await sandbox.run_code("import time, sys\nprint('a')\ntime.sleep(0.5)\nprint('b', file=sys.stderr)\n"
                               "print('c')", on_stdout=lambda d: chunks.append((time.monotonic() - start, d)))
    assert (r.stdout, r.stderr) == ("a\nc\n", "b\n")
    assert chunks[0][1] == b"a\n" and chunks[0][0] < 0.45  # streamed, not held to the end


async def test_bytes_exact(sandbox):
    r = await sandbox.run_code("import sys\nsys.stdout.buffer.write(b'a\\xff\\xfe\\x00b')\nprint('!')")
    assert r.stdout_bytes == b"a\xff\xfe\x00b!\n"


async def test_error_and_session_survives(sandbox):
    await sandbox.run_code("y = 'kept'")
    r = await sandbox.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert r.error is not None and (r.error.name, r.error.value) == ("ValueError", "bad value")
    assert 'File "<cell-2>", line 2, in f' in r.error.traceback and "kernel.py" not in r.error.traceback
    r = await sandbox.run_code("y")
    assert r.results[0].data["text/plain"] == "'kept'" and r.error is None
    r = await sandbox.run_code("def (")
    assert r.error is not None and r.error.name == "SyntaxError"


async def test_matplotlib_figure_without_savefig(sandbox):
    r = await sandbox.run_code("import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(4, 3), dpi=100)\n"
                               "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()")
    assert r.error is None, r.error
    pngs = [x for x in r.results if "image/png" in x.data]
    assert len(pngs) == 1 and not pngs[0].is_main_result
    assert png_size(base64.b64decode(pngs[0].data["image/png"])) == (400, 300)
    r = await sandbox.run_code("len(plt.get_fignums())")  # rendered figures are closed
    assert r.results[0].data["text/plain"] == "0"


async def test_pandas_and_display(sandbox):
    r = await sandbox.run_code("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\ndf")
    (main,) = r.results
    assert main.is_main_result and "<table" in main.data["text/html"] and "a  b" in main.data["text/plain"]
    r = await sandbox.run_code("class H:\n    def _repr_html_(self): return '<b>h</b>'\n"
                               "display(1, 'two', H())\nNone")
    assert [x.data.get("text/html", x.data["text/plain"]) for x in r.results] == ["1", "'two'", "<b>h</b>"]
    assert not any(x.is_main_result for x in r.results)


async def test_shell_and_pip_magics(sandbox):
    r = await sandbox.run_code("!echo hi\n%pip --version")
    assert r.error is None and r.stdout.startswith("hi\npip ")


async def test_named_sessions_are_isolated(sandbox):
    await sandbox.run_code("z = 1", session="one")
    r = await sandbox.run_code("z", session="two")
    assert r.error is not None and r.error.name == "NameError"
    sessions = await sandbox._engine.code_sessions(sandbox.id)
    assert {s.name for s in sessions} == {"one", "two"} and all(s.pid > 0 for s in sessions)
    await sandbox._engine.close_code(sandbox.id, "two")
    assert [s.name for s in await sandbox._engine.code_sessions(sandbox.id)] == ["one"]


async def test_timeout_interrupts_and_state_survives(sandbox):
    await sandbox.run_code("kept = 7")
    start = time.monotonic()
    r = await sandbox.run_code("while True: pass", timeout=1)
    assert r.timed_out and not r.session_restarted and time.monotonic() - start < 5
    assert r.error is not None and r.error.name == "KeyboardInterrupt"
    r = await sandbox.run_code("kept")
    assert r.results[0].data["text/plain"] == "7"


async def test_interrupt_from_another_task_and_restart(sandbox):
    await sandbox.run_code("a = 1")
    task = asyncio.create_task(sandbox.run_code("import time\ntime.sleep(60)"))
    await asyncio.sleep(1.0)
    await sandbox._engine.interrupt_code(sandbox.id, "default")
    r = await asyncio.wait_for(task, 10)
    assert r.error is not None and r.error.name == "KeyboardInterrupt" and not r.timed_out
    await sandbox._engine.restart_code(sandbox.id, "default")
    r = await sandbox.run_code("a")
    assert r.error is not None and r.error.name == "NameError"


async def test_oom_kills_only_the_session(engine):
    async with await engine.create(spec(memory="256M")) as sb:
        r = await sb.run_code("x = bytearray(1024 ** 3)")
        assert r.oom_killed and r.session_restarted and r.error is not None
        r = await sb.run_code("1 + 1")
        assert r.results[0].data["text/plain"] == "2" and not r.oom_killed


async def test_bash_session(sandbox):
    r = await sandbox.run_code("cd /tmp && export FOO=bar", language="bash", session="sh")
    assert r.error is None and r.language == "bash"
    r = await sandbox.run_code("pwd; echo $FOO; false", language="bash", session="sh")
    assert r.stdout == "/tmp\nbar\n" and r.error is not None and r.error.value == "1"


async def test_javascript_session(sandbox):
    r = await sandbox.run_code("let n = 41; function inc(x) { return x + 1 }", language="javascript", session="js")
    assert r.error is None
    r = await sandbox.run_code("console.log('hi'); ({v: inc(n)})", language="javascript", session="js")
    assert r.stdout == "hi\n" and r.results[0].data["text/plain"] == "{ v: 42 }"
    r = await sandbox.run_code("throw new TypeError('nope')", language="javascript", session="js")
    assert r.error is not None and (r.error.name, r.error.value) == ("TypeError", "nope")
    assert "kernel.js" not in r.error.traceback


async def test_unknown_language_and_mismatch(sandbox):
    with pytest.raises(InvalidRequestError, match="python, bash, javascript"):
        await sandbox.run_code("1", language="cobol")


async def test_csv_with_pandas_and_sklearn(sandbox):
    await sandbox.files.write("/workspace/data.csv", "a,b\n1,2\n3,4\n5,6\n")
    r = await sandbox.run_code("import pandas as pd\ndf = pd.read_csv('data.csv')\ndf.describe()")
    assert r.error is None and "mean" in r.results[0].data["text/plain"]
    r = await sandbox.run_code(
        "from sklearn.datasets import load_iris\nfrom sklearn.linear_model import LogisticRegression\n"
        "X, y = load_iris(return_X_y=True)\nm = LogisticRegression(max_iter=500).fit(X, y)\n"
        "print(f'accuracy {m.score(X, y):.2f}')", timeout=120)
    assert r.error is None, r.error
    assert float(r.stdout.split()[-1]) > 0.9
