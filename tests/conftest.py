"""Shared fixtures: every catalog and storage test runs on SQLite and on PostgreSQL.

`catalog_url` is parametrized over `sqlite` (a file in the test's tmp_path) and
`postgres` (a fresh schema `t_<random>` per test, put first on the search_path through
the URL's `options`, so the Alembic version table lands there too; dropped afterwards).
The PostgreSQL server is `$TANDEM_TEST_POSTGRES_URL`, by default
postgresql+psycopg://postgres@127.0.0.1:5432/test. If it cannot be reached the postgres
tests are skipped locally, and fail when `$CI` is set: a skipped PostgreSQL run in CI is
a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):  # packages at the root, uninstalled; tests/workers.py
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

if TYPE_CHECKING:
    from catalog import Catalog
    from storage import Storage

# SQLAlchemy, the catalog and storage are imported inside the fixtures, so tests that
# need none of them (history's, which check what history imports) load none of them.

def pytest_configure(config: pytest.Config) -> None:
    """Make the JVM class archive before any test launches a JVM: once per machine
    (about 40 s), and every JVM of the suite then starts in about half the time
    (replica_service/_class_archive.py). Done by xdist's controller (or the one process
    of `-n 0`), in a subprocess: this process imports nothing for it."""
    if not hasattr(config, "workerinput"):
        subprocess.run([sys.executable, "-m", "replica_service._class_archive"], cwd=ROOT, check=False)


@pytest.fixture(scope="session", autouse=True)
def jvm_before_grpc(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Launch this process's JVM before any test opens a gRPC channel, when a test that
    starts Spark in this process is selected. Launching it (a fork with PySpark's
    preexec_fn) while gRPC's threads run sometimes makes the JVM exit before it reports
    its port, which is why the replica and the controller launch theirs first too. Later
    sessions reuse the JVM: a stopped SparkContext leaves its gateway in place."""
    if not any(item.get_closest_marker("spark") for item in request.session.items):
        return
    from pyspark import SparkConf, SparkContext

    from replica_service import _spark

    settings, work_dir = _spark.SparkSettings("local[1]"), tmp_path_factory.mktemp("jvm")
    gateway = _spark.launch_jvm(settings, work_dir)
    if gateway is not None:
        SparkContext(conf=SparkConf().setAll(_spark.session_conf(settings, work_dir).items()), gateway=gateway).stop()


POSTGRES_URL = os.environ.get(
    "TANDEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
_postgres_problem: list[str | None] = []  # memo: [None] reachable, [reason] not


def _postgres_unreachable() -> str | None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    if not _postgres_problem:
        engine = create_engine(
            POSTGRES_URL, poolclass=NullPool, connect_args={"connect_timeout": 5}
        )
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            _postgres_problem.append(None)
        except Exception as error:  # any failure to connect means "unreachable"
            _postgres_problem.append(f"{type(error).__name__}: {error}".splitlines()[0])
        finally:
            engine.dispose()
    return _postgres_problem[0]


def require_postgres() -> None:
    problem = _postgres_unreachable()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"PostgreSQL at {POSTGRES_URL} is required in CI but unreachable: {problem}")
    pytest.skip(f"PostgreSQL at {POSTGRES_URL} is unreachable: {problem}")


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A catalog URL on a fresh PostgreSQL schema, dropped on exit."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(POSTGRES_URL, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    base = make_url(POSTGRES_URL)
    options = " ".join(filter(None, [base.query.get("options"), f"-csearch_path={schema}"]))
    url = base.update_query_dict({"options": options}).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (no schema yet) of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
    else:
        with postgres_schema() as url:
            yield url


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    """A migrated catalog that has not become controller (as a replica opens it)."""
    from catalog import Catalog

    opened = Catalog.open(catalog_url)
    yield opened
    opened.close()


@pytest.fixture
def controller(catalog_url: str) -> Iterator[Catalog]:
    """A migrated catalog that became controller."""
    from catalog import Catalog

    opened = Catalog.open(catalog_url)
    opened.become_controller()
    yield opened
    opened.close()


@pytest.fixture
def blob_dir(tmp_path: Path) -> Path:
    return tmp_path / "blobs"


@pytest.fixture
def storage(controller: Catalog, blob_dir: Path) -> Storage:
    """Storage through the controller's catalog."""
    from storage import Storage

    return Storage(controller, blob_dir)


def dump_database(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every catalog table as the database has it now (at any revision),
    sorted: equal dumps mean nothing was written."""
    from sqlalchemy import MetaData, select

    from catalog import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            tables = MetaData()
            tables.reflect(bind=connection)
            return {
                table.name: sorted(
                    (tuple(row) for row in connection.execute(select(table))), key=repr
                )
                for table in tables.sorted_tables
                if table.name != "alembic_version"
            }
    finally:
        engine.dispose()


@pytest.fixture
def dump(catalog_url: str):  # type: ignore[no-untyped-def]
    """`dump()` returns every row of the test's catalog (see `dump_database`)."""
    return lambda: dump_database(catalog_url)
