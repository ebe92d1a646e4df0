"""The template store: `<home>/templates/<digest>/{rootfs,template.json}` plus `names/<name>` pointers.

Layout:

```
<home>/templates/
    .lock                        flock: serialises creating and reaping build directories
    <digest>/template.json       metadata; the directory appears only by one rename, complete
    <digest>/rootfs/             the root filesystem (the overlay's read-only lower layer)
    <digest>/pushed.json         the images pushed from it (`corral templates push`), replaced atomically
    names/<name>                 {"digest": ...}, replaced atomically
    .build-<digest>-<random>/    a build in progress (flock held by its builder) or a leftover
    .trash-<digest>-<random>/    a template being deleted
```

Only a finished build is ever renamed to `<digest>`, so a crash, Ctrl-C or SIGTERM at any moment leaves at
worst a `.build-*` directory, which the next build reaps: every builder holds an flock on its own build
directory, so a directory whose lock is free belongs to nobody.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast, get_args

from .._exceptions import InvalidRequestError, NotFoundError, ServerError
from .._settings import corral_home
from ._fs import atomic_write, disk_usage, exchange, fsync_dir, remove_tree, syncfs
from ._spec import DIGEST_RE, NAME_RE, validate_name

__all__ = ["PushedImage", "Template", "TemplateSource", "TemplateStore"]

logger = logging.getLogger("corral.templates")

# "debootstrap": built by Corral before mmdebstrap replaced it; such templates keep working.
TemplateSource = Literal["mmdebstrap", "debootstrap", "oci", "docker-archive"]

_METADATA = "template.json"
_PUSHED = "pushed.json"
_METADATA_FORMAT = 1
_BUILD_HINT = "corral templates build default"


@dataclass(frozen=True, slots=True)
class PushedImage:
    """An image made from a template and pushed to a registry (`corral templates push`).

    `reference` pins it by digest (`REGISTRY/REPO@sha256:...`), which is how the Kubernetes backend names the
    image of a Pod; `tag` is the tagged name it was pushed as; `agent` the digest of its agent layer (which
    changes with the agent alone).
    """

    reference: str
    digest: str
    tag: str
    agent: str
    pushed_at: datetime

    def to_dict(self) -> dict[str, str]:
        return {"reference": self.reference, "digest": self.digest, "tag": self.tag, "agent": self.agent,
                "pushed_at": self.pushed_at.isoformat()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PushedImage:
        return cls(str(data["reference"]), str(data["digest"]), str(data["tag"]), str(data["agent"]),
                   datetime.fromisoformat(data["pushed_at"]))


@dataclass(frozen=True, slots=True)
class Template:
    """A built template: a root filesystem and what a sandbox made from it needs to know.

    `name` is the name it was looked up by (or built under, when looked up by digest). `spec` is the
    `TemplateSpec` for built templates and a description of the image for imports. `pushed` lists the
    images pushed from it, newest last (one per tag).
    """

    name: str
    digest: str
    rootfs: Path
    env: dict[str, str]
    created_at: datetime
    size_bytes: int
    source: TemplateSource
    spec: dict[str, Any]
    pushed: tuple[PushedImage, ...] = field(default=())

    @property
    def path(self) -> Path:
        """The template's directory (`rootfs/` and `template.json`)."""
        return self.rootfs.parent

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, for `corral templates ls --json` and the HTTP API."""
        return {
            "name": self.name,
            "digest": self.digest,
            "rootfs": str(self.rootfs),
            "env": dict(self.env),
            "created_at": self.created_at.isoformat(),
            "size_bytes": self.size_bytes,
            "source": self.source,
            "spec": self.spec,
            "pushed": [image.to_dict() for image in self.pushed],
        }


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on directory `path`, or None if someone else holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class TemplateStore:
    """Templates under `<home>/templates`; `home` defaults to `CORRAL_HOME` (`/var/lib/corral`)."""

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = corral_home(home)
        self.root = self.home / "templates"
        self._names = self.root / "names"

    def __repr__(self) -> str:
        return f"TemplateStore({str(self.home)!r})"

    # -- reading ------------------------------------------------------------------------------------------

    def get(self, name_or_digest: str) -> Template:
        """The template called `name_or_digest`, or with that digest (hex, optionally `sha256:`-prefixed)."""
        match = DIGEST_RE.match(name_or_digest)
        if match:
            found = self._load(match[1], name=None)
            if found is None:
                raise self._not_found(f"no template has digest {match[1]}")
            return found
        name = validate_name(name_or_digest)
        digest = self._read_name(name)
        if digest is None:
            raise self._not_found(f"template {name!r} not found")
        found = self._load(digest, name=name)
        if found is None:
            raise NotFoundError(
                f"template {name!r} points to {digest[:12]}, which is no longer in {self.root}; "
                f"rebuild it with `corral templates build {name}`"
            )
        return found

    def list(self) -> builtins.list[Template]:
        """Every named template, sorted by name (names whose files have vanished are left out)."""
        found: builtins.list[Template] = []
        for name in self._all_names():
            digest = self._read_name(name)
            template = self._load(digest, name=name) if digest else None
            if template is not None:
                found.append(template)
        return found

    def exists(self, name: str) -> bool:
        """Whether `get(name)` would find a template (names and digests; never raises for bad input)."""
        try:
            self.get(name)
        except (NotFoundError, InvalidRequestError):
            return False
        return True

    def remove(self, name: str) -> None:
        """Forget `name`, and delete its root filesystem unless another name still uses it.

        The caller makes sure no sandbox still runs on it: the rootfs is the lower layer of their overlays.
        """
        validate_name(name)
        doomed: tuple[Path, int] | None = None
        with self._store_lock():
            digest = self._read_name(name)
            if digest is None:
                raise self._not_found(f"template {name!r} not found")
            (self._names / name).unlink()
            fsync_dir(self._names)
            in_use = any(self._read_name(other) == digest for other in self._all_names())
            if not in_use:
                doomed = self._move_to_trash(self.root / digest)
        if doomed is not None:
            path, fd = doomed
            try:
                remove_tree(path)
            finally:
                os.close(fd)

    # -- for the builders -----------------------------------------------------------------------------

    def lookup_digest(self, digest: str) -> Template | None:
        """The template stored under `digest`, or None."""
        return self._load(digest, name=None)

    def link(self, name: str, digest: str) -> Template:
        """Point `name` at the template stored under `digest` and return it under that name."""
        validate_name(name)
        self._names.mkdir(parents=True, exist_ok=True)
        if self._read_name(name) != digest:
            atomic_write(self._names / name, json.dumps({"digest": digest}).encode() + b"\n")
        template = self._load(digest, name=name)
        if template is None:
            raise ServerError(f"template {digest} vanished while naming it {name!r}")
        return template

    def record_push(self, template: Template, image: PushedImage) -> Template:
        """Add `image` to the images pushed from `template` (replacing an earlier push of the same tag) and
        return the template with it. The template's files are not touched; the record is replaced atomically."""
        path = self.root / template.digest / _PUSHED
        with self._store_lock():
            self._must_load(template)  # deleted meanwhile: record nothing
            kept = [p for p in self._load_pushed(template.digest) if p.tag != image.tag]
            records = [p.to_dict() for p in (*kept, image)]
            atomic_write(path, json.dumps(records, indent=2).encode() + b"\n")
        return self._must_load(template)

    def _must_load(self, template: Template) -> Template:
        found = self._load(template.digest, name=template.name)
        if found is None:
            raise NotFoundError(f"template {template.name!r} ({template.digest[:12]}) is no longer in {self.root}")
        return found

    @contextlib.contextmanager
    def staging(self, digest: str) -> Iterator[Staging]:
        """A fresh, locked build directory for `digest`, reaped on the way out unless it was published.

        Leftovers of earlier builds that died are reaped first.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.reap()
        with self._store_lock():
            path = self.root / f".build-{digest}-{secrets.token_hex(4)}"
            path.mkdir(mode=0o700)
            fd = _try_lock(path)
        if fd is None:  # cannot happen: the store lock kept reapers away since mkdir
            raise ServerError(f"cannot lock build directory {path}")
        staging = Staging(self, digest, path, fd)
        try:
            yield staging
        finally:
            staging.close()

    def reap(self) -> None:
        """Delete `.build-*` and `.trash-*` directories that no live process holds."""
        if not self.root.is_dir():
            return
        stale: builtins.list[tuple[Path, int]] = []
        with self._store_lock():
            for entry in os.scandir(self.root):
                if entry.name.startswith((".build-", ".trash-")) and entry.is_dir(follow_symlinks=False):
                    fd = _try_lock(Path(entry.path))
                    if fd is not None:
                        stale.append((Path(entry.path), fd))
        for path, fd in stale:
            try:
                logger.info("removing leftover %s", path)
                remove_tree(path)
            except (ServerError, OSError) as exc:
                logger.warning("cannot remove leftover %s: %s", path, exc)
            finally:
                os.close(fd)

    # -- internals ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _store_lock(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _move_to_trash(self, path: Path) -> tuple[Path, int] | None:
        if not path.is_dir():
            return None
        fd = _try_lock(path)
        if fd is None:
            raise ServerError(f"{path} is locked by another process; try again")
        trash = self.root / f".trash-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, trash)
        fsync_dir(self.root)
        return trash, fd

    def _all_names(self) -> builtins.list[str]:
        try:
            entries = os.listdir(self._names)
        except FileNotFoundError:
            return []
        return sorted(n for n in entries if NAME_RE.match(n))

    def _read_name(self, name: str) -> str | None:
        try:
            data = json.loads((self._names / name).read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ServerError(f"template name file {self._names / name} is unreadable: {exc}") from exc
        digest = data.get("digest") if isinstance(data, dict) else None
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest) or digest.startswith("sha256:"):
            raise ServerError(f"template name file {self._names / name} holds no valid digest")
        return digest

    def _load(self, digest: str, *, name: str | None) -> Template | None:
        path = self.root / digest / _METADATA
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ServerError(f"template metadata {path} is unreadable: {exc}") from exc
        try:
            source = data["source"]
            if source not in get_args(TemplateSource):
                raise ValueError(f"unknown source {source!r}")
            return Template(
                name=name or str(data["name"]),
                digest=digest,
                rootfs=self.root / digest / "rootfs",
                env={str(k): str(v) for k, v in data["env"].items()},
                created_at=datetime.fromisoformat(data["created_at"]),
                size_bytes=int(data["size_bytes"]),
                source=cast(TemplateSource, source),
                spec=dict(data["spec"]),
                pushed=self._load_pushed(digest),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ServerError(f"template metadata {path} is malformed: {exc}") from exc

    def _load_pushed(self, digest: str) -> tuple[PushedImage, ...]:
        path = self.root / digest / _PUSHED
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return ()
        except (OSError, ValueError) as exc:
            raise ServerError(f"pushed-image record {path} is unreadable: {exc}") from exc
        try:
            return tuple(PushedImage.from_dict(item) for item in data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"pushed-image record {path} is malformed: {exc}") from exc

    def _not_found(self, what: str) -> NotFoundError:
        names = self._all_names()
        if names:
            known = f"Available templates: {', '.join(names)}."
        else:
            known = f"No templates are built yet in {self.root}."
        return NotFoundError(f"{what}. {known} Build one with `{_BUILD_HINT}`.", details={"available": names})


class Staging:
    """A build directory in progress: fill `rootfs`, then `publish`. Made by `TemplateStore.staging`."""

    def __init__(self, store: TemplateStore, digest: str, path: Path, lock_fd: int) -> None:
        self.store = store
        self.digest = digest
        self.path = path
        self.rootfs = path / "rootfs"
        self._fds = [lock_fd]

    def publish(
        self,
        *,
        name: str,
        source: TemplateSource,
        spec: dict[str, Any],
        env: dict[str, str],
        force: bool = False,
    ) -> Template:
        """Write `template.json`, flush, and make the template visible under its digest and `name`.

        If another build of the same digest finished first, its template is kept and returned, unless
        `force`, which swaps this build in atomically (the old files are deleted on the way out).
        """
        metadata = {
            "format": _METADATA_FORMAT,
            "name": name,
            "digest": self.digest,
            "source": source,
            "spec": spec,
            "env": env,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "size_bytes": disk_usage(self.rootfs),
        }
        atomic_write(self.path / _METADATA, json.dumps(metadata, indent=2, sort_keys=True).encode() + b"\n")
        os.chmod(self.path, 0o755)  # noqa: S103 - private while building, readable once done
        syncfs(self.path)
        final = self.store.root / self.digest
        if os.path.lexists(final) and force:
            self._swap_in(final)
        elif not os.path.lexists(final):
            try:
                os.rename(self.path, final)
            except OSError as exc:  # a concurrent build of the same digest won the race: use its result
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        fsync_dir(self.store.root)
        return self.store.link(name, self.digest)

    def _swap_in(self, final: Path) -> None:
        # Lock the old template too: after the swap it sits at our build path, and no reaper may race us.
        fd = _try_lock(final)
        if fd is None:
            raise ServerError(f"{final} is locked by another process; try again")
        self._fds.append(fd)
        try:
            exchange(self.path, final)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            # This filesystem cannot swap atomically: the template is missing for a moment instead.
            old = self.store.root / f".trash-{self.digest}-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(self.path, final)
            self.path = old  # close() deletes it

    def close(self) -> None:
        """Delete whatever is left at the build path (a failed build, or the old files after a swap)."""
        try:
            remove_tree(self.path)
        except (ServerError, OSError) as exc:
            # Never mask the exception that ended the build; the next build reaps what is left.
            logger.warning("cannot remove build directory %s: %s", self.path, exc)
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
