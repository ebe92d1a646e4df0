"""A file's metadata: its `user.e2b.*` extended attributes, prefix stripped (E2B's name for them): read, checked
before anything is written (envd's rules), and replaced whole."""

from __future__ import annotations

import errno
import os

from .file_access import FileError

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

METADATA_PREFIX = "user.e2b."
_MAX_XATTR_NAME = 255  # the kernel's limit on a whole attribute name, prefix included
_MAX_METADATA = 4096  # names (with prefix) plus values, envd's rule (ext4 keeps a little less: replace_metadata)
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)


def read_metadata(path: str) -> dict[str, str]:
    """The file's metadata; {} where the file system keeps none (/proc) or a value is not UTF-8 (set by hand)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    found: dict[str, str] = {}
    for xname in names:
        if not xname.startswith(METADATA_PREFIX):
            continue
        try:
            found[xname[len(METADATA_PREFIX):]] = os.getxattr(path, xname, follow_symlinks=False).decode()
        except (OSError, UnicodeDecodeError):
            continue
    return {k: v for k, v in found.items() if _is_utf8(k)}


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a name that was not UTF-8 on disk comes back with surrogate escapes
        return False
    return True


def check_metadata(value: Any) -> dict[str, str]:
    """Validate metadata to set, before anything is written (envd's rules): keys and values printable ASCII,
    keys not empty, each attribute name at most 255 bytes, all of it at most 4096 bytes."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FileError("invalid_request", "metadata must be an object of strings")
    total = 0
    for key, val in value.items():
        if not isinstance(key, str) or not isinstance(val, str):
            raise FileError("invalid_request", "metadata keys and values must be strings")
        if not key:
            raise FileError("invalid_request", "a metadata key must not be empty")
        for what, text in (("key", key), (f"value of {key!r}", val)):
            if not (text.isascii() and text.isprintable()):
                raise FileError("invalid_request", f"metadata {what} must be printable ASCII")
        if len(METADATA_PREFIX) + len(key) > _MAX_XATTR_NAME:
            longest = _MAX_XATTR_NAME - len(METADATA_PREFIX)
            raise FileError("invalid_request", f"metadata key {key[:32]!r}... is longer than {longest} bytes")
        total += len(METADATA_PREFIX) + len(key) + len(val)
    if total > _MAX_METADATA:
        raise FileError("invalid_request", f"metadata takes {total} bytes, more than {_MAX_METADATA}")
    return dict(value)


def replace_metadata(fd: int, metadata: dict[str, str], path: str) -> None:
    """Make `metadata` the file's whole metadata: other user.e2b.* attributes go (a rewrite keeps the inode and
    its attributes). A file system without user attributes is an error only if there is metadata to keep."""
    try:
        old = [n for n in os.listxattr(fd) if n.startswith(METADATA_PREFIX)]
        for xname in old:
            if xname[len(METADATA_PREFIX):] not in metadata:
                os.removexattr(fd, xname)
        for key, value in metadata.items():
            os.setxattr(fd, METADATA_PREFIX + key, value.encode())
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            if not metadata:
                return
            raise FileError("invalid_request",
                            f"{path}: this file system does not keep file metadata (extended attributes "
                            "user.*); write the file elsewhere or without metadata") from exc
        if exc.errno in (errno.ENOSPC, errno.E2BIG) and not _disk_full(fd):
            # ext4 keeps a file's attributes in one block: about 4 KB, a little less than the rule allows.
            raise FileError("invalid_request", f"{path}: the metadata does not fit in the space this file system "
                            "keeps for one file's attributes; use fewer or shorter values") from exc
        raise FileError.from_os(exc, path) from exc


def _disk_full(fd: int) -> bool:
    try:
        st = os.fstatvfs(fd)
    except OSError:
        return True
    return st.f_bavail * st.f_frsize < 64 * 1024
