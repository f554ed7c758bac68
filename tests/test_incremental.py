"""Incremental maintenance on real Spark (DESIGN section 10): path independence.

Hypothesis generates update sequences on two sources (inserts, retractions, updates as
a retraction plus an insert, keys that appear and vanish, NULLs, groups that empty),
written through storage as batch files. For every supported shape of query, at every
time:
- the version maintained incrementally from the first time,
- from halfway on, the version of a dataflow hydrated then (at a later `as_of`), or, in
  the next example, of one whose state was rebuilt (`restore`) through the step before,
  as a replica rebuilds it after losing its Spark state (the examples take them in
  turn: each costs an example about a quarter of its time), and
- the version recomputed from scratch (the `recompute` strategy)
have the same digest, bit for bit; and all equal Spark's own answer over the same
snapshot (floats within rounding: Spark's float sum depends on its partitioning).

Here: the shapes without stages, dataflows over another dataflow's index, and the
shapes the delta planner refuses (with a reason); `test_incremental_subqueries.py` has
the shapes with stages (aggregates below joins, subqueries). The machinery is in
`incremental_cases.py`.
"""

from __future__ import annotations

import gc
from time import monotonic, sleep

import pytest
from hypothesis import HealthCheck, given, settings
from py4j.protocol import Py4JJavaError
from incremental_cases import (
    CONF,
    EXAMPLES,
    T_SCHEMA,
    U_SCHEMA,
    Flow,
    Sources,
    check_shape,
    release,
    sequences,
    spark_answer,
    spark_env,
)
from rows import assert_same_rows

import history as h
from replica_service import _spark
from replica_service._arrangement import Arrangement, Version
from replica_service.dataplane import NotIncremental, StorageReader, _maintain, delta_plan

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from spark_env(tmp_path_factory)

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
    # A union beside a join's other side is read whole in that side's term.
    "union_joined": "SELECT x.id, x.k, u.y FROM (SELECT id, k FROM t WHERE n > 0 UNION ALL SELECT id, z AS k FROM u) x JOIN u ON x.id = u.id",
    "floats": "SELECT id, x, -x AS nx, x * 0 AS zero FROM t",  # -0.0 and NaN carried through as they are
    "join": "SELECT t.id, t.k, u.y FROM t JOIN u ON t.id = u.id",
    "join_aggregate": "SELECT u.z, count(*) AS c, sum(t.q) AS s, avg(t.x) AS a, max(t.n) AS m FROM t JOIN u ON t.id = u.id GROUP BY u.z",
    "three_way": "SELECT a.k, count(*) AS c, sum(b.q) AS s FROM t a JOIN u ON a.id = u.id JOIN t b ON b.id = u.y GROUP BY a.k",
    # Listed in an order whose first two inputs share no condition (TPC-H q8, q9).
    "from_list": "SELECT a.k, b.n, u.z FROM t a, t b, u WHERE a.id = u.id AND b.id = u.y AND a.n <= b.n",
    "top": "SELECT k, count(*) AS c FROM t GROUP BY k HAVING count(*) > 0 ORDER BY sum(n) DESC NULLS LAST, k LIMIT 2",
    "top_ties": "SELECT u.z, count(*) AS c, max(t.x) AS m FROM t JOIN u ON t.id = u.id GROUP BY u.z ORDER BY c DESC LIMIT 1",
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
    "SELECT id FROM t WHERE NOT EXISTS (SELECT * FROM u WHERE u.id = t.id OR u.y = t.n)": "linked by",
    "SELECT id FROM t a WHERE EXISTS (SELECT * FROM t b WHERE b.k = a.k AND b.n > a.n)": "only equalities",
    "SELECT a.k, b.n FROM t a JOIN t b ON a.id = b.id WHERE NOT EXISTS (SELECT * FROM u WHERE u.y = a.n + b.n)": "two columns of one name",
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


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_incremental_equals_recompute_and_a_late_hydration_at_every_time(env, name):
    check_shape(env, name, SHAPES[name], EXPECTED.get(name))


def test_a_steps_rows_changed_are_its_consolidated_changes_whichever_the_strategy(env):
    """Rows inserted plus rows deleted, counted with their multiplicity: a row retracted
    and inserted again at one time changed nothing, two copies retracted changed two."""
    sources = Sources(env)
    reader = StorageReader(sources.storage, sources.t)
    row = {"id": 1, "k": "a", "x": 0.5, "q": None, "n": 2}
    batches = [
        ([row, row], [], [], [], []),  # two copies
        ([], [], [], [], [(0, row)]),  # one retracted and inserted again, unchanged
        ([], [0, 0], [], [], []),  # both retracted
    ]
    flows: dict[str, Flow] = {}
    for batch in batches:
        time = sources.apply(batch)
        reader.refresh(env["session"])
        flows = flows or {s: Flow(env, "linear", "SELECT id, k, n FROM t", s, {"t": reader}) for s in ("incremental", "recompute")}
        for flow in flows.values():
            flow.step(time)
    for strategy, flow in flows.items():
        assert list(flow.rows_changed.values()) == [2, 0, 2], strategy
        flow.maintainer.close()


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
    try:
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
            upstream_rows = spark_answer(env, UPSTREAM, {"t": storage.read_snapshot(sources.t, time)})
            for query, sql in DOWNSTREAMS.items():
                incremental, recomputed = downstream[query, "incremental"], downstream[query, "recompute"]
                assert incremental.digests[time] == recomputed.digests[time], f"{query}: step {index}"
                assert_same_rows(versions[query, "incremental"], spark_answer(env, sql, {"totals": upstream_rows}))
            _spark.release_dropped_proxies()
    finally:
        release([*downstream.values(), *([upstream] if upstream is not None else [])], [reader])


def test_a_term_joins_its_change_with_one_linked_input_at_a_time(env):
    """Each term is a left-deep chain of joins starting from its leaf's change, each
    join linked by a condition to the inputs before it: never the cross product of the
    query's first two inputs, which share no condition."""
    session = _spark.dataflow_session(env["session"], CONF)
    session.createDataFrame([], T_SCHEMA).createOrReplaceTempView("t")
    session.createDataFrame([], U_SCHEMA).createOrReplaceTempView("u")
    analyzed = session.sql(SHAPES["from_list"])._jdf.queryExecution().analyzed()
    plan = delta_plan(session._jsparkSession, analyzed, {"t": "t", "u": "u"})
    assert [leaf.name for leaf in plan.leaves] == ["t", "t", "u"]
    for leaf, term in zip(plan.leaves, plan.terms):
        joins = [node for node in _nodes(term) if node.getClass().getSimpleName() == "Join"]
        assert len(joins) == 2 and all(join.condition().isDefined() for join in joins)
        first = joins[-1].left()  # the lowest join's left side: the change
        while first.getClass().getSimpleName() != "UnresolvedRelation":
            first = first.child()
        assert first.tableName() == leaf.view


def _nodes(plan):
    """The nodes of a Catalyst tree, top down."""
    found, stack = [], [plan]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children().apply(i) for i in reversed(range(node.children().size())))
    return found


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
    for flow in flows.values():
        flow.maintainer.close()


@pytest.mark.parametrize("strategy", ["incremental", "recompute"])
def test_a_small_step_is_planned_whole_with_one_partition_per_shuffle(env, monkeypatch, strategy):
    """A step whose inputs changed by more rows than a small step's, and a hydration of
    more input rows than that, run adaptively over the instance's shuffle partitions; a
    small step, or the hydration of a small input (a recompute's every step), is
    planned whole, one partition per shuffle. A step past hydration that reads few rows
    (here: a query of one input, its state counted at the step before) has its
    projections interpreted. Either way the versions are Spark's answer, and the same
    bits: the dataflow stepped with interpreted projections and the one hydrated late
    with generated ones agree on the digest."""
    monkeypatch.setattr(_maintain, "SMALL_STEP_MAX_ROWS", 2)
    sources = Sources(env)
    reader = StorageReader(sources.storage, sources.t)
    flows, planned = {}, []
    for start, count in ((0, 2), (2, 1), (3, 2), (5, 3)):
        rows = [{"id": i, "k": "ab"[i % 2], "x": 0.5 * i, "q": None, "n": i % 3} for i in range(start, start + count)]
        time = sources.apply((rows, [], [], [], []))
        reader.refresh(env["session"])
        # One dataflow from the first time (2 rows), one hydrated at the third (5 rows).
        for name in ("early", "late") if start == 3 else ("early",):
            flows.setdefault(name, Flow(env, name, SHAPES["aggregates"], strategy, {"t": reader}))
        for name, flow in flows.items():
            flow.step(time)
            conf = flow.maintainer.session.conf
            settings = ("spark.sql.adaptive.enabled", "spark.sql.shuffle.partitions", "spark.sql.codegen.factoryMode")
            planned.append((name, *(conf.get(key) for key in settings)))
            assert_same_rows(flow.table, spark_answer(env, SHAPES["aggregates"], {"t": sources.storage.read_snapshot(sources.t, time)}))
        if "late" in flows:
            assert flows["early"].digests[time] == flows["late"].digests[time]
    adaptive, whole = ("true", CONF["spark.sql.shuffle.partitions"]), ("false", "1")
    generated, interpreted = "FALLBACK", "NO_CODEGEN"
    if strategy == "incremental":
        sizes = [
            ("early", *whole, generated),  # hydration
            ("early", *whole, generated),  # its state not counted yet
            ("early", *whole, interpreted),
            ("late", *adaptive, generated),
            ("early", *adaptive, interpreted),  # more rows than a small step's, still few
            ("late", *adaptive, generated),  # its state not counted yet
        ]
    else:  # every step hydrates: small while the input is, never interpreted
        sizes = [("early", *whole, generated), ("early", *adaptive, generated), ("early", *adaptive, generated)]
        sizes += [("late", *adaptive, generated), ("early", *adaptive, generated), ("late", *adaptive, generated)]
    assert planned == sizes
    for flow in flows.values():
        flow.maintainer.close()


def test_steps_of_a_query_seen_before_compile_no_code(env):
    """Spark compiles each distinct generated source once and keeps the class. Replicas
    name generated classes without their codegen stage's number (which moves with the
    plan around the stage) and keep 4096 of them, so a second dataflow of the same
    query over the same changes compiles nothing. Without both settings this second run
    compiled 154 classes, without the first alone 8 (ARCHITECTURE "Generated code")."""
    compilations = env["session"]._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()
    batches = [
        ([{"id": i, "k": "ab"[i % 2], "x": 0.5 * i, "q": None, "n": i % 3}], [0] * (i % 2), [], [], [])
        for i in range(4)
    ]

    def run() -> int:
        sources = Sources(env)
        reader = StorageReader(sources.storage, sources.t)
        before = compilations.getCount()
        flow = None
        for batch in batches:
            time = sources.apply(batch)
            reader.refresh(env["session"])
            flow = flow or Flow(env, "compiled", SHAPES["extremes"], "incremental", {"t": reader})
            flow.step(time)
        flow.maintainer.close()
        return compilations.getCount() - before

    assert run() > 0  # the counter counts
    assert run() == 0


def test_a_rehearsal_compiles_the_next_steps_code_and_keeps_nothing(env, tmp_path):
    """After hydration a replica rehearses (`Incremental.rehearse`): a step over a
    made-up change of the largest input, planned as a real change's, so that the code
    the next steps run is compiled by then. It keeps nothing: it holds no checkpoint
    after, and the versions after it are those computed without it. Each query's
    code is compiled by no other test (the literal is in its generated source)."""
    session = env["session"]
    compilations = session._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()
    persisted = lambda: set(session.sparkContext._jsc.getPersistentRDDs().keySet())
    t_rows = [{"id": i, "k": "ab"[i % 2], "x": 0.5 * i, "q": i, "n": i % 5} for i in range(300)]
    u_rows = [{"id": i, "y": i, "z": "xyz"[i % 3]} for i in range(100)]
    changes = [  # of t, the largest input: a retraction and an insert, then an update
        ([{"id": 7, "k": "c", "x": 1.0, "q": 3, "n": 9}], [4], [], [], []),
        ([], [], [], [], [(3, {"k": "b", "x": 0.0, "q": None, "n": 4})]),
    ]

    def run(factor: int, *, rehearse: bool) -> tuple[list[str], int]:
        """The versions' digests, and the classes compiled by the first step after hydration."""
        sql = f"SELECT u.z, count(*) AS c, sum(t.q) AS s, max(t.n) AS m FROM t JOIN u ON t.id = u.id WHERE t.n + u.y <> {factor} GROUP BY u.z"
        sources = Sources(env)
        readers = {"t": StorageReader(sources.storage, sources.t), "u": StorageReader(sources.storage, sources.u)}
        flow = Flow(env, f"rehearsed{factor}", sql, "incremental", readers)
        for number, change in enumerate([(t_rows, [], u_rows, [], []), *changes]):
            time = sources.apply(change)
            for reader in readers.values():
                reader.refresh(session)
            before = compilations.getCount()
            flow.step(time)
            if number == 1:
                compiled_first = compilations.getCount() - before
            if number == 0 and rehearse:
                kept, compiled = persisted(), compilations.getCount()
                assert flow.maintainer.rehearse(tmp_path / str(factor))
                assert compilations.getCount() > compiled
                assert persisted() == kept
        release([flow], readers.values())
        return list(flow.digests.values()), compiled_first

    assert run(7907, rehearse=False)[1] > 0  # 44 classes, when written
    rehearsed, compiled = run(7919, rehearse=True)
    assert compiled == 0
    assert run(7919, rehearse=False)[0] == rehearsed


def test_light_steps_have_a_scheduler_pool_that_takes_a_free_core_first(env):
    """Spark's FAIR scheduler serves first a pool with fewer running tasks than its
    minimum share: the light pool's exceeds any machine's cores."""
    pool = env["session"].sparkContext._jsc.sc().getPoolForName(_spark.LIGHT_POOL)
    assert pool.isDefined()
    assert pool.get().minShare() > 10_000 and pool.get().schedulingMode().toString() == "FAIR"


def _local_checkpoints(session) -> dict[int, bool]:
    """The context's persisted local checkpoints: whether each one's lineage is cut."""
    persisted = session.sparkContext._jsc.getPersistentRDDs()
    rdds = [persisted.get(id).rdd() for id in persisted.keySet()]
    return {rdd.id(): rdd.isCheckpointed() for rdd in rdds if rdd.isLocallyCheckpointed()}


def test_an_abandoned_step_keeps_nothing_in_spark(env):
    """A step that failed, or whose dataflow was dropped, before it finished ends with
    `StepOutput.abandon`: what it persisted (a recompute's state built afresh for the
    step) is released, as a finished step's is. A dropped incremental dataflow's
    maintainer releases its state with `close`."""
    session = env["session"]
    sources = Sources(env)
    reader = StorageReader(sources.storage, sources.t)
    time = sources.apply(([{"id": 1, "k": "a", "x": 1.5, "q": None, "n": 2}], [], [], [], []))
    reader.refresh(session)
    persisted = lambda: set(session.sparkContext._jsc.getPersistentRDDs().keySet())
    before = persisted()
    recompute = Flow(env, "abandoned", SHAPES["extremes"], "recompute", {"t": reader})
    output = recompute.maintainer.step([time])
    assert persisted() > before  # the state of the step's recompute
    output.abandon()
    assert persisted() == before

    incremental = Flow(env, "closed", SHAPES["extremes"], "incremental", {"t": reader})
    incremental.step(time)
    assert persisted() > before  # its state
    incremental.maintainer.close()  # dropped
    assert persisted() == before


@pytest.mark.parametrize(
    "sql",
    [
        SHAPES["extremes"],  # accumulators, extremes repaired, value counts
        "SELECT u.z, a.k, a.s, a.m FROM (SELECT k, sum(n) AS s, max(x) AS m FROM t GROUP BY k) a JOIN u ON a.s = u.y",  # a stage
        "SELECT k, sum(n) AS s FROM t GROUP BY k ORDER BY s DESC LIMIT 2",  # top rows
    ],
    ids=["extremes", "stage", "ranked"],
)
def test_a_dataflow_keeps_one_states_checkpoints_however_many_steps(env, sql):
    """A step checkpoints the state it leads to, and its commit cuts their lineage and
    releases the state before: the blocks a dataflow keeps do not grow with its
    steps, and no state pins the plans of the steps before it. (Lazy checkpoints, which
    an adaptive query's shuffle stage computes without cutting their lineage, chained
    every step's plans and broadcast relations until the driver's heap was full.)"""
    session = env["session"]
    sources = Sources(env)
    readers = {"t": StorageReader(sources.storage, sources.t), "u": StorageReader(sources.storage, sources.u)}
    before = set(_local_checkpoints(session))
    row = {"id": 1, "k": "a", "x": 2.5, "q": None, "n": 3}
    counts, flow = [], None
    for step in range(6):
        inserts = [{**row, "id": step * 10 + i, "k": "ab"[i % 2], "x": float(step + i), "n": step + i} for i in range(4)]
        # Retract two of the rows live, among them a group's extreme (its newest, highest x).
        time = sources.apply((inserts, [-1, 0] if step else [], [{"id": 1, "y": 3 + step, "z": "z"}], [], []))
        for reader in readers.values():
            reader.refresh(session)
        flow = flow or Flow(env, "kept", sql, "incremental", readers)
        flow.step(time)
        _spark.release_dropped_proxies()
        ours = {id: cut for id, cut in _local_checkpoints(session).items() if id not in before}
        assert ours and all(ours.values()), f"step {step}: a kept checkpoint still has its lineage"
        counts.append(len(ours))
    assert counts[1:] == [counts[1]] * 5, counts


def _row(id: int, k: str) -> dict:
    return {"id": id, "k": k, "x": float(id % 3), "q": None, "n": id}


# Batches of (t inserts, t retraction picks, u inserts, u picks, t updates): b vanishes
# at the first overlaid step and comes back at the next; then two groups a step.
_OVERLAID_BATCHES = [
    ([_row(0, "a"), _row(1, "b"), _row(2, "a"), _row(3, "b")], [], [], [], []),
    ([_row(4, "a")], [1, 2], [], [], []),  # b's two rows retracted
    ([_row(5, "b")], [], [], [], []),
    ([_row(6, "a"), _row(7, "c")], [], [], [], []),
    ([_row(8, "a"), _row(9, "b")], [], [], [], []),
    ([_row(10, "c")], [0], [], [], []),
    ([_row(11, "b"), _row(12, "c")], [], [], [], []),
]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT k, count(*) AS c, sum(n) AS s, max(x) AS m FROM t GROUP BY k",
        "SELECT k, sum(n) AS s FROM t GROUP BY k ORDER BY s DESC LIMIT 2",  # reads every group
    ],
    ids=["aggregate", "ranked"],
)
def test_a_large_state_steps_through_an_overlay_merged_into_a_new_base_at_its_limit(env, sql):
    """A state of many groups (here: any, the limits forced low by `Flow(overlaid=True)`)
    keeps its base while steps write only the overlay of the groups they touch (a group
    left with no rows keeps a row there that hides the base's); once the overlay may
    hold more than its limit (8 groups), a full step merges it into a new base. Every
    version equals the recomputed one, and the checkpoints kept stay bounded, their
    lineage cut."""
    session = env["session"]
    sources = Sources(env)
    readers = {"t": StorageReader(sources.storage, sources.t), "u": StorageReader(sources.storage, sources.u)}
    before = set(_local_checkpoints(session))
    flows, kinds, kept = {}, [], []
    for step, batch in enumerate(_OVERLAID_BATCHES):
        time = sources.apply(batch)
        for reader in readers.values():
            reader.refresh(session)
        flows = flows or {
            "overlaid": Flow(env, "overlaid", sql, "incremental", readers, overlaid=True),
            "recompute": Flow(env, "recomputed", sql, "recompute", readers),
        }
        state = flows["overlaid"].maintainer.state
        base = state._base
        for flow in flows.values():
            flow.step(time)
        assert flows["overlaid"].digests[time] == flows["recompute"].digests[time], f"step {step}"
        overlaid = state._overlay is not None
        assert (state._base is base) == overlaid, f"step {step}: the base was written by an overlaid step, or kept by a full one"
        kinds.append("overlaid" if overlaid else "full")
        _spark.release_dropped_proxies()
        ours = {id: cut for id, cut in _local_checkpoints(session).items() if id not in before}
        assert all(ours.values()), f"step {step}: a kept checkpoint still has its lineage"
        kept.append(len(ours))
    # Groups touched: 2, 1, 2, 2 overlaid (7), then 2 more (a retracted, c) is 9 > 8:
    # merged; then 2.
    assert kinds == ["full", "overlaid", "overlaid", "overlaid", "overlaid", "full", "overlaid"], kinds
    # The base, the overlay and one step's others (touched keys, sums, repairs, top
    # rows): as many after the merge as before it.
    assert max(kept[5:]) <= max(kept[:5]), kept


def test_a_replica_session_takes_task_memory_in_small_pages(env):
    """A step's few rows must not cost a page sized to the heap per operator and task:
    an aggregation of a few rows in a replica's session peaks at a 1 MB page (and its
    hash index) per task, where Spark's own page size grows with the heap (2 MB for
    this test's 512 MB driver, 16 MB for a `small` replica's 1 GB)."""
    session = env["session"]
    context = session.sparkContext
    context.setJobGroup("small-pages", "a few rows aggregated")
    try:
        session.range(100).selectExpr("id % 7 AS k", "id AS v").groupBy("k").sum("v").collect()
    finally:
        context.setJobGroup(None, None)
    store = context._jsc.sc().statusStore()
    stages = [s for job in context.statusTracker().getJobIdsForGroup("small-pages") for s in context.statusTracker().getJobInfo(job).stageIds]
    deadline = monotonic() + 10
    peaks: list[int] = []
    while monotonic() < deadline:  # the status store hears of finished stages from a listener thread
        try:
            attempts = [store.lastStageAttempt(s) for s in stages]
            peaks = [a.peakExecutionMemory() // a.numTasks() for a in attempts]  # a stage's peak sums its tasks'
            break
        except Py4JJavaError:  # not heard of yet
            sleep(0.05)
    assert peaks and 1 << 20 <= max(peaks) < 2 << 20, peaks


def test_released_proxies_let_the_jvm_drop_their_objects(env):
    """A py4j proxy whose methods were called sits in a reference cycle: the JVM keeps
    its object until a cyclic collection frees the proxy."""
    session = env["session"]
    bindings = session.sparkContext._gateway.java_gateway_server.getGateway().getBindings()
    gc.disable()  # only the collection under test frees the proxy
    try:
        frame = session.range(3).selectExpr("id + 1 AS x")
        frame._jdf.schema()  # a bound method cached on the proxy: the cycle
        target = frame._jdf._target_id
        del frame
        sleep(0.5)
        assert bindings.containsKey(target)
        _spark.release_dropped_proxies()
        deadline = monotonic() + 10
        while bindings.containsKey(target) and monotonic() < deadline:  # py4j tells the JVM from a thread
            sleep(0.05)
        assert not bindings.containsKey(target)
    finally:
        gc.enable()
