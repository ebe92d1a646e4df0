"""Items 37 and 38: secrets at egress (docs/secrets.md).

37: a sandbox created with a secret holds a placeholder: the value is in no process's environment or command
line and no file the sandbox can read. The probe gives the value to the search reversed, in an unexported
variable, so the search itself puts it in no environment.

38: through plain HTTP to the runner's loopback server (`/echo/`, reachable by the tenant as its host service):
under the bound name (`host.corral.internal`) the server receives the value and its echo reaches the sandbox
as the placeholder; under another name for the same server (`127.0.0.1`) it receives the placeholder. What a
probe found reflected in other ways comes back scrubbed too: the Basic credentials the proxy built (`curl -u`),
echoed in their base64; the value as the answer's reason phrase and in a header's name (`/reflect/`); and an
answer under `Transfer-Encoding: gzip, chunked` (`/gzip-te/`) is refused (502), not passed on compressed. HTTPS
takes the same path once intercepted, which needs a certificate the deployment's proxy trusts for the check's server:
tests/test_secrets.py proves that part. Both items are N/A where the server refuses secrets (a backend whose proxy
cannot put them in), naming why.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .._exceptions import InvalidRequestError
from .._sdk import AsyncSandbox
from ._context import CheckContext, clip, run_ok
from ._model import ItemFailed, NotApplicable

__all__ = ["item_37_secrets_never_inside", "item_38_secrets_reach_only_their_hosts"]

HOST = "host.corral.internal"
NAME = "CORRAL_CHECK_SECRET"
_SEARCHED = "/proc/[0-9]*/environ /home /tmp /workspace /etc /.corral"
# Every process's command line but the search's own (which holds the value by necessity).
_SEARCH = ('V=$(rev <<< "$R"); ( me=$BASHPID; files=$(for f in /proc/[0-9]*/cmdline; do '
           '[ "$f" != "/proc/$me/cmdline" ] && echo "$f"; done); exec grep -rlsF --binary-files=text -e "$V" '
           f'$files {_SEARCHED} ); echo "searched"')


@asynccontextmanager
async def _with_secret(ctx: CheckContext, value: str, network: list[str]) -> AsyncIterator[AsyncSandbox]:
    try:
        async with ctx.sandbox(network=network, secrets={NAME: {"value": value, "hosts": [HOST]}}) as sb:
            yield sb
    except InvalidRequestError as exc:
        if "secrets need" in exc.message:
            raise NotApplicable(f"this server refuses secrets: {clip(exc.message)}") from exc
        raise


async def item_37_secrets_never_inside(ctx: CheckContext) -> str:
    value = f"chk{secrets.token_hex(20)}"
    async with _with_secret(ctx, value, [HOST]) as sb:
        placeholder = (await run_ok(sb, ["bash", "-c", f'printf %s "${NAME}"'], what="print the secret")).stdout
        if not placeholder or value in placeholder:
            raise ItemFailed(f"${NAME} inside the sandbox is {clip(placeholder, 80)!r}, not a placeholder")
        await run_ok(sb, ["bash", "-c", "nohup sleep 120 >/dev/null 2>&1 &"], what="a background process")
        r = await sb.commands.run(["bash", "-c", _SEARCH], env={"R": value[::-1]}, timeout=60)
        found = [line for line in r.stdout.splitlines() if line and line != "searched"]
        if r.stdout.splitlines()[-1:] != ["searched"]:
            raise ItemFailed(f"the search inside the sandbox did not finish: {clip(r.stdout + r.stderr)}")
        if found:
            raise ItemFailed(f"the secret's value is inside the sandbox: {', '.join(found[:5])}")
    return (f"${NAME} is a placeholder ({placeholder[:24]}...); the value is in no environment, command line or "
            f"file under {_SEARCHED.replace('/proc/[0-9]*/environ ', '')}")


async def item_38_secrets_reach_only_their_hosts(ctx: CheckContext) -> str:
    if ctx.loopback is None:
        raise NotApplicable("needs the check's loopback server, which only a server on this machine can reach "
                            "(run `corral check` where the server runs); tests/test_secrets.py covers it")
    port = ctx.loopback.rsplit(":", 1)[1]
    value = f"chk{secrets.token_hex(20)}"
    nonce = secrets.token_hex(6)
    async with _with_secret(ctx, value, [HOST, "127.0.0.1"]) as sb:
        bound = await run_ok(sb, ["bash", "-c", f'curl -sS --max-time 20 -D - -H "Authorization: Bearer ${NAME}" '
                                                f'http://{HOST}:{port}/echo/bound-{nonce}'], what="curl, bound")
        other = await run_ok(sb, ["bash", "-c", f'curl -sS --max-time 20 --noproxy "" -H "Authorization: Bearer '
                                                f'${NAME}" http://127.0.0.1:{port}/echo/other-{nonce}'],
                              what="curl, another name")
        placeholder = (await run_ok(sb, ["bash", "-c", f'printf %s "${NAME}"'], what="print the secret")).stdout
        basic = await run_ok(sb, ["bash", "-c", f'curl -sS --max-time 20 -D - -u "x:${NAME}" '
                                                f'http://{HOST}:{port}/echo/basic-{nonce}'], what="curl -u, bound")
        head = await run_ok(sb, ["bash", "-c", f'curl -sS --max-time 20 -D - "http://{HOST}:{port}/reflect/'
                                               f'{nonce}?${NAME}"'], what="curl, the value in the head")
        coded = await run_ok(sb, ["bash", "-c", f'curl -sS --max-time 20 -D - --raw "http://{HOST}:{port}/gzip-te/'
                                                f'{nonce}?${NAME}" | gzip -dcf'], what="curl, transfer-coded")
    received = {path.split("/")[-1].split("-")[0]: headers.get("Authorization", "")
                for path, headers in list(ctx.echoes) if path.endswith(nonce)}
    if received.get("bound") != f"Bearer {value}":
        raise ItemFailed(f"the bound host received {clip(received.get('bound', '(no request)'), 80)!r}, not the "
                         "secret's value")
    if value in received.get("other", "") or "other" not in received:
        raise ItemFailed(f"another host received {clip(received.get('other', '(no request)'), 80)!r}: only the "
                         "placeholder may go there")
    if value in bound.stdout or value in other.stdout:
        raise ItemFailed("the server's echo of the value reached the sandbox unscrubbed")
    try:
        echoed = json.loads(bound.stdout.split("\r\n\r\n", 1)[-1])["headers"]["Authorization"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ItemFailed(f"the echo server's answer did not reach the sandbox: {clip(bound.stdout)}") from exc
    _reflections(value, placeholder, received.get("basic", ""), basic.stdout, head.stdout, coded.stdout)
    return (f"the bound host received the value, another name for the same server the placeholder, and the echo "
            f"came back as {echoed[:30]}...; Basic credentials, the answer's reason phrase and header names come "
            f"back scrubbed, a gzip transfer-coding is refused")


def _reflections(value: str, placeholder: str, received: str, basic: str, head: str, coded: str) -> None:
    """The ways a probe found the value handed back (issue 29): each must reach the sandbox without it."""
    made, theirs = (base64.b64encode(f"x:{v}".encode()).decode() for v in (value, placeholder))
    if received != f"Basic {made}":
        raise ItemFailed(f"with `curl -u` the bound host received {clip(received or '(no request)', 80)!r}, not "
                         "Basic credentials with the secret's value")
    if made in basic or f"Basic {theirs}" not in basic:
        raise ItemFailed("the echo of the Basic credentials the proxy built reached the sandbox with the value in "
                         f"their base64: {clip(basic)}")
    if value in head or f"X-{placeholder}" not in head:
        raise ItemFailed(f"the value in the answer's reason phrase or a header's name was not scrubbed: {clip(head)}")
    if value in coded or not coded.startswith("HTTP/1.1 502 ") or "Transfer-Encoding" not in coded:
        raise ItemFailed("an answer under `Transfer-Encoding: gzip, chunked` was not refused (502) on its way to "
                         f"the sandbox: {clip(coded)}")
