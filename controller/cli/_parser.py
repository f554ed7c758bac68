"""The `tandem` command line's arguments: every command, its options and their
defaults, each leaf bound to its handler and renderer."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.cli._commands import (
    Handler,
    _dataflow_create,
    _drop,
    _follow_events,
    _instance_create,
    _peek,
    _query,
    _replica_add,
    _resize,
    _run,
    _run_demo,
    _serve,
    _source_append,
    _source_create,
    _subscribe,
    _watch_status,
)
from controller.cli import _storage
from controller.cli._render import format_table, _dataflows, _events, _handover, _instances, _leadership, _one, _replicas, _rows, _said, _sources, _status_report
from controller.client import DEFAULT_ADDRESS, Client
from protocol.security import add_server_arguments

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



def _status_data(client: Client, args: argparse.Namespace) -> Any:
    """What `tandem status` prints: the instances as JSON, or as text with who leads."""
    return client.status(args.instance) if args.json else _status_report(client, args.instance)


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

    p = commands.add_parser(
        "serve",
        help="run a controller",
        description="Run a controller in the foreground. SIGTERM or Ctrl-C stops it and the replica "
        "processes it runs (see --keep-replicas); `tandem serve &` is stopped with `kill %%1`.",
    )
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
        metavar="HOST:PORT",
        help="where to serve the status page (/), its JSON (/api/status) and Prometheus metrics (/metrics), "
        "or off (default: the --listen host and the next port, 127.0.0.1:6876)",
    )
    p.add_argument(
        "--keep-replicas",
        action="store_true",
        help="on SIGTERM or Ctrl-C, leave the replica processes running, for the next controller on this "
        "catalog to adopt (default: stop them too; a kill -9 of the controller always leaves them)",
    )
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="what the terminal (stderr) shows; DATA_DIR/logs/controller.log gets everything from info on "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="wait warm (catalog open, planner started) and take the lead when the leader's lease lapses or "
        "its process is gone (default: take the lead at once, fencing any other controller on this catalog)",
    )
    p.add_argument("--lease-ms", type=int, default=5_000, metavar="N", help="the leader's lease (default: %(default)s)")
    p.add_argument("--lease-renew-ms", type=int, default=1_000, metavar="N", help="how often the leader renews it (default: %(default)s)")
    p.add_argument(
        "--lease-margin-ms",
        type=int,
        default=1_500,
        metavar="N",
        help="how long before its lease ends a leader that could not renew it stops serving; more than the "
        "clock skew between the controllers' hosts (default: %(default)s)",
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
    p.add_argument("--on-timeout", choices=("rollback", "commit"), default="rollback", help="then drop the new replicas, or the old ones (default: %(default)s)")

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
    p.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="apply the append once per KEY (within 10 minutes): run again with the same KEY after a failure, "
        "it appends nothing if the first try was committed and prints that one's timestamp",
    )
    p = leaf(
        source, "drop", "drop a source", _drop("source", lambda c, a: c.drop_source(a.name)), _said
    )
    p.add_argument("name")
    leaf(source, "list", "list sources", lambda c, a: c.list_sources(), _sources)

    leader = group("leader", "which controller leads, and its standbys")
    leaf(leader, "show", "show the leading controller, its epoch and lease, and the standbys", lambda c, a: c.leadership(), _leadership)
    p = leaf(
        leader,
        "handover",
        "move the lead to a standby on purpose (to upgrade or stop the leader): the leader holds new calls, "
        "lets those in flight finish, hands over and exits once the standby serves",
        lambda c, a: c.handover(a.to),
        _handover,
    )
    p.add_argument("--to", metavar="HOST:PORT", help="the standby to hand over to (default: the one heard from last)")

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
        "who leads; instances with their replicas, dataflows and collections, and what fails",
        _status_data,
        str,
    )
    p.add_argument("instance", nargs="?")
    p.add_argument("--watch", action="store_true", help="redraw it every --interval seconds until interrupted")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="with --watch (default: %(default)s)")
    p.set_defaults(run=lambda args: _watch_status(args) if args.watch else _run(_status_data, str, args))

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
    _storage.register(commands, leaf, format_table)
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

