"""A toy POSIX shell for the fake agent (tests/fake_agent.py): the commands front-end tests send, run in Python
over a `FakeFs`, a sandbox file system kept in a temp directory. No host process is started and no host path
outside that directory is read or written: every path, symlinks included, is resolved inside the root.

Grammar: words with '...' and "..." quoting, backslash escapes, `$VAR` / `${VAR}` / `$?`; `;`, `&&`, `||`,
`|`, redirections `>`, `>>`, `<`, `2>`, `>&2`, `2>&1`; `VAR=value` prefixes; `sh -c` / `bash -c` / `bash -lc`, and
`bash` / `sh` alone reading commands from stdin (line by line, with a `$ ` prompt on a terminal).
Builtins: echo, printf, cat, exit, true, false, sleep, pwd, cd, id, whoami, wc, sha256sum, ls, mkdir, touch,
rm, ln, find, sort, head, env, export, stty (`size`, on a terminal), and `python3 -m http.server [PORT]
[--bind ADDR] [--directory DIR]` (a server on the fake agent's ports, tests/fake_ports.py). Anything else is
`command not found` (127), as in bash.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import posixpath
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FakeFs", "Io", "Shell", "ShellExit", "is_interactive_shell"]

SHELLS = ("sh", "bash", "dash")


def is_interactive_shell(argv: list[str]) -> bool:
    """`bash`, `/bin/sh -l`, `bash -i`: a shell that reads its commands from its input."""
    return posixpath.basename(argv[0]) in SHELLS and all(a in ("-i", "-l", "--login") for a in argv[1:])

Write = Callable[[bytes], Awaitable[None]]


class FsError(OSError):
    """An errno-carrying error about a sandbox path (the real agent's codes come from its errno)."""


class FakeFs:
    """Sandbox paths mapped into `root`, symlinks followed by their sandbox text (never the host's)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.placed: set[int] = set()  # inodes of files renamed into place whole (tests/fake_watch.py)
        for d in ("workspace", "tmp", "home/user", "etc", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n")
        (root / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")

    def host(self, path: str, *, follow: bool = True) -> Path:
        """The host path of the sandbox path `path` (absolute), resolving symlinks inside the root."""
        parts = [p for p in posixpath.normpath(path).split("/") if p]
        done: list[str] = []
        hops = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if done:
                    done.pop()
                continue
            candidate = self.root.joinpath(*done, name)
            if candidate.is_symlink() and (follow or parts):
                hops += 1
                if hops > 40:
                    raise FsError(40, os.strerror(40), path)  # ELOOP
                target = os.readlink(candidate)
                if target.startswith("/"):
                    done = []
                parts = [p for p in target.split("/") if p and p != "."] + parts
                continue
            done.append(name)
        return self.root.joinpath(*done)

    def sandbox_path(self, host: Path) -> str:
        return "/" + str(host.relative_to(self.root)) if host != self.root else "/"


@dataclass
class Io:
    """One command's streams: stdin bytes (None: read from the process's live stdin), stdout and stderr writers."""

    stdin: Callable[[], Awaitable[bytes]]
    out: Write
    err: Write


class ShellExit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@dataclass
class Shell:
    fs: FakeFs
    env: dict[str, str]
    cwd: str = "/workspace"
    status: int = 0
    user: str = "user"
    ids: dict[str, str] = field(default_factory=lambda: {"user": "uid=1000(user) gid=1000(user) groups=1000(user)",
                                                          "root": "uid=0(root) gid=0(root) groups=0(root)"})
    terminal: list[int] | None = None  # [rows, cols] when the process has a PTY
    ports: dict[int, Any] | None = None  # the fake agent's listeners, for `python3 -m http.server`

    async def repl(self, io: Io) -> int:
        """Commands from stdin, each line run as it arrives, until EOF or `exit` (a prompt on a terminal)."""
        pending = b""
        while True:
            if self.terminal is not None:
                await io.out(b"$ ")
            while b"\n" not in pending:
                chunk = await io.stdin()
                if not chunk:
                    if pending.strip():
                        await self.run_script(pending.decode(errors="replace"), io)
                    return self.status
                pending += chunk
            line, pending = pending.split(b"\n", 1)
            try:
                for pipeline_chain in _split(tokenize(line.decode(errors="replace"), self)):
                    await self._chain(pipeline_chain, io)
            except ShellExit as exc:
                self.status = exc.code
                return self.status

    async def run_argv(self, argv: list[str], io: Io) -> int:
        try:
            self.status = await self._command(list(argv), io)
        except ShellExit as exc:
            self.status = exc.code
        return self.status

    async def run_script(self, script: str, io: Io) -> int:
        try:
            for pipeline_chain in _split(tokenize(script, self)):
                await self._chain(pipeline_chain, io)
        except ShellExit as exc:
            self.status = exc.code
        return self.status

    # -- structure -----------------------------------------------------------------------------------------

    async def _chain(self, chain: list[object], io: Io) -> None:
        """`a && b || c`: each pipeline run or skipped by the status before it."""
        run = True
        for item in chain:
            if item == "&&":
                run = self.status == 0
            elif item == "||":
                run = self.status != 0
            elif run:
                assert isinstance(item, list)
                self.status = await self._pipeline(item, io)

    async def _pipeline(self, stages: list[list[str | tuple[str]]], io: Io) -> int:
        data: bytes | None = None
        status = 0
        for i, words in enumerate(stages):
            last = i == len(stages) - 1
            captured = bytearray()

            async def into(b: bytes, buf: bytearray = captured) -> None:
                buf += b

            stage_in = io.stdin if data is None else _const(data)
            stage_io = Io(stage_in, io.out if last else into, io.err)
            status = await self._simple(words, stage_io)
            data = bytes(captured)
        return status

    async def _simple(self, words: list[str | tuple[str]], io: Io) -> int:
        argv: list[str] = []
        assigns: dict[str, str] = {}
        it = iter(words)
        for w in it:
            if isinstance(w, tuple):  # an operator: a redirection
                op = w[0]
                if op in (">&2", "1>&2"):
                    io = Io(io.stdin, io.err, io.err)
                elif op == "2>&1":
                    io = Io(io.stdin, io.out, io.out)
                elif op in (">", ">>", "2>", "2>>", "<"):
                    target = next(it, None)
                    if not isinstance(target, str):
                        await io.err(b"sh: syntax error near unexpected token `newline'\n")
                        return 2
                    io = await self._redirect(op, target, io)
                continue
            if not argv and "=" in w and w.split("=", 1)[0].isidentifier():
                name, value = w.split("=", 1)
                assigns[name] = value
                continue
            argv.append(w)
        if not argv:
            self.env.update(assigns)
            return 0
        saved = dict(self.env)
        self.env.update(assigns)
        try:
            return await self._command(argv, io)
        finally:
            if argv[0] not in ("export", "cd"):
                self.env.clear()
                self.env.update(saved)

    async def _redirect(self, op: str, target: str, io: Io) -> Io:
        if target == "/dev/null":
            async def drop(_: bytes) -> None:
                return None
            return Io(io.stdin, drop if op in (">", ">>") else io.out, drop if op.startswith("2") else io.err)
        host = self.fs.host(self._abs(target))
        if op == "<":
            return Io(_const(host.read_bytes()), io.out, io.err)
        if op in (">", "2>"):
            host.write_bytes(b"")

        async def append(b: bytes) -> None:
            with host.open("ab") as f:
                f.write(b)

        return Io(io.stdin, io.out if op.startswith("2") else append, append if op.startswith("2") else io.err)

    def _abs(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.cwd, path))

    # -- commands ------------------------------------------------------------------------------------------

    async def _command(self, argv: list[str], io: Io) -> int:
        name = posixpath.basename(argv[0])
        script = _script_of(argv) if name in SHELLS else None
        if script is not None:
            sub = Shell(self.fs, dict(self.env), self.cwd, user=self.user, terminal=self.terminal, ports=self.ports)
            return await sub.run_script(script, io)
        if is_interactive_shell(argv):
            sub = Shell(self.fs, dict(self.env), self.cwd, user=self.user, terminal=self.terminal, ports=self.ports)
            return await sub.repl(io)
        handler = getattr(self, "c_" + name.replace("-", "_"), None)
        if handler is None:
            await io.err(f"bash: line 1: {argv[0]}: command not found\n".encode())
            return 127
        try:
            result: int = await handler(argv[1:], io)
            return result
        except FileNotFoundError as exc:
            await io.err(f"{name}: {exc.filename and self._shown(str(exc.filename))}: No such file or directory\n"
                         .encode())
            return 1
        except OSError as exc:
            await io.err(f"{name}: {exc.strerror}\n".encode())
            return 1

    def _shown(self, host: str) -> str:
        try:
            return self.fs.sandbox_path(Path(host))
        except ValueError:
            return host

    async def c_true(self, args: list[str], io: Io) -> int:
        return 0

    async def c_false(self, args: list[str], io: Io) -> int:
        return 1

    async def c_exit(self, args: list[str], io: Io) -> int:
        raise ShellExit(int(args[0]) & 0xFF if args else self.status)

    async def c_echo(self, args: list[str], io: Io) -> int:
        newline = True
        if args and args[0] == "-n":
            newline, args = False, args[1:]
        await io.out((" ".join(args) + ("\n" if newline else "")).encode())
        return 0

    async def c_printf(self, args: list[str], io: Io) -> int:
        if not args:
            return 1
        fmt, rest = args[0], args[1:]
        text = fmt.replace("%s", "{}").format(*rest) if "%s" in fmt else fmt
        await io.out(_escapes(text))
        return 0

    async def c_cat(self, args: list[str], io: Io) -> int:
        if not args or args == ["-"]:
            while chunk := await io.stdin():
                await io.out(chunk)
            return 0
        status = 0
        for a in args:
            host = self.fs.host(self._abs(a))
            if host.is_dir():
                await io.err(f"cat: {a}: Is a directory\n".encode())
                status = 1
                continue
            if not host.exists():
                await io.err(f"cat: {a}: No such file or directory\n".encode())
                status = 1
                continue
            await io.out(host.read_bytes())
        return status

    async def c_sleep(self, args: list[str], io: Io) -> int:
        await asyncio.sleep(float(args[0]) if args else 0)
        return 0

    async def c_stty(self, args: list[str], io: Io) -> int:
        if self.terminal is None:
            await io.err(b"stty: 'standard input': Inappropriate ioctl for device\n")
            return 1
        if args == ["size"]:
            await io.out(f"{self.terminal[0]} {self.terminal[1]}\n".encode())
        return 0

    async def c_python3(self, args: list[str], io: Io) -> int:
        if args[:2] != ["-m", "http.server"] or self.ports is None:
            await io.err(b"python3: the fake shell runs only `python3 -m http.server`\n")
            return 127
        from .fake_ports import serve_http

        return await serve_http(self, args[2:], io)

    async def c_pwd(self, args: list[str], io: Io) -> int:
        await io.out(self.cwd.encode() + b"\n")
        return 0

    async def c_cd(self, args: list[str], io: Io) -> int:
        target = self._abs(args[0]) if args else self.env.get("HOME", "/")
        if not self.fs.host(target).is_dir():
            await io.err(f"cd: {args[0] if args else target}: No such file or directory\n".encode())
            return 1
        self.cwd = target
        return 0

    async def c_id(self, args: list[str], io: Io) -> int:
        if args == ["-u"]:
            await io.out(b"0\n" if self.user == "root" else b"1000\n")
        else:
            await io.out(self.ids[self.user].encode() + b"\n")
        return 0

    async def c_whoami(self, args: list[str], io: Io) -> int:
        await io.out(self.user.encode() + b"\n")
        return 0

    async def c_env(self, args: list[str], io: Io) -> int:
        await io.out("".join(f"{k}={v}\n" for k, v in sorted(self.env.items())).encode())
        return 0

    async def c_export(self, args: list[str], io: Io) -> int:
        for a in args:
            if "=" in a:
                k, v = a.split("=", 1)
                self.env[k] = v
        return 0

    async def _inputs(self, args: list[str], io: Io) -> list[tuple[str, bytes]]:
        if not args:
            data = bytearray()
            while chunk := await io.stdin():
                data += chunk
            return [("-", bytes(data))]
        return [(a, self.fs.host(self._abs(a)).read_bytes()) for a in args]

    async def c_wc(self, args: list[str], io: Io) -> int:
        flags = [a for a in args if a.startswith("-")]
        files = [a for a in args if not a.startswith("-")]
        for name, data in await self._inputs(files, io):
            count = len(data) if "-c" in flags else data.count(b"\n") if "-l" in flags else len(data)
            await io.out(f"{count}\n".encode() if name == "-" else f"{count} {name}\n".encode())
        return 0

    async def c_sha256sum(self, args: list[str], io: Io) -> int:
        for name, data in await self._inputs(args, io):
            await io.out(f"{hashlib.sha256(data).hexdigest()}  {name}\n".encode())
        return 0

    async def c_head(self, args: list[str], io: Io) -> int:
        count = int(args[1]) if len(args) >= 2 and args[0] == "-c" else None
        files = args[2:] if count is not None else args
        for _, data in await self._inputs(files, io):
            await io.out(data[:count] if count is not None else b"".join(data.splitlines(True)[:10]))
        return 0

    async def c_sort(self, args: list[str], io: Io) -> int:
        for _, data in await self._inputs(args, io):
            await io.out(b"".join(sorted(data.splitlines(True))))
        return 0

    async def c_ls(self, args: list[str], io: Io) -> int:
        show_all = any(a.startswith("-") and ("a" in a or "A" in a) for a in args)
        paths = [a for a in args if not a.startswith("-")] or ["."]
        status = 0
        for p in paths:
            host = self.fs.host(self._abs(p))
            if not host.exists() and not host.is_symlink():
                await io.err(f"ls: cannot access '{p}': No such file or directory\n".encode())
                status = 2
            elif host.is_dir():
                names = sorted(n for n in os.listdir(host) if show_all or not n.startswith("."))
                await io.out("".join(n + "\n" for n in names).encode())
            else:
                await io.out(p.encode() + b"\n")
        return status

    async def c_mkdir(self, args: list[str], io: Io) -> int:
        parents = "-p" in args
        for a in (a for a in args if not a.startswith("-")):
            self.fs.host(self._abs(a)).mkdir(parents=parents, exist_ok=parents)
        return 0

    async def c_touch(self, args: list[str], io: Io) -> int:
        for a in args:
            self.fs.host(self._abs(a)).touch()
        return 0

    async def c_rm(self, args: list[str], io: Io) -> int:
        import shutil

        force = any(a.startswith("-") and "f" in a for a in args)
        for a in (a for a in args if not a.startswith("-")):
            host = self.fs.host(self._abs(a), follow=False)
            if host.is_dir() and not host.is_symlink():
                shutil.rmtree(host)
            elif host.exists() or host.is_symlink():
                host.unlink()
            elif not force:
                await io.err(f"rm: cannot remove '{a}': No such file or directory\n".encode())
                return 1
        return 0

    async def c_ln(self, args: list[str], io: Io) -> int:
        rest = [a for a in args if not a.startswith("-")]
        if "-s" not in args or len(rest) != 2:
            await io.err(b"ln: the fake shell makes symbolic links only (ln -s TARGET LINK)\n")
            return 1
        os.symlink(rest[0], self.fs.host(self._abs(rest[1]), follow=False))
        return 0

    async def c_find(self, args: list[str], io: Io) -> int:
        top = args[0] if args and not args[0].startswith("-") else "."
        only = args[args.index("-type") + 1] if "-type" in args else None
        host_top = self.fs.host(self._abs(top))
        found = [top]
        for dirpath, dirnames, filenames in os.walk(host_top):
            for n in dirnames + filenames:
                full = Path(dirpath) / n
                kind = "d" if full.is_dir() and not full.is_symlink() else "l" if full.is_symlink() else "f"
                if only is None or only == kind:
                    found.append(posixpath.join(top, str(full.relative_to(host_top))))
        if only not in (None, "d"):
            found = found[1:]
        await io.out("".join(f + "\n" for f in found).encode())
        return 0

    async def c_stat(self, args: list[str], io: Io) -> int:
        for a in (a for a in args if not a.startswith("-")):
            st = self.fs.host(self._abs(a)).stat()
            await io.out(f"{stat.filemode(st.st_mode)} {st.st_size} {a}\n".encode())
        return 0


def _script_of(argv: list[str]) -> str | None:
    """The script of `bash -c S`, `bash -l -c S`, `sh -ec S`: options before it, one of them with a `c`."""
    for i, arg in enumerate(argv[1:], 1):
        if not arg.startswith("-"):
            return None
        if "c" in arg[1:] and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _const(data: bytes) -> Callable[[], Awaitable[bytes]]:
    pending = [data]

    async def read() -> bytes:
        return pending.pop() if pending else b""

    return read


def _escapes(text: str) -> bytes:
    out = bytearray()
    i = 0
    simple = {"n": b"\n", "t": b"\t", "\\": b"\\", "0": b"\0", "r": b"\r"}
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in simple:
            out += simple[text[i + 1]]
            i += 2
        else:
            out += text[i].encode()
            i += 1
    return bytes(out)


_OPERATORS = ("2>&1", "1>&2", ">&2", "2>>", "&&", "||", ">>", "2>", ";", "|", ">", "<", "\n")


def tokenize(script: str, shell: Shell) -> list[str | tuple[str]]:
    """Words (quotes removed, variables expanded) and operators (1-tuples)."""
    tokens: list[str | tuple[str]] = []
    word: list[str] = []
    in_word = False
    i = 0

    def var(j: int) -> tuple[str, int]:
        if script[j] == "?":
            return str(shell.status), j + 1
        if script[j] == "{":
            end = script.index("}", j)
            return shell.env.get(script[j + 1 : end], ""), end + 1
        k = j
        while k < len(script) and (script[k].isalnum() or script[k] == "_"):
            k += 1
        if k == j:
            return "$", j
        return shell.env.get(script[j:k], ""), k

    while i < len(script):
        c = script[i]
        op = next((o for o in _OPERATORS if script.startswith(o, i)), None)
        if op is not None and not (op[0] == "2" and in_word):
            if in_word:
                tokens.append("".join(word))
                word, in_word = [], False
            tokens.append((";",) if op == "\n" else (op,))
            i += len(op)
        elif c in " \t":
            if in_word:
                tokens.append("".join(word))
                word, in_word = [], False
            i += 1
        elif c == "#" and not in_word:
            while i < len(script) and script[i] != "\n":
                i += 1
        elif c == "'":
            end = script.index("'", i + 1)
            word.append(script[i + 1 : end])
            in_word, i = True, end + 1
        elif c == '"':
            i += 1
            in_word = True
            while script[i] != '"':
                if script[i] == "\\" and script[i + 1] in '"\\$`':
                    word.append(script[i + 1])
                    i += 2
                elif script[i] == "$":
                    value, i = var(i + 1)
                    word.append(value)
                else:
                    word.append(script[i])
                    i += 1
            i += 1
        elif c == "\\" and i + 1 < len(script):
            word.append(script[i + 1])
            in_word, i = True, i + 2
        elif c == "$" and i + 1 < len(script):
            value, i = var(i + 1)
            word.append(value)
            in_word = True
        else:
            word.append(c)
            in_word, i = True, i + 1
    if in_word:
        tokens.append("".join(word))
    return tokens


def _split(tokens: list[str | tuple[str]]) -> list[list[object]]:
    """Tokens -> lists (split at `;`) of pipelines (lists of simple commands) joined by `&&` / `||`."""
    chains: list[list[object]] = [[]]
    stages: list[list[str | tuple[str]]] = [[]]
    for t in tokens:
        if t in ((";",), ("&&",), ("||",)):
            if any(stages):
                chains[-1].append(stages)
            stages = [[]]
            if t == (";",):
                chains.append([])
            else:
                chains[-1].append(t[0])
        elif t == ("|",):
            stages.append([])
        else:
            stages[-1].append(t)
    if any(stages):
        chains[-1].append(stages)
    return [c for c in chains if c]
