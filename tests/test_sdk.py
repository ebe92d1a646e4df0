"""The Python SDK against a fake Corral server: an in-memory implementation of docs/api.md behind an httpx
transport (MockTransport's design, but the handler sees the request body chunk by chunk as the client sent it, so
streamed uploads can be told apart from buffered ones)."""

from __future__ import annotations

import base64
import inspect
import io
import json
import os
import re
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

import corral
from corral import (
    AgentError,
    AsyncSandbox,
    AuthenticationError,
    CapacityError,
    CommandResult,
    ConflictError,
    CorralError,
    DiskFullError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    ReplicaUnavailableError,
    RuntimeUnavailableError,
    Sandbox,
    SandboxTimeoutError,
    ServerError,
    TemplateBuildError,
)
from corral._sdk import AsyncCommands, AsyncFiles, Commands, Files

KEY = "test-key"
URL = "http://corral.test:7770"
API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _doc_error_table() -> dict[str, int]:
    """The `code | status` table of docs/api.md, the contract both sides implement."""
    section = API_DOC.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for codes, status in re.findall(r"^\| ([a-z_, ]+) \| (\d{3})", section, re.M):
        for code in codes.split(","):
            table[code.strip()] = int(status)
    return table


DOC_ERRORS = _doc_error_table()
EXPECTED_CLASS: dict[str, type[CorralError]] = {
    "invalid_request": InvalidRequestError,
    "unauthenticated": AuthenticationError,
    "permission_denied": PermissionDeniedError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "sandbox_timeout": SandboxTimeoutError,
    "quota_exceeded": QuotaExceededError,
    "capacity_exceeded": CapacityError,
    "disk_full": DiskFullError,
    "server_error": ServerError,
    "template_build_failed": TemplateBuildError,
    "agent_error": AgentError,
    "runtime_unavailable": RuntimeUnavailableError,
    "replica_unavailable": ReplicaUnavailableError,
}

BINARY_OUT = b"a\x00b\xffc\n"
BINARY_ERR = b"\xfe\xfferr\x00"
STREAM_EVENTS: list[dict[str, Any]] = [
    {"event": "stdout", "data_b64": base64.b64encode(b"one\n").decode()},
    {"event": "stderr", "data_b64": base64.b64encode(b"warn\x00\xff").decode()},
    {"event": "stdout", "data_b64": base64.b64encode(b"\xff\x00two\n").decode()},
    {"event": "stdout", "data_b64": base64.b64encode(b"three\n").decode()},
    {"event": "exit", "exit_code": 0, "signal": None, "stdout_b64": base64.b64encode(b"tail").decode(),
     "stderr_b64": "", "duration": 0.5, "timed_out": False, "oom_killed": False, "killed": False,
     "truncated": False, "stdout_size": 18, "stderr_size": 6, "stdout_cut": 0, "stderr_cut": 0},
]


def _error(status: int, code: str, message: str, **details: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message, "details": details}})


class ChunkStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body sent in the given chunks, logging each one as it leaves the 'server'."""

    def __init__(self, chunks: list[bytes], log: list[tuple[str, Any]]) -> None:
        self.chunks = chunks
        self.log = log

    def __iter__(self):
        for i, chunk in enumerate(self.chunks):
            self.log.append(("sent", i))
            yield chunk

    async def __aiter__(self):
        for i, chunk in enumerate(self.chunks):
            self.log.append(("sent", i))
            yield chunk


def _ndjson(events: list[dict[str, Any]], size: int = 7) -> list[bytes]:
    """NDJSON cut into small chunks that split lines (and base64) in the middle."""
    raw = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    return [raw[i : i + size] for i in range(0, len(raw), size)]


class FakeCorral:
    """docs/api.md in memory: sandboxes, files, and canned command results."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.dirs: set[tuple[str, str]] = set()
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []
        self.upload_chunks: list[bytes] = []
        self.log: list[tuple[str, Any]] = []
        self.next_response: httpx.Response | None = None
        self.count = 0

    # the transport calls this with the request body as the chunks the client produced
    def handle(self, request: httpx.Request, chunks: list[bytes]) -> httpx.Response:
        self.requests.append(request)
        body = b"".join(chunks)
        self.bodies.append(body)
        if self.next_response is not None:
            response, self.next_response = self.next_response, None
            return response
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return _error(401, "unauthenticated", "missing or wrong API key")
        path, method = request.url.path, request.method
        params = request.url.params
        if path == "/v1/sandboxes" and method == "POST":
            return self.create(json.loads(body))
        if path == "/v1/sandboxes" and method == "GET":
            wanted = {k[len("metadata."):]: v for k, v in params.items() if k.startswith("metadata.")}
            found = [s for s in self.sandboxes.values() if all(s["metadata"].get(k) == v for k, v in wanted.items())]
            return httpx.Response(200, json={"sandboxes": found})
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)(/.*)?", path)
        if m is None:
            return _error(404, "not_found", f"no route {path}")
        sid, rest = m.group(1), m.group(2) or ""
        if sid not in self.sandboxes:
            return _error(404, "not_found", f"no sandbox {sid!r}")
        box = self.sandboxes[sid]
        if rest == "" and method == "GET":
            return httpx.Response(200, json=box)
        if rest == "" and method == "DELETE":
            del self.sandboxes[sid]
            return httpx.Response(204)
        if rest == "/timeout" and method == "POST":
            box["expires_at"] = f"+{json.loads(body)['timeout']}s"
            return httpx.Response(200, json=box)
        if rest == "/exec" and method == "POST":
            return self.exec(json.loads(body))
        if rest.startswith("/files"):
            return self.file_op(sid, rest, method, params, chunks)
        return _error(404, "not_found", f"no route {method} {path}")

    def create(self, spec: dict[str, Any]) -> httpx.Response:
        if spec["network"] != "none":
            return _error(400, "invalid_request", "network policies other than 'none' are not supported yet")
        self.count += 1
        sid = f"sb-{self.count}"
        self.sandboxes[sid] = {"id": sid, "state": "running", "template": spec["template"], "runtime": "runc",
                               "limits": spec["limits"], "created_at": "now", "expires_at": f"+{spec['timeout']}s",
                               "metadata": spec["metadata"]}
        return httpx.Response(201, json=self.sandboxes[sid])

    def exec(self, req: dict[str, Any]) -> httpx.Response:
        if req["stream"]:
            events = STREAM_EVENTS
            if req["cmd"] == "fail-mid-stream":
                events = [STREAM_EVENTS[0], {"event": "error", "error": {"code": "agent_error",
                                                                         "message": "agent went away"}}]
            return httpx.Response(200, headers={"content-type": "application/x-ndjson"},
                                  stream=ChunkStream(_ndjson(events), self.log))
        result: dict[str, Any] = {"exit_code": 0, "signal": None, "stdout_b64": "", "stderr_b64": "",
                                  "duration": 0.01, "timed_out": False, "oom_killed": False, "killed": False,
                                  "truncated": False, "stdout_size": 0, "stderr_size": 0, "stdout_cut": 0,
                                  "stderr_cut": 0}
        cmd = req["cmd"]
        if cmd == "binary":
            result |= {"exit_code": 3, "stdout_b64": base64.b64encode(BINARY_OUT).decode(),
                       "stderr_b64": base64.b64encode(BINARY_ERR).decode(), "stdout_size": len(BINARY_OUT),
                       "stderr_size": len(BINARY_ERR)}
        elif cmd == "cat":
            data = base64.b64decode(req["stdin_b64"] or "")
            result |= {"stdout_b64": base64.b64encode(data).decode(), "stdout_size": len(data)}
        elif cmd == "sleep 100":
            result |= {"exit_code": None, "signal": 9, "timed_out": True, "killed": True, "duration": req["timeout"]}
        elif cmd == "oom":
            result |= {"exit_code": 137, "signal": 9, "oom_killed": True, "killed": True}
        elif cmd == "flood":
            result |= {"truncated": True, "stdout_b64": base64.b64encode(b"kept").decode(),
                       "stdout_size": 10_000_000, "stdout_cut": 9_999_996}
        return httpx.Response(200, json=result)

    def file_op(self, sid: str, rest: str, method: str, params: Any, chunks: list[bytes]) -> httpx.Response:
        def norm(p: str) -> str:
            return p if p.startswith("/") else f"/workspace/{p}"

        if rest == "/files/mkdir":
            p = norm(json.loads(b"".join(chunks))["path"])
            created = (sid, p) not in self.dirs
            self.dirs.add((sid, p))
            return httpx.Response(200, json={"created": created})
        p = norm(params["path"])
        if rest == "/files" and method == "PUT":
            self.upload_chunks = chunks
            self.files[(sid, p)] = b"".join(chunks)
            return httpx.Response(200, json={"path": p, "size": len(self.files[(sid, p)])})
        if rest == "/files" and method == "GET":
            if (sid, p) not in self.files:
                return _error(404, "not_found", f"no file {p}")
            data = self.files[(sid, p)]
            return httpx.Response(200, stream=ChunkStream([data[i : i + 65536] for i in range(0, len(data), 65536)],
                                                          self.log))
        if rest == "/files" and method == "DELETE":
            if (sid, p) in self.dirs and any(k[1].startswith(p + "/") for k in self.files) and \
                    params.get("recursive") != "true":
                return _error(409, "conflict", "directory not empty")
            gone = [k for k in self.files if k[1] == p or k[1].startswith(p + "/")]
            if not gone and (sid, p) not in self.dirs:
                return _error(404, "not_found", f"no file {p}")
            for k in gone:
                del self.files[k]
            self.dirs.discard((sid, p))
            return httpx.Response(204)
        if rest == "/files/exists":
            return httpx.Response(200, json={"exists": (sid, p) in self.files or (sid, p) in self.dirs})
        if rest == "/files/list":
            entries = [{"name": k[1][len(p) + 1:], "path": k[1], "type": "file", "size": len(v), "mode": 0o644,
                        "mtime": 1.0} for k, v in self.files.items() if k[0] == sid and
                       k[1].rsplit("/", 1)[0] == p]
            entries += [{"name": d[len(p) + 1:], "path": d, "type": "dir", "size": 0, "mode": 0o755, "mtime": 1.0}
                        for s, d in self.dirs if s == sid and d.rsplit("/", 1)[0] == p]
            return httpx.Response(200, json={"entries": entries})
        return _error(404, "not_found", "no such file route")


class FakeTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """Like httpx.MockTransport, but it reads the request body chunk by chunk (logging each) instead of
    buffering it first, so a test can see whether the client streamed it."""

    def __init__(self, fake: FakeCorral) -> None:
        self.fake = fake

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        chunks = []
        for chunk in request.stream:  # type: ignore[union-attr]
            self.fake.log.append(("recv", len(chunk)))
            chunks.append(bytes(chunk))
        return self.fake.handle(request, chunks)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        chunks = []
        async for chunk in request.stream:  # type: ignore[union-attr]
            self.fake.log.append(("recv", len(chunk)))
            chunks.append(bytes(chunk))
        return self.fake.handle(request, chunks)


class LoggingFile(io.BytesIO):
    """A binary file that logs its reads into the fake's log."""

    def __init__(self, data: bytes, log: list[tuple[str, Any]]) -> None:
        super().__init__(data)
        self.log = log

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.log.append(("read", len(chunk)))
        return chunk


@pytest.fixture
def fake() -> FakeCorral:
    return FakeCorral()


@pytest.fixture
def opts(fake: FakeCorral) -> dict[str, Any]:
    # No retries here: these tests see each answer once; retries of 429/503 are tested on their own below.
    return {"api_key": KEY, "base_url": URL, "transport": FakeTransport(fake), "max_retries": 0}


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_URL", raising=False)
    monkeypatch.delenv("CORRAL_API_KEY", raising=False)


def _json(request: httpx.Request, fake: FakeCorral) -> Any:
    return json.loads(fake.bodies[fake.requests.index(request)])


# --- lifecycle ---------------------------------------------------------------------------------------------------


def test_create_sends_the_spec_and_context_manager_kills(fake, opts):
    with Sandbox.create(template="tiny", timeout=60, limits={"memory": "256M", "cpus": 1}, env={"A": "1"},
                        metadata={"task": "t1"}, **opts) as sb:
        assert sb.id == "sb-1" and sb.id in fake.sandboxes
        assert sb.info.template == "tiny" and sb.info.metadata == {"task": "t1"}
    sent = _json(fake.requests[0], fake)
    assert sent == {"template": "tiny", "timeout": 60, "network": "none", "limits": {"memory": "256M", "cpus": 1},
                    "env": {"A": "1"}, "metadata": {"task": "t1"}}
    assert fake.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert fake.sandboxes == {}
    assert (fake.requests[-1].method, fake.requests[-1].url.path) == ("DELETE", "/v1/sandboxes/sb-1")


def test_context_manager_kills_on_error_and_tolerates_an_explicit_kill(fake, opts):
    with pytest.raises(RuntimeError, match="boom"), Sandbox.create(**opts):
        raise RuntimeError("boom")
    assert fake.sandboxes == {}
    with Sandbox.create(**opts) as sb:
        sb.kill()
    assert fake.sandboxes == {}
    assert [r.method for r in fake.requests].count("DELETE") == 2  # no second DELETE after the explicit kill


def test_connect_list_set_timeout_kill(fake, opts):
    a = Sandbox.create(metadata={"team": "x"}, **opts)
    b = Sandbox.create(metadata={"team": "y"}, **opts)
    again = Sandbox.connect(a.id, **opts)
    assert again.id == a.id and again.info.metadata == {"team": "x"}
    assert sorted(s.id for s in Sandbox.list(**opts)) == [a.id, b.id]
    assert [s.id for s in Sandbox.list(metadata={"team": "y"}, **opts)] == [b.id]
    assert fake.requests[-1].url.params["metadata.team"] == "y"
    assert again.set_timeout(600).expires_at == "+600s"
    a.kill()
    assert a.id not in fake.sandboxes and b.id in fake.sandboxes
    with pytest.raises(NotFoundError, match="no sandbox"):
        Sandbox.connect(a.id, **opts)
    b.kill()
    again.close()


def test_environment_supplies_url_and_key(fake, monkeypatch):
    monkeypatch.setenv("CORRAL_URL", "http://from-env.test:9999/")
    monkeypatch.setenv("CORRAL_API_KEY", KEY)
    with Sandbox.create(transport=FakeTransport(fake)):
        pass
    assert str(fake.requests[0].url) == "http://from-env.test:9999/v1/sandboxes"
    assert fake.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_default_url_and_missing_key(fake):
    with pytest.raises(AuthenticationError, match="API key"):
        Sandbox.create(transport=FakeTransport(fake))
    assert str(fake.requests[0].url) == "http://127.0.0.1:7770/v1/sandboxes"
    assert "authorization" not in fake.requests[0].headers


def test_invalid_request_from_server_is_raised(fake, opts):
    with pytest.raises(InvalidRequestError, match="not supported yet"):
        Sandbox.create(network=["example.org"], **opts)
    assert _json(fake.requests[0], fake)["network"] == ["example.org"]


# --- commands ----------------------------------------------------------------------------------------------------


def test_run_keeps_exact_bytes_and_gives_a_replacing_str_view(fake, opts):
    with Sandbox.create(**opts) as sb:
        r = sb.commands.run("binary")
    assert isinstance(r, CommandResult)
    assert r.exit_code == 3  # a failing command is a result, not an exception
    assert r.stdout_bytes == BINARY_OUT and r.stderr_bytes == BINARY_ERR
    assert r.stdout == "a\x00b\ufffdc\n" and r.stderr == "\ufffd\ufffderr\x00"
    assert (r.stdout_size, r.stderr_size) == (len(BINARY_OUT), len(BINARY_ERR))
    assert not (r.timed_out or r.oom_killed or r.truncated)


def test_run_sends_cmd_options_and_stdin_bytes_as_exact_base64(fake, opts):
    data = b"\xff" + bytes(range(256)) + b"\x00\x00"
    with Sandbox.create(**opts) as sb:
        r = sb.commands.run("cat", timeout=5, cwd="/tmp", env={"X": "y"}, stdin=data)
        sent = _json(fake.requests[-1], fake)
        r_text = sb.commands.run("cat", stdin="héllo")
        sent_text = _json(fake.requests[-1], fake)
        sb.commands.run(["ls", "-l"])
        sent_argv = _json(fake.requests[-1], fake)
    assert sent["stdin_b64"] == base64.b64encode(data).decode()
    assert sent | {"stdin_b64": None} == {"cmd": "cat", "cwd": "/tmp", "env": {"X": "y"}, "timeout": 5,
                                          "stdin_b64": None, "stream": False}
    assert r.stdout_bytes == data
    assert sent_text["stdin_b64"] == base64.b64encode("héllo".encode()).decode() and r_text.stdout == "héllo"
    assert sent_argv["cmd"] == ["ls", "-l"] and sent_argv["stdin_b64"] is None and sent_argv["timeout"] == 30


def test_timeout_oom_and_truncation_are_mapped(fake, opts):
    with Sandbox.create(**opts) as sb:
        slow = sb.commands.run("sleep 100", timeout=2)
        oom = sb.commands.run("oom")
        flood = sb.commands.run("flood")
    assert slow.timed_out and slow.killed and slow.exit_code is None and slow.signal == 9 and not slow.oom_killed
    assert slow.duration == 2
    assert oom.oom_killed and oom.exit_code == 137 and not oom.timed_out
    assert flood.truncated and flood.stdout_bytes == b"kept" and flood.stdout_size == 10_000_000
    assert flood.stdout_cut == 9_999_996


def test_exec_http_timeout_outlasts_the_command(fake, opts):
    with Sandbox.create(request_timeout=10, **opts) as sb:
        sb.commands.run("sleep 100", timeout=100)
        timeouts = fake.requests[-1].extensions["timeout"]
    assert timeouts["read"] == 110 and timeouts["connect"] == 10


def test_streaming_callbacks_get_chunks_in_order_as_they_arrive(fake, opts):
    seen: list[tuple[str, bytes]] = []

    def on_stdout(data: bytes) -> None:
        seen.append(("stdout", data))
        fake.log.append(("cb", data))

    def on_stderr(data: bytes) -> None:
        seen.append(("stderr", data))
        fake.log.append(("cb", data))

    with Sandbox.create(**opts) as sb:
        r = sb.commands.run("make", on_stdout=on_stdout, on_stderr=on_stderr)
        assert _json(fake.requests[-1], fake)["stream"] is True
    assert seen == [("stdout", b"one\n"), ("stderr", b"warn\x00\xff"), ("stdout", b"\xff\x00two\n"),
                    ("stdout", b"three\n"), ("stdout", b"tail")]
    assert r.stdout_bytes == b"one\n\xff\x00two\nthree\ntail" and r.stderr_bytes == b"warn\x00\xff"
    assert r.exit_code == 0 and r.duration == 0.5
    # the first callback ran before the server had sent its last chunk: output is delivered as it arrives
    sent = [i for kind, i in fake.log if kind == "sent"]
    first_cb = next(n for n, (kind, _) in enumerate(fake.log) if kind == "cb")
    assert fake.log.index(("sent", max(sent))) > first_cb


def test_only_one_callback_still_collects_both_streams(fake, opts):
    got: list[bytes] = []
    with Sandbox.create(**opts) as sb:
        r = sb.commands.run("make", on_stderr=got.append)
    assert got == [b"warn\x00\xff"] and r.stdout == "one\n\ufffd\x00two\nthree\ntail"


def test_error_after_the_stream_began_raises_the_mapped_error(fake, opts):
    got: list[bytes] = []
    with Sandbox.create(**opts) as sb, pytest.raises(AgentError, match="agent went away"):
        sb.commands.run("fail-mid-stream", on_stdout=got.append)
    assert got == [b"one\n"]


def test_stream_cut_before_exit_is_a_server_error(fake, opts):
    with Sandbox.create(**opts) as sb:
        fake.next_response = httpx.Response(200, stream=ChunkStream(_ndjson(STREAM_EVENTS[:2]), fake.log))
        with pytest.raises(ServerError, match="exit event"):
            sb.commands.run("make", on_stdout=lambda _: None)


# --- files -------------------------------------------------------------------------------------------------------


def test_files_round_trip_one_mib_of_random_bytes(fake, opts):
    data = os.urandom(1 << 20) + b"\x00"
    with Sandbox.create(**opts) as sb:
        entry = sb.files.write("/workspace/a.bin", data)
        back = sb.files.read("/workspace/a.bin")
        put = next(r for r in fake.requests if r.method == "PUT")
    assert back == data and entry.size == len(data) and entry.path == "/workspace/a.bin" and not entry.is_dir
    assert put.headers["content-type"] == "application/octet-stream"
    assert put.url.params["path"] == "/workspace/a.bin"
    assert fake.files[("sb-1", "/workspace/a.bin")] == data


def test_file_object_upload_is_streamed_in_chunks(fake, opts):
    data = os.urandom(3 << 20)
    f = LoggingFile(data, fake.log)
    with Sandbox.create(**opts) as sb:
        sb.files.write("big.bin", f)
        put = next(r for r in fake.requests if r.method == "PUT")
    assert fake.files[("sb-1", "/workspace/big.bin")] == data
    assert len(fake.upload_chunks) > 1 and max(map(len, fake.upload_chunks)) < len(data)
    assert "content-length" not in put.headers and put.headers["transfer-encoding"] == "chunked"
    # the server had the first chunk before the file was read to its end: never fully buffered
    reads = [n for n, (kind, _) in enumerate(fake.log) if kind == "read"]
    first_recv = next(n for n, (kind, _) in enumerate(fake.log) if kind == "recv")
    assert first_recv < reads[-1]


def test_write_str_and_read_text(fake, opts):
    with Sandbox.create(**opts) as sb:
        sb.files.write("t.txt", "héllo\n")
        sb.files.write("bad.txt", b"ok\xff")
        assert sb.files.read("t.txt") == "héllo\n".encode()
        assert sb.files.read_text("t.txt") == "héllo\n"
        assert sb.files.read_text("bad.txt") == "ok\ufffd"
        with pytest.raises(TypeError, match="binary"):
            sb.files.write("x", io.StringIO("text"))  # type: ignore[arg-type]


def test_list_exists_make_dir_remove(fake, opts):
    with Sandbox.create(**opts) as sb:
        assert sb.files.make_dir("/workspace/d") is True
        assert sb.files.make_dir("/workspace/d") is False
        sb.files.write("/workspace/d/x.bin", b"12345")
        sb.files.write("/workspace/top.txt", b"t")
        entries = {e.name: e for e in sb.files.list("/workspace")}
        assert set(entries) == {"d", "top.txt"}
        assert entries["d"].is_dir and entries["d"].type == "dir" and entries["d"].path == "/workspace/d"
        assert not entries["top.txt"].is_dir and entries["top.txt"].size == 1 and entries["top.txt"].mode == 0o644
        assert sb.files.exists("/workspace/d/x.bin") and not sb.files.exists("/workspace/nope")
        with pytest.raises(ConflictError):
            sb.files.remove("/workspace/d")
        sb.files.remove("/workspace/d", recursive=True)
        assert fake.requests[-1].url.params["recursive"] == "true"
        assert not sb.files.exists("/workspace/d/x.bin")
        with pytest.raises(NotFoundError, match="no file"):
            sb.files.read("/workspace/d/x.bin")


# --- errors ------------------------------------------------------------------------------------------------------


def test_the_doc_error_table_is_fully_covered():
    assert set(DOC_ERRORS) == set(EXPECTED_CLASS)
    assert len(DOC_ERRORS) == 14


@pytest.mark.parametrize(("code", "status"), sorted(DOC_ERRORS.items()))
def test_every_error_code_maps_to_its_class(fake, opts, code, status):
    fake.next_response = _error(status, code, f"because {code}", hint="h")
    with pytest.raises(CorralError) as info:
        Sandbox.create(**opts)
    assert type(info.value) is EXPECTED_CLASS[code]
    assert info.value.message == f"because {code}"
    assert info.value.details["hint"] == "h" and info.value.details["status"] == status


@pytest.mark.parametrize("status", sorted(set(DOC_ERRORS.values())))
def test_status_alone_maps_through_the_table(fake, opts, status):
    first_code = next(c for c, s in DOC_ERRORS.items() if s == status)  # the doc lists server_error first for 500
    fake.next_response = httpx.Response(status, content=b"<html>proxy says no</html>")
    with pytest.raises(CorralError) as info:
        Sandbox.create(**opts)
    assert type(info.value) is EXPECTED_CLASS[first_code]
    assert f"HTTP {status}" in info.value.message and "proxy says no" in info.value.message


def test_the_body_code_wins_over_the_status(fake, opts):
    fake.next_response = _error(400, "conflict", "paused")
    with pytest.raises(ConflictError):
        Sandbox.create(**opts)


def test_unknown_code_and_unknown_status_are_server_errors(fake, opts):
    fake.next_response = _error(418, "frobnicated", "teapot")
    with pytest.raises(ServerError) as info:
        Sandbox.create(**opts)
    assert type(info.value) is ServerError and "frobnicated" in info.value.message
    fake.next_response = httpx.Response(418)
    with pytest.raises(ServerError) as info:
        Sandbox.create(**opts)
    assert type(info.value) is ServerError and "HTTP 418" in info.value.message


def test_retry_after_is_kept(fake, opts):
    fake.next_response = httpx.Response(429, headers={"Retry-After": "7"},
                                        json={"error": {"code": "quota_exceeded", "message": "full"}})
    with pytest.raises(QuotaExceededError) as info:
        Sandbox.create(**opts)
    assert info.value.details["retry_after"] == "7"


def test_malformed_success_body_is_a_server_error(fake, opts):
    fake.next_response = httpx.Response(201, content=b"not json")
    with pytest.raises(ServerError, match="malformed"):
        Sandbox.create(**opts)


def test_metrics_send_unix_seconds_and_refuse_malformed_samples(fake, opts):
    sb = Sandbox.create(**opts)
    sample = {"timestamp": "2027-01-15T08:00:05+00:00", "cpus": 0.5, "cpu_used_pct": 12.5, "memory_used": 3,
              "memory_total": 4, "memory_cache": 1, "disk_used": 5, "disk_total": 6}
    fake.next_response = httpx.Response(200, json={"metrics": [sample]})
    start = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)
    [got] = sb.get_metrics(start=start, end=start.timestamp() + 60.5)
    assert dict(fake.requests[-1].url.params) == {"start": str(start.timestamp()), "end": str(start.timestamp() + 60.5)}
    assert got == corral.SandboxMetric(timestamp=start.replace(second=5), cpus=0.5, cpu_used_pct=12.5, memory_used=3,
                                       memory_total=4, memory_cache=1, disk_used=5, disk_total=6)
    malformed: list[Any] = [{"metrics": [{**sample, "cpus": None}]}, {"metrics": [{"timestamp": "soon"}]},
                            {"metrics": 3}, []]
    for body in malformed:
        fake.next_response = httpx.Response(200, json=body)
        with pytest.raises(ServerError, match="malformed"):
            sb.get_metrics()
    fake.next_response = httpx.Response(200, json={"metrics": []})
    sb.get_metrics()
    assert "start" not in fake.requests[-1].url.params  # nothing asked: every sample kept


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_connection_refused_is_a_clear_corral_error():
    port = _closed_port()
    with pytest.raises(CorralError) as info:
        Sandbox.create(api_key=KEY, base_url=f"http://127.0.0.1:{port}")
    assert isinstance(info.value, ServerError)
    assert f"cannot connect to Corral at http://127.0.0.1:{port}" in info.value.message
    assert isinstance(info.value.__cause__, httpx.ConnectError)


@pytest.mark.anyio
async def test_async_connection_refused_is_a_clear_corral_error():
    port = _closed_port()
    with pytest.raises(ServerError, match="cannot connect to Corral") as info:
        await AsyncSandbox.list(api_key=KEY, base_url=f"http://127.0.0.1:{port}")
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_transport_timeout_is_a_server_error(opts):
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(ServerError, match="timed out talking to Corral"):
        Sandbox.create(api_key=KEY, base_url=URL, transport=httpx.MockTransport(handler))


# --- async -------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_lifecycle_commands_and_files(fake, opts):
    seen: list[bytes] = []

    async def on_stdout(data: bytes) -> None:
        seen.append(data)

    data = os.urandom(1 << 20)
    async with await AsyncSandbox.create(metadata={"k": "v"}, **opts) as sb:
        assert [s.id for s in await AsyncSandbox.list(metadata={"k": "v"}, **opts)] == [sb.id]
        other = await AsyncSandbox.connect(sb.id, **opts)
        assert (await other.set_timeout(99)).expires_at == "+99s"
        await other.close()
        r = await sb.commands.run("binary")
        assert r.exit_code == 3 and r.stdout_bytes == BINARY_OUT and r.stdout == "a\x00b\ufffdc\n"
        r = await sb.commands.run("cat", stdin=b"\x00\xff")
        assert r.stdout_bytes == b"\x00\xff"
        streamed = await sb.commands.run("make", on_stdout=on_stdout, on_stderr=lambda _: None)
        assert seen == [b"one\n", b"\xff\x00two\n", b"three\n", b"tail"]
        assert streamed.stderr_bytes == b"warn\x00\xff"
        assert (await sb.commands.run("oom")).oom_killed
        await sb.files.write("a.bin", data)
        assert await sb.files.read("/workspace/a.bin") == data
        await sb.files.write("f.bin", LoggingFile(data, fake.log))
        assert len(fake.upload_chunks) > 1 and fake.files[("sb-1", "/workspace/f.bin")] == data
        assert await sb.files.read_text("a.bin") == data.decode("utf-8", errors="replace")
        assert await sb.files.make_dir("d") and await sb.files.exists("d")
        assert {e.name for e in await sb.files.list("/workspace")} == {"a.bin", "f.bin", "d"}
        await sb.files.remove("a.bin")
        assert not await sb.files.exists("a.bin")
        with pytest.raises(NotFoundError):
            await sb.files.read("a.bin")
    assert fake.sandboxes == {}


@pytest.mark.anyio
@pytest.mark.parametrize(("code", "status"), sorted(DOC_ERRORS.items()))
async def test_async_error_codes_map_too(fake, opts, code, status):
    fake.next_response = _error(status, code, "no")
    with pytest.raises(CorralError) as info:
        await AsyncSandbox.create(**opts)
    assert type(info.value) is EXPECTED_CLASS[code]


# --- surface -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sync_cls", "async_cls"), [(Sandbox, AsyncSandbox), (Commands, AsyncCommands),
                                                     (Files, AsyncFiles)])
def test_sync_and_async_have_the_same_signatures(sync_cls, async_cls):
    sync = {n: m for n, m in vars(sync_cls).items() if not n.startswith("_")}
    asyn = {n: m for n, m in vars(async_cls).items() if not n.startswith("_")}
    assert set(sync) == set(asyn) and sync
    for name, member in sync.items():
        other = asyn[name]
        if isinstance(member, property):
            assert isinstance(other, property), name
            continue
        f, g = (m.__func__ if isinstance(m, classmethod) else m for m in (member, other))
        assert isinstance(member, classmethod) == isinstance(other, classmethod), name
        assert inspect.iscoroutinefunction(g) and not inspect.iscoroutinefunction(f), name
        ps, pa = inspect.signature(f).parameters, inspect.signature(g).parameters
        assert [(p.name, p.kind, p.default) for p in ps.values()] == \
            [(p.name, p.kind, p.default) for p in pa.values()], name
    if sync_cls is Sandbox:
        assert hasattr(Sandbox, "__enter__") and hasattr(AsyncSandbox, "__aenter__")


def test_design_surface_is_there():
    for name in ("Sandbox", "AsyncSandbox", "CommandResult", "Entry", "SandboxInfo"):
        assert name in corral.__all__
    assert corral.__all__ == sorted(corral.__all__)
    create = inspect.signature(Sandbox.create).parameters
    assert {"template", "timeout", "network", "limits", "env", "metadata", "api_key", "base_url"} <= set(create)
    assert create["template"].default == "default" and create["timeout"].default == 300
    assert create["network"].default == "none"
    run = inspect.signature(Commands.run).parameters
    assert [*run][1:] == ["cmd", "timeout", "cwd", "env", "stdin", "on_stdout", "on_stderr", "background", "user"]
    assert run["timeout"].default == 30
    for method in ("write", "read", "read_text", "list", "remove", "exists", "make_dir"):
        assert callable(getattr(Files, method))
    for method in ("set_timeout", "kill", "connect", "list", "create"):
        assert callable(getattr(Sandbox, method))


# --- retries of 429 and 503 -------------------------------------------------------------------------------------


class Flaky(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """A transport that answers the first `failures` requests with `status` (and `Retry-After`), then delegates."""

    def __init__(self, inner: FakeTransport, failures: int, status: int, retry_after: str | None) -> None:
        self.inner, self.failures, self.status, self.retry_after = inner, failures, status, retry_after
        self.seen = 0

    def _failure(self) -> httpx.Response | None:
        self.seen += 1
        if self.seen > self.failures:
            return None
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
        code = {503: "capacity_exceeded", 429: "quota_exceeded"}.get(self.status, "server_error")
        return httpx.Response(self.status, headers=headers,
                              json={"error": {"code": code, "message": "full", "details": {}}})

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._failure() or self.inner.handle_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self._failure() or await self.inner.handle_async_request(request)


@pytest.mark.parametrize("status", [429, 503])
def test_429_and_503_are_retried_after_retry_after(fake, status):
    flaky = Flaky(FakeTransport(fake), failures=2, status=status, retry_after="0")
    sb = Sandbox.create(api_key=KEY, base_url=URL, transport=flaky)  # type: ignore[arg-type]
    assert flaky.seen == 3 and sb.id in fake.sandboxes


def test_retries_give_up_after_max_retries_with_the_servers_error(fake):
    flaky = Flaky(FakeTransport(fake), failures=5, status=503, retry_after="0")
    with pytest.raises(CapacityError) as info:
        Sandbox.create(api_key=KEY, base_url=URL, transport=flaky, max_retries=2)  # type: ignore[arg-type]
    assert flaky.seen == 3 and info.value.details["retry_after"] == "0"
    assert fake.sandboxes == {}


def test_a_long_retry_after_is_left_to_the_caller(fake):
    flaky = Flaky(FakeTransport(fake), failures=1, status=429, retry_after="120")
    with pytest.raises(QuotaExceededError) as info:
        Sandbox.create(api_key=KEY, base_url=URL, transport=flaky)  # type: ignore[arg-type]
    assert flaky.seen == 1 and info.value.details["retry_after"] == "120"


def test_a_quota_without_retry_after_is_not_retried_but_a_busy_machine_is(fake):
    flaky = Flaky(FakeTransport(fake), failures=1, status=429, retry_after=None)  # max_snapshots, say
    with pytest.raises(QuotaExceededError):
        Sandbox.create(api_key=KEY, base_url=URL, transport=flaky)  # type: ignore[arg-type]
    assert flaky.seen == 1
    flaky = Flaky(FakeTransport(fake), failures=1, status=503, retry_after=None)
    Sandbox.create(api_key=KEY, base_url=URL, transport=flaky).close()  # type: ignore[arg-type]
    assert flaky.seen == 2


def test_other_errors_and_streamed_bodies_are_not_retried(fake):
    flaky = Flaky(FakeTransport(fake), failures=1, status=500, retry_after="0")
    with pytest.raises(ServerError):
        Sandbox.create(api_key=KEY, base_url=URL, transport=flaky)  # type: ignore[arg-type]
    assert flaky.seen == 1
    sb = Sandbox.create(api_key=KEY, base_url=URL, transport=FakeTransport(fake))  # type: ignore[arg-type]
    sb._client._http._transport = flaky = Flaky(FakeTransport(fake), failures=1, status=503, retry_after="0")
    with pytest.raises(CapacityError):
        sb.files.write("/workspace/f", io.BytesIO(b"streamed once"))  # a file object cannot be sent twice
    assert flaky.seen == 1


@pytest.mark.anyio
async def test_async_retries_too(fake):
    flaky = Flaky(FakeTransport(fake), failures=1, status=503, retry_after="0")
    sb = await AsyncSandbox.create(api_key=KEY, base_url=URL, transport=flaky)
    assert flaky.seen == 2 and sb.id in fake.sandboxes
    await sb.close()


def test_a_path_with_a_lone_surrogate_is_refused_before_any_request(fake, opts):
    # Found by the eval corpus: such a path (undecodable bytes via os.fsdecode) escaped as a UnicodeEncodeError.
    from corral import InvalidRequestError

    with Sandbox.create(**opts) as sb:
        sent = len(fake.requests)
        bad = "/workspace/\udcff.txt"
        for call in (lambda: sb.files.write(bad, b"x"), lambda: sb.files.read(bad), lambda: sb.files.stat(bad),
                     lambda: sb.files.rename("/workspace/a", bad)):
            with pytest.raises(InvalidRequestError, match="lone surrogate"):
                call()
        assert len(fake.requests) == sent
