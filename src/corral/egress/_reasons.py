"""The words of refusals: every text names the host, the policy and the fix, because it is all the agent sees.

`Refusal` is raised inside the proxy and becomes one response (`status reason`, the `X-Corral-Egress` header)
and one refused `EgressEvent`.
"""

from __future__ import annotations

from ._policy import EgressPolicy

__all__ = ["PROXY_HINT", "Refusal"]

PROXY_HINT = "HTTP_PROXY=http://127.0.0.1:3128"


class Refusal(Exception):
    """The proxy will not (or could not) carry this request: answer `status reason`, record `rule`."""

    def __init__(self, status: int, reason: str, rule: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.rule = rule


def _show(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# Package registries: the usual fix is the caching mirror, not opening the registry itself.
_REGISTRIES = frozenset({"pypi.org", "files.pythonhosted.org", "registry.npmjs.org"})


def policy_denied(host: str, port: int, policy: EgressPolicy, rule: str) -> Refusal:
    # A host allowed on another port gets the host:port fix, so the suggestion is the smallest grant that works.
    other_port = any(r.port is not None and r.port != port and r.matches(host, r.port) for r in policy.rules)
    name = f"{_show(host)}:{port}" if other_port else _show(host)
    if policy.mode == "none":
        text = (f"Corral egress denied: {name} is not reachable, this sandbox has no network access (policy: none); "
                f'allow it with network=["{name}"]')
    else:
        text = (f"Corral egress denied: {name} is not in this sandbox's allowlist (policy: {policy.describe()}); "
                f'allow it with network=[..., "{name}"]')
    if host in _REGISTRIES:
        text += ', or with "@packages" for pip and npm through Corral\'s package cache'
    return Refusal(403, text, rule)


def address_forbidden(host: str, ip: str, port: int, why: str, policy: EgressPolicy) -> Refusal:
    what = _show(ip) if host == ip else f"{_show(host)} resolves to {_show(ip)}"
    text = (f"Corral egress denied: {what} ({why}), an address no sandbox may reach under any policy "
            f"(policy: {policy.describe()}); an admin can grant this exact address and an operator switch it on "
            f'with private=["{_show(ip)}:{port}"]')
    return Refusal(403, text, f"forbidden address {ip} ({why})")


def no_host_service(name: str, port: int, policy: EgressPolicy) -> Refusal:
    text = (f"Corral egress denied: {name}:{port} names no host service of this tenant (policy: {policy.describe()}); "
            f'an admin grants one and an operator switches it on with private=["<its ip>:{port}"] in the tenant\'s '
            "egress settings")
    return Refusal(403, text, "no host service")


def host_service_ambiguous(name: str, port: int, addresses: list[str]) -> Refusal:
    text = (f"Corral egress denied: {name}:{port} is ambiguous, the tenant allows {len(addresses)} host services on "
            f"port {port} ({', '.join(addresses)}); connect to the address itself")
    return Refusal(403, text, "host service ambiguous")


def mirror_denied(policy: EgressPolicy) -> Refusal:
    text = ("Corral egress denied: package mirror needs the @packages preset "
            f'(policy: {policy.describe()}); allow it with network=[..., "@packages"]')
    return Refusal(403, text, "mirror needs @packages")


def dns_refused(name: str) -> str:
    return f"DNS lookup of {name} refused: names resolve through the proxy only ({PROXY_HINT})"


def not_a_proxy_request(target: str) -> Refusal:
    return Refusal(400, f"Corral egress proxy: {target} is not a proxy request; use this address as an HTTP "
                        f"proxy ({PROXY_HINT}, HTTPS_PROXY likewise), not as a server", "bad request")


def https_in_the_clear() -> Refusal:
    return Refusal(400, "Corral egress proxy: https:// URLs go through CONNECT; set HTTPS_PROXY=http://127.0.0.1:3128",
                   "bad request")


def proxy_credentials_needed(why: str) -> Refusal:
    return Refusal(407, f"Corral egress proxy: proxy credentials refused: {why}; use the proxy URL Corral gives "
                        "each command (HTTP_PROXY, with the sandbox's id and credential in it)", "proxy credentials")


def policy_unavailable(sandbox_id: str, why: str) -> Refusal:
    return Refusal(503, f"Corral egress: cannot read the network policy of sandbox {sandbox_id} now ({why}); "
                        "try again", "policy unavailable")


def bad_request(why: str) -> Refusal:
    return Refusal(400, f"Corral egress proxy: bad request: {why}", "bad request")


def unresolvable(host: str, why: str) -> Refusal:
    return Refusal(502, f"Corral egress: cannot resolve {host}: {why}", "unresolvable")


def upstream_failed(host: str, port: int, why: str) -> Refusal:
    return Refusal(502, f"Corral egress: cannot connect to {_show(host)}:{port}: {why}", "connect failed")


def upstream_timeout(what: str, host: str, port: int, seconds: float) -> Refusal:
    return Refusal(504, f"Corral egress: {what} {_show(host)}:{port} timed out after {seconds:g} s", "timeout")


def upstream_untrusted(host: str, port: int, why: str) -> Refusal:
    # The proxy checks a bound host's certificate itself: the sandbox cannot, it sees the proxy's.
    return Refusal(502, f"Corral egress: the certificate of {_show(host)}:{port} is not trusted ({why}); behind a "
                        "TLS-inspecting gateway, start Corral with --upstream-ca FILE naming the gateway's CA",
                   "upstream certificate")


def no_interception(host: str) -> Refusal:
    return Refusal(502, f"Corral egress: {_show(host)} has secrets bound to it, and this proxy has no CA to put them "
                        "into TLS (docs/secrets.md)", "error")
