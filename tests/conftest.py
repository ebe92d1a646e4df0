"""Shared fixtures: a real engine on a throwaway state directory, sandboxes that are always destroyed, and a
leak check when the session ends (no mounts, runc containers, cgroups, loop devices or processes left)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from corral.backends.local import LocalBackend
from corral.egress import EgressProxy
from corral.engine import Engine, Limits, SandboxSession, SandboxSpec
from corral.templates import Template

# Templates are read from the real store (building one takes minutes); sandbox state goes to a test home.
TEMPLATE_HOME = Path(os.environ.get("CORRAL_TEST_TEMPLATE_HOME", os.environ.get("CORRAL_HOME", "/var/lib/corral")))
TEMPLATE = os.environ.get("CORRAL_TEST_TEMPLATE", "default")
DEV_ROOTFS = os.environ.get("CORRAL_TEST_ROOTFS")  # a bare rootfs instead of the store, for quick iteration
TEST_HOME = Path(f"/var/tmp/corral-test-{os.getpid()}")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def ci_sampled(variable: str, full: int, in_ci: int) -> int:
    """How many of a slow tier's cases run: `$variable` if set, else `in_ci` under CI (.ci/run sets CI=true: its
    45-minute budget, README "Tests"), else `full`."""
    value = os.environ.get(variable)
    return int(value) if value else in_ci if IN_CI else full
CGROUP_PARENT = f"corral-test-{os.getpid()}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _DevStore:
    """Serves a bare root filesystem (CORRAL_TEST_ROOTFS) as the one template, for quick iteration."""

    def get(self, name: str) -> Template:
        assert DEV_ROOTFS is not None
        if name != TEMPLATE:
            from corral import NotFoundError

            raise NotFoundError(f"no template {name!r}")
        return Template(name=name, digest="dev", rootfs=Path(DEV_ROOTFS), env={}, created_at=datetime.now(UTC),
                        size_bytes=0, source="debootstrap", spec={})


def template_store():  # type: ignore[no-untyped-def]
    if DEV_ROOTFS:
        return _DevStore()
    from corral.templates import TemplateStore

    store = TemplateStore(TEMPLATE_HOME)
    if not store.exists(TEMPLATE):
        pytest.fail(f"the {TEMPLATE!r} template is missing from {TEMPLATE_HOME}: build it first with "
                    f"`CORRAL_HOME={TEMPLATE_HOME} corral templates build {TEMPLATE}`", pytrace=False)
    return store


def make_engine(home: Path, **kwargs: object) -> Engine:
    backend = LocalBackend(home, cgroup_parent=CGROUP_PARENT)
    return Engine(home, backend=backend, templates=template_store(), **kwargs)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def engine_behind(home: Path, proxy: EgressProxy) -> AsyncIterator[Engine]:
    """A started engine whose sandboxes go out through `proxy` (started too); both closed, every sandbox destroyed."""
    await proxy.start()
    try:
        async with started_engine(home, egress=proxy) as engine:
            yield engine
    finally:
        await proxy.close()


@pytest.fixture
def test_home() -> Path:
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    return TEST_HOME


@contextlib.asynccontextmanager
async def started_engine(home: Path, **kwargs: object) -> AsyncIterator[Engine]:
    """A started engine (`make_engine`'s arguments) that destroys every sandbox it still has when the block ends."""
    eng = make_engine(home, **kwargs)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close(destroy_all=True)


@pytest.fixture
async def engine(test_home: Path) -> AsyncIterator[Engine]:
    async with started_engine(test_home) as eng:
        yield eng


@contextlib.asynccontextmanager
async def fake_started_engine(**kwargs: object) -> AsyncIterator[Engine]:
    """A started engine over `FakeBackend` (its agent: tests/fake_agent.py) in a fresh temp directory, closed
    with every sandbox destroyed and the directory removed: no runc, no template, no host process."""
    from .fakes import FakeBackend, FakeTemplates

    home = Path(tempfile.mkdtemp(prefix="corral-fake-"))  # short: agent sockets live here (108-byte limit)
    try:
        eng = Engine(home, backend=FakeBackend(home), templates=FakeTemplates(), **kwargs)  # type: ignore[arg-type]
        await eng.start()
        try:
            yield eng
        finally:
            await eng.close(destroy_all=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
async def fake_engine() -> AsyncIterator[Engine]:
    async with fake_started_engine() as eng:
        yield eng


@pytest.fixture
def front_engine(request: pytest.FixtureRequest) -> Engine:
    """The engine a front-end test runs on: a real one (runc) for a test marked `runc`, else the fake (the fast
    tier). Front-end files use this, so moving a test between tiers is its marker alone (or `on_both_engines`)."""
    real = getattr(request, "param", None) == "real" or request.node.get_closest_marker("runc") is not None
    engine: Engine = request.getfixturevalue("engine" if real else "fake_engine")
    return engine


# A front-end test whose behaviour includes the agent's (bytes, streams, limits, paths): it runs on the fake in the
# fast tier and on a real sandbox in the runc tier, so nothing tested on real sandboxes before leaves them.
on_both_engines = pytest.mark.parametrize(
    "front_engine", ["fake", pytest.param("real", marks=pytest.mark.runc)], indirect=True)


@pytest.fixture
async def sandbox(engine: Engine) -> AsyncIterator[SandboxSession]:
    sb = await engine.create(SandboxSpec(template=TEMPLATE))
    try:
        yield sb
    finally:
        if sb.id in {s.id for s in engine.list()}:
            await sb.destroy()


def spec(**limits: object) -> SandboxSpec:
    return SandboxSpec(template=TEMPLATE, limits=Limits(**limits))  # type: ignore[arg-type]


# -- the leak check ---------------------------------------------------------------------------------


def leaks(home: Path) -> list[str]:
    found: list[str] = []
    prefix = str(home).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if line.split()[4].startswith(prefix)]
    for runtime in ("runc", "runsc"):
        root = home / "runtime" / runtime
        if root.exists() and shutil.which(runtime):
            out = subprocess.run([runtime, "--root", str(root), "list", "-q"], capture_output=True, text=True)
            found += [f"{runtime} container {c}" for c in out.stdout.split()]
    sandboxes = home / "sandboxes"
    ids = {p.name for p in sandboxes.iterdir()} if sandboxes.exists() else set()
    found += [f"sandbox directory {i}" for i in ids]
    layers = home / "layers"  # snapshot layers: each goes with its last snapshot or sandbox
    found += [f"snapshot layer {p.name}" for p in layers.iterdir()] if layers.exists() else []
    cg = Path("/sys/fs/cgroup")
    for d in [cg / CGROUP_PARENT, *cg.glob(f"*/{CGROUP_PARENT}")]:
        if d.is_dir():
            found += [f"cgroup {c}" for c in d.iterdir() if c.is_dir()]
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True)
    found += [f"loop device {line.split(':')[0]}" for line in out.stdout.splitlines() if prefix in line]
    uid_base = 1 << 20
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                uid = proc.stat().st_uid
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            # A zombie holds nothing but its pid entry; reaping it is the host init's job (the runtime exited).
            if uid >= uid_base and state != "Z" and _ours(uid, uid_base, prefix):
                found.append(f"process {proc.name} (host uid {uid})")
    return found


def _ours(uid: int, uid_base: int, prefix: str) -> bool:
    """Is this host uid in a range that this session's sandboxes held (or that nobody holds any more)?

    Other engines on the machine (a server, another test run) own other slots; their sandboxes are theirs.
    """
    slot_file = Path("/run/corral/uid-slots") / str((uid - uid_base) // 65536)
    try:
        owner = slot_file.read_text()
    except OSError:
        return True  # a process in a released range: leaked by someone
    return owner.startswith(prefix)


def _remove_stale_cgroup_parents() -> None:
    """Empty cgroup parents of earlier test runs that were killed before their own cleanup."""
    for d in Path("/sys/fs/cgroup").glob("*/corral-test-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            for child in d.iterdir():
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()


@pytest.fixture(scope="session", autouse=True)
def leak_check() -> Iterator[None]:
    _remove_stale_cgroup_parents()
    yield
    if not TEST_HOME.exists():
        return
    found = leaks(TEST_HOME)
    if found:
        pytest.fail("sandboxes leaked: " + "; ".join(found[:20]), pytrace=False)
    shutil.rmtree(TEST_HOME, ignore_errors=True)
    for d in [Path("/sys/fs/cgroup") / CGROUP_PARENT, *Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}")]:
        if d.is_dir():
            d.rmdir()


# -- the fast tier's guard ------------------------------------------------------------------------------
# A test with none of these markers is in the fast tier (`./scripts/test --fast`: in-process, no runtime). One that
# starts a real sandbox anyway fails loudly, whichever run it is in, so that it cannot slow the fast tier down
# unnoticed: in-process, the real backends' create and boot refuse; in any subprocess it starts (a `corral serve`),
# `runc`, `runsc` and `docker` on PATH are shims that record the call, and the test fails at teardown.
REAL_MARKERS = ("runc", "runsc", "docker", "k8s_fake", "k8s", "slow")
_SHIM = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CORRAL_TEST_FAST_TIER_LOG"
echo "corral tests: $(basename "$0") ran in a fast-tier test (mark it runc, runsc or docker)" >&2
exit 97
"""


def in_fast_tier(node: pytest.Item) -> bool:
    return not any(node.get_closest_marker(name) is not None for name in REAL_MARKERS)


@pytest.fixture(scope="session")
def _runtime_shims(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shims = tmp_path_factory.mktemp("fast-tier-shims")
    for name in ("runc", "runsc", "docker"):
        (shims / name).write_text(_SHIM)
        (shims / name).chmod(0o755)
    return shims


def _refuse_real_backend(method: Callable[..., object], kind: str, hits: list[str]) -> object:
    @functools.wraps(method)  # the contract test reads the signature
    async def refuse(self: object, *args: object, **kwargs: object) -> object:
        hits.append(f"a real {kind} sandbox")  # failed at teardown too: a front may turn this into a 500
        pytest.fail(f"this test started a real {kind} sandbox but has no runc/runsc/docker marker: mark it, or run "
                    "it on the fake engine (`fake_engine`, `front_engine`)", pytrace=False)

    return refuse


class FastTierGuard:
    """What a fast-tier test ran of the real runtimes: refused backend calls, and shim invocations."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.hits: list[str] = []

    def calls(self) -> list[str]:
        return self.hits + (self.log.read_text().splitlines() if self.log.exists() else [])

    def forget(self) -> None:
        """For the guard's own tests, which trip it on purpose."""
        self.hits.clear()
        self.log.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory:
                     pytest.TempPathFactory) -> Iterator[FastTierGuard | None]:
    if not in_fast_tier(request.node):
        yield None
        return
    shims: Path = request.getfixturevalue("_runtime_shims")
    guard = FastTierGuard(tmp_path_factory.mktemp("fast-tier-log") / "calls")
    log, hits = guard.log, guard.hits
    monkeypatch.setenv("PATH", f"{shims}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("CORRAL_TEST_FAST_TIER_LOG", str(log))
    for method in ("create", "boot"):
        real = getattr(LocalBackend, method)
        monkeypatch.setattr(LocalBackend, method, _refuse_real_backend(real, "runc (LocalBackend)", hits))
    with contextlib.suppress(ImportError):  # corral[docker] is an extra
        from corral.backends.docker import DockerBackend

        for method in ("create", "boot"):
            real = getattr(DockerBackend, method)
            monkeypatch.setattr(DockerBackend, method, _refuse_real_backend(real, "Docker", hits))
    yield guard
    if calls := guard.calls():
        pytest.fail(f"this fast-tier test ran a container runtime ({'; '.join(calls[:3])}): mark it runc, runsc "
                    "or docker, or run it on the fake engine", pytrace=False)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]
