"""`corral bench e2b`: E2B's own SDKs (`e2b`, `e2b-code-interpreter` from PyPI) against Corral's E2B API, beside the
same operations through Corral's own SDK, on the same `corral serve` in the same run.

Figures (p50 and p95 of each, and the ratio E2B path / native path of the p50s; the target is <= 1.5):
- create to first command: `Sandbox.create` then `commands.run("true")`, the sandbox killed after each sample
- command round trip of `true` in a running sandbox (`bash -lc true` on both paths: E2B's SDK runs every command
  in a login shell, and so does Corral's for a command given as a string)
- a 100 MiB file (`--size-mib`) both ways (`files.write` of a file object, `files.read` as bytes), every byte checked
- `run_code("1+1")` in a warm default context

Both paths go through the same service layer and the same sandboxes: what is measured is each front end's own
cost (E2B's Connect-RPC over HTTP/1.1 and its JSON bodies against Corral's REST and NDJSON) and each SDK's.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral import Admin
from corral import Sandbox as CorralSandbox
from corral.server import ServerProcess

Progress = Callable[[str, int, int], None]  # (what, done, total)

MIB = 2**20
TARGET_RATIO = 1.5


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2)}


def _timed(n: int, what: str, progress: Progress, fn: Callable[[], Any]) -> dict[str, float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        progress(what, i + 1, n)
    return summary(samples)


def _pair(native: dict[str, float], e2b: dict[str, float]) -> dict[str, Any]:
    return {"native": native, "e2b": e2b, "ratio_p50": round(e2b["p50_ms"] / native["p50_ms"], 2),
            "target": TARGET_RATIO}


class _Client:
    """What both SDKs do alike: a file object uploads streamed (E2B's SDK: as octet-stream), a cell is `run_code`."""

    @staticmethod
    def upload(sb: Any, src: Path) -> None:
        with open(src, "rb") as f:
            sb.files.write("/home/user/big.bin", f)

    @staticmethod
    def one_plus_one(sb: Any) -> None:
        assert sb.run_code("1+1").text == "2"


class _Native(_Client):
    """Corral's own SDK."""

    def __init__(self, url: str, key: str, template: str) -> None:
        self.opts = {"api_key": key, "base_url": url}
        self.template = template

    def create_and_run(self) -> None:
        sb = CorralSandbox.create(template=self.template, **self.opts)
        try:
            assert sb.commands.run("true").exit_code == 0
        finally:
            sb.kill()

    def open(self) -> Any:
        return CorralSandbox.create(template=self.template, timeout=600, limits={"disk": "2G"}, **self.opts)

    @staticmethod
    def run_true(sb: Any) -> None:
        assert sb.commands.run("true").exit_code == 0  # `bash -lc true`, as E2B's SDK runs every command

    @staticmethod
    def download(sb: Any) -> bytes:
        data: bytes = sb.files.read("/home/user/big.bin")
        return data



class _E2B(_Client):
    """E2B's SDKs, configured as an E2B user configures them: the environment alone."""

    def __init__(self, url: str, key: str, template: str) -> None:
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key, E2B_VALIDATE_API_KEY="false")
        for name in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
            os.environ.pop(name, None)
        from e2b_code_interpreter import Sandbox  # a subclass of e2b.Sandbox with run_code

        self.sandbox = Sandbox
        self.template = template

    def create_and_run(self) -> None:
        sb = self.sandbox.create(self.template)
        try:
            sb.commands.run("true")
        finally:
            sb.kill()

    def open(self) -> Any:
        return self.sandbox.create(self.template, timeout=600)

    @staticmethod
    def run_true(sb: Any) -> None:
        sb.commands.run("true")

    @staticmethod
    def download(sb: Any) -> bytes:
        return bytes(sb.files.read("/home/user/big.bin", format="bytes"))



def _measure(client: Any, label: str, n: int, src: Path, digest: str, rounds: int,
             progress: Progress) -> dict[str, dict[str, float]]:
    out = {"create_first_command": _timed(max(5, n // 4), f"{label}: create + first command", progress,
                                          client.create_and_run)}
    sb = client.open()
    try:
        client.run_true(sb)
        out["command_true"] = _timed(n, f"{label}: command true", progress, lambda: client.run_true(sb))
        client.one_plus_one(sb)  # the default context started
        out["run_code_1_plus_1"] = _timed(n, f"{label}: run_code 1+1", progress, lambda: client.one_plus_one(sb))
        out["upload"] = _timed(rounds, f"{label}: upload", progress, lambda: client.upload(sb, src))
        downloads: list[float] = []
        for i in range(rounds):
            t = time.perf_counter()
            data = client.download(sb)
            downloads.append(time.perf_counter() - t)
            if hashlib.sha256(data).hexdigest() != digest:
                raise RuntimeError(f"{label}: the download differs from what was uploaded")
            progress(f"{label}: download", i + 1, rounds)
        out["download"] = summary(downloads)
    finally:
        sb.kill()
    return out


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 100, size_mib: int = 100,
        rounds: int = 5, progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    home.mkdir(parents=True, exist_ok=True)
    src = home / "payload.bin"
    src.write_bytes(os.urandom(size_mib * MIB))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    results: dict[str, Any] = {"template": template, "n": n, "size_mib": size_mib, "cpus": os.cpu_count(),
                               "load_avg_1m_at_start": os.getloadavg()[0]}
    with ServerProcess(home / "server", template_home=template_home) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("bench")
            key = admin.keys.create("bench", "developer").key
        native = _measure(_Native(server.url, key, template), "native", n, src, digest, rounds, progress)
        e2b = _measure(_E2B(server.url, key, template), "e2b", n, src, digest, rounds, progress)
    results["figures"] = {name: _pair(native[name], e2b[name]) for name in native}
    for name in ("upload", "download"):
        for side in ("native", "e2b"):
            figure = results["figures"][name][side]
            figure["p50_mb_s"] = round(size_mib * MIB / (figure["p50_ms"] / 1000) / 1e6, 1)
    results["within_target"] = all(f["ratio_p50"] <= TARGET_RATIO for f in results["figures"].values())
    return results
