"""Rows from files for `tandem source append`: CSV (a header row), JSON lines and
Parquet, each value read by the type of its column in the source's schema; a row that
does not read is refused naming the file, the line and the column."""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime as dt
import decimal
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import grpc
import pyarrow as pa

from controller import _progress
from controller.client import Client, TandemError
from protocol.arrow import SPARK_TYPE


def _bool(text: str) -> bool:
    words = {"true": True, "false": False}
    if text.strip().lower() not in words:
        raise ValueError(f"not a boolean: {text!r}")
    return words[text.strip().lower()]


# Arrow type test -> how a text value becomes the Python value storage checks.
_FROM_TEXT: tuple[tuple[Callable[[pa.DataType], bool], Callable[[str], Any]], ...] = (
    (pa.types.is_boolean, _bool),
    (pa.types.is_integer, int),
    (pa.types.is_floating, float),
    (pa.types.is_decimal, decimal.Decimal),
    (pa.types.is_binary, lambda s: base64.b64decode(s, validate=True)),
    (pa.types.is_date, dt.date.fromisoformat),
    (pa.types.is_timestamp, dt.datetime.fromisoformat),
)


@dataclass(frozen=True, slots=True)
class _Column:
    """How a value of one column is read: `convert` (text or JSON to the value storage
    checks), and what the column is, for messages (`BIGINT NOT NULL`)."""

    name: str
    convert: Callable[[Any], Any]
    nullable: bool
    what: str


def _columns(schema: pa.Schema) -> dict[str, _Column]:
    """The source's columns and `_diff` (optional, a BIGINT)."""
    columns = {}
    for field in [*schema, pa.field("_diff", pa.int64())]:
        spark_type = (field.metadata or {}).get(SPARK_TYPE, b"").decode() or str(field.type)
        what = spark_type + ("" if field.nullable else " NOT NULL")
        columns[field.name] = _Column(field.name, _converter(field.type), field.nullable, what)
    return columns


def _converter(arrow_type: pa.DataType) -> Callable[[Any], Any]:
    """Text (CSV cells, JSON strings) parsed for a column of `arrow_type`; an empty CSV
    cell is NULL except in string columns. JSON decimals (read exactly) become floats in
    float columns. Anything else passes as is, for storage to accept or refuse."""
    if pa.types.is_string(arrow_type):
        return _keep
    parse = next((p for test, p in _FROM_TEXT if test(arrow_type)), _keep)
    exact_float = pa.types.is_floating(arrow_type)

    def convert(value: Any) -> Any:
        if isinstance(value, str):
            return parse(value) if value else None
        if exact_float and isinstance(value, decimal.Decimal):
            return float(value)
        return value

    return convert


def _keep(value: Any) -> Any:
    return value  # strings, and what storage checks itself


def _convert(number: int, row: dict[str, Any], columns: dict[str, _Column]) -> dict[str, Any]:
    """Row `number` of a file read by `columns`: every value converted; a column the
    row lacks is NULL, which a NOT NULL column refuses, as it refuses an empty value."""
    converted = {}
    for name, value in row.items():
        column = columns[name]
        try:
            converted[name] = column.convert(value)
        except (ValueError, ArithmeticError):  # decimal.InvalidOperation is arithmetic
            raise ValueError(f"line {number}: column {name!r} ({column.what}) cannot take {value!r}") from None
    for column in columns.values():
        if not column.nullable and converted.get(column.name) is None and column.name != "_diff":
            raise ValueError(f"line {number}: column {column.name!r} ({column.what}) has no value")
    return converted


def _check_names(names: list[str], columns: dict[str, _Column], source: str, line: int) -> None:
    """Names a file gives (a CSV header, a JSON object's keys) that are not the source's."""
    unknown = [name for name in names if name not in columns]
    if unknown:
        known = ", ".join(c for c in columns if c != "_diff")
        raise ValueError(f"line {line}: column {unknown[0]!r} is not a column of source {source!r} ({known}, and _diff)")


def _read_rows(
    client: Client, source: str, csv_path: str | None, jsonl_path: str | None
) -> list[dict[str, Any]]:
    """The rows of a CSV (header row) or JSONL file (`-`: stdin), each value converted by
    the type of its column in the source's schema, so a DATE column gets dates. A CSV
    header names every column of the source (`_diff` may be left out; an empty field is
    NULL); a JSON object may leave out nullable columns. Nothing is sent unless every
    row reads."""
    columns = _columns(client.source_schema(source))
    path = csv_path or jsonl_path or "-"
    with _open(path) as lines:
        counted = _progress.counted_bytes(lines, None if path == "-" else os.path.getsize(path), f"reading {path}")
        rows = _csv_rows(counted, columns, source) if csv_path else _jsonl_rows(counted, columns, source)
        try:
            return [_convert(number, row, columns) for number, row in rows]
        except ValueError as error:
            raise _invalid(f"{path}: {error}") from None


def _read_parquet(client: Client, source: str, path: str) -> pa.Table:
    """A Parquet file's rows, cast to the source's column types (with `_diff` when the
    file has one): columns are matched by name, so their order in the file is free."""
    import pyarrow.parquet as pq  # imported here: only --parquet reads Parquet

    schema = client.source_schema(source)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise _invalid(f"cannot read {path}: {error}") from None
    fields = [*schema, pa.field("_diff", pa.int64(), nullable=False)] if "_diff" in table.column_names else list(schema)
    extra = sorted(set(table.column_names) - {f.name for f in fields})
    missing = [f.name for f in fields if f.name not in table.column_names]
    if extra or missing:
        raise _invalid(f"{path}: the columns do not match source {source!r}: missing {missing}, not in the source {extra}")
    columns, what = [], _columns(schema)
    for field in fields:
        try:
            columns.append(table.column(field.name).cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise _invalid(f"{path}: column {field.name!r} ({what[field.name].what}) cannot take its {table.schema.field(field.name).type} values: {error}") from None
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _open(path: str) -> Any:
    if path == "-":
        return contextlib.nullcontext(sys.stdin)
    try:
        return open(path, newline="", encoding="utf-8")  # newline="": csv handles line ends
    except OSError as error:
        raise _invalid(f"cannot read {path}: {error.strerror}") from None


def _csv_rows(lines: TextIO, columns: dict[str, _Column], source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(lines)
    header = reader.fieldnames or []
    _check_names(header, columns, source, 1)
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise ValueError(f"line 1: column {twice[0]!r} appears twice in the header")
    missing = [c for c in columns.values() if c.name not in header and c.name != "_diff"]
    if missing:
        named = ", ".join(f"{c.name!r} ({c.what})" for c in missing)
        raise ValueError(f"line 1: the header lacks column{'s' if len(missing) > 1 else ''} {named} of source {source!r}; give every column (an empty field is NULL)")
    for row in reader:
        if None in row:  # DictReader's key for cells beyond the header
            raise ValueError(f"line {reader.line_num}: more cells than the header has columns")
        yield reader.line_num, row


def _jsonl_rows(lines: TextIO, columns: dict[str, _Column], source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_float=decimal.Decimal)  # decimals stay exact
        except ValueError as error:
            raise ValueError(f"line {number}: not JSON: {error}") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number}: expected a JSON object")
        _check_names(list(row), columns, source, number)
        yield number, row


def _invalid(message: str) -> TandemError:
    return TandemError(grpc.StatusCode.INVALID_ARGUMENT, message)

