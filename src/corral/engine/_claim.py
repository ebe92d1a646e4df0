"""A claimed warm-pool member made fit for the caller's spec before `Engine.adopt` hands it out: its agent still
answers, and its memory, CPU and pids limits are the caller's (resized in place where the backend can). A member
that fails either is replaced by a sandbox created cold under the same id, so a claim never hands out a dead or
wrongly limited sandbox.
"""

from __future__ import annotations

import asyncio
import logging

from .._exceptions import AgentError, CapacityError, CorralError
from ..backends import RESIZABLE_LIMITS
from ._models import SandboxSpec
from ._runtime import Runtime
from ._sandbox import LiveSandbox

__all__ = ["member_answers", "resized_for"]

logger = logging.getLogger("corral.engine")

_CLAIM_PING_TIMEOUT = 2.0  # a pool member's agent answers a ping in a millisecond; one that does not is dead


async def member_answers(sb: LiveSandbox) -> bool:
    try:
        async with asyncio.timeout(_CLAIM_PING_TIMEOUT):
            await sb.agent.ping()
    except (AgentError, TimeoutError):
        logger.warning("pool.member_dead", extra={"sandbox": sb.id})
        return False
    return True


async def resized_for(runtime: Runtime, sb: LiveSandbox, spec: SandboxSpec) -> bool:
    """Give a claimed member `spec`'s memory, CPU and pids limits (if they differ); False if the backend refused,
    or more memory than the member had does not fit the machine: the claim then starts a sandbox cold, which, as
    every create, takes the room of ready members first (and raises `CapacityError` without)."""
    resizable = runtime.resizable
    if resizable is None or all(getattr(sb.spec.limits, n) == getattr(spec.limits, n) for n in RESIZABLE_LIMITS):
        return True
    if spec.limits.memory > sb.spec.limits.memory:
        # `adopt` took the member out of the claimed: `usage` has it no more, so it is checked whole.
        try:
            runtime.check_capacity(spec.limits.memory, await runtime.backend.capacity())
        except CapacityError:
            return False  # started cold instead, in this member's room and other members' if need be
    try:
        await resizable.resize(sb.record, spec.limits)
    except CorralError:
        logger.exception("pool.resize_failed", extra={"sandbox": sb.id})
        return False
    return True
