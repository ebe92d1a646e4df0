"""The corpus against a real Corral: the seeded sample CI runs (every family, 100% expected), and faults
injected into a real transport, each caught and named by the mode it is."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.eval import (
    Blob,
    Data,
    Denied,
    Exec,
    ExitCode,
    Fails,
    Oom,
    Outcome,
    Read,
    RunResults,
    Setup,
    Stdout,
    Task,
    TimedOut,
    Write,
    load_corpus,
)
from corral.eval._deployment import local_capabilities, local_server, run_on_corral

pytestmark = [pytest.mark.runc, pytest.mark.slow]

# The sample CI runs: >= 150 tasks, every family (tests/test_eval_corpus.py checks the coverage).
CI_SAMPLE = int(os.environ.get("CORRAL_EVAL_SAMPLE", "150"))
CI_SEED = int(os.environ.get("CORRAL_EVAL_SEED", "20261130"))


@pytest.mark.timeout(1500)
def test_the_ci_sample_passes_every_task(tmp_path: Path) -> None:
    out = tmp_path / "sample.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", "from corral.cli import main; main()", "eval", "run", "--local",
         "--sample", str(CI_SAMPLE), "--seed", str(CI_SEED), "--out", str(out)],
        capture_output=True, text=True, timeout=1400,
    )
    run = RunResults.load(out)
    failed = [f"{r.id}: {r.mode}: {r.failures[0].detail}" for r in run.results if r.status == "fail"]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + "\n" + proc.stderr[-3000:]
    assert run.complete and len(run.results) >= 150
    assert {r.family for r in run.results} == {t.family for t in load_corpus()}
    skipped = [r for r in run.results if r.status == "skip"]
    assert all("polyglot" in r.skip_reason for r in skipped), [r.skip_reason for r in skipped]
    for name in ("report.md", "report.html", "report.json"):
        assert (out.with_suffix("") / name).stat().st_size > 0


# -- faults injected into a real transport are caught and named -------------------------------------------


NUL_BLOB = Blob.literal(b"head\x00" + bytes(range(256)) * 8)
BIN_BLOB = Blob.random(64 * 1024, seed=99)

FAULTS = {
    # fault name -> (task, what the fault does to the real outcome, the mode the report must name)
    "nul": Task("fault.nul/read", "fault.nul", "file_io", "download a file with a NUL byte",
                (Write("/workspace/n.bin", NUL_BLOB), Read("/workspace/n.bin", (Data(NUL_BLOB),)))),
    "text": Task("fault.text/cat", "fault.text", "file_io", "binary on stdout",
                 (Write("/workspace/b.bin", BIN_BLOB), Exec("cat /workspace/b.bin", (Stdout(equals=BIN_BLOB),)))),
    "timeout": Task("fault.timeout/sleep", "fault.timeout", "long_running", "a timeout",
                    (Exec("sleep 20", (TimedOut(within=8),), timeout=1),)),
    "denials": Task("fault.denials/pip", "fault.denials", "packages", "a refused download",
                    (Exec("curl -sS https://pypi.org/simple/ || true", (Denied("pypi.org"),)),)),
    "traversal": Task("fault.traversal/write", "fault.traversal", "security", "a traversal",
                      (Write("/etc/passwd", Blob.literal("x"),
                             (Fails(code=("invalid_request", "permission_denied")),)),)),
    "oom": Task("fault.oom/hog", "fault.oom", "resource_abuse", "a memory hog",
                (Exec("python3 -c 'b = bytearray(400 << 20)'", (Oom(),), timeout=20),),
                setup=Setup(limits={"memory": "128M"})),
    "exit": Task("fault.exit/3", "fault.exit", "file_io", "an exit code", (Exec("exit 3", (ExitCode(3),)),)),
}
EXPECTED = {"nul": "nul_truncation", "text": "binary_corruption", "timeout": "timeout_not_enforced",
            "denials": "unhelpful_network_error", "traversal": "path_traversal_accepted",
            "oom": "oom_not_reported", "exit": "wrong_exit_code"}


def inject(fault: str, o: Outcome) -> Outcome:
    """What a sloppy sandbox service does to an outcome."""
    if fault == "nul" and o.data is not None:
        return dataclasses.replace(o, data=o.data.split(b"\x00")[0])
    if fault == "text" and o.kind == "exec":
        return dataclasses.replace(o, stdout=o.stdout.decode("utf-8", "replace").encode())
    if fault == "timeout":
        return dataclasses.replace(o, timed_out=False, exit_code=-1)
    if fault == "denials":
        return dataclasses.replace(o, denials=())
    if fault == "traversal" and o.error is not None:
        return dataclasses.replace(o, error=None)
    if fault == "oom":
        return dataclasses.replace(o, oom_killed=False)
    if fault == "exit" and o.kind == "exec":
        return dataclasses.replace(o, exit_code=0 if o.exit_code else 1)
    return o


class FaultySession:
    def __init__(self, inner, fault: str) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.fault = inner, fault
        self.create_seconds = inner.create_seconds

    async def run(self, step):
        return inject(self.fault, await self.inner.run(step))

    async def close(self) -> None:
        await self.inner.close()


def test_faults_in_a_real_transport_are_caught_and_named() -> None:
    from corral.eval._corral import CorralAdapter

    class Faulty(CorralAdapter):
        async def open(self, task):
            fault = task.family.split(".")[1]
            return FaultySession(await super().open(task), fault)

    async def both(url: str, key: str) -> tuple[RunResults, RunResults]:
        tasks = list(FAULTS.values())
        clean = await run_on_corral(tasks, base_url=url, admin_key=key, capabilities=local_capabilities())
        faulty = await run_on_corral(tasks, base_url=url, admin_key=key, capabilities=local_capabilities(),
                                     adapter_type=Faulty)
        return clean, faulty

    with local_server() as (url, key):
        clean, faulty = asyncio.run(both(url, key))
    assert [(r.id, r.status, r.failures) for r in clean.results if r.status != "pass"] == []
    named = {r.family.split(".")[1]: r.mode for r in faulty.results}
    assert named == EXPECTED, json.dumps(
        [{"id": r.id, "mode": r.mode, "failures": [f.detail for f in r.failures]} for r in faulty.results], indent=1)
