"""`KubernetesRecord`: what the engine keeps of one sandbox's Pod to find it again after a restart (its name, uid,
IP, agent token, template and egress proxy), checked when it is read back."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._contract import JSON, BackendRecord

SAFE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,48}[a-z0-9])?")  # a Pod name Corral makes (a DNS label)


@dataclass(frozen=True)
class KubernetesRecord(BackendRecord):
    """One sandbox's Pod: its name and uid (a Pod made again under the name is another Pod), its IP (fixed for
    the Pod's life), its agent's token, and the egress proxy it was given ("" for none)."""

    pod: str
    uid: str
    ip: str
    token: str
    template: str = ""
    proxy: str = ""  # host:port of the egress proxy Service

    def to_json(self) -> JSON:
        return {"backend": "kubernetes", "sandbox_id": self.sandbox_id, "pod": self.pod, "uid": self.uid,
                "ip": self.ip, "token": self.token, "template": self.template, "proxy": self.proxy}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KubernetesRecord:
        """`ValueError` unless `data` is what `to_json` made."""
        if not isinstance(data, Mapping) or data.get("backend") != "kubernetes":
            raise ValueError("not a Kubernetes backend record")
        keys = ("sandbox_id", "pod", "uid", "ip", "token", "template", "proxy")
        try:
            fields = {key: data[key] for key in keys}
        except KeyError as exc:
            raise ValueError(f"not a Kubernetes backend record: {exc!r} is missing") from None
        if not all(isinstance(value, str) for value in fields.values()):
            raise ValueError("not a Kubernetes backend record: every field is a string")
        if not SAFE_NAME.fullmatch(fields["pod"]):
            raise ValueError(f"not a Kubernetes backend record: pod name {fields['pod']!r}")
        return cls(**fields)


def k8s_record(record: BackendRecord) -> KubernetesRecord:
    if not isinstance(record, KubernetesRecord):
        raise TypeError(f"the Kubernetes backend was given a {type(record).__name__}, not one of its own records")
    return record
