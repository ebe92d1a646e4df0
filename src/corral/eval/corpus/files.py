"""file_io: bytes in through the file API, stdin or a command, and the same bytes out again.

The field report's worst failures were here: binary data decoded as text, NUL bytes ending a file, output cut
without notice, CRLF translation, names mangled on the way. Every variant moves one kind of content (a size, a byte
pattern, an encoding, a file name) through one path (file API, command, stdout, stdin) and compares the bytes
exactly, so a failure names what happened to them (`classify_bytes`).
"""

from __future__ import annotations

import gzip
import pickle
import struct
import zlib
from collections.abc import Iterable, Iterator

from .._checks import (
    Check,
    Data,
    ExitCode,
    Fails,
    Ok,
    Stderr,
    Stdout,
    Truncated,
)
from .._task import Blob, Code, Exec, Read, Setup, Severity, Step, Task, Write

__all__ = ["tasks"]

CATEGORY = "file_io"
KIB = 1024
MIB = 1024 * 1024
CAP = 16 * MIB  # Corral keeps at most this much of each output stream (head and tail)


def tasks() -> Iterable[Task]:
    yield from _binary_roundtrip()
    yield from _api_write_command_check()
    yield from _command_write_api_read()
    yield from _stdout_binary()
    yield from _stdin_binary()
    yield from _filenames()
    yield from _nested_dirs()
    yield from _overwrite()
    yield from _append()
    yield from _empty()
    yield from _invalid_utf8_output()
    yield from _large_output()
    yield from _exit_codes()
    yield from _cwd_env()
    yield from _state_across_steps()


def _task(family: str, variant: str, title: str, steps: Iterable[Step], *, severity: Severity = "high",
          budget: float = 60, setup: Setup | None = None, tags: tuple[str, ...] = ()) -> Task:
    return Task(id=f"{family}/{variant}", family=family, category=CATEGORY, title=title, steps=tuple(steps),
                setup=setup or Setup(), severity=severity, budget=budget, tags=tags)


def _sized_budget(size: int) -> float:
    """Tight for small transfers; large ones get room for the upload and download themselves."""
    return 60 if size < 4 * MIB else 90 if size <= 16 * MIB else 150


def _upload_ok(size: int) -> Ok:
    return Ok(mode="large_transfer_failed" if size >= MIB else "sandbox_unavailable")


def _size_name(n: int) -> str:
    """4096 -> 4KiB, 4097 -> 4KiB+1, 65535 -> 64KiB-1, 255 -> 255B."""
    for unit, name in ((MIB, "MiB"), (KIB, "KiB")):
        for delta, suffix in ((0, ""), (-1, "+1"), (1, "-1")):
            if n + delta >= unit and (n + delta) % unit == 0:
                return f"{(n + delta) // unit}{name}{suffix}"
    return f"{n}B"


# -- byte patterns --------------------------------------------------------------------------------------------

_TEXT = "Grüße, 世界! 🦀 naïve café"


def _tiny_png() -> bytes:
    """A valid 1x1 PNG: its signature has CRLF, a Ctrl-Z and high bytes, the classic text-mode victims."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", 1, 1, 8, 6, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00\xff")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


# name -> (bytes, severity, what the pattern is); each breaks a different way of treating bytes as text.
PATTERNS: dict[str, tuple[Blob, str]] = {
    "all-256-bytes": (Blob.all_bytes(1), "every byte value once"),
    "all-256-bytes-1MiB": (Blob.all_bytes(4096), "every byte value, 1 MiB"),
    "nul-1": (Blob.literal(b"\x00"), "a single NUL"),
    "nul-4KiB": (Blob.repeat(b"\x00", 4 * KIB), "4 KiB of NULs"),
    "nul-1MiB": (Blob.repeat(b"\x00", MIB), "1 MiB of NULs"),
    "nul-at-start": (Blob.literal(b"\x00header after a NUL\n"), "a NUL as the first byte"),
    "nul-in-middle": (Blob.literal(b"before the NUL\x00after the NUL\n"), "a NUL in the middle"),
    "nul-at-end": (Blob.literal(b"text then a NUL\x00"), "a NUL as the last byte"),
    "nul-at-4096": (Blob.literal(b"a" * 4096 + b"\x00" + b"b" * 4096), "a NUL at a page boundary"),
    "nul-at-65536": (Blob.literal(b"c" * 65536 + b"\x00" + b"d" * 100), "a NUL at a pipe-buffer boundary"),
    "nul-every-other": (Blob.repeat(b"x\x00", 10_000), "NUL as every second byte"),
    "ff-run-1000": (Blob.repeat(b"\xff", 1000), "a run of 0xFF"),
    "crlf-lines": (Blob.literal(b"line one\r\nline two\r\nline three\r\n"), "CRLF line endings"),
    "lf-lines": (Blob.literal(b"line one\nline two\nline three\n"), "LF endings that must not become CRLF"),
    "lone-cr": (Blob.literal(b"progress 10%\rprogress 50%\rprogress 100%\r"), "lone CRs (progress bars)"),
    "mixed-line-endings": (Blob.literal(b"unix\nwindows\r\nmac\rreverse\n\rend"), "LF, CRLF, CR and LF-CR"),
    "no-trailing-newline": (Blob.literal(b"no newline at the end"), "text without a final newline"),
    "only-newlines": (Blob.repeat(b"\n", 1000), "a thousand newlines"),
    "trailing-whitespace": (Blob.literal(b"spaces   \ntabs\t\t\n  \n"), "trailing spaces and tabs"),
    "ctrl-z-in-middle": (Blob.literal(b"before\x1aafter"), "0x1A, DOS's end-of-file byte"),
    "c0-controls": (Blob.literal(bytes(range(32))), "every C0 control character"),
    "del-and-c1": (Blob.literal(bytes(range(0x7F, 0xA0))), "DEL and the C1 controls"),
    "ansi-escapes": (Blob.literal(b"\x1b[31mred\x1b[0m \x1b[1mbold\x1b[0m\x1b]0;title\x07"), "terminal escapes"),
    "utf8-text": (Blob.literal(_TEXT + "\n"), "valid UTF-8 in several scripts"),
    "utf8-bom": (Blob.literal(b"\xef\xbb\xbf" + (_TEXT + "\n").encode()), "a UTF-8 BOM before text"),
    "utf16le-bom": (Blob.literal(b"\xff\xfe" + _TEXT.encode("utf-16-le")), "UTF-16 LE with its BOM"),
    "utf16be-bom": (Blob.literal(b"\xfe\xff" + _TEXT.encode("utf-16-be")), "UTF-16 BE with its BOM"),
    "nfd-text": (Blob.literal("cafe\u0301 nai\u0308ve\n"), "decomposed (NFD) accents that must not be normalized"),
    "emoji-zwj": (Blob.literal("👩\u200d👩\u200d👧 🏳\ufe0f\u200d🌈\n"), "emoji ZWJ sequences"),
    "latin1-text": (Blob.literal("café naïve déjà vu\n".encode("latin-1")), "Latin-1 text (invalid UTF-8)"),
    "cp1252-quotes": (Blob.literal("\u201csmart quotes\u201d \u2013 dash\u2026\n".encode("cp1252")),
                      "Windows-1252 punctuation"),
    "utf8-lone-continuation": (Blob.literal(b"abc\x80def\xbfghi"), "continuation bytes with no lead"),
    "utf8-overlong": (Blob.literal(b"overlong slash \xc0\xaf and \xe0\x80\xaf"), "overlong encodings"),
    "utf8-truncated-sequence": (Blob.literal(b"euro sign cut \xe2\x82"), "a multi-byte character cut short"),
    "utf8-invalid-lead": (Blob.literal(bytes(range(0xF5, 0x100)) + b"tail"), "bytes 0xF5-0xFF, never UTF-8"),
    "utf8-above-max": (Blob.literal(b"\xf4\x90\x80\x80 beyond U+10FFFF"), "a code point above U+10FFFF"),
    "wtf8-surrogate-pair": (Blob.literal(b"\xed\xa0\xbd\xed\xb8\x80 WTF-8"), "a surrogate pair encoded as WTF-8"),
    "wtf8-lone-surrogate": (Blob.literal(b"lone \xed\xb2\x80 surrogate"), "a lone surrogate encoded as WTF-8"),
    "png-image": (Blob.literal(_tiny_png()), "a real PNG file"),
    "gzip-stream": (Blob.literal(gzip.compress(b"compressible text " * 500, mtime=0)), "a gzip stream"),
    "pickle-protocol5": (Blob.literal(pickle.dumps({"a": [1, 2.5, None], "b": b"\x00\xff"}, protocol=5)),
                         "a pickle"),
    "long-line-1MiB": (Blob.repeat(b"x", MIB), "a 1 MiB line with no newline"),
}

def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _pattern_ok(blob: Blob) -> Ok:
    """A request that fails on bytes that are not UTF-8 reveals a text decoder in the transport."""
    if blob.size >= MIB:
        return Ok(mode="large_transfer_failed")
    return Ok(mode="sandbox_unavailable" if _is_utf8(blob.bytes()) else "text_decoding_crash")


RANDOM_SIZES = (0, 1, 255, 4095, 4096, 4097, 65535, 65536, 65537, MIB - 1, MIB, MIB + 1, 10 * MIB)


def _binary_roundtrip() -> Iterator[Task]:
    family = "file_io.binary_roundtrip"
    for i, size in enumerate(RANDOM_SIZES):
        blob = Blob.random(size, seed=100 + i)
        path = f"/workspace/rt/random-{size}.bin"
        yield _task(family, f"random-{_size_name(size)}", f"upload {blob.describe()} and download them unchanged",
                    [Write(path, blob, (_upload_ok(size),)), Read(path, (_upload_ok(size), Data(equals=blob)))],
                    severity="critical", budget=_sized_budget(size))
    for seed in (1, 2):
        blob = Blob.random(50 * MIB, seed=seed)
        path = f"/workspace/rt/big-{seed}.bin"
        yield _task(family, f"random-50MiB-seed{seed}", "upload 50 MiB of random bytes and download them unchanged",
                    [Write(path, blob, (_upload_ok(blob.size),)),
                     Read(path, (_upload_ok(blob.size), Data(equals=blob)))],
                    severity="critical", budget=_sized_budget(blob.size), tags=("large",))
    for name, (blob, what) in PATTERNS.items():
        path = f"/workspace/rt/{name}.bin"
        yield _task(family, name, f"upload {what} and download them unchanged",
                    [Write(path, blob, (_pattern_ok(blob),)), Read(path, (_pattern_ok(blob), Data(equals=blob)))],
                    severity="critical")
    # The other roots the file API allows, and a relative path (resolved against /workspace).
    for variant, write_path, read_path in (
        ("root-tmp", "/tmp/rt/data.bin", "/tmp/rt/data.bin"),
        ("root-home", "/home/user/rt/data.bin", "/home/user/rt/data.bin"),
        ("relative-path", "rt/relative.bin", "/workspace/rt/relative.bin"),
        ("dot-segments", "/workspace/a/./b/../c.bin", "/workspace/a/c.bin"),
    ):
        blob = Blob.random(65537, seed=len(variant))
        yield _task(family, variant, f"upload to {write_path} and download from {read_path}",
                    [Write(write_path, blob), Read(read_path, (Data(equals=blob),))], severity="critical")


def _api_write_command_check() -> Iterator[Task]:
    """Upload through the API, then let a program inside see the bytes (sha256sum, wc, cmp)."""
    family = "file_io.api_write_command_reads"
    blobs: list[tuple[str, Blob]] = [
        (f"random-{_size_name(n)}", Blob.random(n, seed=200 + n % 97))
        for n in (0, 1, 4096, 65537, MIB, 10 * MIB)
    ]
    blobs += [(name, PATTERNS[name][0]) for name in (
        "all-256-bytes", "nul-4KiB", "crlf-lines", "utf16le-bom", "wtf8-surrogate-pair")]
    for variant, blob in blobs:
        path = f"/workspace/in/{variant}.bin"
        yield _task(family, f"sha256-{variant}", f"upload {blob.describe()}; sha256sum and wc -c inside agree",
                    [Write(path, blob, (_upload_ok(blob.size),)),
                     Exec(f"sha256sum '{path}' && wc -c < '{path}'", (
                         ExitCode(0), Stdout(contains=blob.sha256, mode="binary_corruption"),
                         Stdout(contains=f"\n{blob.size}\n", mode="binary_corruption")))],
                    severity="critical", budget=_sized_budget(blob.size))
    # The sandbox's own Python regenerates the same random bytes, so `cmp` checks every byte inside.
    for n, seed in ((4097, 5), (MIB + 7, 6)):
        path = f"/workspace/in/cmp-{n}.bin"
        blob = Blob.random(n, seed)
        gen = f"python3 -c 'import random,sys; sys.stdout.buffer.write(random.Random({seed}).randbytes({n}))'"
        yield _task(family, f"cmp-{_size_name(n)}", "upload random bytes; cmp inside against a regenerated copy",
                    [Write(path, blob), Exec(f"{gen} > /tmp/expected.bin && cmp /tmp/expected.bin '{path}' && "
                                             "echo identical", (ExitCode(0, mode="binary_corruption"),
                                                                Stdout(equals="identical\n")))],
                    severity="critical")
    # Setup uploads happen before the first step: the program must see them complete.
    blob = Blob.random(3 * MIB + 3, seed=77)
    yield _task(family, "setup-file-complete", "a setup file of 3 MiB is complete when the first command runs",
                [Exec("sha256sum /workspace/setup.bin", (ExitCode(0),
                                                           Stdout(contains=blob.sha256, mode="binary_corruption")))],
                setup=Setup(files=(("/workspace/setup.bin", blob),)), severity="critical")
    yield _task(family, "python-reads-binary", "upload binary; Python opened in binary mode counts NULs and 0xFF",
                [Write("/workspace/in/counts.bin", Blob.all_bytes(64)),
                 Exec("python3 -c \"d=open('/workspace/in/counts.bin','rb').read(); "
                      "print(len(d), d.count(0), d.count(255))\"", (Stdout(equals="16384 64 64\n"),))],
                severity="critical")


def _hex_writer(data: bytes, path: str) -> str:
    return f"python3 -c \"import sys; sys.stdout.buffer.write(bytes.fromhex('{data.hex()}'))\" > '{path}'"


def _command_write_api_read() -> Iterator[Task]:
    """A program writes the file; the file API must bring back exactly its bytes."""
    family = "file_io.command_write_api_reads"
    seq_text = "".join(f"{i}\n" for i in range(1, 100_001))
    cases: list[tuple[str, str, str, Blob]] = [
        ("head-dev-zero-64KiB", "head -c 65536 /dev/zero > {p}", "NULs from /dev/zero", Blob.repeat(b"\x00", 65536)),
        ("dd-zero-1MiB", "dd if=/dev/zero of={p} bs=4096 count=256 status=none", "dd of NULs",
         Blob.repeat(b"\x00", MIB)),
        ("sparse-truncate-1MiB", "truncate -s 1M {p}", "a sparse file", Blob.repeat(b"\x00", MIB)),
        ("yes-lines-100KiB", "yes 'a line of text' | head -c 102400 > {p}", "repeated lines",
         Blob.repeat(b"a line of text\n", 102400)),
        ("seq-100000", "seq 1 100000 > {p}", "the numbers 1 to 100000", Blob.literal(seq_text)),
        ("printf-crlf", "printf 'one\\r\\ntwo\\r\\n' > {p}", "CRLF lines from printf",
         Blob.literal(b"one\r\ntwo\r\n")),
        ("printf-nul-ff", "printf 'a\\000b\\377c' > {p}", "a NUL and 0xFF from printf",
         Blob.literal(b"a\x00b\xffc")),
        ("python-all-bytes", "python3 -c \"import sys; sys.stdout.buffer.write(bytes(range(256))*64)\" > {p}",
         "every byte value from Python", Blob.all_bytes(64)),
        ("python-text-crlf", "python3 -c \"open('{P}', 'w', newline='\\r\\n').write('a\\nb\\n')\"",
         "a text file with CRLF newlines", Blob.literal(b"a\r\nb\r\n")),
        ("node-buffer", "node -e \"require('fs').writeFileSync('{P}', Buffer.from([0,255,254,0,10,13]))\"",
         "a Node Buffer", Blob.literal(b"\x00\xff\xfe\x00\n\r")),
        ("tee-copy", "printf 'tee\\000d\\n' | tee {p} > /dev/null", "tee's copy", Blob.literal(b"tee\x00d\n")),
    ]
    for n, seed in ((1, 11), (4097, 12), (MIB, 13), (10 * MIB, 14)):
        cases.append((f"python-random-{_size_name(n)}",
                      f"python3 -c 'import random,sys; sys.stdout.buffer.write(random.Random({seed}).randbytes({n}))'"
                      " > {p}", f"{n} random bytes", Blob.random(n, seed)))
    for name in ("utf16be-bom", "wtf8-lone-surrogate", "png-image"):
        blob = PATTERNS[name][0]
        cases.append((f"hex-{name}", _hex_writer(blob.bytes(), "{p}").replace("'{p}'", "{p}"),
                      PATTERNS[name][1], blob))
    for variant, cmd, what, blob in cases:
        path = f"/workspace/out/{variant}.bin"
        yield _task(family, variant, f"a command writes {what}; download it through the file API",
                    [Exec("mkdir -p /workspace/out && " + cmd.replace("{p}", f"'{path}'").replace("{P}", path),
                          (ExitCode(0),)),
                     Read(path, (_upload_ok(blob.size), Data(equals=blob)))],
                    severity="critical", budget=_sized_budget(blob.size))
    # Other roots, and files reached through links.
    blob = Blob.literal(b"in another root\x00\xff\n")
    for root in ("/tmp", "/home/user"):
        path = f"{root}/made-by-command.bin"
        yield _task(family, f"root-{root.strip('/').replace('/', '-')}", f"a command writes under {root}; "
                    "download it", [Exec(_hex_writer(blob.bytes(), path), (ExitCode(0),)),
                                    Read(path, (Data(equals=blob),))], severity="critical")
    yield _task(family, "through-symlink", "download a file through a symlink that stays in /workspace",
                [Exec(_hex_writer(blob.bytes(), "/workspace/target.bin") + " && ln -s target.bin /workspace/link.bin",
                      (ExitCode(0),)),
                 Read("/workspace/link.bin", (Data(equals=blob),))])
    yield _task(family, "hardlink", "download a hard link made by a command",
                [Exec(_hex_writer(blob.bytes(), "/workspace/orig.bin") + " && ln /workspace/orig.bin /workspace/hl.bin",
                      (ExitCode(0),)),
                 Read("/workspace/hl.bin", (Data(equals=blob),))])
    yield _task(family, "private-mode-0600", "download a file the command made private (mode 0600)",
                [Exec(_hex_writer(blob.bytes(), "/workspace/secret.bin") + " && chmod 600 /workspace/secret.bin",
                      (ExitCode(0),)),
                 Read("/workspace/secret.bin", (Data(equals=blob),))])


def _stdout_binary() -> Iterator[Task]:
    """A file uploaded at setup comes back byte for byte as a command's stdout (or stderr)."""
    family = "file_io.stdout_binary"
    blobs: list[tuple[str, Blob]] = [
        (f"random-{_size_name(n)}", Blob.random(n, seed=300 + i))
        for i, n in enumerate((1, 65537, MIB, 4 * MIB))
    ]
    blobs += [(name, PATTERNS[name][0]) for name in (
        "all-256-bytes", "nul-4KiB", "nul-in-middle", "nul-at-65536", "utf8-lone-continuation", "crlf-lines",
        "lone-cr", "utf16le-bom", "wtf8-surrogate-pair")]
    for variant, blob in blobs:
        path = f"/workspace/{variant}.bin"
        yield _task(family, f"cat-{variant}", f"cat {blob.describe()} to stdout, byte for byte",
                    [Exec(f"cat '{path}'", (Ok(mode="text_decoding_crash"), ExitCode(0), Stdout(equals=blob)))],
                    setup=Setup(files=((path, blob),)), severity="critical", budget=_sized_budget(blob.size))
    blob = Blob.random(65537, seed=310)
    yield _task(family, "cat-argv", "cat binary to stdout, command given as argv",
                [Exec(("cat", "/workspace/argv.bin"), (ExitCode(0), Stdout(equals=blob)))],
                setup=Setup(files=(("/workspace/argv.bin", blob),)), severity="critical")
    for variant, name in (("stderr-all-bytes", "all-256-bytes"), ("stderr-nul-middle", "nul-in-middle"),
                          ("stderr-random-64KiB+1", "")):
        blob = PATTERNS[name][0] if name else Blob.random(65537, seed=311)
        yield _task(family, f"cat-{variant}", "cat binary to stderr, byte for byte",
                    [Exec("cat /workspace/err.bin >&2", (ExitCode(0), Stderr(equals=blob), Stdout(equals=b"")))],
                    setup=Setup(files=(("/workspace/err.bin", blob),)), severity="critical")


def _stdin_binary() -> Iterator[Task]:
    """Bytes sent to a command's stdin arrive exactly, whatever they are and whoever reads them."""
    family = "file_io.stdin_binary"
    blobs: list[tuple[str, Blob]] = [
        (f"random-{_size_name(n)}", Blob.random(n, seed=400 + i))
        for i, n in enumerate((0, 1, 65537, MIB, 8 * MIB))
    ]
    blobs += [(name, PATTERNS[name][0]) for name in (
        "all-256-bytes", "nul-1", "nul-4KiB", "utf8-overlong", "crlf-lines", "lone-cr", "wtf8-lone-surrogate")]
    for variant, blob in blobs:
        yield _task(family, f"cat-{variant}", f"send {blob.describe()} to cat's stdin; stdout echoes them",
                    [Exec(("cat",), (Ok(mode="stdin_lost"), ExitCode(0), Stdout(equals=blob, mode="stdin_lost")),
                          stdin=blob)], severity="critical", budget=_sized_budget(blob.size))
    blob = Blob.random(MIB + 3, seed=420)
    yield _task(family, "sha256-of-stdin", "sha256sum of 1 MiB sent on stdin matches",
                [Exec("sha256sum -", (ExitCode(0), Stdout(contains=blob.sha256, mode="stdin_lost")), stdin=blob)],
                severity="critical")
    blob = Blob.literal(b"line one\nline two\r\n\x00nul line\nlast without newline")
    yield _task(family, "python-reads-stdin", "Python counts the bytes of its binary stdin",
                [Exec("python3 -c 'import sys; d=sys.stdin.buffer.read(); print(len(d), d.count(0), d.count(10))'",
                      (ExitCode(0), Stdout(equals=f"{blob.size} 1 3\n", mode="stdin_lost")), stdin=blob)])
    yield _task(family, "node-reads-stdin", "Node reads binary stdin into a Buffer",
                [Exec("node -e \"const b=require('fs').readFileSync(0); console.log(b.length, b[0], b[b.length-1])\"",
                      (ExitCode(0), Stdout(equals="256 0 255\n", mode="stdin_lost")), stdin=Blob.all_bytes(1))])
    lines = Blob.literal("first\nsecond line\n  indented\nünïcödé\nlast")
    yield _task(family, "bash-read-loop", "a bash read loop sees every line, the last one without a newline",
                [Exec("while IFS= read -r l || [ -n \"$l\" ]; do printf '[%s]\\n' \"$l\"; done",
                      (ExitCode(0), Stdout(equals="[first]\n[second line]\n[  indented]\n[ünïcödé]\n[last]\n",
                                           mode="stdin_lost")), stdin=lines)])
    big = Blob.random(MIB, seed=421)
    yield _task(family, "reader-stops-early", "head reads 10 bytes of a 1 MiB stdin and exits; the call still works",
                [Exec("head -c 10", (Ok(mode="stdin_lost"), ExitCode(0),
                                     Stdout(equals=big.bytes()[:10], mode="stdin_lost")), stdin=big, timeout=20)],
                severity="medium")
    yield _task(family, "reader-ignores-stdin", "a command that never reads its 1 MiB stdin does not hang",
                [Exec("echo done", (Ok(mode="hang"), ExitCode(0), Stdout(equals="done\n")), stdin=big, timeout=20)],
                severity="medium")
    yield _task(family, "sort-stdin", "sort the lines given on stdin",
                [Exec("LC_ALL=C sort", (ExitCode(0), Stdout(equals="apple\nbanana\ncherry\n", mode="stdin_lost")),
                      stdin=Blob.literal("cherry\napple\nbanana\n"))])


# Names an agent really writes: spaces from user uploads, quotes, shell metacharacters, non-Latin scripts.
FILENAMES: dict[str, str] = {
    "space": "with space.txt",
    "leading-spaces": "  leading spaces.txt",
    "trailing-space": "trailing space .txt",
    "single-quote": "it's here.txt",
    "double-quote": 'say "hi".txt',
    "backslash": "back\\slash.txt",
    "dollar": "cost $HOME $(id).txt",
    "backtick": "tick `id`.txt",
    "glob-chars": "star*question?[set].txt",
    "semicolon-pipe-amp": "a;b|c&d.txt",
    "parens-braces": "copy (1) {2}.txt",
    "hash-percent-plus": "#tag %20 +plus.txt",
    "colon-comma-equals": "a:b,c=d.txt",
    "leading-dash": "-rf.txt",
    "dotfile": ".hidden",
    "double-dot-prefix": "..dots.txt",
    "tab": "tab\tin name.txt",
    "newline": "new\nline.txt",
    "emoji": "report 🦀🐍.txt",
    "cjk": "数据分析.csv",
    "greek": "Ελληνικά.txt",
    "arabic-rtl": "ملف عربي.txt",
    "cyrillic": "Отчёт.txt",
    "nfc-accent": "caf\u00e9.txt",
    "nfd-accent": "cafe\u0301.txt",
    "zero-width-joiner": "a\u200db.txt",
    "fullwidth": "\uff46\uff55\uff4c\uff4c.txt",
    "long-250-bytes": "n" * 246 + ".txt",
    "long-255-bytes": "m" * 251 + ".txt",
    "long-multibyte-252-bytes": "é" * 124 + ".txt",
}


def _filenames() -> Iterator[Task]:
    family = "file_io.filenames"
    for i, (variant, name) in enumerate(FILENAMES.items()):
        directory = f"/workspace/names-{i}"
        path = f"{directory}/{name}"
        content = Blob.literal(f"content of {variant}\n")
        yield _task(family, f"api-{variant}", f"upload a file named {name!r}; ls lists it; download it",
                    [Write(path, content, (Ok(mode="filename_mangled"),)),
                     # One file in the directory: ls must print exactly its name (non-tty output is literal).
                     Exec(("ls", "-1A", "--", directory),
                          (ExitCode(0), Stdout(equals=f"{name}\n", mode="filename_mangled"))),
                     Read(path, (Ok(mode="filename_mangled"), Data(equals=content)))], severity="medium")
    # The other way: a program names the file, the file API must find it under the same name.
    for variant in ("space", "single-quote", "newline", "emoji", "nfd-accent", "arabic-rtl", "long-255-bytes",
                    "backslash"):
        name = FILENAMES[variant]
        content = Blob.literal(f"written by a command: {variant}\n")
        path = f"/workspace/cmd-names/{name}"
        yield _task(family, f"command-{variant}", f"a command creates {name!r}; download it by that name",
                    [Exec("mkdir -p cmd-names && printf 'written by a command: %s\\n' \"$V\" > \"cmd-names/$N\"",
                          (ExitCode(0),), env={"N": name, "V": variant}),
                     Read(path, (Ok(mode="filename_mangled"), Data(equals=content)))], severity="medium")
    # A directory whose name needs quoting, and a too-long name that must be refused clearly.
    yield _task(family, "api-dir-with-spaces", "upload into 'my data/2024 results/'; find lists the full path",
                [Write("/workspace/my data/2024 results/out put.csv", Blob.literal("a,b\n1,2\n")),
                 Exec("find '/workspace/my data' -type f", (Stdout(equals="/workspace/my data/2024 results/"
                                                                    "out put.csv\n", mode="filename_mangled"),))],
                severity="medium")
    yield _task(family, "api-name-too-long", "uploading a 256-byte file name is refused with a clear error",
                [Write("/workspace/" + "x" * 256, Blob.literal("x"),
                       (Fails(code="invalid_request", matches=r"too long|name", mode="unclear_error"),))],
                severity="medium")


def _nested_dirs() -> Iterator[Task]:
    family = "file_io.nested_dirs"
    for depth in (1, 8, 40):
        parts = "/".join(f"d{i}" for i in range(depth))
        path = f"/workspace/tree/{parts}/leaf.bin"
        blob = Blob.random(1000 + depth, seed=depth)
        yield _task(family, f"api-depth-{depth}", f"upload {depth} directories deep (parents created); find sees it",
                    [Write(path, blob), Exec("find /workspace/tree -type f", (Stdout(equals=path + "\n"),)),
                     Read(path, (Data(equals=blob),))])
    yield _task(family, "command-mkdir-then-api", "mkdir -p inside, then upload into the new tree",
                [Exec("mkdir -p /workspace/proj/src/pkg/sub", (ExitCode(0),)),
                 Write("/workspace/proj/src/pkg/sub/mod.py", Blob.literal("X = 1\n")),
                 Exec("cd /workspace/proj/src && python3 -c 'from pkg.sub.mod import X; print(X)'",
                      (Stdout(equals="1\n"),))])
    files = {f"/workspace/site/{p}": Blob.literal(f"<p>{p}</p>\n") for p in
             ("index.html", "a/b.html", "a/c/d.html", "e/f/g/h.html")}
    yield _task(family, "api-many-dirs-ls-r", "upload four files into a tree; ls -R shows the whole tree",
                [*(Write(p, b) for p, b in files.items()),
                 Exec("cd /workspace/site && find . -type f | sort",
                      (Stdout(equals="./a/b.html\n./a/c/d.html\n./e/f/g/h.html\n./index.html\n"),))])
    yield _task(family, "unicode-dirs", "upload under Unicode directory names; read back",
                [Write("/workspace/données/报告/φ.txt", Blob.literal("φ\n")),
                 Read("/workspace/données/报告/φ.txt", (Data(equals=Blob.literal("φ\n"), mode="filename_mangled"),))])


def _overwrite() -> Iterator[Task]:
    family = "file_io.overwrite"
    long, short = Blob.random(MIB, seed=501), Blob.literal(b"short\x00")
    yield _task(family, "api-long-then-short", "overwrite a 1 MiB file with 6 bytes; nothing of the old remains",
                [Write("/workspace/f.bin", long), Write("/workspace/f.bin", short),
                 Read("/workspace/f.bin", (Data(equals=short),))], severity="critical")
    yield _task(family, "api-short-then-long", "overwrite 6 bytes with 1 MiB",
                [Write("/workspace/f.bin", short), Write("/workspace/f.bin", long),
                 Read("/workspace/f.bin", (Data(equals=long),))], severity="critical")
    yield _task(family, "api-then-empty", "overwrite a file with nothing",
                [Write("/workspace/f.bin", long), Write("/workspace/f.bin", Blob.literal(b"")),
                 Exec("stat -c %s /workspace/f.bin", (Stdout(equals="0\n"),)),
                 Read("/workspace/f.bin", (Data(equals=b""),))], severity="critical")
    yield _task(family, "command-then-api", "a command writes 100 KiB; the API overwrites it with 5 bytes",
                [Exec("head -c 102400 /dev/urandom > /workspace/g.bin", (ExitCode(0),)),
                 Write("/workspace/g.bin", Blob.literal(b"fresh")),
                 Exec("cat /workspace/g.bin", (Stdout(equals="fresh"),))], severity="critical")
    yield _task(family, "api-then-command", "the API writes a file; a command overwrites it; download the new bytes",
                [Write("/workspace/h.txt", Blob.literal("old content that is long\n")),
                 Exec("printf 'new\\n' > /workspace/h.txt", (ExitCode(0),)),
                 Read("/workspace/h.txt", (Data(equals="new\n"),))], severity="critical")
    yield _task(family, "command-sees-new-inode", "a process holding the old file open; the API replaces it",
                [Write("/workspace/i.txt", Blob.literal("v1\n")),
                 Exec("exec 3< /workspace/i.txt; sleep 0.2; cat /workspace/i.txt", (Stdout(equals="v1\n"),)),
                 Write("/workspace/i.txt", Blob.literal("v2\n")),
                 Exec("cat /workspace/i.txt", (Stdout(equals="v2\n", mode="lost_state"),))])


def _append() -> Iterator[Task]:
    family = "file_io.append"
    head, tail = Blob.literal(b"head\x00\xff\n"), b"tail\r\n"
    yield _task(family, "api-then-printf", "upload a file, append with printf >>, download the concatenation",
                [Write("/workspace/log.bin", head), Exec("printf 'tail\\r\\n' >> /workspace/log.bin", (ExitCode(0),)),
                 Read("/workspace/log.bin", (Data(equals=head.bytes() + tail),))], severity="critical")
    extra = Blob.random(65537, seed=601)
    yield _task(family, "stdin-cat-append", "append 64 KiB of binary stdin with cat >>",
                [Write("/workspace/log.bin", head), Exec("cat >> /workspace/log.bin", (ExitCode(0),), stdin=extra),
                 Read("/workspace/log.bin", (Data(equals=head.bytes() + extra.bytes()),))], severity="critical")
    text = "".join(f"{i}\n" for i in range(1, 501))
    yield _task(family, "loop-500-appends", "append 500 lines one echo at a time",
                [Exec("for i in $(seq 1 500); do echo $i >> /workspace/n.txt; done", (ExitCode(0),)),
                 Read("/workspace/n.txt", (Data(equals=text),))])
    yield _task(family, "python-append-mode", "Python appends binary records in 'ab' mode over three steps",
                [*(Exec(f"python3 -c \"open('/workspace/rec.bin','ab').write(bytes([{i}, 0, 255]))\"",
                        (ExitCode(0),)) for i in range(3)),
                 Read("/workspace/rec.bin",
                      (Data(equals=b"\x00\x00\xff\x01\x00\xff\x02\x00\xff", mode="lost_state"),))])
    yield _task(family, "append-after-api-overwrite", "append to a file right after the API replaced it",
                [Write("/workspace/a.txt", Blob.literal("first version\n")),
                 Write("/workspace/a.txt", Blob.literal("second\n")),
                 Exec("echo more >> /workspace/a.txt && cat /workspace/a.txt", (Stdout(equals="second\nmore\n"),))])


def _empty() -> Iterator[Task]:
    family = "file_io.empty"
    empty = Blob.literal(b"")
    yield _task(family, "api-roundtrip", "upload an empty file and download it",
                [Write("/workspace/e", empty), Read("/workspace/e", (Data(equals=b""),))])
    yield _task(family, "command-truncate", "a command empties a file (: >); the API reads 0 bytes",
                [Write("/workspace/e", Blob.literal("data")), Exec(": > /workspace/e", (ExitCode(0),)),
                 Read("/workspace/e", (Data(equals=b""),))])
    yield _task(family, "touch", "touch creates a file; the API reads 0 bytes",
                [Exec("touch /workspace/t", (ExitCode(0),)), Read("/workspace/t", (Data(equals=b""),))])
    yield _task(family, "no-output", "a command that prints nothing has empty stdout and stderr",
                [Exec("true", (ExitCode(0), Stdout(equals=b""), Stderr(equals=b"")))], severity="medium")
    yield _task(family, "empty-stdin", "empty stdin is an immediate EOF",
                [Exec("wc -c", (ExitCode(0), Stdout(matches=r"^0\n$", mode="stdin_lost")), stdin=empty, timeout=10)],
                severity="medium")
    yield _task(family, "setup-empty-file", "an empty setup file exists and is empty",
                [Exec("test -f /workspace/empty.txt && ! test -s /workspace/empty.txt && echo ok",
                      (Stdout(equals="ok\n"),))], setup=Setup(files=(("/workspace/empty.txt", empty),)))


def _invalid_utf8_output() -> Iterator[Task]:
    """Programs print what they like; invalid UTF-8 must come back byte for byte, never as an error."""
    family = "file_io.invalid_utf8_output"
    cases: dict[str, bytes] = {
        "ff-fe": b"\xff\xfe",
        "lone-continuation": b"abc\x80def",
        "overlong": b"\xc0\xaf\xe0\x80\xaf",
        "ends-mid-character": b"euro \xe2\x82",
        "wtf8-surrogate": b"\xed\xa0\x80",
        "latin1": b"caf\xe9\n",
        "mixed-valid-invalid": "ok ✓ ".encode() + b"\xff" + " end ✓\n".encode(),
        "nul-in-middle": b"a\x00b\n",
        "ansi-and-bell": b"\x1b[32mgreen\x1b[0m\x07\n",
    }
    for variant, data in cases.items():
        fmt = "".join(f"\\{b:03o}" for b in data)
        yield _task(family, f"stdout-{variant}", f"printf {data!r} to stdout; the bytes come back exactly",
                    [Exec(f"printf '{fmt}'", (Ok(mode="text_decoding_crash"), ExitCode(0), Stdout(equals=data)))],
                    severity="critical")
    for variant in ("ff-fe", "nul-in-middle", "overlong"):
        data = cases[variant]
        fmt = "".join(f"\\{b:03o}" for b in data)
        yield _task(family, f"stderr-{variant}", f"printf {data!r} to stderr; the bytes come back exactly",
                    [Exec(f"printf '{fmt}' >&2; exit 3", (Ok(mode="text_decoding_crash"), ExitCode(3),
                                                          Stderr(equals=data), Stdout(equals=b"")))],
                    severity="critical")
    # Valid UTF-8 whose multi-byte characters straddle every read boundary: a per-chunk decoder breaks them.
    for variant, char, count in (("euro-3-byte", "€", 700_001), ("emoji-4-byte", "🦀", 500_003)):
        expected = Blob.repeat(char.encode(), len(char.encode()) * count)
        yield _task(family, f"chunk-boundaries-{variant}", f"{count} x {char} across output chunks, byte exact",
                    [Exec(f"python3 -c \"import sys; sys.stdout.write('{char}' * {count})\"",
                          (Ok(mode="text_decoding_crash"), ExitCode(0), Stdout(equals=expected)))],
                    severity="critical")
    out, err = Blob.random(200_000, seed=701), Blob.random(150_000, seed=702)
    yield _task(family, "both-streams-random", "random bytes on stdout and stderr at once, interleaved",
                [Exec("python3 -c \"import random,sys\no,e=random.Random(701).randbytes(200000),"
                      "random.Random(702).randbytes(150000)\nfor i in range(0,200000,10000):\n"
                      " sys.stdout.buffer.write(o[i:i+10000]); sys.stdout.flush()\n"
                      " sys.stderr.buffer.write(e[i*3//4:(i+10000)*3//4]); sys.stderr.flush()\"",
                      (Ok(mode="text_decoding_crash"), ExitCode(0), Stdout(equals=out), Stderr(equals=err)))],
                severity="critical")
    yield _task(family, "code-cell-python-bytes", "a Python cell writes invalid UTF-8 to sys.stdout.buffer",
                [Code("import sys\nsys.stdout.buffer.write(b'\\xff\\x00\\xfe ok\\n'); sys.stdout.flush()",
                      (Ok(mode="text_decoding_crash"), Stdout(equals=b"\xff\x00\xfe ok\n")))],
                severity="critical")
    yield _task(family, "code-cell-bash-bytes", "a bash cell prints invalid UTF-8",
                [Code("printf '\\377\\376\\000end\\n'", (Ok(mode="text_decoding_crash"),
                                                         Stdout(equals=b"\xff\xfe\x00end\n")), language="bash")],
                severity="critical")


def _large_output() -> Iterator[Task]:
    family = "file_io.large_output"
    within: list[tuple[str, str, Blob]] = [
        ("stdout-1MiB-zeros", "head -c 1048576 /dev/zero", Blob.repeat(b"\x00", MIB)),
        ("stdout-8MiB-random", "python3 -c 'import random,sys; sys.stdout.buffer.write(random.Random(801)"
                               ".randbytes(8388608))'", Blob.random(8 * MIB, seed=801)),
        ("stdout-15MiB-lines", "yes 'output line' | head -c 15728640", Blob.repeat(b"output line\n", 15 * MIB)),
        ("stdout-exactly-16MiB", "yes 'at the cap' | head -c 16777216", Blob.repeat(b"at the cap\n", CAP)),
        ("stdout-4MiB-one-line", "head -c 4194304 /dev/zero | tr '\\0' 'z'", Blob.repeat(b"z", 4 * MIB)),
    ]
    for variant, cmd, blob in within:
        yield _task(family, variant, f"{blob.size} bytes of stdout (within the cap) come back exactly",
                    [Exec(cmd, (Ok(mode="large_transfer_failed"), ExitCode(0), Stdout(equals=blob)), timeout=60)],
                    severity="critical", budget=_sized_budget(blob.size))
    err = Blob.repeat(b"warning: something\n", 8 * MIB)
    yield _task(family, "stderr-8MiB", "8 MiB of stderr come back exactly",
                [Exec("yes 'warning: something' | head -c 8388608 >&2",
                      (ExitCode(0), Stderr(equals=err), Stdout(equals=b"")), timeout=60)],
                severity="critical", budget=90)
    both = Blob.repeat(b"o", 6 * MIB)
    yield _task(family, "both-streams-6MiB", "6 MiB on each stream at once: no deadlock, both exact",
                [Exec("python3 -c \"import sys\nfor _ in range(96):\n sys.stdout.buffer.write(b'o'*65536);"
                      " sys.stderr.buffer.write(b'e'*65536)\"",
                      (Ok(mode="hang"), ExitCode(0), Stdout(equals=both), Stderr(equals=Blob.repeat(b"e", 6 * MIB))),
                      timeout=60)], severity="critical", budget=90)
    lines = "".join(f"line {i}\n" for i in range(50_000))
    yield _task(family, "many-flushed-lines", "50,000 separately flushed lines arrive complete and in order",
                [Exec("python3 -u -c \"\nfor i in range(50000): print(f'line {i}', flush=True)\"",
                      (ExitCode(0), Stdout(equals=lines)), timeout=60)], severity="critical", budget=90)
    for variant, size in (("over-cap-16MiB+1", CAP + 1), ("over-cap-20MiB", 20 * MIB), ("over-cap-64MiB", 64 * MIB)):
        yield _task(family, variant, f"{size} bytes of stdout: cut at the cap, flagged, true size kept",
                    [Exec(f"head -c {size} /dev/zero", (Ok(mode="large_transfer_failed"), ExitCode(0),
                                                        Truncated(size=size)), timeout=60)],
                    severity="high", budget=120)
    seq = "".join(f"{i}\n" for i in range(1, 3_000_001))
    yield _task(family, "over-cap-keeps-head-and-tail", "20 MB of numbered lines: the first and last lines are kept",
                [Exec("seq 1 3000000", (ExitCode(0), Truncated(size=len(seq)),
                                        Stdout(matches=r"\A1\n2\n3\n4\n5\n"),
                                        Stdout(matches=r"\n2999999\n3000000\n\Z")), timeout=60)],
                severity="high", budget=120)


def _exit_codes() -> Iterator[Task]:
    family = "file_io.exit_codes"
    for code in (0, 1, 2, 42, 128, 200, 255):
        yield _task(family, f"exit-{code}", f"a command exits {code}; the status comes back",
                    [Exec(f"echo before; exit {code}", (ExitCode(code), Stdout(equals="before\n")))], severity="medium")
    for variant, cmd, code, extra in (
        ("exit-256-wraps", "exit 256", 0, ()),
        ("exit-300-wraps", "exit 300", 44, ()),
        ("false", "false", 1, ()),
        ("command-not-found", "no-such-command-xyz", 127, (Stderr(contains="not found"),)),
        ("not-executable", "printf 'echo hi' > s.sh && ./s.sh", 126, (Stderr(contains="Permission denied"),)),
        ("python-sys-exit", "python3 -c 'import sys; sys.exit(5)'", 5, ()),
        ("python-exception", "python3 -c 'raise ValueError(\"boom\")'", 1, (Stderr(contains="ValueError: boom"),)),
        ("node-process-exit", "node -e 'process.exit(9)'", 9, ()),
        ("node-uncaught", "node -e 'throw new Error(\"kaboom\")'", 1, (Stderr(contains="kaboom"),)),
        ("set-e", "set -e; false; echo unreachable", 1, (Stdout(absent="unreachable"),)),
        ("pipeline-last-wins", "false | true", 0, ()),
        ("pipefail", "set -o pipefail; false | true", 1, ()),
        ("subshell-status", "(exit 17); echo \"sub=$?\"", 0, (Stdout(equals="sub=17\n"),)),
        ("child-killed-reported-by-parent", "sh -c 'kill -9 $$'; echo \"child=$?\"", 0,
         (Stdout(equals="child=137\n"),)),
    ):
        yield _task(family, variant, f"{cmd!r} ends with status {code}", [Exec(cmd, (ExitCode(code), *extra))],
                    severity="medium")
    yield _task(family, "argv-exit-code", "an argv command's exit status comes back",
                [Exec(("python3", "-c", "import sys; print('x'); sys.exit(77)"), (ExitCode(77), Stdout(equals="x\n")))],
                severity="medium")
    # Signals: the shell running the command is killed by one; the status is 128 + its number.
    for variant, cmd, code in (
        ("kill-9-self", "echo alive; kill -9 $$", 137),
        ("kill-term-self", "echo alive; kill -TERM $$", 143),
        ("kill-hup-self", "echo alive; kill -HUP $$", 129),
        ("kill-segv-self", "echo alive; kill -SEGV $$", 139),
        ("kill-usr1-self", "echo alive; kill -USR1 $$", 138),
        ("python-abort", "echo alive; exec python3 -c 'import os; os.abort()'", 134),
    ):
        yield _task(family, f"signal-{variant}", f"{cmd!r}: the signal's status {code} comes back, output kept",
                    [Exec(cmd, (ExitCode(code), Stdout(equals="alive\n")))], severity="medium")
    yield _task(family, "signal-argv-kill-9", "an argv process that SIGKILLs itself reports 137",
                [Exec(("python3", "-c", "import os; os.kill(os.getpid(), 9)"), (ExitCode(137),))], severity="medium")


def _cwd_env() -> Iterator[Task]:
    family = "file_io.cwd_env"
    yield _task(family, "default-cwd", "commands start in /workspace", [Exec("pwd", (Stdout(equals="/workspace\n"),))],
                severity="medium")
    for cwd in ("/tmp", "/home/user", "/workspace/sub dir/ünï"):
        yield _task(family, f"cwd-{cwd.strip('/').replace('/', '-').replace(' ', '_')}", f"run a command in {cwd}",
                    [Exec(f"mkdir -p '{cwd}'", (ExitCode(0),)), Exec("pwd", (Stdout(equals=f"{cwd}\n"),), cwd=cwd),
                     Exec(("pwd",), (Stdout(equals=f"{cwd}\n"),), cwd=cwd)], severity="medium")
    yield _task(family, "cwd-missing", "a cwd that does not exist is a clear error, not a 500",
                [Exec("pwd", (Fails(code=("invalid_request", "not_found"), matches="/workspace/nope",
                                    mode="unclear_error"),), cwd="/workspace/nope")], severity="medium")
    values = {
        "plain": "bar",
        "spaces": "two  spaces and\ttab",
        "quotes": "it's \"quoted\" $HOME `id`",
        "newlines": "line1\nline2\n",
        "unicode": "日本語 🦀 ñ",
        "equals": "a=b=c",
        "empty": "",
        "long-64KiB": "v" * 65536,
    }
    for variant, value in values.items():
        yield _task(family, f"env-{variant}", "an environment variable reaches the command exactly",
                    [Exec("printf '%s|%s' \"${MYVAR+set}\" \"$MYVAR\"", (Stdout(equals=f"set|{value}"),),
                          env={"MYVAR": value})], severity="medium")
    yield _task(family, "setup-env", "the sandbox's env is in every command; a command's env overrides it",
                [Exec("echo \"$APP_MODE $APP_LEVEL\"", (Stdout(equals="prod 1\n"),)),
                 Exec("echo \"$APP_MODE $APP_LEVEL\"", (Stdout(equals="debug 1\n"),), env={"APP_MODE": "debug"}),
                 Exec("echo \"$APP_MODE\"", (Stdout(equals="prod\n", mode="lost_state"),))],
                setup=Setup(env={"APP_MODE": "prod", "APP_LEVEL": "1"}), severity="medium")
    yield _task(family, "env-not-sticky", "a command's env does not leak into the next command",
                [Exec("echo \"$ONCE\"", (Stdout(equals="only here\n"),), env={"ONCE": "only here"}),
                 Exec("echo \"${ONCE:-unset}\"", (Stdout(equals="unset\n"),))], severity="medium")
    yield _task(family, "user-and-home", "commands run as the sandbox user with its home",
                [Exec("echo \"$(id -u) $(id -un) $HOME\"", (Stdout(equals="1000 user /home/user\n"),))],
                severity="medium")
    yield _task(family, "env-python-sees", "Python sees a variable given to the command",
                [Exec(("python3", "-c", "import os; print(os.environ['DATA_DIR'])"),
                      (Stdout(equals="/workspace/data\n"),), env={"DATA_DIR": "/workspace/data"})], severity="medium")


def _state_across_steps() -> Iterator[Task]:
    family = "file_io.state_across_steps"

    def noise(i: int) -> Exec:
        return Exec(f"echo step {i}", (Stdout(equals=f"step {i}\n"),))

    blob = Blob.random(100_000, seed=901)
    lost: tuple[Check, ...] = (Data(equals=blob, mode="lost_state"),)
    yield _task(family, "api-file", "a file uploaded in step 1 is still there in step 3",
                [Write("/workspace/keep.bin", blob), noise(2), Read("/workspace/keep.bin", lost)])
    yield _task(family, "command-file", "a file a command wrote in step 1 is read by a command in step 3",
                [Exec("echo persisted > /workspace/p.txt", (ExitCode(0),)), noise(2),
                 Exec("cat /workspace/p.txt", (Stdout(equals="persisted\n", mode="lost_state"),))])
    yield _task(family, "tmp-file", "a file in /tmp survives between commands",
                [Exec("echo in-tmp > /tmp/t.txt", (ExitCode(0),)), noise(2),
                 Read("/tmp/t.txt", (Data(equals="in-tmp\n", mode="lost_state"),))])
    yield _task(family, "home-config", "a config file in ~/.config survives between commands",
                [Exec("mkdir -p ~/.config/app && echo 'key=1' > ~/.config/app/rc", (ExitCode(0),)), noise(2),
                 Read("/home/user/.config/app/rc", (Data(equals="key=1\n", mode="lost_state"),))])
    yield _task(family, "executable-script", "a script uploaded and chmod +x'd runs in a later step",
                [Write("/workspace/run.sh", Blob.literal("#!/bin/bash\necho \"ran with $1\"\n")),
                 Exec("chmod +x /workspace/run.sh", (ExitCode(0),)), noise(3),
                 Exec("./run.sh arg", (Stdout(equals="ran with arg\n", mode="lost_state"),))])
    yield _task(family, "symlink", "a symlink made in step 1 still resolves in step 3",
                [Exec("echo target > real.txt && ln -s real.txt alias.txt", (ExitCode(0),)), noise(2),
                 Exec("readlink alias.txt && cat alias.txt",
                      (Stdout(equals="real.txt\ntarget\n", mode="lost_state"),))])
    yield _task(family, "bash-profile-export", "a variable exported from ~/.bash_profile is in later login shells",
                [Exec("echo 'export PROJECT_ROOT=/workspace/proj' >> ~/.bash_profile", (ExitCode(0),)), noise(2),
                 Exec("echo \"$PROJECT_ROOT\"", (Stdout(equals="/workspace/proj\n", mode="lost_state"),))],
                severity="medium")
    yield _task(family, "hundred-files", "100 files made in step 1 are all there in step 3",
                [Exec("mkdir many && for i in $(seq 1 100); do echo $i > many/f$i; done", (ExitCode(0),)), noise(2),
                 Exec("ls many | wc -l && cat many/f100", (Stdout(equals="100\n100\n", mode="lost_state"),))])
    yield _task(family, "git-repo", "a git commit made in step 1 is in the log in step 3",
                [Exec("git init -q repo && cd repo && echo x > f && git add f && "
                      "git -c user.name=a -c user.email=a@b.c commit -qm first", (ExitCode(0),)), noise(2),
                 Exec("cd repo && git log --format=%s", (Stdout(equals="first\n", mode="lost_state"),))])
    yield _task(family, "code-cell-file-to-command", "a Python cell writes a file; a command reads it",
                [Code("open('/workspace/from_cell.txt', 'w').write('from a cell\\n')", (Ok(),)), noise(2),
                 Exec("cat /workspace/from_cell.txt", (Stdout(equals="from a cell\n", mode="lost_state"),))])
    steps: list[Step] = [Exec(f"echo {i} >> /workspace/steps.txt", (ExitCode(0),)) for i in range(1, 9)]
    yield _task(family, "eight-appends", "eight commands each append a line; all eight are there",
                [*steps, Read("/workspace/steps.txt", (Data(equals="".join(f"{i}\n" for i in range(1, 9)),
                                                            mode="lost_state"),))])
    yield _task(family, "api-write-overwrites-between-reads", "the API rewrites a file between two commands",
                [Write("/workspace/v.txt", Blob.literal("one\n")), Exec("cat v.txt", (Stdout(equals="one\n"),)),
                 Write("/workspace/v.txt", Blob.literal("two\n")),
                 Exec("cat v.txt", (Stdout(equals="two\n", mode="lost_state"),))])

