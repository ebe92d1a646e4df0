"""Items 2, 19 and 36: the agent channel, the symlink-swap race and failing closed.

Parts of them need the host: the agent's socket and token live in the server's state directory, a canary file
on the host is what an escaping transfer would return, and failing closed is observed by starting an engine on
the server's backend (`GET /v1/info`) without its runtime. Those parts run when the server is on this machine
(`Target.home`, or a loopback URL for the canary), and say so when they cannot.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._exceptions import AgentError, CorralError
from ._context import CheckContext, clip, readable_dir, run_json
from ._model import ItemFailed, NotApplicable

if TYPE_CHECKING:
    from ..backends import AgentAddress

__all__ = ["item_02_agent_channel", "item_19_symlink_swap_race", "item_36_fail_closed"]

# A backend whose agent listens on TCP at the sandbox's own address (the Kubernetes backend: a Pod's IP, admitted by
# NetworkPolicy from the control plane only): item 2 allows that one listener, and says so.
AGENT_TCP_LIMITATION = "agent_tcp"

LISTEN_PROBE = r"""
import json, socket
own = socket.socket()
own.bind(("127.0.0.1", 0))
own.listen(1)  # a listener the probe must see, or it sees nothing at all
listening = []
for name in ("/proc/net/tcp", "/proc/net/tcp6", "/proc/net/udp", "/proc/net/udp6"):
    try:
        with open(name) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        fields = line.split()
        if "tcp" in name and fields[3] != "0A":  # LISTEN
            continue
        listening.append([name.rsplit("/", 1)[1], fields[1]])
print(json.dumps({"own": "%04X" % own.getsockname()[1], "listening": listening}))
"""


def _loopback(address: str) -> bool:
    """A /proc/net address (`0100007F:1F90`): IPv4 127/8 (little-endian, so the first octet is last), ::1, or an
    IPv4-mapped 127/8."""
    host = address.split(":")[0]
    if len(host) == 8:
        return host.endswith("7F")
    return host == "00000000000000000000000001000000" or (host.startswith("0000000000000000FFFF0000")
                                                          and host.endswith("7F"))


async def item_02_agent_channel(ctx: CheckContext) -> str:
    """Nothing listens inside a sandbox on a non-loopback address; with the state directory at hand, the agent's
    socket is its owner's only and refuses requests without the sandbox's own token."""
    async with ctx.sandbox() as sb, ctx.sandbox() as other:
        out = await run_json(sb, LISTEN_PROBE, what="listening sockets")
        token = await _agent_refuses_bad_tokens(ctx, sb.id, other.id)
    if not any(addr.endswith(":" + out["own"]) for _, addr in out["listening"]):
        raise ItemFailed(f"the probe did not see its own listener in /proc/net: {out['listening']}")
    exposed, agent = exposed_listeners(out["listening"], ctx.deployment.limitations)
    if exposed:
        raise ItemFailed(f"listening on non-loopback addresses inside a sandbox: {', '.join(exposed)}")
    if agent:
        return (f"only loopback listeners inside ({len(out['listening'])} seen) besides the agent's own TCP "
                f"listener ({agent}: {AGENT_TCP_LIMITATION}); {token}")
    return f"only loopback listeners inside ({len(out['listening'])} seen); {token}"


def exposed_listeners(listening: list[list[str]], limitations: Mapping[str, str]) -> tuple[list[str], str]:
    """The non-loopback listeners of a sandbox that only the probe and the agent run in, and the agent's own
    where the backend declares `agent_tcp` (a Pod's agent listens on its IP: the one TCP listener allowed)."""
    exposed = [f"{kind} {addr}" for kind, addr in listening if not _loopback(addr)]
    tcp = [entry for entry in exposed if entry.startswith("tcp")]
    if AGENT_TCP_LIMITATION in limitations and len(tcp) == 1:
        exposed.remove(tcp[0])
        return exposed, tcp[0]
    return exposed, ""


async def _agent_refuses_bad_tokens(ctx: CheckContext, sid: str, other_sid: str) -> str:
    from ..backends import UnixEndpoint
    from ..engine import AgentClient  # the engine (and pydantic) load only when the agent is probed

    home = ctx.home
    if home is None or not readable_dir(home / "engine"):
        return ("the agent's token was not probed: that needs the server's state directory on this machine "
                "(`--home`)")
    address = _agent_address(home, sid)
    other_token = _agent_address(home, other_sid).token
    endpoint = address.endpoint
    await AgentClient(endpoint, address.token).ping()  # the control: the right token works, so refusals mean something
    for label, bad in (("no token", ""), ("a guessed token", "x" * 43), ("another sandbox's token", other_token)):
        try:
            await AgentClient(endpoint, bad).ping()
        except AgentError as exc:
            raise ItemFailed(f"the agent broke on a request with {label}: {exc.message}") from exc
        except CorralError as exc:
            if "token" not in exc.message:
                raise ItemFailed(f"a request with {label} was refused, but not for its token: {exc.message}") from exc
            continue
        raise ItemFailed(f"the agent answered a request with {label}",
                         fix="upgrade Corral: the agent must check its per-sandbox token on every request")
    if not isinstance(endpoint, UnixEndpoint):
        return "the agent (over TCP) refused no token, a guessed one and another sandbox's"
    sock = Path(endpoint.path)
    mode = sock.stat().st_mode & 0o777
    if mode & 0o077:
        raise ItemFailed(f"the agent's socket {sock} is mode {mode:o}: other users of the host can connect",
                         fix="upgrade Corral; do not change permissions under the state directory")
    return f"the agent's socket (mode {mode:o}) refused no token, a guessed one and another sandbox's"


def _agent_address(home: Path, sid: str) -> AgentAddress:
    from ..engine import read_agent_address

    try:
        return read_agent_address(home, sid)
    except (OSError, ValueError, KeyError, CorralError) as exc:
        raise ItemFailed(f"sandbox {sid} has no readable engine state under {home}/engine: is `--home` the "
                         f"server's state directory? ({exc})", fix="pass the server's CORRAL_HOME as --home") from exc


SWAPPER = r"""
import ctypes, os, sys, time
canary, seconds = sys.argv[1], float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
os.chdir("/workspace")
os.makedirs("d" + canary, exist_ok=True)
with open("d" + canary + "/f", "w") as f:
    f.write("SANDBOX-DIR")
os.makedirs(canary, exist_ok=True)
with open(canary + "/f", "w") as f:
    f.write("SANDBOX-ROOT")
os.symlink("/", "d.alt")
n = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    if libc.renameat2(-100, b"d", -100, b"d.alt", 2) != 0:  # RENAME_EXCHANGE: an atomic swap
        os.rename("d", "d.tmp"); os.rename("d.alt", "d"); os.rename("d.tmp", "d.alt")
    n += 1
    if n % 500 == 0:  # replaced whole, never truncated in place: a read between truncate and write saw "0"
        with open("/tmp/swaps.new", "w") as f:
            f.write(str(n))
        os.replace("/tmp/swaps.new", "/tmp/swaps")
"""
RACE_OPS = 150
MIN_SWAPS = 1000
OWN_CONTENT = (b"SANDBOX-DIR", b"SANDBOX-ROOT")


async def item_19_symlink_swap_race(ctx: CheckContext) -> str:
    """While a sandbox swaps a directory with a symlink to `/` as fast as it can, downloads and uploads through
    the swapping path only ever see the sandbox's own files (a host canary stays untouched)."""
    canary = Path(f"/tmp/corral-check-canary-{secrets.token_hex(6)}")
    secret = f"HOST-CANARY-{secrets.token_hex(16)}".encode()
    local = ctx.target.on_this_machine
    if local:
        canary.mkdir(mode=0o755)
        (canary / "f").write_bytes(secret)
    try:
        outcomes, swaps = await _race(ctx, canary, secret)
        if local and ((canary / "f").read_bytes() != secret or sorted(p.name for p in canary.iterdir()) != ["f"]):
            raise ItemFailed(f"a write through the swapping path changed the host canary {canary}")
    finally:
        if local:
            shutil.rmtree(canary, ignore_errors=True)
    if swaps < MIN_SWAPS:
        raise ItemFailed(f"only {swaps} swaps happened during {RACE_OPS} transfers: the race was not exercised")
    where = "with a host canary" if local else "without a host canary (the server is not on this machine)"
    seen = ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()))
    return f"{RACE_OPS} transfers during {swaps} swaps, {where}, never escaped ({seen})"


def _host_shadow() -> bytes | None:
    try:
        return Path("/etc/shadow").read_bytes()
    except OSError:
        return None


async def _race(ctx: CheckContext, canary: Path, secret: bytes) -> tuple[Counter[str], int]:
    host_shadow = _host_shadow() if ctx.target.on_this_machine else None
    outcomes: Counter[str] = Counter()
    async with ctx.sandbox() as sb:
        swapper = await sb.commands.run(["python3", "-c", SWAPPER, str(canary), "90"], background=True, timeout=120)
        for _ in range(150):
            if await sb.files.exists("/tmp/swaps"):
                break
            await asyncio.sleep(0.1)
        else:
            raise ItemFailed("the swapper never started swapping")
        target = f"/workspace/d{canary}/f"
        written: set[bytes] = set()
        for i in range(RACE_OPS):
            try:
                if i % 2:
                    data = f"W{i}".encode()
                    async with asyncio.timeout(30):
                        await sb.files.write(target, data)
                    written.add(data)
                    outcomes["write ok"] += 1
                    continue
                path = "/workspace/d/etc/shadow" if i % 10 == 0 else target
                async with asyncio.timeout(30):
                    data = await sb.files.read(path)
            except AgentError as exc:
                raise ItemFailed(f"the agent failed during the race (transfer {i}): {exc.message}") from exc
            except CorralError as exc:
                outcomes[exc.code] += 1
                continue
            if secret in data or (host_shadow is not None and data == host_shadow):
                raise ItemFailed(f"download {i} of {path} returned the host's file", fix=ITEM_19_FIX)
            if path == target and data not in OWN_CONTENT and data not in written:
                raise ItemFailed(f"download {i} of {path} returned bytes the sandbox never wrote there: "
                                 f"{clip(data, 80)!r}", fix=ITEM_19_FIX)
            outcomes["read " + ("own file" if path == target else "sandbox's /etc/shadow")] += 1
        swaps = int((await sb.files.read("/tmp/swaps")).decode() or 0)
        await sb.commands.kill(swapper.id)
    return outcomes, swaps


ITEM_19_FIX = "upgrade Corral: transfers must resolve paths inside the sandbox, never follow links on the host"

FAIL_CLOSED_PROBE = r"""
import asyncio, json, sys
from pathlib import Path
from corral import CorralError
from corral.backends import load_backend
from corral.engine import Engine, SandboxSpec
from corral.templates import TemplateStore
home, templates, template = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
backend, options = sys.argv[4], json.loads(sys.argv[5])
async def main():
    engine = Engine(home, load_backend(backend, home, **options), templates=TemplateStore(templates))
    stage = "starting the engine"
    try:
        await engine.start()
        stage = "creating a sandbox"
        sb = await engine.create(SandboxSpec(template=template))
    except CorralError as exc:
        return {"error": type(exc).__name__, "code": exc.code, "message": exc.message, "stage": stage,
                "listed": [s.id for s in engine.list()]}
    finally:
        await engine.close(destroy_all=True)
    return {"created": sb.id}
print(json.dumps(asyncio.run(main())))
"""


@dataclass(frozen=True)
class _NoRuntime:
    """How item 36 takes a backend's runtime away in its probe, and what the refusal must then name."""

    what: str  # for the report: "with no OCI runtime on PATH"
    names: str  # the refusal's message must name it
    empty_path: bool = False  # run the probe with an empty PATH
    socket_option: str = ""  # the backend's option naming its runtime's socket: given one that does not exist


# The backends whose runtime the probe knows how to take away; on any other, item 36 is N/A, saying so.
NO_RUNTIME = {
    "local": _NoRuntime("with no OCI runtime on PATH", "runc", empty_path=True),
    "docker": _NoRuntime("with no Docker daemon at its socket", "Docker daemon", socket_option="base_url"),
}


async def item_36_fail_closed(ctx: CheckContext) -> str:
    """An engine on this machine, on the server's own backend, whose runtime cannot be reached (runc off PATH;
    no Docker daemon at its socket) refuses to create a sandbox, with a clear error, and leaves nothing
    behind."""
    if ctx.home is None:
        raise NotApplicable("failing closed is observed on the server's machine: run `corral check --home "
                            "<the server's state directory>` there")
    if not readable_dir(ctx.home / "templates"):
        raise NotApplicable(f"{ctx.home}/templates is not readable here: the probe needs the server's templates")
    backend = ctx.deployment.backend
    how = NO_RUNTIME.get(backend)
    if how is None:
        raise NotApplicable(f"failing closed is probed on the {' and '.join(NO_RUNTIME)} backends; the server "
                            f"runs the {backend} backend")
    with tempfile.TemporaryDirectory(prefix="corral-check-") as tmp:
        home, empty = Path(tmp) / "home", Path(tmp) / "bin"
        empty.mkdir()
        options = {how.socket_option: f"unix://{tmp}/no-such.sock"} if how.socket_option else {}
        result = await asyncio.to_thread(_fail_closed_probe, home, ctx.home, ctx.target.template, backend, options,
                                         empty if how.empty_path else None)
        left = _left_behind(home)
    if "created" in result:
        raise ItemFailed(f"{how.what}, an engine on the {backend} backend still created a sandbox: it runs bare")
    if result.get("code") != "runtime_unavailable" or how.names not in result.get("message", ""):
        raise ItemFailed(f"{how.what}, {result.get('stage')} on the {backend} backend failed with "
                         f"{result.get('error')} ({result.get('code')}): {result.get('message')} (expected "
                         f"runtime_unavailable naming the {how.names})")
    if result.get("listed") or left:
        raise ItemFailed(f"the refused create left things behind: {result.get('listed') or ''} {left}")
    return (f"{how.what} ({backend} backend), {result['stage']} failed: runtime_unavailable "
            f"({clip(result['message'], 120)}); nothing left behind")


def _fail_closed_probe(home: Path, templates: Path, template: str, backend: str, options: dict[str, str],
                       path: Path | None) -> dict[str, str]:
    """Run the probe in a child process: its own engine lock, and its own PATH (without the runtime) if given."""
    env = {**os.environ, "CORRAL_HOME": str(home), **({"PATH": str(path)} if path is not None else {})}
    proc = subprocess.run([sys.executable, "-c", FAIL_CLOSED_PROBE, str(home), str(templates), template, backend,
                           json.dumps(options)], env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ItemFailed(f"the fail-closed probe crashed (exit {proc.returncode}): {clip(proc.stderr, 500)}")
    result: dict[str, str] = json.loads(lines[-1])
    return result


def _left_behind(home: Path) -> list[str]:
    found: list[str] = []
    for where in ("sandboxes", "docker"):  # the local and the Docker backends' sandbox directories
        if (home / where).is_dir():
            found += [f"sandbox directory {where}/{p.name}" for p in (home / where).iterdir() if p.is_dir()]
    found += [f"engine state {p.name}" for p in (home / "engine").glob("*.json")]
    prefix = str(home).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if line.split()[4].startswith(prefix)]
    for runtime in ("runc", "runsc"):
        root = home / "runtime" / runtime
        if root.is_dir() and any(root.iterdir()):
            found.append(f"{runtime} state {sorted(p.name for p in root.iterdir())}")
    return found
