"""`SecretKeyring`: how secret values are kept at rest (docs/secrets.md): sealed with Fernet (AES-128-CBC and
HMAC-SHA256, from `cryptography`) under a key that is not in the database, so a copy of the database, or of a
sandbox's stored spec, holds no usable value.

The keys come from `CORRAL_SECRETS_KEY` (several replicas on one database must share it), else from
`<home>/secrets.key` (made on first use, 0600): one Fernet key per line or comma-separated, newest first. The
first seals; all of them open, so a new key can be put in front of the old one and stored values still open;
`corral secret reseal` then seals the stored ones again with the new key, so that the old one can go.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from .._atomic import write_atomic
from .._exceptions import InvalidRequestError, ServerError

__all__ = ["KEY_FILE", "SecretKeyring"]

KEY_FILE = "secrets.key"
ENV = "CORRAL_SECRETS_KEY"


class SecretKeyring:
    def __init__(self, keys: list[bytes]) -> None:
        if not keys:
            raise InvalidRequestError("a secrets keyring needs at least one key")
        try:
            fernets = [Fernet(k) for k in keys]
            self._newest, self._fernet = fernets[0], MultiFernet(fernets)
        except ValueError as exc:
            raise InvalidRequestError(f"{ENV} or {KEY_FILE}: not Fernet keys ({exc}); make one with "
                                      "`python -c 'from cryptography.fernet import Fernet; "
                                      "print(Fernet.generate_key().decode())'`") from None

    @classmethod
    def from_environment(cls, home: Path) -> SecretKeyring:
        """`CORRAL_SECRETS_KEY`, else the key file in `home` (made when missing)."""
        text = os.environ.get(ENV)
        if text is None:
            path = home / KEY_FILE
            if not path.exists():
                home.mkdir(parents=True, exist_ok=True)
                _create(path)
            text = path.read_text()
        return cls([k.strip().encode() for k in text.replace(",", "\n").splitlines() if k.strip()])

    def seal(self, value: str) -> str:
        return self._fernet.encrypt(value.encode()).decode("ascii")

    def open(self, sealed: str) -> str:
        try:
            return self._fernet.decrypt(sealed.encode("ascii")).decode()
        except (InvalidToken, ValueError, UnicodeError):
            raise ServerError(f"a stored secret cannot be opened with the keys in {ENV} / {KEY_FILE}: the key that "
                              "sealed it is missing (keep old keys after the new one until values are resealed)")\
                from None

    def current(self, sealed: str) -> bool:
        """Whether `sealed` opens with the newest key (a reseal would change nothing but the token)."""
        try:
            self._newest.decrypt(sealed.encode("ascii"))
        except (InvalidToken, ValueError):
            return False
        return True

    def reseal(self, sealed: str) -> str:
        """The same value, sealed with the newest key (key rotation)."""
        try:
            return self._fernet.rotate(sealed.encode("ascii")).decode("ascii")
        except (InvalidToken, ValueError):
            raise ServerError("a stored secret cannot be opened with the keys in the keyring") from None


def _create(path: Path) -> None:
    staged = path.with_name(f".{path.name}.new-{os.urandom(4).hex()}")
    write_atomic(staged, Fernet.generate_key() + b"\n", mode=0o600)
    try:
        os.link(staged, path)  # never replaces: servers starting at once end up with the same key
    except FileExistsError:
        pass
    finally:
        staged.unlink()
