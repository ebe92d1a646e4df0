"""API keys: `corral_<prefix>_<secret>`, stored as a SHA-256 hash, compared in constant time.

The prefix (8 lowercase letters or digits) is stored in clear so a key can be found with one indexed lookup and
shown in listings; the secret is 32 random bytes, URL-safe base64 (43 characters). Only the hash of the whole key
is stored, so a stolen database does not yield usable keys.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from typing import NamedTuple

from .._exceptions import AuthenticationError, InvalidRequestError

KEY_SCHEME = "corral"
PREFIX_LENGTH = 8
SECRET_BYTES = 32
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
# 32 bytes of URL-safe base64 is 43 characters; longer secrets (a hand-made CORRAL_ADMIN_KEY) are fine.
_KEY = re.compile(rf"^{KEY_SCHEME}_([a-z0-9]{{{PREFIX_LENGTH}}})_([A-Za-z0-9_-]{{43,256}})$")
KEY_FORMAT = f"{KEY_SCHEME}_<{PREFIX_LENGTH} lowercase letters or digits>_<43 to 256 URL-safe base64 characters>"


class ParsedKey(NamedTuple):
    prefix: str
    secret: str


def generate_key() -> str:
    """A new random API key (256-bit secret)."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
    return f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"


def parse_key(raw: str) -> ParsedKey:
    """Split a presented key; a malformed one is an authentication failure (the caller sent it as a credential)."""
    match = _KEY.fullmatch(raw.strip())
    if match is None:
        raise AuthenticationError(f"malformed API key: expected {KEY_FORMAT}")
    return ParsedKey(match.group(1), match.group(2))


def validate_key(raw: str, what: str = "API key") -> ParsedKey:
    """Like `parse_key` for keys an operator configures (CORRAL_ADMIN_KEY): bad input, not bad credentials."""
    try:
        return parse_key(raw)
    except AuthenticationError:
        raise InvalidRequestError(f"{what} is not a Corral key: expected {KEY_FORMAT}") from None


def hash_key(raw: str) -> str:
    """SHA-256 of the whole key, hex.

    A plain fast hash is enough here: the secret is 256 random bits, so there is no dictionary to try and brute
    force is hopeless whatever the hash costs. Slow password hashes (bcrypt, argon2) protect low-entropy human
    passwords and would only add latency to every request.
    """
    return hashlib.sha256(raw.strip().encode("ascii")).hexdigest()


def same_hash(presented_hash: str, stored_hash: str) -> bool:
    """Constant-time comparison, so response timing does not reveal how much of a hash matched."""
    return hmac.compare_digest(presented_hash.encode("ascii"), stored_hash.encode("ascii"))
