"""`CertificateAuthority`: the deployment's own CA, with which the egress proxy intercepts TLS to the hosts a
sandbox's secrets are bound to, and to those only (docs/secrets.md). Everything else stays end-to-end TLS.

The CA's key never leaves the host: it sits in `<home>/egress-ca/ca.key` (0600), and sandboxes get only its
certificate. Leaf certificates are made on demand, one per host name, signed by the CA, short-lived, and kept
in memory (their PEM files, which `ssl` can only load from a path, live in a private directory removed on close).
The upstream side is verified here, against the host's trust store plus `upstream_ca` (a TLS-inspecting gateway's
certificate), so intercepting never weakens what the sandbox would have checked itself.

`cryptography` makes the certificates; `ssl` speaks TLS. No library does the CA's small job (load or create once,
mint leaves per name), so it is written here.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import os
import shutil
import ssl
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .._atomic import write_atomic
from .._exceptions import InvalidRequestError, ServerError

__all__ = ["CA_CERT", "CA_DIR", "CertificateAuthority", "upstream_context"]

CA_DIR = "egress-ca"  # under the server's home
CA_CERT = "ca.crt"
_CA_KEY = "ca.key"
_CA_YEARS = 10
_LEAF_DAYS = 7  # a leaf is remade when less than a day is left: clients never see one about to expire
_LEAVES_KEPT = 512  # per process; a sandbox's bound hosts are few, this bounds a deployment with many tenants
_BACKDATE = datetime.timedelta(hours=1)  # clocks inside sandboxes may lag the host's a little


class CertificateAuthority:
    """The CA in `directory` (made there on first use); `server_context(host)` is what the proxy presents."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert
        self.pem = cert.public_bytes(serialization.Encoding.PEM)
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())  # one key for every leaf of this process
        self._leaves: OrderedDict[str, tuple[ssl.SSLContext, datetime.datetime]] = OrderedDict()
        self._lock = threading.Lock()
        self._scratch = Path(tempfile.mkdtemp(prefix="corral-leaves-"))  # 0700: the leaves' PEM files

    @classmethod
    def load_or_create(cls, directory: Path) -> CertificateAuthority:
        """The CA kept in `directory`; a new one, written there (key 0600), when there is none. Two processes
        starting at once end up with the same CA: the files are linked into place, never replaced."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key_path, cert_path = directory / _CA_KEY, directory / CA_CERT
        if not key_path.exists():
            cls._create(directory)
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ServerError(f"the egress CA in {directory} cannot be read ({exc}); move the directory away to "
                              "make a new CA (docs/secrets.md, \"Rotating the CA\")") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ServerError(f"the egress CA key in {key_path} is not an EC key")
        return cls(key, cert)

    @staticmethod
    def _create(directory: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Corral"),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"Corral egress CA {os.urandom(4).hex()}")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=365 * _CA_YEARS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        suffix = os.urandom(4).hex()
        staged_key, staged_cert = directory / f".{_CA_KEY}.{suffix}", directory / f".{CA_CERT}.{suffix}"
        write_atomic(staged_cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        write_atomic(staged_key, key_pem, mode=0o600)
        try:
            os.link(staged_cert, directory / CA_CERT)
            os.link(staged_key, directory / _CA_KEY)  # the key last: its presence says the pair is complete
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            staged_key.unlink()
            staged_cert.unlink()

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for `host` (a name or an IP literal), HTTP/1.1 only."""
        now = datetime.datetime.now(datetime.UTC)
        with self._lock:
            found = self._leaves.get(host)
            if found is not None and found[1] - now > datetime.timedelta(days=1):
                self._leaves.move_to_end(host)
                return found[0]
            context, expires = self._leaf(host, now)
            self._leaves[host] = (context, expires)
            while len(self._leaves) > _LEAVES_KEPT:
                self._leaves.popitem(last=False)
            return context

    def _leaf(self, host: str, now: datetime.datetime) -> tuple[ssl.SSLContext, datetime.datetime]:
        expires = now + datetime.timedelta(days=_LEAF_DAYS)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _common_name(host))]))
                .issuer_name(self.cert.subject).public_key(self._leaf_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _BACKDATE).not_valid_after(expires)
                .add_extension(x509.SubjectAlternativeName([_general_name(host)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        chain = cert.public_bytes(serialization.Encoding.PEM) + self.pem
        key = self._leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())
        path = self._scratch / (hashlib.sha256(host.encode()).hexdigest()[:32] + ".pem")
        write_atomic(path, key + chain, mode=0o600)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(path)
        context.set_alpn_protocols(["http/1.1"])  # the proxy rewrites HTTP/1.1 only; clients fall back to it
        return context, expires

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self._scratch)


def upstream_context(extra_ca: Path | None = None) -> ssl.SSLContext:
    """How the proxy verifies a bound host's real certificate: the host's trust store, plus `extra_ca` (a PEM
    file: a TLS-inspecting gateway's CA, or a test's own), hostname checked, HTTP/1.1."""
    context = ssl.create_default_context()
    if extra_ca is not None:
        try:
            context.load_verify_locations(cafile=str(extra_ca))
        except (OSError, ssl.SSLError) as exc:
            raise InvalidRequestError(f"--upstream-ca {extra_ca}: not a readable PEM certificate file ({exc})")\
                from exc
    context.set_alpn_protocols(["http/1.1"])
    return context


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _common_name(host: str) -> str:
    return host if len(host) <= 64 else host[:61] + "..."  # the CN attribute is at most 64 characters
