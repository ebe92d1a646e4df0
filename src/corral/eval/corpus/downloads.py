"""Downloads: binary files fetched from inside the sandbox through the egress proxy, byte-exact, or refused.

The source is the runner's loopback server (`{server}`), reachable only because the task's policy names it, so
no task depends on the internet. Every download is checked twice where it is cheap: its sha256 computed inside
the sandbox against `Blob.sha256`, and the file read back through the file API against the blob's bytes. The
same URLs under policies that do not allow the server must be refused, at once, with the refusal reported.
Registry downloads (a wheel, an npm tarball) go through the package mirror and are checked against the hashes
PyPI and npm publish.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator

from .._checks import Check, CodeError, CodeText, Data, Denied, Duration, ExitCode, Stderr, Stdout
from .._task import Blob, Code, Exec, Read, SetNetwork, Setup, Severity, Task

__all__ = ["tasks"]


def said(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`, a short verdict: a mismatch shows what was printed (an `equals` check would show
    hashes, and call a wrong answer binary corruption)."""
    return Stdout(matches=r"\A" + re.escape(text).replace("\\\n", r"\n") + r"\Z", mode=mode)


CATEGORY = "downloads"
KiB = 1024
MiB = 1024 * KiB
SERVER = Setup(network=("{server}",))
# --noproxy '': the sandbox's NO_PROXY lists 127.0.0.1 (its own loopback), but the runner's server is the
# host's 127.0.0.1, reachable only through the proxy.
CURL = "curl -sS --fail --noproxy ''"
READ_BACK_MAX = 16 * MiB  # files up to this size are also read back through the file API


def _url(blob: Blob) -> str:
    return "http://{server}" + blob.url_path


def _label(blob: Blob) -> str:
    size = blob.size
    if size >= MiB and size % MiB == 0:
        text = f"{size // MiB}MiB"
    elif size >= KiB and size % KiB == 0:
        text = f"{size // KiB}KiB"
    else:
        text = f"{size}B"
    return f"{blob.kind.replace('_', '-')}-{text}" + (f"-s{blob.seed}" if blob.kind == "random" else "")


def _task(family: str, variant: str, title: str, steps: tuple[Exec | Code | Read | SetNetwork, ...], *,
          setup: Setup = SERVER, budget: float = 45, severity: Severity = "high",
          requires: frozenset[str] = frozenset(), tags: tuple[str, ...] = ()) -> Task:
    return Task(id=f"downloads.{family}/{variant}", family=f"downloads.{family}", category=CATEGORY, title=title,
                steps=steps, setup=setup, budget=budget, severity=severity,
                requires=requires, tags=tags)


def _transfer_mode(blob: Blob) -> str:
    return "large_transfer_failed" if blob.size >= 32 * MiB else "sandbox_unavailable"


# -- curl to a file -------------------------------------------------------------------------------------------

# Sizes around the boundaries where buffers, chunked copies and splice pipes turn over, and some large ones.
CURL_FILE_BLOBS: tuple[Blob, ...] = (
    Blob.random(0, 1), Blob.random(1, 2), Blob.random(2, 3), Blob.random(255, 4), Blob.random(511, 5),
    Blob.random(1000, 6), Blob.random(1023, 7), Blob.random(4095, 8), Blob.random(4096, 9), Blob.random(4097, 10),
    Blob.random(65535, 11), Blob.random(65536, 12), Blob.random(65537, 13), Blob.random(100_000, 14),
    Blob.random(MiB - 1, 15), Blob.random(MiB, 16), Blob.random(MiB + 1, 17), Blob.random(3 * MiB, 18),
    Blob.random(4 * MiB + 7, 19), Blob.random(8 * MiB, 20), Blob.random(10 * MiB, 21), Blob.random(16 * MiB, 22),
    Blob.random(32 * MiB, 23), Blob.random(64 * MiB, 24),
    Blob.all_bytes(1), Blob.all_bytes(4), Blob.all_bytes(256), Blob.all_bytes(4096),
)


def _curl_file(blob: Blob) -> Task:
    path = "/workspace/download.bin"
    steps: tuple[Exec | Read, ...] = (
        Exec(f"{CURL} -o {path} {_url(blob)} && sha256sum {path} && stat -c %s {path}", timeout=120,
             checks=(ExitCode(0, mode=_transfer_mode(blob)), Stdout(equals=f"{blob.sha256}  {path}\n{blob.size}\n"))),
    )
    if blob.size <= READ_BACK_MAX:
        steps += (Read(path, checks=(Data(equals=blob),)),)
    return _task("curl_file", _label(blob), f"curl {blob.describe()} from the loopback server into /workspace; "
                 "sha256 inside, then read the file back through the file API", steps,
                 budget=45 + blob.size / MiB)


# -- curl to stdout: the bytes come back as the command's own output ------------------------------------------

CURL_STDOUT_BLOBS: tuple[Blob, ...] = (
    Blob.random(1, 31), Blob.all_bytes(1), Blob.all_bytes(64), Blob.random(4096, 32), Blob.random(65536, 33),
    Blob.random(MiB, 34), Blob.random(4 * MiB, 35), Blob.random(15 * MiB, 36),
)


def _curl_stdout(blob: Blob) -> Task:
    return _task("curl_stdout", _label(blob), f"curl {blob.describe()} to stdout: the exec result carries the "
                 "binary bytes exactly", (Exec(f"{CURL} {_url(blob)}", timeout=60,
                                               checks=(ExitCode(0), Stdout(equals=blob))),), budget=90)


# -- Python urllib with an explicit proxy ---------------------------------------------------------------------

URLLIB = r"""
import hashlib, os, sys, urllib.request
# urllib honours no_proxy even with an explicit ProxyHandler, and no_proxy lists 127.0.0.1 (the sandbox's own).
for name in ("no_proxy", "NO_PROXY"):
    os.environ.pop(name, None)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://127.0.0.1:3128"}))
digest, size = hashlib.sha256(), 0
out = open(sys.argv[2], "wb") if len(sys.argv) > 2 else None
with opener.open(sys.argv[1], timeout=60) as r:
    length = r.headers["Content-Length"]
    while chunk := r.read(1 << 16):
        digest.update(chunk)
        size += len(chunk)
        if out:
            out.write(chunk)
if out:
    out.close()
print(r.status, length, size, digest.hexdigest())
"""

URLLIB_BLOBS: tuple[Blob, ...] = (
    Blob.random(0, 41), Blob.random(1, 42), Blob.random(1000, 43), Blob.random(8191, 44), Blob.random(8192, 45),
    Blob.random(65536, 46), Blob.random(300_000, 47), Blob.random(MiB, 48), Blob.random(2 * MiB + 3, 49),
    Blob.random(10 * MiB, 50), Blob.random(48 * MiB, 51), Blob.all_bytes(16), Blob.all_bytes(1024),
)


def _urllib(blob: Blob) -> Task:
    path = "/tmp/urllib.bin"
    steps: tuple[Exec | Read, ...] = (
        Exec(("python3", "-c", URLLIB, _url(blob), path), timeout=120,
             checks=(ExitCode(0, mode=_transfer_mode(blob)),
                     Stdout(equals=f"200 {blob.size} {blob.size} {blob.sha256}\n"))),
    )
    if blob.size <= READ_BACK_MAX:
        steps += (Read(path, checks=(Data(equals=blob),)),)
    return _task("urllib", _label(blob), f"Python urllib (explicit ProxyHandler) downloads {blob.describe()}; "
                 "status, Content-Length, size and sha256 agree, and the saved file reads back equal", steps,
                 budget=45 + blob.size / MiB)


# -- ranges ---------------------------------------------------------------------------------------------------

RANGE_BLOB = Blob.random(MiB, 61)


def _slice_sha(start: int, end: int) -> tuple[str, int]:
    part = RANGE_BLOB.bytes()[start:end + 1]
    return hashlib.sha256(part).hexdigest(), len(part)


def _ranges() -> Iterator[Task]:
    size = RANGE_BLOB.size
    cases = {  # label: (curl -r argument, first byte, last byte)
        "first-100": ("0-99", 0, 99),
        "first-byte": ("0-0", 0, 0),
        "middle": ("500000-599999", 500000, 599999),
        "last-byte": (f"{size - 1}-{size - 1}", size - 1, size - 1),
        "suffix-500": ("-500", size - 500, size - 1),
        "open-ended": ("1000000-", 1000000, size - 1),
        "past-the-end": ("1048000-2000000", 1048000, size - 1),
        "whole": ("0-", 0, size - 1),
    }
    url = _url(RANGE_BLOB)
    for label, (arg, start, end) in cases.items():
        sha, length = _slice_sha(start, end)
        yield _task("range", label, f"an HTTP range request ({arg}) of a 1 MiB blob returns 206 and exactly "
                    "those bytes", (Exec(f"{CURL} -r {arg} -o /tmp/part -w '%{{http_code}}\\n' {url} && "
                                         "sha256sum < /tmp/part && stat -c %s /tmp/part", timeout=30,
                                         checks=(ExitCode(0), Stdout(equals=f"206\n{sha}  -\n{length}\n"))),))
    yield _task("range", "unsatisfiable", "a range past the end of the blob is answered 416 and curl fails",
                (Exec(f"curl -sS --noproxy '' -r {size + 10}-{size + 20} -o /dev/null -w '%{{http_code}}\\n' {url}",
                      timeout=30, checks=(said("416\n"),)),))
    resume = (f"{CURL} -r 0-299999 -o /workspace/r.bin {url} && stat -c %s /workspace/r.bin && "
              f"{CURL} -C - -o /workspace/r.bin {url} && sha256sum /workspace/r.bin")
    yield _task("range", "resume", "a partial download resumed with curl -C - ends byte-identical to the blob",
                (Exec(resume, timeout=30, checks=(ExitCode(0), Stdout(equals=f"300000\n{RANGE_BLOB.sha256}  "
                                                                              "/workspace/r.bin\n"))),
                 Read("/workspace/r.bin", checks=(Data(equals=RANGE_BLOB),))))
    pieces = " ".join(f"{CURL} -r {a}-{b} -o /tmp/p{i} {url} &" for i, (a, b) in
                      enumerate(((0, 262143), (262144, 524287), (524288, 786431), (786432, size - 1))))
    yield _task("range", "four-parallel-pieces", "four ranges fetched in parallel and concatenated make the blob",
                (Exec(f"{pieces} wait; cat /tmp/p0 /tmp/p1 /tmp/p2 /tmp/p3 | sha256sum", timeout=30,
                      checks=(Stdout(equals=f"{RANGE_BLOB.sha256}  -\n"),)),))
    sha, length = _slice_sha(4096, 8191)
    probe = URLLIB.replace("with opener.open(sys.argv[1], timeout=60) as r:",
                           "req = urllib.request.Request(sys.argv[1], headers={'Range': 'bytes=4096-8191'})\n"
                           "with opener.open(req, timeout=60) as r:\n    print(r.headers['Content-Range'])")
    yield _task("range", "urllib-range-header", "Python urllib with a Range header gets 206, Content-Range and "
                "the slice", (Exec(("python3", "-c", probe, url), timeout=30,
                                   checks=(Stdout(equals=f"bytes 4096-8191/{size}\n206 {length} {length} {sha}\n"),)),))


# -- several at once -----------------------------------------------------------------------------------------


def _parallel() -> Iterator[Task]:
    for count, size in ((4, MiB), (8, 256 * KiB), (16, 64 * KiB)):
        blobs = [Blob.random(size, 700 + count * 10 + i) for i in range(count)]
        fetch = " ".join(f"{CURL} -o /workspace/p{i:02d} {_url(b)} &" for i, b in enumerate(blobs))
        expect = "".join(f"{b.sha256}  /workspace/p{i:02d}\n" for i, b in enumerate(blobs))
        yield _task("parallel", f"{count}x{size // KiB}KiB", f"{count} downloads at once through the proxy, "
                    "each byte-exact", (Exec(f"{fetch} wait; sha256sum /workspace/p*", timeout=60,
                                             checks=(Stdout(equals=expect),)),), budget=90)
    blobs = [Blob.random(100_000, 800 + i) for i in range(3)]
    seq = " && ".join(f"{CURL} -o /tmp/s{i} {_url(b)}" for i, b in enumerate(blobs))
    expect = "".join(f"{b.sha256}  /tmp/s{i}\n" for i, b in enumerate(blobs))
    yield _task("parallel", "sequential-keepalive", "three downloads in a row from one shell, each byte-exact",
                (Exec(f"{seq} && sha256sum /tmp/s0 /tmp/s1 /tmp/s2", timeout=60, checks=(Stdout(equals=expect),)),))
    one = Blob.random(512 * KiB, 900)
    yield _task("parallel", "same-url-in-one-curl", "one curl fetching the same URL three times over one "
                "keep-alive connection gets three identical copies",
                (Exec(f"{CURL} -o /tmp/a {_url(one)} -o /tmp/b {_url(one)} -o /tmp/c {_url(one)} && "
                      "sha256sum /tmp/a /tmp/b /tmp/c", timeout=60,
                      checks=(Stdout(equals="".join(f"{one.sha256}  /tmp/{n}\n" for n in "abc")),)),))


# -- code cells and other runtimes ----------------------------------------------------------------------------

CELL = """import hashlib, os, urllib.request
for name in ("no_proxy", "NO_PROXY"):
    os.environ.pop(name, None)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://127.0.0.1:3128"}))
data = opener.open("URL", timeout=60).read()
open("/workspace/cell.bin", "wb").write(data)
hashlib.sha256(data).hexdigest()
"""

NODE = r"""
const http = require('http'), crypto = require('crypto');
// Node ignores HTTP_PROXY: send the absolute-form request to the proxy itself.
http.get({host: '127.0.0.1', port: 3128, path: process.argv[1]}, (res) => {
  const h = crypto.createHash('sha256'); let n = 0;
  res.on('data', (c) => { h.update(c); n += c.length; });
  res.on('end', () => console.log(res.statusCode, n, h.digest('hex')));
}).on('error', (e) => { console.error(e.message); process.exit(2); });
"""


def _runtimes() -> Iterator[Task]:
    for blob in (Blob.random(1000, 1001), Blob.random(MiB, 1002), Blob.random(10 * MiB, 1003)):
        yield _task("code_cell", _label(blob), f"a python code cell downloads {blob.describe()}; its value is "
                    "the sha256 and the saved file reads back equal",
                    (Code(CELL.replace("URL", _url(blob)), timeout=60, checks=(CodeText(equals=repr(blob.sha256)),)),
                     Read("/workspace/cell.bin", checks=(Data(equals=blob),))),
                    requires=frozenset({"code"}), budget=90)
    blob = Blob.random(200_000, 1004)
    yield _task("code_cell", "bash-cell", "a bash code cell pipes curl into sha256sum",
                (Code(f"{CURL} {_url(blob)} | sha256sum", language="bash", timeout=60,
                      checks=(Stdout(equals=f"{blob.sha256}  -\n"),)),), requires=frozenset({"code"}))
    for blob in (Blob.random(1, 1101), Blob.random(100_000, 1102), Blob.random(5 * MiB, 1103),
                 Blob.all_bytes(512)):
        yield _task("node", _label(blob), f"node's http module fetches {blob.describe()} through the proxy",
                    (Exec(("node", "-e", NODE, _url(blob)), timeout=60,
                          checks=(ExitCode(0), Stdout(equals=f"200 {blob.size} {blob.sha256}\n"))),))


# -- headers, destinations, sizes, errors ----------------------------------------------------------------------


def _misc() -> Iterator[Task]:
    blob = Blob.random(123_457, 1201)
    yield _task("headers", "head-request", "a HEAD request through the proxy returns the length and the sha256 "
                "header and no body",
                (Exec(f"{CURL} -I {_url(blob)}", timeout=30,
                      checks=(Stdout(matches=rf"(?i)content-length: {blob.size}\r?\n"),
                              Stdout(matches=rf"(?i)x-blob-sha256: {blob.sha256}\r?\n"))),))
    yield _task("headers", "dump-headers-and-body", "curl -D saves the headers apart from the body, which stays "
                "byte-exact",
                (Exec(f"{CURL} -D /tmp/h -o /tmp/b {_url(blob)} && grep -ic '^content-length: {blob.size}' /tmp/h "
                      "&& sha256sum < /tmp/b", timeout=30, checks=(Stdout(equals=f"1\n{blob.sha256}  -\n"),)),))
    yield _task("headers", "write-out-size", "curl's own byte count of the transfer equals the blob size",
                (Exec(f"{CURL} -o /dev/null -w '%{{size_download}} %{{http_code}}' {_url(blob)}", timeout=30,
                      checks=(Stdout(equals=f"{blob.size} 200"),)),))
    destinations = {
        "tmp": "/tmp/d.bin",
        "home": "/home/user/downloads/d.bin",
        "nested-new-dirs": "/workspace/a/b/c/d.bin",
        "spaces-and-unicode": "/workspace/my files/données ü 日本.bin",
    }
    for label, path in destinations.items():
        blob = Blob.random(200_000, 1300 + len(label))
        yield _task("destination", label, f"curl --create-dirs into {path!r}, read back through the file API",
                    (Exec(("curl", "-sS", "--fail", "--noproxy", "", "--create-dirs", "-o", path,
                           "http://{server}" + blob.url_path), timeout=30, checks=(ExitCode(0),)),
                     Read(path, checks=(Data(equals=blob),))))
    shm = Blob.random(2 * MiB, 1310)
    yield _task("destination", "dev-shm", "download into /dev/shm (a tmpfs) and hash it there",
                (Exec(f"{CURL} -o /dev/shm/d.bin {_url(shm)} && sha256sum < /dev/shm/d.bin", timeout=30,
                      checks=(Stdout(equals=f"{shm.sha256}  -\n"),)),))
    for size in (100 * MiB, 256 * MiB):
        blob = Blob.random(size, 1400 + size // MiB)
        yield _task("large", f"stream-{size // MiB}MiB", f"stream {size // MiB} MiB through the proxy into "
                    "sha256sum without touching the disk",
                    (Exec(f"{CURL} {_url(blob)} | sha256sum", timeout=240,
                          checks=(ExitCode(0, mode="large_transfer_failed"),
                                  Stdout(equals=f"{blob.sha256}  -\n", mode="large_transfer_failed"))),),
                    budget=300, tags=("slow",))
    blob = Blob.random(200 * MiB, 1500)
    yield _task("large", "file-200MiB", "a 200 MiB download to /workspace; size and sha256 checked inside",
                (Exec(f"{CURL} -o /workspace/big.bin {_url(blob)} && stat -c %s /workspace/big.bin && "
                      "sha256sum < /workspace/big.bin && rm /workspace/big.bin", timeout=240,
                      checks=(ExitCode(0, mode="large_transfer_failed"),
                              Stdout(equals=f"{blob.size}\n{blob.sha256}  -\n", mode="large_transfer_failed"))),),
                budget=300, tags=("slow",))
    yield _task("errors", "not-found", "a missing path on the allowed server is a plain 404 (curl --fail exits 22), "
                "not a policy refusal",
                (Exec(f"{CURL} http://{{server}}/blob/nothing/1/1", timeout=30,
                      checks=(ExitCode(22), Stderr(contains="404"))),), severity="medium")
    yield _task("errors", "not-found-body", "a 404's body comes back to the client as the server sent it",
                (Exec("curl -sS --noproxy '' -w '\\n%{http_code}' http://{server}/nothing", timeout=30,
                      checks=(Stdout(matches=r"no such blob.*\n404$"),)),), severity="medium")


# -- refusals ------------------------------------------------------------------------------------------------

DENY_BLOB = Blob.random(4096, 1601)


def _refused(extra: tuple[Check, ...] = ()) -> tuple[Check, ...]:
    # The refusal names the host (127.0.0.1 with the server's port); no byte of the blob arrives.
    return (Denied(host="127.0.0.1"), Duration(max=20, mode="unhelpful_network_error"), *extra)


def _refusals() -> Iterator[Task]:
    policies: dict[str, str | tuple[str, ...]] = {
        "none": "none",
        "other-host": ("example.org",),
        "other-port": ("127.0.0.1:1",),
        "packages-only": ("@packages",),
        "wildcard": ("*.example.com",),
    }
    url = _url(DENY_BLOB)
    for label, network in policies.items():
        yield _task("denied", f"curl-{label}", f"the loopback server under policy {network!r}: curl is refused "
                    "with 403 at once, nothing is saved",
                    (Exec(f"{CURL} -o /workspace/x.bin {url}; echo rc=$?; test -e /workspace/x.bin && echo SAVED",
                          timeout=30, checks=_refused((said("rc=22\n", mode="network_isolation_breach"),))),),
                    setup=Setup(network=network), severity="critical")
    probe = URLLIB.replace("with opener.open(sys.argv[1], timeout=60) as r:",
                           "try:\n    opener.open(sys.argv[1], timeout=60)\nexcept urllib.error.HTTPError as e:\n"
                           "    print(e.code, 'x-corral-egress' in {k.lower() for k in e.headers})\n"
                           "    sys.exit(0)\nwith opener.open(sys.argv[1], timeout=60) as r:")
    probe = probe.replace("import hashlib, os, sys, urllib.request", "import hashlib, os, sys, urllib.error, "
                          "urllib.request")
    yield _task("denied", "urllib-none", "Python urllib under policy none gets 403 with Corral's X-Corral-Egress "
                "header", (Exec(("python3", "-c", probe, url), timeout=30,
                                checks=_refused((said("403 True\n", mode="network_isolation_breach"),))),),
                setup=Setup(), severity="critical")
    yield _task("denied", "node-none", "node under policy none gets a 403 and no bytes",
                (Exec(("node", "-e", NODE, url), timeout=30,
                      checks=_refused((Stdout(matches=r"^403 ", mode="network_isolation_breach"),))),),
                setup=Setup(), severity="critical")
    yield _task("denied", "code-cell-none", "a code cell under policy none gets HTTPError 403",
                (Code(CELL.replace("URL", url), timeout=30,
                      checks=(CodeError("HTTPError", matches="403"),)),),
                setup=Setup(), severity="critical", requires=frozenset({"code"}))
    yield _task("denied", "curl-proxy-reason-none", "the 403 body says the host is not reachable and how to allow it",
                (Exec(f"curl -sS --noproxy '' {url}", timeout=30,
                      checks=_refused((Stdout(contains="Corral egress denied"), Stdout(contains="network="))),),),
                setup=Setup(), severity="medium")
    yield _task("denied", "no-proxy-direct", "bypassing the proxy reaches only the sandbox's own loopback: "
                "connection refused at once",
                (Exec(f"curl -sS -o /dev/null {url}; echo rc=$?", timeout=30,
                      checks=(said("rc=7\n", mode="network_isolation_breach"),
                              Duration(max=15, mode="hang"))),), severity="critical")
    yield _task("denied", "raw-socket-to-server-port", "a raw TCP connect to the server's port hits the "
                "sandbox's own loopback and is refused",
                (Exec(("python3", "-c", "import errno, socket, sys\nhost, port = sys.argv[1].split(':')\n"
                       "try:\n    socket.create_connection((host, int(port)), timeout=5)\n    print('connected')\n"
                       "except OSError as e:\n    print(errno.errorcode.get(e.errno, e))", "{server}"), timeout=30,
                      checks=(said("ECONNREFUSED\n", mode="network_isolation_breach"),)),),
                severity="critical")


def _policy_changes() -> Iterator[Task]:
    url = _url(DENY_BLOB)
    fetch = f"{CURL} {url} | sha256sum"
    ok = Stdout(equals=f"{DENY_BLOB.sha256}  -\n")
    yield _task("policy_change", "grant-then-revoke", "allowed, then the policy changes to none: the next "
                "download is refused",
                (Exec(fetch, timeout=30, checks=(ok,)), SetNetwork("none"),
                 Exec(f"{CURL} -o /dev/null {url}", timeout=30,
                      checks=(ExitCode(22, mode="network_isolation_breach"), Denied(host="127.0.0.1")))),
                severity="critical")
    yield _task("policy_change", "refuse-then-grant", "refused under none; after the policy allows the server "
                "the same download works",
                (Exec(f"{CURL} -o /dev/null {url}", timeout=30, checks=(ExitCode(22), Denied(host="127.0.0.1"))),
                 SetNetwork(("{server}",)), Exec(fetch, timeout=30, checks=(ok,))), setup=Setup())
    yield _task("policy_change", "narrow-to-other-host", "the policy changes to another host: the server is "
                "refused from then on",
                (Exec(fetch, timeout=30, checks=(ok,)), SetNetwork(("example.org",)),
                 Exec(f"{CURL} -o /dev/null {url}", timeout=30,
                      checks=(ExitCode(22, mode="network_isolation_breach"), Denied(host="127.0.0.1")))),
                severity="critical")


# -- registries: files as PyPI and npm publish them -----------------------------------------------------------

# sha256 of wheels and sdists as PyPI publishes them.
WHEELS: dict[str, tuple[str, str]] = {
    "tomli==2.0.1": ("tomli-2.0.1-py3-none-any.whl",
                     "939de3e7a6161af0c887ef91b7d41a53e7c5a1ca976325f429cb46ea9bc30ecc"),
    "six==1.17.0": ("six-1.17.0-py2.py3-none-any.whl",
                    "4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274"),
    "idna==3.4": ("idna-3.4-py3-none-any.whl", "90b77e79eaa3eba6de819a0c442c0b4ceefc341a7a2ab77d7562bf49f425c5c2"),
    "toolz==0.12.0": ("toolz-0.12.0-py3-none-any.whl",
                      "2059bd4148deb1884bb0eb770a3cde70e7f954cfbbdc2285f1f2de01fd21eb6f"),
    "semver==3.0.2": ("semver-3.0.2-py3-none-any.whl",
                      "b1ea4686fe70b981f85359eda33199d60c53964284e0cfb4977d243e37cf4bf4"),
    "attrs==23.1.0": ("attrs-23.1.0-py3-none-any.whl",
                      "1f28b4522cdc2fb4256ac1a020c78acf9cba2c6b461ccd2c126f3aa8e8335d04"),
    "docopt==0.6.2": ("docopt-0.6.2.tar.gz", "49b3a825280bd66b3aa83585ef59c4a8c82f2c8a522dbe754a8bc8d08c85c491"),
}
# sha1 (npm's dist.shasum) of tarballs as the npm registry publishes them.
TARBALLS: dict[str, tuple[str, str]] = {
    "is-number@7.0.0": ("is-number-7.0.0.tgz", "7535345b896734d5f80c4d06c50955527a14f12b"),
    "ms@2.1.3": ("ms-2.1.3.tgz", "574c8138ce1d2b5861f0b44579dbadd60c6615b2"),
    "left-pad@1.3.0": ("left-pad-1.3.0.tgz", "5b8a3a7765dfe001261dde915589e782f8c94d1e"),
}
PIP_DOWNLOAD = "pip download --no-deps --no-cache-dir --disable-pip-version-check -q --retries 1 -d /tmp/w"
PACKAGES = frozenset({"packages"})
MIRROR = Setup(network=("@packages",))


def _registries() -> Iterator[Task]:
    for spec, (name, sha) in WHEELS.items():
        yield _task("registry", f"pip-download-{name}", f"pip download {spec} through the mirror: the file's "
                    "sha256 is the one PyPI publishes",
                    (Exec(f"{PIP_DOWNLOAD} {spec} && sha256sum /tmp/w/*", timeout=120,
                          checks=(ExitCode(0, mode="package_install_failed"),
                                  Stdout(equals=f"{sha}  /tmp/w/{name}\n"))),),
                    setup=MIRROR, requires=PACKAGES, budget=150)
    # Against the index page the mirror serves: the #sha256= fragment of the link must be the file's hash.
    for spec, name in (("tabulate==0.9.0", "tabulate-0.9.0-py3-none-any.whl"),
                       ("xmltodict==0.13.0", "xmltodict-0.13.0-py2.py3-none-any.whl"),
                       ("PyYAML==6.0.1", "PyYAML-6.0.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")):
        project = spec.split("==")[0].lower()
        cmd = (f"{PIP_DOWNLOAD} {spec} && f=$(ls /tmp/w) && echo $f && "
               f"want=$(curl -s http://127.0.0.1:3128/pypi/simple/{project}/ | grep -o \"$f#sha256=[0-9a-f]*\" | "
               "head -1 | cut -d= -f2) && got=$(sha256sum < /tmp/w/$f | cut -d' ' -f1) && "
               "if [ -n \"$want\" ] && [ \"$want\" = \"$got\" ]; then echo MATCH; "
               "else echo \"want=$want got=$got\"; fi")
        yield _task("registry", f"index-hash-{project}", f"pip download {spec}: the file matches the sha256 in the "
                    "mirror's index page", (Exec(cmd, timeout=120, checks=(said(f"{name}\nMATCH\n"),)),),
                    setup=MIRROR, requires=PACKAGES, budget=150, tags=("x86_64",) if "x86_64" in name else ())
    for spec, (name, sha1) in TARBALLS.items():
        yield _task("registry", f"npm-pack-{name}", f"npm pack {spec} through the mirror: the tarball's sha1 is "
                    "npm's dist.shasum",
                    (Exec(f"cd /tmp && npm pack -q --fetch-retries=1 {spec} && sha1sum /tmp/{name}", timeout=120,
                          checks=(ExitCode(0, mode="package_install_failed"), Stdout(equals=f"{name}\n{sha1}  "
                                                                                         f"/tmp/{name}\n"))),),
                    setup=MIRROR, requires=PACKAGES, budget=150)
    yield _task("registry", "npm-tarball-by-url", "the mirror serves an npm tarball by its registry path, "
                "byte-identical to the registry's",
                (Exec("curl -sS --fail http://127.0.0.1:3128/npm/is-number/-/is-number-7.0.0.tgz | sha1sum",
                      timeout=60, checks=(Stdout(equals=f"{TARBALLS['is-number@7.0.0'][1]}  -\n"),)),),
                setup=MIRROR, requires=PACKAGES)
    yield _task("registry", "npm-view-shasum", "npm view reports the dist.shasum that npm pack's tarball has",
                (Exec("cd /tmp && npm pack -q ms@2.1.3 >/dev/null && [ \"$(npm view ms@2.1.3 dist.shasum)\" = "
                      "\"$(sha1sum < ms-2.1.3.tgz | cut -d' ' -f1)\" ] && echo SAME", timeout=120,
                      checks=(said("SAME\n"),)),), setup=MIRROR, requires=PACKAGES, budget=150)
    yield _task("registry", "pip-download-refused", "pip download under policy none is refused at once, naming "
                "pypi.org", (Exec(f"{PIP_DOWNLOAD} tomli==2.0.1", timeout=60,
                                  checks=(ExitCode(1), Denied(host="pypi.org"),
                                          Duration(max=30, mode="unhelpful_network_error"))),),
                setup=Setup(), severity="medium")


def tasks() -> Iterable[Task]:
    for blob in CURL_FILE_BLOBS:
        yield _curl_file(blob)
    for blob in CURL_STDOUT_BLOBS:
        yield _curl_stdout(blob)
    for blob in URLLIB_BLOBS:
        yield _urllib(blob)
    yield from _ranges()
    yield from _parallel()
    yield from _runtimes()
    yield from _misc()
    yield from _refusals()
    yield from _policy_changes()
    yield from _registries()
