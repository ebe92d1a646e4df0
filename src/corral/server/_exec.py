"""`POST /v1/sandboxes/{id}/exec`: one JSON result, or NDJSON events as the output is produced."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .._bounds import MAX_OUTPUT, Duration, EnvVars
from ..egress import EgressEvent
from ..engine import ExecResult
from ..service import Command, CommandStream
from ._auth import CurrentPrincipal
from ._checkpoints import checkpoint_taken
from ._context import SandboxUser, service
from ._ndjson import Producer, Sink, b64, line, ndjson_response
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)


def _decode_b64(value: object) -> object:
    if not isinstance(value, str):
        return value  # the bytes type refuses it
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64") from None


Base64 = Annotated[bytes, BeforeValidator(_decode_b64)]  # a base64 string on the wire, its bytes in the model


class CommandBody(BaseModel):
    """A command's options as a request body names them (exec's and a background process's): checked by the
    model, then built once into the service's `Command`."""

    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str]
    cwd: str | None = None
    env: EnvVars = Field(default_factory=dict)
    timeout: Duration | None = None
    max_output: Annotated[int, Field(gt=0, le=MAX_OUTPUT)] | None = None
    stdin_b64: Base64 | None = None
    user: SandboxUser | None = None

    def command(self) -> Command:
        return Command(self.cmd, cwd=self.cwd, env=self.env, timeout=self.timeout, max_output=self.max_output,
                       stdin=self.stdin_b64, user=self.user)


class ExecRequest(CommandBody):
    stream: bool = False


def result_json(result: ExecResult, *, streamed: bool = False) -> dict[str, Any]:
    """The result fields; once streamed, stdout_b64/stderr_b64 hold only the kept tail of truncated output."""
    out, err = result.stdout_bytes, result.stderr_bytes
    if streamed:
        out = out[result.stdout_cut:] if result.stdout_cut is not None else b""
        err = err[result.stderr_cut:] if result.stderr_cut is not None else b""
    return {
        "exit_code": result.exit_code,
        "signal": result.signal,
        "stdout_b64": b64(out),
        "stderr_b64": b64(err),
        "duration": result.duration,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "killed": result.killed,
        "truncated": result.truncated,
        "stdout_size": result.stdout_size,
        "stderr_size": result.stderr_size,
        "stdout_cut": result.stdout_cut,
        "stderr_cut": result.stderr_cut,
        "egress_denials": [denial_json(d) for d in result.egress_denials],
        "reclaimed": [tree.to_wire() for tree in result.reclaimed],
    }


def denial_json(event: EgressEvent) -> dict[str, Any]:
    """What a client needs to explain a refusal: where, what kind, and the reason with its fix."""
    return {"kind": event.kind, "host": event.host, "port": event.port, "method": event.method,
            "rule": event.rule, "reason": event.reason, "time": event.time}


@router.post("/{sandbox_id}/exec", response_model=None)
async def exec_command(sandbox_id: str, body: ExecRequest, request: Request,
                       principal: CurrentPrincipal) -> Response:
    commands = service(request).commands
    if not body.stream:
        # Encoded here: the fields are JSON types already, and FastAPI's jsonable_encoder walk of a returned dict
        # (the same bytes in the end) cost a tenth of the round trip of a short command.
        result = await commands.run(principal, sandbox_id, body.command())
        return JSONResponse({**result_json(result), "checkpoint": checkpoint_taken()})
    stream = await commands.stream(principal, sandbox_id, body.command())
    return ndjson_response(_events(stream), stream.close)


def _events(stream: CommandStream) -> Producer:
    """Output as it comes, then `exit`; a client that leaves cancels the command: its tree is killed."""
    async def produce(sink: Sink) -> bytes:
        result = await stream.run(sink.stdout, sink.stderr)
        return line({"event": "exit", **result_json(result, streamed=True), "checkpoint": checkpoint_taken()})

    return produce
