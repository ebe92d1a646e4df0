"""What tools return: each result as text for the model (most clients show only that) and the same facts as
structured content (JSON) for programs; a code cell's figures as PNG image content.

Output is text here (invalid UTF-8 shown as U+FFFD): a model reads text. Exact bytes travel through read_file with
`encoding="base64"`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import mcp_types as types

from .._output import egress_notice, reclaim_notice
from ..control import SandboxRecord
from ..engine import CodeResult, Entry, ExecResult, RichResult

__all__ = ["code_result", "command_result", "entries_result", "result", "sandbox_json", "sandboxes_result",
           "with_checkpoint"]

_IMAGE_TYPES = ("image/png", "image/jpeg")  # what MCP clients show as images; the agent sends both as base64
_TEXT_TYPES = ("text/plain", "text/markdown", "application/json", "text/html")  # a rich result's text, best first


def result(text: str, structured: dict[str, Any], *images: types.ImageContent) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text), *images], structured_content=structured)


def with_checkpoint(done: types.CallToolResult, checkpoint: str | None) -> types.CallToolResult:
    """A step of a sandbox with automatic checkpoints: the id of the one taken before it, in both forms (the
    text says how to undo the step)."""
    if checkpoint is None or not isinstance(done.structured_content, dict):
        return done
    first = done.content[0]
    text = first.text if isinstance(first, types.TextContent) else ""
    note = f"[checkpoint {checkpoint} was taken before this: restore it to undo this step]"
    return types.CallToolResult(content=[types.TextContent(text=f"{text}\n{note}" if text else note),
                                         *done.content[1:]],
                                structured_content={**done.structured_content, "checkpoint": checkpoint})


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def sandbox_json(record: SandboxRecord) -> dict[str, Any]:
    network = record.spec.network
    return {"sandbox_id": record.id, "state": record.state.value, "template": record.template,
            "network": network if isinstance(network, str) else list(network),
            "created_at": _iso(record.created_at), "expires_at": _iso(record.expires_at),
            "metadata": record.metadata}


def sandboxes_result(records: list[SandboxRecord]) -> types.CallToolResult:
    found = [sandbox_json(r) for r in records]
    lines = [f"{s['sandbox_id']}  {s['state']}  template {s['template']}  expires {s['expires_at']}" for s in found]
    text = "\n".join(lines) if lines else "No sandboxes. Create one with create_sandbox."
    return result(text, {"sandboxes": found})


# -- commands ------------------------------------------------------------------------------------------------


def command_result(outcome: ExecResult, timeout: float) -> types.CallToolResult:
    denials = [{"host": d.host, "port": d.port, "reason": d.reason} for d in outcome.egress_denials]
    notice = egress_notice((d.host, d.port, d.reason) for d in outcome.egress_denials)
    structured = {"exit_code": outcome.exit_code, "stdout": outcome.stdout, "stderr": outcome.stderr,
                  "timed_out": outcome.timed_out, "oom_killed": outcome.oom_killed,
                  "truncated": outcome.truncated, "signal": outcome.signal, "duration": outcome.duration,
                  "stdout_size": outcome.stdout_size, "stderr_size": outcome.stderr_size,
                  "egress_denials": denials, "egress_notice": notice,
                  "reclaimed": [tree.to_wire() for tree in outcome.reclaimed]}
    return result(_command_text(outcome, timeout, notice), structured)


def _command_text(outcome: ExecResult, timeout: float, notice: str) -> str:
    parts = [_ending(outcome, timeout)]
    parts += _section("stdout", outcome.stdout) + _section("stderr", outcome.stderr)
    if outcome.truncated:
        parts.append(_truncation(outcome.stdout_size, outcome.stderr_size))
    if notice:
        parts.append("[network refused by the sandbox's egress policy (create the sandbox with network set to "
                     f"the domains it needs)]\n{notice.rstrip()}")
    if outcome.reclaimed:  # what an ended command left running was stopped so that this one could start
        parts.append(reclaim_notice(outcome.reclaimed).rstrip())
    return "\n".join(parts)


def _truncation(stdout_size: int, stderr_size: int) -> str:
    return (f"[output truncated: {stdout_size} bytes of stdout and {stderr_size} of stderr in all; the middle was "
            "left out. Write it to a file and read parts of it]")


def _ending(outcome: ExecResult, timeout: float) -> str:
    if outcome.timed_out:
        return (f"timed out after {timeout:g} s: the command was killed. Give it a larger timeout, or run it in "
                "the background (`nohup ... > log 2>&1 &`) and check the log later")
    if outcome.oom_killed:
        return "killed: the sandbox ran out of memory (OOM)"
    if outcome.exit_code is None:
        return f"killed by signal {outcome.signal}"
    return f"exit code {outcome.exit_code}"


def _section(name: str, text: str) -> list[str]:
    return [f"--- {name} ---", text.rstrip("\n")] if text else []


# -- code cells ----------------------------------------------------------------------------------------------


def code_result(outcome: CodeResult) -> types.CallToolResult:
    images = [image for rich in outcome.results for image in _images(rich)]
    rich = [_rich_json(r) for r in outcome.results]
    error = outcome.error
    structured = {"text": _main_text(outcome), "stdout": outcome.stdout, "stderr": outcome.stderr,
                  "results": rich, "images": len(images),
                  "error": None if error is None else {"name": error.name, "value": error.value,
                                                       "traceback": error.traceback},
                  "timed_out": outcome.timed_out, "oom_killed": outcome.oom_killed,
                  "session_restarted": outcome.session_restarted, "duration": outcome.duration,
                  "truncated": outcome.truncated}
    return result(_code_text(outcome, len(images)), structured, *images)


def _image_types(rich: RichResult) -> list[str]:
    return [mime for mime in _IMAGE_TYPES if mime in rich.data]


def _images(rich: RichResult) -> list[types.ImageContent]:
    return [types.ImageContent(data=rich.data[mime], mime_type=mime) for mime in _image_types(rich)]


def _text_of(rich: RichResult) -> str | None:
    return next((rich.data[mime] for mime in _TEXT_TYPES if mime in rich.data), None)


def _main_text(outcome: CodeResult) -> str | None:
    """The cell's value, as a notebook's `Out[n]` shows it."""
    return next((_text_of(r) for r in outcome.results if r.is_main_result), None)


def _rich_json(rich: RichResult) -> dict[str, Any]:
    """A displayed object's text forms (images go as image content, not twice)."""
    return {"is_main_result": rich.is_main_result,
            "data": {mime: value for mime, value in rich.data.items() if mime not in _IMAGE_TYPES},
            "image_types": _image_types(rich)}


def _code_text(outcome: CodeResult, images: int) -> str:
    parts = _section("stdout", outcome.stdout) + _section("stderr", outcome.stderr)
    # A figure's text/plain ("<Figure size 640x480 ...>") says nothing its image does not.
    shown = [t for r in outcome.results if not r.is_main_result and not _image_types(r) and
             (t := _text_of(r)) is not None]
    parts += [f"[display] {t}" for t in shown]
    if (main := _main_text(outcome)) is not None:
        parts.append(f"Out: {main}")
    if images:
        parts.append(f"[{images} image(s) attached]")
    if outcome.error is not None:
        parts.append(f"Error: {outcome.error.name}: {outcome.error.value}\n{outcome.error.traceback}".rstrip())
    if outcome.truncated:
        parts.append(_truncation(outcome.stdout_size, outcome.stderr_size))
    if outcome.timed_out:
        parts.append("[timed out: the cell was interrupted; give it a larger timeout]")
    if outcome.oom_killed or outcome.session_restarted:
        parts.append("[the session's process ended (out of memory?): its variables are gone]")
    return "\n".join(parts) if parts else "(no output)"


# -- files ---------------------------------------------------------------------------------------------------


def entries_result(path: str, entries: list[Entry]) -> types.CallToolResult:
    found = [{"name": e.name, "path": e.path, "type": e.type, "size": e.size, "permissions": e.permissions,
              "mtime": e.mtime} for e in entries]
    lines = [f"{e['permissions'] or e['type']:<11} {e['size']:>10}  {e['path']}" for e in found]
    text = "\n".join(lines) if lines else f"{path} is empty"
    return result(text, {"path": path, "entries": found})
