"""The `tandem` CLI end to end: `cli.main([...])` -> `Client` -> a real in-process
`ControllerServer` over the `FakeApi` of tests/test_client_api.py; stdout, stderr and the
exit code are checked as a user (or a script, with `--json`) sees them."""

from __future__ import annotations

import datetime as dt
import decimal
import gc
import io
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import grpc
import pyarrow as pa
import pytest
from test_client_api import FakeApi, ServerThread, fail_kept, free_address, populated

import controller
from controller._api import EventView
from controller._leadership import LeaseOptions
from controller.cli import format_table, main
from controller.client import Client, TandemError
from history import OrderBy, Predicate
from protocol.security import ServerSecurity


@pytest.fixture
def server():
    running = ServerThread(FakeApi())
    with Client.connect(running.address) as client:
        populated(client)
    yield running
    running.close()


@pytest.fixture
def api(server: ServerThread) -> FakeApi:
    return server.api


@pytest.fixture
def tandem(server, capsys):
    """`tandem(*argv)` runs the CLI against the server: (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--address", server.address])
        out, err = capsys.readouterr()
        return code, out, err

    return run


# --- Tables ----------------------------------------------------------------------------


def test_format_table_aligns_text_left_and_numbers_right():
    text = format_table(["NAME", "N", "OK"], [["a", 1, True], ["bbbb", 200, None]])
    assert text.splitlines() == [
        "NAME    N  OK",
        "----  ---  ----",
        "a       1  true",
        "bbbb  200  -",
    ]
    assert format_table(["A"], []) == "A\n-"


# --- Usage -----------------------------------------------------------------------------


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in (
        "serve",
        "instance",
        "replica",
        "source",
        "dataflow",
        "peek",
        "query",
        "status",
        "events",
    ):
        assert command in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["peek", "prod"],
        ["peek", "prod", "t", "--where", "id~1"],
        ["instance", "create", "x", "--conf", "no-equals-sign"],
        ["source", "append", "orders"],
        ["source", "append", "orders", "--csv", "a.csv", "--jsonl", "b.jsonl"],
        ["source", "append", "orders", "--csv", "a.csv", "--parquet", "b.parquet"],
        ["source", "create", "orders"],
        ["source", "create", "orders", "--schema", "id INT", "--like-parquet", "o.parquet"],
        ["instance", "create", "x", "--min-in-sync", "two"],
    ],
)
def test_usage_errors_exit_2(capsys, argv):
    assert main(argv) == 2
    assert "usage: tandem" in capsys.readouterr().err


# --- Instances and replicas ------------------------------------------------------------


def test_instance_create_list_drop(tandem, api):
    code, out, _ = tandem(
        "instance",
        "create",
        "dev",
        "--min-in-sync",
        "2",
        "--max-lag-ms",
        "250",
        "--max-hold-back-ms",
        "60000",
        "--replace-slow",
        "--conf",
        "spark.sql.shuffle.partitions=8",
        "--conf",
        "a=b=c",
    )
    assert code == 0
    assert out.splitlines()[0].split() == [
        "NAME",
        "HEALTH",
        "IN_SYNC",
        "REPLICAS",
        "MIN_IN_SYNC",
        "MAX_LAG_MS",
        "COLLECTIONS",
    ]
    assert out.splitlines()[2].split() == ["dev", "unavailable", "0", "0", "2", "250", "0"]
    assert api.last("create_instance")[1]["spark_conf"] == {
        "spark.sql.shuffle.partitions": "8",
        "a": "b=c",
    }
    assert api.last("create_instance")[1]["max_hold_back_ms"] == 60_000
    assert api.last("create_instance")[1]["replace_slow"] is True

    code, out, _ = tandem("instance", "list", "--json")
    assert [i["name"] for i in json.loads(out)] == ["dev", "prod"]
    assert json.loads(out)[1]["replicas"][0]["name"] == "r1"
    assert tandem("instance", "drop", "dev") == (0, "dropped instance dev\n", "")
    assert json.loads(tandem("instance", "drop", "prod", "--json")[1]) == {
        "dropped": "instance",
        "name": "prod",
    }
    assert tandem("instance", "list")[1] == (
        "NAME  HEALTH  IN_SYNC  REPLICAS  MIN_IN_SYNC  MAX_LAG_MS  COLLECTIONS\n"
        "----  ------  -------  --------  -----------  ----------  -----------\n"
    )


def test_replica_add_drop_and_instance_resize(tandem, api):
    code, out, _ = tandem(
        "replica",
        "add",
        "prod",
        "r2",
        "--spark-master",
        "spark://h:7077",
        "--conf",
        "spark.executor.cores=4",
    )
    assert code == 0 and "r2" in out and "spark://h:7077" in out
    assert api.last("add_replica")[1] == {
        "size": None,
        "spark_master": "spark://h:7077",
        "spark_conf": {"spark.executor.cores": "4"},
        "address": None,
        "driver_host": None,
        "driver_bind_address": None,
        "wait": False,
        "timeout_ms": None,
    }
    tandem("replica", "add", "prod", "r3")
    assert api.last("add_replica")[1]["size"] == "xsmall"
    tandem(
        "replica", "add", "prod", "r5", "--spark-master", "spark://h:7077", "--driver-host", "10.0.0.2",
        "--driver-bind-address", "0.0.0.0", "--wait", "--timeout-ms", "45000",
    )
    assert {k: v for k, v in api.last("add_replica")[1].items() if k.startswith(("driver", "wait", "timeout"))} == {
        "driver_host": "10.0.0.2",
        "driver_bind_address": "0.0.0.0",
        "wait": True,
        "timeout_ms": 45_000,
    }
    tandem("replica", "drop", "prod", "r5", "--force")
    tandem("replica", "add", "prod", "ext", "--replica-address", "10.0.0.5:7000", "--size", "large")
    assert api.last("add_replica")[1] == {
        "size": "large",
        "spark_master": None,
        "spark_conf": None,
        "address": "10.0.0.5:7000",
        "driver_host": None,
        "driver_bind_address": None,
        "wait": False,
        "timeout_ms": None,
    }
    assert tandem("replica", "drop", "prod", "ext", "--force") == (0, "dropped replica ext\n", "")
    assert api.last("drop_replica")[1] == {"force": True}

    code, out, _ = tandem("instance", "resize", "prod", "medium", "--timeout-ms", "5000", "--on-timeout", "commit", "--json")
    assert [r["name"] for r in json.loads(out)] == ["r1-medium", "r2-medium", "r3-medium"]
    assert api.last("resize") == (("prod", "medium"), {"timeout_ms": 5000, "on_timeout": "commit"})


# --- Sources ---------------------------------------------------------------------------

TYPED = "id BIGINT NOT NULL, day DATE, at TIMESTAMP, price DECIMAL(10,2), ok BOOLEAN, name STRING, score FLOAT"


def stored(api: FakeApi, source: str) -> list[dict]:
    return api.batches[source][-1].drop_columns(["_time"]).to_pylist()


def test_leader_show_names_the_leader_its_lease_and_the_standbys(tandem):
    code, out, _ = tandem("leader", "show")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "10.0.0.5:6875 leads at epoch 7 (lease 3880 ms left, 52 renewals)"
    assert [line.split()[:3] for line in lines[3:5]] == [["leader", "10.0.0.5:6875", "h1"], ["standby", "10.0.0.6:6875", "h2"]]
    code, out, _ = tandem("leader", "show", "--json")
    assert json.loads(out)["standbys"][0] == {"role": "standby", "address": "10.0.0.6:6875", "host": "h2", "pid": 42, "heard_ms_ago": 480}


def test_leader_handover_says_where_the_lead_went(tandem):
    code, out, _ = tandem("leader", "handover", "--to", "10.0.0.6:6875")
    assert code == 0 and out.strip() == "handed the lead over from 10.0.0.5:6875 to 10.0.0.6:6875 (epoch 8); new calls waited 67 ms"
    code, _, err = tandem("leader", "handover", "--to", "10.0.0.9:1")
    assert code == 1 and err.strip() == "error: NOT_FOUND: no standby at 10.0.0.9:1: the standbys are at 10.0.0.6:6875"


def test_source_create_and_list(tandem):
    code, out, _ = tandem(
        "source", "create", "events", "--schema", "id bigint not null, note string"
    )
    assert code == 0
    assert out.splitlines()[2].split()[:4] == ["events", "s2", "0", "0"]
    code, out, _ = tandem("source", "create", "more", "--schema", "x INT", "--json")
    assert json.loads(out) == {
        "id": "s3",
        "name": "more",
        "schema": "x INT",
        "since": 0,
        "upper": 0,
    }
    tandem("source", "drop", "more")
    code, out, _ = tandem("source", "list", "--json")
    assert [s["schema"] for s in json.loads(out)] == [
        "id BIGINT NOT NULL, region STRING, amount DOUBLE",
        "id BIGINT NOT NULL, note STRING",
    ]
    assert tandem("source", "drop", "events") == (0, "dropped source events\n", "")


def test_csv_append_converts_values_by_the_source_schema(tandem, api, tmp_path):
    tandem("source", "create", "events", "--schema", TYPED)
    path = tmp_path / "events.csv"
    path.write_text(
        "id,day,at,price,ok,name,score,_diff\n"
        "1,2024-01-31,2024-01-31T12:30:00,9.99,true,ann,1.5,1\n"
        '2,,,,,"",,-1\n'
    )
    code, out, err = tandem("source", "append", "events", "--csv", str(path))
    assert (code, out, err) == (0, "appended 2 rows to events at timestamp 1001\n", "")
    assert stored(api, "events") == [
        {
            "id": 1,
            "day": dt.date(2024, 1, 31),
            "at": dt.datetime(2024, 1, 31, 12, 30, tzinfo=dt.UTC),
            "price": decimal.Decimal("9.99"),
            "ok": True,
            "name": "ann",
            "score": 1.5,
            "_diff": 1,
        },
        # An empty cell is NULL, except in a string column, where it is "".
        {
            "id": 2,
            "day": None,
            "at": None,
            "price": None,
            "ok": None,
            "name": "",
            "score": None,
            "_diff": -1,
        },
    ]


def test_jsonl_append_from_a_file_and_from_stdin(tandem, api, tmp_path, monkeypatch):
    tandem("source", "create", "events", "--schema", TYPED)
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"id": 1, "day": "2024-02-01", "price": 1.10, "score": 2.25, "ok": false}\n\n{"id": 2}\n'
    )
    code, out, _ = tandem("source", "append", "events", "--jsonl", str(path), "--json")
    assert code == 0 and json.loads(out) == {"source": "events", "rows": 2, "timestamp": 1001}
    first = stored(api, "events")[0]
    assert (first["day"], first["price"], first["score"], first["ok"]) == (
        dt.date(2024, 2, 1),
        decimal.Decimal("1.10"),
        2.25,
        False,
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": 3, "name": "from stdin"}\n'))
    assert tandem("source", "append", "events", "-")[0] == 0
    assert stored(api, "events")[0]["name"] == "from stdin"
    monkeypatch.setattr(sys, "stdin", io.StringIO("id,day,at,price,ok,name,score\n4,,,,,csv on stdin,\n"))
    assert tandem("source", "append", "events", "--csv", "-")[0] == 0
    assert stored(api, "events")[0] == dict.fromkeys(first, None) | {
        "id": 4,
        "name": "csv on stdin",
        "_diff": 1,
    }
    # Each append carries a fresh key unless given one; run again with it, it appends once.
    appended = len(api.batches["events"])
    assert len(set(api.append_keys)) == len(api.append_keys) and None not in api.append_keys
    said = []
    for _ in range(2):
        monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": 5}\n'))
        code, out, _ = tandem("source", "append", "events", "-", "--idempotency-key", "load-5", "--json")
        said.append((code, json.loads(out)["timestamp"]))
    assert said == [(0, 1001 + appended)] * 2
    assert api.append_keys[-2:] == ["load-5", "load-5"] and len(api.batches["events"]) == appended + 1


def test_a_source_like_a_parquet_file_takes_its_rows_by_column_name(tandem, api, tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "trips.parquet"
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("city", pa.string()), pa.field("km", pa.float64())])
    pq.write_table(pa.table({"id": [1, 2], "city": ["Oslo", None], "km": [3.5, 7.0]}, schema=schema), path)
    code, out, _ = tandem("source", "create", "trips", "--like-parquet", str(path), "--json")
    assert code == 0 and json.loads(out)["schema"] == "id BIGINT NOT NULL, city STRING, km DOUBLE"

    code, out, _ = tandem("source", "append", "trips", "--parquet", str(path), "--json")
    assert code == 0 and json.loads(out)["rows"] == 2
    assert stored(api, "trips") == [{"id": 1, "city": "Oslo", "km": 3.5, "_diff": 1}, {"id": 2, "city": None, "km": 7.0, "_diff": 1}]

    # Another order, narrower types and a _diff: matched by name and cast.
    retract = tmp_path / "retract.parquet"
    pq.write_table(pa.table({"km": pa.array([3.5], pa.float32()), "_diff": [-1], "city": ["Oslo"], "id": pa.array([1], pa.int32())}), retract)
    assert tandem("source", "append", "trips", "--parquet", str(retract))[0] == 0
    assert stored(api, "trips") == [{"id": 1, "city": "Oslo", "km": 3.5, "_diff": -1}]

    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"id": [1], "town": ["Oslo"]}), wrong)
    code, _, err = tandem("source", "append", "trips", "--parquet", str(wrong))
    assert code == 1 and "missing ['city', 'km'], not in the source ['town']" in err
    unconvertible = tmp_path / "text_ids.parquet"
    pq.write_table(pa.table({"id": ["x"], "city": ["Oslo"], "km": [1.0]}), unconvertible)
    code, _, err = tandem("source", "append", "trips", "--parquet", str(unconvertible))
    assert code == 1 and "INVALID_ARGUMENT" in err and "column 'id' (BIGINT NOT NULL) cannot take its string values" in err
    code, _, err = tandem("source", "create", "nothing", "--like-parquet", str(tmp_path / "missing.parquet"))
    assert code == 1 and "cannot read the schema of" in err
    assert len(api.batches["trips"]) == 2 and "nothing" not in api.sources  # the refusals wrote nothing


HEADER = "id,day,at,price,ok,name,score"


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "bad.csv",
            f"{HEADER}\n1,2024-01-01,,,,,\nx,2024-01-02,,,,,\n",
            "bad.csv: line 3: column 'id' (BIGINT NOT NULL) cannot take 'x'",
        ),
        ("bad.csv", f"{HEADER}\n1,,,,maybe,,\n", "bad.csv: line 2: column 'ok' (BOOLEAN) cannot take 'maybe'"),
        ("bad.csv", f"{HEADER}\n1,,,9.x,,,\n", "bad.csv: line 2: column 'price' (DECIMAL(10,2)) cannot take '9.x'"),
        ("bad.csv", f"{HEADER}\n1,2,,,,,,\n", "bad.csv: line 2: more cells than the header has columns"),
        # A NULL in a NOT NULL column: the file and its line, not storage's row index.
        ("bad.csv", f"{HEADER}\n1,,,,,,\n,,,,,,\n", "bad.csv: line 3: column 'id' (BIGINT NOT NULL) has no value"),
        # Issue 50: a header without a column appended the rows with it NULL.
        (
            "bad.csv",
            "id,name\n1,ann\n",
            "bad.csv: line 1: the header lacks columns 'day' (DATE), 'at' (TIMESTAMP), 'price' (DECIMAL(10,2)), "
            "'ok' (BOOLEAN), 'score' (FLOAT) of source 'events'; give every column (an empty field is NULL)",
        ),
        ("bad.csv", f"{HEADER},extra\n1,,,,,,,\n", "bad.csv: line 1: column 'extra' is not a column of source 'events' (id, day, at, price, ok, name, score, and _diff)"),
        ("bad.csv", f"{HEADER},id\n1,,,,,,,1\n", "bad.csv: line 1: column 'id' appears twice in the header"),
        ("bad.jsonl", '{"id": 1}\n{"id": \n', "bad.jsonl: line 2: not JSON"),
        ("bad.jsonl", "[1]\n", "bad.jsonl: line 1: expected a JSON object"),
        (
            "bad.jsonl",
            '{"id": 1, "day": "31/01/2024"}\n',
            "bad.jsonl: line 1: column 'day' (DATE) cannot take '31/01/2024'",
        ),
        ("bad.jsonl", '{"id": 1}\n{"name": "no id"}\n', "bad.jsonl: line 2: column 'id' (BIGINT NOT NULL) has no value"),
        ("bad.jsonl", '{"id": 1, "nmae": "typo"}\n', "bad.jsonl: line 1: column 'nmae' is not a column of source 'events'"),
    ],
)
def test_rows_that_do_not_read_are_refused_naming_file_line_column_and_type(
    tandem, api, tmp_path, name, text, message
):
    tandem("source", "create", "events", "--schema", TYPED)
    path = tmp_path / name
    path.write_text(text)
    flag = "--csv" if name.endswith(".csv") else "--jsonl"
    code, out, err = tandem("source", "append", "events", flag, str(path))
    assert (code, out) == (1, "")
    assert err.startswith("error: INVALID_ARGUMENT: ") and message in err, err
    assert len(api.batches["events"]) == 0  # nothing written


def test_one_row_is_one_row(tandem, tmp_path):
    path = tmp_path / "one.csv"
    path.write_text("id,region,amount\n1,eu,\n")  # an explicit empty field: NULL
    assert tandem("source", "append", "orders", "--csv", str(path)) == (0, "appended 1 row to orders at timestamp 1001\n", "")


def test_append_to_an_unknown_source_or_from_a_missing_file(tandem, tmp_path):
    assert (
        tandem("source", "append", "nope", "--csv", "x.csv")[2]
        == "error: NOT_FOUND: no source named 'nope'\n"
    )
    missing = tmp_path / "missing.csv"
    code, _, err = tandem("source", "append", "orders", "--csv", str(missing))
    assert (code, err) == (
        1,
        f"error: INVALID_ARGUMENT: cannot read {missing}: No such file or directory\n",
    )


CLIENT_ONLY = """
import sys
from controller.cli import main
code = main(sys.argv[1:])
heavy = {"pyspark", "sqlalchemy", "alembic", "storage", "catalog", "pyarrow.compute", "pyarrow.parquet"}
print(sorted(m for m in sys.modules if m in heavy or m.split(".")[0] in heavy), code)
"""


@pytest.mark.parametrize("argv", [["status"], ["source", "append", "orders", "--csv", "{csv}"], ["peek", "prod", "by_id", "--key", "1"]])
def test_client_commands_load_neither_spark_nor_the_catalog(server, tmp_path, argv):
    """Issue 50: `source append` took 4-7 s on a loaded machine, most of it importing
    storage (the catalog's SQLAlchemy and Alembic, pyarrow.compute and Parquet) for a
    DDL parser. A client command loads what a client needs (bench/cli_startup_bench.py
    times them)."""
    csv_path = tmp_path / "orders.csv"
    csv_path.write_text("id,region,amount\n7,eu,1.5\n")
    command = [sys.executable, "-c", CLIENT_ONLY, *(a.format(csv=csv_path) for a in argv), "--address", server.address]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.splitlines()[-1] == "[] 0", run.stdout + run.stderr


# --- Dataflows and reads ---------------------------------------------------------------


def test_dataflow_create_list_drop(tandem, api):
    code, out, _ = tandem(
        "dataflow",
        "create",
        "prod",
        "copy",
        "--sql",
        "SELECT * FROM orders",
        "--index-key",
        "region, id",
        "--materialize",
        "--compaction-window-ms",
        "60000",
    )
    assert code == 0 and out.splitlines()[2].split()[:6] == [
        "prod",
        "copy",
        "d2",
        "region,id",
        "m2",
        "60000",
    ]
    assert api.last("create_dataflow")[1] == {
        "index_key": ("region", "id"),
        "materialize": True,
        "compaction_window_ms": 60000,
        "strategy": "auto",
    }
    tandem("dataflow", "create", "prod", "rows", "--sql", "SELECT * FROM orders", "--index-key", "")
    assert api.last("create_dataflow")[1]["index_key"] == ()
    code, out, _ = tandem("dataflow", "list", "prod")
    assert [line.split()[1] for line in out.splitlines()[2:]] == ["by_id", "copy", "rows"]
    assert "(whole row)" in out
    assert tandem("dataflow", "drop", "prod", "copy") == (0, "dropped dataflow copy\n", "")
    assert [d["name"] for d in json.loads(tandem("dataflow", "list", "--json")[1])] == [
        "by_id",
        "rows",
    ]


def test_peek_prints_an_aligned_table(tandem):
    code, out, err = tandem("peek", "prod", "by_id", "--where", "region=eu", "--order-by=-id")
    assert (code, err) == (0, "")
    assert out == (
        "id  region  amount\n"
        "--  ------  ------\n"
        " 3  eu        NULL\n"
        " 1  eu        10.0\n"
        "(2 rows at timestamp 1000, from replica r1)\n"
    )


def test_peek_options_reach_the_api(tandem, api):
    code, out, _ = tandem(
        "peek",
        "prod",
        "by_id",
        "--key",
        "3",
        "--where",
        "amount = null",
        "--where",
        "id=[1, 3]",
        "--where",
        "region != null",
        "--where",
        "id>=0",
        "--where",
        'region="eu"',
        "--order-by",
        "amount:desc,id",
        "--columns",
        "id,region",
        "--limit",
        "5",
        "--offset",
        "0",
        "--timestamp",
        "1000",
        "--strict",
        "--timeout-ms",
        "700",
        "--json",
    )
    assert code == 0 and json.loads(out) == {
        "timestamp": 1000,
        "replica": "r1",
        "rows": [{"id": 3, "region": "eu"}],
    }
    options = api.last("peek")[1]
    assert options["key"] == (3,)
    assert options["where"] == (
        Predicate("amount", "is_null"),
        Predicate("id", "in", (1, 3)),
        Predicate("region", "is_not_null"),
        Predicate("id", ">=", 0),
        Predicate("region", "=", "eu"),
    )
    assert options["order_by"] == (OrderBy("amount", descending=True), OrderBy("id"))
    assert (options["columns"], options["limit"], options["timestamp"]) == (
        ("id", "region"),
        5,
        1000,
    )
    assert (options["consistency"], options["timeout_ms"]) == ("strict", 700)


def test_command_line_literals(tandem, api):
    tandem(
        "peek",
        "prod",
        "by_id",
        "--key",
        "eu",
        "--key",
        '"42"',
        "--key",
        "1.5",
        "--key",
        "true",
        "--where",
        "day=2024-01-31",
    )
    options = api.last("peek")[1]
    assert options["key"] == ("eu", "42", 1.5, True)
    assert options["where"] == (Predicate("day", "=", "2024-01-31"),)


def test_query_prints_rows(tandem, api):
    code, out, _ = tandem("query", "prod", "SELECT 1", "--timestamp", "7")
    assert code == 0
    assert out.splitlines() == [
        "sql       consistency",
        "--------  ------------",
        "SELECT 1  serializable",
        "(1 row at timestamp 7, from replica r1)",
    ]
    assert api.last("query")[1] == {
        "timestamp": 7,
        "consistency": "serializable",
        "timeout_ms": 30_000,
    }


def test_status_shows_replicas_and_collections(tandem, api):
    tandem("dataflow", "create", "prod", "kept", "--sql", "SELECT * FROM orders", "--materialize")
    code, out, _ = tandem("status", "prod")
    lead, blank, *lines = out.splitlines()
    assert code == 0
    assert (lead, blank) == ("controller 10.0.0.5:6875 leads at epoch 7 (lease 3880 ms left); standbys: 10.0.0.6:6875 (heard 480 ms ago)", "")
    assert lines[0] == (
        "instance prod: healthy (1 of 1 replicas in sync, min 1; max lag 1000 ms; "
        "history 5 commands, 1 reductions, 10 pushed)"
    )
    assert lines[1].split()[:4] == ["NAME", "SIZE", "STATE", "IN_SYNC"]
    assert lines[3].split()[:4] == ["r1", "xsmall", "active", "true"]
    assert lines[5].split() == ["COLLECTION", "ID", "SINCE", "WRITE_FRONTIER", "STALE_MS"]
    assert lines[8].split() == ["kept", "(sink)", "m2", "empty", "empty", "-"]
    code, out, _ = tandem("status", "--json")
    assert json.loads(out)[0]["collections"][1] == {
        "id": "m2",
        "name": "kept (sink)",
        "since": None,
        "write_frontier": None,
        "wallclock_lag_ms": None,
    }


def test_events_list_the_latest_and_follow_prints_new_ones_as_they_come(tandem, api, monkeypatch):
    api.events_recorded = [
        EventView(1, 1_700_000_000_000, "prod", "replica_failed", "r1", "replica r1 (incarnation 1) failed: stream broke"),
        EventView(2, 1_700_000_001_500, "prod", "took_over", "", "controller epoch 2 recovered the instance"),
    ]
    code, out, _ = tandem("events", "--instance", "prod")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["TIME", "INSTANCE", "KIND", "REPLICA", "MESSAGE"]
    assert lines[2].split()[:4] == ["2023-11-14T22:13:20.000+00:00", "prod", "replica_failed", "r1"]
    assert lines[3].split()[:4] == ["2023-11-14T22:13:21.500+00:00", "prod", "took_over", "-"]

    polls = []

    def poll_later(seconds: float) -> None:  # a new event arrives during the first wait
        polls.append(seconds)
        if len(polls) == 1:
            api.events_recorded.append(EventView(3, 1_700_000_002_000, "prod", "slow", "r2", "replica r2 is slow"))
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr("controller.cli._commands.time", types.SimpleNamespace(sleep=poll_later, time=time.time))
    code, out, _ = tandem("events", "--follow", "--limit", "1", "--json")
    assert code == 130 and [json.loads(line)["id"] for line in out.splitlines()] == [2, 3]
    assert api.last("events") == ((None,), {"after": 2, "limit": 1_000})  # from the last id it printed


def test_status_watch_draws_again_until_interrupted(tandem, api, monkeypatch):
    tandem("instance", "create", "prod")
    naps = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) % 2 == 0:  # two snapshots, then Ctrl-C
            raise KeyboardInterrupt

    monkeypatch.setattr("controller.cli._commands.time", types.SimpleNamespace(sleep=nap, time=time.time))
    code, out, _ = tandem("status", "prod", "--watch", "--interval", "0.5")
    assert code == 130 and naps == [0.5, 0.5]
    assert out.count("instance prod: healthy") == 2  # not a terminal: one snapshot after another
    code, out, _ = tandem("status", "--watch", "--json")
    assert code == 130 and len(naps) == 4 and [json.loads(line)[0]["name"] for line in out.splitlines()] == ["prod", "prod"]


def test_status_watch_redraws_in_place_on_a_terminal(tandem, api, monkeypatch):
    """Issue 50: after a replica kill, old `instance shop: healthy` lines and parts of
    earlier tables stayed at the top of the terminal, a frame taller than the terminal
    being redrawn by moving the cursor up. Now each frame is drawn from the top of a
    screen of its own, cut to its height, and the last is left on the terminal."""
    from rich.console import Console

    from controller.cli import _commands

    screen = io.StringIO()
    monkeypatch.setattr(_commands, "_console", lambda: Console(file=screen, force_terminal=True, width=200, height=6))
    naps = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("controller.cli._commands.time", types.SimpleNamespace(sleep=nap, time=time.time))
    code, out, _ = tandem("status", "prod", "--watch")
    assert code == 130
    drawn = screen.getvalue()
    on_screen, _, left = drawn.partition("\x1b[?1049l")  # leaving the screen of its own
    assert on_screen.startswith("\x1b[?1049h") and on_screen.count("instance prod: healthy") == 3
    frames = on_screen.split("\x1b[H")[1:]  # each drawn from the top left
    assert len(frames) >= 3 and all(frame.count("\n") < 6 for frame in frames)  # cut to the height
    assert left.count("instance prod: healthy") == 1 and "COLLECTION" in left  # the last frame, whole


def test_status_and_dataflow_list_say_what_fails(tandem, api, monkeypatch):
    tandem("dataflow", "create", "prod", "kept", "--sql", "SELECT * FROM orders", "--materialize")
    fail_kept(api)
    # This machine's clock, 4.25 s before the retry.
    monkeypatch.setattr("controller.cli._render.time", types.SimpleNamespace(time=lambda: 1_700_000_000 - 4.25))

    code, out, _ = tandem("status", "prod")

    lines = out.splitlines()[2:]  # after who leads
    assert code == 0 and lines[0].startswith("instance prod: healthy")
    assert lines[1] == "dataflow kept serves nowhere: failed on r1: division by zero"
    header, row = lines[2].split(), lines[4].split()
    assert row[header.index("FAILURES")] == "3" and row[header.index("RETRY") :][:2] == ["in", "4.2s"]
    assert lines[5:8] == [
        "replica r1 reports: no live executors",
        "replica r1 reports: disk full",
        "replica r1 failed 3 time(s) in a row, last: refused (STALE_EPOCH): epoch 1 < 2",
    ]
    assert [line.split() for line in lines[9:15]] == [
        ["DATAFLOW", "REPLICA", "HYDRATED", "STEPS", "LAST_STEP_MS", "ROWS_CHANGED", "STEP_TIMES", "PENDING_TIMES", "PENDING_ROWS", "ERROR"],
        ["--------", "-------", "-" * 9, "-----", "------------", "------------", "----------", "-------------", "------------", "-" * len("retrying (2): storage failed: disk hiccup")],
        ["by_id", "r1", "true", "12", "340", "4", "40", "3", "150", "-"],
        ["kept", "r1", "false", "0", "0", "0", "0", "0", "0", "division", "by", "zero"],
        ["late", "r1", "3/8", "tasks", "0", "0", "0", "0", "0", "0", "-"],
        ["stalled", "r1", "true", "5", "80", "0", "0", "0", "0", "retrying", "(2):", "storage", "failed:", "disk", "hiccup"],
    ]
    assert lines[16].split() == ["COLLECTION", "ID", "SINCE", "WRITE_FRONTIER", "STALE_MS"]
    (view,) = json.loads(tandem("status", "prod", "--json")[1])
    assert view["unavailable_dataflows"] == {"kept": "failed on r1: division by zero"}
    r1 = view["replicas"][0]
    assert r1["errors"] == ["no live executors", "disk full"]
    assert r1["dataflows"]["by_id"] == {
        "hydrated": True,
        "error": None,
        "digest": "ab12",
        "last_step_ms": 340,
        "rows_changed": 4,
        "steps": 12,
        "hydration_tasks_done": 0,
        "hydration_tasks_total": 0,
        "pending_times": 3,
        "pending_rows": 150,
        "last_step_times": 40,
        "retries": 0,
        "retry_error": None,
    }
    assert (r1["consecutive_failures"], r1["next_retry_ms"]) == (3, 1_700_000_000_000)

    code, out, _ = tandem("dataflow", "list", "prod")
    assert out.splitlines()[0].split()[-1] == "ERRORS"
    assert out.splitlines()[3].endswith("r1: division by zero")
    assert out.splitlines()[2].endswith("-")  # by_id failed nowhere
    listed = json.loads(tandem("dataflow", "list", "prod", "--json")[1])
    assert listed[1]["replicas"]["r1"]["error"] == "division by zero"


# --- Errors and the address ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, error",
    [
        (["peek", "prod", "nope"], "error: NOT_FOUND: no dataflow named 'nope' on 'prod'\n"),
        (["instance", "create", "prod"], "error: ALREADY_EXISTS: instance 'prod' already exists\n"),
        (
            ["replica", "drop", "prod", "r1"],
            "error: FAILED_PRECONDITION: dropping it leaves fewer replicas than min_in_sync; use force\n",
        ),
        (["peek", "prod", "by_id", "--where", "id=[1, {}]"], "error: INVALID_ARGUMENT: "),
    ],
)
def test_refusals_print_status_and_message_and_exit_1(tandem, argv, error):
    code, out, err = tandem(*argv)
    assert (code, out) == (1, "")
    assert err.startswith(error)


def test_an_unreachable_controller_exits_1_naming_the_address(capsys):
    address = free_address()
    assert main(["status", "--address", address]) == 1
    assert capsys.readouterr().err.startswith(
        f"error: UNAVAILABLE: cannot reach the controller at {address}: "
    )


def test_the_address_defaults_to_the_environment(server, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_ADDRESS", server.address)
    assert main(["instance", "list"]) == 0
    assert "prod" in capsys.readouterr().out


def test_serve_hands_its_options_to_the_controller(monkeypatch, tmp_path, capsys):
    # An earlier test's in-process server may have left an RPC's tasks behind; asyncio
    # logs them, to the stderr this test reads, whenever the collector finds them: now.
    gc.collect()
    calls = []

    async def serve(**options):
        calls.append(options)

    fake = types.SimpleNamespace(serve=serve)
    monkeypatch.setitem(sys.modules, "controller._serve", fake)
    # `from controller import _serve` finds the package's attribute first, once another
    # test has imported the real module.
    monkeypatch.setattr(controller, "_serve", fake, raising=False)
    assert main(["serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:7000"]) == 0
    assert main(["serve", "--catalog", "postgresql://db/tandem"]) == 0
    storage_options = [
        "--blob-uri", "s3://bucket/tandem", "--retention-ms", "1000",
        "--gc-grace-ms", "60000", "--upkeep-interval-ms", "250",
    ]
    assert main(["serve", *storage_options]) == 0
    defaults = {
        "blob_uri": None, "retention_ms": None, "gc_grace_ms": None, "upkeep_interval_ms": None,
        "security": ServerSecurity(), "http_listen": "127.0.0.1:6876", "keep_replicas": False, "log_level": "warning",
        "standby": False, "lease": LeaseOptions(),
    }
    assert calls == [
        # The HTTP port follows the gRPC one: a second controller on another --listen
        # found 6876 taken.
        {"data_dir": tmp_path, "catalog_url": None, "listen": "127.0.0.1:7000", **defaults, "http_listen": "127.0.0.1:7001"},
        {
            "data_dir": Path("tandem-data"),
            "catalog_url": "postgresql://db/tandem",
            "listen": "127.0.0.1:6875",
            **defaults,
        },
        {
            "data_dir": Path("tandem-data"),
            "catalog_url": None,
            "listen": "127.0.0.1:6875",
            "blob_uri": "s3://bucket/tandem",
            "retention_ms": 1000,
            "gc_grace_ms": 60000,
            "upkeep_interval_ms": 250,
            "security": ServerSecurity(),
            "http_listen": "127.0.0.1:6876",
            "keep_replicas": False,
            "log_level": "warning",
            "standby": False,
            "lease": LeaseOptions(),
        },
    ]
    assert main(["serve", "--http-listen", "off"]) == 0
    assert calls[-1]["http_listen"] is None
    assert main(["serve", "--listen", "127.0.0.1:0", "--keep-replicas", "--log-level", "info"]) == 0
    assert (calls[-1]["http_listen"], calls[-1]["keep_replicas"], calls[-1]["log_level"]) == ("127.0.0.1:0", True, "info")
    assert main(["serve", "--standby", "--lease-ms", "3000", "--lease-renew-ms", "500", "--lease-margin-ms", "1000"]) == 0
    assert (calls[-1]["standby"], calls[-1]["lease"]) == (True, LeaseOptions(3000, 500, 1000))
    capsys.readouterr()
    assert main(["serve", "--lease-ms", "1000"]) == 1  # renewed every 1000 ms with a 1500 ms margin: cannot hold
    assert "error: INVALID_ARGUMENT: a lease of 1000 ms cannot be renewed every 1000 ms" in capsys.readouterr().err
    assert main(["serve", "--listen", "127.0.0.1:65535"]) == 1
    assert "give --http-listen HOST:PORT" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert main(["serve", "--auth-token-file", str(token)]) == 0
    assert calls[-1]["security"] == ServerSecurity(None, token, "s3cret")
    capsys.readouterr()
    assert main(["serve", "--tls-client-ca", str(token)]) == 1  # a CA without TLS: refused
    assert main(["serve", "--tls-cert", str(token)]) == 1  # a certificate without its key
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(e.startswith("error: INVALID_ARGUMENT: ") for e in errors)  # one prefix


def test_serve_help_states_the_runtime_defaults(capsys):
    from controller._upkeep import UpkeepOptions

    assert main(["serve", "--help"]) == 0
    help = " ".join(capsys.readouterr().out.split())
    defaults = UpkeepOptions()
    for value in (defaults.retention_ms, defaults.gc_grace_ms, defaults.interval_ms):
        assert f"(default: {value}" in help


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--blob-uri", "ftp://files/tandem"], "unsupported blob location 'ftp://files/tandem'"),
        (["--blob-uri", "{file}/blobs"], "blob location file://{file}/blobs is unusable"),
        (["--retention-ms", "-1"], "retention_ms must be an int >= 0, not -1"),
    ],
)
def test_serve_refuses_a_bad_blob_location_or_option_at_start(tmp_path, capsys, options, named):
    """The real runtime: it checks the location before it launches anything."""
    (tmp_path / "a-file").write_text("not a directory")
    options = [o.format(file=tmp_path / "a-file") for o in options]
    assert main(["serve", "--data-dir", str(tmp_path / "data"), *options]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: ") and named.format(file=tmp_path / "a-file") in err


# --- Progress --------------------------------------------------------------------------


@pytest.fixture
def terminal(monkeypatch):
    """What progress draws, as if stderr were a terminal."""
    from rich.console import Console

    from controller import _progress

    screen = io.StringIO()
    monkeypatch.setattr(_progress, "_console", lambda: Console(file=screen, force_terminal=True, width=120))
    return screen


def test_a_long_call_shows_what_its_poll_reports_and_returns_its_result(terminal):
    from controller import _progress

    def slow() -> int:
        time.sleep(1.2)
        return 42

    assert _progress.while_running(slow, lambda: ("replica r3: active, 1 of 2 dataflows hydrated", 1, 2)) == 42
    drawn = terminal.getvalue()
    assert "replica r3: active, 1 of 2 dataflows hydrated" in drawn and "1/2" in drawn

    def refused() -> None:
        raise TandemError(grpc.StatusCode.DEADLINE_EXCEEDED, "replica r3 did not get in sync")

    with pytest.raises(TandemError, match="did not get in sync"):
        _progress.while_running(refused, lambda: ("waiting", None, None))


def test_reading_a_file_counts_its_bytes(terminal):
    from controller import _progress

    lines = ["id,name\n", "1,é\n"]
    assert list(_progress.counted_bytes(lines, 13, "reading rows.csv")) == lines
    assert "reading rows.csv" in terminal.getvalue()


def test_progress_draws_nothing_when_stderr_is_not_a_terminal(capsys):
    from controller import _progress

    assert _progress.while_running(lambda: "done", lambda: ("never drawn", 0, 1)) == "done"
    with _progress.spinner("never drawn either"):
        pass
    assert capsys.readouterr() == ("", "")
