"""The SDK against the real API over a loopback socket and real runc sandboxes: the file, archive and lifecycle
calls the fake server of tests/test_sdk.py cannot prove (exact bytes through the whole stack, real refusals)."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from corral import (
    AsyncSandbox,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    Sandbox,
    SandboxMetric,
)

from .conftest import TEMPLATE
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


def _opts(api: Api, url: str) -> dict[str, Any]:
    return {"api_key": api.keys["a_dev"], "base_url": url}


async def test_stat_rename_and_streamed_reads(api: Api, live_url: str) -> None:
    data = os.urandom(3 * 2**20) + b"\x00\xff"
    async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
        await sb.files.write("a.bin", data)
        entry = await sb.files.stat("/workspace/a.bin")
        assert entry.size == len(data) and not entry.is_dir and entry.path == "/workspace/a.bin"
        await sb.files.rename("a.bin", "b.bin")
        assert not await sb.files.exists("a.bin")
        await sb.files.write("c.bin", b"other")
        with pytest.raises(ConflictError):
            await sb.files.rename("c.bin", "b.bin")
        await sb.files.rename("c.bin", "b.bin", overwrite=True)
        assert await sb.files.read("b.bin") == b"other"
        await sb.files.write("big.bin", io.BytesIO(data))
        sink = io.BytesIO()
        assert await sb.files.read_into("big.bin", sink) == len(data)
        assert sink.getvalue() == data
        with pytest.raises(NotFoundError):
            await sb.files.stat("nope")


async def test_archives_round_trip_and_refuse_escapes(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
        await sb.commands.run("mkdir -p /workspace/src/sub && printf 'a\\0b' > /workspace/src/sub/x.bin "
                              "&& ln -s x.bin /workspace/src/sub/link")
        tar_bytes = io.BytesIO()
        assert await sb.files.read_archive("src", tar_bytes) > 0
        names = tarfile.open(fileobj=io.BytesIO(tar_bytes.getvalue())).getnames()
        assert any(n.endswith("sub/x.bin") for n in names) and any(n.endswith("sub/link") for n in names)
        tar_bytes.seek(0)
        assert await sb.files.write_archive("/workspace/copy", tar_bytes) >= 3
        out = await sb.commands.run("cat /workspace/copy/src/sub/x.bin")  # entries are named under `src/`
        assert out.stdout_bytes == b"a\x00b", out.stdout
        evil = io.BytesIO()
        with tarfile.open(fileobj=evil, mode="w") as tar:
            info = tarfile.TarInfo("../../etc/evil")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        with pytest.raises((InvalidRequestError, PermissionDeniedError)):
            await sb.files.write_archive("/workspace/e", evil.getvalue())
        assert (await sb.commands.run("ls /etc/evil /workspace/e")).exit_code != 0


async def test_pause_resume_and_file_roots(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, file_roots=["/workspace/out"], **_opts(api, live_url)) as sb:
        assert sb.info.file_roots == ("/workspace/out",)
        assert (await sb.pause()).state == "paused"
        with pytest.raises(ConflictError):
            await sb.commands.run("true")
        assert (await sb.resume()).state == "running"
        assert (await sb.commands.run("echo back")).stdout == "back\n"
        await sb.files.make_dir("/workspace/out")
        await sb.files.write("/workspace/out/ok", b"1")
        with pytest.raises((InvalidRequestError, PermissionDeniedError)):
            await sb.files.write("/workspace/no", b"1")


async def test_the_sync_sdk_too(api: Api, live_url: str) -> None:
    def flow() -> None:  # in a thread: the server runs in this test's event loop
        with Sandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
            sb.files.write("f", b"\x00\x01")
            assert sb.files.stat("f").size == 2
            sb.files.rename("f", "g")
            sink = io.BytesIO()
            assert sb.files.read_into("g", sink) == 2 and sink.getvalue() == b"\x00\x01"
            archive = io.BytesIO()
            sb.files.read_archive("/workspace", archive)
            assert sb.files.write_archive("/tmp/restored", archive.getvalue()) >= 1
            assert sb.files.read("/tmp/restored/workspace/g") == b"\x00\x01"
            assert sb.pause().state == "paused" and sb.resume().state == "running"

    await asyncio.to_thread(flow)


async def test_metrics_come_within_a_second_or_two_of_create_in_both_sdks(api: Api, live_url: str) -> None:
    sampler = api.app.state.corral.sampler
    sampler.start()  # lifespan off: the service's sampler runs only when started
    try:
        started = datetime.now(UTC)
        async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
            created = time.monotonic()
            while not (samples := await sb.get_metrics(start=started, end=datetime.now(UTC))):
                assert time.monotonic() - created < 5, "no sample within 5 s of create"
                await asyncio.sleep(0.1)
            first = samples[0]
            assert isinstance(first, SandboxMetric) and first.timestamp.tzinfo is not None
            assert started.timestamp() - 1 <= first.timestamp.timestamp() <= time.time()
            assert first.cpus == 1.0 and first.memory_total == 512 * 2**20 and first.disk_total > first.disk_used > 0
            assert await sb.get_metrics(start=started - timedelta(hours=1), end=started - timedelta(minutes=30)) == []
            assert await sb.get_metrics(start=time.time() + 60) == []  # unix seconds too
            with pytest.raises(InvalidRequestError):
                await sb.get_metrics(start=time.time(), end=time.time() - 60)

            def flow() -> list[SandboxMetric]:  # in a thread: the server runs in this test's event loop
                same = Sandbox.connect(sb.id, **_opts(api, live_url))
                try:
                    return same.get_metrics()
                finally:
                    same.close()  # the sandbox stays: the async one above kills it

            assert (await asyncio.to_thread(flow))[0] == first
    finally:
        await sampler.close()


async def test_run_code_sessions_and_a_cpp_program(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
        assert (await sb.run_code("n = 20")).error is None
        ex = await sb.run_code("import matplotlib.pyplot as plt\nplt.plot(range(n))\nn * 2", timeout=120)
        assert ex.text == "40" and ex.error is None
        [png] = [r.png for r in ex.results if r.png is not None]
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        cpp = "#include <iostream>\nint main(){std::string s; std::cin >> s; std::cout << s.size() << '\\n';}"
        out = await sb.run_code(cpp, language="cpp", stdin="hello")
        assert out.stdout == "5\n" and out.error is None
        failed = await sb.run_code("raise ValueError('no')")
        assert failed.error is not None and failed.error.name == "ValueError" and failed.error.value == "no"


async def test_a_cells_output_past_max_output_keeps_head_and_tail_and_streams_every_byte(api: Api,
                                                                                          live_url: str) -> None:
    # The server keeps max_output bytes of each stream (3/4 head, 1/4 tail), whatever the cell prints; a stream's
    # callbacks still get every byte, and the default keeps 16 MiB of 40 MB.
    printer = ("import sys\nw = sys.stdout.buffer.write\nw(b'h' * 3000); w(b'm' * 10000); w(b't' * 1000)\n"
               "sys.stdout.flush(); sys.stderr.write('e' * 10)")
    async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
        ex = await sb.run_code(printer, max_output=4000)
        assert ex.truncated and ex.stdout_size == 14000 and ex.stdout_cut == 3000 and ex.stderr_cut is None
        assert ex.stdout_bytes == b"h" * 3000 + b"t" * 1000 and ex.stderr_bytes == b"e" * 10
        streamed: list[bytes] = []
        whole = await sb.run_code(printer, max_output=4000, on_stdout=streamed.append)
        assert b"".join(streamed) == b"h" * 3000 + b"m" * 10000 + b"t" * 1000 and not whole.truncated
        big = await sb.run_code("import sys\nfor _ in range(40): sys.stdout.buffer.write(b'x' * 1_000_000)",
                                timeout=120)
        assert big.truncated and big.stdout_size == 40_000_000 and len(big.stdout_bytes) == 16 * 2**20
        assert big.stdout_cut == 12 * 2**20 and big.error is None
        with pytest.raises(InvalidRequestError, match="max_output"):
            await sb.run_code("1", max_output=3)
