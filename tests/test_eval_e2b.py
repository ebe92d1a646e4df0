"""The E2B adapter's mapping, against a stand-in for the E2B SDK (the real service is not reachable from CI):
non-zero exits and timeouts become outcomes, text output is what the corpus measures, errors keep their kind,
and tasks needing what E2B lacks are skipped."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from corral.eval import (
    Blob,
    Code,
    CodeError,
    CodeText,
    Data,
    E2BAdapter,
    Exec,
    ExitCode,
    Read,
    Setup,
    Stdout,
    Task,
    TimedOut,
    Write,
    run_tasks,
)

pytestmark = pytest.mark.anyio


class CommandExitException(Exception):
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        super().__init__(f"exit {exit_code}")
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr


class TimeoutException(Exception):
    pass


class NotFoundException(Exception):
    pass


@dataclass
class FakeFiles:
    store: dict[str, bytes] = field(default_factory=dict)

    async def write(self, path: str, data: bytes) -> None:
        self.store[path] = data

    async def read(self, path: str, format: str = "text") -> Any:
        if path not in self.store:
            raise NotFoundException(f"{path} not found")
        data = self.store[path]
        return bytearray(data) if format == "bytes" else data.decode("utf-8", "replace")


@dataclass
class FakeCommands:
    files: FakeFiles

    async def run(self, cmd: str, timeout: float = 60, cwd: str | None = None, envs: Any = None) -> Any:
        if cmd.startswith("sleep"):
            raise TimeoutException("context deadline exceeded")
        if cmd.startswith("exit "):
            raise CommandExitException(int(cmd.split()[1]), "", "bye\n")
        if cmd.startswith("(cat) < "):
            data = self.files.store[cmd.split("< ")[1]]
            return types.SimpleNamespace(exit_code=0, stdout=data.decode("utf-8", "replace"), stderr="")
        return types.SimpleNamespace(exit_code=0, stdout=cmd.removeprefix("echo ") + "\n", stderr="")


class FakeSandbox:
    killed: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.files = FakeFiles()
        self.commands = FakeCommands(self.files)

    @classmethod
    async def create(cls, **kwargs: Any) -> FakeSandbox:
        return cls()

    async def run_code(self, code: str, language: str = "python", timeout: float = 60) -> Any:
        logs = types.SimpleNamespace(stdout=[], stderr=[])
        if code == "1/0":
            err = types.SimpleNamespace(name="ZeroDivisionError", value="division by zero")
            return types.SimpleNamespace(logs=logs, results=[], error=err)
        main = types.SimpleNamespace(is_main_result=True, text=str(eval(code)), png=None)
        return types.SimpleNamespace(logs=logs, results=[main], error=None)

    async def kill(self) -> None:
        FakeSandbox.killed.append("x")


@pytest.fixture
def fake_e2b(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("e2b_code_interpreter")
    module.AsyncSandbox = FakeSandbox  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", module)
    FakeSandbox.killed = []


def task(name: str, *steps: Any, **kwargs: Any) -> Task:
    return Task(f"e2b.x/{name}", "e2b.x", "file_io", name, tuple(steps), **kwargs)


async def test_steps_map_to_outcomes_and_text_transport_is_measured(fake_e2b: None) -> None:
    binary = Blob.literal(b"\xff\xfe\x00ok")
    tasks = [
        task("echo", Exec("echo hi", (Stdout(equals=b"hi\n"), ExitCode(0)))),
        task("exit", Exec("exit 3", (ExitCode(3),))),
        task("timeout", Exec("sleep 9", (TimedOut(),), timeout=1)),
        task("stdin", Exec("cat", (Stdout(equals=binary, mode="stdin_lost"),), stdin=binary)),
        task("files", Write("/home/user/b", binary), Read("/home/user/b", (Data(binary),))),
        task("missing", Read("/home/user/none", (Data(b""),))),
        task("code", Code("1+1", (CodeText(equals="2"),)), Code("1/0", (CodeError("ZeroDivisionError"),))),
        task("limits", Exec("true", (ExitCode(0),)), setup=Setup(limits={"memory": "64M"})),
    ]
    run = await run_tasks(tasks, E2BAdapter(api_key="test"), concurrency=4)
    got = {r.id.split("/")[1]: (r.status, r.mode) for r in run.results}
    assert got == {
        "echo": ("pass", None), "exit": ("pass", None), "timeout": ("pass", None),
        "stdin": ("fail", "stdin_lost"),  # text transport replaced the invalid bytes: measured, not hidden
        "files": ("pass", None), "missing": ("fail", "sandbox_unavailable"), "code": ("pass", None),
        "limits": ("skip", None),
    }
    missing = next(r for r in run.results if r.id.endswith("/missing"))
    assert "NotFoundException" in missing.failures[0].detail
    assert len(FakeSandbox.killed) == 7  # every sandbox opened was killed


async def test_without_the_sdk_every_task_fails_setup_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)
    [r] = (await run_tasks([task("echo", Exec("echo hi", (ExitCode(0),)))], E2BAdapter())).results
    assert r.mode == "sandbox_unavailable" and "pip install e2b-code-interpreter" in r.failures[0].detail
