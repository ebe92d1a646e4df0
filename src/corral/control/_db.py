"""The database connection: an async SQLAlchemy engine, sessions for reading and for writing, the schema.

SQLite (the default, embedded) gets WAL (readers never block the writer), foreign keys (off by default in
SQLite) and a busy timeout. Its driver's own transaction handling is replaced: Python's sqlite3 module starts a
transaction only before the first INSERT/UPDATE/DELETE, so a SELECT followed by an INSERT (a quota check, an
audit append) would not be one transaction. Here every transaction starts with an explicit BEGIN, and a write
transaction with BEGIN IMMEDIATE, which takes SQLite's write lock up front so two writers (even in two
processes) serialise instead of both reading the same state. Nothing else is SQLite-specific: queries are
plain portable SQLAlchemy, and PostgreSQL works by URL.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from .._settings import corral_home
from ._models import SCHEMA_VERSION, Base, SchemaVersionRow

_WRITE = "corral_write"  # execution option marking a write transaction
SQLITE_BUSY_TIMEOUT_MS = 10_000


def default_url(home: str | os.PathLike[str] | None = None) -> str:
    """`sqlite+aiosqlite:///<CORRAL_HOME>/corral.db`."""
    path = corral_home(home).absolute() / "corral.db"
    return f"sqlite+aiosqlite:///{path}"


class Database:
    """One engine and its session factory."""

    def __init__(self, url: str | URL) -> None:
        self.url = make_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.engine: AsyncEngine = create_async_engine(self.url)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        if self.is_sqlite:
            _prepare_sqlite(self.engine)

    async def start(self, now: datetime) -> None:
        """Create missing tables and record the schema version of a new database."""
        database = self.url.database if self.is_sqlite and self.url.database not in (None, "", ":memory:") else None
        if database is not None:
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            # Key hashes and the audit log: readable by root only. Created empty here so that SQLite (which
            # keeps an existing file's mode for its -wal and -shm companions) never makes it 0644.
            fd = os.open(database, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            os.chmod(database, 0o600)
        async with self.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with self.write() as session:
            if await session.scalar(select(SchemaVersionRow.version)) is None:
                session.add(SchemaVersionRow(id=1, version=SCHEMA_VERSION, created_at=now))

    async def schema_version(self) -> int | None:
        async with self.read() as session:
            return await session.scalar(select(SchemaVersionRow.version))

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A session for reads; its transaction (one consistent snapshot) is rolled back when it closes."""
        async with self._sessions() as session:
            yield session

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A write transaction, committed when the block ends without an exception."""
        async with self._sessions() as session, session.begin():
            # Bind the connection now, with the write marker, so BEGIN IMMEDIATE is what opens it.
            await session.connection(execution_options={_WRITE: True})
            yield session

    async def close(self) -> None:
        await self.engine.dispose()


def _prepare_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (see the module docstring)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: commits do not fsync (checkpoints do). A power cut can lose the last few commits but never
        # corrupts the database or forks the audit chain (what survives is a valid prefix); FULL cost every
        # audited request an fsync (~20 ms here), the larger part of an exec round trip through the API.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")
