"""What each command does: handlers `(client, args) -> data` (rendered by `_render`,
or printed as JSON), the commands that stream (`subscribe`, `status --watch`, `events
--follow`), and `serve` and `demo`, which start processes."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import pyarrow as pa
from rich.console import Console
from rich.live import Live
from rich.text import Text

from controller import _progress
from controller._api import ControllerError, DataflowView, InstanceView, ReplicaView, SourceView
from controller.cli._files import _invalid, _read_parquet, _read_rows
from controller.cli._render import _cell, _count, _event_row, _json_value, _status_report
from controller.client import Client, QueryResult, TandemError
from protocol.security import ServerSecurity, read_token

FOLLOW_INTERVAL_S = 1.0  # how often `events --follow` asks for new events


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
    """`tandem status --watch`: on a terminal, redrawn in place on a screen of its own
    (as `watch` does), cut to the terminal's height, and the last frame left on the
    terminal when interrupted; elsewhere (or with --json) one snapshot after another,
    until interrupted. (Redrawn by moving the cursor up, a frame taller than the
    terminal left its top lines behind, frame after frame.)"""
    console = _console()
    with Client(args.address, **_security(args)) as client:
        if args.json or not console.is_terminal:
            while True:
                if args.json:
                    print(json.dumps(client.status(args.instance), default=_json_value), flush=True)
                else:
                    print(_status_report(client, args.instance) + "\n", flush=True)
                time.sleep(args.interval)
        frame = Text()
        try:
            with Live(console=console, auto_refresh=False, screen=True, vertical_overflow="crop") as live:
                while True:
                    frame = Text(_status_report(client, args.instance))
                    live.update(frame, refresh=True)
                    time.sleep(args.interval)
        finally:
            console.print(frame)


def _console() -> Console:
    return Console()


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

    return _progress.while_running(lambda: client.resize(args.name, args.size, timeout_ms=args.timeout_ms, on_timeout=args.on_timeout), replaced)


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
    with _progress.spinner(f"appending {_count(count, 'row')} to {args.name}"):
        timestamp = client.append(args.name, rows, idempotency_key=args.idempotency_key)
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
    from controller import _serve
    from controller._leadership import LeaseOptions

    try:
        security = ServerSecurity.of(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file)
    except (OSError, ValueError) as error:
        raise TandemError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
    http_listen = args.http_listen or http_beside(args.listen)
    try:
        lease = LeaseOptions(args.lease_ms, args.lease_renew_ms, args.lease_margin_ms)
        asyncio.run(
            _serve.serve(
                data_dir=args.data_dir,
                catalog_url=args.catalog,
                listen=args.listen,
                blob_uri=args.blob_uri,
                retention_ms=args.retention_ms,
                gc_grace_ms=args.gc_grace_ms,
                upkeep_interval_ms=args.upkeep_interval_ms,
                security=security,
                http_listen=None if http_listen == "off" else http_listen,
                keep_replicas=args.keep_replicas,
                log_level=args.log_level,
                standby=args.standby,
                lease=lease,
            )
        )
    except ControllerError as error:  # refused at start (a bad option, address or blob location), or the end of a lead
        raise TandemError(grpc.StatusCode[error.code], error.message) from None


def http_beside(listen: str) -> str:
    """The default HTTP address of a controller listening on `listen`: the same host,
    the next port (port 0, any free port, stays 0), so that controllers on different
    ports never collide on the HTTP one."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) >= 65535:
        raise TandemError(grpc.StatusCode.INVALID_ARGUMENT, f"no HTTP port follows --listen {listen}; give --http-listen HOST:PORT (or off)")
    return f"{host}:{int(port) + 1 if int(port) else 0}"


def _run_demo(args: argparse.Namespace) -> None:
    # Imported here, as the runtime is: only `tandem demo` starts processes.
    from controller import _demo

    try:
        _demo.run(args.data_dir, keep=args.keep)
    except _demo.DemoFailed as error:  # a step did not happen (in time)
        raise TandemError(grpc.StatusCode.ABORTED, f"the demo stopped: {error}") from None
    except RuntimeError as error:  # its controller did not start
        raise TandemError(grpc.StatusCode.UNAVAILABLE, str(error)) from None



Handler = Callable[[Client, argparse.Namespace], Any]


def _drop(kind: str, drop: Callable[[Client, argparse.Namespace], None]) -> Handler:
    def handler(client: Client, args: argparse.Namespace) -> dict[str, str]:
        drop(client, args)
        return {"dropped": kind, "name": args.name}

    return handler



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

