"""What the CLI prints: aligned tables (drawn by rich) and the text of each command's
data; `--json` prints the data itself instead (`_json_value`)."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import io
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from controller._api import DataflowStatusView, DataflowView, EventView, HandoverView, InstanceView, LeadershipView, ReplicaView, SourceView
from controller.client import QueryResult

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
            "INCARNATION",
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
    """Each dataflow on each replica that reports it: its latest step (its time, the
    rows it changed, the times it computed in one pass), its backlog (change times not
    computed yet, and the input updates they hold) and any error (or retries)."""
    rows = sorted(
        [name, r.name, _hydration(s), s.steps, s.last_step_ms, s.rows_changed, s.last_step_times, s.pending_times, s.pending_rows, _problem(s)]
        for r in views
        for name, s in r.dataflows.items()
    )
    headers = ["DATAFLOW", "REPLICA", "HYDRATED", "STEPS", "LAST_STEP_MS", "ROWS_CHANGED", "STEP_TIMES", "PENDING_TIMES", "PENDING_ROWS", "ERROR"]
    return format_table(headers, rows) if rows else None


def _problem(status: DataflowStatusView) -> str | None:
    """Its error once failed; while it backs off and retries, how often and why."""
    if status.error is None and status.retries:
        return f"retrying ({status.retries}): {status.retry_error}"
    return status.error


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


def _status_report(client: Any, instance: str | None) -> str:
    """`tandem status` as text: who leads, then `_status` of the instances."""
    return _lead_line(client.leadership()) + "\n\n" + _status(client.status(instance))


def _lead_line(view: LeadershipView) -> str:
    """The controllers in a line: the leader, its epoch and lease, and the standbys."""
    if view.leader is None or view.lease_remaining_ms is None:
        lead = f"controller epoch {view.epoch}, no lease held"
    else:
        lease = view.lease_remaining_ms
        lead = f"controller {view.leader.address} leads at epoch {view.epoch} (lease {f'lapsed {-lease} ms ago' if lease < 0 else f'{lease} ms left'})"
    standbys = ", ".join(f"{s.address} (heard {s.heard_ms_ago} ms ago)" for s in view.standbys) or "none"
    return f"{lead}; standbys: {standbys}"


def _events(events: list[EventView]) -> str:
    return format_table(["TIME", "INSTANCE", "KIND", "REPLICA", "MESSAGE"], [_event_row(e) for e in events])


def _leadership(view: LeadershipView) -> str:
    """The lead and its lease in a line, then the controllers taking part."""
    if view.leader is None or view.lease_remaining_ms is None:
        head = f"no controller leads (epoch {view.epoch}); a standby takes the lead at its next poll"
    else:
        lease = view.lease_remaining_ms
        ends = f"lapsed {-lease} ms ago" if lease < 0 else f"{lease} ms left"
        head = f"{view.leader.address} leads at epoch {view.epoch} (lease {ends}, {view.lease_renewals} renewals)"
    controllers = [c for c in (view.leader, *view.standbys) if c is not None]
    table = format_table(["ROLE", "ADDRESS", "HOST", "PID", "HEARD_MS_AGO"], [[c.role, c.address, c.host, c.pid, c.heard_ms_ago] for c in controllers])
    return head + "\n" + table


def _handover(view: HandoverView) -> str:
    return f"handed the lead over from {view.previous} to {view.leader} (epoch {view.epoch}); new calls waited {view.unavailable_ms} ms"


def _event_row(event: EventView) -> list[Any]:
    at = dt.datetime.fromtimestamp(event.at_ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")
    return [at, event.instance, event.kind, event.replica or None, event.message]



def _rows(result: QueryResult) -> str:
    footer = f"({_count(result.table.num_rows, 'row')} at timestamp {result.timestamp}"
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



def _said(data: dict[str, Any]) -> str:
    if "dropped" in data:
        return f"dropped {data['dropped']} {data['name']}"
    return f"appended {_count(data['rows'], 'row')} to {data['source']} at timestamp {data['timestamp']}"


def _count(n: int, noun: str) -> str:
    """"1 row", "2 rows"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"

