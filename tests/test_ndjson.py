"""The NDJSON output stream (server/_ndjson.py): a producer that raises still ends the stream, with an `error`
last line, and the operation's audit record names the error. Every read is bounded, so a regression fails
instead of hanging."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

import pytest

from corral import NotFoundError
from corral._sdk._code import _CodeStream
from corral._sdk._processes import _ExecStream
from corral.control import AuditEvent, ControlStore, Principal, Role
from corral.server._ndjson import Producer, Sink, line, output_stream
from corral.service import Audited, Streamed

pytestmark = pytest.mark.anyio
BOUND = 5.0  # seconds: far more than a stream of three lines needs


class _Trail:
    def __init__(self) -> None:
        self.events: list[AuditEvent] = []

    async def append(self, event: AuditEvent) -> None:
        self.events.append(event)


class _Store:
    def __init__(self) -> None:
        self.audit = _Trail()


class _Op(Streamed[int]):
    """The smallest streamed operation: `run` awaits `call`, the outcome keeps its value."""

    async def run(self, call: Callable[[], Awaitable[int]]) -> int:
        return await self._run(call, lambda value: {"value": value})


def _op(store: _Store) -> _Op:
    principal = Principal(tenant_id="t-1", key_id="k-1", role=Role.DEVELOPER)
    return _Op(Audited(cast(ControlStore, store), principal, "sandbox.exec", "sb-1"))


class _Ends:
    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> None:
        self.count += 1


async def _drain(produce: Producer, on_end: Callable[[], Awaitable[None]]) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        return [chunk async for chunk in output_stream(produce, on_end)]

    chunks = await asyncio.wait_for(collect(), BOUND)
    return [json.loads(c) for c in b"".join(chunks).splitlines()]


async def test_a_producer_that_raises_a_corral_error_ends_the_stream_with_it() -> None:
    ends = _Ends()

    async def produce(sink: Sink) -> bytes:
        await sink.stdout(b"partial")
        raise NotFoundError("no such process", details={"process": "p-1"})

    events = await _drain(produce, ends)
    assert events[0] == {"event": "stdout", "data_b64": "cGFydGlhbA=="}
    assert events[-1] == {"event": "error", "error": {"code": "not_found", "message": "no such process",
                                                      "details": {"process": "p-1"}}}
    assert ends.count == 1


async def test_an_unexpected_exception_is_a_logged_server_error(caplog: pytest.LogCaptureFixture) -> None:
    ends = _Ends()

    async def produce(sink: Sink) -> bytes:
        await sink.stderr(b"x")
        raise RuntimeError("secret internal detail /var/lib/corral/sandboxes/sb-1")

    with caplog.at_level(logging.ERROR, logger="corral.server"):
        events = await _drain(produce, ends)
    last = events[-1]
    assert last["event"] == "error"
    assert last["error"]["code"] == "server_error"
    assert "secret internal detail" not in last["error"]["message"]  # the log has it, the client does not
    assert any(r.exc_info and "secret internal detail" in str(r.exc_info[1]) for r in caplog.records)
    assert ends.count == 1


@pytest.mark.parametrize(("error", "code"), [(NotFoundError("gone"), "not_found"),
                                             (RuntimeError("boom"), "server_error")])
async def test_the_audit_record_of_a_failed_stream_names_the_error(error: Exception, code: str) -> None:
    store = _Store()
    op = _op(store)

    async def fail() -> int:
        raise error

    async def produce(sink: Sink) -> bytes:
        return line({"event": "exit", "value": await op.run(fail)})

    events = await _drain(produce, op.close)
    assert events[-1]["event"] == "error" and events[-1]["error"]["code"] == code
    [record] = store.audit.events
    assert record.outcome["error"] == code
    assert "disconnected" not in record.outcome


async def test_sdk_decoders_raise_the_streamed_error() -> None:
    async def produce(sink: Sink) -> bytes:
        await sink.stdout(b"out")
        raise NotFoundError("gone")

    body = b"".join([line(e) for e in await _drain(produce, _Ends())])
    exec_stream = _ExecStream()
    with pytest.raises(NotFoundError, match="gone"):
        exec_stream.feed(body)
        exec_stream.finish()
    code_stream = _CodeStream()
    assert code_stream.feed(body) == [("stdout", b"out")]
    with pytest.raises(NotFoundError, match="gone"):
        code_stream.finish()


async def test_a_producer_that_returns_still_ends_normally() -> None:
    store = _Store()
    op = _op(store)

    async def seven() -> int:
        return 7

    async def produce(sink: Sink) -> bytes:
        await sink.stdout(b"a" * 10)
        return line({"event": "exit", "value": await op.run(seven)})

    events = await _drain(produce, op.close)
    assert events[-1] == {"event": "exit", "value": 7}
    [record] = store.audit.events
    assert record.outcome["value"] == 7 and "error" not in record.outcome


async def test_a_client_that_leaves_cancels_the_producer() -> None:
    store = _Store()
    op = _op(store)
    cancelled = asyncio.Event()

    async def forever() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    async def produce(sink: Sink) -> bytes:
        await sink.stdout(b"first")
        return line({"event": "exit", "value": await op.run(forever)})

    stream = cast(AsyncGenerator[bytes, None], output_stream(produce, op.close))
    assert json.loads(await asyncio.wait_for(anext(stream), BOUND))["event"] == "stdout"
    await asyncio.wait_for(stream.aclose(), BOUND)
    assert cancelled.is_set()
    [record] = store.audit.events
    assert record.outcome["disconnected"] is True
