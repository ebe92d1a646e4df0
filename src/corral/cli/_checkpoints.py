"""`corral sandbox checkpoint|checkpoints|restore|changes|delete-checkpoint`: undo in place (docs/lifecycle.md,
"Checkpoints"), one request of the REST API each (docs/api.md, "Checkpoints"); `--json` prints its answer as the
API gave it.

The commands are registered on `corral sandbox` by `_sandbox.py` (they act on one sandbox, like `snapshot`).
They do not look the sandbox up first: an auditor, who may not read the sandbox itself, lists its checkpoints
and their changes; none of them resumes a paused sandbox (a paused-to-disk one is restored and stays paused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import typer
from rich.table import Table

from .._sdk._transport import SyncClient, json_dict, sandbox_path
from ._common import ApiKeyOption, JsonOption, UrlOption, client, note, print_json, print_table, short_time

__all__ = ["changes", "checkpoint", "checkpoints", "delete_checkpoint", "restore"]

SandboxArg = typer.Argument(..., help="Sandbox id.")
CheckpointArg = typer.Argument(..., metavar="checkpoint", help="A checkpoint's id (ckpt-...) or name.")


@contextlib.contextmanager
def _api(url: str | None, api_key: str | None) -> Iterator[SyncClient]:
    http = client(url, api_key)
    try:
        yield http
    finally:
        http.close()


def _call(url: str | None, api_key: str | None, method: str, path: str, what: str,
          **kwargs: Any) -> dict[str, Any]:
    with _api(url, api_key) as http:
        return json_dict(http.request(method, path, **kwargs), what)


def _checkpoint_path(sandbox_id: str, checkpoint: str) -> str:
    return sandbox_path(sandbox_id, "/checkpoints/" + quote(checkpoint, safe=""))


def _size(n: int | None) -> str:
    if n is None:
        return ""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def checkpoint(
    sandbox_id: str = SandboxArg,
    name: str | None = typer.Option(None, help="A name for it, unique among the sandbox's checkpoints (a named "
                                    "checkpoint is never evicted to make room)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Keep the sandbox's files as they are now, to restore in place later; print the checkpoint's id (it costs
    what changed since the last one)."""
    made = _call(url, api_key, "POST", sandbox_path(sandbox_id, "/checkpoints"), "a checkpoint",
                 json={"name": name})
    if as_json:
        print_json(made)
    else:
        typer.echo(made["id"])


def checkpoints(
    sandbox_id: str = SandboxArg,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """List the sandbox's checkpoints, newest first, with the command each automatic one was taken before."""
    found = _call(url, api_key, "GET", sandbox_path(sandbox_id, "/checkpoints"), "checkpoints")["checkpoints"]
    if as_json:
        print_json(found)
        return
    print_table(_checkpoint_table(found))


def _checkpoint_table(found: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "created", "size", "kind", "before")
    table.columns[0].no_wrap = True  # ids are copied from here
    for c in found:
        table.add_row(c["id"], c.get("name") or "", short_time(c.get("created_at")), _size(c.get("size")),
                      "auto" if c.get("automatic") else "manual", c.get("command") or "")
    return table


def restore(
    sandbox_id: str = SandboxArg,
    checkpoint_ref: str = CheckpointArg,
    path: list[str] = typer.Option([], "--path", "-p", help="Restore only this path (and everything below it), "
                                   "leaving the rest as it is; repeatable. Default: every file.",
                                   show_default=False),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Put the sandbox's files back as they were at the checkpoint, in place (same id, limits, network, secrets,
    volumes). Its running processes, code sessions and terminals are stopped first: this prints which."""
    done = _call(url, api_key, "POST", sandbox_path(sandbox_id, "/restore"), "a restore",
                 json={"checkpoint": checkpoint_ref, "paths": path or None})
    if as_json:
        print_json(done)
        return
    typer.echo(_restored_text(sandbox_id, done))


def _restored_text(sandbox_id: str, done: dict[str, Any]) -> str:
    where = ", ".join(done.get("paths") or []) or "every file"
    stopped = done.get("stopped") or {}
    lines = [f"restored {sandbox_id} to {done['checkpoint']['id']} ({where})"]
    lines += [f"stopped process {p.get('pid')}: {p.get('cmd')}" for p in stopped.get("processes") or []]
    if stopped.get("code_contexts"):
        lines.append(f"restarted {stopped['code_contexts']} code session(s): their variables are gone")
    if stopped.get("terminals"):
        lines.append(f"closed {stopped['terminals']} terminal(s)")
    if len(lines) == 1:
        lines.append("nothing was running")
    return "\n".join(lines)


def changes(
    sandbox_id: str = SandboxArg,
    since: str = typer.Option(..., "--since", help="The checkpoint (id or name) to compare from."),
    until: str | None = typer.Option(None, "--until", help="The checkpoint to compare to (default: the files "
                                     "as they are now)."),
    diff: bool = typer.Option(False, "--diff", help="Also print a unified diff of each changed text file "
                              "(bounded per file and in all)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """List what changed in the sandbox's files between two checkpoints (or one and now): added, modified,
    deleted and mode-changed paths with their sizes."""
    query = {"since": since, "diff": "true" if diff else "false", **({"until": until} if until else {})}
    found = _call(url, api_key, "GET", sandbox_path(sandbox_id, "/changes"), "changes", params=query)
    if as_json:
        print_json(found)
        return
    _print_changes(found)


def _print_changes(found: dict[str, Any]) -> None:
    listed: list[dict[str, Any]] = found.get("changes") or []
    if not listed:
        typer.echo(f"no changes from {found.get('since')} to {found.get('until') or 'now'}")
    else:
        print_table(_change_table(listed))
    for change in listed:
        if change.get("diff"):
            typer.echo(str(change["diff"]).rstrip("\n"))
    if found.get("truncated"):
        note("note: the list or its diffs were cut at the server's bound; narrow it with checkpoints closer "
             "together")


def _change_table(listed: list[dict[str, Any]]) -> Table:
    table = Table("change", "type", "path", "size", "was")
    table.columns[2].no_wrap = True  # paths are copied from here
    for c in listed:
        table.add_row(c["kind"], c.get("type") or "", c["path"], _size(c.get("size")), _size(c.get("old_size")))
    return table


def delete_checkpoint(
    sandbox_id: str = SandboxArg,
    checkpoint_ref: str = CheckpointArg,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Delete a checkpoint (the bytes only it holds are freed); print its id or name."""
    with _api(url, api_key) as http:
        http.request("DELETE", _checkpoint_path(sandbox_id, checkpoint_ref))
    typer.echo(checkpoint_ref)
