"""The tools: each is a name, a description written for the model that calls it, its arguments' model (the JSON
schema it lists) and one function that calls one service method with the caller's principal and renders what
it returns. Authorization, audit, quotas and tenancy are the service's: a tool only shapes the call.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from typing import Any

import mcp_types as types

from .._exceptions import InvalidRequestError
from .._paths import SandboxPath, sandbox_path
from ..service import Cell, Command, CreateSandbox, current_request
from ._args import (
    CreateArgs,
    KillArgs,
    ListArgs,
    ListFilesArgs,
    ReadArgs,
    RunCodeArgs,
    RunCommandArgs,
    WriteArgs,
)
from ._call import CHANGES, DESTROYS, READ_ONLY, RUNS, Call, Tool
from ._checkpoints import CHECKPOINT_TOOLS
from ._results import (
    code_result,
    command_result,
    entries_result,
    result,
    sandbox_json,
    sandboxes_result,
    with_checkpoint,
)

__all__ = ["MAX_OUTPUT", "MAX_READ", "TOOLS", "Call", "Tool", "tool_named"]

MAX_READ = 8 * 2**20  # bytes read_file returns: a model cannot use more, and the answer is held in memory
# Bytes of each output stream a command keeps (the middle of more is left out, and said so): about 30k tokens,
# what a model can still read; a command with more output should write it to a file.
MAX_OUTPUT = 128 * 2**10


def _path(path: str) -> SandboxPath:
    """The one path check of every front end (the agent checks roots, `..` and symlinks): relative paths are under
    /workspace; a bad one is the tool's error."""
    return sandbox_path(path)


def _checkpoint_taken() -> str | None:
    """The automatic checkpoint the service took before this call's step (a sandbox with checkpoints "auto")."""
    request = current_request()
    return None if request is None else request.checkpoint


# -- sandboxes -----------------------------------------------------------------------------------------------


async def create_sandbox(call: Call, args: CreateArgs) -> types.CallToolResult:
    request = CreateSandbox(template=args.template, network=args.network, timeout=args.timeout,
                            checkpoints=args.checkpoints)  # None: the tenant's default
    record = await call.service.sandboxes.create(call.principal, request)
    created = sandbox_json(record)
    text = (f"Created sandbox {record.id} (template {record.template}, network {created['network']}); it lives "
            f"until {created['expires_at']}. Pass sandbox_id \"{record.id}\" to the other tools, and kill_sandbox "
            "it when done.")
    return result(text, created)


async def list_sandboxes(call: Call, args: ListArgs) -> types.CallToolResult:
    return sandboxes_result(await call.service.sandboxes.list(call.principal))


async def kill_sandbox(call: Call, args: KillArgs) -> types.CallToolResult:
    await call.service.sandboxes.kill(call.principal, args.sandbox_id)
    return result(f"Killed sandbox {args.sandbox_id}: its processes and files are gone.",
                  {"sandbox_id": args.sandbox_id, "killed": True})


# -- commands and code ---------------------------------------------------------------------------------------


async def run_command(call: Call, args: RunCommandArgs) -> types.CallToolResult:
    command = Command(args.command, cwd=None if args.cwd is None else _path(args.cwd), timeout=args.timeout,
                      max_output=MAX_OUTPUT)
    stream = await call.service.commands.stream(call.principal, args.sandbox_id, command)
    try:
        outcome = await stream.run(call.progress.stream("stdout"), call.progress.stream("stderr"))
    finally:
        await stream.close()
    return with_checkpoint(command_result(outcome, args.timeout), _checkpoint_taken())


async def run_code(call: Call, args: RunCodeArgs) -> types.CallToolResult:
    cell = Cell(args.code, language=args.language, timeout=args.timeout, max_output=MAX_OUTPUT)
    stream = await call.service.code.stream(call.principal, args.sandbox_id, cell)
    try:
        outcome = await stream.run(call.progress.stream("stdout"), call.progress.stream("stderr"))
    finally:
        await stream.close()
    return with_checkpoint(code_result(outcome), _checkpoint_taken())


# -- files ---------------------------------------------------------------------------------------------------


async def write_file(call: Call, args: WriteArgs) -> types.CallToolResult:
    data = _decode(args.content, args.encoding)
    path = _path(args.path)

    async def body() -> AsyncIterator[bytes]:
        yield data

    size = await call.service.files.write(call.principal, args.sandbox_id, path, body())
    return with_checkpoint(result(f"Wrote {size} bytes to {path}.", {"path": path, "size": size}),
                           _checkpoint_taken())


def _decode(content: str, encoding: str) -> bytes:
    try:
        return base64.b64decode(content, validate=True) if encoding == "base64" else content.encode("utf-8")
    except (binascii.Error, ValueError) as exc:  # UnicodeEncodeError (a lone surrogate) is a ValueError
        what = "valid base64" if encoding == "base64" else "encodable as UTF-8"
        raise InvalidRequestError(f"content is not {what} ({exc})", details={"encoding": encoding}) from None


async def read_file(call: Call, args: ReadArgs) -> types.CallToolResult:
    path = _path(args.path)
    data = await _read_whole(await call.service.files.read(call.principal, args.sandbox_id, path), path)
    if args.encoding == "base64":
        content = base64.b64encode(data).decode("ascii")
        return result(content, {"path": path, "size": len(data), "encoding": "base64", "content": content})
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{path} is not UTF-8 text (byte {exc.start} of {len(data)}): read it with "
                                  "encoding \"base64\" for its exact bytes", details={"path": path}) from None
    return result(text, {"path": path, "size": len(data), "encoding": "text", "content": text})


async def _read_whole(chunks: AsyncIterator[bytes], path: str) -> bytes:
    data = bytearray()
    try:
        async for chunk in chunks:
            data += chunk
            if len(data) > MAX_READ:
                raise InvalidRequestError(f"{path} is larger than {MAX_READ} bytes, more than one tool result "
                                          "should carry: read parts of it with run_command (head -c, tail -c, "
                                          "split)", details={"path": path, "limit": MAX_READ})
    finally:
        aclose = getattr(chunks, "aclose", None)  # ends the download (and its audit record) if we stopped early
        if aclose is not None:
            await aclose()
    return bytes(data)


async def list_files(call: Call, args: ListFilesArgs) -> types.CallToolResult:
    path = _path(args.path)
    found = await call.service.files.list(call.principal, args.sandbox_id, path, depth=args.depth)
    return entries_result(path, found)


# -- the table -----------------------------------------------------------------------------------------------

TOOLS: tuple[Tool[Any], ...] = (
    Tool("create_sandbox", "Create an isolated Linux sandbox (a fresh machine of its own: Debian, Python 3 with "
         "numpy/pandas/matplotlib/scikit-learn, Node.js, gcc) and return its sandbox_id. It has no network unless "
         "`network` allows it, and is destroyed after `timeout` seconds. Work in /workspace. With checkpoints "
         "\"auto\", every step you take can be undone with restore.",
         CreateArgs, create_sandbox, CHANGES),
    Tool("list_sandboxes", "List the sandboxes this API key's tenant has running, with their ids, templates and "
         "expiry times.", ListArgs, list_sandboxes, READ_ONLY),
    Tool("kill_sandbox", "Destroy a sandbox now, with its processes and files. Kill sandboxes you no longer "
         "need: they count against the tenant's quota until they expire.", KillArgs, kill_sandbox, DESTROYS),
    Tool("run_command", "Run a shell command in a sandbox and return its exit code, stdout and stderr (and "
         "whether it timed out or ran out of memory, and any network access the sandbox's policy refused). A "
         "non-zero exit code is a result, not an error. Output streams as progress while it runs.",
         RunCommandArgs, run_command, RUNS),
    Tool("run_code", "Run code in a sandbox like a notebook cell (Python by default; state persists between "
         "calls) and return its output, the cell's value, displayed results, matplotlib figures as PNG images, "
         "and the exception if it raised (name, value, traceback).", RunCodeArgs, run_code, RUNS),
    Tool("write_file", "Write a file in a sandbox (its parent directories are made), replacing it if it exists: "
         "UTF-8 text, or exact bytes given as base64 with encoding \"base64\".", WriteArgs, write_file, CHANGES),
    Tool("read_file", "Read a file from a sandbox: as UTF-8 text, or its exact bytes as base64 with encoding "
         "\"base64\" (use that for binary files: images, archives, anything not text).", ReadArgs, read_file,
         READ_ONLY),
    Tool("list_files", "List a directory in a sandbox (default /workspace): each entry's path, type (file, dir, "
         "symlink), size and permissions.", ListFilesArgs, list_files, READ_ONLY),
    *CHECKPOINT_TOOLS,
)
_BY_NAME = {tool.name: tool for tool in TOOLS}


def tool_named(name: str) -> Tool[Any]:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise InvalidRequestError(f"no tool {name[:64]!r}: the tools are {', '.join(_BY_NAME)}") from None
