"""The R, Java (JShell) and TypeScript sessions of the `polyglot` template (docs/code.md), as E2B's kernels behave:
R prints as its console does, Java reads environment variables as system properties and prints `println` as two
chunks, TypeScript cells lose their types and keep their state. `language="java"` or `"typescript"` outside a
context stays a compiled program (tests/test_code_polyglot.py)."""

from __future__ import annotations

import pytest

from corral.engine import Engine, SandboxSession, SandboxSpec
from tests.test_code_polyglot import POLYGLOT
from tests.test_code_polyglot import polyglot as polyglot  # the fixture

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

HOME = "/home/user"


def texts(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.data.get("text/plain", "") for r in result.results]


async def run(engine: Engine, sb: SandboxSession, code: str, context: str, **kwargs):  # type: ignore[no-untyped-def]
    chunks: list[bytes] = []
    r = await engine.get(sb.id).run_code(code, context=context, cwd=HOME, on_stdout=chunks.append, timeout=60,
                              **kwargs)
    return r, chunks


async def test_r_session(engine: Engine) -> None:
    async with await engine.create(SandboxSpec(template=POLYGLOT, env={"TEST_ENV_VAR": "supertest"})) as sb:
        r, chunks = await run(engine, sb, 'print("Hello, World!")', "r")
        assert chunks == [b'[1] "Hello, World!"\n'] and r.results == () and r.execution_count == 1
        r, _ = await run(engine, sb, "getwd()", "r")
        assert [(x.is_main_result, x.data) for x in r.results] == [(True, {"text/plain": f'[1] "{HOME}"'})]
        r, _ = await run(engine, sb, "Sys.getenv('FOO')", "r", env={"FOO": "bar"})
        assert texts(r) == ['[1] "bar"']
        r, _ = await run(engine, sb, "c(Sys.getenv('FOO', unset = 'default'), Sys.getenv('TEST_ENV_VAR'))", "r")
        assert texts(r) == ['[1] "default"   "supertest"']
        # Each visible value shows, the last as the main result; warnings go to stderr; state stays.
        r, chunks = await run(engine, sb, "x <- 1:3\nx * 2\ncat('no newline')\nwarning('careful')\nsum(x)", "r")
        assert [(x.is_main_result, x.data["text/plain"]) for x in r.results] == [(False, "[1] 2 4 6"),
                                                                                (True, "[1] 6")]
        assert chunks == [b"no newline"] and "careful" in r.stderr
        r, _ = await run(engine, sb, "stop('boom')", "r")
        assert r.error is not None and (r.error.name, r.error.value) == ("Error", "boom")
        r, _ = await run(engine, sb, "1 +", "r")
        assert r.error is not None and "unexpected end of input" in r.error.value
        r = await engine.get(sb.id).run_code("Sys.sleep(60)", context="r", timeout=1)
        assert r.timed_out and r.error is not None and r.error.name == "Interrupted" and not r.session_restarted
        r, _ = await run(engine, sb, "sum(x)", "r")
        assert texts(r) == ["[1] 6"]


async def test_java_session(engine: Engine) -> None:
    async with await engine.create(SandboxSpec(template=POLYGLOT, env={"TEST_ENV_VAR": "supertest"})) as sb:
        r, chunks = await run(engine, sb, 'System.out.println("Hello, World!")', "java")
        assert chunks == [b"Hello, World!", b"\n"] and r.results == ()  # as E2B's Java kernel streams it
        r, _ = await run(engine, sb, 'System.getProperty("user.dir")', "java")
        assert [(x.is_main_result, x.data) for x in r.results] == [(True, {"text/plain": f'"{HOME}"'})]
        r, _ = await run(engine, sb, 'System.getProperty("FOO")', "java", env={"FOO": "bar"})
        assert texts(r) == ['"bar"']
        r, _ = await run(engine, sb, 'System.getProperty("FOO", "default") + System.getProperty("TEST_ENV_VAR")',
                         "java")
        assert texts(r) == ['"defaultsupertest"']
        r, _ = await run(engine, sb, "int x = 20;\nint twice(int v) { return 2 * v; }\ntwice(x) + 2", "java")
        assert texts(r) == ["42"] and r.execution_count == 5
        r, _ = await run(engine, sb, "1 / (x - 20)", "java")
        assert r.error is not None and (r.error.name, r.error.value) == ("ArithmeticException", "/ by zero")
        assert r.error.traceback.startswith("java.lang.ArithmeticException: / by zero")
        r, _ = await run(engine, sb, 'int y = "text";', "java")
        assert r.error is not None and r.error.name == "CompileError" and "incompatible types" in r.error.value
        r = await engine.get(sb.id).run_code("while (true) {}", context="java", timeout=1)
        assert r.timed_out and r.error is not None and r.error.name == "Interrupted" and not r.session_restarted
        r, _ = await run(engine, sb, "x", "java")
        assert texts(r) == ["20"]


async def test_typescript_session(engine: Engine, polyglot: SandboxSession) -> None:
    r, chunks = await run(engine, polyglot, "const message: string = 'Hello, World!'; console.log(message)",
                          "typescript")
    assert chunks == [b"Hello, World!\n"] and r.error is None and r.language == "typescript"
    r, _ = await run(engine, polyglot, "process.cwd()", "typescript")
    assert texts(r) == [f"'{HOME}'"]
    code = ("interface P { x: number }\nenum E { A, B }\nimport { sep } from 'path'\n"
            "const p: P = await Promise.resolve({ x: 3 })\np.x + E.B + message.length + sep.length")
    r, _ = await run(engine, polyglot, code, "typescript")
    assert r.error is None and texts(r) == ["18"], r.error
    r, _ = await run(engine, polyglot, "p.x as number", "typescript")
    assert texts(r) == ["3"]
    r, _ = await run(engine, polyglot, "const bad: = 1", "typescript")
    assert r.error is not None and (r.error.name, r.error.value) == ("SyntaxError", "Type expected.")
    # A type error does not stop a cell (types are erased, not checked), as in E2B's kernel.
    r, _ = await run(engine, polyglot, "const n: number = 'text' as any; n", "typescript")
    assert texts(r) == ["'text'"]
    # Outside a context, typescript is still the type-checked program of /v1.
    r = await engine.get(polyglot.id).run_code("const n: number = 'text'", language="typescript")
    assert r.error is not None and r.error.name == "CompileError" and r.execution_count is None
