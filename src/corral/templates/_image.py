"""A template as an OCI image: its root filesystem plus the in-sandbox agent, written as an OCI image layout.

No Python library writes an OCI image from a directory with owners, modes, hard links and xattrs kept (skopeo,
the registry client `_push` uses, copies images but makes none from a tree), and the format is small: an
`oci-layout` file, `index.json`, and content-addressed blobs (a manifest, a config, the layers). So this module
writes it, into one layout per Corral home (`<home>/images/oci`, blobs shared between templates):

- layer 1: the template's root filesystem, as on disk (numeric owners, the template's mtimes), gzip'd. It is
  made once per template build (recorded in `<home>/images/rootfs/<template digest>.json`) because it is the
  slow part: the default template is 1.8 GB.
- layer 2: the agent at `/.corral/agent`, root-owned and read-only to the sandbox, with fixed mtimes and its
  bytecode compiled for that path. A new agent changes this small layer only, so a registry that has the
  rootfs layer is not sent it again.
- config: user 1000:1000, working directory `/.corral`, the agent as entrypoint (as the Docker backend starts
  it), the template's environment, labels naming the template and agent digests.

Blobs are shared and kept: each push first drops the images of templates that are no longer in the store, and
every blob no remaining image uses (`keep`). Writers hold the layout's lock exclusively, readers (skopeo while it
copies) shared, so no blob disappears under a copy.

The same template and agent give the same bytes, so the same manifest digest: nothing in the image depends on
the time or the host beyond the template's own files (whose mtimes it keeps) and the agent's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import py_compile
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._atomic import write_atomic
from .._exceptions import TemplateBuildError
from ._process import Progress
from ._rootfs import USER_GID, USER_UID
from ._spec import canonical_json
from ._store import Template
from ._tarball import LayerBlob, Normalize, write_layer

__all__ = ["AGENT_ENTRYPOINT", "AGENT_PATH", "AgentFiles", "LocalImage", "reading_image", "write_image"]

# As the local bundle and the Docker backend start the agent (tests/test_image_push.py checks they agree).
AGENT_ENTRYPOINT = ("/usr/bin/python3", "-S", "-B", "-c", "from agent.__main__ import main; main()")
AGENT_PATH = ".corral/agent"
IMAGE_FORMAT = "corral-image/1"  # a label: bump when what goes into an image changes

_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
_REF_ANNOTATION = "org.opencontainers.image.ref.name"
_TEMPLATE_ANNOTATION = "org.corral.template.digest"
_DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_ARCHES = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}


@dataclass(frozen=True)
class AgentFiles:
    """The agent as the image carries it: the directory copied to /.corral/agent and the command that runs it."""

    directory: Path
    entrypoint: Sequence[str] = AGENT_ENTRYPOINT


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class LocalImage:
    """An image written into an OCI layout: `oci:<layout>:<ref>` names it for skopeo."""

    layout: Path
    ref: str
    manifest: Descriptor
    config: Descriptor
    layers: tuple[Descriptor, ...]

    @property
    def digest(self) -> str:
        """The manifest digest: what a registry reports, and what `REPO@digest` pins."""
        return self.manifest.digest


def write_image(template: Template, agent: AgentFiles, home: Path, *, emit: Progress,
                keep: Callable[[str], bool] | None = None) -> LocalImage:
    """Write `template` plus `agent` as an image into `<home>/images/oci` and return it.

    With `keep` (template digest -> whether that template still exists), the images of templates that are gone
    are dropped first, with every blob no image uses any more. `TemplateBuildError` if the files cannot be read
    or written; a failure leaves no partial blob behind (blobs are renamed into place once complete, and
    index.json is replaced atomically).
    """
    layout = home / "images" / "oci"
    try:
        with _layout_lock(layout, exclusive=True):
            if keep is not None:
                _prune(layout, home, keep, emit)
            rootfs = _rootfs_layer(template, home, layout, emit)
            agent_layer = _agent_layer(agent, layout, emit)
            return _finish(template, agent, layout, (rootfs, agent_layer))
    except OSError as exc:
        raise TemplateBuildError(f"writing the image of template {template.name!r} failed: {exc}") from exc


@contextlib.contextmanager
def reading_image(image: LocalImage) -> Iterator[None]:
    """Hold `image`'s blobs in place while something reads them (skopeo copying it): no prune runs meanwhile."""
    with _layout_lock(image.layout, exclusive=False):
        yield


@contextlib.contextmanager
def _layout_lock(layout: Path, *, exclusive: bool) -> Iterator[None]:
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.parent / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        # Writers (and pruning) exclusive: pushes share blobs and index.json. Readers shared.
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive and not (layout / "oci-layout").exists():
            write_atomic(layout / "oci-layout", b'{"imageLayoutVersion":"1.0.0"}', mode=0o644)
        yield
    finally:
        os.close(fd)


def _blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _put_blob(layout: Path, data: bytes, media_type: str) -> Descriptor:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    path = _blob_path(layout, digest)
    if not path.exists():
        write_atomic(path, data, mode=0o644)
    return Descriptor(media_type, digest, len(data))


def _store_layer(layout: Path, blob: LayerBlob) -> Descriptor:
    final = _blob_path(layout, blob.digest)
    os.chmod(blob.path, 0o644)
    os.replace(blob.path, final)
    return Descriptor(_OCI_LAYER_GZIP, blob.digest, blob.size)


@dataclass(frozen=True)
class _Layer:
    descriptor: Descriptor
    diff_id: str


def _rootfs_layer(template: Template, home: Path, layout: Path, emit: Progress) -> _Layer:
    record = home / "images" / "rootfs" / f"{template.digest}.json"
    cached = _cached_layer(record, template, layout)
    if cached is not None:
        emit(f"==> rootfs layer {cached.descriptor.digest[:19]} already made "
             f"({cached.descriptor.size / 1e6:.1f} MB)")
        return cached
    emit(f"==> archiving the root filesystem of {template.name!r} ({template.size_bytes / 1e6:.0f} MB on disk)")
    blob = _new_layer(template.rootfs, layout, "", None, emit)
    layer = _Layer(_store_layer(layout, blob), blob.diff_id)
    emit(f"==> rootfs layer {blob.digest[:19]}: {blob.tar_size / 1e6:.1f} MB, {blob.size / 1e6:.1f} MB gzip"
         + (f" ({blob.skipped} device nodes and sockets left out)" if blob.skipped else ""))
    record.parent.mkdir(parents=True, exist_ok=True)
    entry = {"created_at": template.created_at.isoformat(), "diff_id": blob.diff_id, **layer.descriptor.to_json()}
    write_atomic(record, canonical_json(entry), mode=0o644)
    return layer


def _cached_layer(record: Path, template: Template, layout: Path) -> _Layer | None:
    """The rootfs layer made earlier for this very build of the template (a forced rebuild keeps the digest
    but not the files, hence `created_at`), if its blob is still there."""
    try:
        entry = json.loads(record.read_bytes())
        if entry["created_at"] != template.created_at.isoformat():
            return None
        descriptor = Descriptor(entry["mediaType"], entry["digest"], int(entry["size"]))
        diff_id = str(entry["diff_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    blob = _blob_path(layout, descriptor.digest)
    if not blob.is_file() or blob.stat().st_size != descriptor.size:
        return None
    return _Layer(descriptor, diff_id)


def _new_layer(source: Path, layout: Path, prefix: str, normalize: Normalize | None, emit: Progress) -> LayerBlob:
    tmp = layout / "blobs" / f".tmp-{secrets.token_hex(8)}"
    try:
        return write_layer(source, tmp, prefix=prefix, normalize=normalize, emit=emit)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _agent_layer(agent: AgentFiles, layout: Path, emit: Progress) -> _Layer:
    if not (agent.directory / "__main__.py").is_file():
        raise TemplateBuildError(f"{agent.directory} does not hold the agent (no __main__.py)")
    with tempfile.TemporaryDirectory(dir=layout.parent, prefix=".agent-") as tmp:
        staged = _stage_agent(agent.directory, Path(tmp) / "agent")
        blob = _new_layer(staged, layout, AGENT_PATH + "/", Normalize(), emit)
    if _blob_path(layout, blob.digest).exists():
        blob.path.unlink()
        descriptor = Descriptor(_OCI_LAYER_GZIP, blob.digest, blob.size)
    else:
        descriptor = _store_layer(layout, blob)
    emit(f"==> agent layer {blob.digest[:19]}: {blob.size / 1e3:.0f} kB gzip")
    return _Layer(descriptor, blob.diff_id)


def _stage_agent(source: Path, dest: Path) -> Path:
    """A copy of the agent whose bytecode names the files where the image has them (/.corral/agent/x.py).

    The host's copy was compiled where it was made (`<home>/agent/<digest>/.tmp<pid>/x.py`, which every pyc
    records as its file name), so its bytecode would make the layer depend on the home and the process that
    installed the agent, and tracebacks in the sandbox name a host path. Unchecked-hash pycs, as on the host:
    the files never change under one image."""
    dest.mkdir(mode=0o755)
    for entry in sorted(source.iterdir()):
        if entry.name == "__pycache__":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest / entry.name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(entry, dest / entry.name, follow_symlinks=False)
    for module in sorted(dest.rglob("*.py")):
        in_image = "/" + AGENT_PATH + "/" + module.relative_to(dest).as_posix()
        py_compile.compile(str(module), cfile=importlib.util.cache_from_source(str(module)), dfile=in_image,
                           doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return dest


def _config(template: Template, agent: AgentFiles, layers: Sequence[_Layer]) -> dict[str, Any]:
    env = {**_DEFAULT_ENV, **template.env}
    return {
        "architecture": _ARCHES.get(platform.machine(), platform.machine()),
        "os": "linux",
        # No "created": the image is a function of the template's files and the agent, not of when either was made.
        "config": {
            "User": f"{USER_UID}:{USER_GID}",
            "WorkingDir": "/.corral",
            "Entrypoint": list(agent.entrypoint),
            "Env": [f"{key}={value}" for key, value in sorted(env.items())],
            "Labels": {
                "org.corral.template.digest": template.digest,
                "org.corral.agent.diff-id": layers[1].diff_id,
                "org.corral.image-format": IMAGE_FORMAT,
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [
            {"created_by": f"corral template {template.digest}"},
            {"created_by": "corral agent at /" + AGENT_PATH},
        ],
    }


def _finish(template: Template, agent: AgentFiles, layout: Path, layers: Sequence[_Layer]) -> LocalImage:
    config = _put_blob(layout, canonical_json(_config(template, agent, layers)), _OCI_CONFIG)
    manifest_json = {
        "schemaVersion": 2,
        "mediaType": _OCI_MANIFEST,
        "config": config.to_json(),
        "layers": [layer.descriptor.to_json() for layer in layers],
    }
    manifest = _put_blob(layout, canonical_json(manifest_json), _OCI_MANIFEST)
    ref = manifest.digest.removeprefix("sha256:")
    _add_to_index(layout, manifest, ref, template.digest)
    return LocalImage(layout, ref, manifest, config, tuple(layer.descriptor for layer in layers))


def _read_index(layout: Path) -> dict[str, Any]:
    path = layout / "index.json"
    try:
        index: dict[str, Any] = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}
    except ValueError as exc:
        raise TemplateBuildError(f"{path} is not valid JSON: {exc}") from exc
    return index


def _add_to_index(layout: Path, manifest: Descriptor, ref: str, template_digest: str) -> None:
    index = _read_index(layout)
    kept = [m for m in index.get("manifests", []) if (m.get("annotations") or {}).get(_REF_ANNOTATION) != ref]
    # Annotations of the index entry, not of the manifest: they leave the image's digest alone.
    annotations = {_REF_ANNOTATION: ref, _TEMPLATE_ANNOTATION: template_digest}
    index["manifests"] = [*kept, {**manifest.to_json(), "annotations": annotations}]
    write_atomic(layout / "index.json", canonical_json(index), mode=0o644)


def _prune(layout: Path, home: Path, keep: Callable[[str], bool], emit: Progress) -> None:
    """Drop the images (and cached rootfs layers) of templates that are gone, then every unreferenced blob."""
    index = _read_index(layout)
    manifests = index.get("manifests", [])
    kept = [m for m in manifests if keep(str((m.get("annotations") or {}).get(_TEMPLATE_ANNOTATION, "")))]
    if len(kept) != len(manifests):
        index["manifests"] = kept
        write_atomic(layout / "index.json", canonical_json(index), mode=0o644)
    used: set[str] = set()
    for record in sorted((home / "images" / "rootfs").glob("*.json")):
        if not keep(record.stem):
            record.unlink()
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            used.add(str(json.loads(record.read_bytes())["digest"]))
    for entry in kept:
        used |= _blobs_of(layout, str(entry["digest"]))
    _remove_unused_blobs(layout, {d.removeprefix("sha256:") for d in used}, emit)


def _blobs_of(layout: Path, manifest_digest: str) -> set[str]:
    try:
        manifest = json.loads(_blob_path(layout, manifest_digest).read_bytes())
        return {manifest_digest, manifest["config"]["digest"], *(layer["digest"] for layer in manifest["layers"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {manifest_digest}


def _remove_unused_blobs(layout: Path, used: set[str], emit: Progress) -> None:
    removed, freed = 0, 0
    blobs = layout / "blobs"
    # `.tmp-*` are layers whose writer was killed: writers hold the exclusive lock, so none is being written.
    doomed = [p for p in (blobs / "sha256").iterdir() if p.name not in used] + list(blobs.glob(".tmp-*"))
    for path in doomed:
        freed += path.stat().st_size
        path.unlink()
        removed += 1
    if removed:
        emit(f"==> removed {removed} unused image blobs ({freed / 1e6:.1f} MB)")
