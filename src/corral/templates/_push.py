"""`push_template`: a template published as an OCI image to a registry, pinned by digest.

The image is written locally first (`_image.write_image`: the rootfs layer once per template build, the agent
layer each time, both reproducible), then copied to the registry by `skopeo` (Debian's `skopeo` package, the
containers project's registry client: blob existence checks, chunked uploads, token and basic auth, the
standard auth files). A layer the registry already has is not sent again, so a second push of the same
template is a manifest write and nothing more.

Credentials: `creds` (`USER:PASSWORD`, or `$CORRAL_REGISTRY_CREDS`) go to skopeo in a private temporary auth
file, never on its command line (which every local user can read in /proc); without them skopeo reads the
standard files itself (`$REGISTRY_AUTH_FILE`, `${XDG_RUNTIME_DIR}/containers/auth.json`,
`~/.docker/config.json`). Nothing here prints them.

Errors: a malformed destination is an `InvalidRequestError` before anything is written or sent; a refused login
an `AuthenticationError`; an unreachable registry, a timeout or any other failure of the copy a `ServerError`
whose `details` say which (`reason`: `unreachable`, `timeout`, `failed`) with the end of skopeo's output. Only
a push that completed, with the digest the registry reported equal to the image's own, is recorded.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from .._exceptions import AuthenticationError, InvalidRequestError, ServerError
from .._settings import registry_creds
from ._image import AgentFiles, LocalImage, reading_image, write_image
from ._process import Progress, discard, sigterm_raises
from ._spec import DIGEST_RE
from ._store import PushedImage, Template, TemplateStore

__all__ = ["ImageReference", "PushResult", "parse_reference", "push_template"]

# The distribution project's reference grammar (docker/distribution `reference/regexp.go`), restricted to
# what a push destination may be: an explicit registry, a repository path, an optional tag; no digest.
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:.]+\])"
_REGISTRY_RE = re.compile(rf"^{_HOST}(?::[0-9]{{1,5}})?$")
_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_MAX_NAME = 255
_TAIL_LINES = 15
DEFAULT_TIMEOUT_S = 3600.0
_KILL_GRACE_S = 10.0

# skopeo's messages (containers/image), most specific first: what the registry or the network said.
_AUTH_MARKERS = ("unauthorized", "authentication required", "access to the resource is denied",
                 "invalid username/password", "incorrect username or password")
_UNREACHABLE_MARKERS = ("connection refused", "no such host", "no route to host", "network is unreachable",
                        "i/o timeout", "server gave http response to https client", "tls: ", "x509: ",
                        "connection reset")


@dataclass(frozen=True)
class ImageReference:
    """A push destination: `registry/repository:tag`."""

    registry: str
    repository: str
    tag: str

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"

    def pinned(self, digest: str) -> str:
        """The image by digest: what a Pod spec names, immune to the tag moving."""
        return f"{self.registry}/{self.repository}@{digest}"


@dataclass(frozen=True)
class PushResult:
    reference: str  # REGISTRY/REPO@sha256:...
    tag: str  # REGISTRY/REPO:TAG
    digest: str
    image: LocalImage
    template: Template  # with the push recorded


def parse_reference(text: str, *, default_tag: str) -> ImageReference:
    """`REGISTRY/REPO[:TAG]` checked and split; `InvalidRequestError` saying what is wrong otherwise."""
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"invalid image reference {text!r}: {why}; expected REGISTRY/REPOSITORY[:TAG], "
                                   "e.g. registry.example.com/corral/default:v1 or 127.0.0.1:5000/corral",
                                   details={"reference": text})

    if "@" in text:
        raise bad("a push destination names a tag, not a digest (the digest is the result)")
    registry, slash, rest = text.partition("/")
    if not slash or not rest:
        raise bad("no registry")
    if not _REGISTRY_RE.match(registry) or not ("." in registry or ":" in registry or registry == "localhost"):
        raise bad(f"{registry!r} is not a registry host (a name with a dot or a port, or localhost)")
    repository, _, tag = rest.rpartition(":") if ":" in rest else (rest, "", default_tag)
    if not _TAG_RE.match(tag):
        raise bad(f"{tag!r} is not a tag (letters, digits, '_', '.', '-'; at most 128)")
    for component in repository.split("/"):
        if not _COMPONENT_RE.match(component):
            raise bad(f"{component!r} is not a repository path component (lower-case letters, digits, "
                      "separated by '.', '_', '__' or '-')")
    if len(registry) + 1 + len(repository) > _MAX_NAME:
        raise bad(f"the name is longer than {_MAX_NAME} characters")
    return ImageReference(registry, repository, tag)


def push_template(
    template: Template,
    destination: str,
    store: TemplateStore,
    *,
    agent: AgentFiles,
    creds: str | None = None,
    insecure: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    progress: Progress | None = None,
) -> PushResult:
    """Build `template`'s image (with `agent`) and push it to `destination` (`REGISTRY/REPO[:TAG]`; the tag
    defaults to the template's name); record and return the pinned reference.

    `insecure` talks plain HTTP (or unverified TLS) to the registry: for a registry on loopback. The whole copy
    is bounded by `timeout` seconds.
    """
    emit = progress or discard
    ref = parse_reference(destination, default_tag=template.name)
    login = _login(creds or registry_creds())  # bad input is refused before anything is written
    skopeo = _skopeo()
    with sigterm_raises():  # a half-written layer and a running skopeo are cleaned up on SIGTERM too
        image = write_image(template, agent, store.home, emit=emit, keep=_still_there(store))
        emit(f"==> pushing {image.digest[:19]} to {ref} "
             f"({sum(layer.size for layer in image.layers) / 1e6:.1f} MB in {len(image.layers)} layers)")
        with reading_image(image):
            digest = _copy(skopeo, image, ref, login=login, insecure=insecure, timeout=timeout, emit=emit)
    if digest != image.digest:
        raise ServerError(f"the registry reports digest {digest} for {ref}, not the image's {image.digest}",
                          details={"registry": ref.registry, "reason": "digest_mismatch"})
    pushed = PushedImage(ref.pinned(digest), digest, str(ref), _agent_id(image), datetime.now(UTC))
    recorded = store.record_push(template, pushed)
    emit(f"==> pushed {pushed.reference}")
    return PushResult(pushed.reference, str(ref), digest, image, recorded)


def _still_there(store: TemplateStore) -> Callable[[str], bool]:
    def keep(digest: str) -> bool:
        return bool(DIGEST_RE.fullmatch(digest)) and store.lookup_digest(digest) is not None

    return keep


def _agent_id(image: LocalImage) -> str:
    return image.layers[-1].digest


def _skopeo() -> str:
    found = shutil.which("skopeo")
    if found is None:
        raise ServerError("skopeo is not installed; pushing images needs it (on Debian: apt-get install skopeo)",
                          details={"reason": "missing_tool"})
    return found


@contextmanager
def _private_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="corral-push-") as tmp:  # 0700: the auth file stays ours
        yield Path(tmp)


def _login(creds: str | None) -> tuple[str, str] | None:
    if creds is None:
        return None
    user, colon, password = creds.partition(":")
    if not user or not colon:
        raise InvalidRequestError("registry credentials must be USER:PASSWORD")
    return user, password


def _auth_file(directory: Path, registry: str, login: tuple[str, str]) -> Path:
    token = base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()
    path = directory / "auth.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {registry: {"auth": token}}}, f)
    return path


def _copy(skopeo: str, image: LocalImage, ref: ImageReference, *, login: tuple[str, str] | None, insecure: bool,
          timeout: float, emit: Progress) -> str:
    with _private_dir() as tmp:
        digest_file = tmp / "digest"
        cmd = [skopeo, "--command-timeout", f"{int(timeout)}s", "copy", "--retry-times", "0",
               "--digestfile", str(digest_file)]
        if login is not None:
            cmd += ["--dest-authfile", str(_auth_file(tmp, ref.registry, login))]
        if insecure:
            cmd += ["--dest-tls-verify=false"]
        cmd += [f"oci:{image.layout}:{image.ref}", f"docker://{ref}"]
        _run(cmd, ref, timeout=timeout, emit=emit)
        try:
            return digest_file.read_text().strip()
        except OSError as exc:
            raise ServerError(f"skopeo pushed {ref} but wrote no digest: {exc}",
                              details={"registry": ref.registry, "reason": "failed"}) from exc


def _run(cmd: list[str], ref: ImageReference, *, timeout: float, emit: Progress) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise ServerError(f"cannot run skopeo: {exc.strerror}", details={"reason": "missing_tool"}) from exc
    assert proc.stdout is not None
    # skopeo's own --command-timeout should end it first; this kill is the backstop that bounds the read loop.
    watchdog = threading.Timer(timeout + _KILL_GRACE_S, proc.kill)
    watchdog.start()
    try:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            emit(f"    {line}")
        returncode = proc.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if returncode is not None and returncode < 0:
        returncode = None  # killed by the watchdog
    if returncode != 0:
        raise _push_error(ref, list(tail), returncode)


def _push_error(ref: ImageReference, tail: list[str], returncode: int | None) -> Exception:
    text = "\n".join(tail)
    lowered = text.lower()
    details = {"registry": ref.registry, "reference": str(ref), "exit_code": returncode, "output_tail": tail}
    if any(marker in lowered for marker in _AUTH_MARKERS):
        return AuthenticationError(
            f"the registry {ref.registry} refused the credentials for pushing {ref} (pass --creds USER:PASSWORD, "
            f"set CORRAL_REGISTRY_CREDS, or log in with `skopeo login {ref.registry}`):\n{text}",
            details={**details, "reason": "unauthorized"})
    if "context deadline exceeded" in lowered or returncode is None:
        return ServerError(f"pushing {ref} did not finish in time:\n{text}", details={**details, "reason": "timeout"})
    if any(marker in lowered for marker in _UNREACHABLE_MARKERS):
        hint = " (a plain-HTTP registry on loopback needs --insecure)" if "http response" in lowered else ""
        return ServerError(f"the registry {ref.registry} is unreachable{hint}:\n{text}",
                           details={**details, "reason": "unreachable"})
    return ServerError(f"pushing {ref} failed (skopeo exited {returncode}):\n{text}",
                       details={**details, "reason": "failed"})
