"""Templates as OCI images: `corral templates push` against a real registry on loopback (Debian's
`docker-registry`), read back with skopeo; and zstd layers through the real import path."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import http.server
import json
import marshal
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from corral import AuthenticationError, InvalidRequestError, ServerError
from corral.backends import UnixEndpoint
from corral.backends.docker._container import AGENT_ARGV
from corral.backends.local import _bundle
from corral.backends.local._agent_files import install_agent
from corral.cli import app
from corral.engine._agent_client import AgentClient
from corral.templates import (
    AGENT_ENTRYPOINT,
    AgentFiles,
    PushedImage,
    Template,
    TemplateStore,
    import_image,
    parse_reference,
    push_template,
    write_image,
)

from .conftest import IN_CI, TEMPLATE_HOME
from .fakes import silent_server

REGISTRY_BIN = "/usr/bin/docker-registry"
needs_registry = pytest.mark.skipif(
    os.geteuid() != 0 or not (Path(REGISTRY_BIN).exists() and shutil.which("skopeo")),
    reason="needs root, skopeo and docker-registry (scripts/install installs them)",
)


# -- the registry and the template --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the registry exited at start"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"the registry did not listen on {port} within {timeout} s")


@dataclass(frozen=True)
class Registry:
    host: str  # 127.0.0.1:PORT
    log: Path  # its access log: one line per request

    def __str__(self) -> str:
        return self.host

    def uploads(self) -> int:
        """Blob uploads started so far (a blob the registry has is only HEAD-checked)."""
        return sum(1 for line in self.log.read_text().splitlines() if '"POST /v2/' in line and "/blobs/uploads" in line)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """A real registry (distribution 2.8) on loopback, plain HTTP, filesystem storage in a temp dir."""
    port = free_port()
    root = tmp_path / "registry"
    (root / "data").mkdir(parents=True)
    config = root / "config.yml"
    config.write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(root / "log", "wb")
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc)
        yield Registry(f"127.0.0.1:{port}", root / "log")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(tmp_path: Path) -> TemplateStore:
    return TemplateStore(tmp_path / "home")


@pytest.fixture
def agent(store: TemplateStore) -> AgentFiles:
    return AgentFiles(install_agent(store.home))


def make_rootfs(root: Path) -> None:
    """A small root filesystem with every kind of entry a layer must carry (or leave out)."""
    for d in ("etc", "bin", "lib", "run", ".corral", "tmp", "dev", "proc", "sys"):
        (root / d).mkdir(parents=True, mode=0o755)
    os.chmod(root / "tmp", 0o1777)
    (root / "etc" / "hostname").write_text("tiny\n")
    os.link(root / "etc" / "hostname", root / "etc" / "hostname2")
    (root / "etc" / "shadow").write_text("root:*:1::::::\n")
    os.chmod(root / "etc" / "shadow", 0o640)
    os.chown(root / "etc" / "shadow", 0, 42)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    os.chmod(root / "bin" / "tool", 0o4755)
    os.symlink("../etc/hostname", root / "bin" / "link")
    os.mkfifo(root / "run" / "fifo", 0o600)
    os.mknod(root / "lib" / "devnull", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (root / "lib" / "attrs").write_text("x")
    os.setxattr(root / "lib" / "attrs", "user.corral", b"\x00\xffvalue")
    for d in ("home/user", "workspace"):
        (root / d).mkdir(parents=True, mode=0o750)
        os.chown(root / d, 1000, 1000)
    (root / "home" / "user" / ".profile").write_text("export A=1\n")
    os.chown(root / "home" / "user" / ".profile", 1000, 1000)


@pytest.fixture
def tiny(store: TemplateStore) -> Template:
    with store.staging("ab" * 32) as staging:
        staging.rootfs.mkdir(mode=0o755)
        make_rootfs(staging.rootfs)
        return staging.publish(name="tiny", source="debootstrap", spec={}, env={"LANG": "C.UTF-8", "GREETING": "hi"})


def skopeo(*args: str) -> str:
    result = subprocess.run(["skopeo", "--command-timeout", "120s", *args], capture_output=True, text=True,
                            timeout=150, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def catalog(registry: Registry) -> list[str]:
    with urllib.request.urlopen(f"http://{registry}/v2/_catalog", timeout=10) as response:
        return list(json.load(response)["repositories"])


def pull(ref: str, dest: Path) -> tuple[dict[str, Any], dict[str, Any], list[Path]]:
    """The image at `ref` copied into an OCI layout at `dest`: (manifest, config, layer blob paths)."""
    skopeo("copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{dest}:pulled")
    blobs = dest / "blobs" / "sha256"
    index = json.loads((dest / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"].removeprefix("sha256:")).read_text())
    config = json.loads((blobs / manifest["config"]["digest"].removeprefix("sha256:")).read_text())
    layers = [blobs / layer["digest"].removeprefix("sha256:") for layer in manifest["layers"]]
    return manifest, config, layers


def members(layer: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(layer, "r:*") as tar:
        return {m.name.rstrip("/"): m for m in tar.getmembers()}


# -- references ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:5000/corral", ("127.0.0.1:5000", "corral", "tiny")),
        ("localhost/a/b:v1.2", ("localhost", "a/b", "v1.2")),
        ("registry.example.com/corral/default:latest", ("registry.example.com", "corral/default", "latest")),
        ("[::1]:5000/x__y-z.w", ("[::1]:5000", "x__y-z.w", "tiny")),
    ],
)
def test_references_are_parsed(text: str, expected: tuple[str, str, str]) -> None:
    ref = parse_reference(text, default_tag="tiny")
    assert (ref.registry, ref.repository, ref.tag) == expected
    assert ref.pinned("sha256:" + "0" * 64) == f"{expected[0]}/{expected[1]}@sha256:{'0' * 64}"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("corral/default", "not a registry host"),  # docker.io is never implied
        ("ubuntu", "no registry"),
        ("127.0.0.1:5000/", "no registry"),
        ("127.0.0.1:5000/Upper", "repository path component"),
        ("127.0.0.1:5000/a//b", "repository path component"),
        ("127.0.0.1:5000/a:-bad", "is not a tag"),
        ("127.0.0.1:5000/a@sha256:" + "0" * 64, "not a digest"),
        ("127.0.0.1:5000/a b", "repository path component"),
        ("127.0.0.1:5000/" + "a" * 300, "longer than"),
    ],
)
def test_bad_references_are_refused(text: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        parse_reference(text, default_tag="tiny")


def test_the_entrypoint_is_the_agent_as_the_other_backends_start_it() -> None:
    assert list(AGENT_ENTRYPOINT) == AGENT_ARGV
    source = Path(_bundle.__file__).read_text()
    assert json.dumps(list(AGENT_ENTRYPOINT)) in source.replace("'", '"')
    assert _bundle.AGENT_DIR == "/.corral/agent"


# -- pushing -------------------------------------------------------------------------------------------


@needs_registry
def test_push_round_trip(registry: Registry, store: TemplateStore, tiny: Template, agent: AgentFiles,
                         tmp_path: Path) -> None:
    lines: list[str] = []
    result = push_template(tiny, f"{registry}/corral/tiny", store, agent=agent, insecure=True,
                           progress=lines.append)
    assert result.reference == f"{registry}/corral/tiny@{result.digest}"
    assert result.tag == f"{registry}/corral/tiny:tiny"
    assert lines[-1] == f"==> pushed {result.reference}"
    assert any(line.startswith("==> rootfs layer sha256:") and "1 device nodes" in line for line in lines)
    assert any("Copying blob" in line for line in lines)  # skopeo's progress was streamed

    # The registry serves what was printed, under the tag and under the digest.
    inspected = json.loads(skopeo("inspect", "--tls-verify=false", f"docker://{result.tag}"))
    assert inspected["Digest"] == result.digest
    raw = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{result.reference}")
    assert "sha256:" + hashlib.sha256(raw.encode()).hexdigest() == result.digest

    manifest, config, layers = pull(result.reference, tmp_path / "pulled")
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert [layer["mediaType"] for layer in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"] * 2
    run = config["config"]
    assert run["User"] == "1000:1000" and run["WorkingDir"] == "/.corral"
    assert run["Entrypoint"] == list(AGENT_ENTRYPOINT)
    assert run["Env"] == ["GREETING=hi", "LANG=C.UTF-8",
                          "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    assert run["Labels"]["org.corral.template.digest"] == tiny.digest

    rootfs, agent_layer = members(layers[0]), members(layers[1])
    shadow = rootfs["etc/shadow"]
    assert (shadow.uid, shadow.gid, shadow.mode, shadow.uname) == (0, 42, 0o640, "")
    assert rootfs["bin/tool"].mode == 0o4755
    assert rootfs["bin/link"].issym() and rootfs["bin/link"].linkname == "../etc/hostname"
    assert rootfs["etc/hostname"].isreg() and rootfs["etc/hostname2"].islnk()
    assert rootfs["etc/hostname2"].linkname == "etc/hostname"
    assert rootfs["run/fifo"].isfifo()
    assert "lib/devnull" not in rootfs  # device nodes are the runtime's business
    assert rootfs["lib/attrs"].pax_headers["SCHILY.xattr.user.corral"].encode("utf-8", "surrogateescape") == \
        b"\x00\xffvalue"
    home = rootfs["home/user"]
    assert (home.uid, home.gid, home.mode) == (1000, 1000, 0o750)
    assert (rootfs["home/user/.profile"].uid, rootfs["tmp"].mode) == (1000, 0o1777)
    names = list(rootfs)
    assert names == sorted(names, key=lambda n: n.split("/"))  # sorted, parents first

    agent_files = {name: m for name, m in agent_layer.items()}
    assert {".corral", ".corral/agent", ".corral/agent/__main__.py", ".corral/agent/protocol.py"} <= set(agent_files)
    for m in agent_files.values():
        assert (m.uid, m.gid, m.mtime) == (0, 0, 0)
        assert m.mode in (0o755, 0o644), (m.name, oct(m.mode))
    assert agent_files[".corral/agent/__main__.py"].mode == 0o644
    # Its bytecode names the files where the image has them (not the host copy's path).
    with tarfile.open(layers[1], "r:*") as tar:
        pyc = tar.extractfile(f".corral/agent/__pycache__/__main__.{sys.implementation.cache_tag}.pyc")
        assert pyc is not None
        code = marshal.loads(pyc.read()[16:])
    assert code.co_filename == "/.corral/agent/__main__.py"

    # The pinned reference is recorded with the template, and shown by `corral templates show`.
    again = store.get("tiny")
    assert [p.reference for p in again.pushed] == [result.reference]
    assert again.to_dict()["pushed"][0]["tag"] == result.tag

    # Corral's own importer reads the image back: the agent lands where sandboxes find it.
    imported = import_image(tmp_path / "pulled", "back", TemplateStore(tmp_path / "other"))
    assert (imported.rootfs / ".corral" / "agent" / "__main__.py").is_file()
    assert (imported.rootfs / "etc" / "hostname").read_text() == "tiny\n"
    assert os.lstat(imported.rootfs / "etc" / "hostname").st_ino == \
        os.lstat(imported.rootfs / "etc" / "hostname2").st_ino


@needs_registry
def test_second_push_sends_no_layer_and_digests_are_reproducible(registry: Registry, store: TemplateStore,
                                                                 tiny: Template, agent: AgentFiles,
                                                                 tmp_path: Path) -> None:
    first = push_template(tiny, f"{registry}/corral/tiny:v1", store, agent=agent, insecure=True)
    uploads = registry.uploads()
    assert uploads == 3  # two layers and the config
    lines: list[str] = []
    second = push_template(tiny, f"{registry}/corral/tiny:v1", store, agent=agent, insecure=True,
                           progress=lines.append)
    assert second.digest == first.digest
    assert registry.uploads() == uploads  # the registry had every blob: only the manifest was written again
    assert any("rootfs layer" in line and "already made" in line for line in lines)
    assert [p.tag for p in store.get("tiny").pushed] == [f"{registry}/corral/tiny:v1"]

    # From scratch (no cached layer, no layout) and with the agent installed elsewhere by another process (its
    # host bytecode names another path): the very same image, byte for byte.
    shutil.rmtree(store.home / "images")
    elsewhere = tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from corral.backends.local._agent_files import install_agent; "
                    "print(install_agent(Path(sys.argv[1])))", str(elsewhere)], check=True, timeout=120)
    other_agent = AgentFiles(next((elsewhere / "agent").glob("*/agent")))
    assert other_agent.directory != agent.directory
    third = push_template(tiny, f"{registry}/corral/tiny:v2", store, agent=other_agent, insecure=True)
    assert third.digest == first.digest
    assert [p.tag for p in store.get("tiny").pushed] == [f"{registry}/corral/tiny:v1", f"{registry}/corral/tiny:v2"]


@needs_registry
def test_bad_reference_is_refused_before_anything(registry: Registry, store: TemplateStore, tiny: Template,
                                                  agent: AgentFiles) -> None:
    with pytest.raises(InvalidRequestError, match="invalid image reference"):
        push_template(tiny, f"{registry}/Corral/Tiny", store, agent=agent, insecure=True)
    with pytest.raises(InvalidRequestError, match="USER:PASSWORD"):
        push_template(tiny, f"{registry}/corral/tiny", store, agent=agent, insecure=True, creds="no-colon")
    assert not (store.home / "images").exists()
    assert catalog(registry) == []
    assert store.get("tiny").pushed == ()


@needs_registry
def test_unreachable_registry_is_a_structured_error(store: TemplateStore, tiny: Template,
                                                    agent: AgentFiles) -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(ServerError) as info:
        push_template(tiny, f"127.0.0.1:{port}/corral/tiny", store, agent=agent, insecure=True, timeout=60)
    assert info.value.details["reason"] == "unreachable"
    assert info.value.details["registry"] == f"127.0.0.1:{port}"
    assert "connection refused" in info.value.message.lower()
    assert store.get("tiny").pushed == ()


@needs_registry
def test_plain_http_registry_without_insecure_says_so(registry: Registry, store: TemplateStore, tiny: Template,
                                                      agent: AgentFiles) -> None:
    with pytest.raises(ServerError, match="needs --insecure") as info:
        push_template(tiny, f"{registry}/corral/tiny", store, agent=agent, timeout=60)
    assert info.value.details["reason"] == "unreachable"
    assert catalog(registry) == [] and store.get("tiny").pushed == ()


def silent_registry() -> contextlib.AbstractContextManager[str]:
    """Accepts connections and never answers: only a timeout ends a push to it."""
    return silent_server()

@needs_registry
@pytest.mark.slow  # waits out a timeout
def test_a_registry_that_never_answers_times_out(store: TemplateStore, tiny: Template, agent: AgentFiles) -> None:
    with silent_registry() as host:
        started = time.monotonic()
        with pytest.raises(ServerError) as info:
            push_template(tiny, f"{host}/corral/tiny", store, agent=agent, insecure=True, timeout=3)
        assert time.monotonic() - started < 30
    assert info.value.details["reason"] == "timeout", info.value.message
    assert store.get("tiny").pushed == ()


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A registry that wants a login and accepts none, recording the Authorization headers it was sent."""

    seen: ClassVar[list[str]] = []

    def _refuse(self) -> None:
        self.seen.append(self.headers.get("Authorization", ""))
        body = b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}'
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="corral-test"')
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = _refuse

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_registry() -> Iterator[str]:
    _Refusing.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@needs_registry
def test_refused_credentials_are_an_authentication_error(refusing_registry: Registry, store: TemplateStore,
                                                         tiny: Template, agent: AgentFiles,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_REGISTRY_CREDS", "alice:s3cret-pw")
    with pytest.raises(AuthenticationError) as info:
        push_template(tiny, f"{refusing_registry}/corral/tiny", store, agent=agent, insecure=True, timeout=60)
    assert info.value.details["reason"] == "unauthorized"
    assert "s3cret-pw" not in info.value.message and "s3cret-pw" not in json.dumps(info.value.details)
    # The credentials reached the registry (from the environment, through a private auth file).
    assert "Basic " + base64.b64encode(b"alice:s3cret-pw").decode() in _Refusing.seen
    assert store.get("tiny").pushed == ()


@needs_registry
def test_cli_push_prints_the_pinned_reference_and_show_lists_it(registry: Registry, store: TemplateStore,
                                                                tiny: Template) -> None:
    env = {"CORRAL_HOME": str(store.home)}
    r = CliRunner().invoke(app, ["templates", "push", "tiny", f"{registry}/corral/cli", "--insecure"], env=env)
    assert r.exit_code == 0, r.output
    reference = r.stdout.strip().splitlines()[-1]
    assert reference.startswith(f"{registry}/corral/cli@sha256:")
    shown = CliRunner().invoke(app, ["templates", "show", "tiny"], env=env)
    assert shown.exit_code == 0
    assert json.loads(shown.stdout)["pushed"][0]["reference"] == reference


def test_pushed_records_survive_a_reload(store: TemplateStore, tiny: Template) -> None:
    image = PushedImage("r.example/x@sha256:" + "1" * 64, "sha256:" + "1" * 64, "r.example/x:t", "sha256:" + "2" * 64,
                        datetime(2026, 12, 4, tzinfo=UTC))
    recorded = store.record_push(tiny, image)
    assert recorded.pushed == (image,)
    assert TemplateStore(store.home).get("tiny").pushed == (image,)


# -- zstd layers, as skopeo writes them, through the real import path ------------------------------------


@needs_registry
def test_zstd_image_written_by_skopeo_is_imported(store: TemplateStore, tiny: Template, agent: AgentFiles,
                                                  tmp_path: Path) -> None:
    image = write_image(tiny, agent, store.home, emit=lambda _line: None)
    zstd_dir = tmp_path / "zstd"
    skopeo("copy", "--dest-compress-format", "zstd", f"oci:{image.layout}:{image.ref}", f"oci:{zstd_dir}:z")
    index = json.loads((zstd_dir / "index.json").read_text())
    blobs = zstd_dir / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"].removeprefix("sha256:")).read_text())
    assert [layer["mediaType"] for layer in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+zstd"] * 2
    for layer in manifest["layers"]:
        assert (blobs / layer["digest"].removeprefix("sha256:")).read_bytes()[:4] == b"\x28\xb5\x2f\xfd"

    lines: list[str] = []
    imported = import_image(zstd_dir, "from-zstd", TemplateStore(tmp_path / "other"), progress=lines.append)
    root = imported.rootfs
    assert (root / "etc" / "hostname").read_text() == "tiny\n"
    assert stat.S_IMODE(os.lstat(root / "bin" / "tool").st_mode) == 0o4755
    assert (os.lstat(root / "home" / "user").st_uid, os.lstat(root / "etc" / "shadow").st_gid) == (1000, 42)
    assert (root / ".corral" / "agent" / "__main__.py").read_bytes() == (agent.directory / "__main__.py").read_bytes()
    assert imported.spec["layers"] == json.loads(
        (image.layout / "blobs" / "sha256" / image.config.digest.removeprefix("sha256:")).read_text()
    )["rootfs"]["diff_ids"]


# -- the default template through Docker: pulled by digest from the registry, its agent answering -------------


def docker(*args: str, timeout: float = 600) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout.strip()


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                           timeout=30, check=False)
    return probe.returncode == 0


@contextlib.contextmanager
def default_template_in(store: TemplateStore) -> Iterator[Template]:
    """The suite's `default` template, named in `store` without copying it: the build directory's rootfs is a
    symlink to the real one, which the push only reads. Nothing is written to the real store."""
    source = TemplateStore(TEMPLATE_HOME)
    if not source.exists("default"):
        pytest.skip(f"no 'default' template in {TEMPLATE_HOME}")
    real = source.get("default")
    with store.staging(real.digest) as staging:
        staging.rootfs.symlink_to(real.rootfs)
        yield staging.publish(name="default", source=real.source, spec=real.spec, env=real.env)


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(1200)
@needs_registry
@pytest.mark.skipif(IN_CI and not os.environ.get("CORRAL_TEST_FULL_PUSH"),
                    reason="under CI (its 45-minute budget, README 'Development'): pushing and pulling the whole "
                           "default template takes 200 s; the push round trips above run with a small template; "
                           "CORRAL_TEST_FULL_PUSH=1 runs it")
def test_docker_runs_the_pushed_default_template_and_its_agent_serves(registry: Registry, tmp_path: Path) -> None:
    if not docker_available():
        pytest.fail("no Docker daemon answers: start one with scripts/start-dockerd")
    store = TemplateStore(tmp_path / "home")
    container = f"corral-push-test-{os.getpid()}"
    pinned = ""
    try:
        with default_template_in(store) as template:
            agent = AgentFiles(install_agent(store.home))
            started = time.monotonic()
            result = push_template(template, f"{registry}/corral/default", store, agent=agent, insecure=True)
            pushed_s = time.monotonic() - started
        pinned = result.reference
        started = time.monotonic()
        docker("pull", "-q", pinned)  # Docker takes 127.0.0.0/8 registries over plain HTTP
        pulled_s = time.monotonic() - started
        assert docker("image", "inspect", "--format", "{{index .RepoDigests 0}}", pinned) == pinned
        config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", pinned))
        assert (config["User"], config["WorkingDir"], config["Entrypoint"]) == \
            ("1000:1000", "/.corral", list(AGENT_ENTRYPOINT))
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        os.chmod(run_dir, 0o777)
        docker("run", "-d", "--rm", "--name", container, "--network", "none", "-e", "CORRAL_AGENT_TOKEN=t0ken",
               "-e", "CORRAL_AGENT_LISTEN=/.corral/run/agent.sock", "-v", f"{run_dir}:/.corral/run", pinned)
        socket_path = run_dir / "agent.sock"
        deadline = time.monotonic() + 60
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert socket_path.exists(), docker("logs", container)

        async def exec_in_sandbox() -> Any:
            client = AgentClient(UnixEndpoint(str(socket_path)), "t0ken")
            return await client.exec("id -u; pwd; python3 -c 'import numpy, pandas; print(numpy.__version__)'",
                                     timeout=60)

        r = asyncio.run(exec_in_sandbox())
        assert r.exit_code == 0, r.stderr
        uid, cwd, numpy_version = r.stdout.split()
        assert (uid, cwd) == ("1000", "/workspace") and numpy_version[0].isdigit()  # the agent's default cwd
        print(f"default template: pushed in {pushed_s:.0f} s, docker pull {pulled_s:.0f} s, {result.digest}")
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60, check=False)
        if pinned:
            subprocess.run(["docker", "rmi", "-f", pinned], capture_output=True, timeout=120, check=False)
        shutil.rmtree(store.home, ignore_errors=True)  # the symlinked rootfs is unlinked, never followed


@needs_registry
def test_images_of_removed_templates_are_pruned(registry: Registry, store: TemplateStore, tiny: Template,
                                                agent: AgentFiles) -> None:
    first = push_template(tiny, f"{registry}/corral/tiny", store, agent=agent, insecure=True)
    with store.staging("cd" * 32) as staging:
        staging.rootfs.mkdir(mode=0o755)
        (staging.rootfs / "other").write_text("another template\n")
        other = staging.publish(name="other", source="mmdebstrap", spec={}, env={})
    layout = store.home / "images" / "oci"
    (layout / "blobs" / ".tmp-leftover").write_bytes(b"a writer that was killed")
    blobs = layout / "blobs" / "sha256"
    rootfs_blob = blobs / first.image.layers[0].digest.removeprefix("sha256:")
    assert rootfs_blob.exists()

    # While `tiny` exists, pushing another template keeps its image.
    push_template(other, f"{registry}/corral/other", store, agent=agent, insecure=True)
    assert rootfs_blob.exists() and (store.home / "images" / "rootfs" / f"{tiny.digest}.json").exists()
    assert not (layout / "blobs" / ".tmp-leftover").exists()

    store.remove("tiny")
    lines: list[str] = []
    second = push_template(other, f"{registry}/corral/other", store, agent=agent, insecure=True,
                           progress=lines.append)
    assert any(line.startswith("==> removed ") and "unused image blobs" in line for line in lines)
    assert not rootfs_blob.exists() and not (store.home / "images" / "rootfs" / f"{tiny.digest}.json").exists()
    index = json.loads((layout / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [second.digest]
    remaining = {p.name for p in blobs.iterdir()}
    assert remaining == {d.removeprefix("sha256:") for d in
                         (second.digest, second.image.config.digest, *(lay.digest for lay in second.image.layers))}
    # What is left is a complete image: skopeo still reads it.
    json.loads(skopeo("inspect", f"oci:{layout}:{second.image.ref}"))
