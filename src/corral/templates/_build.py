"""`build_template`: a `TemplateSpec` turned into a root filesystem with debootstrap, apt and a chroot.

Steps, all inside a locked `.build-*` directory that only a final rename makes visible:

1. `debootstrap --variant=minbase <suite> <rootfs> <mirror>`: the base system alone
2. `apt-get update` and `apt-get install --no-install-recommends <packages>`, inside the chroot: apt resolves
   and dpkg configures in dependency order, which debootstrap's `--include` cannot do for every package
   (npm's node-gyp fails to configure there)
3. the sandbox user (1000:1000) with `useradd`, inside the chroot
4. `pip install` into /usr/local, inside the chroot
5. the spec's files, the mount points, and a clean-up of apt's caches, package lists and logs
6. `template.json`, a filesystem sync, and the rename

Every command runs under `unshare --mount --pid --fork --kill-child`: what it mounts (debootstrap mounts /proc
and /sys in its target; the chroot steps mount /proc, and apt's also a fresh /dev and a read-only /sys) lives
in a private mount namespace, and what it starts lives in a private pid namespace. Both die with the command,
so no exit path (exception, SIGKILL of the builder) can leave a mount on the host or a download or a
maintainer script's daemon running on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .._exceptions import TemplateBuildError
from ._fs import resolve_in_root
from ._process import Progress, discard, run_streamed, sigterm_raises
from ._rootfs import USER_GID, USER_HOME, USER_NAME, USER_UID, finish_rootfs, write_file, write_spec_files
from ._spec import TemplateSpec
from ._store import Template, TemplateStore

__all__ = ["build_template"]

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A build host behind a proxy or with its own package index needs these passed to debootstrap (wget), apt
# and pip; nothing else is inherited from the caller's environment.
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
# A file:// mirror is a host directory: the apt step bind-mounts it here, under a tmpfs on /run, and points a
# temporary source list at it.
_MIRROR_MOUNT = "/run/corral-mirror"
_BUILD_SOURCES = "/tmp/corral-build-sources.list"
# Maintainer scripts ask invoke-rc.d before starting a service; 101 means "not allowed" (policy-rc.d(8)).
_POLICY_RC_D = "/usr/sbin/policy-rc.d"

_APT_OPTIONS = (
    "-q",  # no progress bars: one line per download and per dpkg step
    "-o",
    "Dpkg::Use-Pty=0",
    "-o",
    "APT::Color=0",
    # Package descriptions are not needed to install (and a mirror that served debootstrap may lack them).
    "-o",
    "Acquire::Languages=none",
    # No fsync per file: nothing uses the rootfs until it is published, and publishing syncs the filesystem.
    "-o",
    "Dpkg::Options::=--force-unsafe-io",
)

# Run by the first process of the apt step's pid namespace, inside its private mount namespace, before it
# chroots: maintainer scripts get a /dev of their own (the usual nodes, none of the host's disks) and a
# read-only /sys; /proc is unshare's. The mounts are undone on the way out, and die with the namespace
# whatever happens (this shell is the namespace's init: when it dies, the kernel kills the rest).
_CHROOT_SCRIPT = r"""
set -eu
root=$1 mirror=$2
shift 2
mount -t tmpfs -o nosuid,noexec,mode=0755 corral-dev "$root/dev"
mknod -m 666 "$root/dev/null" c 1 3
mknod -m 666 "$root/dev/zero" c 1 5
mknod -m 666 "$root/dev/full" c 1 7
mknod -m 666 "$root/dev/random" c 1 8
mknod -m 666 "$root/dev/urandom" c 1 9
mknod -m 666 "$root/dev/tty" c 5 0
mkdir "$root/dev/pts" "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
mount -t sysfs -o ro,nosuid,nodev,noexec corral-sys "$root/sys"
if [ -n "$mirror" ]; then
    mount -t tmpfs -o nosuid,nodev,mode=0755 corral-run "$root/run"
    mkdir "$root/run/corral-mirror"
    mount --bind "$mirror" "$root/run/corral-mirror"
    mount -o remount,bind,ro "$root/run/corral-mirror"
fi
status=0
chroot "$root" "$@" || status=$?
# Lazily: a straggler holding /dev/null must not turn a finished install into a failure.
if [ -n "$mirror" ]; then umount -l "$root/run"; fi
umount -l "$root/sys" "$root/dev"
exit "$status"
"""

_RESOLV_CONF = b"# Corral sandboxes reach the network only through the egress proxy (see HTTPS_PROXY).\n"
_HOSTNAME = b"corral\n"


def build_template(
    spec: TemplateSpec,
    store: TemplateStore,
    *,
    progress: Progress | None = None,
    force: bool = False,
) -> Template:
    """Build `spec` into `store` and name it `spec.name`; return the template.

    A spec whose digest is already built returns at once (only the name is pointed at it) unless `force`.
    `progress` receives one line at a time: Corral's own steps start with `==> `, the rest is the output of
    debootstrap and pip. Needs root. Raises `TemplateBuildError` when a step fails; whatever the failure or
    interruption (exception, Ctrl-C, SIGTERM), no partial template ever becomes visible.
    """
    emit = progress or discard
    digest = spec.digest()
    if not force and store.lookup_digest(digest) is not None:
        emit(f"==> template {spec.name!r} is up to date ({digest[:12]})")
        store.reap()
        return store.link(spec.name, digest)
    _check_host()
    emit(f"==> building template {spec.name!r} ({digest[:12]}) in {store.root}")
    with sigterm_raises(), store.staging(digest) as staging:
        try:
            _debootstrap(spec, staging.rootfs, emit)
            packages = spec.effective_apt_packages()
            if packages:
                _apt_install(spec, staging.rootfs, packages, emit)
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
            source="debootstrap",
            spec=spec.model_dump(mode="json"),
            env=dict(spec.env),
            force=force,
        )
    emit(f"==> template {spec.name!r} built: {template.size_bytes / 1e6:.0f} MB ({digest[:12]})")
    return template


def _check_host() -> None:
    if os.geteuid() != 0:
        raise TemplateBuildError("building a template needs root (debootstrap and chroot)")
    for tool in ("debootstrap", "chroot", "unshare", "setpriv", "mount"):
        if shutil.which(tool, path=_PATH) is None:
            raise TemplateBuildError(f"{tool} is not installed; on Debian: apt-get install debootstrap util-linux")


def _command_env() -> dict[str, str]:
    env = {"PATH": _PATH, "LANG": "C.UTF-8", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
    env.update({k: v for k, v in os.environ.items() if k in _PASSED_VARS})
    return env


def _run(cmd: Sequence[str], *, emit: Progress, what: str, log: Path | None = None) -> None:
    run_streamed(cmd, emit=emit, what=what, env=_command_env(), log=log)


def _isolated(*cmd: str, proc: str = "/proc") -> list[str]:
    # --kill-child: if unshare dies, the namespace's first process gets SIGKILL, and with it all the others.
    return ["unshare", "--mount", "--pid", "--fork", "--kill-child", f"--mount-proc={proc}", *cmd]


def _in_chroot(rootfs: Path, *cmd: str) -> list[str]:
    return _isolated("chroot", str(rootfs), *cmd, proc=f"{rootfs}/proc")


def _in_build_chroot(rootfs: Path, *cmd: str, mirror_dir: Path | None = None) -> list[str]:
    """`_in_chroot`, plus a private /dev and /sys (and the bind-mounted `mirror_dir`) for maintainer scripts."""
    mounts = ("/dev", "/sys", "/proc") + (("/run",) if mirror_dir is not None else ())
    for mount_point in mounts:
        host = rootfs / mount_point.lstrip("/")
        # mount(8) follows symlinks: a mount point that is not a plain directory could put a mount elsewhere.
        if host.is_symlink() or not host.is_dir():
            raise TemplateBuildError(f"the root filesystem's {mount_point} is not a directory")
    script = ["sh", "-c", _CHROOT_SCRIPT, "corral-chroot", str(rootfs), str(mirror_dir or "")]
    return _isolated(*script, *cmd, proc=f"{rootfs}/proc")


def _debootstrap(spec: TemplateSpec, rootfs: Path, emit: Progress) -> None:
    emit(f"==> debootstrap {spec.suite} ({spec.variant}) from {spec.mirror}")
    cmd = _isolated("debootstrap", f"--variant={spec.variant}", spec.suite, str(rootfs), spec.mirror)
    # On failure debootstrap's own log says which package or download broke; its stdout often does not.
    _run(cmd, emit=emit, what="debootstrap", log=rootfs / "debootstrap" / "debootstrap.log")


def _local_mirror(mirror: str) -> Path | None:
    """The host directory of a file:// mirror; None for a mirror apt reaches over the network."""
    parts = urlsplit(mirror)
    if parts.scheme != "file":
        return None
    path = Path(unquote(parts.path))
    if not path.is_dir():
        raise TemplateBuildError(f"the mirror directory {path} does not exist")
    return path


def _apt_install(spec: TemplateSpec, rootfs: Path, packages: Sequence[str], emit: Progress) -> None:
    emit(f"==> apt-get install {' '.join(packages)}")
    mirror_dir = _local_mirror(spec.mirror)
    options = list(_APT_OPTIONS)
    with _host_network(rootfs) as ca_bundle, _no_services(rootfs):
        if ca_bundle is not None:
            options += ["-o", f"Acquire::https::CAInfo={ca_bundle}"]
        try:
            if mirror_dir is not None:
                # debootstrap leaves no source for a file:// mirror, and the chroot cannot see its path.
                sources = f"deb file://{_MIRROR_MOUNT} {spec.suite} main\n"
                write_file(rootfs, _BUILD_SOURCES, sources.encode())
                options += ["-o", f"Dir::Etc::SourceList={_BUILD_SOURCES}"]
            apt = ("apt-get", *options)
            update = _in_build_chroot(rootfs, *apt, "update", mirror_dir=mirror_dir)
            _run(update, emit=emit, what="apt-get update")
            install_cmd = (*apt, "install", "--yes", "--no-install-recommends", *packages)
            install = _in_build_chroot(rootfs, *install_cmd, mirror_dir=mirror_dir)
            _run(install, emit=emit, what="apt-get install")
        finally:
            resolve_in_root(rootfs, _BUILD_SOURCES).unlink(missing_ok=True)


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


@contextlib.contextmanager
def _no_services(rootfs: Path) -> Iterator[None]:
    """Keep maintainer scripts from starting services while packages are installed."""
    write_file(rootfs, _POLICY_RC_D, b"#!/bin/sh\nexit 101\n", mode=0o755)
    try:
        yield
    finally:
        resolve_in_root(rootfs, _POLICY_RC_D).unlink(missing_ok=True)


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
        _run(_in_chroot(rootfs, *pip), emit=emit, what="pip install")


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
    # debootstrap copied the build host's resolver and hostname; they mean nothing in a sandbox.
    write_file(rootfs, "/etc/resolv.conf", _RESOLV_CONF)
    write_file(rootfs, "/etc/hostname", _HOSTNAME)
