"""Issue 11's "done when" on a real dockerd: the seeded eval sample and the whole `corral check` pass on
`corral serve --backend docker`, and what Docker cannot give is N/A with the reason, never a silent pass.

Both run against a real server on this machine (`ServerProcess(..., backend="docker")`), as tests/test_eval_live.py
and tests/test_check.py do on the local backend. Skipped, saying why, only when no Docker daemon answers; under CI
(CI=true) that is a failure (the helpers of tests/test_docker_backend.py). Template images this session imported
are removed at its end, unless CORRAL_TEST_KEEP_DOCKER_IMAGES=1 (importing the default template takes about a
minute, the polyglot one two).

Wall time here (2 CPUs, images already imported): the full 150-task sample takes about 150 s on Docker (sandbox
creates are not its bottleneck), so CI runs the same seeded sample as on the local backend, not a smaller one; the
whole checklist 140 to 230 s (117 s on the local backend). A fresh CI machine imports the two template images
once, about two minutes, before the first task's budget starts.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.check import CheckOptions, Target, checklist_tasks, run_check
from corral.eval import CAPABILITIES, RunResults, load_corpus, select
from corral.eval._deployment import local_capabilities
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, IN_CI, TEMPLATE_HOME, ci_sampled
from .test_docker_backend import KEEP_IMAGES, SHARED_CACHES, docker_client  # noqa: F401 - a fixture
from .test_eval_live import CI_SAMPLE, CI_SEED

pytestmark = [pytest.mark.docker, pytest.mark.slow,
              pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare "
                                                           "rootfs")]

TEMPLATE_REPOSITORY = "corral-template"


@pytest.fixture(scope="module")
def images(docker_client: Any) -> Iterator[None]:  # noqa: F811 - the fixture imported above
    """The template images the module's servers import are removed at its end (unless kept)."""
    before = {i["Id"] for i in docker_client.images(name=TEMPLATE_REPOSITORY)}
    yield
    if KEEP_IMAGES:
        return
    for image in docker_client.images(name=TEMPLATE_REPOSITORY):
        if image["Id"] not in before:
            try:
                docker_client.remove_image(image["Id"])
            except Exception as exc:  # in use by another session's sandbox: left to its own teardown
                print(f"image {image['RepoTags']} not removed: {exc}")


def _containers_of(client: Any, home_prefix: str) -> list[str]:
    return [c["Names"][0] for c in client.containers(all=True, filters={"label": "corral.backend=docker"})
            if (c.get("Labels") or {}).get("corral.home", "").startswith(home_prefix)]


# -- (a) the seeded sample -----------------------------------------------------------------------------------------

# The local backend's sample (tests/test_eval_live.py), the same seed; under CI 40 tasks of 40 families (CI's
# 45-minute budget, README "Development"): the full sample runs on the local backend there.
DOCKER_SAMPLE = ci_sampled("CORRAL_EVAL_SAMPLE_DOCKER", CI_SAMPLE, 40)


@pytest.mark.timeout(1500)
def test_the_ci_sample_passes_every_task_on_docker(tmp_path: Path, docker_client: Any,  # noqa: F811
                                                   images: None) -> None:
    out = tmp_path / "sample.jsonl"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "from corral.cli import main; main()", "eval", "run", "--local", "--backend",
         "docker", "--sample", str(DOCKER_SAMPLE), "--seed", str(CI_SEED), "--out", str(out)],
        capture_output=True, text=True, timeout=1400,
    )
    wall = time.monotonic() - started
    run = RunResults.load(out)
    failed = [f"{r.id}: {r.mode}: {r.failures[0].detail}" for r in run.results if r.status == "fail"]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + "\n" + proc.stderr[-3000:]
    assert run.complete and len(run.results) == DOCKER_SAMPLE
    chosen = select(load_corpus(), sample=DOCKER_SAMPLE, seed=CI_SEED)  # every family, with the full sample
    assert {r.family for r in run.results} == {t.family for t in chosen}
    # A task is skipped only for a capability this machine lacks (the polyglot template not built), with the
    # reason: nothing the Docker backend gives is taken away from the corpus.
    lacking = sorted(CAPABILITIES - local_capabilities())
    skipped = [r for r in run.results if r.status == "skip"]
    assert all(r.skip_reason and any(c in r.skip_reason for c in lacking) for r in skipped), \
        [(r.id, r.skip_reason) for r in skipped]
    assert run.header.get("base_url", "").startswith("http://127.0.0.1:")
    print(f"docker eval sample: {len(run.results)} tasks, {len(skipped)} skipped, {wall:.0f} s wall "
          f"({(run.end or {}).get('wall_seconds')} s of tasks)")
    # the private server and everything it ran are gone
    assert _containers_of(docker_client, "/var/tmp/corral-eval-") == []


# -- (b) the whole checklist ---------------------------------------------------------------------------------------


@pytest.fixture
def docker_server(docker_client: Any, images: None) -> Iterator[ServerProcess]:  # noqa: F811
    home = Path(tempfile.mkdtemp(prefix="corral-check-docker-", dir="/var/tmp"))
    home.chmod(0o755)
    # The agent's installed files and the golden disk images: the Docker tests' shared caches.
    for cache in ("agent", "cache"):
        (SHARED_CACHES / cache).mkdir(parents=True, exist_ok=True)
        (home / cache).symlink_to(SHARED_CACHES / cache)
    try:
        with ServerProcess(home, template_home=TEMPLATE_HOME, backend="docker") as srv:
            yield srv
        assert _containers_of(docker_client, str(home)) == []  # destroy_leftovers went through Docker
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.timeout(1500)
@pytest.mark.skipif(IN_CI and not os.environ.get("CORRAL_TEST_DOCKER_CHECKLIST"),
                    reason="under CI (its 45-minute budget, README 'Development'): the whole checklist runs on "
                           "the local backend there (tests/test_check.py); CORRAL_TEST_DOCKER_CHECKLIST=1 runs it "
                           "on Docker")
def test_the_whole_checklist_passes_or_says_why_not_on_docker(docker_server: ServerProcess) -> None:
    tasks = list(checklist_tasks())
    target = Target(url=docker_server.url, admin_key=docker_server.admin_key, home=docker_server.home)
    report = asyncio.run(run_check(target))
    print(f"docker checklist: {report.counts()} in {report.seconds:.0f} s")
    problems = [f"{i.number} {i.title}: {i.status}: {i.detail} (fix: {i.fix})" for i in report.items
                if i.status == "FAIL" or (i.status == "N/A" and not i.detail)]
    assert problems == [], "\n".join(problems)
    assert report.backend == "docker" and report.notes == [] and report.cleanup_problems == []
    assert report.exit_code == 0
    assert {t for i in report.items for t in i.tasks} == {t.id for t in tasks}  # every task ran, none skipped
    detail = {i.number: i.detail for i in report.items}
    status = {i.number: i.status for i in report.items}
    # What Docker cannot give: named, with its reason, on the items it touches, beside what still passes.
    assert status[31] == "PASS" and "not applicable here: gVisor on the docker backend: no gVisor" in detail[31]
    assert status[3] == "PASS" and "no per-sandbox user namespace" in detail[3]
    assert status[1] == "PASS" and "/.corral/run/agent.sock" in detail[1]
    # The host-side parts ran against the Docker backend itself.
    assert "refused no token, a guessed one and another sandbox's" in detail[2]
    assert "with a host canary" in detail[19]
    assert "with no Docker daemon at its socket (docker backend)" in detail[36] and \
        "runtime_unavailable" in detail[36], detail[36]
    assert status[36] == "PASS"
    # Secrets at egress and the keyed audit chain hold on Docker as on runc (docs/secrets.md, docs/audit.md).
    assert (status[37], status[38], status[39]) == ("PASS", "PASS", "PASS"), (detail[37], detail[38], detail[39])


@pytest.mark.timeout(900)
def test_ports_and_volumes_hold_on_docker_and_what_it_cannot_give_says_why(docker_server: ServerProcess) -> None:
    # Items 41 and 42 for real on Docker (its containers' ports through the server, its volumes' images under the
    # home); 40 needs runsc, which Docker does not run; 44 is Kubernetes' own.
    target = Target(url=docker_server.url, admin_key=docker_server.admin_key, home=docker_server.home)
    report = asyncio.run(run_check(target, CheckOptions(items=frozenset({40, 41, 42, 44}))))
    status = {i.number: (i.status, i.detail) for i in report.items}
    assert status[41][0] == "PASS" and "no credentials got 401" in status[41][1], status
    assert status[42][0] == "PASS" and "ENOSPC" in status[42][1] and "on the host its image took" in status[42][1]
    assert status[40][0] == "N/A" and "gVisor on the docker backend: no gVisor" in status[40][1], status
    assert status[44] == ("N/A", "Kubernetes Pods: the server runs the docker backend")
    assert report.exit_code == 0 and report.cleanup_problems == []
    assert list((docker_server.home / "volumes").iterdir()) == []


def test_the_server_names_its_backend(docker_server: ServerProcess) -> None:
    r = httpx.get(f"{docker_server.url}/v1/info", headers={"Authorization": f"Bearer {docker_server.admin_key}"})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["backend"] == "docker" and info["runtimes"] == ["runc"]
    assert set(info["limitations"]) == {"user_namespace", "agent_socket", "runtime_runsc", "root"}
    assert httpx.get(f"{docker_server.url}/v1/info").status_code == 401
