"""`tandem`, the command line of a controller, built on `controller.client.Client`.

    tandem demo                      # the tour: start here
    tandem serve --data-dir ./tandem-data
    tandem instance create prod --min-in-sync 1
    tandem replica add prod r1 --size small
    tandem source create orders --schema "id BIGINT NOT NULL, region STRING, amount DOUBLE"
    tandem source append orders --csv orders.csv
    tandem dataflow create prod totals --sql "SELECT region, sum(amount) AS total FROM orders
        GROUP BY region" --index-key region
    tandem peek prod totals --where region=eu
    tandem status prod

Rules:
- Every command but `serve` and `demo` takes `--address` (default `$TANDEM_ADDRESS`, else
  127.0.0.1:6875) and `--json` (JSON on stdout for scripts, instead of aligned tables).
- Exit codes: 0 done; 1 refused or failed, with `error: <STATUS>: <message>` on stderr;
  2 a usage error (argparse); 130 interrupted.
- Each leaf command is a handler `(client, args) -> data` and a text renderer of that
  data; `--json` prints the data itself, so both outputs always say the same.
- Literals on the command line (`--key`, `--where` values) are read as JSON when they
  parse (42, 1.5, true, null, "42", [1, 2]) and as plain strings otherwise (eu, 2024-01-31).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import csv
import dataclasses
import datetime as dt
import decimal
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc
import pyarrow as pa

from controller._api import ControllerError, DataflowStatusView, DataflowView, InstanceView, ReplicaView, SourceView
from controller.client import DEFAULT_ADDRESS, Client, QueryResult, TandemError

# --- Tables ----------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], null: str = "-") -> str:
    """`rows` under `headers`, columns separated by two spaces; None shows as `null`,
    booleans as true/false, and a column of numbers is right-aligned."""
    rows = list(rows)
    cells = [[_cell(value, null) for value in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(_is_number(r[i]) or r[i] is None for r in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric))
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, decimal.Decimal)) and not isinstance(value, bool)


def _cell(value: Any, null: str) -> str:
    if value is None:
        return null
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _frontier(time: int | None) -> int | str:
    return "empty" if time is None else time  # None in a view is the empty frontier


# --- Renderers: data -> text -----------------------------------------------------------


def _instances(views: list[InstanceView]) -> str:
    return format_table(
        ["NAME", "HEALTH", "IN_SYNC", "REPLICAS", "MIN_IN_SYNC", "MAX_LAG_MS", "COLLECTIONS"],
        [
            [
                v.name,
                v.health,
                sum(r.in_sync for r in v.replicas),
                len(v.replicas),
                v.min_in_sync,
                v.max_lag_ms,
                len(v.collections),
            ]
            for v in views
        ],
    )


def _replicas(views: list[ReplicaView]) -> str:
    return format_table(
        [
            "NAME",
            "SIZE",
            "STATE",
            "IN_SYNC",
            "HYDRATED",
            "LAG_MS",
            "EPOCH",
            "PID",
            "PEEKS_WON",
            "RESUMED/REPLAYED",
            "FAILURES",
            "RETRY",
            "SPARK_MASTER",
            "ADDRESS",
        ],
        [
            [
                r.name,
                r.size,
                r.state,
                r.in_sync,
                r.hydrated,
                r.lag_ms,
                r.epoch,
                r.pid,
                r.peeks_won,
                f"{r.resumes}/{r.replays}",
                r.consecutive_failures,
                _retry(r.next_retry_ms),
                r.spark_master,
                r.address,
            ]
            for r in views
        ],
    )


def _retry(next_retry_ms: int | None) -> str | None:
    """When a failed replica connects again, from now (by this machine's clock)."""
    if next_retry_ms is None:
        return None
    return f"in {max(0.0, next_retry_ms / 1000 - time.time()):.1f}s"


def _replica_problems(views: Sequence[ReplicaView]) -> list[str]:
    """A line per replica-wide error, and per replica failing again and again."""
    lines = []
    for r in views:
        lines += [f"replica {r.name} reports: {error}" for error in r.errors]
        if r.consecutive_failures:
            lines.append(
                f"replica {r.name} failed {r.consecutive_failures} time(s) in a row, "
                f"last: {r.last_failure}"
            )
    return lines


def _dataflow_statuses(views: Sequence[ReplicaView]) -> str | None:
    """Each dataflow on each replica that reports it: its latest step and any error."""
    rows = sorted(
        [name, r.name, s.hydrated, s.steps, s.last_step_ms, s.rows_changed, s.error]
        for r in views
        for name, s in r.dataflows.items()
    )
    headers = ["DATAFLOW", "REPLICA", "HYDRATED", "STEPS", "LAST_STEP_MS", "ROWS_CHANGED", "ERROR"]
    return format_table(headers, rows) if rows else None


def _errors(statuses: Mapping[str, DataflowStatusView]) -> str | None:
    """A dataflow's error on each replica where it failed; None where it failed nowhere."""
    failed = sorted((replica, s.error) for replica, s in statuses.items() if s.error is not None)
    return "; ".join(f"{replica}: {error}" for replica, error in failed) or None


def _sources(views: list[SourceView]) -> str:
    return format_table(
        ["NAME", "ID", "SINCE", "UPPER", "SCHEMA"],
        [[s.name, s.id, _frontier(s.since), _frontier(s.upper), s.schema] for s in views],
    )


def _dataflows(views: list[DataflowView]) -> str:
    return format_table(
        ["INSTANCE", "NAME", "ID", "INDEX_KEY", "SINK", "COMPACTION_WINDOW_MS", "STRATEGY", "SCHEMA", "ERRORS"],
        [
            [
                d.instance,
                d.name,
                d.id,
                _index_key(d.index_key),
                d.sink_id,
                d.compaction_window_ms,
                d.strategy,
                d.schema,
                _errors(d.replicas),
            ]
            for d in views
        ],
    )


def _one(render: Callable[[list[Any]], str]) -> Callable[[Any], str]:
    """The renderer of one view, as a table of one row (its JSON stays one object)."""
    return lambda view: render([view])


def _index_key(key: tuple[str, ...] | None) -> str | None:
    return None if key is None else ",".join(key) or "(whole row)"


def _status(views: list[InstanceView]) -> str:
    """Per instance: its health and the dataflows nothing serves; its replicas and their
    problems; each dataflow on each replica; its collections."""
    blocks = []
    for v in views:
        in_sync = sum(r.in_sync for r in v.replicas)
        head = [
            f"instance {v.name}: {v.health} ({in_sync} of {len(v.replicas)} replicas in sync, "
            f"min {v.min_in_sync}; max lag {v.max_lag_ms} ms; history {v.history_length} "
            f"commands, {v.history_reductions} reductions, {v.commands_pushed} pushed)",
            *(f"dataflow {name} serves nowhere: {why}" for name, why in v.unavailable_dataflows.items()),
            _replicas(list(v.replicas)),
            *_replica_problems(v.replicas),
        ]
        collections = format_table(
            ["COLLECTION", "ID", "SINCE", "WRITE_FRONTIER"],
            [[c.name, c.id, _frontier(c.since), _frontier(c.write_frontier)] for c in v.collections],
        )
        sections = ["\n".join(head), _dataflow_statuses(v.replicas), collections]
        blocks.append("\n\n".join(s for s in sections if s is not None))
    return "\n\n".join(blocks)


def _rows(result: QueryResult) -> str:
    count = result.table.num_rows
    footer = f"({count} row{'' if count == 1 else 's'} at timestamp {result.timestamp}"
    footer += f", from replica {result.replica})" if result.replica else ")"
    rows = [list(row.values()) for row in result.rows]
    return format_table(result.table.column_names, rows, null="NULL") + "\n" + footer


def _json_value(value: Any) -> Any:
    """`json.dumps` fallback for values of result rows and views."""
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, QueryResult):
        return {"timestamp": value.timestamp, "replica": value.replica, "rows": value.rows}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# --- Handlers: (client, args) -> data --------------------------------------------------


def _conf(pairs: list[str] | None) -> dict[str, str] | None:
    return None if pairs is None else dict(pair.split("=", 1) for pair in pairs)


def _dataflow_create(client: Client, args: argparse.Namespace) -> DataflowView:
    return client.create_dataflow(
        args.instance,
        args.name,
        args.sql,
        index_key=args.index_key,
        materialize=args.materialize,
        compaction_window_ms=args.compaction_window_ms,
        strategy=args.strategy,
    )


def _instance_create(client: Client, args: argparse.Namespace) -> InstanceView:
    return client.create_instance(
        args.name,
        min_in_sync=args.min_in_sync,
        max_lag_ms=args.max_lag_ms,
        replica_timeout_ms=args.replica_timeout_ms,
        spark_conf=_conf(args.conf),
    )


def _replica_add(client: Client, args: argparse.Namespace) -> ReplicaView:
    return client.add_replica(
        args.instance,
        args.name,
        size=args.size,
        spark_master=args.spark_master,
        spark_conf=_conf(args.conf),
        address=args.replica_address,
        driver_host=args.driver_host,
        driver_bind_address=args.driver_bind_address,
        wait=args.wait,
        timeout_ms=args.timeout_ms,
    )


def _source_append(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    rows = _read_rows(client, args.name, args.csv, args.jsonl)
    return {"source": args.name, "rows": len(rows), "timestamp": client.append(args.name, rows)}


def _peek(client: Client, args: argparse.Namespace) -> QueryResult:
    return client.peek(
        args.instance,
        args.name,
        key=None if args.key is None else tuple(args.key),
        where=args.where,
        order_by=args.order_by,
        limit=args.limit,
        offset=args.offset,
        columns=args.columns,
        timestamp=args.timestamp,
        consistency="strict" if args.strict else "serializable",
        timeout_ms=args.timeout_ms,
    )


def _query(client: Client, args: argparse.Namespace) -> QueryResult:
    return client.query(
        args.instance,
        args.sql,
        timestamp=args.timestamp,
        consistency="strict" if args.strict else "serializable",
        timeout_ms=args.timeout_ms,
    )


def _serve(args: argparse.Namespace) -> None:
    # Imported here: the runtime brings Spark planning and the catalog, which no other
    # command needs, and the CLI must work against a remote controller without them.
    from controller import runtime

    try:
        asyncio.run(
            runtime.serve(
                data_dir=args.data_dir,
                catalog_url=args.catalog,
                listen=args.listen,
                blob_uri=args.blob_uri,
                retention_ms=args.retention_ms,
                gc_grace_ms=args.gc_grace_ms,
                upkeep_interval_ms=args.upkeep_interval_ms,
            )
        )
    except ControllerError as error:  # refused at start: a bad option or blob location
        print(f"error: {error.code}: {error.message}", file=sys.stderr)
        raise SystemExit(1) from None


def _run_demo(args: argparse.Namespace) -> None:
    # Imported here, as the runtime is: only `tandem demo` starts processes.
    from controller import _demo

    try:
        _demo.run(args.data_dir, keep=args.keep)
    except (_demo.DemoFailed, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


# --- Rows from files -------------------------------------------------------------------


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
    return value  # strings, and columns the schema lacks (storage refuses those by name)


def _convert(
    number: int, row: dict[str, Any], converters: dict[str, Callable[[Any], Any]]
) -> dict[str, Any]:
    converted = {}
    for column, value in row.items():
        try:
            converted[column] = converters.get(column, _keep)(value)
        except (ValueError, ArithmeticError):  # decimal.InvalidOperation is arithmetic
            raise ValueError(f"line {number}: column {column!r} cannot take {value!r}") from None
    return converted


def _read_rows(
    client: Client, source: str, csv_path: str | None, jsonl_path: str | None
) -> list[dict[str, Any]]:
    """The rows of a CSV (header row) or JSONL file (`-`: stdin), each value converted by
    the type of its column in the source's schema, so a DATE column gets dates."""
    from storage import parse_schema  # imported here: it loads the catalog's SQLAlchemy

    schema = next((s.schema for s in client.list_sources() if s.name == source), None)
    if schema is None:
        raise TandemError(grpc.StatusCode.NOT_FOUND, f"no source named {source!r}")
    converters = {f.name: _converter(f.type) for f in parse_schema(schema)}
    converters["_diff"] = _converter(pa.int64())
    path = csv_path or jsonl_path or "-"
    with _open(path) as lines:
        try:
            return [
                _convert(number, row, converters)
                for number, row in (_csv_rows(lines) if csv_path else _jsonl_rows(lines))
            ]
        except ValueError as error:
            raise _invalid(f"{path}: {error}") from None


def _open(path: str) -> Any:
    if path == "-":
        return contextlib.nullcontext(sys.stdin)
    try:
        return open(path, newline="", encoding="utf-8")  # newline="": csv handles line ends
    except OSError as error:
        raise _invalid(f"cannot read {path}: {error.strerror}") from None


def _csv_rows(lines: TextIO) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(lines)
    for row in reader:
        if None in row:  # DictReader's key for cells beyond the header
            raise ValueError(f"line {reader.line_num}: more cells than the header has columns")
        yield reader.line_num, row


def _jsonl_rows(lines: TextIO) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_float=decimal.Decimal)  # decimals stay exact
        except ValueError as error:
            raise ValueError(f"line {number}: not JSON: {error}") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number}: expected a JSON object")
        yield number, row


def _invalid(message: str) -> TandemError:
    return TandemError(grpc.StatusCode.INVALID_ARGUMENT, message)


# --- Arguments -------------------------------------------------------------------------


def _literal(text: str) -> Any:
    """A command-line literal: JSON when it parses to a scalar or a list, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, dict) else value


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _orders(text: str) -> list[Any]:
    """`a,-b,c:desc`: `-b` (write `--order-by=-b`, or argparse takes it for an option) and
    `c:desc` descend."""
    return [tuple(name.split(":", 1)) if ":" in name else name for name in _names(text)]


def _pair(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return text


_WHERE = re.compile(r"\s*([^=!<>\s]+)\s*(!=|<=|>=|=|<|>)\s*(.*)\Z", re.DOTALL)
_NULL_OPS = {"=": "is_null", "!=": "is_not_null"}


def _where(text: str) -> tuple[Any, ...]:
    """`col OP value` as a `(column, op[, value])` item of `Client.peek`'s `where`:
    `= null` is is_null, `!= null` is_not_null, `= [a, b]` is in."""
    match = _WHERE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected COLUMN OP VALUE with OP one of = != < <= > >=, not {text!r}"
        )
    column, op, value = match[1], match[2], _literal(match[3])
    if value is None and op in _NULL_OPS:
        return (column, _NULL_OPS[op])
    if isinstance(value, list) and op == "=":
        return (column, "in", value)
    return (column, op, value)


Handler = Callable[[Client, argparse.Namespace], Any]


def _drop(kind: str, drop: Callable[[Client, argparse.Namespace], None]) -> Handler:
    def handler(client: Client, args: argparse.Namespace) -> dict[str, str]:
        drop(client, args)
        return {"dropped": kind, "name": args.name}

    return handler


def _said(data: dict[str, Any]) -> str:
    if "dropped" in data:
        return f"dropped {data['dropped']} {data['name']}"
    return f"appended {data['rows']} rows to {data['source']} at timestamp {data['timestamp']}"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        default=os.environ.get("TANDEM_ADDRESS", DEFAULT_ADDRESS),
        help="the controller's host:port (default: $TANDEM_ADDRESS, else 127.0.0.1:6875)",
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")

    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Run and drive a Tandem controller: active-replication compute for Spark.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def group(name: str, help: str) -> Any:
        sub = commands.add_parser(name, help=help, description=help)
        return sub.add_subparsers(dest="action", required=True, metavar="ACTION")

    def leaf(parent: Any, name: str, help: str, handler: Handler, render: Callable) -> Any:
        sub = parent.add_parser(name, parents=[common], help=help, description=help)
        sub.set_defaults(run=lambda args: _run(handler, render, args))
        return sub

    p = commands.add_parser("serve", help="run a controller", description="Run a controller.")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("./tandem-data"),
        help="where the data files live (default: %(default)s)",
    )
    p.add_argument(
        "--catalog",
        metavar="URL",
        help="the catalog's database URL (default: sqlite:///DATA_DIR/catalog.db)",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:6875",
        metavar="HOST:PORT",
        help="where to serve the client API (default: %(default)s)",
    )
    # Defaults left to the runtime (None here), which owns them: see UpkeepOptions.
    p.add_argument(
        "--blob-uri",
        metavar="URI",
        help="where storage batch files live: a directory, file:///abs/dir or "
        "s3://bucket/prefix (default: DATA_DIR/blobs)",
    )
    p.add_argument(
        "--retention-ms",
        type=int,
        metavar="N",
        help="how far behind its upper a storage collection stays readable when no "
        "dataflow holds it; longer than a dataflow takes to create (default: 60000)",
    )
    p.add_argument(
        "--gc-grace-ms",
        type=int,
        metavar="N",
        help="how long unreferenced batch files stay before they are deleted; readers "
        "must be done with a read plan within it (default: 900000, 15 minutes)",
    )
    p.add_argument(
        "--upkeep-interval-ms",
        type=int,
        metavar="N",
        help="how often storage upkeep (retention holds, compaction, garbage) runs "
        "(default: 5000)",
    )
    p.set_defaults(run=_serve)

    p = commands.add_parser(
        "demo",
        help="the tour: a controller, two replicas, a crash of each kind and a resize",
        description="Start a controller and two xsmall replicas on the embedded defaults, "
        "build a dataflow, kill a replica and the controller with SIGKILL and resize the "
        "instance under a peek loop, showing that no peek fails; then end every process "
        "it started. Takes a few minutes.",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="where the data files live (default: a temporary directory, removed at the end)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the temporary data directory at the end"
    )
    p.set_defaults(run=_run_demo)

    instance = group("instance", "create, drop, list and resize compute instances")
    p = leaf(instance, "create", "create an instance", _instance_create, _one(_instances))
    p.add_argument("name")
    p.add_argument(
        "--min-in-sync",
        type=int,
        default=1,
        help="replicas in sync for the instance to be healthy (default: 1)",
    )
    p.add_argument("--max-lag-ms", type=int, help="the most an in-sync replica may lag")
    p.add_argument("--replica-timeout-ms", type=int, help="silence that fails a replica")
    p.add_argument(
        "--conf",
        type=_pair,
        action="append",
        metavar="KEY=VALUE",
        help="a Spark setting that decides results, for every replica (repeatable)",
    )
    p = leaf(
        instance,
        "drop",
        "drop an instance",
        _drop("instance", lambda c, a: c.drop_instance(a.name)),
        _said,
    )
    p.add_argument("name")
    leaf(instance, "list", "list instances", lambda c, a: c.list_instances(), _instances)
    p = leaf(
        instance,
        "resize",
        "replace an instance's replicas by ones of SIZE, no downtime",
        lambda c, a: c.resize(a.name, a.size, timeout_ms=a.timeout_ms),
        _replicas,
    )
    p.add_argument("name")
    p.add_argument("size")
    p.add_argument(
        "--timeout-ms",
        type=int,
        default=600_000,
        help="for the new replicas to get in sync (default: %(default)s)",
    )

    replica = group("replica", "add and drop replicas of an instance")
    p = leaf(
        replica,
        "add",
        "add a replica: managed (a size, or a Spark master), or external",
        _replica_add,
        _one(_replicas),
    )
    p.add_argument("instance")
    p.add_argument("name")
    p.add_argument(
        "--size",
        help="a named size (default: xsmall, unless --spark-master or --replica-address is given)",
    )
    p.add_argument("--spark-master", metavar="URL", help="e.g. spark://host:7077")
    p.add_argument(
        "--conf",
        type=_pair,
        action="append",
        metavar="KEY=VALUE",
        help="a Spark resource setting of this replica (repeatable)",
    )
    p.add_argument(
        "--replica-address", metavar="HOST:PORT", help="an external replica, already running there"
    )
    p.add_argument(
        "--driver-host",
        metavar="HOST",
        help="on a cluster: this host's address the executors reach the replica's driver at "
        "(default 127.0.0.1)",
    )
    p.add_argument(
        "--driver-bind-address",
        metavar="HOST",
        help="the interface the replica's driver listens on (default: the driver host)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="return once the replica is in sync; if it cannot start or get in sync in time, "
        "it is dropped again",
    )
    p.add_argument(
        "--timeout-ms",
        type=int,
        help="with --wait: how long (default: the instance's replica timeout)",
    )
    p = leaf(
        replica,
        "drop",
        "drop a replica",
        _drop("replica", lambda c, a: c.drop_replica(a.instance, a.name, force=a.force)),
        _said,
    )
    p.add_argument("instance")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="even below the instance's min-in-sync")

    source = group("source", "create, append to, drop and list sources")
    p = leaf(
        source,
        "create",
        "create a source",
        lambda c, a: c.create_source(a.name, a.schema),
        _one(_sources),
    )
    p.add_argument("name")
    p.add_argument(
        "--schema",
        required=True,
        metavar="DDL",
        help='Spark DDL columns, e.g. "id BIGINT NOT NULL, region STRING"',
    )
    p = leaf(
        source,
        "append",
        "append the rows of --csv FILE, --jsonl FILE or - (JSON lines on stdin) at one new "
        "timestamp; values are read by the source's column types; a _diff of -1 retracts",
        _source_append,
        _said,
    )
    p.add_argument("name")
    rows = p.add_mutually_exclusive_group(required=True)
    rows.add_argument("--csv", metavar="FILE", help="CSV with a header row ('-': stdin)")
    rows.add_argument("--jsonl", metavar="FILE", help="one JSON object per line ('-': stdin)")
    rows.add_argument("stdin", nargs="?", choices=["-"], help="JSON lines on stdin")
    p = leaf(
        source, "drop", "drop a source", _drop("source", lambda c, a: c.drop_source(a.name)), _said
    )
    p.add_argument("name")
    leaf(source, "list", "list sources", lambda c, a: c.list_sources(), _sources)

    dataflow = group("dataflow", "create, drop and list dataflows")
    p = leaf(
        dataflow,
        "create",
        "create a dataflow: an index and/or a materialized view",
        _dataflow_create,
        _one(_dataflows),
    )
    p.add_argument("instance")
    p.add_argument("name")
    p.add_argument("--sql", required=True, help="Spark SQL over sources and other dataflows")
    p.add_argument(
        "--index-key",
        type=_names,
        metavar="COLUMNS",
        help='index on these columns, comma-separated ("" for the whole row)',
    )
    p.add_argument("--materialize", action="store_true", help="write the output to storage")
    p.add_argument(
        "--compaction-window-ms",
        type=int,
        default=0,
        metavar="N",
        help="how far back reads may go (default: 0)",
    )
    p.add_argument(
        "--strategy",
        choices=["auto", "incremental", "recompute"],
        default="auto",
        help="maintain incrementally where possible (auto, the default), always recompute, "
        "or refuse a query that cannot be maintained incrementally",
    )
    p = leaf(
        dataflow,
        "drop",
        "drop a dataflow",
        _drop("dataflow", lambda c, a: c.drop_dataflow(a.instance, a.name)),
        _said,
    )
    p.add_argument("instance")
    p.add_argument("name")
    p = leaf(
        dataflow, "list", "list dataflows", lambda c, a: c.list_dataflows(a.instance), _dataflows
    )
    p.add_argument("instance", nargs="?", help="only this instance's")

    p = leaf(commands, "peek", "read the index of a dataflow", _peek, _rows)
    p.add_argument("instance")
    p.add_argument("name")
    p.add_argument(
        "--key",
        type=_literal,
        action="append",
        metavar="VALUE",
        help="look up this key, one --key per key column",
    )
    p.add_argument(
        "--where",
        type=_where,
        action="append",
        metavar="COL_OP_VALUE",
        help="a filter: col=v, col!=v, col<v, col<=v, col>v, col>=v; "
        "col=null, col!=null, col=[a,b] (repeatable, all must hold)",
    )
    p.add_argument(
        "--order-by",
        type=_orders,
        metavar="COLUMNS",
        help="comma-separated; col:desc (or --order-by=-col) descends",
    )
    p.add_argument("--columns", type=_names, help="comma-separated columns to return")
    _add_read_options(p)
    p.add_argument("--limit", type=int)
    p.add_argument("--offset", type=int, default=0)

    p = leaf(commands, "query", "run SQL over an instance's indexes", _query, _rows)
    p.add_argument("instance")
    p.add_argument("sql")
    _add_read_options(p)

    p = leaf(
        commands,
        "status",
        "instances with their replicas, dataflows and collections, and what fails",
        lambda c, a: c.status(a.instance),
        _status,
    )
    p.add_argument("instance", nargs="?")
    return parser


def _add_read_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timestamp", type=int, metavar="T", help="read at this time")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="read the latest write, waiting for it (default: serializable)",
    )
    parser.add_argument(
        "--timeout-ms",
        type=int,
        default=30_000,
        metavar="N",
        help="how long the read may wait (default: %(default)s)",
    )


def _run(handler: Handler, render: Callable[[Any], str], args: argparse.Namespace) -> None:
    with Client(args.address) as client:
        data = handler(client, args)
    print(json.dumps(data, indent=2, default=_json_value) if args.json else render(data))


def main(argv: Sequence[str] | None = None) -> int:
    """The `tandem` console script: run one command; the exit code (see the module)."""
    try:
        args = _parser().parse_args(argv)
        args.run(args)
    except SystemExit as exit:  # argparse: 2 on a usage error, 0 after --help
        return exit.code if isinstance(exit.code, int) else 1
    except TandemError as error:
        print(f"error: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
