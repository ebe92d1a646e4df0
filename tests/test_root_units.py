"""Root inside a sandbox, without sandboxes: the bundle a root sandbox gets (and that a default one does not), what
`sudo` makes of a command line, the Docker backend's refusal, and the service's side over the fake backend.
tests/test_root.py proves the behaviour in real runc and runsc sandboxes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral import InvalidRequestError
from corral.agent import sudo
from corral.backends import ROOT_FILE_ROOTS, Limits, SandboxSpec, check_user, supports_root, user_home
from corral.backends.docker import DockerBackend
from corral.backends.local import LocalBackend
from corral.backends.local._agent_files import SUDO_SCRIPT, install_agent, root_layer
from corral.backends.local._bundle import ROOT_CAPABILITIES, BundleParams, build_config
from corral.service import Command, CreateSandbox

from .test_service import Setup
from .test_service import setup as setup  # the fixture: a Service over FakeBackend, tenants a and b


def _config(tmp_path: Path, *, root: bool) -> dict[str, Any]:
    return build_config(BundleParams(sandbox_id="sb-x", rootfs=tmp_path, agent_source=tmp_path,
                                     host_uid_base=1 << 20, limits=Limits(), token="t",
                                     cgroups_path="/corral/sb-x", swap_limit=True, root=root))


def test_a_root_bundle_differs_only_in_the_agents_user_and_capabilities(tmp_path: Path) -> None:
    plain, root = _config(tmp_path, root=False), _config(tmp_path, root=True)
    assert plain["process"]["user"] == {"uid": 1000, "gid": 1000, "additionalGids": []}
    assert all(caps == [] for caps in plain["process"]["capabilities"].values())
    assert root["process"]["user"] == {"uid": 0, "gid": 0, "additionalGids": []}
    caps = root["process"]["capabilities"]
    assert caps["bounding"] == caps["effective"] == caps["permitted"] == ROOT_CAPABILITIES
    assert caps["inheritable"] == caps["ambient"] == []
    assert root["process"]["noNewPrivileges"] is True
    for key in ("user", "capabilities"):
        del plain["process"][key], root["process"][key]
    assert plain == root  # the same namespaces, id map, seccomp, masked paths, mounts and limits
    forbidden = {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE", "CAP_MKNOD", "CAP_SYS_MODULE",
                 "CAP_SETFCAP", "CAP_SYS_CHROOT", "CAP_SYS_RESOURCE", "CAP_LINUX_IMMUTABLE", "CAP_AUDIT_WRITE"}
    assert not forbidden & set(ROOT_CAPABILITIES) and len(ROOT_CAPABILITIES) == 10


def test_the_root_layer_holds_sudo_and_changes_with_it(tmp_path: Path) -> None:
    agent = install_agent(tmp_path)
    sudo_file = root_layer(agent) / "usr" / "local" / "bin" / "sudo"
    assert sudo_file.read_bytes() == SUDO_SCRIPT and sudo_file.stat().st_mode & 0o777 == 0o755
    assert SUDO_SCRIPT.startswith(b"#!/usr/bin/python3 -SIB\n") and b"from agent.sudo import main" in SUDO_SCRIPT


def test_spec_users_and_the_pool() -> None:
    assert SandboxSpec(root=True).pool_key() != SandboxSpec().pool_key()  # a pooled plain sandbox is no root one
    assert check_user(None) is None and check_user("root") == "root" and check_user("user") == "user"
    with pytest.raises(InvalidRequestError, match="unknown user 'admin'"):
        check_user("admin")
    assert (user_home(None), user_home("user"), user_home("root")) == ("/home/user", "/home/user", "/root")


# -- sudo's command line ------------------------------------------------------------------------------------


def _plan(*args: str, env: dict[str, str] | None = None, cwd: str = "/workspace") -> dict[str, Any]:
    return sudo.plan(sudo.parse(list(args)), {"FOO": "bar", "TERM": "xterm", "LC_ALL": "C", "HOME": "/home/user",
                                              "HTTP_PROXY": "http://127.0.0.1:3128", **(env or {})}, cwd)


def test_sudo_runs_the_command_as_given_with_the_environment_reset() -> None:
    plan = _plan("apt-get", "install", "-y", "jq")
    assert (plan["argv"], plan["user"], plan["cwd"]) == (["apt-get", "install", "-y", "jq"], "root", "/workspace")
    assert plan["env"] == {"TERM": "xterm", "LC_ALL": "C", "HTTP_PROXY": "http://127.0.0.1:3128",
                           "PATH": sudo.SECURE_PATH, "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash",
                           "MAIL": "/var/mail/root", "HOME": "/root"}
    kept = _plan("-E", "env")["env"]
    assert kept["FOO"] == "bar" and kept["HOME"] == "/home/user" and kept["USER"] == "root"
    assert _plan("-EH", "env")["env"]["HOME"] == "/root"
    assert {"FOO": "bar", "BAR": "1"}.items() <= _plan("--preserve-env=FOO", "BAR=1", "env")["env"].items()
    assert _plan("-u", "user", "id")["user"] == "user" and _plan("-uroot", "id")["user"] == "root"
    assert _plan("--user=#1000", "id")["env"]["HOME"] == "/home/user"
    assert _plan("-n", "-S", "-p", "pw:", "--", "-weird")["argv"] == ["-weird"]
    assert _plan("-D", "/etc", "ls")["cwd"] == "/etc" and _plan("--chdir=/tmp", "ls")["cwd"] == "/tmp"


def test_sudo_login_and_shell_escape_the_command_as_sudo_does() -> None:
    login = _plan("-i")
    assert (login["argv"], login["cwd"]) == (["/bin/bash", "-l"], "/root")
    assert _plan("-i", "echo", "a b", "$HOME")["argv"] == ["/bin/bash", "-l", "-c", "echo a\\ b $HOME"]
    assert _plan("-s", "ls", "-la;")["argv"] == ["/bin/bash", "-c", "ls -la\\;"]
    assert _plan("-s", env={"SHELL": "/bin/sh"})["argv"] == ["/bin/sh"]


@pytest.mark.parametrize(("args", "message"), [
    ((), "a command is needed"),
    (("-Z", "x"), "invalid option -- 'Z'"),
    (("-u",), "option requires an argument -- 'u'"),
    (("-u", "mallory", "id"), "unknown user mallory"),
    (("-g", "staff", "id"), "unknown group staff"),
    (("-i", "-s"), "you may not specify both"),
    (("--frobnicate", "x"), "unrecognized option '--frobnicate'"),
    (("-e", "/etc/hosts"), "sudoedit (-e) is not available"),
])
def test_sudo_refuses_what_it_cannot_do(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(sudo.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _plan(*args)


# -- backends and the service -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_docker_backend_refuses_root_before_asking_the_daemon(tmp_path: Path) -> None:
    docker = DockerBackend(tmp_path, base_url="unix:///nonexistent/docker.sock")
    with pytest.raises(InvalidRequestError, match=r"root=True is refused on the Docker backend: .*user namespace"):
        await docker.check(SandboxSpec(root=True))
    assert not supports_root(docker) and supports_root(LocalBackend(tmp_path))


@pytest.mark.anyio
async def test_the_service_creates_root_sandboxes_and_audits_the_user(setup: Setup) -> None:
    s = setup
    record = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox(root=True))
    assert record.spec.root and record.spec.file_roots == ROOT_FILE_ROOTS
    plain = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox())
    assert not plain.spec.root and "/root" not in (plain.spec.file_roots or ())
    assert (await s.service.info.get(s.who["a_dev"])).root  # the fake backend declares no limitation
    assert Command("id", user="root").audit_params()["user"] == "root"
    assert "user" not in Command("id").audit_params()  # the default user's records stay what they were
    with pytest.raises(InvalidRequestError, match="unknown user"):
        await s.service.files.stat(s.who["a_dev"], record.id, "/root", user="admin")
    assert (await s.last("files.stat")).params == {"path": "/root", "user": "admin"}
