"""The code interpreter's HTTP API (docs/code.md, "HTTP API").

Most tests run the app in-process (httpx.ASGITransport) over a fake engine that speaks the engine's contract,
and a real ControlStore; the last ones, marked runc, run cells in real sandboxes.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from corral._exceptions import InvalidRequestError, NotFoundError
from corral.control import ControlStore, Role
from corral.engine import CodeError, CodeResult, CodeSession, Engine, RichResult, SandboxSpec
from corral.server import create_app

from .conftest import TEMPLATE

pytestmark = pytest.mark.anyio

BASE = "http://corral.test"
API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
LANGUAGES = ("python", "bash", "javascript")
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
BINARY_OUT = b"a\x00b\xffc\n"
BINARY_ERR = b"\xfe\xfferr\x00"
TEXT_2 = RichResult(is_main_result=True, data={"text/plain": "2"})
FIGURE = RichResult(is_main_result=False, data={"image/png": base64.b64encode(PNG).decode(),
                                                "text/plain": "<Figure size 640x480 with 1 Axes>"})

def cell(**fields: Any) -> CodeResult:
    """A CodeResult with empty output unless given."""
    return CodeResult(**{"stdout_bytes": b"", "stderr_bytes": b"", **fields})


Callback = Callable[[Any], Awaitable[None] | None]


async def _call(callback: Callback | None, value: Any) -> None:
    if callback is not None and (pending := callback(value)) is not None:
        await pending


@dataclass
class FakeEngine:
    """The engine's code methods as docs/code.md describes them, scripted: `script` is what the cell emits
    through the callbacks, `result` what run_code returns."""

    script: list[tuple[str, Any]] = field(default_factory=list)
    result: CodeResult = field(default_factory=lambda: cell(session="default", language="python"))
    fail_after_script: Exception | None = None
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    sessions: dict[str, CodeSession] = field(default_factory=dict)
    egress: None = None
    backend: None = None  # what the service's composition reads (Info, Templates); the code routes never do
    templates: None = None
    home: Path = Path("/nonexistent")  # the eval reports' home: never read here

    def info(self, sandbox_id: str) -> None:
        self.calls.append(("info", (sandbox_id,), {}))

    def get(self, sandbox_id: str) -> SimpleNamespace:
        """The sandbox's session: this engine's code operations with the sandbox's id bound, as the real one."""
        ops = ("run_code", "code_sessions", "interrupt_code", "restart_code", "close_code")
        return SimpleNamespace(**{op: functools.partial(getattr(self, op), sandbox_id) for op in ops})

    async def run_code(self, sandbox_id: str, code: str, *, language: str = "python", session: str = "default",
                       timeout: float | None = None, on_stdout: Callback | None = None,
                       on_stderr: Callback | None = None, on_result: Callback | None = None) -> CodeResult:
        self.calls.append(("run_code", (sandbox_id, code), {"language": language, "session": session,
                                                            "timeout": timeout}))
        if language not in LANGUAGES:
            raise InvalidRequestError(f"unknown language {language!r}; available: {', '.join(LANGUAGES)}")
        callbacks = {"stdout": on_stdout, "stderr": on_stderr, "result": on_result}
        for kind, value in self.script:
            await _call(callbacks[kind], value)
        if self.fail_after_script is not None:
            raise self.fail_after_script
        return self.result

    async def code_sessions(self, sandbox_id: str) -> list[CodeSession]:
        return list(self.sessions.values())

    def _session(self, name: str) -> None:
        if name not in self.sessions:
            raise NotFoundError(f"no code session {name!r} in this sandbox")

    async def interrupt_code(self, sandbox_id: str, session: str) -> None:
        self._session(session)
        self.calls.append(("interrupt_code", (sandbox_id, session), {}))

    async def restart_code(self, sandbox_id: str, session: str) -> None:
        self._session(session)
        self.calls.append(("restart_code", (sandbox_id, session), {}))

    async def close_code(self, sandbox_id: str, session: str) -> None:
        self._session(session)
        self.calls.append(("close_code", (sandbox_id, session), {}))
        del self.sessions[session]


@dataclass
class Api:
    app: Any
    store: ControlStore
    engine: FakeEngine
    keys: dict[str, str]
    sandbox: str  # tenant a's

    def client(self, who: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE,
                                 headers={"Authorization": f"Bearer {self.keys[who]}"})


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        tenants = {name: (await store.create_tenant(name)).id for name in ("a", "b")}
        keys: dict[str, str] = {}
        for who, tenant, role in [("a_dev", "a", Role.DEVELOPER), ("a_aud", "a", Role.AUDITOR),
                                  ("b_dev", "b", Role.DEVELOPER)]:
            keys[who] = (await store.create_key(tenants[tenant], role, who)).key
        dev = await store.authenticate(keys["a_dev"])
        sandbox = (await store.reserve_sandbox(dev, SandboxSpec())).id
        await store.mark_running(sandbox)
        engine = FakeEngine()
        yield Api(create_app(engine, store), store, engine, keys, sandbox)  # type: ignore[arg-type]
    finally:
        await store.close()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ndjson(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.content.splitlines() if line.strip()]


async def audit_records(api: Api, action: str) -> list[Any]:
    return await api.store.audit.query(action=action)


# -- running a cell ----------------------------------------------------------------------------------------------


async def test_json_result_has_every_field_and_exact_bytes(api: Api) -> None:
    api.engine.result = cell(session="default", language="python", stdout_bytes=BINARY_OUT,
                                   stderr_bytes=BINARY_ERR, results=(FIGURE, TEXT_2), duration=0.25)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "1+1"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "session": "default", "language": "python",
        "results": [{"is_main_result": False, "data": FIGURE.data},
                    {"is_main_result": True, "data": {"text/plain": "2"}}],
        "stdout_b64": b64(BINARY_OUT), "stderr_b64": b64(BINARY_ERR), "error": None, "timed_out": False,
        "oom_killed": False, "session_restarted": False, "duration": 0.25, "checkpoint": None,
        "truncated": False, "stdout_size": len(BINARY_OUT), "stderr_size": len(BINARY_ERR), "stdout_cut": None,
        "stderr_cut": None,
    }
    assert base64.b64decode(r.json()["results"][0]["data"]["image/png"]) == PNG
    assert ("run_code", (api.sandbox, "1+1"), {"language": "python", "session": "default", "timeout": None}) \
        in api.engine.calls


async def test_language_session_and_timeout_reach_the_engine(api: Api) -> None:
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code",
                         json={"code": "cd /tmp", "language": "bash", "session": "s1", "timeout": 2.5})
    assert r.status_code == 200, r.text
    assert ("run_code", (api.sandbox, "cd /tmp"), {"language": "bash", "session": "s1", "timeout": 2.5}) \
        in api.engine.calls


async def test_a_raising_cell_is_a_200_with_its_error(api: Api) -> None:
    error = CodeError(name="ZeroDivisionError", value="division by zero",
                      traceback="Traceback (most recent call last):\n  ...\nZeroDivisionError: division by zero\n")
    api.engine.result = cell(session="default", language="python", error=error)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "1/0"})
    assert r.status_code == 200, r.text
    assert r.json()["error"] == {"name": error.name, "value": error.value, "traceback": error.traceback}
    assert r.json()["results"] == []


async def test_stream_is_ndjson_in_the_order_produced(api: Api) -> None:
    api.engine.script = [("stdout", b"one\x00"), ("result", FIGURE), ("stderr", b"\xffwarn"), ("stdout", b"\xfe\n"),
                         ("result", TEXT_2)]
    api.engine.result = cell(session="s", language="python", stdout_bytes=b"one\x00\xfe\n",
                                   stderr_bytes=b"\xffwarn", results=(FIGURE, TEXT_2), timed_out=True,
                                   session_restarted=True, duration=2.0)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "session": "s", "stream": True})
    assert r.status_code == 200, r.text
    events = ndjson(r)
    assert [e["event"] for e in events] == ["stdout", "result", "stderr", "stdout", "result", "end"]
    assert base64.b64decode(events[0]["data_b64"]) + base64.b64decode(events[3]["data_b64"]) == b"one\x00\xfe\n"
    assert base64.b64decode(events[2]["data_b64"]) == b"\xffwarn"
    assert events[1]["result"] == {"is_main_result": False, "data": FIGURE.data}
    assert events[4]["result"] == {"is_main_result": True, "data": {"text/plain": "2"}}
    assert events[-1] == {"event": "end", "session": "s", "language": "python", "stdout_b64": "", "stderr_b64": "",
                          "error": None, "timed_out": True, "oom_killed": False, "session_restarted": True,
                          "duration": 2.0, "checkpoint": None}


async def test_stream_end_carries_what_the_callbacks_did_not(api: Api) -> None:
    """Output or results the engine returned without streaming them still reach the client, once."""
    api.engine.script = [("stdout", b"head")]
    api.engine.result = cell(session="default", language="python", stdout_bytes=b"head\x00tail",
                                   stderr_bytes=b"late", results=(TEXT_2,))
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "stream": True})
    events = ndjson(r)
    assert [e["event"] for e in events] == ["stdout", "result", "end"]
    assert base64.b64decode(events[-1]["stdout_b64"]) == b"\x00tail"
    assert base64.b64decode(events[-1]["stderr_b64"]) == b"late"
    assert "results" not in events[-1]


async def test_an_engine_failure_mid_stream_is_a_final_error_event(api: Api) -> None:
    api.engine.script = [("stdout", b"partial")]
    api.engine.fail_after_script = NotFoundError("the sandbox went away")
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "stream": True})
    events = ndjson(r)
    assert [e["event"] for e in events] == ["stdout", "error"]
    assert events[-1]["error"]["code"] == "not_found"
    [record] = await audit_records(api, "code.run")
    assert record.outcome["error"] == "not_found"


@pytest.mark.parametrize("body", [
    {},
    {"code": 1},
    {"code": ["print(1)"]},
    {"code": "1", "language": 3},
    {"code": "1", "timeout": 0},
    {"code": "1", "timeout": -1},
    {"code": "1", "session": ""},
    {"code": "1", "session": "a/b"},
    {"code": "1", "stream": "yes"},
    {"code": "1", "unknown": True},
])
async def test_bad_bodies_are_400(api: Api, body: dict[str, Any]) -> None:
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert not [call for call in api.engine.calls if call[0] == "run_code"]


async def test_not_json_is_400(api: Api) -> None:
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", content=b"\xff{",
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_language_is_the_engines_400(api: Api, stream: bool) -> None:
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "language": "cobol", "stream": stream})
    if stream:  # the engine refuses once the stream began: a final error event
        [event] = ndjson(r)
        error = event["error"]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["code"] == "invalid_request" and "python" in error["message"]


# -- who may ---------------------------------------------------------------------------------------------------------


def _routes(sandbox: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    base = f"/v1/sandboxes/{sandbox}/code"
    return [("POST", base, {"code": "1+1"}), ("POST", base, {"code": "1+1", "stream": True}),
            ("GET", f"{base}/sessions", None), ("POST", f"{base}/sessions/default/interrupt", None),
            ("POST", f"{base}/sessions/default/restart", None), ("DELETE", f"{base}/sessions/default", None)]


async def test_another_tenants_sandbox_is_404_on_every_route(api: Api) -> None:
    api.engine.sessions["default"] = CodeSession(name="default", language="python", pid=7, started_at=1.0)
    async with api.client("b_dev") as c:
        for method, path, body in _routes(api.sandbox):
            r = await c.request(method, path, json=body)
            assert r.status_code == 404, (method, path, r.text)
    assert api.engine.calls == []


async def test_an_auditor_may_not_run_code(api: Api) -> None:
    api.engine.sessions["default"] = CodeSession(name="default", language="python", pid=7, started_at=1.0)
    async with api.client("a_aud") as c:
        for method, path, body in _routes(api.sandbox):
            r = await c.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["code"] == "permission_denied"
    assert api.engine.calls == []


async def test_unknown_sandbox_is_404(api: Api) -> None:
    async with api.client("a_dev") as c:
        r = await c.post("/v1/sandboxes/sb_nope/code", json={"code": "1"})
    assert r.status_code == 404


# -- audit ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_code_run_is_audited_with_the_code_verbatim(api: Api, stream: bool) -> None:
    code = "import os\nprint(os.environ['SECRET'])  # \u00e9\n"
    api.engine.result = cell(session="s", language="python", timed_out=True, oom_killed=True,
                                   error=CodeError(name="KeyboardInterrupt", value="", traceback=""))
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code",
                         json={"code": code, "session": "s", "timeout": 1, "stream": stream})
        assert r.status_code == 200
    [record] = await audit_records(api, "code.run")
    assert record.target == api.sandbox
    assert record.params == {"code": code, "language": "python", "session": "s", "timeout": 1, "stream": stream}
    assert record.outcome == {"status": 200, "timed_out": True, "oom_killed": True, "session_restarted": False,
                              "exception": "KeyboardInterrupt"}


async def test_a_refused_run_is_audited(api: Api) -> None:
    async with api.client("a_dev") as c:
        await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "language": "cobol"})
    [record] = await audit_records(api, "code.run")
    assert record.outcome["status"] == 400 and record.outcome["error"] == "invalid_request"
    assert record.params["code"] == "x"


# -- sessions ---------------------------------------------------------------------------------------------------------


async def test_sessions_list_interrupt_restart_close(api: Api) -> None:
    api.engine.sessions["default"] = CodeSession(name="default", language="python", pid=42, started_at=0.0 + 1e9)
    api.engine.sessions["sh"] = CodeSession(name="sh", language="bash", pid=43, started_at=1e9)
    base = f"/v1/sandboxes/{api.sandbox}/code/sessions"
    async with api.client("a_dev") as c:
        listed = (await c.get(base)).json()["sessions"]
        assert [(s["name"], s["language"], s["pid"]) for s in listed] == [("default", "python", 42), ("sh", "bash", 43)]
        assert listed[0]["started_at"].startswith("2001-09-09T01:46:40")
        assert (await c.post(f"{base}/sh/interrupt")).status_code == 204
        assert (await c.post(f"{base}/sh/restart")).status_code == 204
        assert (await c.delete(f"{base}/sh")).status_code == 204
        assert [s["name"] for s in (await c.get(base)).json()["sessions"]] == ["default"]
        for method, path in [("POST", f"{base}/sh/interrupt"), ("POST", f"{base}/sh/restart"),
                             ("DELETE", f"{base}/sh")]:
            r = await c.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path)
    assert [call[0] for call in api.engine.calls] == ["interrupt_code", "restart_code", "close_code"]
    actions = [(await audit_records(api, a))[0].params for a in ("code.interrupt", "code.restart", "code.close")]
    assert actions == [{"session": "sh"}] * 3
    assert (await audit_records(api, "code.sessions"))[0].outcome == {"status": 200, "count": 2}


async def test_code_routes_are_in_the_contract(api: Api) -> None:
    doc = API_DOC.read_text()
    async with api.client("a_dev") as c:
        paths = (await c.get("/openapi.json")).json()["paths"]
    served = {(m.upper(), p.replace("{sandbox_id}", "{id}")) for p, ms in paths.items() for m in ms if "/code" in p}
    assert len(served) == 5
    for method, path in served:
        assert f"`{method} {path}`" in doc, (method, path)
    documented = set(re.findall(r"`(GET|POST|DELETE) (/v1/sandboxes/\{id\}/code[^`]*)`", doc))
    assert documented == served


# -- end to end, over real sandboxes -------------------------------------------------------------------------------


@pytest.fixture
async def real(engine: Engine, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A client of tenant a's developer over a real engine, and a sandbox of the test template."""
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        tenant = (await store.create_tenant("a")).id
        key = (await store.create_key(tenant, Role.DEVELOPER, "dev")).key
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, store)), base_url=BASE,
                                     headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
            r = await client.post("/v1/sandboxes", json={"template": TEMPLATE, "limits": {"memory": "1G"}})
            assert r.status_code == 201, r.text
            yield client, r.json()["id"]
    finally:
        await store.close()


async def run_cell(client: httpx.AsyncClient, sandbox: str, code: str, **body: Any) -> dict[str, Any]:
    r = await client.post(f"/v1/sandboxes/{sandbox}/code", json={"code": code, **body})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


@pytest.mark.runc
async def test_real_cells_keep_state_and_return_text(real: tuple[httpx.AsyncClient, str]) -> None:
    client, sandbox = real
    assert (await run_cell(client, sandbox, "x = 41"))["results"] == []
    result = await run_cell(client, sandbox, "print('hi')\nx + 1")
    assert [r["data"]["text/plain"] for r in result["results"] if r["is_main_result"]] == ["42"]
    assert base64.b64decode(result["stdout_b64"]) == b"hi\n" and result["error"] is None
    assert [r["data"] for r in (await run_cell(client, sandbox, "1+1"))["results"]] == [{"text/plain": "2"}]
    failed = await run_cell(client, sandbox, "1/0")
    assert failed["error"]["name"] == "ZeroDivisionError" and "1/0" in failed["error"]["traceback"]


@pytest.mark.runc
async def test_real_matplotlib_plot_is_a_png(real: tuple[httpx.AsyncClient, str]) -> None:
    client, sandbox = real
    result = await run_cell(client, sandbox, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\n",
                            timeout=120)
    assert result["error"] is None, result["error"]
    pngs = [base64.b64decode(r["data"]["image/png"]) for r in result["results"] if "image/png" in r["data"]]
    assert len(pngs) == 1 and pngs[0].startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.runc
async def test_real_dataframe_is_html_and_streams(real: tuple[httpx.AsyncClient, str]) -> None:
    client, sandbox = real
    code = "import pandas as pd\nprint('made')\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})"
    r = await client.post(f"/v1/sandboxes/{sandbox}/code", json={"code": code, "stream": True, "timeout": 120})
    events = ndjson(r)
    assert events[-1]["event"] == "end" and events[-1]["error"] is None, events[-1]
    [main] = [e["result"] for e in events if e["event"] == "result" and e["result"]["is_main_result"]]
    assert "<table" in main["data"]["text/html"] and "text/plain" in main["data"]
    assert b"".join(base64.b64decode(e["data_b64"]) for e in events if e["event"] == "stdout") == b"made\n"
    sessions = (await client.get(f"/v1/sandboxes/{sandbox}/code/sessions")).json()["sessions"]
    assert [s["name"] for s in sessions] == ["default"]


@pytest.mark.runc
async def test_real_c_program_reads_stdin_and_reports_compile_errors_apart(real: tuple[httpx.AsyncClient, str]) -> None:
    client, sandbox = real
    echo = '#include <stdio.h>\nint main(void){int c; while((c=getchar())!=EOF) putchar(c); return 3;}\n'
    stdin = b"in\x00\xff\n"
    result = await run_cell(client, sandbox, echo, language="c", stdin_b64=base64.b64encode(stdin).decode())
    assert base64.b64decode(result["stdout_b64"]) == stdin  # exact bytes through stdin and stdout
    assert result["error"]["name"] == "ExitStatus" and result["error"]["value"] == "3"
    broken = await run_cell(client, sandbox, "int main(void){ return undefined_name; }", language="c")
    assert broken["error"]["name"] == "CompileError" and "undefined_name" in broken["error"]["traceback"]
    assert broken["stdout_b64"] == ""
    r = await client.post(f"/v1/sandboxes/{sandbox}/code", json={"code": "1", "language": "cobol"})
    assert r.status_code == 400 and "python, bash, javascript, c, cpp" in r.json()["error"]["message"]
