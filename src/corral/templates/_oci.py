"""`import_image`: an OCI image layout or a `docker save` archive flattened into a template.

An image is untrusted input. Every blob is checked against its digest (manifest, config, compressed layer)
and every layer against the config's `rootfs.diff_ids`, so the config digest pins the whole root filesystem
and can name the template. Layer entries are applied as a container runtime would, never trusting a path:

- absolute names, names with `..` and hard links whose target escapes are skipped with a warning;
- parent directories are resolved inside the rootfs (`resolve_in_root`), so a symlink planted by an earlier
  entry (`evil -> /`) cannot redirect a later one (`evil/etc/passwd`) to the host;
- layers may be uncompressed or compressed with gzip, zstd (what `skopeo copy --dest-compress-format zstd`,
  BuildKit's `compression=zstd` and zstd:chunked write), bzip2 or xz, recognised by their magic bytes;
- device nodes are skipped (every sandbox gets its /dev from the runtime);
- whiteouts (`.wh.<name>`) delete from lower layers and `.wh..wh..opq` hides a directory's lower contents; per
  the OCI spec neither hides entries of its own layer.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import os
import platform
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

import zstandard

from .._exceptions import InvalidRequestError, TemplateBuildError
from ._fs import resolve_in_root
from ._process import Progress, discard, sigterm_raises
from ._rootfs import ensure_user, finish_rootfs
from ._spec import canonical_json, validate_name
from ._store import Template, TemplateStore

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["IMPORTER_VERSION", "import_image"]

# Part of every imported template's digest; bump it when importing the same image would give other files.
IMPORTER_VERSION = "corral-import/1"

_MAX_JSON_BYTES = 16 << 20
_CHUNK = 1 << 20
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ARCHES = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}

ImageFormat = Literal["oci", "docker-archive"]


def import_image(
    path: str | os.PathLike[str],
    name: str,
    store: TemplateStore,
    *,
    progress: Progress | None = None,
    force: bool = False,
) -> Template:
    """Import an OCI image layout (directory or tar) or a docker-archive tarball as template `name`.

    The template's env is the image's `Env` (with a default `PATH` if the image sets none). An image already
    imported returns at once unless `force`. Raises `InvalidRequestError` for a missing, malformed, corrupt or
    unsupported image, `TemplateBuildError` if writing the root filesystem fails; no partial template is ever
    visible.
    """
    emit = progress or discard
    validate_name(name)
    path = Path(path)
    with _open_source(path) as source:
        image = _read_image(source, emit)
        content = {"importer": IMPORTER_VERSION, "config": image.config_digest}
        hexdigest = hashlib.sha256(canonical_json(content)).hexdigest()
        if not force and store.lookup_digest(hexdigest) is not None:
            emit(f"==> image {image.config_digest[:19]} is already imported ({hexdigest[:12]})")
            store.reap()
            return store.link(name, hexdigest)
        emit(f"==> importing {path} ({image.format}, {len(image.layers)} layers) as {name!r}")
        with sigterm_raises(), store.staging(hexdigest) as staging:
            staging.rootfs.mkdir(mode=0o755)
            try:
                for number, layer in enumerate(image.layers, 1):
                    emit(f"==> layer {number}/{len(image.layers)} {layer.diff_id[:19]}")
                    _apply_layer(source, layer, staging.rootfs, emit)
                ensure_user(staging.rootfs)
            except OSError as exc:
                raise TemplateBuildError(f"importing {path} failed: {exc}") from exc
            finish_rootfs(staging.rootfs)
            template = staging.publish(
                name=name,
                source=image.format,
                spec=image.describe(path),
                env=image.env,
                force=force,
            )
    emit(f"==> template {name!r} imported: {template.size_bytes / 1e6:.0f} MB ({hexdigest[:12]})")
    return template


# -- reading the image ---------------------------------------------------------------------------------


class _Source(Protocol):
    def has(self, name: str) -> bool: ...

    def open(self, name: str) -> IO[bytes]: ...


def _archive_path(name: str) -> str:
    """A path inside the image as written in its JSON; `InvalidRequestError` if it could leave the image."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or not parts:
        raise InvalidRequestError(f"image refers to {name!r}, a path outside the image")
    return "/".join(parts)


def _safe_name(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "" if name.startswith("/") or ".." in parts else "/".join(parts)


class _DirSource:
    def __init__(self, root: Path) -> None:
        self._root = root.resolve()

    def _path(self, name: str) -> Path:
        path = (self._root / _archive_path(name)).resolve()
        if not path.is_relative_to(self._root):  # a symlink inside the layout pointing elsewhere
            raise InvalidRequestError(f"image file {name!r} is a link to outside the image directory")
        return path

    def has(self, name: str) -> bool:
        return self._path(name).is_file()

    def open(self, name: str) -> IO[bytes]:
        try:
            return open(self._path(name), "rb")  # the caller closes it
        except OSError as exc:
            raise InvalidRequestError(f"image file {name!r} cannot be read: {exc.strerror}") from exc


class _TarSource:
    def __init__(self, archive: tarfile.TarFile) -> None:
        self._archive = archive
        # Members with unsafe names are left out: nothing can refer to them through `_archive_path`.
        self._members = {_safe_name(m.name): m for m in archive.getmembers()}
        self._members.pop("", None)

    def has(self, name: str) -> bool:
        member = self._members.get(_archive_path(name))
        return member is not None and (member.isfile() or member.issym() or member.islnk())

    def open(self, name: str) -> IO[bytes]:
        member = self._members.get(_archive_path(name))
        try:
            extracted = self._archive.extractfile(member) if member is not None else None
        except KeyError:  # a link to a member the archive does not have
            extracted = None
        if extracted is None:
            raise InvalidRequestError(f"image archive has no file {name!r}")
        return extracted


@contextlib.contextmanager
def _open_source(path: Path) -> Iterator[_Source]:
    if path.is_dir():
        yield _DirSource(path)
        return
    if not path.is_file():
        raise InvalidRequestError(f"image {path} does not exist")
    unreadable = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)
    try:
        archive = tarfile.open(path, "r:*")
    except unreadable as exc:
        raise InvalidRequestError(f"image {path} is not a readable tar archive: {exc}") from exc
    with archive:
        try:
            source = _TarSource(archive)  # reads the whole member list
        except unreadable as exc:
            raise InvalidRequestError(f"image {path} is not a readable tar archive: {exc}") from exc
        yield source


@dataclass(frozen=True)
class _Layer:
    path: str  # inside the image
    digest: str | None  # of the stored (maybe compressed) blob, when the format records it
    diff_id: str  # of the uncompressed tar, from the config


@dataclass(frozen=True)
class _Image:
    format: ImageFormat
    config_digest: str
    manifest_digest: str | None
    config: dict[str, Any]
    layers: list[_Layer]
    reference: str | None

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in _run_config(self.config).get("Env") or []:
            if isinstance(item, str) and "=" in item and "\x00" not in item:
                key, _, value = item.partition("=")
                env[key] = value
        env.setdefault("PATH", _DEFAULT_PATH)  # as Docker does for images that set none
        return env

    def describe(self, path: Path) -> dict[str, Any]:
        run = _run_config(self.config)
        return {
            "image": str(path.resolve()),
            "format": self.format,
            "reference": self.reference,
            "config_digest": self.config_digest,
            "manifest_digest": self.manifest_digest,
            "layers": [layer.diff_id for layer in self.layers],
            "user": run.get("User") or None,
            "workdir": run.get("WorkingDir") or None,
        }


def _run_config(config: dict[str, Any]) -> dict[str, Any]:
    run = config.get("config") or config.get("Config") or {}
    return run if isinstance(run, dict) else {}


def _sha256_digest(digest: object) -> str:
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise InvalidRequestError(f"unsupported blob digest {digest!r}: only sha256 is supported")
    hexpart = digest.removeprefix("sha256:")
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise InvalidRequestError(f"malformed blob digest {digest!r}")
    return digest


def _read_small(source: _Source, name: str, expected: str | None = None) -> bytes:
    with source.open(name) as f:
        data = f.read(_MAX_JSON_BYTES + 1)
    if len(data) > _MAX_JSON_BYTES:
        raise InvalidRequestError(f"image file {name!r} is larger than {_MAX_JSON_BYTES} bytes")
    if expected is not None and f"sha256:{hashlib.sha256(data).hexdigest()}" != expected:
        raise InvalidRequestError(f"image file {name!r} does not match its digest {expected}; the image is corrupt")
    return data


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from exc


def _blob_name(digest: str) -> str:
    return "blobs/sha256/" + _sha256_digest(digest).removeprefix("sha256:")


def _read_image(source: _Source, emit: Progress) -> _Image:
    try:
        if source.has("index.json"):
            return _read_oci(source, emit)
        if source.has("manifest.json"):
            return _read_docker_archive(source, emit)
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequestError(f"image metadata is malformed: missing or wrong field {exc}") from exc
    raise InvalidRequestError(
        "not an image: found neither index.json (OCI image layout) nor manifest.json (docker save archive)"
    )


def _select_manifest(source: _Source, index: dict[str, Any], emit: Progress, depth: int = 0) -> dict[str, Any]:
    if depth > 4:
        raise InvalidRequestError("image index nests too deeply")
    manifests = [m for m in index["manifests"] if (m.get("platform") or {}).get("os") != "unknown"]
    if not manifests:
        raise InvalidRequestError("image index lists no manifests")
    if len(manifests) > 1:
        arch = _ARCHES.get(platform.machine(), platform.machine())
        matching = [m for m in manifests if (m.get("platform") or {}).get("architecture") in (arch, None)]
        if not matching:
            found = sorted({str((m.get("platform") or {}).get("architecture")) for m in manifests})
            raise InvalidRequestError(f"image has no {arch} variant (it has: {', '.join(found)})")
        if len(matching) > 1:
            emit(f"warning: the image index lists {len(matching)} images; importing the first")
        manifests = matching
    chosen: dict[str, Any] = manifests[0]
    if chosen.get("mediaType") in _INDEX_TYPES:
        nested = _json(_read_small(source, _blob_name(chosen["digest"]), chosen["digest"]), "image index")
        return _select_manifest(source, nested, emit, depth + 1)
    return chosen


def _read_config(source: _Source, name: str, expected: str | None) -> tuple[str, dict[str, Any], list[str]]:
    data = _read_small(source, name, expected)
    config = _json(data, "image config")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids")
    if not isinstance(diff_ids, list):
        raise InvalidRequestError("image config has no rootfs.diff_ids")
    return f"sha256:{hashlib.sha256(data).hexdigest()}", config, [_sha256_digest(d) for d in diff_ids]


def _read_oci(source: _Source, emit: Progress) -> _Image:
    index = _json(_read_small(source, "index.json"), "index.json")
    descriptor = _select_manifest(source, index, emit)
    manifest_digest = _sha256_digest(descriptor["digest"])
    manifest = _json(_read_small(source, _blob_name(manifest_digest), manifest_digest), "image manifest")
    config_digest = _sha256_digest(manifest["config"]["digest"])
    _, config, diff_ids = _read_config(source, _blob_name(config_digest), config_digest)
    descriptors = manifest["layers"]
    if len(descriptors) != len(diff_ids):
        raise InvalidRequestError(f"image manifest has {len(descriptors)} layers but its config {len(diff_ids)}")
    layers = [
        _Layer(path=_blob_name(d["digest"]), digest=_sha256_digest(d["digest"]), diff_id=diff_id)
        for d, diff_id in zip(descriptors, diff_ids, strict=True)
    ]
    reference = ((descriptor.get("annotations") or {}).get("org.opencontainers.image.ref.name")) or None
    return _Image("oci", config_digest, manifest_digest, config, layers, reference)


def _read_docker_archive(source: _Source, emit: Progress) -> _Image:
    entries = _json(_read_small(source, "manifest.json"), "manifest.json")
    if not isinstance(entries, list) or not entries:
        raise InvalidRequestError("manifest.json lists no images")
    if len(entries) > 1:
        emit(f"warning: the archive holds {len(entries)} images; importing the first")
    entry = entries[0]
    config_digest, config, diff_ids = _read_config(source, entry["Config"], None)
    paths = entry["Layers"]
    if len(paths) != len(diff_ids):
        raise InvalidRequestError(f"manifest.json lists {len(paths)} layers but the image config {len(diff_ids)}")
    layers = [_Layer(path=str(p), digest=None, diff_id=d) for p, d in zip(paths, diff_ids, strict=True)]
    tags = entry.get("RepoTags") or []
    return _Image("docker-archive", config_digest, None, config, layers, str(tags[0]) if tags else None)


# -- applying layers -----------------------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """Passes bytes through from `inner`, hashing them."""

    def __init__(self, inner: IO[bytes] | io.BufferedIOBase) -> None:
        super().__init__()
        self._inner = inner
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._inner.read(len(view))
        view[: len(data)] = data
        self.sha256.update(data)
        return len(data)

    def digest(self) -> str:
        return f"sha256:{self.sha256.hexdigest()}"


def _drain(reader: IO[bytes] | io.BufferedIOBase) -> None:
    while reader.read(_CHUNK):
        pass


def _decompressor(packed: io.BufferedReader[_HashingReader]) -> IO[bytes] | io.BufferedIOBase:
    magic = packed.peek(6)[:6]
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=packed, mode="rb")
    if magic.startswith(_ZSTD_MAGIC):
        # Across frames: a layer may be several concatenated zstd frames (skippable ones included, as zstd:chunked
        # writes), and its diff_id covers all of them.
        return zstandard.ZstdDecompressor().stream_reader(packed, read_across_frames=True, closefd=False)
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(packed)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(packed)
    return packed


def _apply_layer(source: _Source, layer: _Layer, rootfs: Path, emit: Progress) -> None:
    applier = _LayerApplier(rootfs, emit)
    with source.open(layer.path) as raw:
        packed_hash = _HashingReader(raw)
        packed = io.BufferedReader(packed_hash, _CHUNK)
        try:
            stream = _decompressor(packed)
            unpacked_hash = _HashingReader(stream)
            unpacked = io.BufferedReader(unpacked_hash, _CHUNK)
            with tarfile.open(fileobj=unpacked, mode="r|") as archive:
                for member in archive:
                    applier.apply(member, archive)
            # The tar ends before its blob does (padding, trailing blocks): hash every byte.
            _drain(unpacked)
            _drain(packed)
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile, zstandard.ZstdError) as exc:
            raise InvalidRequestError(f"layer {layer.diff_id} is not a readable tar: {exc}") from exc
    if layer.digest is not None and packed_hash.digest() != layer.digest:
        raise InvalidRequestError(f"layer blob does not match its digest {layer.digest}; the image is corrupt")
    if unpacked_hash.digest() != layer.diff_id:
        raise InvalidRequestError(
            f"layer does not match the config's diff_id {layer.diff_id} (got {unpacked_hash.digest()}); "
            "the image is corrupt"
        )
    applier.report()


def _entry_parts(name: str) -> list[str] | None:
    """The components of a layer entry's path, or None if it is absolute or uses `..`."""
    if name.startswith("/"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return None if ".." in parts else parts


class _LayerApplier:
    """Applies one layer's entries, in order, onto the rootfs built from the layers below it."""

    def __init__(self, root: Path, emit: Progress) -> None:
        self._root = root
        self._emit = emit
        self._created: set[str] = set()  # host paths this layer wrote: its own whiteouts do not hide them
        self._dirs: dict[tuple[str, ...], Path] = {}  # resolved parent directories, until a removal
        self._devices = 0
        self._as_root = os.geteuid() == 0

    def apply(self, member: tarfile.TarInfo, archive: tarfile.TarFile) -> None:
        parts = _entry_parts(member.name)
        if parts is None:
            self._emit(f"warning: skipped layer entry {member.name!r}: its path leaves the root")
            return
        if not parts:
            return  # the root directory itself keeps Corral's permissions
        *parent, base = parts
        if base == ".wh..wh..opq":
            self._opaque(parent)
        elif base.startswith(".wh."):
            self._whiteout(parent, base.removeprefix(".wh."))
        elif member.ischr() or member.isblk():
            self._devices += 1
        elif member.isdir() or member.isreg() or member.issym() or member.islnk() or member.isfifo():
            self._write(self._parent(parent) / base, member, archive)
        else:
            self._emit(f"warning: skipped layer entry {member.name!r}: unsupported type {member.type!r}")

    def report(self) -> None:
        if self._devices:
            self._emit(f"==> skipped {self._devices} device nodes (the runtime provides /dev)")

    def _write(self, dest: Path, member: tarfile.TarInfo, archive: tarfile.TarFile) -> None:
        if member.isdir():
            if not (dest.is_dir() and not dest.is_symlink()):
                self._remove(dest)
                dest.mkdir(mode=0o700)
        else:
            self._remove(dest)
            if member.isreg():
                self._write_file(dest, member, archive)
            elif member.issym():
                os.symlink(member.linkname, dest)
            elif member.islnk():
                if not self._hard_link(dest, member):
                    return
                self._created.add(str(dest))
                return  # the inode's metadata came with its first name
            else:
                os.mkfifo(dest, 0o600)
        self._set_metadata(dest, member)
        self._created.add(str(dest))

    def _write_file(self, dest: Path, member: tarfile.TarInfo, archive: tarfile.TarFile) -> None:
        content = archive.extractfile(member)
        if content is None:
            raise InvalidRequestError(f"layer entry {member.name!r} has no content")
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(content, out, _CHUNK)

    def _hard_link(self, dest: Path, member: tarfile.TarInfo) -> bool:
        parts = _entry_parts(member.linkname)
        if not parts:
            self._emit(f"warning: skipped hard link {member.name!r}: its target {member.linkname!r} leaves the root")
            return False
        target = resolve_in_root(self._root, "/".join(parts), follow_last=False)
        if not os.path.lexists(target) or (target.is_dir() and not target.is_symlink()):
            self._emit(f"warning: skipped hard link {member.name!r}: no file {member.linkname!r} to link to")
            return False
        os.link(target, dest, follow_symlinks=False)
        return True

    def _set_metadata(self, dest: Path, member: tarfile.TarInfo) -> None:
        if self._as_root:
            os.chown(dest, member.uid, member.gid, follow_symlinks=False)
        if not member.issym():
            os.chmod(dest, member.mode & 0o7777)  # after chown, which would clear setuid bits
        with contextlib.suppress(OverflowError, ValueError):
            os.utime(dest, (member.mtime, member.mtime), follow_symlinks=False)

    def _parent(self, parts: list[str]) -> Path:
        """The host directory for `parts`, created (as this layer's) where missing."""
        host = self._root
        for i in range(1, len(parts) + 1):
            key = tuple(parts[:i])
            cached = self._dirs.get(key)
            if cached is not None:
                host = cached
                continue
            host = resolve_in_root(self._root, "/".join(key))
            if os.path.lexists(host) and not host.is_dir():
                self._remove(host)
            if not os.path.lexists(host):
                host.mkdir(mode=0o755, parents=True)
                self._created.add(str(host))
            self._dirs[key] = host
        return host

    def _remove(self, path: Path) -> None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
            self._dirs.clear()  # a cached parent may have gone through it

    def _whiteout(self, parent: list[str], name: str) -> None:
        if not name or name in (".", "..") or "/" in name:
            return
        target = resolve_in_root(self._root, "/".join(parent)) / name
        if str(target) not in self._created:
            self._remove(target)

    def _opaque(self, parent: list[str]) -> None:
        directory = resolve_in_root(self._root, "/".join(parent))
        if directory.is_dir():
            self._hide_lower(directory)

    def _hide_lower(self, directory: Path) -> None:
        with os.scandir(directory) as entries:
            children = list(entries)
        for child in children:
            if child.path not in self._created:
                self._remove(Path(child.path))
            elif child.is_dir(follow_symlinks=False):
                self._hide_lower(Path(child.path))
