"""The audit chain's keys: HMAC-SHA256 secrets kept outside the database, newest first.

A key is a line of text of at least 32 characters (a new one is 64 hex digits, 32 random bytes); its bytes are
the HMAC key. Its id is the first 8 hex digits of the SHA-256 of those bytes: each record stores the id of the
key that signed it, so a verifier knows which key to use and can name one it does not hold. The id says nothing
useful about a random key, and the key itself is never written to the database or to a record.

Where the keys come from: `CORRAL_AUDIT_KEY` (several separated by commas or newlines, newest first) if set,
which replicas sharing one database must all be given; else `<CORRAL_HOME>/audit.key`, one key per line, newest
first, made 0600 with one random key on the server's first start. New records are signed with the first key;
records signed earlier verify with any key listed, so rotating is putting a new key first and keeping the old.

Beside the keys, an item `unkeyed-until=<seq>` says which records may be unkeyed: those an older Corral wrote
before the chain was keyed. Without it a verifier holding keys accepts no unkeyed record at all; otherwise
whoever can write the database could rewrite the whole chain as plain SHA-256 and pass it off as pre-key
history. The server writes it into the key file it makes (the chain's head then, 0 on a new database); an
operator upgrading with `CORRAL_AUDIT_KEY` adds it there (the head from `corral audit head` before upgrading).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

from .._atomic import write_atomic
from .._exceptions import InvalidRequestError
from .._settings import audit_key

__all__ = ["AUDIT_KEY_FILE", "AuditKeyring", "audit_key_id", "load_audit_keys", "read_key_file",
           "rotate_audit_key_file"]

AUDIT_KEY_FILE = "audit.key"
KEY_MIN_CHARS = 32
_NEW_KEY_BYTES = 32
_SEPARATORS = re.compile(r"[,\s]+")
_UNKEYED_UNTIL = re.compile(r"unkeyed-until=(\d+)")


def audit_key_id(key: bytes) -> str:
    """The id records store for the key that signed them: 8 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:8]


class AuditKeyring:
    """The keys a server signs and verifies with: the first (`signing_id`) signs, every one verifies."""

    def __init__(self, keys: Iterable[bytes] = (), source: str = "no keys", *, unkeyed_until: int = 0) -> None:
        listed = list(keys)
        self._keys = {audit_key_id(key): key for key in listed}
        self._order = list(dict.fromkeys(audit_key_id(key) for key in listed))
        self.source = source  # where the keys came from, for messages (never the keys themselves)
        self.unkeyed_until = unkeyed_until  # records after this seq must be keyed (module docstring)

    @classmethod
    def parse(cls, text: str, source: str) -> AuditKeyring:
        """Keys separated by commas or newlines, newest first; `InvalidRequestError` naming `source` if one is
        too short to be a secret."""
        parts = [part for part in _SEPARATORS.split(text) if part]
        marks = [int(m.group(1)) for m in map(_UNKEYED_UNTIL.fullmatch, parts) if m is not None]
        keys = [part for part in parts if _UNKEYED_UNTIL.fullmatch(part) is None]
        short = [i + 1 for i, key in enumerate(keys) if len(key) < KEY_MIN_CHARS]
        if short:
            raise InvalidRequestError(f"audit key {short[0]} in {source} is shorter than {KEY_MIN_CHARS} "
                                      f"characters; make one with `openssl rand -hex 32`")
        return cls([key.encode() for key in keys], source, unkeyed_until=max(marks, default=0))

    @property
    def ids(self) -> list[str]:
        return list(self._order)

    @property
    def signing_id(self) -> str | None:
        return self._order[0] if self._order else None

    def __bool__(self) -> bool:
        return bool(self._order)

    def get(self, key_id: str) -> bytes | None:
        return self._keys.get(key_id)

    def sign(self, key_id: str, message: bytes) -> str:
        """HMAC-SHA256 of `message` with the key `key_id` (which must be held), as hex."""
        return hmac.new(self._keys[key_id], message, hashlib.sha256).hexdigest()


def load_audit_keys(home: Path, *, create_after: int | None = None) -> AuditKeyring:
    """`CORRAL_AUDIT_KEY`, else `<home>/audit.key`. A missing file is made, with one new key and
    `unkeyed-until=<create_after>`, when `create_after` (the chain's head seq) is given; else the keyring is
    empty."""
    configured = audit_key()
    if configured:
        return _with_a_key(AuditKeyring.parse(configured, "CORRAL_AUDIT_KEY"))
    path = home / AUDIT_KEY_FILE
    if create_after is not None and not path.exists():
        _make_key_file(path, create_after)
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return AuditKeyring(source=str(path))
    return _with_a_key(AuditKeyring.parse(text, str(path)))


def _with_a_key(keys: AuditKeyring) -> AuditKeyring:
    """Refuse a configured source that holds no key: a server would otherwise sign its records unkeyed."""
    if not keys:
        raise InvalidRequestError(f"{keys.source} holds no audit key; make one with `openssl rand -hex 32`")
    return keys


def _make_key_file(path: Path, unkeyed_until: int) -> None:
    """Write a new key file, never replacing one: two servers starting at once end up with the same key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.new-{secrets.token_hex(4)}")
    text = f"{secrets.token_hex(_NEW_KEY_BYTES)}\nunkeyed-until={unkeyed_until}\n"
    write_atomic(staged, text.encode("ascii"), mode=0o600)
    try:
        os.link(staged, path)
    except FileExistsError:
        pass
    finally:
        staged.unlink()


def read_key_file(path: Path) -> AuditKeyring:
    """The keys of a key file given explicitly (`corral audit verify --key-file`)."""
    try:
        return _with_a_key(AuditKeyring.parse(path.read_text(encoding="ascii"), str(path)))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read the audit key file {path}: {exc}") from exc


def rotate_audit_key_file(path: Path) -> tuple[str, list[str]]:
    """Put a new random key first in the key file at `path`, keeping the others (and `unkeyed-until`); return
    (new id, kept ids). A missing file is refused: the server makes the first one, knowing where the unkeyed
    records end."""
    if not path.exists():
        raise InvalidRequestError(f"there is no audit key file at {path}: start the server once (it makes one), "
                                  "or pass the server's --home")
    old = read_key_file(path)  # refuses a file with a bad key rather than keeping it
    kept = [part for part in _SEPARATORS.split(path.read_text(encoding="ascii")) if part]
    new = secrets.token_hex(_NEW_KEY_BYTES)
    write_atomic(path, "".join(f"{key}\n" for key in [new, *kept]).encode("ascii"), mode=0o600)
    return audit_key_id(new.encode()), old.ids
