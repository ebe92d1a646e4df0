"""SDK defects, each pinned by a test: a default code session per language, `corral eval run` reading
$CORRAL_API_KEY, one egress notice per refused host and reason, `runtime=` and `timeout=` at create, and transport
errors apart from server errors (every httpx transport exception mapped)."""

from __future__ import annotations

import json
import socket
from operator import attrgetter
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import corral
from corral import (
    AsyncSandbox,
    CommandResult,
    ConflictError,
    ConnectError,
    CorralError,
    EgressDenial,
    InvalidRequestError,
    Sandbox,
    ServerError,
    TransportError,
    TransportTimeoutError,
    error_from_code,
)
from corral._exceptions import _all_subclasses
from corral._sdk import AsyncPty, ConnectionConfig, Pty
from corral._sdk._transport import _TRANSPORT_ERRORS, AsyncClient, SyncClient
from corral.cli import _eval as cli_eval
from corral.cli import app
from corral.cli._common import error_line
from corral.engine import SandboxSession
from corral.eval import RunResults, load_corpus

from .conftest import TEMPLATE
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

KEY = "test-key"
URL = "http://corral.test:7770"
SANDBOX = {"id": "sb-1", "state": "running", "template": "default", "runtime": "runc", "limits": {},
           "metadata": {}, "file_roots": ["/workspace"], "network": "none"}


# -- (a) each language has its own default code session --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.runc
async def test_each_language_has_its_own_default_session(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, api_key=api.keys["a_dev"], base_url=live_url) as sb:
        assert (await sb.run_code("x = 41")).error is None
        js = await sb.run_code("let n = 1; console.log(n)", language="javascript")
        assert js.error is None and js.stdout == "1\n" and js.session == "javascript"
        sh = await sb.run_code("export Y=bash-state; echo hi", language="bash")
        assert sh.error is None and sh.stdout == "hi\n" and sh.session == "bash"
        py = await sb.run_code("x + 1")
        assert py.text == "42" and py.session == "default"  # python's default session kept its state
        assert (await sb.run_code("console.log(n + 1)", language="javascript")).stdout == "2\n"
        assert (await sb.run_code("echo $Y", language="bash")).stdout == "bash-state\n"
        sessions = {(s.name, s.language) for s in await sb.code.sessions()}
        assert sessions == {("default", "python"), ("javascript", "javascript"), ("bash", "bash")}


@pytest.mark.anyio
@pytest.mark.runc
async def test_engine_picks_the_language_default_session(sandbox: SandboxSession) -> None:
    assert (await sandbox.run_code("1", language="python")).session == "default"
    r = await sandbox.run_code("console.log(6 * 7)", language="javascript")
    assert r.error is None and r.stdout == "42\n" and r.session == "javascript"
    with pytest.raises(ConflictError, match="runs python"):  # a session named by the caller keeps its language
        await sandbox.run_code("console.log(1)", language="javascript", session="default")


# -- (b) `corral eval run` reads $CORRAL_API_KEY and $CORRAL_URL, like every command ------------------------------


def _fake_run_on_corral(seen: dict[str, Any]) -> Any:
    async def run_on_corral(tasks: Any, **kwargs: Any) -> RunResults:
        seen.update(kwargs, tasks=len(tasks))
        return RunResults(header={})

    return run_on_corral


@pytest.mark.parametrize(("as_tenant", "key_arg"), [(False, "admin_key"), (True, "api_key")])
def test_eval_run_reads_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     as_tenant: bool, key_arg: str) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli_eval, "run_on_corral", _fake_run_on_corral(seen))
    monkeypatch.setenv("CORRAL_API_KEY", "key-from-env")
    monkeypatch.setenv("CORRAL_URL", "http://corral.example:7770/")
    task = load_corpus()[0].id
    argv = ["eval", "run", "--task", task, "--out", str(tmp_path / "r.jsonl"), *(["--as-tenant"] * as_tenant)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert seen[key_arg] == "key-from-env" and seen["base_url"] == "http://corral.example:7770"
    assert seen["tasks"] == 1


def test_eval_run_option_beats_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli_eval, "run_on_corral", _fake_run_on_corral(seen))
    monkeypatch.setenv("CORRAL_API_KEY", "key-from-env")
    result = CliRunner().invoke(app, ["eval", "run", "--task", load_corpus()[0].id, "--api-key", "given",
                                      "--url", "http://x:1", "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 0, result.output
    assert (seen["admin_key"], seen["base_url"]) == ("given", "http://x:1")


def test_eval_run_without_any_key_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli_eval, "run_on_corral", _fake_run_on_corral({}))
    monkeypatch.delenv("CORRAL_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["eval", "run", "--task", load_corpus()[0].id,
                                      "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 2 and "CORRAL_API_KEY" in result.output
    assert not (tmp_path / "r.jsonl").exists()  # refused before anything was started or written


# -- (c) one notice per refused host, port and reason --------------------------------------------------------------


def _denial(host: str, port: int | None = 443, reason: str | None = None) -> dict[str, Any]:
    return {"kind": "connect", "host": host, "port": port,
            "reason": reason or f"egress denied: {host}:{port} is not allowed by network policy 'none'"}


def test_a_retried_refusal_is_one_notice_with_its_count() -> None:
    wire = [_denial("pypi.org")] * 6 + [_denial("files.pythonhosted.org"), _denial("pypi.org", 80)]
    result = CommandResult.from_wire({"exit_code": 1, "egress_denials": wire})
    assert len(result.egress_denials) == 8  # every attempt is still there
    assert result.notice == (
        "corral: egress denied: pypi.org:443 is not allowed by network policy 'none' (6 attempts)\n"
        "corral: egress denied: files.pythonhosted.org:443 is not allowed by network policy 'none'\n"
        "corral: egress denied: pypi.org:80 is not allowed by network policy 'none'\n")
    assert CommandResult(exit_code=0).notice == ""


def test_same_host_with_another_reason_is_another_notice() -> None:
    denials = (EgressDenial("dns", "x.org", None, "lookup refused"), EgressDenial("dns", "x.org", None, "other"),
               EgressDenial("dns", "x.org", None, "lookup refused"))
    assert CommandResult(exit_code=0, egress_denials=denials).notice == \
        "corral: lookup refused (2 attempts)\ncorral: other\n"


# -- (d) runtime= and timeout= at create ---------------------------------------------------------------------------


def _recording(bodies: list[dict[str, Any]]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json={**SANDBOX, "runtime": bodies[-1].get("runtime", "runc")})

    return httpx.MockTransport(handler)


def test_create_sends_runtime_only_when_given() -> None:
    bodies: list[dict[str, Any]] = []
    Sandbox.create(runtime="runsc", api_key=KEY, base_url=URL, transport=_recording(bodies)).close()
    Sandbox.create(api_key=KEY, base_url=URL, transport=_recording(bodies)).close()
    assert bodies[0]["runtime"] == "runsc" and "runtime" not in bodies[1]  # None: the server's default


@pytest.mark.anyio
async def test_async_create_sends_runtime() -> None:
    bodies: list[dict[str, Any]] = []
    sb = await AsyncSandbox.create(runtime="runsc", api_key=KEY, base_url=URL, transport=_recording(bodies))
    await sb.close()
    assert bodies[0]["runtime"] == "runsc" and sb.info.runtime == "runsc"


@pytest.mark.anyio
async def test_timeout_none_is_refused_before_any_request() -> None:
    bodies: list[dict[str, Any]] = []
    with pytest.raises(InvalidRequestError, match="timeout must be a number of seconds"):
        Sandbox.create(timeout=None, api_key=KEY, base_url=URL, transport=_recording(bodies))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="timeout must be a number of seconds"):
        await AsyncSandbox.create(timeout=None, api_key=KEY, base_url=URL,  # type: ignore[arg-type]
                                  transport=_recording(bodies))
    assert bodies == []


def test_create_signatures_say_what_the_server_takes() -> None:
    import inspect

    for create in (Sandbox.create, AsyncSandbox.create):
        params = inspect.signature(create).parameters
        assert params["timeout"].annotation == "float" and params["timeout"].default == 300
        assert params["runtime"].default is None and params["runtime"].kind is inspect.Parameter.KEYWORD_ONLY


# -- (e) transport errors are not server errors ---------------------------------------------------------------------


def _httpx_transport_errors() -> set[type[httpx.TransportError]]:
    found: set[type[httpx.TransportError]] = set()
    todo: list[type[httpx.TransportError]] = [httpx.TransportError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("httpx"):
            found.add(cls)
        todo.extend(cls.__subclasses__())
    exported = {v for v in vars(httpx).values() if isinstance(v, type) and issubclass(v, httpx.TransportError)}
    return found | exported


def test_every_httpx_transport_error_is_mapped() -> None:
    # As httpx's test_httpcore_all_exceptions_mapped: a transport exception a new httpx adds must be named.
    unmapped = sorted(cls.__name__ for cls in _httpx_transport_errors() - set(_TRANSPORT_ERRORS))
    if unmapped:
        pytest.fail(f"httpx transport exceptions missing from corral._sdk._transport._TRANSPORT_ERRORS: {unmapped}")


EXPECTED: dict[type[httpx.TransportError], type[TransportError]] = {
    httpx.ConnectError: ConnectError, httpx.ProxyError: ConnectError, httpx.UnsupportedProtocol: ConnectError,
    httpx.ConnectTimeout: TransportTimeoutError, httpx.ReadTimeout: TransportTimeoutError,
    httpx.WriteTimeout: TransportTimeoutError, httpx.PoolTimeout: TransportTimeoutError,
    httpx.TimeoutException: TransportTimeoutError,
}


@pytest.mark.parametrize("httpx_error", sorted(_httpx_transport_errors(), key=attrgetter("__name__")),
                         ids=attrgetter("__name__"))
def test_transport_errors_become_corral_transport_errors(httpx_error: type[httpx.TransportError]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx_error("boom", request=request)

    with pytest.raises(TransportError) as info:
        Sandbox.list(api_key=KEY, base_url=URL, transport=httpx.MockTransport(handler))
    assert type(info.value) is EXPECTED.get(httpx_error, TransportError)
    assert isinstance(info.value.__cause__, httpx_error)
    assert info.value.details == {"url": URL, "transport_error": httpx_error.__name__}
    assert URL in info.value.message


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_is_a_connect_error_not_a_500() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ConnectError, match="cannot connect to Corral") as refused:
        Sandbox.create(api_key=KEY, base_url=url)
    assert isinstance(refused.value, ServerError)  # still caught by `except ServerError`, as before

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"code": "server_error", "message": "broken"}})

    with pytest.raises(ServerError) as failed:
        Sandbox.create(api_key=KEY, base_url=URL, transport=httpx.MockTransport(handler))
    assert not isinstance(failed.value, TransportError)


@pytest.mark.anyio
async def test_async_refused_connection_is_a_connect_error() -> None:
    with pytest.raises(ConnectError):
        await AsyncSandbox.list(api_key=KEY, base_url=f"http://127.0.0.1:{_closed_port()}")


@pytest.mark.anyio
async def test_a_refused_terminal_is_a_connect_error() -> None:
    config = ConnectionConfig(base_url=f"http://127.0.0.1:{_closed_port()}", api_key="k", request_timeout=5)
    client = SyncClient(config)
    with pytest.raises(ConnectError, match="cannot connect") as info:
        Pty(client, "sb-x").create()
    assert isinstance(info.value.__cause__, OSError)
    client.close()
    aclient = AsyncClient(config)
    with pytest.raises(ConnectError, match="cannot connect"):
        await AsyncPty(aclient, "sb-x").create()
    await aclient.close()


def test_transport_errors_never_cross_a_wire() -> None:
    wire = set(_all_subclasses(CorralError))
    assert not wire & {TransportError, ConnectError, TransportTimeoutError}
    for code in ("transport_error", "connect_error", "transport_timeout"):
        err = error_from_code(code, "m")  # a server never sends these: an unknown code, kept in the message
        assert type(err) is ServerError and code in err.message
    assert {"TransportError", "ConnectError", "TransportTimeoutError"} <= set(corral.__all__)


def test_the_cli_prints_a_transport_error_with_an_api_code() -> None:
    line = error_line(ConnectError("cannot connect to Corral at http://x:1: refused"))
    assert line == "error: server_error: cannot connect to Corral at http://x:1: refused"  # codes of docs/api.md
    assert error_line(InvalidRequestError("bad")) == "error: invalid_request: bad"
