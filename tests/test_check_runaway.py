"""Checklist item 46 (`corral check`) on a real server (runc), the probe failing when a result hides what was
stopped, and the notice of a reclaim on every front: the REST result through the SDK, the CLI's notice, MCP's
`run_command`. The agent's side with real fork bombs: tests/test_forkbomb.py; Docker: tests/test_docker_backend.py;
gVisor: tests/test_runsc.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from corral import CommandResult, ReclaimedTree, Sandbox
from corral.check import CheckOptions, Deployment, Target, run_check
from corral.check._limits import HOLDING_BOMB, RUNAWAY_PIDS, SATURATE, item_46_runaway_tree_does_not_lock
from corral.cli._exec import exit_code
from corral.engine import ExecResult
from corral.mcp._results import command_result
from corral.server import ServerProcess

from .test_check import FakeCorral, _context, _verdict, needs_store
from .test_check import server as server  # the fixture: a real `corral serve` (runc) in a temporary home
from .test_check_items import Tampering, _live, _probe, _replaced

TREE = ReclaimedTree(processes=120, id="7", command="f(){ f|f & }; f")


@pytest.mark.runc
@pytest.mark.timeout(300)
@needs_store
def test_item_46_passes_on_a_local_deployment(server: ServerProcess) -> None:
    target = Target(url=server.url, admin_key=server.admin_key, home=server.home)
    report = asyncio.run(run_check(target, CheckOptions(items=frozenset({46}))))
    [item] = report.items
    assert (item.number, item.status) == (46, "PASS"), item
    assert "the next command ran in" in item.detail and "of the bomb's processes were stopped" in item.detail
    assert report.exit_code == 0 and report.cleanup_problems == []


def _hide_reclaimed(request: httpx.Request, body: dict[str, Any], response: httpx.Response) -> httpx.Response:
    if not request.url.path.endswith("/exec") or response.status_code != 200:
        return response
    answer = json.loads(response.content)
    answer.pop("reclaimed", None)
    return _replaced(response, answer)


@pytest.mark.runc
@pytest.mark.anyio
@pytest.mark.timeout(300)
@needs_store
async def test_item_46_fails_when_the_result_does_not_say_what_was_stopped(server: ServerProcess) -> None:
    async with _live(server) as ctx:
        found = await _probe(ctx, item_46_runaway_tree_does_not_lock, Tampering(answer=_hide_reclaimed))
    assert found.status == "FAIL" and "does not say what was stopped" in found.detail, found


@pytest.mark.runc
@pytest.mark.timeout(300)
@needs_store
def test_the_sdk_result_names_the_stopped_tree(server: ServerProcess) -> None:
    with Sandbox.create(api_key=server.admin_key, base_url=server.url, limits={"pids": RUNAWAY_PIDS}) as sb:
        assert sb.commands.run(HOLDING_BOMB, timeout=60).stdout == "started\n"
        time.sleep(SATURATE)
        after = sb.commands.run("echo ok", timeout=30)
        assert (after.exit_code, after.stdout) == (0, "ok\n"), after
        [tree] = after.reclaimed
        assert tree.command == HOLDING_BOMB and tree.processes > 0 and tree.id, tree
        assert f"stopped {tree.processes} leftover processes of command {tree.id}" in after.notice
        assert sb.commands.run("echo again", timeout=30).reclaimed == ()  # told once


def test_the_cli_prints_what_was_stopped_as_a_notice(capsys: pytest.CaptureFixture[str]) -> None:
    result = CommandResult.from_wire({"exit_code": 0, "stdout_b64": "", "reclaimed": [TREE.to_wire()]})
    assert result.reclaimed == (TREE,)
    assert exit_code(result, None) == 0
    err = capsys.readouterr().err
    assert "corral: stopped 120 leftover processes of command 7 ('f(){ f|f & }; f'), which had ended" in err


def test_mcp_run_command_says_what_was_stopped() -> None:
    outcome = ExecResult(exit_code=0, stdout_bytes=b"ok\n", stderr_bytes=b"", reclaimed=(TREE,))
    answer = command_result(outcome, 30)
    assert answer.structured_content is not None
    assert answer.structured_content["reclaimed"] == [{"processes": 120, "id": "7", "command": "f(){ f|f & }; f"}]
    text = answer.content[0].text  # type: ignore[union-attr]
    assert "stopped 120 leftover processes of command 7" in text


def test_a_result_without_a_reclaim_has_no_notice_of_one() -> None:
    result = CommandResult.from_wire({"exit_code": 0, "reclaimed": [{"processes": 3}, "junk"]})
    assert result.reclaimed == (ReclaimedTree(processes=3),)
    assert "of no running command" in result.notice
    assert CommandResult.from_wire({"exit_code": 0}).notice == ""


@pytest.mark.anyio
async def test_item_46_is_not_applicable_on_kubernetes_and_says_why() -> None:
    # A Pod cannot be given a pids limit of its own (the kubelet's podPidsLimit is the node's): nothing to fill.
    found = await _verdict(item_46_runaway_tree_does_not_lock,
                           _context(FakeCorral(), Deployment(backend="kubernetes", runtimes=("runc",))))
    assert found.status == "N/A" and "podPidsLimit" in found.detail, found
