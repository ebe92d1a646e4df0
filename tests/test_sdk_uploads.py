"""Every input form `files.write` takes arrives byte for byte, sync and async, through a real server and a runc
sandbox: bytes, bytearray, memoryview, str, a file object, a generator (small, empty and oversized chunks), a
list of chunks, an async generator; NUL bytes and 0 bytes; and a bad chunk is a TypeError. (Their speed is
`corral bench api`'s, never a test's.)"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from corral import AsyncSandbox, Sandbox

from .conftest import TEMPLATE
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

# Over two of the SDK's 256 KiB slices and not a multiple of one; NULs at both ends and in the middle.
DATA = b"\x00" + os.urandom(600 * 1024) + b"\x00" * 1000 + os.urandom(777) + b"\x00"


def _gen(data: bytes, size: int) -> Iterator[bytes]:
    yield b""  # an empty chunk is skipped, not an end
    for i in range(0, len(data), size):
        yield data[i:i + size]


FORMS: dict[str, Callable[[bytes], Any]] = {
    "bytes": lambda d: d,
    "bytearray": bytearray,
    "memoryview": memoryview,
    "file": io.BytesIO,
    "generator_small_chunks": lambda d: _gen(d, 1000),
    "generator_one_big_chunk": lambda d: _gen(d, len(d) or 1),
    "list_of_chunks": lambda d: [bytearray(d[:10]), memoryview(d[10:])],
}


def _opts(api: Api, url: str) -> dict[str, Any]:
    return {"api_key": api.keys["a_dev"], "base_url": url}


async def test_every_form_sync(api: Api, live_url: str) -> None:
    def flow() -> None:  # in a thread: the server runs in this test's event loop
        with Sandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
            for name, form in FORMS.items():
                for data in (DATA, b""):
                    assert sb.files.write(f"{name}.bin", form(data)).size == len(data), name
                    assert sb.files.read(f"{name}.bin") == data, name
            sb.files.write("s.txt", "h\u00e9\x00llo")
            assert sb.files.read("s.txt") == "h\u00e9\x00llo".encode()
            with pytest.raises(TypeError, match="str"):
                sb.files.write("bad.bin", iter([b"ok", "text"]))  # type: ignore[list-item]
            with pytest.raises(TypeError):
                sb.files.write("bad.bin", 42)  # type: ignore[arg-type]
            assert sb.files.read("list_of_chunks.bin") == b""  # the last good write stands

    await asyncio.to_thread(flow)


async def _agen(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 4096):
        yield data[i:i + 4096]


async def test_every_form_async(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
        forms: dict[str, Callable[[bytes], Any]] = {**FORMS, "async_generator": _agen}
        for name, form in forms.items():
            for data in (DATA, b""):
                assert (await sb.files.write(f"{name}.bin", form(data))).size == len(data), name
                assert await sb.files.read(f"{name}.bin") == data, name
        await sb.files.write("s.txt", "\x00z")
        assert await sb.files.read("s.txt") == b"\x00z"
        with pytest.raises(TypeError):
            await sb.files.write("bad.bin", 42)  # type: ignore[arg-type]
