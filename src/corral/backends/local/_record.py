"""The local backend's record of one sandbox: what it needs to find the sandbox again after a restart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._contract import JSON, BackendRecord
from .._spec import Runtime
from ._layers import check_layers

__all__ = ["LocalRecord", "local_record"]


@dataclass(frozen=True)
class LocalRecord(BackendRecord):
    """One local sandbox: its directory, runtime, uid range (slot), agent token and cgroup."""

    dir: Path
    runtime: Runtime
    slot: int  # -1: none allocated yet
    uid_base: int  # host uid of the sandbox's root
    token: str
    cgroups_path: str
    template: str = ""  # the template's digest and root: what `boot` mounts again ("": made before `boot` was)
    template_rootfs: str = ""
    layers: tuple[str, ...] = ()  # started from a snapshot: its layers, newest first (`_layers`)

    def to_json(self) -> JSON:
        return {"sandbox_id": self.sandbox_id, "dir": str(self.dir), "runtime": self.runtime.value,
                "slot": self.slot, "uid_base": self.uid_base, "token": self.token,
                "cgroups_path": self.cgroups_path, "template": self.template,
                "template_rootfs": self.template_rootfs, "layers": list(self.layers)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LocalRecord:
        """`ValueError` unless `data` is what `to_json` made."""
        try:
            record = cls(sandbox_id=_typed(data, "sandbox_id", str), dir=Path(_typed(data, "dir", str)),
                         runtime=Runtime(data["runtime"]), slot=_typed(data, "slot", int),
                         uid_base=_typed(data, "uid_base", int), token=_typed(data, "token", str),
                         cgroups_path=_typed(data, "cgroups_path", str),
                         template=str(data.get("template", "")), template_rootfs=str(data.get("template_rootfs", "")),
                         layers=check_layers(data.get("layers", [])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a local backend record: {exc!r}") from None
        if not record.cgroups_path.startswith("/") or ".." in record.cgroups_path.split("/"):
            raise ValueError(f"not a local backend record: cgroups path {record.cgroups_path!r}")
        return record


def local_record(record: BackendRecord) -> LocalRecord:
    if not isinstance(record, LocalRecord):
        raise TypeError(f"the local backend was given a {type(record).__name__}, not one of its own records")
    return record


def _typed(data: Mapping[str, Any], key: str, kind: type[Any]) -> Any:
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key} is a {type(value).__name__}, not a {kind.__name__}")
    return value
