"""Engines for the catalog database, and schema migration through Alembic.

Rules of this module:
- SQLite (the default) runs in WAL mode with a busy timeout and foreign keys on. Write
  transactions start with `BEGIN IMMEDIATE`, so concurrent writers queue on the busy
  timeout instead of failing when a read lock must be upgraded; read transactions start
  with a plain `BEGIN` and see one snapshot. A write may wait less (`BUSY_MS`): a
  standby's poll must not queue behind a leader hung while it holds the write lock.
- PostgreSQL is reached through psycopg 3. Read transactions run at REPEATABLE READ so a
  multi-statement read sees one snapshot; writes run at READ COMMITTED and take explicit
  row locks (see `_catalog.py`). A session idle inside a transaction for
  `IDLE_IN_TRANSACTION_MS` is ended by the server, so a client hung mid-transaction (a
  leader stopped by SIGSTOP) releases its locks and a standby's takeover goes on.
- The schema is created and upgraded only by Alembic (`migrations/`, found as the package
  resource "migrations:"; this module does not import it).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url

BUSY_TIMEOUT_MS = 30_000
BUSY_MS = "tandem_busy_ms"  # execution option: a write's busy timeout on SQLite, if not BUSY_TIMEOUT_MS
IDLE_IN_TRANSACTION_MS = 5_000
MIGRATIONS = "migrations:"
READ_ONLY = "tandem_read_only"  # execution option marking read transactions


def default_url(data_dir: str | Path) -> str:
    """The default catalog: `sqlite:///<data-dir>/catalog.db`."""
    return f"sqlite:///{Path(data_dir).resolve() / 'catalog.db'}"


def normalize_url(url: str | URL) -> URL:
    """`url` as an SQLAlchemy URL; a bare `postgresql://` gets the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL) -> Engine:
    """An engine with the transaction behaviour this module's docstring describes."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    # Added to the URL's own options (a search_path, say), which connect_args would replace.
    options = " ".join(filter(None, [parsed.query.get("options"), f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}"]))
    return create_engine(parsed.update_query_dict({"options": options}), pool_size=8, max_overflow=16)


def _use_wal(cursor: sqlite3.Cursor) -> None:
    """Put the database in WAL mode. The mode is kept in the file, so only its first
    openers switch it; the switch needs an exclusive lock, and when several first opens
    contend for it SQLite can answer "database is locked" despite the busy timeout
    (seen with three processes on a loaded machine): retry within the timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                return
            mode = cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        if mode != "wal":  # refused, not contended (a file system without shared memory, say)
            raise sqlite3.OperationalError(f"the catalog stayed in journal mode {mode}, not WAL")
        return


def _sqlite_engine(url: URL) -> Engine:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        raise ValueError(f"the catalog needs a SQLite file, not {database or 'memory'!r}")
    Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        # Take BEGIN away from the sqlite3 module: it would skip it for SELECTs.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        _use_wal(cursor)
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:  # type: ignore[no-untyped-def]
        options = connection.get_execution_options()
        busy_ms = options.get(BUSY_MS, BUSY_TIMEOUT_MS)
        if connection.info.get(BUSY_MS, BUSY_TIMEOUT_MS) != busy_ms:  # the pooled connection's setting
            connection.exec_driver_sql(f"PRAGMA busy_timeout={int(busy_ms)}")
            connection.info[BUSY_MS] = busy_ms
        connection.exec_driver_sql("BEGIN" if options.get(READ_ONLY, False) else "BEGIN IMMEDIATE")

    return engine


def read_only(engine: Engine) -> Engine:
    """A view of `engine` whose transactions read one consistent snapshot."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
    return engine.execution_options(**{READ_ONLY: True})


def alembic_config(connection: object | None = None) -> Config:
    """An Alembic configuration for the migrations package; with `connection`, env.py
    migrates over it instead of opening its own."""
    config = Config()
    config.set_main_option("script_location", MIGRATIONS)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"the migrations must have exactly one head, not {heads}")
    return heads[0]


def upgrade(engine: Engine) -> None:
    """Bring the schema to the head revision (a no-op when it is there already)."""
    head = head_revision()
    with read_only(engine).connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
        connection.rollback()
    if current == head:
        return
    with engine.connect() as connection:
        command.upgrade(alembic_config(connection), "head")
