"""Alembic environment of the Tandem catalog.

Rules:
- Online: over the connection in `config.attributes["connection"]` (Catalog.open), or
  over an engine made by `catalog.make_engine` from `-x url=...`, $TANDEM_CATALOG_URL or
  `sqlalchemy.url`, so the CLI gets the same SQLite pragmas as the catalog.
- SQLite: batch mode (`render_as_batch`), and foreign keys are off while migrating (a
  batch "move and copy" of a parent table must not cascade); violations are checked
  before commit. All revisions run in one transaction (`transactional_ddl`), whose
  `BEGIN IMMEDIATE` makes concurrent first opens migrate one at a time.
- PostgreSQL: one migration at a time per database, by a transaction-level advisory lock
  taken before the version table is read. The version table lives in the current
  schema (the first one on the search_path).
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, text

from catalog import make_engine
from catalog._models import Base

MIGRATION_LOCK = 0x74616E64656D  # "tandem": key of the advisory lock on PostgreSQL

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("TANDEM_CATALOG_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit("no catalog URL: pass -x url=... or set TANDEM_CATALOG_URL")
    return url


def _configure(**options: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        compare_server_default=True,
        **options,
    )


def _migrate(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Outside any transaction, or SQLite ignores it.
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
    try:
        # All revisions in one transaction, on SQLite too (Alembic's default there is one
        # per revision): the version is read under the write lock `BEGIN IMMEDIATE`
        # takes, and kept until the last revision commits. Per revision, a concurrent
        # first open could migrate between two of ours, and we then applied a revision
        # already applied (seen: "duplicate column name: strategy").
        _configure(connection=connection, render_as_batch=sqlite, transactional_ddl=True)
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                lock = text("SELECT pg_advisory_xact_lock(:key)")
                connection.execute(lock, {"key": MIGRATION_LOCK})
            context.run_migrations()
            if sqlite:
                violations = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
                if violations:
                    raise RuntimeError(f"the migration broke foreign keys: {violations}")
    finally:
        if sqlite:
            connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()


def run_offline() -> None:
    url = _url()
    _configure(url=url, literal_binds=True, render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
