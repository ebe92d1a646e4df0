"""Rootless template builds: a real build as an unprivileged user in a user namespace of its subordinate ids,
compared file by file with a root build of the same spec; and every missing prerequisite's error."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral import TemplateBuildError
from corral.backends.local._agent_files import install_agent
from corral.cli import app
from corral.templates import AgentFiles, Template, TemplateSpec, TemplateStore, build_template, push_template
from corral.templates import _userns as userns_module
from corral.templates._fs import mounts_under, remove_tree

from .fakes import silent_server
from .test_image_push import Registry, needs_registry, pull, registry  # noqa: F401 - registry: a fixture

_SBIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
needs_root_tools = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t, path=_SBIN_PATH) is None
                             for t in ("mmdebstrap", "newuidmap", "newgidmap", "runuser", "useradd")),
    reason="needs root, mmdebstrap, uidmap (newuidmap) and useradd",
)

# A small spec that still goes through every step: apt packages (pip's), the user, pip, user-owned files.
SPEC = TemplateSpec(
    name="rootless",
    pip_packages=["six==1.16.0"],
    files={"/etc/corral-test": "hello\n", "/home/user/.config/app/settings": "x=1\n", "/workspace/README": "hi"},
)

CLI_SCRIPT = "import sys; from corral.cli import main; sys.argv[0] = 'corral'; main()"
BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from corral.templates import TemplateSpec, TemplateStore, build_template
    spec = TemplateSpec.model_validate_json(sys.argv[2])
    try:
        template = build_template(spec, TemplateStore(sys.argv[1]), progress=lambda line: print(line, flush=True))
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc.message, flush=True)
        sys.exit(3)
    print("DIGEST", template.digest, template.name, template.source, template.rootfs, flush=True)
    """
)


@dataclass(frozen=True)
class BuildUser:
    name: str
    uid: int
    gid: int
    subid_start: int | None  # the same start in /etc/subuid and /etc/subgid, or None: no ranges
    home: Path  # a CORRAL_HOME the user owns

    def host_to_inside(self, host_id: int, own_id: int) -> int:
        """How the build's user namespace shows an owner on the host: the user's own id is root."""
        if host_id == own_id:
            return 0
        assert self.subid_start is not None
        assert self.subid_start <= host_id < self.subid_start + userns_module.NAMESPACE_IDS, host_id
        return host_id - self.subid_start + 1

    def run(self, *cmd: str, timeout: float = 900, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", self.name, "--", *cmd], capture_output=True, text=True,
                              timeout=timeout, check=False, env={**_user_env(), **(env or {})}, cwd=self.home)

    def python(self, *args: str, timeout: float = 900, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        return self.run(_python_for(self.name), *args, timeout=timeout, env=env)


def _user_env() -> dict[str, str]:
    # Corral and its dependencies by the test process's own import path (unreadable entries are skipped).
    return {"PATH": _SBIN_PATH, "LANG": "C.UTF-8", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _python_for(user: str) -> str:
    """An interpreter `user` may run: this one, or the system's of the same version (this one may sit in a
    directory only root can enter, such as /root/.pyenv)."""
    for candidate in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        probe = subprocess.run(["runuser", "-u", user, "--", candidate, "-c", "pass"], capture_output=True,
                               check=False)
        if probe.returncode == 0:
            return candidate
    pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that user {user} can run")


def _free_subid_start() -> int:
    """A range above everything /etc/subuid and /etc/subgid give and above the local backend's sandboxes."""
    end = 2_000_000_000
    for path in (userns_module.SUBUID, userns_module.SUBGID):
        for line in path.read_text().splitlines() if path.exists() else []:
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                end = max(end, int(fields[1]) + int(fields[2]))
    return end + 65536 * secrets.randbelow(64)


def _edit_subids(line: str, *, add: bool) -> None:
    for path in (userns_module.SUBUID, userns_module.SUBGID):
        lines = path.read_text().splitlines() if path.exists() else []
        lines = [*lines, line] if add else [entry for entry in lines if entry != line]
        path.write_text("".join(entry + "\n" for entry in lines))


def _processes_of(uid: int) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                found.append(pid)
    return found


@contextlib.contextmanager
def build_user(*, with_ranges: bool) -> Iterator[BuildUser]:
    """A throwaway unprivileged user (and its subordinate ids); everything it made is gone afterwards."""
    name = f"crl-rl-{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                    "/usr/sbin/nologin", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    home = Path(tempfile.mkdtemp(prefix="corral-rootless-"))  # in /tmp (sticky, 1777): reachable by the user
    os.chown(home, entry.pw_uid, entry.pw_gid)
    start = _free_subid_start() if with_ranges else None
    line = f"{name}:{start}:65536"
    if start is not None:
        _edit_subids(line, add=True)
    try:
        yield BuildUser(name, entry.pw_uid, entry.pw_gid, start, home)
    finally:
        leftover = _processes_of(entry.pw_uid)
        if start is not None:
            _edit_subids(line, add=False)
        remove_tree(home)
        subprocess.run(["userdel", name], check=True, capture_output=True)
        assert leftover == [], f"processes of {name} outlived the test: {leftover}"


@pytest.fixture(scope="module")
def ranged_user() -> Iterator[BuildUser]:
    with build_user(with_ranges=True) as user:
        yield user


@pytest.fixture
def plain_user() -> Iterator[BuildUser]:
    with build_user(with_ranges=False) as user:
        yield user


# -- the build ---------------------------------------------------------------------------------------------

Entry = tuple[str, int, int, str]  # file type and mode, owner, group, content (sha256 / link target / "")


def manifest(root: Path, owner: Callable[[int, bool], int]) -> dict[str, Entry]:
    """Every path under `root` with what a sandbox sees of it; `owner(id, is_group)` maps host ids to inside."""
    found: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            else:
                content = ""
            found[os.path.relpath(path, root)] = (oct(st.st_mode), owner(st.st_uid, False),
                                                  owner(st.st_gid, True), content)
    return found


def _differences(a: dict[str, Entry], b: dict[str, Entry]) -> list[str]:
    return [f"{path}: {a.get(path)} != {b.get(path)}" for path in sorted(a.keys() | b.keys())
            if a.get(path) != b.get(path)]


def _build_as(user: BuildUser, spec: TemplateSpec, home: Path) -> tuple[list[str], float]:
    started = time.monotonic()
    result = user.python("-c", BUILD_SCRIPT, str(home), spec.model_dump_json())
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines(), elapsed


def _inside(user: BuildUser, rootfs: Path, script: str) -> str:
    """`script` run by the sandbox user (1000) in the template, in the build's user namespace."""
    assert user.subid_start is not None
    prefix = userns_module.user_namespace(userns_module.IdRange(user.subid_start, 65536),
                                          userns_module.IdRange(user.subid_start, 65536))
    result = user.run(*prefix, "unshare", "--mount", "--pid", "--fork", "--kill-child",
                      f"--mount-proc={rootfs}/proc", "chroot", str(rootfs), "setpriv", "--reuid=1000",
                      "--regid=1000", "--clear-groups", "--", "/bin/sh", "-c", script, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@dataclass(frozen=True)
class Builds:
    """One spec built twice: rootless by `user` (the store in its home) and by root."""

    user: BuildUser
    lines: list[str]  # the rootless build's progress, with the script's DIGEST line last
    seconds: float
    rootfs: Path  # the rootless template's
    root_built: Template
    root_store: TemplateStore


@pytest.fixture(scope="module")
def builds(ranged_user: BuildUser, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    lines, rootless_s = _build_as(ranged_user, SPEC, ranged_user.home / "corral")
    print(f"rootless build: {rootless_s:.1f} s")
    root_store = TemplateStore(tmp_path_factory.mktemp("root-build") / "home")
    try:
        started = time.monotonic()
        root_built = build_template(SPEC, root_store, rootless=False)
        print(f"root build: {time.monotonic() - started:.1f} s")
        yield Builds(ranged_user, lines, rootless_s, Path(lines[-1].split()[-1]), root_built, root_store)
    finally:
        remove_tree(root_store.home)  # pytest keeps tmp_path: no rootfs is left in it


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two builds with pip: 1-5 minutes each, depending on the mirror and the machine
@needs_root_tools
def test_rootless_build_gives_the_root_builds_files_and_owners(builds: Builds) -> None:
    user, lines, rootfs = builds.user, builds.lines, builds.rootfs
    assert lines[0].startswith("==> rootless build: uid 0 is ")
    assert "==> creating user user (1000:1000)" in lines and "==> pip install six==1.16.0" in lines
    digest, name, source = lines[-1].split()[1:4]
    assert (digest, name, source) == (SPEC.digest(), "rootless", "mmdebstrap")
    assert builds.root_built.digest == digest  # one spec, one digest, whoever builds it

    # On the host: the namespace's root is the user, the sandbox user one of its subordinate ids.
    assert os.lstat(rootfs / "etc" / "passwd").st_uid == user.uid
    assert user.subid_start is not None
    assert os.lstat(rootfs / "home" / "user").st_uid == user.subid_start + 999
    # Inside: the same files, modes, owners, contents and links as the root build (mtimes are the builds').
    rootless = manifest(rootfs, lambda i, group: user.host_to_inside(i, user.gid if group else user.uid))
    assert _differences(manifest(builds.root_built.rootfs, lambda i, _group: i), rootless) == []
    assert rootless["home/user/.config/app/settings"][1:3] == (1000, 1000)
    assert rootless["usr/local/lib/python3.11/dist-packages/six.py"][1:3] == (0, 0)

    # What a sandbox's process sees: itself as 1000 owning its home, root's files as root's, pip's package.
    seen = _inside(user, rootfs, "id -u; stat -c %u:%g /home/user /etc/passwd /workspace/README; "
                                 "test -w /home/user && echo writable; python3 -c 'import six; print(six.__version__)'")
    assert seen.split() == ["1000", "1000:1000", "0:0", "1000:1000", "writable", "1.16.0"]

    # The store is the user's, holds no build leftovers, and nothing is still mounted or running.
    store_root = user.home / "corral" / "templates"
    assert os.lstat(store_root).st_uid == user.uid and os.lstat(store_root / "names").st_uid == user.uid
    assert sorted(p.name for p in store_root.iterdir()) == [".lock", digest, "names"]
    assert mounts_under(user.home) == []
    assert _processes_of(user.uid) == []

    # An unchanged spec is instant as a rootless build too.
    again, again_s = _build_as(user, SPEC, user.home / "corral")
    assert f"==> template 'rootless' is up to date ({digest[:12]})" in again and again_s < 10


def _layer_entries(layer: Path) -> dict[str, tuple[int, int, int, int, str, int]]:
    """A layer's entries without their mtimes: type, mode, owner, group, link target, size."""
    with tarfile.open(layer, "r:*") as tar:
        return {m.name.rstrip("/"): (int.from_bytes(m.type, "big"), m.mode, m.uid, m.gid, m.linkname, m.size)
                for m in tar.getmembers()}


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_root_tools
@needs_registry
def test_rootless_push_carries_the_owners_a_sandbox_sees(
    builds: Builds, registry: Registry, tmp_path: Path  # noqa: F811 - the fixture imported above
) -> None:
    user = builds.user
    started = time.monotonic()
    # As the user, by the CLI: `push` runs itself again in the build's user namespace.
    result = user.python("-c", CLI_SCRIPT, "templates", "push", "rootless", f"{registry}/corral/rootless",
                         "--insecure", timeout=600, env={"CORRAL_HOME": str(user.home / "corral")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    print(f"rootless push: {time.monotonic() - started:.1f} s")
    reference = result.stdout.split()[-1]
    assert reference.startswith(f"{registry}/corral/rootless@sha256:")
    root_push = push_template(builds.root_built, f"{registry}/corral/root", builds.root_store, insecure=True,
                              agent=AgentFiles(install_agent(builds.root_store.home)))

    _, _, rootless_layers = pull(reference, tmp_path / "rootless")
    _, _, root_layers = pull(root_push.reference, tmp_path / "root")
    rootless = _layer_entries(rootless_layers[0])
    assert rootless == _layer_entries(root_layers[0])  # the rootfs layers differ only in their mtimes
    assert rootless["home/user"][2:4] == (1000, 1000) and rootless["etc/passwd"][2:4] == (0, 0)

    # `rm` too runs in the namespace: the user could not delete the sandbox user's files outside it.
    home = {"CORRAL_HOME": str(user.home / "corral")}
    removed = user.python("-c", CLI_SCRIPT, "templates", "rm", "rootless", timeout=120, env=home)
    assert removed.returncode == 0, removed.stderr
    store_root = user.home / "corral" / "templates"
    assert not (store_root / builds.root_built.digest).exists() and list((store_root / "names").iterdir()) == []
    assert _processes_of(user.uid) == []


@needs_root_tools
@pytest.mark.slow  # a real rootless build
def test_failed_rootless_build_reports_the_inside_error_and_leaves_nothing(ranged_user: BuildUser) -> None:
    home = ranged_user.home / "failing"
    spec = TemplateSpec(name="broken", mirror="http://127.0.0.1:9/debian")
    result = ranged_user.python("-c", BUILD_SCRIPT, str(home), spec.model_dump_json())
    assert result.returncode == 3, result.stderr
    # The inside build's own error (with mmdebstrap's last lines), raised again outside as a TemplateBuildError.
    error = result.stdout[result.stdout.index("ERROR "):]
    assert error.startswith("ERROR TemplateBuildError mmdebstrap failed with exit code")
    assert "Could not connect to 127.0.0.1:9" in error
    assert "rootless build failed" not in result.stdout  # the report line is not shown as progress
    assert sorted(p.name for p in (home / "templates").iterdir()) == [".lock"]
    assert _processes_of(ranged_user.uid) == []


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _start_stuck_build(user: BuildUser, home: Path, mirror: str) -> tuple[subprocess.Popen[str], int]:
    """A rootless build waiting on `mirror`, and the builder's pid (runuser's child)."""
    spec = TemplateSpec(name="t", mirror=mirror)
    proc = subprocess.Popen(["runuser", "-u", user.name, "--", _python_for(user.name), "-c", BUILD_SCRIPT,
                             str(home), spec.model_dump_json()],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_user_env())
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("I: running apt-get update..."):  # mmdebstrap waits on the silent mirror
            break
    (builder,) = _children(proc.pid)
    return proc, builder


@needs_root_tools
@pytest.mark.slow  # a real rootless build, stopped
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_rootless_builder_takes_the_inside_build_with_it(ranged_user: BuildUser, signum: int) -> None:
    home = ranged_user.home / f"stopped-{signum}"
    with silent_server() as address:
        proc, builder = _start_stuck_build(ranged_user, home, f"http://{address}/debian")
        # SIGTERM: the builder stops the inside build, which cleans up as a root build does. SIGKILL: no cleanup
        # runs anywhere, and the parent-death signals must end the inside build and its commands.
        os.kill(builder, signum)
        proc.wait(timeout=60)
        assert proc.stdout is not None
        proc.stdout.close()
        assert _wait_until(lambda: _processes_of(ranged_user.uid) == []), _processes_of(ranged_user.uid)
    assert mounts_under(home) == []
    assert [p for p in Path(tempfile.gettempdir()).glob("corral-spec-*") if p.stat().st_uid == ranged_user.uid] == []
    leftovers = [p for p in (home / "templates").iterdir() if p.name.startswith(".build-")]
    assert len(leftovers) == (1 if signum == signal.SIGKILL else 0)
    # A build directory left by SIGKILL (as a root build's would be) is reaped by the next build.
    result = ranged_user.python("-c", BUILD_SCRIPT, str(home),
                                TemplateSpec(name="t", mirror="http://127.0.0.1:9/debian").model_dump_json())
    assert result.returncode == 3
    assert sorted(p.name for p in (home / "templates").iterdir()) == [".lock"]


# -- prerequisites -----------------------------------------------------------------------------------------


@needs_root_tools
def test_user_without_subordinate_ids_is_told_the_line_to_add(plain_user: BuildUser) -> None:
    home = plain_user.home / "corral"
    result = plain_user.python("-c", BUILD_SCRIPT, str(home), SPEC.model_dump_json(), timeout=60)
    assert result.returncode == 3, result.stderr
    assert f"/etc/subuid has none for user {plain_user.name}" in result.stdout
    assert f"add `{plain_user.name}:100000:65536` to /etc/subuid" in result.stdout
    assert not home.exists()  # nothing was written


@needs_root_tools
def test_store_the_user_cannot_write_is_refused(ranged_user: BuildUser, tmp_path: Path) -> None:
    result = ranged_user.python("-c", BUILD_SCRIPT, "/var/lib/corral-not-yours", SPEC.model_dump_json(), timeout=60)
    assert result.returncode == 3, result.stderr
    assert f"/var/lib is not writable by user {ranged_user.name}: set CORRAL_HOME" in result.stdout
    assert not Path("/var/lib/corral-not-yours").exists()


def test_subordinate_ranges_are_found_by_name_or_uid_and_must_be_large_enough(tmp_path: Path) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("other:100000:65536\nalice:200000:1000\n1001:300000:65536\n")
    assert userns_module.subordinate_range(subuid, "alice", 1001) == userns_module.IdRange(300000, 65536)
    subuid.write_text("alice:200000:1000\n")
    with pytest.raises(TemplateBuildError, match="gives user alice only 1000: add `alice:100000:65536`"):
        userns_module.subordinate_range(subuid, "alice", 1001)
    with pytest.raises(TemplateBuildError, match="has none for user bob"):
        userns_module.subordinate_range(tmp_path / "missing", "bob", 1002)


@pytest.mark.parametrize(
    ("switch", "value", "fix"),
    [
        ("user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
        ("kernel/unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
        ("kernel/apparmor_restrict_unprivileged_userns", "1",
         "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"),
    ],
)
def test_disabled_user_namespaces_are_told_the_sysctl(
    switch: str, value: str, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake /proc/sys: turning user namespaces off for real would break every other user of this machine.
    (tmp_path / switch).parent.mkdir(parents=True)
    (tmp_path / switch).write_text(value + "\n")
    monkeypatch.setattr(userns_module, "PROC_SYS", tmp_path)
    with pytest.raises(TemplateBuildError, match="unprivileged user namespaces are disabled") as info:
        build_template(SPEC, TemplateStore(tmp_path / "home"), rootless=True)
    assert fix in info.value.message
    assert not (tmp_path / "home").exists()


def test_missing_newuidmap_is_told_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(userns_module, "ID_MAPPERS", ("corral-no-such-newuidmap",))
    with pytest.raises(TemplateBuildError, match=r"needs corral-no-such-newuidmap.*apt-get install uidmap"):
        build_template(SPEC, TemplateStore(tmp_path / "home"), rootless=True)
    assert not (tmp_path / "home").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a non-root caller builds rootless anyway)")
def test_cli_builds_rootless_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("")
    monkeypatch.setattr(userns_module, "SUBUID", subuid)
    result = CliRunner().invoke(app, ["templates", "build", "--rootless", "default"],
                                env={"CORRAL_HOME": str(tmp_path / "home")})
    assert result.exit_code == 1
    assert f"add `root:100000:65536` to {subuid}" in result.output
    assert not (tmp_path / "home").exists()


def test_non_root_builds_rootless_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("")
    monkeypatch.setattr(userns_module, "SUBUID", subuid)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TemplateBuildError, match="a rootless build needs subordinate ids"):
        build_template(SPEC, TemplateStore(tmp_path / "home"))
    with pytest.raises(TemplateBuildError, match=r"needs root .* or a rootless build"):
        build_template(SPEC, TemplateStore(tmp_path / "home"), rootless=False)
    assert not (tmp_path / "home").exists()
