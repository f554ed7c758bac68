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
    tandem status prod --watch
    tandem events --instance prod --follow

Rules:
- Every command but `serve` and `demo` takes `--address` (default `$TANDEM_ADDRESS`, else
  127.0.0.1:6875) and `--json` (JSON on stdout for scripts, instead of aligned tables);
  against a secured controller, `--token-file` (default `$TANDEM_TOKEN`), `--tls-ca` and
  `--tls-client-cert`/`--tls-client-key`. `serve` takes the server's side: `--tls-cert`,
  `--tls-key`, `--tls-client-ca`, `--auth-token-file`.
- Exit codes: 0 done; 1 refused or failed, with `error: <STATUS>: <message>` on stderr;
  2 a usage error (argparse); 130 interrupted.
- Each leaf command is a handler `(client, args) -> data` and a text renderer of that
  data; `--json` prints the data itself, so both outputs always say the same. Tables
  and progress are drawn by rich; progress only on a terminal (on stderr).
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
import io
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
from rich import box
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from controller._api import ControllerError, DataflowStatusView, DataflowView, EventView, InstanceView, ReplicaView, SourceView
from controller import _progress
from controller.client import DEFAULT_ADDRESS, Client, QueryResult, TandemError
from protocol.security import ServerSecurity, add_server_arguments, read_token

FOLLOW_INTERVAL_S = 1.0  # how often `events --follow` asks for new events

# --- Tables ----------------------------------------------------------------------------


# Header, a rule of dashes under each column, rows; no other lines. Columns are set
# apart by one space of right padding and a space as the divider.
_DASHED = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n")


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], null: str = "-") -> str:
    """`rows` under `headers` (drawn by rich); None shows as `null`, booleans as
    true/false, and a column of numbers is right-aligned. On a terminal, long cells wrap
    to its width; elsewhere (a pipe, a file) lines are never wrapped."""
    rows = list(rows)
    numeric = [bool(rows) and all(_is_number(r[i]) or r[i] is None for r in rows) for i in range(len(headers))]
    table = Table(box=_DASHED, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style=None)
    for header, is_number in zip(headers, numeric):
        table.add_column(header, justify="right" if is_number else "left", overflow="fold")
    for row in rows:
        table.add_row(*(escape(_cell(value, null)) for value in row))
    terminal = Console()
    console = Console(file=io.StringIO(), width=terminal.width if terminal.is_terminal else 1_000_000, color_system=None)
    console.print(table)
    head, rule, *body = console.file.getvalue().splitlines()
    rule = rule.replace("- ", "  ")  # the rule spans a column's right padding too: not under it
    return "\n".join(line.rstrip() for line in [head, rule, *body])


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
            "STALE_MS",
            "EPOCH",
            "PID",
            "PEEKS_WON",
            "RESUMED/REPLAYED",
            "FAILURES",
            "RETRY",
            "SPARK_MASTER",
            "ADDRESS",
            "METRICS",
        ],
        [
            [
                r.name,
                r.size,
                r.state,
                r.in_sync,
                r.hydrated,
                r.lag_ms,
                r.wallclock_lag_ms,
                r.epoch,
                r.pid,
                r.peeks_won,
                f"{r.resumes}/{r.replays}",
                r.consecutive_failures,
                _retry(r.next_retry_ms),
                r.spark_master,
                r.address,
                r.metrics_address,
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
        [name, r.name, _hydration(s), s.steps, s.last_step_ms, s.rows_changed, s.error]
        for r in views
        for name, s in r.dataflows.items()
    )
    headers = ["DATAFLOW", "REPLICA", "HYDRATED", "STEPS", "LAST_STEP_MS", "ROWS_CHANGED", "ERROR"]
    return format_table(headers, rows) if rows else None


def _hydration(status: DataflowStatusView) -> bool | str:
    """true once hydrated; while hydrating, how far its first step's Spark tasks are."""
    if status.hydrated or not status.hydration_tasks_total:
        return status.hydrated
    return f"{status.hydration_tasks_done}/{status.hydration_tasks_total} tasks"


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
            *(f"replica {r.name} is not trusted: it diverged on {r.diverged}" for r in v.replicas if r.diverged),
            *(f"replica {r.name} is slow: it has lost every read by far for a while" for r in v.replicas if r.slow),
            *(
                f"collection {c.name} is {c.wallclock_lag_ms} ms behind the clock on every replica (max lag {v.max_lag_ms} ms)"
                for c in v.collections
                if c.wallclock_lag_ms is not None and c.wallclock_lag_ms > v.max_lag_ms
            ),
            _replicas(list(v.replicas)),
            *_replica_problems(v.replicas),
        ]
        collections = format_table(
            ["COLLECTION", "ID", "SINCE", "WRITE_FRONTIER", "STALE_MS"],
            [[c.name, c.id, _frontier(c.since), _frontier(c.write_frontier), c.wallclock_lag_ms] for c in v.collections],
        )
        sections = ["\n".join(head), _dataflow_statuses(v.replicas), collections]
        blocks.append("\n\n".join(s for s in sections if s is not None))
    return "\n\n".join(blocks)


def _events(events: list[EventView]) -> str:
    return format_table(["TIME", "INSTANCE", "KIND", "REPLICA", "MESSAGE"], [_event_row(e) for e in events])


def _event_row(event: EventView) -> list[Any]:
    at = dt.datetime.fromtimestamp(event.at_ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")
    return [at, event.instance, event.kind, event.replica or None, event.message]


def _subscribe(args: argparse.Namespace) -> None:
    """`tandem subscribe`: one line per update (time, diff, row; a JSON object with
    --json), and with --progress one per progress, until the feed ends or Ctrl-C."""
    with Client(args.address, **_security(args)) as client:
        feed = client.subscribe(
            None if args.instance == "-" else args.instance,
            args.name, as_of=args.as_of, up_to=args.up_to, snapshot=not args.no_snapshot, progress=args.progress
        )
        for batch in feed:
            for row in batch.updates.to_pylist():
                time_, diff = row.pop("_time"), row.pop("_diff")
                if args.json:
                    print(json.dumps({"time": time_, "diff": diff, "row": row}, default=_json_value), flush=True)
                else:
                    print(f"{time_}  {diff:+d}  {json.dumps(row, default=_json_value)}", flush=True)
            if args.progress and batch.progress is not None:
                print(json.dumps({"progress": batch.progress}) if args.json else f"{batch.progress}  progress", flush=True)


def _watch_status(args: argparse.Namespace) -> None:
    """`tandem status --watch`: redrawn in place on a terminal; elsewhere (or with
    --json) one snapshot after another, until interrupted."""
    console = Console()
    with Client(args.address, **_security(args)) as client:
        if args.json or not console.is_terminal:
            while True:
                views = client.status(args.instance)
                print(json.dumps(views, default=_json_value) if args.json else _status(views) + "\n", flush=True)
                time.sleep(args.interval)
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(Text(_status(client.status(args.instance))), refresh=True)
                time.sleep(args.interval)


def _follow_events(args: argparse.Namespace) -> None:
    """`tandem events --follow`: the latest events, then each new one as it is recorded,
    one line each (a JSON object with --json), until interrupted."""
    with Client(args.address, **_security(args)) as client:
        events = client.events(args.instance, limit=args.limit)
        while True:
            for event in events:
                print(json.dumps(dataclasses.asdict(event)) if args.json else "  ".join(_cell(v, "-") for v in _event_row(event)), flush=True)
            after = events[-1].id if events else 0
            time.sleep(FOLLOW_INTERVAL_S)
            events = client.events(args.instance, after=after, limit=1_000)


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
        max_hold_back_ms=args.max_hold_back_ms,
        replace_slow=args.replace_slow or None,
    )


def _replica_add(client: Client, args: argparse.Namespace) -> ReplicaView:
    def add() -> ReplicaView:
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

    def hydration() -> tuple[str, int | None, int | None]:
        replica = next((r for r in client.status(args.instance)[0].replicas if r.name == args.name), None)
        if replica is None:
            return f"replica {args.name}: starting", None, None
        statuses = list(replica.dataflows.values())
        hydrated = sum(s.hydrated for s in statuses)
        done, total = sum(s.hydration_tasks_done for s in statuses), sum(s.hydration_tasks_total for s in statuses)
        tasks = f", {done}/{total} tasks of hydrating steps" if total else ""
        return f"replica {args.name}: {replica.state}, {hydrated} of {len(statuses)} dataflows hydrated{tasks}", hydrated, len(statuses) or None

    return _progress.while_running(add, hydration) if args.wait else add()


def _resize(client: Client, args: argparse.Namespace) -> list[ReplicaView]:
    old = {r.name for r in client.status(args.name)[0].replicas}

    def replaced() -> tuple[str, int | None, int | None]:
        replicas = client.status(args.name)[0].replicas
        new = [r for r in replicas if r.name not in old]
        wanted, in_sync = max(len(old), 1), sum(r.in_sync for r in new)
        left = len(old & {r.name for r in replicas})
        return f"{len(new)} of {wanted} {args.size} replicas added, {in_sync} in sync, {left} old left", in_sync, wanted

    return _progress.while_running(lambda: client.resize(args.name, args.size, timeout_ms=args.timeout_ms), replaced)


def _source_create(client: Client, args: argparse.Namespace) -> SourceView:
    if args.like_parquet is None:
        return client.create_source(args.name, args.schema)
    import pyarrow.parquet as pq

    from storage import InvalidArgument, schema_to_ddl  # imported here: it loads the catalog's SQLAlchemy

    try:
        schema = pq.read_schema(args.like_parquet)
    except (OSError, pa.ArrowException) as error:
        raise _invalid(f"cannot read the schema of {args.like_parquet}: {error}") from None
    try:
        ddl = schema_to_ddl(schema)
    except InvalidArgument as error:
        raise _invalid(f"{args.like_parquet}: {error}") from None
    return client.create_source(args.name, ddl)


def _source_append(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    if args.parquet is not None:
        rows: pa.Table | list[dict[str, Any]] = _read_parquet(client, args.name, args.parquet)
    else:
        rows = _read_rows(client, args.name, args.csv, args.jsonl)
    count = rows.num_rows if isinstance(rows, pa.Table) else len(rows)
    with _progress.spinner(f"appending {count} rows to {args.name}"):
        timestamp = client.append(args.name, rows)
    return {"source": args.name, "rows": count, "timestamp": timestamp}


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
        security = ServerSecurity.of(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file)
    except (OSError, ValueError) as error:
        print(f"error: INVALID_ARGUMENT: {error}", file=sys.stderr)
        raise SystemExit(1) from None
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
                security=security,
                http_listen=None if args.http_listen == "off" else args.http_listen,
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

    converters = {f.name: _converter(f.type) for f in parse_schema(_source_schema(client, source))}
    converters["_diff"] = _converter(pa.int64())
    path = csv_path or jsonl_path or "-"
    with _open(path) as lines:
        counted = _progress.counted_bytes(lines, None if path == "-" else os.path.getsize(path), f"reading {path}")
        try:
            return [
                _convert(number, row, converters)
                for number, row in (_csv_rows(counted) if csv_path else _jsonl_rows(counted))
            ]
        except ValueError as error:
            raise _invalid(f"{path}: {error}") from None


def _source_schema(client: Client, source: str) -> str:
    schema = next((s.schema for s in client.list_sources() if s.name == source), None)
    if schema is None:
        raise TandemError(grpc.StatusCode.NOT_FOUND, f"no source named {source!r}")
    return schema


def _read_parquet(client: Client, source: str, path: str) -> pa.Table:
    """A Parquet file's rows, cast to the source's column types (with `_diff` when the
    file has one): columns are matched by name, so their order in the file is free."""
    import pyarrow.parquet as pq

    from storage import parse_schema  # imported here: it loads the catalog's SQLAlchemy

    schema = parse_schema(_source_schema(client, source))
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise _invalid(f"cannot read {path}: {error}") from None
    fields = [*schema, pa.field("_diff", pa.int64(), nullable=False)] if "_diff" in table.column_names else list(schema)
    extra = sorted(set(table.column_names) - {f.name for f in fields})
    missing = [f.name for f in fields if f.name not in table.column_names]
    if extra or missing:
        raise _invalid(f"{path}: the columns do not match source {source!r}: missing {missing}, not in the source {extra}")
    columns = []
    for field in fields:
        try:
            columns.append(table.column(field.name).cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise _invalid(f"{path}: column {field.name!r} does not convert to {field.type}: {error}") from None
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


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
    common.add_argument(
        "--token-file", type=Path, help="the bearer token the controller requires (default: $TANDEM_TOKEN, else none)"
    )
    common.add_argument("--tls-ca", type=Path, help="talk TLS, checking the controller's certificate against this CA (PEM)")
    common.add_argument("--tls-client-cert", type=Path, help="a client certificate (PEM), for a controller that requires one")
    common.add_argument("--tls-client-key", type=Path, help="the private key (PEM) of --tls-client-cert")

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
    p.add_argument(
        "--http-listen",
        default="127.0.0.1:6876",
        metavar="HOST:PORT",
        help="where to serve the status page (/), its JSON (/api/status) and Prometheus metrics (/metrics), or off (default: %(default)s)",
    )
    add_server_arguments(p)
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
        "--max-hold-back-ms",
        type=int,
        help="how far behind a replica may hold compaction back before it is rehydrated",
    )
    p.add_argument(
        "--replace-slow",
        action="store_true",
        help="rehydrate a replica that loses every read by far for a while (default: only report it)",
    )
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
        _resize,
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
    p = leaf(source, "create", "create a source", _source_create, _one(_sources))
    p.add_argument("name")
    shape = p.add_mutually_exclusive_group(required=True)
    shape.add_argument("--schema", metavar="DDL", help='Spark DDL columns, e.g. "id BIGINT NOT NULL, region STRING"')
    shape.add_argument("--like-parquet", metavar="FILE", help="the columns (names, types, nullability) of this Parquet file")
    p = leaf(
        source,
        "append",
        "append the rows of --csv FILE, --jsonl FILE, --parquet FILE or - (JSON lines on stdin) at one "
        "new timestamp; values are read by the source's column types; a _diff of -1 retracts",
        _source_append,
        _said,
    )
    p.add_argument("name")
    rows = p.add_mutually_exclusive_group(required=True)
    rows.add_argument("--csv", metavar="FILE", help="CSV with a header row ('-': stdin)")
    rows.add_argument("--jsonl", metavar="FILE", help="one JSON object per line ('-': stdin)")
    rows.add_argument("--parquet", metavar="FILE", help="a Parquet file, columns by name (cast to the source's types)")
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
    p.add_argument("--watch", action="store_true", help="redraw it every --interval seconds until interrupted")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="with --watch (default: %(default)s)")
    p.set_defaults(run=lambda args: _watch_status(args) if args.watch else _run(lambda c, a: c.status(a.instance), _status, args))

    follow = (
        "follow the changes of a dataflow (its view or its index), a source or a view: the contents at "
        "--as-of, then every change in time order, one line per update (time, diff, row), until interrupted"
    )
    p = commands.add_parser("subscribe", parents=[common], help=follow, description=follow)
    p.add_argument("instance", help="the instance of the dataflow (for a source or view: any, or -)")
    p.add_argument("name")
    p.add_argument("--as-of", type=int, metavar="T", help="start here (default: the latest complete time); to resume, the last progress seen")
    p.add_argument("--up-to", type=int, metavar="T", help="end once every update before T is printed")
    p.add_argument("--no-snapshot", action="store_true", help="only the changes after --as-of, not the contents at it")
    p.add_argument("--progress", action="store_true", help="also print each progress: every update at or before it is printed")
    p.set_defaults(run=_subscribe)

    latest_events: Handler = lambda c, a: c.events(a.instance, limit=a.limit)
    p = leaf(
        commands,
        "events",
        "what happened to instances: replica failures and rehydrations, reconciliations, "
        "divergences, slow replicas, dataflow errors, controllers taking over",
        latest_events,
        _events,
    )
    p.add_argument("--instance", help="only this instance's events")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="how many of the latest to show (default: %(default)s)")
    p.add_argument("--follow", action="store_true", help="then print new events as they are recorded, until interrupted")
    p.set_defaults(run=lambda args: _follow_events(args) if args.follow else _run(latest_events, _events, args))
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
    with Client(args.address, **_security(args)) as client:
        data = handler(client, args)
    print(json.dumps(data, indent=2, default=_json_value) if args.json else render(data))


def _security(args: argparse.Namespace) -> dict[str, Any]:
    """The client's token (from --token-file, else $TANDEM_TOKEN) and TLS files."""
    try:
        token = read_token(args.token_file) if args.token_file is not None else os.environ.get("TANDEM_TOKEN") or None
    except (OSError, ValueError) as error:
        raise TandemError(grpc.StatusCode.INVALID_ARGUMENT, f"--token-file: {error}") from None
    return {"token": token, "tls_ca": args.tls_ca, "tls_cert": args.tls_client_cert, "tls_key": args.tls_client_key}


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
