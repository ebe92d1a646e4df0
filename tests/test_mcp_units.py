"""The MCP front's pieces without a server: every error code becomes a tool error with a fix, every tool's
schema describes each argument for the model, and output becomes progress in order (docs/mcp.md)."""

from __future__ import annotations

import pytest

from corral._exceptions import _BY_CODE, PermissionDeniedError
from corral.mcp import TOOLS
from corral.mcp._errors import tool_error
from corral.mcp._progress import MAX_MESSAGE, Progress


@pytest.mark.parametrize("code", sorted(_BY_CODE))
def test_every_error_code_is_a_tool_error_that_says_what_to_do(code: str) -> None:
    result = tool_error(_BY_CODE[code]("it went wrong"))
    assert result.is_error
    text = result.content[0].text  # type: ignore[union-attr]
    assert text.startswith(f"{code}: it went wrong\nWhat to do: ") and len(text) > len(code) + 40
    assert result.structured_content == {"error": {"code": code, "message": "it went wrong", "details": {}}}


def test_a_roles_refusal_and_a_files_refusal_get_different_fixes() -> None:
    role = tool_error(PermissionDeniedError("role 'auditor' may not sandbox.exec", details={"role": "auditor"}))
    path = tool_error(PermissionDeniedError("/etc/passwd is outside the directories the file API may touch"))
    assert "developer's key" in role.content[0].text  # type: ignore[union-attr]
    assert "/workspace" in path.content[0].text and "key" not in path.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.name)
def test_each_tool_describes_itself_and_every_argument(tool) -> None:  # type: ignore[no-untyped-def]
    listed = tool.listing()
    assert listed.description and listed.annotations is not None
    schema = listed.input_schema
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    for name, field in schema.get("properties", {}).items():
        assert len(field.get("description", "")) > 15, (tool.name, name)


@pytest.mark.anyio
async def test_output_becomes_progress_in_order_with_split_characters_whole() -> None:
    sent: list[tuple[float, float | None, str | None]] = []

    async def report(progress: float, total: float | None, message: str | None) -> None:
        sent.append((progress, total, message))

    progress = Progress(report)
    stdout, stderr = progress.stream("stdout"), progress.stream("stderr")
    check = "✓".encode()
    await stdout(b"one " + check[:1])  # the mark's first byte only: held back until the rest comes
    await stdout(check[1:] + b"\n")
    await stderr(b"oops\n")
    await stdout(b"x" * (MAX_MESSAGE + 10))
    assert [(p, m) for p, _, m in sent[:3]] == [(5, "one "), (8, "✓\n"), (13, "[stderr] oops\n")]
    assert sent[3][0] == 13 + MAX_MESSAGE + 10 and sent[3][2] == "x" * MAX_MESSAGE
    assert all(total is None for _, total, _ in sent)
