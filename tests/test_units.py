"""Unit tests of the I/O-free pieces: framing, output caps, path and archive checks, limits, the error table."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

import corral
from corral import CorralError, InvalidRequestError, error_from_code
from corral._exceptions import _all_subclasses
from corral.agent import archives, file_access, protocol
from corral.agent.output import OutputBuffer
from corral.agent.process_requests import ProcessError, build_argv, build_env
from corral.backends.local._bundle import MASKED_PATHS, BundleParams, build_config
from corral.engine import Limits, SandboxSpec, parse_size
from corral.engine._session import sandbox_path


def test_frames_round_trip_bytes_exactly():
    payload = bytes(range(256)) * 3
    frame = protocol.encode(protocol.STDOUT, payload)
    kind, length = protocol.parse_header(frame[: protocol.HEADER.size])
    assert (kind, length) == (protocol.STDOUT, len(payload))
    assert frame[protocol.HEADER.size :] == payload
    obj = {"op": "exec", "cmd": "echo \udcff"}
    kind, length = protocol.parse_header(protocol.encode_json(protocol.REQUEST, obj)[:5])
    assert kind == protocol.REQUEST


@pytest.mark.parametrize("header", [b"\x00\x00\x00\x00\x01", b"\x00\x00\x00\x02\x63", b"\xff\xff\xff\xff\x01"])
def test_bad_frames_are_refused(header):
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_header(header)


def test_oversized_frame_cannot_be_encoded():
    with pytest.raises(protocol.ProtocolError):
        protocol.encode(protocol.DATA, b"x" * (protocol.MAX_FRAME + 1))
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_json(b"[1, 2]")


def test_output_buffer_keeps_head_tail_and_total():
    buf = OutputBuffer(100)  # head 75, tail 25
    data = bytes(i % 251 for i in range(10_000))
    live = b"".join(buf.feed(data[i : i + 7]) for i in range(0, len(data), 7))
    assert live == data[:75] and bytes(buf.head) == data[:75]
    assert buf.tail_bytes() == data[-25:]
    assert buf.total == 10_000 and buf.omitted == 10_000 - 100


def test_output_buffer_small_output_is_whole():
    buf = OutputBuffer(100)
    buf.feed(b"a" * 80)
    assert bytes(buf.head) + buf.tail_bytes() == b"a" * 80 and buf.omitted == 0


def test_argv_and_env_validation():
    assert build_argv("echo hi") == ["/bin/bash", "-lc", "echo hi"]
    assert build_argv(["ls", "-l"]) == ["ls", "-l"]
    for bad in ([], "a\x00b", ["x", 1], None, ["\udcff"]):
        with pytest.raises(ProcessError):
            build_argv(bad)
    env = build_env({"A": "1"})
    assert env["A"] == "1" and env["HOME"] == "/home/user"
    for bad_env in ({"A=B": "1"}, {"A": "x\x00"}, {"A": 1}, ["A"]):
        with pytest.raises(ProcessError):
            build_env(bad_env)


@pytest.mark.parametrize("bad", ["", "relative", "/a\x00b", "/\udcff", 5])
def test_agent_path_check(bad):
    with pytest.raises(file_access.FileError):
        file_access.check_path(bad)


def test_agent_path_normalises():
    assert file_access.check_path("/workspace/./a//b/../c") == "/workspace/a/c"


def test_engine_path_resolves_relative_to_workspace():
    assert sandbox_path("a/b.txt") == "/workspace/a/b.txt"
    assert sandbox_path("/tmp/x") == "/tmp/x"
    for bad in ("", "a\x00", "\udcff"):
        with pytest.raises(InvalidRequestError):
            sandbox_path(bad)


def _members(*specs: tuple[str, str | None, str | None]) -> list[tarfile.TarInfo]:
    out = []
    for name, kind, link in specs:
        info = tarfile.TarInfo(name)
        if kind == "sym":
            info.type, info.linkname = tarfile.SYMTYPE, link or ""
        elif kind == "hard":
            info.type, info.linkname = tarfile.LNKTYPE, link or ""
        elif kind == "dev":
            info.type = tarfile.CHRTYPE
        out.append(info)
    return out


@pytest.mark.parametrize("specs", [
    [("../x", None, None)],
    [("/abs", None, None)],
    [("a/../../x", None, None)],
    [("l", "sym", "/etc")],
    [("l", "sym", "../..")],
    [("d/l", "sym", "../../x")],
    [("h", "hard", "../outside")],
    [("l", "sym", "sub"), ("l/file", None, None)],
    [("dev", "dev", None)],
])
def test_unsafe_archive_members(specs, tmp_path):
    with pytest.raises(file_access.FileError):
        archives._validate_members(_members(*specs), str(tmp_path))


def test_safe_archive_members(tmp_path):
    archives._validate_members(_members(("a/b", None, None), ("a/l", "sym", "b"), ("a/h", "hard", "a/b")),
                               str(tmp_path))


def test_sizes_and_limits():
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size(4096) == 4096
    for bad in ("lots", "-1M", 0, True):
        with pytest.raises(ValueError):
            parse_size(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpus"):
        Limits(cpus=0)
    with pytest.raises(ValueError):
        SandboxSpec(env={"BAD-NAME": "x"})
    with pytest.raises(ValueError):
        SandboxSpec(timeout=-1)
    with pytest.raises(ValueError):
        Limits(unknown=1)  # type: ignore[call-arg]


def test_tmpfs_sizes_fit_in_memory():
    # tmpfs pages count against memory and cannot be reclaimed: /tmp and /dev/shm must leave room for processes.
    assert (Limits().tmp, Limits().shm) == (256 << 20, 64 << 20)  # the defaults fit 512M as they are
    small = Limits(memory="128M")
    assert small.tmp + small.shm <= 96 << 20 and small.tmp >= 64 << 20  # defaults shrink to fit
    assert Limits(memory="128M", shm="64M").tmp == 32 << 20
    assert Limits(memory="512M", tmp="470M").shm == 10 << 20
    with pytest.raises(ValueError, match=r"together must be at most 96M: tmpfs pages count against memory"):
        Limits(memory="128M", tmp="200M", shm="8M")
    with pytest.raises(ValueError, match="leaves no room"):
        Limits(memory="128M", tmp="100M")
    again = Limits.model_validate(small.model_dump())  # a stored spec reloads unchanged
    assert again == small


def test_every_error_code_round_trips():
    classes = _all_subclasses(CorralError)
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        err = error_from_code(cls.code, "m", {"k": 1})
        assert type(err) is cls and err.message == "m" and err.details == {"k": 1}
        assert json.loads(json.dumps(err.to_dict()))["code"] == cls.code
    unknown = error_from_code("nope", "m")
    assert isinstance(unknown, corral.ServerError) and "nope" in unknown.message


def test_agent_file_error_codes_are_known():
    known = {c.code for c in _all_subclasses(CorralError)}
    assert set(file_access.ERRNO_CODES.values()) <= known


def test_exports_are_complete():
    for name in corral.__all__:
        assert hasattr(corral, name)
    public = {n for n in dir(corral) if isinstance(getattr(corral, n), type)
              and issubclass(getattr(corral, n), Exception)}
    assert public <= set(corral.__all__)


def test_bundle_has_every_hardening_item(tmp_path):
    params = BundleParams(sandbox_id="sb-x", rootfs=tmp_path, agent_source=tmp_path, host_uid_base=1 << 20,
                          limits=Limits(memory="256M", cpus=0.5, pids=100, open_files=1000), token="t",
                          cgroups_path="/corral/sb-x", swap_limit=True)
    cfg = build_config(params)
    proc, linux = cfg["process"], cfg["linux"]
    assert proc["user"]["uid"] == 1000 and proc["noNewPrivileges"] is True
    assert all(v == [] for v in proc["capabilities"].values())
    assert {n["type"] for n in linux["namespaces"]} == {"pid", "ipc", "uts", "mount", "network", "user", "cgroup"}
    assert linux["uidMappings"] == [{"containerID": 0, "hostID": 1 << 20, "size": 65536}]
    res = linux["resources"]
    assert res["memory"] == {"limit": 256 * 2**20, "swap": 256 * 2**20}
    assert res["cpu"] == {"quota": 50_000, "period": 100_000} and res["pids"] == {"limit": 100}
    assert {"type": "RLIMIT_NOFILE", "hard": 1000, "soft": 1000} in proc["rlimits"]
    assert "/proc/kcore" in MASKED_PATHS and linux["seccomp"]["defaultAction"].startswith("SCMP_ACT_ERRNO")
    mounts = {m["destination"]: m for m in cfg["mounts"]}
    # /tmp and /dev/shm shrink to fit memory (256M) less 32M: shm 56M, tmp 168M.
    assert "ro" in mounts["/.corral/agent"]["options"] and "size=176160768" in mounts["/tmp"]["options"]
    assert sorted(e.split("=")[0] for e in proc["env"]) == ["CORRAL_AGENT_TOKEN", "LANG", "PATH"]


def test_tar_helpers_reject_garbage_archive(tmp_path):
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(file_access.FileError, match="not a valid tar"):
            archives._extract_safely(io.BytesIO(b"not a tar at all" * 100), archives._Dirs(root, str(tmp_path)),
                                     str(tmp_path))
    finally:
        os.close(root)
    assert list(tmp_path.iterdir()) == []
