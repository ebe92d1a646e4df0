"""`sudo` in a sandbox created with root: a client of the agent, which runs the command as root for it.

`noNewPrivileges` (kept in every sandbox) makes setuid binaries useless, so the real `sudo` cannot work. This
program, installed as /usr/local/bin/sudo in root sandboxes only, parses what agents type (`sudo cmd args`, `-E`,
`-u root`, `-i`, `-s`, `-n`, `-S`, `-H`, `-D dir`, `-b`, `VAR=value`, `--`), builds the command's environment
as sudo's default `env_reset` would, and asks the agent over a Unix socket of the sandbox (`SOCKET`) to run it,
handing over its stdin, stdout and stderr (SCM_RIGHTS): the command reads and writes them directly. It relays
the signals it gets to the command and exits with its status (a command killed by a signal kills it the same
way). If it goes away (its caller's timeout killed it), the agent kills the command's tree.

Every user of a root sandbox may use it, as E2B's base image gives its user passwordless sudo: there is no
password, and `-n` changes nothing. Standard library only; run as `python3 -SIB` by the installed script.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # `signal` builds enums on import: ~12 ms
import _socket
import os
import struct
import sys

from . import protocol

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

SOCKET = b"\0corral/sudo"  # abstract: in the sandbox's own network namespace, never a file anyone could replace
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What sudo's env_reset keeps of the caller's environment (its defaults), and Corral's egress settings: without
# them `sudo apt-get`, `sudo pip` and `sudo curl` could not reach the egress proxy, the sandbox's only way out.
KEEP = frozenset({
    "COLORS", "DISPLAY", "HOSTNAME", "KRB5CCNAME", "LS_COLORS", "PS1", "PS2", "TZ", "XAUTHORITY", "XAUTHORIZATION",
    "XDG_CURRENT_DESKTOP", "TERM", "LANG", "LANGUAGE", "LINGUAS", "COLUMNS", "LINES",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "PIP_INDEX_URL", "npm_config_registry", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT",
})
USERS = {"root": ("root", "/root"), "0": ("root", "/root"), "#0": ("root", "/root"),
         "user": ("user", "/home/user"), "1000": ("user", "/home/user"), "#1000": ("user", "/home/user")}
RELAYED = (1, 2, 3, 10, 12, 14, 15, 28)  # HUP INT QUIT USR1 USR2 ALRM TERM WINCH
NO_ROOT = ("sudo: this sandbox has no root: Corral's sudo asks the sandbox's agent to run the command as root, "
           "which it does only in a sandbox created with root=True\n")
USAGE = """usage: sudo [-bEHinSs] [-u user] [-D directory] [--preserve-env[=list]] [VAR=value] [--] command [arg ...]
       sudo -i | -s [command]
       sudo -h | -V | -v | -k | -l

Corral's sudo: runs the command as root through the sandbox's agent (the sandbox was created with root=True).
There is no password; -n, -S, -P, -A and -p are accepted and change nothing.
"""
_WITH_VALUE = {"u": "user", "g": "group", "D": "chdir", "p": "prompt", "C": "close-from", "U": "other-user",
               "T": "command-timeout"}
_FLAGS = {"E": "preserve-env", "H": "set-home", "i": "login", "s": "shell", "n": "non-interactive", "S": "stdin",
          "k": "reset-timestamp", "K": "remove-timestamp", "v": "validate", "l": "list", "V": "version",
          "b": "background", "P": "preserve-groups", "A": "askpass", "B": "bell", "N": "no-update"}
_LONG_WITH_VALUE = frozenset(_WITH_VALUE.values())


class UsageError(Exception):
    pass


class Options:
    def __init__(self) -> None:
        self.flags: set[str] = set()
        self.values: dict[str, str] = {}
        self.keep: set[str] = set()  # --preserve-env=A,B
        self.assignments: dict[str, str] = {}
        self.command: list[str] = []


def parse(args: list[str]) -> Options:
    """sudo's command line: options, then VAR=value assignments, then the command (`--` ends options)."""
    opts = Options()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--"):
            i = _long(opts, args, i)
        elif arg.startswith("-") and len(arg) > 1:
            i = _short(opts, args, i)
        else:
            break
    while i < len(args) and _assignment(args[i]):
        name, _, value = args[i].partition("=")
        opts.assignments[name] = value
        i += 1
    opts.command = args[i:]
    return opts


def _long(opts: Options, args: list[str], i: int) -> int:
    name, eq, value = args[i][2:].partition("=")
    if name == "help":
        name = "show-help"
    if name == "preserve-env":
        if eq:
            opts.keep.update(v for v in value.split(",") if v)
        else:
            opts.flags.add(name)
        return i + 1
    if name in _LONG_WITH_VALUE:
        if not eq:
            if i + 1 >= len(args):
                raise UsageError(f"option '--{name}' requires an argument")
            i, value = i + 1, args[i + 1]
        opts.values[name] = value
        return i + 1
    if name in _FLAGS.values() or name == "show-help":
        opts.flags.add(name)
        return i + 1
    raise UsageError(f"unrecognized option '--{name}'")


def _short(opts: Options, args: list[str], i: int) -> int:
    cluster = args[i][1:]
    for pos, letter in enumerate(cluster):
        if letter in _WITH_VALUE:
            value = cluster[pos + 1:]
            if not value:
                if i + 1 >= len(args):
                    raise UsageError(f"option requires an argument -- '{letter}'")
                i, value = i + 1, args[i + 1]
            opts.values[_WITH_VALUE[letter]] = value
            return i + 1
        if letter == "h":
            opts.flags.add("show-help")
        elif letter in _FLAGS:
            opts.flags.add(_FLAGS[letter])
        else:
            raise UsageError(f"invalid option -- '{letter}'" if letter != "e" else
                             "sudoedit (-e) is not available: edit the file with sudo and an editor instead")
    return i + 1


def _assignment(arg: str) -> bool:
    name, eq, _ = arg.partition("=")
    return bool(eq) and bool(name) and (name[0].isalpha() or name[0] == "_") and \
        all(c.isalnum() or c == "_" for c in name) and name.isascii()


def plan(opts: Options, environ: dict[str, str], cwd: str) -> dict[str, Any]:
    """The request for the agent: what to run, as whom, where, with which environment."""
    who = opts.values.get("user", "root")
    if who not in USERS:
        raise UsageError(f"unknown user {who}")
    name, home = USERS[who]
    group = opts.values.get("group")
    if group is not None and group not in ("root", "0", "#0", name, "1000", "#1000"):
        raise UsageError(f"unknown group {group}")
    login, shell = "login" in opts.flags, "shell" in opts.flags
    if login and shell:
        raise UsageError("you may not specify both the -i and -s options")
    if not opts.command and not (login or shell):
        raise UsageError("a command is needed")
    env = _environment(opts, environ, name, home)
    if login:
        argv = ["/bin/bash", "-l", *(["-c", _escaped(opts.command)] if opts.command else [])]
        cwd = home
    elif shell:
        argv = [environ.get("SHELL") or "/bin/bash", *(["-c", _escaped(opts.command)] if opts.command else [])]
    else:
        argv = list(opts.command)
    return {"argv": argv, "env": env, "cwd": opts.values.get("chdir", cwd), "user": name}


def _environment(opts: Options, environ: dict[str, str], name: str, home: str) -> dict[str, str]:
    if "preserve-env" in opts.flags:
        env = dict(environ)
    else:
        env = {k: v for k, v in environ.items() if k in KEEP or k.startswith("LC_") or k in opts.keep}
    keep_home = "preserve-env" in opts.flags and not ({"set-home", "login"} & opts.flags)
    env.update({"PATH": SECURE_PATH, "USER": name, "LOGNAME": name, "SHELL": "/bin/bash",
                "MAIL": f"/var/mail/{name}"})
    if not keep_home or "HOME" not in env:
        env["HOME"] = home
    env.update(opts.assignments)
    return env


def _escaped(command: list[str]) -> str:
    """The command for `shell -c`, as sudo builds it for -i and -s: every character but letters, digits, `_`,
    `-` and `$` backslash-escaped, so the shell sees the words that were given (and still expands variables)."""
    return " ".join("".join(c if c.isalnum() or c in "_-$" else "\\" + c for c in word) for word in command)


# -- talking to the agent -----------------------------------------------------------------------------------


def run(request: dict[str, Any]) -> tuple[int | None, int | None]:
    """Have the agent run `request` with our stdio; its (exit code, signal). Exits with 1 on a refusal."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(SOCKET)
    except OSError:
        _fail(NO_ROOT)
    fds = [_usable(fd) for fd in (0, 1, 2)]
    frame = protocol.encode_json(protocol.REQUEST, request)
    sock.sendmsg([frame], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("3i", *fds))])
    for fd, given in zip(fds, (0, 1, 2), strict=True):
        if fd != given:
            os.close(fd)
    _relay_signals(sock)
    return _wait(sock)


def _usable(fd: int) -> int:
    """`fd` if it is open, else /dev/null in its place (a command always gets three)."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        return os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)


def _relay_signals(sock: _socket.socket) -> None:
    def relay(signum: int, _frame: object) -> None:
        try:
            sock.sendall(protocol.encode_json(protocol.CONTROL, {"signal": signum}))
        except OSError:
            pass

    for signum in RELAYED:
        _signal.signal(signum, relay)


def _wait(sock: _socket.socket) -> tuple[int | None, int | None]:
    while True:
        header = _recv_exact(sock, protocol.HEADER.size)
        if header is None:
            _fail("sudo: the sandbox's agent ended the command without its exit status\n")
        kind, length = protocol.parse_header(header)
        payload = _recv_exact(sock, length) if length else b""
        message = protocol.decode_json(payload or b"{}")
        if kind == protocol.ERROR:
            _fail(f"sudo: {message.get('message')}\n")
        if kind == protocol.EVENT and message.get("event") == "exit":
            return message.get("exit_code"), message.get("signal")


def _recv_exact(sock: _socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _which(name: str) -> str | None:
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for directory in SECURE_PATH.split(":"):
        candidate = f"{directory}/{name}"
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _fail(message: str) -> NoReturn:
    sys.stderr.write(message)
    sys.stderr.flush()
    os._exit(1)


def _exit_like(code: int | None, signum: int | None) -> NoReturn:
    """End as the command ended: its exit code, or killed by its signal."""
    sys.stdout.flush()
    if signum:
        _signal.signal(signum, _signal.SIG_DFL)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not end a process (SIGCHLD, SIGWINCH): its code, as bash has it
    os._exit(code if code is not None else 1)


def _informational(opts: Options) -> bool:
    """-h, -V, -v, -k, -K and -l: answered here; True if that is all there was to do."""
    if "show-help" in opts.flags:
        sys.stdout.write(USAGE)
    elif "version" in opts.flags:
        sys.stdout.write("Corral sudo (runs commands as root through the sandbox's agent)\n")
    elif "list" in opts.flags and not opts.command:
        sys.stdout.write("User may run the following commands on this sandbox:\n    (ALL : ALL) NOPASSWD: ALL\n")
    elif "list" in opts.flags:  # `sudo -l cmd`: the command that would run, if there is one
        found = _which(opts.command[0])
        if found is None:
            os._exit(1)
        sys.stdout.write(" ".join([found, *opts.command[1:]]) + "\n")
    elif {"validate", "reset-timestamp", "remove-timestamp"} & opts.flags and not opts.command:
        pass
    else:
        return False
    return True


def main() -> NoReturn:
    try:
        opts = parse(sys.argv[1:])
        if _informational(opts):
            sys.stdout.flush()
            os._exit(0)
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = "/"
        request = plan(opts, dict(os.environ), cwd)
    except UsageError as exc:
        _fail(f"sudo: {exc}\n{USAGE}")
    if "background" in opts.flags and os.fork():
        os._exit(0)  # sudo -b: the command goes on without us waiting
    _exit_like(*run(request))
