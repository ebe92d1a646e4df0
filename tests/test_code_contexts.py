"""Code contexts in real sandboxes (docs/code.md, "Contexts"): what E2B's code interpreter needs from sessions.

Contexts (made, listed with the default python and javascript ones first, restarted, removed; a working
directory the sandbox user may not enter), environment variables for one cell in every session language,
execution counts, ESM imports and top-level await in javascript, Jupyter's results in python (indented cells,
`plt.show()`, `IPython.display`, PIL, DataFrames as `e2b/data`), and a cell whose caller goes away.
The polyglot template's R, Java (JShell) and TypeScript sessions are in tests/test_code_kernels.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from corral import ConflictError, InvalidRequestError, NotFoundError, PermissionDeniedError
from corral.engine import Engine, SandboxSession, SandboxSpec, default_context
from tests.conftest import TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

HOME = "/home/user"


def texts(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.data.get("text/plain", "") for r in result.results]


async def test_default_contexts_are_listed_first_then_the_made_ones(engine: Engine, sandbox: SandboxSession) -> None:
    listed = await engine.get(sandbox.id).code_contexts(cwd=HOME)
    assert [(c.name, c.language, c.cwd, c.pid) for c in listed] == [("default", "python", HOME, 0),
                                                                     ("javascript", "javascript", HOME, 0)]
    made = await engine.get(sandbox.id).create_code_context("js", cwd="/tmp")
    assert (made.language, made.cwd, made.pid) == ("javascript", "/tmp", 0) and len(made.name) == 36  # a UUID
    r = await engine.get(sandbox.id).run_code("process.cwd()", context=made.name)
    assert texts(r) == ["'/tmp'"] and r.session == made.name and r.execution_count == 1
    listed = await engine.get(sandbox.id).code_contexts()
    assert [c.name for c in listed] == ["default", "javascript", made.name]
    assert listed[-1].pid > 0 and listed[-1].execution_count == 1 and listed[0].pid == 0
    assert [s.name for s in await engine.get(sandbox.id).code_sessions()] == [made.name]  # /v1: only running ones


async def test_a_context_keeps_its_own_state_language_and_directory(engine: Engine, sandbox: SandboxSession) -> None:
    await engine.get(sandbox.id).run_code("x = 1", cwd=HOME)  # the default python context, made here in HOME
    made = await engine.get(sandbox.id).create_code_context()
    assert (made.language, made.cwd) == ("python", "/workspace")  # Corral's default directory
    r = await engine.get(sandbox.id).run_code("x", context=made.name)
    assert r.error is not None and r.error.value == "name 'x' is not defined"
    r = await engine.get(sandbox.id).run_code("import os; x, os.getcwd()", context=default_context("python"))
    assert texts(r) == [f"(1, '{HOME}')"]
    # In a context its own language applies, whatever language the call names.
    r = await engine.get(sandbox.id).run_code("process.version.length > 0", language="python", context="javascript")
    assert texts(r) == ["true"] and r.language == "javascript"


async def test_context_errors_are_clear_and_change_nothing(engine: Engine, sandbox: SandboxSession) -> None:
    with pytest.raises(NotFoundError, match="no code context 'nope'"):
        await engine.get(sandbox.id).run_code("1", context="nope")
    with pytest.raises(InvalidRequestError, match="contexts run python, bash, javascript"):
        await engine.get(sandbox.id).create_code_context("cobol")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        await engine.get(sandbox.id).create_code_context(cwd="/no/such/dir")
    with pytest.raises(InvalidRequestError, match="absolute"):
        await engine.get(sandbox.id).create_code_context(cwd="relative")
    with pytest.raises(InvalidRequestError, match="polyglot"):
        await engine.get(sandbox.id).create_code_context("r")
    made = await engine.get(sandbox.id).create_code_context(name="mine")
    with pytest.raises(ConflictError, match="exists already"):
        await engine.get(sandbox.id).create_code_context("bash", name="mine")
    with pytest.raises(ConflictError, match="runs python, not bash"):
        await engine.get(sandbox.id).run_code("echo", language="bash", session="mine")
    assert [c.name for c in await engine.get(sandbox.id).code_contexts()] == ["default", "javascript", made.name]


async def test_a_directory_the_user_cannot_enter(engine: Engine, sandbox: SandboxSession) -> None:
    made = await engine.get(sandbox.id).create_code_context("python", cwd="/root")  # root's home: mode 0700
    listed = await engine.get(sandbox.id).code_contexts()
    assert (listed[-1].name, listed[-1].cwd) == (made.name, "/root")
    with pytest.raises(PermissionDeniedError, match=r"/root of code context .* cannot be entered"):
        await engine.get(sandbox.id).run_code("1", context=made.name)
    assert [c.name for c in await engine.get(sandbox.id).code_contexts()][-1] == made.name  # listing still works
    await engine.get(sandbox.id).close_code(made.name)
    assert made.name not in [c.name for c in await engine.get(sandbox.id).code_contexts()]


async def test_restart_forgets_the_state_and_close_removes_the_context(engine: Engine,
                                                                       sandbox: SandboxSession) -> None:
    made = await engine.get(sandbox.id).create_code_context(cwd=HOME)
    await engine.get(sandbox.id).restart_code(made.name)  # never ran: nothing to forget, and no error
    r = await engine.get(sandbox.id).run_code("x = 1", context=made.name)
    r = await engine.get(sandbox.id).run_code("x", context=made.name)
    assert texts(r) == ["1"] and r.execution_count == 2
    await engine.get(sandbox.id).restart_code(made.name)
    r = await engine.get(sandbox.id).run_code("x", context=made.name)
    assert r.error is not None and (r.error.name, r.error.value) == ("NameError", "name 'x' is not defined")
    assert r.execution_count == 1  # a fresh session counts from 1
    [listed] = [c for c in await engine.get(sandbox.id).code_contexts() if c.name == made.name]
    assert listed.cwd == HOME  # restarting keeps the context
    await engine.get(sandbox.id).close_code(made.name)
    assert made.name not in [c.name for c in await engine.get(sandbox.id).code_contexts()]
    with pytest.raises(NotFoundError):
        await engine.get(sandbox.id).close_code(made.name)
    with pytest.raises(NotFoundError):
        await engine.get(sandbox.id).run_code("1", context=made.name)


@pytest.mark.parametrize(("language", "read", "default"), [
    ("python", "import os; print(os.environ.get('FOO'), os.environ.get('BASE'))", "None base\n"),
    ("bash", "echo ${FOO:-None} $BASE", "None base\n"),
    ("javascript", "console.log(process.env.FOO || 'None', process.env.BASE)", "None base\n"),
])
async def test_env_vars_for_one_cell_on_top_of_the_sandboxs(engine: Engine, language: str, read: str,
                                                            default: str) -> None:
    async with await engine.create(SandboxSpec(template=TEMPLATE, env={"BASE": "base"})) as sb:
        r = await engine.get(sb.id).run_code(read, language=language, env={"FOO": "bar", "BASE": "over"})
        assert r.stdout == "bar over\n", r
        r = await engine.get(sb.id).run_code(read, language=language)
        assert r.stdout == default, r  # restored: FOO unset again, BASE the sandbox's
        # Subprocesses of the cell see them too.
        shell = {"python": "!echo $FOO", "bash": "sh -c 'echo $FOO'",
                 "javascript": "console.log(require('child_process').execSync('echo $FOO').toString().trim())"}
        r = await engine.get(sb.id).run_code(shell[language], language=language, env={"FOO": "sub"})
        assert r.stdout == "sub\n", r


async def test_env_vars_of_a_cell_are_checked(engine: Engine, sandbox: SandboxSession) -> None:
    for env in ({"1X": "a"}, {"A-B": "a"}, {"A": "nul\x00"}):
        with pytest.raises(InvalidRequestError, match="environment variable"):
            await engine.get(sandbox.id).run_code("1", env=env)
    program = '#include <stdio.h>\n#include <stdlib.h>\nint main(void){puts(getenv("X"));return 0;}'
    r = await engine.get(sandbox.id).run_code(program, language="c", env={"X": "for the program"})
    assert r.stdout == "for the program\n", r


async def test_execution_counts(engine: Engine, sandbox: SandboxSession) -> None:
    r = await engine.get(sandbox.id).run_code("echo 'E2B is awesome!'")  # a SyntaxError counts, as in IPython
    assert r.error is not None and r.error.name == "SyntaxError" and r.execution_count == 1
    assert "ast.py" not in r.error.traceback  # the parser's frames are not the cell's
    r = await engine.get(sandbox.id).run_code("!pwd", cwd=HOME)
    assert r.execution_count == 2 and r.stdout == "/workspace\n"  # the default context was made by the first cell
    r = await engine.get(sandbox.id).run_code("1", language="javascript")
    assert r.execution_count == 1  # per session
    r = await engine.get(sandbox.id).run_code("int main(void){return 0;}", language="c")
    assert r.execution_count is None  # a program is no session


async def test_javascript_esm_imports_top_level_await_and_state(engine: Engine, sandbox: SandboxSession) -> None:
    async def js(code: str) -> list[str]:
        r = await engine.get(sandbox.id).run_code(code, language="js")
        assert r.error is None, r.error
        return [r.stdout, *texts(r)]

    assert await js("\n    import { readFileSync } from 'fs'\n    console.log(typeof readFileSync)\n    ") == [
        "function\n"]
    assert await js("\n    await Promise.resolve('Hello World!')\n    ") == ["", "'Hello World!'"]
    assert await js("import path, * as p2 from 'path'; import { join as j } from 'node:path'\n"
                    "j('a', 'b') + path.sep + p2.sep") == ["", "'a/b//'"]
    # Declarations of a cell with top-level await outlive it, functions and classes too.
    assert await js("const a = await Promise.resolve(41); function inc(x) { return x + 1 }\n"
                    "class K { v() { return 'k' } }\nlet { b, c: [d] } = { b: 1, c: [2] }") == [""]
    assert await js("[inc(a), new K().v(), b + d, readFileSync === require('fs').readFileSync]") == [
        "", "[ 42, 'k', 3, true ]"]
    assert await js("import { readFileSync } from 'fs'\nreadFileSync.name") == ["", "'readFileSync'"]  # again
    assert await js("for await (const x of [Promise.resolve(1)]) console.log(x)") == ["1\n"]
    r = await engine.get(sandbox.id).run_code("await Promise.reject(new RangeError('late'))", language="js")
    assert r.error is not None and (r.error.name, r.error.value) == ("RangeError", "late")


async def test_javascript_interrupted_during_an_await(engine: Engine, sandbox: SandboxSession) -> None:
    r = await engine.get(sandbox.id).run_code("await new Promise((r) => setTimeout(r, 60000))", language="js",
                              timeout=1)
    assert r.timed_out and not r.session_restarted and r.error is not None and r.error.name == "Interrupted"
    r = await engine.get(sandbox.id).run_code("1 + 1", language="js")
    assert texts(r) == ["2"]


async def test_typescript_needs_the_polyglot_template(engine: Engine, sandbox: SandboxSession) -> None:
    with pytest.raises(InvalidRequestError, match=r"no tsc.*polyglot"):
        await engine.get(sandbox.id).run_code("1", context="typescript")
    for language in ("java", "r"):
        with pytest.raises(InvalidRequestError, match="polyglot"):
            await engine.get(sandbox.id).run_code("1", context=default_context(language))


async def test_python_results_as_in_jupyter(engine: Engine, sandbox: SandboxSession) -> None:
    # A cell indented as a whole (a triple-quoted string in the caller's code), as E2B's tests send them.
    r = await engine.get(sandbox.id).run_code('\n        import pandas as pd\n        pd.DataFrame({"a": [1, 2, 3], '
                              '"t": pd.to_datetime(["2020-01-02", None, "2020-01-03"])})\n        ')
    assert r.error is None, r.error
    [frame] = r.results
    assert json.loads(frame.data["e2b/data"]) == {"a": [1, 2, 3], "t": ["2020-01-02T00:00:00", "NaT",
                                                                        "2020-01-03T00:00:00"]}
    assert "<table" in frame.data["text/html"]
    r = await engine.get(sandbox.id).run_code("from IPython.display import display, HTML, Markdown\n"
                              "display({'text/latex': r'\\text{x}'}, raw=True)\n"
                              "display(HTML('<b>b</b>'), Markdown('*m*'))")
    assert [x.data for x in r.results] == [
        {"text/latex": r"\text{x}"},
        {"text/html": "<b>b</b>", "text/plain": "<IPython.core.display.HTML object>"},
        {"text/markdown": "*m*", "text/plain": "<IPython.core.display.Markdown object>"}]
    # plt.show() shows the figure then and there, before the cell's own value.
    r = await engine.get(sandbox.id).run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\n"
                              "print('shown')\n7")
    figure, value = r.results
    assert not figure.is_main_result and base64.b64decode(figure.data["image/png"]).startswith(b"\x89PNG")
    assert value.is_main_result and value.data == {"text/plain": "7"} and r.stdout == "shown\n"
    chunks: list[bytes] = []
    r = await engine.get(sandbox.id).run_code("print(1)", on_stdout=chunks.append)
    assert chunks == [b"1\n"]


async def test_pil_images_show_as_results(engine: Engine, sandbox: SandboxSession) -> None:
    make = "from PIL import Image\nimage = Image.new('RGB', (4, 4), 'red')\n"
    r = await engine.get(sandbox.id).run_code(make + "image.show()\nprint('shown')")
    assert r.stdout == "shown\n" and base64.b64decode(r.results[0].data["image/png"]).startswith(b"\x89PNG")
    r = await engine.get(sandbox.id).run_code(make + "image.save('/tmp/a.png')")
    assert r.results == ()  # saving shows nothing, unless the context asked for it (E2B's kernel does)
    r = await engine.get(sandbox.id).run_code(
        make + "image.save('/tmp/b.png')\nimport os; os.path.getsize('/tmp/b.png')", session="e2b",
        show_saved_images=True)
    assert base64.b64decode(r.results[0].data["image/png"]).startswith(b"\x89PNG") and r.results[1].is_main_result


async def test_a_cell_whose_caller_left_is_interrupted(engine: Engine, sandbox: SandboxSession) -> None:
    await engine.get(sandbox.id).run_code("kept = 'state'")
    started = asyncio.Event()
    task = asyncio.create_task(engine.get(sandbox.id).run_code("print('go', flush=True)\nimport time; time.sleep(300)",
                                               on_stdout=lambda _: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    start = time.monotonic()
    r = await asyncio.wait_for(engine.get(sandbox.id).run_code("kept"), 20)  # not held up behind the abandoned sleep
    assert texts(r) == ["'state'"] and time.monotonic() - start < 3
