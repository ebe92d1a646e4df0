"""The engine's pure logic, with no sandbox: environment composition, OOM detection, refusals on a result, and
the one place a warm pool's wanted size is decided."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from corral.backends import BackendCapacity
from corral.backends._spec import SealedSecret
from corral.egress._events import EgressEvent
from corral.engine import CodeResult, ExecResult, SandboxSpec, WarmPool
from corral.engine._environment import (
    EGRESS_ENV,
    MIRROR_ENV,
    TRUST_ENV,
    code_with_oom,
    compose_env,
    may_be_oom,
    with_denials,
    with_oom,
)
from corral.engine._pool import Pools, PoolState
from corral.engine._sandbox import LiveSandbox

pytestmark = pytest.mark.anyio


def _result(**kw: object) -> ExecResult:
    return ExecResult(exit_code=kw.pop("exit_code", None), stdout_bytes=b"", stderr_bytes=b"", **kw)  # type: ignore[arg-type]


def test_env_layers_from_proxy_to_spec_and_extra() -> None:
    spec = SandboxSpec(env={"A": "spec", "HTTP_PROXY": "mine"})
    env = compose_env(spec, {"A": "template", "T": "t"}, extra={"X": "extra"})
    assert env["A"] == "spec" and env["T"] == "t" and env["X"] == "extra"
    assert env["HTTP_PROXY"] == "mine" and env["https_proxy"] == EGRESS_ENV["https_proxy"]
    assert not set(TRUST_ENV) & set(env)  # no secrets: no trust variables


def test_env_has_the_mirror_only_where_the_policy_grants_packages() -> None:
    assert set(MIRROR_ENV) <= set(compose_env(SandboxSpec(network=["@packages"]), {}))
    assert not set(MIRROR_ENV) & set(compose_env(SandboxSpec(network="none"), {}))


def test_a_remote_proxys_env_replaces_the_local_one() -> None:
    env = compose_env(SandboxSpec(network=["@packages"]), {}, proxy_env={"HTTPS_PROXY": "http://remote:3128"})
    assert env["HTTPS_PROXY"] == "http://remote:3128"
    assert "http_proxy" not in env and not set(MIRROR_ENV) & set(env)


def test_secrets_bring_their_placeholders_and_the_ca_trust_variables() -> None:
    secret = SealedSecret(name="TOKEN", placeholder="corral-secret-" + "ab" * 16, hosts=("api.example",), sealed="x")
    env = compose_env(SandboxSpec.model_construct(**{**SandboxSpec().__dict__, "secrets": (secret,)}), {})
    assert env["TOKEN"] == "corral-secret-" + "ab" * 16
    assert all(env[k] == v for k, v in TRUST_ENV.items())


@pytest.mark.parametrize(("result", "suspect"), [
    (_result(signal=9), True),
    (_result(signal=9, timed_out=True), False),
    (_result(signal=9, killed=True), False),
    (_result(signal=15), False),
    (_result(exit_code=0), False),
])
def test_only_an_unsent_sigkill_is_an_oom_suspect(result: ExecResult, suspect: bool) -> None:
    assert may_be_oom(result) is suspect
    assert with_oom(result, 1, 2).oom_killed is suspect
    assert not with_oom(result, 1, 1).oom_killed  # the counter did not move: not the OOM killer
    assert not with_oom(result, 1, None).oom_killed  # not read


def test_a_cells_oom_is_a_memory_error_and_its_timeout_does_not_rule_it_out() -> None:
    cell = CodeResult(session="default", language="python", stdout_bytes=b"", stderr_bytes=b"", signal=9,
                      timed_out=True)
    marked = code_with_oom(cell, 0, 1)
    assert marked.oom_killed and marked.error is not None and marked.error.name == "MemoryError"
    assert code_with_oom(cell, 1, 1) is cell


def test_refusals_are_put_on_the_result_and_none_leave_it_as_it_was() -> None:
    result = _result(exit_code=0)
    assert with_denials(result, ()) is result
    event = EgressEvent(time=1.0, sandbox_id="sb-abcd", kind="connect", method="CONNECT", host="x.example",
                        port=443, allowed=False, rule="policy none")
    assert with_denials(result, [event]).egress_denials == (event,)


async def test_the_filler_starts_what_wanted_asks_for(tmp_path: Path) -> None:
    made: list[str] = []

    async def make(spec: SandboxSpec, sandbox_id: str) -> LiveSandbox:
        made.append(sandbox_id)
        return LiveSandbox(id=sandbox_id, spec=spec, record=None, agent=None, created_at=0.0)  # type: ignore[arg-type]

    async def destroy(sb: LiveSandbox, reason: str) -> None:
        raise AssertionError("nothing is evicted here")

    async def capacity() -> BackendCapacity:
        return BackendCapacity(memory_total=64 << 30, memory_available=64 << 30)

    pools = Pools([WarmPool(SandboxSpec(), 5)], resizable=False, make=make, destroy=destroy, capacity=capacity,
                  creating={})

    pools.wanted = lambda state: 2  # type: ignore[method-assign]  # a sizing policy plugs in here
    await pools.step()
    await asyncio.gather(*pools.tasks)
    (state,) = pools.states.values()
    assert isinstance(state, PoolState) and len(made) == 2 and len(state.members) == 2
    await pools.step()
    await asyncio.gather(*pools.tasks)
    assert len(made) == 2  # full at what `wanted` says, not at the configured 5
