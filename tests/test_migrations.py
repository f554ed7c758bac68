"""Migrations: one head; down to base and up again with data in place; the models and
the migrations agree (Alembic's `check`, through the CLI and through compare_metadata);
concurrent first opens migrate once. On SQLite and PostgreSQL."""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, Integer, MetaData, inspect
from sqlalchemy.exc import IntegrityError
from workers import open_catalog

from catalog import Catalog, ControllerSpec, NewBatch, NewEvent, make_engine
from catalog._engine import alembic_config, head_revision
from catalog._models import NAMING_CONVENTION, Base
from history import Frontier, Import

ROOT = Path(__file__).resolve().parent.parent

TABLES = {t.name for t in Base.metadata.sorted_tables}


def cli_config(url: str) -> Config:
    """The configuration `alembic -x url=<url> ...` builds from alembic.ini."""
    config = Config(str(ROOT / "alembic.ini"))
    config.cmd_opts = argparse.Namespace(x=[f"url={url}"])
    return config


def differences(url: str, metadata: MetaData = Base.metadata) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "compare_server_default": True}
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def populate(url: str) -> None:
    """A row in every table."""
    with Catalog.open(url) as catalog:
        catalog.take_lead(ControllerSpec("c1", "127.0.0.1:6875", "h", 1, None), 5_000, lambda state: "started")
        catalog.register_standby(ControllerSpec("c2", "127.0.0.1:6877", "h", 2, "boot/9"))
        catalog.write_ts()
        catalog.create_instance("main")
        catalog.create_replica("main", "r1", size="s")
        source = catalog.create_source("orders", "id BIGINT")
        catalog.create_dataflow(
            "main",
            "idx",
            sql="SELECT * FROM o",
            imports=[Import("o", source.id)],
            schema="id BIGINT",
            as_of=Frontier(0),
            index_key=[],
        )
        catalog.append_batch(source.id, Frontier(0), Frontier(2), NewBatch("u1/a.parquet", 1, 9))
        catalog.acquire_read_hold(source.id, "h", Frontier(0))
        catalog.append_group(lambda ts, earlier: {source.id: NewBatch("u1/k.parquet", 1, 9)}, {"key-1": source.id})
        doomed = catalog.create_source("doomed", "id BIGINT")
        catalog.append_batch(doomed.id, Frontier(0), Frontier(2), NewBatch("u5/b.parquet", 1, 9))
        catalog.drop_source(doomed.id)  # retires its file
        catalog.record_events([NewEvent(1, "main", "replica_failed", "r1 lost its stream", replica="r1")])
        catalog.begin_reconfiguration("main", size="small", old=["r1"], new=["small_1"], deadline_ms=catalog.now_ms(), on_timeout="rollback")


def test_there_is_exactly_one_head() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    assert len(script.get_heads()) == 1
    assert script.get_heads() == [head_revision()]
    for revision in script.walk_revisions():
        assert revision.doc and "Why" in revision.module.__doc__, revision.revision
        assert Path(revision.path).name[:10].replace("_", "").isdigit()  # dated file names


def test_models_and_migrations_agree(catalog: Catalog, catalog_url: str) -> None:
    assert differences(catalog_url) == []


def test_the_comparison_sees_a_difference(catalog: Catalog, catalog_url: str) -> None:
    changed = MetaData(naming_convention=NAMING_CONVENTION)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(changed)
    changed.tables["instances"].append_column(Column("extra", Integer, nullable=True))
    found = differences(catalog_url, changed)
    assert [d[0] for d in found if isinstance(d, tuple)] == ["add_column"]


def test_alembic_check_through_the_cli(catalog: Catalog, catalog_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"url={catalog_url}", "check"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "No new upgrade operations detected" in result.stdout + result.stderr


def test_down_to_base_and_up_again_with_data_in_place(catalog_url: str) -> None:
    populate(catalog_url)
    engine = make_engine(catalog_url)
    with engine.connect() as connection:
        for table in Base.metadata.sorted_tables:
            assert connection.execute(table.select()).first() is not None, table.name
    engine.dispose()

    command.downgrade(cli_config(catalog_url), "base")
    assert tables(catalog_url) & TABLES == set()

    command.upgrade(cli_config(catalog_url), "head")
    assert TABLES <= tables(catalog_url)
    assert differences(catalog_url) == []
    with Catalog.open(catalog_url) as catalog:
        assert (catalog.controller_epoch(), catalog.read_ts()) == (0, 0)
        catalog.become_controller()
        assert catalog.create_source("orders", "id BIGINT").id == "u1"


PER_INSTANCE_INDEX_NAMES = "ed8674a1e99b"  # live names unique among storage only
DATAFLOW_STRATEGY = "5c1d2e7a9b30"  # dataflows record how they are maintained


def write_rows(url: str, rows: dict[str, list[dict[str, object]]]) -> None:
    """Insert `rows` (table name: rows, in foreign-key order) below the Catalog API, so
    they can be written at any revision whose tables still have these columns."""
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            for table, values in rows.items():
                connection.execute(Base.metadata.tables[table].insert(), values)
    finally:
        engine.dispose()


def collection(id: str, name: str, kind: str, **fields: object) -> dict[str, object]:
    namespace = "compute" if kind == "index" else "storage"
    row = {"id": id, "name": name, "namespace": namespace, "kind": kind, "schema": "id BIGINT"}
    return {"since": 0, "upper": 0, "dropped": False, "dataflow_id": None, **row, **fields}


def test_the_previous_revision_upgrades_with_its_data(catalog_url: str, dump) -> None:  # type: ignore[no-untyped-def]
    """A catalog written under globally unique index names keeps every row, and then
    lets a second instance have an index `totals`; storage names stay unique."""
    previous = ScriptDirectory.from_config(alembic_config()).get_revision(
        PER_INSTANCE_INDEX_NAMES
    )
    command.upgrade(cli_config(catalog_url), previous.down_revision)
    write_rows(
        catalog_url,
        {
            "instances": [
                {
                    "name": "main",
                    "spark_conf": {},
                    "min_in_sync": 1,
                    "max_lag_ms": 0,
                    "replica_timeout_ms": 1,
                    "parameters": {},
                }
            ],
            "dataflows": [
                {
                    "id": "u2",
                    "instance_name": "main",
                    "name": "totals",
                    "sql": "SELECT * FROM o",
                    "imports": [{"name": "o", "id": "u1", "kind": "storage"}],
                    "index_exports": [{"id": "u3", "key": ["id"]}],
                    "sink_id": "u4",
                    "schema": "id BIGINT",
                    "as_of": 0,
                    "until": None,
                    "compaction_window_ms": None,
                }
            ],
            "collections": [
                collection("u1", "orders", "source"),
                collection("u3", "totals", "index", dataflow_id="u2"),
                collection("u4", "totals", "materialized_view", dataflow_id="u2"),
                collection("u5", "totals", "index", since=None, dropped=True),
            ],
        },
    )
    engine = make_engine(catalog_url)
    with engine.begin() as connection:
        connection.execute(Base.metadata.tables["id_allocator"].update().values(next_id=6))
    engine.dispose()
    before = dump()

    command.upgrade(cli_config(catalog_url), PER_INSTANCE_INDEX_NAMES)
    assert dump() == before
    command.upgrade(cli_config(catalog_url), "head")
    assert differences(catalog_url) == []
    with Catalog.open(catalog_url) as catalog:
        catalog.become_controller()
        assert catalog.dataflow_by_name("main", "totals").index_id == "u3"
        assert catalog.collection_by_name("totals").id == "u4"
        assert len(catalog.recover_history("main")) == 4  # instance, dataflow, schedule, done
        catalog.create_instance("other")
        theirs = catalog.create_dataflow(
            "other",
            "totals",
            sql="SELECT * FROM o",
            imports=[Import("o", "u1")],
            schema="id BIGINT",
            as_of=Frontier(0),
            index_key=["id"],
        )
        assert catalog.dataflow_by_name("other", "totals").index_id == theirs.index_id == "u7"
    # The storage half of the new index, below the catalog's own checks.
    with pytest.raises(IntegrityError):
        write_rows(catalog_url, {"collections": [collection("u99", "orders", "source")]})


def test_the_downgrade_waits_until_index_names_are_unique_again(catalog_url: str, dump) -> None:  # type: ignore[no-untyped-def]
    with Catalog.open(catalog_url) as catalog:
        catalog.become_controller()
        source = catalog.create_source("orders", "id BIGINT")
        shared = []
        for instance in ("main", "other"):
            catalog.create_instance(instance)
            shared.append(
                catalog.create_dataflow(
                    instance,
                    "totals",
                    sql="SELECT * FROM o",
                    imports=[Import("o", source.id)],
                    schema="id BIGINT",
                    as_of=Frontier(0),
                    index_key=[],
                )
            )
    previous = ScriptDirectory.from_config(alembic_config()).get_revision(
        PER_INSTANCE_INDEX_NAMES
    )
    command.downgrade(cli_config(catalog_url), PER_INSTANCE_INDEX_NAMES)
    before = dump()
    with pytest.raises(RuntimeError, match=r"indexes named \['totals'\]"):
        command.downgrade(cli_config(catalog_url), previous.down_revision)
    assert dump() == before

    with Catalog.open(catalog_url) as catalog:
        catalog.become_controller()
        catalog.drop_dataflow(shared[1].id)
    command.downgrade(cli_config(catalog_url), previous.down_revision)
    # The old index is back: live index names are unique across instances again.
    with pytest.raises(IntegrityError):
        write_rows(catalog_url, {"collections": [collection("u99", "totals", "index")]})
    command.upgrade(cli_config(catalog_url), "head")
    assert differences(catalog_url) == []
    with Catalog.open(catalog_url) as catalog:
        assert catalog.dataflow_by_name("main", "totals").index_id == shared[0].index_id


def test_open_upgrades_an_empty_database_and_then_does_nothing(catalog_url: str) -> None:
    with Catalog.open(catalog_url):
        pass
    engine = make_engine(catalog_url)
    with engine.connect() as connection:
        assert MigrationContext.configure(connection).get_current_revision() == head_revision()
    engine.dispose()
    populate(catalog_url)
    with Catalog.open(catalog_url) as again:
        assert [i.name for i in again.list_instances()] == ["main"]


def test_concurrent_first_opens_migrate_once(catalog_url: str) -> None:
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 2  # after every process has started and imported
    with context.Pool(3) as pool:
        epochs = pool.starmap(open_catalog, [(catalog_url, start_at)] * 3)
    assert epochs == [0, 0, 0]
    assert differences(catalog_url) == []


def test_the_schema_is_never_made_with_create_all() -> None:
    for package in ("catalog", "storage", "migrations"):
        for path in (ROOT / package).rglob("*.py"):
            assert "create_all" not in path.read_text(), path


@pytest.fixture(autouse=True)
def _quiet_alembic(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="alembic")


def test_dataflows_from_before_strategies_upgrade_as_recomputed(catalog_url: str) -> None:
    command.upgrade(cli_config(catalog_url), PER_INSTANCE_INDEX_NAMES)
    write_rows(
        catalog_url,
        {
            "instances": [
                {"name": "main", "spark_conf": {}, "min_in_sync": 1, "max_lag_ms": 0, "replica_timeout_ms": 1, "parameters": {}}
            ],
            "collections": [collection("u1", "orders", "source")],
            "dataflows": [
                {
                    "id": "u2",
                    "instance_name": "main",
                    "name": "totals",
                    "sql": "SELECT * FROM orders",
                    "imports": [{"name": "orders", "id": "u1", "kind": "storage"}],
                    "index_exports": [{"id": "u3", "key": ["id"]}],
                    "sink_id": None,
                    "schema": "id BIGINT",
                    "as_of": 0,
                    "until": None,
                    "compaction_window_ms": None,
                }
            ],
        },
    )
    command.upgrade(cli_config(catalog_url), DATAFLOW_STRATEGY)
    with Catalog.open(catalog_url) as catalog:
        info = catalog.dataflow_by_name("main", "totals")
        assert info.strategy == "recompute: created before incremental maintenance"
        assert info.description().strategy == "recompute"
    command.downgrade(cli_config(catalog_url), PER_INSTANCE_INDEX_NAMES)
    assert differences(catalog_url) != []  # the models are ahead of this revision again


READ_HOLD_OWNERS = "58e69b8e9a58"  # every read hold names its owner


def test_existing_holds_get_their_owners_from_their_names_and_the_leaked_ones_are_removable(catalog_url: str) -> None:
    """Holds recorded before owners existed are classified by their holder names; a
    dropped dataflow's leaked input hold and a feed of the last controller then count as
    orphans, which the next controller removes."""
    previous = ScriptDirectory.from_config(alembic_config()).get_revision(READ_HOLD_OWNERS)
    command.upgrade(cli_config(catalog_url), previous.down_revision)
    engine = make_engine(catalog_url)
    with engine.begin() as connection:
        connection.execute(Base.metadata.tables["controller_epoch"].update().values(epoch=4))
    engine.dispose()
    write_rows(
        catalog_url,
        {
            "collections": [
                collection("u1", "orders", "source"),
                collection("u3", "totals", "index", since=None, dropped=True),  # its dataflow dropped
                collection("u4", "view", "materialized_view"),
            ],
            "read_holds": [
                {"collection_id": "u1", "holder": "tandem/retention", "frontier": 0},
                {"collection_id": "u1", "holder": "main/u3", "frontier": 0},
                {"collection_id": "u1", "holder": "subscribe:abc", "frontier": 0},
                {"collection_id": "u1", "holder": "tool", "frontier": 0},
                {"collection_id": "u4", "holder": "u2/sink", "frontier": 0},
            ],
        },
    )
    command.upgrade(cli_config(catalog_url), "head")
    assert differences(catalog_url) == []
    with Catalog.open(catalog_url) as catalog:
        owners = {(h.collection_id, h.holder): str(h.owner) for h in catalog.list_holds()}
        assert owners == {
            ("u1", "tandem/retention"): "retention",
            ("u1", "main/u3"): "dataflow of u3",
            ("u1", "subscribe:abc"): "feed of controller epoch 4",
            ("u1", "tool"): "caller",
            ("u4", "u2/sink"): "dataflow of u4",
        }
        catalog.become_controller()
        removed = catalog.remove_orphaned_holds(frozenset)
        assert sorted(h.holder for h in removed) == ["main/u3", "subscribe:abc"]
        assert {h.holder for h in catalog.list_holds()} == {"tandem/retention", "tool", "u2/sink"}
    command.downgrade(cli_config(catalog_url), previous.down_revision)
    engine = make_engine(catalog_url)
    try:
        assert "owner" not in {c["name"] for c in inspect(engine).get_columns("read_holds")}
    finally:
        engine.dispose()
