"""The pieces of secrets at egress without sandboxes: the scrubber across every split of a stream, header and Basic
credential injection, the keyring, and the deployment's CA (docs/secrets.md)."""

from __future__ import annotations

import base64
import datetime
import random
import re
import ssl
import stat
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.fernet import Fernet
from pydantic import ValidationError

from corral import InvalidRequestError, ServerError
from corral.control import StoredSecret
from corral.egress import CertificateAuthority, EgressPolicy
from corral.egress._keyring import SecretKeyring
from corral.egress._secrets import PLACEHOLDER, Injection, Scrubber, SecretBinding, bound, new_placeholder
from corral.service._secrets import SecretRequest, seal_secrets

A = SecretBinding("A", new_placeholder(), "tok-AAAA/+=", ("api.example.com",))
B = SecretBinding("B", new_placeholder(), "b", ("*.example.org",), body=True)


def test_placeholders_are_unique_and_shaped() -> None:
    seen = {new_placeholder() for _ in range(1000)}
    assert len(seen) == 1000 and all(PLACEHOLDER.fullmatch(p) for p in seen)


def test_binding_hosts() -> None:
    assert A.binds("api.example.com", 443) and A.binds("api.example.com", 8080)  # no port: any port
    assert not A.binds("example.com", 443) and not A.binds("x.api.example.com", 443)
    assert B.binds("a.example.org", 443) and B.binds("a.b.example.org", 80) and not B.binds("example.org", 443)
    assert bound((A, B), "api.example.com", 443) == (A,)


def test_a_binding_with_a_port_binds_that_port_alone() -> None:
    c = SecretBinding("C", new_placeholder(), "c", ("127.0.0.1:45713", "[::1]:8443", "*.example.net:443"))
    assert c.binds("127.0.0.1", 45713) and not c.binds("127.0.0.1", 45714) and not c.binds("127.0.0.1", 80)
    assert c.binds("::1", 8443) and not c.binds("::1", 443)
    assert c.binds("a.example.net", 443) and not c.binds("a.example.net", 80) and not c.binds("example.net", 443)
    assert bound((A, c), "127.0.0.1", 45713) == (c,) and bound((A, c), "127.0.0.1", 1) == ()


# -- one host grammar: a secret's hosts are written as network rules are ----------------------------------------------

GOOD_HOSTS = ["api.example.com", "PyPI.org.", "*.Example.COM", "*.example.com:443", "127.0.0.1:45713", "127.0.0.1",
              "[::1]:8080", "::2", "[::2]", "bücher.de:8443", "under_score.example.org", "10.0.0.1:5432"]
BAD_HOSTS = ["", "a*.b.com", "*", "*.*.com", "foo.*", "a.*.example", "*.10.0.0.1", "a\x00b.com", "a b.com", "x.com:0",
             "x.com:65536", "x.com:http", "x.com:", "[::1", "[x.com]:80", "https://pypi.org", "-bad.com", "a..b.com",
             "a" * 64 + ".com", "a.org:" + "9" * 5000, "xn--zz.de", "127.0.0.1:45713:1", "h/p"]


def _secret_hosts(hosts: list[str]) -> list[str]:
    return SecretRequest(value="v", hosts=hosts).hosts or []


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_secret_hosts_and_network_rules_accept_the_same_strings_alike(host: str) -> None:
    wire = EgressPolicy.parse([host]).to_wire()
    assert _secret_hosts([host]) == wire  # the same canonical form: "127.0.0.1:45713", "[::1]:8080", "*.example.com"
    assert SecretBinding("S", new_placeholder(), "v", tuple(wire)).rules == EgressPolicy.parse([host]).rules


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_secret_hosts_and_network_rules_refuse_the_same_strings_for_the_same_reason(host: str) -> None:
    with pytest.raises(InvalidRequestError) as rule:
        EgressPolicy.parse([host])
    with pytest.raises(ValidationError) as secret:
        SecretRequest.model_validate({"value": "v", "hosts": [host]})
    why = rule.value.details["why"]
    assert rule.value.message == f"invalid network rule {host!r}: {why}"
    assert f"invalid secret host {host!r}: {why}" in str(secret.value)


def test_a_preset_is_a_network_rule_but_no_secret_host() -> None:
    with pytest.raises(ValidationError, match="invalid secret host '@packages'"):
        SecretRequest.model_validate({"value": "v", "hosts": ["@packages"]})


def _stored(*hosts: str) -> StoredSecret:
    now = datetime.datetime.now(datetime.UTC)
    return StoredSecret(name="gh", hosts=hosts, body=False, created_at=now, updated_at=now, sealed="sealed")


class _Keyring:
    def current(self, sealed: str) -> bool:
        return True


@pytest.mark.parametrize(("stored", "asked", "narrower"), [
    (("api.example.com",), ["api.example.com:443"], True),  # one port of any
    (("*.example.com",), ["a.example.com:443", "b.example.com"], True),
    (("api.example.com:443",), ["api.example.com:443"], True),
    (("api.example.com:443",), ["api.example.com"], False),  # any port is wider than one
    (("api.example.com:443",), ["api.example.com:8443"], False),
    (("127.0.0.1:45713",), ["127.0.0.1"], False),
])
def test_a_stored_secret_is_narrowed_by_host_and_port_never_widened(stored: tuple[str, ...], asked: list[str],
                                                                  narrower: bool) -> None:
    request = {"T": SecretRequest(stored="gh", hosts=asked)}
    keyring: Any = _Keyring()
    if narrower:
        (sealed,) = seal_secrets(request, {}, keyring, {"gh": _stored(*stored)})
        assert sealed.hosts == tuple(_secret_hosts(asked))
    else:
        with pytest.raises(InvalidRequestError, match="is not among them"):
            seal_secrets(request, {}, keyring, {"gh": _stored(*stored)})


@pytest.mark.parametrize("seed", range(20))
def test_the_scrubber_finds_values_split_anywhere(seed: int) -> None:
    rng = random.Random(seed)
    pieces = [rng.choice([b"x" * rng.randrange(0, 50), A.value.encode(), b"tok-AAAA%2F%2B%3D", b"tok-AAA"])
              for _ in range(40)]
    data = b"".join(pieces)
    expected = data.replace(A.value.encode(), A.placeholder.encode()).replace(b"tok-AAAA%2F%2B%3D",
                                                                              A.placeholder.encode())
    scrub = Scrubber([A])
    out, at = [], 0
    while at < len(data):
        n = rng.randrange(1, 12)
        out.append(scrub.feed(data[at:at + n]))
        at += n
    out.append(scrub.flush())
    assert b"".join(out) == expected
    assert A.value.encode() not in b"".join(out)


def _scrubbed(data: bytes, bindings: list[SecretBinding]) -> bytes:
    """The reference: one regex pass over the whole answer, the longest form first."""
    pairs = {}
    for b in bindings:
        pairs[b.value.encode()] = pairs[urllib.parse.quote(b.value, safe="").encode()] = b.placeholder.encode()
    pattern = re.compile(b"|".join(re.escape(v) for v in sorted(pairs, key=len, reverse=True)))
    return pattern.sub(lambda m: pairs[m.group()], data)


def test_the_scrubber_finds_values_across_every_pair_of_read_boundaries() -> None:
    """Reads of any size, the value split at every place, after reads longer than a value (the bytes held back
    are then exactly a value's length minus one) and shorter ones; a short value of another secret beside it."""
    short = SecretBinding("S", new_placeholder(), "xy", ("other.example",))
    quoted = urllib.parse.quote(A.value, safe="").encode()  # the longest form: it sets what is held back
    data = bytes(range(256)) * 2 + quoted + b"-xy-" + A.value.encode() + bytes(range(200))
    expected = _scrubbed(data, [A, short])
    start = 512 - 30
    for first in range(start, start + 60):
        for second in range(first + 1, first + 40):
            scrub = Scrubber([A, short])
            parts = [data[:first], data[first:second], data[second:]]
            out = b"".join(scrub.feed(p) for p in parts) + scrub.flush()
            assert out == expected, (first, second)


@pytest.mark.parametrize("seed", range(5))
def test_the_scrubber_with_several_secrets_on_big_random_reads(seed: int) -> None:
    """Several secrets (some values found, some not in a read): feed and feed_parts agree with the reference."""
    rng = random.Random(seed)
    secrets = [SecretBinding(f"S{i}", new_placeholder(), rng.choice(["tok/", "k-", "%", ""]) + rng.randbytes(
        rng.randrange(4, 30)).hex(), ("h.example",)) for i in range(4)]
    forms = [f.encode() for b in secrets for f in (b.value, urllib.parse.quote(b.value, safe=""))]
    pieces = [rng.randbytes(rng.randrange(0, 5000)) if rng.random() < 0.7 else rng.choice(forms)
              for _ in range(300)]
    data = b"".join(pieces)
    one, other = Scrubber(secrets), Scrubber(secrets)
    out, joined, at = [], [], 0
    while at < len(data):
        n = rng.choice([1, 7, rng.randrange(1, 70_000)])
        out.append(one.feed(data[at:at + n]))
        joined.append(b"".join(other.feed_parts(data[at:at + n])))
        at += n
    out.append(one.flush())
    joined.append(other.flush())
    assert b"".join(out) == b"".join(joined) == _scrubbed(data, secrets)
    assert one.hits == other.hits > 0


def test_the_scrubber_passes_other_bytes_untouched() -> None:
    data = bytes(range(256)) * 64
    scrub = Scrubber([A, B])  # B's value "b" is one byte: every b goes
    out = scrub.feed(data) + scrub.flush()
    assert out == data.replace(b"b", B.placeholder.encode())
    assert Scrubber([]).feed(data) == data


def test_injection_in_text_headers_basic_and_bodies() -> None:
    inj = Injection((A, B))
    assert inj.text(f"/x?t={A.placeholder}") == f"/x?t={A.value}" and inj.used == {"A"}
    basic = base64.b64encode(f"user:{A.placeholder}".encode()).decode()
    out = inj.header("Authorization", f"Basic {basic}")
    assert base64.b64decode(out.split()[1]).decode() == f"user:{A.value}"
    assert inj.header("Authorization", "Basic !!notbase64") == "Basic !!notbase64"
    assert inj.body(f"k={A.placeholder}&b={B.placeholder}".encode()) == f"k={A.placeholder}&b=b".encode()
    only_a = Injection((A,))
    assert not only_a.rewrites_body and only_a.text("nothing") == "nothing" and not only_a.used


def test_the_keyring_seals_opens_and_rotates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_SECRETS_KEY", raising=False)
    ring = SecretKeyring.from_environment(tmp_path)
    key_file = tmp_path / "secrets.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    sealed = ring.seal("v@lue")
    assert "v@lue" not in sealed and ring.open(sealed) == "v@lue"
    assert SecretKeyring.from_environment(tmp_path).open(sealed) == "v@lue"  # the same key, kept
    new = Fernet.generate_key().decode()
    monkeypatch.setenv("CORRAL_SECRETS_KEY", f"{new},{key_file.read_text().strip()}")
    rotated = SecretKeyring.from_environment(tmp_path)
    assert rotated.open(sealed) == "v@lue"
    resealed = rotated.reseal(sealed)
    monkeypatch.setenv("CORRAL_SECRETS_KEY", new)
    only_new = SecretKeyring.from_environment(tmp_path)
    assert only_new.open(resealed) == "v@lue"
    with pytest.raises(ServerError, match="key that sealed it is missing"):
        only_new.open(sealed)
    monkeypatch.setenv("CORRAL_SECRETS_KEY", "not-a-key")
    with pytest.raises(InvalidRequestError, match="not Fernet keys"):
        SecretKeyring.from_environment(tmp_path)


def test_the_ca_is_made_once_kept_private_and_signs_leaves(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    again = CertificateAuthority.load_or_create(tmp_path / "ca")
    try:
        assert again.pem == ca.pem
        assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
        assert b"PRIVATE" not in ca.pem
        context = ca.server_context("api.example.com")
        assert ca.server_context("api.example.com") is context  # cached
        assert isinstance(context, ssl.SSLContext)
        cert = x509.load_pem_x509_certificate(ca.pem)
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        ca.server_context("127.0.0.1")  # an IP literal gets an IP SAN
    finally:
        ca.close()
        again.close()


def test_a_broken_ca_directory_says_how_to_recover(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir()
    (tmp_path / "ca" / "ca.key").write_text("garbage")
    (tmp_path / "ca" / "ca.crt").write_text("garbage")
    with pytest.raises(ServerError, match="move the directory away"):
        CertificateAuthority.load_or_create(tmp_path / "ca")
