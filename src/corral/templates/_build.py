"""`build_template`: a `TemplateSpec` turned into a root filesystem with debootstrap and a chroot.

Steps, all inside a locked `.build-*` directory that only a final rename makes visible:

1. `debootstrap --variant=minbase --include=<packages> <suite> <rootfs> <mirror>`
2. the sandbox user (1000:1000) with `useradd`, inside the chroot
3. `pip install` into /usr/local, inside the chroot
4. the spec's files, the mount points, and a clean-up of apt's caches
5. `template.json`, a filesystem sync, and the rename

Every command runs under `unshare --mount --pid --fork --kill-child`: what it mounts (debootstrap mounts /proc
and /sys in its target, the chroot steps mount /proc) lives in a private mount namespace, and what it starts
lives in a private pid namespace. Both die with the command, so no exit path (exception, SIGKILL of the
builder) can leave a mount on the host or a download running on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from .._exceptions import TemplateBuildError
from ._fs import resolve_in_root
from ._process import Progress, discard, run_streamed, sigterm_raises
from ._rootfs import USER_GID, USER_HOME, USER_NAME, USER_UID, finish_rootfs, write_file, write_spec_files
from ._spec import TemplateSpec
from ._store import Template, TemplateStore

__all__ = ["build_template"]

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A build host behind a proxy or with its own package index needs these passed to debootstrap (wget) and
# pip; nothing else is inherited from the caller's environment.
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
    for tool in ("debootstrap", "chroot", "unshare", "setpriv"):
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


def _debootstrap(spec: TemplateSpec, rootfs: Path, emit: Progress) -> None:
    packages = spec.effective_apt_packages()
    emit(f"==> debootstrap {spec.suite} from {spec.mirror} with {len(packages)} extra packages")
    cmd = _isolated("debootstrap", f"--variant={spec.variant}")
    if packages:
        cmd.append("--include=" + ",".join(packages))
    cmd += [spec.suite, str(rootfs), spec.mirror]
    # On failure debootstrap's own log says which package or download broke; its stdout often does not.
    _run(cmd, emit=emit, what="debootstrap", log=rootfs / "debootstrap" / "debootstrap.log")


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
    # pip resolves names with the build host's DNS settings; the template gets a neutral file afterwards.
    with contextlib.suppress(OSError):
        write_file(rootfs, "/etc/resolv.conf", Path("/etc/resolv.conf").read_bytes())
    # pip in the chroot trusts the template's certificates; downloads go through the build host's network,
    # so they need the host's trust (a TLS-inspecting proxy, say). The copy is gone before publishing.
    host_ca = _host_ca_bundle()
    cert_args = []
    if host_ca is not None:
        write_file(rootfs, _BUILD_CA, host_ca.read_bytes())
        cert_args = [f"--cert={_BUILD_CA}"]
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
        *cert_args,
        "--",
        *packages,
    ]
    try:
        _run(_in_chroot(rootfs, *pip), emit=emit, what="pip install")
    finally:
        resolve_in_root(rootfs, _BUILD_CA).unlink(missing_ok=True)


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
    """Drop what only the build needed: downloaded packages, package lists, host network settings."""
    # apt recreates all of these; `partial` and `lock` are kept so apt finds the layout it expects.
    _empty_dir(resolve_in_root(rootfs, "/var/cache/apt/archives"), keep=("partial", "lock"))
    _empty_dir(resolve_in_root(rootfs, "/var/lib/apt/lists"), keep=("partial", "lock"))
    for cache in ("/var/cache/apt/pkgcache.bin", "/var/cache/apt/srcpkgcache.bin"):
        resolve_in_root(rootfs, cache).unlink(missing_ok=True)
    # debootstrap copied the build host's resolver and hostname; they mean nothing in a sandbox.
    write_file(rootfs, "/etc/resolv.conf", _RESOLV_CONF)
    write_file(rootfs, "/etc/hostname", _HOSTNAME)
