"""The Docker backend's record of one sandbox: what it needs to find the sandbox again after a restart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._contract import JSON, BackendRecord

__all__ = ["DockerRecord", "docker_record"]


@dataclass(frozen=True)
class DockerRecord(BackendRecord):
    """One Docker sandbox: its container (by name; the id once made), its directory and its agent token, and
    what `boot` and `snapshot` need: the template's image and digest."""

    name: str
    dir: Path
    token: str
    container_id: str = ""
    cgroup: str = ""  # the memory cgroup of the container, relative to the hierarchy ("" until it runs)
    image: str = ""  # the template's image (`image_ref`); "" in records made before sandboxes could boot again
    template: str = ""  # the template's digest

    def to_json(self) -> JSON:
        return {"backend": "docker", "sandbox_id": self.sandbox_id, "name": self.name, "dir": str(self.dir),
                "token": self.token, "container_id": self.container_id, "cgroup": self.cgroup,
                "image": self.image, "template": self.template}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DockerRecord:
        """`ValueError` unless `data` is what `to_json` made."""
        if not isinstance(data, Mapping) or data.get("backend") != "docker":
            raise ValueError("not a Docker backend record")
        try:
            fields = {key: data[key] for key in ("sandbox_id", "name", "dir", "token", "container_id", "cgroup")}
        except KeyError as exc:
            raise ValueError(f"not a Docker backend record: {exc!r} is missing") from None
        fields |= {key: data.get(key, "") for key in ("image", "template")}  # absent from older records
        if not all(isinstance(value, str) for value in fields.values()):
            raise ValueError("not a Docker backend record: every field is a string")
        if fields["cgroup"] and (not fields["cgroup"].startswith("/") or ".." in fields["cgroup"].split("/")):
            raise ValueError(f"not a Docker backend record: cgroup {fields['cgroup']!r}")
        return cls(sandbox_id=fields["sandbox_id"], name=fields["name"], dir=Path(fields["dir"]),
                   token=fields["token"], container_id=fields["container_id"], cgroup=fields["cgroup"],
                   image=fields["image"], template=fields["template"])


def docker_record(record: BackendRecord) -> DockerRecord:
    if not isinstance(record, DockerRecord):
        raise TypeError(f"the Docker backend was given a {type(record).__name__}, not one of its own records")
    return record
