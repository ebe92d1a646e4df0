"""`sb.run_code()` and `sb.code` against a fake server (httpx.MockTransport answering as docs/code.md says):
parsing of results and errors, the NDJSON stream and its callbacks, sessions, and sync/async parity."""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import corral
from corral import (
    AsyncCodeInterpreter,
    AsyncSandbox,
    CodeInterpreter,
    CodeSessionInfo,
    Execution,
    InvalidRequestError,
    NotFoundError,
    Result,
    Sandbox,
    ServerError,
)
from corral._sdk._code import _CodeStream

KEY = "test-key"
URL = "http://corral.test:7770"
SB = "sb_1"
PNG = b"\x89PNG\r\n\x1a\n\x00\xff"
JPEG = b"\xff\xd8\xff\xe0\x00"
OUT = b"a\x00b\xffc\n"
ERR = b"\xfe\xfferr\x00"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


EVERY_FORMAT = {"image/png": b64(PNG), "image/jpeg": b64(JPEG), "image/svg+xml": "<svg/>", "text/html": "<table/>",
                "text/markdown": "**b**", "text/latex": "$x$", "application/json": '{"a": [1, 2]}',
                "text/plain": "<obj>", "application/vnd.custom": "raw"}
RESULT = {
    "session": "default", "language": "python",
    "results": [{"is_main_result": False, "data": EVERY_FORMAT},
                {"is_main_result": True, "data": {"text/plain": "2"}}],
    "stdout_b64": b64(OUT), "stderr_b64": b64(ERR), "error": None, "timed_out": False, "oom_killed": False,
    "session_restarted": False, "duration": 0.5,
}
TRACEBACK = "Traceback (most recent call last):\n  File \"<cell>\", line 1\nZeroDivisionError: division by zero\n"


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


STREAM = b"".join([
    line({"event": "stdout", "data_b64": b64(b"one\x00")}),
    line({"event": "result", "result": {"is_main_result": False, "data": {"image/png": b64(PNG)}}}),
    line({"event": "stderr", "data_b64": b64(b"\xffwarn")}),
    line({"event": "stdout", "data_b64": b64(b"two\n")}),
    line({"event": "result", "result": {"is_main_result": True, "data": {"text/plain": "2"}}}),
    line({"event": "end", "session": "s", "language": "python", "stdout_b64": b64(b"tail"), "stderr_b64": "",
          "error": {"name": "ValueError", "value": "bad", "traceback": TRACEBACK}, "timed_out": True,
          "oom_killed": False, "session_restarted": True, "duration": 1.5}),
])


class Server:
    """Answers the sandbox lookup and the code routes; remembers every request."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.answer: Callable[[httpx.Request], httpx.Response] = lambda r: httpx.Response(200, json=RESULT)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.method == "GET" and request.url.path == f"/v1/sandboxes/{SB}":
            return httpx.Response(200, json={"id": SB, "state": "running", "template": "default"})
        return self.answer(request)

    def bodies(self) -> list[Any]:
        return [json.loads(r.content) if r.content else None for r in self.requests[1:]]


@pytest.fixture
def server() -> Server:
    return Server()


@pytest.fixture(params=["sync", "async"])
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def connect(server: Server, flavor: str) -> Sandbox | AsyncSandbox:
    transport = httpx.MockTransport(server)
    if flavor == "sync":
        return Sandbox.connect(SB, api_key=KEY, base_url=URL, transport=transport)
    return await AsyncSandbox.connect(SB, api_key=KEY, base_url=URL, transport=transport)


async def call(target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    value = getattr(target, method)(*args, **kwargs)
    return await value if inspect.isawaitable(value) else value


# -- one result ----------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_run_code_parses_every_format(server: Server, flavor: str) -> None:
    sb = await connect(server, flavor)
    ex = await call(sb, "run_code", "1+1")
    assert isinstance(ex, Execution)
    assert ex.text == "2" and ex.main_result is ex.results[1] and ex.results[1].is_main_result
    first = ex.results[0]
    assert first.png == PNG and first.jpeg == JPEG and first.svg == "<svg/>" and first.html == "<table/>"
    assert first.markdown == "**b**" and first.latex == "$x$" and first.json == {"a": [1, 2]}
    assert first.text == "<obj>" and first.data["application/vnd.custom"] == "raw"
    assert first.formats() == ["png", "jpeg", "svg", "html", "markdown", "latex", "json", "text",
                               "application/vnd.custom"]
    assert "\\x89" not in repr(first) and "formats=" in repr(first)
    assert ex.stdout_bytes == OUT and ex.stderr_bytes == ERR
    assert ex.stdout == "a\x00b\ufffdc\n" and ex.stderr.endswith("err\x00")
    assert ex.error is None and not ex.timed_out and not ex.oom_killed and ex.duration == 0.5
    assert server.bodies() == [{"code": "1+1", "language": "python", "session": None, "timeout": 60,
                                "stream": False}]
    assert server.requests[1].url.path == f"/v1/sandboxes/{SB}/code"


@pytest.mark.anyio
async def test_a_raising_cell_is_returned_not_raised(server: Server, flavor: str) -> None:
    server.answer = lambda r: httpx.Response(200, json={
        **RESULT, "results": [], "error": {"name": "ZeroDivisionError", "value": "division by zero",
                                           "traceback": TRACEBACK}, "oom_killed": True, "timed_out": True})
    sb = await connect(server, flavor)
    ex = await call(sb, "run_code", "1/0", language="python", session="s2", timeout=None)
    assert ex.text is None and ex.results == ()
    assert (ex.error.name, ex.error.value, ex.error.traceback) == ("ZeroDivisionError", "division by zero", TRACEBACK)
    assert ex.timed_out and ex.oom_killed
    assert server.bodies()[0] == {"code": "1/0", "language": "python", "session": "s2", "timeout": None,
                                  "stream": False}


@pytest.mark.anyio
async def test_request_errors_raise(server: Server, flavor: str) -> None:
    server.answer = lambda r: httpx.Response(400, json={"error": {"code": "invalid_request",
                                                                  "message": "unknown language 'cobol'"}})
    sb = await connect(server, flavor)
    with pytest.raises(InvalidRequestError, match="cobol"):
        await call(sb, "run_code", "x", language="cobol")


@pytest.mark.parametrize("data", [{"image/png": "not base64!"}, {"application/json": "{"}, {"text/plain": 3}, []])
def test_a_malformed_result_is_a_server_error(data: Any) -> None:
    with pytest.raises(ServerError, match="malformed"):
        Result.from_wire({"is_main_result": True, "data": data})


# -- streaming -------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_callbacks_get_events_in_order(server: Server, flavor: str) -> None:
    server.answer = lambda r: httpx.Response(200, content=STREAM, headers={"content-type": "application/x-ndjson"})
    sb = await connect(server, flavor)
    seen: list[tuple[str, Any]] = []

    def recorder(kind: str) -> Callable[[Any], None]:
        return lambda value: seen.append((kind, value))

    ex = await call(sb, "run_code", "x", session="s", on_stdout=recorder("out"), on_stderr=recorder("err"),
                    on_result=recorder("result"))
    assert [k for k, _ in seen] == ["out", "result", "err", "out", "result", "out"]
    assert [v for k, v in seen if k == "out"] == [b"one\x00", b"two\n", b"tail"]
    assert seen[1][1].png == PNG and seen[4][1].text == "2"
    assert ex.stdout_bytes == b"one\x00two\ntail" and ex.stderr_bytes == b"\xffwarn"
    assert [r.formats() for r in ex.results] == [["png"], ["text"]] and ex.text == "2"
    assert ex.error is not None and ex.error.name == "ValueError" and ex.timed_out and ex.session_restarted
    assert ex.session == "s"
    assert server.bodies()[0]["stream"] is True


@pytest.mark.anyio
async def test_only_on_result_streams_too(server: Server, flavor: str) -> None:
    server.answer = lambda r: httpx.Response(200, content=STREAM)
    sb = await connect(server, flavor)
    results: list[Result] = []
    ex = await call(sb, "run_code", "x", on_result=results.append)
    assert results == list(ex.results) and len(results) == 2


@pytest.mark.anyio
async def test_async_callbacks_may_be_coroutines(server: Server) -> None:
    server.answer = lambda r: httpx.Response(200, content=STREAM)
    sb = await connect(server, "async")
    seen: list[Any] = []

    async def on_result(result: Result) -> None:
        seen.append(result)

    async def on_stdout(data: bytes) -> None:
        seen.append(data)

    assert isinstance(sb, AsyncSandbox)
    await sb.run_code("x", on_stdout=on_stdout, on_result=on_result)
    assert [type(v).__name__ for v in seen] == ["bytes", "Result", "bytes", "Result", "bytes"]


@pytest.mark.anyio
@pytest.mark.parametrize(("tail", "error"), [
    (line({"event": "error", "error": {"code": "not_found", "message": "gone"}}), NotFoundError),
    (b"", ServerError),  # the connection ended before `end`
    (b"{not json\n", ServerError),
])
async def test_a_broken_stream_raises(server: Server, flavor: str, tail: bytes, error: type[Exception]) -> None:
    server.answer = lambda r: httpx.Response(200, content=STREAM.split(b"\n")[0] + b"\n" + tail)
    sb = await connect(server, flavor)
    out: list[bytes] = []
    with pytest.raises(error):
        await call(sb, "run_code", "x", on_stdout=out.append)
    assert out == [b"one\x00"]  # what arrived before was delivered


def test_the_decoder_is_indifferent_to_chunk_boundaries() -> None:
    decoder = _CodeStream()
    events = [e for i in range(len(STREAM)) for e in decoder.feed(STREAM[i:i + 1])]
    tail, ex = decoder.finish()
    assert [k for k, _ in events + tail] == ["stdout", "result", "stderr", "stdout", "result", "stdout"]
    assert ex.stdout_bytes == b"one\x00two\ntail"


def test_unknown_events_are_ignored() -> None:
    decoder = _CodeStream()
    assert decoder.feed(line({"event": "progress", "x": 1})) == []


# -- sessions --------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_sessions_interrupt_restart_close(server: Server, flavor: str) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"sessions": [{"name": "default", "language": "python", "pid": 9,
                                                           "started_at": "2030-01-01T00:00:00+00:00"}]})
        return httpx.Response(204)

    server.answer = answer
    sb = await connect(server, flavor)
    assert await call(sb.code, "sessions") == [CodeSessionInfo("default", "python", 9, "2030-01-01T00:00:00+00:00")]
    assert await call(sb.code, "interrupt") is None
    await call(sb.code, "restart", "a b/c")
    await call(sb.code, "close", "s1")
    assert [(r.method, r.url.raw_path.decode()) for r in server.requests[1:]] == [
        ("GET", f"/v1/sandboxes/{SB}/code/sessions"),
        ("POST", f"/v1/sandboxes/{SB}/code/sessions/default/interrupt"),
        ("POST", f"/v1/sandboxes/{SB}/code/sessions/a%20b%2Fc/restart"),
        ("DELETE", f"/v1/sandboxes/{SB}/code/sessions/s1"),
    ]


# -- surface ---------------------------------------------------------------------------------------------------------


def _params(func: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


def test_sync_and_async_twins_have_the_same_signatures() -> None:
    sync = {n: m for n, m in vars(CodeInterpreter).items() if not n.startswith("_")}
    aio = {n: m for n, m in vars(AsyncCodeInterpreter).items() if not n.startswith("_")}
    assert set(sync) == set(aio) == {"run", "sessions", "interrupt", "restart", "close"}
    for name, member in sync.items():
        assert inspect.iscoroutinefunction(aio[name]) and not inspect.iscoroutinefunction(member), name
        assert _params(member) == _params(aio[name]), name
    assert _params(Sandbox.run_code) == _params(AsyncSandbox.run_code) == _params(CodeInterpreter.run)


def test_the_design_surface_is_there() -> None:
    run = inspect.signature(Sandbox.run_code).parameters
    assert [*run][1:] == ["code", "language", "session", "timeout", "on_stdout", "on_stderr", "on_result", "stdin",
                          "max_output"]
    assert run["language"].default == "python" and run["session"].default is None and run["timeout"].default == 60
    for name in ("Execution", "Result", "ExecutionError", "CodeInterpreter", "AsyncCodeInterpreter"):
        assert name in corral.__all__
    assert corral.__all__ == sorted(corral.__all__)


# -- the CLI's part: what `corral run-code` prints, saves and exits with -------------------------------------------


def test_cli_report_prints_the_main_result_and_saves_rich_ones(tmp_path: Any, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    from corral.cli._code import report

    ex = Execution.from_wire(RESULT)
    assert report(ex, tmp_path / "out", None) == 0
    out, err = capsys.readouterr()
    assert out == "2\n" and "result-1.png" in err
    assert (tmp_path / "out" / "result-1.png").read_bytes() == PNG
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["result-1.png"]


def test_cli_report_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    from corral.cli._code import report

    error = {"name": "ZeroDivisionError", "value": "division by zero", "traceback": TRACEBACK}
    assert report(Execution.from_wire({**RESULT, "results": [], "error": error}), None, None) == 1
    assert capsys.readouterr().err.endswith(TRACEBACK)
    assert report(Execution.from_wire({**RESULT, "timed_out": True}), None, 5) == 124
    assert "timed out after 5s" in capsys.readouterr().err
    assert report(Execution.from_wire({**RESULT, "oom_killed": True}), None, None) == 1
