"""Spark DDL schemas of storage collections, as Arrow schemas and back.

A storage schema is a Spark DDL column list, e.g. `id BIGINT NOT NULL, region STRING,
amount DOUBLE`. The parser is strict: every type must be one of `SPARK_TYPES` (with its
aliases), names are identifiers or `backquoted`, distinct ignoring case (Spark's default),
and never `_time` or `_diff`, which storage reserves. A bad schema raises
`InvalidArgument` naming the column and the problem.

`parse_schema` and `schema_to_ddl` round-trip: `schema_to_ddl(parse_schema(d))` is the
normal form of `d` (aliases resolved, one space after each comma), and parsing the
normal form gives the same Arrow schema. VARCHAR(n) and CHAR(n) are Arrow strings that
remember their Spark type in the field metadata (key `spark_type`).
"""

from __future__ import annotations

import re

import pyarrow as pa

from catalog import InvalidArgument

RESERVED_COLUMNS = ("_time", "_diff")
SPARK_TYPE_KEY = b"spark_type"

_SIMPLE: dict[str, pa.DataType] = {
    "BOOLEAN": pa.bool_(),
    "TINYINT": pa.int8(),
    "BYTE": pa.int8(),
    "SMALLINT": pa.int16(),
    "SHORT": pa.int16(),
    "INT": pa.int32(),
    "INTEGER": pa.int32(),
    "BIGINT": pa.int64(),
    "LONG": pa.int64(),
    "FLOAT": pa.float32(),
    "REAL": pa.float32(),
    "DOUBLE": pa.float64(),
    "STRING": pa.string(),
    "DATE": pa.date32(),
    "TIMESTAMP": pa.timestamp("us", tz="UTC"),
    "TIMESTAMP_LTZ": pa.timestamp("us", tz="UTC"),
    "TIMESTAMP_NTZ": pa.timestamp("us"),
    "BINARY": pa.binary(),
}
_DECIMAL = ("DECIMAL", "DEC", "NUMERIC")
_SIZED_STRING = ("VARCHAR", "CHAR")
SPARK_TYPES = tuple(_SIMPLE) + _DECIMAL + _SIZED_STRING
MAX_DECIMAL_PRECISION = 38

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COLUMN_TYPE = re.compile(
    r"(?P<type>[A-Za-z_]+)\s*(?:\((?P<args>[^()]*)\))?\s*(?P<not_null>NOT\s+NULL)?\s*\Z",
    re.IGNORECASE,
)

_NESTED = re.compile(r"(ARRAY|MAP|STRUCT)\s*<", re.IGNORECASE)

_DDL_NAMES: dict[pa.DataType, str] = {
    pa.bool_(): "BOOLEAN",
    pa.int8(): "TINYINT",
    pa.int16(): "SMALLINT",
    pa.int32(): "INT",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.string(): "STRING",
    pa.date32(): "DATE",
    pa.timestamp("us", tz="UTC"): "TIMESTAMP",
    pa.timestamp("us"): "TIMESTAMP_NTZ",
    pa.binary(): "BINARY",
}


def _split_columns(ddl: str) -> list[str]:
    """Split on the commas outside parentheses, angle brackets and backquotes."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(ddl):
        if char == "`":
            quoted = not quoted
        elif quoted:
            continue
        elif char in "(<":
            depth += 1
        elif char in ")>":
            depth -= 1
            if depth < 0:
                raise InvalidArgument(f"schema {ddl!r}: unbalanced {char!r} at position {i}")
        elif char == "," and depth == 0:
            parts.append(ddl[start:i])
            start = i + 1
    if quoted:
        raise InvalidArgument(f"schema {ddl!r}: unterminated backquote")
    if depth:
        raise InvalidArgument(f"schema {ddl!r}: unbalanced '(' or '<'")
    parts.append(ddl[start:])
    return parts


def _column_name(text: str, number: int) -> tuple[str, str]:
    """The column name at the start of `text`, and the rest."""
    if text.startswith("`"):
        end = 1
        while True:
            end = text.find("`", end)
            if end + 1 < len(text) and text[end + 1] == "`":  # `` is an escaped backquote
                end += 2
                continue
            break
        name = text[1:end].replace("``", "`")
        if not name:
            raise InvalidArgument(f"column {number}: empty column name")
        return name, text[end + 1 :]
    match = _IDENTIFIER.match(text)
    if not match:
        raise InvalidArgument(
            f"column {number}: {text!r} does not start with a column name "
            f"(an identifier, or a name in backquotes)"
        )
    return match.group(), text[match.end() :]


def _int_args(args: str, name: str, type_name: str) -> list[int]:
    try:
        return [int(arg) for arg in args.split(",")]
    except ValueError:
        raise InvalidArgument(
            f"column {name!r}: {type_name}({args}) needs integer arguments"
        ) from None


def _column_type(name: str, type_name: str, args: str | None) -> pa.Field:
    if type_name in _SIMPLE:
        if args is not None:
            raise InvalidArgument(f"column {name!r}: {type_name} takes no arguments")
        return pa.field(name, _SIMPLE[type_name])
    if type_name in _DECIMAL:
        numbers = [10, 0] if args is None else _int_args(args, name, type_name)
        if len(numbers) == 1:
            numbers.append(0)
        if len(numbers) != 2:
            raise InvalidArgument(f"column {name!r}: DECIMAL takes (precision, scale)")
        precision, scale = numbers
        if not 1 <= precision <= MAX_DECIMAL_PRECISION or not 0 <= scale <= precision:
            raise InvalidArgument(
                f"column {name!r}: DECIMAL({precision},{scale}) needs 1 <= precision <= "
                f"{MAX_DECIMAL_PRECISION} and 0 <= scale <= precision"
            )
        return pa.field(name, pa.decimal128(precision, scale))
    if type_name in _SIZED_STRING:
        numbers = [] if args is None else _int_args(args, name, type_name)
        if len(numbers) != 1 or numbers[0] < 1:
            raise InvalidArgument(
                f"column {name!r}: {type_name} needs a length, e.g. {type_name}(10)"
            )
        spark_type = f"{type_name}({numbers[0]})".encode()
        return pa.field(name, pa.string(), metadata={SPARK_TYPE_KEY: spark_type})
    raise InvalidArgument(
        f"column {name!r}: unknown or unsupported type {type_name}; use one of "
        f"{', '.join(SPARK_TYPES)}"
    )


def parse_schema(ddl: str) -> pa.Schema:
    """The Arrow schema of a Spark DDL column list; InvalidArgument if it is not one."""
    if not isinstance(ddl, str) or not ddl.strip():
        raise InvalidArgument("a schema needs at least one column, e.g. 'id BIGINT NOT NULL'")
    fields: list[pa.Field] = []
    seen: dict[str, str] = {}
    for number, part in enumerate(_split_columns(ddl), start=1):
        text = part.strip()
        if not text:
            raise InvalidArgument(f"schema {ddl!r}: column {number} is empty (a stray comma?)")
        name, rest = _column_name(text, number)
        match = _COLUMN_TYPE.match(rest.strip())
        if not rest.strip():
            raise InvalidArgument(f"column {name!r} has no type")
        if _NESTED.match(rest.strip()):
            raise InvalidArgument(
                f"column {name!r}: nested types ({rest.strip()}) are not supported in storage"
            )
        if not rest[:1].isspace() or not match:
            raise InvalidArgument(
                f"column {name!r}: cannot read the type {rest.strip()!r}; expected a type "
                f"such as BIGINT or DECIMAL(10,2), optionally followed by NOT NULL"
            )
        if name.lower() in RESERVED_COLUMNS:
            raise InvalidArgument(
                f"column {name!r}: the names _time and _diff are reserved by storage"
            )
        if name.lower() in seen:
            raise InvalidArgument(f"column {name!r} appears twice (Spark ignores case in names)")
        seen[name.lower()] = name
        field = _column_type(name, match.group("type").upper(), match.group("args"))
        fields.append(field.with_nullable(match.group("not_null") is None))
    return pa.schema(fields)


def _quote(name: str) -> str:
    if _IDENTIFIER.fullmatch(name):
        return name
    return "`" + name.replace("`", "``") + "`"


def type_ddl(field: pa.Field) -> str:
    if field.metadata and SPARK_TYPE_KEY in field.metadata:
        return field.metadata[SPARK_TYPE_KEY].decode()
    if pa.types.is_decimal128(field.type):
        return f"DECIMAL({field.type.precision},{field.type.scale})"
    try:
        return _DDL_NAMES[field.type]
    except KeyError:
        raise InvalidArgument(
            f"column {field.name!r}: Arrow type {field.type} has no storage equivalent"
        ) from None


def schema_to_ddl(schema: pa.Schema) -> str:
    """The normal Spark DDL of an Arrow schema made by `parse_schema`."""
    return ", ".join(
        f"{_quote(f.name)} {type_ddl(f)}{'' if f.nullable else ' NOT NULL'}" for f in schema
    )


def normalize_ddl(ddl: str) -> str:
    """The normal form of a DDL string (checked by parsing)."""
    return schema_to_ddl(parse_schema(ddl))
