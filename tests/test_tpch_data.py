"""The TPC-H generator and lineitem changes of `bench/tpch.py`.

Pure pyarrow, no Spark: the 22 queries themselves are run by
`python bench/tpch.py --check`. One SF 0.001 data set (1,500 orders, about 6,000
lines) is generated per module and shared.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from bench import tpch
from storage import parse_schema, to_batch

SF = 0.001


@pytest.fixture(scope="module")
def tables() -> dict[str, pa.Table]:
    return tpch.generate(SF, seed=0)


def ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def unique(table: pa.Table, keys: Sequence[str]) -> bool:
    return table.group_by(list(keys)).aggregate([]).num_rows == table.num_rows


def all_in(
    table: pa.Table, keys: Sequence[str], parent: pa.Table, parent_keys: Sequence[str]
) -> bool:
    """Every row's `keys` are some `parent` row's `parent_keys`."""
    renamed = parent.select(list(parent_keys)).rename_columns(list(keys))
    return table.join(renamed, keys=list(keys), join_type="left anti").num_rows == 0


def test_same_seed_same_bytes_other_seed_other_data(tables: dict[str, pa.Table]) -> None:
    again = tpch.generate(SF, seed=0)
    for name in tpch.TABLES:
        assert ipc_bytes(again[name]) == ipc_bytes(tables[name]), name
    other = tpch.generate(SF, seed=1)
    assert not other["lineitem"].equals(tables["lineitem"])


def test_cardinalities(tables: dict[str, pa.Table]) -> None:
    counts = {name: table.num_rows for name, table in tables.items()}
    assert list(counts) == list(tpch.TABLES)
    orders = counts.pop("orders")
    lines = counts.pop("lineitem")
    assert counts == {
        "region": 5, "nation": 25, "supplier": 10, "customer": 150, "part": 200,
        "partsupp": 800,
    }  # fmt: skip
    assert orders == 1_500
    # 1 to 7 lines an order, 4 on average.
    assert 3.8 * orders < lines < 4.2 * orders


def test_tables_have_their_source_schemas_and_storage_takes_them(
    tables: dict[str, pa.Table],
) -> None:
    for name, table in tables.items():
        table.validate(full=True)
        assert table.schema == parse_schema(tpch.SCHEMAS[name]), name
        # What the controller does to an appended table: it must pass unchanged.
        batch = to_batch(table, table.schema, default_time=0)
        assert batch.select(table.column_names).equals(table), name


def test_keys_are_unique_and_references_exist(tables: dict[str, pa.Table]) -> None:
    t = tables
    for name, keys in [
        ("region", ["r_regionkey"]),
        ("nation", ["n_nationkey"]),
        ("supplier", ["s_suppkey"]),
        ("customer", ["c_custkey"]),
        ("part", ["p_partkey"]),
        ("partsupp", ["ps_partkey", "ps_suppkey"]),
        ("orders", ["o_orderkey"]),
        ("lineitem", ["l_orderkey", "l_linenumber"]),
    ]:
        assert unique(t[name], keys), name
    assert all_in(t["nation"], ["n_regionkey"], t["region"], ["r_regionkey"])
    assert all_in(t["supplier"], ["s_nationkey"], t["nation"], ["n_nationkey"])
    assert all_in(t["customer"], ["c_nationkey"], t["nation"], ["n_nationkey"])
    assert all_in(t["partsupp"], ["ps_partkey"], t["part"], ["p_partkey"])
    assert all_in(t["partsupp"], ["ps_suppkey"], t["supplier"], ["s_suppkey"])
    assert all_in(t["orders"], ["o_custkey"], t["customer"], ["c_custkey"])
    assert all_in(t["lineitem"], ["l_orderkey"], t["orders"], ["o_orderkey"])
    assert all_in(t["orders"], ["o_orderkey"], t["lineitem"], ["l_orderkey"])
    assert all_in(
        t["lineitem"], ["l_partkey", "l_suppkey"], t["partsupp"], ["ps_partkey", "ps_suppkey"]
    )
    # Every part has 4 suppliers; a third of the customers (key divisible by 3) no order.
    per_part = t["partsupp"].group_by("ps_partkey").aggregate([("ps_suppkey", "count")])
    assert pc.all(pc.equal(per_part["ps_suppkey_count"], 4)).as_py()
    assert not pc.any(pc.equal(pc.remainder(t["orders"]["o_custkey"], 3), 0)).as_py()


def test_lines_follow_the_spec_rules(tables: dict[str, pa.Table]) -> None:
    orders = {row["o_orderkey"]: row for row in tables["orders"].to_pylist()}
    lines: dict[int, list[dict]] = {}
    current = dt.date(1995, 6, 17)
    for line in tables["lineitem"].to_pylist():
        lines.setdefault(line["l_orderkey"], []).append(line)
        ordered = orders[line["l_orderkey"]]["o_orderdate"]
        assert 1 <= (line["l_shipdate"] - ordered).days <= 121
        assert 30 <= (line["l_commitdate"] - ordered).days <= 90
        assert 1 <= (line["l_receiptdate"] - line["l_shipdate"]).days <= 30
        assert (line["l_returnflag"] == "N") == (line["l_receiptdate"] > current)
        assert line["l_returnflag"] in "RAN" and line["l_shipmode"] in tpch.SHIP_MODES
        assert (line["l_linestatus"] == "O") == (line["l_shipdate"] > current)
        assert 1 <= line["l_quantity"] <= 50 and 0 <= line["l_discount"] <= 0.1
    for key, order in orders.items():
        assert sorted(line["l_linenumber"] for line in lines[key]) == list(
            range(1, len(lines[key]) + 1)
        )
        assert len(lines[key]) <= 7
        statuses = {line["l_linestatus"] for line in lines[key]}
        assert order["o_orderstatus"] == (statuses.pop() if len(statuses) == 1 else "P")
        assert dt.date(1992, 1, 1) <= order["o_orderdate"] <= dt.date(1998, 8, 2)
    # A line costs quantity times its part's retail price.
    part = tables["part"]
    prices = dict(zip(part["p_partkey"].to_pylist(), part["p_retailprice"].to_pylist()))
    for line in tables["lineitem"].slice(0, 500).to_pylist():
        assert line["l_extendedprice"] == line["l_quantity"] * prices[line["l_partkey"]]


def test_values_the_queries_look_for(tables: dict[str, pa.Table]) -> None:
    t = tables
    assert t["region"]["r_name"].to_pylist() == list(tpch.REGIONS)
    assert "SAUDI ARABIA" in t["nation"]["n_name"].to_pylist()
    for name in ("supplier", "customer"):
        prefix = name[0]
        codes = pc.utf8_slice_codeunits(t[name][f"{prefix}_phone"], 0, 2).cast(pa.int64())
        assert pc.all(pc.equal(codes, pc.add(t[name][f"{prefix}_nationkey"], 10))).as_py()
    for words in t["part"]["p_name"].to_pylist():
        assert len(set(words.split())) == 5 and set(words.split()) <= set(tpch.COLORS)
    assert set(t["part"]["p_type"].to_pylist()) <= set(tpch.TYPES)
    assert set(t["part"]["p_container"].to_pylist()) <= set(tpch.CONTAINERS)
    assert pc.all(pc.match_substring_regex(t["part"]["p_brand"], r"^Brand#[1-5][1-5]$")).as_py()
    assert pc.sum(pc.match_like(t["orders"]["o_comment"], "%special%requests%")).as_py() > 0
    complaints = pc.match_like(t["supplier"]["s_comment"], "%Customer%Complaints%")
    assert pc.sum(complaints).as_py() == 1


@pytest.mark.parametrize("n", [100, 101])
def test_lineitem_change_retracts_existing_rows_and_inserts_consistent_ones(
    tables: dict[str, pa.Table], n: int
) -> None:
    lineitem = tables["lineitem"]
    change = tpch.lineitem_change(tables, n, seed=7)
    assert change.equals(tpch.lineitem_change(tables, n, seed=7))
    assert change.column_names == lineitem.column_names + ["_diff"]
    retracted = change.filter(pc.equal(change["_diff"], -1)).drop_columns(["_diff"])
    inserted = change.filter(pc.equal(change["_diff"], 1)).drop_columns(["_diff"])
    assert (retracted.num_rows, inserted.num_rows) == (n // 2, n - n // 2)
    # Retractions are distinct rows that exist, value for value.
    assert unique(retracted, retracted.column_names)
    assert all_in(retracted, retracted.column_names, lineitem, lineitem.column_names)
    assert all_in(inserted, ["l_orderkey"], tables["orders"], ["o_orderkey"])
    assert all_in(
        inserted, ["l_partkey", "l_suppkey"], tables["partsupp"], ["ps_partkey", "ps_suppkey"]
    )

    after = tpch.apply_change(tables, change)
    assert after["lineitem"].num_rows == lineitem.num_rows - n // 2 + (n - n // 2)
    assert after["lineitem"].schema == lineitem.schema
    assert unique(after["lineitem"], ["l_orderkey", "l_linenumber"])
    assert all(after[name] is tables[name] for name in tpch.TABLES if name != "lineitem")
    # A second change on top applies too: it only retracts rows of the new state.
    tpch.apply_change(after, tpch.lineitem_change(after, n, seed=8))


def test_apply_change_refuses_a_retraction_of_a_missing_row(tables: dict[str, pa.Table]) -> None:
    change = tpch.lineitem_change(tables, 2, seed=7)
    twice = pa.concat_tables([change.slice(0, 1), change.slice(0, 1)])  # one row, retracted twice
    with pytest.raises(ValueError, match="match exactly one"):
        tpch.apply_change(tables, twice)


def test_change_of_more_retractions_than_rows_keeps_counts_non_negative() -> None:
    small = tpch.generate(SF, seed=3)
    everything = small["lineitem"].num_rows
    change = tpch.lineitem_change(small, 2 * everything + 10, seed=1)
    after = tpch.apply_change(small, change)
    assert pc.sum(pc.equal(change["_diff"], -1)).as_py() == everything
    assert after["lineitem"].num_rows == everything + 10


class RecordingClient:
    """Stands in for `controller.client.Client`: records sources and appends."""

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}
        self.appends: list[tuple[str, pa.Table]] = []

    def create_source(self, name: str, schema: str) -> None:
        self.sources[name] = schema

    def append(self, source: str, rows: pa.Table) -> int:
        self.appends.append((source, rows))
        return len(self.appends)


def test_load_creates_the_sources_and_appends_in_batches(tables: dict[str, pa.Table]) -> None:
    client = RecordingClient()
    timestamps = tpch.load(client, tables, prefix="sf0001_", batch_rows=1_000)
    assert client.sources == {f"sf0001_{name}": ddl for name, ddl in tpch.SCHEMAS.items()}
    for name, table in tables.items():
        batches = [rows for source, rows in client.appends if source == f"sf0001_{name}"]
        assert all(batch.num_rows <= 1_000 for batch in batches)
        assert pa.concat_tables(batches).equals(table)
    assert timestamps["sf0001_lineitem"] == len(client.appends)


@pytest.mark.parametrize("rows", [0, 1, 2, 1_000])
def test_text_is_cut_from_the_pool_where_drawn(rows: int) -> None:
    # One cut, or cuts that happen to be adjacent, come out of Arrow as a slice of the
    # pool rather than a copy: the offset of that slice must be honoured.
    text = bytes(tpch._text_pool(0).to_pylist()).decode()
    draws = tpch._Draws(0, "test")  # the same stream: lengths first, then starts
    lengths, starts = draws.ints(rows, 10, 43), draws.ints(rows, 0, len(text) - 43)
    expected = [text[s : s + n] for s, n in zip(starts.to_pylist(), lengths.to_pylist())]
    cuts = tpch._Draws(0, "test").text(rows, 10, 43)
    cuts.validate(full=True)
    assert cuts.to_pylist() == expected
