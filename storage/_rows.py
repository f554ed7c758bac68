"""Checking data against a storage schema, and shaping it into a batch.

Rules:
- `to_batch` takes rows (a sequence of mappings) or an Arrow table and returns a table
  with exactly the schema's columns, in its order and types, plus `_time` and `_diff`
  (BIGINT NOT NULL). Anything that does not fit refuses the whole batch with
  `InvalidArgument` naming the column and the row (index from 0) before anything is
  written.
- Strict but lossless: ints fit their width exactly, floats take ints, decimals take
  ints and decimals that need no rounding, strings and binaries are not interchanged,
  DATE takes dates (not datetimes), TIMESTAMP takes datetimes (naive ones are UTC, the
  session time zone), TIMESTAMP_NTZ only naive ones, VARCHAR(n)/CHAR(n) at most n
  characters (CHAR is padded to n, as Spark stores it). Missing nullable columns are
  null; missing NOT NULL columns, unknown columns and nulls in NOT NULL columns refuse.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from catalog import InvalidArgument
from storage._schema import SPARK_TYPE_KEY, type_ddl

TIME, DIFF = "_time", "_diff"
SYSTEM_COLUMNS = (TIME, DIFF)
_FLOAT32_MAX = 3.4028234663852886e38
_EXACT = decimal.Context(prec=100)

Rows = Sequence[Mapping[str, Any]]


def file_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of a batch file: the user columns, then `_time` and `_diff`."""
    return schema.append(pa.field(TIME, pa.int64(), nullable=False)).append(
        pa.field(DIFF, pa.int64(), nullable=False)
    )


class _Bad(Exception):
    """A value that does not fit; the message says why."""


def _sized(field: pa.Field) -> tuple[str, int] | None:
    """('VARCHAR' | 'CHAR', n) for a sized string column."""
    if field.metadata and SPARK_TYPE_KEY in field.metadata:
        spark_type = field.metadata[SPARK_TYPE_KEY].decode()
        kind, _, length = spark_type.partition("(")
        return kind, int(length.rstrip(")"))
    return None


def _value_checker(field: pa.Field) -> Callable[[Any], Any]:
    """A function that returns a value ready for Arrow, or raises _Bad."""
    t = field.type
    if pa.types.is_boolean(t):

        def check(v: Any) -> Any:
            if type(v) is not bool:
                raise _Bad("expected a bool")
            return v

    elif pa.types.is_integer(t):
        low, high = -(1 << (t.bit_width - 1)), (1 << (t.bit_width - 1)) - 1

        def check(v: Any) -> Any:
            if not isinstance(v, int) or isinstance(v, bool):
                raise _Bad("expected an int")
            if not low <= v <= high:
                raise _Bad(f"out of range [{low}, {high}]")
            return int(v)

    elif pa.types.is_floating(t):
        single = t == pa.float32()

        def check(v: Any) -> Any:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise _Bad("expected a float or an int")
            value = float(v)
            if single and math.isfinite(value) and abs(value) > _FLOAT32_MAX:
                raise _Bad("out of range for FLOAT")
            return value

    elif pa.types.is_decimal(t):
        quantum = decimal.Decimal(1).scaleb(-t.scale)
        limit = decimal.Decimal(10) ** (t.precision - t.scale)

        def check(v: Any) -> Any:
            if not isinstance(v, (int, decimal.Decimal)) or isinstance(v, bool):
                raise _Bad("expected a decimal.Decimal or an int")
            value = decimal.Decimal(v)
            if not value.is_finite():
                raise _Bad("expected a finite decimal")
            exact = value.quantize(quantum, context=_EXACT)
            if exact != value:
                raise _Bad(f"has more than {t.scale} digits after the point")
            if abs(exact) >= limit:
                raise _Bad(f"has more than {t.precision - t.scale} digits before the point")
            return exact

    elif pa.types.is_string(t):
        sized = _sized(field)

        def check(v: Any) -> Any:
            if not isinstance(v, str):
                raise _Bad("expected a str")
            if sized is not None:
                kind, length = sized
                if len(v) > length:
                    raise _Bad(f"longer than {length} characters")
                if kind == "CHAR":
                    return v.ljust(length)
            return v

    elif pa.types.is_binary(t):

        def check(v: Any) -> Any:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise _Bad("expected bytes")
            return bytes(v)

    elif pa.types.is_date(t):

        def check(v: Any) -> Any:
            if not isinstance(v, dt.date) or isinstance(v, dt.datetime):
                raise _Bad("expected a datetime.date")
            return v

    elif pa.types.is_timestamp(t) and t.tz is not None:

        def check(v: Any) -> Any:
            if not isinstance(v, dt.datetime):
                raise _Bad("expected a datetime.datetime")
            if v.tzinfo is None:
                return v.replace(tzinfo=dt.UTC)
            return v.astimezone(dt.UTC)

    elif pa.types.is_timestamp(t):

        def check(v: Any) -> Any:
            if not isinstance(v, dt.datetime) or v.tzinfo is not None:
                raise _Bad("expected a naive datetime.datetime (TIMESTAMP_NTZ has no time zone)")
            return v

    else:  # parse_schema makes no other types
        raise AssertionError(f"unexpected storage type {t}")
    return check


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(index: int, name: str, what: str, reason: str, value: Any = None) -> InvalidArgument:
    shown = "" if value is None else f", got {_show(value)}"
    return InvalidArgument(f"row index {index}: column {name!r} ({what}): {reason}{shown}")


def _from_rows(rows: Rows, schema: pa.Schema, default_time: int, allow_time: bool) -> pa.Table:
    allowed = set(schema.names) | {DIFF} | ({TIME} if allow_time else set())
    checks = {f.name: (f, _value_checker(f), type_ddl(f)) for f in schema}
    columns: dict[str, list[Any]] = {name: [] for name in [*schema.names, TIME, DIFF]}
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise InvalidArgument(
                f"row index {index}: expected a mapping of column to value, got {_show(row)}"
            )
        for key in row:
            if key not in allowed:
                raise _unknown(key, schema, index, allow_time)
        for name, (field, check, what) in checks.items():
            value = row.get(name)
            if value is None:
                if not field.nullable:
                    raise _refuse(index, name, what + " NOT NULL", "is missing or null")
                columns[name].append(None)
                continue
            try:
                columns[name].append(check(value))
            except _Bad as bad:
                raise _refuse(index, name, what, str(bad), value) from None
        for name, default in ((TIME, default_time), (DIFF, 1)):
            value = row.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool):
                raise _refuse(index, name, "BIGINT NOT NULL", "expected an int", value)
            columns[name].append(value)
    out = file_schema(schema)
    return pa.table([pa.array(columns[f.name], f.type) for f in out], schema=out)


def _unknown(name: str, schema: pa.Schema, index: int | None, allow_time: bool) -> InvalidArgument:
    where = "" if index is None else f"row index {index}: "
    if name == TIME and not allow_time:
        return InvalidArgument(
            f"{where}column '_time' is not allowed here: append stamps every row with its "
            f"timestamp (compare_and_append takes explicit times)"
        )
    return InvalidArgument(
        f"{where}unknown column {name!r}; the schema has {', '.join(schema.names)}"
    )


# --- Arrow tables ---------------------------------------------------------------------

_FAMILIES: tuple[tuple[str, Callable[[pa.DataType], bool]], ...] = (
    ("null", pa.types.is_null),
    ("bool", pa.types.is_boolean),
    ("int", pa.types.is_integer),
    ("float", pa.types.is_floating),
    ("decimal", pa.types.is_decimal),
    (
        "string",
        lambda t: (
            pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
        ),
    ),
    (
        "binary",
        lambda t: (
            pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
            or pa.types.is_binary_view(t)
            or pa.types.is_fixed_size_binary(t)
        ),
    ),
    ("date", pa.types.is_date),
    ("timestamp", pa.types.is_timestamp),
)
_ACCEPTS = {
    "bool": {"bool"},
    "int": {"int"},
    "float": {"int", "float"},
    "decimal": {"int", "decimal"},
    "string": {"string"},
    "binary": {"binary"},
    "date": {"date"},
    "timestamp": {"timestamp"},
}


def _family(t: pa.DataType) -> str:
    return next((name for name, test in _FAMILIES if test(t)), str(t))


def _cast(column: pa.ChunkedArray, target: pa.DataType) -> pa.ChunkedArray:
    """A safe (lossless) cast; ints reach a decimal through a type wide enough for any."""
    if pa.types.is_integer(column.type) and pa.types.is_decimal(target):
        column = column.cast(pa.decimal256(76, target.scale))
    return column.cast(target, safe=True)


def _first_failing(column: pa.ChunkedArray, target: pa.DataType) -> int:
    """The first index whose value does not cast safely (binary search over prefixes)."""
    low, high = 0, len(column)  # invariant: column[:low] casts, column[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        try:
            _cast(column.slice(0, middle), target)
            low = middle
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            high = middle
    return low


def _scalar(column: pa.ChunkedArray, index: int) -> Any:
    try:
        return column[index].as_py()
    except (pa.ArrowInvalid, ValueError):  # e.g. nanoseconds, which Python cannot hold
        return column.slice(index, 1).cast(pa.string())[0].as_py()


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int:
    return pc.index(mask, True).as_py()


def _conform_column(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    name, what = field.name, type_ddl(field)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    source, target = _family(column.type), _family(field.type)
    ntz_from_zoned = (
        pa.types.is_timestamp(field.type)
        and field.type.tz is None
        and pa.types.is_timestamp(column.type)
        and column.type.tz is not None
    )
    if (source != "null" and source not in _ACCEPTS[target]) or ntz_from_zoned:
        raise InvalidArgument(f"column {name!r} ({what}) cannot take Arrow type {column.type}")
    try:
        result = _cast(column, field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        index = _first_failing(column, field.type)
        raise _refuse(
            index, name, what, f"does not fit ({error})", _scalar(column, index)
        ) from None
    if not field.nullable and result.null_count:
        index = _first_true(pc.is_null(result))
        raise _refuse(index, name, what + " NOT NULL", "is null")
    sized = _sized(field)
    if sized is not None and len(result):
        kind, length = sized
        too_long = pc.greater(pc.utf8_length(result), length)
        if pc.any(too_long).as_py():
            index = _first_true(pc.fill_null(too_long, False))
            raise _refuse(
                index, name, what, f"longer than {length} characters", _scalar(column, index)
            )
        if kind == "CHAR":
            result = pc.utf8_rpad(result, width=length, padding=" ")
    return result


def _system_column(table: pa.Table, name: str, default: int) -> pa.ChunkedArray | pa.Array:
    if name not in table.column_names:
        return pa.array([default] * table.num_rows, pa.int64())
    column = table[name]
    if _family(column.type) not in ("int", "null"):
        raise InvalidArgument(
            f"column {name!r} (BIGINT NOT NULL) cannot take Arrow type {column.type}"
        )
    result = column.cast(pa.int64(), safe=True)
    if result.null_count:
        raise _refuse(_first_true(pc.is_null(result)), name, "BIGINT NOT NULL", "is null")
    return result


def _from_table(
    table: pa.Table, schema: pa.Schema, default_time: int, allow_time: bool
) -> pa.Table:
    names = table.column_names
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidArgument(f"the table has column {duplicates[0]!r} more than once")
    allowed = set(schema.names) | {DIFF} | ({TIME} if allow_time else set())
    for name in names:
        if name not in allowed:
            raise _unknown(name, schema, None, allow_time)
    columns = []
    for field in schema:
        if field.name in names:
            columns.append(_conform_column(table[field.name], field))
        elif field.nullable:
            columns.append(pa.nulls(table.num_rows, field.type))
        else:
            raise InvalidArgument(f"column {field.name!r} ({type_ddl(field)} NOT NULL) is missing")
    columns.append(_system_column(table, TIME, default_time))
    columns.append(_system_column(table, DIFF, 1))
    return pa.table(columns, schema=file_schema(schema))


def to_batch(
    data: pa.Table | Rows, schema: pa.Schema, *, default_time: int, allow_time: bool = True
) -> pa.Table:
    """`data` checked against `schema` and shaped as a batch (see the module docstring).
    Rows without `_time` get `default_time`; rows without `_diff` get +1."""
    if isinstance(data, pa.Table):
        return _from_table(data, schema, default_time, allow_time)
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Sequence):
        raise InvalidArgument("data must be a pyarrow.Table or a sequence of row mappings")
    return _from_rows(data, schema, default_time, allow_time)
