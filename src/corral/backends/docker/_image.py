"""Templates as Docker images: a template's root filesystem imported (`docker import`) as a one-layer image.

No registry is involved: the root filesystem on this machine is streamed as a tar to the daemon, tagged by the
template's content digest (`corral-template:v1-<digest>`) and kept. Importing the 1.7 GB default template takes
about a minute; every later sandbox of the same digest reuses the image. Ownership is kept as it is on disk
(numeric ids, no shifting): without a user namespace the container sees the template's files exactly as the
host does, owned by root and read-only to the sandbox user.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..._exceptions import ServerError
from ...templates import Template
from ._api import DockerAPI

__all__ = ["IMAGE_FORMAT", "REPOSITORY", "Images", "image_ref"]

REPOSITORY = "corral-template"
IMAGE_FORMAT = 1  # bump when what goes into the image changes: the tag then names a new image
LOCK_DIR = Path("/run/corral")  # machine-wide, like the daemon: two engines never import the same digest twice
_CHUNK = 1 << 20


def image_ref(template: Template) -> str:
    # A tag is [A-Za-z0-9_.-], at most 128 characters; store digests are hex, but a tag must never be invalid.
    digest = re.sub(r"[^A-Za-z0-9_.-]", "-", template.digest)
    return f"{REPOSITORY}:v{IMAGE_FORMAT}-{digest}"[: len(REPOSITORY) + 1 + 128]


class Images:
    """The image of each template, imported on first use; concurrent creates wait for the one import."""

    def __init__(self, api: DockerAPI) -> None:
        self.api = api
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, template: Template) -> str:
        """The image reference for `template`, imported now if the daemon does not have it."""
        ref = image_ref(template)
        if await self.api.image(ref) is not None:
            return ref
        async with self._locks.setdefault(template.digest, asyncio.Lock()):
            if await self.api.image(ref) is not None:
                return ref
            lock_fd = await asyncio.to_thread(_lock, template.digest)
            try:
                if await self.api.image(ref) is None:  # another process may have imported it meanwhile
                    await self._import(template, ref)
            finally:
                os.close(lock_fd)
        return ref

    async def remove(self, template: Template) -> None:
        """Remove the template's image (sandboxes still running on it keep it until they are gone: the daemon
        refuses, and that refusal is raised as a `ConflictError`)."""
        await self.api.remove_image(image_ref(template))

    async def _import(self, template: Template, ref: str) -> None:
        repository, tag = ref.split(":", 1)
        labels = {"corral.template.digest": template.digest, "corral.template.name": template.name,
                  "corral.image-format": str(IMAGE_FORMAT)}
        changes = [f"LABEL {key}={json.dumps(value)}" for key, value in labels.items()]
        await self.api.import_image(_tar_stream(template.rootfs), repository, tag, changes)
        found = await self.api.image(ref) or {}
        if ((found.get("Config") or {}).get("Labels") or {}).get("corral.template.digest") != template.digest:
            await self.api.remove_image(ref)
            raise ServerError(f"importing template {template.name} as {ref} did not make the expected image")


def _lock(digest: str) -> int:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_DIR / f"docker-import-{digest}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _tar_stream(rootfs: Path) -> Iterator[bytes]:
    """The root filesystem as an uncompressed tar, in chunks. If tar fails, the generator raises before the
    stream ends, so the daemon sees a broken upload and makes no image of a partial tree."""
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(rootfs),
                                 "-cf", "-", "."], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        assert proc.stdout is not None
        try:
            while chunk := proc.stdout.read(_CHUNK):
                yield chunk
            if proc.wait() != 0:
                errors.seek(0)
                message = errors.read()[-2000:].decode(errors="replace").strip()
                raise ServerError(f"archiving template root {rootfs} failed (tar exited {proc.returncode}): "
                                  f"{message}")
        finally:
            proc.stdout.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
