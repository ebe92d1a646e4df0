"""Templates: specs and digests, the store, mmdebstrap builds, and OCI / docker-archive imports."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidRequestError, NotFoundError, TemplateBuildError
from corral.templates import (
    BUILDER_VERSION,
    DEFAULT_TEMPLATE,
    Template,
    TemplateSpec,
    TemplateStore,
    build_template,
    builtin_spec,
    import_image,
    load_spec,
)
from corral.templates import _build as build_module
from corral.templates import _spec as spec_module
from corral.templates import _store as store_module

from .conftest import TEMPLATE
from .fakes import silent_server

is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="needs root")
needs_mmdebstrap = pytest.mark.skipif(
    not is_root or shutil.which("mmdebstrap", path="/usr/sbin:/usr/bin:/sbin:/bin") is None,
    reason="needs root and mmdebstrap",
)
# The line mmdebstrap prints when it starts downloading: a silent mirror holds the build there.
DOWNLOADING = "I: running apt-get update..."


# -- specs and digests ---------------------------------------------------------------------------------


def test_spec_defaults() -> None:
    spec = TemplateSpec(name="t")
    assert spec.suite == "bookworm"
    assert spec.mirror == "http://deb.debian.org/debian"
    assert spec.variant == "minbase"
    assert spec.apt_packages == [] and spec.pip_packages == [] and spec.files == {} and spec.env == {}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"name": "Bad Name"}, "name: 'Bad Name' is not a valid name"),
        ({"name": "../x"}, "name:"),
        ({"name": "x" * 64}, "name:"),
        ({"suite": "bookworm; rm -rf /"}, "suite:"),
        ({"mirror": "ftp://example.org/debian"}, "mirror:"),
        ({"mirror": "http://"}, "mirror:"),
        ({"variant": "buildd"}, "variant:"),
        ({"apt_packages": ["python3", "Bad_Pkg"]}, "'Bad_Pkg' is not a Debian package name"),
        ({"apt_packages": ["a,b"]}, "apt_packages:"),
        ({"pip_packages": ["--index-url=http://evil"]}, "options are not allowed"),
        ({"pip_packages": ["-r requirements.txt"]}, "options are not allowed"),
        ({"pip_packages": ["six\nnumpy"]}, "pip_packages:"),
        ({"files": {"etc/motd": "x"}}, "is not absolute"),
        ({"files": {"/etc/../shadow": "x"}}, "contains '..'"),
        ({"files": {"/etc/a\x00b": "x"}}, "NUL"),
        ({"files": {"/": "x"}}, "names a directory"),
        ({"files": {"/etc/": "x"}}, "names a directory"),
        ({"files": {"/proc/self/x": "x"}}, "mounts over"),
        ({"files": {"/.corral/agent": "x"}}, "mounts over"),
        ({"env": {"1BAD": "x"}}, "is not an environment variable name"),
        ({"env": {"A": "x\x00y"}}, "NUL"),
        ({"unknown": 1}, "unknown: Extra inputs are not permitted"),
    ],
)
def test_spec_rejects_bad_input_with_invalid_request(fields: dict[str, Any], needle: str) -> None:
    data = {"name": "t", **fields}
    with pytest.raises(InvalidRequestError) as info:
        TemplateSpec(**data)
    assert info.value.message.startswith("invalid template spec: ")
    assert needle in info.value.message
    assert info.value.details["errors"]
    # Every way of building a spec reports the same error class.
    with pytest.raises(InvalidRequestError):
        TemplateSpec.model_validate(data)


def test_spec_reports_every_problem_at_once() -> None:
    with pytest.raises(InvalidRequestError) as info:
        TemplateSpec(name="t", apt_packages=["Bad"], files={"rel": "x"})
    fields = [e["field"] for e in info.value.details["errors"]]
    assert fields == ["apt_packages", "files"]


def test_spec_is_frozen_and_normalised() -> None:
    spec = TemplateSpec(name="t", apt_packages=["git", "curl", "git"], files={"/etc//a/./b": "x", "/home/user/c": "y"})
    assert spec.apt_packages == ["curl", "git"]
    assert spec.files == {"/etc/a/b": "x", "/home/user/c": "y"}
    with pytest.raises(Exception, match="frozen"):
        spec.name = "other"


def test_digest_is_stable_and_ignores_order_and_name() -> None:
    a = TemplateSpec(name="a", apt_packages=["git", "curl"], env={"X": "1", "Y": "2"}, files={"/a": "1", "/b": "2"})
    b = TemplateSpec(name="b", apt_packages=["curl", "git"], env={"Y": "2", "X": "1"}, files={"/b": "2", "/a": "1"})
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64 and int(a.digest(), 16) >= 0
    # Stable across processes (no hash randomisation, no object ids).
    code = (
        "from corral.templates import TemplateSpec as T;"
        "print(T(name='a', apt_packages=['git', 'curl'], env={'X': '1', 'Y': '2'},"
        " files={'/a': '1', '/b': '2'}).digest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == a.digest()


@pytest.mark.parametrize(
    "change",
    [
        {"suite": "trixie"},
        {"mirror": "http://ftp.de.debian.org/debian"},
        {"apt_packages": ["git", "curl", "make"]},
        {"pip_packages": ["six"]},
        {"pip_packages": ["six==1.16.0"]},
        {"files": {"/a": "1", "/b": "2", "/c": ""}},
        {"files": {"/a": "1", "/b": "2 "}},
        {"env": {"X": "1", "Y": "3"}},
        {"env": {"X": "1", "Y": "2", "Z": ""}},
    ],
)
def test_digest_changes_with_anything_that_changes_the_rootfs(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "name": "t",
        "apt_packages": ["git", "curl"],
        "files": {"/a": "1", "/b": "2"},
        "env": {"X": "1", "Y": "2"},
    }
    assert TemplateSpec(**{**base, **change}).digest() != TemplateSpec(**base).digest()


def test_digest_includes_the_builder_version(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TemplateSpec(name="t")
    before = spec.digest()
    monkeypatch.setattr(spec_module, "BUILDER_VERSION", BUILDER_VERSION + "+next")
    assert spec.digest() != before


def test_pip_packages_bring_pip_and_certificates() -> None:
    assert TemplateSpec(name="t", apt_packages=["git"]).effective_apt_packages() == ["git"]
    spec = TemplateSpec(name="t", apt_packages=["git"], pip_packages=["six"])
    assert spec.effective_apt_packages() == ["ca-certificates", "git", "python3-pip"]


def test_default_template() -> None:
    spec = DEFAULT_TEMPLATE
    assert spec.name == "default" and spec.suite == "bookworm" and spec.variant == "minbase"
    required = """python3 python3-pip python3-venv python3-numpy python3-pandas python3-matplotlib
        python3-sklearn nodejs npm bash coreutils procps curl git gcc g++ make ca-certificates tar gzip
        xz-utils less file""".split()
    assert set(required) <= set(spec.apt_packages)
    assert spec.env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert spec.env["LANG"] == "C.UTF-8"
    assert spec.env["MPLBACKEND"] == "Agg"
    assert "backend: Agg" in spec.files["/etc/matplotlibrc"]
    assert builtin_spec("default") is DEFAULT_TEMPLATE
    with pytest.raises(NotFoundError, match="built-in specs: default"):
        builtin_spec("nope")


def test_load_spec_from_json_and_toml(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps({"name": "j", "apt_packages": ["git"], "env": {"A": "1"}}))
    (tmp_path / "s.toml").write_text('name = "j"\napt_packages = ["git"]\n[env]\nA = "1"\n')
    assert load_spec(tmp_path / "s.json") == load_spec(tmp_path / "s.toml")
    (tmp_path / "bad.toml").write_text("name = ")
    with pytest.raises(InvalidRequestError, match="not valid toml"):
        load_spec(tmp_path / "bad.toml")
    (tmp_path / "bad.json").write_text('{"name": "x", "files": {"rel": ""}}')
    with pytest.raises(InvalidRequestError, match="is not absolute"):
        load_spec(tmp_path / "bad.json")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load_spec(tmp_path / "missing.json")


# -- building images in the test: tar layers, OCI layouts, docker archives ----------------------------


@dataclass
class Entry:
    name: str
    kind: str = "file"  # file | dir | symlink | hardlink | chr | fifo
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


def tar_bytes(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, 1_700_000_000
            content = None
            if e.kind == "file":
                info.size = len(e.data)
                content = io.BytesIO(e.data)
            elif e.kind == "dir":
                info.type = tarfile.DIRTYPE
                info.mode = e.mode if e.mode != 0o644 else 0o755
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.target
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.target
            elif e.kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif e.kind == "fifo":
                info.type = tarfile.FIFOTYPE
            tar.addfile(info, content)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


LAYER1 = [
    Entry("etc", "dir"),
    Entry("etc/os-release", data=b"ID=test\n"),
    Entry("a", "dir"),
    Entry("a/keep", data=b"keep"),
    Entry("a/gone", data=b"gone"),
    Entry("opq", "dir"),
    Entry("opq/old", data=b"old"),
    Entry("opq/sub", "dir"),
    Entry("opq/sub/deep", data=b"deep"),
    Entry("override", data=b"v1", mode=0o600),
    Entry("link", "symlink", target="override"),
    Entry("evil", "symlink", target="../../../.."),  # tries to point above the root
    Entry("abs", "symlink", target="/etc"),  # absolute: must mean the image's /etc
    Entry("bin", "dir"),
    Entry("bin/tool", data=b"#!/bin/sh\n", mode=0o4755, uid=123, gid=45),
    Entry("hl", "hardlink", target="a/keep"),
]

LAYER2 = [
    Entry("a/.wh.gone", data=b""),
    Entry("opq", "dir"),
    Entry("opq/new", data=b"new"),  # before the opaque marker: same-layer entries are never hidden
    Entry("opq/.wh..wh..opq", data=b""),
    Entry("override", data=b"v2"),
    Entry("fresh", data=b"fresh"),
    Entry(".wh.fresh", data=b""),  # a layer's whiteout does not hide its own files
    Entry("../escape", data=b"x"),
    Entry("/abs-file", data=b"x"),
    Entry("a/../../up", data=b"x"),
    Entry("hl-out", "hardlink", target="../outside"),
    Entry("hl-abs", "hardlink", target="/etc/os-release"),
    Entry("dev", "dir"),
    Entry("dev/null", "chr"),
    Entry("evil/pwned", data=b"contained"),  # through evil -> ../../../.. : lands at the rootfs' top
    Entry("abs/hosts", data=b"127.0.0.1 localhost\n"),  # through abs -> /etc : lands in the rootfs' etc
    Entry("pipe", "fifo"),
]

EXPECTED = {
    ".corral": "dir",
    "a": "dir",
    "a/keep": "file:keep",
    "abs": "link:/etc",
    "bin": "dir",
    "bin/tool": "file:#!/bin/sh\n",
    "dev": "dir",
    "etc": "dir",
    "etc/group": "file:root:x:0:\nuser:x:1000:\n",
    "etc/hosts": "file:127.0.0.1 localhost\n",
    "etc/os-release": "file:ID=test\n",
    "etc/passwd": ("file:root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:Corral sandbox user:/home/user:/bin/sh\n"),
    "evil": "link:../../../..",
    "fresh": "file:fresh",
    "hl": "file:keep",
    "home": "dir",
    "home/user": "dir",
    "link": "link:override",
    "opq": "dir",
    "opq/new": "file:new",
    "override": "file:v2",
    "pipe": "fifo",
    "proc": "dir",
    "pwned": "file:contained",
    "sys": "dir",
    "tmp": "dir",
    "workspace": "dir",
}

CONFIG = {
    "architecture": "amd64",
    "os": "linux",
    "config": {"Env": ["PATH=/custom/bin:/usr/bin", "FOO=bar=baz"], "WorkingDir": "/srv", "User": "app"},
}


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with its type and content."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                found[rel] = "link:" + os.readlink(path)
            elif stat.S_ISDIR(mode):
                found[rel] = "dir"
            elif stat.S_ISFIFO(mode):
                found[rel] = "fifo"
            elif stat.S_ISREG(mode):
                found[rel] = "file:" + path.read_bytes().decode()
            else:
                found[rel] = "other"
    return found


@dataclass
class Image:
    layers: list[bytes]  # as stored (maybe compressed)
    diff_ids: list[str]
    config: bytes
    extra: dict[str, bytes] = field(default_factory=dict)


def make_image(
    layers: list[list[Entry]], *, gzip_layers: tuple[int, ...] = (1,), config: dict[str, Any] | None = None
) -> Image:
    raw = [tar_bytes(entries) for entries in layers]
    stored = [gzip.compress(r, mtime=0) if i in gzip_layers else r for i, r in enumerate(raw)]
    cfg = dict(config if config is not None else CONFIG)
    cfg["rootfs"] = {"type": "layers", "diff_ids": [sha(r) for r in raw]}
    return Image(stored, [sha(r) for r in raw], json.dumps(cfg).encode())


def write_oci_dir(image: Image, dest: Path, *, tamper_layer: int | None = None) -> Path:
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = sha(data)
        (blobs / digest.removeprefix("sha256:")).write_bytes(data)
        return digest

    layer_descriptors = []
    for i, layer in enumerate(image.layers):
        suffix = {b"\x1f\x8b": "+gzip", b"\x28\xb5": "+zstd"}.get(layer[:2], "")
        media = "application/vnd.oci.image.layer.v1.tar" + suffix
        digest = put(layer)
        if i == tamper_layer:
            (blobs / digest.removeprefix("sha256:")).write_bytes(layer[:-1] + bytes([layer[-1] ^ 1]))
        layer_descriptors.append({"mediaType": media, "digest": digest, "size": len(layer)})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(image.config)},
        "layers": layer_descriptors,
    }
    manifest_bytes = json.dumps(manifest).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": put(manifest_bytes),
                "size": len(manifest_bytes),
                "annotations": {"org.opencontainers.image.ref.name": "test:latest"},
            }
        ],
    }
    (dest / "index.json").write_text(json.dumps(index))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return dest


def tar_dir(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
    return dest


def write_docker_archive(image: Image, dest: Path, *, layer_paths: list[str] | None = None) -> Path:
    config_name = hashlib.sha256(image.config).hexdigest() + ".json"
    paths = layer_paths or [f"layer{i}/layer.tar" for i in range(len(image.layers))]
    manifest = [{"Config": config_name, "RepoTags": ["test:latest"], "Layers": paths}]
    with tarfile.open(dest, "w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("manifest.json", json.dumps(manifest).encode())
        add(config_name, image.config)
        for path, layer in zip(paths, image.layers, strict=False):
            add(path, layer)
    return dest


@pytest.fixture
def store(tmp_path: Path) -> TemplateStore:
    return TemplateStore(tmp_path / "home")


@pytest.fixture
def image() -> Image:
    return make_image([LAYER1, LAYER2])


def build_dirs(store: TemplateStore) -> list[str]:
    if not store.root.exists():
        return []
    return sorted(p.name for p in store.root.iterdir() if p.name.startswith((".build-", ".trash-")))


# -- importing images ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["oci-dir", "oci-tar", "docker-archive"])
def test_import_applies_layers_exactly(layout: str, tmp_path: Path, store: TemplateStore, image: Image) -> None:
    if layout == "oci-dir":
        source = write_oci_dir(image, tmp_path / "oci")
    elif layout == "oci-tar":
        source = tar_dir(write_oci_dir(image, tmp_path / "oci"), tmp_path / "oci.tar")
    else:
        source = write_docker_archive(image, tmp_path / "docker.tar")
    lines: list[str] = []

    template = import_image(source, "img", store, progress=lines.append)

    assert snapshot(template.rootfs) == EXPECTED
    assert template.source == ("docker-archive" if layout == "docker-archive" else "oci")
    assert template.env == {"PATH": "/custom/bin:/usr/bin", "FOO": "bar=baz"}
    assert template.spec["config_digest"] == sha(image.config)
    assert template.spec["layers"] == image.diff_ids
    assert template.spec["workdir"] == "/srv" and template.spec["user"] == "app"
    assert template.spec["reference"] == "test:latest"
    assert template.size_bytes > 0
    assert store.get("img") == template
    # Nothing escaped: not next to the rootfs, not in the test's directory, not in the image source.
    for name in ("escape", "abs-file", "up", "outside", "pwned", "hl-out", "hl-abs"):
        assert not [p for p in tmp_path.rglob(name) if template.rootfs not in p.parents], name
    assert any("'../escape'" in line and "leaves the root" in line for line in lines)
    assert any("'/abs-file'" in line for line in lines)
    assert any("'hl-out'" in line for line in lines)
    assert any("skipped 1 device nodes" in line for line in lines)
    assert build_dirs(store) == []


@needs_root
def test_import_keeps_ownership_and_modes(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    template = import_image(write_oci_dir(image, tmp_path / "oci"), "img", store)
    tool = os.lstat(template.rootfs / "bin" / "tool")
    assert (tool.st_uid, tool.st_gid, stat.S_IMODE(tool.st_mode)) == (123, 45, 0o4755)
    assert stat.S_IMODE(os.lstat(template.rootfs / "override").st_mode) == 0o644  # from layer 2
    assert os.lstat(template.rootfs / "hl").st_ino == os.lstat(template.rootfs / "a" / "keep").st_ino
    for path in ("workspace", "home/user"):
        st = os.lstat(template.rootfs / path)
        assert (st.st_uid, st.st_gid) == (1000, 1000)
    assert stat.S_IMODE(os.lstat(template.rootfs / "tmp").st_mode) == 0o1777


def test_same_config_gives_same_digest_in_every_format(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    oci = import_image(write_oci_dir(image, tmp_path / "oci"), "a", store)
    lines: list[str] = []
    docker = import_image(write_docker_archive(image, tmp_path / "d.tar"), "b", store, progress=lines.append)
    assert oci.digest == docker.digest
    assert any("already imported" in line for line in lines)
    assert [t.name for t in store.list()] == ["a", "b"]


def test_reimport_is_instant_and_force_swaps_atomically(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    source = write_oci_dir(image, tmp_path / "oci")
    first = import_image(source, "img", store)
    marker = first.rootfs / "marker"
    marker.write_text("still the first build")

    again = import_image(source, "img", store)
    assert again == first
    assert marker.exists()

    forced = import_image(source, "img", store, force=True)
    assert forced.digest == first.digest and forced.rootfs == first.rootfs
    assert not marker.exists()
    assert snapshot(forced.rootfs) == EXPECTED
    assert build_dirs(store) == []


def test_force_works_where_atomic_swap_is_unsupported(
    tmp_path: Path, store: TemplateStore, image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_oci_dir(image, tmp_path / "oci")
    first = import_image(source, "img", store)
    (first.rootfs / "marker").write_text("old")

    def unsupported(a: Path, b: Path) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(store_module, "exchange", unsupported)
    forced = import_image(source, "img", store, force=True)
    assert forced.rootfs == first.rootfs and not (forced.rootfs / "marker").exists()
    assert build_dirs(store) == []


def test_corrupt_layer_is_rejected_and_leaves_nothing(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    source = write_oci_dir(image, tmp_path / "oci", tamper_layer=0)
    with pytest.raises(InvalidRequestError, match="corrupt"):
        import_image(source, "img", store)
    assert store.list() == [] and not store.exists("img")
    assert build_dirs(store) == []
    assert [p.name for p in store.root.iterdir() if not p.name.startswith(".")] == []


def test_layer_not_matching_its_diff_id_is_rejected(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    config = json.loads(image.config)
    config["rootfs"]["diff_ids"][1] = sha(b"something else")
    forged = Image(image.layers, config["rootfs"]["diff_ids"], json.dumps(config).encode())
    with pytest.raises(InvalidRequestError, match="diff_id"):
        import_image(write_docker_archive(forged, tmp_path / "d.tar"), "img", store)
    assert store.list() == [] and build_dirs(store) == []


def zstd(data: bytes, *args: str) -> bytes:
    """`data` compressed by the zstd command line tool: a real encoder, independent of the one that decodes."""
    return subprocess.run(["zstd", "-q", "-c", *args], input=data, capture_output=True, check=True).stdout


needs_zstd = pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command")


@needs_zstd
@pytest.mark.parametrize("layout", ["oci-dir", "docker-archive"])
def test_zstd_layers_are_imported(layout: str, tmp_path: Path, store: TemplateStore) -> None:
    image = make_image([LAYER1, LAYER2], gzip_layers=())
    raw1, raw2 = (tar_bytes(LAYER1), tar_bytes(LAYER2))
    # Layer 2 as several frames with a skippable frame between them, as zstd:chunked writes a layer.
    half = len(raw2) // 2
    skippable = b"\x50\x2a\x4d\x18" + (8).to_bytes(4, "little") + b"corral!!"
    image.layers = [zstd(raw1, "-19"), zstd(raw2[:half]) + skippable + zstd(raw2[half:])]
    if layout == "oci-dir":
        source = write_oci_dir(image, tmp_path / "oci")
    else:
        source = write_docker_archive(image, tmp_path / "docker.tar")
    template = import_image(source, "img", store)
    assert snapshot(template.rootfs) == EXPECTED
    assert template.spec["layers"] == image.diff_ids


@needs_zstd
def test_corrupt_zstd_layer_is_rejected_and_leaves_nothing(tmp_path: Path, store: TemplateStore) -> None:
    raw = tar_bytes(LAYER1)
    packed = bytearray(zstd(raw))
    packed[len(packed) // 2] ^= 0xFF
    image = make_image([LAYER1], gzip_layers=())
    image.layers = [bytes(packed)]
    with pytest.raises(InvalidRequestError, match=r"not a readable tar|does not match"):
        import_image(write_docker_archive(image, tmp_path / "d.tar"), "img", store)
    assert store.list() == [] and build_dirs(store) == []


def test_gzip_and_uncompressed_layers_still_import(tmp_path: Path, store: TemplateStore) -> None:
    image = make_image([LAYER1, LAYER2], gzip_layers=(0,))
    assert image.layers[0][:2] == b"\x1f\x8b" and image.layers[1][:2] != b"\x1f\x8b"
    template = import_image(write_oci_dir(image, tmp_path / "oci"), "img", store)
    assert snapshot(template.rootfs) == EXPECTED


def test_env_gets_a_default_path(tmp_path: Path, store: TemplateStore) -> None:
    image = make_image([[Entry("f", data=b"x")]], config={"config": {"Env": ["A=1"]}})
    template = import_image(write_docker_archive(image, tmp_path / "d.tar"), "img", store)
    assert template.env == {"A": "1", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def test_existing_user_and_passwd_are_kept(tmp_path: Path, store: TemplateStore) -> None:
    passwd = b"root:x:0:0:root:/root:/bin/bash\nnode:x:1000:1000::/home/node:/bin/bash\n"
    layer = [
        Entry("etc", "dir"),
        Entry("etc/passwd", data=passwd),
        Entry("bin", "dir"),
        Entry("bin/bash", data=b""),
    ]
    template = import_image(write_docker_archive(make_image([layer]), tmp_path / "d.tar"), "img", store)
    assert (template.rootfs / "etc" / "passwd").read_bytes() == passwd
    assert (template.rootfs / "etc" / "group").read_text() == "root:x:0:\nuser:x:1000:\n"


@pytest.mark.parametrize(
    "content",
    [
        {"etc/x": b"not an image"},
        {"manifest.json": b"{not json"},
        {"manifest.json": b"[]"},
        {"index.json": b'{"manifests": []}'},
        {"manifest.json": json.dumps([{"Config": "../../../etc/passwd", "Layers": []}]).encode()},
        {"manifest.json": json.dumps([{"Config": "/etc/passwd", "Layers": []}]).encode()},
    ],
)
def test_malformed_images_are_rejected(content: dict[str, bytes], tmp_path: Path, store: TemplateStore) -> None:
    src = tmp_path / "img"
    for name, data in content.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    with pytest.raises(InvalidRequestError):
        import_image(src, "img", store)
    with pytest.raises(InvalidRequestError):
        import_image(tar_dir(src, tmp_path / "img.tar"), "img", store)
    assert build_dirs(store) == []


def test_layer_path_escaping_the_archive_is_rejected(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    archive = write_docker_archive(image, tmp_path / "d.tar", layer_paths=["../../etc/shadow", "x/layer.tar"])
    with pytest.raises(InvalidRequestError, match="outside the image"):
        import_image(archive, "img", store)


def test_import_of_missing_file_and_bad_name(tmp_path: Path, store: TemplateStore) -> None:
    with pytest.raises(InvalidRequestError, match="does not exist"):
        import_image(tmp_path / "nope.tar", "img", store)
    with pytest.raises(InvalidRequestError, match="invalid template name"):
        import_image(tmp_path / "nope.tar", "Bad/Name", store)


# -- the store ---------------------------------------------------------------------------------------------


def test_empty_store(store: TemplateStore) -> None:
    assert store.list() == []
    assert not store.exists("default")
    with pytest.raises(NotFoundError) as info:
        store.get("default")
    assert "template 'default' not found" in info.value.message
    assert "No templates are built yet" in info.value.message
    assert "`corral templates build default`" in info.value.message


def test_store_names_digests_and_removal(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    source = write_oci_dir(image, tmp_path / "oci")
    a = import_image(source, "a", store)
    b = import_image(source, "b", store)
    other = import_image(
        write_docker_archive(make_image([[Entry("f", data=b"1")]]), tmp_path / "o.tar"), "other", store
    )
    assert a.digest == b.digest != other.digest
    assert (a.name, b.name) == ("a", "b")
    assert json.loads((store.root / "names" / "a").read_text()) == {"digest": a.digest}

    assert [t.name for t in store.list()] == ["a", "b", "other"]
    assert store.get(a.digest).digest == a.digest
    assert store.get("sha256:" + a.digest).name == "a"  # by digest: the name it was built under
    assert store.exists("a") and store.exists(a.digest) and not store.exists("c")
    assert not store.exists("../etc") and not store.exists("")

    with pytest.raises(NotFoundError) as info:
        store.get("c")
    assert "Available templates: a, b, other." in info.value.message
    assert info.value.details == {"available": ["a", "b", "other"]}
    with pytest.raises(NotFoundError, match="no template has digest"):
        store.get("0" * 64)
    with pytest.raises(InvalidRequestError):
        store.get("../../etc")

    store.remove("a")  # b still uses the rootfs
    assert a.rootfs.is_dir() and not store.exists("a") and store.get("b").rootfs == a.rootfs
    store.remove("b")
    assert not a.path.exists()
    assert [t.name for t in store.list()] == ["other"]
    assert build_dirs(store) == []
    with pytest.raises(NotFoundError):
        store.remove("b")


def test_store_home_defaults_to_corral_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_HOME", str(tmp_path))
    assert TemplateStore().root == tmp_path / "templates"
    assert TemplateStore(tmp_path / "x").root == tmp_path / "x" / "templates"


def test_template_to_dict(tmp_path: Path, store: TemplateStore, image: Image) -> None:
    template = import_image(write_oci_dir(image, tmp_path / "oci"), "img", store)
    data = json.loads(json.dumps(template.to_dict()))
    assert data["name"] == "img" and data["digest"] == template.digest and data["source"] == "oci"
    assert data["rootfs"] == str(template.rootfs) and template.path == template.rootfs.parent
    assert isinstance(template, Template)


def test_leftover_build_dirs_are_reaped_but_live_ones_kept(tmp_path: Path, store: TemplateStore) -> None:
    store.root.mkdir(parents=True)
    dead = store.root / ".build-dead-0000"
    (dead / "rootfs" / "etc").mkdir(parents=True)
    (dead / "rootfs" / "etc" / "x").write_text("x")
    trash = store.root / ".trash-old-0000"
    trash.mkdir()
    live = store.root / ".build-live-0000"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a build in progress holds it
    try:
        import_image(write_docker_archive(make_image([[Entry("f", data=b"1")]]), tmp_path / "d.tar"), "img", store)
        assert build_dirs(store) == [".build-live-0000"]
    finally:
        os.close(fd)
    store.reap()
    assert build_dirs(store) == []


@needs_root
def test_reaping_unmounts_first_and_never_deletes_through_a_mount(tmp_path: Path, store: TemplateStore) -> None:
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / "precious").write_text("must survive")
    leftover = store.root / ".build-crashed-0000" / "rootfs"
    for sub in ("dev", "proc"):
        (leftover / sub).mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(host_dir), str(leftover / "dev")], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(leftover / "proc")], check=True)
    try:
        store.reap()
        assert build_dirs(store) == []
        assert (host_dir / "precious").read_text() == "must survive"
        assert str(store.root) not in Path("/proc/self/mountinfo").read_text()
    finally:
        for sub in ("dev", "proc"):
            subprocess.run(["umount", "-l", str(leftover / sub)], check=False, capture_output=True)


# -- mmdebstrap builds ---------------------------------------------------------------------------------


def test_build_needs_root(monkeypatch: pytest.MonkeyPatch, store: TemplateStore) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TemplateBuildError, match="needs root"):
        build_template(TemplateSpec(name="t"), store, rootless=False)  # (rootless: test_templates_rootless.py)
    assert build_dirs(store) == []


def test_mmdebstrap_gets_the_whole_package_list(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(build_module, "_run", lambda cmd, **_kw: commands.append(list(cmd)))
    spec = TemplateSpec(name="t", apt_packages=["procps", "curl"], pip_packages=["six"])
    build_module._mmdebstrap(spec, tmp_path / "rootfs", lambda _line: None)
    (cmd,) = commands
    assert cmd[:5] == ["unshare", "--mount", "--pid", "--fork", "--kill-child"]
    assert "--include=ca-certificates,curl,procps,python3-pip" in cmd  # one apt run resolves them all
    assert "--mode=root" in cmd and "--variant=minbase" in cmd
    assert cmd[-4:] == ["--", "bookworm", str(tmp_path / "rootfs"), "http://deb.debian.org/debian"]
    assert not any(c.startswith("--hook-dir=") and "file-mirror" in c for c in cmd)
    ca = tmp_path / "proxy-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("PIP_CERT", str(ca))
    build_module._mmdebstrap(spec, tmp_path / "rootfs", lambda _line: None)
    assert f'--aptopt=Acquire::https::CAInfo "{ca}"' in commands[-1]  # apt trusts what pip trusts
    commands.clear()
    (tmp_path / "mirror").mkdir()
    build_module._mmdebstrap(TemplateSpec(name="t", mirror=f"file://{tmp_path}/mirror"), tmp_path / "r2",
                             lambda _line: None)
    assert f"--hook-dir={build_module._FILE_MIRROR_HOOKS}" in commands[0]
    assert not any(c.startswith("--include") for c in commands[0])


def test_file_mirror_must_be_a_directory(tmp_path: Path) -> None:
    assert build_module._local_mirror("http://deb.debian.org/debian") is None
    (tmp_path / "my mirror").mkdir()
    assert build_module._local_mirror(f"file://{tmp_path}/my%20mirror") == tmp_path / "my mirror"
    with pytest.raises(TemplateBuildError, match="does not exist"):
        build_module._local_mirror(f"file://{tmp_path}/nope")


@needs_mmdebstrap
@pytest.mark.slow  # a real mmdebstrap run
def test_failed_build_leaves_nothing(store: TemplateStore) -> None:
    spec = TemplateSpec(name="broken", mirror="http://127.0.0.1:9/debian")
    lines: list[str] = []
    with pytest.raises(TemplateBuildError) as info:
        build_template(spec, store, progress=lines.append)
    assert "mmdebstrap failed" in info.value.message
    assert "Could not connect to 127.0.0.1:9" in info.value.message
    assert any(line.startswith("==> mmdebstrap bookworm") for line in lines)
    assert store.list() == [] and not store.exists("broken") and not store.exists(spec.digest())
    assert sorted(p.name for p in store.root.iterdir()) == [".lock"]


@contextlib.contextmanager
def silent_mirror() -> Iterator[str]:
    """A mirror that accepts connections and never answers: apt waits on it until stopped."""
    with silent_server() as address:
        yield f"http://{address}/debian"

def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = Path("/proc", pid, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if text in cmdline:
                    found.append(f"{pid}: {cmdline}")
    return found


def wait_until(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


@needs_mmdebstrap
def test_ctrl_c_during_mmdebstrap_stops_it_and_leaves_nothing(store: TemplateStore) -> None:
    def interrupt_once_downloading(line: str) -> None:
        if line.startswith(DOWNLOADING):
            raise KeyboardInterrupt

    with silent_mirror() as mirror, pytest.raises(KeyboardInterrupt):
        build_template(TemplateSpec(name="t", mirror=mirror), store, progress=interrupt_once_downloading)
    assert build_dirs(store) == []
    assert store.list() == []
    assert wait_until(lambda: not processes_mentioning(str(store.root)))


BUILDER_SCRIPT = textwrap.dedent(
    """
    import sys
    from corral.templates import TemplateSpec, TemplateStore, build_template
    spec = TemplateSpec(name="t", mirror=sys.argv[2])
    build_template(spec, TemplateStore(sys.argv[1]), progress=lambda line: print(line, flush=True))
    """
)


def start_builder(store: TemplateStore, mirror: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILDER_SCRIPT, str(store.home), mirror],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(DOWNLOADING):
            return proc
    proc.wait()
    raise AssertionError("the builder ended before mmdebstrap started downloading")


@needs_mmdebstrap
def test_sigterm_during_mmdebstrap_cleans_up(store: TemplateStore) -> None:
    with silent_mirror() as mirror:
        proc = start_builder(store, mirror)
        assert len(build_dirs(store)) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert proc.stdout is not None
        proc.stdout.close()
        assert build_dirs(store) == []
        assert wait_until(lambda: not processes_mentioning(str(store.root)))
    assert store.list() == []


@needs_mmdebstrap
@pytest.mark.slow  # a real mmdebstrap run, killed
def test_sigkill_leaves_no_template_and_next_build_reaps(store: TemplateStore) -> None:
    with silent_mirror() as mirror:
        proc = start_builder(store, mirror)
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        # mmdebstrap dies with its parent (parent-death signal) rather than running on.
        assert wait_until(lambda: not processes_mentioning(str(store.root)))
        leftovers = build_dirs(store)
        assert len(leftovers) == 1  # no cleanup ran; nothing is visible as a template though
        assert store.list() == [] and not store.exists("t")
    with pytest.raises(TemplateBuildError):
        build_template(TemplateSpec(name="t", mirror="http://127.0.0.1:9/debian"), store)
    assert build_dirs(store) == []


@pytest.mark.slow
@pytest.mark.timeout(900)  # an mmdebstrap run takes 20-200 s, depending on the mirror and the machine
@needs_mmdebstrap
def test_build_minimal_template_then_rebuild_instantly(store: TemplateStore) -> None:
    spec = TemplateSpec(
        name="tiny",
        files={
            "/etc/corral-test": "hello\n",
            "/home/user/.config/app/settings": "x=1\n",
            "/workspace/README": "hi",
        },
        env={"LANG": "C.UTF-8", "GREETING": "hello"},
    )
    lines: list[str] = []
    started = time.monotonic()
    template = build_template(spec, store, progress=lines.append)
    assert time.monotonic() - started < 240
    assert any(line.startswith("I: ") for line in lines)  # mmdebstrap's output was streamed
    assert f"==> mmdebstrap bookworm (minbase) from {spec.mirror}" in lines  # no packages asked for

    root = template.rootfs
    assert (template.name, template.digest, template.source) == ("tiny", spec.digest(), "mmdebstrap")
    assert template.env == {"LANG": "C.UTF-8", "GREETING": "hello"}
    assert template.spec == spec.model_dump(mode="json")
    assert 50e6 < template.size_bytes < 400e6
    assert "VERSION_CODENAME=bookworm" in (root / "etc" / "os-release").read_text()
    assert "user:x:1000:1000::/home/user:/bin/bash" in (root / "etc" / "passwd").read_text().splitlines()
    assert "user:x:1000:" in (root / "etc" / "group").read_text().splitlines()
    for path in ("dev", "proc", "sys", "tmp", "workspace", "home/user", ".corral"):
        assert (root / path).is_dir() and not (root / path).is_symlink(), path
    for path in (
        "workspace",
        "home/user",
        "home/user/.config",
        "home/user/.config/app/settings",
        "workspace/README",
    ):
        st = os.lstat(root / path)
        assert (st.st_uid, st.st_gid) == (1000, 1000), path
    st = os.lstat(root / "etc" / "corral-test")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
    assert (root / "etc" / "corral-test").read_text() == "hello\n"
    assert (root / "home" / "user" / ".bashrc").is_file()  # useradd copied /etc/skel
    assert not list((root / "var" / "cache" / "apt" / "archives").glob("*.deb"))
    assert {p.name for p in (root / "var" / "lib" / "apt" / "lists").iterdir()} <= {"lock", "partial"}
    # merged /usr by symlinks, as debootstrap made it, without the usrmerge package (and its perl)
    assert os.readlink(root / "bin") == "usr/bin"
    installed = subprocess.run(["dpkg-query", f"--admindir={root}/var/lib/dpkg", "-W", "-f", "${Package}\\n"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert "usr-is-merged" in installed and "usrmerge" not in installed and "perl" not in installed
    for build_config in ("etc/apt/apt.conf.d/99mmdebstrap", "etc/dpkg/dpkg.cfg.d/99mmdebstrap"):
        assert not os.path.lexists(root / build_config)
    dev_modes = [os.lstat(p).st_mode for p in (root / "dev").iterdir()]
    assert not [m for m in dev_modes if stat.S_ISCHR(m) or stat.S_ISBLK(m)]
    assert build_dirs(store) == []
    assert str(store.root) not in Path("/proc/self/mountinfo").read_text()
    metadata = json.loads((template.path / "template.json").read_text())
    assert metadata["digest"] == spec.digest() and metadata["source"] == "mmdebstrap"

    lines.clear()
    started = time.monotonic()
    again = build_template(spec, store, progress=lines.append)
    assert time.monotonic() - started < 2
    assert again == template
    assert lines == [f"==> template 'tiny' is up to date ({spec.digest()[:12]})"]

    renamed = build_template(spec.model_copy(update={"name": "tiny2"}), store)
    assert renamed.digest == template.digest and renamed.name == "tiny2"
    assert [t.name for t in store.list()] == ["tiny", "tiny2"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # an mmdebstrap run takes 20-200 s, depending on the mirror and the machine
@needs_mmdebstrap
def test_build_installs_pip_packages(store: TemplateStore) -> None:
    spec = TemplateSpec(name="pip", pip_packages=["six==1.16.0"])
    lines: list[str] = []
    template = build_template(spec, store, progress=lines.append)
    # pip and its certificates came in mmdebstrap's one apt run, whose output was streamed.
    assert f"==> mmdebstrap bookworm (minbase) from {spec.mirror} with ca-certificates python3-pip" in lines
    assert any(line.startswith("Setting up python3-pip") for line in lines)
    site = template.rootfs / "usr" / "local" / "lib" / "python3.11" / "dist-packages"
    assert (site / "six.py").is_file()
    assert (template.rootfs / "usr" / "bin" / "pip3").exists()
    assert not (template.rootfs / "root" / ".cache" / "pip").exists()
    # Nothing the build used is left: service policy, the host's CA copy, apt's downloads, lists and logs.
    root = template.rootfs
    for leftover in ("usr/sbin/policy-rc.d", "tmp/corral-build-ca.pem"):
        assert not os.path.lexists(root / leftover), leftover
    assert not list((root / "var" / "cache" / "apt" / "archives").glob("*.deb"))
    assert not list((root / "var" / "cache" / "apt").glob("*.bin"))
    assert {p.name for p in (root / "var" / "lib" / "apt" / "lists").iterdir()} <= {"lock", "partial"}
    assert list((root / "var" / "log" / "apt").iterdir()) == []
    assert (root / "etc" / "resolv.conf").read_bytes() == build_module._RESOLV_CONF
    # mmdebstrap's /dev and /sys were the build's own: nothing of them reached the rootfs or the host.
    dev_modes = [os.lstat(p).st_mode for p in (root / "dev").iterdir()]
    assert not [m for m in dev_modes if stat.S_ISCHR(m) or stat.S_ISBLK(m)]
    assert list((root / "sys").iterdir()) == []
    assert str(store.root) not in Path("/proc/self/mountinfo").read_text()


def processes_rooted_in(path: Path) -> list[str]:
    """Processes whose root directory (chroot) or cwd is under `path`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for link in ("root", "cwd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/{link}").startswith(str(path)):
                        found.append(f"{pid} ({link})")
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)  # an mmdebstrap run takes 20-200 s, depending on the mirror and the machine
@needs_mmdebstrap
def test_ctrl_c_during_dpkg_stops_it_and_leaves_nothing(store: TemplateStore) -> None:
    def interrupt_while_dpkg_runs(line: str) -> None:
        if line.startswith("Unpacking "):
            raise KeyboardInterrupt

    spec = TemplateSpec(name="t", apt_packages=["file", "less", "procps"])
    with pytest.raises(KeyboardInterrupt):
        build_template(spec, store, progress=interrupt_while_dpkg_runs)
    assert build_dirs(store) == [] and store.list() == []
    assert wait_until(lambda: not processes_mentioning(str(store.root)))
    assert wait_until(lambda: not processes_rooted_in(store.root))
    assert str(store.root) not in Path("/proc/self/mountinfo").read_text()


# -- the suite's template ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.runc
async def test_default_template_runs_node_and_npm(engine: Any, sandbox: Any) -> None:
    if TEMPLATE != "default":
        pytest.skip(f"the suite runs on template {TEMPLATE!r}, not 'default'")
    template = engine.templates.get(TEMPLATE)
    if template.digest != DEFAULT_TEMPLATE.digest():
        pytest.skip(
            f"the 'default' template in {template.rootfs.parent.parent} was built from an older spec or "
            "builder; rebuild it with `corral templates build default`"
        )
    r = await sandbox.exec("node -v && npm -v && npm config get registry")
    assert r.exit_code == 0, r.stderr
    node, npm, registry = r.stdout.split()
    assert node.startswith("v") and npm[0].isdigit()
    assert registry.startswith("http")
