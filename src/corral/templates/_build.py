"""`build_template`: a `TemplateSpec` turned into a root filesystem with mmdebstrap and a chroot.

Steps, all inside a locked `.build-*` directory that only a final rename makes visible:

1. `mmdebstrap --variant=minbase --include=<packages> <suite> <rootfs> <mirror>`: the base system and the spec's
   packages in one run. apt resolves the whole package list itself and dpkg configures in dependency order
   (debootstrap's `--include` could not: npm's node-gyp failed to configure there, which is why the builder
   used to run apt in a chroot as a second phase); mmdebstrap gives maintainer scripts a populated /dev,
   /proc and /sys, and a policy-rc.d that keeps services from starting, and removes all of it at the end.
2. the sandbox user (1000:1000) with `useradd`, inside the chroot
3. `pip install` into /usr/local, inside the chroot
4. the spec's files, the mount points, and a clean-up of apt's caches, package lists and logs
5. `template.json`, a filesystem sync, and the rename

mmdebstrap is required (scripts/install installs it); there is no debootstrap fallback, because two builders
would give one spec digest two different root filesystems. It runs in `--mode=root`: the builder is root, or,
for a rootless build (a user without root, a build Job in a cluster), root of a user namespace of the caller's
subordinate ids that the whole build runs in (`_userns.py`, `_build_rootless`). One code path either way, and
the same files with the same owners as seen inside; mmdebstrap's own `unshare` mode would map root to a
subordinate id and need a namespace per later step.

Every command runs under `unshare --mount --pid --fork --kill-child`: what it mounts (mmdebstrap mounts /dev,
/proc and /sys in its target; the chroot steps mount /proc) lives in a private mount namespace, and what it
starts lives in a private pid namespace. Both die with the command, so no exit path (exception, SIGKILL of the
builder) can leave a mount on the host or a download or a maintainer script's daemon running on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .._exceptions import TemplateBuildError
from ._fs import resolve_in_root
from ._process import Progress, discard, run_streamed, sigterm_raises
from ._rootfs import (
    USER_GID,
    USER_HOME,
    USER_NAME,
    USER_UID,
    ensure_dir,
    finish_rootfs,
    write_file,
    write_spec_files,
)
from ._spec import TemplateSpec
from ._store import Template, TemplateStore
from ._userns import NAMESPACE_IDS, rootless_namespace

__all__ = ["INSIDE_ERROR", "build_template"]

# How the inside half of a rootless build (`_userns_build.py`) reports its error: a last line of JSON.
INSIDE_ERROR = "==> rootless build failed: "
_INSIDE_MODULE = f"{__package__}._userns_build"

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A build host behind a proxy or with its own package index needs these passed to mmdebstrap (apt) and pip;
# nothing else is inherited from the caller's environment.
_PASSED_VARS = (
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_DEFAULT_TIMEOUT",
)
# Where the build host keeps the certificates it trusts (a TLS-inspecting proxy's CA, for one).
_HOST_CA_SOURCES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
_HOST_CA_DEFAULT = "/etc/ssl/certs/ca-certificates.crt"
_BUILD_CA = "/tmp/corral-build-ca.pem"
_MMDEBSTRAP_OPTIONS = (
    "--mode=root",
    "--format=directory",
    "--verbose",  # apt's and dpkg's own lines: one per download and per package set up
    "--aptopt=Dpkg::Use-Pty \"0\"",
    "--aptopt=APT::Color \"0\"",
    # Package descriptions are not needed to install (and a local mirror may lack them).
    "--aptopt=Acquire::Languages \"none\"",
    # No fsync per file: nothing uses the rootfs until it is published, and publishing syncs the filesystem.
    "--dpkgopt=force-unsafe-io",
    # merged /usr by symlinks plus the usr-is-merged marker, as debootstrap makes it, instead of the usrmerge
    # package that bookworm's init-system-helpers would pull in (with perl and three perl libraries: 50 MB).
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
)
# With SOURCE_DATE_EPOCH set, Python compiles the bytecode of what pip installs with a hash of each source file
# (PEP 552) instead of its mtime, which is the time of the install: two builds of a spec then write the same .pyc
# bytes (Debian's own .pyc files embed the mtimes of the packaged sources, which are fixed). The value only
# matters to a package built from an sdist on the way (wheel dates its zip entries with it; zip starts in 1980).
_PIP_ENV = {"SOURCE_DATE_EPOCH": "315532800"}
# Makes a file:// mirror's directory visible inside the chroot, where apt installs the --include packages.
_FILE_MIRROR_HOOKS = "/usr/share/mmdebstrap/hooks/file-mirror-automount"

# mmdebstrap's own list (`@devfiles`), less the device nodes: what its root mode leaves in /dev.
_DEV_LINKS = (("fd", "/proc/self/fd"), ("stderr", "/proc/self/fd/2"), ("stdin", "/proc/self/fd/0"),
              ("stdout", "/proc/self/fd/1"))
_DEV_DIRS = ("pts", "shm")

_RESOLV_CONF = b"# Corral sandboxes reach the network only through the egress proxy (see HTTPS_PROXY).\n"
_HOSTNAME = b"corral\n"


def build_template(
    spec: TemplateSpec,
    store: TemplateStore,
    *,
    progress: Progress | None = None,
    force: bool = False,
    rootless: bool | None = None,
) -> Template:
    """Build `spec` into `store` and name it `spec.name`; return the template.

    A spec whose digest is already built returns at once (only the name is pointed at it) unless `force`.
    `progress` receives one line at a time: Corral's own steps start with `==> `, the rest is the output of
    mmdebstrap (apt's and dpkg's included) and pip. `rootless` (the default when not run as root) runs the whole
    build in a user namespace of the caller's subordinate ids (`_userns.py`); otherwise it needs root. Raises
    `TemplateBuildError` when a step fails or a prerequisite is missing; whatever the failure or interruption
    (exception, Ctrl-C, SIGTERM), no partial template ever becomes visible.
    """
    emit = progress or discard
    if rootless is None:
        rootless = os.geteuid() != 0
    if rootless:
        return _build_rootless(spec, store, emit, force=force)
    digest = spec.digest()
    if not force and store.lookup_digest(digest) is not None:
        emit(f"==> template {spec.name!r} is up to date ({digest[:12]})")
        store.reap()
        return store.link(spec.name, digest)
    _check_host()
    emit(f"==> building template {spec.name!r} ({digest[:12]}) in {store.root}")
    with sigterm_raises(), store.staging(digest) as staging:
        try:
            _mmdebstrap(spec, staging.rootfs, emit)
            _keep_dev_entries(staging.rootfs)
            _add_user(staging.rootfs, emit)
            if spec.pip_packages:
                _pip_install(staging.rootfs, spec.pip_packages, emit)
            emit("==> writing files and cleaning up")
            write_spec_files(staging.rootfs, spec.files)
            _clean(staging.rootfs)
            finish_rootfs(staging.rootfs)
        except OSError as exc:
            raise TemplateBuildError(f"building template {spec.name!r} failed: {exc}") from exc
        template = staging.publish(
            name=spec.name,
            source="mmdebstrap",
            spec=spec.model_dump(mode="json"),
            env=dict(spec.env),
            force=force,
        )
    emit(f"==> template {spec.name!r} built: {template.size_bytes / 1e6:.0f} MB ({digest[:12]})")
    return template


def _check_host() -> None:
    if os.geteuid() != 0:
        raise TemplateBuildError("building a template needs root (mmdebstrap --mode=root and chroot), or a rootless "
                                 "build (`corral templates build --rootless`) in a user namespace")
    _check_tools()


def _check_tools() -> None:
    for tool in ("mmdebstrap", "chroot", "unshare", "setpriv", "mount"):
        if shutil.which(tool, path=_PATH) is None:
            raise TemplateBuildError(f"{tool} is not installed; on Debian: apt-get install mmdebstrap util-linux")


def _build_rootless(spec: TemplateSpec, store: TemplateStore, emit: Progress, *, force: bool) -> Template:
    """Run `build_template` again as root of a user namespace (`_userns.py`), and return what it built.

    Everything that touches the store happens inside (the build, reaping, publishing): on the host, part of
    the store belongs to the caller's subordinate ids, which only the namespace's root may change.
    """
    _check_tools()
    prefix = rootless_namespace(store.root)
    emit(f"==> rootless build: uid 0 is {os.getuid()} and uids 1-{NAMESPACE_IDS} are subordinate ids")
    # A file, not an argument: a spec's files may be larger than one argument can be (128 KiB). The inside
    # build deletes it once read, so that not even a SIGKILL of this process can leave it behind.
    fd, spec_file = tempfile.mkstemp(prefix="corral-spec-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(spec.model_dump_json())
        _run_inside([*prefix, *_inside_command(Path(spec_file), store, force=force)], emit)
    finally:
        Path(spec_file).unlink(missing_ok=True)
    return store.link(spec.name, spec.digest())


def _inside_command(spec_file: Path, store: TemplateStore, *, force: bool) -> list[str]:
    # setpriv inside the namespace: unshare's change of credentials clears the parent-death signal that
    # run_streamed set outside, and the inside build must die with this process as any build command does.
    return ["setpriv", "--pdeathsig", "KILL", "--", sys.executable, "-m", _INSIDE_MODULE, str(spec_file),
            str(store.home.absolute()), *(["--force"] if force else [])]


def _run_inside(cmd: list[str], emit: Progress) -> None:
    # The inside build imports Corral as this process does, whatever its environment (a venv, PYTHONPATH).
    env = {**_command_env(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        # SIGTERM here must reach the inside build as SIGTERM (run_streamed stops it so), which then cleans up as
        # any build does; by default it would end this process at once, and the inside with SIGKILL.
        with sigterm_raises():
            run_streamed(cmd, emit=_hide_errors(emit), what="the rootless build", env=env)
    except TemplateBuildError as exc:
        reported = _inside_error(exc)
        if reported is None:  # it died without a word (killed, say): the output's tail says what it can
            raise
        raise reported from exc


def _hide_errors(emit: Progress) -> Progress:
    def forward(line: str) -> None:
        if not line.startswith(INSIDE_ERROR):
            emit(line)

    return forward


def _inside_error(exc: TemplateBuildError) -> TemplateBuildError | None:
    """The error the inside build reported (its last line), if it did."""
    tail = exc.details.get("output_tail") or [""]
    if not tail[-1].startswith(INSIDE_ERROR):
        return None
    reported = json.loads(tail[-1].removeprefix(INSIDE_ERROR))
    return TemplateBuildError(str(reported["message"]), details=dict(reported["details"]))


def _command_env() -> dict[str, str]:
    env = {"PATH": _PATH, "LANG": "C.UTF-8", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
    env.update({k: v for k, v in os.environ.items() if k in _PASSED_VARS})
    return env


def _run(cmd: Sequence[str], *, emit: Progress, what: str, log: Path | None = None,
         env: dict[str, str] | None = None) -> None:
    run_streamed(cmd, emit=emit, what=what, env={**_command_env(), **(env or {})}, log=log)


# A new mount namespace starts with a copy of every mount, running sandboxes' among them: a copy of a sandbox's
# disk keeps that filesystem mounted after its backend unmounts it (its last writes then wait for the build) and
# makes Docker's stop find the disk "still held". So a build first lets go (lazily, in its own namespace only) of
# every mount under a sandbox's directory (a path component `sb-<id>`) and of Docker's.
_SANDBOX_MOUNTS = r"$5 ~ /\/sb-[0-9a-z-]+(\/|$)/ || $5 ~ /^\/var\/lib\/docker\//"
_LET_GO = (f"awk '{_SANDBOX_MOUNTS} {{print $5}}' /proc/self/mountinfo | sort -r | "
           'while read -r m; do umount -l "$m" 2>/dev/null; done; exec "$@"')


def _isolated(*cmd: str, proc: str = "/proc") -> list[str]:
    # --kill-child: if unshare dies, the namespace's first process gets SIGKILL, and with it all the others.
    return ["unshare", "--mount", "--pid", "--fork", "--kill-child", f"--mount-proc={proc}",
            "sh", "-c", _LET_GO, "sh", *cmd]


def _in_chroot(rootfs: Path, *cmd: str) -> list[str]:
    return _isolated("chroot", str(rootfs), *cmd, proc=f"{rootfs}/proc")


def _mmdebstrap(spec: TemplateSpec, rootfs: Path, emit: Progress) -> None:
    packages = spec.effective_apt_packages()
    with_packages = f" with {' '.join(packages)}" if packages else ""
    emit(f"==> mmdebstrap {spec.suite} ({spec.variant}) from {spec.mirror}{with_packages}")
    cmd = ["mmdebstrap", *_MMDEBSTRAP_OPTIONS, f"--variant={spec.variant}"]
    if packages:
        cmd.append("--include=" + ",".join(packages))
    if _local_mirror(spec.mirror) is not None:
        cmd.append(f"--hook-dir={_FILE_MIRROR_HOOKS}")
    ca_bundle = _host_ca_bundle()
    if ca_bundle is not None:
        # apt downloads every package on the host side (mmdebstrap's download step), so a host path is right;
        # the same trust as pip's (a TLS-inspecting proxy's CA), and the system's store by default.
        cmd.append(f'--aptopt=Acquire::https::CAInfo "{ca_bundle}"')
    cmd += ["--", spec.suite, str(rootfs), spec.mirror]
    _run(_isolated(*cmd), emit=emit, what="mmdebstrap")


def _keep_dev_entries(rootfs: Path) -> None:
    """Give /dev the links and directories mmdebstrap leaves there when it can create device nodes.

    As real root mmdebstrap makes its /dev entries for good (the device nodes are dropped later, by
    `finish_rootfs`); as root of a user namespace it cannot mknod, so it makes them for the build only and takes
    them away. Both builds of a spec must give the same files, so the links and directories are made here.
    """
    for name, target in _DEV_LINKS:
        path = resolve_in_root(rootfs, f"/dev/{name}", follow_last=False)
        if not os.path.lexists(path):
            os.symlink(target, path)
    for name in _DEV_DIRS:
        ensure_dir(rootfs, f"/dev/{name}")


def _local_mirror(mirror: str) -> Path | None:
    """The host directory of a file:// mirror; None for a mirror apt reaches over the network."""
    parts = urlsplit(mirror)
    if parts.scheme != "file":
        return None
    path = Path(unquote(parts.path))
    if not path.is_dir():
        raise TemplateBuildError(f"the mirror directory {path} does not exist")
    return path


@contextlib.contextmanager
def _host_network(rootfs: Path) -> Iterator[str | None]:
    """Let downloads in the chroot use the build host's resolver and certificates; yield the CA bundle's path.

    Downloads go through the build host's network, so they need its DNS settings and its trust (a
    TLS-inspecting proxy's CA, say). The template gets a neutral resolv.conf at the end, and the CA copy is
    gone before the step returns.
    """
    with contextlib.suppress(OSError):
        write_file(rootfs, "/etc/resolv.conf", Path("/etc/resolv.conf").read_bytes())
    host_ca = _host_ca_bundle()
    if host_ca is None:
        yield None
        return
    write_file(rootfs, _BUILD_CA, host_ca.read_bytes())
    try:
        yield _BUILD_CA
    finally:
        resolve_in_root(rootfs, _BUILD_CA).unlink(missing_ok=True)


def _add_user(rootfs: Path, emit: Progress) -> None:
    emit(f"==> creating user {USER_NAME} ({USER_UID}:{USER_GID})")
    _run(_in_chroot(rootfs, "groupadd", "--gid", str(USER_GID), USER_NAME), emit=emit, what="groupadd")
    useradd = [
        "useradd",
        "--uid",
        str(USER_UID),
        "--gid",
        str(USER_GID),
        "--create-home",
        "--home-dir",
        USER_HOME,
        "--shell",
        "/bin/bash",
        USER_NAME,
    ]
    _run(_in_chroot(rootfs, *useradd), emit=emit, what="useradd")


def _pip_install(rootfs: Path, packages: Sequence[str], emit: Progress) -> None:
    emit(f"==> pip install {' '.join(packages)}")
    with _host_network(rootfs) as ca_bundle:
        pip = [
            "python3",
            "-m",
            "pip",
            "install",
            "--break-system-packages",  # bookworm's Python is "externally managed"; this goes to /usr/local
            "--no-cache-dir",
            "--root-user-action=ignore",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar=off",
            *([f"--cert={ca_bundle}"] if ca_bundle is not None else []),
            "--",
            *packages,
        ]
        _run(_in_chroot(rootfs, *pip), emit=emit, what="pip install", env=_PIP_ENV)


def _host_ca_bundle() -> Path | None:
    candidates = [os.environ.get(var) for var in _HOST_CA_SOURCES] + [_HOST_CA_DEFAULT]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _empty_dir(path: Path, *, keep: tuple[str, ...] = ()) -> None:
    if not path.is_dir() or path.is_symlink():
        return
    for entry in os.scandir(path):
        if entry.name in keep:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def _clean(rootfs: Path) -> None:
    """Drop what only the build needed: downloaded packages, package lists, logs, host network settings."""
    # apt recreates all of these; `partial` and `lock` are kept so apt finds the layout it expects.
    _empty_dir(resolve_in_root(rootfs, "/var/cache/apt/archives"), keep=("partial", "lock"))
    _empty_dir(resolve_in_root(rootfs, "/var/lib/apt/lists"), keep=("partial", "lock"))
    for cache in ("/var/cache/apt/pkgcache.bin", "/var/cache/apt/srcpkgcache.bin"):
        resolve_in_root(rootfs, cache).unlink(missing_ok=True)
    _empty_dir(resolve_in_root(rootfs, "/var/log/apt"))
    for old in ("/var/cache/debconf/config.dat-old", "/var/cache/debconf/templates.dat-old"):
        resolve_in_root(rootfs, old).unlink(missing_ok=True)
    # mmdebstrap keeps its --aptopt/--dpkgopt here on purpose; they are build settings (no fsync per file, no
    # package descriptions) that must not become the sandbox's apt and dpkg configuration.
    for config in ("/etc/apt/apt.conf.d/99mmdebstrap", "/etc/dpkg/dpkg.cfg.d/99mmdebstrap"):
        resolve_in_root(rootfs, config).unlink(missing_ok=True)
    # mmdebstrap copied the build host's resolver and hostname; they mean nothing in a sandbox.
    write_file(rootfs, "/etc/resolv.conf", _RESOLV_CONF)
    write_file(rootfs, "/etc/hostname", _HOSTNAME)
