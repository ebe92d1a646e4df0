"""The evaluation's core without sandboxes: blobs, checks and their failure modes, selection, the runner's
budgets, skips and streaming, the loopback server. Fake adapters stand in for a sandbox service here; the corpus
against a real Corral is tests/test_eval_live.py."""

from __future__ import annotations

import asyncio
import io
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from corral.eval import (
    CAPABILITIES,
    MODES,
    Blob,
    CodeError,
    CodeText,
    Data,
    Denial,
    Denied,
    ErrorInfo,
    Exec,
    ExitCode,
    Fails,
    Ok,
    Oom,
    Outcome,
    Read,
    RichResult,
    RunResults,
    Setup,
    Stdout,
    Task,
    TimedOut,
    Truncated,
    Write,
    classify_bytes,
)
from corral.eval._adapter import SetupError
from corral.eval._loopback import LoopbackServer
from corral.eval._runner import evaluate, resolve, run_tasks
from corral.eval._select import select
from corral.eval.corpus import validate

pytestmark = pytest.mark.anyio


# -- blobs ---------------------------------------------------------------------------------------------


def test_blobs_are_deterministic_and_stream_the_same_bytes():
    b = Blob.random(3 * 1024 * 1024 + 17, seed=4)
    assert b.bytes() == Blob.random(3 * 1024 * 1024 + 17, seed=4).bytes()
    assert b.bytes() != Blob.random(3 * 1024 * 1024 + 17, seed=5).bytes()
    assert b"".join(b.chunks()) == b.bytes() and len(b.bytes()) == b.size
    assert Blob.all_bytes(2).bytes() == bytes(range(256)) * 2
    assert Blob.repeat(b"ab\x00", 7).bytes() == b"ab\x00ab\x00a"
    assert Blob.literal("é").bytes() == "é".encode()


# -- checks name the right failure mode ------------------------------------------------------------------


@pytest.mark.parametrize(("expected", "got", "mode"), [
    (b"abc\x00def", b"abc", "nul_truncation"),
    (b"abcdef", b"abc", "silent_output_truncation"),
    (b"a\nb\n", b"a\r\nb\r\n", "binary_corruption"),
    (b"\xff\xfeok", "\ufffd\ufffdok".encode(), "binary_corruption"),
    (bytes(range(256)), bytes(range(128)) + bytes(range(128, 256)).decode("latin-1").encode(), "binary_corruption"),
    (b"abcd", b"abce", "binary_corruption"),
])
def test_classify_bytes_tells_the_failures_apart(expected, got, mode):
    found = classify_bytes(expected, got)
    assert found is not None and found.mode == mode, found
    assert classify_bytes(expected, expected) is None


def test_classify_names_the_offset_of_the_nul():
    found = classify_bytes(b"x" * 10 + b"\x00" + b"y", b"x" * 10)
    assert found is not None and "offset 10" in found.detail


def test_checks_pass_and_fail_on_real_outcomes():
    ok = Outcome("exec", exit_code=0, stdout=b"42\n")
    assert ExitCode(0).verify(ok) is None
    assert ExitCode(1).verify(ok).mode == "wrong_exit_code"  # type: ignore[union-attr]
    assert Stdout(matches=r"^42$").verify(ok) is None
    assert Stdout(contains="43").verify(ok).mode == "wrong_result"  # type: ignore[union-attr]
    echoed = Stdout(equals=b"42\n\x00tail", mode="stdin_lost").verify(ok)
    assert echoed is not None and echoed.mode == "stdin_lost" and "NUL" in echoed.detail
    assert TimedOut(within=5).verify(Outcome("exec", duration=2, timed_out=True)) is None
    late = TimedOut(within=5).verify(Outcome("exec", duration=9, timed_out=True))
    assert late is not None and late.mode == "timeout_not_enforced" and "9.0 s" in late.detail
    assert Oom().verify(Outcome("exec", exit_code=137)).mode == "oom_not_reported"  # type: ignore[union-attr]
    assert Truncated(size=10).verify(Outcome("exec", truncated=True, stdout_size=10)) is None
    assert Truncated().verify(Outcome("exec", stdout=b"x")).mode == "silent_output_truncation"  # type: ignore[union-attr]
    refused = Outcome("exec", denials=(Denial("pypi.org", 443, "pypi.org is not allowed by policy none"),))
    assert Denied("pypi.org").verify(refused) is None
    bare = Denied("pypi.org").verify(Outcome("exec", denials=(Denial("pypi.org", 443, "403"),)))
    assert bare is not None and bare.mode == "unhelpful_network_error"
    assert CodeText(equals="2").verify(Outcome("code", text="2")) is None
    assert CodeText(equals="2").verify(Outcome("code", code_error=("NameError", "x"))) is not None
    assert CodeError("ZeroDivisionError").verify(Outcome("code", text="inf")).mode == "code_error_misreported"  # type: ignore[union-attr]
    assert RichResult("image/png").verify(Outcome("code", results=({"image/png": "iVBOR"},))) is None
    assert RichResult("image/png").verify(Outcome("code", results=({"text/plain": "<Figure>"},))) is not None


def test_fails_check_distinguishes_accepted_unclear_and_500():
    check = Fails(code="invalid_request", matches="outside", mode="path_traversal_accepted")
    assert check.verify(Outcome("write")).mode == "path_traversal_accepted"  # type: ignore[union-attr]
    assert check.verify(Outcome("write", error=ErrorInfo("invalid_request", "bad"))).mode == "unclear_error"  # type: ignore[union-attr]
    crash = check.verify(Outcome("write", error=ErrorInfo("server_error", "boom", 500)))
    assert crash is not None and crash.mode == "unstructured_error"
    assert check.verify(Outcome("write", error=ErrorInfo("invalid_request", "/etc is outside the roots"))) is None


def test_an_unexpected_error_fails_with_the_ok_checks_mode():
    err = Outcome("write", error=ErrorInfo("invalid_request", "no"))
    assert [f.mode for f in evaluate(Write("/workspace/é", Blob.literal("x"), (Ok("filename_mangled"),)), err)] \
        == ["filename_mangled"]
    assert [f.mode for f in evaluate(Write("/workspace/a", Blob.literal("x"), (Data(b"x"),)), err)] \
        == ["sandbox_unavailable"]
    five = Outcome("exec", error=ErrorInfo("server_error", "Internal Server Error", 500))
    assert [f.mode for f in evaluate(Exec("true", (ExitCode(0),)), five)] == ["unstructured_error"]


def test_every_mode_a_check_names_is_in_the_taxonomy_and_there_are_at_least_18():
    assert len(MODES) >= 18
    for m in MODES.values():
        assert m.severity in ("critical", "high", "medium", "low") and m.seen and m.title
    with pytest.raises(ValueError, match="unknown mode 'nope'"):
        validate([Task("f.x/1", "f.x", "file_io", "t", (Exec("true", (ExitCode(0, mode="nope"),)),))])


def test_validate_names_every_problem():
    bad = [
        Task("f.x/1", "f.x", "file_io", "t", (Exec("true", (ExitCode(0),)),)),
        Task("f.x/1", "f.x", "file_io", "t", (Exec("true", (ExitCode(0),)),)),
        Task("g/2", "f.x", "nonsense", "t", (Exec("true"),)),
    ]
    with pytest.raises(ValueError) as info:
        validate(bad)
    text = str(info.value)
    assert "duplicate id" in text and "must start with its family" in text and "unknown category" in text
    assert "no checks" in text


# -- selection and placeholders --------------------------------------------------------------------------


def _fake_corpus() -> list[Task]:
    return [Task(f"fam{f}.x/{i}", f"fam{f}.x", "file_io", "t", (Exec("true", (ExitCode(0),)),))
            for f in range(12) for i in range(20)]


def test_a_sample_covers_every_family_and_is_reproducible():
    corpus = _fake_corpus()
    a = select(corpus, sample=30, seed=7)
    assert len(a) == 30 and {t.family for t in a} == {t.family for t in corpus}
    assert [t.id for t in a] == [t.id for t in select(corpus, sample=30, seed=7)]
    assert [t.id for t in a] != [t.id for t in select(corpus, sample=30, seed=8)]
    assert [t.id for t in select(corpus, families=["fam3"])] == [f"fam3.x/{i}" for i in range(20)]


def test_server_placeholder_is_resolved_everywhere():
    t = Task("f.x/1", "f.x", "downloads", "t", (Exec("curl http://{server}/a", (ExitCode(0),)),),
             setup=Setup(network=("{server}",)))
    assert "loopback_server" in t.needs()
    r = resolve(t, "127.0.0.1:9")
    assert r.setup.network == ("127.0.0.1:9",) and r.steps[0].cmd == "curl http://127.0.0.1:9/a"  # type: ignore[union-attr]


def test_a_truncation_check_needs_an_output_cap():
    def needs(*steps: Exec) -> frozenset[str]:
        return Task("f.x/1", "f.x", "resource_abuse", "t", steps).needs()

    assert "output_cap" in needs(Exec("yes", (Truncated(),)))
    assert "output_cap" not in needs(Exec("yes", (ExitCode(0),)))


def test_a_bare_string_shows_its_repr_only_from_a_service_that_shows_strings_bare():
    assert CodeText(equals="'done'").verify(Outcome("code", text="done", text_unquoted=True)) is None
    assert CodeText(equals='"done"').verify(Outcome("code", text="done", text_unquoted=True)) is None
    assert CodeText(equals="'done'").verify(Outcome("code", text="done")) is not None  # Corral keeps the repr
    assert CodeText(equals="42").verify(Outcome("code", text="4", text_unquoted=True)) is not None
    assert CodeText(equals="'done'").verify(Outcome("code", text="'done'", text_unquoted=True)) is None


# -- the runner with fake adapters ----------------------------------------------------------------------


@dataclass
class FakeSession:
    behaviour: str
    closed: list[str] = field(default_factory=list)

    async def run(self, step):
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.behaviour == "raise":
            raise RuntimeError("adapter bug")
        if isinstance(step, Read):
            return Outcome("read", data=b"abc")  # a transport that stops at NUL bytes
        return Outcome("exec", exit_code=0, stdout=b"hi\n")

    async def close(self):
        self.closed.append("closed")


@dataclass
class FakeAdapter:
    behaviour: str = "ok"
    name: str = "fake"
    capabilities: frozenset[str] = frozenset(CAPABILITIES - {"polyglot"})
    sessions: list[FakeSession] = field(default_factory=list)

    async def open(self, task):
        if self.behaviour == "setup":
            raise SetupError(ErrorInfo("capacity_exceeded", "machine full", 503))
        s = FakeSession(self.behaviour)
        self.sessions.append(s)
        return s

    async def aclose(self):
        pass


def _tasks() -> list[Task]:
    return [
        Task("a.x/ok", "a.x", "file_io", "echo", (Exec("echo hi", (Stdout(equals=b"hi\n"),)),)),
        Task("a.x/nul", "a.x", "file_io", "nul", (Read("/workspace/f", (Data(b"abc\x00def"),)),), budget=2),
        Task("a.x/poly", "a.x", "multi_language", "java", (Exec("java", (ExitCode(0),)),),
             setup=Setup(template="polyglot")),
        Task("a.x/srv", "a.x", "downloads", "dl", (Exec("curl {server}", (ExitCode(0),)),)),
    ]


async def test_runner_streams_results_classifies_and_skips():
    out = io.StringIO()
    adapter = FakeAdapter()
    run = await run_tasks(_tasks(), adapter, concurrency=2, out=out, server=None)
    by_id = {r.id: r for r in run.results}
    assert by_id["a.x/ok"].status == "pass"
    assert by_id["a.x/nul"].status == "fail" and by_id["a.x/nul"].mode == "nul_truncation"
    assert by_id["a.x/poly"].status == "skip" and "polyglot" in by_id["a.x/poly"].skip_reason
    assert by_id["a.x/srv"].status == "skip" and "loopback_server" in by_id["a.x/srv"].skip_reason
    assert all(s.closed == ["closed"] for s in adapter.sessions)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["type"] == "run" and lines[-1]["type"] == "end"
    assert lines[-1]["counts"] == {"pass": 1, "fail": 1, "skip": 2}
    assert run.pass_rate() == 0.5


async def test_a_hung_step_is_a_hang_within_its_budget_and_the_sandbox_is_closed():
    adapter = FakeAdapter("hang")
    task = Task("h.x/1", "h.x", "long_running", "hang", (Exec("sleep", (ExitCode(0),)),), budget=0.5)
    run = await asyncio.wait_for(run_tasks([task], adapter), 10)
    [r] = run.results
    assert r.status == "fail" and r.mode == "hang" and "step 1 of 1" in r.failures[0].detail
    assert adapter.sessions[0].closed == ["closed"]


async def test_adapter_bugs_and_setup_errors_fail_the_task_not_the_run():
    [bug] = (await run_tasks(_tasks()[:1], FakeAdapter("raise"))).results
    assert bug.mode == "sandbox_unavailable" and "adapter bug" in bug.failures[0].detail
    [setup] = (await run_tasks(_tasks()[:1], FakeAdapter("setup"))).results
    assert setup.mode == "sandbox_unavailable" and "machine full" in setup.failures[0].detail


async def test_retries_are_off_by_default_and_counted_when_on():
    [r] = (await run_tasks(_tasks()[1:2], FakeAdapter())).results
    assert r.attempts == 1
    [r] = (await run_tasks(_tasks()[1:2], FakeAdapter(), retries=2)).results
    assert r.attempts == 3 and r.status == "fail"


async def test_results_file_round_trips(tmp_path):
    path = tmp_path / "r.jsonl"
    with open(path, "w") as f:
        run = await run_tasks(_tasks(), FakeAdapter(), out=f)
    back = RunResults.load(path)
    assert back.complete and back.header['adapter'] == 'fake'
    assert {r.id: r for r in back.results} == {r.id: r for r in run.results}
    path.write_text(path.read_text().rsplit("\n", 2)[0] + "\n")  # an interrupted run: no end line
    assert not RunResults.load(path).complete


# -- the loopback server ---------------------------------------------------------------------------------


def test_loopback_server_serves_blobs_ranges_and_refuses_the_rest():
    blob = Blob.random(2 * 1024 * 1024 + 3, seed=11)
    with LoopbackServer() as server:
        base = f"http://{server.address}"
        with urllib.request.urlopen(base + blob.url_path) as r:
            assert r.read() == blob.bytes() and r.headers["X-Blob-Sha256"] == blob.sha256
        req = urllib.request.Request(base + blob.url_path, headers={"Range": "bytes=1048570-1048580"})
        with urllib.request.urlopen(req) as r:
            assert r.status == 206 and r.read() == blob.bytes()[1048570:1048581]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/etc/passwd")
        assert info.value.code == 404
        info.value.close()


def test_docs_list_every_failure_mode():
    from pathlib import Path

    docs = (Path(__file__).parent.parent / "docs" / "eval.md").read_text()
    missing = [name for name in MODES if f"| `{name}` |" not in docs]
    assert missing == [], f"docs/eval.md lacks modes {missing}"


def test_tasks_start_round_robin_across_families_and_heavy_ones_are_known():
    from corral.eval._runner import interleave, is_heavy

    tasks = [Task(f"{f}.x/{i}", f"{f}.x", "file_io", "t", (Exec("true", (ExitCode(0),)),))
             for f in ("a", "b") for i in range(3)]
    assert [t.id for t in interleave(tasks)] == ["a.x/0", "b.x/0", "a.x/1", "b.x/1", "a.x/2", "b.x/2"]
    fit = Task("m.x/1", "m.x", "ml_training", "fit", (Exec("true", (ExitCode(0),)),))
    assert is_heavy(fit) and not is_heavy(tasks[0])


async def test_heavy_tasks_never_exceed_their_own_limit():
    running = {"now": 0, "max": 0}

    class Counting(FakeAdapter):
        async def open(self, task):
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
            await asyncio.sleep(0.02)
            running["now"] -= 1
            return await super().open(task)

    tasks = [Task(f"m.x/{i}", "m.x", "ml_training", "fit", (Exec("true", (ExitCode(0),)),)) for i in range(12)]
    run = await run_tasks(tasks, Counting(), concurrency=10, heavy_concurrency=3)
    assert running["max"] == 3 and run.counts()["pass"] == 12
