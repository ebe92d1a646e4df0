"""The code interpreter's binary frames (docs/api.md, "Code interpreter"): a client that accepts
`application/vnd.corral.frames` gets output as raw bytes, streamed or not; any other client keeps JSON and NDJSON.

The server side runs in-process over test_server_code's fake engine; the SDK side runs against that same app (async,
through httpx.ASGITransport) and against the server's own encoder (sync, through httpx.MockTransport); the decoder is
fed every chunking; the last test runs real cells in a real sandbox, frames and JSON side by side.
"""
# ruff: noqa: F811  (`api` is test_server_code's fixture, imported, then named by the tests that use it)

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import NotFoundError, ServerError
from corral._sdk._code import AsyncCodeInterpreter, CodeInterpreter, _CodeStream
from corral._sdk._config import ConnectionConfig
from corral._sdk._transport import AsyncClient, SyncClient
from corral.control import ControlStore, Role
from corral.engine import CodeError, Engine
from corral.server import _code as server_code
from corral.server import create_app

from .conftest import TEMPLATE
from .test_server_code import (  # noqa: F401
    BASE,
    BINARY_ERR,
    BINARY_OUT,
    FIGURE,
    PNG,
    TEXT_2,
    Api,
    api,
    audit_records,
    cell,
)

pytestmark = pytest.mark.anyio

FRAMES = "application/vnd.corral.frames"
ACCEPT = {"Accept": f"{FRAMES}, application/json"}
HEADER = struct.Struct(">IB")
KINDS = {1: "stdout", 2: "stderr", 3: "event"}


def frames(r: httpx.Response) -> list[tuple[str, Any]]:
    """The frames of a response, decoded here (not by the SDK): (kind, bytes) or ("event", dict)."""
    assert r.headers["content-type"] == FRAMES, r.headers
    body, out, pos = r.content, [], 0
    while pos < len(body):
        length, kind = HEADER.unpack_from(body, pos)
        payload = body[pos + 5:pos + 4 + length]
        assert len(payload) == length - 1, "a frame cut short"
        out.append(("event", json.loads(payload)) if kind == 3 else (KINDS[kind], payload))
        pos += 4 + length
    return out


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload) + 1, kind) + payload


def event(obj: dict[str, Any]) -> bytes:
    return frame(3, json.dumps(obj).encode())


OUTCOME = {"session": "default", "language": "python", "error": None, "timed_out": False, "oom_killed": False,
           "session_restarted": False, "duration": 0.25, "checkpoint": None}
# What a whole result adds (a stream carried every byte: its end says nothing of kept output).
KEPT = {"truncated": False, "stdout_size": 6, "stderr_size": 6, "stdout_cut": None, "stderr_cut": None}


# -- the server ------------------------------------------------------------------------------------------------------


async def test_a_whole_result_is_frames_with_exact_bytes_and_every_field(api: Api) -> None:
    api.engine.result = cell(session="default", language="python", stdout_bytes=BINARY_OUT,
                             stderr_bytes=BINARY_ERR, results=(FIGURE, TEXT_2), duration=0.25)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "1+1"}, headers=ACCEPT)
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(r.content)
    assert frames(r) == [
        ("stdout", BINARY_OUT), ("stderr", BINARY_ERR),
        ("event", {"event": "end", **OUTCOME, **KEPT, "results": [{"is_main_result": False, "data": FIGURE.data},
                                                          {"is_main_result": True, "data": {"text/plain": "2"}}]}),
    ]


async def test_empty_output_has_no_frames_and_an_error_stays_a_field(api: Api) -> None:
    error = CodeError(name="ZeroDivisionError", value="division by zero", traceback="Traceback ...\n")
    api.engine.result = cell(session="s", language="python", error=error, timed_out=True)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "1/0"}, headers=ACCEPT)
    [(kind, end)] = frames(r)
    assert kind == "event" and end["error"] == {"name": error.name, "value": error.value,
                                                "traceback": error.traceback}
    assert end["timed_out"] and end["results"] == [] and "stdout_b64" not in end


async def test_output_larger_than_a_frame_is_split(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_code, "MAX_FRAME", 4)
    api.engine.result = cell(session="default", language="python", stdout_bytes=b"0123456789")
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x"}, headers=ACCEPT)
    assert frames(r)[:3] == [("stdout", b"0123"), ("stdout", b"4567"), ("stdout", b"89")]


async def test_a_stream_is_frames_in_the_order_produced(api: Api) -> None:
    """What the engine handed to no callback comes as frames before the end, which carries no output."""
    api.engine.script = [("stdout", b"one\x00"), ("result", FIGURE), ("stderr", b"\xffwarn"), ("stdout", b"\xfe\n")]
    api.engine.result = cell(session="s", language="python", stdout_bytes=b"one\x00\xfe\n\x00tail",
                             stderr_bytes=b"\xffwarn", results=(FIGURE, TEXT_2), session_restarted=True)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "session": "s", "stream": True},
                         headers={"Accept": f"{FRAMES}, application/x-ndjson"})
    assert r.status_code == 200, r.text
    end = {"event": "end", **OUTCOME, "session": "s", "session_restarted": True, "duration": 0.0}
    assert frames(r) == [
        ("stdout", b"one\x00"),
        ("event", {"event": "result", "result": {"is_main_result": False, "data": FIGURE.data}}),
        ("stderr", b"\xffwarn"), ("stdout", b"\xfe\n"),
        ("event", {"event": "result", "result": {"is_main_result": True, "data": {"text/plain": "2"}}}),
        ("stdout", b"\x00tail"), ("event", end),
    ]


async def test_a_failure_mid_stream_is_a_final_error_frame(api: Api) -> None:
    api.engine.script = [("stdout", b"partial")]
    api.engine.fail_after_script = NotFoundError("the sandbox went away")
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "stream": True}, headers=ACCEPT)
    [out, (kind, last)] = frames(r)
    assert out == ("stdout", b"partial") and kind == "event"
    assert last["event"] == "error" and last["error"]["code"] == "not_found"
    [record] = await audit_records(api, "code.run")
    assert record.outcome["error"] == "not_found" and record.params["stream"] is True


@pytest.mark.parametrize("accept", ["application/json", "*/*", "", f"{FRAMES};q=0, application/json",
                                    "application/vnd.corral.framesx"])
async def test_other_clients_keep_json(api: Api, accept: str) -> None:
    api.engine.result = cell(session="default", language="python", stdout_bytes=BINARY_OUT)
    async with api.client("a_dev") as c:
        r = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x"}, headers={"Accept": accept})
        streamed = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "x", "stream": True},
                                headers={"Accept": accept})
    assert r.headers["content-type"] == "application/json"
    assert base64.b64decode(r.json()["stdout_b64"]) == BINARY_OUT
    assert streamed.headers["content-type"].startswith("application/x-ndjson")


async def test_refusals_are_json_errors_whatever_the_client_accepts(api: Api) -> None:
    async with api.client("a_dev") as c:
        missing = await c.post("/v1/sandboxes/sb_nope/code", json={"code": "1"}, headers=ACCEPT)
        bad = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": 1}, headers=ACCEPT)
        language = await c.post(f"/v1/sandboxes/{api.sandbox}/code", json={"code": "1", "language": "cobol"},
                                headers=ACCEPT)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_request")
    assert (language.status_code, language.json()["error"]["code"]) == (400, "invalid_request")


# -- the SDK ---------------------------------------------------------------------------------------------------------


def sdk(api: Api) -> AsyncCodeInterpreter:
    config = ConnectionConfig.resolve(api_key=api.keys["a_dev"], base_url=BASE)
    return AsyncCodeInterpreter(AsyncClient(config, httpx.ASGITransport(app=api.app)), api.sandbox)


async def test_the_sdk_gets_exact_bytes_from_frames(api: Api) -> None:
    api.engine.script = [("stdout", b"one\x00"), ("result", FIGURE), ("stderr", b"\xffwarn")]
    api.engine.result = cell(session="default", language="python", stdout_bytes=b"one\x00" + BINARY_OUT,
                             stderr_bytes=b"\xffwarn" + BINARY_ERR, results=(FIGURE, TEXT_2),
                             error=CodeError(name="ValueError", value="bad", traceback="tb"), oom_killed=True,
                             duration=0.25)
    code = sdk(api)
    whole = await code.run("x")
    seen: list[Any] = []
    streamed = await code.run("x", on_stdout=seen.append, on_stderr=seen.append, on_result=seen.append)
    for ex in (whole, streamed):
        assert (ex.stdout_bytes, ex.stderr_bytes) == (b"one\x00" + BINARY_OUT, b"\xffwarn" + BINARY_ERR)
        assert [r.png for r in ex.results] == [PNG, None] and ex.text == "2"
        assert ex.error is not None and (ex.error.name, ex.error.value, ex.error.traceback) == ("ValueError", "bad",
                                                                                                "tb")
        assert ex.oom_killed and not ex.timed_out and ex.duration == 0.25 and ex.session == "default"
    assert seen[:3] == [b"one\x00", streamed.results[0], b"\xffwarn"]
    assert seen[3:] == [streamed.results[1], BINARY_OUT, BINARY_ERR]  # what the engine did not stream, at the end


async def test_the_sdk_raises_a_failure_after_the_output_before_it(api: Api) -> None:
    api.engine.script = [("stdout", b"partial")]
    api.engine.fail_after_script = NotFoundError("the sandbox went away")
    out: list[bytes] = []
    with pytest.raises(NotFoundError, match="went away"):
        await sdk(api).run("x", on_stdout=out.append)
    assert out == [b"partial"]


def test_the_sync_sdk_reads_the_servers_frames() -> None:
    result = cell(session="default", language="python", stdout_bytes=BINARY_OUT, stderr_bytes=BINARY_ERR,
                  results=(FIGURE,))
    accepted: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        accepted.append(request.headers["accept"])
        return httpx.Response(200, headers={"content-type": FRAMES},
                              content=b"".join(server_code.FramesResponse(result).parts))

    config = ConnectionConfig.resolve(api_key="k", base_url=BASE)
    ex = CodeInterpreter(SyncClient(config, httpx.MockTransport(answer)), "sb_1").run("x")
    assert (ex.stdout_bytes, ex.stderr_bytes, ex.results[0].png) == (BINARY_OUT, BINARY_ERR, PNG)
    assert accepted == [f"{FRAMES}, application/json"]


# -- the decoder -----------------------------------------------------------------------------------------------------

STREAM = b"".join([
    frame(1, b"one\x00"), event({"event": "result", "result": {"is_main_result": True, "data": {"text/plain": "2"}}}),
    frame(9, b"a kind from a newer server"), frame(2, b"\xff"), frame(1, b""), frame(1, b"two"),
    event({"event": "end", **OUTCOME}), frame(1, b"after the end"),
])


def test_the_decoder_is_indifferent_to_chunk_boundaries() -> None:
    for size in (1, 2, 5, 7, len(STREAM)):
        decoder = _CodeStream(frames=True)
        events = [e for i in range(0, len(STREAM), size) for e in decoder.feed(STREAM[i:i + size])]
        tail, ex = decoder.finish()
        assert events == [("stdout", b"one\x00"), ("result", ex.results[0]), ("stderr", b"\xff"),
                          ("stdout", b"two")] and tail == []
        assert (ex.stdout_bytes, ex.stderr_bytes, ex.text) == (b"one\x00two", b"\xff", "2")


@pytest.mark.parametrize(("body", "error"), [
    (frame(1, b"out") + STREAM[:-30], ServerError),  # cut before the end
    (frame(1, b"out") + HEADER.pack(0, 1), ServerError),  # a frame of length 0
    (frame(1, b"out") + frame(3, b"{not json"), ServerError),
    (frame(1, b"out") + event({"event": "error", "error": {"code": "not_found", "message": "gone"}}), NotFoundError),
])
def test_a_broken_stream_raises_after_the_output_before_it(body: bytes, error: type[Exception]) -> None:
    decoder = _CodeStream(frames=True)
    assert decoder.feed(body)[0] == ("stdout", b"out")
    with pytest.raises(error):
        decoder.finish()


# -- real sandboxes ----------------------------------------------------------------------------------------------------


@pytest.fixture
async def real(engine: Engine, tmp_path: Path) -> AsyncIterator[tuple[AsyncClient, str]]:
    """An SDK client of tenant a's developer over a real engine, and a sandbox of the test template."""
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        tenant = (await store.create_tenant("a")).id
        key = (await store.create_key(tenant, Role.DEVELOPER, "dev")).key
        config = ConnectionConfig.resolve(api_key=key, base_url=BASE, request_timeout=120)
        client = AsyncClient(config, httpx.ASGITransport(app=create_app(engine, store)))
        try:
            created = await client.request("POST", "/v1/sandboxes", json={"template": TEMPLATE})
            yield client, created["id"]
        finally:
            await client.close()
    finally:
        await store.close()


CELL = """import sys
sys.stdout.buffer.write(bytes(range(256)) * 4096 + b'\\x00end')
sys.stdout.flush()
sys.stderr.buffer.write(b'\\xfe\\xff warn\\x00')
from IPython.display import display, HTML
display(HTML('<b>x</b>'))
raise KeyError('k')"""


@pytest.mark.runc
async def test_real_cells_arrive_byte_for_byte_in_every_format(real: tuple[AsyncClient, str]) -> None:
    """A 1 MiB binary stdout, a stderr, a displayed result and the cell's error: frames (whole and streamed) and
    an old client's JSON agree, byte for byte."""
    client, sandbox = real
    code = AsyncCodeInterpreter(client, sandbox)
    whole = await code.run(CELL)
    chunks: list[bytes] = []
    streamed = await code.run(CELL, on_stdout=chunks.append)
    legacy = await client.request("POST", f"/v1/sandboxes/{sandbox}/code", json={"code": CELL})
    stdout = bytes(range(256)) * 4096 + b"\x00end"
    for ex in (whole, streamed):
        assert ex.stdout_bytes == stdout and ex.stderr_bytes == b"\xfe\xff warn\x00"
        assert [r.html for r in ex.results] == ["<b>x</b>"]
        assert ex.error is not None and ex.error.name == "KeyError" and not ex.timed_out
    assert b"".join(chunks) == stdout and len(chunks) > 1
    assert base64.b64decode(legacy["stdout_b64"]) == stdout
    assert base64.b64decode(legacy["stderr_b64"]) == b"\xfe\xff warn\x00"
    assert legacy["error"]["name"] == "KeyError" and legacy["results"][0]["data"]["text/html"] == "<b>x</b>"
