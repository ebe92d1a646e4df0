"""The OCI runtime CLI (runc, or runsc for gVisor): the boundary where its failures become Corral errors."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._exceptions import ConflictError, RuntimeUnavailableError, ServerError
from ._system import run

INSTALL_HINT = {
    "runc": "apt-get install runc",
    "runsc": "apt-get install runsc (gVisor)",
}


# Tries at freezing a tree that keeps forking (see `pause`), with a backoff of 50 ms more each time up to
# 250 ms: about 2.5 s in all, which a busy build on 2 CPUs needs under the cgroup v1 freezer (6 were not enough).
_PAUSE_ATTEMPTS = 12
_PAUSE_BACKOFF_MAX = 0.25


@dataclass(frozen=True)
class OCIRuntime:
    name: str  # "runc" | "runsc"
    state_root: Path

    @property
    def binary(self) -> str:
        path = shutil.which(self.name)
        if path is None:
            raise RuntimeUnavailableError(
                f"the OCI runtime {self.name!r} is not installed; install it with `{INSTALL_HINT[self.name]}`")
        return path

    def _base(self) -> list[str]:
        argv = [self.binary, "--root", str(self.state_root)]
        if self.name == "runsc":
            # The KVM platform hangs on many hosts; ptrace works everywhere gVisor does. `network=none` is
            # loopback only. The root stays on our disk image (no in-memory overlay, which would bypass the
            # disk quota). The agent creates its socket on a host directory, since runsc cannot inherit one.
            # No --oci-seccomp: gVisor's own kernel is the syscall boundary, and this build ignores errnoRet
            # (clone3 gets EPERM instead of ENOSYS, so glibc cannot start threads).
            argv += ["--platform=ptrace", "--network=none", "--overlay2=none",
                     "--host-uds=all"]  # create: the agent's socket; open: the egress proxy's
        return argv

    @property
    def inherits_fds(self) -> bool:
        return self.name == "runc"

    async def start(self, container_id: str, bundle: Path, *, listen_fd: int | None, log: Path,
                    timeout: float = 60.0) -> None:
        """`run --detach`: returns once the container's PID 1 (the agent) is running."""
        self.state_root.mkdir(parents=True, exist_ok=True)
        argv = [*self._base(), "run", "--detach", "--bundle", str(bundle), "--pid-file", str(bundle / "pid"),
                container_id]
        with open(log, "ab") as logf:
            # With --detach the runtime hands its own stdio to the container's PID 1: stdout and stderr go to a
            # log file (never a pipe we would wait on), and stdin *is* the agent's listening socket. That
            # passes the socket without `--preserve-fds` and the `preexec_fn` that renumbering it would need
            # (which forces a full fork of this big process: milliseconds per sandbox).
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=listen_fd if listen_fd is not None else asyncio.subprocess.DEVNULL,
                stdout=logf, stderr=logf,
            )
        try:
            async with asyncio.timeout(timeout):
                code = await proc.wait()
        except TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise ServerError(f"{self.name} did not start sandbox {container_id} within {timeout:.0f}s") from exc
        if code != 0:
            detail = _tail(log)
            raise ServerError(f"{self.name} failed to start sandbox {container_id} (exit {code}): {detail}")

    async def state(self, container_id: str) -> dict[str, Any] | None:
        code, out = await run([*self._base(), "state", container_id], what="reading sandbox state", check=False)
        if code != 0:
            return None
        try:
            state: dict[str, Any] = json.loads(out)
        except ValueError:
            return None
        return state

    async def list(self) -> list[dict[str, Any]]:
        if not self.state_root.exists():
            return []
        code, out = await run([*self._base(), "list", "--format", "json"], what="listing sandboxes", check=False)
        if code != 0 or not out.strip() or out.strip() == "null":
            return []
        try:
            items: list[dict[str, Any]] = json.loads(out)
        except ValueError:
            return []
        return items

    async def kill(self, container_id: str, signal: str = "KILL") -> None:
        await run([*self._base(), "kill", container_id, signal], what="killing a sandbox", check=False)

    async def delete(self, container_id: str) -> None:
        await run([*self._base(), "delete", "--force", container_id], what="deleting a sandbox", check=False,
                  timeout=30)

    async def pause(self, container_id: str) -> None:
        # The cgroup v1 freezer cannot freeze a process tree that keeps forking: runc gives up ("unable to
        # freeze") and thaws it again. Found by the eval corpus (pause while forking); usually the next try
        # lands between forks, so retry briefly, then say what happened instead of a bare runtime failure.
        text = ""
        for attempt in range(_PAUSE_ATTEMPTS):
            code, text = await run([*self._base(), "pause", container_id], what="pausing a sandbox", check=False)
            if code == 0:
                return
            if "unable to freeze" not in text:
                raise ServerError(f"pausing a sandbox failed: {self.name} pause exited {code}: {text[-2000:]}")
            await asyncio.sleep(min(_PAUSE_BACKOFF_MAX, 0.05 * (attempt + 1)))
        raise ConflictError(
            f"sandbox {container_id} could not be paused: its processes kept changing while the cgroup freezer "
            f"tried to stop them ({_PAUSE_ATTEMPTS} attempts: {text[-300:]}); it is still running, try again",
            details={"retryable": True})

    async def resume(self, container_id: str) -> None:
        await run([*self._base(), "resume", container_id], what="resuming a sandbox")


def _tail(log: Path, limit: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-limit:].strip() or "(no output)"
    except OSError:
        return "(no log)"
