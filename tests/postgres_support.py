"""A throwaway PostgreSQL cluster for a test session (tests/test_control_postgres.py, tests/test_replicas.py).

The cluster is made with `initdb` in a /var/tmp directory owned by the `postgres` user (PostgreSQL refuses to
run as root), listens on a Unix socket in that directory only (`listen_addresses = ''`), and is stopped and
removed when the session ends. CI installs PostgreSQL in `scripts/install`; without its binaries these tests fail
(they never skip).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_USER = "postgres"
DATABASE = "corral_test"



def _pg_bindir() -> Path:
    """The newest PostgreSQL server binaries: /usr/lib/postgresql/<version>/bin (Debian), else on PATH."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(re.sub(r"\D", "", p.parent.name)
                                                                                   or 0), reverse=True)
    on_path = [Path(found).parent for found in [shutil.which("initdb")] if found is not None]
    for candidate in [*debian, *on_path]:
        if (candidate / "initdb").is_file() and (candidate / "pg_ctl").is_file():
            return candidate
    pytest.fail("PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin or on PATH: "
                "install them with scripts/install (apt-get install postgresql)", pytrace=False)


class Cluster:
    """One PostgreSQL cluster in a temporary directory, reachable only through its Unix socket there."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="corral-pg-", dir="/var/tmp"))
        self.data = self.dir / "data"
        self.port = 5432  # only names the socket file (.s.PGSQL.5432 in self.dir): nothing listens on TCP
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam(PG_USER)
            except KeyError:
                pytest.fail(f"PostgreSQL refuses to run as root and there is no {PG_USER!r} user to run it as: "
                            f"install PostgreSQL with scripts/install", pytrace=False)
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            self._as_owner = ["runuser", "-u", PG_USER, "--"]
        self.dir.chmod(0o700)

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql+asyncpg://{PG_USER}@/{database}?host={self.dir}&port={self.port}"

    def start(self) -> None:
        self._run("initdb", "--pgdata", str(self.data), "--username", PG_USER, "--auth", "trust",
                  "--encoding", "UTF8", "--locale", "C", "--no-sync")
        settings = {"listen_addresses": "''", "unix_socket_directories": f"'{self.dir}'", "port": str(self.port),
                    # A throwaway cluster: durability buys nothing here and costs seconds.
                    "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
        self._run("pg_ctl", "--pgdata", str(self.data), "--log", str(self.dir / "server.log"), "--wait",
                  "--timeout", "60", "start")
        self.create_database(DATABASE)

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        self._run("createdb", "--host", str(self.dir), "--port", str(self.port), "--username", PG_USER, name)
        return self.url(name)

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "--pgdata", str(self.data), "--mode", "fast", "--wait", "--timeout", "60",
                          "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self) -> str:
        log = self.dir / "server.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else "(no server log)"

    def _run(self, program: str, *args: str) -> None:
        command = [*self._as_owner, str(self.bindir / program), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n"
                        f"{self.log_tail()}", pytrace=False)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    cluster = Cluster(_pg_bindir())
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
