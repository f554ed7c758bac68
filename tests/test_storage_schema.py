"""Storage schemas (Spark DDL <-> Arrow) and the checking of rows against them.

Pure: no database. Round trips and the agreement of the two input paths (rows and Arrow
tables) are properties, checked with hypothesis.
"""

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog import InvalidArgument
from storage import file_schema, normalize_ddl, parse_schema, schema_to_ddl, to_batch

UTC = dt.UTC


def test_every_supported_type() -> None:
    schema = parse_schema(
        "a BOOLEAN, b TINYINT, c SMALLINT, d INT, e INTEGER, f BIGINT, g LONG, h FLOAT, "
        "i REAL, j DOUBLE, k DECIMAL(12,3), l STRING, m VARCHAR(5), n CHAR(2), o DATE, "
        "p TIMESTAMP, q TIMESTAMP_NTZ, r BINARY, s decimal, t numeric(7), u byte, v short"
    )
    assert [f.type for f in schema] == [
        pa.bool_(),
        pa.int8(),
        pa.int16(),
        pa.int32(),
        pa.int32(),
        pa.int64(),
        pa.int64(),
        pa.float32(),
        pa.float32(),
        pa.float64(),
        pa.decimal128(12, 3),
        pa.string(),
        pa.string(),
        pa.string(),
        pa.date32(),
        pa.timestamp("us", tz="UTC"),
        pa.timestamp("us"),
        pa.binary(),
        pa.decimal128(10, 0),
        pa.decimal128(7, 0),
        pa.int8(),
        pa.int16(),
    ]
    assert all(f.nullable for f in schema)
    assert schema_to_ddl(schema) == (
        "a BOOLEAN, b TINYINT, c SMALLINT, d INT, e INT, f BIGINT, g BIGINT, h FLOAT, "
        "i FLOAT, j DOUBLE, k DECIMAL(12,3), l STRING, m VARCHAR(5), n CHAR(2), o DATE, "
        "p TIMESTAMP, q TIMESTAMP_NTZ, r BINARY, s DECIMAL(10,0), t DECIMAL(7,0), "
        "u TINYINT, v SMALLINT"
    )


def test_not_null_and_quoted_names() -> None:
    schema = parse_schema("  id  bigint  not   null ,`odd, name` STRING,`tick``s` INT NOT NULL")
    assert schema.names == ["id", "odd, name", "tick`s"]
    assert [f.nullable for f in schema] == [False, True, False]
    assert schema_to_ddl(schema) == "id BIGINT NOT NULL, `odd, name` STRING, `tick``s` INT NOT NULL"


@pytest.mark.parametrize(
    ("ddl", "message"),
    [
        ("", "at least one column"),
        ("id", "'id' has no type"),
        ("id BIGINT,", "column 2 is empty"),
        ("id BIGINT,, x INT", "column 2 is empty"),
        ("id MAP<STRING, INT>", "nested types"),
        ("id ARRAY<INT>", "nested types"),
        ("id UUID", "unsupported type UUID"),
        ("id INT, ID BIGINT", "'ID' appears twice"),
        ("_time BIGINT", "reserved"),
        ("x INT, _DIFF INT", "reserved"),
        ("x DECIMAL(39,0)", "precision"),
        ("x DECIMAL(5,6)", "scale"),
        ("x DECIMAL(a,b)", "integer arguments"),
        ("x VARCHAR", "needs a length"),
        ("x CHAR(0)", "needs a length"),
        ("x INT(4)", "takes no arguments"),
        ("x INT NULL", "cannot read the type"),
        ("x INT NOT NULL DEFAULT 1", "cannot read the type"),
        ("1x INT", "does not start with a column name"),
        ("`` INT", "empty column name"),
        ("`x INT", "unterminated backquote"),
        ("x DECIMAL(5,2", "unbalanced"),
        ("x INT)", "unbalanced"),
    ],
)
def test_bad_schemas_are_refused_with_the_reason(ddl: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_schema(ddl)


_TYPES = st.sampled_from(
    [
        "BOOLEAN",
        "tinyint",
        "SMALLINT",
        "Int",
        "INTEGER",
        "BIGINT",
        "LONG",
        "FLOAT",
        "REAL",
        "DOUBLE",
        "DECIMAL(10,2)",
        "DECIMAL(38,38)",
        "DEC(1)",
        "STRING",
        "VARCHAR(3)",
        "CHAR(9)",
        "DATE",
        "TIMESTAMP",
        "TIMESTAMP_LTZ",
        "TIMESTAMP_NTZ",
        "BINARY",
    ]
)
_NAMES = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=8,
).filter(lambda n: n.strip() == n and n.lower() not in ("_time", "_diff"))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(_NAMES, _TYPES, st.booleans()),
        min_size=1,
        max_size=6,
        unique_by=lambda c: c[0].lower(),
    )
)
def test_ddl_round_trips_through_arrow(columns: list[tuple[str, str, bool]]) -> None:
    ddl = ", ".join(
        f"`{name.replace('`', '``')}` {type_}{' NOT NULL' if not_null else ''}"
        for name, type_, not_null in columns
    )
    schema = parse_schema(ddl)
    assert schema.names == [name for name, _, _ in columns]
    assert [not f.nullable for f in schema] == [not_null for _, _, not_null in columns]
    normal = schema_to_ddl(schema)
    assert parse_schema(normal).equals(schema, check_metadata=True)
    assert normalize_ddl(normal) == normal


# --- Rows against a schema -----------------------------------------------------------

ALL = parse_schema(
    "b BOOLEAN, i8 TINYINT, i32 INT NOT NULL, f FLOAT, d DOUBLE, dec DECIMAL(5,2), "
    "s STRING, v VARCHAR(3), c CHAR(3), day DATE, ts TIMESTAMP, ntz TIMESTAMP_NTZ, bin BINARY"
)
GOOD = {
    "b": True,
    "i8": -128,
    "i32": 7,
    "f": 1,
    "d": 2.5,
    "dec": decimal.Decimal("123.45"),
    "s": "héllo",
    "v": "abc",
    "c": "a",
    "day": dt.date(2024, 2, 29),
    "ts": dt.datetime(2024, 1, 1, 12, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    "ntz": dt.datetime(2024, 1, 1, 12),
    "bin": b"\x00\x01",
}


def test_good_rows_become_a_batch() -> None:
    batch = to_batch([GOOD, {"i32": 1, "_diff": -1}], ALL, default_time=42)
    assert batch.schema.names == [*ALL.names, "_time", "_diff"]
    first, second = batch.to_pylist()
    assert first["c"] == "a  "  # CHAR is padded, as Spark stores it
    assert first["f"] == 1.0 and first["dec"] == decimal.Decimal("123.45")
    assert first["ts"] == dt.datetime(2024, 1, 1, 10, tzinfo=UTC)
    assert (first["_time"], first["_diff"]) == (42, 1)
    assert second["b"] is None and (second["_time"], second["_diff"]) == (42, -1)


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("b", 1, "expected a bool"),
        ("i8", True, "expected an int"),
        ("i8", 128, r"out of range \[-128, 127\]"),
        ("i32", 2.0, "expected an int"),
        ("i32", None, "NOT NULL.*missing or null"),
        ("f", "1.0", "expected a float"),
        ("f", 1e39, "out of range for FLOAT"),
        ("dec", 1.5, "expected a decimal.Decimal"),
        ("dec", decimal.Decimal("1.234"), "more than 2 digits after the point"),
        ("dec", 1000, "more than 3 digits before the point"),
        ("dec", decimal.Decimal("NaN"), "finite"),
        ("s", b"x", "expected a str"),
        ("v", "abcd", "longer than 3 characters"),
        ("c", "abcd", "longer than 3 characters"),
        ("day", dt.datetime(2024, 1, 1), "expected a datetime.date"),
        ("ts", dt.date(2024, 1, 1), "expected a datetime.datetime"),
        ("ntz", dt.datetime(2024, 1, 1, tzinfo=UTC), "naive"),
        ("bin", "x", "expected bytes"),
    ],
)
def test_a_bad_value_refuses_the_batch_naming_column_and_row(
    column: str, value: object, message: str
) -> None:
    rows = [GOOD, GOOD, {**GOOD, column: value}]
    with pytest.raises(InvalidArgument, match=f"row index 2: column '{column}'.*{message}"):
        to_batch(rows, ALL, default_time=0)


def test_row_shapes_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="row index 1: unknown column 'nope'"):
        to_batch([GOOD, {**GOOD, "nope": 1}], ALL, default_time=0)
    with pytest.raises(InvalidArgument, match="row index 0: column '_time' is not allowed"):
        to_batch([{**GOOD, "_time": 3}], ALL, default_time=0, allow_time=False)
    with pytest.raises(InvalidArgument, match="row index 0: column '_diff'.*expected an int"):
        to_batch([{**GOOD, "_diff": 1.0}], ALL, default_time=0)
    with pytest.raises(InvalidArgument, match="row index 0: expected a mapping"):
        to_batch([("a", 1)], ALL, default_time=0)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="sequence of row mappings"):
        to_batch(GOOD, ALL, default_time=0)  # type: ignore[arg-type]


# --- Arrow tables against a schema ---------------------------------------------------


def test_tables_are_cast_losslessly() -> None:
    schema = parse_schema("id INT NOT NULL, amount DECIMAL(6,2), at TIMESTAMP, name STRING")
    table = pa.table(
        {
            "name": pa.array(["a", "b"]).dictionary_encode(),
            "id": pa.array([1, 2], pa.uint8()),
            "amount": pa.array([3, 4], pa.int64()),
            "at": pa.array([0, 1_000], pa.timestamp("ms", tz="Asia/Tokyo")),
            "_time": pa.array([5, 6], pa.int32()),
        }
    )
    batch = to_batch(table, schema, default_time=0)
    assert batch.schema == file_schema(schema)
    assert batch.schema.names == ["id", "amount", "at", "name", "_time", "_diff"]
    assert batch["amount"].to_pylist() == [decimal.Decimal("3.00"), decimal.Decimal("4.00")]
    assert batch["at"].to_pylist()[1] == dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert batch["_time"].to_pylist() == [5, 6] and batch["_diff"].to_pylist() == [1, 1]


@pytest.mark.parametrize(
    ("schema", "table", "message"),
    [
        (
            "x INT",
            {"x": pa.array([1, 2**31, 3], pa.int64())},
            "row index 1: column 'x'.*does not fit",
        ),
        ("x INT", {"x": pa.array([1.0])}, "cannot take Arrow type double"),
        ("x DOUBLE", {"x": pa.array(["1"])}, "cannot take Arrow type string"),
        ("x DECIMAL(3,1)", {"x": pa.array([1.5])}, "cannot take Arrow type double"),
        ("x DECIMAL(3,1)", {"x": pa.array([1, 2, 100])}, "row index 2"),
        ("x TIMESTAMP_NTZ", {"x": pa.array([0], pa.timestamp("us", tz="UTC"))}, "cannot take"),
        ("x TIMESTAMP", {"x": pa.array([0, 1], pa.timestamp("ns"))}, "row index 1.*does not fit"),
        ("x STRING", {"x": pa.array([b"a"])}, "cannot take Arrow type binary"),
        ("x INT NOT NULL", {"x": pa.array([1, None])}, "row index 1: column 'x'.*is null"),
        ("x INT NOT NULL", {"y": pa.array([1])}, "unknown column 'y'"),
        ("x INT NOT NULL", {"_diff": pa.array([1])}, "'x'.*is missing"),
        ("x VARCHAR(2)", {"x": pa.array(["ab", None, "abc"])}, "row index 2.*longer than 2"),
        ("x INT", {"x": pa.array([1]), "_diff": pa.array([None], pa.int64())}, "'_diff'.*is null"),
        ("x INT", {"x": pa.array([1]), "_time": pa.array(["1"])}, "'_time'.*cannot take"),
    ],
)
def test_bad_tables_are_refused(schema: str, table: dict[str, pa.Array], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        to_batch(pa.table(table), parse_schema(schema), default_time=0)


_VALUES = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, width=64),
    st.decimals(
        allow_nan=False, allow_infinity=False, places=3, min_value=-(10**5), max_value=10**5
    ),
    st.text(max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["INT", "BIGINT", "DOUBLE", "DECIMAL(8,2)", "VARCHAR(3)", "STRING"]),
    st.lists(_VALUES, min_size=1, max_size=5),
)
def test_rows_and_tables_agree(type_: str, values: list[object]) -> None:
    """Values of one Python kind, as rows or as an Arrow table: both refuse, or both
    give the same batch."""
    kinds = {type(v) for v in values}
    if len(kinds) != 1:
        return
    schema = parse_schema(f"x {type_}")
    outcomes = []
    for data in ([{"x": v} for v in values], pa.table({"x": pa.array(values)})):
        try:
            outcomes.append(to_batch(data, schema, default_time=0))
        except InvalidArgument:
            outcomes.append(None)
    assert (outcomes[0] is None) == (outcomes[1] is None)
    if outcomes[0] is not None:
        assert outcomes[0].equals(outcomes[1])
