"""Incremental maintenance on real Spark (DESIGN section 10): path independence.

Hypothesis generates update sequences on two sources (inserts, retractions, updates as
a retraction plus an insert, keys that appear and vanish, NULLs, groups that empty),
written through storage as batch files. For every supported shape of query, at every
time:
- the version maintained incrementally from the first time,
- the version of a dataflow hydrated later (at a later `as_of`), from then on,
- the version of a dataflow whose state was rebuilt (`restore`) through the step before,
  as a replica rebuilds it after losing its Spark state, from then on, and
- the version recomputed from scratch (the `recompute` strategy)
have the same digest, bit for bit; and all equal Spark's own answer over the same
snapshot (floats within rounding: Spark's float sum depends on its partitioning).

Each shape also has an index-reading variant: a dataflow over another dataflow's
index. Shapes outside the supported set are refused by the delta planner with a reason.

`TANDEM_PROPERTY_EXAMPLES` sets the number of generated sequences per shape (CI runs
the default).
"""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import history as h
from catalog import Catalog
from replica_service import _spark
from replica_service._arrangement import Arrangement, Version
from replica_service.dataplane import NotIncremental, StorageReader, delta_plan, maintainer
from rows import assert_same_rows
from storage import Storage

pytestmark = pytest.mark.spark

EXAMPLES = int(os.environ.get("TANDEM_PROPERTY_EXAMPLES", "4"))

T_SCHEMA = "id BIGINT, k STRING, x DOUBLE, q DECIMAL(10,2), n INT"
U_SCHEMA = "id BIGINT, y INT, z STRING"

SHAPES = {
    "project": (
        "SELECT id, k, CASE WHEN x > 1 THEN 'hi' ELSE 'lo' END AS band, n * 2 + 1 AS m, "
        "date_add(DATE '2024-01-01', n) AS d, q * 3 AS q3 FROM t WHERE k IS NOT NULL"
    ),
    "aggregates": (
        "SELECT k, count(*) AS c, count(x) AS cx, sum(x) AS sx, avg(x) AS ax, sum(q) AS sq, "
        "avg(q) AS aq, sum(n) AS sn, avg(n) AS an, sum(q * q) AS sqq, avg(q * q) AS aqq FROM t GROUP BY k"
    ),
    "extremes": "SELECT k, min(x) AS lo, max(n) AS hi, count(DISTINCT n) AS dn, min(q) AS mq, max(k) AS mk FROM t GROUP BY k",
    "having": (
        "SELECT k, sum(q) / count(*) AS ratio, sum(CASE WHEN n > 0 THEN x ELSE 0 END) AS s, "
        "sum(CAST(q AS DECIMAL(38,6)) * 3) AS wide "
        "FROM t GROUP BY k HAVING count(*) > 1"
    ),
    "global": "SELECT count(*) AS c, sum(x) AS s, max(q) AS m, count(DISTINCT k) AS dk FROM t",
    "distinct": "SELECT DISTINCT k, n FROM t",
    "union": "SELECT id, k FROM t WHERE n > 0 UNION ALL SELECT id, z AS k FROM u",
    "floats": "SELECT id, x, -x AS nx, x * 0 AS zero FROM t",  # -0.0 and NaN carried through as they are
    "join": "SELECT t.id, t.k, u.y FROM t JOIN u ON t.id = u.id",
    "join_aggregate": "SELECT u.z, count(*) AS c, sum(t.q) AS s, avg(t.x) AS a, max(t.n) AS m FROM t JOIN u ON t.id = u.id GROUP BY u.z",
    "three_way": "SELECT a.k, count(*) AS c, sum(b.q) AS s FROM t a JOIN u ON a.id = u.id JOIN t b ON b.id = u.y GROUP BY a.k",
    "top": "SELECT k, count(*) AS c FROM t GROUP BY k HAVING count(*) > 0 ORDER BY sum(n) DESC NULLS LAST, k LIMIT 2",
    "top_ties": "SELECT u.z, count(*) AS c, max(t.x) AS m FROM t JOIN u ON t.id = u.id GROUP BY u.z ORDER BY c DESC LIMIT 1",
    # Stages: aggregates below joins, and IN / EXISTS as joins over DISTINCT stages.
    "aggregate_join": "SELECT u.z, a.k, a.s, a.m FROM (SELECT k, sum(n) AS s, max(x) AS m FROM t GROUP BY k) a JOIN u ON a.s = u.y",
    "in": "SELECT id, k, x FROM t WHERE id IN (SELECT id FROM u WHERE y > 0) AND n IS NOT NULL",
    "exists": "SELECT u.z, count(*) AS c, sum(u.y) AS s FROM u WHERE EXISTS (SELECT * FROM t WHERE t.id = u.id AND t.n >= 0) GROUP BY u.z",
    "scalar": "SELECT t.k, sum(t.x) AS s, count(*) AS c FROM t WHERE t.n < (SELECT avg(u.y) FROM u WHERE u.id = t.id) GROUP BY t.k",
    "outer_filtered": "SELECT t.id, u.y FROM t LEFT JOIN u ON t.id = u.id WHERE u.y > 0",
    "cte_max": "WITH r AS (SELECT k, sum(n) AS s FROM t GROUP BY k) SELECT k, s FROM r WHERE s = (SELECT max(s) FROM r)",
    "scalar_having": "SELECT k, sum(q) AS s FROM t GROUP BY k HAVING sum(q) > (SELECT sum(y) FROM u) / 10",
    "scalar_projection": "SELECT id, n * (SELECT count(*) FROM u) AS m FROM t",
    "in_pairs": "SELECT id, k, n FROM t WHERE (id, n) IN (SELECT id, y FROM u)",
    "exists_pairs": "SELECT id, k FROM t WHERE EXISTS (SELECT * FROM u WHERE u.id = t.id AND u.y = t.n AND t.n >= 0)",
    "nested": "SELECT id, k FROM t WHERE id IN (SELECT u.id FROM u WHERE u.y > (SELECT sum(b.n) FROM t b WHERE b.id = u.id))",
    # Anti-joins: L less its rows with a match; and a match on another value (`<>`).
    "not_exists": "SELECT id, k, n FROM t WHERE NOT EXISTS (SELECT * FROM u WHERE u.id = t.id AND u.y > 0)",
    "exists_other": "SELECT id, k FROM t a WHERE EXISTS (SELECT * FROM t b WHERE b.id = a.id AND b.k <> a.k)",
    "not_exists_other": (
        "SELECT k, count(*) AS c, sum(q) AS s FROM t a "
        "WHERE NOT EXISTS (SELECT * FROM t b WHERE b.id = a.id AND b.n <> a.n AND b.x > 0) GROUP BY k"
    ),
    "in_aggregate": "SELECT t.k, sum(t.q) AS s, count(*) AS c FROM t WHERE t.id IN (SELECT id FROM u GROUP BY id HAVING count(*) > 1) GROUP BY t.k",
}

# Spark picks any of the rows tied at a LIMIT; a ranked dataflow breaks ties by every
# column the sort sees, ascending: Spark's answer with that order spelled out.
EXPECTED = {
    "top_ties": "SELECT u.z, count(*) AS c, max(t.x) AS m FROM t JOIN u ON t.id = u.id GROUP BY u.z ORDER BY c DESC, z, c, m LIMIT 1",
}

UPSTREAM = "SELECT k, count(*) AS c, sum(q) AS s FROM t GROUP BY k"
# Over UPSTREAM's index: a linear query, and one with a stage (the scalar subquery's
# aggregate) whose own leaf is the index.
DOWNSTREAMS = {
    "linear": "SELECT k, c * 2 AS c2, s FROM totals WHERE c > 1",
    "stage": "SELECT k, s FROM totals WHERE c = (SELECT max(c) FROM totals)",
}

NOT_INCREMENTAL = {
    "SELECT t.id, u.y FROM t LEFT JOIN u ON t.id = u.id": "left outer join",
    "SELECT id FROM t WHERE id NOT IN (SELECT id FROM u)": "NOT IN \\(subquery\\), a null-aware anti-join",
    "SELECT id FROM t a WHERE EXISTS (SELECT * FROM t b WHERE b.id = a.id AND b.k <> a.k AND b.n <> a.n)": "one <>",
    "SELECT id FROM t a WHERE EXISTS (SELECT * FROM t b WHERE b.k = a.k AND b.n > a.n)": "only equalities",
    "SELECT id FROM t WHERE id IN (SELECT id FROM u) OR n > 0": "under OR",
    "SELECT id FROM t WHERE n = (SELECT count(*) FROM u WHERE u.id = t.id)": "left outer join",
    "SELECT k FROM t WHERE x > (SELECT y FROM u WHERE id = 1)": "a subquery",
    "SELECT id, row_number() OVER (ORDER BY id) AS r FROM t": "a window function",
    "SELECT id FROM t ORDER BY id LIMIT 3": "LIMIT over rows that are not an aggregate's",
    "SELECT k, count(*) AS c FROM t GROUP BY k LIMIT 2": "LIMIT without ORDER BY",
    "SELECT k, count(*) AS c FROM t GROUP BY k SORT BY c LIMIT 2": "LIMIT without ORDER BY",
    "SELECT k, count(*) AS c FROM t GROUP BY k ORDER BY c, k LIMIT 2 OFFSET 1": "OFFSET",
    "SELECT k FROM (SELECT k, count(*) AS c FROM t GROUP BY k ORDER BY c, k LIMIT 3) LIMIT 2": "LIMIT over a LIMIT",
    "SELECT k, c + (SELECT count(*) FROM u) AS d FROM (SELECT k, count(*) AS c FROM t GROUP BY k ORDER BY c, k LIMIT 3)": "LIMIT",
    "SELECT k, stddev(x) AS sd FROM t GROUP BY k": "the aggregate stddev",
}

CONF = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.ansi.enabled": "true",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("incremental")
    catalog = Catalog.open(f"sqlite:///{root / 'catalog.db'}")
    catalog.become_controller()
    storage = Storage(catalog, root / "blobs", fsync=False)
    session = _spark.start_session(_spark.SparkSettings("local[2]"), root / "spark", CONF)
    yield dict(storage=storage, session=session, sources=iter(range(10**6)))
    session.stop()


# --- Update sequences ----------------------------------------------------------------

values_k = st.sampled_from(["a", "b", "c", None])
values_x = st.sampled_from([0.1, 0.2, -2.5, 3.0, 1e10, 1e-9, 0.0, -0.0, None])
values_q = st.sampled_from([Decimal("1.10"), Decimal("-2.05"), Decimal("0.00"), Decimal("99999999.99"), None])
values_n = st.sampled_from([0, 1, 2, -3, None])
t_rows = st.fixed_dictionaries({"id": st.integers(0, 6), "k": values_k, "x": values_x, "q": values_q, "n": values_n})
u_rows = st.fixed_dictionaries({"id": st.sampled_from([0, 1, 2, 3, 4, 5, 6, None]), "y": st.sampled_from([0, 1, 2, 3, None]), "z": st.sampled_from(["p", "q", None])})


@st.composite
def sequences(draw):
    """Batches of changes: (t inserts, t retraction picks, u inserts, u retraction
    picks, t updates). A pick selects a live row by position, so every retraction
    retracts a row that exists; an update retracts a row and inserts a changed copy."""
    steps = draw(st.integers(3, 4))
    return [
        (
            draw(st.lists(t_rows, max_size=6)),
            draw(st.lists(st.integers(0, 10**6), max_size=3)),
            draw(st.lists(u_rows, max_size=3)),
            draw(st.lists(st.integers(0, 10**6), max_size=2)),
            draw(st.lists(st.tuples(st.integers(0, 10**6), t_rows), max_size=2)),
        )
        for _ in range(steps)
    ]


class Sources:
    """Two fresh sources in storage, their live rows, and the change of each batch."""

    def __init__(self, env) -> None:
        self.storage: Storage = env["storage"]
        number = next(env["sources"])
        self.t = self.storage.create_source(f"t{number}", T_SCHEMA).id
        self.u = self.storage.create_source(f"u{number}", U_SCHEMA).id
        self.rows = {self.t: [], self.u: []}

    def apply(self, batch) -> int:
        t_inserts, t_picks, u_inserts, u_picks, t_updates = batch
        changes = {self.t: [], self.u: []}
        for id, inserts, picks in ((self.t, t_inserts, t_picks), (self.u, u_inserts, u_picks)):
            live = self.rows[id]
            for pick in picks:
                if live:
                    changes[id].append({**live.pop(pick % len(live)), "_diff": -1})
            for row in inserts:
                live.append(row)
                changes[id].append({**row, "_diff": 1})
        for pick, row in t_updates:
            live = self.rows[self.t]
            if live:
                old = live.pop(pick % len(live))
                changes[self.t].append({**old, "_diff": -1})
                new = {**row, "id": old["id"]}
                live.append(new)
                changes[self.t].append({**new, "_diff": 1})
        time = self.storage.catalog.write_ts()
        for id, rows in changes.items():
            if rows:
                self.storage.append(id, rows, ts=time)
            else:  # no change: the upper still moves past the time
                self.storage.compare_and_append(id, self.storage.upper(id), h.Frontier(time + 1))
        return time


# --- Dataflows under test --------------------------------------------------------------


class Flow:
    """One dataflow in one session, stepped at given times; its versions as tables."""

    def __init__(self, env, name: str, sql: str, strategy: str, inputs: dict) -> None:
        session = _spark.dataflow_session(env["session"], CONF)
        desc = h.DataflowDescription(name, sql, (), (h.IndexExport(name, ()),), strategy=strategy)
        self.maintainer = maintainer(desc, session, inputs, {}, 2)
        self.table: pa.Table | None = None
        self.digests: dict[int, str] = {}

    def step(self, time: int) -> pa.Table:
        output = self.maintainer.step(time)
        self.table = output.version(self.table)
        output.finish()
        self.digests[time] = Version.build(time, self.table, ()).digest
        return self.table


def _run_shape(env, name: str, sql: str, sequence) -> None:
    sources = Sources(env)
    storage = sources.storage
    readers = {"t": StorageReader(storage, sources.t), "u": StorageReader(storage, sources.u)}
    times = []
    flows = {}
    late = None
    for index, batch in enumerate(sequence):
        time = sources.apply(batch)
        times.append(time)
        for reader in readers.values():
            reader.refresh(env["session"])
        if index == 0:
            flows = {s: Flow(env, name, sql, s, readers) for s in ("incremental", "recompute")}
        if index == len(sequence) // 2:
            late = Flow(env, name, sql, "incremental", readers)
            # A replica that lost its Spark state rebuilds it through its last step.
            restored = Flow(env, name, sql, "incremental", readers)
            restored.maintainer.restore(times[-2])
            restored.table = flows["incremental"].table
            flows["restored"] = restored
        versions = {s: f.step(time) for s, f in flows.items()}
        if late is not None:
            late.step(time)
            assert late.digests[time] == flows["incremental"].digests[time], f"{name}: hydrated late differs at step {index}"
        if "restored" in flows:
            assert flows["restored"].digests[time] == flows["incremental"].digests[time], f"{name}: restored differs at step {index}"
        assert flows["incremental"].digests[time] == flows["recompute"].digests[time], f"{name}: incremental != recompute at step {index}"
        expected = _spark_answer(env, EXPECTED.get(name, sql), {"t": storage.read_snapshot(sources.t, time), "u": storage.read_snapshot(sources.u, time)})
        assert_same_rows(versions["incremental"], expected)


def _spark_answer(env, sql: str, tables: dict[str, pa.Table]) -> pa.Table:
    session = _spark.dataflow_session(env["session"], CONF)
    return _spark.query(session, sql, tables).toArrow()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_incremental_equals_recompute_and_a_late_hydration_at_every_time(env, name):
    sql = SHAPES[name]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(sequences())
    def check(sequence):
        _run_shape(env, name, sql, sequence)

    check()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sequences())
def test_a_dataflow_over_an_index_is_maintained_from_the_index_changes(env, sequence):
    """The upstream keeps an index (versions in this process, as a replica keeps them);
    the downstream reads it: its changes come from the difference of two versions."""
    sources = Sources(env)
    storage = sources.storage
    reader = StorageReader(storage, sources.t)
    totals = Arrangement("totals", (), h.Frontier.minimum(), h.Frontier.minimum())
    upstream = None
    downstream: dict[str, Flow] = {}
    for index, batch in enumerate(sequence):
        time = sources.apply(batch)
        reader.refresh(env["session"])
        if upstream is None:
            upstream = Flow(env, "totals", UPSTREAM, "incremental", {"t": reader})
        totals.insert(Version.build(time, upstream.step(time), ()))
        totals.upper = h.Frontier(time + 1)
        if index == 0:
            downstream = {(q, s): Flow(env, q, sql, s, {"totals": totals}) for q, sql in DOWNSTREAMS.items() for s in ("incremental", "recompute")}
            assert downstream["stage", "incremental"].maintainer.stages, "the scalar subquery's aggregate is a stage"
        versions = {key: f.step(time) for key, f in downstream.items()}
        upstream_rows = _spark_answer(env, UPSTREAM, {"t": storage.read_snapshot(sources.t, time)})
        for query, sql in DOWNSTREAMS.items():
            incremental, recomputed = downstream[query, "incremental"], downstream[query, "recompute"]
            assert incremental.digests[time] == recomputed.digests[time], f"{query}: step {index}"
            assert_same_rows(versions[query, "incremental"], _spark_answer(env, sql, {"totals": upstream_rows}))


@pytest.mark.parametrize("sql, reason", sorted(NOT_INCREMENTAL.items()))
def test_other_shapes_are_refused_with_the_reason(env, sql, reason):
    session = _spark.dataflow_session(env["session"], CONF)
    session.createDataFrame([], T_SCHEMA).createOrReplaceTempView("t")
    session.createDataFrame([], U_SCHEMA).createOrReplaceTempView("u")
    analyzed = session.sql(sql)._jdf.queryExecution().analyzed()
    with pytest.raises(NotIncremental, match=reason):
        delta_plan(session._jsparkSession, analyzed, {"t": "t", "u": "u"})


def test_an_incremental_step_is_light_once_hydrated_and_a_recomputed_one_never(env):
    """A light step reads the changes, not the inputs: the replica runs such steps on
    workers of their own, never queued behind hydrations and recomputes."""
    sources = Sources(env)
    time = sources.apply(([{"id": 1, "k": "a", "x": 1.5, "q": None, "n": 2}], [], [], [], []))
    reader = StorageReader(sources.storage, sources.t)
    reader.refresh(env["session"])
    flows = {s: Flow(env, "light", SHAPES["aggregates"], s, {"t": reader}) for s in ("incremental", "recompute")}
    assert not any(flow.maintainer.light for flow in flows.values())
    for flow in flows.values():
        flow.step(time)
    assert flows["incremental"].maintainer.light
    assert not flows["recompute"].maintainer.light


def test_light_steps_have_a_scheduler_pool_that_takes_a_free_core_first(env):
    """Spark's FAIR scheduler serves first a pool with fewer running tasks than its
    minimum share: the light pool's exceeds any machine's cores."""
    pool = env["session"].sparkContext._jsc.sc().getPoolForName(_spark.LIGHT_POOL)
    assert pool.isDefined()
    assert pool.get().minShare() > 10_000 and pool.get().schedulingMode().toString() == "FAIR"
