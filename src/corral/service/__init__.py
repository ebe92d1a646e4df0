"""The service layer: one method per operation, called by every front end (docs/architecture.md)."""

from ._access import SandboxAccess, TokenPurpose
from ._accounts import KEEP, REQUIRED_RUNTIMES, Keys, Tenants
from ._audit import AuditFilter, AuditTrail
from ._audited import Audited, Auditor
from ._callers import REQUEST_INVALID, Callers, ClientInfo
from ._changes import Change, Changes
from ._checkpoints import CHECKPOINT_ID, CheckpointEngine, CheckpointOptions, Checkpoints, RestoreResult, Stopped
from ._code import Cell, Code, CodeStream, ResultCallback
from ._commands import Command, Commands, CommandStream, StartCallback, exec_outcome
from ._egress_directory import EgressDirectory
from ._eval import EvalReports, EvalRun
from ._files import Files
from ._grants import ControlPlane, PrivateGrants
from ._info import Caller, Info, ServerInfo
from ._metrics import MetricsSampler, SandboxMetric
from ._on_sandbox import Authorize, BeforeChange, OnSandbox, SandboxGate, Sessions
from ._outcome import RETRY_AFTER_DETAIL, STATUS_BY_CODE, outcome_of, status_for
from ._ports import DEFAULT_DOMAIN, PORT_ACTION, PortConnection, PortRequest, Ports, check_domain
from ._processes import AttachStream, Processes, parse_signal
from ._pty import Pty, PtyRequest, Terminal
from ._replicas import DEFAULT_REPLICA_TTL, Replica, ReplicaConfig
from ._requests import REQUEST_ID, RequestInfo, current_request, new_request_id, request_scope
from ._sandboxes import CreateSandbox, ForkSandbox, KillReport, Sandboxes, SandboxPage, check_network, file_roots
from ._service import Service, StartupHook
from ._snapshots import Snapshots
from ._streamed import OutputCallback, Streamed
from ._telemetry import METRICS_CONTENT_TYPE, EgressMetrics, Telemetry, egress_registry
from ._templates import Templates
from ._volumes import VolumeDetail, Volumes

__all__ = [
    "CHECKPOINT_ID",
    "DEFAULT_DOMAIN",
    "DEFAULT_REPLICA_TTL",
    "KEEP",
    "METRICS_CONTENT_TYPE",
    "PORT_ACTION",
    "REQUEST_ID",
    "REQUEST_INVALID",
    "REQUIRED_RUNTIMES",
    "RETRY_AFTER_DETAIL",
    "STATUS_BY_CODE",
    "AttachStream",
    "AuditFilter",
    "AuditTrail",
    "Audited",
    "Auditor",
    "Authorize",
    "BeforeChange",
    "Caller",
    "Callers",
    "Cell",
    "Change",
    "Changes",
    "CheckpointEngine",
    "CheckpointOptions",
    "Checkpoints",
    "ClientInfo",
    "Code",
    "CodeStream",
    "Command",
    "CommandStream",
    "Commands",
    "ControlPlane",
    "CreateSandbox",
    "EgressDirectory",
    "EgressMetrics",
    "EvalReports",
    "EvalRun",
    "Files",
    "ForkSandbox",
    "Info",
    "Keys",
    "KillReport",
    "MetricsSampler",
    "OnSandbox",
    "OutputCallback",
    "PortConnection",
    "PortRequest",
    "Ports",
    "PrivateGrants",
    "Processes",
    "Pty",
    "PtyRequest",
    "Replica",
    "ReplicaConfig",
    "RequestInfo",
    "RestoreResult",
    "ResultCallback",
    "SandboxAccess",
    "SandboxGate",
    "SandboxMetric",
    "SandboxPage",
    "Sandboxes",
    "ServerInfo",
    "Service",
    "Sessions",
    "Snapshots",
    "StartCallback",
    "StartupHook",
    "Stopped",
    "Streamed",
    "Telemetry",
    "Templates",
    "Tenants",
    "Terminal",
    "TokenPurpose",
    "VolumeDetail",
    "Volumes",
    "check_domain",
    "check_network",
    "current_request",
    "egress_registry",
    "exec_outcome",
    "file_roots",
    "new_request_id",
    "outcome_of",
    "parse_signal",
    "request_scope",
    "status_for",
]
