"""Corral's records as E2B's JSON (`Sandbox`, `SandboxDetail`, `ListedSandbox`, `SnapshotInfo` of E2B's spec).

Timestamps are RFC 3339 in UTC; sizes in E2B's units (MB). `clientID` is deprecated but required by the SDKs'
parsers: Corral sends a constant.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from ..control import SandboxRecord, SnapshotRecord
from ..engine import SandboxState
from ..service import SandboxAccess, SandboxMetric, TokenPurpose
from ._config import E2BConfig

__all__ = ["detail_json", "listed_json", "metric_json", "sandbox_json", "snapshot_json", "timestamp"]

CLIENT_ID = "corral"
_MB = 1024 * 1024


def timestamp(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def state_of(record: SandboxRecord) -> str:
    return "paused" if record.state is SandboxState.PAUSED else "running"


def sandbox_json(record: SandboxRecord, config: E2BConfig, access: SandboxAccess, domain: str,
                 template_id: str | None = None) -> dict[str, Any]:
    """The create/connect/resume answer: the ids, envd's version, the two access tokens and the domain."""
    return {
        "templateID": template_id or record.template,
        "sandboxID": record.id,
        "clientID": CLIENT_ID,
        "envdVersion": config.envd_version,
        "alias": record.template,
        "envdAccessToken": access.token(record.id, TokenPurpose.SANDBOX),
        "trafficAccessToken": access.token(record.id, TokenPurpose.PORTS),
        "domain": domain,
    }


def listed_json(record: SandboxRecord, config: E2BConfig) -> dict[str, Any]:
    spec = record.spec
    return {
        "templateID": record.template,
        "alias": record.template,
        "sandboxID": record.id,
        "clientID": CLIENT_ID,
        "startedAt": timestamp(record.created_at),
        "endAt": timestamp(record.expires_at),
        "cpuCount": max(1, round(record.cpus)),
        "memoryMB": record.memory_bytes // _MB,
        "diskSizeMB": record.disk_bytes // _MB,
        "state": state_of(record),
        "envdVersion": config.envd_version,
        "metadata": dict(record.metadata),
        "volumeMounts": [{"name": name, "path": path} for path, name in spec.volumes.items()],
    }


def detail_json(record: SandboxRecord, config: E2BConfig, access: SandboxAccess, domain: str) -> dict[str, Any]:
    spec = record.spec
    network = spec.network
    return {
        **listed_json(record, config),
        "envdAccessToken": access.token(record.id, TokenPurpose.SANDBOX),
        "domain": domain,
        "allowInternetAccess": network != "none",
        "network": {"allowPublicTraffic": spec.public_ports,
                    **({"allowOut": list(network)} if isinstance(network, tuple | list) else {})},
        "lifecycle": {"autoResume": spec.auto_resume, "onTimeout": "kill" if spec.on_timeout == "kill" else "pause"},
        **({"pauseMode": "filesystem" if record.paused_to_disk else "full"}
           if record.state is SandboxState.PAUSED else {}),
    }


def snapshot_json(record: SnapshotRecord) -> dict[str, Any]:
    return {"snapshotID": record.id, "names": [record.name] if record.name else []}


def metric_json(metric: SandboxMetric) -> dict[str, Any]:
    return {"timestamp": timestamp(metric.timestamp), "timestampUnix": int(metric.timestamp.timestamp()),
            "cpuCount": max(1, math.ceil(metric.cpus)), "cpuUsedPct": round(metric.cpu_used_pct, 2),
            "memUsed": metric.memory_used, "memTotal": metric.memory_total, "memCache": metric.memory_cache,
            "diskUsed": metric.disk_used, "diskTotal": metric.disk_total}
