"""The JSON bodies E2B's SDKs send to the control plane (E2B's OpenAPI spec, `spec/openapi.yml`), as pydantic models.

Field names are E2B's (`templateID`, `envVars`, ...); fields a newer SDK adds are ignored, so an upgrade of the
client never breaks on a field it merely sends, while a feature Corral cannot honour is refused by name where it is
used (`_control`), never silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .._bounds import EnvVars, Metadata

__all__ = ["ConnectRequest", "ForkRequest", "NetworkConfig", "NewSandbox", "PauseRequest", "ResumeRequest",
           "SnapshotRequest", "TimeoutRequest", "VolumeMount"]

_MAX_TIMEOUT = 7 * 24 * 3600


class _Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NetworkConfig(_Body):
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    mask_request_host: str | None = Field(None, alias="maskRequestHost")
    egress_proxy: dict[str, Any] | None = Field(None, alias="egressProxy")
    rules: dict[str, Any] | None = None


class VolumeMount(_Body):
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)


class AutoResume(_Body):
    enabled: bool = False


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: int = Field(300, ge=1, le=_MAX_TIMEOUT)
    auto_pause: bool = Field(False, alias="autoPause")
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(None, alias="autoResume")
    secure: bool | None = None  # Corral always hands out access tokens (see `_auth`)
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    metadata: Metadata | None = None
    env_vars: EnvVars | None = Field(None, alias="envVars")
    mcp: dict[str, Any] | None = None  # the SDK starts the MCP gateway itself, with a command
    iam: dict[str, Any] | None = None
    volume_mounts: list[VolumeMount] | None = Field(None, alias="volumeMounts")


class ConnectRequest(_Body):
    timeout: int | None = Field(None, ge=0, le=_MAX_TIMEOUT)
    memory: bool | None = None


class ResumeRequest(_Body):
    timeout: int | None = Field(None, ge=0, le=_MAX_TIMEOUT)
    auto_pause: bool | None = Field(None, alias="autoPause")


class TimeoutRequest(_Body):
    timeout: int = Field(ge=0, le=_MAX_TIMEOUT)


class RefreshRequest(_Body):
    duration: int | None = Field(None, ge=0, le=3600)


class PauseRequest(_Body):
    memory: bool = True


class ForkRequest(_Body):
    timeout: int | None = Field(None, ge=1, le=_MAX_TIMEOUT)
    count: int | None = Field(None, ge=1, le=100)


class SnapshotRequest(_Body):
    name: str | None = Field(None, min_length=1, max_length=128)
