"""The E2B adapter's mapping, against a stand-in for the E2B SDK: non-zero exits, signals and timeouts become
outcomes, text output is what the corpus measures, errors keep their kind, egress refusals come back from the
command's error, and tasks needing what the target lacks are skipped. Against Corral's E2B API the adapter
uses what that API offers (network policies, live changes, pause and connect, contexts in /workspace).

The live tier at the end runs a seeded sample through the real E2B SDK against a real `corral serve`, beside
Corral's own SDK on the same sample."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from corral.eval import (
    Blob,
    Code,
    CodeError,
    CodeText,
    Data,
    Denied,
    E2BAdapter,
    Exec,
    ExitCode,
    Fails,
    Oom,
    Pause,
    Read,
    RunResults,
    SetNetwork,
    Setup,
    Stdout,
    Task,
    TimedOut,
    Truncated,
    Write,
    run_tasks,
)

from .conftest import ci_sampled

pytestmark = pytest.mark.anyio

DENIED = ("corral: Corral egress denied: pypi.org is not reachable, this sandbox has no network access (policy: "
          'none); allow it with network=["pypi.org"] (6 attempts)')


class SandboxException(Exception):
    pass


@dataclass
class CommandExitException(SandboxException):
    exit_code: int
    stdout: str
    stderr: str
    error: str | None


class TimeoutException(SandboxException):
    pass


class NotFoundException(SandboxException):
    pass


class InvalidArgumentException(SandboxException):
    pass


@dataclass
class FakeFiles:
    store: dict[str, bytes] = field(default_factory=dict)

    async def write(self, path: str, data: bytes) -> None:
        if not path.startswith("/"):
            raise InvalidArgumentException(f"{path!r} is relative")
        if path.startswith("/etc/"):
            raise SandboxException(f"403: {path}: Permission denied")
        self.store[path] = data

    async def read(self, path: str, format: str = "text") -> Any:
        if path not in self.store:
            raise NotFoundException(f"{path} not found")
        data = self.store[path]
        return bytearray(data) if format == "bytes" else data.decode("utf-8", "replace")


@dataclass
class Result:
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    error: str | None = None


class FakeHandle:
    """What `commands.run(background=True)` returns: output so far, and `wait()` for the end."""

    def __init__(self, cmd: str, cwd: str | None, stdin: bool) -> None:
        self.cmd, self.cwd, self.pid = cmd, cwd or "/home/user", 7
        self.stdin: bytearray | None = bytearray() if stdin else None
        self.stdin_closed = False
        self.stdout, self.stderr = "", ""

    async def wait(self) -> Result:
        cmd = self.cmd
        if cmd.startswith("sleep"):
            self.stdout = "partial\n"
            raise TimeoutException("context deadline exceeded")
        if cmd.startswith("exit "):
            code = int(cmd.split()[1])
            raise CommandExitException(code, "", "bye\n", f"exit status {code}")
        if cmd == "kill -9 $$":
            raise CommandExitException(-1, "", "", "signal: killed")
        if cmd == "hog":  # Corral's E2B API: the memory limit killed it, and its error says so
            raise CommandExitException(-1, "", "", "signal: killed; corral: out of memory: the sandbox's memory "
                                                   "limit was reached and the kernel killed the command")
        if cmd == "pip install x":
            raise CommandExitException(1, "", "ERROR: 403\n", f"exit status 1; {DENIED}")
        if cmd == "cat":
            assert self.stdin is not None and self.stdin_closed, "stdin was not sent and closed"
            return Result(stdout=bytes(self.stdin).decode("utf-8", "replace"))
        if cmd == "pwd":
            return Result(stdout=self.cwd + "\n")
        return Result(stdout=cmd.removeprefix("echo ").split(";")[0] + "\n")  # `echo x; exit 0` says x


@dataclass
class FakeCommands:
    handles: dict[int, FakeHandle] = field(default_factory=dict)

    async def run(self, cmd: str, background: bool = False, envs: Any = None, cwd: str | None = None,
                  stdin: bool = False, timeout: float = 60) -> Any:
        handle = FakeHandle(cmd, cwd, stdin)
        self.handles[handle.pid] = handle
        return handle if background else await handle.wait()

    async def send_stdin(self, pid: int, data: bytes) -> None:
        stdin = self.handles[pid].stdin
        assert stdin is not None, "the command was started without stdin"
        stdin += data

    async def close_stdin(self, pid: int) -> None:
        self.handles[pid].stdin_closed = True


@dataclass
class Context:
    id: str
    language: str
    cwd: str


class FakeSandbox:
    made: ClassVar[list[dict[str, Any]]] = []
    killed: ClassVar[list[str]] = []

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.files = FakeFiles()
        self.commands = FakeCommands()
        self.network: list[dict[str, Any]] = []
        self.contexts: list[Context] = []
        self.variables: dict[str, dict[str, str]] = {}
        self.paused = False

    @classmethod
    async def create(cls, **kwargs: Any) -> FakeSandbox:
        cls.made.append(kwargs)
        return cls(kwargs)

    async def update_network(self, network: dict[str, Any]) -> None:
        self.network.append(network)

    async def pause(self) -> bool:
        self.paused = True
        return True

    async def connect(self) -> FakeSandbox:
        assert self.paused, "connect resumes a paused sandbox"
        self.paused = False
        return self

    async def create_code_context(self, cwd: str | None = None, language: str | None = None) -> Context:
        context = Context(f"ctx-{len(self.contexts)}", language or "python", cwd or "/home/user")
        self.contexts.append(context)
        return context

    async def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                       timeout: float = 60) -> Any:
        assert not (language and context), "E2B takes a language or a context, not both"
        logs = types.SimpleNamespace(stdout=[], stderr=[])
        if code == "1/0":
            err = types.SimpleNamespace(name="ZeroDivisionError", value="division by zero")
            return types.SimpleNamespace(logs=logs, results=[], error=err)
        variables = self.variables.setdefault(context.id if context else language or "python", {})
        if "=" in code:
            name, value = (part.strip() for part in code.split("=", 1))
            variables[name] = value
            return types.SimpleNamespace(logs=logs, results=[], error=None)
        text = variables[code] if code in variables else str(eval(code))
        text = text[1:-1] if text[:1] == text[-1:] == "'" else text  # E2B shows a string without its quotes
        main = types.SimpleNamespace(is_main_result=True, text=text, png=None, extra={})
        return types.SimpleNamespace(logs=logs, results=[main], error=None)

    async def kill(self) -> None:
        FakeSandbox.killed.append("x")


@pytest.fixture
def fake_e2b(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("e2b_code_interpreter")
    module.AsyncSandbox = FakeSandbox  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", module)
    FakeSandbox.killed, FakeSandbox.made = [], []


def task(name: str, *steps: Any, **kwargs: Any) -> Task:
    return Task(f"e2b.x/{name}", "e2b.x", "file_io", name, tuple(steps), **kwargs)


def outcomes(run: Any) -> dict[str, tuple[str, str | None]]:
    return {r.id.split("/")[1]: (r.status, r.mode) for r in run.results}


CORRAL = "http://corral.test:7770"


async def test_steps_map_to_outcomes_and_text_transport_is_measured(fake_e2b: None) -> None:
    binary = Blob.literal(b"\xff\xfe\x00ok")
    tasks = [
        task("echo", Exec("echo hi", (Stdout(equals=b"hi\n"), ExitCode(0)))),
        task("exit", Exec("exit 3", (ExitCode(3), Stdout(equals=b"")))),
        task("signal", Exec("kill -9 $$", (ExitCode(137),))),  # E2B's "signal: killed", as a shell says it
        task("timeout", Exec("sleep 9", (TimedOut(), Stdout(equals=b"partial\n")), timeout=1)),
        task("stdin", Exec("cat", (Stdout(equals=binary, mode="stdin_lost"),), stdin=binary)),
        task("stdin-text", Exec("cat", (Stdout(equals=b"line\n"),), stdin=Blob.literal(b"line\n"))),
        task("files", Write("/home/user/b", binary), Read("/home/user/b", (Data(binary),))),
        task("missing", Read("/home/user/none", (Data(b""),))),
        task("refused", Write("/etc/x", Blob.literal("x"), (Fails(code="permission_denied"),))),
        task("code", Code("1+1", (CodeText(equals="2"),)), Code("1/0", (CodeError("ZeroDivisionError"),))),
        task("limits", Exec("true", (ExitCode(0),)), setup=Setup(limits={"memory": "64M"})),
    ]
    run = await run_tasks(tasks, E2BAdapter(api_key="test"), concurrency=4)
    assert outcomes(run) == {
        "echo": ("pass", None), "exit": ("pass", None), "signal": ("pass", None), "timeout": ("pass", None),
        "stdin": ("fail", "stdin_lost"),  # text transport replaced the invalid bytes: measured, not hidden
        "stdin-text": ("pass", None), "files": ("pass", None), "missing": ("fail", "sandbox_unavailable"),
        "refused": ("pass", None), "code": ("pass", None), "limits": ("skip", None),
    }
    missing = next(r for r in run.results if r.id.endswith("/missing"))
    assert "NotFoundException" in missing.failures[0].detail
    assert len(FakeSandbox.killed) == 10  # every sandbox opened was killed


async def test_e2b_cloud_claims_only_what_it_has_and_keeps_its_own_conventions(fake_e2b: None) -> None:
    tasks = [
        task("pwd", Exec("pwd", (Stdout(equals=b"/home/user\n"),))),
        task("policy", Exec("true"), setup=Setup(network=("pypi.org",))),
        task("pause", Pause()),
        task("cap", Exec("echo x", (Truncated(),))),
    ]
    run = await run_tasks(tasks, E2BAdapter(api_key="e2b_key", template="code-interpreter-v1"), concurrency=2)
    assert outcomes(run) == {"pwd": ("pass", None), "policy": ("skip", None), "pause": ("skip", None),
                             "cap": ("skip", None)}
    [made] = FakeSandbox.made
    assert made["template"] == "code-interpreter-v1" and made["allow_internet_access"] is False
    assert "api_url" not in made and made["api_key"] == "e2b_key"  # E2B_DOMAIN and its defaults decide


async def test_against_corral_the_adapter_uses_what_its_e2b_api_offers(fake_e2b: None) -> None:
    tasks = [
        task("pwd", Exec("pwd", (Stdout(equals=b"/workspace\n"),))),
        task("relative", Write("data.bin", Blob.literal("d")), Read("/workspace/data.bin", (Data(b"d"),))),
        task("allowlist", Exec("pip install x", (ExitCode(1), Denied("pypi.org"))),
             setup=Setup(network=("@packages", "127.0.0.1:8080"))),
        task("live", SetNetwork("none"), SetNetwork(("pypi.org",)), SetNetwork("internet"),
             setup=Setup(network="internet")),
        task("pause", Code("x = 'kept'"), Pause(), Code("x", (CodeText(equals="'kept'"),))),
        task("sessions", Code("x = 'one'", session="a"), Code("x = 'two'", session="b"),
             Code("x", (CodeText(equals="'one'"),), session="a")),
        task("cap", Exec("echo x", (Truncated(),))),
        task("oom", Exec("hog", (Oom(), ExitCode(137)))),
    ]
    run = await run_tasks(tasks, E2BAdapter(base_url=CORRAL, api_key="dev-key"), concurrency=1)
    assert outcomes(run) == {
        "pwd": ("pass", None), "relative": ("pass", None), "allowlist": ("pass", None), "live": ("pass", None),
        "pause": ("pass", None), "sessions": ("pass", None), "oom": ("pass", None),
        "cap": ("skip", None),  # E2B's protocol has no truncation flag
    }
    skipped = {r.id.split("/")[1]: r.skip_reason for r in run.results if r.status == "skip"}
    assert skipped == {"cap": "e2b lacks output_cap"}
    made = {m["metadata"]["eval"].split("/")[1]: m for m in FakeSandbox.made}
    for options in made.values():
        assert options["api_url"] == options["sandbox_url"] == CORRAL and options["validate_api_key"] is False
        assert options["api_key"] == "dev-key" and options["template"] == "default"
    assert made["pwd"]["allow_internet_access"] is False and made["live"]["allow_internet_access"] is True
    assert made["allowlist"]["network"] == {"allow_out": ["@packages", "127.0.0.1:8080"], "deny_out": ["0.0.0.0/0"]}


async def test_live_network_changes_and_contexts_reach_the_sdk(fake_e2b: None) -> None:
    adapter = E2BAdapter(base_url=CORRAL, api_key="dev-key")
    session = await adapter.open(task("x", Exec("true")))
    sandbox = session.sandbox
    for step in (SetNetwork("none"), SetNetwork(("pypi.org",)), SetNetwork("internet")):
        assert (await session.run(step)).error is None
    assert sandbox.network == [{"deny_out": ["0.0.0.0/0"]}, {"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]},
                               {}]
    for cell in (Code("1"), Code("2"), Code("4", language="bash"), Code("3", session="s")):
        assert (await session.run(cell)).error is None
    assert [(c.language, c.cwd) for c in sandbox.contexts] == [("python", "/workspace"), ("bash", "/workspace"),
                                                               ("python", "/workspace")]
    await session.close()


def test_the_cli_aims_e2b_at_its_cloud_without_a_url(fake_e2b: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from corral.cli import app

    monkeypatch.setenv("CORRAL_URL", "http://corral.test:1")  # a Corral's URL in the environment is not a target
    out = tmp_path / "r.jsonl"
    args = ["eval", "run", "--adapter", "e2b", "--task", "file_io.exit_codes/exit-0", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = RunResults.load(out)
    assert run.header["target"] == "e2b-cloud" and set(run.header["sdk"]) == {"e2b", "e2b-code-interpreter"}
    assert [r.status for r in run.results] == ["pass"] and "api_url" not in FakeSandbox.made[0]
    bad = CliRunner().invoke(app, ["eval", "run", "--adapter", "modal", "--task", "file_io.exit_codes/exit-0"])
    assert bad.exit_code == 2 and "corral or e2b" in bad.output


async def test_without_the_sdk_every_task_fails_setup_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)
    [r] = (await run_tasks([task("echo", Exec("echo hi", (ExitCode(0),)))], E2BAdapter())).results
    assert r.mode == "sandbox_unavailable" and "pip install e2b-code-interpreter" in r.failures[0].detail


# -- live: a seeded sample through E2B's SDK against a real `corral serve`, beside Corral's own SDK ------------

# 120 >= 107 families: every family is in it; under CI 40 (the sample runs twice, natively and through E2B's SDK,
# and the native side is test_eval_live's job in full).
LIVE_SAMPLE = ci_sampled("CORRAL_EVAL_E2B_SAMPLE", 120, 40)
LIVE_SEED = int(os.environ.get("CORRAL_EVAL_SEED", "20261130"))

# Why a task that Corral's own SDK passes may come out otherwise through E2B's SDK on Corral's E2B API
# (docs/eval-report/e2b/README.md says more): E2B's semantics, E2B's SDK, or what Corral's E2B API does not offer.
SKIPS = {"e2b lacks limits", "e2b lacks archive", "e2b lacks output_cap", "e2b lacks auto_checkpoints"}


@dataclass(frozen=True)
class Explained:
    why: str
    modes: frozenset[str]
    says: str = ""  # a regex the failure's detail matches
    family: str = ""  # the task's family starts with this

    def covers(self, r: Any) -> bool:
        detail = r.failures[0].detail if r.failures else ""
        return r.mode in self.modes and bool(re.search(self.says, detail)) and r.family.startswith(self.family)


EXPLAINED = (
    Explained("E2B's SDK decodes command and cell output as UTF-8 text, replacing invalid bytes",
              frozenset({"binary_corruption", "stdin_lost"}), says="decoded as UTF-8 text with replacement"),
    Explained("E2B sandboxes' file API serves every path the user can reach (envd's semantics: file roots '/')",
              frozenset({"path_traversal_accepted", "unclear_error"}), family="security.traversal"),
    Explained("the same, through a symlink", frozenset({"host_file_exposed"}), family="security.symlink"),
    Explained("a timed-out cell is the SDK's TimeoutException: what the kernel did then is not reported",
              frozenset({"code_error_misreported", "timeout_not_enforced"}),
              says="no error came back .*expected (KeyboardInterrupt|SessionKilled)"),
    Explained("E2B's sandboxes have root and sudo, as E2B's own do (docs/security.md)",
              frozenset({"privilege_escalation"}), says="sudo", family="security.setuid"),
    Explained("E2B's java and typescript cells are kernels (JShell, node), not compiled programs",
              frozenset({"code_error_misreported", "wrong_result"}), family="multi_language.polyglot"),
    Explained("E2B's SDK raises UnicodeEncodeError for a path with a lone surrogate, before any request",
              frozenset({"path_traversal_accepted"}), says="UnicodeEncodeError"),
)


def _cli_run(out: Path, *args: str) -> RunResults:
    proc = subprocess.run(
        [sys.executable, "-c", "from corral.cli import main; main()", "eval", "run", "--local", "--sample",
         str(LIVE_SAMPLE), "--seed", str(LIVE_SEED), "--out", str(out), *args],
        capture_output=True, text=True, timeout=1400,
    )
    assert out.exists(), proc.stderr[-3000:]
    run = RunResults.load(out)
    assert run.complete and len(run.results) == LIVE_SAMPLE, proc.stderr[-3000:]
    return run


@pytest.mark.runc
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_sample_through_e2bs_sdk_comes_out_as_through_corrals_own(tmp_path: Path) -> None:
    native = _cli_run(tmp_path / "native.jsonl")
    e2b = _cli_run(tmp_path / "e2b.jsonl", "--adapter", "e2b")
    assert e2b.header["adapter"] == "e2b" and e2b.header["sdk"]["e2b"], e2b.header
    ours_by_id = {r.id: r for r in native.results}  # results are written as tasks finish: in no fixed order
    assert sorted(ours_by_id) == sorted(r.id for r in e2b.results)
    assert [f"{r.id}: {r.mode}" for r in native.results if r.status == "fail"] == []
    unexplained = []
    for theirs in e2b.results:
        ours = ours_by_id[theirs.id]
        if theirs.status == ours.status or (ours.status == "skip" and "polyglot" in ours.skip_reason):
            continue
        if theirs.status == "skip" and theirs.skip_reason in SKIPS:
            continue
        if theirs.status == "fail" and any(e.covers(theirs) for e in EXPLAINED):
            continue
        detail = theirs.failures[0].detail[:300] if theirs.failures else theirs.skip_reason
        unexplained.append(f"{theirs.id}: native {ours.status}, e2b {theirs.status} {theirs.mode}: {detail}")
    assert unexplained == [], "\n".join(unexplained)
    passed = sum(r.status == "pass" for r in e2b.results)
    assert passed >= 0.8 * sum(r.status == "pass" for r in native.results)  # most of it, not a vacuous match
