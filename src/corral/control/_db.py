"""The database connection: an async SQLAlchemy engine, sessions for reading and for writing, the schema.

SQLite (the default, embedded) gets WAL (readers never block the writer), foreign keys (off by default in
SQLite) and a busy timeout. Its driver's own transaction handling is replaced: Python's sqlite3 module starts a
transaction only before the first INSERT/UPDATE/DELETE, so a SELECT followed by an INSERT (a quota check, an
audit append) would not be one transaction. Here every transaction starts with an explicit BEGIN, and a write
transaction with BEGIN IMMEDIATE, which takes SQLite's write lock up front so two writers (even in two
processes) serialise instead of both reading the same state. Nothing else is SQLite-specific: queries are
plain portable SQLAlchemy, and PostgreSQL works by URL (`postgresql+asyncpg://user@/db?host=/run/postgresql`).

One exception, for speed: `insert_now` (the audit append, once per request, on SQLite) is a single statement
committed on its own. Every SQLAlchemy call on SQLite is a hop to aiosqlite's worker thread (BEGIN, cursor,
execute, close, commit, the pool's reset: about 0.3 ms each here, twelve for an append), and even one hop costs
two thread switches (0.25 ms of an exec's round trip through the API). So the insert runs inline, on the event
loop's thread, on a plain `sqlite3` connection of its own: with WAL and synchronous=NORMAL a commit writes the
WAL without an fsync (about 40 us). Nothing there may block the loop: that connection never waits for the write
lock (busy timeout 0: a writer elsewhere, in this process or another, makes it answer SQLITE_BUSY at once, and the
insert, which did not happen, is sent on the held aiosqlite connection instead, which waits as every other writer
does), and it never checkpoints (`wal_autocheckpoint=0`: a checkpoint fsyncs). Every `_CHECKPOINT_EVERY` inline
inserts, the insert that made it that many waits for a passive checkpoint on the aiosqlite connection's thread
(the loop goes on; the appends after it wait for it, as they waited for SQLite's automatic checkpoint inside a
commit before). Awaited, not left running beside the appends: a checkpoint that new commits keep overtaking never
copies the whole WAL, and the WAL is only reused once one has. The record is committed before `insert_now`
returns either way, with the durability every other commit has.

`exclusive_write` is a write transaction that also excludes every other `exclusive_write` on the database, in
any process: SQLite's BEGIN IMMEDIATE already holds its only write lock; PostgreSQL takes a transaction-scoped
advisory lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import aiosqlite
from sqlalchemy import Table, event, insert, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL, Connection, Dialect, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from .._exceptions import ConflictError, InvalidRequestError, ServerError
from .._settings import corral_home
from ._models import SCHEMA_VERSION, Base, SchemaVersionRow

logger = logging.getLogger(__name__)

_WRITE = "corral_write"  # execution option marking a write transaction
SQLITE_BUSY_TIMEOUT_MS = 10_000
# Inline inserts between two passive checkpoints (module docstring). An audit record adds about 28 KiB to the WAL
# (its row and five indexes); SQLite's own automatic checkpoint comes at 1000 pages (4 MiB), about as often.
_CHECKPOINT_EVERY = 128
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6  # primary result codes (an extended code's low byte)
# Replicas starting together on one PostgreSQL database take this transaction-scoped advisory lock around
# CREATE TABLE, so only one of them creates the schema (an arbitrary constant: "corral" in ASCII).
_PG_SCHEMA_LOCK = 0x636F7272616C
# A URL without a driver gets the async one Corral ships with (`postgresql://...` means asyncpg).
_ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}


def default_url(home: str | os.PathLike[str] | None = None) -> str:
    """`sqlite+aiosqlite:///<CORRAL_HOME>/corral.db`."""
    path = corral_home(home).absolute() / "corral.db"
    return f"sqlite+aiosqlite:///{path}"


class Database:
    """One engine and its session factory."""

    def __init__(self, url: str | URL) -> None:
        self.url = _async_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.is_postgresql = self.url.get_backend_name() == "postgresql"
        try:
            self.engine: AsyncEngine = create_async_engine(self.url)
        except SQLAlchemyError as exc:  # an unknown dialect or driver, a sync driver
            raise InvalidRequestError(f"cannot use the database {self.safe_url}: {exc}") from exc
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self._inserts: dict[str, _SqliteInsert] = {}
        self._held: AsyncConnection | None = None  # SQLite: the connection insert_now waits on, and checkpoints
        self._held_lock = asyncio.Lock()
        self._inline: sqlite3.Connection | None = None  # SQLite: the loop thread's own, for inline inserts
        self._inline_inserts = 0
        if self.is_sqlite:
            _prepare_sqlite(self.engine)

    @property
    def safe_url(self) -> str:
        """The URL for messages and logs: no password."""
        return self.url.render_as_string(hide_password=True)

    @property
    def is_file_sqlite(self) -> bool:
        return self.is_sqlite and self.url.database not in (None, "", ":memory:")

    async def start(self, now: datetime) -> None:
        """Create missing tables and record the schema version of a new database."""
        try:
            await self._create_schema(now)
        except (SQLAlchemyError, OSError) as exc:  # unreachable server, refused login, missing database, ...
            raise ServerError(f"cannot open the control database {self.safe_url}: {exc}") from exc

    async def _create_schema(self, now: datetime) -> None:
        database = self.url.database if self.is_file_sqlite else None
        if database is not None:
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            # Key hashes and the audit log: readable by root only. Created empty here so that SQLite (which
            # keeps an existing file's mode for its -wal and -shm companions) never makes it 0644.
            fd = os.open(database, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            os.chmod(database, 0o600)
        async with self.engine.begin() as conn:
            if self.is_postgresql:
                await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_SCHEMA_LOCK})
            await conn.run_sync(Base.metadata.create_all)
            await conn.run_sync(add_missing_columns)
            if await conn.scalar(select(SchemaVersionRow.version)) is None:
                await conn.execute(insert(SchemaVersionRow).values(id=1, version=SCHEMA_VERSION, created_at=now))

    async def schema_version(self) -> int | None:
        async with self.read() as session:
            return await session.scalar(select(SchemaVersionRow.version))

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A session for reads; its transaction (one consistent snapshot) is rolled back when it closes. A database
        that fails (unreachable, lost) is `ServerError`: the callers' callers (the API, the egress proxy) answer
        that, not a driver's exception."""
        try:
            async with self._sessions() as session:
                yield session
        except (SQLAlchemyError, OSError) as exc:
            raise ServerError(f"reading the control database {self.safe_url} failed: {exc}") from exc

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A write transaction, committed when the block ends without an exception."""
        async with self._sessions() as session, session.begin():
            # Bind the connection now, with the write marker, so BEGIN IMMEDIATE is what opens it.
            await session.connection(execution_options={_WRITE: True})
            yield session

    @asynccontextmanager
    async def exclusive_write(self, lock_key: int) -> AsyncIterator[AsyncSession]:
        """A write transaction that excludes every other `exclusive_write(lock_key)`, in any process."""
        async with self.write() as session:
            if self.is_postgresql:
                await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock_key})
            yield session

    async def insert_now(self, table: Table, values: Mapping[str, Any]) -> None:
        """Insert one row in one statement committed on its own, on a SQLite file (`is_file_sqlite`) only.

        `ConflictError` if a unique key is taken. Callers that read before they insert (the audit chain's head)
        must expect it: nothing holds a lock between their read and this write.
        """
        if not self.is_file_sqlite:
            raise ServerError(f"insert_now is for SQLite files, not {self.url.get_backend_name()}")
        prepared = self._inserts.get(table.name)
        if prepared is None:
            prepared = self._inserts[table.name] = _SqliteInsert(table, self.engine.dialect)
        parameters = prepared.parameters(values)
        try:
            if self._insert_inline(prepared.sql, parameters):
                if self._inline_inserts % _CHECKPOINT_EVERY == 0:
                    await self._checkpoint()
                return
            driver = await self._held_driver()
            # The connection is in autocommit mode (see _prepare_sqlite): one statement, one transaction.
            await driver.execute(prepared.sql, parameters)
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a {table.name} row with this key exists") from exc
        except (sqlite3.Error, ValueError) as exc:  # ValueError: aiosqlite's "Connection closed"
            raise ServerError(f"could not write to the database: {exc}") from exc

    def _insert_inline(self, sql: str, parameters: tuple[Any, ...]) -> bool:
        """The insert, committed, on the loop's own connection; False (nothing written) if another writer holds
        the write lock. Never waits: see the module docstring."""
        con = self._inline
        if con is None:
            assert self.url.database is not None
            con = self._inline = _inline_connection(self.url.database)
        try:
            con.execute(sql, parameters)
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED):
                return False
            raise
        self._inline_inserts += 1
        return True

    async def _checkpoint(self) -> None:
        """Copy the WAL's pages into the database (and fsync it) off the loop's thread; PASSIVE: it waits for
        nobody, and a WAL still in use by a reader is checkpointed as far as it can be (the next one goes on).
        The insert before it is committed: a failure here only logs."""
        try:
            driver = await self._held_driver()
            await driver.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except (sqlite3.Error, ValueError, SQLAlchemyError) as exc:  # best effort: SQLite's own will do it later
            logger.warning("checkpointing the control database %s failed: %s", self.safe_url, exc)

    async def _held_driver(self) -> aiosqlite.Connection:
        async with self._held_lock:
            if self._held is None:
                self._held = await self.engine.connect()
            raw = await self._held.get_raw_connection()
        return cast(aiosqlite.Connection, raw.driver_connection)

    async def close(self) -> None:
        if self._inline is not None:
            inline, self._inline = self._inline, None
            inline.close()
        async with self._held_lock:
            held, self._held = self._held, None
        if held is not None:
            try:
                await held.close()
            except SQLAlchemyError:  # closing is best effort; dispose() below drops the pool anyway
                pass
        await self.engine.dispose()


def add_missing_columns(conn: Connection) -> list[str]:
    """Bring a database made by an older Corral up to the models: `create_all` adds missing tables, not
    missing columns of existing ones. Every column added since the first schema is nullable, so an
    `ALTER TABLE ... ADD COLUMN` (the same on SQLite and PostgreSQL) is the whole migration. Returns what it added.
    """
    inspector = sa_inspect(conn)
    added: list[str] = []
    for table in Base.metadata.sorted_tables:
        present = {column["name"] for column in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            if not column.nullable:
                raise ServerError(f"the control database lacks column {table.name}.{column.name}, which cannot be "
                                  "added to existing rows; migrate it by hand")
            kind = column.type.compile(dialect=conn.dialect)
            preparer = conn.dialect.identifier_preparer
            conn.execute(text(f"ALTER TABLE {preparer.quote(table.name)} "
                              f"ADD COLUMN {preparer.quote(column.name)} {kind}"))
            added.append(f"{table.name}.{column.name}")
    return added


class _SqliteInsert:
    """`INSERT INTO <table> (...) VALUES (?, ...)` compiled once, with each column's bind processor (UTC
    timestamps to SQLite's text form, JSON to text), so a row is stored exactly as SQLAlchemy would store it."""

    def __init__(self, table: Table, dialect: Dialect) -> None:
        compiled = insert(table).compile(dialect=dialect)
        self.sql = str(compiled)
        self._names: list[str] = list(compiled.positiontup or [])
        processors = {c.name: c.type.dialect_impl(dialect).bind_processor(dialect) for c in table.columns}
        self._processors: list[Callable[[Any], Any] | None] = [processors[n] for n in self._names]

    def parameters(self, values: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(process(values[name]) if process is not None else values[name]
                     for name, process in zip(self._names, self._processors, strict=True))


def _inline_connection(path: str) -> sqlite3.Connection:
    """A connection for inline inserts on the event loop's thread: autocommit, never waiting for a lock (timeout 0),
    never checkpointing, and durable like the others (WAL, synchronous=NORMAL; see `_prepare_sqlite`)."""
    con = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("PRAGMA foreign_keys=ON")
        con.execute("PRAGMA wal_autocheckpoint=0")
    except BaseException:
        con.close()
        raise
    return con


def _async_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InvalidRequestError(f"not a database URL: {exc}") from exc
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    return parsed.set(drivername=driver) if driver is not None else parsed


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
