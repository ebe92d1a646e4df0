"""Pure logic of what runs in a sandbox: its environment, how an OOM kill shows, which refusals a result carries.

No I/O here: each function takes what the engine measured (counters, refusals, the backend's proxy variables) and
returns a value, so all of it is tested without a sandbox (tests/test_engine_logic.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ._code import CodeError, CodeResult
from ._models import ExecResult, SandboxSpec

if TYPE_CHECKING:
    from ..egress import EgressEvent

# Every sandbox reaches out only through the egress proxy, bridged by the agent to 127.0.0.1:3128 (docs/egress.md).
# Lower-case twins: curl and wget read only those.
_PROXY = "http://127.0.0.1:3128"
_NO_PROXY = "localhost,127.0.0.1,::1"
EGRESS_ENV = {
    "HTTP_PROXY": _PROXY, "HTTPS_PROXY": _PROXY, "http_proxy": _PROXY, "https_proxy": _PROXY,
    "NO_PROXY": _NO_PROXY, "no_proxy": _NO_PROXY,
}
# A sandbox with secrets trusts the deployment's CA (docs/secrets.md), through the variables its clients read:
# OpenSSL and Python's ssl, requests, curl, git, pip and Node (which adds to its own store).
TRUST_DIR = "/.corral/egress"
TRUST_CA, TRUST_BUNDLE = "ca.pem", "ca-bundle.pem"
TRUST_ENV = {
    "SSL_CERT_FILE": f"{TRUST_DIR}/{TRUST_BUNDLE}", "REQUESTS_CA_BUNDLE": f"{TRUST_DIR}/{TRUST_BUNDLE}",
    "CURL_CA_BUNDLE": f"{TRUST_DIR}/{TRUST_BUNDLE}", "GIT_SSL_CAINFO": f"{TRUST_DIR}/{TRUST_BUNDLE}",
    "PIP_CERT": f"{TRUST_DIR}/{TRUST_BUNDLE}", "NODE_EXTRA_CA_CERTS": f"{TRUST_DIR}/{TRUST_CA}",
}
# Where the policy grants the package preset, pip and npm use the proxy's caching mirror. Elsewhere they keep
# their usual registries through the proxy, so a refusal reaches them as a refused CONNECT, whose reason pip
# prints in its retry warnings (a refused mirror page, pip would report only as "no matching distribution").
MIRROR_ENV = {"PIP_INDEX_URL": f"{_PROXY}/pypi/simple/", "npm_config_registry": f"{_PROXY}/npm/"}

_SIGKILL = 9
_CODE_OOM = CodeError("MemoryError", "the session ran out of memory and was killed (the sandbox's memory limit); "
                      "its state is lost, and the next call starts a fresh session", "")


@functools.lru_cache(maxsize=1024)
def grants_packages(network: str | tuple[str, ...], private: tuple[str, ...]) -> bool:
    """Memoised: every exec builds an environment, and parsing the policy each time would tax that hot path."""
    spec_policy = SandboxSpec.model_construct(network=network, network_private=private).egress_policy()
    return spec_policy.grants_preset("packages")


def compose_env(spec: SandboxSpec, template_env: Mapping[str, str], *, proxy_env: Mapping[str, str] | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The sandbox's environment, lowest first: the proxy's variables (`proxy_env`: a `RemoteEgress` backend's own,
    None: the local proxy's, with the package mirror where the policy grants it), the template's, the spec's, the
    CA trust variables and secrets' placeholders where it has secrets, then `extra`."""
    if proxy_env is None:
        packages = grants_packages(spec.network, spec.network_private)
        env = {**EGRESS_ENV, **(MIRROR_ENV if packages else {})}
    else:
        env = dict(proxy_env)
    env.update(template_env)
    env.update(spec.env)
    if spec.secrets:
        env.update(TRUST_ENV)
        env.update({s.name: s.placeholder for s in spec.secrets})
    if extra:
        env.update(extra)
    return env


def may_be_oom(result: ExecResult | CodeResult) -> bool:
    """A SIGKILL nobody sent (not ours, nor a command's timeout): worth asking whether the OOM counter moved. A
    cell's timeout interrupts its session rather than killing it, so only `killed` rules a cell out."""
    ours = result.killed or (isinstance(result, ExecResult) and result.timed_out)
    return result.signal == _SIGKILL and not ours


def with_oom(result: ExecResult, oom_before: int, oom_after: int | None) -> ExecResult:
    """The command's result, `oom_killed` where an unsent SIGKILL came while the OOM counter moved
    (`oom_after` None: not read, because `may_be_oom` said there was no need)."""
    if oom_after is not None and may_be_oom(result) and oom_after > oom_before:
        return replace(result, oom_killed=True)
    return result


def code_with_oom(result: CodeResult, oom_before: int, oom_after: int | None) -> CodeResult:
    """As `with_oom`, for a cell: its session died, so the result says so as a `MemoryError`."""
    if oom_after is not None and may_be_oom(result) and oom_after > oom_before:
        return replace(result, oom_killed=True, error=_CODE_OOM)
    return result


def with_denials(result: ExecResult, denials: Sequence[EgressEvent]) -> ExecResult:
    """The command's result with the egress proxy's refusals while it ran (none: the result unchanged)."""
    return replace(result, egress_denials=tuple(denials)) if denials else result
