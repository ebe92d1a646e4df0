"""Rootless builds: the user namespace a non-root builder runs the whole build in, and its prerequisites.

The namespace maps its uid 0 to the builder (so the store's directories, the template's metadata and every
root-owned file of the template belong to the builder on the host) and its uids 1-65535 to the builder's
subordinate ids from /etc/subuid (gids alike, from /etc/subgid):

```
inside      host
0           the builder's own uid (gid)
1..65535    subuid_start .. subuid_start + 65534
```

Inside it the builder is root, so the build runs exactly as a root build does (mmdebstrap, chroot, useradd,
pip, Corral's own file writes, publishing): one code path, and the same files with the same owners as seen
from inside (uid 0 and the sandbox user's 1000). On the host the sandbox user's files belong to
`subuid_start + 999`: the template is meant to be read through the same mapping (pushed as an image from
inside it, or run by a runtime that maps the same way), not by a root server that expects owners 0 and 1000.

Every prerequisite is checked before anything is written, and a missing one is a `TemplateBuildError` that
says the fix.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .._exceptions import TemplateBuildError

__all__ = ["IdRange", "rootless_namespace", "subordinate_range", "user_namespace"]

# Debian's ids go up to 65534 (nobody): the namespace needs ids 1..65534 besides root, and maps 65535 of them
# so that it spans 0..65535, as a sandbox's own user namespace does.
NAMESPACE_IDS = 65535
SUBUID = Path("/etc/subuid")
SUBGID = Path("/etc/subgid")
# Where the kernel says whether unprivileged users may create user namespaces (a path, so tests can fake it).
PROC_SYS = Path("/proc/sys")
# The setuid helpers (Debian's uidmap) that let an unprivileged user map its subordinate ids.
ID_MAPPERS = ("newuidmap", "newgidmap")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SUGGESTED_START = 100000
_SYSCTLS = (
    # (file under /proc/sys, value that forbids, what to run)
    ("user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
    ("kernel/unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("kernel/apparmor_restrict_unprivileged_userns", "1", "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"),
)
_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class IdRange:
    """The subordinate ids of one user (one line of /etc/subuid or /etc/subgid)."""

    start: int
    count: int


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError as exc:
        raise TemplateBuildError(f"uid {uid} has no user name (/etc/passwd); a rootless build needs one") from exc


def _parse_range(line: str, owners: tuple[str, str]) -> IdRange | None:
    fields = line.strip().split(":")
    if len(fields) != 3 or fields[0] not in owners:
        return None
    try:
        return IdRange(int(fields[1]), int(fields[2]))
    except ValueError:
        return None


def subordinate_range(path: Path, user: str, uid: int) -> IdRange:
    """The first range of `user` (by name or uid, as newuidmap reads it) in `path` with room for the namespace.

    `TemplateBuildError` saying which line to add when there is none.
    """
    fix = (f"add `{user}:{_SUGGESTED_START}:{NAMESPACE_IDS + 1}` to {path} (or run `usermod --add-sub"
           f"{'uids' if path.name == 'subuid' else 'gids'} {_SUGGESTED_START}-{_SUGGESTED_START + NAMESPACE_IDS} "
           f"{user}`), choosing a range no other user or sandbox uses")
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    except OSError as exc:
        raise TemplateBuildError(f"cannot read {path}: {exc.strerror}") from exc
    ranges = [r for r in (_parse_range(line, (user, str(uid))) for line in lines) if r is not None]
    if not ranges:
        raise TemplateBuildError(f"a rootless build needs subordinate ids, and {path} has none for user {user}: {fix}")
    for found in ranges:
        if found.count >= NAMESPACE_IDS:
            return found
    raise TemplateBuildError(
        f"a rootless build needs {NAMESPACE_IDS} subordinate ids, and {path} gives user {user} only "
        f"{max(r.count for r in ranges)}: {fix}"
    )


def _sysctl_problems() -> list[str]:
    found = []
    for name, forbidding, fix in _SYSCTLS:
        try:
            value = (PROC_SYS / name).read_text().strip()
        except OSError:
            continue  # this kernel has no such switch
        if value == forbidding:
            found.append(f"unprivileged user namespaces are disabled ({name.replace('/', '.')} = {value}): "
                         f"as root, `{fix}`")
    return found


def _check_writable(store_root: Path, user: str) -> None:
    # The nearest existing directory decides: the build creates the rest of the path as the builder.
    existing = store_root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TemplateBuildError(
            f"a rootless build stores its template under {store_root}, and {existing} is not writable by user "
            f"{user}: set CORRAL_HOME to a directory of {user}'s (for example ~/.local/share/corral)"
        )


def user_namespace(uids: IdRange, gids: IdRange) -> list[str]:
    """The command prefix that runs a command as root of the build's user namespace (see the module doc)."""
    return [
        "unshare",
        "--map-user=0",  # the caller's own uid and gid become the namespace's root
        "--map-group=0",
        f"--map-users={uids.start},1,{NAMESPACE_IDS}",
        f"--map-groups={gids.start},1,{NAMESPACE_IDS}",
        "--",
    ]


def _probe(prefix: list[str]) -> None:
    # The sysctls do not say everything (a seccomp profile, a container without CAP_SETUID for newuidmap, a
    # range newuidmap refuses): entering the namespace once does.
    try:
        result = subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, capture_output=True,
                                timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TemplateBuildError(f"cannot enter a user namespace for a rootless build: {exc}") from exc
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise TemplateBuildError(f"cannot enter a user namespace for a rootless build (`{' '.join(prefix)} true`): "
                                 f"{message}")


def rootless_namespace(store_root: Path) -> list[str]:
    """Check everything a rootless build needs; return the command prefix that runs a command as root of its
    user namespace.

    What a non-root user does with its templates' files (build, push, delete them) runs there: only there do
    the files have the owners a sandbox sees, and only there may all of them be read and deleted.
    `TemplateBuildError` naming the fix for the first thing missing; nothing is written either way.
    """
    uid = os.getuid()
    user = _user_name(uid)
    problems = _sysctl_problems()
    if problems:
        raise TemplateBuildError("; ".join(problems), details={"problems": problems})
    for tool in ID_MAPPERS:
        if shutil.which(tool, path=_PATH) is None:
            raise TemplateBuildError(f"a rootless build needs {tool}, which is not installed; on Debian, as root: "
                                     "apt-get install uidmap")
    uids = subordinate_range(SUBUID, user, uid)
    gids = subordinate_range(SUBGID, user, uid)
    _check_writable(store_root, user)
    prefix = user_namespace(uids, gids)
    _probe(prefix)
    return prefix

