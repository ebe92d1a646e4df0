"""envd's `filesystem.Filesystem` service on Corral's file service: Stat, ListDir, MakeDir, Move, Remove, WatchDir
and the polled watchers (CreateWatcher, GetWatcherEvents, RemoveWatcher).

Paths are absolute, or relative to the user's home. Entries are envd's `EntryInfo`: a symlink is shown as what it
leads to, with `symlinkTarget` the absolute path there (a dangling one stays a symlink). Watch events are named as
envd (Go's fsnotify) names them, relative to the watched directory; a queue that overflowed is an error, never a
silent gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._exceptions import NotFoundError
from .._paths import SandboxPath
from .._users import SandboxUser
from ..control import Action
from ..engine import Entry, WatchEvent
from ._connect import RpcError
from ._proto import field, integer, timestamp
from ._rpc import Call, Rpc, Send
from ._user import absolute_path, home_of, service_user

__all__ = ["FILESYSTEM_RPCS", "entry_info"]

KEEPALIVE: Mapping[str, Any] = {"keepalive": {}}
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_EVENTS = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
           "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
_MAX_DEPTH = 64


def entry_info(entry: Entry) -> dict[str, Any]:
    kind = entry.type
    info: dict[str, Any] = {"name": entry.name, "path": entry.path}
    if kind == "symlink" and entry.target_type is not None:
        kind = entry.target_type  # envd shows a link as what it leads to
        if entry.resolved:
            info["symlinkTarget"] = entry.resolved
    info.update({"type": _TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"), "size": str(entry.size), "mode": entry.mode,
                 "permissions": entry.permissions, "owner": entry.owner, "group": entry.group,
                 "modifiedTime": timestamp(entry.mtime)})
    if entry.metadata:
        info["metadata"] = dict(entry.metadata)
    return info


def _user(call: Call) -> SandboxUser | None:
    return service_user(call.user)


def _path(call: Call, name: str = "path") -> SandboxPath:
    value = field(call.message, name)
    if value is not None and not isinstance(value, str):
        raise RpcError("invalid_argument", f"{name} must be text")
    return absolute_path(value, what=name, home=home_of(call.user))


async def stat(call: Call) -> dict[str, Any]:
    entry = await call.service.files.stat(call.principal, call.sandbox_id, _path(call), user=_user(call))
    return {"entry": entry_info(entry)}


async def list_dir(call: Call) -> dict[str, Any]:
    depth = integer(field(call.message, "depth"), "depth", default=0) or 1
    if not 1 <= depth <= _MAX_DEPTH:
        raise RpcError("invalid_argument", f"depth must be between 1 and {_MAX_DEPTH}")
    entries = await call.service.files.list(call.principal, call.sandbox_id, _path(call), depth=depth,
                                            user=_user(call))
    return {"entries": [entry_info(e) for e in entries]}


async def make_dir(call: Call) -> dict[str, Any]:
    path = _path(call)
    if not await call.service.files.make_dir(call.principal, call.sandbox_id, path, user=_user(call)):
        raise RpcError("already_exists", f"directory {path} already exists")
    return {"entry": entry_info(await call.service.files.stat(call.principal, call.sandbox_id, path,
                                                               user=_user(call)))}


async def move(call: Call) -> dict[str, Any]:
    entry = await call.service.files.rename(call.principal, call.sandbox_id, _path(call, "source"),
                                            _path(call, "destination"), overwrite=True, parents=True,
                                            user=_user(call))
    return {"entry": entry_info(entry)}


async def remove(call: Call) -> dict[str, Any]:
    try:
        await call.service.files.remove(call.principal, call.sandbox_id, _path(call), recursive=True,
                                        user=_user(call))
    except NotFoundError:
        # envd: removing what is not there is no error; but a sandbox the caller may not see is not found.
        await call.service.sandboxes.authorized(call.principal, call.sandbox_id, Action.SANDBOX_FILES_WRITE)
    return {}


def _watch_options(call: Call) -> dict[str, Any]:
    # allowNetworkMounts needs nothing: no network file system is ever mounted in a Corral sandbox.
    return {"recursive": bool(field(call.message, "recursive")),
            "include_entry": bool(field(call.message, "includeEntry")), "user": _user(call)}


def _event(event: WatchEvent) -> dict[str, Any]:
    if event.type == "overflow":
        raise RpcError("resource_exhausted", "the directory changed faster than its events were read: events "
                                             "were lost; watch it again")
    out: dict[str, Any] = {"name": event.name, "type": _EVENTS[event.type]}
    if event.entry is not None:
        out["entry"] = entry_info(event.entry)
    return out


async def watch_dir(call: Call, send: Send) -> None:
    events = await call.service.files.watch(call.principal, call.sandbox_id, _path(call), **_watch_options(call))
    try:
        await send({"start": {}})
        async for event in events:
            await send({"filesystem": _event(event)})
    finally:
        await events.aclose()


async def create_watcher(call: Call) -> dict[str, Any]:
    watcher_id = await call.service.files.create_watcher(call.principal, call.sandbox_id, _path(call),
                                                         **_watch_options(call))
    return {"watcherId": watcher_id}


def _watcher_id(call: Call) -> str:
    watcher_id = field(call.message, "watcherId")
    if not isinstance(watcher_id, str) or not watcher_id:
        raise RpcError("invalid_argument", "watcherId is required")
    return watcher_id


async def get_watcher_events(call: Call) -> dict[str, Any]:
    events = await call.service.files.watcher_events(call.principal, call.sandbox_id, _watcher_id(call))
    return {"events": [_event(e) for e in events]}


async def remove_watcher(call: Call) -> dict[str, Any]:
    await call.service.files.remove_watcher(call.principal, call.sandbox_id, _watcher_id(call))
    return {}


FILESYSTEM_RPCS: Mapping[str, Rpc] = {
    "filesystem.Filesystem/Stat": Rpc("unary", stat),
    "filesystem.Filesystem/ListDir": Rpc("unary", list_dir),
    "filesystem.Filesystem/MakeDir": Rpc("unary", make_dir),
    "filesystem.Filesystem/Move": Rpc("unary", move),
    "filesystem.Filesystem/Remove": Rpc("unary", remove),
    "filesystem.Filesystem/WatchDir": Rpc("stream", watch_dir, KEEPALIVE),
    "filesystem.Filesystem/CreateWatcher": Rpc("unary", create_watcher),
    "filesystem.Filesystem/GetWatcherEvents": Rpc("unary", get_watcher_events),
    "filesystem.Filesystem/RemoveWatcher": Rpc("unary", remove_watcher),
}
