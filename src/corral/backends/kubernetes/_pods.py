"""Reading Pods: names Corral gives them (a sandbox's, a warm pool's image key), their phase and readiness, a
short account of their state for diagnostics, their age, and Kubernetes quantities (a node's allocatable memory)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..._exceptions import ServerError
from ._record import SAFE_NAME

_MIB = 1024**2


def pod_name(sandbox_id: str) -> str:
    """`corral-<id>` for ids that are DNS labels already (the engine's `sb-<hex>`), else of a digest."""
    if SAFE_NAME.fullmatch(sandbox_id) and len(sandbox_id) <= 40:
        return f"corral-{sandbox_id}"
    return f"corral-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:16]}"


def pool_key(image: str) -> str:
    """A label value naming the image: a warm Pod serves only sandboxes of that very image."""
    return hashlib.sha256(image.encode()).hexdigest()[:16]


def phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def is_ready(pod: Mapping[str, Any]) -> bool:
    return (phase(pod) == "Running" and bool((pod.get("status") or {}).get("podIP"))
            and not pod["metadata"].get("deletionTimestamp"))


def ready_or_failed(pod: Mapping[str, Any]) -> bool:
    if phase(pod) in ("Failed", "Succeeded"):
        raise ServerError(f"pod {pod['metadata']['name']} ended before it served: {pod_state(pod)}")
    return is_ready(pod)


def pod_state(pod: Mapping[str, Any]) -> str:
    status = pod.get("status") or {}
    parts = [f"phase {phase(pod)}"]
    if status.get("reason") or status.get("message"):
        parts.append(f"{status.get('reason') or ''} {status.get('message') or ''}".strip())
    for container in status.get("containerStatuses") or []:
        for state, info in (container.get("state") or {}).items():
            if info and state != "running":
                parts.append(f"container {container.get('name')} {state}: {info.get('reason') or ''} "
                             f"{info.get('message') or ''}".strip())
    return "; ".join(parts)


def started_seconds_ago(pod: Mapping[str, Any]) -> int:
    """Seconds since the Pod started (`activeDeadlineSeconds` counts from then); 0 if unknown."""
    started = (pod.get("status") or {}).get("startTime")
    if not started:
        return 0
    try:
        at = datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0
    return max(0, int(time.time() - at) + 1)


_SUFFIXES = {"Ki": 1024, "Mi": _MIB, "Gi": 1024**3, "Ti": 1024**4, "k": 1000, "M": 10**6, "G": 10**9, "T": 10**12,
             "m": 0.001}


def parse_quantity(text: object) -> float:
    """A Kubernetes quantity ("16Gi", "1500m", "110") as a number; 0 for what is not one."""
    value = str(text)
    for suffix, factor in _SUFFIXES.items():
        if value.endswith(suffix):
            try:
                return float(value[: -len(suffix)]) * factor
            except ValueError:
                return 0.0
    try:
        return float(value)
    except ValueError:
        return 0.0
