"""`corral bench net`: the egress proxy against direct loopback connections, measured in the same run.

Figures (median and p95, and the ratio to the baseline):
- per-request latency of a small GET on a fresh connection: direct, through the proxy as absolute-form HTTP,
  and through a CONNECT tunnel; the proxy's overhead is the difference of the medians (target: <= 2 ms)
- throughput of a large download: direct, absolute-form and CONNECT (target: >= 0.9 of direct at the median),
  the best, median (p50) and p95 round of each path (the paths interleaved, so a busy neighbour slows them
  alike), the ratios to direct of each, and the median of the per-round ratios (`paired`)
- both again as `rewritten`: absolute-form from a sandbox with a secret bound to the origin (docs/secrets.md),
  whose requests and answers the proxy parses and scrubs byte by byte instead of copying socket to socket

The origin server and the proxy each run in their own process, as in production (the proxy lives in
`corral serve`, the client in a sandbox), so the client's loop, the proxy's and the server's do not share a core
more than the machine makes them. The client speaks plain blocking sockets: the least overhead a client can have.

With `in_sandbox_too` (`--in-sandbox`), the whole path as a sandbox sees it: a runc sandbox of an engine that has
the proxy, reaching an origin on the host's loopback through its `private` allowance (agent bridge on
127.0.0.1:3128 -> Unix socket -> proxy -> origin):
- small GETs, each on a fresh connection, timed inside one Python process (urllib through the proxy) against the
  same loop on the host straight to the origin
- a large download with curl inside (absolute-form and CONNECT) against curl on the host straight to the origin
- the package mirror: `pip install` of a few small packages in a sandbox granted only `@packages`, first with an
  empty mirror cache, then in a new sandbox with the cache filled (target: the second >= 5x faster)
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

Progress = Callable[[str, int, int], None]  # (what, done, total)
MIB = 1024 * 1024

# The origin: /small answers 64 bytes, /big/N answers N bytes (a repeated random 4 MiB block). Blocking threads and
# sendall: the origin should cost as little CPU as possible, since a real one runs on another machine.
_ORIGIN = r"""
import os, socket, sys, threading
BLOCK = memoryview(os.urandom(4 * 1024 * 1024))
def serve(conn):
    with conn:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            path = head.split(b" ")[1]
            size = 64 if path == b"/small" else int(path.rsplit(b"/", 1)[1])
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            while size > 0:
                part = BLOCK[: min(size, len(BLOCK))]
                conn.sendall(part)
                size -= len(part)
def accept(server):
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
threading.Thread(target=accept, args=(server,), daemon=True).start()
sys.stdin.read()
"""

# The proxy, as `corral serve` runs it: one sandbox socket, policy `internet` plus the origin as a private pair.
_PROXY = r"""
import asyncio, dataclasses, sys
from pathlib import Path
from corral.egress import EgressPolicy, EgressProxy
from corral.egress._secrets import SecretBinding, new_placeholder
async def main(path, port):
    proxy = EgressProxy(on_event=lambda event: None)
    await proxy.start()
    policy = EgressPolicy.parse("internet", private=[f"127.0.0.1:{port}"])
    await proxy.attach("bench", Path(path), policy)
    secret = SecretBinding("TOKEN", new_placeholder(), "v" * 40, ("127.0.0.1",))
    await proxy.attach("bench-secret", Path(path + ".secret"), dataclasses.replace(policy, secrets=(secret,)))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await proxy.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3), "p95_ms": round(p95, 3),
            "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3)}


@contextmanager
def _process(args: list[str]) -> Iterator[str]:
    """Start a helper process; yield its first line of output; stop it by closing its stdin."""
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_response(sock: socket.socket, buf: bytearray) -> int:
    """Read one Content-Length response; returns the body size. `buf` is scratch space (no copies kept)."""
    view = memoryview(buf)
    got = 0
    head = b""
    while b"\r\n\r\n" not in head:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("closed before the response head")
        head += bytes(view[:n])
    head, _, rest = head.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise ConnectionError(f"unexpected response: {head[:200]!r}")
    if b"transfer-encoding: chunked" in head.lower():  # the rewriting path re-frames what it scrubs
        return _read_chunked(sock, rest)
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    got = len(rest)
    while got < length:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError(f"closed after {got} of {length} bytes")
        got += n
    return got


class _Prefixed:
    """A socket's file, with bytes already received served first."""

    def __init__(self, prefix: bytes, sock: socket.socket) -> None:
        self.prefix = prefix
        self.file = sock.makefile("rb")

    def readline(self) -> bytes:
        if b"\n" in self.prefix:
            line, _, self.prefix = self.prefix.partition(b"\n")
            return line + b"\n"
        line, self.prefix = self.prefix + self.file.readline(), b""
        return line

    def read(self, n: int) -> bytes:
        if self.prefix:
            part, self.prefix = self.prefix[:n], self.prefix[n:]
            return part
        return self.file.read(n)


def _read_chunked(sock: socket.socket, rest: bytes) -> int:
    """A chunked body's size, parsed as it arrives (the rewriting path re-frames what it scrubs)."""
    reader = _Prefixed(rest, sock)
    total = 0
    while size := int(reader.readline().split(b";")[0], 16):
        left = size
        while left:
            part = reader.read(min(left, MIB))
            if not part:
                raise ConnectionError("closed inside a chunked body")
            left -= len(part)
        total += size
        reader.read(2)
    while reader.readline() not in (b"\r\n", b""):
        pass
    return total


class _Client:
    """A fresh connection per request, the way urllib, pip or curl make one: direct, absolute-form or CONNECT."""

    def __init__(self, port: int, proxy_socket: Path) -> None:
        self.port = port
        self.proxy_socket = proxy_socket
        self.buf = bytearray(1024 * 1024)

    def get(self, mode: str, path: str) -> int:
        if mode == "direct":
            sock = socket.create_connection(("127.0.0.1", self.port))
            request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(self.proxy_socket) + (".secret" if mode == "rewritten" else ""))
            request = f"GET http://127.0.0.1:{self.port}{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        with sock:
            sock.settimeout(60)
            if mode == "connect":
                sock.sendall(f"CONNECT 127.0.0.1:{self.port} HTTP/1.1\r\n\r\n".encode())
                reply = sock.recv(4096)
                if not reply.startswith(b"HTTP/1.1 200"):
                    raise ConnectionError(f"CONNECT refused: {reply[:200]!r}")
                request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            sock.sendall(request.encode())
            return _read_response(sock, self.buf)


def _latency(client: _Client, mode: str, n: int, progress: Progress) -> list[float]:
    for _ in range(min(20, n)):  # warm up caches and the proxy's code paths
        client.get(mode, "/small")
    samples = []
    for i in range(n):
        t = time.perf_counter()
        client.get(mode, "/small")
        samples.append(time.perf_counter() - t)
        progress(f"small GET, {mode}", i + 1, n)
    return samples


def _throughput(client: _Client, size: int, rounds: int, progress: Progress) -> dict[str, dict[str, float]]:
    """Every path `rounds` times, the paths interleaved: a busy neighbour slows every path alike instead of
    whichever happened to run at the time. The best round is what a path can do, the median what it usually does,
    p95 its slow tail; `paired_*` compare each round with the direct download of the same round."""
    modes = ("direct", "absolute", "connect", "rewritten")
    times: dict[str, list[float]] = {m: [] for m in modes}
    client.get("direct", f"/big/{size}")  # warm: the origin's and the client's first big copy fault pages in
    for i in range(rounds):
        for mode in modes:
            t = time.perf_counter()
            got = client.get(mode, f"/big/{size}")
            times[mode].append(time.perf_counter() - t)
            assert got == size
        progress(f"{size // MIB} MiB downloads (direct, absolute, connect, rewritten)", i + 1, rounds)
    rates = {m: _rates(times[m], size) for m in modes}
    for mode in modes[1:]:
        paired = sorted(d / t for d, t in zip(times["direct"], times[mode], strict=True))
        rates[mode]["paired_ratio_p50"] = round(statistics.median(paired), 3)
        rates[mode]["paired_ratio_p5"] = round(_percentile(paired, 0.05), 3)  # the worst rounds but one in 20
    return rates


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rates(seconds: list[float], size: int) -> dict[str, float]:
    """Throughput of the best round, the median one (p50) and the p95 one (only 5% of rounds were slower)."""
    best, median, p95 = min(seconds), statistics.median(seconds), _percentile(seconds, 0.95)
    return {"seconds": round(best, 3), "mib_per_s": round(size / MIB / best, 1),
            "median_seconds": round(median, 3), "median_mib_per_s": round(size / MIB / median, 1),
            "p95_seconds": round(p95, 3), "p95_mib_per_s": round(size / MIB / p95, 1)}


def _ratios(rates: dict[str, dict[str, float]], base: str, key: str) -> dict[str, float]:
    return {m: round(r[key] / rates[base][key], 3) for m, r in rates.items() if m != base}


# -- in a sandbox ----------------------------------------------------------------------------------------------

DEFAULT_PACKAGES = ("six==1.16.0", "idna==3.6", "certifi==2024.2.2", "urllib3==2.2.1", "charset-normalizer==3.3.2",
                    "requests==2.31.0", "packaging==24.0", "attrs==23.2.0", "pyparsing==3.1.2", "click==8.1.7")
STATE = Path("/var/tmp/corral-bench-net")  # sandboxes run as other users: every directory on the way is 0755

# Small GETs timed in one process: urllib (a new connection per request, as pip's or a script's first request
# makes it), through the given proxy or straight to the origin. Prints the samples (seconds) as JSON.
_URLLIB = r"""
import json, os, sys, time, urllib.request
url, n, proxy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for name in ("no_proxy", "NO_PROXY", "http_proxy", "HTTP_PROXY"):
    os.environ.pop(name, None)  # NO_PROXY would keep 127.0.0.1 on the sandbox's own loopback
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy} if proxy else {}))
def get():
    with opener.open(url, timeout=30) as response:
        if len(response.read()) != 64:
            raise SystemExit("short body")
for _ in range(min(20, n)):
    get()
samples = []
for i in range(n):
    t = time.perf_counter()
    get()
    samples.append(time.perf_counter() - t)
print(json.dumps(samples))
"""


def _curl(url: str, *, proxy: str | None = None, tunnel: bool = False) -> list[str]:
    """curl downloading `url` to /dev/null, printing bytes and seconds; never any proxy unless `proxy` is given."""
    cmd = ["curl", "-sS", "--fail", "--max-time", "600", "-o", "/dev/null", "-w", "%{size_download} %{time_total}"]
    cmd += ["--noproxy", "", "-x", proxy] if proxy else ["--noproxy", "*"]
    return cmd + (["--proxytunnel"] if tunnel else []) + [url]


def _curl_seconds(output: str, size: int) -> float:
    got, seconds = output.split()
    if int(got) != size:
        raise RuntimeError(f"curl downloaded {got} of {size} bytes")
    return float(seconds)


async def _host(cmd: list[str]) -> str:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                stdin=subprocess.DEVNULL)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)[:200]} failed: {err.decode(errors='replace')[-2000:]}")
    return out.decode()


async def _in(sb: Any, cmd: list[str] | str, timeout: float = 600) -> str:
    r = await sb.exec(cmd, timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"in the sandbox, {str(cmd)[:200]} failed ({r.exit_code}): {(r.stdout + r.stderr)[-3000:]}"
                           f"{' denials: ' + str([d.reason for d in r.egress_denials]) if r.egress_denials else ''}")
    return str(r.stdout)


async def _sandbox_path(engine: Any, spec_args: dict[str, Any], port: int, n: int, size: int, rounds: int,
                        progress: Progress) -> dict[str, Any]:
    from corral.engine import SandboxSpec

    small = f"http://127.0.0.1:{port}/small"
    big = f"http://127.0.0.1:{port}/big/{size}"
    spec = SandboxSpec(network=("127.0.0.1",), network_private=(f"127.0.0.1:{port}",), **spec_args)
    async with await engine.create(spec) as sb:
        progress("in a sandbox: small GETs (sandbox via proxy, host direct)", 0, 2)
        inside = json.loads(await _in(sb, ["python3", "-c", _URLLIB, small, str(n), "http://127.0.0.1:3128"]))
        progress("in a sandbox: small GETs (sandbox via proxy, host direct)", 1, 2)
        host = json.loads(await _host([sys.executable, "-c", _URLLIB, small, str(n), ""]))
        progress("in a sandbox: small GETs (sandbox via proxy, host direct)", 2, 2)
        latency = {"host_direct": summary(host), "sandbox_proxy": summary(inside)}
        proxy = "http://127.0.0.1:3128"
        paths: dict[str, Callable[[], Awaitable[str]]] = {
            "host_direct": lambda: _host(_curl(big)),
            "sandbox_absolute": lambda: _in(sb, _curl(big, proxy=proxy)),
            "sandbox_connect": lambda: _in(sb, _curl(big, proxy=proxy, tunnel=True))}
        times: dict[str, list[float]] = {p: [] for p in paths}
        await paths["sandbox_absolute"]()  # warm: the first big copy in a fresh sandbox pays for its page cache
        for i in range(rounds):
            for name, fetch in paths.items():
                times[name].append(_curl_seconds(await fetch(), size))
            progress(f"in a sandbox: {size // MIB} MiB curl downloads (host, absolute, connect)", i + 1, rounds)
    throughput = {p: _rates(t, size) for p, t in times.items()}
    return {
        "latency_small_get_urllib": latency,
        "overhead_p50_ms": round(latency["sandbox_proxy"]["p50_ms"] - latency["host_direct"]["p50_ms"], 3),
        "overhead_p95_ms": round(latency["sandbox_proxy"]["p95_ms"] - latency["host_direct"]["p95_ms"], 3),
        "throughput_curl": throughput,
        "throughput_ratio": _ratios(throughput, "host_direct", "mib_per_s"),
        "throughput_ratio_median": _ratios(throughput, "host_direct", "median_mib_per_s"),
        "throughput_ratio_p95": _ratios(throughput, "host_direct", "p95_mib_per_s"),
    }


async def _package_cache(engine: Any, spec_args: dict[str, Any], packages: tuple[str, ...],
                         progress: Progress) -> dict[str, Any]:
    """pip install in a sandbox granted only `@packages`: the mirror's cache empty, then filled (new sandbox)."""
    from corral.engine import SandboxSpec

    cmd = "pip install --no-cache-dir --user --ignore-installed --disable-pip-version-check -q " + " ".join(
        shlex.quote(p) for p in packages)
    check = "python3 -c 'import " + ", ".join(p.split("==")[0].replace("-", "_") for p in packages) + "'"
    seconds = []
    for i in range(2):
        async with await engine.create(SandboxSpec(network=("@packages",), **spec_args)) as sb:
            t = time.perf_counter()
            await _in(sb, "python3 -m pip --version")  # also: the sandbox is up, pip is in the page cache
            startup = time.perf_counter() - t
            t = time.perf_counter()
            await _in(sb, cmd)
            seconds.append(time.perf_counter() - t)
            await _in(sb, check)
        progress("in a sandbox: pip install, mirror cache empty then filled", i + 1, 2)
    first, second = seconds
    return {"packages": list(packages), "command": cmd, "first_s": round(first, 2), "second_s": round(second, 2),
            "speedup": round(first / second, 2), "target_speedup": 5.0,
            # pip's own start-up (`pip --version`), which no cache shortens, and the speedup of the rest
            "pip_startup_s": round(startup, 2),
            "speedup_beyond_pip_startup": round((first - startup) / max(second - startup, 0.01), 2)}


async def in_sandbox(*, template_home: Path, n: int, size: int, rounds: int, packages: tuple[str, ...],
                     progress: Progress) -> dict[str, Any]:
    """The sandbox side: an engine with the proxy (and a package mirror on a fresh cache), as `corral serve` has."""
    from corral.backends.local import LocalBackend
    from corral.egress import EgressProxy, PackageMirror
    from corral.engine import Engine, Limits
    from corral.templates import TemplateStore

    STATE.mkdir(mode=0o755, exist_ok=True)
    STATE.chmod(0o755)
    home = Path(tempfile.mkdtemp(prefix="run-", dir=STATE))
    home.chmod(0o755)  # mkdtemp makes it 0700: sandbox users could not reach their egress socket
    cpus = float(os.cpu_count() or 1)
    spec_args: dict[str, Any] = {"limits": Limits(cpus=cpus, memory=2 * 1024**3)}  # the path, not the quota
    results: dict[str, Any] = {"sandbox_limits": {"cpus": cpus, "memory_mib": 2048}}
    mirror = PackageMirror(home / "packages")
    proxy = EgressProxy(mirror=mirror)
    await proxy.start()
    engine = Engine(home, backend=LocalBackend(home, cgroup_parent="corral-bench-net"),
                    templates=TemplateStore(template_home), egress=proxy)
    await engine.start()
    try:
        with _process(["-c", _ORIGIN]) as port:
            results.update(await _sandbox_path(engine, spec_args, int(port), n, size, rounds, progress))
        if packages:
            try:
                results["package_cache"] = await _package_cache(engine, spec_args, packages, progress)
            except RuntimeError as exc:  # the registries are out of our hands: report it, keep the other figures
                results["package_cache"] = {"error": str(exc)[-3000:]}
            results["package_cache"]["mirror_stats"] = mirror.stats
    finally:
        await engine.close(destroy_all=True)
        await proxy.close()
        await mirror.close()
        shutil.rmtree(home, ignore_errors=True)
    return results


def run(*, home: Path, template_home: Path | None = None, n: int = 300, size_mib: int = 200, rounds: int = 20,
        in_sandbox_too: bool = False, sandbox_n: int | None = None, packages: tuple[str, ...] = DEFAULT_PACKAGES,
        progress: Progress | None = None) -> dict[str, Any]:
    """`n` small GETs per path, `rounds` downloads of `size_mib` per path; with `in_sandbox_too`, the same from
    inside a sandbox (`sandbox_n` GETs, default `n`) and the package-cache figures (`packages`; empty: skipped)."""
    progress = progress or (lambda what, done, total: None)
    work = Path(tempfile.mkdtemp(prefix="corral-bench-net-"))
    proxy_socket = work / "proxy.sock"
    size = size_mib * MIB
    try:
        with _process(["-c", _ORIGIN]) as port_line, \
                _process(["-c", _PROXY, str(proxy_socket), port_line]) as ready:
            assert ready == "ready", f"the proxy did not start: {ready!r}"
            client = _Client(int(port_line), proxy_socket)
            latency = {mode: summary(_latency(client, mode, n, progress))
                       for mode in ("direct", "absolute", "connect", "rewritten")}
            throughput = _throughput(client, size, rounds, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    direct = latency["direct"]["p50_ms"]
    results: dict[str, Any] = {
        "latency_small_get": latency,
        "overhead_p50_ms": {m: round(latency[m]["p50_ms"] - direct, 3) for m in ("absolute", "connect", "rewritten")},
        "overhead_p95_ms": {m: round(latency[m]["p95_ms"] - latency["direct"]["p95_ms"], 3)
                            for m in ("absolute", "connect", "rewritten")},
        "throughput": throughput,
        "throughput_ratio": _ratios(throughput, "direct", "mib_per_s"),
        "throughput_ratio_median": _ratios(throughput, "direct", "median_mib_per_s"),
        "throughput_ratio_p95": _ratios(throughput, "direct", "p95_mib_per_s"),
        "throughput_ratio_paired_p50": {m: r["paired_ratio_p50"] for m, r in throughput.items() if m != "direct"},
        "targets": {"overhead_p50_ms_max": 2.0, "throughput_ratio_min": 0.9, "package_cache_speedup_min": 5.0},
        "cpus": os.cpu_count(),
    }
    if in_sandbox_too:
        results["in_sandbox"] = asyncio.run(in_sandbox(
            template_home=template_home or Path("/var/lib/corral"), n=sandbox_n or n, size=size, rounds=rounds,
            packages=tuple(packages), progress=progress))
    return results
