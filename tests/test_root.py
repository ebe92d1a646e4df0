"""Root inside a sandbox, on request (`root=True`, docs/security.md), against real runc sandboxes: the user's
commands stay exactly as unprivileged as in any sandbox, root's have the bounded capability set and nothing
beyond the sandbox, files are owned by whoever the operation acts as (on the host: the sandbox's range, never
host root), `sudo` goes through the agent, and a sandbox without root has none of it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import AsyncSandbox, InvalidRequestError, PermissionDeniedError
from corral.backends.local._bundle import ROOT_CAPABILITIES
from corral.engine import Engine, SandboxSession, SandboxSpec

from .conftest import TEMPLATE
from .test_server_api import Api, create, run, unb64
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

# The kernel's numbers of the capabilities a root sandbox gets (linux/capability.h).
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
               "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10}
ROOT_MASK = sum(1 << CAP_NUMBERS[name] for name in ROOT_CAPABILITIES)
STATUS = "grep -E '^(Uid|Gid|Groups|Cap[A-Za-z]+|NoNewPrivs|Seccomp):' /proc/self/status"


def rooted(**fields: object) -> SandboxSpec:
    return SandboxSpec(template=TEMPLATE, root=True, **fields)  # type: ignore[arg-type]


@pytest.fixture
async def root_sb(engine: Engine) -> AsyncIterator[SandboxSession]:
    sb = await engine.create(rooted())
    try:
        yield sb
    finally:
        if sb.id in {s.id for s in engine.list()}:
            await sb.destroy()


def status(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def upper(engine: Engine, sb: SandboxSession) -> Path:
    return engine.home / "sandboxes" / sb.id / "disk" / "upper"


def uid_base(engine: Engine, sb: SandboxSession) -> int:
    base: int = engine.runtime.sandboxes[sb.id].record.uid_base  # type: ignore[attr-defined]
    return base


async def until_gone(sb: SandboxSession, pattern: str, seconds: float = 5.0) -> str:
    """The sandbox's processes matching `pattern`, polled until there are none (or `seconds` pass)."""
    found = ""
    for _ in range(int(seconds / 0.1)):
        found = (await sb.exec(f"pgrep -af '{pattern}' | grep -v pgrep || true", user="root")).stdout
        if not found:
            break
        await asyncio.sleep(0.1)
    return found


# -- the user's side: as in any sandbox ------------------------------------------------------------------


async def test_the_users_commands_are_as_unprivileged_as_in_any_sandbox(root_sb: SandboxSession) -> None:
    r = await root_sb.exec(STATUS)
    found = status(r.stdout)
    assert found["Uid"].split() == ["1000"] * 4 and found["Gid"].split() == ["1000"] * 4, found
    assert found["Groups"] == ""
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(found[cap], 16) == 0, (cap, found)
    assert found["NoNewPrivs"] == "1" and found["Seccomp"] == "2"
    r = await root_sb.exec("echo x > /usr/x; echo x > /etc/x; mkdir /usr/local/d")
    assert r.exit_code != 0 and r.stderr.count("Permission denied") == 3, r.stderr
    listed = await root_sb.exec("ls /root")
    assert listed.exit_code != 0 and "Permission denied" in listed.stderr  # root's home is root's


async def test_the_template_is_roots_and_sudo_is_there(root_sb: SandboxSession) -> None:
    r = await root_sb.exec("stat -c '%U %a' /usr /usr/bin/ls /etc/passwd /root; stat -c '%U' /home/user; "
                           "command -v sudo")
    assert r.stdout.splitlines() == ["root 755", "root 755", "root 644", "root 700", "user",
                                     "/usr/local/bin/sudo"], r.stdout


# -- root's side: the bounded set, nothing beyond the sandbox --------------------------------------------


async def test_a_root_command_has_the_bounded_capability_set(root_sb: SandboxSession) -> None:
    r = await root_sb.exec(f"{STATUS}; echo $HOME $USER $LOGNAME", user="root")
    lines = r.stdout.splitlines()
    found = status("\n".join(lines[:-1]))
    assert found["Uid"].split() == ["0"] * 4 and found["Groups"] == "", found
    for cap in ("CapPrm", "CapEff", "CapBnd"):
        assert int(found[cap], 16) == ROOT_MASK, (cap, found)
    assert int(found["CapInh"], 16) == 0 and int(found["CapAmb"], 16) == 0
    assert found["NoNewPrivs"] == "1" and found["Seccomp"] == "2"
    assert lines[-1] == "/root root root"
    assert ROOT_MASK == 0x5FF  # no SYS_ADMIN, NET_ADMIN, NET_RAW, SYS_PTRACE, MKNOD, SYS_MODULE, SETFCAP...


async def test_root_writes_the_system_and_its_files_are_the_sandboxs_own_range(engine: Engine,
                                                                             root_sb: SandboxSession) -> None:
    r = await root_sb.exec("mkdir -p /usr/local/lib/pkg && echo data > /usr/local/lib/pkg/f && "
                           "echo user > /usr/local/lib/pkg/mine && chown 1000:1000 /usr/local/lib/pkg/mine && "
                           "echo '10.0.0.9 pkg.test' >> /etc/hosts && chmod 4755 /usr/local/lib/pkg/f && "
                           "stat -c '%U %a' /usr/local/lib/pkg/f /usr/local/lib/pkg/mine && tail -1 /etc/hosts",
                           user="root")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["root 4755", "user 644", "10.0.0.9 pkg.test"]
    base = uid_base(engine, root_sb)
    pkg = upper(engine, root_sb) / "usr" / "local" / "lib" / "pkg"
    owners = {name: (os.stat(pkg / name).st_uid, os.stat(pkg / name).st_gid) for name in ("f", "mine")}
    assert owners == {"f": (base, base), "mine": (base + 1000, base + 1000)}  # never host root (0)
    assert os.stat(upper(engine, root_sb) / "etc" / "hosts").st_uid == base  # a copy-up into the sandbox's disk
    mine = await root_sb.exec("echo more >> /usr/local/lib/pkg/mine; cat /usr/local/lib/pkg/mine; "
                              "echo no > /usr/local/lib/pkg/f")
    assert mine.stdout == "user\nmore\n" and "Permission denied" in mine.stderr  # setuid bit: still no root


async def test_roots_writes_count_against_the_sandboxs_own_disk(engine: Engine) -> None:
    async with await engine.create(rooted(limits={"disk": "64M"})) as sb:
        r = await sb.exec("dd if=/dev/zero of=/usr/local/big bs=1M count=100 2>&1", user="root")
        assert "No space left on device" in r.stdout, r.stdout
        template = Path(engine.templates.get(TEMPLATE).rootfs)
        assert not (template / "usr" / "local" / "big").exists()  # the template itself is never written


async def test_sudo_installs_and_removes_a_package(root_sb: SandboxSession) -> None:
    """dpkg as root through sudo, a package built by the user: what `sudo apt-get install` does once it has the
    .deb (the download itself goes through the egress proxy, which this test's engine has not)."""
    r = await root_sb.exec(
        "cd /tmp && mkdir -p pkg/DEBIAN pkg/usr/local/bin && printf 'Package: corral-t\\nVersion: 1.0\\n"
        "Architecture: all\\nMaintainer: t <t@t>\\nDescription: t\\n' > pkg/DEBIAN/control && "
        "printf '#!/bin/sh\\necho installed\\n' > pkg/usr/local/bin/corral-t && chmod 755 pkg/usr/local/bin/corral-t "
        "&& dpkg-deb --root-owner-group --build pkg >/dev/null && sudo dpkg -i pkg.deb >/dev/null && corral-t && "
        "stat -c %U /usr/local/bin/corral-t && dpkg -s corral-t | grep Status && sudo dpkg -r corral-t >/dev/null "
        "2>&1 && test -e /usr/local/bin/corral-t || echo removed")
    assert r.stdout.splitlines() == ["installed", "root", "Status: install ok installed", "removed"], r.stderr


async def test_root_cannot_reach_the_agent_the_kernel_or_the_host(root_sb: SandboxSession) -> None:
    r = await root_sb.exec(
        "unshare -U true; echo unshare=$?; mount -t tmpfs none /mnt; echo mount=$?; "
        "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); "
        "print(\"ptrace\", l.ptrace(16, 1, 0, 0), ctypes.get_errno())'; "
        "cat /proc/1/environ; echo environ=$?; cat /proc/1/mem; echo mem=$?; readlink /proc/1/fd/0; echo fd=$?; "
        "ls /proc/1/root/; echo root=$?; echo 1 > /proc/sys/kernel/ns_last_pid; echo sysctl=$?; "
        "mknod /tmp/null c 1 3; echo mknod=$?", user="root")
    found = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert all(found[k] != "0" for k in ("unshare", "mount", "environ", "mem", "fd", "root", "sysctl", "mknod")), r
    assert "ptrace -1 1\n" in r.stdout  # EPERM
    assert "CORRAL_AGENT_TOKEN" not in r.stdout
    for sig in ("INT", "TERM", "HUP", "KILL", "STOP"):
        await root_sb.exec(f"kill -{sig} 1", user="root")
    assert (await root_sb.exec("echo alive")).stdout == "alive\n"  # PID 1 of its namespace: not killable


async def test_without_the_spawn_helper_the_drop_is_the_same(root_sb: SandboxSession) -> None:
    """Where the host had no C compiler the agent spawns through Python's preexec_fn: the same drop to the user."""
    script = ("import os, sys; sys.path.insert(0, '/.corral'); from agent import spawn, users; "
              "pid = spawn.popen_fallback(['grep', '-E', '^(Uid|Groups|CapPrm|CapEff|CapBnd):', "
              "'/proc/self/status'], {'PATH': '/usr/bin:/bin'}, '/', (0, 1, 2), tty=False, drop=users.USER); "
              "os.waitpid(pid, 0)")
    r = await root_sb.exec(["python3", "-c", script], user="root")
    found = status(r.stdout)
    assert found["Uid"].split() == ["1000"] * 4 and found["Groups"] == "", (r.stdout, r.stderr)
    assert all(int(found[cap], 16) == 0 for cap in ("CapPrm", "CapEff", "CapBnd")), found


async def test_code_sessions_stay_the_users(root_sb: SandboxSession) -> None:
    cell = await root_sb.run_code("import os\n"
                                  "os.getuid(), 'CapEff:\\t0000000000000000' in open('/proc/self/status').read()")
    assert cell.results[0].data["text/plain"] == "(1000, True)", cell
    program = await root_sb.run_code('#include <stdio.h>\n#include <unistd.h>\nint main(void) { printf("%d\\n", '
                                     'getuid()); return 0; }', language="c")
    assert program.stdout == "1000\n", program


# -- file operations as a user --------------------------------------------------------------------------


async def test_file_operations_act_as_the_requested_user(engine: Engine, root_sb: SandboxSession) -> None:
    as_user, as_root = engine.get(root_sb.id).files_for(), engine.get(root_sb.id).files_for(user="root")
    await as_user.write("/workspace/u.txt", b"u")
    await as_root.write("/workspace/r.txt", b"r")
    assert (await as_user.stat("/workspace/u.txt")).owner == "user"
    assert (await as_user.stat("/workspace/r.txt")).owner == "root"
    base = uid_base(engine, root_sb)
    workspace = upper(engine, root_sb) / "workspace"
    assert os.stat(workspace / "u.txt").st_uid == base + 1000 and os.stat(workspace / "r.txt").st_uid == base
    with pytest.raises(PermissionDeniedError, match="Permission denied"):
        await as_user.write("/usr/local/u.txt", b"u")
    with pytest.raises(PermissionDeniedError, match="Permission denied"):
        await as_user.list("/root")
    await as_root.write("/usr/local/etc/tool.conf", b"conf")
    assert await as_root.make_dir("/etc/tool.d") and await as_root.exists("/etc/tool.d")
    assert (await as_user.read("/usr/local/etc/tool.conf")) == b"conf"  # 0644: readable by the user
    assert [e.name for e in await as_root.list("/root")] == [".bashrc", ".profile"]
    with pytest.raises(PermissionDeniedError, match="never changes"):
        await as_root.write("/.corral/x", b"x")
    with pytest.raises(InvalidRequestError, match="unknown user"):
        engine.get(root_sb.id).files_for(user="nobody")


# -- sudo -----------------------------------------------------------------------------------------------


async def test_sudo_runs_as_root_with_exact_io_and_status(root_sb: SandboxSession) -> None:
    r = await root_sb.exec("sudo echo ok")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "ok\n", "")
    first = await root_sb.exec("echo $FOO", env={"FOO": "bar"})  # E2B's test_bash_command_scoped_env_vars
    second = await root_sb.exec('sudo echo "$FOO"')
    assert first.stdout == "bar\n" and (second.exit_code, second.stdout) == (0, "\n")
    r = await root_sb.exec("sudo sh -c 'cat; echo err >&2; exit 7'", stdin=b"a\x00b\xff")
    assert (r.exit_code, r.stdout_bytes, r.stderr) == (7, b"a\x00b\xff", "err\n")
    r = await root_sb.exec("sudo sh -c 'kill -TERM $$'; echo $?")
    assert r.stdout == "143\n"  # killed by its signal: sudo ends the same way
    r = await root_sb.exec("sudo id -u; sudo -n -- id -u; sudo -u user id -u; sudo -u root -H id -u; "
                           "sudo -i pwd; sudo -s echo '$HOME'; cd /tmp && sudo pwd; sudo -D /etc pwd")
    assert r.stdout.splitlines() == ["0", "0", "1000", "0", "/root", "/root", "/tmp", "/etc"], r.stderr
    r = await root_sb.exec("sudo -b sh -c 'sleep 0.5; id -u > /tmp/bg'; test -e /tmp/bg || echo not-yet; "
                           "sleep 2; cat /tmp/bg")
    assert r.stdout == "not-yet\n0\n", r.stderr  # -b: sudo returns at once, the command goes on


async def test_sudo_resets_the_environment_like_env_reset(root_sb: SandboxSession) -> None:
    reset = await root_sb.exec("sudo env", env={"FOO": "bar"})
    env = dict(line.split("=", 1) for line in reset.stdout.splitlines())
    assert "FOO" not in env
    assert (env["USER"], env["HOME"], env["LOGNAME"]) == ("root", "/root", "root")
    assert (env["SUDO_USER"], env["SUDO_UID"], env["SUDO_GID"], env["SUDO_COMMAND"]) == ("user", "1000", "1000",
                                                                                          "env")
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:3128"  # the egress proxy: `sudo apt-get` needs it
    kept = await root_sb.exec("sudo -E sh -c 'echo $FOO $USER'; sudo BAR=baz sh -c 'echo $BAR'; "
                              "sudo --preserve-env=FOO sh -c 'echo $FOO'", env={"FOO": "bar"})
    assert kept.stdout == "bar root\nbaz\nbar\n"


async def test_sudo_says_what_it_cannot_do(root_sb: SandboxSession) -> None:
    r = await root_sb.exec("sudo no-such-command")
    assert (r.exit_code, r.stderr) == (1, "sudo: no-such-command: command not found\n")
    r = await root_sb.exec("sudo -Z true")
    assert r.exit_code == 1 and r.stderr.startswith("sudo: invalid option -- 'Z'\nusage: sudo")
    r = await root_sb.exec("sudo -u nobody true; sudo; sudo -e /etc/hosts")
    assert "sudo: unknown user nobody" in r.stderr and "a command is needed" in r.stderr
    assert "sudoedit (-e) is not available" in r.stderr
    assert (await root_sb.exec("sudo -v && sudo -k && sudo -l")).stdout.endswith("NOPASSWD: ALL\n")


async def test_a_timeout_also_ends_what_sudo_started(root_sb: SandboxSession) -> None:
    r = await root_sb.exec("sudo sleep 301", timeout=1)
    assert r.timed_out
    assert await until_gone(root_sb, "sleep 301") == ""  # the agent killed root's tree when sudo went away
    r = await root_sb.exec("sudo sh -c 'sleep 302 & sleep 303'", timeout=1)
    assert r.timed_out and await until_gone(root_sb, "sleep 30[23]") == ""


async def test_a_signal_to_sudo_reaches_the_command(root_sb: SandboxSession) -> None:
    proc = await root_sb.processes.start("sudo sh -c 'trap \"echo got TERM; exit 3\" TERM; sleep 30 & wait'")
    await asyncio.sleep(1.0)
    await root_sb.processes.kill(proc.id, 15)  # to sudo's group: sudo relays it to root's command
    result = await root_sb.processes.wait(proc.id, timeout=10)
    assert result is not None and result.exit_code == 3 and result.stdout == "got TERM\n", result


# -- a sandbox without root -----------------------------------------------------------------------------


async def test_a_sandbox_without_root_has_no_root_at_all(engine: Engine, sandbox: SandboxSession) -> None:
    r = await sandbox.exec("command -v sudo; sudo true")
    assert r.exit_code == 127 and r.stdout == ""
    with pytest.raises(PermissionDeniedError, match="root=True"):
        await sandbox.exec("id", user="root")
    with pytest.raises(PermissionDeniedError, match="root=True"):
        await sandbox.processes.start("id", user="root")
    with pytest.raises(PermissionDeniedError, match="root=True"):
        await engine.get(sandbox.id).files_for(user="root").write("/workspace/x", b"x")
    assert not await sandbox.files.exists("/workspace/x")  # refused: nothing written
    config = json.loads((engine.home / "sandboxes" / sandbox.id / "config.json").read_text())
    process = config["process"]
    assert process["user"] == {"uid": 1000, "gid": 1000, "additionalGids": []}
    assert all(caps == [] for caps in process["capabilities"].values()) and process["noNewPrivileges"]
    assert not (engine.home / "sandboxes" / sandbox.id / "lower").exists()  # no idmapped template either


async def test_the_agent_outlives_signals_from_its_own_user(sandbox: SandboxSession) -> None:
    """In a default sandbox the agent and the user share uid 1000: Python's SIGINT handler let `kill -INT 1`
    end the sandbox (KeyboardInterrupt in PID 1). The agent ignores it now; commands still get it by default."""
    for sig in ("INT", "TERM", "HUP", "QUIT", "USR1", "KILL"):
        await sandbox.exec(f"kill -{sig} 1")
    r = await sandbox.exec("grep SigIgn /proc/self/status; sh -c 'kill -INT $$'; echo $?")
    ignored, status = r.stdout.splitlines()
    assert not int(ignored.split()[1], 16) & (1 << (2 - 1)) and status == "130", r.stdout  # SIGINT: default


# -- lifecycle of a root sandbox --------------------------------------------------------------------------


async def test_pause_to_disk_keeps_roots_files_and_owners(engine: Engine, root_sb: SandboxSession) -> None:
    await root_sb.exec("install -m 600 /dev/null /tmp/root-only && echo secret > /tmp/root-only && "
                       "echo pkg > /usr/local/share/pkg.txt", user="root")
    await root_sb.exec("echo mine > /tmp/user.txt")
    await engine.pause(root_sb.id, memory=False)
    await engine.resume(root_sb.id)
    r = await root_sb.exec("stat -c '%U %a' /tmp/root-only /tmp/user.txt; cat /tmp/root-only "
                           "/usr/local/share/pkg.txt", user="root")
    assert r.stdout.splitlines() == ["root 600", "user 644", "secret", "pkg"], (r.stdout, r.stderr)
    assert (await root_sb.exec("sudo id -u")).stdout == "0\n"


async def test_a_boot_never_follows_what_root_planted_in_its_layer(engine: Engine, root_sb: SandboxSession,
                                                                   tmp_path: Path) -> None:
    """After a pause to disk the host prepares the sandbox's directories again in its upper layer, where root
    may have left symlinks to host paths in their place: they are replaced, never followed."""
    canary = tmp_path / "canary"
    canary.mkdir(mode=0o700)
    (canary / "file").write_text("host")
    os.chmod(canary / "file", 0o600)
    r = await root_sb.exec(f"mv /workspace /ws-old && ln -s {canary} /workspace && "
                           f"mv /home/user /home/u-old && ln -s {canary} /home/user && "
                           f"rm /etc/resolv.conf && ln -s {canary}/file /etc/resolv.conf && echo planted", user="root")
    assert r.stdout == "planted\n", r.stderr
    await engine.pause(root_sb.id, memory=False)
    await engine.resume(root_sb.id)
    for path, mode in ((canary, 0o700), (canary / "file", 0o600)):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, mode), path
    assert (canary / "file").read_text() == "host" and sorted(os.listdir(canary)) == ["file"]
    r = await root_sb.exec("stat -c '%F %U' /workspace /home/user; grep -c '^nameserver 127.0.0.1' /etc/resolv.conf")
    assert r.stdout.splitlines() == ["directory user", "directory user", "1"], r.stderr
    await root_sb.files.write("/workspace/after.txt", b"ok")


async def test_forks_and_snapshots_of_a_root_sandbox(engine: Engine, root_sb: SandboxSession) -> None:
    await root_sb.exec("echo pkg > /usr/local/share/pkg.txt", user="root")
    async with await engine.fork(root_sb.id) as child:
        r = await child.exec("stat -c %U /usr/local/share/pkg.txt; sudo id -u; id -u")
        assert r.stdout.splitlines() == ["root", "0", "1000"], r.stderr
    artifact = await engine.snapshot(root_sb.id)
    try:
        async with await engine.create(SandboxSpec(template=TEMPLATE), source=artifact) as plain:
            r = await plain.exec("cat /usr/local/share/pkg.txt; command -v sudo; echo x > /usr/local/share/pkg.txt")
            assert r.stdout == "pkg\n" and "Permission denied" in r.stderr  # root's file, and no root to write it
            with pytest.raises(PermissionDeniedError):
                await plain.exec("id", user="root")
    finally:
        await engine.delete_snapshot(artifact)


async def test_a_root_terminal_and_a_users_terminal(root_sb: SandboxSession) -> None:
    for user, expected in ((None, b"1000"), ("root", b"0")):
        session = await root_sb.pty(["sh", "-c", "id -u; tty; stat -c %u $(tty)"], user=user)
        output = b"".join([chunk async for chunk in session])
        await session.close()
        lines = output.replace(b"\r", b"").split(b"\n")
        assert lines[0] == expected and lines[1].startswith(b"/dev/pts/") and lines[2] == expected, output


# -- the REST API and the SDK ----------------------------------------------------------------------------


async def test_the_rest_api_asks_for_root_where_it_is_given(api: Api) -> None:
    async with api.client("a_dev") as c:
        assert (await c.get("/v1/info")).json()["root"] is True
        assert "/root" in (await create(c, root=True))["file_roots"]  # the default roots add root's home
        sb = await create(c, root=True, file_roots=["/"])
        assert sb["root"] is True
        assert unb64((await run(c, sb["id"], "id -u", user="root"))["stdout_b64"]) == b"0\n"
        assert unb64((await run(c, sb["id"], "id -u"))["stdout_b64"]) == b"1000\n"
        files = f"/v1/sandboxes/{sb['id']}/files"
        r = await c.put(files, params={"path": "/usr/local/x", "user": "root"}, content=b"x")
        assert r.status_code == 200, r.text
        r = await c.get(f"{files}/stat", params={"path": "/usr/local/x"})
        assert r.json()["owner"] == "root"
        r = await c.put(files, params={"path": "/usr/local/y"}, content=b"y")
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
        r = await c.get(f"{files}/list", params={"path": "/root", "user": "root"})
        assert r.status_code == 200 and [e["name"] for e in r.json()["entries"]] == [".bashrc", ".profile"]
        r = await c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "id", "user": "admin"})
        assert r.status_code == 400, r.text
        plain = await create(c)
        assert plain["root"] is False
        r = await c.post(f"/v1/sandboxes/{plain['id']}/exec", json={"cmd": "id", "user": "root"})
        assert r.status_code == 403 and "root=True" in r.json()["error"]["message"], r.text
        r = await c.post(f"/v1/sandboxes/{plain['id']}/processes", json={"cmd": "id", "user": "root"})
        assert r.status_code == 403, r.text
    execs = await api.store.audit.query(action="sandbox.exec", sandbox=sb["id"])
    assert [e.params.get("user") for e in execs] == ["root", None]  # "admin" was refused as request.invalid
    refused = await api.store.audit.query(action="sandbox.exec", sandbox=plain["id"])
    assert [(e.params.get("user"), e.outcome.get("error")) for e in refused] == [("root", "permission_denied")]


async def test_the_sdk_creates_root_sandboxes(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, root=True, file_roots=["/"], api_key=api.keys["a_dev"],
                                         base_url=live_url) as sb:
        assert sb.info.root
        r = await sb.commands.run("id -u; sudo id -u", user="root")
        assert r.stdout == "0\n0\n", r.stderr
        handle = await sb.commands.run("id -u", user="root", background=True)
        assert (await handle.wait()).stdout == "0\n"
        await sb.files.write("/etc/corral.conf", b"x", user="root")
        assert (await sb.files.stat("/etc/corral.conf")).owner == "root"
        assert await sb.files.exists("/root/.bashrc", user="root")
        with pytest.raises(PermissionDeniedError):
            await sb.files.write("/etc/other.conf", b"x")
        assert await sb.files.make_dir("/opt/tool", user="root")


# -- under gVisor -------------------------------------------------------------------------------------------


@pytest.mark.runsc
async def test_root_under_gvisor(engine: Engine) -> None:
    """runsc runs the same bundle: the agent as root in the sandbox's namespace, per-thread users for files
    (gVisor has no setfsuid: raw setresuid), sudo through the agent. gVisor shows a non-dumpable process's
    environ to its own uid: the agent's token was wiped from it before anything else ran."""
    async with await engine.create(rooted(runtime="runsc")) as sb:
        r = await sb.exec("id -u; echo x > /usr/local/u.txt", timeout=60)
        assert r.stdout == "1000\n" and "Permission denied" in r.stderr
        r = await sb.exec("id -u; echo x > /usr/local/r.txt && cat /usr/local/r.txt; sudo id -u", user="root",
                          timeout=60)
        assert r.stdout == "0\nx\n0\n", r.stderr
        assert (await sb.exec("sudo id -u; sudo -u user id -u", timeout=60)).stdout == "0\n1000\n"
        await engine.get(sb.id).files_for().write("/workspace/u.txt", b"u")
        await engine.get(sb.id).files_for(user="root").write("/workspace/r.txt", b"r")
        assert [(await sb.files.stat(f"/workspace/{n}.txt")).owner for n in "ur"] == ["user", "root"]
        with pytest.raises(PermissionDeniedError):
            await engine.get(sb.id).files_for().write("/usr/local/u.txt", b"u")
        base = uid_base(engine, sb)
        assert os.stat(upper(engine, sb) / "usr" / "local" / "r.txt").st_uid == base
        assert os.stat(upper(engine, sb) / "workspace" / "u.txt").st_uid == base + 1000
        environ = await sb.exec("cat /proc/1/environ", user="root", timeout=60)
        token: str = engine.runtime.sandboxes[sb.id].record.token  # type: ignore[attr-defined]
        assert token not in environ.stdout
